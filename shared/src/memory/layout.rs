//! BasicNet's parameter layout under each strategy, as closed forms of the width and the world
//! size — no tensors: the per-rank model-state bytes ([`model_state`]) that
//! [`WrappedModel::memory`](crate::parallel::WrappedModel::memory) reports after a
//! synchronised step, and the sizes the peak model needs (FSDP units, DDP buckets, ZeRO-1's
//! partition).

use super::ModelStateBytes;
use crate::parallel::ddp::compute_bucket_assignment;
use crate::parallel::zero::ALIGN;
use crate::parallel::{BackwardPrefetch, DdpOptions, FsdpOptions, ShardingStrategy, Strategy, WrapConfig};

/// Bytes of one master parameter element: the model is built in fp32 (mixed precision casts
/// copies; the parameters, their gradients and AdamW's moments stay fp32).
pub const MASTER_BYTES: u64 = 4;

/// BasicNet's parameter tensors in definition order: `(segment, numel)` — `conv1.weight`
/// 32·1·3·3, `conv1.bias` 32, `conv2.weight` 64·32·3·3, `conv2.bias` 64, `fc1.weight`
/// 9216·width, `fc1.bias` width, `fc2.weight` 10·width, `fc2.bias` 10 (segments as
/// [`crate::model::Segmented`] for BasicNet: 0 conv1, 1 conv2, 3 fc1, 5 fc2).
pub fn param_numels(width: i64) -> [(usize, i64); 8] {
    [(0, 288), (0, 32), (1, 18_432), (1, 64), (3, 9216 * width), (3, width), (5, 10 * width), (5, 10)]
}

/// ⌈a / b⌉ for positive `b` (`i64::div_ceil` is not stable).
fn ceil_div(a: i64, b: i64) -> i64 {
    (a + b - 1) / b
}

/// Ψ: BasicNet's parameter count at `width` (1,199,882 at 128).
pub fn num_parameters(width: i64) -> i64 {
    param_numels(width).iter().map(|&(_, n)| n).sum()
}

/// Parameter elements of segment `s` (0 for the parameter-free segments).
pub fn segment_numel(width: i64, s: usize) -> i64 {
    param_numels(width).iter().filter(|&&(seg, _)| seg == s).map(|&(_, n)| n).sum()
}

/// Which engine a [`WrapConfig`] runs on, as [`WrappedModel::new`](crate::parallel::WrappedModel::new)
/// decides: DDP with mixed precision runs on FSDP's `NO_SHARD` path.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Engine {
    /// `DistributedDataParallel` in fp32 (with ZeRO-1 when its option is set).
    Ddp(DdpOptions),
    /// `FullyShardedDataParallel` with these options.
    Fsdp(FsdpOptions),
}

impl Engine {
    /// The engine `wrap` runs on.
    pub fn of(wrap: &WrapConfig) -> Self {
        match (wrap.strategy, wrap.mixed_precision.policy()) {
            (Strategy::Fsdp(o), _) => Engine::Fsdp(o),
            (Strategy::Ddp(_), Some(_)) => Engine::Fsdp(FsdpOptions::with_sharding(ShardingStrategy::NoShard)),
            (Strategy::Ddp(o), None) => Engine::Ddp(o),
        }
    }
}

/// One FSDP unit's FlatParameter, as [`crate::parallel::fsdp::plan_units`] lays it out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnitSize {
    /// The segments whose parameters it holds, ascending.
    pub segments: Vec<usize>,
    /// Elements of its parameters.
    pub numel: i64,
    /// Elements after padding to a multiple of W (`numel` for `NO_SHARD`).
    pub padded: i64,
    /// Elements each rank keeps: `padded / W` (`numel` for `NO_SHARD`).
    pub shard: i64,
}

/// FSDP's units for BasicNet at `width`: each layer with at least `min_num_params` parameters
/// its own unit (segment order), the rest in the root unit, last (`size_based_auto_wrap_policy`).
///
/// The shards are 1/S of each unit, S the ranks they are sharded over: the world size, or
/// HSDP's shard-group size ([`FsdpOptions::shard_group_size`]).
pub fn fsdp_units(width: i64, o: &FsdpOptions, world_size: usize) -> Vec<UnitSize> {
    let w = o.shard_group_size(world_size).max(1) as i64;
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut root = Vec::new();
    for s in [0, 1, 3, 5] {
        if segment_numel(width, s) as u64 >= o.min_num_params as u64 {
            groups.push(vec![s]);
        } else {
            root.push(s);
        }
    }
    if !root.is_empty() {
        groups.push(root);
    }
    groups
        .into_iter()
        .map(|segments| {
            let numel: i64 = segments.iter().map(|&s| segment_numel(width, s)).sum();
            let (padded, shard) =
                if o.sharding_strategy.is_sharded() { (ceil_div(numel, w) * w, ceil_div(numel, w)) } else { (numel, numel) };
            UnitSize { segments, numel, padded, shard }
        })
        .collect()
}

/// ZeRO-1's flat partition ([`crate::parallel::zero`]): each parameter's `(offset, numel)` in
/// the flat buffer (starts aligned to [`ALIGN`] elements), the buffer's length (a multiple of
/// `ALIGN · W`) and one rank's shard (`padded / W`).
pub fn zero_partition(width: i64, world_size: usize) -> (Vec<(i64, i64)>, i64, i64) {
    let w = world_size.max(1) as i64;
    let mut layout = Vec::new();
    let mut end = 0i64;
    for (_, n) in param_numels(width) {
        layout.push((end, n));
        end = ceil_div(end + n, ALIGN) * ALIGN;
    }
    let padded = ceil_div(end.max(1), ALIGN * w) * ALIGN * w;
    (layout, padded, padded / w)
}

/// Parameter elements inside rank `rank`'s ZeRO-1 shard (alignment gaps and padding excluded),
/// and the largest piece (one parameter's part of the shard).
pub fn zero_mine(width: i64, world_size: usize, rank: usize) -> (i64, i64) {
    let (layout, _, shard) = zero_partition(width, world_size);
    let (lo, hi) = (rank as i64 * shard, (rank as i64 + 1) * shard);
    let pieces = layout.iter().map(|&(o, n)| ((o + n).min(hi) - o.max(lo)).max(0));
    pieces.fold((0, 0), |(sum, max), p| (sum + p, max.max(p)))
}

/// DDP's gradient buckets for BasicNet at `width` (PyTorch's assignment: reverse order, first
/// bucket 1 MiB, then `bucket_cap_mb`): each bucket's bytes.
pub fn bucket_bytes(width: i64, bucket_cap_mb: f64) -> Vec<u64> {
    let sizes: Vec<(i64, u64)> = param_numels(width).iter().map(|&(_, n)| (n, n as u64 * MASTER_BYTES)).collect();
    compute_bucket_assignment(&sizes, bucket_cap_mb).iter().map(|b| b.bytes).collect()
}

/// The most bytes of gathered parameters alive at once on a rank (FSDP; 0 for DDP), with
/// compute elements of `compute_bytes`: `FULL_SHARD` one unit, or two consecutive units when
/// an all-gather is prefetched (`BACKWARD_PRE`, `forward_prefetch`); `SHARD_GRAD_OP` every
/// unit; `NO_SHARD` 0 in fp32 (the parameters are the shards) or a low-precision copy of every
/// unit. Exact for one unit per layer (`min_num_params` 0) and for one unit (the default);
/// a root unit holding non-adjacent layers is counted as if adjacent.
pub fn gathered_peak(units: &[UnitSize], o: &FsdpOptions, compute_bytes: u64) -> u64 {
    let elements = match o.sharding_strategy {
        ShardingStrategy::NoShard if compute_bytes == MASTER_BYTES => 0,
        ShardingStrategy::NoShard => units.iter().map(|u| u.numel).sum(),
        ShardingStrategy::ShardGradOp | ShardingStrategy::HybridShardZero2 => units.iter().map(|u| u.padded).sum(),
        ShardingStrategy::FullShard | ShardingStrategy::HybridShard => {
            let one = units.iter().map(|u| u.padded).max().unwrap_or(0);
            let prefetch = o.backward_prefetch == BackwardPrefetch::BackwardPre || o.forward_prefetch;
            let two = units.windows(2).map(|p| p[0].padded + p[1].padded).max();
            if prefetch {
                two.unwrap_or(one)
            } else {
                one
            }
        }
    };
    elements as u64 * compute_bytes
}

/// Rank `rank`'s model-state bytes after a synchronised training step (gradients defined,
/// AdamW's moments allocated), as the wrapped model's exact accounting reports them:
///
/// | engine | parameters | gradients | optimizer | gathered peak |
/// |---|---|---|---|---|
/// | DDP | 4Ψ | 4Ψ | 8Ψ | 0 |
/// | ZeRO-1 | 4P (P: the aligned, padded flat buffer) | 4P (one flat buffer; the shard's pieces are views of it) | 8m (m: parameter elements in the rank's shard) | 0 |
/// | FSDP | 4·Σ shard | 4·Σ shard | 8·Σ shard | [`gathered_peak`] |
///
/// (FSDP: shard = ⌈numel/W⌉ per unit, `numel` for `NO_SHARD`, ⌈numel/S⌉ for HSDP with shard
/// groups of S ranks — FULL_SHARD's figures at world size S; DDP with mixed precision runs
/// on FSDP's `NO_SHARD`). AdamW's step counts (one 4-byte tensor per optimized tensor) are not
/// counted, as in the accounting.
pub fn model_state(wrap: &WrapConfig, width: i64, world_size: usize, rank: usize) -> ModelStateBytes {
    let psi = num_parameters(width) as u64;
    match Engine::of(wrap) {
        Engine::Ddp(o) if o.zero_redundancy_optimizer => {
            let (_, padded, _) = zero_partition(width, world_size);
            let (mine, _) = zero_mine(width, world_size, rank);
            let mine = mine as u64;
            ModelStateBytes {
                parameters: MASTER_BYTES * padded as u64,
                gradients: MASTER_BYTES * padded as u64,
                optimizer: 2 * MASTER_BYTES * mine,
                gathered_peak: 0,
                optimizer_on_disk: 0,
            }
        }
        Engine::Ddp(_) => ModelStateBytes {
            parameters: MASTER_BYTES * psi,
            gradients: MASTER_BYTES * psi,
            optimizer: 2 * MASTER_BYTES * psi,
            gathered_peak: 0,
            optimizer_on_disk: 0,
        },
        Engine::Fsdp(o) => {
            let units = fsdp_units(width, &o, world_size);
            let shards = MASTER_BYTES * units.iter().map(|u| u.shard as u64).sum::<u64>();
            let gathered_peak = gathered_peak(&units, &o, compute_bytes(wrap));
            ModelStateBytes { parameters: shards, gradients: shards, optimizer: 2 * shards, gathered_peak, optimizer_on_disk: 0 }
        }
    }
}

/// Bytes of one compute element: 4 in fp32, 2 under bf16 or fp16.
pub fn compute_bytes(wrap: &WrapConfig) -> u64 {
    wrap.mixed_precision.policy().map_or(MASTER_BYTES, |p| p.param_dtype.kind().elt_size_in_bytes() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_layout_is_basicnets() {
        assert_eq!(num_parameters(128), 1_199_882);
        assert_eq!((segment_numel(128, 0), segment_numel(128, 1), segment_numel(128, 2)), (320, 18_496, 0));
        // ZeRO-1 at W = 2, width 32: starts 0, 320, 384, 18,816, 18,880, 313,792, 313,856,
        // 314,176 (multiples of 64); the end 314,240 is a multiple of 64 · 2 already.
        let (layout, padded, shard) = zero_partition(32, 2);
        assert_eq!((layout[3], layout[4], layout[7]), ((18_816, 64), (18_880, 9216 * 32), (314_176, 10)));
        assert_eq!((padded, shard), (314_240, 157_120));
        let total: i64 = (0..3).map(|r| zero_mine(32, 3, r).0).sum();
        assert_eq!(total, num_parameters(32), "the shards cover every element once");
    }
}
