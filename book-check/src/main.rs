//! `book-check check` — verify the book's includes and anchors (run by `make test`).
//! `book-check diff` — regenerate the level diffs into book/src/generated/ (run by `make book-data`).

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
    /// Verify every {{#include}} of the book's Markdown: the path exists; an anchor exists once,
    /// is closed and is not empty. Lists every problem with its .md file and line.
    Check {
        /// The book's source directory.
        #[arg(long, default_value = "book/src")]
        src: PathBuf,
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
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Check { src } => book_check::includes::check(src).map(|s| {
            println!("book-check: {} includes ({} with anchors) in {} Markdown files under {}: all present", s.includes, s.anchors, s.files, src.display());
        }),
        Command::Diff { root, out } => book_check::diff::write_all(root, out).map(|files| {
            for f in files {
                println!("book-check: wrote {}", f.display());
            }
        }),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("book-check: error: {e}");
            ExitCode::FAILURE
        }
    }
}
