//! `bench run` (`make bench`): level {1,2,3} × strategy × world size × fc1 width × precision
//! (× batch size × activation checkpointing × CPU offload × optimizer offload, when asked),
//! each run `--repeats` times, interleaved with its PyTorch peer from `bench/reference/` (same
//! model, recipe, per-rank batch and threads per rank) so that every ratio compares runs taken
//! minutes apart on the same machine; plus the all-reduce bus bandwidth of
//! `shared/examples/allreduce_bench.rs` next to raw rsmpi.
//!
//! What runs:
//! * strategy `single`: `ladder-baseline` (one process, all cores) — world size 1, width 128,
//!   fp32 only — next to `bench/reference/tutorial.py`;
//! * `ddp`, `fsdp-*`: `ladder-run --nproc-per-node W target/release/<level> --strategy S …`; the
//!   `ddp` runs at width 128 in fp32 are next to `bench/reference/ddp_gloo.py` under
//!   `torchrun --standalone` (PyTorch DDP over gloo) at the same W;
//! * `zero1` is DDP with ZeRO-1 (level 1 `--zero-redundancy-optimizer`, level 2 `--zero-stage 1`,
//!   level 3 `--deepspeed` with `zero_optimization.stage` 1), fp32 only;
//! * FSDP strategies get `--fsdp-min-num-params 0` (every layer its own FlatParameter);
//! * width ≠ 128 or a batch size ≠ 64 runs `--wide-steps` steps (a memory measurement); bf16 is
//!   every level's `--mixed-precision bf16`; `--activation-checkpointing true`,
//!   `--cpu-offload true` (FSDP strategies) and `--offload-optimizer nvme` (the moments in a
//!   directory under `--out-dir`, `nvme/`, removed after each run) every level's own flags; only
//!   DDP at width 128, fp32, batch 64, without checkpointing or offload has PyTorch peers.
//!
//! Outputs in `--out-dir` (default `bench/results/`): `bench.md`, `bench.json`, `bench.csv`,
//! `throughput.svg`, `memory.svg`, every run's own
//! report in `runs/`, its log in `logs/`, each level-3 run's Trainer output (state and loss plot;
//! its checkpoints and weights removed after the run) in `trainer-output/`, and `allreduce-2.json`.
//!
//! The rooms: [`case`] (a cell: how it replicates the model, its PyTorch peer), [`plan`]
//! (`bench run`'s flags and the cells they select), `run` (running them), [`rows`] (a cell's
//! repeats as its row), [`targets`] (issues #10, #11, #23 and #25), [`summary`] (`bench.json`),
//! `render` and `plots` (tables and SVGs).

pub mod case;
mod efficiency;
mod narrow;
pub mod plan;
mod plots;
mod render;
pub mod rows;
mod run;
pub mod summary;
pub mod targets;

pub use case::{label, Case, Peer, Replication};
pub use efficiency::{efficiency_notes, render_efficiency};
pub use narrow::render_terminal;
pub use plan::{plan, RunArgs};
pub use plots::write_plots;
pub use render::{
    render_allreduce, render_buckets, render_csv, render_markdown, render_memory, render_steps, render_targets, render_targets_csv,
    render_throughput,
};
pub use rows::{aggregate, Ours, Row, StepFigures, Theirs};
pub use run::run_matrix;
pub use summary::{AllReduce, AllReduceRow, BucketRow, Buckets, MatrixSummary};
pub use targets::{targets, Target};
