//! The bench's one error type.

use std::path::PathBuf;

/// Everything `bench` can fail with; each message names the file, flag, binary or run involved
/// and what was expected.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A level's source file has no `// ANCHOR: user_code` … `// ANCHOR_END: user_code` pair.
    #[error(
        "{file}: no `// ANCHOR: {anchor}` … `// ANCHOR_END: {anchor}` pair (expected the user's training code between those two mdBook anchor comments)"
    )]
    AnchorMissing {
        /// The file(s) searched.
        file: String,
        /// The anchor name (`user_code`).
        anchor: String,
    },
    /// An anchor opened and never closed, closed before being opened, or opened twice.
    #[error("{file}:{line}: {problem} (anchors must come in `// ANCHOR: {anchor}` … `// ANCHOR_END: {anchor}` pairs)")]
    AnchorUnbalanced {
        /// The file.
        file: PathBuf,
        /// 1-based line of the offending anchor.
        line: usize,
        /// The anchor name.
        anchor: String,
        /// What is wrong.
        problem: String,
    },
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A JSON file is not what it should be.
    #[error("{path}: not a run report ({source})")]
    Json {
        /// The file.
        path: PathBuf,
        /// The parse error.
        source: serde_json::Error,
    },
    /// A flag has a value the bench cannot use.
    #[error("{flag} {value}: expected {expected}")]
    InvalidValue {
        /// The flag (`--levels`).
        flag: &'static str,
        /// The value given.
        value: String,
        /// What would have been accepted.
        expected: String,
    },
    /// A binary the bench runs is not built.
    #[error("{path} not found: build it first with `cargo build --release --workspace --bins --examples` (what `make build` runs)")]
    MissingBinary {
        /// The missing binary.
        path: PathBuf,
    },
    /// A program could not be started.
    #[error("could not start {program}: {source}")]
    Spawn {
        /// The program.
        program: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// A run exited unsuccessfully or was killed.
    #[error("{what} failed ({status}); its last lines:\n{tail}")]
    RunFailed {
        /// The run (`level 1 (raw DDP)`).
        what: String,
        /// Exit code, signal, or timeout.
        status: String,
        /// The last lines it printed.
        tail: String,
    },
    /// A run exited 0 but wrote no report.
    #[error("{what} exited 0 but wrote no report to {path} (does the binary implement --metrics-json?)")]
    NoReport {
        /// The run.
        what: String,
        /// Where the report was expected.
        path: PathBuf,
    },
    /// pip could not install the 🤗 peers' packages.
    #[error("{python}: `pip install accelerate transformers` failed (bench run --install-peers); pip said:\n{tail}")]
    PeerInstall {
        /// The venv's Python.
        python: std::path::PathBuf,
        /// pip's last lines.
        tail: String,
    },
    /// A PyTorch peer printed no JSON line.
    #[error("{what} printed no JSON result line; its last lines:\n{tail}")]
    NoPeerResult {
        /// The peer run.
        what: String,
        /// The last lines it printed.
        tail: String,
    },
    /// Some runs failed; the others were reported.
    #[error("{failed} of {total} runs failed: {names}")]
    RunsFailed {
        /// How many failed.
        failed: usize,
        /// How many were attempted.
        total: usize,
        /// Which.
        names: String,
    },
}

/// `Result` with the bench's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// [`Error::Io`] naming `path`.
    pub fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Error {
        let path = path.into();
        move |source| Error::Io { path, source }
    }
}
