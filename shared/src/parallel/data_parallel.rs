//! The one interface DDP and FSDP implement for a training loop, so that [`WrappedModel`]
//! delegates instead of matching on the strategy in every method.
//!
//! [`WrappedModel`]: super::WrappedModel

use super::ddp::DistributedDataParallel;
use super::fsdp::{CpuOffloadStats, FullyShardedDataParallel};
use crate::dist::{ProcessGroup, ReduceOp};
use crate::memory::ModelStateBytes;
use crate::model::Segmented;
use crate::optim::AdamW;
use crate::timing::Comm;
use crate::{Error, Result};
use std::collections::BTreeMap;
use tch::{Device, Kind, Tensor};

/// Whether backward synchronises gradients — PyTorch's `require_backward_grad_sync` — and
/// `no_sync`, the closure that turns it off, written once for DDP and FSDP.
pub trait GradSync {
    /// True when the next backward synchronises the gradients (the default).
    fn require_backward_grad_sync(&self) -> bool;

    /// Turns the gradient sync of the next backwards on or off (what
    /// [`no_sync`](Self::no_sync) toggles for the duration of a closure).
    fn set_require_backward_grad_sync(&mut self, sync: bool);

    /// Runs `f` with gradient synchronisation off, as `with model.no_sync():` — gradients
    /// accumulate locally; the next backward outside syncs the accumulated sum. The switch is
    /// put back as it was.
    fn no_sync<R>(&mut self, f: impl FnOnce(&mut Self) -> R) -> R
    where
        Self: Sized,
    {
        let before = self.require_backward_grad_sync();
        self.set_require_backward_grad_sync(false);
        let out = f(self);
        self.set_require_backward_grad_sync(before);
        out
    }
}

/// What a data-parallel strategy does for a training loop. Every method that communicates must
/// be called by every rank in the same order, as any collective.
pub trait DataParallel: GradSync {
    /// The forward pass: images `[b, 1, 28, 28]` → log-probabilities `[b, 10]` in the compute
    /// dtype. In train mode with grad on, the graph is kept for [`backward`](Self::backward).
    ///
    /// # Errors
    /// Collective errors (FSDP gathers its units).
    fn forward(&mut self, xs: &Tensor, train: bool) -> Result<Tensor>;

    /// `loss.backward()`, then the gradient sync unless it is switched off
    /// ([`GradSync::set_require_backward_grad_sync`]).
    ///
    /// # Errors
    /// Collective errors; [`Error::Torch`] from autograd.
    fn backward(&mut self, loss: &Tensor) -> Result<()>;

    /// What an optimizer updates on this rank, with names, in its order: the parameters
    /// (`conv1.weight`, …) for DDP, this rank's FlatParameter shards (`fc1._flat_param`, …) for
    /// FSDP; shallow clones sharing storage and gradients.
    fn optimizer_params(&self) -> Vec<(String, Tensor)>;

    /// Whether the gradients of [`optimizer_params`](Self::optimizer_params) are shards of the
    /// global gradient (their squared norms must be summed over ranks).
    fn grads_are_sharded(&self) -> bool;

    /// The group whose ranks hold the shards of the gradient, when it is not every rank (HSDP's
    /// shard group: summing over the replicas too would count each shard once per replica).
    /// Default `None`: the whole group.
    fn shard_group(&self) -> Option<&dyn ProcessGroup> {
        None
    }

    /// Bytes of model state this rank holds.
    fn memory(&self) -> ModelStateBytes;

    /// Cumulative communication since wrapping: seconds inside collectives and payload bytes.
    fn comm(&self) -> Comm;

    /// FSDP's CPU offload (`offload_params`): what it copied since wrapping, and whether the
    /// host memory is pinned. Default `None`: nothing offloaded.
    fn cpu_offload(&self) -> Option<(CpuOffloadStats, bool)> {
        None
    }

    /// The unwrapped model's weights on rank 0 (`conv1.weight`, …, definition order, BasicNet's
    /// shapes, the parameters' dtype), `None` on other ranks. Collective. As torch's
    /// `state_dict()`, the tensors share storage with what the rank holds where it holds the
    /// whole parameter (DDP, NO_SHARD): copy them to keep a snapshot across steps.
    ///
    /// # Errors
    /// Collective errors.
    fn full_state_dict(&self) -> Result<Option<Vec<(String, Tensor)>>>;

    /// Loads the unwrapped model's weights (every rank passes the same dict). No communication.
    ///
    /// # Errors
    /// [`Error::StateDict`] naming every missing and unexpected key, or a shape that differs.
    fn load_full_state_dict(&mut self, state_dict: &[(String, Tensor)]) -> Result<()>;

    /// The optimizer's state with the unwrapped model's keys, on rank 0 (`None` elsewhere):
    /// `conv1.weight.exp_avg`, `conv1.weight.exp_avg_sq` (the parameter's shape) and
    /// `conv1.weight.step` (0-d i64) per parameter — the same at any world size and strategy
    /// (FSDP gathers and unflattens its shards' moments, as `FULL_OPTIM_STATE_DICT`).
    /// Collective. Under DDP and NO_SHARD the moments are the optimizer's own, not copies.
    ///
    /// # Errors
    /// Collective errors.
    fn optim_state_dict(&self, opt: &AdamW) -> Result<Option<Vec<(String, Tensor)>>>;

    /// Loads what [`optim_state_dict`](Self::optim_state_dict) returned (every rank passes the
    /// same dict; FSDP keeps its shard of each moment). No communication.
    ///
    /// # Errors
    /// [`Error::StateDict`] naming missing or unexpected keys and shapes that differ.
    fn load_optim_state_dict(&self, opt: &mut AdamW, state_dict: &[(String, Tensor)]) -> Result<()>;

    /// The unwrapped model's parameter names, in definition order.
    fn param_names(&self) -> Vec<String>;

    /// Checks every rank holds the same parameters (DDP, FSDP NO_SHARD) or the same shard
    /// layout (sharded FSDP).
    ///
    /// # Errors
    /// [`Error::CollectiveMismatch`] naming what differs.
    fn check_parameters_in_sync(&self) -> Result<()>;

    /// The bucket (DDP) or FlatParameter (FSDP) layout as a table, for `--explain`.
    fn explain(&self) -> String;
}

/// True when autograd records operations here (not inside `no_grad`): DDP's segmented forward
/// and FSDP's forward keep graphs for backward only then.
pub(crate) fn grad_enabled() -> bool {
    let probe = Tensor::zeros([1], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    (&probe * 1.0).requires_grad()
}

/// Clips `grads` (what this rank holds) by their global L2 norm, as `clip_grad_norm_`: the
/// squared norms are summed in f64, in pieces of
/// [`FINITE_CHECK_CHUNK`](crate::parallel::wrapped::FINITE_CHECK_CHUNK) elements — over ranks too, with one all-reduce, when `sharded_over`
/// is given (FSDP's shards at W > 1) — and every gradient is scaled by `min(1, max_norm /
/// (total_norm + 1e-6))`. Returns the total norm before clipping. Undefined gradients count 0.
///
/// # Errors
/// [`Error::InvalidValue`] naming `max_norm` when it is not positive and finite; collective
/// errors.
pub fn clip_grad_norm(grads: &[Tensor], max_norm: f64, sharded_over: Option<&dyn ProcessGroup>) -> Result<f64> {
    if !(max_norm.is_finite() && max_norm > 0.0) {
        return Err(Error::invalid("max_norm", max_norm, "a positive, finite gradient norm"));
    }
    tch::no_grad(|| {
        let defined: Vec<&Tensor> = grads.iter().filter(|g| g.defined()).collect();
        // Piece by piece: the f64 copy and its square of a whole gradient were two transient
        // full-size f64 tensors (604 MB for fc1 at width 4096, in every step of the Trainer,
        // whose max_grad_norm defaults to 1.0).
        let local_sq: f64 = defined
            .iter()
            .flat_map(|g| crate::parallel::wrapped::f64_pieces(g))
            .map(|piece| piece.to_kind(Kind::Double).square().sum(Kind::Double).double_value(&[]))
            .sum();
        let total_sq = match sharded_over.filter(|pg| pg.world_size() > 1) {
            Some(pg) => {
                let mut t = Tensor::from_slice(&[local_sq]).to_device(pg.device());
                pg.all_reduce(&mut t, ReduceOp::Sum)?;
                t.double_value(&[0])
            }
            None => local_sq,
        };
        let total = total_sq.sqrt();
        let coef = (max_norm / (total + 1e-6)).min(1.0);
        if coef < 1.0 {
            for g in defined {
                let _ = g.shallow_clone().f_mul_scalar_(coef)?;
            }
        }
        Ok(total)
    })
}

impl<M: Segmented> DataParallel for DistributedDataParallel<'_, M> {
    fn forward(&mut self, xs: &Tensor, train: bool) -> Result<Tensor> {
        self.sync_parameters()?;
        if let Some(zero) = self.zero().filter(|_| train && grad_enabled()) {
            // ZeRO-1: backward accumulates straight into the flat gradient buffer.
            zero.attach_gradients(self.named_parameters())?;
        }
        if (self.options().overlap || self.activation_checkpointing()) && train {
            self.forward_segmented(xs, train)
        } else {
            Ok(self.forward_t(xs, train))
        }
    }
    fn backward(&mut self, loss: &Tensor) -> Result<()> {
        DistributedDataParallel::backward(self, loss)
    }
    fn optimizer_params(&self) -> Vec<(String, Tensor)> {
        if let Some(zero) = self.zero() {
            return zero.optimizer_params(self.named_parameters());
        }
        self.named_parameters().iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect()
    }
    fn grads_are_sharded(&self) -> bool {
        self.zero().is_some()
    }
    fn memory(&self) -> ModelStateBytes {
        if let Some(zero) = self.zero() {
            return zero.memory(self.named_parameters());
        }
        let bytes: u64 = self.named_parameters().iter().map(|(_, t)| (t.numel() * t.kind().elt_size_in_bytes()) as u64).sum();
        ModelStateBytes { parameters: bytes, gradients: bytes, optimizer: 2 * bytes, gathered_peak: 0, optimizer_on_disk: 0 }
    }
    fn comm(&self) -> Comm {
        Comm { seconds: self.comm_seconds(), bytes: self.comm_bytes() }
    }
    fn full_state_dict(&self) -> Result<Option<Vec<(String, Tensor)>>> {
        self.sync_parameters()?;
        // The parameters themselves, detached (torch's state_dict()): no copy of the model.
        Ok((self.pg().rank() == 0).then(|| self.named_parameters().iter().map(|(n, t)| (n.clone(), t.detach())).collect()))
    }
    fn load_full_state_dict(&mut self, state_dict: &[(String, Tensor)]) -> Result<()> {
        let expected: Vec<(String, Vec<i64>)> = self.named_parameters().iter().map(|(n, t)| (n.clone(), t.size())).collect();
        let map = check_named(state_dict, &expected, "model")?;
        tch::no_grad(|| {
            for (name, p) in self.named_parameters() {
                p.detach().f_copy_(&map[name.as_str()].to_device(p.device()).to_kind(p.kind()))?;
            }
            Ok(())
        })
    }
    fn optim_state_dict(&self, opt: &AdamW) -> Result<Option<Vec<(String, Tensor)>>> {
        if let Some(zero) = self.zero() {
            return zero.optim_state_dict(self.pg(), opt, self.named_parameters());
        }
        if self.pg().rank() != 0 {
            return Ok(None);
        }
        opt.try_state_dict(&self.param_names()).map(Some)
    }
    fn load_optim_state_dict(&self, opt: &mut AdamW, state_dict: &[(String, Tensor)]) -> Result<()> {
        if let Some(zero) = self.zero() {
            return zero.load_optim_state_dict(opt, self.named_parameters(), state_dict);
        }
        opt.load_state_dict(&self.param_names(), state_dict)
    }
    fn param_names(&self) -> Vec<String> {
        self.named_parameters().iter().map(|(n, _)| n.clone()).collect()
    }
    fn check_parameters_in_sync(&self) -> Result<()> {
        DistributedDataParallel::check_parameters_in_sync(self)
    }
    fn explain(&self) -> String {
        DistributedDataParallel::explain(self)
    }
}

impl<M: Segmented> DataParallel for FullyShardedDataParallel<'_, M> {
    fn forward(&mut self, xs: &Tensor, train: bool) -> Result<Tensor> {
        self.forward_t(xs, train)
    }
    fn backward(&mut self, loss: &Tensor) -> Result<()> {
        FullyShardedDataParallel::backward(self, loss)
    }
    fn optimizer_params(&self) -> Vec<(String, Tensor)> {
        self.units().iter().map(|u| u.key()).zip(self.shards()).collect()
    }
    fn grads_are_sharded(&self) -> bool {
        self.config().sharding_strategy.is_sharded()
    }
    fn shard_group(&self) -> Option<&dyn ProcessGroup> {
        Some(FullyShardedDataParallel::shard_group(self))
    }
    fn memory(&self) -> ModelStateBytes {
        FullyShardedDataParallel::memory(self)
    }
    fn comm(&self) -> Comm {
        Comm { seconds: self.comm_seconds(), bytes: self.comm_bytes() }
    }
    fn cpu_offload(&self) -> Option<(CpuOffloadStats, bool)> {
        FullyShardedDataParallel::cpu_offload(self).map(|s| (s, self.cpu_offload_pinned()))
    }
    fn full_state_dict(&self) -> Result<Option<Vec<(String, Tensor)>>> {
        FullyShardedDataParallel::full_state_dict(self)
    }
    fn load_full_state_dict(&mut self, state_dict: &[(String, Tensor)]) -> Result<()> {
        FullyShardedDataParallel::load_full_state_dict(self, state_dict)
    }
    fn optim_state_dict(&self, opt: &AdamW) -> Result<Option<Vec<(String, Tensor)>>> {
        FullyShardedDataParallel::optim_state_dict(self, opt)
    }
    fn load_optim_state_dict(&self, opt: &mut AdamW, state_dict: &[(String, Tensor)]) -> Result<()> {
        FullyShardedDataParallel::load_optim_state_dict(self, opt, state_dict)
    }
    fn param_names(&self) -> Vec<String> {
        FullyShardedDataParallel::param_names(self)
    }
    fn check_parameters_in_sync(&self) -> Result<()> {
        FullyShardedDataParallel::check_parameters_in_sync(self)
    }
    fn explain(&self) -> String {
        FullyShardedDataParallel::explain(self)
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
