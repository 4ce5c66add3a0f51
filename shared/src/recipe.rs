//! The training recipe every level shares: the command-line arguments ([`TrainArgs`]) and
//! their checks, the batch-size and memory checks, the batch counts every rank must agree on,
//! one dropout seed per batch, the AdamW recipe, weight saving and the end-of-epoch lines.
//!
//! Recipe (PyTorch's MNIST example with the DDP tutorial's optimizer): BasicNet, AdamW (lr 1e-3,
//! betas 0.9/0.999, eps 1e-8, weight_decay 0.01), `nll_loss` on log-probabilities, batch 64,
//! train mode with dropout, evaluation ([`crate::eval`]) in eval mode under `no_grad`, argmax
//! accuracy. The single-process baseline that runs it is the `ladder-baseline` binary.

use crate::data::{resolve_data_dir, Mnist};
use crate::device::DeviceKind;
use crate::eval::EvalSums;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use tch::nn::{self, ModuleT};
use tch::{Kind, Tensor};

/// The training flags every level's binary shares (the tutorial's, plus `--metrics-json`).
#[derive(Debug, Clone, PartialEq, clap::Args, Serialize, Deserialize)]
pub struct TrainArgs {
    /// Passes over the 60,000 training images.
    #[arg(long, default_value_t = 1)]
    pub epochs: usize,
    /// Samples per optimizer step (per rank when several ranks train).
    #[arg(long, default_value_t = 64)]
    pub batch_size: usize,
    /// AdamW learning rate.
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f64,
    /// Seed of the weights' initialisation, dropout and the shuffle.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Stop after this many optimizer steps (over all epochs) — for quick runs.
    #[arg(long)]
    pub max_steps: Option<usize>,
    /// Directory holding the four MNIST IDX files (.gz or raw). Default: $MNIST_DIR, else
    /// ./data/mnist, else the workspace's data/mnist.
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Download missing MNIST files into the data directory (as torchvision's download=True).
    #[arg(long)]
    pub download: bool,
    /// Mirror to download from (repeatable; tried in order). Default: $MNIST_MIRRORS
    /// (comma-separated), else the canonical public mirrors.
    #[arg(long = "mirror", value_name = "URL")]
    pub mirrors: Vec<String>,
    /// Device to train on. Default: cuda if available, else cpu.
    #[arg(long, value_enum, value_parser = crate::cli::choice::<DeviceKind>())]
    pub device: Option<DeviceKind>,
    /// Write the run's figures as JSON to this file.
    #[arg(long, value_name = "PATH")]
    pub metrics_json: Option<PathBuf>,
    /// Print the training loss every N steps (0: only per epoch).
    #[arg(long, default_value_t = 100)]
    pub log_interval: usize,
    /// Save the trained weights to this file as safetensors, with the unwrapped model's keys
    /// (`conv1.weight`, …), as the tutorial's `--save-model` (written by rank 0).
    #[arg(long, value_name = "PATH")]
    #[serde(default)]
    pub save_model: Option<PathBuf>,
    /// Seconds a collective may wait for the other ranks; then every waiting rank fails with
    /// an error naming the ranks that did not arrive and the job ends (as
    /// init_process_group(timeout=...); Accelerate's InitProcessGroupKwargs(timeout),
    /// Transformers' ddp_timeout).
    #[arg(long, alias = "ddp-timeout", value_name = "SECONDS", env = crate::dist::TIMEOUT_VAR, hide_env_values = true, default_value_t = 600.0,
          value_parser = parse_seconds)]
    #[serde(default = "default_timeout")]
    pub timeout: f64,
    /// Keep training when the loss or a gradient is NaN or infinite. By default such a step
    /// stops every rank with an error naming the step and the rank where it appeared (with
    /// fp16 loss scaling, inf gradients stay the scaler's business: the step is skipped).
    #[arg(long)]
    #[serde(default)]
    pub allow_non_finite: bool,
}

fn default_timeout() -> f64 {
    crate::dist::DEFAULT_TIMEOUT.as_secs_f64()
}

/// clap parser for `--timeout`: a positive number of seconds.
fn parse_seconds(s: &str) -> std::result::Result<f64, String> {
    crate::dist::parse_timeout("--timeout", s)
        .map(|d| d.as_secs_f64())
        .map_err(|_| format!("expected a positive number of seconds (e.g. 600), got {s:?}"))
}

impl Default for TrainArgs {
    fn default() -> Self {
        Self {
            epochs: 1,
            batch_size: 64,
            lr: 1e-3,
            seed: 1,
            max_steps: None,
            data_dir: None,
            download: false,
            mirrors: Vec::new(),
            device: None,
            metrics_json: None,
            log_interval: 100,
            save_model: None,
            timeout: default_timeout(),
            allow_non_finite: false,
        }
    }
}

impl TrainArgs {
    /// Checks the values clap cannot.
    ///
    /// # Errors
    /// [`Error::InvalidValue`] naming the flag.
    pub fn validate(&self) -> Result<()> {
        if self.epochs == 0 {
            return Err(Error::invalid("--epochs", self.epochs, "at least 1"));
        }
        if self.batch_size == 0 {
            return Err(Error::invalid("--batch-size", self.batch_size, "at least 1"));
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(Error::invalid("--lr", self.lr, "a positive, finite learning rate"));
        }
        if self.max_steps == Some(0) {
            return Err(Error::invalid("--max-steps", 0, "at least 1 (or leave it out)"));
        }
        if !(self.timeout.is_finite() && self.timeout > 0.0) {
            return Err(Error::invalid("--timeout", self.timeout, "a positive number of seconds (e.g. 600)"));
        }
        // Files written after training are checked before it (a probe file created and removed
        // where each will go), so a typo or a read-only directory costs seconds, not an epoch.
        // (The metrics JSON creates missing directories; the weights file does not.)
        for (flag, path, dirs) in
            [("--metrics-json", &self.metrics_json, MissingDirs::Created), ("--save-model", &self.save_model, MissingDirs::Refused)]
        {
            if let Some(path) = path {
                check_output_file(flag, path, dirs)?;
            }
        }
        Ok(())
    }

    /// Checks `--batch-size` against one rank's share of the training set, `train_len /
    /// world_size` rounded up (what a `DistributedSampler` gives each rank): a larger batch is a
    /// mistake, and allocating it can get the process killed by the kernel's OOM killer.
    ///
    /// # Errors
    /// [`Error::InvalidValue`] naming `--batch-size`, the share and the world size.
    pub fn check_batch_size(&self, train_len: usize, world_size: usize) -> Result<()> {
        check_batch_size("--batch-size", self.batch_size, train_len, world_size)
    }

    /// Checks that one training step at `--batch-size` fits in this node's free memory with
    /// fc1 `width` and `local_world_size` ranks on the node ([`check_batch_fits_memory`]; CPU
    /// only).
    ///
    /// # Errors
    /// [`Error::BatchTooLargeForMemory`] naming `--batch-size`, the estimate, the available
    /// memory and the largest batch that fits.
    pub fn check_batch_memory(&self, width: i64, local_world_size: usize, device: tch::Device) -> Result<()> {
        check_batch_fits_memory("--batch-size", self.batch_size, width, local_world_size, device)
    }

    /// Checks that the device given with `--device` can be used (for cuda: a driver, libtorch's
    /// CUDA backend and a device), before anything is set up; nothing to check without
    /// `--device` (the default is cuda only where it is available).
    ///
    /// # Errors
    /// [`Error::CudaUnavailable`] naming `--device`.
    pub fn check_device(&self) -> Result<()> {
        match self.device {
            Some(kind) => kind.resolve(0).map(drop).map_err(|e| e.named_by(&[("device", "--device")])),
            None => Ok(()),
        }
    }

    /// Writes `report` to the `--metrics-json` file when one was given (pretty JSON, atomically:
    /// [`Report::write_json`](crate::metrics::Report::write_json)). One process writes it (rank
    /// 0); every level and the baseline end with it.
    ///
    /// # Errors
    /// [`Error::InvalidValue`] naming `--metrics-json` and the path when it cannot be written.
    pub fn write_metrics_json(&self, report: &crate::metrics::Report) -> Result<()> {
        let Some(path) = &self.metrics_json else { return Ok(()) };
        report.write_json(path).map_err(|e| Error::invalid("--metrics-json", path.display(), format!("a writable file ({e})")))
    }

    /// The collective timeout of `--timeout` (or `LADDER_COLLECTIVE_TIMEOUT_S`).
    pub fn collective_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.timeout)
    }

    /// The device kind to use: `--device`, else cuda if available.
    pub fn device_kind(&self) -> DeviceKind {
        self.device.unwrap_or_else(DeviceKind::default_for_machine)
    }

    /// Loads MNIST from the resolved data directory, downloading missing files when
    /// `--download` is given.
    ///
    /// # Errors
    /// The data module's typed errors (missing file with a hint, checksum mismatch, …).
    pub fn load_mnist(&self) -> Result<Mnist> {
        let dir = resolve_data_dir(self.data_dir.as_deref());
        if self.download {
            let mirrors = if self.mirrors.is_empty() { crate::data::mirrors_from_env() } else { self.mirrors.clone() };
            Mnist::load_or_download(&dir, &mirrors)
        } else {
            Mnist::load(&dir)
        }
    }
}

/// Checks a per-rank batch size (`flag`, e.g. `--batch-size` or
/// `per_device_train_batch_size`) against one rank's share of `train_len` samples at
/// `world_size` ranks (rounded up, as `DistributedSampler`'s `num_samples`). Every level calls
/// it before loading a batch.
///
/// # Errors
/// [`Error::InvalidValue`] naming the flag, the share and the world size.
pub fn check_batch_size(flag: &str, batch_size: usize, train_len: usize, world_size: usize) -> Result<()> {
    let w = world_size.max(1);
    let share = train_len.div_ceil(w);
    if batch_size > share {
        let expected = if w == 1 {
            format!("at most the {train_len} training images")
        } else {
            format!("at most {share}, one rank's share of the {train_len} training images at world size {w} ({train_len} / {w})")
        };
        return Err(Error::invalid(flag, batch_size, expected));
    }
    Ok(())
}

/// Checks that one training step's activations fit in the memory this node has free, before
/// the first batch is allocated: `batch_size` (named `flag`, e.g. `--batch-size` or
/// `per_device_train_batch_size`) × [`activation_bytes_per_sample`](crate::memory::activation_bytes_per_sample)`(width)`
/// × `local_world_size` ranks training on this node, against `available` bytes. A pure
/// function (the caller reads `MemAvailable`: [`check_batch_fits_memory`]).
///
/// # Errors
/// [`Error::BatchTooLargeForMemory`] naming the flag, the estimate and the available memory
/// in MiB, and the largest batch size that fits.
pub fn check_batch_memory(flag: &str, batch_size: usize, width: i64, local_world_size: usize, available: u64) -> Result<()> {
    let per_sample = crate::memory::activation_bytes_per_sample(width);
    let ranks = local_world_size.max(1);
    let per_rank = per_sample.saturating_mul(batch_size as u64);
    let total = per_rank.saturating_mul(ranks as u64);
    if total <= available {
        return Ok(());
    }
    let max_batch_size = (available / per_sample.saturating_mul(ranks as u64)) as usize;
    let advice = if max_batch_size == 0 {
        "not even a batch of 1 fits: free memory, or run fewer ranks on this node".to_string()
    } else if ranks > 1 {
        format!("the largest {flag} that fits is {max_batch_size} (or run fewer ranks on this node)")
    } else {
        format!("the largest {flag} that fits is {max_batch_size}")
    };
    let mib = |b: u64| b >> 20;
    Err(Error::BatchTooLargeForMemory {
        flag: flag.to_string(),
        batch_size,
        width,
        per_sample_kib: per_sample.div_ceil(1024),
        estimate_mib: mib(per_rank),
        ranks,
        total_mib: mib(total),
        available_mib: mib(available),
        max_batch_size,
        advice,
    })
}

/// [`check_batch_memory`] against this machine's `MemAvailable` (`/proc/meminfo`), on CPU.
/// On CUDA the activations live in the device's memory, which libtorch's caching allocator
/// reports itself (a clear CUDA out-of-memory error, not the OOM killer): nothing is checked;
/// nor where `/proc/meminfo` cannot be read. Every level calls it beside [`check_batch_size`].
///
/// # Errors
/// [`Error::BatchTooLargeForMemory`] (see [`check_batch_memory`]).
pub fn check_batch_fits_memory(flag: &str, batch_size: usize, width: i64, local_world_size: usize, device: tch::Device) -> Result<()> {
    if device != tch::Device::Cpu {
        return Ok(());
    }
    match crate::memory::mem_available_bytes() {
        Some(available) => check_batch_memory(flag, batch_size, width, local_world_size, available),
        None => Ok(()),
    }
}

/// Checks, before the first step, that every rank will run the same number of batches per
/// epoch (one all-gather of one integer). A rank with fewer would leave the others waiting in
/// an all-reduce it never joins; this names it instead.
///
/// # Errors
/// [`Error::UnevenBatches`] on every rank, naming the first rank whose count differs from rank
/// 0's and both counts; collective errors.
pub fn check_batch_counts(pg: &dyn crate::dist::ProcessGroup, batches: usize) -> Result<()> {
    let w = pg.world_size();
    if w == 1 {
        return Ok(());
    }
    let mine = Tensor::from_slice(&[batches as i64]).to_device(pg.device());
    let mut all = Tensor::zeros([w as i64], (Kind::Int64, pg.device()));
    pg.all_gather(&mut all, &mine)?;
    let counts = Vec::<i64>::try_from(all.to_device(tch::Device::Cpu))?;
    if let Some(r) = (1..w).find(|&r| counts[r] != counts[0]) {
        return Err(Error::UnevenBatches { rank: r, batches: counts[r] as u64, other_rank: 0, other_batches: counts[0] as u64 });
    }
    Ok(())
}

/// The end of an epoch as the tutorial has it: the mean training loss over the epoch's steps
/// (averaged over ranks with one all-reduce; pass `None` for a single process) and the test
/// figures, printed on rank 0 — `Epoch N: mean train loss … over S steps`, then the tutorial's
/// `Test set: Average loss: …, Accuracy: …` (the binaries end with
/// [`Report::figures_line`](crate::metrics::Report::figures_line)).
///
/// # Errors
/// Collective errors.
pub fn end_of_epoch(
    pg: Option<&dyn crate::dist::ProcessGroup>,
    epoch: usize,
    steps: usize,
    local_mean_loss: f64,
    eval: &EvalSums,
) -> Result<crate::metrics::EpochFigures> {
    let train_loss = match pg {
        Some(pg) if pg.world_size() > 1 => {
            let mut t = Tensor::from_slice(&[local_mean_loss]).to_device(pg.device());
            pg.all_reduce(&mut t, crate::dist::ReduceOp::Avg)?;
            t.double_value(&[0])
        }
        _ => local_mean_loss,
    };
    let figures = crate::metrics::EpochFigures {
        epoch,
        steps,
        train_loss,
        test_loss: eval.mean_loss(),
        accuracy: eval.accuracy(),
        eval_samples: eval.count as u64,
    };
    if pg.is_none_or(|pg| pg.rank() == 0) {
        println!("{}", figures.train_line());
        println!("{}", figures.test_line());
    }
    Ok(figures)
}

/// Seeds libtorch's generator for one batch, so that its dropout masks are a function of
/// (`seed`, `rank`, `batch_index`) alone: a run resumed from a checkpoint at batch k draws the
/// same masks as one that never stopped, without saving generator state (tch cannot read it).
/// `batch_index` counts micro-batches from 0 over all epochs. Ranks draw different masks, as
/// independent workers do. Every level calls it before each batch's forward (where the rank
/// is, [`crate::dist::progress::set_step`], is recorded by the loop's batches: level 1's
/// [`crate::timing::StepTimer::timed`], levels 2 and 3's prepared data loader).
// ANCHOR: seed_batch
pub fn seed_batch(seed: u64, rank: usize, batch_index: u64) {
    // splitmix64 of the three inputs: well-spread seeds for neighbouring batches.
    let mut z = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add((rank as u64).wrapping_mul(0xD1B5_4A32_D192_ED03))
        .wrapping_add(batch_index.wrapping_mul(0x8CB9_2BA7_2F3D_8DD7));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    tch::manual_seed((z >> 1) as i64);
}
// ANCHOR_END: seed_batch

/// The name [`save_weights`]' errors give the file they could not write; a level renames it to
/// its own flag or argument with [`Error::named_by`] (`--save-model`, `output_dir`).
pub const WEIGHTS_FILE: &str = "weights file";

/// Writes `weights` (name → tensor) to `path` as safetensors, atomically (a temporary file in
/// the same directory, renamed into place), with the mode of any file a program creates (0666
/// less the umask).
///
/// # Errors
/// [`Error::InvalidValue`] naming [`WEIGHTS_FILE`] and the path when it cannot be written.
pub fn save_weights(path: &std::path::Path, weights: &[(String, Tensor)]) -> Result<()> {
    let bad = |e: String| Error::invalid(WEIGHTS_FILE, path.display(), format!("a writable file ({e})"));
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
    // Mode 0666 less the umask, as every file the project writes (tempfile's own is 0600).
    let tmp = tempfile::Builder::new()
        .prefix(".ladder-")
        .suffix(".safetensors")
        .permissions(std::os::unix::fs::PermissionsExt::from_mode(0o666))
        .tempfile_in(dir)
        .map_err(|e| bad(e.to_string()))?;
    crate::safetensors_file::write(tmp.path(), weights).map_err(|e| bad(e.to_string()))?;
    tmp.persist(path).map_err(|e| bad(e.error.to_string()))?;
    Ok(())
}

/// The loss of one batch: `nll_loss(model(images), labels)`, mean over the batch.
pub fn batch_loss(model: &impl ModuleT, images: &Tensor, labels: &Tensor) -> Tensor {
    model.forward_t(images, true).nll_loss(labels)
}

/// Builds the core's AdamW ([`crate::optim::AdamW`], libtorch's fused kernel) over every
/// trainable variable of `vs` with the recipe's hyper-parameters (`torch.optim.AdamW`'s
/// defaults, learning rate `lr`) — the optimizer every level builds, so that the baseline and
/// level 1 at world size 1 stay one computation.
///
/// # Errors
/// [`Error::InvalidValue`] for a negative or non-finite `lr`.
pub fn adamw(vs: &nn::VarStore, lr: f64) -> Result<crate::optim::AdamW> {
    crate::optim::AdamW::new(vs.trainable_variables(), crate::optim::AdamWConfig { lr, ..Default::default() })
}

/// What the writer of a file does with the missing directories above it (see
/// [`check_output_file`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MissingDirs {
    /// It creates them (the metrics JSON, as `write_atomic`).
    Created,
    /// They must exist already (the weights file, as [`save_weights`]).
    Refused,
}

/// What a run writes at a path the user gave it (see [`check_writable`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputKind {
    /// A file, written whole into its directory (a temporary file renamed into place):
    /// `--save-model`, `--metrics-json`.
    File(MissingDirs),
    /// A directory written whole, as a checkpoint: built beside it in its parent and renamed
    /// into place ([`crate::checkpoint::Writer`]); missing parents are created. Level 2's
    /// `--save-state`.
    Checkpoint,
    /// A directory the run writes files into, created with its missing parents: level 3's
    /// `output_dir`.
    Dir,
}

/// Checks that `path` can be written as a file later (see [`check_writable`] with
/// [`OutputKind::File`]).
///
/// # Errors
/// [`Error::InvalidValue`] naming `flag`, the path and what is wrong.
pub fn check_output_file(flag: &str, path: &std::path::Path, dirs: MissingDirs) -> Result<()> {
    check_writable(flag, path, OutputKind::File(dirs))
}

/// The one writability check every level runs before its first step, for every path the run
/// will write (`--save-model`, `--metrics-json`, level 2's `--save-state`, level 3's
/// `output_dir`), so that a typo or a read-only directory costs seconds, not an epoch: `path`
/// has the right kind (a file path is not a directory; a directory path is not a file), the
/// directory the writer will create its file in exists — or, where the writer creates missing
/// directories, its nearest existing ancestor is a directory — and a probe file can be created
/// (and is removed) there. Nothing is left behind: missing directories are not created here
/// (the writer creates them later, as it does without this check); the probe goes to the
/// nearest existing ancestor instead, where their creation needs write permission.
///
/// # Errors
/// [`Error::InvalidValue`] naming `flag`, the path and what is wrong (`Is a directory`, a
/// missing directory, a parent that is a file, or the directory where no file can be created
/// and the system's reason).
pub fn check_writable(flag: &str, path: &std::path::Path, kind: OutputKind) -> Result<()> {
    let what = if matches!(kind, OutputKind::File(_)) { "a writable file" } else { "a writable directory" };
    let bad = |why: String| Err(Error::invalid(flag, path.display(), format!("{what} ({why})")));
    match kind {
        OutputKind::File(_) if path.is_dir() => return bad("Is a directory".into()),
        OutputKind::Checkpoint | OutputKind::Dir if path.exists() && !path.is_dir() => {
            return bad("it exists and is not a directory".into())
        }
        _ => {}
    }
    // The directory the writer creates its file (or its checkpoint's temporary directory) in.
    let target = match kind {
        OutputKind::Dir => Some(path),
        OutputKind::File(_) | OutputKind::Checkpoint => path.parent(),
    };
    let here = std::path::Path::new(".");
    let mut dir = target.filter(|d| !d.as_os_str().is_empty()).unwrap_or(here);
    while !dir.exists() {
        if kind == OutputKind::File(MissingDirs::Refused) {
            return bad(format!("its directory {} does not exist", dir.display()));
        }
        // relative to the working directory, which exists
        dir = dir.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(here);
    }
    if !dir.is_dir() {
        return bad(format!("{} is not a directory", dir.display()));
    }
    match tempfile::Builder::new().prefix(".ladder-probe-").tempfile_in(dir) {
        Ok(probe) => probe.close().or_else(|e| bad(format!("cannot remove a probe file in {}: {e}", dir.display()))),
        // tempfile's error ends with the probe's random name: keep the system's reason.
        Err(e) => bad(format!("cannot create a file in {}: {}", dir.display(), e.to_string().split(" at path ").next().unwrap_or(""))),
    }
}

#[cfg(test)]
mod tests {
    use super::{check_output_file, check_writable, MissingDirs, OutputKind, TrainArgs};
    use std::path::Path;

    #[test]
    fn output_files_are_checked_before_training() {
        let dir = tempfile::tempdir().unwrap();
        let msg = |p: &std::path::Path, dirs: MissingDirs| check_output_file("--x", p, dirs).map_err(|e| e.to_string());
        assert!(msg(dir.path(), MissingDirs::Created).unwrap_err().ends_with("a writable file (Is a directory)"));
        let nested = dir.path().join("a/b/m.json");
        assert!(msg(&nested, MissingDirs::Created).is_ok(), "missing directories are created by such a writer");
        assert!(msg(&nested, MissingDirs::Refused)
            .unwrap_err()
            .ends_with(&format!("its directory {} does not exist)", dir.path().join("a/b").display())));
        assert!(msg(&dir.path().join("m.json"), MissingDirs::Refused).is_ok());
        assert!(msg(std::path::Path::new("m.json"), MissingDirs::Refused).is_ok(), "the working directory");
        assert!(msg(std::path::Path::new("/dev/null/m.json"), MissingDirs::Created)
            .unwrap_err()
            .ends_with("(/dev/null is not a directory)"));
    }

    /// A directory where no file can be created: read-only, or sysfs where permissions do not
    /// stop this process (root). The temp dir holding the read-only one comes along.
    fn unwritable_dir() -> (Option<tempfile::TempDir>, std::path::PathBuf) {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let ro = tmp.path().join("read-only");
        std::fs::create_dir(&ro).unwrap();
        std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o555)).unwrap();
        if std::fs::File::create(ro.join("probe")).is_err() {
            return (Some(tmp), ro);
        }
        (None, "/sys".into())
    }

    /// Issue 27: the weights file gets the mode every other file gets (0666 less the umask, as
    /// `File::create`), not tempfile's 0600.
    #[test]
    fn weights_files_get_the_usual_mode() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let (weights, plain) = (dir.path().join("m.safetensors"), dir.path().join("plain"));
        super::save_weights(&weights, &[("w".to_string(), tch::Tensor::from_slice(&[1f32, 2.0]))]).unwrap();
        std::fs::File::create(&plain).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&weights), mode(&plain));
        assert_ne!(mode(&weights), 0o600, "umask 0177 is not what tests run under");
    }

    /// Every path a run writes is probed before training: a read-only directory is refused
    /// with the flag, the path and the system's reason, missing directories included (the
    /// probe goes to the nearest existing one), and nothing is left behind.
    #[test]
    fn unwritable_outputs_are_refused_before_training() {
        let (_keep, ro) = unwritable_dir();
        let err = |flag: &str, p: &Path, kind: OutputKind| check_writable(flag, p, kind).unwrap_err().to_string();
        let cannot = format!("cannot create a file in {}: ", ro.display());
        for (kind, what) in [
            (OutputKind::File(MissingDirs::Refused), "a writable file"),
            (OutputKind::File(MissingDirs::Created), "a writable file"),
            (OutputKind::Checkpoint, "a writable directory"),
        ] {
            let e = err("--x", &ro.join("out"), kind);
            assert!(e.starts_with(&format!("invalid value \"{}\" for --x: {what} ({cannot}", ro.join("out").display())), "{e}");
        }
        let e = err("output_dir", &ro.join("a/b"), OutputKind::Dir);
        assert!(
            e.starts_with(&format!("invalid value \"{}\" for output_dir: a writable directory ({cannot}", ro.join("a/b").display())),
            "{e}"
        );
        let e = err("--x", &ro.join("a/m.json"), OutputKind::File(MissingDirs::Created));
        assert!(e.contains(&cannot), "missing directories under a read-only one: {e}");

        // TrainArgs::validate, what every level calls before its first step, names the flag.
        let args = TrainArgs { save_model: Some(ro.join("m.safetensors")), ..TrainArgs::default() };
        let e = args.validate().unwrap_err().to_string();
        assert!(
            e.starts_with(&format!("invalid value \"{}\" for --save-model: a writable file ({cannot}", ro.join("m.safetensors").display())),
            "{e}"
        );
        let args = TrainArgs { metrics_json: Some(ro.join("m.json")), ..TrainArgs::default() };
        assert!(args.validate().unwrap_err().to_string().contains("for --metrics-json: a writable file (cannot create a file in"));

        // Writable places pass, and keep nothing: no probe, no directory created.
        let dir = tempfile::tempdir().unwrap();
        for (p, kind) in [
            (dir.path().join("m.safetensors"), OutputKind::File(MissingDirs::Refused)),
            (dir.path().join("a/b/m.json"), OutputKind::File(MissingDirs::Created)),
            (dir.path().join("state"), OutputKind::Checkpoint),
            (dir.path().join("out/run"), OutputKind::Dir),
            (dir.path().to_path_buf(), OutputKind::Dir),
            (dir.path().to_path_buf(), OutputKind::Checkpoint),
        ] {
            assert!(check_writable("--x", &p, kind).is_ok(), "{p:?} {kind:?}");
        }
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "the check leaves nothing behind");
        let file = dir.path().join("f");
        std::fs::write(&file, b"").unwrap();
        assert!(err("--save-state", &file, OutputKind::Checkpoint).ends_with("a writable directory (it exists and is not a directory)"));
        assert!(err("output_dir", &file.join("x"), OutputKind::Dir).ends_with(&format!("({} is not a directory)", file.display())));
    }
}
