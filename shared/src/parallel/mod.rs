//! How the model is spread over ranks: the one vocabulary every level speaks, and the
//! strategies themselves.
//!
//! Each choice is defined here once and parses every spelling its users know, so a level reads
//! the user's words straight into these types and converts nothing:
//!
//! | choice | values (flag spelling) | also read from |
//! |---|---|---|
//! | [`Strategy`] | `ddp`, `fsdp-full-shard`, `fsdp-shard-grad-op`, `fsdp-no-shard`, `fsdp-hybrid-shard`, `fsdp-hybrid-shard-zero2` | the sharding strategy's spellings (`full_shard`, `FULL_SHARD`) |
//! | [`ShardingStrategy`] | `full-shard`, `shard-grad-op`, `no-shard`, `hybrid-shard`, `hybrid-shard-zero2` | PyTorch's `FULL_SHARD` / `ShardingStrategy.FULL_SHARD` / `_HYBRID_SHARD_ZERO2`, Accelerate's `1`..`5`, Transformers' `full_shard` / `hybrid_shard_zero2` |
//! | [`BackwardPrefetch`] | `backward-pre`, `backward-post`, `no-prefetch` | PyTorch's `BACKWARD_PRE` / `BackwardPrefetch.BACKWARD_PRE`, Accelerate's `1`, `2`, `NO_PREFETCH` |
//! | [`Precision`] | `no`, `bf16`, `fp16` | `fp32`, `bfloat16`, `torch.bfloat16`, `float16`, `torch.float16` |
//!
//! Reading is case-insensitive and takes `_` for `-` (see [`choice`]). A [`Strategy`]'s variant
//! carries the options of that strategy (DDP's bucket cap; FSDP's sharding strategy, auto-wrap
//! threshold and prefetch), so an option cannot be set on a strategy it does not belong to;
//! options given apart from the strategy's name (a flag, a config key) are applied with
//! [`Strategy::with_options`], which names the one that does not fit.
//!
//! The strategies: [`ddp`] (`DistributedDataParallel`), [`fsdp`] (`FullyShardedDataParallel`),
//! and [`wrapped`], the model every level trains, which delegates to either.

pub mod checkpointing;
pub mod choice;
pub mod data_parallel;
pub mod ddp;
pub mod fsdp;
pub mod offload;
pub mod wrapped;
pub mod zero;

pub use choice::{Choice, ChoiceError};
pub use data_parallel::{DataParallel, GradSync};
pub use ddp::DistributedDataParallel;
pub use fsdp::FullyShardedDataParallel;
pub use offload::{NvmeOffload, OffloadDevice, OptimizerOffload};
pub use wrapped::WrappedModel;

use crate::{Error, Result};
use clap::builder::PossibleValue;
use clap::ValueEnum;
use serde::{Deserialize, Serialize};
use tch::Kind;

/// How parameters, gradients and optimizer state are split over ranks, with PyTorch's names
/// (`torch.distributed.fsdp.ShardingStrategy`). Written as PyTorch's `FULL_SHARD`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, ValueEnum)]
pub enum ShardingStrategy {
    /// ZeRO-3: parameters, gradients and optimizer state sharded; parameters all-gathered
    /// before forward, freed after it, all-gathered again for backward (PyTorch's default).
    #[default]
    #[value(name = "full-shard", alias = "FULL_SHARD", alias = "ShardingStrategy.FULL_SHARD", alias = "1")]
    FullShard,
    /// ZeRO-2: as full-shard, but the gathered parameters are kept from forward to backward
    /// (one all-gather per step instead of two).
    #[value(name = "shard-grad-op", alias = "SHARD_GRAD_OP", alias = "ShardingStrategy.SHARD_GRAD_OP", alias = "2")]
    ShardGradOp,
    /// No sharding: full parameters on every rank, gradients all-reduced — DDP's behaviour
    /// through FSDP's code path.
    #[value(name = "no-shard", alias = "NO_SHARD", alias = "ShardingStrategy.NO_SHARD", alias = "3")]
    NoShard,
    /// HSDP: FULL_SHARD within each shard group (dp_shard_size ranks, by default one node's),
    /// replicas across the groups; gradients reduce-scattered in the shard group, then
    /// all-reduced (averaged over the world) across the replicas.
    #[value(name = "hybrid-shard", alias = "HYBRID_SHARD", alias = "ShardingStrategy.HYBRID_SHARD", alias = "4")]
    HybridShard,
    /// As hybrid-shard, with SHARD_GRAD_OP (ZeRO-2) within the shard group: gathered parameters
    /// kept from forward to backward (PyTorch's private _HYBRID_SHARD_ZERO2).
    #[value(
        name = "hybrid-shard-zero2",
        alias = "_HYBRID_SHARD_ZERO2",
        alias = "HYBRID_SHARD_ZERO2",
        alias = "ShardingStrategy._HYBRID_SHARD_ZERO2",
        alias = "5"
    )]
    HybridShardZero2,
}

impl Choice for ShardingStrategy {
    const WHAT: &'static str = "sharding strategy";
    fn name(self) -> &'static str {
        match self {
            ShardingStrategy::FullShard => "FULL_SHARD",
            ShardingStrategy::ShardGradOp => "SHARD_GRAD_OP",
            ShardingStrategy::NoShard => "NO_SHARD",
            ShardingStrategy::HybridShard => "HYBRID_SHARD",
            ShardingStrategy::HybridShardZero2 => "_HYBRID_SHARD_ZERO2",
        }
    }
}
crate::impl_choice!(ShardingStrategy);

impl ShardingStrategy {
    /// True for the strategies that keep 1/W of each FlatParameter per rank.
    pub fn is_sharded(self) -> bool {
        self != ShardingStrategy::NoShard
    }

    /// True when gathered parameters are freed after forward (ZeRO-3).
    pub fn reshard_after_forward(self) -> bool {
        matches!(self, ShardingStrategy::FullShard | ShardingStrategy::HybridShard)
    }

    /// True for HSDP (`HYBRID_SHARD`, `_HYBRID_SHARD_ZERO2`): sharded within a shard group,
    /// replicated across the replicate group.
    pub fn is_hybrid(self) -> bool {
        matches!(self, ShardingStrategy::HybridShard | ShardingStrategy::HybridShardZero2)
    }
}

/// When FSDP's backward all-gathers the next unit's parameters ahead of need, with PyTorch's
/// names (`torch.distributed.fsdp.BackwardPrefetch`, and `None`, Accelerate's `NO_PREFETCH`).
/// Only full-shard re-gathers in backward, so only it prefetches there. Written as
/// Accelerate's `BACKWARD_PRE`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, ValueEnum)]
pub enum BackwardPrefetch {
    /// `BackwardPrefetch.BACKWARD_PRE`: the next unit's all-gather starts before the current
    /// unit's gradient computation (most overlap; two units' parameters alive at once).
    /// PyTorch's default.
    #[default]
    #[value(name = "backward-pre", alias = "BACKWARD_PRE", alias = "BackwardPrefetch.BACKWARD_PRE", alias = "1")]
    BackwardPre,
    /// `BackwardPrefetch.BACKWARD_POST`: it starts after the current unit's gradient
    /// computation, once that unit's parameters are freed (less memory).
    #[value(name = "backward-post", alias = "BACKWARD_POST", alias = "BackwardPrefetch.BACKWARD_POST", alias = "2")]
    BackwardPost,
    /// `backward_prefetch=None`: each unit is all-gathered when backward reaches it
    /// (Accelerate's and Transformers' default).
    #[value(name = "no-prefetch", alias = "NO_PREFETCH")]
    NoPrefetch,
}

impl Choice for BackwardPrefetch {
    const WHAT: &'static str = "backward prefetch";
    fn name(self) -> &'static str {
        match self {
            BackwardPrefetch::BackwardPre => "BACKWARD_PRE",
            BackwardPrefetch::BackwardPost => "BACKWARD_POST",
            BackwardPrefetch::NoPrefetch => "NO_PREFETCH",
        }
    }
}
crate::impl_choice!(BackwardPrefetch);

/// Mixed precision, as Accelerate's `mixed_precision` (`no` | `bf16` | `fp16`; Transformers'
/// `bf16` and `fp16` arguments): forward and backward in the low-precision dtype, fp32 master
/// weights, fp32 AdamW state and fp32 gradient reduction (FSDP's `MixedPrecision(param_dtype,
/// reduce_dtype=float32)`; see [`Precision::policy`]). `fp16` needs CUDA and dynamic loss
/// scaling (the Accelerator's). Written as Accelerate's `no`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, ValueEnum)]
pub enum Precision {
    /// fp32 throughout, as the tutorial.
    #[default]
    #[value(name = "no", alias = "fp32", alias = "float32", alias = "torch.float32")]
    No,
    /// bfloat16 compute, fp32 master weights, optimizer state and gradient reduction.
    #[value(name = "bf16", alias = "bfloat16", alias = "torch.bfloat16")]
    Bf16,
    /// float16 compute with dynamic loss scaling (CUDA only), fp32 master weights.
    #[value(name = "fp16", alias = "float16", alias = "torch.float16")]
    Fp16,
}

impl Choice for Precision {
    const WHAT: &'static str = "mixed precision";
    fn name(self) -> &'static str {
        match self {
            Precision::No => "no",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        }
    }
    fn unsupported(text: &str) -> Option<&'static str> {
        text.trim().eq_ignore_ascii_case("fp8").then_some("fp8 is not supported by ddp-ladder")
    }
}
crate::impl_choice!(Precision);

impl Precision {
    /// The compute dtype's name for tables: `fp32`, `bf16`, `fp16`.
    pub fn label(self) -> &'static str {
        match self {
            Precision::No => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        }
    }

    /// The policy the strategies apply: `None` for fp32; otherwise compute in the
    /// low-precision dtype and reduce gradients in fp32.
    pub fn policy(self) -> Option<MixedPrecision> {
        match self {
            Precision::No => None,
            Precision::Bf16 => Some(MixedPrecision { param_dtype: Dtype::Bf16, reduce_dtype: Dtype::F32 }),
            Precision::Fp16 => Some(MixedPrecision { param_dtype: Dtype::F16, reduce_dtype: Dtype::F32 }),
        }
    }
}

/// A floating-point dtype by name (`tch::Kind` is not serde). Serde names: `f32`, `f64`,
/// `bf16`, `f16`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
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

/// A mixed-precision policy, as `torch.distributed.fsdp.MixedPrecision(param_dtype,
/// reduce_dtype)`: compute in `param_dtype`, reduce gradients in `reduce_dtype`; the shards
/// (master weights) keep the model's dtype. Users choose a [`Precision`]; this is what it means.
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

/// DDP's options, as `DistributedDataParallel(...)`'s keyword arguments.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DdpOptions {
    /// Gradient bucket cap in MiB (PyTorch's `bucket_cap_mb`, 25); the first bucket is 1 MiB.
    pub bucket_cap_mb: f64,
    /// Start each bucket's all-reduce during backward, as soon as its gradients are final
    /// ([`DistributedDataParallel::forward_segmented`]), as PyTorch's autograd hooks do.
    /// Default false: on CPU the collectives share the cores with backward and the blocking
    /// all-reduce after backward measured faster (see [`ddp`]); it pays with NCCL's stream.
    pub overlap: bool,
    /// ZeRO-1: wrap the optimizer as `ZeroRedundancyOptimizer` (DeepSpeed's ZeRO stage 1) —
    /// each rank keeps and steps the AdamW state of its 1/W of the parameters (a flat,
    /// contiguous partition), then the updated blocks are broadcast from their owners (see
    /// [`zero`]). Default false.
    pub zero_redundancy_optimizer: bool,
}

impl DdpOptions {
    /// PyTorch's defaults: `bucket_cap_mb` 25, no overlap (see [`DdpOptions::overlap`]), a plain
    /// optimizer.
    pub const DEFAULT: DdpOptions = DdpOptions { bucket_cap_mb: 25.0, overlap: false, zero_redundancy_optimizer: false };
}

impl Default for DdpOptions {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// FSDP's options, as `FullyShardedDataParallel(...)`'s keyword arguments, with PyTorch's
/// defaults. The mixed-precision policy is not among them: it comes from the run's
/// [`Precision`], which applies to DDP alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct FsdpOptions {
    /// How state is split over ranks (PyTorch's default `FULL_SHARD`).
    pub sharding_strategy: ShardingStrategy,
    /// `size_based_auto_wrap_policy(min_num_params)`: a layer with at least this many
    /// parameters becomes its own unit. Default 100,000,000 (PyTorch's), i.e. one unit for
    /// BasicNet; 0 wraps every layer.
    pub min_num_params: usize,
    /// When full-shard's backward starts the next unit's all-gather (PyTorch's default
    /// `BACKWARD_PRE`; Accelerate and Transformers default to `NO_PREFETCH`).
    pub backward_prefetch: BackwardPrefetch,
    /// Start the next unit's all-gather before the current unit's forward computation
    /// (sharded strategies). Default false, PyTorch's.
    pub forward_prefetch: bool,
    /// Broadcast rank 0's parameters before sharding, so every rank starts from the same model.
    /// Default true (PyTorch's default is false; the ladder always wants rank 0's weights).
    pub sync_module_states: bool,
    /// The hybrid strategies' shard-group size, as Accelerate's / Transformers'
    /// `ParallelismConfig(dp_shard_size=…)` (then `dp_replicate_size = world_size /
    /// dp_shard_size`): shard groups are runs of `dp_shard_size` consecutive ranks, replicate
    /// groups the ranks with the same position in every run. `None` (default): the ranks of
    /// one node (`LOCAL_WORLD_SIZE`), as PyTorch's `HYBRID_SHARD` without a device mesh.
    /// Ignored by the other strategies.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dp_shard_size: Option<usize>,
    /// CPU offload of the parameters, as PyTorch's `CPUOffload(offload_params=True)`
    /// (Accelerate's `fsdp_offload_params`, Transformers' `fsdp="full_shard offload"`): the
    /// sharded parameters, their gradients and the optimizer state live in host memory
    /// (pinned when the compute device is CUDA) and the optimizer steps there; a unit's shard
    /// is copied to the compute device before each all-gather, and the reduced gradient shard
    /// back to the host. Default false, PyTorch's. See [`fsdp`]'s `offload` room.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub offload_params: bool,
}

impl FsdpOptions {
    /// PyTorch's defaults, with `sharding_strategy`.
    pub const fn with_sharding(sharding_strategy: ShardingStrategy) -> Self {
        FsdpOptions {
            sharding_strategy,
            min_num_params: 100_000_000,
            backward_prefetch: BackwardPrefetch::BackwardPre,
            forward_prefetch: false,
            sync_module_states: true,
            dp_shard_size: None,
            offload_params: false,
        }
    }
}

impl FsdpOptions {
    /// How many ranks the parameters are sharded over at `world_size`: the world, or for the
    /// hybrid strategies [`dp_shard_size`](Self::dp_shard_size) — when not given, the whole
    /// world here (one node), since `LOCAL_WORLD_SIZE` is known only to a launched rank
    /// (the wrapper itself reads it: [`fsdp::mesh::resolve_shard_size`]).
    pub fn shard_group_size(&self, world_size: usize) -> usize {
        match self.dp_shard_size {
            Some(s) if self.sharding_strategy.is_hybrid() => s,
            _ => world_size,
        }
    }
}

impl Default for FsdpOptions {
    fn default() -> Self {
        Self::with_sharding(ShardingStrategy::FullShard)
    }
}

/// How the model is replicated across ranks; each variant carries its own options.
/// Flag spellings: `ddp`, `fsdp-full-shard`, `fsdp-shard-grad-op`, `fsdp-no-shard` (also read:
/// a [`ShardingStrategy`] spelling alone, `full_shard`, `FULL_SHARD`, for FSDP).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Strategy {
    /// DistributedDataParallel: a full replica per rank, gradients all-reduced in buckets.
    Ddp(DdpOptions),
    /// FullyShardedDataParallel with its sharding strategy (ZeRO-3, ZeRO-2, or none).
    Fsdp(FsdpOptions),
}

impl Default for Strategy {
    fn default() -> Self {
        Strategy::Ddp(DdpOptions::DEFAULT)
    }
}

/// The six strategies with their default options, in `--help` order.
static STRATEGIES: [Strategy; 6] = [
    Strategy::Ddp(DdpOptions::DEFAULT),
    Strategy::Fsdp(FsdpOptions::with_sharding(ShardingStrategy::FullShard)),
    Strategy::Fsdp(FsdpOptions::with_sharding(ShardingStrategy::ShardGradOp)),
    Strategy::Fsdp(FsdpOptions::with_sharding(ShardingStrategy::NoShard)),
    Strategy::Fsdp(FsdpOptions::with_sharding(ShardingStrategy::HybridShard)),
    Strategy::Fsdp(FsdpOptions::with_sharding(ShardingStrategy::HybridShardZero2)),
];

impl ValueEnum for Strategy {
    fn value_variants<'a>() -> &'a [Self] {
        &STRATEGIES
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        let help = match self.sharding() {
            None => "DistributedDataParallel: a full replica per rank, gradients all-reduced in buckets",
            Some(ShardingStrategy::FullShard) => {
                "FSDP FULL_SHARD (ZeRO-3): parameters, gradients and optimizer state sharded; parameters gathered for forward, freed, gathered again for backward"
            }
            Some(ShardingStrategy::ShardGradOp) => "FSDP SHARD_GRAD_OP (ZeRO-2): gathered parameters kept from forward to backward",
            Some(ShardingStrategy::NoShard) => "FSDP NO_SHARD: full replicas, gradients all-reduced (DDP's behaviour, FSDP's code path)",
            Some(ShardingStrategy::HybridShard) => {
                "FSDP HYBRID_SHARD (HSDP): FULL_SHARD within each node (dp_shard_size ranks), replicas across nodes"
            }
            Some(ShardingStrategy::HybridShardZero2) => "FSDP _HYBRID_SHARD_ZERO2: SHARD_GRAD_OP within each node, replicas across nodes",
        };
        let value = PossibleValue::new(self.name()).help(help);
        Some(match self.sharding() {
            None => value,
            Some(s) => {
                // A sharding strategy's spellings, alone and after `fsdp-` (numbers aside).
                let p = s.to_possible_value().expect("every sharding strategy has a spelling");
                let names = p.get_name_and_aliases().filter(|n| !n.chars().all(|c| c.is_ascii_digit()));
                let aliases: Vec<String> = names.flat_map(|n| [n.to_string(), format!("fsdp-{n}")]).filter(|a| a != self.name()).collect();
                value.aliases(aliases)
            }
        })
    }
}

impl Choice for Strategy {
    const WHAT: &'static str = "strategy";
    fn name(self) -> &'static str {
        match self.sharding() {
            None => "ddp",
            Some(ShardingStrategy::FullShard) => "fsdp-full-shard",
            Some(ShardingStrategy::ShardGradOp) => "fsdp-shard-grad-op",
            Some(ShardingStrategy::NoShard) => "fsdp-no-shard",
            Some(ShardingStrategy::HybridShard) => "fsdp-hybrid-shard",
            Some(ShardingStrategy::HybridShardZero2) => "fsdp-hybrid-shard-zero2",
        }
    }
    fn unsupported(text: &str) -> Option<&'static str> {
        let t = text.trim().to_ascii_lowercase().replace('_', "-");
        (t == "fsdp").then_some("say which sharding strategy")
    }
}

impl std::str::FromStr for Strategy {
    type Err = ChoiceError;
    /// The strategy with its default options (see [`Strategy::with_options`]).
    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        choice::parse(s)
    }
}

impl std::fmt::Display for Strategy {
    /// The flag spelling: `ddp`, `fsdp-full-shard`, ….
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl Strategy {
    /// The name used in flags and reports: `ddp`, `fsdp-full-shard`, `fsdp-shard-grad-op`,
    /// `fsdp-no-shard`, `fsdp-hybrid-shard`, `fsdp-hybrid-shard-zero2`.
    pub fn name(self) -> &'static str {
        Choice::name(self)
    }

    /// The name in reports, banners and tables: [`name`](Self::name), or `zero1` for DDP with
    /// ZeRO-1 (DeepSpeed's stage 1): a `--strategy` value of `estimate-memory` and the bench,
    /// not of the levels (level 1: `--strategy ddp --zero-redundancy-optimizer`).
    pub fn label(self) -> &'static str {
        match self {
            Strategy::Ddp(o) if o.zero_redundancy_optimizer => "zero1",
            s => s.name(),
        }
    }

    /// FSDP's sharding strategy, or `None` for DDP.
    pub fn sharding(self) -> Option<ShardingStrategy> {
        match self {
            Strategy::Ddp(_) => None,
            Strategy::Fsdp(o) => Some(o.sharding_strategy),
        }
    }

    /// FSDP with `sharding_strategy` and PyTorch's other defaults.
    pub fn fsdp(sharding_strategy: ShardingStrategy) -> Self {
        Strategy::Fsdp(FsdpOptions::with_sharding(sharding_strategy))
    }

    /// This strategy with the options given apart from its name laid over its own.
    ///
    /// # Errors
    /// [`Error::OptionNotForStrategy`] naming the first option that belongs to the other kind
    /// of strategy (`bucket_cap_mb` or `zero_redundancy_optimizer` with FSDP; `min_num_params`, `backward_prefetch`,
    /// `forward_prefetch`, `dp_shard_size` or `offload_params` with DDP); [`Error::InvalidValue`] for a `dp_shard_size` of 0; [`Error::InvalidValue`] for a `bucket_cap_mb` that is not
    /// a positive, finite number of MiB.
    pub fn with_options(self, given: &StrategyOptions) -> Result<Self> {
        let misplaced = |option: &'static str, belongs_to: &'static str| Error::OptionNotForStrategy {
            option,
            strategy: format!("strategy {}", self.name()),
            belongs_to,
        };
        match self {
            Strategy::Ddp(mut o) => {
                let fsdp_only = [
                    ("min_num_params", given.min_num_params.is_some()),
                    ("backward_prefetch", given.backward_prefetch.is_some()),
                    ("forward_prefetch", given.forward_prefetch.is_some()),
                    ("dp_shard_size", given.dp_shard_size.is_some()),
                ];
                if let Some((option, _)) = fsdp_only.into_iter().find(|(_, g)| *g) {
                    return Err(misplaced(option, "the FSDP strategies (fsdp-full-shard, fsdp-shard-grad-op, fsdp-no-shard, fsdp-hybrid-shard, fsdp-hybrid-shard-zero2)"));
                }
                if given.offload_params == Some(true) {
                    return Err(misplaced(
                        "offload_params",
                        "the FSDP strategies (fsdp-full-shard, fsdp-shard-grad-op, fsdp-no-shard, fsdp-hybrid-shard, \
                         fsdp-hybrid-shard-zero2): CPUOffload(offload_params=True) moves FSDP's parameter shards to the host; \
                         DDP keeps a full replica on the compute device",
                    ));
                }
                o.zero_redundancy_optimizer = given.zero_redundancy_optimizer.unwrap_or(o.zero_redundancy_optimizer);
                if let Some(cap) = given.bucket_cap_mb {
                    if !(cap.is_finite() && cap > 0.0) {
                        return Err(Error::invalid("bucket_cap_mb", cap, "a positive number of MiB"));
                    }
                    o.bucket_cap_mb = cap;
                }
                Ok(Strategy::Ddp(o))
            }
            Strategy::Fsdp(mut o) => {
                if given.bucket_cap_mb.is_some() {
                    return Err(misplaced("bucket_cap_mb", "ddp (gradient buckets are DDP's; FSDP reduces one FlatParameter per unit)"));
                }
                if given.zero_redundancy_optimizer == Some(true) {
                    return Err(misplaced(
                        "zero_redundancy_optimizer",
                        "ddp (ZeRO-1 shards the optimizer state of replicated parameters; FSDP already shards it)",
                    ));
                }
                o.min_num_params = given.min_num_params.unwrap_or(o.min_num_params);
                o.backward_prefetch = given.backward_prefetch.unwrap_or(o.backward_prefetch);
                o.forward_prefetch = given.forward_prefetch.unwrap_or(o.forward_prefetch);
                o.offload_params = given.offload_params.unwrap_or(o.offload_params);
                if let Some(size) = given.dp_shard_size {
                    if size == 0 {
                        return Err(Error::invalid("dp_shard_size", size, "at least 1 rank per shard group"));
                    }
                    o.dp_shard_size = Some(size);
                }
                Ok(Strategy::Fsdp(o))
            }
        }
    }
}

/// Options given apart from a strategy's name — each a flag, a config key or an argument of a
/// level — applied with [`Strategy::with_options`]. `None`: not given.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StrategyOptions {
    /// DDP's `bucket_cap_mb`.
    pub bucket_cap_mb: Option<f64>,
    /// FSDP's auto-wrap `min_num_params`.
    pub min_num_params: Option<usize>,
    /// FSDP's `backward_prefetch`.
    pub backward_prefetch: Option<BackwardPrefetch>,
    /// FSDP's `forward_prefetch`.
    pub forward_prefetch: Option<bool>,
    /// DDP's ZeRO-1 optimizer ([`DdpOptions::zero_redundancy_optimizer`]).
    pub zero_redundancy_optimizer: Option<bool>,
    /// HSDP's shard-group size ([`FsdpOptions::dp_shard_size`]).
    pub dp_shard_size: Option<usize>,
    /// FSDP's CPU offload of the parameters ([`FsdpOptions::offload_params`]).
    pub offload_params: Option<bool>,
}

/// How to wrap the model: the strategy with its options, and the precision it computes in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct WrapConfig {
    /// DDP or FSDP, with its options.
    pub strategy: Strategy,
    /// Mixed precision: compute (forward, backward) in the low-precision dtype, gradients
    /// reduced in fp32, fp32 master weights and optimizer state; outputs are returned in fp32
    /// (as Accelerate's autocast does). FSDP applies it itself; DDP with mixed precision runs on
    /// FSDP's `NO_SHARD` code path, which keeps the fp32 masters and the low-precision compute
    /// copy (full replicas and one all-reduce per step, as DDP).
    pub mixed_precision: Precision,
    /// Activation checkpointing (PyTorch's non-reentrant `torch.utils.checkpoint` around every
    /// segment of the model; Accelerate's `fsdp_activation_checkpointing`, Transformers'
    /// `gradient_checkpointing`), for DDP and every FSDP strategy: forward keeps each segment's
    /// input only, backward recomputes the segment (dropout replays its mask) before its
    /// gradient — fewer activations kept (on BasicNet little lower peak, if any), one more
    /// forward per step; the same weights, bit for bit on CPU. Default off. See [`checkpointing`].
    #[serde(default)]
    pub activation_checkpointing: bool,
}

impl WrapConfig {
    /// Checks that the options combine: ZeRO-1 needs fp32 (DDP with mixed precision runs on
    /// FSDP's `NO_SHARD` path, which has no ZeRO-1). [`WrappedModel::new`] calls it; a level
    /// calls it before training to name its own flags ([`Error::named_by`]).
    ///
    /// # Errors
    /// [`Error::OptionNotForStrategy`] naming `zero_redundancy_optimizer` and the precision.
    pub fn validate(&self) -> Result<()> {
        if let Strategy::Ddp(o) = self.strategy {
            if o.zero_redundancy_optimizer && self.mixed_precision != Precision::No {
                return Err(Error::OptionNotForStrategy {
                    option: "zero_redundancy_optimizer",
                    strategy: format!("mixed precision {}", self.mixed_precision),
                    belongs_to: "ddp in fp32 (mixed precision runs DDP on FSDP's NO_SHARD path; \
                                 for sharded optimizer state in bf16 use fsdp-shard-grad-op, ZeRO-2)",
                });
            }
        }
        Ok(())
    }
}
