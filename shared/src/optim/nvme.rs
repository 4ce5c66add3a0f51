//! AdamW's moments in a file: DeepSpeed's `offload_optimizer: {"device": "nvme"}` (see
//! [`crate::parallel::offload`]).
//!
//! One file per rank under `nvme_path`, named `ladder-adamw-rank{rank}-XXXXXX.moments`
//! (created as `tempfile` does: a fresh random name, `O_EXCL`, mode 0600; removed when the
//! optimizer is dropped). Parameter `i` owns the byte range `[offset_i, offset_i + 2·n_i·e)`:
//! its `exp_avg` (`n_i` elements of the parameter's dtype, `e` bytes each, native byte order),
//! then its `exp_avg_sq`. The file is created at its full length, sparse: unwritten bytes read
//! as zeros, the moments' initial value.
//!
//! A step streams each parameter with a gradient through a buffer of `buffer_size` elements
//! per moment (a multiple of [`ALIGN`]): plain `pread` of the chunk of `exp_avg` and of
//! `exp_avg_sq`, the same fused AdamW kernel as the in-memory optimizer on that slice of the
//! parameter and its gradient, `pwrite` back. The kernel is element-wise and every chunk
//! starts at a multiple of [`ALIGN`] elements from the parameter's start, so each element goes
//! through the same arithmetic (the same vector lanes, the same scalar tail) as in the
//! in-memory step: the result is bit-identical (as ZeRO-1's pieces, [`crate::parallel::zero`]).
//!
//! Nothing of the moments stays resident between steps: no mapping, only the buffer
//! (`2 · buffer_size` elements per dtype, allocated once; the file is read into it and written
//! from it in place). The operating system's page
//! cache may still hold (part of) the file; that memory is the kernel's, reclaimable, and not
//! counted in the process's resident set size, which is what this offload lowers.

use crate::optim::AdamWConfig;
use crate::parallel::offload::NvmeOffload;
use crate::parallel::zero::ALIGN;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::time::Instant;
use tch::{Device, Kind, Tensor};

/// What an offloaded optimizer moved to and from its file: one step's, or the sum since it was
/// created.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct OffloadStats {
    /// Bytes of moments read from the file (a parameter's first step reads nothing: its
    /// moments start at zero).
    pub bytes_read: u64,
    /// Bytes of moments written to the file.
    pub bytes_written: u64,
    /// Seconds in the offloaded step: reading, the AdamW arithmetic and writing.
    pub seconds: f64,
    /// Optimizer steps counted.
    pub steps: u64,
}

impl OffloadStats {
    /// The mean per step of totals over `steps` steps (`steps` 1; zeros when none).
    pub fn per_step(total: &OffloadStats) -> OffloadStats {
        let n = total.steps.max(1);
        OffloadStats {
            bytes_read: total.bytes_read / n,
            bytes_written: total.bytes_written / n,
            seconds: total.seconds / n as f64,
            steps: 1,
        }
    }

    /// One line for the levels' output: `offload_optimizer (nvme): per step 288.0 MiB read,
    /// 288.0 MiB written, 0.412 s` (this rank's figures).
    pub fn summary(&self) -> String {
        let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
        format!(
            "offload_optimizer (nvme): per step {:.1} MiB read, {:.1} MiB written, {:.3} s (rank 0)",
            mib(self.bytes_read),
            mib(self.bytes_written),
            self.seconds
        )
    }

    fn add(&mut self, o: &OffloadStats) {
        self.bytes_read += o.bytes_read;
        self.bytes_written += o.bytes_written;
        self.seconds += o.seconds;
        self.steps += o.steps;
    }
}

/// One parameter's place in the file.
#[derive(Debug, Clone, Copy)]
struct Region {
    /// Byte offset of its `exp_avg`; its `exp_avg_sq` follows.
    offset: u64,
    numel: i64,
    kind: Kind,
}

impl Region {
    fn moment_bytes(&self) -> u64 {
        (self.numel as usize * self.kind.elt_size_in_bytes()) as u64
    }
}

/// The moments' file of one rank and the buffer they stream through.
#[derive(Debug)]
pub(crate) struct MomentFile {
    file: tempfile::NamedTempFile,
    regions: Vec<Region>,
    /// Elements per chunk, a multiple of [`ALIGN`].
    buffer_size: i64,
    /// The buffer, `[2, buffer_size]` on the CPU per dtype: a chunk of `exp_avg`, one of
    /// `exp_avg_sq` (allocated at the first step).
    buffers: Vec<(Kind, Tensor)>,
    last: OffloadStats,
    total: OffloadStats,
}

fn round_up(n: i64, to: i64) -> i64 {
    (n + to - 1) / to * to
}

impl MomentFile {
    /// Creates rank `rank`'s file under `o.nvme_path`, sized for the moments of `params`.
    ///
    /// # Errors
    /// [`Error::Io`] naming the directory or the file.
    pub(crate) fn create(params: &[Tensor], o: &NvmeOffload, rank: usize) -> Result<Self> {
        let file = tempfile::Builder::new()
            .prefix(&format!("ladder-adamw-rank{rank}-"))
            .suffix(".moments")
            .tempfile_in(&o.nvme_path)
            .map_err(|e| Error::io(&o.nvme_path, e))?;
        let mut regions = Vec::with_capacity(params.len());
        let mut offset = 0u64;
        for p in params {
            let r = Region { offset, numel: p.numel() as i64, kind: p.kind() };
            offset += 2 * r.moment_bytes();
            regions.push(r);
        }
        file.as_file().set_len(offset).map_err(|e| Error::io(file.path(), e))?;
        let buffer_size = round_up(o.buffer_size.max(1) as i64, ALIGN);
        Ok(Self { file, regions, buffer_size, buffers: Vec::new(), last: OffloadStats::default(), total: OffloadStats::default() })
    }

    /// The file's path.
    pub(crate) fn path(&self) -> PathBuf {
        self.file.path().to_path_buf()
    }

    /// The last step's transfers and the totals.
    pub(crate) fn stats(&self) -> (OffloadStats, OffloadStats) {
        (self.last, self.total)
    }

    /// Elements per moment held in memory while stepping.
    pub(crate) fn buffer_size(&self) -> i64 {
        self.buffer_size
    }

    /// Starts counting a step.
    pub(crate) fn begin_step(&mut self) -> Instant {
        self.last = OffloadStats { steps: 1, ..OffloadStats::default() };
        Instant::now()
    }

    /// Ends the step begun at `t0`.
    pub(crate) fn end_step(&mut self, t0: Instant) {
        self.last.seconds = t0.elapsed().as_secs_f64();
        let last = self.last;
        self.total.add(&last);
    }

    /// The buffer for `kind`: `[2, buffer_size]` on the CPU.
    fn buffer(&mut self, kind: Kind) -> Tensor {
        if let Some((_, b)) = self.buffers.iter().find(|(k, _)| *k == kind) {
            return b.shallow_clone();
        }
        let b = Tensor::zeros([2, self.buffer_size], (kind, Device::Cpu));
        self.buffers.push((kind, b.shallow_clone()));
        b
    }

    /// Byte offset of element `start` of parameter `i`'s moment `which` (0 `exp_avg`, 1
    /// `exp_avg_sq`).
    fn at(&self, i: usize, which: u64, start: i64) -> u64 {
        let r = self.regions[i];
        r.offset + which * r.moment_bytes() + (start as usize * r.kind.elt_size_in_bytes()) as u64
    }

    /// Fills `dst` (contiguous, CPU, parameter `i`'s dtype) from parameter `i`'s moment `which`
    /// at element `start`.
    fn read(&mut self, i: usize, which: u64, start: i64, dst: &mut Tensor) -> Result<()> {
        let (at, file) = (self.at(i, which, start), self.file.as_file());
        let n = crate::ffi::optim::with_bytes_mut(dst, |b| file.read_exact_at(b, at).map(|()| b.len()))
            .map_err(|e| Error::io(self.file.path(), e))?;
        self.last.bytes_read += n as u64;
        Ok(())
    }

    /// Writes `src` (contiguous, CPU, parameter `i`'s dtype) as parameter `i`'s moment `which`
    /// from element `start`.
    fn write(&mut self, i: usize, which: u64, start: i64, src: &mut Tensor) -> Result<()> {
        let (at, file) = (self.at(i, which, start), self.file.as_file());
        let n = crate::ffi::optim::with_bytes_mut(src, |b| file.write_all_at(b, at).map(|()| b.len()))
            .map_err(|e| Error::io(self.file.path(), e))?;
        self.last.bytes_written += n as u64;
        Ok(())
    }

    /// One AdamW update of parameter `i` (`p`, its gradient `g`, its step tensor after this
    /// step), chunk by chunk through the buffer; `fresh`: its moments start at zero (its first
    /// step), so nothing is read.
    ///
    /// # Errors
    /// File errors; libtorch's refusal of the step.
    pub(crate) fn step_param(&mut self, i: usize, p: &Tensor, g: &Tensor, step_t: &Tensor, fresh: bool, c: &AdamWConfig) -> Result<()> {
        let r = self.regions[i];
        let (flat_p, flat_g) = tch::no_grad(|| (p.view([-1]), g.reshape([-1])));
        let buffer = self.buffer(r.kind);
        let mut start = 0;
        while start < r.numel {
            let len = self.buffer_size.min(r.numel - start);
            let (mut m, mut v) = (buffer.get(0).narrow(0, 0, len), buffer.get(1).narrow(0, 0, len));
            if fresh {
                let _ = (m.zero_(), v.zero_());
            } else {
                self.read(i, 0, start, &mut m)?;
                self.read(i, 1, start, &mut v)?;
            }
            // On CUDA the chunk goes to the parameter's device and back (a copy each way).
            let on_device = p.device() != Device::Cpu;
            let (dm, dv) =
                if on_device { (m.to_device(p.device()), v.to_device(p.device())) } else { (m.shallow_clone(), v.shallow_clone()) };
            let (pc, gc) = tch::no_grad(|| (flat_p.narrow(0, start, len), flat_g.narrow(0, start, len)));
            let tensors =
                crate::ffi::optim::FusedAdamW { params: &[&pc], grads: &[&gc], exp_avgs: &[&dm], exp_avg_sqs: &[&dv], steps: &[step_t] };
            crate::ffi::optim::fused_adamw(&tensors, c)
                .map_err(|msg| Error::invalid("optimizer step", "AdamW", format!("gradients libtorch's fused AdamW accepts ({msg})")))?;
            if on_device {
                m.f_copy_(&dm)?;
                v.f_copy_(&dv)?;
            }
            self.write(i, 0, start, &mut m)?;
            self.write(i, 1, start, &mut v)?;
            start += len;
        }
        Ok(())
    }

    /// Parameter `i`'s two moments, read whole (`[numel]` each, its dtype, CPU): for a state
    /// dict (not counted as a step's transfer).
    ///
    /// # Errors
    /// File errors.
    pub(crate) fn load(&self, i: usize) -> Result<(Tensor, Tensor)> {
        let r = self.regions[i];
        let file = self.file.as_file();
        let read = |which: u64| -> Result<Tensor> {
            let mut t = Tensor::zeros([r.numel], (r.kind, Device::Cpu));
            let at = self.at(i, which, 0);
            crate::ffi::optim::with_bytes_mut(&mut t, |b| file.read_exact_at(b, at)).map_err(|e| Error::io(self.file.path(), e))?;
            Ok(t)
        };
        Ok((read(0)?, read(1)?))
    }

    /// Writes parameter `i`'s two moments whole (each `numel` elements, any dtype and device):
    /// from a state dict (not counted as a step's transfer).
    ///
    /// # Errors
    /// File errors.
    pub(crate) fn store(&mut self, i: usize, m: &Tensor, v: &Tensor) -> Result<()> {
        let saved = self.last;
        let r = self.regions[i];
        for (which, t) in [(0, m), (1, v)] {
            let mut cpu = t.to_device(Device::Cpu).to_kind(r.kind).reshape([-1]).contiguous();
            self.write(i, which, 0, &mut cpu)?;
        }
        self.last = saved;
        Ok(())
    }
}
