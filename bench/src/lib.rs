//! `bench`: ddp-ladder's measurements, run as processes and read back from their JSON reports.
//!
//! * [`demo`] — `bench demo` (`make demo`): the three levels one after another, one epoch on
//!   real MNIST at 2 ranks over MPI with DDP, then one comparison table.
//! * [`matrix`] — `bench run` (`make bench`): level × strategy × world size × width × precision,
//!   repeated and interleaved with the PyTorch peers of `bench/reference/`, plus the all-reduce
//!   bus bandwidth; results in `bench/results/`.
//! * [`compute`] — training FLOPs per sample and the machine's peak: compute efficiency.
//! * [`loc`] — the "lines of user training code" between mdBook anchors.
//!
//! The bench never links a level: it runs the binaries (`target/release/…`) as a user would and
//! reads their `--metrics-json` files ([`figures`]).

pub mod compute;
pub mod demo;
pub mod error;
pub mod figures;
pub mod loc;
pub mod machine;
pub mod matrix;
pub mod process;
pub mod stats;

pub use error::{Error, Result};

use std::path::{Path, PathBuf};
use std::time::Duration;

/// One rung of the ladder: what the demo and the matrix run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Level {
    /// 1, 2 or 3.
    pub number: u8,
    /// What the level is (`raw DDP`, `Accelerator`, `Trainer`).
    pub title: &'static str,
    /// The crate's directory under the workspace root (holds `src/main.rs` / `src/lib.rs`).
    pub crate_dir: &'static str,
    /// The training binary's name in `target/release/`.
    pub binary: &'static str,
}

/// The three levels, in order.
pub const LEVELS: [Level; 3] = [
    Level { number: 1, title: "raw DDP", crate_dir: "level1-raw-ddp", binary: "level1-raw-ddp" },
    Level { number: 2, title: "Accelerator", crate_dir: "level2-accelerator", binary: "level2-accelerator" },
    Level { number: 3, title: "Trainer", crate_dir: "level3-trainer", binary: "level3-trainer" },
];

/// The levels numbered in `numbers`, in the order given, without duplicates.
///
/// # Errors
/// [`Error::InvalidValue`] naming `--levels` for a number outside 1..=3 or an empty list.
pub fn select_levels(numbers: &[u8]) -> Result<Vec<Level>> {
    let mut out: Vec<Level> = Vec::new();
    for &n in numbers {
        let level = LEVELS.iter().find(|l| l.number == n).ok_or_else(|| Error::InvalidValue {
            flag: "--levels",
            value: n.to_string(),
            expected: "level numbers among 1, 2, 3 (comma-separated, e.g. --levels 1,3)".into(),
        })?;
        if !out.contains(level) {
            out.push(*level);
        }
    }
    if out.is_empty() {
        return Err(Error::InvalidValue { flag: "--levels", value: String::new(), expected: "at least one of 1, 2, 3".into() });
    }
    Ok(out)
}

/// Where the binaries `bench demo` and `bench run` start are, and how long each may run: the
/// options both take.
#[derive(Debug, Clone, clap::Args)]
pub struct LaunchArgs {
    /// Workspace root: where the sources and, by default, the binaries are. Default: the one
    /// this bench was built in.
    #[arg(long)]
    pub root: Option<PathBuf>,
    /// Where the built binaries are. Default: `<root>/target/release`.
    #[arg(long)]
    pub bin_dir: Option<PathBuf>,
    /// Kill a run still going after this many seconds.
    #[arg(long, default_value_t = 1800)]
    pub timeout_s: u64,
}

impl LaunchArgs {
    /// `--root`, or the workspace this bench was built in ([`default_root`]).
    pub fn root(&self) -> PathBuf {
        self.root.clone().unwrap_or_else(default_root)
    }

    /// `--bin-dir`, or `<root>/target/release`.
    pub fn bin_dir(&self) -> PathBuf {
        self.bin_dir.clone().unwrap_or_else(|| self.root().join("target").join("release"))
    }

    /// `--timeout-s`.
    pub fn timeout(&self) -> Duration {
        Duration::from_secs(self.timeout_s)
    }
}

/// The workspace root this bench was built in (the binaries and sources are found from here
/// unless `--root` says otherwise).
pub fn default_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().map(Path::to_path_buf).unwrap_or_else(|| PathBuf::from("."))
}

/// Writes `text` to `path` atomically (temp file + rename), creating parent directories.
///
/// # Errors
/// [`Error::Io`] naming `path`.
pub fn write_file(path: &Path, text: &str) -> Result<()> {
    ladder_core::atomic::write_atomic(path, text.as_bytes())
        .map_err(|e| Error::Io { path: path.to_path_buf(), source: std::io::Error::other(e.to_string()) })
}

/// `path` if it exists as a file, else [`Error::MissingBinary`].
///
/// # Errors
/// [`Error::MissingBinary`] naming the path.
pub fn require_binary(path: PathBuf) -> Result<PathBuf> {
    if path.is_file() {
        Ok(path)
    } else {
        Err(Error::MissingBinary { path })
    }
}
