//! `FullyShardedDataParallel`: each rank keeps 1/W of the model state — as
//! `torch.distributed.fsdp.FullyShardedDataParallel` (FSDP1, `use_orig_params=False`).
//!
//! What it does, in PyTorch's order:
//! 1. **Wrapping.** PyTorch's `size_based_auto_wrap_policy`: each layer (a segment of a
//!    [`Segmented`] model that has parameters) holding at least `min_num_params` parameters becomes
//!    its own unit; the remaining parameters go to the root unit. `min_num_params = 0` gives one
//!    unit per layer, the default `100_000_000` one unit for the whole model.
//! 2. **Flattening.** Each unit's parameters are flattened in definition order into one
//!    `FlatParameter`, zero-padded to a multiple of the world size W (`padded_numel`), and rank r
//!    keeps elements `[r·padded_numel/W, (r+1)·padded_numel/W)`. The shards live in this wrapper's
//!    own [`nn::VarStore`]; the model's own VarStore is taken by value, so an optimizer can only
//!    be built over the shards (the classic bug of an optimizer still holding the unsharded
//!    tensors cannot be written).
//! 3. **Forward.** Before a unit's first segment its shards are all-gathered into a full flat
//!    buffer and the model's parameter tensors are pointed at views of it (`Tensor::set_data`),
//!    so the model's own forward code runs unchanged, with grad: each segment's graph is kept
//!    for backward. `FullShard` (ZeRO-3) then *frees the memory* of the gathered flat parameter
//!    after the unit's last segment while keeping its storage object (PyTorch's
//!    `_full_param_padded.untyped_storage().resize_(0)`, see [`storage`]): the graph's saved
//!    views of the parameters stay valid but hold no memory. `ShardGradOp` (ZeRO-2) keeps the
//!    gathered parameters until backward; `NoShard` (DDP) keeps full parameters on every rank.
//! 4. **Backward.** Segments in reverse, each running the graph forward saved (no second
//!    forward): before a `FullShard` unit's last segment, its storage is allocated again and
//!    all-gathered into (`resize_(n)`, then `all_gather_into_tensor`), so the saved views read
//!    the parameters again. The gradient of each segment comes from `torch.autograd.grad`
//!    with the next segment's input gradient as `grad_outputs` ([`crate::autograd::grad`]),
//!    which does not accumulate into `.grad` (no full-size gradient persists) and releases the
//!    segment's saved tensors as it goes. Once a unit's gradient is
//!    complete its gathered parameters are freed *first*, then the gradient is flattened and
//!    reduce-scattered with `ReduceOp::Avg` into the shard's gradient (accumulating), so the
//!    gathered parameters, the fresh per-parameter gradients and the flat gradient are never all
//!    alive at once; `NoShard` all-reduces (Avg) instead.
//! 5. **Step.** The optimizer steps only the local shards (its state is 1/W per rank); the next
//!    forward all-gathers the updated shards.
//!
//! 6. **Prefetch.** `backward_prefetch` (PyTorch's default `BackwardPre`) starts `FullShard`'s
//!    all-gather of the next unit backward needs before the current unit's gradient
//!    computation (`BackwardPost`: after it, once the current unit's parameters are freed, so
//!    it overlaps the gradient's reduce-scatter); `forward_prefetch` (default off, as PyTorch)
//!    starts the next unit's all-gather before the current unit's forward. The collective is
//!    non-blocking ([`ProcessGroup::start`] of an all-gather handed its tensors, so that the
//!    `Work` owns them) and at most one is in flight, so every rank issues collectives in one
//!    order; results are bit-identical with or without.
//!    What it buys depends on the engine: Open MPI progresses a non-blocking collective only
//!    inside MPI calls, so on CPU a prefetched all-gather advances during the next blocking
//!    collective (the reduce-scatter) or its wait, not while libtorch computes.
//!
//! Differences from PyTorch: tch exposes no autograd hooks, so backward runs segment by
//! segment (above) to reduce and prefetch between layers; the root unit is resharded after
//! forward like every other unit (PyTorch keeps the root unsharded as an optimisation).
//!
//! CPU offload (`offload_params`, see [`offload`]): the shards, their gradients and the
//! optimizer state live in host memory; each gather starts with a copy of the shard to the
//! compute device, each reduction ends with a copy of the gradient shard to the host.
//!
//! Mixed precision (`MixedPrecision`): shards stay in the model's dtype (fp32 master weights);
//! they are cast to `param_dtype` before the all-gather, so forward and backward run in
//! `param_dtype` (the root input is cast too, as FSDP's `cast_root_forward_inputs`); gradients
//! are reduced in `reduce_dtype` and cast back to the shard's dtype.

mod backward;
mod gather;
pub mod mesh;
pub mod offload;
mod plan;
mod state_dict;
mod storage;

pub use offload::{CpuOffloadPerStep, CpuOffloadStats};
pub use plan::{explain_units, plan_units, FlatParamUnit};

use crate::dist::ProcessGroup;
use crate::memory::ModelStateBytes;
use crate::model::Segmented;
use crate::parallel::checkpointing::SavedSegment;
use crate::parallel::data_parallel::{clip_grad_norm, grad_enabled};
use crate::parallel::ddp::check_in_sync;
use crate::parallel::{FsdpOptions, GradSync, MixedPrecision};
use crate::{Error, Result};
use gather::{Gathered, Inflight};
use offload::CpuOffload;
use plan::{flatten_padded, segment_params};
use std::time::Duration;
use tch::nn::{self, OptimizerConfig};
use tch::{Kind, Tensor};

/// A model whose parameters, gradients and optimizer state are sharded over ranks.
///
/// Usage (the model's VarStore is given up; the optimizer is built from the wrapper):
/// ```ignore
/// let vs = nn::VarStore::new(Device::Cpu);
/// let net = BasicNet::new(&vs.root(), BasicNetConfig::default());
/// let mut fsdp = FullyShardedDataParallel::new(vs, net, &*pg, FsdpOptions::default())?;
/// let mut opt = fsdp.adamw(1e-3)?;          // over this rank's shards only
/// opt.zero_grad();
/// let loss = fsdp.forward_t(&x, true)?.nll_loss(&y);
/// fsdp.backward(&loss)?;                     // re-gather, backward, reduce-scatter(Avg) per unit
/// fsdp.clip_grad_norm(1.0)?;                 // optional: global norm over all shards
/// opt.step();
/// ```
///
/// Every method that communicates (`new`, `forward_t`, `backward`, `clip_grad_norm`,
/// `full_state_dict`, `check_parameters_in_sync`) must be called by every rank in the same
/// order, as with any collective.
pub struct FullyShardedDataParallel<'pg, M: Segmented> {
    module: M,
    /// The model's own VarStore, owned so that no optimizer can be built over it.
    _module_vs: nn::VarStore,
    params: Vec<(String, Tensor)>,
    seg_params: Vec<Vec<usize>>,
    seg_unit: Vec<Option<usize>>,
    units: Vec<FlatParamUnit>,
    shard_vs: nn::VarStore,
    shards: Vec<Tensor>,
    /// Per unit: the gathered full flat parameter (in the compute dtype), if any.
    gathered: Vec<Option<Gathered>>,
    /// Per unit, `NoShard` under mixed precision: the freed cast of the last gather, which the
    /// next gather writes over instead of allocating.
    retired: Vec<Option<Tensor>>,
    /// Per unit: the unsharded gradient being accumulated during backward (and across
    /// backwards under `no_sync`).
    full_grads: Vec<Option<backward::FlatGrad>>,
    /// Per segment of the last grad-mode forward: its input and graph (or, checkpointed, what
    /// recomputes the graph; see [`crate::parallel::checkpointing`]).
    saved: Vec<SavedSegment>,
    /// Keep only each segment's input in a grad-mode forward and recompute in backward.
    activation_checkpointing: bool,
    output: Option<Tensor>,
    train: bool,
    /// The group the parameters are sharded over: the world, or HSDP's shard group.
    shard_pg: &'pg dyn ProcessGroup,
    /// Every rank of the job (the group given to [`new`](Self::new)).
    world: &'pg dyn ProcessGroup,
    /// HSDP's replicate group: the reduce-scattered gradient shards are all-reduced (Avg)
    /// over it. `None` for the other strategies (and a mesh of one replica).
    replicate: Option<&'pg dyn ProcessGroup>,
    config: FsdpOptions,
    /// The mixed-precision policy (`None`: the model's dtype).
    mixed_precision: Option<MixedPrecision>,
    live_gathered: u64,
    peak_gathered: u64,
    require_backward_grad_sync: bool,
    comm: Duration,
    /// Payload bytes of the all-gathers and gradient reductions since construction.
    comm_bytes: u64,
    /// The prefetched all-gather in flight, if any: at most one, so every rank issues its
    /// collectives in the same order (as MPI requires).
    inflight: Option<Inflight<'pg>>,
    /// All-gathers started ahead of need since construction.
    prefetches: u64,
    /// CPU offload of the shards (`offload_params`), with its copy counts.
    offload: Option<CpuOffload>,
}

/// FSDP's gradient reduction after backward: on by default; under `no_sync` the unsharded
/// gradients accumulate locally (full size per unit, as PyTorch) and the next synced backward
/// reduces the sum.
impl<M: Segmented> GradSync for FullyShardedDataParallel<'_, M> {
    fn require_backward_grad_sync(&self) -> bool {
        self.require_backward_grad_sync
    }
    fn set_require_backward_grad_sync(&mut self, sync: bool) {
        self.require_backward_grad_sync = sync;
    }
}

impl<M: Segmented> std::fmt::Debug for FullyShardedDataParallel<'_, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FullyShardedDataParallel")
            .field("rank", &self.world.rank())
            .field("world_size", &self.world.world_size())
            .field("sharding_strategy", &self.config.sharding_strategy)
            .field("units", &self.units.len())
            .finish()
    }
}

impl<'pg, M: Segmented> FullyShardedDataParallel<'pg, M> {
    /// Wraps `module`, built in `vs`: broadcasts rank 0's parameters (`sync_module_states`),
    /// plans the units, keeps this rank's shard of each FlatParameter and frees the model's full
    /// parameters (they hold 0 elements until forward gathers them).
    ///
    /// `vs` is taken by value so that no optimizer can be built over the unsharded tensors;
    /// build it with [`adamw`](Self::adamw) or over [`var_store`](Self::var_store).
    ///
    /// # Errors
    /// [`Error::Fsdp`] when `vs` is not the VarStore holding exactly the module's parameters,
    /// lives on another device than the group, or the segments are inconsistent (see
    /// [`plan_units`]); collective errors ([`Error::CollectiveMismatch`] when ranks' models
    /// differ in shape).
    pub fn new(vs: nn::VarStore, module: M, pg: &'pg dyn ProcessGroup, config: FsdpOptions) -> Result<Self> {
        let world = pg;
        let mesh = if config.sharding_strategy.is_hybrid() {
            mesh::HybridMesh::new(world, mesh::resolve_shard_size(config.dp_shard_size)?)?
        } else {
            mesh::HybridMesh { shard: world, replicate: None }
        };
        let pg = mesh.shard;
        let (rank, w) = (pg.rank(), pg.world_size());
        let bad = |problem: String| Error::Fsdp { rank, problem };
        if vs.device() != pg.device() {
            return Err(bad(format!(
                "the model's VarStore is on {:?}, but the process group works on {:?}; build the model on the group's device",
                vs.device(),
                pg.device()
            )));
        }
        let mut params = module.named_parameters();
        plan::check_var_store(&vs, &params, rank)?;
        let seg_params = segment_params(&module, &params, rank)?;
        let units = plan_units(&module, config.min_num_params, config.sharding_strategy, w)?;
        if config.sync_module_states && world.world_size() > 1 {
            let mut ts: Vec<Tensor> = params.iter().map(|(_, t)| t.detach()).collect();
            tch::no_grad(|| world.broadcast_coalesced(&mut ts, 0))?;
        }
        let offload = config.offload_params.then(|| CpuOffload::new(pg.device(), rank));
        // With CPU offload the shards (and so the optimizer) live in host memory.
        let shard_vs = nn::VarStore::new(if offload.is_some() { tch::Device::Cpu } else { pg.device() });
        let mut shards = Vec::with_capacity(units.len());
        for unit in &units {
            let flat = tch::no_grad(|| {
                let pieces: Vec<Tensor> = unit.params.iter().map(|&p| params[p].1.detach().reshape([-1])).collect();
                flatten_padded(&pieces, unit)
            });
            let (start, len) = unit.shard_range(rank, config.sharding_strategy);
            let shard = match &offload {
                Some(o) => tch::no_grad(|| o.home(&flat.narrow(0, start, len)))?,
                None => tch::no_grad(|| flat.narrow(0, start, len).copy()),
            };
            let key = unit.key();
            let mut path = shard_vs.root();
            let mut comps: Vec<&str> = key.split('.').collect();
            let leaf = comps.pop().unwrap_or("_flat_param");
            for c in comps {
                path = path.sub(c);
            }
            shards.push(path.add(leaf, shard, true));
        }
        // The model keeps no full parameters between uses.
        for (_, p) in params.iter_mut() {
            let empty = Tensor::empty([0], (p.kind(), p.device()));
            p.f_set_data(&empty)?;
        }
        let seg_unit = {
            let mut s = vec![None; seg_params.len()];
            for (u, unit) in units.iter().enumerate() {
                for &i in &unit.segments {
                    s[i] = Some(u);
                }
            }
            s
        };
        let n_units = units.len();
        Ok(Self {
            module,
            _module_vs: vs,
            params,
            seg_params,
            seg_unit,
            units,
            shard_vs,
            shards,
            gathered: (0..n_units).map(|_| None).collect(),
            retired: (0..n_units).map(|_| None).collect(),
            full_grads: (0..n_units).map(|_| None).collect(),
            saved: Vec::new(),
            activation_checkpointing: false,
            output: None,
            train: false,
            shard_pg: pg,
            world,
            replicate: mesh.replicate,
            config,
            mixed_precision: None,
            live_gathered: 0,
            peak_gathered: 0,
            require_backward_grad_sync: true,
            comm: Duration::ZERO,
            comm_bytes: 0,
            inflight: None,
            prefetches: 0,
            offload,
        })
    }

    /// The wrapped model (PyTorch's `fsdp.module`). Its parameter tensors hold 0 elements
    /// except while a unit is gathered; use [`full_state_dict`](Self::full_state_dict) to read
    /// the weights.
    pub fn module(&self) -> &M {
        &self.module
    }

    /// The process group it was given (every rank of the job).
    pub fn pg(&self) -> &'pg dyn ProcessGroup {
        self.world
    }

    /// The group the parameters are sharded over: [`pg`](Self::pg), or HSDP's shard group
    /// (`dp_shard_size` ranks).
    pub fn shard_group(&self) -> &'pg dyn ProcessGroup {
        self.shard_pg
    }

    /// HSDP's replicate group (`dp_replicate_size` ranks), `None` for the other strategies.
    pub fn replicate_group(&self) -> Option<&'pg dyn ProcessGroup> {
        self.replicate
    }

    /// This process's rank in the group.
    pub fn rank(&self) -> usize {
        self.world.rank()
    }

    /// Number of ranks in the group (the model is sharded over
    /// [`shard_group`](Self::shard_group)'s, all of them but under HSDP).
    pub fn world_size(&self) -> usize {
        self.world.world_size()
    }

    /// The options it was built with.
    pub fn config(&self) -> &FsdpOptions {
        &self.config
    }

    /// The mixed-precision policy it applies (`None`: the model's dtype).
    pub fn mixed_precision(&self) -> Option<MixedPrecision> {
        self.mixed_precision
    }

    /// Computes in `policy`'s dtypes (FSDP's `mixed_precision=` keyword; `None`: the model's
    /// dtype). Call it before the first forward: the shards stay in the model's dtype (fp32
    /// master weights); gathers cast them to `param_dtype`, gradients are reduced in
    /// `reduce_dtype`.
    pub fn with_mixed_precision(mut self, policy: Option<MixedPrecision>) -> Self {
        self.mixed_precision = policy;
        self
    }

    /// Turns activation checkpointing on or off (Accelerate's `fsdp_activation_checkpointing`:
    /// `torch.utils.checkpoint` around every segment, see [`crate::parallel::checkpointing`]):
    /// a grad-mode forward keeps each segment's input only (a `FullShard` unit's gathered
    /// parameters are freed after forward as without), and backward, once the segment's unit is
    /// gathered again, recomputes the segment before its gradient. Same collectives, same
    /// gradients (bit-identical on CPU).
    pub fn with_activation_checkpointing(mut self, on: bool) -> Self {
        self.activation_checkpointing = on;
        self
    }

    /// Whether activation checkpointing is on.
    pub fn activation_checkpointing(&self) -> bool {
        self.activation_checkpointing
    }

    /// The unit layout (children in segment order, then the root unit).
    pub fn units(&self) -> &[FlatParamUnit] {
        &self.units
    }

    /// This rank's shards, one trainable variable per unit (`fc1._flat_param`, …, shape
    /// `[shard_numel]`, the model's dtype). Build optimizers over this VarStore only.
    pub fn var_store(&self) -> &nn::VarStore {
        &self.shard_vs
    }

    /// AdamW with PyTorch's defaults (betas 0.9/0.999, eps 1e-8, weight decay 0.01) and
    /// learning rate `lr`, over this rank's shards: its `exp_avg`/`exp_avg_sq` are 1/W of the
    /// model per rank.
    ///
    /// # Errors
    /// [`Error::Torch`] if libtorch cannot build the optimizer.
    pub fn adamw(&self, lr: f64) -> Result<nn::Optimizer> {
        Ok(nn::AdamW::default().build(&self.shard_vs, lr)?)
    }

    /// Seconds spent inside collectives since construction (gathers and gradient reduction).
    pub fn comm_seconds(&self) -> f64 {
        self.comm.as_secs_f64()
    }

    /// Payload bytes of the collectives since construction: all-gather outputs and
    /// reduce-scatter / all-reduce inputs. Per step, with P the padded parameter numel, b the
    /// bytes per element, S the shard group's size (the world but under HSDP): FULL_SHARD and
    /// HYBRID_SHARD `3·P·b` (two all-gathers, one reduce-scatter), SHARD_GRAD_OP and
    /// _HYBRID_SHARD_ZERO2 `2·P·b`, NO_SHARD `P·b` (one all-reduce); HSDP adds the all-reduce of
    /// its `P·b/S` gradient shard across replicas (none with one replica).
    pub fn comm_bytes(&self) -> u64 {
        self.comm_bytes
    }

    /// What the CPU offload copied since construction (`None` without `offload_params`): bytes
    /// host → device for training and evaluation, device → host, and optimizer steps; see
    /// [`CpuOffloadStats`] for the closed forms.
    pub fn cpu_offload(&self) -> Option<CpuOffloadStats> {
        self.offload.as_ref().map(CpuOffload::stats)
    }

    /// Whether the offloaded shards are in pinned host memory (`false` without offload).
    pub fn cpu_offload_pinned(&self) -> bool {
        self.offload.as_ref().is_some_and(CpuOffload::pinned)
    }

    /// `t` on the compute device, uncounted: a no-op unless offloaded shards must meet a
    /// device collective (state dicts, the sync check).
    fn on_compute_device(&self, t: &Tensor) -> Tensor {
        t.to_device(self.shard_pg.device())
    }

    /// All-gathers started ahead of need since construction (`forward_prefetch`,
    /// `backward_prefetch`): per step with `min_num_params = 0` and U units, U − 1 in forward
    /// with `forward_prefetch`, and U − 1 in `FullShard`'s backward with a `backward_prefetch`.
    pub fn prefetches(&self) -> u64 {
        self.prefetches
    }

    fn param_kind(&self, u: usize) -> Kind {
        self.mixed_precision.map_or(self.shards[u].kind(), |mp| mp.param_dtype.kind())
    }

    fn reduce_kind(&self, u: usize) -> Kind {
        self.mixed_precision.map_or(self.shards[u].kind(), |mp| mp.reduce_dtype.kind())
    }

    /// The wrapped model's forward pass (`fsdp(x)`), segment by segment, gathering each unit
    /// before its first segment. Input and output as the model's (BasicNet: `[batch, 1, 28, 28]`
    /// → `[batch, 10]` f32 log-probabilities); under mixed precision a floating input is cast
    /// to `param_dtype`.
    ///
    /// In grad mode each segment's graph is kept for [`backward`](Self::backward) (no second
    /// forward there) and the output is a leaf that requires grad: compute the loss from it and
    /// pass the loss to `backward`. `FullShard` frees each unit's gathered parameters after its
    /// last segment (the graph keeps views of them that hold no memory until backward refills
    /// them). Under `no_grad` (evaluation) nothing is kept for backward and every sharded unit is
    /// freed after its last segment.
    ///
    /// # Errors
    /// Collective errors from the all-gathers; [`Error::Torch`] if a shape does not fit;
    /// [`Error::Fsdp`] if a storage cannot be freed or allocated.
    pub fn forward_t(&mut self, xs: &Tensor, train: bool) -> Result<Tensor> {
        // Shards may have changed since the last gather (an optimizer step): gather afresh.
        self.free_all()?;
        let grad = grad_enabled();
        if let Some(o) = &mut self.offload {
            o.set_eval(!grad);
        }
        let strategy = self.config.sharding_strategy;
        let mut x = match self.mixed_precision {
            Some(mp) if xs.is_floating_point() => xs.to_kind(mp.param_dtype.kind()),
            _ => xs.shallow_clone(),
        };
        for i in 0..self.seg_params.len() {
            let unit = self.seg_unit[i];
            if let Some(u) = unit {
                self.gather(u)?;
            }
            if self.config.forward_prefetch {
                // Before this segment computes, start the next unit's all-gather.
                if let Some(v) = self.next_unit_forward(i, unit) {
                    self.prefetch(v)?;
                }
            }
            let x_in = if grad && i > 0 { x.detach().set_requires_grad(true) } else { x.detach() };
            let y = if grad {
                let (seg, y) = SavedSegment::forward(&self.module, i, x_in, train, self.activation_checkpointing)?;
                self.saved.push(seg);
                y
            } else {
                self.module.segment_forward(i, &x_in, train)
            };
            if let Some(u) = unit {
                if self.units[u].segments.last() == Some(&i) && strategy.is_sharded() {
                    if !grad {
                        self.free(u)?;
                    } else if strategy.reshard_after_forward() {
                        self.release(u)?;
                    }
                }
            }
            x = y;
        }
        self.finish_prefetch()?;
        if !grad {
            return Ok(x);
        }
        let out = x.detach().set_requires_grad(true);
        self.output = Some(out.shallow_clone());
        self.train = train;
        Ok(out)
    }

    /// Clips the gradients of all shards by their global L2 norm, as
    /// `FullyShardedDataParallel.clip_grad_norm_(max_norm)`: the shared
    /// [`clip_grad_norm`](crate::parallel::data_parallel::clip_grad_norm) over this rank's
    /// shards' gradients, their squared norms summed over ranks with one all-reduce (none for
    /// `NoShard`, whose ranks each hold the whole gradient); every gradient is scaled by
    /// `min(1, max_norm / (total_norm + 1e-6))`. Returns the total norm (before clipping).
    /// Padding holds zero gradients and does not change the norm.
    ///
    /// # Errors
    /// [`Error::InvalidValue`] for a `max_norm` that is not positive and finite; collective
    /// errors.
    pub fn clip_grad_norm(&self, max_norm: f64) -> Result<f64> {
        let grads: Vec<Tensor> = self.shards.iter().map(Tensor::grad).collect();
        clip_grad_norm(&grads, max_norm, self.config.sharding_strategy.is_sharded().then_some(self.shard_pg))
    }

    /// This rank's shards (one trainable `[shard_numel]` tensor per unit, unit order): what an
    /// optimizer updates. Shallow clones sharing storage and gradients.
    pub fn shards(&self) -> Vec<Tensor> {
        self.shards.iter().map(|s| s.shallow_clone()).collect()
    }

    /// The unwrapped model's parameter names, in definition order.
    pub fn param_names(&self) -> Vec<String> {
        self.params.iter().map(|(n, _)| n.clone()).collect()
    }

    /// Debug check that the ranks agree: for `NoShard` every rank's full parameters must be
    /// bit-identical; for the sharded strategies the unit layouts must match (the shards
    /// themselves differ by design). Uses [`crate::parallel::ddp::check_in_sync`].
    ///
    /// # Errors
    /// [`Error::CollectiveMismatch`] naming what differs.
    pub fn check_parameters_in_sync(&self) -> Result<()> {
        if self.config.sharding_strategy.is_sharded() {
            let layout: Vec<(String, Tensor)> = self
                .units
                .iter()
                .map(|u| {
                    let v = [u.numel as f64, u.padded_numel as f64, u.shard_numel as f64];
                    (format!("layout of unit {}", u.display_name()), Tensor::from_slice(&v).to_device(self.shard_pg.device()))
                })
                .collect();
            check_in_sync(self.world, &layout)
        } else {
            let named: Vec<(String, Tensor)> =
                self.units.iter().zip(&self.shards).map(|(u, s)| (u.key(), self.on_compute_device(&s.detach()))).collect();
            check_in_sync(self.shard_pg, &named)
        }
    }

    /// The unit layout as a table, for `--explain`.
    pub fn explain(&self) -> String {
        explain_units(&self.units, self.config.sharding_strategy, self.shard_pg.world_size(), self.config.min_num_params)
    }

    /// Model-state bytes this rank holds, from the tensors themselves (numel × element size):
    /// `parameters` = the shards; `gradients` = the shards' `.grad` where defined, plus any
    /// unsharded gradient held under `no_sync`; `optimizer` = AdamW's `exp_avg` and
    /// `exp_avg_sq`, one of each per shard element in the shard's dtype (libtorch's optimizer
    /// state is not reachable through tch; this is what it allocates at the first step);
    /// `gathered_peak` = the most bytes of gathered parameters alive at once since construction
    /// (0 for `NoShard` without mixed precision, whose parameters are views of the shards).
    // ANCHOR: fsdp_memory
    pub fn memory(&self) -> ModelStateBytes {
        let bytes = |t: &Tensor| (t.numel() * t.kind().elt_size_in_bytes()) as u64;
        let parameters: u64 = self.shards.iter().map(bytes).sum();
        let gradients: u64 = self
            .shards
            .iter()
            .map(|s| {
                let g = s.grad();
                if g.defined() {
                    bytes(&g)
                } else {
                    0
                }
            })
            .sum::<u64>()
            + self.full_grads.iter().flatten().filter(|g| !g.in_grad).map(|g| bytes(g.tensor())).sum::<u64>();
        ModelStateBytes { parameters, gradients, optimizer: 2 * parameters, gathered_peak: self.peak_gathered, optimizer_on_disk: 0 }
    }
    // ANCHOR_END: fsdp_memory
}
