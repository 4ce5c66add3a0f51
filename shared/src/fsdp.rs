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
//!    so the model's own forward code runs unchanged. `FullShard` (ZeRO-3) runs the unit under
//!    `no_grad`, keeps only the segment inputs and frees the gathered parameters after the unit's
//!    last segment; `ShardGradOp` (ZeRO-2) keeps the graph and the gathered parameters until
//!    backward; `NoShard` (DDP) keeps full parameters on every rank.
//! 4. **Backward.** Segments in reverse: `FullShard` all-gathers again and recomputes the unit's
//!    segments with grad (activation recomputation stands in for the hooks tch lacks); the
//!    gradient of each segment comes from `torch.autograd.grad` (`Tensor::run_backward`), which
//!    does not accumulate into `.grad`, so no full-size gradient persists. Once a unit's
//!    gradient is complete it is reduce-scattered with `ReduceOp::Avg` into the shard's gradient
//!    (accumulating) and the gathered parameters are freed; `NoShard` all-reduces (Avg) instead.
//! 5. **Step.** The optimizer steps only the local shards (its state is 1/W per rank); the next
//!    forward all-gathers the updated shards.
//!
//! Differences from PyTorch: no communication/computation overlap (tch exposes no autograd
//! hooks); the root unit is resharded after forward like every other unit (PyTorch keeps the
//! root unsharded as an optimisation); `FullShard` recomputes a unit's forward in backward
//! instead of keeping its activations.
//!
//! Mixed precision (`MixedPrecision`): shards stay in the model's dtype (fp32 master weights);
//! they are cast to `param_dtype` before the all-gather, so forward and backward run in
//! `param_dtype` (the root input is cast too, as FSDP's `cast_root_forward_inputs`); gradients
//! are reduced in `reduce_dtype` and cast back to the shard's dtype.

use crate::ddp::check_in_sync;
use crate::dist::{ProcessGroup, ReduceOp};
use crate::memory::ModelStateBytes;
use crate::model::Segmented;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use tch::nn::{self, OptimizerConfig};
use tch::{Device, Kind, Tensor};

/// How parameters, gradients and optimizer state are split over ranks, with PyTorch's names
/// (`torch.distributed.fsdp.ShardingStrategy`). CLI and serde names: `full-shard`,
/// `shard-grad-op`, `no-shard`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum ShardingStrategy {
    /// ZeRO-3: parameters, gradients and optimizer state sharded; parameters all-gathered before
    /// forward, freed after it, all-gathered again for backward; gradients reduce-scattered.
    /// PyTorch's default.
    #[default]
    FullShard,
    /// ZeRO-2: as `FullShard`, but the gathered parameters are kept from forward to backward
    /// (one all-gather per step instead of two).
    ShardGradOp,
    /// No sharding: full parameters on every rank, gradients all-reduced — the DDP equivalent.
    NoShard,
}

impl ShardingStrategy {
    /// True for the strategies that keep 1/W of each FlatParameter per rank.
    pub fn is_sharded(self) -> bool {
        self != ShardingStrategy::NoShard
    }
    /// True when gathered parameters are freed after forward (ZeRO-3).
    pub fn reshard_after_forward(self) -> bool {
        self == ShardingStrategy::FullShard
    }
}

impl std::fmt::Display for ShardingStrategy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ShardingStrategy::FullShard => "full-shard",
            ShardingStrategy::ShardGradOp => "shard-grad-op",
            ShardingStrategy::NoShard => "no-shard",
        })
    }
}

/// A floating-point dtype by name (`tch::Kind` is not serde). Serde and CLI names: `f32`,
/// `f64`, `bf16`, `f16`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// `torch.float32`.
    F32,
    /// `torch.float64`.
    F64,
    /// `torch.bfloat16`.
    Bf16,
    /// `torch.float16`.
    F16,
}

impl Dtype {
    /// The tch kind.
    pub fn kind(self) -> Kind {
        match self {
            Dtype::F32 => Kind::Float,
            Dtype::F64 => Kind::Double,
            Dtype::Bf16 => Kind::BFloat16,
            Dtype::F16 => Kind::Half,
        }
    }
}

/// Mixed-precision policy, as `torch.distributed.fsdp.MixedPrecision(param_dtype,
/// reduce_dtype)`; the shards (master weights) keep the model's dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MixedPrecision {
    /// Dtype of the gathered parameters, hence of forward and backward compute.
    pub param_dtype: Dtype,
    /// Dtype in which gradients are reduce-scattered (all-reduced for `NoShard`).
    pub reduce_dtype: Dtype,
}

impl MixedPrecision {
    /// bf16 compute and bf16 gradient reduction, fp32 master shards.
    pub fn bf16() -> Self {
        Self { param_dtype: Dtype::Bf16, reduce_dtype: Dtype::Bf16 }
    }
}

/// FSDP options, as `FullyShardedDataParallel(...)`'s keyword arguments.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct FsdpConfig {
    /// How state is split over ranks (PyTorch's default `FULL_SHARD`).
    pub sharding_strategy: ShardingStrategy,
    /// `size_based_auto_wrap_policy(min_num_params)`: a layer with at least this many parameters
    /// becomes its own unit. Default 100,000,000 (PyTorch's), i.e. one unit for BasicNet; 0 wraps
    /// every layer.
    pub min_num_params: usize,
    /// Broadcast rank 0's parameters before sharding, so every rank starts from the same model.
    /// Default true (PyTorch's default is false; the ladder always wants rank 0's weights).
    pub sync_module_states: bool,
    /// Mixed-precision policy; `None` (default) computes in the model's own dtype.
    pub mixed_precision: Option<MixedPrecision>,
}

impl Default for FsdpConfig {
    fn default() -> Self {
        Self {
            sharding_strategy: ShardingStrategy::FullShard,
            min_num_params: 100_000_000,
            sync_module_states: true,
            mixed_precision: None,
        }
    }
}

/// The layout of one wrapped unit's `FlatParameter`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlatParamUnit {
    /// Module path of the layer this unit wraps (`fc1`); empty for the root unit.
    pub name: String,
    /// Segments of the model whose parameters belong to this unit, ascending.
    pub segments: Vec<usize>,
    /// Indices into `named_parameters()`, in flattening (definition) order.
    pub params: Vec<usize>,
    /// Names of those parameters.
    pub param_names: Vec<String>,
    /// Their shapes.
    pub shapes: Vec<Vec<i64>>,
    /// Offset of each parameter in the flat parameter, elements.
    pub offsets: Vec<i64>,
    /// Elements of the unpadded flat parameter.
    pub numel: i64,
    /// Elements after padding to a multiple of the world size (`numel` for `NoShard`).
    pub padded_numel: i64,
    /// Elements each rank keeps: `padded_numel / W` (`numel` for `NoShard`).
    pub shard_numel: i64,
    /// Bytes per element of the parameters (the shard's dtype).
    pub elt_size: usize,
}

impl FlatParamUnit {
    /// The name shown in tables: the module path, or `(root)`.
    pub fn display_name(&self) -> &str {
        if self.name.is_empty() {
            "(root)"
        } else {
            &self.name
        }
    }

    /// Key of this unit's shard in a sharded state dict: `fc1._flat_param`, or `_flat_param`
    /// for the root (PyTorch's local state dict naming).
    pub fn key(&self) -> String {
        if self.name.is_empty() {
            "_flat_param".to_string()
        } else {
            format!("{}._flat_param", self.name)
        }
    }

    /// `(start, len)` of rank `rank`'s shard in the padded flat parameter, elements.
    pub fn shard_range(&self, rank: usize, sharded: bool) -> (i64, i64) {
        if sharded {
            (rank as i64 * self.shard_numel, self.shard_numel)
        } else {
            (0, self.shard_numel)
        }
    }

    /// Bytes of one rank's shard.
    pub fn shard_bytes(&self) -> u64 {
        self.shard_numel as u64 * self.elt_size as u64
    }
}

/// Groups `module`'s parameters into units as `size_based_auto_wrap_policy(min_num_params)`
/// does and lays out each unit's FlatParameter for `world_size` ranks: children in segment
/// order, then the root unit (only when some parameters are left for it).
///
/// # Errors
/// [`Error::InvalidValue`] for `world_size == 0`; [`Error::Fsdp`] (rank 0) when the model's
/// segments do not use every parameter exactly once, a segment names a parameter that does not
/// exist, or one unit mixes dtypes.
pub fn plan_units<M: Segmented + ?Sized>(
    module: &M,
    min_num_params: usize,
    strategy: ShardingStrategy,
    world_size: usize,
) -> Result<Vec<FlatParamUnit>> {
    if world_size == 0 {
        return Err(Error::invalid("world_size", 0, "at least 1 rank"));
    }
    let params = module.named_parameters();
    let seg_params = segment_params(module, &params, 0)?;
    let bad = |problem: String| Error::Fsdp { rank: 0, problem };
    // Each layer with enough parameters is its own unit; the rest go to the root.
    let mut groups: Vec<(String, Vec<usize>)> = Vec::new();
    let mut root = Vec::new();
    for (i, ps) in seg_params.iter().enumerate() {
        if ps.is_empty() {
            continue;
        }
        let numel: i64 = ps.iter().map(|&p| params[p].1.numel() as i64).sum();
        if numel as u64 >= min_num_params as u64 {
            groups.push((segment_name(ps, &params), vec![i]));
        } else {
            root.push(i);
        }
    }
    if !root.is_empty() {
        groups.push((String::new(), root));
    }
    let mut units = Vec::with_capacity(groups.len());
    for (name, segments) in groups {
        let mut idx: Vec<usize> = segments.iter().flat_map(|&s| seg_params[s].iter().copied()).collect();
        idx.sort_unstable();
        let kind = params[idx[0]].1.kind();
        let (mut offsets, mut shapes, mut names, mut numel) = (Vec::new(), Vec::new(), Vec::new(), 0i64);
        for &p in &idx {
            let (pname, t) = &params[p];
            if t.kind() != kind {
                return Err(bad(format!(
                    "unit {}: parameter {pname} is {:?} but {} is {kind:?}; a FlatParameter needs one dtype",
                    if name.is_empty() { "(root)" } else { &name },
                    t.kind(),
                    params[idx[0]].0
                )));
            }
            offsets.push(numel);
            shapes.push(t.size());
            names.push(pname.clone());
            numel += t.numel() as i64;
        }
        let w = world_size as i64;
        let (padded_numel, shard_numel) = if strategy.is_sharded() {
            let padded = (numel + w - 1) / w * w;
            (padded, padded / w)
        } else {
            (numel, numel)
        };
        units.push(FlatParamUnit {
            name,
            segments,
            params: idx,
            param_names: names,
            shapes,
            offsets,
            numel,
            padded_numel,
            shard_numel,
            elt_size: kind.elt_size_in_bytes(),
        });
    }
    Ok(units)
}

/// Validated `segment_params` for every segment.
fn segment_params<M: Segmented + ?Sized>(
    module: &M,
    params: &[(String, Tensor)],
    rank: usize,
) -> Result<Vec<Vec<usize>>> {
    let bad = |problem: String| Error::Fsdp { rank, problem };
    let n = module.num_segments();
    if n == 0 {
        return Err(bad("the model has 0 segments; expected at least 1".into()));
    }
    let mut owner: Vec<Option<usize>> = vec![None; params.len()];
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let ps = module.segment_params(i);
        for &p in &ps {
            let Some(slot) = owner.get_mut(p) else {
                return Err(bad(format!(
                    "segment {i} uses parameter index {p}, but the model has {} parameters",
                    params.len()
                )));
            };
            if let Some(j) = *slot {
                return Err(bad(format!(
                    "parameter {} is used by segments {j} and {i}; expected each parameter in exactly one segment (no weight tying)",
                    params[p].0
                )));
            }
            *slot = Some(i);
        }
        out.push(ps);
    }
    if let Some(p) = owner.iter().position(Option::is_none) {
        return Err(bad(format!(
            "parameter {} is used by no segment; expected every parameter in exactly one segment",
            params[p].0
        )));
    }
    Ok(out)
}

/// The module path of a segment's parameters: `fc1` for `fc1.weight`, `fc1.bias`.
fn segment_name(ps: &[usize], params: &[(String, Tensor)]) -> String {
    let mut names: Vec<&str> = Vec::new();
    for &p in ps {
        let n = params[p].0.as_str();
        let module = n.rsplit_once('.').map_or(n, |(m, _)| m);
        if !names.contains(&module) {
            names.push(module);
        }
    }
    names.join("+")
}

/// Renders a unit layout as a table, for `--explain`: one row per unit with its parameters,
/// numel, padded numel, and what each rank keeps.
pub fn explain_units(
    units: &[FlatParamUnit],
    strategy: ShardingStrategy,
    world_size: usize,
    min_num_params: usize,
) -> String {
    let mut table = comfy_table::Table::new();
    table.load_preset(comfy_table::presets::ASCII_MARKDOWN);
    table.set_header(["unit", "parameters", "numel", "padded numel", "shard numel per rank", "bytes per rank"]);
    let (mut numel, mut padded, mut shard, mut bytes, mut count) = (0i64, 0i64, 0i64, 0u64, 0usize);
    for u in units {
        let names: Vec<String> = u.param_names.iter().zip(&u.shapes).map(|(n, s)| format!("{n} {s:?}")).collect();
        table.add_row([
            u.display_name().to_string(),
            names.join(", "),
            u.numel.to_string(),
            u.padded_numel.to_string(),
            u.shard_numel.to_string(),
            u.shard_bytes().to_string(),
        ]);
        numel += u.numel;
        padded += u.padded_numel;
        shard += u.shard_numel;
        bytes += u.shard_bytes();
        count += u.params.len();
    }
    table.add_row([
        "total".to_string(),
        format!("{count} parameter tensors"),
        numel.to_string(),
        padded.to_string(),
        shard.to_string(),
        bytes.to_string(),
    ]);
    let what = match strategy {
        ShardingStrategy::FullShard => {
            "all-gather before forward and again before backward, reduce-scatter(Avg) gradients"
        }
        ShardingStrategy::ShardGradOp => {
            "all-gather before forward, keep until backward, reduce-scatter(Avg) gradients"
        }
        ShardingStrategy::NoShard => "full parameters on every rank, all-reduce(Avg) gradients",
    };
    format!(
        "FSDP units: {} FlatParameter(s), sharding_strategy {strategy} ({what}), world size {world_size}, \
         size_based_auto_wrap_policy(min_num_params = {min_num_params})\n{table}",
        units.len()
    )
}

/// What forward keeps for backward, per segment.
struct Saved {
    /// The segment's input: a detached leaf (requires grad for segments after the first).
    x: Tensor,
    /// The segment's output with its graph; `None` when backward recomputes it (`FullShard`).
    y: Option<Tensor>,
}

/// A model whose parameters, gradients and optimizer state are sharded over ranks.
///
/// Usage (the model's VarStore is given up; the optimizer is built from the wrapper):
/// ```ignore
/// let vs = nn::VarStore::new(Device::Cpu);
/// let net = BasicNet::new(&vs.root(), BasicNetConfig::default());
/// let mut fsdp = FullyShardedDataParallel::new(vs, net, &*pg, FsdpConfig::default())?;
/// let mut opt = fsdp.adamw(1e-3)?;          // over this rank's shards only
/// opt.zero_grad();
/// let loss = fsdp.forward_t(&x, true)?.nll_loss(&y);
/// fsdp.backward(&loss)?;                     // recompute, reduce-scatter(Avg) per unit
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
    /// Per unit: the gathered full flat parameter (in the compute dtype) and its bytes.
    gathered: Vec<Option<(Tensor, u64)>>,
    /// Per unit: the unsharded gradient being accumulated during backward (and across
    /// backwards under `no_sync`).
    full_grads: Vec<Option<Tensor>>,
    saved: Vec<Saved>,
    output: Option<Tensor>,
    train: bool,
    pg: &'pg dyn ProcessGroup,
    config: FsdpConfig,
    live_gathered: u64,
    peak_gathered: u64,
    require_backward_grad_sync: bool,
    comm: Duration,
    /// Payload bytes of the all-gathers and gradient reductions since construction.
    comm_bytes: u64,
}

impl<M: Segmented> std::fmt::Debug for FullyShardedDataParallel<'_, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FullyShardedDataParallel")
            .field("rank", &self.pg.rank())
            .field("world_size", &self.pg.world_size())
            .field("sharding_strategy", &self.config.sharding_strategy)
            .field("units", &self.units.len())
            .finish()
    }
}

/// True when autograd records operations here (not inside `no_grad`).
fn grad_enabled() -> bool {
    let probe = Tensor::zeros([1], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    (&probe * 1.0).requires_grad()
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
    pub fn new(vs: nn::VarStore, module: M, pg: &'pg dyn ProcessGroup, config: FsdpConfig) -> Result<Self> {
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
        check_var_store(&vs, &params, rank)?;
        let seg_params = segment_params(&module, &params, rank)?;
        let units = plan_units(&module, config.min_num_params, config.sharding_strategy, w)?;
        if config.sync_module_states && w > 1 {
            let mut ts: Vec<Tensor> = params.iter().map(|(_, t)| t.detach()).collect();
            tch::no_grad(|| pg.broadcast_coalesced(&mut ts, 0))?;
        }
        let sharded = config.sharding_strategy.is_sharded();
        let shard_vs = nn::VarStore::new(pg.device());
        let mut shards = Vec::with_capacity(units.len());
        for unit in &units {
            let flat = tch::no_grad(|| {
                let pieces: Vec<Tensor> = unit.params.iter().map(|&p| params[p].1.detach().reshape([-1])).collect();
                flatten_padded(&pieces, unit)
            });
            let (start, len) = unit.shard_range(rank, sharded);
            let shard = tch::no_grad(|| flat.narrow(0, start, len).copy());
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
            full_grads: (0..n_units).map(|_| None).collect(),
            saved: Vec::new(),
            output: None,
            train: false,
            pg,
            config,
            live_gathered: 0,
            peak_gathered: 0,
            require_backward_grad_sync: true,
            comm: Duration::ZERO,
            comm_bytes: 0,
        })
    }

    /// The wrapped model (PyTorch's `fsdp.module`). Its parameter tensors hold 0 elements
    /// except while a unit is gathered; use [`full_state_dict`](Self::full_state_dict) to read
    /// the weights.
    pub fn module(&self) -> &M {
        &self.module
    }

    /// This process's rank in the group.
    pub fn rank(&self) -> usize {
        self.pg.rank()
    }

    /// Number of ranks the model is sharded over.
    pub fn world_size(&self) -> usize {
        self.pg.world_size()
    }

    /// The configuration it was built with.
    pub fn config(&self) -> &FsdpConfig {
        &self.config
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
    /// reduce-scatter / all-reduce inputs.
    pub fn comm_bytes(&self) -> u64 {
        self.comm_bytes
    }

    fn param_kind(&self, u: usize) -> Kind {
        self.config.mixed_precision.map_or(self.shards[u].kind(), |mp| mp.param_dtype.kind())
    }

    fn reduce_kind(&self, u: usize) -> Kind {
        self.config.mixed_precision.map_or(self.shards[u].kind(), |mp| mp.reduce_dtype.kind())
    }

    /// All-gathers unit `u` (in the compute dtype) and points the model's parameters at it.
    fn gather(&mut self, u: usize) -> Result<()> {
        if self.gathered[u].is_some() {
            return Ok(());
        }
        let pkind = self.param_kind(u);
        let shard = self.shards[u].detach();
        let unit = &self.units[u];
        let (full, bytes) = tch::no_grad(|| -> Result<(Tensor, u64)> {
            if !self.config.sharding_strategy.is_sharded() {
                // NoShard: the "shard" is the whole flat parameter; only a dtype cast copies.
                return Ok(if pkind == shard.kind() {
                    (shard, 0)
                } else {
                    (shard.to_kind(pkind), unit.numel as u64 * pkind.elt_size_in_bytes() as u64)
                });
            }
            let input = shard.to_kind(pkind).contiguous();
            let mut full = Tensor::empty([unit.padded_numel], (pkind, shard.device()));
            let t0 = Instant::now();
            self.pg.all_gather(&mut full, &input)?;
            self.comm += t0.elapsed();
            self.comm_bytes += unit.padded_numel as u64 * pkind.elt_size_in_bytes() as u64;
            Ok((full, unit.padded_numel as u64 * pkind.elt_size_in_bytes() as u64))
        })?;
        for (k, &p) in unit.params.iter().enumerate() {
            let n: i64 = unit.shapes[k].iter().product();
            let view = full.narrow(0, unit.offsets[k], n).view(unit.shapes[k].as_slice());
            self.params[p].1.f_set_data(&view)?;
        }
        self.live_gathered += bytes;
        self.peak_gathered = self.peak_gathered.max(self.live_gathered);
        self.gathered[u] = Some((full, bytes));
        Ok(())
    }

    /// Frees unit `u`'s gathered parameters (the model's tensors go back to 0 elements).
    fn free(&mut self, u: usize) -> Result<()> {
        if let Some((full, bytes)) = self.gathered[u].take() {
            for &p in &self.units[u].params {
                let empty = Tensor::empty([0], (full.kind(), full.device()));
                self.params[p].1.f_set_data(&empty)?;
            }
            self.live_gathered -= bytes;
        }
        Ok(())
    }

    fn free_all(&mut self) -> Result<()> {
        for u in 0..self.units.len() {
            self.free(u)?;
        }
        Ok(())
    }

    /// The wrapped model's forward pass (`fsdp(x)`), segment by segment, gathering each unit
    /// before its first segment. Input and output as the model's (BasicNet: `[batch, 1, 28, 28]`
    /// → `[batch, 10]` f32 log-probabilities); under mixed precision a floating input is cast
    /// to `param_dtype`.
    ///
    /// In grad mode the output is a leaf that requires grad: compute the loss from it and pass
    /// the loss to [`backward`](Self::backward). Under `no_grad` (evaluation) nothing is kept
    /// for backward and every unit is freed after its last segment.
    ///
    /// # Errors
    /// Collective errors from the all-gathers; [`Error::Torch`] if a shape does not fit.
    pub fn forward_t(&mut self, xs: &Tensor, train: bool) -> Result<Tensor> {
        self.saved.clear();
        self.output = None;
        // Shards may have changed since the last gather (an optimizer step): gather afresh.
        self.free_all()?;
        let grad = grad_enabled();
        let strategy = self.config.sharding_strategy;
        let mut x = match self.config.mixed_precision {
            Some(mp) if xs.is_floating_point() => xs.to_kind(mp.param_dtype.kind()),
            _ => xs.shallow_clone(),
        };
        for i in 0..self.seg_params.len() {
            let unit = self.seg_unit[i];
            if let Some(u) = unit {
                self.gather(u)?;
            }
            let recompute = grad && unit.is_some() && strategy.reshard_after_forward();
            let x_in = if grad && i > 0 { x.detach().set_requires_grad(true) } else { x.detach() };
            let y = if recompute {
                tch::no_grad(|| self.module.segment_forward(i, &x_in, train))
            } else {
                self.module.segment_forward(i, &x_in, train)
            };
            if grad {
                self.saved.push(Saved { x: x_in, y: (!recompute).then(|| y.shallow_clone()) });
            }
            if let Some(u) = unit {
                let last = self.units[u].segments.last() == Some(&i);
                if last && (recompute || (!grad && strategy.is_sharded())) {
                    self.free(u)?;
                }
            }
            x = y;
        }
        if !grad {
            return Ok(x);
        }
        let out = x.detach().set_requires_grad(true);
        self.output = Some(out.shallow_clone());
        self.train = train;
        Ok(out)
    }

    /// Runs `loss.backward()` (which stops at the output of [`forward_t`](Self::forward_t)),
    /// then backpropagates segment by segment in reverse, recomputing `FullShard` units, and —
    /// unless inside [`no_sync`](Self::no_sync) — reduces each unit's gradient as soon as it is
    /// complete: reduce-scatter(Avg) into the shard's `.grad` (accumulating, as PyTorch), or
    /// all-reduce(Avg) for `NoShard`. Call it where single-process code calls
    /// `loss.backward()`: `zero_grad` → `backward` → (`clip_grad_norm`) → `step`.
    ///
    /// # Errors
    /// [`Error::Fsdp`] when no grad-mode `forward_t` precedes it (or it is called twice for one
    /// forward); collective errors; [`Error::Torch`] from autograd.
    pub fn backward(&mut self, loss: &Tensor) -> Result<()> {
        let Some(out) = self.output.take() else {
            return Err(Error::Fsdp {
                rank: self.pg.rank(),
                problem: "backward called without a preceding forward_t in grad mode (or twice for one forward); \
                          expected forward_t(x, train) → loss → backward(&loss)"
                    .into(),
            });
        };
        tch::with_grad(|| loss.f_backward())?;
        let mut g = out.grad();
        if !g.defined() {
            g = out.zeros_like();
        }
        let saved = std::mem::take(&mut self.saved);
        for i in (0..saved.len()).rev() {
            let unit = self.seg_unit[i];
            let s = &saved[i];
            let y = match &s.y {
                Some(y) => y.shallow_clone(),
                None => {
                    let u = unit.expect("only segments of a unit are recomputed");
                    self.gather(u)?;
                    tch::with_grad(|| self.module.segment_forward(i, &s.x, self.train))
                }
            };
            let want_x = i > 0 && s.x.requires_grad();
            let mut inputs: Vec<Tensor> = Vec::new();
            if want_x {
                inputs.push(s.x.shallow_clone());
            }
            inputs.extend(self.seg_params[i].iter().map(|&p| self.params[p].1.shallow_clone()));
            let grads: Vec<Tensor> = if inputs.is_empty() || !y.requires_grad() {
                Vec::new()
            } else {
                // torch.autograd.grad(y, inputs, grad_outputs=g): nothing accumulates in .grad.
                tch::with_grad(|| {
                    let root = (&y * &g).sum(y.kind());
                    Tensor::f_run_backward(&[root], &inputs, false, false)
                })?
            };
            let grad_of = |k: usize| grads.get(k).filter(|t| t.defined());
            if let Some(u) = unit {
                let unit_ref = &self.units[u];
                let pkind = self.param_kind(u);
                let fg = self.full_grads[u]
                    .get_or_insert_with(|| Tensor::zeros([unit_ref.padded_numel], (pkind, self.shards[u].device())));
                tch::no_grad(|| {
                    for (k, &p) in self.seg_params[i].iter().enumerate() {
                        if let Some(gp) = grad_of(usize::from(want_x) + k) {
                            let j =
                                unit_ref.params.iter().position(|&q| q == p).expect("segment params are in the unit");
                            let n: i64 = unit_ref.shapes[j].iter().product();
                            let _ =
                                fg.narrow(0, unit_ref.offsets[j], n).view(unit_ref.shapes[j].as_slice()).f_add_(gp)?;
                        }
                    }
                    Ok::<(), tch::TchError>(())
                })?;
            }
            if want_x {
                g = match grad_of(0) {
                    Some(gx) => gx.shallow_clone(),
                    None => s.x.zeros_like(),
                };
            }
            if let Some(u) = unit {
                if self.units[u].segments.first() == Some(&i) {
                    self.finish_unit(u)?;
                }
            }
        }
        Ok(())
    }

    /// A unit's gradient is complete: reduce it into the shard's gradient (unless under
    /// `no_sync`) and free the gathered parameters (sharded strategies).
    fn finish_unit(&mut self, u: usize) -> Result<()> {
        if self.require_backward_grad_sync {
            if let Some(fg) = self.full_grads[u].take() {
                let rkind = self.reduce_kind(u);
                let shard = self.shards[u].shallow_clone();
                let reduced = tch::no_grad(|| -> Result<Tensor> {
                    let mut input = fg.to_kind(rkind).contiguous();
                    let bytes = (input.numel() * input.kind().elt_size_in_bytes()) as u64;
                    let t0 = Instant::now();
                    let out = if self.config.sharding_strategy.is_sharded() {
                        let mut out = Tensor::zeros([self.units[u].shard_numel], (rkind, input.device()));
                        self.pg.reduce_scatter(&mut out, &input, ReduceOp::Avg)?;
                        out
                    } else {
                        self.pg.all_reduce(&mut input, ReduceOp::Avg)?;
                        input
                    };
                    self.comm += t0.elapsed();
                    self.comm_bytes += bytes;
                    Ok(out.to_kind(shard.kind()))
                })?;
                // Accumulate into shard.grad (defined or not — zero_grad sets it to None):
                // d/dshard of sum(shard * reduced) is exactly `reduced`.
                tch::with_grad(|| (&shard * &reduced).sum(shard.kind()).f_backward())?;
            }
        }
        if self.config.sharding_strategy.is_sharded() {
            self.free(u)?;
        }
        Ok(())
    }

    /// Runs `f` with gradient reduction off, as `with fsdp.no_sync():` — unsharded gradients
    /// accumulate locally (full size per unit, as PyTorch); the next `backward` outside reduces
    /// the accumulated sum.
    pub fn no_sync<R>(&mut self, f: impl FnOnce(&mut Self) -> R) -> R {
        let before = self.require_backward_grad_sync;
        self.require_backward_grad_sync = false;
        let out = f(self);
        self.require_backward_grad_sync = before;
        out
    }

    /// Clips the gradients of all shards by their global L2 norm, as
    /// `FullyShardedDataParallel.clip_grad_norm_(max_norm)`: the squared norms of the local
    /// shards are summed over ranks with one all-reduce (none for `NoShard`, whose ranks each
    /// hold the whole gradient), then every gradient is scaled by
    /// `min(1, max_norm / (total_norm + 1e-6))`. Returns the total norm (before clipping).
    /// Padding holds zero gradients and does not change the norm.
    ///
    /// # Errors
    /// [`Error::InvalidValue`] for a `max_norm` that is not positive and finite; collective
    /// errors.
    pub fn clip_grad_norm(&self, max_norm: f64) -> Result<f64> {
        if !(max_norm.is_finite() && max_norm > 0.0) {
            return Err(Error::invalid("max_norm", max_norm, "a positive, finite gradient norm"));
        }
        tch::no_grad(|| {
            let mut local_sq = 0.0;
            for s in &self.shards {
                let g = s.grad();
                if g.defined() {
                    local_sq += g.to_kind(Kind::Double).square().sum(Kind::Double).double_value(&[]);
                }
            }
            let total_sq = if self.config.sharding_strategy.is_sharded() && self.pg.world_size() > 1 {
                let mut t = Tensor::from_slice(&[local_sq]).to_device(self.pg.device());
                self.pg.all_reduce(&mut t, ReduceOp::Sum)?;
                t.double_value(&[0])
            } else {
                local_sq
            };
            let total = total_sq.sqrt();
            let coef = (max_norm / (total + 1e-6)).min(1.0);
            if coef < 1.0 {
                for s in &self.shards {
                    let mut g = s.grad();
                    if g.defined() {
                        let _ = g.f_mul_scalar_(coef)?;
                    }
                }
            }
            Ok(total)
        })
    }

    /// The full state dict, gathered (all-gather of every shard) and returned on rank 0 only, as
    /// `FULL_STATE_DICT` with `rank0_only=True`: keys and shapes exactly those of the unwrapped
    /// model's `named_parameters()` (no wrapper prefixes, padding removed), in definition
    /// order, dtype of the shards (the fp32 master weights under mixed precision). Loadable
    /// into a single-process model by name. Other ranks get `None`; every rank must call it.
    ///
    /// # Errors
    /// Collective errors.
    pub fn full_state_dict(&self) -> Result<Option<Vec<(String, Tensor)>>> {
        let shards: Vec<Tensor> = self.shards.iter().map(|s| s.detach()).collect();
        self.gather_full(&shards)
    }

    /// Gathers tensors laid out like this rank's shards (one `[shard_numel]` tensor per unit,
    /// e.g. the shards themselves or AdamW's moments of them) into per-parameter tensors with the
    /// unwrapped model's keys and shapes, padding removed — on rank 0 (`None` elsewhere). One
    /// all-gather per unit (none for `NoShard`). Every rank must call it.
    ///
    /// # Errors
    /// [`Error::Fsdp`] when `per_unit` does not hold one shard-shaped tensor per unit; collective
    /// errors.
    pub fn gather_full(&self, per_unit: &[Tensor]) -> Result<Option<Vec<(String, Tensor)>>> {
        let rank = self.pg.rank();
        if per_unit.len() != self.units.len()
            || per_unit.iter().zip(&self.units).any(|(t, u)| t.numel() as i64 != u.shard_numel)
        {
            return Err(Error::Fsdp {
                rank,
                problem: format!(
                    "gather_full expects one tensor of shard_numel elements per unit ({:?}), got {:?}",
                    self.units.iter().map(|u| u.shard_numel).collect::<Vec<_>>(),
                    per_unit.iter().map(|t| t.numel()).collect::<Vec<_>>()
                ),
            });
        }
        let mut per_param: Vec<Option<Tensor>> = (0..self.params.len()).map(|_| None).collect();
        tch::no_grad(|| -> Result<()> {
            for (u, unit) in self.units.iter().enumerate() {
                let shard = per_unit[u].detach().contiguous();
                let full = if self.config.sharding_strategy.is_sharded() {
                    let mut full = Tensor::empty([unit.padded_numel], (shard.kind(), shard.device()));
                    self.pg.all_gather(&mut full, &shard)?;
                    full
                } else {
                    shard
                };
                if rank == 0 {
                    for (k, &p) in unit.params.iter().enumerate() {
                        let n: i64 = unit.shapes[k].iter().product();
                        per_param[p] = Some(full.narrow(0, unit.offsets[k], n).view(unit.shapes[k].as_slice()).copy());
                    }
                }
            }
            Ok(())
        })?;
        if rank != 0 {
            return Ok(None);
        }
        Ok(Some(
            self.params
                .iter()
                .zip(per_param)
                .map(|((name, _), t)| (name.clone(), t.expect("every parameter is in a unit")))
                .collect(),
        ))
    }

    /// The inverse of [`gather_full`](Self::gather_full): from per-parameter tensors with the
    /// unwrapped model's keys and shapes (any floating dtype), this rank's shard of each unit
    /// (`[shard_numel]`, in the shards' dtype and device). No communication.
    ///
    /// # Errors
    /// [`Error::StateDict`] naming missing, duplicated or unexpected keys, or shapes that differ.
    pub fn shard_full(&self, full: &[(String, Tensor)]) -> Result<Vec<Tensor>> {
        let map = by_key(full, "full")?;
        let expected: BTreeMap<&str, &[i64]> = self
            .units
            .iter()
            .flat_map(|u| u.param_names.iter().zip(&u.shapes).map(|(n, s)| (n.as_str(), s.as_slice())))
            .collect();
        check_keys(&map, &expected, "full", "the unwrapped model's named_parameters()")?;
        let (rank, sharded) = (self.pg.rank(), self.config.sharding_strategy.is_sharded());
        tch::no_grad(|| {
            self.units
                .iter()
                .enumerate()
                .map(|(u, unit)| {
                    let (kind, device) = (self.shards[u].kind(), self.shards[u].device());
                    let pieces: Vec<Tensor> = unit
                        .param_names
                        .iter()
                        .map(|n| map[n.as_str()].to_device(device).to_kind(kind).reshape([-1]))
                        .collect();
                    let flat = flatten_padded(&pieces, unit);
                    let (start, len) = unit.shard_range(rank, sharded);
                    Ok(flat.narrow(0, start, len).copy())
                })
                .collect()
        })
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

    /// Turns the gradient reduction of the next backwards on or off (what
    /// [`no_sync`](Self::no_sync) toggles for the duration of a closure).
    pub fn set_require_backward_grad_sync(&mut self, sync: bool) {
        self.require_backward_grad_sync = sync;
    }

    /// Loads a full state dict (keys and shapes of the unwrapped model, any floating dtype):
    /// every rank passes the same dict and keeps its own shard of it. No communication. The
    /// optimizer keeps working on the same shard tensors (they are overwritten in place).
    ///
    /// # Errors
    /// [`Error::StateDict`] naming a missing, duplicated or unexpected key, or a key whose shape
    /// differs from the model's (expected vs found).
    pub fn load_full_state_dict(&mut self, state_dict: &[(String, Tensor)]) -> Result<()> {
        let mine = self.shard_full(state_dict)?;
        self.free_all()?;
        tch::no_grad(|| -> Result<()> {
            for (shard, src) in self.shards.iter().zip(mine) {
                shard.detach().f_copy_(&src)?;
            }
            Ok(())
        })
    }

    /// This rank's shards as a state dict (PyTorch's local state dict): one entry per unit,
    /// key [`FlatParamUnit::key`], shape `[shard_numel]`, the shard's dtype; copies.
    pub fn sharded_state_dict(&self) -> Vec<(String, Tensor)> {
        self.units.iter().zip(&self.shards).map(|(u, s)| (u.key(), s.detach().copy())).collect()
    }

    /// Loads what [`sharded_state_dict`](Self::sharded_state_dict) returned on this rank, at
    /// the same world size and wrapping. No communication.
    ///
    /// # Errors
    /// [`Error::StateDict`] naming a missing, duplicated or unexpected key or a shard whose
    /// shape differs (expected vs found; a different world size or wrapping shows up here).
    pub fn load_sharded_state_dict(&mut self, state_dict: &[(String, Tensor)]) -> Result<()> {
        let map = by_key(state_dict, "sharded")?;
        let shapes: Vec<(String, [i64; 1])> = self.units.iter().map(|u| (u.key(), [u.shard_numel])).collect();
        let expected: BTreeMap<&str, &[i64]> = shapes.iter().map(|(k, s)| (k.as_str(), s.as_slice())).collect();
        let what = format!(
            "the shards of rank {} of {} ({}, min_num_params {})",
            self.pg.rank(),
            self.pg.world_size(),
            self.config.sharding_strategy,
            self.config.min_num_params
        );
        check_keys(&map, &expected, "sharded", &what)?;
        self.free_all()?;
        tch::no_grad(|| -> Result<()> {
            for (u, unit) in self.units.iter().enumerate() {
                let s = &self.shards[u];
                let src = map[unit.key().as_str()].to_device(s.device()).to_kind(s.kind());
                s.detach().f_copy_(&src)?;
            }
            Ok(())
        })
    }

    /// Debug check that the ranks agree: for `NoShard` every rank's full parameters must be
    /// bit-identical; for the sharded strategies the unit layouts must match (the shards
    /// themselves differ by design). Uses [`crate::ddp::check_in_sync`].
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
                    (format!("layout of unit {}", u.display_name()), Tensor::from_slice(&v).to_device(self.pg.device()))
                })
                .collect();
            check_in_sync(self.pg, &layout)
        } else {
            let named: Vec<(String, Tensor)> =
                self.units.iter().zip(&self.shards).map(|(u, s)| (u.key(), s.detach())).collect();
            check_in_sync(self.pg, &named)
        }
    }

    /// The unit layout as a table, for `--explain`.
    pub fn explain(&self) -> String {
        explain_units(&self.units, self.config.sharding_strategy, self.pg.world_size(), self.config.min_num_params)
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
            + self.full_grads.iter().flatten().map(bytes).sum::<u64>();
        ModelStateBytes { parameters, gradients, optimizer: 2 * parameters, gathered_peak: self.peak_gathered }
    }
    // ANCHOR_END: fsdp_memory
}

/// Concatenates flat pieces and zero-pads to the unit's padded numel.
fn flatten_padded(pieces: &[Tensor], unit: &FlatParamUnit) -> Tensor {
    let mut flat = Tensor::cat(pieces, 0);
    let pad = unit.padded_numel - unit.numel;
    if pad > 0 {
        let zeros = Tensor::zeros([pad], (flat.kind(), flat.device()));
        flat = Tensor::cat(&[flat, zeros], 0);
    }
    flat
}

/// Checks `vs` holds exactly the module's parameters (same tensors, not just the same names).
fn check_var_store(vs: &nn::VarStore, params: &[(String, Tensor)], rank: usize) -> Result<()> {
    let vars = vs.trainable_variables();
    let in_vs: std::collections::HashSet<usize> = vars.iter().map(|t| t.data_ptr() as usize).collect();
    for (name, t) in params {
        if t.numel() > 0 && !in_vs.contains(&(t.data_ptr() as usize)) {
            return Err(Error::Fsdp {
                rank,
                problem: format!(
                    "parameter {name} is not a variable of the VarStore passed in; expected the VarStore the model was built in"
                ),
            });
        }
    }
    if vars.len() != params.len() {
        return Err(Error::Fsdp {
            rank,
            problem: format!(
                "the VarStore passed in holds {} trainable variables but the model has {} parameters; \
                 expected the VarStore of this model alone",
                vars.len(),
                params.len()
            ),
        });
    }
    Ok(())
}

fn by_key<'a>(state_dict: &'a [(String, Tensor)], which: &str) -> Result<BTreeMap<&'a str, &'a Tensor>> {
    let mut map = BTreeMap::new();
    for (k, t) in state_dict {
        if map.insert(k.as_str(), t).is_some() {
            return Err(Error::StateDict(format!("{which} state dict holds key {k} twice; expected each key once")));
        }
    }
    Ok(map)
}

fn check_keys(map: &BTreeMap<&str, &Tensor>, expected: &BTreeMap<&str, &[i64]>, which: &str, what: &str) -> Result<()> {
    for (k, shape) in expected {
        match map.get(k) {
            None => {
                let suffix = format!(".{k}");
                let hint = match map.keys().find(|found| found.ends_with(&suffix)) {
                    Some(found) => format!("; found {found}, which looks like it carries a wrapper prefix: strip it"),
                    None => String::new(),
                };
                return Err(Error::StateDict(format!(
                    "{which} state dict is missing key {k} (expected shape {shape:?}); expected the keys of {what}{hint}"
                )));
            }
            Some(t) if t.size().as_slice() != *shape => {
                return Err(Error::StateDict(format!(
                    "{which} state dict key {k}: expected shape {shape:?}, found {:?}",
                    t.size()
                )))
            }
            Some(t) if !t.is_floating_point() => {
                return Err(Error::StateDict(format!(
                    "{which} state dict key {k}: expected a floating-point tensor, found {:?}",
                    t.kind()
                )))
            }
            Some(_) => {}
        }
    }
    if let Some(k) = map.keys().find(|k| !expected.contains_key(*k)) {
        let keys: Vec<&str> = expected.keys().copied().collect();
        return Err(Error::StateDict(format!(
            "{which} state dict has unexpected key {k}; expected the keys of {what}: {}",
            keys.join(", ")
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strategy_names_match_pytorch_in_kebab_case() {
        use clap::ValueEnum;
        let names: Vec<String> = ShardingStrategy::value_variants()
            .iter()
            .map(|v| v.to_possible_value().expect("named").get_name().to_string())
            .collect();
        assert_eq!(names, ["full-shard", "shard-grad-op", "no-shard"]);
        for v in ShardingStrategy::value_variants() {
            assert_eq!(serde_json::to_string(v).unwrap(), format!("\"{v}\""));
        }
        assert_eq!(ShardingStrategy::default(), ShardingStrategy::FullShard);
    }

    #[test]
    fn config_defaults_and_serde_round_trip() {
        let c = FsdpConfig::default();
        assert_eq!(c.min_num_params, 100_000_000);
        assert!(c.sync_module_states && c.mixed_precision.is_none());
        let mp = FsdpConfig { mixed_precision: Some(MixedPrecision::bf16()), ..c };
        let json = serde_json::to_string(&mp).unwrap();
        assert!(json.contains("\"param_dtype\":\"bf16\""), "{json}");
        assert_eq!(serde_json::from_str::<FsdpConfig>(&json).unwrap(), mp);
        // Missing fields take the defaults.
        let partial: FsdpConfig = serde_json::from_str(r#"{"sharding_strategy":"no-shard"}"#).unwrap();
        assert_eq!(partial, FsdpConfig { sharding_strategy: ShardingStrategy::NoShard, ..FsdpConfig::default() });
    }
}
