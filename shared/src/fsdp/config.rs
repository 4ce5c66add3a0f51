//! FSDP's options: the sharding strategy, the mixed-precision policy and `FsdpConfig`, with
//! PyTorch's names and defaults.

use serde::{Deserialize, Serialize};
use tch::Kind;

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

/// When backward all-gathers the next unit's parameters ahead of need, with PyTorch's names
/// (`torch.distributed.fsdp.BackwardPrefetch`). CLI and serde names: `backward-pre`,
/// `backward-post`. Only `FullShard` re-gathers in backward, so only it prefetches there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum BackwardPrefetch {
    /// Start the next unit's all-gather before the current unit's gradient computation: it
    /// overlaps that computation; two units' gathered parameters are alive at once.
    BackwardPre,
    /// Start it after the current unit's gradient computation, once its gathered parameters
    /// are freed: it overlaps the current unit's gradient reduce-scatter; less memory.
    BackwardPost,
}

impl std::fmt::Display for BackwardPrefetch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BackwardPrefetch::BackwardPre => "backward-pre",
            BackwardPrefetch::BackwardPost => "backward-post",
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
    /// PyTorch's `backward_prefetch`: when `FullShard`'s backward starts the next unit's
    /// all-gather (`None`: when the unit is reached). Default `BackwardPre`, PyTorch's.
    pub backward_prefetch: Option<BackwardPrefetch>,
    /// PyTorch's `forward_prefetch`: start the next unit's all-gather before the current unit's
    /// forward computation (sharded strategies). Default false, PyTorch's.
    pub forward_prefetch: bool,
}

impl Default for FsdpConfig {
    fn default() -> Self {
        Self {
            sharding_strategy: ShardingStrategy::FullShard,
            min_num_params: 100_000_000,
            sync_module_states: true,
            mixed_precision: None,
            backward_prefetch: Some(BackwardPrefetch::BackwardPre),
            forward_prefetch: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strategy_names_match_pytorch_in_kebab_case() {
        use clap::ValueEnum;
        let names: Vec<String> =
            ShardingStrategy::value_variants().iter().map(|v| v.to_possible_value().expect("named").get_name().to_string()).collect();
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
