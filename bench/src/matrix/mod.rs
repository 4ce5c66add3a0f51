//! `bench run` (`make bench`): level {1,2,3} × strategy × world size × fc1 width × precision,
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
//! * FSDP strategies get `--fsdp-min-num-params 0` (every layer its own FlatParameter);
//! * width ≠ 128 runs `--wide-steps` steps (a memory measurement); bf16 (`--mixed-precision bf16`)
//!   exists at levels 2 and 3 only.
//!
//! Outputs in `--out-dir` (default `bench/results/`): `bench.md`, `bench.json`, `bench.csv`,
//! `throughput.svg`, `memory.svg`, every run's own
//! report in `runs/`, its log in `logs/`, and `allreduce-2.json`.

mod plots;
mod render;
mod run;

pub use plots::write_plots;

pub use render::{
    render_allreduce, render_buckets, render_csv, render_markdown, render_memory, render_steps, render_targets, render_targets_csv,
    render_terminal, render_throughput,
};
pub use run::run_matrix;

use crate::error::{Error, Result};
use crate::figures::{ModelState, PhaseTimes, RunFigures, StepTiming};
use crate::machine::Machine;
use crate::stats::Spread;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// How the model is replicated: the process-level strategies of the matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Strategy {
    /// One process, no process group: `ladder-baseline` (level-independent).
    Single,
    /// DistributedDataParallel.
    Ddp,
    /// FSDP FULL_SHARD (ZeRO-3).
    FsdpFullShard,
    /// FSDP SHARD_GRAD_OP (ZeRO-2).
    FsdpShardGradOp,
    /// FSDP NO_SHARD.
    FsdpNoShard,
}

impl Strategy {
    /// The flag value / report name (`fsdp-full-shard`).
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Single => "single",
            Strategy::Ddp => "ddp",
            Strategy::FsdpFullShard => "fsdp-full-shard",
            Strategy::FsdpShardGradOp => "fsdp-shard-grad-op",
            Strategy::FsdpNoShard => "fsdp-no-shard",
        }
    }
}

/// Parameter and compute precision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// f32 throughout.
    Fp32,
    /// bf16 compute with fp32 master weights (every level's `--mixed-precision bf16`, as
    /// Accelerate's).
    Bf16,
}

impl Precision {
    /// `fp32` / `bf16`.
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
        }
    }
}

/// `bench run`'s options. Every list flag takes comma-separated values.
#[derive(Debug, Clone, clap::Args)]
pub struct RunArgs {
    /// Levels (1, 2, 3).
    #[arg(long, value_delimiter = ',', default_values_t = [1u8, 2, 3])]
    pub levels: Vec<u8>,
    /// Strategies (`single` is ladder-baseline, one process).
    #[arg(long, value_enum, value_parser = ladder_core::cli::choice::<Strategy>(), value_delimiter = ',', default_values_t = [Strategy::Single, Strategy::Ddp, Strategy::FsdpFullShard, Strategy::FsdpShardGradOp])]
    pub strategies: Vec<Strategy>,
    /// World sizes (ranks; more ranks than cores are oversubscribed).
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 2, 4])]
    pub world_sizes: Vec<usize>,
    /// fc1 widths (128 is the tutorial's BasicNet; 4096 gives ~38M parameters).
    #[arg(long, value_delimiter = ',', default_values_t = [128i64, 4096])]
    pub widths: Vec<i64>,
    /// Precisions (bf16: every level's `--mixed-precision bf16`; the baseline is fp32 only).
    #[arg(long, value_enum, value_parser = ladder_core::cli::choice::<Precision>(), value_delimiter = ',', default_values_t = [Precision::Fp32, Precision::Bf16])]
    pub precisions: Vec<Precision>,
    /// Optimizer steps per rank for width-128 runs (938 is one epoch at one process).
    #[arg(long, default_value_t = 300)]
    pub steps: usize,
    /// Optimizer steps per rank for runs at another width (memory measurements).
    #[arg(long, default_value_t = 20)]
    pub wide_steps: usize,
    /// Repeats of every run, interleaved with the PyTorch peers (median, min, max reported).
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Repeats of runs at another width (memory measurements vary little; at most --repeats).
    #[arg(long, default_value_t = 1)]
    pub wide_repeats: usize,
    /// Leave the PyTorch peers out (no ratios).
    #[arg(long)]
    pub no_peers: bool,
    /// Install 🤗 accelerate and transformers into the peers' venv (pip, from PyPI; nothing
    /// happens when both import already) so that levels 2 and 3 get their Accelerate and
    /// Trainer peers. Without it those peers run only if the venv has them.
    #[arg(long)]
    pub install_peers: bool,
    /// Leave the all-reduce bandwidth and DDP bucket measurements out.
    #[arg(long)]
    pub no_allreduce: bool,
    /// Timed rounds per bucket_cap_mb in the DDP bucket measurement.
    #[arg(long, default_value_t = 30)]
    pub bucket_iters: usize,
    /// Ranks of the all-reduce and DDP bucket measurements.
    #[arg(long, default_value_t = 2)]
    pub allreduce_ranks: usize,
    /// Output directory. Default: `<root>/bench/results`.
    #[arg(long)]
    pub out_dir: Option<PathBuf>,
    /// Workspace root. Default: the one this bench was built in.
    #[arg(long)]
    pub root: Option<PathBuf>,
    /// Where the built binaries are. Default: `<root>/target/release`.
    #[arg(long)]
    pub bin_dir: Option<PathBuf>,
    /// Python of the PyTorch peers. Default: `<root>/.venv/bin/python`.
    #[arg(long)]
    pub python: Option<PathBuf>,
    /// Kill a run still going after this many seconds.
    #[arg(long, default_value_t = 1800)]
    pub timeout_s: u64,
}

/// A PyTorch peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(tag = "peer", rename_all = "kebab-case")]
pub enum Peer {
    /// `bench/reference/tutorial.py`: the MNIST example loop, one process.
    Tutorial,
    /// `bench/reference/ddp_gloo.py` under `torchrun --standalone --nproc-per-node W`.
    DdpGloo {
        /// Ranks.
        world_size: usize,
    },
    /// `bench/reference/accelerate_loop.py` under `accelerate launch --num_processes W`
    /// (W processes over gloo on CPU): level 2's twin.
    Accelerate {
        /// Processes.
        world_size: usize,
    },
    /// `bench/reference/trainer.py` (🤗 `Trainer`, `TrainingArguments`) under `torchrun
    /// --standalone --nproc-per-node W`: level 3's twin.
    Trainer {
        /// Processes.
        world_size: usize,
    },
}

impl Peer {
    /// `pytorch-tutorial`, `pytorch-ddp-gloo-w2`.
    pub fn id(self) -> String {
        match self {
            Peer::Tutorial => "pytorch-tutorial".into(),
            Peer::DdpGloo { world_size } => format!("pytorch-ddp-gloo-w{world_size}"),
            Peer::Accelerate { world_size } => format!("hf-accelerate-w{world_size}"),
            Peer::Trainer { world_size } => format!("hf-trainer-w{world_size}"),
        }
    }

    /// Whether the peer needs 🤗 accelerate and transformers in the venv.
    pub fn needs_hf(self) -> bool {
        matches!(self, Peer::Accelerate { .. } | Peer::Trainer { .. })
    }

    /// What the peer is, for tables: `PyTorch DDP (gloo)`, `🤗 Accelerate`, …
    pub fn title(self) -> &'static str {
        match self {
            Peer::Tutorial => "PyTorch tutorial",
            Peer::DdpGloo { .. } => "PyTorch DDP (gloo)",
            Peer::Accelerate { .. } => "🤗 Accelerate",
            Peer::Trainer { .. } => "🤗 Trainer",
        }
    }
}

/// One cell of the matrix.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Case {
    /// File-name-safe id: `baseline-w1-128-fp32`, `l2-fsdp-full-shard-w4-4096-bf16`.
    pub id: String,
    /// Level, `None` for the single-process baseline.
    pub level: Option<u8>,
    /// Strategy.
    pub strategy: Strategy,
    /// Ranks.
    pub world_size: usize,
    /// fc1 width.
    pub width: i64,
    /// Precision.
    pub precision: Precision,
    /// Optimizer steps per rank.
    pub steps: usize,
    /// The PyTorch twin, if any.
    pub peer: Option<Peer>,
}

/// The cells `args` select, in run order, and a line for every combination left out and why.
///
/// # Errors
/// [`Error::InvalidValue`] for an unknown level, an empty list, world size 0, width < 1,
/// 0 steps or 0 repeats.
pub fn plan(args: &RunArgs) -> Result<(Vec<Case>, Vec<String>)> {
    let invalid = |flag: &'static str, value: String, expected: &str| Error::InvalidValue { flag, value, expected: expected.into() };
    let levels = crate::select_levels(&args.levels)?;
    if args.strategies.is_empty() {
        return Err(invalid("--strategies", String::new(), "at least one strategy"));
    }
    if args.precisions.is_empty() {
        return Err(invalid("--precisions", String::new(), "fp32, bf16 or both"));
    }
    if args.world_sizes.is_empty() || args.world_sizes.contains(&0) {
        return Err(invalid("--world-sizes", format!("{:?}", args.world_sizes), "one or more world sizes of at least 1"));
    }
    if args.widths.is_empty() || args.widths.iter().any(|&w| w < 1) {
        return Err(invalid("--widths", format!("{:?}", args.widths), "one or more fc1 widths of at least 1"));
    }
    if args.steps == 0 || args.wide_steps == 0 {
        return Err(invalid("--steps", format!("{} / --wide-steps {}", args.steps, args.wide_steps), "at least 1 step"));
    }
    if args.repeats == 0 || args.wide_repeats == 0 {
        return Err(invalid("--repeats", format!("{} / --wide-repeats {}", args.repeats, args.wide_repeats), "at least 1 repeat"));
    }
    let (mut cases, mut skipped) = (Vec::new(), Vec::new());
    let steps_for = |width: i64| if width == 128 { args.steps } else { args.wide_steps };
    for &strategy in &args.strategies {
        if strategy == Strategy::Single {
            if !args.world_sizes.contains(&1) {
                skipped.push("single: runs at world size 1 only, not among --world-sizes".into());
                continue;
            }
            for &width in &args.widths {
                for &precision in &args.precisions {
                    if width != 128 || precision != Precision::Fp32 {
                        skipped.push(format!(
                            "single at width {width} {}: ladder-baseline is the tutorial's BasicNet in fp32 only",
                            precision.name()
                        ));
                        continue;
                    }
                    cases.push(Case {
                        id: "baseline-w1-128-fp32".into(),
                        level: None,
                        strategy,
                        world_size: 1,
                        width,
                        precision,
                        steps: steps_for(width),
                        peer: (!args.no_peers).then_some(Peer::Tutorial),
                    });
                }
            }
            continue;
        }
        for level in &levels {
            for &world_size in &args.world_sizes {
                for &width in &args.widths {
                    for &precision in &args.precisions {
                        // Each level's twin: PyTorch DDP, 🤗 Accelerate, 🤗 Trainer.
                        let twin = match level.number {
                            1 => Peer::DdpGloo { world_size },
                            2 => Peer::Accelerate { world_size },
                            _ => Peer::Trainer { world_size },
                        };
                        let peer =
                            (!args.no_peers && strategy == Strategy::Ddp && width == 128 && precision == Precision::Fp32).then_some(twin);
                        cases.push(Case {
                            id: format!("l{}-{}-w{world_size}-{width}-{}", level.number, strategy.name(), precision.name()),
                            level: Some(level.number),
                            strategy,
                            world_size,
                            width,
                            precision,
                            steps: steps_for(width),
                            peer,
                        });
                    }
                }
            }
        }
    }
    Ok((cases, skipped))
}

/// A matrix cell's figures over its repeats.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Row {
    /// The cell.
    pub case: Case,
    /// Errors of failed repeats (the row still shows the repeats that ran).
    pub errors: Vec<String>,
    /// Training samples/s over all ranks, per repeat.
    pub samples_per_s: Option<Spread>,
    /// The PyTorch twin's samples/s, per repeat.
    pub peer_samples_per_s: Option<Spread>,
    /// Ours / PyTorch, per repeat pair (same repeat = minutes apart).
    pub ratio: Option<Spread>,
    /// This level's median samples/s over level 1's at the same strategy, world size, width and
    /// precision (levels 2 and 3).
    pub vs_level1: Option<f64>,
    /// This FSDP strategy's median samples/s over DDP's at the same level, world size, width and
    /// precision.
    #[serde(default)]
    pub vs_ddp: Option<f64>,
    /// Median test accuracy (fraction).
    pub accuracy: Option<f64>,
    /// The peer's median test accuracy.
    pub peer_accuracy: Option<f64>,
    /// Test images evaluated (the last successful repeat's).
    pub eval_samples: Option<u64>,
    /// Median mean test NLL.
    pub test_loss: Option<f64>,
    /// Median over repeats of the max over ranks of comm_s / train_s.
    pub comm_share: Option<f64>,
    /// Rank 0's model-state bytes (the last successful repeat's).
    pub model_state: Option<ModelState>,
    /// Peak RSS per rank, MiB: per rank, the max over repeats (whole-process high-water mark).
    pub peak_rss_per_rank: Vec<f64>,
    /// Wall seconds per run (launch to exit), per repeat.
    pub wall_s: Option<Spread>,
    /// Training-phase peak RSS per rank, MiB: per rank, the max over repeats (reset when
    /// training starts; empty when not measured).
    #[serde(default)]
    pub train_peak_rss_per_rank: Vec<f64>,
    /// The peer's training-phase peak RSS, MiB (max over its ranks and repeats).
    #[serde(default)]
    pub peer_train_peak_rss_mib: Option<f64>,
    /// The peer's whole-process peak RSS, MiB (max over its ranks and repeats).
    #[serde(default)]
    pub peer_peak_rss_mib: Option<f64>,
    /// Step figures (the slowest rank's), medians over repeats.
    #[serde(default)]
    pub step: Option<StepFigures>,
    /// The peer's step figures, medians over repeats.
    #[serde(default)]
    pub peer_step: Option<StepFigures>,
    /// This bf16 cell's median samples/s over the fp32 cell's at the same level, strategy,
    /// world size and width.
    #[serde(default)]
    pub vs_fp32: Option<f64>,
    /// What training added to each rank's RSS, MiB: per rank, the max over repeats of the
    /// training-phase peak less the RSS when training started (empty when not measured).
    #[serde(default)]
    pub train_rss_growth_per_rank: Vec<f64>,
    /// Median over repeats of the largest per-rank training RSS growth, MiB.
    #[serde(default)]
    pub train_rss_growth_median: Option<f64>,
    /// Median over repeats of the largest per-rank whole-process peak RSS, MiB.
    #[serde(default)]
    pub peak_rss_median: Option<f64>,
    /// This FSDP strategy's [`train_rss_growth_median`](Self::train_rss_growth_median) over
    /// DDP's at the same level, world size, width and precision.
    #[serde(default)]
    pub vs_ddp_rss_growth: Option<f64>,
    /// This FSDP strategy's [`peak_rss_median`](Self::peak_rss_median) over DDP's at the same
    /// level, world size, width and precision.
    #[serde(default)]
    pub vs_ddp_peak_rss: Option<f64>,
}

/// A cell's step figures, each the median over repeats of the run's slowest rank's: seconds,
/// bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct StepFigures {
    /// Median step time over the timed steps, seconds.
    pub step_p50_s: f64,
    /// 95th-percentile step time, seconds.
    pub step_p95_s: f64,
    /// Time from the start of training to the end of the first step, seconds.
    pub first_step_s: f64,
    /// Mean seconds per step by phase (data, forward, backward without communication,
    /// communication, optimizer).
    pub phases: PhaseTimes,
    /// Mean communication payload bytes per step.
    pub comm_bytes_per_step: f64,
    /// Timed steps per run (the last repeat's).
    pub timed_steps: u64,
}

impl StepFigures {
    /// Medians over `runs` of their step figures; `None` when no run timed a step.
    pub fn median_of(runs: &[&RunFigures]) -> Option<StepFigures> {
        let timed: Vec<&StepTiming> = runs.iter().map(|f| &f.timing).filter(|t| t.timed_steps > 0).collect();
        let last = timed.last()?;
        let med = |g: &dyn Fn(&StepTiming) -> f64| Spread::of(&timed.iter().map(|t| g(t)).collect::<Vec<_>>()).map_or(0.0, |s| s.median);
        Some(StepFigures {
            step_p50_s: med(&|t| t.step_p50_s),
            step_p95_s: med(&|t| t.step_p95_s),
            first_step_s: med(&|t| t.first_step_s),
            phases: PhaseTimes {
                data_s: med(&|t| t.phases.data_s),
                forward_s: med(&|t| t.phases.forward_s),
                backward_s: med(&|t| t.phases.backward_s),
                comm_s: med(&|t| t.phases.comm_s),
                optimizer_s: med(&|t| t.phases.optimizer_s),
            },
            comm_bytes_per_step: med(&|t| t.comm_bytes_per_step),
            timed_steps: last.timed_steps,
        })
    }
}

/// One row of the all-reduce measurement (`allreduce_bench --json`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct AllReduceRow {
    /// Message size, bytes.
    pub bytes: u64,
    /// Timed rounds.
    pub iters: u64,
    /// `ProcessGroup::all_reduce` median latency, µs.
    pub ours_latency_us: f64,
    /// Raw rsmpi `all_reduce_into` median latency, µs.
    pub raw_latency_us: f64,
    /// Ours, bus bandwidth GB/s (algbw × 2(n−1)/n).
    pub ours_busbw_gbps: f64,
    /// Raw rsmpi, bus bandwidth GB/s.
    pub raw_busbw_gbps: f64,
    /// ours / raw.
    pub ratio: f64,
    /// `Collective::all_reduce(..).prechecked()` run by `ProcessGroup::run` (no per-call
    /// agreement check: DDP's path, its bucket layout checked once) median latency, µs; 0 in
    /// reports from before it was measured.
    pub prechecked_latency_us: f64,
    /// Prechecked, bus bandwidth GB/s.
    pub prechecked_busbw_gbps: f64,
    /// prechecked / raw.
    pub prechecked_ratio: f64,
}

/// The all-reduce measurement.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct AllReduce {
    /// Ranks.
    pub world_size: usize,
    /// One row per message size.
    pub rows: Vec<AllReduceRow>,
}

/// One row of the DDP bucket measurement (`examples/ddp_buckets --json`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct BucketRow {
    /// `bucket_cap_mb` (MiB); `None` for the one flat all-reduce.
    pub bucket_cap_mb: Option<f64>,
    /// Buckets (all-reduce calls) per sync.
    pub buckets: usize,
    /// Gradient bytes per sync.
    pub bytes: u64,
    /// Timed rounds.
    pub iters: usize,
    /// Median seconds of one sync, in ms.
    pub median_ms: f64,
    /// 95th percentile, ms.
    pub p95_ms: f64,
    /// Bus bandwidth, GB/s (bytes / median × 2(n−1)/n).
    pub busbw_gbps: f64,
}

/// DDP's bucketed gradient all-reduce of BasicNet vs `bucket_cap_mb`, and one flat all-reduce.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Buckets {
    /// Ranks.
    pub world_size: usize,
    /// One row per cap (1, 5, 25, 100 MiB).
    pub rows: Vec<BucketRow>,
    /// Every gradient in one buffer, one all-reduce (no packing).
    pub flat: BucketRow,
}

/// A target of issues #10 and #11, for one cell, with its measured value.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Target {
    /// The issue that sets it (10 or 11).
    pub issue: u32,
    /// What is compared: `ours / PyTorch DDP (gloo) samples/s`.
    pub what: String,
    /// The cell ([`label`]).
    pub cell: String,
    /// The measured ratio.
    pub measured: f64,
    /// The threshold.
    pub threshold: f64,
    /// `true`: measured ≥ threshold is met; `false`: measured ≤ threshold is.
    pub at_least: bool,
    /// Whether the measured value meets the threshold.
    pub met: bool,
}

impl Target {
    fn new(issue: u32, what: String, cell: &Case, measured: f64, threshold: f64, at_least: bool) -> Self {
        let met = if at_least { measured >= threshold } else { measured <= threshold };
        Self { issue, what, cell: label(cell), measured, threshold, at_least, met }
    }

    /// `≥ 1.30×` / `≤ 0.50×`.
    pub fn bound(&self) -> String {
        format!("{} {:.2}×", if self.at_least { "≥" } else { "≤" }, self.threshold)
    }
}

/// Every target the rows can be checked against, in row order: ours / peer samples/s ≥ 1.3 and
/// training-phase peak RSS / peer's ≤ 0.5 (#11), FSDP FULL_SHARD / DDP ≥ 0.9 (#11), bf16 / fp32
/// ≥ 1.5 (#11), at width ≥ 4096 FULL_SHARD's training RSS growth ≤ 0.8× DDP's and
/// SHARD_GRAD_OP's whole-process peak RSS ≤ DDP's, medians over repeats (#11), level 2 / level 1
/// ≥ 0.98 and level 3 / level 1 ≥ 0.97 (#10).
pub fn targets(rows: &[Row]) -> Vec<Target> {
    let mut out = Vec::new();
    for r in rows {
        let c = &r.case;
        let peer = c.peer.map_or("PyTorch", Peer::title);
        if let Some(ratio) = r.ratio {
            out.push(Target::new(11, format!("ours / {peer} samples/s"), c, ratio.median, 1.3, true));
        }
        let ours_train = r.train_peak_rss_per_rank.iter().copied().reduce(f64::max);
        if let (Some(a), Some(b)) = (ours_train, r.peer_train_peak_rss_mib) {
            out.push(Target::new(11, format!("training-phase peak RSS per rank, ours / {peer}"), c, a / b, 0.5, false));
        }
        if let (Strategy::FsdpFullShard, Some(v)) = (c.strategy, r.vs_ddp) {
            out.push(Target::new(11, "FSDP FULL_SHARD / DDP samples/s".into(), c, v, 0.9, true));
        }
        if let Some(v) = r.vs_fp32 {
            out.push(Target::new(11, "bf16 / fp32 samples/s".into(), c, v, 1.5, true));
        }
        // The memory targets are set for the wide model, where sharding has bytes to save.
        if c.width >= 4096 {
            if let (Strategy::FsdpFullShard, Some(v)) = (c.strategy, r.vs_ddp_rss_growth) {
                out.push(Target::new(11, "FULL_SHARD / DDP RSS growth in training per rank".into(), c, v, 0.8, false));
            }
            if let (Strategy::FsdpShardGradOp, Some(v)) = (c.strategy, r.vs_ddp_peak_rss) {
                out.push(Target::new(11, "SHARD_GRAD_OP / DDP peak RSS per rank".into(), c, v, 1.0, false));
            }
        }
        match (c.level, r.vs_level1) {
            (Some(2), Some(v)) => out.push(Target::new(10, "level 2 / level 1 samples/s".into(), c, v, 0.98, true)),
            (Some(3), Some(v)) => out.push(Target::new(10, "level 3 / level 1 samples/s".into(), c, v, 0.97, true)),
            _ => {}
        }
    }
    out
}

/// What `bench.json` holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MatrixSummary {
    /// Where and when.
    pub machine: Machine,
    /// Repeats per cell.
    pub repeats: usize,
    /// The matrix, in run order.
    pub rows: Vec<Row>,
    /// Combinations left out and why.
    pub skipped: Vec<String>,
    /// The all-reduce bandwidth, when measured.
    pub allreduce: Option<AllReduce>,
    /// Why the all-reduce measurement failed, if it did.
    pub allreduce_error: Option<String>,
    /// The targets of issues #10 and #11 with their measured values ([`targets`] of `rows`).
    #[serde(default)]
    pub targets: Vec<Target>,
    /// DDP's bucketed all-reduce vs bucket_cap_mb, when measured.
    #[serde(default)]
    pub buckets: Option<Buckets>,
    /// Why the bucket measurement failed, if it did.
    #[serde(default)]
    pub buckets_error: Option<String>,
}

impl MatrixSummary {
    /// `Ok` when every run succeeded.
    ///
    /// # Errors
    /// [`Error::RunsFailed`] naming the failed cells (and the all-reduce measurement).
    pub fn check(&self) -> Result<()> {
        let mut names: Vec<String> = self.rows.iter().filter(|r| !r.errors.is_empty()).map(|r| r.case.id.clone()).collect();
        if self.allreduce_error.is_some() {
            names.push("allreduce".into());
        }
        if self.buckets_error.is_some() {
            names.push("ddp-buckets".into());
        }
        if names.is_empty() {
            Ok(())
        } else {
            Err(Error::RunsFailed {
                failed: names.len(),
                total: self.rows.len()
                    + usize::from(self.allreduce.is_some() || self.allreduce_error.is_some())
                    + usize::from(self.buckets.is_some() || self.buckets_error.is_some()),
                names: names.join(", "),
            })
        }
    }
}

/// `L2 fsdp-full-shard ×4 fc1 4096 bf16` / `baseline single ×1 fc1 128 fp32`.
pub fn label(case: &Case) -> String {
    let who = case.level.map_or("baseline".to_string(), |l| format!("L{l}"));
    format!("{who} {} ×{} fc1 {} {}", case.strategy.name(), case.world_size, case.width, case.precision.name())
}

/// Our runs per cell id, one entry per repeat: figures and bench-measured wall seconds, or the error.
pub type Ours = BTreeMap<String, Vec<std::result::Result<(RunFigures, f64), String>>>;
/// The peers' runs per peer id, one entry per repeat.
pub type Theirs = BTreeMap<String, Vec<std::result::Result<RunFigures, String>>>;

/// Turns every cell's repeats into its row: spreads, ratios (repeat by repeat), level ratios.
pub fn aggregate(cases: &[Case], ours: &Ours, theirs: &Theirs) -> Vec<Row> {
    // The largest of a measured per-rank list (`None` when it is empty: not measured).
    let max_of = |v: &[f64]| v.iter().copied().reduce(f64::max);
    let mut rows: Vec<Row> = cases
        .iter()
        .map(|case| {
            let runs = ours.get(&case.id).map(Vec::as_slice).unwrap_or(&[]);
            let peer_runs = case.peer.and_then(|p| theirs.get(&p.id())).map(Vec::as_slice).unwrap_or(&[]);
            let ok: Vec<&(RunFigures, f64)> = runs.iter().filter_map(|r| r.as_ref().ok()).collect();
            let peer_ok: Vec<&RunFigures> = peer_runs.iter().filter_map(|r| r.as_ref().ok()).collect();
            let mut errors: Vec<String> = runs.iter().filter_map(|r| r.as_ref().err().cloned()).collect();
            errors.extend(peer_runs.iter().filter_map(|r| r.as_ref().err().map(|e| format!("PyTorch peer: {e}"))));
            let ratios: Vec<f64> = runs
                .iter()
                .zip(peer_runs)
                .filter_map(|(a, b)| match (a, b) {
                    (Ok((a, _)), Ok(b)) if b.samples_per_s > 0.0 => Some(a.samples_per_s / b.samples_per_s),
                    _ => None,
                })
                .collect();
            let med = |v: Vec<f64>| Spread::of(&v).map(|s| s.median);
            let last = ok.last().map(|(f, _)| f);
            let per_rank_max = |get: &dyn Fn(&RunFigures) -> Vec<f64>| {
                let mut peak: Vec<f64> = Vec::new();
                for (f, _) in &ok {
                    for (i, m) in get(f).into_iter().enumerate() {
                        if i < peak.len() {
                            peak[i] = peak[i].max(m);
                        } else {
                            peak.push(m);
                        }
                    }
                }
                peak
            };
            let peak = per_rank_max(&RunFigures::peak_rss_per_rank);
            let train_peak = per_rank_max(&RunFigures::train_peak_rss_per_rank);
            let growth = per_rank_max(&RunFigures::train_rss_growth_per_rank);
            let peer_max = |get: &dyn Fn(&RunFigures) -> f64| peer_ok.iter().map(|f| get(f)).filter(|&m| m > 0.0).reduce(f64::max);
            Row {
                case: case.clone(),
                errors,
                samples_per_s: Spread::of(&ok.iter().map(|(f, _)| f.samples_per_s).collect::<Vec<_>>()),
                peer_samples_per_s: Spread::of(&peer_ok.iter().map(|f| f.samples_per_s).collect::<Vec<_>>()),
                ratio: Spread::of(&ratios),
                vs_level1: None,
                vs_ddp: None,
                accuracy: med(ok.iter().map(|(f, _)| f.accuracy).collect()),
                peer_accuracy: med(peer_ok.iter().map(|f| f.accuracy).collect()),
                eval_samples: last.map(|f| f.eval_samples),
                test_loss: med(ok.iter().map(|(f, _)| f.test_loss).collect()),
                comm_share: med(ok.iter().filter_map(|(f, _)| f.comm_share()).collect()),
                model_state: last.and_then(|f| f.ranks.first()).map(|r| r.model_state),
                peak_rss_per_rank: peak,
                wall_s: Spread::of(&ok.iter().map(|(_, w)| *w).collect::<Vec<_>>()),
                train_peak_rss_per_rank: train_peak,
                peer_train_peak_rss_mib: peer_max(&|f| f.train_peak_rss_mib),
                peer_peak_rss_mib: peer_max(&|f| f.peak_rss_mib),
                step: StepFigures::median_of(&ok.iter().map(|(f, _)| f).collect::<Vec<_>>()),
                peer_step: StepFigures::median_of(&peer_ok),
                vs_fp32: None,
                train_rss_growth_per_rank: growth,
                // A measured growth of 0 counts (FULL_SHARD at its best); an unmeasured one does not.
                train_rss_growth_median: med(ok.iter().filter_map(|(f, _)| max_of(&f.train_rss_growth_per_rank())).collect()),
                peak_rss_median: med(ok.iter().filter_map(|(f, _)| max_of(&f.peak_rss_per_rank()).filter(|&m| m > 0.0)).collect()),
                vs_ddp_rss_growth: None,
                vs_ddp_peak_rss: None,
            }
        })
        .collect();
    // Ratios within the run: level 2/3 over level 1, FSDP over DDP, same other coordinates.
    let before = rows.clone();
    let twin = |pred: &dyn Fn(&Case) -> bool| before.iter().find(|r| pred(&r.case));
    let median = |r: &Row| r.samples_per_s.map(|s| s.median);
    let over = |x: Option<f64>, d: Option<f64>| x.zip(d.filter(|&d| d > 0.0)).map(|(x, d)| x / d);
    for row in &mut rows {
        let (c, ours) = (&row.case, median(row));
        let same = |o: &Case| o.world_size == c.world_size && o.width == c.width && o.precision == c.precision;
        if c.level.is_some_and(|l| l > 1) {
            row.vs_level1 = over(ours, twin(&|o| o.level == Some(1) && o.strategy == c.strategy && same(o)).and_then(median));
        }
        if c.level.is_some() && !matches!(c.strategy, Strategy::Ddp | Strategy::Single) {
            if let Some(ddp) = twin(&|o| o.level == c.level && o.strategy == Strategy::Ddp && same(o)) {
                row.vs_ddp = over(ours, median(ddp));
                row.vs_ddp_rss_growth = over(row.train_rss_growth_median, ddp.train_rss_growth_median);
                row.vs_ddp_peak_rss = over(row.peak_rss_median, ddp.peak_rss_median);
            }
        }
        if c.precision == Precision::Bf16 {
            let fp32 = twin(&|o| {
                o.level == c.level
                    && o.strategy == c.strategy
                    && o.world_size == c.world_size
                    && o.width == c.width
                    && o.precision == Precision::Fp32
            });
            row.vs_fp32 = over(ours, fp32.and_then(median));
        }
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        run: RunArgs,
    }

    fn args(flags: &[&str]) -> RunArgs {
        Cli::parse_from(std::iter::once("bench").chain(flags.iter().copied())).run
    }

    #[test]
    fn the_default_matrix_and_what_it_leaves_out() {
        let (cases, skipped) = plan(&args(&[])).unwrap();
        // baseline 1 + levels 1, 2 and 3: 3 strategies × 3 world sizes × 2 widths × 2 precisions.
        assert_eq!(cases.len(), 1 + 3 * 36);
        assert_eq!(cases[0].id, "baseline-w1-128-fp32");
        assert_eq!(cases[0].peer, Some(Peer::Tutorial));
        // Peers: ddp at width 128 in fp32, per level and world size.
        let with_peer: Vec<&str> = cases.iter().filter(|c| c.level.is_some() && c.peer.is_some()).map(|c| c.id.as_str()).collect();
        assert_eq!(with_peer.len(), 9);
        assert!(with_peer.contains(&"l3-ddp-w4-128-fp32"));
        assert!(cases.iter().all(|c| c.steps == if c.width == 128 { 300 } else { 20 }));
        assert_eq!(cases.iter().filter(|c| c.level == Some(1) && c.precision == Precision::Bf16).count(), 18);
        assert_eq!(
            skipped,
            [
                "single at width 128 bf16: ladder-baseline is the tutorial's BasicNet in fp32 only",
                "single at width 4096 fp32: ladder-baseline is the tutorial's BasicNet in fp32 only",
                "single at width 4096 bf16: ladder-baseline is the tutorial's BasicNet in fp32 only",
            ]
        );
        let (cases, _) =
            plan(&args(&["--levels", "2", "--strategies", "ddp", "--world-sizes", "2", "--widths", "128", "--no-peers"])).unwrap();
        assert_eq!(cases.iter().map(|c| c.id.as_str()).collect::<Vec<_>>(), ["l2-ddp-w2-128-fp32", "l2-ddp-w2-128-bf16"]);
        assert!(cases.iter().all(|c| c.peer.is_none()));
    }

    fn figures(sps: f64) -> RunFigures {
        RunFigures { samples_per_s: sps, accuracy: 0.9, eval_samples: 10_000, ..Default::default() }
    }

    #[test]
    fn ratios_are_taken_repeat_by_repeat_and_levels_compared_within_the_run() {
        let (cases, _) = plan(&args(&[
            "--levels",
            "1,2",
            "--strategies",
            "ddp,fsdp-full-shard",
            "--world-sizes",
            "2",
            "--widths",
            "128",
            "--precisions",
            "fp32",
        ]))
        .unwrap();
        let ids: Vec<&str> = cases.iter().map(|c| c.id.as_str()).collect();
        assert_eq!(ids, ["l1-ddp-w2-128-fp32", "l2-ddp-w2-128-fp32", "l1-fsdp-full-shard-w2-128-fp32", "l2-fsdp-full-shard-w2-128-fp32"]);
        let mut ours = Ours::new();
        ours.insert(ids[0].into(), vec![Ok((figures(100.0), 1.0)), Ok((figures(120.0), 1.0)), Ok((figures(90.0), 1.0))]);
        ours.insert(ids[1].into(), vec![Ok((figures(99.0), 1.0)), Err("boom".into()), Ok((figures(117.0), 1.0))]);
        ours.insert(ids[2].into(), vec![Ok((figures(50.0), 1.0))]);
        let mut theirs = Theirs::new();
        theirs.insert("pytorch-ddp-gloo-w2".into(), vec![Ok(figures(50.0)), Ok(figures(100.0)), Ok(figures(45.0))]);
        // Level 2's twin is 🤗 Accelerate, level 1's PyTorch DDP.
        assert_eq!((cases[0].peer, cases[1].peer), (Some(Peer::DdpGloo { world_size: 2 }), Some(Peer::Accelerate { world_size: 2 })));
        theirs.insert("hf-accelerate-w2".into(), vec![Ok(figures(50.0)), Ok(figures(100.0)), Ok(figures(45.0))]);
        let rows = aggregate(&cases, &ours, &theirs);
        // Level 1: ratios 2.0, 1.2, 2.0 → median 2.0; not the ratio of the medians (100 / 50).
        assert_eq!(rows[0].ratio, Some(Spread { median: 2.0, min: 1.2, max: 2.0, n: 3 }));
        assert_eq!(rows[0].samples_per_s, Some(Spread { median: 100.0, min: 90.0, max: 120.0, n: 3 }));
        // Level 2: the failed repeat drops out of its pairs; it is reported.
        assert_eq!(rows[1].ratio, Some(Spread { median: (1.98 + 2.6) / 2.0, min: 1.98, max: 2.6, n: 2 }));
        assert_eq!(rows[1].errors, ["boom"]);
        assert_eq!(rows[1].vs_level1, Some(108.0 / 100.0));
        assert_eq!(rows[2].vs_ddp, Some(0.5));
        assert_eq!((rows[2].ratio, rows[2].vs_level1), (None, None));
        // A cell that never ran has no figures.
        assert_eq!((rows[3].samples_per_s, rows[3].vs_ddp, rows[3].eval_samples), (None, None, None));
    }

    /// Two ranks whose training started at `start` MiB and peaked at `peak`, whole-process `whole`.
    fn memory_figures(start: [f64; 2], peak: [f64; 2], whole: [f64; 2]) -> RunFigures {
        let ranks = (0..2)
            .map(|r| crate::figures::RankFigures {
                rank: r,
                peak_rss_mib: whole[r],
                timing: StepTiming { train_start_rss_mib: start[r], train_peak_rss_mib: peak[r], ..Default::default() },
                ..Default::default()
            })
            .collect();
        RunFigures { ranks, ..figures(100.0) }
    }

    #[test]
    fn the_fsdp_memory_targets_compare_with_ddp_at_width_4096_only() {
        let flags = ["--levels", "1", "--strategies", "ddp,fsdp-full-shard,fsdp-shard-grad-op", "--world-sizes", "2"];
        let flags: Vec<&str> = flags.into_iter().chain(["--widths", "128,4096", "--precisions", "fp32", "--no-peers"]).collect();
        let (cases, _) = plan(&args(&flags)).unwrap();
        let mut ours = Ours::new();
        for c in &cases {
            // DDP grows by 400 MiB (rank 1's, the larger), FULL_SHARD by 200, SHARD_GRAD_OP by 300;
            // whole-process peaks 1,000 / 900 / 1,100 MiB (SHARD_GRAD_OP above DDP: not met).
            // FULL_SHARD's third repeat is an outlier (390 MiB): the ratio takes the median.
            let runs = match c.strategy {
                Strategy::Ddp => vec![memory_figures([500.0, 500.0], [850.0, 900.0], [1000.0, 990.0])],
                Strategy::FsdpFullShard => vec![
                    memory_figures([500.0, 450.0], [700.0, 600.0], [900.0, 880.0]),
                    memory_figures([500.0, 450.0], [690.0, 650.0], [900.0, 880.0]),
                    memory_figures([500.0, 450.0], [890.0, 600.0], [900.0, 880.0]),
                ],
                _ => vec![memory_figures([500.0, 500.0], [800.0, 700.0], [1100.0, 1050.0])],
            };
            ours.insert(c.id.clone(), runs.into_iter().map(|f| Ok((f, 1.0))).collect());
        }
        let rows = aggregate(&cases, &ours, &Theirs::new());
        let full = rows.iter().find(|r| r.case.id == "l1-fsdp-full-shard-w2-4096-fp32").unwrap();
        assert_eq!(full.train_rss_growth_per_rank, [390.0, 200.0], "per rank, the max over repeats");
        assert_eq!(full.train_rss_growth_median, Some(200.0));
        assert_eq!(full.vs_ddp_rss_growth, Some(0.5));
        let sgo = rows.iter().find(|r| r.case.id == "l1-fsdp-shard-grad-op-w2-4096-fp32").unwrap();
        assert_eq!(sgo.vs_ddp_peak_rss, Some(1.1));
        let memory: Vec<(String, bool)> =
            targets(&rows).into_iter().filter(|t| t.what.contains("RSS")).map(|t| (format!("{} · {}", t.what, t.cell), t.met)).collect();
        assert_eq!(
            memory,
            [
                ("FULL_SHARD / DDP RSS growth in training per rank · L1 fsdp-full-shard ×2 fc1 4096 fp32".to_string(), true),
                ("SHARD_GRAD_OP / DDP peak RSS per rank · L1 fsdp-shard-grad-op ×2 fc1 4096 fp32".to_string(), false),
            ]
        );
    }
}
