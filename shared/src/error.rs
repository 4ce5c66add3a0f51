//! The one error type of `ladder-core`. Every variant names the file, rank, flag or value at
//! fault and what was expected.

use std::path::PathBuf;

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in the shared core.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    // ---- data -------------------------------------------------------------------------------
    /// A file could not be read or written.
    #[error("{file}: {source}")]
    Io {
        file: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A data file is not where it was looked for.
    #[error("{file}: file not found; {hint}")]
    MissingFile { file: PathBuf, hint: String },
    /// The IDX magic number is not the expected one.
    #[error("{file}: bad IDX magic number 0x{found:08x}, expected 0x{expected:08x} ({what}){extra}")]
    BadMagic {
        file: PathBuf,
        expected: u32,
        found: u32,
        what: &'static str,
        /// A hint appended to the message, e.g. that the file is still gzip-compressed.
        extra: String,
    },
    /// The file ends before the header or the data it announces.
    #[error("{file}: truncated: expected {expected} bytes, found {found}")]
    Truncated { file: PathBuf, expected: u64, found: u64 },
    /// A dimension in the IDX header differs from MNIST's.
    #[error("{file}: bad dimensions {found}, expected {expected}")]
    BadDims { file: PathBuf, expected: String, found: String },
    /// Image and label files of one split hold different numbers of items.
    #[error("{images} holds {n_images} images but {labels} holds {n_labels} labels")]
    CountMismatch { images: PathBuf, n_images: usize, labels: PathBuf, n_labels: usize },
    /// A label outside 0..=9.
    #[error("{file}: label {label} at index {index} is outside 0..=9")]
    BadLabel { file: PathBuf, index: usize, label: u8 },
    /// The MD5 of the decompressed bytes is not the canonical one.
    #[error("{file}: checksum mismatch: MD5 of the decompressed bytes is {actual}, expected {expected}; delete the file, or pass --download to fetch it again")]
    ChecksumMismatch { file: PathBuf, expected: String, actual: String },
    /// A `.gz` file that cannot be decompressed (not gzip, corrupt, cut short, or too large).
    #[error("{file}: not a readable gzip file: {problem}; expected a gzip-compressed MNIST IDX file (delete the file, or pass --download to fetch it again)")]
    BadGzip { file: PathBuf, problem: String },
    /// The file holds more bytes than its IDX header announces.
    #[error("{file}: trailing data: the IDX header announces {expected} bytes, the file holds {found}")]
    TrailingData { file: PathBuf, expected: u64, found: u64 },
    /// Every mirror failed for a file; `attempts` lists each mirror and why.
    #[error("could not download {file}: every mirror failed:\n{attempts}")]
    DownloadFailed { file: String, attempts: String },

    // ---- configuration and devices ------------------------------------------------------------
    /// A flag, option or environment variable holds a value that cannot be used.
    #[error("invalid value {value:?} for {name}: {expected}")]
    InvalidValue { name: String, value: String, expected: String },
    /// An option given for a strategy it does not belong to (see
    /// [`Strategy::with_options`](crate::parallel::Strategy::with_options)): `option` is its
    /// PyTorch name (`bucket_cap_mb`), `strategy` the strategy as the user gave it (`strategy
    /// fsdp-full-shard`), `belongs_to` the strategies it applies to.
    #[error("{option} does not apply to {strategy}: it is an option of {belongs_to}")]
    OptionNotForStrategy { option: &'static str, strategy: String, belongs_to: &'static str },
    /// A spelling that names no value of a choice (strategy, precision, …).
    #[error(transparent)]
    Choice(#[from] crate::parallel::ChoiceError),
    /// One training step's activations would need more memory than the machine has free: a
    /// clear error instead of the kernel's OOM killer. `estimate_mib` is per rank (from
    /// [`crate::memory::activation_bytes_per_sample`]), `ranks` the ranks on this node,
    /// `available_mib` the kernel's `MemAvailable`, `max_batch_size` the largest batch that fits.
    #[error(
        "{flag} {batch_size} does not fit in memory: one training step's activations and their gradients need \
         about {estimate_mib} MiB per rank (BasicNet, fc1 width {width}; {per_sample_kib} KiB per sample), \
         {total_mib} MiB for the {ranks} rank(s) on this node, but only {available_mib} MiB is available \
         (MemAvailable); {advice}"
    )]
    BatchTooLargeForMemory {
        flag: String,
        batch_size: usize,
        width: i64,
        per_sample_kib: u64,
        estimate_mib: u64,
        ranks: usize,
        total_mib: u64,
        available_mib: u64,
        max_batch_size: usize,
        advice: String,
    },
    /// CUDA was asked for but is not usable here. The message reads `{option} cuda requested
    /// but CUDA is not available ({why}; use {option} cpu)`.
    #[error("{option} cuda requested but CUDA is not available ({why}{})", if *suggest_cpu { format!("; use {option} cpu") } else { String::new() })]
    CudaUnavailable {
        /// The choice as the caller names it: the core's `device`, which a level renames to
        /// its own flag with [`Error::named_by`] (`--device`).
        option: String,
        /// What is missing (no driver, no CUDA build of libtorch, no device).
        why: String,
        /// Whether to advise the CPU instead (not when the fault is the build itself).
        suggest_cpu: bool,
    },
    /// An error from libtorch.
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),

    // ---- distributed --------------------------------------------------------------------------
    /// The torchrun / mpirun environment contradicts itself.
    #[error("bad distributed environment: {0}")]
    Env(String),
    /// A backend was asked for that this build or this machine cannot provide.
    #[error("backend {backend} unavailable: {why}")]
    BackendUnavailable { backend: String, why: String },
    /// A tensor handed to a collective cannot be used as it is.
    #[error("{op} on rank {rank}: {problem}")]
    BadTensor { op: &'static str, rank: usize, problem: String },
    /// Ranks disagree on the shape or dtype of a collective's tensor.
    #[error("{op}: ranks disagree on the tensor: {detail}")]
    CollectiveMismatch { op: &'static str, detail: String },
    /// A source/destination rank outside 0..world_size.
    #[error("{op}: rank {rank} is outside 0..{world_size}")]
    RankOutOfRange { op: &'static str, rank: usize, world_size: usize },
    /// A call into MPI or NCCL returned an error code.
    #[error("{backend} {call} failed on rank {rank} with code {code}: {message}")]
    Backend { backend: &'static str, call: &'static str, rank: usize, code: i64, message: String },
    /// A collective did not complete within the group's timeout (`--timeout`,
    /// `LADDER_COLLECTIVE_TIMEOUT_S`; as `init_process_group(timeout=...)`). `not_arrived` lists
    /// the ranks whose progress record shows they never reached it; `detail` says where each
    /// was last seen.
    #[error(
        "rank {rank}: {op} #{seq} at step {step} did not complete within the collective timeout of {timeout_s} s \
         (waited {waited_s:.1} s; set it with --timeout or LADDER_COLLECTIVE_TIMEOUT_S): {detail}"
    )]
    CollectiveTimeout {
        op: &'static str,
        seq: u64,
        step: u64,
        rank: usize,
        waited_s: f64,
        timeout_s: f64,
        not_arrived: Vec<usize>,
        detail: String,
    },
    /// A collective on a group that already failed (a timeout), refused at once.
    #[error("rank {rank}: {op} refused: the process group failed earlier ({why})")]
    GroupAborted { op: &'static str, rank: usize, why: String },
    /// The loss or a gradient is NaN or infinite: training diverged. `rank` is the first rank
    /// where it appeared (the lowest, when several saw it at the same step).
    #[error(
        "training diverged: the {what} is {value} at step {step} on rank {rank}{others}; \
         lower --lr, or pass --allow-non-finite to keep training"
    )]
    NonFinite { what: &'static str, value: String, step: u64, rank: usize, others: String },
    /// Ranks would run different numbers of batches: the one with fewer would leave the others
    /// waiting in an all-reduce it never joins.
    #[error(
        "uneven data: rank {rank} has {batches} batches per epoch but rank {other_rank} has {other_batches}; \
         every rank must run the same number of steps (use DistributedSampler, which pads to equal shares)"
    )]
    UnevenBatches { rank: usize, batches: u64, other_rank: usize, other_batches: u64 },
    /// The rendezvous did not complete.
    #[error("rendezvous at {addr}: {problem}")]
    Rendezvous { addr: String, problem: String },
    /// A launched rank failed.
    #[error("{0}")]
    Launch(String),
    /// A rank started by `ladder-run` / `launch` failed; `summary` is the torchrun-style report
    /// (rank, exit code or signal, last stderr lines). `exitcode` is negative for a signal.
    #[error("{summary}")]
    RankFailed { rank: usize, exitcode: i32, summary: String },
    /// A state dict does not fit the model it is loaded into.
    #[error("state dict: {0}")]
    StateDict(String),
    /// FSDP was handed a module it cannot wrap or was called out of order (e.g. `backward`
    /// without a `forward_t`).
    /// A checkpoint directory that cannot be written or read back: names the directory and
    /// what is wrong with it (a missing file, an unreadable training state, …).
    #[error("checkpoint {dir}: {problem}")]
    Checkpoint { dir: PathBuf, problem: String },
    #[error("FSDP on rank {rank}: {problem}")]
    Fsdp { rank: usize, problem: String },
}

impl Error {
    /// An [`Error::Io`] naming `file`.
    pub fn io(file: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { file: file.into(), source }
    }
    /// This error with the core's names for values and options (`bucket_cap_mb`) replaced by
    /// the caller's (`--bucket-cap-mb`, a config key): each level maps the core's words to its
    /// own flag or argument names with a table of `(core name, level name)`.
    #[must_use]
    pub fn named_by(self, names: &[(&str, &'static str)]) -> Self {
        let rename = |n: &str| names.iter().find(|(core, _)| *core == n).map(|(_, theirs)| *theirs);
        match self {
            Error::InvalidValue { name, value, expected } => {
                Error::InvalidValue { name: rename(&name).map_or(name, str::to_string), value, expected }
            }
            Error::OptionNotForStrategy { option, strategy, belongs_to } => {
                Error::OptionNotForStrategy { option: rename(option).unwrap_or(option), strategy, belongs_to }
            }
            Error::CudaUnavailable { option, why, suggest_cpu } => {
                Error::CudaUnavailable { option: rename(&option).map_or(option, str::to_string), why, suggest_cpu }
            }
            other => other,
        }
    }

    /// An [`Error::InvalidValue`].
    pub fn invalid(name: impl Into<String>, value: impl ToString, expected: impl Into<String>) -> Self {
        Error::InvalidValue { name: name.into(), value: value.to_string(), expected: expected.into() }
    }
}
