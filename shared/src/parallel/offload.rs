//! Where AdamW's two moments live: in memory (the default) or in one file per rank on disk —
//! DeepSpeed's `zero_optimization.offload_optimizer: {"device": "nvme", "nvme_path": DIR}`
//! (ZeRO-Infinity), defined once here and read by every level.
//!
//! DeepSpeed's `offload_optimizer` keys and what ddp-ladder does with each:
//!
//! | key | DeepSpeed's default | here |
//! |---|---|---|
//! | `device` | `"none"` | `"none"` or `"nvme"`; `"cpu"` refused (see [`OffloadDevice`]) |
//! | `nvme_path` | `/local_nvme` | required with `"nvme"`: an existing, writable directory |
//! | `buffer_count` | 4 | only 4 (one synchronous buffer per moment is used; the value is not honoured otherwise) |
//! | `pin_memory` | false | only false (pinned memory speeds host↔GPU copies; the moments are read on the host) |
//! | `pipeline_read`, `pipeline_write` | false | only false (reads and writes are synchronous) |
//! | `fast_init` | false | only false |
//! | `ratio` | 1 | only 1 (every moment is offloaded) |
//!
//! The optimizer streams the file through a bounded buffer of [`NvmeOffload::buffer_size`]
//! elements per moment (ddp-ladder's knob; DeepSpeed sizes its swap buffers from the largest
//! parameter group): see [`crate::optim`].

use crate::{Error, Result};
use clap::ValueEnum;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// DeepSpeed's `offload_optimizer.device`: where the optimizer state lives. Written as
/// DeepSpeed's `none`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, ValueEnum)]
pub enum OffloadDevice {
    /// In memory, beside the parameters (DeepSpeed's default).
    #[default]
    #[value(name = "none")]
    None,
    /// In one file per rank under `nvme_path`, streamed through a bounded buffer at each step.
    #[value(name = "nvme")]
    Nvme,
}

impl super::Choice for OffloadDevice {
    const WHAT: &'static str = "offload_optimizer device";
    fn name(self) -> &'static str {
        match self {
            OffloadDevice::None => "none",
            OffloadDevice::Nvme => "nvme",
        }
    }
    fn unsupported(text: &str) -> Option<&'static str> {
        text.trim().eq_ignore_ascii_case("cpu").then_some(
            "offload to cpu is not implemented by ddp-ladder (on --device cpu the moments already live in host \
             memory, so it would save nothing; use nvme to move them out of memory)",
        )
    }
}
crate::impl_choice!(OffloadDevice);

/// The moments on disk: DeepSpeed's `offload_optimizer: {"device": "nvme", "nvme_path": …}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NvmeOffload {
    /// Directory the per-rank moment files are created in (DeepSpeed's `nvme_path`): it must
    /// exist and be writable; each rank creates its own file there and removes it when the
    /// optimizer is dropped.
    pub nvme_path: PathBuf,
    /// Elements of each moment held in memory at once while stepping (a multiple of
    /// [`crate::parallel::zero::ALIGN`], rounded up otherwise): the step reads this many
    /// elements of `exp_avg` and of `exp_avg_sq`, updates them and writes them back, chunk by
    /// chunk. Default [`NvmeOffload::DEFAULT_BUFFER_SIZE`].
    pub buffer_size: usize,
}

impl NvmeOffload {
    /// 2²⁰ elements per moment: 4 MiB each in fp32, 8 MiB for the pair.
    pub const DEFAULT_BUFFER_SIZE: usize = 1 << 20;

    /// Offload to `nvme_path` with the default buffer.
    pub fn new(nvme_path: impl Into<PathBuf>) -> Self {
        Self { nvme_path: nvme_path.into(), buffer_size: Self::DEFAULT_BUFFER_SIZE }
    }
}

/// Where the optimizer's moments live ([`OptimizerOffload::None`]: in memory).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", tag = "device")]
pub enum OptimizerOffload {
    /// In memory (DeepSpeed's `device: "none"`).
    #[default]
    None,
    /// On disk, one file per rank (DeepSpeed's `device: "nvme"`).
    Nvme(NvmeOffload),
}

impl OptimizerOffload {
    /// The choice from DeepSpeed's `device` and `nvme_path` (ignored with `none`, as DeepSpeed).
    ///
    /// # Errors
    /// [`Error::InvalidValue`] naming `nvme_path` when `device` is nvme and no path is given.
    pub fn new(device: OffloadDevice, nvme_path: Option<PathBuf>) -> Result<Self> {
        match (device, nvme_path) {
            (OffloadDevice::None, _) => Ok(OptimizerOffload::None),
            (OffloadDevice::Nvme, Some(p)) => Ok(OptimizerOffload::Nvme(NvmeOffload::new(p))),
            (OffloadDevice::Nvme, None) => {
                Err(Error::invalid("nvme_path", "(missing)", "a directory for the optimizer's moment files (offload device nvme)"))
            }
        }
    }

    /// The device it names.
    pub fn device(&self) -> OffloadDevice {
        match self {
            OptimizerOffload::None => OffloadDevice::None,
            OptimizerOffload::Nvme(_) => OffloadDevice::Nvme,
        }
    }

    /// True when the moments are on disk.
    pub fn is_offloaded(&self) -> bool {
        matches!(self, OptimizerOffload::Nvme(_))
    }

    /// Checks, before training, that `nvme_path` is an existing directory this process can
    /// create files in (it creates and removes one) and that `buffer_size` is positive.
    ///
    /// # Errors
    /// [`Error::InvalidValue`] naming `nvme_path` (missing, not a directory, not writable, with
    /// the operating system's reason) or `buffer_size`.
    pub fn validate(&self) -> Result<()> {
        let OptimizerOffload::Nvme(o) = self else { return Ok(()) };
        if o.buffer_size == 0 {
            return Err(Error::invalid("buffer_size", 0, "a positive number of elements"));
        }
        check_dir(&o.nvme_path)
    }

    /// Applies one DeepSpeed `offload_optimizer` key other than `device` and `nvme_path`
    /// (`buffer_count`, `pin_memory`, `pipeline_read`, `pipeline_write`, `fast_init`, `ratio`,
    /// given as JSON text): DeepSpeed's default is accepted, any other value refused.
    ///
    /// # Errors
    /// [`Error::InvalidValue`] naming the key: a value other than DeepSpeed's default, or a key
    /// DeepSpeed's `offload_optimizer` does not have.
    pub fn check_deepspeed_key(key: &str, value: &str) -> Result<()> {
        let v = value.trim().trim_matches('"');
        let (ok, why) = match key {
            "buffer_count" => (v == "4", "4, DeepSpeed's default (ddp-ladder streams through one buffer per moment)"),
            "pin_memory" => (v == "false", "false (pinned memory speeds host-GPU copies; ddp-ladder reads the moments on the host)"),
            "pipeline_read" | "pipeline_write" => (v == "false", "false (ddp-ladder reads and writes synchronously)"),
            "fast_init" => (v == "false", "false, DeepSpeed's default"),
            "ratio" => (v.parse::<f64>() == Ok(1.0), "1 (ddp-ladder offloads every moment)"),
            _ => (false, "one of device, nvme_path, buffer_count, pin_memory, pipeline_read, pipeline_write, fast_init, ratio"),
        };
        if ok {
            Ok(())
        } else {
            Err(Error::invalid(format!("offload_optimizer.{key}"), value, why))
        }
    }
}

/// `dir` exists, is a directory, and a file can be created in it.
fn check_dir(dir: &Path) -> Result<()> {
    let meta = std::fs::metadata(dir).map_err(|e| Error::invalid("nvme_path", dir.display(), format!("an existing directory ({e})")))?;
    if !meta.is_dir() {
        return Err(Error::invalid("nvme_path", dir.display(), "a directory (it is a file)"));
    }
    tempfile::Builder::new()
        .prefix(".ladder-write-test-")
        .tempfile_in(dir)
        .map(drop)
        .map_err(|e| Error::invalid("nvme_path", dir.display(), format!("a directory this process can write to ({e})")))
}
