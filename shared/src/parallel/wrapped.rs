//! The wrapped model every level trains: [`DistributedDataParallel`] or
//! [`FullyShardedDataParallel`] around a [`BasicNet`], behind one interface — forward, backward
//! (with or without gradient sync), an optimizer over what this rank owns, gradient clipping,
//! evaluation, full state dicts with the unwrapped model's keys, memory and communication
//! figures. It delegates to the strategy through [`DataParallel`].
//!
//! Level 1 builds it by hand after spelling out `setup()`; the Accelerator's `prepare` and the
//! Trainer build it from their configuration. One definition, so that the three levels run the
//! same computation.

use super::data_parallel::{clip_grad_norm, DataParallel};
use super::{DistributedDataParallel, FsdpOptions, FullyShardedDataParallel, ShardingStrategy, Strategy, WrapConfig};
use crate::dist::{Collective, ProcessGroup, ReduceOp};
use crate::eval::EvalSums;
use crate::memory::ModelStateBytes;
use crate::model::BasicNet;
use crate::optim::{AdamW, AdamWConfig};
use crate::{Error, Result};
use tch::{nn, Kind, Tensor};

/// Elements per piece of the non-finite check's f64 sums (8 MiB of f64 at a time).
pub const FINITE_CHECK_CHUNK: i64 = 1 << 20;

/// `t` flattened and split into pieces of [`FINITE_CHECK_CHUNK`] elements (views): what an f64
/// reduction over a large f32 tensor casts one at a time (libtorch's `sum(dtype=float64)`
/// casts its whole input first).
pub(crate) fn f64_pieces(t: &Tensor) -> Vec<Tensor> {
    t.reshape([-1]).split(FINITE_CHECK_CHUNK, 0)
}

/// True when every element of every defined tensor of `tensors` is finite: the f64 sums of
/// their [`FINITE_CHECK_CHUNK`]-element pieces, added up, are finite.
fn all_finite(tensors: &[Tensor]) -> bool {
    tch::no_grad(|| {
        let sums: Vec<Tensor> = tensors
            .iter()
            .filter(|g| g.defined() && g.numel() > 0)
            .flat_map(f64_pieces)
            .map(|piece| piece.sum(tch::Kind::Double))
            .collect();
        sums.is_empty() || Tensor::stack(&sums, 0).sum(tch::Kind::Double).double_value(&[]).is_finite()
    })
}

/// Test-only: `LADDER_TEST_NONFINITE=loss@STEP` (or `gradient@STEP`) makes
/// [`WrappedModel::check_finite`] on this process take its loss (or its gradients) as NaN at
/// training step `STEP` — so that tests can make one rank alone see a non-finite value (set it
/// for one rank, e.g. through mpirun's `-x` in MPMD form). Not for training runs.
pub const TEST_NONFINITE_VAR: &str = "LADDER_TEST_NONFINITE";

/// `(loss, gradient)`: whether [`TEST_NONFINITE_VAR`] injects a non-finite value at `step`.
fn test_nonfinite_at(step: u64) -> (bool, bool) {
    static PARSED: std::sync::OnceLock<Option<(bool, u64)>> = std::sync::OnceLock::new();
    let parsed = PARSED.get_or_init(|| {
        let v = std::env::var(TEST_NONFINITE_VAR).ok()?;
        let (what, at) = v.split_once('@')?;
        let is_loss = match what {
            "loss" => true,
            "gradient" => false,
            _ => return None,
        };
        Some((is_loss, at.trim().parse().ok()?))
    });
    match *parsed {
        Some((is_loss, at)) if at == step => (is_loss, !is_loss),
        _ => (false, false),
    }
}

/// DDP or FSDP around a [`BasicNet`]: one interface for every level's loop.
pub struct WrappedModel<'pg> {
    inner: Box<dyn DataParallel + 'pg>,
    pg: &'pg dyn ProcessGroup,
    /// The DDP model's VarStore, which owns its parameters (FSDP owns its own).
    _vs: Option<nn::VarStore>,
    /// The engine is FSDP (a DDP strategy with mixed precision runs on FSDP's NO_SHARD path).
    fsdp: bool,
    /// Outputs are cast to fp32 (mixed precision).
    fp32_outputs: bool,
    config: WrapConfig,
}

impl std::fmt::Debug for WrappedModel<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WrappedModel").field("config", &self.config).field("fsdp", &self.fsdp).finish()
    }
}

impl<'pg> WrappedModel<'pg> {
    /// Wraps `net` (built in `vs`, on the group's device) as `cfg` says. Collective: every rank
    /// calls it. DDP broadcasts rank 0's weights; FSDP broadcasts them and keeps this rank's
    /// shards. DDP with mixed precision runs on FSDP's `NO_SHARD` path (see
    /// [`WrapConfig::mixed_precision`]). bf16 on a CPU without bf16 units prints, on rank 0
    /// and once per process, that it runs several times slower than fp32 there
    /// ([`warn_bf16_on_cpu`](crate::device::warn_bf16_on_cpu)).
    ///
    /// # Errors
    /// A non-positive `bucket_cap_mb`; [`Error::OptionNotForStrategy`] for ZeRO-1 with mixed
    /// precision; FSDP layout errors; collective errors.
    pub fn new(vs: nn::VarStore, net: BasicNet, pg: &'pg dyn ProcessGroup, cfg: &WrapConfig) -> Result<Self> {
        let policy = cfg.mixed_precision.policy();
        cfg.validate()?;
        if cfg.mixed_precision == crate::parallel::Precision::Bf16 && pg.device() == tch::Device::Cpu && pg.rank() == 0 {
            crate::device::warn_bf16_on_cpu(); // once, at start-up, where bf16 is emulated
        }
        let fsdp_options = match (cfg.strategy, policy) {
            (Strategy::Fsdp(o), _) => Some(o),
            (Strategy::Ddp(_), Some(_)) => Some(FsdpOptions::with_sharding(ShardingStrategy::NoShard)),
            (Strategy::Ddp(_), None) => None,
        };
        let (inner, vs): (Box<dyn DataParallel + 'pg>, _) = match (cfg.strategy, fsdp_options) {
            (_, Some(o)) => {
                let fsdp = FullyShardedDataParallel::new(vs, net, pg, o)?.with_mixed_precision(policy);
                (Box::new(fsdp.with_activation_checkpointing(cfg.activation_checkpointing)), None)
            }
            (Strategy::Ddp(o), None) => {
                let ddp = DistributedDataParallel::new(net, pg, o)?.with_activation_checkpointing(cfg.activation_checkpointing);
                (Box::new(ddp), Some(vs))
            }
            (Strategy::Fsdp(_), None) => unreachable!("an FSDP strategy has FSDP options"),
        };
        Ok(Self { inner, pg, _vs: vs, fsdp: fsdp_options.is_some(), fp32_outputs: policy.is_some(), config: *cfg })
    }

    /// The strategy it was wrapped with, with its options.
    pub fn strategy(&self) -> Strategy {
        self.config.strategy
    }

    /// The configuration it was wrapped with.
    pub fn config(&self) -> &WrapConfig {
        &self.config
    }

    /// The names of the tensors the optimizer updates, in its order: the parameters'
    /// (`conv1.weight`, …) for DDP, the FlatParameters' (`fc1._flat_param`, …) for FSDP.
    pub fn optimizer_param_names(&self) -> Vec<String> {
        self.inner.optimizer_params().into_iter().map(|(n, _)| n).collect()
    }

    /// The gradients of what the optimizer updates (undefined where none).
    fn optimizer_grads(&self) -> Vec<Tensor> {
        self.inner.optimizer_params().iter().map(|(_, t)| t.grad()).collect()
    }

    /// AdamW over what this rank owns: every parameter (DDP) or this rank's shards (FSDP, whose
    /// moments are then 1/W of the model per rank).
    ///
    /// # Errors
    /// An out-of-range hyper-parameter.
    // ANCHOR: wrapped_optimizer
    pub fn optimizer(&self, cfg: AdamWConfig) -> Result<AdamW> {
        AdamW::new(self.inner.optimizer_params().into_iter().map(|(_, t)| t).collect(), cfg)
    }
    // ANCHOR_END: wrapped_optimizer

    /// [`optimizer`](Self::optimizer) with its moments where `offload` says: with
    /// [`OptimizerOffload::Nvme`](super::OptimizerOffload::Nvme), in this rank's file under
    /// `nvme_path` (DeepSpeed's `offload_optimizer: {"device": "nvme"}`) — what this rank
    /// steps: every parameter (DDP), its ZeRO-1 pieces, or its FSDP shards. See
    /// [`AdamW::with_offload`].
    ///
    /// # Errors
    /// An out-of-range hyper-parameter; [`crate::Error::Io`] when the file cannot be created.
    pub fn optimizer_with_offload(&self, cfg: AdamWConfig, offload: &super::OptimizerOffload) -> Result<AdamW> {
        let params = self.inner.optimizer_params().into_iter().map(|(_, t)| t).collect();
        AdamW::with_offload(params, cfg, offload, self.pg.rank())
    }

    /// The wrapped model's forward pass: images `[b, 1, 28, 28]` f32 → log-probabilities `[b, 10]`
    /// (f32 also under mixed precision).
    ///
    /// In eval mode (`train` false) a batch of more than [`EVAL_PIECE`](crate::eval::EVAL_PIECE)
    /// images runs in pieces of that many, their outputs concatenated: the same
    /// log-probabilities per image, an eighth of the activations at the tutorial's test batch
    /// of 1,000 (see [`EVAL_PIECE`](crate::eval::EVAL_PIECE)).
    ///
    /// # Errors
    /// FSDP's gather errors.
    pub fn forward_t(&mut self, xs: &Tensor, train: bool) -> Result<Tensor> {
        if train {
            self.forward_whole(xs, true)
        } else {
            crate::eval::forward_in_pieces(xs, |piece| self.forward_whole(piece, false))
        }
    }

    /// [`forward_t`](Self::forward_t) of the whole batch at once.
    fn forward_whole(&mut self, xs: &Tensor, train: bool) -> Result<Tensor> {
        let out = self.inner.forward(xs, train)?;
        Ok(if self.fp32_outputs { out.to_kind(Kind::Float) } else { out })
    }

    /// `loss.backward()`, then the gradient sync unless it is switched off
    /// ([`set_require_backward_grad_sync`](Self::set_require_backward_grad_sync)).
    ///
    /// # Errors
    /// Collective errors.
    pub fn backward(&mut self, loss: &Tensor) -> Result<()> {
        self.inner.backward(loss)
    }

    /// Turns the gradient sync of the next backwards on or off (DDP's
    /// `require_backward_grad_sync`, what `no_sync` toggles): off, gradients accumulate locally;
    /// the first backward with it on syncs the accumulated sum.
    pub fn set_require_backward_grad_sync(&mut self, sync: bool) {
        self.inner.set_require_backward_grad_sync(sync)
    }

    /// Clips the gradients by their global L2 norm (`clip_grad_norm_`): every gradient is
    /// scaled by `min(1, max_norm / (total_norm + 1e-6))`. Returns the total norm before
    /// clipping. Call it after the gradient sync.
    ///
    /// # Errors
    /// A `max_norm` that is not positive and finite; collective errors (sharded FSDP).
    pub fn clip_grad_norm(&self, max_norm: f64) -> Result<f64> {
        let sharded_over = self.inner.grads_are_sharded().then(|| self.inner.shard_group().unwrap_or(self.pg));
        clip_grad_norm(&self.optimizer_grads(), max_norm, sharded_over)
    }

    /// Copies of the gradients of what the optimizer updates, in its order (undefined tensors
    /// where none exists yet).
    pub fn gradients(&self) -> Vec<Tensor> {
        let grads = self.optimizer_grads();
        grads.into_iter().map(|g| if g.defined() { g.copy() } else { g }).collect()
    }

    /// Multiplies every gradient this rank holds by `factor` (a GradScaler's unscale).
    ///
    /// # Errors
    /// libtorch errors.
    pub fn scale_grads(&self, factor: f64) -> Result<()> {
        let grads = self.optimizer_grads();
        tch::no_grad(|| {
            for mut g in grads.into_iter().filter(|g| g.defined()) {
                let _ = g.f_mul_scalar_(factor)?;
            }
            Ok(())
        })
    }

    /// True when every gradient this rank holds is finite (no inf/NaN), checked on every rank
    /// alike after a Max all-reduce — what GradScaler's `found_inf` computes.
    ///
    /// # Errors
    /// Collective errors.
    pub fn grads_finite(&self) -> Result<bool> {
        let pg = self.pg;
        let bad = !self.local_grads_finite();
        let mut flag = Tensor::from_slice(&[f64::from(u8::from(bad))]).to_device(pg.device());
        pg.all_reduce(&mut flag, ReduceOp::Max)?;
        Ok(flag.double_value(&[0]) == 0.0)
    }

    /// Stops a diverging run: the one check of every level (level 1's loop, the Accelerator's
    /// optimizer step, hence the Trainer). Call it after a backward that synchronised the
    /// gradients, before the optimizer step, with this rank's loss value of the step (already
    /// read for logging) and `step` (1-based).
    ///
    /// Cheap: the loss is a value already computed; the gradients (see
    /// [`check_finite_loss`](Self::check_finite_loss) for fp16 loss scaling) are summed in f64, one pass and one read. At world size W > 1 the ranks then agree, with
    /// one 8-byte Min all-reduce per step, on the first rank that saw a non-finite value
    /// (encoded `rank` for a loss, `W + rank` for a gradient, `2W` for none): a rank's local
    /// view may differ from its peers' — an FSDP gradient shard, or an infinite loss whose
    /// gradients are finite — and without agreement only that rank would stop, the others
    /// ending through its error instead of their own. So every rank returns the same
    /// [`Error::NonFinite`], naming the first rank (a non-finite loss wins over a gradient, as
    /// the loss is where it came from) and the step; a loss's value is broadcast from that rank
    /// (the rare path's second collective). Measured on `mpirun -n 2` level 1, FSDP, 200 steps,
    /// 2 CPU cores: the all-reduce itself 3–4 µs per step (back to back, ranks in step), and
    /// 0.1–0.4 ms per step including the wait for the slower rank, which without it is spent
    /// at the step's next collective; throughput with and without it within noise (±2 %).
    ///
    /// Test-only: [`TEST_NONFINITE_VAR`] makes this rank see a non-finite value at one step.
    ///
    /// # Errors
    /// [`Error::NonFinite`] naming the step, the rank and the value; collective errors.
    pub fn check_finite(&self, step: u64, loss: f64) -> Result<()> {
        self.check_finite_of(step, loss, true)
    }

    /// [`check_finite`](Self::check_finite) of the loss alone, for fp16 loss scaling: there an
    /// infinite gradient is the scaler's business (it skips the step and lowers the scale).
    ///
    /// # Errors
    /// [`Error::NonFinite`] naming the step, the rank and the loss; collective errors.
    pub fn check_finite_loss(&self, step: u64, loss: f64) -> Result<()> {
        self.check_finite_of(step, loss, false)
    }

    fn check_finite_of(&self, step: u64, loss: f64, check_grads: bool) -> Result<()> {
        let pg = self.pg;
        let (inject_loss, inject_grad) = test_nonfinite_at(step);
        let loss = if inject_loss { f64::NAN } else { loss };
        let loss_bad = !loss.is_finite();
        let grads_bad = check_grads && (inject_grad || !self.local_grads_finite());
        let fmt = |v: f64| if v.is_nan() { "NaN".to_string() } else { format!("{v}") };
        let (rank, w) = (pg.rank(), pg.world_size());
        let first = if w == 1 {
            if loss_bad {
                0
            } else if grads_bad {
                1
            } else {
                2
            }
        } else {
            let code = if loss_bad {
                rank
            } else if grads_bad {
                w + rank
            } else {
                2 * w
            };
            let mut first = Tensor::from_slice(&[code as f64]).to_device(pg.device());
            // The same 1-element f64 on every rank at every step: no agreement probe needed.
            pg.run(Collective::all_reduce(&mut first, ReduceOp::Min).prechecked())?;
            first.double_value(&[0]) as usize
        };
        if first >= 2 * w {
            return Ok(());
        }
        if first < w {
            let value = if w == 1 {
                loss
            } else {
                let mut v = Tensor::from_slice(&[loss]).to_device(pg.device());
                pg.broadcast(&mut v, first)?;
                v.double_value(&[0])
            };
            return Err(Error::NonFinite { what: "loss", value: fmt(value), step, rank: first, others: String::new() });
        }
        let others = match (self.fsdp, w) {
            (_, 1) => String::new(),
            (false, _) => " and so on every rank after the gradient all-reduce (the loss was finite on every rank)".to_string(),
            (true, _) => " (its gradient, or its shard of the reduced gradients; the loss was finite on every rank)".to_string(),
        };
        Err(Error::NonFinite { what: "gradient", value: "NaN or infinite".into(), step, rank: first - w, others })
    }

    /// True when every gradient this rank holds is finite: their sums in f64, added up, are
    /// finite (one pass over the gradients, one read; no collective). No finite f32/bf16/f16
    /// values can overflow an f64 sum, so the answer is exact. Each gradient is summed in
    /// pieces of [`FINITE_CHECK_CHUNK`] elements: libtorch's `sum(dtype=float64)` casts its
    /// whole input first, which for fc1 at width 8192 was a 577 MiB transient copy.
    fn local_grads_finite(&self) -> bool {
        all_finite(&self.optimizer_grads())
    }

    /// The bucket (DDP) or FlatParameter (FSDP) layout as a table.
    pub fn explain(&self) -> String {
        self.inner.explain()
    }

    /// Checks every rank holds the same parameters (DDP, FSDP NO_SHARD) or the same shard
    /// layout (sharded FSDP).
    ///
    /// # Errors
    /// [`Error::CollectiveMismatch`] naming what differs.
    pub fn check_parameters_in_sync(&self) -> Result<()> {
        self.inner.check_parameters_in_sync()
    }

    /// Seconds this rank spent inside collectives since wrapping.
    pub fn comm_seconds(&self) -> f64 {
        self.inner.comm().seconds
    }

    /// Cumulative communication since wrapping: collective seconds and payload bytes (what
    /// [`crate::timing::StepTimer`] takes per lap).
    pub fn comm(&self) -> crate::timing::Comm {
        self.inner.comm()
    }

    /// FSDP's CPU offload (`offload_params`): what it copied since wrapping (see
    /// [`CpuOffloadStats`](super::fsdp::CpuOffloadStats) for the closed forms); `None` without
    /// it.
    pub fn cpu_offload(&self) -> Option<super::fsdp::CpuOffloadStats> {
        self.inner.cpu_offload().map(|(s, _)| s)
    }

    /// With FSDP's CPU offload, the report's `cpu_offload` entry (`offload_params`, `pinned`,
    /// `host_bytes` — this rank's shards, gradients and moments in host memory — and the
    /// `per_step` and `total` bytes each way, this process's) and a line for the output; `None`
    /// without it. Every level adds both to its report.
    pub fn cpu_offload_report(&self) -> Option<(serde_json::Value, String)> {
        let (stats, pinned) = self.inner.cpu_offload()?;
        Some((stats.report_entry(pinned, &self.memory()), stats.summary()))
    }

    /// Bytes of model state this rank holds (AdamW: two state tensors per parameter element).
    // ANCHOR: wrapped_memory
    pub fn memory(&self) -> ModelStateBytes {
        self.inner.memory()
    }
    // ANCHOR_END: wrapped_memory

    /// Exact distributed evaluation over `test` (see [`crate::eval::evaluate_distributed`]):
    /// every image counted once at any world size, on the strategy's own outputs (the compute
    /// dtype). Collective.
    ///
    /// # Errors
    /// Collective errors.
    pub fn evaluate(&mut self, test: &crate::data::Dataset, batch_size: usize) -> Result<EvalSums> {
        let inner = &mut self.inner;
        crate::eval::evaluate_distributed_with(self.pg, |x| inner.forward(x, false), test, batch_size)
    }

    /// The unwrapped model's weights on rank 0 (`conv1.weight`, …, definition order, shapes of
    /// BasicNet, the parameters' dtype; FSDP gathers them), `None` on other ranks. Collective.
    /// Under DDP and NO_SHARD the tensors are the parameters themselves, detached (torch's
    /// `state_dict()`): copy them to keep a snapshot across steps.
    ///
    /// # Errors
    /// Collective errors.
    pub fn full_state_dict(&self) -> Result<Option<Vec<(String, Tensor)>>> {
        self.inner.full_state_dict()
    }

    /// Loads the unwrapped model's weights (every rank passes the same dict). No communication.
    ///
    /// # Errors
    /// [`Error::StateDict`] naming every missing and unexpected key, or a shape that differs.
    pub fn load_full_state_dict(&mut self, state_dict: &[(String, Tensor)]) -> Result<()> {
        self.inner.load_full_state_dict(state_dict)
    }

    /// The optimizer's state with the unwrapped model's keys, on rank 0 (`None` elsewhere):
    /// `conv1.weight.exp_avg`, `conv1.weight.exp_avg_sq` (the parameter's shape) and
    /// `conv1.weight.step` (0-d i64) per parameter — the same at any world size and strategy
    /// (FSDP gathers and unflattens its shards' moments, as `FULL_OPTIM_STATE_DICT`).
    /// Collective. Under DDP and NO_SHARD the moments are the optimizer's own (torch's
    /// `Optimizer.state_dict()`): copy them to keep a snapshot across steps.
    ///
    /// # Errors
    /// Collective errors.
    pub fn optimizer_state_dict(&self, opt: &AdamW) -> Result<Option<Vec<(String, Tensor)>>> {
        self.inner.optim_state_dict(opt)
    }

    /// Loads what [`optimizer_state_dict`](Self::optimizer_state_dict) returned (every rank
    /// passes the same dict; FSDP keeps its shard of each moment). No communication.
    ///
    /// # Errors
    /// [`Error::StateDict`] naming unexpected keys or shapes.
    pub fn load_optimizer_state_dict(&self, opt: &mut AdamW, state_dict: &[(String, Tensor)]) -> Result<()> {
        self.inner.load_optim_state_dict(opt, state_dict)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_finite_check_reads_every_piece_and_never_overflows() {
        let n = 3 * FINITE_CHECK_CHUNK + 7;
        let big = Tensor::full([n], f64::from(f32::MAX), (Kind::Float, tch::Device::Cpu));
        assert!(all_finite(&[big.shallow_clone(), Tensor::new()]), "finite values as large as f32 allows");
        for (at, bad) in [(n - 1, f64::NAN), (FINITE_CHECK_CHUNK + 1, f64::INFINITY), (0, f64::NEG_INFINITY)] {
            let t = big.copy();
            let _ = t.get(at).fill_(bad);
            assert!(!all_finite(&[Tensor::zeros([4], (Kind::Float, tch::Device::Cpu)), t]), "{bad} at {at} of {n}");
        }
        let half = Tensor::ones([FINITE_CHECK_CHUNK + 3], (Kind::BFloat16, tch::Device::Cpu));
        let _ = half.get(FINITE_CHECK_CHUNK + 2).fill_(f64::NAN);
        assert!(!all_finite(&[half]), "bf16");
        assert!(all_finite(&[]));
    }
}
