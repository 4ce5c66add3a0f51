//! `book-check generate` — write every generated file of the book (run by `make book`).
//! `book-check check` — verify the book's includes, anchors, links and named tests, and that
//! every generated file is what its generator writes now (run by `make test`).
//! `book-check rendered` — verify the pages mdBook rendered (run after `mdbook build`).
//! `book-check diff` / `book-check memory` — write only the level diffs / the memory arithmetic.

use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Debug, Parser)]
#[command(name = "book-check", version, about = "Checks ddp-ladder's mdBook and generates its listings, diffs, tables and plots")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Verify the book's Markdown: every {{#include}} path exists and an anchor exists once, is
    /// closed and is not empty; no .snap is included with its header; every relative link
    /// exists; every test named as `path/file.rs::test` exists; and every generated file is
    /// what `book-check generate` would write now. Lists every problem with its file and line.
    Check {
        /// The book's source directory.
        #[arg(long, default_value = "book/src")]
        src: PathBuf,
        /// The workspace root, where tests named as `file.rs::test` are looked up.
        #[arg(long, default_value = ".")]
        root: PathBuf,
    },
    /// Write every generated file: the level listings and diffs, the memory arithmetic, the
    /// snapshots without insta's header, and — from the reference run of `make book-data` —
    /// the tables, the plots and the README's `make demo` block. Files that would not change
    /// are left alone.
    Generate {
        /// The workspace root.
        #[arg(long, default_value = ".")]
        root: PathBuf,
    },
    /// Verify the book as mdBook rendered it (run after `mdbook build`): no stray code fence, no
    /// raw `{{#` directive, no insta snapshot header, no heading that is not the chapter's own,
    /// no page older than its chapter or a file it includes.
    Rendered {
        /// The book's directory (holding book.toml, src/ and the rendered book/).
        #[arg(long, default_value = "book")]
        book: PathBuf,
    },
    /// Write only the level 1 → 2, 2 → 3 and baseline → 2 diffs of the user code (and each
    /// level's whole user code) as Markdown.
    Diff {
        /// The workspace root (holding level1-raw-ddp/, level2-accelerator/, level3-trainer/).
        #[arg(long, default_value = ".")]
        root: PathBuf,
        /// Where to write the Markdown files.
        #[arg(long, default_value = "book/src/generated")]
        out: PathBuf,
    },
    /// Write only the per-rank memory arithmetic (DDP, ZeRO-1/2/3) of BasicNet as Markdown.
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
        Command::Check { src, root } => book_check::includes::check(src, root).and_then(|s| {
            let fresh = book_check::generate::check_fresh(root)?;
            println!(
                "book-check: {} Markdown files under {}: {} includes ({} with anchors), {} relative links, {} named tests: all present; \
                 {fresh} generated files up to date",
                s.files,
                src.display(),
                s.includes,
                s.anchors,
                s.links,
                s.tests
            );
            Ok(())
        }),
        Command::Generate { root } => book_check::generate::outputs(root)
            .and_then(|o| {
                let n = o.len();
                book_check::generate::write(root, &o).map(|w| (n, w))
            })
            .map(|(n, written)| {
                for f in &written {
                    println!("book-check: wrote {}", f.display());
                }
                println!("book-check: {n} generated files, {} rewritten", written.len());
            }),
        Command::Rendered { book } => book_check::rendered::check(book).map(|s| {
            println!(
                "book-check: {} rendered pages under {}: {} headings, all the chapters' own; no stray fence, raw {{{{#, snapshot header, flag turned into a dash or stale page",
                s.pages,
                book.join("book").display(),
                s.headings
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
