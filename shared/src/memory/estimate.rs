//! The memory estimate: per rank, the model state (closed forms equal to the wrapped model's
//! exact accounting, see [`layout::model_state`]) and the expected training-phase peak RSS
//! growth — what `ladder-accelerate estimate-memory` prints and the bench holds against its
//! measurements.
//!
//! # What is alive at the peak
//!
//! The training phase starts with the model wrapped and the data loaded, so its growth is the
//! gradients and AdamW's moments (allocated by the first backward and step), plus the largest
//! of the moments of a step (after the first, when gradients accumulate into existing ones):
//!
//! - **forward of segment s**: the batch, what the graphs of segments `< s` keep, segment s's
//!   intermediates; FSDP's gathered parameters;
//! - **backward of segment s**: the same kept tensors, segment s's gradients (incoming,
//!   intermediate, outgoing), and its parameters' fresh gradients (libtorch computes a new
//!   tensor and adds it into `.grad`); FSDP: gathered parameters and the unit's unsharded flat
//!   gradient;
//! - **FSDP's flat gradient**: after a unit's first segment's backward, its gradients are
//!   added into the unit's unsharded flat gradient, fp32 also under mixed precision (allocated
//!   then, the gathered parameters freed just before when sharded; NO_SHARD adds into the
//!   shard's `.grad` itself);
//! - **gradient reduction**: DDP's bucket copy (`cat` of one bucket's gradients) and Open MPI's
//!   scratch while it is all-reduced ([`allreduce_scratch_bytes`]; ZeRO-1's pieces are views of
//!   the flat gradient, no copy); FSDP's reduce-scatter input (the flat gradient, fp32) and
//!   output (not the reduce-scatter's own temporaries: [`fitted`] says why), or NO_SHARD's
//!   all-reduce of `.grad` in place with its scratch;
//! - **non-finite check** (every level, unless `--allow-non-finite`): each gradient the
//!   optimizer steps is summed in f64 piece by piece, through an f64 copy of one piece
//!   ([`FINITE_CHECK_CHUNK`](crate::parallel::wrapped::FINITE_CHECK_CHUNK) elements).
//!
//! Per sample, in compute elements (4 bytes in fp32, 2 under bf16), BasicNet's segments keep
//! for backward (libtorch's saved tensors; the ops' outputs not saved are freed at once):
//!
//! | segment | keeps (besides its input) | only while it runs forward | its backward holds |
//! |---|---|---|---|
//! | 0 conv1, relu | relu's result 32·26·26 = 21,632 | conv1's output 21,632 | 2 × 21,632 |
//! | 1 conv2, max_pool2d, relu | relu's result 9,216; 9,216 one-byte window codes | conv2's output 36,864 and the pool's 9,216 | conv2's output gradient and input gradient, 36,864 + 21,632 |
//! | 2 dropout 0.25, flatten | the mask 9,216, the output 9,216 | — | 2 × 9,216 |
//! | 3 fc1, relu | relu's result `width` | fc1's output `width` | `width` + 9,216 |
//! | 4 dropout 0.5 | the mask and the output, `width` each | — | 2 · `width` |
//! | 5 fc2, log_softmax | the result 10 | fc2's output 10 | 20 + `width` |
//!
//! The convolutions run channels-last on CPU ([`crate::model::channels_last`]), and oneDNN then
//! computes in the tensors' own layout, without the reorder copies NCHW needs (measured with
//! libtorch 2.13, batch 512, one thread: conv2's forward grows the RSS by 36,866 f32 per sample,
//! its output, and its backward by 21,634 beyond its incoming gradient, its input gradient; on
//! NCHW tensors 73,664 and 80,048, the output and the gradients alive twice).
//!
//! plus the batch: 784 f32 per image and its label, the image's cast under mixed precision and
//! its channels-last copy in the compute dtype (what conv1 keeps). With activation
//! checkpointing a segment keeps only its input: the forward's tensors are the segments'
//! outputs, and a segment's saved tensors live again only while backward recomputes it.
//!
//! # How close it is
//!
//! The closed forms of the model state are exact (tests/estimate.rs checks them against the
//! accounting for every strategy at W = 1, 2, 3). The live bytes of a step are within 3% of an
//! `LD_PRELOAD` count of the bytes `malloc` hands out (level 1, width 4096, batch 64 and 512,
//! DDP and FULL_SHARD at W = 1, DDP and ZeRO-1 at W = 2; AMD EPYC Zen 5), once a
//! segment-by-segment backward is counted (two buffers of a segment's output gradient). What
//! glibc's heap keeps beyond them is not a closed form: fitted constants turn the live bytes into
//! resident ones, [`RESIDENT_PER_LIVE_FP32`], [`RESIDENT_PER_LIVE_16BIT`] and
//! [`RESIDENT_PER_LIVE_16BIT_AVX512`] (1.65 resident bytes per live activation byte in fp32; in
//! 16 bits 2.3 with AMX and 1.9 with AVX512-BF16, [`EstimateInput::cpu_bf16`]), [`RUNTIME_BYTES`]
//! / [`FSDP_RUNTIME_BYTES`] (30 and 42 MiB, FSDP's in fp32 only) and [`HUGE_PAGES_BYTES`] (72
//! MiB, where the levels back tensors with transparent huge pages from 32 MiB of parameters; 36,
//! [`fitted::FSDP_SHARDED_HUGE_PAGES_BYTES`], for FSDP's sharded strategies in fp32), beside a
//! measured one, Open MPI's all-reduce scratch ([`allreduce_scratch_bytes`]); and with activation
//! checkpointing on a CPU the estimate is never below the one without
//! ([`fitted::checkpointing_keeps_the_heap`]). The measured figure is the largest rank's growth
//! over the training steps alone (evaluation and saves left out, [`crate::timing`]), the median
//! over repeats of runs long enough for most of the heap's growth (20 steps and more). How close
//! it comes on two CPUs, cell by cell, over how many steps, and what is left: [`fitted`]'s docs.
//!
//! # On CUDA
//!
//! [`estimate_on`] with [`DeviceKind::Cuda`] estimates the CUDA caching allocator's peak of
//! allocated bytes instead (`torch.cuda.max_memory_allocated` over the steps, what
//! [`crate::timing::StepTiming::train_cuda_peak_mib`] measures): the allocator counts tensors'
//! bytes exactly, so activations count at their live bytes (no heap factor), and the runtime
//! term is [`CUDA_RUNTIME_BYTES`] plus [`CUDA_BYTES_PER_SAMPLE`] per sample. Measured on an
//! NVIDIA H200 (libtorch 2.11, cuDNN 9.19, `scripts/gpu-check.sh`, the book's "On a GPU"), level
//! 1 at W = 1 in fp32: the five will-it-fit runs at width 4096 and batch 512 (DDP with and
//! without activation checkpointing, FULL_SHARD with and without CPU offload) and widths 128
//! and 4096 at batch 64 and 512 are within 6% of the estimate (the constants were fitted to
//! them). Several processes are estimated the same way, with no collective scratch: NCCL's
//! buffers are outside the allocator's count (and no machine with two GPUs has measured it).

use super::layout::{self, Engine, UnitSize, MASTER_BYTES};
use super::ModelStateBytes;
use crate::device::{CpuBf16Unit, DeviceKind};
use crate::parallel::{BackwardPrefetch, DdpOptions, ShardingStrategy, Strategy, WrapConfig};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};

pub mod fitted;
use fitted::scratch_on;
pub use fitted::{
    allreduce_scratch_bytes, resident_per_live, CUDA_BYTES_PER_SAMPLE, CUDA_RUNTIME_BYTES, FSDP_RUNTIME_BYTES, HUGE_PAGES_BYTES,
    RESIDENT_PER_LIVE_16BIT, RESIDENT_PER_LIVE_16BIT_AVX512, RESIDENT_PER_LIVE_FP32, RUNTIME_BYTES,
};

/// What to estimate: how the model is wrapped, the ranks, fc1's width and the batch per rank.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct EstimateInput {
    /// Strategy (with its options, ZeRO-1 among DDP's), precision, activation checkpointing.
    pub wrap: WrapConfig,
    /// Ranks (W ≥ 1).
    pub world_size: usize,
    /// BasicNet's fc1 width (the tutorial's 128).
    pub width: i64,
    /// Samples per rank per step (`per_device_train_batch_size`).
    pub batch_size: usize,
    /// Where AdamW's moments live: with `nvme` (DeepSpeed's `offload_optimizer`) the estimate
    /// counts the buffer they stream through (the default 2²⁰ elements per moment) instead of
    /// the moments, which go to `optimizer_on_disk`.
    #[serde(default)]
    pub offload_optimizer: crate::parallel::OffloadDevice,
    /// Whether the phase writes a checkpoint (model and optimizer state, gathered to rank 0
    /// where sharded): the Trainer's `checkpoint-N` at the end of training, `save_state`.
    /// Adds the save as a moment ([`super::checkpoint_save`]).
    #[serde(default)]
    pub save_checkpoint: bool,
    /// On a CPU, its bf16 unit, which decides how far the heap runs ahead of activations
    /// computed in 16 bits ([`resident_per_live`]); `None` (not known) takes the larger factor
    /// measured. No effect in fp32 or on CUDA. `ladder-accelerate estimate-memory` and the
    /// bench pass this machine's ([`CpuBf16Unit::of_this_machine`]).
    #[serde(default)]
    pub cpu_bf16: Option<CpuBf16Unit>,
    /// On a CPU, whether the levels back tensors with transparent huge pages (adds
    /// [`HUGE_PAGES_BYTES`] or [`fitted::FSDP_SHARDED_HUGE_PAGES_BYTES`]); `None` assumes their
    /// default, on from 32 MiB of parameters ([`crate::device::huge_pages_by_default`]).
    /// `estimate-memory` and the bench pass what a run would do with their environment's
    /// `THP_MEM_ALLOC_ENABLE` ([`crate::device::huge_pages_for`]).
    #[serde(default)]
    pub huge_pages: Option<bool>,
}

/// One rank's estimate, bytes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankEstimate {
    /// The rank.
    pub rank: usize,
    /// Parameters, gradients, optimizer state, gathered peak: what the accounting reports after
    /// a synchronised step ([`layout::model_state`]).
    pub model_state: ModelStateBytes,
    /// Activations and their gradients at the peak moment, as resident bytes (live bytes ×
    /// [`resident_per_live`]; on CUDA, live bytes: [`estimate_on`]).
    pub activations: u64,
    /// Other transient bytes at the peak moment: fresh parameter gradients, gathered
    /// parameters, flat gradients, bucket copies.
    pub transient: u64,
    /// What the training phase adds whatever the model's activations ([`RUNTIME_BYTES`] or
    /// [`FSDP_RUNTIME_BYTES`], plus the huge pages' term from 32 MiB of parameters; on CUDA
    /// [`CUDA_RUNTIME_BYTES`] and [`CUDA_BYTES_PER_SAMPLE`] per sample).
    pub runtime: u64,
    /// Where in the step the peak falls (`backward of conv2`, `gradient reduction`, …).
    pub peak_at: String,
    /// Expected training-phase peak RSS growth: gradients + optimizer state + activations +
    /// transient + runtime (the parameters exist before training starts).
    pub peak_growth: u64,
    /// On CUDA, the dataset the device holds ([`cuda_dataset_bytes`], allocated before
    /// training, so in the allocator's peak but not in the growth); 0 on a CPU, where the
    /// pixels are the node's shared mapping, outside what training adds.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub dataset: u64,
    /// Parameters + dataset + expected peak growth: the model's and training's bytes at the
    /// peak, without the process's own (libtorch, MPI; on a CPU the dataset).
    pub total: u64,
    /// Of `total`, the bytes in host memory under FSDP's CPU offload (`offload_params`): the
    /// parameter shards, their gradients and the optimizer state; the compute device holds
    /// `total − host`. 0 without offload. On a CPU both are one memory. The copies to the device
    /// are in `transient` (one unit's shard while it is all-gathered; under `NO_SHARD` the
    /// whole parameters while they are gathered), not in `host`.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub host: u64,
}

fn is_zero(b: &u64) -> bool {
    *b == 0
}

/// Per-sample compute elements of one segment (see the module docs' table).
#[derive(Debug, Clone, Copy)]
struct SegmentActs {
    name: &'static str,
    /// Output elements, kept as the next segment's input.
    out: i64,
    /// Elements the graph keeps besides input and output (dropout's mask).
    saved: i64,
    /// Bytes the graph keeps that are not compute elements (max_pool2d's window codes).
    saved_bytes: u64,
    /// Elements alive only while its forward runs.
    forward: i64,
    /// Gradient elements its backward holds at once.
    backward: i64,
}

fn segments(width: i64) -> [SegmentActs; 6] {
    let s = |name, out, saved, saved_bytes, forward, backward| SegmentActs { name, out, saved, saved_bytes, forward, backward };
    [
        s("conv1", 21_632, 0, 0, 21_632, 2 * 21_632),
        s("conv2", 9216, 0, 9216, 36_864 + 9216, 36_864 + 21_632),
        s("dropout 0.25", 9216, 9216, 0, 0, 2 * 9216),
        s("fc1", width, 0, 0, width, width + 9216),
        s("dropout 0.5", width, width, 0, 0, 2 * width),
        s("fc2", 10, 0, 0, 10, 20 + width),
    ]
}

/// Bytes of the batch per sample: the f32 image from the loader and its i64 label, the
/// image's cast to the compute dtype under mixed precision, and its channels-last copy in the
/// compute dtype (conv1's saved input).
fn input_bytes_per_sample(cb: u64) -> u64 {
    784 * 4 + 8 + 784 * cb + if cb == MASTER_BYTES { 0 } else { 784 * cb }
}

/// A moment of the step: activation bytes and other transient bytes alive.
#[derive(Debug, Clone)]
struct Moment {
    what: String,
    activations: u64,
    transient: u64,
}

/// Activation bytes (per batch) kept by segments `< s`, and those of the moment at `s`
/// (`backward`: its backward; else its forward).
fn activations(segs: &[SegmentActs], s: usize, backward: bool, checkpointing: bool, cb: u64, batch: u64) -> u64 {
    let kept = |t: &SegmentActs| if checkpointing { t.out as u64 * cb } else { (t.out + t.saved) as u64 * cb + t.saved_bytes };
    let before: u64 = segs[..s].iter().map(kept).sum();
    let this = &segs[s];
    let own = (this.out + this.saved) as u64 * cb + this.saved_bytes + if backward { this.backward } else { this.forward } as u64 * cb;
    batch * (input_bytes_per_sample(cb) + before + own)
}

/// What a segment-by-segment backward (FSDP's, [`crate::parallel::fsdp`]; DDP's when checkpointed
/// or overlapped, [`crate::parallel::DistributedDataParallel::forward_segmented`]) holds at
/// segment `s` beyond one graph's backward: two buffers of the segment's output gradient — the
/// incoming gradient, held through the segment, and one more of its size. Measured with an
/// `LD_PRELOAD` count of live `malloc`'d bytes (level 1, W = 1, fp32, 8 steps, AMD EPYC Zen 5):
/// 2 × 9,216 f32 per sample, conv2's output, at width 128 (36 MiB at batch 512) — FULL_SHARD's
/// live peak over DDP's, and DDP's with checkpointing over DDP's without (226.0 against 191.4
/// MiB; at width 4096 fc1's, 16 MiB: 726.6 against 734.6 where checkpointing saves 24 more).
fn segment_by_segment(segs: &[SegmentActs], s: usize, cb: u64, batch: u64) -> u64 {
    batch * 2 * segs[s].out as u64 * cb
}

/// Estimates every rank's memory (see the module docs).
///
/// # Errors
/// [`Error::InvalidValue`] for a world size, width or batch size of 0; what
/// [`WrapConfig::validate`] refuses (ZeRO-1 with mixed precision).
pub fn estimate(input: &EstimateInput) -> Result<Vec<RankEstimate>> {
    estimate_on(input, DeviceKind::Cpu)
}

/// [`estimate`] of the memory of `device`: on [`DeviceKind::Cpu`] the training-phase peak RSS
/// growth (live activation bytes × [`resident_per_live`], plus [`RUNTIME_BYTES`]); on
/// [`DeviceKind::Cuda`] the CUDA caching allocator's peak of allocated bytes
/// (`torch.cuda.max_memory_allocated` over the steps), which counts tensors' bytes exactly:
/// activations at their live bytes, `runtime` the cuBLAS workspaces ([`CUDA_RUNTIME_BYTES`])
/// and what cuDNN and the CUDA kernels add per sample ([`CUDA_BYTES_PER_SAMPLE`]) — the CUDA
/// context and the allocator's cached, unallocated blocks (in `nvidia-smi`'s figure) are not,
/// nor data the process put on the device before training. Under FSDP's CPU offload, `host` is
/// in pinned host memory, not the allocator's: the device's figure is `total − host`.
///
/// # Errors
/// As [`estimate`].
pub fn estimate_on(input: &EstimateInput, device: DeviceKind) -> Result<Vec<RankEstimate>> {
    let EstimateInput { wrap, world_size, width, batch_size, .. } = *input;
    if world_size == 0 {
        return Err(Error::invalid("world_size", world_size, "at least 1 rank"));
    }
    if width < 1 {
        return Err(Error::invalid("width", width, "at least 1 fc1 unit"));
    }
    if batch_size == 0 {
        return Err(Error::invalid("batch_size", batch_size, "at least 1 sample per rank"));
    }
    wrap.validate()?;
    let plain = EstimateInput { wrap: WrapConfig { activation_checkpointing: false, ..wrap }, ..*input };
    let floor = |r| fitted::checkpointing_keeps_the_heap(device, &wrap).then(|| estimate_rank(&plain, r, device));
    Ok((0..world_size).map(|r| fitted::floored(estimate_rank(input, r, device), floor(r))).collect())
}

fn estimate_rank(input: &EstimateInput, rank: usize, device: DeviceKind) -> RankEstimate {
    let (wrap, width, w) = (&input.wrap, input.width, input.world_size);
    let model_state = layout::model_state(wrap, width, w, rank).placed(input.offload_optimizer);
    let mut moments = match Engine::of(wrap) {
        Engine::Ddp(o) => ddp_moments(input, o.bucket_cap_mb, o.overlap, o.zero_redundancy_optimizer.then_some(rank), device),
        Engine::Fsdp(o) => {
            let units = layout::fsdp_units(width, &o, w);
            fsdp_moments(input, &units, o.sharding_strategy, (o.backward_prefetch, o.forward_prefetch), o.offload_params, device)
        }
    };
    if input.save_checkpoint {
        // After the step: no activations; the gradients are zeroed in place, not freed.
        let transient = super::checkpoint_save::save_bytes(input, rank);
        moments.push(Moment { what: "checkpoint save".into(), activations: 0, transient });
    }
    let (per_live, runtime) = fitted::heap_terms(device, wrap, input.batch_size as u64, input.huge_pages_on(), input.cpu_bf16);
    let resident = |m: &Moment| (m.activations as f64 * per_live) as u64;
    let peak = moments.into_iter().max_by_key(|m| resident(m) + m.transient).expect("a step has moments");
    let activations = resident(&peak);
    let peak_growth = model_state.gradients + model_state.optimizer + activations + peak.transient + runtime;
    let dataset = match device {
        DeviceKind::Cpu => 0,
        DeviceKind::Cuda => cuda_dataset_bytes(w),
    };
    let offloaded = matches!(Engine::of(wrap), Engine::Fsdp(o) if o.offload_params);
    let host = if offloaded { model_state.parameters + model_state.gradients + model_state.optimizer } else { 0 };
    RankEstimate {
        rank,
        model_state,
        activations,
        transient: peak.transient,
        runtime,
        peak_at: peak.what,
        peak_growth,
        dataset,
        total: model_state.parameters + dataset + peak_growth,
        host,
    }
}

/// Bytes of MNIST each process holds on a CUDA device ([`crate::data::Dataset::to_device`]):
/// both splits' pixels (784 u8) and labels (i64), a 256-f32 normalisation table per split, and
/// this rank's share of the epoch's order (⌈60,000 / W⌉ i64) — 53.3 MiB at one process.
pub fn cuda_dataset_bytes(world_size: usize) -> u64 {
    const TRAIN: u64 = 60_000;
    const TEST: u64 = 10_000;
    let per_rank = TRAIN.div_ceil(world_size.max(1) as u64);
    (TRAIN + TEST) * (784 + 8) + 2 * 256 * 4 + per_rank * 8
}

/// The non-finite check every level runs after backward (unless `--allow-non-finite`): each
/// optimizer tensor's gradient summed in f64 in pieces, each copied to f64 first — 8 bytes per
/// element of the largest piece, with the batch still alive.
fn finite_check(input: &EstimateInput, largest: i64) -> Moment {
    let b = input.batch_size as u64;
    Moment {
        what: "non-finite check".into(),
        activations: b * input_bytes_per_sample(layout::compute_bytes(&input.wrap)),
        transient: 8 * largest.min(crate::parallel::wrapped::FINITE_CHECK_CHUNK) as u64,
    }
}

/// DDP's moments: each segment's forward and backward (with the fresh gradients of its
/// parameters), then the reduction (one bucket's copy; with `overlap` every bucket's; ZeRO-1's
/// largest piece copy).
fn ddp_moments(input: &EstimateInput, bucket_cap_mb: f64, overlap: bool, zero_rank: Option<usize>, device: DeviceKind) -> Vec<Moment> {
    let (width, b, ckpt) = (input.width, input.batch_size as u64, input.wrap.activation_checkpointing);
    let segs = segments(width);
    let mut out = Vec::new();
    for s in 0..segs.len() {
        out.push(Moment {
            what: format!("forward of {}", segs[s].name),
            activations: activations(&segs, s, false, ckpt, MASTER_BYTES, b),
            transient: 0,
        });
    }
    for s in (0..segs.len()).rev() {
        let fresh = MASTER_BYTES * layout::segment_numel(width, s) as u64;
        // Checkpointed or overlapped, DDP runs FSDP's segment-by-segment backward.
        let segmented = if ckpt || overlap { segment_by_segment(&segs, s, MASTER_BYTES, b) } else { 0 };
        out.push(Moment {
            what: format!("backward of {}", segs[s].name),
            activations: activations(&segs, s, true, ckpt, MASTER_BYTES, b) + segmented,
            transient: fresh,
        });
    }
    // One bucket's `cat` copy, all-reduced in place with Open MPI's scratch beside it (every
    // bucket's copy when overlapped: all may be in flight). ZeRO-1's pieces are views of the
    // flat gradient: nothing more.
    let buckets = layout::bucket_bytes(width, bucket_cap_mb);
    let w = input.world_size;
    let reduce = if overlap {
        buckets.iter().sum::<u64>() + buckets.iter().map(|&b| scratch_on(device, b, w)).max().unwrap_or(0)
    } else {
        buckets.iter().map(|&b| b + scratch_on(device, b, w)).max().unwrap_or(0)
    };
    out.push(Moment { what: "gradient reduction".into(), activations: b * input_bytes_per_sample(MASTER_BYTES), transient: reduce });
    let largest = match zero_rank {
        Some(rank) => layout::zero_mine(width, input.world_size, rank).1,
        None => layout::param_numels(width).iter().map(|&(_, n)| n).max().unwrap_or(0),
    };
    out.push(finite_check(input, largest));
    out
}

/// Which units' parameters are gathered, as FSDP's `gather` / `prefetch` / `free` keep them:
/// at most one all-gather in flight, and a prefetch skips units already gathered.
struct Gathers {
    live: Vec<bool>,
    inflight: Option<usize>,
}

impl Gathers {
    fn gather(&mut self, u: usize) {
        self.live[u] = true;
        if self.inflight == Some(u) {
            self.inflight = None;
        }
    }
    fn is_gathered(&self, v: usize) -> bool {
        self.live[v] && self.inflight != Some(v)
    }
    /// Prefetches the first of `candidates` that is neither `current` nor gathered.
    fn prefetch(&mut self, mut candidates: impl Iterator<Item = usize>, current: Option<usize>) {
        if let Some(v) = candidates.find(|&v| Some(v) != current && !self.is_gathered(v)) {
            if self.inflight != Some(v) {
                self.live[v] = true;
                self.inflight = Some(v);
            }
        }
    }
    fn free(&mut self, u: usize) {
        self.live[u] = false;
        if self.inflight == Some(u) {
            self.inflight = None;
        }
    }
}

/// FSDP's moments, following its forward and segment-by-segment backward: which units'
/// parameters are gathered (a low-precision copy for `NO_SHARD` under mixed precision, kept
/// from one forward to the next), each unit's unsharded flat gradient from its first backward
/// segment to its reduction (none for `NO_SHARD`, which adds into `.grad`), the fresh gradients
/// of a segment's parameters, and the reduction's output or scratch.
fn fsdp_moments(
    input: &EstimateInput,
    units: &[UnitSize],
    strategy: ShardingStrategy,
    (bp, fp): (BackwardPrefetch, bool),
    offload: bool,
    device: DeviceKind,
) -> Vec<Moment> {
    let (width, b, ckpt) = (input.width, input.batch_size as u64, input.wrap.activation_checkpointing);
    let cb = layout::compute_bytes(&input.wrap);
    let segs = segments(width);
    let unit_of = |s: usize| units.iter().position(|u| u.segments.contains(&s));
    // Bytes a gathered unit adds: nothing for NO_SHARD in fp32 (the shard is the parameter),
    // unless CPU offload copied it to the compute device.
    let unit_bytes = |u: usize| match strategy {
        ShardingStrategy::NoShard if cb == MASTER_BYTES && !offload => 0,
        ShardingStrategy::NoShard => units[u].numel as u64 * cb,
        _ => units[u].padded as u64 * cb,
    };
    // CPU offload: what a gather of unit `u` holds besides the gathered parameters until its
    // all-gather has run — the shard copied to the compute device (fp32) and its cast to the
    // compute dtype (under NO_SHARD the copy is the gathered parameters in fp32; in bf16 the
    // fp32 copy lives until it is cast).
    let copy_bytes = |u: usize| match (offload, strategy) {
        (false, _) => 0,
        (true, ShardingStrategy::NoShard) if cb == MASTER_BYTES => 0,
        (true, ShardingStrategy::NoShard) => units[u].numel as u64 * MASTER_BYTES,
        (true, _) => units[u].shard as u64 * (MASTER_BYTES + if cb == MASTER_BYTES { 0 } else { cb }),
    };
    let kept_before = |s: usize| if s == 0 { b * input_bytes_per_sample(cb) } else { activations(&segs, s - 1, false, ckpt, cb, b) };
    let sum = |set: &[bool], bytes: &dyn Fn(usize) -> u64| set.iter().enumerate().filter(|(_, &x)| x).map(|(u, _)| bytes(u)).sum::<u64>();
    // The unsharded flat gradient, in the reduce dtype (fp32: a bf16 gradient is widened as it
    // is added). NO_SHARD without offload adds into the shard's `.grad` itself (counted as
    // gradients) once it exists: only the first backward allocates one, which becomes `.grad`.
    let in_grad = !strategy.is_sharded() && !offload;
    let flat_bytes = |u: usize| if in_grad { 0 } else { units[u].padded as u64 * MASTER_BYTES };
    // The gathered units' parameters, and the device copy of a prefetch still in flight (its
    // all-gather reads it until it completes).
    let gathered = |g: &Gathers| sum(&g.live, &unit_bytes) + g.inflight.map_or(0, copy_bytes);
    // Gathers unit `u`, if any; the bytes of its device copy when that took a
    // copy: the unit was not gathered (nor prefetched) yet and its shard is offloaded.
    let gather = |g: &mut Gathers, u: Option<usize>| {
        let u = u?;
        let fresh = !g.live[u];
        g.gather(u);
        Some(copy_bytes(u)).filter(|&c| fresh && c > 0)
    };
    let sharded = strategy.is_sharded();
    // NO_SHARD's cast to the compute dtype is written over by the next forward's gather, not
    // freed: every unit's is alive from the start of a forward.
    let kept_casts = strategy == ShardingStrategy::NoShard && cb != MASTER_BYTES;
    let mut g = Gathers { live: vec![kept_casts; units.len()], inflight: None };
    let mut out = Vec::new();
    for s in 0..segs.len() {
        let u = unit_of(s);
        if let Some(copy) = gather(&mut g, u) {
            let what = format!("all-gather for {} (offloaded shard on the device)", segs[s].name);
            out.push(Moment { what, activations: kept_before(s), transient: gathered(&g) + copy });
        }
        if fp && sharded {
            g.prefetch((s + 1..segs.len()).filter_map(unit_of), u);
        }
        let what = format!("forward of {}", segs[s].name);
        out.push(Moment { what, activations: activations(&segs, s, false, ckpt, cb, b), transient: gathered(&g) });
        if let Some(u) = u.filter(|&u| strategy.reshard_after_forward() && units[u].segments.last() == Some(&s)) {
            g.free(u);
        }
    }
    g.inflight = None;
    let mut flat = vec![false; units.len()];
    for s in (0..segs.len()).rev() {
        let u = unit_of(s);
        if let Some(copy) = gather(&mut g, u) {
            out.push(Moment {
                what: format!("all-gather for the backward of {} (offloaded shard on the device)", segs[s].name),
                activations: activations(&segs, s, false, ckpt, cb, b),
                transient: gathered(&g) + sum(&flat, &flat_bytes) + copy,
            });
        }
        if bp == BackwardPrefetch::BackwardPre && sharded {
            g.prefetch((0..s).rev().filter_map(unit_of), u);
        }
        // The segment's gradients are computed with the unit's flat gradient alive only if an
        // earlier segment of the unit made it: FSDP allocates it after the unit's first
        // gradients (counting it from the start of the unit's backward counted fc1's flat
        // gradient twice with one unit per layer).
        let fresh = cb * layout::segment_numel(width, s) as u64;
        let transient = gathered(&g) + sum(&flat, &flat_bytes) + fresh;
        out.push(Moment {
            what: format!("backward of {}", segs[s].name),
            activations: activations(&segs, s, true, ckpt, cb, b) + segment_by_segment(&segs, s, cb, b),
            transient,
        });
        let done = u.filter(|&u| units[u].segments.first() == Some(&s));
        if let Some(u) = done.filter(|_| sharded) {
            // The unit's backward is over: its gathered parameters are freed before its
            // gradients go into the flat gradient.
            g.free(u);
            if bp == BackwardPrefetch::BackwardPost {
                g.prefetch((0..s).rev().filter_map(unit_of), Some(u));
            }
        }
        if let Some(u) = u.filter(|_| fresh > 0) {
            flat[u] = true;
            let kept = kept_before(s);
            let transient = gathered(&g) + sum(&flat, &flat_bytes) + fresh;
            out.push(Moment { what: format!("flat gradient of {}", segs[s].name), activations: kept, transient });
        }
        let Some(u) = done else { continue };
        flat[u] = false;
        let unit = &units[u];
        // The flat gradient (fp32) reduce-scattered into a fresh shard; NO_SHARD all-reduces it
        // in place (`.grad` itself without offload), Open MPI's scratch beside it.
        let padded = MASTER_BYTES * unit.padded as u64;
        let reduce = match (sharded, in_grad) {
            (true, _) => MASTER_BYTES * (unit.padded + unit.shard) as u64,
            (false, true) => scratch_on(device, padded, input.world_size),
            (false, false) => padded + scratch_on(device, padded, input.world_size),
        };
        let kept = kept_before(s);
        let transient = gathered(&g) + sum(&flat, &flat_bytes) + reduce;
        out.push(Moment { what: "gradient reduction".into(), activations: kept, transient });
    }
    out.push(finite_check(input, units.iter().map(|u| u.shard).max().unwrap_or(0)));
    out
}

/// The strategies `estimate-memory` compares by default, fastest first (the book's order:
/// DDP, ZeRO-1, SHARD_GRAD_OP, FULL_SHARD), then NO_SHARD, each with its default options.
pub fn default_strategies() -> Vec<Strategy> {
    vec![
        Strategy::default(),
        zero1(),
        Strategy::fsdp(ShardingStrategy::ShardGradOp),
        Strategy::fsdp(ShardingStrategy::FullShard),
        Strategy::fsdp(ShardingStrategy::NoShard),
    ]
}

/// DDP with ZeRO-1 (`ZeroRedundancyOptimizer`) and its other defaults.
pub fn zero1() -> Strategy {
    Strategy::Ddp(DdpOptions { zero_redundancy_optimizer: true, ..Default::default() })
}

/// Reads a strategy for the estimate: `zero1` (also `zero-1`, `zero_1`, `ddp-zero1`: DDP with
/// ZeRO-1), else any spelling [`Strategy`] reads (`ddp`, `fsdp-full-shard`, `FULL_SHARD`, …).
///
/// # Errors
/// A message naming the text and every accepted name.
pub fn parse_strategy(text: &str) -> std::result::Result<Strategy, String> {
    let t = text.trim().to_ascii_lowercase().replace('_', "-");
    if matches!(t.as_str(), "zero1" | "zero-1" | "ddp-zero1") {
        return Ok(zero1());
    }
    text.parse::<Strategy>().map_err(|_| {
        let names: Vec<&str> = default_strategies().into_iter().map(Strategy::label).collect();
        let why = <Strategy as crate::parallel::Choice>::unsupported(text).map_or(String::new(), |w| format!("{w}; "));
        format!("invalid strategy {text:?}: {why}expected one of {}", names.join(", "))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parallel::Precision;

    use crate::parallel::OffloadDevice;

    fn input(strategy: Strategy, batch_size: usize, activation_checkpointing: bool) -> EstimateInput {
        let wrap = WrapConfig { strategy, mixed_precision: Precision::No, activation_checkpointing };
        EstimateInput {
            wrap,
            world_size: 2,
            width: 128,
            batch_size,
            offload_optimizer: OffloadDevice::None,
            save_checkpoint: false,
            cpu_bf16: None,
            huge_pages: None,
        }
    }

    /// CPU offload: each gather holds the unit's shard copied to the device beside the gathered
    /// parameters until its all-gather has run — with one unit per layer at width 4096, fc1's
    /// gather holds its padded parameters and its shard, both fp32, and that is the peak.
    #[test]
    fn offload_counts_the_shard_copied_to_the_device_during_its_gather() {
        let fsdp = |offload_params| {
            Strategy::Fsdp(crate::parallel::FsdpOptions {
                min_num_params: 0,
                offload_params,
                ..crate::parallel::FsdpOptions::with_sharding(ShardingStrategy::FullShard)
            })
        };
        let at = |offload| EstimateInput { width: 4096, ..input(fsdp(offload), 64, false) };
        let on = at(true);
        let Engine::Fsdp(o) = Engine::of(&on.wrap) else { panic!("FSDP") };
        let units = layout::fsdp_units(4096, &o, 2);
        let moments =
            fsdp_moments(&on, &units, ShardingStrategy::FullShard, (o.backward_prefetch, o.forward_prefetch), true, DeviceKind::Cpu);
        let fc1 = units.iter().find(|u| u.segments == [3]).expect("fc1's unit");
        let gather = moments.iter().find(|m| m.what == "all-gather for fc1 (offloaded shard on the device)").expect("fc1's gather");
        assert_eq!(gather.transient, 4 * (fc1.padded + fc1.shard) as u64);
        // One gather per unit in forward; in backward only those not prefetched (their copies
        // count while the prefetch is in flight).
        assert_eq!(moments.iter().filter(|m| m.what.starts_with("all-gather for") && !m.what.contains("backward")).count(), units.len());
        let (with, without) = (estimate(&on).unwrap().remove(0), estimate(&at(false)).unwrap().remove(0));
        assert!(with.peak_growth > without.peak_growth);
        // Without offload no gather moment is added.
        let plain = fsdp_moments(
            &at(false),
            &units,
            ShardingStrategy::FullShard,
            (o.backward_prefetch, o.forward_prefetch),
            false,
            DeviceKind::Cpu,
        );
        assert!(plain.iter().all(|m| !m.what.starts_with("all-gather")));
    }

    #[test]
    fn the_peak_grows_with_the_batch_by_the_kept_activations() {
        let at = |b| estimate(&input(Strategy::default(), b, false)).unwrap().remove(0);
        let large = at(512);
        assert_eq!(large.peak_at, "backward of conv2");
        // Backward of conv2: the batch (image, label, channels-last copy), conv1's relu,
        // conv2's kept tensors, its output and input gradients.
        let per_sample = 784 * 4 + 8 + 784 * 4 + 4 * 21_632 + 4 * 9216 + 9216 + 4 * (36_864 + 21_632);
        assert_eq!(large.activations, (512.0 * per_sample as f64 * RESIDENT_PER_LIVE_FP32) as u64);
        assert_eq!(large.transient, 4 * 18_496, "conv2's fresh gradients");
        let m = large.model_state;
        assert_eq!(large.peak_growth, m.gradients + m.optimizer + large.activations + large.transient + RUNTIME_BYTES);
        // The non-finite check copies one piece of a gradient to f64 at a time, not fc1's whole
        // weight gradient (which at width 4096 made it the step's peak).
        let wide = estimate(&EstimateInput { width: 4096, ..input(Strategy::default(), 64, false) }).unwrap().remove(0);
        let check = finite_check(&EstimateInput { width: 4096, ..input(Strategy::default(), 64, false) }, 9216 * 4096);
        assert_eq!(check.transient, 8 << 20);
        assert_ne!(wide.peak_at, "non-finite check");
        // Huge pages from 32 MiB of parameters (width 1024: 36 MiB) on a CPU, not on CUDA.
        let runtime =
            |width, device| estimate_on(&EstimateInput { width, ..input(Strategy::default(), 64, false) }, device).unwrap()[0].runtime;
        assert_eq!((runtime(512, DeviceKind::Cpu), wide.runtime), (RUNTIME_BYTES, RUNTIME_BYTES + HUGE_PAGES_BYTES));
        assert_eq!(runtime(1024, DeviceKind::Cpu), RUNTIME_BYTES + HUGE_PAGES_BYTES);
        assert_eq!(runtime(1024, DeviceKind::Cuda), runtime(128, DeviceKind::Cuda));
    }

    /// On CUDA the same moment at batch 512 (backward of conv2) counts its activations at their
    /// live bytes, and the runtime term is the cuBLAS workspaces plus the per-sample term.
    #[test]
    fn cuda_counts_live_bytes_and_the_workspaces() {
        let i = input(Strategy::default(), 512, false);
        let (cpu, cuda) = (estimate(&i).unwrap().remove(0), estimate_on(&i, DeviceKind::Cuda).unwrap().remove(0));
        assert_eq!(cuda.peak_at, "backward of conv2");
        let per_sample = 784 * 4 + 8 + 784 * 4 + 4 * 21_632 + 4 * 9216 + 9216 + 4 * (36_864 + 21_632);
        assert_eq!(cuda.activations, 512 * per_sample);
        assert_eq!(cpu.activations, (cuda.activations as f64 * RESIDENT_PER_LIVE_FP32) as u64);
        assert_eq!(cuda.runtime, (64 << 20) + 512 * CUDA_BYTES_PER_SAMPLE);
        assert_eq!(cuda.model_state, cpu.model_state);
        let m = cuda.model_state;
        // MNIST on the device: 70,000 images of 784 bytes and i64 labels, two 256-entry f32
        // tables, the rank's half of the 60,000-index epoch order (W = 2); nothing on a CPU.
        assert_eq!(i.world_size, 2);
        assert_eq!((cpu.dataset, cuda.dataset), (0, 70_000 * (784 + 8) + 2 * 1024 + 30_000 * 8));
        assert_eq!(cuda_dataset_bytes(3), 70_000 * (784 + 8) + 2 * 1024 + 20_000 * 8);
        let all = m.parameters + m.gradients + m.optimizer + cuda.activations + cuda.transient + cuda.runtime;
        assert_eq!(cuda.total, all + cuda.dataset);
    }

    /// The CUDA allocator's peaks measured on an NVIDIA H200 by `scripts/gpu-check.sh` and its
    /// probes (level 1, W = 1, fp32, 60 steps; libtorch 2.11, cuDNN 9.19; the book's "On a
    /// GPU"), against the estimate of the device's part: within 10% each (within 4% when
    /// measured).
    #[test]
    fn cuda_estimate_is_within_a_tenth_of_the_h200_measurements() {
        use crate::parallel::FsdpOptions;
        let full_shard =
            |offload_params| Strategy::Fsdp(FsdpOptions { offload_params, ..FsdpOptions::with_sharding(ShardingStrategy::FullShard) });
        let at = |strategy, width, batch, ckpt| EstimateInput { world_size: 1, width, ..input(strategy, batch, ckpt) };
        // The allocator's peaks (MiB) of `scripts/gpu-check.sh`'s fit rows and level 1's probes,
        // measured with MNIST on the device (the book's "On a GPU").
        let cases = [
            (at(Strategy::default(), 4096, 512, false), 1058.1),
            (at(Strategy::default(), 4096, 512, true), 1010.0),
            (at(full_shard(false), 4096, 512, false), 1362.0),
            (at(full_shard(true), 4096, 512, false), 786.0),
            (at(full_shard(true), 4096, 512, true), 721.0),
            (at(Strategy::default(), 128, 64, false), 175.1),
            (at(Strategy::default(), 128, 512, false), 414.8),
            (at(Strategy::default(), 4096, 64, false), 867.4),
        ];
        for (i, measured) in cases {
            let e = estimate_on(&i, DeviceKind::Cuda).unwrap().remove(0);
            assert_eq!(e.dataset, cuda_dataset_bytes(1));
            let device = crate::memory::mib(e.total - e.host);
            let error = (device - measured) / measured;
            assert!(
                error.abs() <= 0.10,
                "{:?} width {} batch {}: estimated {device:.1} MiB, measured {measured} ({:+.1}%)",
                i.wrap,
                i.width,
                i.batch_size,
                100.0 * error
            );
        }
    }

    /// DDP checkpointed or overlapped runs the segment-by-segment backward: at conv2's backward
    /// (width 128, batch 512) it holds conv2's output gradient twice more than one graph's
    /// backward — exactly, on CUDA (live bytes, no heap floor). On a CPU, the estimate with
    /// checkpointing is never below the one without (at width 4096 the floor decides, and says so).
    #[test]
    fn a_segmented_ddp_backward_holds_two_output_gradients_and_the_cpu_keeps_the_heap() {
        let ddp = |overlap| Strategy::Ddp(DdpOptions { overlap, ..Default::default() });
        let cuda = |i: &EstimateInput| estimate_on(i, DeviceKind::Cuda).unwrap().remove(0);
        let plain = cuda(&input(ddp(false), 512, false));
        for segmented in [input(ddp(false), 512, true), input(ddp(true), 512, false)] {
            let e = cuda(&segmented);
            assert_eq!((e.peak_at.as_str(), plain.peak_at.as_str()), ("backward of conv2", "backward of conv2"));
            assert_eq!(e.peak_growth - plain.peak_growth, 2 * 9216 * 512 * 4, "{:?}", segmented.wrap);
        }
        let cpu = |width, ckpt| estimate(&EstimateInput { width, ..input(ddp(false), 512, ckpt) }).unwrap().remove(0);
        assert!(cpu(128, true).peak_growth > cpu(128, false).peak_growth);
        let (wide, wide_plain) = (cpu(4096, true), cpu(4096, false));
        let live = |ckpt| cuda(&EstimateInput { width: 4096, ..input(ddp(false), 512, ckpt) }).peak_growth;
        assert!(live(true) < live(false), "checkpointing lowers the live peak at width 4096");
        assert_eq!(wide.peak_growth, wide_plain.peak_growth);
        assert_eq!(wide.peak_at, format!("{} (as without checkpointing)", wide_plain.peak_at));
        for strategy in default_strategies() {
            for (width, batch) in [(128, 64), (4096, 64), (4096, 512)] {
                let at = |ckpt| EstimateInput { width, ..input(strategy, batch, ckpt) };
                let (with, without) = (estimate(&at(true)).unwrap(), estimate(&at(false)).unwrap());
                assert!(with.iter().zip(&without).all(|(a, b)| a.peak_growth >= b.peak_growth), "{strategy:?} {width} {batch}");
            }
        }
    }

    #[test]
    fn bad_input_is_named() {
        let mut i = input(Strategy::default(), 0, false);
        assert!(estimate(&i).unwrap_err().to_string().contains("batch_size"));
        i.batch_size = 1;
        i.world_size = 0;
        assert!(estimate(&i).unwrap_err().to_string().contains("world_size"));
    }
}
