//! The estimate's moment of a checkpoint save: what writing the full model and optimizer state
//! (`save_state`, the Trainer's `checkpoint-N`) adds to each rank while it runs.
//!
//! The checkpoint holds the unwrapped model's weights and AdamW's moments with the unwrapped
//! keys, in the master dtype (fp32), written by rank 0 from those tensors' own bytes
//! ([`crate::safetensors_file`]), one state dict at a time as Accelerate's `save_state` does
//! (the weights are gathered, written and dropped before the moments are gathered). What that
//! costs depends on whether a rank holds the whole state:
//!
//! - **DDP and NO_SHARD** (DDP's mixed precision among them): the state dicts are the
//!   parameters and moments themselves (torch's `state_dict()`): nothing is added.
//! - **FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD** (`FULL_STATE_DICT`, `rank0_only`): each unit's
//!   shards are all-gathered; rank 0 keeps the gathered weights until their file is written,
//!   then both gathered moments until theirs is — at most `2 · Σ padded` fp32 elements; every
//!   other rank holds one unit's gathered buffer at a time.
//! - **ZeRO-1**: consolidated on rank 0 as PyTorch's `consolidate_state_dict(to=0)`: each
//!   rank broadcasts its shard of a moment in turn, rank 0 keeping both moments whole
//!   (`2 · P`, P the flat buffer's padded length) beside its last moment shard; every other rank
//!   holds its two moment shards laid out for sending and one shard-sized receive buffer
//!   (`3 · P / W`). (An all-gather, before, left `2 · P` on every rank.)
//!   With the moments on disk, the two read back sit beside the two shard buffers they are laid
//!   out into (`4 · P / W`) before the broadcasts.
//! - **Optimizer offload to disk**: the moments are read back from their file — on rank 0 under
//!   DDP, on every rank for its shard under FSDP (alive through the gathers); ZeRO-1 drops them
//!   before its broadcasts (above).
//!
//! Measured at width 4096, 2 ranks, level 3 (whose Trainer saves at the end of training, inside
//! the measured phase), FULL_SHARD, one unit per layer: with all three state dicts held at once
//! (commit 1058d54) rank 0 grew by 727 MiB in fp32 and 701 in bf16, rank 1 by 604 and 485; one
//! at a time, by 637 and 556 (estimated 579, the step's peak, and 555, the save's).

use super::estimate::EstimateInput;
use super::layout::{self, Engine, MASTER_BYTES};
use crate::parallel::OffloadDevice;

/// Bytes a checkpoint save adds on `rank` beyond the model state, at its largest (see the
/// module docs).
pub fn save_bytes(input: &EstimateInput, rank: usize) -> u64 {
    let (width, w) = (input.width, input.world_size);
    let on_disk = input.offload_optimizer == OffloadDevice::Nvme;
    let psi = layout::num_parameters(width) as u64;
    match Engine::of(&input.wrap) {
        Engine::Ddp(o) if o.zero_redundancy_optimizer => {
            // The moments are laid out as the shard (two fresh shard buffers); read back from
            // disk, they are alive beside that layout (two more), and dropped before the
            // broadcasts. At one rank the shard is the whole: nothing is sent.
            let (_, padded, shard) = layout::zero_partition(width, w);
            let layout_peak = if on_disk { 4 * shard as u64 } else { 0 };
            let broadcasts = match (rank, w) {
                (_, 1) => 2 * padded as u64,
                (0, _) => (2 * padded + shard) as u64,
                _ => 3 * shard as u64,
            };
            MASTER_BYTES * layout_peak.max(broadcasts)
        }
        Engine::Ddp(_) => MASTER_BYTES * if on_disk && rank == 0 { 2 * psi } else { 0 },
        Engine::Fsdp(o) => {
            let units = layout::fsdp_units(width, &o, w);
            let shards: u64 = units.iter().map(|u| u.shard as u64).sum();
            let read = if on_disk { 2 * shards } else { 0 };
            if !o.sharding_strategy.is_sharded() {
                return MASTER_BYTES * read;
            }
            let gathered = if rank == 0 {
                2 * units.iter().map(|u| u.padded as u64).sum::<u64>()
            } else {
                units.iter().map(|u| u.padded as u64).max().unwrap_or(0)
            };
            MASTER_BYTES * (gathered + read)
        }
    }
}
