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
        file: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A config file could not be written.
    #[error("config file {file}: cannot write it: {problem}")]
    ConfigWrite { file: PathBuf, problem: String },
    /// A config file is not valid YAML / TOML / JSON, or holds a key or value that does not fit.
    #[error("config file {file}: malformed {format}: {problem}")]
    ConfigParse { file: PathBuf, format: &'static str, problem: String },
    /// A config file whose extension names no supported format.
    #[error("config file {file}: unsupported extension {extension:?}; expected .yaml, .yml, .toml or .json")]
    ConfigFormat { file: PathBuf, extension: String },
    /// One setting holds a value that cannot be used. `origin` says where it was given: an
    /// environment variable, a key of a config file, a builder field, or a flag.
    #[error("invalid value {value:?} for {setting} ({origin}): expected {expected}")]
    InvalidSetting { setting: String, value: String, origin: String, expected: String },
    /// Two settings that cannot be used together, each with where it was given.
    #[error("{first} conflicts with {second}: {why}")]
    Conflict { first: String, second: String, why: String },

    // ---- the CLI ------------------------------------------------------------------------------
    /// A `ladder-accelerate` command that cannot be carried out as asked (e.g. `config` without
    /// a terminal and without `--default` or flags).
    #[error("{command}: {problem}")]
    Cli { command: &'static str, problem: String },

    // ---- the Accelerator ----------------------------------------------------------------------
    /// An Accelerator method called out of order (e.g. `backward` before `prepare_model`, a
    /// second model).
    #[error("{op}: {problem}")]
    Usage { op: &'static str, problem: String },
}
