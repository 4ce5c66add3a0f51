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
        /// The file (or directory).
        file: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// A data file is not where it was looked for.
    #[error("{file}: file not found; {hint}")]
    MissingFile {
        /// The path looked at.
        file: PathBuf,
        /// How to get the file (`--download`, the directories searched).
        hint: String,
    },
    /// The IDX magic number is not the expected one.
    #[error("{file}: bad IDX magic number 0x{found:08x}, expected 0x{expected:08x} ({what}){extra}")]
    BadMagic {
        /// The file read.
        file: PathBuf,
        /// The magic number of the expected IDX kind (2051 images, 2049 labels).
        expected: u32,
        /// The first four bytes of the file, big-endian.
        found: u32,
        /// What the file should hold (`images`, `labels`).
        what: &'static str,
        /// A hint appended to the message, e.g. that the file is still gzip-compressed.
        extra: String,
    },
    /// The file ends before the header or the data it announces.
    #[error("{file}: truncated: expected {expected} bytes, found {found}")]
    Truncated {
        /// The file read.
        file: PathBuf,
        /// Bytes the header announces (or the header's own size), in bytes.
        expected: u64,
        /// Bytes the file holds.
        found: u64,
    },
    /// A dimension in the IDX header differs from MNIST's.
    #[error("{file}: bad dimensions {found}, expected {expected}")]
    BadDims {
        /// The file read.
        file: PathBuf,
        /// MNIST's dimensions (`28x28 (rows x cols)`).
        expected: String,
        /// The header's dimensions (`rows x cols`).
        found: String,
    },
    /// Image and label files of one split hold different numbers of items.
    #[error("{images} holds {n_images} images but {labels} holds {n_labels} labels")]
    CountMismatch {
        /// The images file.
        images: PathBuf,
        /// Images it holds.
        n_images: usize,
        /// The labels file.
        labels: PathBuf,
        /// Labels it holds.
        n_labels: usize,
    },
    /// A label outside 0..=9.
    #[error("{file}: label {label} at index {index} is outside 0..=9")]
    BadLabel {
        /// The labels file.
        file: PathBuf,
        /// The label's index, from 0.
        index: usize,
        /// The byte found.
        label: u8,
    },
    /// The MD5 of the decompressed bytes is not the canonical one.
    #[error("{file}: checksum mismatch: MD5 of the decompressed bytes is {actual}, expected {expected}; delete the file, or pass --download to fetch it again")]
    ChecksumMismatch {
        /// The file read.
        file: PathBuf,
        /// The canonical MD5, hex.
        expected: String,
        /// The MD5 of the decompressed bytes read, hex.
        actual: String,
    },
    /// A `.gz` file that cannot be decompressed (not gzip, corrupt, cut short, or too large).
    #[error("{file}: not a readable gzip file: {problem}; expected a gzip-compressed MNIST IDX file (delete the file, or pass --download to fetch it again)")]
    BadGzip {
        /// The `.gz` file read.
        file: PathBuf,
        /// What is wrong with it (and what it looks like instead).
        problem: String,
    },
    /// The file holds more bytes than its IDX header announces.
    #[error("{file}: trailing data: the IDX header announces {expected} bytes, the file holds {found}")]
    TrailingData {
        /// The file read.
        file: PathBuf,
        /// Bytes the header announces, header included.
        expected: u64,
        /// Bytes the file holds.
        found: u64,
    },
    /// Every mirror failed for a file; `attempts` lists each mirror and why.
    #[error("could not download {file}: every mirror failed:\n{attempts}")]
    DownloadFailed {
        /// The MNIST file name (`train-images-idx3-ubyte.gz`).
        file: String,
        /// One line per mirror tried: its URL and why it failed.
        attempts: String,
    },

    // ---- configuration and devices ------------------------------------------------------------
    /// A flag, option or environment variable holds a value that cannot be used.
    #[error("invalid value {value:?} for {name}: {expected}")]
    InvalidValue {
        /// The value's name: the core's (`bucket_cap_mb`, [`crate::recipe::WEIGHTS_FILE`]), or a
        /// flag or key once a level renamed it ([`Error::named_by`]).
        name: String,
        /// The value given, as text.
        value: String,
        /// What would have been accepted.
        expected: String,
    },
    /// An option given for a strategy it does not belong to (see
    /// [`Strategy::with_options`](crate::parallel::Strategy::with_options)): `option` is its
    /// PyTorch name (`bucket_cap_mb`), `strategy` the strategy as the user gave it (`strategy
    /// fsdp-full-shard`), `belongs_to` the strategies it applies to.
    #[error("{option} does not apply to {strategy}: it is an option of {belongs_to}")]
    OptionNotForStrategy {
        /// The option's name (`bucket_cap_mb`, or the level's flag for it).
        option: &'static str,
        /// The strategy as the user gave it (`strategy fsdp-full-shard`, `--strategy ddp`).
        strategy: String,
        /// The strategies the option applies to.
        belongs_to: &'static str,
    },
    /// A spelling that names no value of a choice (strategy, precision, …).
    #[error(transparent)]
    Choice(
        /// The spelling and the accepted ones.
        #[from]
        crate::parallel::ChoiceError,
    ),
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
        /// The batch size's name as the caller gave it (`--batch-size`, `per_device_train_batch_size`).
        flag: String,
        /// The batch size asked for, in samples per rank.
        batch_size: usize,
        /// BasicNet's fc1 width (output features).
        width: i64,
        /// Activations and their gradients per sample, in KiB (rounded up).
        per_sample_kib: u64,
        /// One rank's step at `batch_size`, in MiB.
        estimate_mib: u64,
        /// Ranks training on this node.
        ranks: usize,
        /// All of this node's ranks, in MiB.
        total_mib: u64,
        /// The kernel's `MemAvailable`, in MiB.
        available_mib: u64,
        /// The largest batch size that fits (0: none).
        max_batch_size: usize,
        /// What to do about it.
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
    Torch(
        /// tch's error, with libtorch's message.
        #[from]
        tch::TchError,
    ),

    // ---- distributed --------------------------------------------------------------------------
    /// The torchrun / mpirun environment contradicts itself.
    #[error("bad distributed environment: {0}")]
    Env(
        /// Which variables disagree, with their values, or what the environment asks that
        /// cannot be done.
        String,
    ),
    /// A backend was asked for that this build or this machine cannot provide.
    #[error("backend {backend} unavailable: {why}")]
    BackendUnavailable {
        /// The backend asked for (`mpi`, `nccl`).
        backend: String,
        /// Why it cannot be used (a cargo feature, a library, a device).
        why: String,
    },
    /// A tensor handed to a collective cannot be used as it is.
    #[error("{op} on rank {rank}: {problem}")]
    BadTensor {
        /// The collective (`all_reduce`, …).
        op: &'static str,
        /// This rank.
        rank: usize,
        /// What is wrong with the tensor (device, dtype, layout, size).
        problem: String,
    },
    /// Ranks disagree on the shape or dtype of a collective's tensor.
    #[error("{op}: ranks disagree on the tensor: {detail}")]
    CollectiveMismatch {
        /// The collective.
        op: &'static str,
        /// Each rank's shape and dtype, or the first difference.
        detail: String,
    },
    /// A source/destination rank outside 0..world_size.
    #[error("{op}: rank {rank} is outside 0..{world_size}")]
    RankOutOfRange {
        /// The call (`broadcast`, `DistributedSampler::new`, …).
        op: &'static str,
        /// The rank given.
        rank: usize,
        /// Ranks in the group.
        world_size: usize,
    },
    /// The rest of an interrupted epoch cannot be split so that every rank runs as many batches
    /// (see `DistributedSampler::num_batches`): its last global batch would leave a rank
    /// without a sample.
    #[error(
        "the epoch's {remaining} unseen samples cannot be split between {world_size} ranks in batches of {batch_size}: the last \
         global batch would hold {last_batch} samples, fewer than one per rank; resume at another world size (or the one that \
         wrote the checkpoint)"
    )]
    UnevenResume {
        /// Samples of the epoch not yet trained on, over all ranks.
        remaining: usize,
        /// Ranks resuming.
        world_size: usize,
        /// Samples per batch and rank.
        batch_size: usize,
        /// Samples the last global batch would hold.
        last_batch: usize,
    },
    /// A call into MPI or NCCL returned an error code.
    #[error("{backend} {call} failed on rank {rank} with code {code}: {message}")]
    Backend {
        /// `mpi` or `nccl`.
        backend: &'static str,
        /// The function called (`MPI_Allreduce`, `ncclAllReduce`).
        call: &'static str,
        /// This rank.
        rank: usize,
        /// The return code.
        code: i64,
        /// The library's text for the code.
        message: String,
    },
    /// A collective did not complete within the group's timeout (`--timeout`,
    /// `LADDER_COLLECTIVE_TIMEOUT_S`; as `init_process_group(timeout=...)`). `not_arrived` lists
    /// the ranks whose progress record shows they never reached it; `detail` says where each
    /// was last seen.
    #[error(
        "rank {rank}: {op} #{seq} at step {step} did not complete within the collective timeout of {timeout_s} s \
         (waited {waited_s:.1} s; set it with --timeout or LADDER_COLLECTIVE_TIMEOUT_S): {detail}"
    )]
    CollectiveTimeout {
        /// The collective waited in.
        op: &'static str,
        /// Its sequence number in this group (1-based).
        seq: u64,
        /// This rank's training step then (1-based; 0: set-up).
        step: u64,
        /// This rank.
        rank: usize,
        /// Seconds waited.
        waited_s: f64,
        /// The timeout, in seconds.
        timeout_s: f64,
        /// Ranks whose record shows they never reached this collective.
        not_arrived: Vec<usize>,
        /// Where each rank was last seen.
        detail: String,
    },
    /// A collective on a group that already failed (a timeout), refused at once.
    #[error("rank {rank}: {op} refused: the process group failed earlier ({why})")]
    GroupAborted {
        /// The collective refused.
        op: &'static str,
        /// This rank.
        rank: usize,
        /// The earlier failure.
        why: String,
    },
    /// The loss or a gradient is NaN or infinite: training diverged. `rank` is the first rank
    /// where it appeared (the lowest, when several saw it at the same step).
    #[error(
        "training diverged: the {what} is {value} at step {step} on rank {rank}{others}; \
         lower --lr, or pass --allow-non-finite to keep training"
    )]
    NonFinite {
        /// What is not finite (`loss`, `gradient`).
        what: &'static str,
        /// Its value (`NaN`, `inf`; `NaN or infinite` for a gradient).
        value: String,
        /// The training step (1-based).
        step: u64,
        /// The lowest rank where it appeared.
        rank: usize,
        /// What else is known about where it appeared, appended to the message (empty: nothing).
        others: String,
    },
    /// Ranks would run different numbers of batches: the one with fewer would leave the others
    /// waiting in an all-reduce it never joins.
    #[error(
        "uneven data: rank {rank} has {batches} batches per epoch but rank {other_rank} has {other_batches}; \
         every rank must run the same number of steps (use DistributedSampler, which pads to equal shares)"
    )]
    UnevenBatches {
        /// The first rank whose count differs from `other_rank`'s.
        rank: usize,
        /// Its batches per epoch.
        batches: u64,
        /// The rank compared with (0).
        other_rank: usize,
        /// Its batches per epoch.
        other_batches: u64,
    },
    /// The rendezvous did not complete.
    #[error("rendezvous at {addr}: {problem}")]
    Rendezvous {
        /// The store's address (`MASTER_ADDR:MASTER_PORT`).
        addr: String,
        /// What went wrong (refused, timed out, a mismatched world size).
        problem: String,
    },
    /// A launcher was given a flag it does not know where PROGRAM belongs (its own flags end
    /// at the first word it does not know, which it would run as PROGRAM).
    #[error("unknown flag {flag} for {launcher}: {hint} ({launcher}'s flags go before PROGRAM, PROGRAM's after it)")]
    UnknownFlag {
        /// The launcher (`ladder-run`, `ladder-accelerate launch`).
        launcher: String,
        /// The flag as given, without its `=VALUE`.
        flag: String,
        /// The reference launcher's equivalent here, or the nearest flag.
        hint: String,
    },
    /// A launched rank failed.
    #[error("{0}")]
    Launch(
        /// What failed and why.
        String,
    ),
    /// A rank started by `ladder-run` / `launch` failed; `summary` is the torchrun-style report
    /// (rank, exit code or signal, last stderr lines). `exitcode` is negative for a signal.
    #[error("{summary}")]
    RankFailed {
        /// The first rank that failed.
        rank: usize,
        /// Its exit code, or minus the signal that ended it.
        exitcode: i32,
        /// The report printed for it.
        summary: String,
    },
    /// A state dict does not fit the model it is loaded into.
    #[error("state dict: {0}")]
    StateDict(
        /// The keys or shapes that do not fit.
        String,
    ),
    /// A checkpoint directory that cannot be written or read back: names the directory and
    /// what is wrong with it (a missing file, an unreadable training state, …).
    #[error("checkpoint {dir}: {problem}")]
    Checkpoint {
        /// The checkpoint directory.
        dir: PathBuf,
        /// What is wrong with it.
        problem: String,
    },
    /// FSDP was handed a module it cannot wrap or was called out of order (e.g. `backward`
    /// without a `forward_t`).
    #[error("FSDP on rank {rank}: {problem}")]
    Fsdp {
        /// This rank.
        rank: usize,
        /// What went wrong.
        problem: String,
    },
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
