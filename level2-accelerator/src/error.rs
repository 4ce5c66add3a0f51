//! The one error type of `level2-accelerator`: the configuration (files, environment variables,
//! builder settings), the `ladder-accelerate` CLI, and the `Accelerator`. Every variant names
//! the file, key, variable, flag or value at fault and what was expected.

use std::path::PathBuf;

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in level 2.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An error from the shared core (data, model, process group, launcher).
    #[error(transparent)]
    Core(#[from] ladder_core::Error),

    // ---- configuration ----------------------------------------------------------------------
    /// A config file could not be read (missing, a directory, no permission).
    #[error("config file {file}: cannot read it: {source}")]
    ConfigRead {
        /// The file.
        file: PathBuf,
        /// Why it cannot be read.
        #[source]
        source: std::io::Error,
    },
    /// A config file could not be written.
    #[error("config file {file}: cannot write it: {problem}")]
    ConfigWrite {
        /// The file.
        file: PathBuf,
        /// Why it cannot be written.
        problem: String,
    },
    /// A config file holds one of Accelerate's keys with a value, or in a place, that this
    /// project does not implement (see `config::file`).
    #[error("config file {file}: {problem}")]
    ConfigKey {
        /// The file.
        file: PathBuf,
        /// The key, its value, why it is refused and what would be accepted.
        problem: String,
    },
    /// A config file is not valid YAML / TOML / JSON, or holds a key or value that does not fit.
    #[error("config file {file}: malformed {format}: {problem}")]
    ConfigParse {
        /// The file.
        file: PathBuf,
        /// `YAML`, `TOML` or `JSON`.
        format: &'static str,
        /// The parser's message: the key, what is wrong, the line.
        problem: String,
    },
    /// A config file whose extension names no supported format.
    #[error("config file {file}: unsupported extension {extension:?}; expected .yaml, .yml, .toml or .json")]
    ConfigFormat {
        /// The file.
        file: PathBuf,
        /// Its extension (lower case; empty when it has none).
        extension: String,
    },
    /// One setting holds a value that cannot be used. `origin` says where it was given: an
    /// environment variable, a key of a config file, a builder field, or a flag.
    #[error("invalid value {value:?} for {setting} ({origin}): expected {expected}")]
    InvalidSetting {
        /// The setting (`mixed_precision`).
        setting: String,
        /// The value given, as text.
        value: String,
        /// Where it was given (`environment variable ACCELERATE_MIXED_PRECISION`).
        origin: String,
        /// What was expected.
        expected: String,
    },
    /// Two settings that cannot be used together, each with where it was given.
    #[error("{first} conflicts with {second}: {why}")]
    Conflict {
        /// The first setting, its value and where it was given.
        first: String,
        /// The second one.
        second: String,
        /// Why they cannot go together, and what to do.
        why: String,
    },

    // ---- the CLI ------------------------------------------------------------------------------
    /// A `ladder-accelerate` command that cannot be carried out as asked (e.g. `config` without
    /// a terminal and without `--default` or flags).
    #[error("{command}: {problem}")]
    Cli {
        /// The subcommand (`config`).
        command: &'static str,
        /// What stands in the way.
        problem: String,
    },

    // ---- the Accelerator ----------------------------------------------------------------------
    /// The run stopped on SIGTERM after writing its state (see `ladder_core::preempt`): not a
    /// failure; the binary exits 143.
    #[error("preempted (SIGTERM): every process finished step {step} and the state was saved to {dir}; resume with --resume-from {dir}")]
    Preempted {
        /// The state directory written.
        dir: std::path::PathBuf,
        /// The optimizer steps it holds.
        step: u64,
    },
    /// An Accelerator method called out of order (e.g. `backward` before `prepare_model`, a
    /// second model).
    #[error("{op}: {problem}")]
    Usage {
        /// The method (`backward`).
        op: &'static str,
        /// What is out of order.
        problem: String,
    },
}
