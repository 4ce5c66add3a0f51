//! `book-check check` — verify the book's includes and anchors (run by `make test`).
//! `book-check diff` — regenerate the level diffs into book/src/generated/ (run by `make book`).
//! `book-check memory` — the per-rank memory arithmetic into book/src/generated/ (run by `make book`).

use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Debug, Parser)]
#[command(name = "book-check", version, about = "Checks ddp-ladder's mdBook includes and generates its level diffs")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Verify the book's Markdown: every {{#include}} path exists and an anchor exists once, is
    /// closed and is not empty; every relative link exists; every test named as
    /// `path/file.rs::test` exists. Lists every problem with its .md file and line.
    Check {
        /// The book's source directory.
        #[arg(long, default_value = "book/src")]
        src: PathBuf,
        /// The workspace root, where tests named as `file.rs::test` are looked up.
        #[arg(long, default_value = ".")]
        root: PathBuf,
    },
    /// Write the level 1 → 2 and 2 → 3 diffs of the `user_code` anchors (and each level's whole
    /// user code) as Markdown.
    Diff {
        /// The workspace root (holding level1-raw-ddp/, level2-accelerator/, level3-trainer/).
        #[arg(long, default_value = ".")]
        root: PathBuf,
        /// Where to write the Markdown files.
        #[arg(long, default_value = "book/src/generated")]
        out: PathBuf,
    },
    /// Write the per-rank memory arithmetic (DDP, ZeRO-1/2/3) of BasicNet as Markdown.
    Memory {
        /// fc1 widths, comma-separated.
        #[arg(long, value_delimiter = ',', default_values_t = [128u64, 4096])]
        widths: Vec<u64>,
        /// World sizes, comma-separated.
        #[arg(long, value_delimiter = ',', default_values_t = [2u64, 4])]
        world_sizes: Vec<u64>,
        /// The file to write.
        #[arg(long, default_value = "book/src/generated/memory-arithmetic.md")]
        out: PathBuf,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Check { src, root } => book_check::includes::check(src, root).map(|s| {
            println!(
                "book-check: {} Markdown files under {}: {} includes ({} with anchors), {} relative links, {} named tests: all present",
                s.files,
                src.display(),
                s.includes,
                s.anchors,
                s.links,
                s.tests
            );
        }),
        Command::Diff { root, out } => book_check::diff::write_all(root, out).map(|files| {
            for f in files {
                println!("book-check: wrote {}", f.display());
            }
        }),
        Command::Memory { widths, world_sizes, out } => {
            if widths.contains(&0) || world_sizes.contains(&0) {
                Err(book_check::Error::Invalid { what: "--widths / --world-sizes", expected: "values of at least 1" })
            } else {
                let text = book_check::memory::markdown(widths, world_sizes);
                out.parent()
                    .map(std::fs::create_dir_all)
                    .transpose()
                    .and_then(|_| std::fs::write(out, text))
                    .map_err(|e| book_check::Error::io(out, e))
                    .map(|()| {
                        println!("book-check: wrote {}", out.display());
                    })
            }
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("book-check: error: {e}");
            ExitCode::FAILURE
        }
    }
}
