//! The one error type of `level3-trainer`. Every variant names the field, flag, file or value at
//! fault and what was expected.

use std::path::PathBuf;

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in the Trainer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A `TrainingArguments` field holds a value that cannot be used.
    #[error("TrainingArguments.{field} = {value}: expected {expected}")]
    InvalidArgument {
        /// The field (Transformers' name, e.g. `warmup_ratio`).
        field: &'static str,
        /// The value given, as text.
        value: String,
        /// What would have been accepted.
        expected: String,
    },
    /// `metric_for_best_model` names a metric that evaluation does not produce.
    #[error("TrainingArguments.metric_for_best_model = {metric:?}: unknown metric; available: {available}")]
    UnknownMetric {
        /// The name given.
        metric: String,
        /// The metric names evaluation produces, comma-separated.
        available: String,
    },
    /// Command-line flags clap refused (unknown flag, bad value); clap's message names the flag
    /// and lists the accepted values.
    #[error("{message}")]
    CommandLine {
        /// clap's rendered message.
        message: String,
    },
    /// The arguments file could not be parsed.
    #[error("{file}: cannot read training arguments: {problem}")]
    ArgsFile {
        /// The file given to `--args-file`.
        file: PathBuf,
        /// The parser's message.
        problem: String,
    },
    /// A file or directory could not be read or written.
    #[error("{file}: {source}")]
    Io {
        /// The path at fault.
        file: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// `output_dir` already holds a previous run's files and neither `overwrite_output_dir`
    /// nor a resume was asked for (as Transformers' "Output directory already exists and is
    /// not empty").
    #[error(
        "output_dir {dir} already holds a previous run ({found}); nothing was changed. To replace that run's files, set \
         overwrite_output_dir (--overwrite-output-dir, or \"overwrite_output_dir\": true in the args file); to continue \
         it, resume_from_checkpoint (--resume-from-checkpoint); or choose another output_dir"
    )]
    OutputDirNotEmpty {
        /// The output directory.
        dir: PathBuf,
        /// The previous run's checkpoints and files found there.
        found: String,
    },
    /// A launcher setting (`ladder-accelerate launch --use-fsdp`, exported as `ACCELERATE_*`)
    /// contradicts a TrainingArguments value set explicitly.
    #[error("{argument} contradicts the launcher's {launcher}; give the setting in one place (drop it from the launcher's flags or config, or from the arguments)")]
    LauncherConflict {
        /// The argument, its value and how it was set (`TrainingArguments.fsdp = ddp (--strategy)`).
        argument: String,
        /// The launcher's value and its variable.
        launcher: String,
    },
    /// The run stopped on SIGTERM after writing its checkpoint (see `ladder_core::preempt`):
    /// not a failure; the binary exits 143.
    #[error("preempted (SIGTERM): every rank finished step {step} and {checkpoint} was written; resume with --resume-from-checkpoint")]
    Preempted {
        /// The checkpoint written.
        checkpoint: PathBuf,
        /// The global step it holds.
        step: u64,
    },
    /// No checkpoint to resume from.
    #[error("{dir}: no checkpoint-<step> directory to resume from; expected one written by a previous run")]
    NoCheckpoint {
        /// Where one was looked for.
        dir: PathBuf,
    },
    /// A checkpoint's `trainer_state.json` (or another of its files) is not what this Trainer
    /// writes.
    #[error("{file}: bad checkpoint file: {problem}")]
    BadCheckpoint {
        /// The file at fault.
        file: PathBuf,
        /// What is wrong with it.
        problem: String,
    },
    /// A callback refused the run (e.g. EarlyStoppingCallback without an evaluation strategy).
    #[error("{callback}: {problem}")]
    Callback {
        /// The callback's name.
        callback: &'static str,
        /// What it needs.
        problem: String,
    },
    /// An error from the level-2 Accelerator (settings, process group, checkpoints).
    #[error(transparent)]
    Accelerate(#[from] level2_accelerator::Error),
    /// An error from the shared core (data, model, process group, collectives).
    #[error(transparent)]
    Core(#[from] ladder_core::Error),
    /// An error from libtorch.
    #[error(transparent)]
    Torch(#[from] tch::TchError),
}

impl Error {
    /// An [`Error::InvalidArgument`] for `field`.
    pub fn invalid(field: &'static str, value: impl ToString, expected: impl Into<String>) -> Self {
        Error::InvalidArgument { field, value: value.to_string(), expected: expected.into() }
    }

    /// An [`Error::Io`] for `file`.
    pub fn io(file: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { file: file.into(), source }
    }
}
