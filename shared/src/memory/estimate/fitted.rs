//! The estimate's measured and fitted constants: how far the heap runs ahead of the live bytes
//! on a CPU, what a training phase adds whatever the model (on a CPU and on CUDA), and Open MPI's
//! all-reduce scratch — each with what it was measured or fitted on.
//!
//! # How close the estimate comes
//!
//! Within 10%, at W = 2, width 128 and 4096 × batch 64 and 512 (four strategies — DDP, ZeRO-1,
//! SHARD_GRAD_OP, FULL_SHARD — or three without ZeRO-1; the fp32 factor and the FSDP runtime
//! term are fitted to the last ten rows' first, the AVX512-BF16 factor to the last six's
//! first, [`HUGE_PAGES_BYTES`] to the first four), and in
//! the book's sweep also at width 8192:
//!
//! | cells | CPU | within 10% | the misses |
//! |---|---|---|---|
//! | level 1, fp32, 1 repeat | Intel Xeon (AMX) | 15 of 16 | ZeRO-1 at width 128, batch 64 (+12.5%) |
//! | level 1, fp32, 3 repeats | AMD EPYC Zen 5 | 15 of 16 | FULL_SHARD at width 128, batch 512 (+16%) |
//! | levels 2 and 3, fp32, 1 repeat | AMD EPYC Zen 5 | 28 of 32 | FULL_SHARD at width 128, batch 64 (−14%, −20%), SHARD_GRAD_OP at 4096, 512 at level 2 (−11%), DDP at 128, 512 at level 3 (−12%) |
//! | level 1, fp32, ± checkpointing, 3 strategies | AMD EPYC Zen 5 | 20 of 24 | DDP at width 128, batch 512 (−10.4%, and −14% with checkpointing), FULL_SHARD at 128, 64 (−11%), SHARD_GRAD_OP at 4096, 512 (+11%) |
//! | level 1, fp32, widths 128, 4096 and 8192, the book's fit sweep, medians of 3 repeats | AMD EPYC Zen 5 | 19 of 24 | ZeRO-1 at widths 4096 and 8192, batch 512 (−16%, −17%), DDP at 128 and 8192, batch 512 (−12%, −10.0%), FULL_SHARD at 128, 64 (−11%); the same sweep with one repeat, earlier the same day: 22 of 24 |
//! | level 1, bf16, ± checkpointing, 3 strategies | AMD EPYC Zen 5 (AVX512-BF16) | 17 of 24 (9 with the AMX factor) | DDP at width 4096, batch 512 with checkpointing (−27%) and FULL_SHARD there (−30%): one rank strayed alone; DDP at 128, 512 (−16%), SHARD_GRAD_OP at 4096, 512 with checkpointing (−14%); FULL_SHARD with checkpointing at 128, 64 (+19%) and 4096, 64 (+13%), SHARD_GRAD_OP at 128, 64 (+13%) |
//! | levels 2 and 3, bf16, 3 strategies, 1 repeat (not fitted to) | AMD EPYC Zen 5 (AVX512-BF16) | 14 of 24 (8 with the AMX factor) | over: SHARD_GRAD_OP and FULL_SHARD at width 4096, batch 64 (+13–14%, three of four), at 128, 64 (+10–20%, three of four), DDP at 4096, 64 at level 3 (+11%); under: FULL_SHARD at 4096, 512 at level 2 and at 128, 512 at level 3 (−11%, −12%), DDP at 128, 512 at level 2 (−11%) |
//! | levels 1–3, fp32, width 4096, W = 1 and 2, DDP, ZeRO-1, FULL_SHARD, AdamW's moments in memory and on disk, 1 repeat (not fitted to) | AMD EPYC Zen 5 | 26 of 36; then, with a one-rank reduce-scatter a copy, the 12 one-rank FULL_SHARD and SHARD_GRAD_OP cells: 12 of 12 | before that fix FULL_SHARD at one rank (−10% to −16%, six cells: Open MPI's temporary); ZeRO-1 at one rank on disk at levels 1 and 2 (+11%), FULL_SHARD at two ranks on disk at levels 2 and 3 (+10%, +12%) |
//! | level 1, fp32, widths 128 and 4096, batch 64, W = 3 and 4, DDP, ZeRO-1, SHARD_GRAD_OP, FULL_SHARD, 1 repeat (not fitted to) | AMD EPYC Zen 5 | 13 of 16 | SHARD_GRAD_OP and FULL_SHARD at width 4096 and 4 ranks (−16%, −15%): from 3 ranks Open MPI 4.1's `MPI_Reduce_scatter_block` reduced through buffers as large as the message on rank 0 (at 3 ranks on rank 1 too), so rank 0 grew by 624–633 MiB and the others by 480–502; FULL_SHARD at width 128 and 4 ranks (−15%, one rank 12 MiB above the others) |
//! | the 8 FSDP cells of the row above, after a large reduce-scatter from 3 ranks became one `MPI_Reduce` per block (`shared/tests/allreduce_memory.rs`), 2 repeats (among the cells [`FSDP_SHARDED_HUGE_PAGES_BYTES`] was fitted to) | AMD EPYC Zen 5 | 11 of 16 runs (12 with [`FSDP_SHARDED_HUGE_PAGES_BYTES`]) | width 4096 all +6.4% to +10.1% with 72 MiB, −0.3% to +2.6% with 36 (rank 0 grows 483–491 MiB at 4 ranks), FULL_SHARD at 4 ranks once +10.06% with 72; width 128: SHARD_GRAD_OP at 4 ranks −17%, −23%, FULL_SHARD at 4 ranks −12.5% and at 3 −11% (one run each) |
//! | the book's sweep (level 1, fp32, W = 2, four strategies, widths 128, 4096 and 8192, batch 64 and 512, medians of 3 repeats), after [`FSDP_SHARDED_HUGE_PAGES_BYTES`] was fitted and not fitted to | AMD EPYC Zen 5 | 21 of 24 (20 with 72 MiB for FSDP; its 8 wide cells −2.0% to +5.4%, were +0.6% to +10.1%) | ZeRO-1 at width 128 and 8192, batch 512 (−14%, −15%), FULL_SHARD at 128, 64 (−12%) |
//! | level 1, fp32, W = 2, DDP, ZeRO-1, SHARD_GRAD_OP, FULL_SHARD × widths 128 and 4096 × batch 64 and 512, **300 steps at width 128 and batch 64, 20 elsewhere**, medians of 3 repeats (the fp32 factor and [`FSDP_RUNTIME_BYTES`] fitted to it) | AMD EPYC Zen 5 | 16 of 16 (10 with the constants before, fitted to shorter runs: every miss under, to −18%) | — |
//! | not fitted to (but used to choose among the equally good fits of the row above): level 1, fp32, as long, 1 to 3 repeats — W = 1 and 4 × the four strategies × widths 128 and 4096 at batch 64 (measured after the fit: 15 of 16, 11 before); W = 1 to 4 at width 128, batch 64, DDP and FULL_SHARD, and SHARD_GRAD_OP at 2 and 4 ranks, NO_SHARD and ZeRO-1 at 4 | AMD EPYC Zen 5 | 30 of 32 (18 before) | ZeRO-1 at width 128, batch 64, 4 ranks (−16%, −12%: no saving on DDP measured there) |
//! | the book's sweep rerun as long (level 1, fp32, W = 2, four strategies, widths 128, 4096 and 8192, batch 64 and 512, 300 steps at 128 and 64, 20 elsewhere, medians of 3 repeats; widths 128 and 4096 the fit's cells again, 8192 not fitted to) | AMD EPYC Zen 5 | 21 of 24 (width 8192: 4 of 6) | ZeRO-1 at widths 4096 and 8192, batch 512 (−17%, −17%), DDP at 8192, 512 (−10.1%) |
//! | levels 2 and 3, fp32, W = 2, DDP and FULL_SHARD, widths 128 (300 steps, 3 repeats) and 4096 (20 steps, 2 repeats), batch 64 (not fitted to) | AMD EPYC Zen 5 | 8 of 8 (−1.5% to +7.0%); in a one-repeat run from a fresh clone, level 3 at width 128 twice outside (+10.2%, +14.4%: one rank 95 MiB, the other 70) | — |
//! | level 1, bf16, W = 2, DDP, SHARD_GRAD_OP, FULL_SHARD × widths 128 and 4096 × batch 64 and 512 × activation checkpointing or not, as long (300 steps at width 128 and batch 64, 20 elsewhere), medians of 3 repeats ([`RESIDENT_PER_LIVE_16BIT_AVX512`] fitted to it, and the 16-bit runtime term chosen with it) | AMD EPYC Zen 5 (AVX512-BF16) | 19 of 24 (11 with the constants before, 1.4 and 36 MiB, fitted to shorter runs: at batch 512 every cell under, to −32%) | SHARD_GRAD_OP at width 4096, batch 512 (−12.2%, −11.7% with checkpointing) and at 128, 64 (+13.5%); with checkpointing at width 4096 and batch 512, DDP (−24%) and FULL_SHARD (−30%): their ranks spread over 807–1,121 and 709–945 MiB across repeats, one rank of a run up to 275 MiB above the other |
//! | levels 2 and 3, bf16, W = 2, DDP and FULL_SHARD × widths 128 and 4096 × batch 64 and 512, as long, medians of 2 repeats (not fitted to) | AMD EPYC Zen 5 (AVX512-BF16) | 15 of 16 (8 before) | FULL_SHARD at width 4096, batch 64 at level 3 (+10.9%) |
//! | level 1, fp32, **W = 8** (four ranks to a core, oversubscribed), DDP, ZeRO-1, SHARD_GRAD_OP, FULL_SHARD × widths 128 and 4096, batch 64, as long, 1 repeat (not fitted to) | AMD EPYC Zen 5 | 5 of 8 | ZeRO-1 at width 128 (−19%: one rank 90 MiB, the others 72–84); SHARD_GRAD_OP and FULL_SHARD at width 4096 (−12%, −11%: every rank 488–512 MiB, about as at W = 4, where the estimate is 54 MiB higher — 506 against 452 — for the model state the other four ranks now hold; a reduce-scatter of fc1's flat gradient, not counted, adds 36 MiB on some rank at W = 8 as at W = 4, `reduce_scatter_bench`; the live bytes follow the estimate — an `LD_PRELOAD` count, FULL_SHARD, 20 steps: every rank 7.5 and 7.6 MiB above the estimate's live bytes at W = 4 and 8, 423.0 and 369.0 MiB — while the anonymous RSS peaks alike, 562–582 and 547–581 MiB: the heap's, as fc1's shard falls under glibc's 32 MiB mmap threshold at W = 8, 18 MiB: with the threshold at 16 MiB, one run, the ranks grew by 429–445 MiB, 479–514 at 32 — not a term yet) |
//! | level 1, fp32, W = 2, the options as long (300 steps at width 128 and batch 64, 20 elsewhere), 2 repeats (not fitted to): activation checkpointing × DDP, ZeRO-1, SHARD_GRAD_OP, FULL_SHARD × widths 128 and 4096 × batch 64 and 512; AdamW's moments on disk (`nvme`) × DDP, ZeRO-1, FULL_SHARD × W = 1 and 2 at width 4096, batch 64; FSDP's CPU offload × SHARD_GRAD_OP, FULL_SHARD × widths 128 and 4096, batch 64 | AMD EPYC Zen 5 | 18 of 26: checkpointing 9 of 16, on disk 5 of 6, CPU offload 4 of 4 | with checkpointing: DDP and ZeRO-1 at width 128, batch 64 (−13%, −12%: DDP grew by 87–95 MiB, 83 without), at width 4096, batch 512 DDP, ZeRO-1, SHARD_GRAD_OP, FULL_SHARD (−13%, −23%, −11%, −10.1%: the estimate counts 37 MiB less live at fc1's backward than without checkpointing, the measured growth is no lower; ZeRO-1's ranks 809–810 and 935–936 in both repeats), FULL_SHARD at 128, 512 (+14%); on disk, DDP at one rank (+11%) |
//! | the checkpointed cells of the row above (fp32, 2 repeats) and of the first bf16 row (3 repeats), level 1, W = 2, as long, after DDP's checkpointed backward was counted segment by segment and the checkpointed estimate floored on a CPU at the one without ([`checkpointing_keeps_the_heap`], chosen from these cells) | AMD EPYC Zen 5 | fp32 13 of 16 (9 before), bf16 9 of 12 (as before) | ZeRO-1 at width 4096, batch 512 (−19%: ranks 809 and 935 MiB); FULL_SHARD and DDP at width 128, batch 512 (+14%, +11%); bf16 at width 4096, batch 512: DDP, SHARD_GRAD_OP, FULL_SHARD (−23%, −10.5%, −29%) |
//! | levels 2 and 3, fp32, W = 2, activation checkpointing × DDP and FULL_SHARD × widths 128 and 4096 × batch 64 and 512, as long, medians of 2 repeats (not fitted to: measured after the row above) | AMD EPYC Zen 5 | 14 of 16 (11 without the row above's two changes) | DDP at width 4096, batch 512 at level 2 (−16.5%), FULL_SHARD there at level 3 (−13.5%) |
//!
//! ## Over how many steps
//!
//! How far the heap runs ahead of the live bytes grows over a run's first tens of steps, so the
//! training phase's peak does too; the fp32 constants are fitted to runs of 20 steps and more
//! (300 at width 128 and batch 64), which reach most of it — the rows above the last ten ran
//! 3 to 20. Level 1, W = 2, fp32, growth per rank (both ranks of one run, at width 128 and batch
//! 64 of two; FULL_SHARD with the levels' default wrap, one unit, where the bench wraps each
//! layer), AMD EPYC Zen 5:
//!
//! | cell | 3 steps | 30 steps | 100 steps | 300 steps |
//! |---|---|---|---|---|
//! | DDP, width 128, batch 64 | 65–68 MiB | 72–78 | 75–91 | 75–85 (81–84 over one epoch, 469) |
//! | FULL_SHARD, width 128, batch 64 | 71–81 | 82–88 | 87–93 | 90–101 (94–96 over 469) |
//! | DDP, width 128, batch 512 | 318 | 359–360 | 353–359 | — |
//! | FULL_SHARD, width 128, batch 512 | 310–328 | 330–413 | 329–425 | — |
//! | DDP, width 4096, batch 64 | 731–734 | 747–752 | 737–757 | — |
//! | FULL_SHARD, width 4096, batch 64 | 739–741 | 740–754 | 748–777 | — |
//! | DDP, width 4096, batch 512 | 835–882 | 940–966 | — | — |
//! | FULL_SHARD, width 4096, batch 512 | 963 | 1,057–1,084 | — | — |
//!
//! Not all of it by 20 steps: DDP at width 128 and batch 512 grew by 342 MiB over 20 (the fit's
//! cell, median of three), 353–360 over 30 and 100. The bench's memory cells run 300 steps at
//! width 128 and batch 64 and `--wide-steps` (20) elsewhere; a cell of fewer steps measures a
//! peak the run has not reached yet. The AVX512-BF16 factor was refitted to such runs too (the
//! table's bf16 rows at the end); AMX's factor was not. The bf16 refit searched the huge-page
//! term too (0 to 120 MiB): 72 is the best fit there, so it stays; the fp32 refit left both
//! huge-page terms as they were, not refitted.
//!
//! Not counted at FSDP's gradient reduction: the reduce-scatter's own temporaries (at 2 ranks
//! the all-reduce's scratch, half the message; from 3 one block, `shared/tests/allreduce_memory.rs`).
//! With them that moment becomes FSDP's peak in bf16 at width 4096 and 2 ranks, 72 MiB higher:
//! with the constants of then (1.4 and 36 MiB), 622 MiB at batch 64 against 484–511 measured
//! (levels 1–3, AMD EPYC Zen 5), where 550 without them was already above (548 now) — not
//! reconciled yet.
//!
//! Each row gives the estimate of its day: the rows above the last eleven counted 72 MiB of huge
//! pages under FSDP's sharded strategies in fp32 too (36 since), the rows above the last ten
//! 1.44 resident bytes per live byte in fp32 and 36 MiB for FSDP's runtime (1.65 and 42
//! since), the bf16 rows above the last six 1.4 with AVX512-BF16 and 36 MiB for every
//! engine's runtime in 16 bits (1.9 and 30 since), and the checkpointed cells above the last two
//! neither DDP's segment-by-segment backward nor the floor of [`checkpointing_keeps_the_heap`].
//!
//! The first four rows are the cells the constants were first fitted to, measured before
//! [`HUGE_PAGES_BYTES`] was a term (67 of their 88 within 10% without it, 78 with it; the
//! constants before that, 1.8 and 26 MiB for every engine, held 40 of the first 64). What is
//! left, measured: at batch 512 DDP's and ZeRO-1's heap runs ahead of the estimate by an amount
//! that changes from run to run (ZeRO-1 at width 4096 grew by 782 MiB in one sweep, 883 in the
//! next, against 733 estimated then, so its measured saving on DDP was 124 and 54 MiB, not the 144 of
//! the halved moments it makes at batch 64; its two ranks' live bytes are the same — an
//! `LD_PRELOAD` count at width 4096, batch 512, 20 steps: 587.7 MiB of growth on each, 570.3 in
//! the estimate — while their RSS grew by 779 and 830 MiB, the difference the heap's); at width 128 FULL_SHARD's heap varies alike (the
//! same cell at batch 512 grew by 369 MiB in one sweep and 308 in the next); one run's rank can stray alone (DDP in bf16 at width 4096 with
//! checkpointing: 808 and 1,072 MiB on two ranks of one cell; at one rank, 8 steps, it grew by
//! 876 MiB against 832 estimated, live bytes 644 counted and 658 estimated) — other allocators, preloaded on
//! the Zen 5, repeat within 0–7% but cost speed (jemalloc, mimalloc: 21–40% at width 128) or
//! change what the strategies save (tcmalloc: ZeRO-1 at width 4096, batch 64, 30 MiB below DDP,
//! not 144), see the book's "Will it fit?"; and the 16-bit factor depends
//! on the CPU's bf16 unit — over runs of 3 to 20 steps AMX kernels left more of the heap than
//! AVX512-BF16 ones (2.3 resident bytes per live byte on the Intel Xeon, 1.4 on the Zen 5; over
//! runs as long as the bench's the Zen 5 keeps 1.9, and AMX's is not remeasured) — and a CPU
//! without one (emulated bf16) is not measured: it takes the larger. Level 3's end-of-training save comes after its
//! last step; it is a moment of its own when [`super::EstimateInput::save_checkpoint`] is set
//! ([`crate::memory::checkpoint_save`]).

use crate::device::{CpuBf16Unit, DeviceKind};
use crate::memory::layout::{compute_bytes, Engine, MASTER_BYTES};
use crate::parallel::{Precision, WrapConfig};

/// Resident bytes per byte of live activations computed in f32: glibc keeps freed heap memory
/// (tensors under its mmap threshold, up to 32 MiB) for reuse, and a step frees and allocates
/// its tensors in an order that leaves part of it unusable for the next ones, so the heap's
/// touched extent runs ahead of what is alive — and further with every step for the first
/// tens of them (the module docs' "Over how many steps"). Measured with an `LD_PRELOAD` count
/// of live `malloc`'d bytes against `VmHWM` (level 1, W = 1, 8 steps, AMD EPYC Zen 5): RSS
/// growth less live growth 30 (DDP) and 40 MiB (FULL_SHARD) at width 128 and batch 64, 141
/// and 126 at batch 512, 75 to 85 at width 4096 whatever the batch — after 8 steps. Fitted,
/// with [`FSDP_RUNTIME_BYTES`], to runs long enough for most of that growth: the 16 cells of level 1 at W = 2 in fp32
/// (DDP, ZeRO-1, SHARD_GRAD_OP, FULL_SHARD × width 128 and 4096 × batch 64 and 512; 300 steps
/// at width 128 and batch 64, 20 elsewhere; medians of three repeats; AMD EPYC Zen 5,
/// 2026-12-05): 16 of 16 within 10% (10 with 1.44 and 36 MiB, the constants fitted before to
/// runs of 3 to 20 steps), and 30 of 32 cells not fitted to (W = 1 to 4, widths 128 and
/// 4096, batch 64, as long; 18 before), which chose among the equally good fits.
pub const RESIDENT_PER_LIVE_FP32: f64 = 1.65;

/// Resident bytes per byte of live activations computed in 16 bits (bf16, fp16) on a CPU with
/// AMX: autocast's casts add short-lived copies between the kept tensors, and the heap runs
/// further ahead (DDP at batch 512: a live peak of 120 MiB, RSS growth 290). Fitted with the
/// f32 constants of then (1.8, and 26 MiB for every engine) to the 77 cells of one
/// `make book-data`-sized run (levels 1–3, every strategy, widths 128 to 8192, batch 16 to 512,
/// commit `b3f165d`, Intel Xeon with AMX); not refitted since. Its wide cells already ran with
/// huge pages, so with [`HUGE_PAGES_BYTES`] now added on top, AMX's wide bf16 estimate may count
/// them twice (not re-measured: no AMX machine since); and the 16-bit runtime term under it
/// has been 26, 36 and now 30 MiB ([`RUNTIME_BYTES`], chosen with the AVX512-BF16 factor on
/// longer runs). Also taken where the CPU's unit is unknown or absent (emulated bf16: not
/// measured), as the larger of the two measured.
pub const RESIDENT_PER_LIVE_16BIT: f64 = 2.3;

/// [`RESIDENT_PER_LIVE_16BIT`] on a CPU whose bf16 unit is AVX512-BF16 without AMX. Fitted,
/// with the 16-bit runtime term ([`RUNTIME_BYTES`] for every engine), to the 24 bf16 cells of
/// level 1 at W = 2 (DDP, SHARD_GRAD_OP, FULL_SHARD × width 128 and 4096 × batch 64 and 512 ×
/// activation checkpointing or not; 300 steps at width 128 and batch 64, 20 elsewhere; medians
/// of three repeats; AMD EPYC Zen 5, 2026-12-05): 19 of the 24 within 10%, and 15 of 16 cells
/// not fitted to (levels 2 and 3, DDP and FULL_SHARD, as long, two repeats) — 11 and 8 with 1.4
/// and 36 MiB, fitted before to runs of 3 to 20 steps, under at every batch-512 cell (to −32%).
/// 2.0 or 2.05 with 26 or 24 MiB fit as well (20 of 24 and 14 or 15 of 16); the runtime term
/// of fp32's DDP was taken instead of a third. Taken for every AVX512-BF16 CPU (Intel Cooper
/// Lake, AMD Zen 4) though measured on the Zen 5 alone.
pub const RESIDENT_PER_LIVE_16BIT_AVX512: f64 = 1.9;

/// [`RESIDENT_PER_LIVE_FP32`] for a compute dtype of `compute_bytes` ≥ 4 bytes per element;
/// for 16 bits, [`RESIDENT_PER_LIVE_16BIT_AVX512`] on a CPU whose bf16 unit is AVX512-BF16 and
/// [`RESIDENT_PER_LIVE_16BIT`] on any other (AMX, none, or `None`: not known).
pub fn resident_per_live(compute_bytes: u64, cpu_bf16: Option<CpuBf16Unit>) -> f64 {
    if compute_bytes >= MASTER_BYTES {
        RESIDENT_PER_LIVE_FP32
    } else if cpu_bf16 == Some(CpuBf16Unit::Avx512Bf16) {
        RESIDENT_PER_LIVE_16BIT_AVX512
    } else {
        RESIDENT_PER_LIVE_16BIT
    }
}

/// Bytes a training phase adds whatever the model: libtorch's, oneDNN's and Open MPI's
/// first-use buffers and the data loader's (fitted with [`RESIDENT_PER_LIVE_FP32`] on shorter
/// runs, and kept when that factor was refitted to longer ones). Also every engine's in 16
/// bits, DDP's there (on FSDP's NO_SHARD path) included: chosen with
/// [`RESIDENT_PER_LIVE_16BIT_AVX512`] on runs as long (with 36 MiB, the 16-bit term before,
/// no factor put more than 15 of its 24 cells within 10%).
///
/// Not counted: MKL's f32 matrix-multiply buffers (`mkl_serv_allocate`, from
/// `sgemm_get_bufs`), which it keeps per thread between steps when a process runs more than
/// one intra-op thread. `ladder-baseline`'s two threads at width 128 kept 34.8 MiB beyond the
/// model state; PyTorch's BasicNet on the same libtorch (bf16: none; one thread: 0 to 16 MiB),
/// f32, 64 samples, kept:
///
/// | threads | width 128 | width 1024 | width 4096 | width 8192 |
/// |---|---|---|---|---|
/// | 2 | 34 MiB | 38 | 57 | 70 |
/// | 4 | 59 | 52 | 115 | 141 |
///
/// and at 512 samples or under load less or more (4 threads, width 4096: 32 MiB) — MKL's own
/// partitioning, not a closed form. The bench's cells run one thread per rank.
pub const RUNTIME_BYTES: u64 = 30 << 20;

/// What transparent huge pages add to a training phase on a CPU, once libtorch backs its
/// tensors of 2 MiB and more with them (`THP_MEM_ALLOC_ENABLE`, which the levels turn on from
/// 32 MiB of parameters: [`crate::device::huge_pages_by_default`]): each such block is aligned
/// to 2 MiB and faulted in a huge page at a time, so the heap keeps whole pages where freed
/// blocks lie between live ones — resident bytes that no live tensor holds (the mechanism is
/// not isolated; the term is fitted, not derived). Fitted with the
/// constants above to the cells at width 4096 (added on top of them: 67 of 88 fp32 cells
/// within 10% without it, 78 with it, on the Intel Xeon and the AMD EPYC Zen 5), and it holds
/// the width-8192 cells of the book's fit sweep (19 to 22 of 24 with widths 128 to 8192 in two
/// sweeps). The
/// same runs with `THP_MEM_ALLOC_ENABLE=0` (level 1, W = 2, width 4096, FULL_SHARD, Zen 5):
/// 120 MiB less at batch 512, but 130 MiB more at batch 64, where 4 KiB pages leave the
/// heap's top and the mapped blocks resident in another pattern — a term for the default
/// only. At width 1024, the narrowest measured (the term starts at 908; DDP, W = 2, two runs): measured 238–243
/// and 459–484 MiB at batch 64 and 512, estimated 269 and 473 (197 and 401 without the term).
pub const HUGE_PAGES_BYTES: u64 = 72 << 20;

/// [`HUGE_PAGES_BYTES`] for FSDP's sharded strategies (FULL_SHARD, SHARD_GRAD_OP, the hybrid
/// ones) in fp32, whose flat buffers leave fewer stray huge pages than DDP's buckets and
/// ZeRO-1's (mechanism not isolated either). With 72 MiB these cells were 3 to 12% above the
/// measured growth at batch 64 — 36 to 55 MiB at every width from 4096 and every W — once Open
/// MPI's reduce-scatter temporaries were out of FSDP's figures (a one-rank reduce-scatter a copy,
/// one `MPI_Reduce` per block from 3 ranks). Fitted to the 34 such cells at hand (AMD EPYC Zen
/// 5: levels 1–3, W = 1 to 4, widths 4096 and 8192, batch 64 and 512, AdamW's moments in memory
/// and on disk): 31 of them within 10% with 72 MiB, all 34 with 36 (−4.7% to +4.1%); then
/// checked on a sweep not fitted to (the module docs' table). bf16 keeps 72: its level-1 cells
/// at width 4096 were already below the measured growth (−0.4% to −33%). NO_SHARD (DDP's
/// memory, on FSDP's engine) keeps 72, not measured apart.
pub const FSDP_SHARDED_HUGE_PAGES_BYTES: u64 = 36 << 20;

impl super::EstimateInput {
    /// [`huge_pages`](Self::huge_pages), or the levels' default for this width's parameters
    /// ([`crate::device::huge_pages_by_default`]).
    pub fn huge_pages_on(&self) -> bool {
        self.huge_pages.unwrap_or_else(|| crate::device::huge_pages_by_default(crate::model::BasicNet::param_bytes(self.width)))
    }
}

/// [`RUNTIME_BYTES`] under FSDP in fp32: its segment-by-segment backward and flat buffers
/// leave more of glibc's heap behind (RSS growth less live growth 8 to 10 MiB above DDP's
/// after 8 steps in the measurements of [`RESIDENT_PER_LIVE_FP32`]; at width 128, batch 64
/// and 2 ranks, FULL_SHARD's growth over 300 steps is 12 to 23 MiB above DDP's, about 7 of it
/// its larger live peak); fitted with it (36 MiB before, on shorter runs). In fp32 only: in 16
/// bits every engine takes [`RUNTIME_BYTES`].
pub const FSDP_RUNTIME_BYTES: u64 = 42 << 20;

/// On CUDA, what the caching allocator holds for any model once a step ran: cuBLAS's and
/// cuBLASLt's workspaces, 32 MiB each with PyTorch's defaults on Hopper, allocated at the
/// first matrix product and kept (an H200, libtorch 2.11: a run with
/// `CUBLAS_WORKSPACE_CONFIG=:0:0` peaked 65 MiB lower; one `F.linear` left 32.0 MiB allocated
/// beyond its output). Older GPUs' default workspaces are smaller (PyTorch: 8 MiB per handle
/// before Hopper), so this errs high there.
pub const CUDA_RUNTIME_BYTES: u64 = 64 << 20;

/// On CUDA, bytes per sample beyond the live-byte model, fitted (0.16 MiB) to the measurements
/// of the module docs — not a sum of parts. What contributes, measured alone with PyTorch on the
/// same machine: cuDNN's workspace for conv2's backward (120 MiB at batch 512, 18 MiB at batch
/// 64), max_pool2d's int64 indices (8 bytes per pooled element, where the CPU kernel keeps
/// one-byte window codes) and, the other way, dropout's one-byte masks (where the CPU keeps its
/// noise in the compute dtype); not all of them are alive at the step's peak.
pub const CUDA_BYTES_PER_SAMPLE: u64 = 167_772;

/// Resident bytes per live activation byte and the runtime term, for `wrap` at `batch` samples
/// per rank on `device`: on a CPU (whose bf16 unit is `cpu_bf16`, used in bf16 only)
/// [`resident_per_live`] and [`RUNTIME_BYTES`] (FSDP in fp32: [`FSDP_RUNTIME_BYTES`]), plus
/// [`HUGE_PAGES_BYTES`] where tensors are backed with `huge_pages` (FSDP's sharded strategies
/// in fp32: [`FSDP_SHARDED_HUGE_PAGES_BYTES`]); on CUDA live bytes as they
/// are (the allocator counts tensors exactly), [`CUDA_RUNTIME_BYTES`] and
/// [`CUDA_BYTES_PER_SAMPLE`] per sample.
pub(super) fn heap_terms(device: DeviceKind, wrap: &WrapConfig, batch: u64, huge_pages: bool, cpu_bf16: Option<CpuBf16Unit>) -> (f64, u64) {
    match device {
        DeviceKind::Cpu => {
            let (engine, cb) = (Engine::of(wrap), compute_bytes(wrap));
            let fp32 = cb >= MASTER_BYTES;
            let (runtime, sharded) = match engine {
                Engine::Fsdp(o) => (if fp32 { FSDP_RUNTIME_BYTES } else { RUNTIME_BYTES }, o.sharding_strategy.is_sharded()),
                Engine::Ddp(_) => (RUNTIME_BYTES, false),
            };
            let huge_pages = match (huge_pages, sharded && fp32) {
                (false, _) => 0,
                (true, true) => FSDP_SHARDED_HUGE_PAGES_BYTES,
                (true, false) => HUGE_PAGES_BYTES,
            };
            // The unit's factor was measured in bf16; fp16 (refused on a CPU by the levels)
            // keeps the larger one.
            let unit = cpu_bf16.filter(|_| wrap.mixed_precision == Precision::Bf16);
            (resident_per_live(cb, unit), runtime + huge_pages)
        }
        DeviceKind::Cuda => (1.0, CUDA_RUNTIME_BYTES + CUDA_BYTES_PER_SAMPLE * batch),
    }
}

/// Whether the estimate with activation checkpointing is held to at least the one without:
/// on a CPU, yes. Checkpointing lowers the live peak a little (level 1, W = 1, DDP, width
/// 4096, batch 512, 8 steps, an `LD_PRELOAD` count: 726.6 against 734.6 MiB) but not the
/// resident one: the RSS grew more (961.7 against 870.9 MiB), presumably as the recomputes run
/// while backward's gradients hold the heap (not isolated). Over runs as long as the bench's (level 1, W = 2, widths
/// 128 and 4096 × batch 64 and 512; fp32: DDP, ZeRO-1, SHARD_GRAD_OP, FULL_SHARD, medians of 2
/// repeats; bf16: DDP, SHARD_GRAD_OP, FULL_SHARD, of 3; AMD EPYC Zen 5) no checkpointed cell
/// grew more than 6% less than its twin without, and 10 of the 28 grew 5% to 27% more. With
/// this floor (and DDP's segment-by-segment backward counted) 13 of the 16 fp32 cells are
/// within 10% (9 before) and 9 of the 12 bf16 ones (as before); measured afterwards, levels 2
/// and 3 (DDP and FULL_SHARD, fp32, the same widths and batches): 14 of 16 (11 without). On
/// CUDA the allocator counts what is alive: no floor.
pub fn checkpointing_keeps_the_heap(device: DeviceKind, wrap: &WrapConfig) -> bool {
    device == DeviceKind::Cpu && wrap.activation_checkpointing
}

/// `checkpointed`, or `plain` (the same input without checkpointing, where
/// [`checkpointing_keeps_the_heap`]) when that is higher, its peak said to be that run's.
pub(super) fn floored(checkpointed: super::RankEstimate, plain: Option<super::RankEstimate>) -> super::RankEstimate {
    match plain {
        Some(p) if p.peak_growth > checkpointed.peak_growth => {
            super::RankEstimate { peak_at: format!("{} (as without checkpointing)", p.peak_at), ..p }
        }
        _ => checkpointed,
    }
}

/// Resident bytes Open MPI's all-reduce of a `message`-byte buffer adds while it runs, at
/// `world_size` ranks (Open MPI 4.1.4, `tuned` component, shared memory): 0 at one rank, half
/// the message at W = 2 and 3 — measured by `shared/tests/allreduce_memory.rs` (0.494 to 0.498
/// of a 64 MiB f32 message on every rank, Intel Xeon, at W = 2 and 3; larger world sizes are
/// not measured and assumed the same). Open MPI's large-message algorithms reduce-scatter
/// first, receiving the part a rank reduces into a scratch buffer. DDP all-reduces each
/// bucket in place, so in its gradient reduction this comes on top of the bucket's copy.
pub fn allreduce_scratch_bytes(message: u64, world_size: usize) -> u64 {
    if world_size <= 1 {
        0
    } else {
        message / 2
    }
}

/// [`allreduce_scratch_bytes`] where the collective's scratch is counted: Open MPI's, in host
/// memory, on a CPU; none on CUDA, where NCCL's buffers are its own, outside the caching
/// allocator's count.
pub(super) fn scratch_on(device: DeviceKind, message: u64, world_size: usize) -> u64 {
    match device {
        DeviceKind::Cpu => allreduce_scratch_bytes(message, world_size),
        DeviceKind::Cuda => 0,
    }
}
