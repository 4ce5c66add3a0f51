//! FSDP's CPU offload of the parameters — PyTorch's `CPUOffload(offload_params=True)`
//! (Accelerate's `fsdp_offload_params`, Transformers' `fsdp="full_shard offload"`).
//!
//! Where each piece of model state lives, with it on:
//!
//! | state | where |
//! |---|---|
//! | the parameter shards (fp32 masters), their gradients, AdamW's moments | host memory (pinned when the compute device is CUDA) |
//! | a unit's gathered parameters, the unsharded gradient of backward | the compute device, while the unit computes |
//!
//! and what moves, as PyTorch's `FlatParamHandle` does it: before each all-gather (forward's,
//! full-shard's second one in backward, a prefetch) the unit's shard is copied to the compute
//! device in its own dtype and cast there to the compute dtype (`_mp_shard.copy_(
//! _local_shard.to(device))`); after a unit's gradient is reduced (reduce-scatter, HSDP's
//! all-reduce across replicas, `NO_SHARD`'s all-reduce) and cast to the shard's dtype, it is
//! copied to the host (`_cpu_grad.copy_(grad)`), where it accumulates into the shard's
//! gradient. The optimizer steps the host shards: its state never reaches the device.
//!
//! On `--device cpu` host and device are one memory, yet the copies are made all the same
//! (real host-to-host copies, [`CpuOffload::copy_to_device`] and [`CpuOffload::copy_to_host`]), so that
//! the code path runs and is counted: its results must be bit-identical to the run without,
//! and its bytes match closed forms ([`CpuOffloadStats`]). What it saves is GPU memory, which
//! only a GPU run can measure.

use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use tch::{Device, Tensor};

/// What the offload copied since the wrapper was built, bytes and copies by direction.
///
/// Closed forms per optimizer step at `k` micro-batches per step (`k` = 1 without
/// accumulation), with `S` the bytes of this rank's shards in their own dtype (`Σ shard_numel ×
/// 4` for fp32 masters; bf16 compute copies fp32 and casts on the device, as PyTorch):
/// `h2d_bytes` = `k · g · S`, where `g` is the all-gathers of one forward and backward — 2 for
/// `FULL_SHARD` and `HYBRID_SHARD` (forward, and again in backward), 1 for `SHARD_GRAD_OP`,
/// `_HYBRID_SHARD_ZERO2` and `NO_SHARD` (whose "gather" is the copy of the whole parameter);
/// `d2h_bytes` = `S` (the reduced gradient shard; `NO_SHARD`: the whole gradient).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CpuOffloadStats {
    /// Bytes copied host → compute device for training (grad-mode forwards and backwards).
    pub h2d_bytes: u64,
    /// Host → device copies for training (one per unit per gather).
    pub h2d_copies: u64,
    /// Bytes copied compute device → host: the reduced gradient shards.
    pub d2h_bytes: u64,
    /// Device → host copies (one per unit per gradient reduction).
    pub d2h_copies: u64,
    /// Backwards that reduced the gradients: the optimizer steps (a backward under `no_sync`
    /// reduces nothing and copies nothing back).
    pub steps: u64,
    /// Bytes copied host → device for evaluation (forwards without grad), apart from training.
    pub eval_h2d_bytes: u64,
}

/// One optimizer step's mean transfers, for reports: [`CpuOffloadStats`] divided by its steps.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CpuOffloadPerStep {
    /// Bytes host → device per step (training).
    pub h2d_bytes: u64,
    /// Bytes device → host per step.
    pub d2h_bytes: u64,
}

impl CpuOffloadStats {
    /// The mean per optimizer step (0 before the first step; exact when every step ran the
    /// same micro-batches, as the closed forms assume).
    pub fn per_step(&self) -> CpuOffloadPerStep {
        let per = |b: u64| b.checked_div(self.steps).unwrap_or(0);
        CpuOffloadPerStep { h2d_bytes: per(self.h2d_bytes), d2h_bytes: per(self.d2h_bytes) }
    }

    /// One line for the levels' output: `cpu_offload (offload_params): per step 144.0 MiB
    /// host→device, 72.0 MiB device→host (rank 0)`.
    pub fn summary(&self) -> String {
        let p = self.per_step();
        format!(
            "cpu_offload (offload_params): per step {:.1} MiB host→device, {:.1} MiB device→host (rank 0)",
            crate::memory::mib(p.h2d_bytes),
            crate::memory::mib(p.d2h_bytes)
        )
    }

    /// The report's `cpu_offload` entry: `offload_params`, `pinned`, the bytes of model state
    /// in host memory (`host_bytes`: parameter shards, gradients and AdamW's moments, from
    /// `model_state`), `per_step` and `total` (this process's).
    pub fn report_entry(&self, pinned: bool, model_state: &crate::memory::ModelStateBytes) -> serde_json::Value {
        serde_json::json!({
            "offload_params": true,
            "pinned": pinned,
            "host_bytes": model_state.parameters + model_state.gradients + model_state.optimizer,
            "per_step": self.per_step(),
            "total": self,
        })
    }
}

/// The offload of one FSDP wrapper: where the shards live, the copies to and from the compute
/// device, and their counts.
#[derive(Debug)]
pub(super) struct CpuOffload {
    /// The compute device (the process group's).
    compute: Device,
    /// Pinned host memory (CUDA compute device).
    pinned: bool,
    /// Copies now are for evaluation (a forward without grad), counted apart.
    eval: bool,
    stats: CpuOffloadStats,
    rank: usize,
}

impl CpuOffload {
    /// The offload for a wrapper computing on `compute`, rank `rank` (for errors).
    pub(super) fn new(compute: Device, rank: usize) -> Self {
        Self { compute, pinned: compute.is_cuda(), eval: false, stats: CpuOffloadStats::default(), rank }
    }

    /// Whether the host memory is pinned (the compute device is CUDA).
    pub(super) fn pinned(&self) -> bool {
        self.pinned
    }

    /// The copies made since construction.
    pub(super) fn stats(&self) -> CpuOffloadStats {
        self.stats
    }

    /// Counts the copies that follow as evaluation's (`true`: a forward without grad) or
    /// training's.
    pub(super) fn set_eval(&mut self, eval: bool) {
        self.eval = eval;
    }

    /// A backward reduced the gradients: one optimizer step's copies are complete.
    pub(super) fn step_done(&mut self) {
        self.stats.steps += 1;
    }

    /// A new tensor in host memory holding `t` (pinned under CUDA): where a shard lives. Not
    /// counted (the wrapper's construction, a state dict's load).
    ///
    /// # Errors
    /// [`Error::Fsdp`] when libtorch cannot allocate or copy it.
    pub(super) fn home(&self, t: &Tensor) -> Result<Tensor> {
        let host = t.f_to_device_(Device::Cpu, t.kind(), false, true).map_err(|e| self.failed("onto the host", &e))?;
        if self.pinned {
            host.f_pin_memory(self.compute).map_err(|e| self.failed("into pinned host memory", &e))
        } else {
            Ok(host)
        }
    }

    /// A copy of host shard `shard` on the compute device, in the shard's dtype — a real copy
    /// also when both are the CPU — counted host → device.
    ///
    /// # Errors
    /// [`Error::Fsdp`] when libtorch cannot allocate or copy it.
    pub(super) fn copy_to_device(&mut self, shard: &Tensor) -> Result<Tensor> {
        // Blocking: the collective that reads it may run on another CUDA stream (PyTorch copies
        // non-blocking and orders its streams; untested here without a GPU, so kept simple).
        let on_device = shard.f_to_device_(self.compute, shard.kind(), false, true).map_err(|e| self.failed("to the device", &e))?;
        let bytes = (shard.numel() * shard.kind().elt_size_in_bytes()) as u64;
        if self.eval {
            self.stats.eval_h2d_bytes += bytes;
        } else {
            self.stats.h2d_bytes += bytes;
            self.stats.h2d_copies += 1;
        }
        Ok(on_device)
    }

    /// A copy of the reduced gradient shard `grad` in host memory (pinned under CUDA), counted
    /// device → host.
    ///
    /// # Errors
    /// [`Error::Fsdp`] when libtorch cannot allocate or copy it.
    pub(super) fn copy_to_host(&mut self, grad: &Tensor) -> Result<Tensor> {
        let host = self.home(grad)?;
        self.stats.d2h_bytes += (grad.numel() * grad.kind().elt_size_in_bytes()) as u64;
        self.stats.d2h_copies += 1;
        Ok(host)
    }

    fn failed(&self, what: &str, e: &tch::TchError) -> Error {
        Error::Fsdp { rank: self.rank, problem: format!("CPU offload (offload_params): copying a shard {what} failed: {e}") }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Kind;

    #[test]
    fn copies_are_real_on_the_cpu_and_counted_by_direction() {
        let mut o = CpuOffload::new(Device::Cpu, 0);
        let shard = Tensor::from_slice(&[1f32, 2., 3.]);
        let home = o.home(&shard).unwrap();
        assert_ne!(home.data_ptr(), shard.data_ptr(), "a copy, not the same memory");
        let dev = o.copy_to_device(&home).unwrap();
        assert_ne!(dev.data_ptr(), home.data_ptr(), "host to host, still a copy");
        assert!(dev.equal(&shard));
        o.set_eval(true);
        let _ = o.copy_to_device(&home).unwrap();
        o.set_eval(false);
        let g = Tensor::from_slice(&[0.5f64, 0.25]);
        let back = o.copy_to_host(&g).unwrap();
        assert!(back.equal(&g) && back.kind() == Kind::Double);
        o.step_done();
        let s = o.stats();
        assert_eq!((s.h2d_bytes, s.h2d_copies, s.eval_h2d_bytes, s.d2h_bytes, s.d2h_copies, s.steps), (12, 1, 12, 16, 1, 1));
        assert_eq!(s.per_step(), CpuOffloadPerStep { h2d_bytes: 12, d2h_bytes: 16 });
        assert_eq!(CpuOffloadStats::default().per_step(), CpuOffloadPerStep::default());
        assert!(!o.pinned());
    }
}
