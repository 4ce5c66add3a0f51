//! The one error type of `book-check`.

use std::path::PathBuf;

/// What can go wrong while checking or generating the book.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// A source file has no `// ANCHOR: {anchor}` … `// ANCHOR_END: {anchor}` span.
    #[error("{file}: no `// ANCHOR: {anchor}` … `// ANCHOR_END: {anchor}` span")]
    AnchorMissing {
        /// The source file.
        file: PathBuf,
        /// The anchor name.
        anchor: String,
    },
    /// An anchor span is opened and never closed.
    #[error("{file}:{line}: `ANCHOR: {anchor}` never closed by `ANCHOR_END: {anchor}`")]
    AnchorUnclosed {
        /// The source file.
        file: PathBuf,
        /// 1-based line of the opening comment.
        line: usize,
        /// The anchor name.
        anchor: String,
    },
    /// A `// ANCHOR: {anchor} (continued)` span with no span of that name before it.
    #[error("{file}:{line}: `ANCHOR: {anchor} (continued)` continues nothing: no `ANCHOR: {anchor}` span comes before it")]
    AnchorContinuesNothing {
        /// The source file.
        file: PathBuf,
        /// 1-based line of the continuation's comment.
        line: usize,
        /// The anchor name.
        anchor: String,
    },
    /// A command-line value out of range.
    #[error("{what}: expected {expected}")]
    Invalid {
        /// The flag(s).
        what: &'static str,
        /// What was expected.
        expected: &'static str,
    },
    /// The include check found problems; each line names the .md file, line, path and anchor.
    #[error("{} problem(s) in the book's includes, links and named tests:\n{}", problems.len(), problems.join("\n"))]
    Includes {
        /// One message per problem.
        problems: Vec<String>,
    },
    /// The rendered-page check found problems; each line names the page.
    #[error("{} problem(s) in the rendered book:\n{}", problems.len(), problems.join("\n"))]
    Rendered {
        /// One message per problem.
        problems: Vec<String>,
    },
    /// Generated files differ from what their generators write now.
    #[error("{} generated file(s) out of date (run `make book`, or `book-check generate`):\n{}", problems.len(), problems.join("\n"))]
    Stale {
        /// One message per file.
        problems: Vec<String>,
    },
    /// A generated input (the bench's Markdown, the provenance table) lacks what a generator
    /// reads from it.
    #[error("{file}: {problem}")]
    Input {
        /// The file read.
        file: PathBuf,
        /// What is missing or malformed, and what was expected.
        problem: String,
    },
}

impl Error {
    /// An I/O error on `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }
}

/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
