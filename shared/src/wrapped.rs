//! The wrapped model every level trains: [`DistributedDataParallel`] or
//! [`FullyShardedDataParallel`] around a [`BasicNet`], behind one interface — forward, backward
//! (with or without gradient sync), an optimizer over what this rank owns, gradient clipping,
//! evaluation, full state dicts with the unwrapped model's keys, memory and communication
//! figures.
//!
//! Level 1 builds it by hand after spelling out `setup()`; the Accelerator's `prepare` and the
//! Trainer build it from their configuration. One definition, so that the three levels run the
//! same computation.

use crate::ddp::{DdpConfig, DistributedDataParallel};
use crate::dist::{ProcessGroup, ReduceOp};
use crate::fsdp::{BackwardPrefetch, FsdpConfig, FullyShardedDataParallel, MixedPrecision, ShardingStrategy};
use crate::memory::ModelStateBytes;
use crate::model::BasicNet;
use crate::optim::{AdamW, AdamWConfig};
use crate::train::EvalSums;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use tch::{nn, Kind, Tensor};

/// How the model is replicated across ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Strategy {
    /// DistributedDataParallel: a full replica per rank, gradients all-reduced in buckets.
    #[default]
    Ddp,
    /// FSDP FULL_SHARD (ZeRO-3): parameters, gradients and optimizer state sharded; parameters
    /// gathered for forward, freed, gathered again for backward.
    FsdpFullShard,
    /// FSDP SHARD_GRAD_OP (ZeRO-2): gathered parameters kept from forward to backward.
    FsdpShardGradOp,
    /// FSDP NO_SHARD: full replicas, gradients all-reduced (DDP's behaviour, FSDP's code path).
    FsdpNoShard,
}

impl Strategy {
    /// The name used in reports (`ddp`, `fsdp-full-shard`, …).
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Ddp => "ddp",
            Strategy::FsdpFullShard => "fsdp-full-shard",
            Strategy::FsdpShardGradOp => "fsdp-shard-grad-op",
            Strategy::FsdpNoShard => "fsdp-no-shard",
        }
    }

    /// The FSDP sharding strategy, or `None` for DDP.
    pub fn sharding(self) -> Option<ShardingStrategy> {
        match self {
            Strategy::Ddp => None,
            Strategy::FsdpFullShard => Some(ShardingStrategy::FullShard),
            Strategy::FsdpShardGradOp => Some(ShardingStrategy::ShardGradOp),
            Strategy::FsdpNoShard => Some(ShardingStrategy::NoShard),
        }
    }
}

/// A flag that does nothing under the chosen strategy is an error naming the strategies it
/// belongs to (rather than being ignored without a word): `--bucket-cap-mb` is DDP's,
/// `--fsdp-min-num-params` and the other `--fsdp-*` flags FSDP's. `source` says where the
/// strategy came from (`--strategy`, `the resolved strategy`); `fsdp_flag` names the first
/// FSDP-only flag the user gave, if any.
///
/// # Errors
/// [`Error::InvalidValue`] naming the flag.
pub fn check_strategy_flags(strategy: Strategy, source: &str, bucket_cap_mb: bool, fsdp_flag: Option<&str>) -> Result<()> {
    if bucket_cap_mb && strategy != Strategy::Ddp {
        return Err(Error::invalid(
            "--bucket-cap-mb",
            format!("given with {source} {}", strategy.name()),
            "--strategy ddp (gradient buckets are DDP's; FSDP reduces one FlatParameter per unit)",
        ));
    }
    if let Some(flag) = fsdp_flag.filter(|_| strategy == Strategy::Ddp) {
        return Err(Error::invalid(
            flag,
            format!("given with {source} ddp"),
            "an FSDP strategy (fsdp-full-shard, fsdp-shard-grad-op, fsdp-no-shard): the flag configures FSDP",
        ));
    }
    Ok(())
}

/// How to wrap the model.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct WrapConfig {
    /// DDP or one of FSDP's sharding strategies.
    pub strategy: Strategy,
    /// DDP gradient bucket cap in MiB (PyTorch's `bucket_cap_mb`, 25).
    pub bucket_cap_mb: f64,
    /// FSDP size-based auto-wrap threshold (PyTorch's `min_num_params`, 1e8: one unit).
    pub fsdp_min_num_params: usize,
    /// Mixed precision: compute (forward, backward) in `param_dtype`, gradients reduced in
    /// `reduce_dtype`, fp32 master weights and optimizer state; outputs are returned in fp32
    /// (as Accelerate's autocast does). FSDP applies it itself; DDP with mixed precision runs on
    /// FSDP's `NO_SHARD` code path, which keeps the fp32 masters and the low-precision compute
    /// copy (full replicas and one all-reduce per step, as DDP). `None`: the model's dtype.
    pub mixed_precision: Option<MixedPrecision>,
    /// FSDP's `backward_prefetch` (PyTorch's default `BACKWARD_PRE`; `None`: no prefetch).
    #[serde(default = "default_backward_prefetch")]
    pub fsdp_backward_prefetch: Option<BackwardPrefetch>,
    /// FSDP's `forward_prefetch` (default false, PyTorch's).
    #[serde(default)]
    pub fsdp_forward_prefetch: bool,
}

fn default_backward_prefetch() -> Option<BackwardPrefetch> {
    FsdpConfig::default().backward_prefetch
}

impl Default for WrapConfig {
    fn default() -> Self {
        Self {
            strategy: Strategy::Ddp,
            bucket_cap_mb: 25.0,
            fsdp_min_num_params: 100_000_000,
            mixed_precision: None,
            fsdp_backward_prefetch: default_backward_prefetch(),
            fsdp_forward_prefetch: false,
        }
    }
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
    inner: Inner<'pg>,
    /// Outputs are cast to fp32 (mixed precision).
    fp32_outputs: bool,
    strategy: Strategy,
}

enum Inner<'pg> {
    /// DistributedDataParallel; `_vs` owns the replica's parameters.
    Ddp { model: DistributedDataParallel<'pg, BasicNet>, _vs: nn::VarStore },
    /// FullyShardedDataParallel (it owns the model's VarStore).
    Fsdp(FullyShardedDataParallel<'pg, BasicNet>),
}

impl std::fmt::Debug for WrappedModel<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.inner {
            Inner::Ddp { model, .. } => model.fmt(f),
            Inner::Fsdp(m) => m.fmt(f),
        }
    }
}

impl<'pg> WrappedModel<'pg> {
    /// Wraps `net` (built in `vs`, on the group's device) as `cfg` says. Collective: every rank
    /// calls it. DDP broadcasts rank 0's weights; FSDP broadcasts them and keeps this rank's
    /// shards.
    ///
    /// # Errors
    /// A non-positive `bucket_cap_mb`; FSDP layout errors; collective errors.
    pub fn new(vs: nn::VarStore, net: BasicNet, pg: &'pg dyn ProcessGroup, cfg: &WrapConfig) -> Result<Self> {
        let sharding = match (cfg.strategy.sharding(), cfg.mixed_precision) {
            (None, Some(_)) => Some(ShardingStrategy::NoShard),
            (s, _) => s,
        };
        let inner = match sharding {
            None => Inner::Ddp { model: DistributedDataParallel::new(net, pg, DdpConfig { bucket_cap_mb: cfg.bucket_cap_mb })?, _vs: vs },
            Some(sharding_strategy) => Inner::Fsdp(FullyShardedDataParallel::new(
                vs,
                net,
                pg,
                FsdpConfig {
                    sharding_strategy,
                    min_num_params: cfg.fsdp_min_num_params,
                    mixed_precision: cfg.mixed_precision,
                    backward_prefetch: cfg.fsdp_backward_prefetch,
                    forward_prefetch: cfg.fsdp_forward_prefetch,
                    ..FsdpConfig::default()
                },
            )?),
        };
        Ok(Self { inner, fp32_outputs: cfg.mixed_precision.is_some(), strategy: cfg.strategy })
    }

    /// The strategy it was wrapped with.
    pub fn strategy(&self) -> Strategy {
        self.strategy
    }

    /// The names of the tensors the optimizer updates, in its order: the parameters'
    /// (`conv1.weight`, …) for DDP, the FlatParameters' (`fc1._flat_param`, …) for FSDP.
    pub fn optimizer_param_names(&self) -> Vec<String> {
        match &self.inner {
            Inner::Ddp { model, .. } => model.named_parameters().iter().map(|(n, _)| n.clone()).collect(),
            Inner::Fsdp(m) => m.units().iter().map(|u| u.key()).collect(),
        }
    }

    /// What the optimizer updates, in [`optimizer_param_names`](Self::optimizer_param_names)
    /// order: the parameters (DDP) or this rank's FlatParameter shards (FSDP); shallow clones
    /// sharing storage and gradients.
    fn optimizer_params(&self) -> Vec<Tensor> {
        match &self.inner {
            Inner::Ddp { model, .. } => model.named_parameters().iter().map(|(_, t)| t.shallow_clone()).collect(),
            Inner::Fsdp(m) => m.shards(),
        }
    }

    /// The gradients of [`optimizer_params`](Self::optimizer_params) (undefined where none).
    fn optimizer_grads(&self) -> Vec<Tensor> {
        self.optimizer_params().iter().map(Tensor::grad).collect()
    }

    /// AdamW over what this rank owns: every parameter (DDP) or this rank's shards (FSDP, whose
    /// moments are then 1/W of the model per rank).
    ///
    /// # Errors
    /// An out-of-range hyper-parameter.
    // ANCHOR: wrapped_optimizer
    pub fn optimizer(&self, cfg: AdamWConfig) -> Result<AdamW> {
        AdamW::new(self.optimizer_params(), cfg)
    }
    // ANCHOR_END: wrapped_optimizer

    /// The wrapped model's forward pass: images `[b, 1, 28, 28]` f32 → log-probabilities `[b, 10]`.
    ///
    /// In eval mode (`train` false) a batch of more than [`EVAL_PIECE`](crate::train::EVAL_PIECE)
    /// images runs in pieces of that many, their outputs concatenated: the same
    /// log-probabilities per image, an eighth of the activations at the tutorial's test batch
    /// of 1,000 (see [`EVAL_PIECE`](crate::train::EVAL_PIECE)).
    ///
    /// # Errors
    /// FSDP's gather errors.
    pub fn forward_t(&mut self, xs: &Tensor, train: bool) -> Result<Tensor> {
        if train {
            self.forward_whole(xs, true)
        } else {
            crate::train::forward_in_pieces(xs, |piece| self.forward_whole(piece, false))
        }
    }

    /// [`forward_t`](Self::forward_t) of the whole batch at once.
    fn forward_whole(&mut self, xs: &Tensor, train: bool) -> Result<Tensor> {
        match &mut self.inner {
            Inner::Ddp { model, .. } => Ok(model.forward_t(xs, train)),
            Inner::Fsdp(m) => {
                let out = m.forward_t(xs, train)?;
                Ok(if self.fp32_outputs { out.to_kind(Kind::Float) } else { out })
            }
        }
    }

    /// `loss.backward()`, then the gradient sync unless it is switched off
    /// ([`set_require_backward_grad_sync`](Self::set_require_backward_grad_sync)).
    ///
    /// # Errors
    /// Collective errors.
    pub fn backward(&mut self, loss: &Tensor) -> Result<()> {
        match &mut self.inner {
            Inner::Ddp { model, .. } => model.backward(loss),
            Inner::Fsdp(m) => m.backward(loss),
        }
    }

    /// Turns the gradient sync of the next backwards on or off (DDP's
    /// `require_backward_grad_sync`, what `no_sync` toggles): off, gradients accumulate locally;
    /// the first backward with it on syncs the accumulated sum.
    pub fn set_require_backward_grad_sync(&mut self, sync: bool) {
        match &mut self.inner {
            Inner::Ddp { model, .. } => model.set_require_backward_grad_sync(sync),
            Inner::Fsdp(m) => m.set_require_backward_grad_sync(sync),
        }
    }

    /// Clips the gradients by their global L2 norm (`clip_grad_norm_`): every gradient is
    /// scaled by `min(1, max_norm / (total_norm + 1e-6))`. Returns the total norm before
    /// clipping. Call it after the gradient sync.
    ///
    /// # Errors
    /// A `max_norm` that is not positive and finite; collective errors (FSDP).
    pub fn clip_grad_norm(&self, max_norm: f64) -> Result<f64> {
        match &self.inner {
            Inner::Ddp { model, .. } => {
                if !(max_norm.is_finite() && max_norm > 0.0) {
                    return Err(Error::invalid("max_grad_norm", max_norm, "a positive, finite gradient norm"));
                }
                tch::no_grad(|| {
                    let grads: Vec<Tensor> = model.named_parameters().iter().map(|(_, p)| p.grad()).filter(|g| g.defined()).collect();
                    let total =
                        grads.iter().map(|g| g.to_kind(Kind::Double).square().sum(Kind::Double).double_value(&[])).sum::<f64>().sqrt();
                    let coef = (max_norm / (total + 1e-6)).min(1.0);
                    if coef < 1.0 {
                        for mut g in grads {
                            let _ = g.f_mul_scalar_(coef)?;
                        }
                    }
                    Ok(total)
                })
            }
            Inner::Fsdp(m) => m.clip_grad_norm(max_norm),
        }
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
    pub fn grads_finite(&self, pg: &dyn ProcessGroup) -> Result<bool> {
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
    /// Cheap: the loss is a value already computed; the gradients (when `check_grads`; pass
    /// false under fp16 loss scaling, where inf gradients are the scaler's business) are
    /// summed in f64, one pass and one read. At world size W > 1 the ranks then agree, with
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
    pub fn check_finite(&self, pg: &dyn ProcessGroup, step: u64, loss: f64, check_grads: bool) -> Result<()> {
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
            pg.all_reduce_prechecked(&mut first, ReduceOp::Min)?;
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
        let others = match (&self.inner, w) {
            (_, 1) => String::new(),
            (Inner::Ddp { .. }, _) => " and so on every rank after the gradient all-reduce (the loss was finite on every rank)".to_string(),
            (Inner::Fsdp(_), _) => " (its gradient, or its shard of the reduced gradients; the loss was finite on every rank)".to_string(),
        };
        Err(Error::NonFinite { what: "gradient", value: "NaN or infinite".into(), step, rank: first - w, others })
    }

    /// True when every gradient this rank holds is finite: their sums in f64, added up, are
    /// finite (one pass over the gradients, one read; no collective).
    fn local_grads_finite(&self) -> bool {
        let grads = self.optimizer_grads();
        tch::no_grad(|| {
            let sums: Vec<Tensor> = grads.iter().filter(|g| g.defined()).map(|g| g.sum(tch::Kind::Double)).collect();
            sums.is_empty() || Tensor::stack(&sums, 0).sum(tch::Kind::Double).double_value(&[]).is_finite()
        })
    }

    /// The bucket (DDP) or FlatParameter (FSDP) layout as a table.
    pub fn explain(&self) -> String {
        match &self.inner {
            Inner::Ddp { model, .. } => model.explain(),
            Inner::Fsdp(m) => m.explain(),
        }
    }

    /// Checks every rank holds the same parameters (DDP, FSDP NO_SHARD) or the same shard
    /// layout (sharded FSDP).
    ///
    /// # Errors
    /// [`Error::CollectiveMismatch`] naming what differs.
    pub fn check_parameters_in_sync(&self) -> Result<()> {
        match &self.inner {
            Inner::Ddp { model, .. } => model.check_parameters_in_sync(),
            Inner::Fsdp(m) => m.check_parameters_in_sync(),
        }
    }

    /// Seconds this rank spent inside collectives since wrapping.
    pub fn comm_seconds(&self) -> f64 {
        match &self.inner {
            Inner::Ddp { model, .. } => model.comm_seconds(),
            Inner::Fsdp(m) => m.comm_seconds(),
        }
    }

    /// Cumulative communication since wrapping: collective seconds and payload bytes (what
    /// [`crate::timing::StepTimer`] takes per lap).
    pub fn comm(&self) -> crate::timing::Comm {
        let bytes = match &self.inner {
            Inner::Ddp { model, .. } => model.comm_bytes(),
            Inner::Fsdp(m) => m.comm_bytes(),
        };
        crate::timing::Comm { seconds: self.comm_seconds(), bytes }
    }

    /// Bytes of model state this rank holds (AdamW: two state tensors per parameter element).
    // ANCHOR: wrapped_memory
    pub fn memory(&self) -> ModelStateBytes {
        match &self.inner {
            Inner::Ddp { model, .. } => {
                let bytes: u64 = model.named_parameters().iter().map(|(_, t)| (t.numel() * t.kind().elt_size_in_bytes()) as u64).sum();
                ModelStateBytes { parameters: bytes, gradients: bytes, optimizer: 2 * bytes, gathered_peak: 0 }
            }
            Inner::Fsdp(m) => m.memory(),
        }
    }
    // ANCHOR_END: wrapped_memory

    /// Exact distributed evaluation over `test` (see [`crate::train::evaluate_distributed`]):
    /// every image counted once at any world size. Collective.
    ///
    /// # Errors
    /// Collective errors.
    pub fn evaluate(&mut self, pg: &dyn ProcessGroup, test: &crate::data::Dataset, batch_size: usize) -> Result<EvalSums> {
        match &mut self.inner {
            Inner::Ddp { model, .. } => crate::train::evaluate_distributed(pg, model.module(), test, batch_size),
            Inner::Fsdp(m) => crate::train::evaluate_distributed_with(pg, |x| m.forward_t(x, false), test, batch_size),
        }
    }

    /// The unwrapped model's weights on rank 0 (`conv1.weight`, …, definition order, shapes of
    /// BasicNet, the parameters' dtype; FSDP gathers them), `None` on other ranks. Collective.
    ///
    /// # Errors
    /// Collective errors.
    pub fn full_state_dict(&self, pg: &dyn ProcessGroup) -> Result<Option<Vec<(String, Tensor)>>> {
        match &self.inner {
            Inner::Ddp { model, .. } => {
                Ok((pg.rank() == 0).then(|| model.named_parameters().iter().map(|(n, t)| (n.clone(), t.detach().copy())).collect()))
            }
            Inner::Fsdp(m) => m.full_state_dict(),
        }
    }

    /// Loads the unwrapped model's weights (every rank passes the same dict). No communication.
    ///
    /// # Errors
    /// [`Error::StateDict`] naming every missing and unexpected key, or a shape that differs.
    pub fn load_full_state_dict(&mut self, state_dict: &[(String, Tensor)]) -> Result<()> {
        match &mut self.inner {
            Inner::Ddp { model, .. } => {
                let expected: Vec<(String, Vec<i64>)> = model.named_parameters().iter().map(|(n, t)| (n.clone(), t.size())).collect();
                let map = check_named(state_dict, &expected, "model")?;
                tch::no_grad(|| {
                    for (name, p) in model.named_parameters() {
                        p.detach().f_copy_(&map[name.as_str()].to_device(p.device()).to_kind(p.kind()))?;
                    }
                    Ok(())
                })
            }
            Inner::Fsdp(m) => m.load_full_state_dict(state_dict),
        }
    }

    /// The optimizer's state with the unwrapped model's keys, on rank 0 (`None` elsewhere):
    /// `conv1.weight.exp_avg`, `conv1.weight.exp_avg_sq` (the parameter's shape) and
    /// `conv1.weight.step` (0-d i64) per parameter — the same at any world size and strategy
    /// (FSDP gathers and unflattens its shards' moments, as `FULL_OPTIM_STATE_DICT`).
    /// Collective.
    ///
    /// # Errors
    /// Collective errors.
    pub fn optimizer_state_dict(&self, opt: &AdamW, pg: &dyn ProcessGroup) -> Result<Option<Vec<(String, Tensor)>>> {
        let names = self.optimizer_param_names();
        let local = opt.state_dict(&names);
        match &self.inner {
            Inner::Ddp { .. } => Ok((pg.rank() == 0).then_some(local)),
            Inner::Fsdp(m) => {
                if local.is_empty() {
                    return Ok((pg.rank() == 0).then(Vec::new));
                }
                let map: BTreeMap<String, Tensor> = local.into_iter().collect();
                let mut out = Vec::new();
                let step = map[&format!("{}.step", names[0])].shallow_clone();
                let mut per_moment = Vec::new();
                for moment in ["exp_avg", "exp_avg_sq"] {
                    let shards: Vec<Tensor> = names.iter().map(|n| map[&format!("{n}.{moment}")].shallow_clone()).collect();
                    per_moment.push((moment, m.gather_full(&shards)?));
                }
                if pg.rank() != 0 {
                    return Ok(None);
                }
                let params: Vec<String> = m.param_names();
                let gathered: Vec<(&str, BTreeMap<String, Tensor>)> =
                    per_moment.into_iter().map(|(k, v)| (k, v.unwrap_or_default().into_iter().collect())).collect();
                for p in &params {
                    for (moment, full) in &gathered {
                        out.push((format!("{p}.{moment}"), full[p].shallow_clone()));
                    }
                    out.push((format!("{p}.step"), step.copy()));
                }
                Ok(Some(out))
            }
        }
    }

    /// Loads what [`optimizer_state_dict`](Self::optimizer_state_dict) returned (every rank
    /// passes the same dict; FSDP keeps its shard of each moment). No communication.
    ///
    /// # Errors
    /// [`Error::StateDict`] naming unexpected keys or shapes.
    pub fn load_optimizer_state_dict(&self, opt: &mut AdamW, state_dict: &[(String, Tensor)]) -> Result<()> {
        let names = self.optimizer_param_names();
        match &self.inner {
            Inner::Ddp { .. } => opt.load_state_dict(&names, state_dict),
            Inner::Fsdp(m) => {
                if state_dict.is_empty() {
                    return opt.load_state_dict(&names, &[]);
                }
                let map: BTreeMap<&str, &Tensor> = state_dict.iter().map(|(k, t)| (k.as_str(), t)).collect();
                let params = m.param_names();
                let mut local = Vec::new();
                let step = params
                    .first()
                    .and_then(|p| map.get(format!("{p}.step").as_str()))
                    .ok_or_else(|| Error::StateDict(format!("optimizer: no {}.step entry", params.first().map_or("", |s| s))))?;
                for moment in ["exp_avg", "exp_avg_sq"] {
                    let mut full = Vec::new();
                    for p in &params {
                        let t = map
                            .get(format!("{p}.{moment}").as_str())
                            .ok_or_else(|| Error::StateDict(format!("optimizer: missing key {p}.{moment}")))?;
                        full.push((p.clone(), t.shallow_clone()));
                    }
                    for (name, shard) in names.iter().zip(m.shard_full(&full)?) {
                        local.push((format!("{name}.{moment}"), shard));
                    }
                }
                for name in &names {
                    local.push((format!("{name}.step"), step.copy()));
                }
                opt.load_state_dict(&names, &local)
            }
        }
    }
}

/// Checks `state_dict` has exactly the `expected` keys with the expected shapes; returns it by
/// key.
///
/// # Errors
/// [`Error::StateDict`] listing every missing key, every unexpected key, and every shape that
/// differs.
pub fn check_named<'a>(
    state_dict: &'a [(String, Tensor)],
    expected: &[(String, Vec<i64>)],
    what: &str,
) -> Result<BTreeMap<&'a str, &'a Tensor>> {
    let map: BTreeMap<&str, &Tensor> = state_dict.iter().map(|(k, t)| (k.as_str(), t)).collect();
    let want: BTreeMap<&str, &[i64]> = expected.iter().map(|(k, s)| (k.as_str(), s.as_slice())).collect();
    let missing: Vec<&str> = want.keys().copied().filter(|k| !map.contains_key(k)).collect();
    let unexpected: Vec<&str> = map.keys().copied().filter(|k| !want.contains_key(k)).collect();
    let shapes: Vec<String> = want
        .iter()
        .filter_map(|(k, s)| map.get(k).filter(|t| t.size() != *s).map(|t| format!("{k}: expected {s:?}, found {:?}", t.size())))
        .collect();
    if missing.is_empty() && unexpected.is_empty() && shapes.is_empty() {
        return Ok(map);
    }
    let mut problems = Vec::new();
    if !missing.is_empty() {
        problems.push(format!("missing keys {missing:?}"));
    }
    if !unexpected.is_empty() {
        problems.push(format!("unexpected keys {unexpected:?}"));
    }
    if !shapes.is_empty() {
        problems.push(format!("shape mismatch ({})", shapes.join("; ")));
    }
    Err(Error::StateDict(format!("{what}: {}", problems.join("; "))))
}
