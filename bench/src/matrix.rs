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
//! Outputs in `--out-dir` (default `bench/results/`): `bench.md`, `bench.json`, every run's own
//! report in `runs/`, its log in `logs/`, and `allreduce-2.json`.

use crate::error::{Error, Result};
use crate::figures::{ModelState, RunFigures};
use crate::machine::Machine;
use crate::stats::Spread;
use crate::{process, require_binary, write_file, LEVELS};
use comfy_table::{presets, CellAlignment, Table};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

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
    /// bf16 autocast (levels 2 and 3: `--mixed-precision bf16`, as Accelerate's).
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
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [Strategy::Single, Strategy::Ddp, Strategy::FsdpFullShard, Strategy::FsdpShardGradOp])]
    pub strategies: Vec<Strategy>,
    /// World sizes (ranks; more ranks than cores are oversubscribed).
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 2, 4])]
    pub world_sizes: Vec<usize>,
    /// fc1 widths (128 is the tutorial's BasicNet; 4096 gives ~38M parameters).
    #[arg(long, value_delimiter = ',', default_values_t = [128i64, 4096])]
    pub widths: Vec<i64>,
    /// Precisions (bf16 at levels 2 and 3 only).
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [Precision::Fp32, Precision::Bf16])]
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
    /// Leave the PyTorch peers out (no ratios).
    #[arg(long)]
    pub no_peers: bool,
    /// Leave the all-reduce bandwidth measurement out.
    #[arg(long)]
    pub no_allreduce: bool,
    /// Ranks of the all-reduce measurement.
    #[arg(long, default_value_t = 2)]
    pub allreduce_ranks: usize,
    /// Output directory. Default: <root>/bench/results.
    #[arg(long)]
    pub out_dir: Option<PathBuf>,
    /// Workspace root. Default: the one this bench was built in.
    #[arg(long)]
    pub root: Option<PathBuf>,
    /// Where the built binaries are. Default: <root>/target/release.
    #[arg(long)]
    pub bin_dir: Option<PathBuf>,
    /// Python of the PyTorch peers. Default: <root>/.venv/bin/python.
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
}

impl Peer {
    /// `pytorch-tutorial`, `pytorch-ddp-gloo-w2`.
    pub fn id(self) -> String {
        match self {
            Peer::Tutorial => "pytorch-tutorial".into(),
            Peer::DdpGloo { world_size } => format!("pytorch-ddp-gloo-w{world_size}"),
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
    if args.repeats == 0 {
        return Err(invalid("--repeats", "0".into(), "at least 1 repeat"));
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
                        if level.number == 1 && precision == Precision::Bf16 {
                            if world_size == args.world_sizes[0] && width == args.widths[0] {
                                skipped.push(format!("level 1 {} bf16: level 1 has no --mixed-precision (levels 2 and 3 do)", strategy.name()));
                            }
                            continue;
                        }
                        let peer = (!args.no_peers && strategy == Strategy::Ddp && width == 128 && precision == Precision::Fp32)
                            .then_some(Peer::DdpGloo { world_size });
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
        if names.is_empty() {
            Ok(())
        } else {
            Err(Error::RunsFailed { failed: names.len(), total: self.rows.len() + usize::from(self.allreduce.is_some() || self.allreduce_error.is_some()), names: names.join(", ") })
        }
    }
}

/// Paths the runner uses.
struct Paths {
    root: PathBuf,
    bin_dir: PathBuf,
    out_dir: PathBuf,
    python: PathBuf,
}

/// Runs the matrix, prints the tables, writes `bench.md` and `bench.json`.
///
/// # Errors
/// Invalid flags; [`Error::MissingBinary`] for a binary or the peers' Python; [`Error::Io`]
/// writing results. A run's own failure is recorded in its row (see [`MatrixSummary::check`]).
pub fn run_matrix(args: &RunArgs) -> Result<MatrixSummary> {
    let (cases, skipped) = plan(args)?;
    let root = args.root.clone().unwrap_or_else(crate::default_root);
    let bin_dir = args.bin_dir.clone().unwrap_or_else(|| root.join("target").join("release"));
    let paths = Paths {
        out_dir: args.out_dir.clone().unwrap_or_else(|| root.join("bench").join("results")),
        python: args.python.clone().unwrap_or_else(|| root.join(".venv").join("bin").join("python")),
        bin_dir,
        root,
    };
    // Check every binary before measuring anything.
    if cases.iter().any(|c| c.level.is_some()) {
        require_binary(paths.bin_dir.join("ladder-run"))?;
    }
    for c in &cases {
        match c.level {
            None => require_binary(paths.bin_dir.join("ladder-baseline"))?,
            Some(n) => require_binary(paths.bin_dir.join(LEVELS[usize::from(n) - 1].binary))?,
        };
    }
    if cases.iter().any(|c| c.peer.is_some()) {
        require_binary(paths.python.clone())?;
    }
    if !args.no_allreduce {
        require_binary(allreduce_binary(&paths.bin_dir))?;
    }
    for sub in ["runs", "logs"] {
        let dir = paths.out_dir.join(sub);
        if dir.exists() {
            std::fs::remove_dir_all(&dir).map_err(Error::io(&dir))?;
        }
    }
    let mut machine = Machine::describe();
    if cases.iter().any(|c| c.peer.is_some()) {
        machine.torch_version = torch_version(&paths.python);
    }

    let peers_per_repeat = {
        let mut p: Vec<Peer> = cases.iter().filter_map(|c| c.peer).collect();
        p.sort();
        p.dedup();
        p.len()
    };
    let total = args.repeats * (cases.len() + peers_per_repeat);
    let timeout = Duration::from_secs(args.timeout_s);
    let mut ours: BTreeMap<String, Vec<std::result::Result<(RunFigures, f64), String>>> = BTreeMap::new();
    let mut theirs: BTreeMap<String, Vec<std::result::Result<RunFigures, String>>> = BTreeMap::new();
    let mut k = 0;
    for r in 1..=args.repeats {
        let mut peers_done = Vec::new();
        for case in &cases {
            k += 1;
            println!("[{k}/{total}] {} (repeat {r}/{})", label(case), args.repeats);
            let result = run_ours(case, r, &paths, timeout);
            match &result {
                Ok((f, _)) => println!("      {:.0} samples/s, accuracy {:.2}%", f.samples_per_s, 100.0 * f.accuracy),
                Err(e) => println!("      FAILED: {}", e.lines().next().unwrap_or("")),
            }
            ours.entry(case.id.clone()).or_default().push(result);
            if let Some(peer) = case.peer.filter(|p| !peers_done.contains(p)) {
                peers_done.push(peer);
                k += 1;
                println!("[{k}/{total}] PyTorch peer {} (repeat {r}/{})", peer.id(), args.repeats);
                let result = run_peer(peer, case.steps, r, &paths, timeout).map_err(|e| e.to_string());
                match &result {
                    Ok(f) => println!("      {:.0} samples/s, accuracy {:.2}%", f.samples_per_s, 100.0 * f.accuracy),
                    Err(e) => println!("      FAILED: {}", e.lines().next().unwrap_or("")),
                }
                theirs.entry(peer.id()).or_default().push(result);
            }
        }
    }
    let (allreduce, allreduce_error) = if args.no_allreduce {
        (None, None)
    } else {
        println!("all-reduce bus bandwidth, {} ranks: ProcessGroup::all_reduce vs raw rsmpi", args.allreduce_ranks);
        match run_allreduce(args.allreduce_ranks, &paths, timeout) {
            Ok(a) => (Some(a), None),
            Err(e) => {
                println!("      FAILED: {}", e.to_string().lines().next().unwrap_or(""));
                (None, Some(e.to_string()))
            }
        }
    };
    let summary = MatrixSummary { machine, repeats: args.repeats, rows: aggregate(&cases, &ours, &theirs), skipped, allreduce, allreduce_error };
    println!("\n{}", render_terminal(&summary));
    write_file(&paths.out_dir.join("bench.json"), &serde_json::to_string_pretty(&summary).unwrap_or_default())?;
    write_file(&paths.out_dir.join("bench.md"), &render_markdown(&summary))?;
    println!("written: {} and {}", paths.out_dir.join("bench.md").display(), paths.out_dir.join("bench.json").display());
    Ok(summary)
}

fn allreduce_binary(bin_dir: &Path) -> PathBuf {
    bin_dir.join("examples").join("allreduce_bench")
}

/// `L2 fsdp-full-shard ×4 fc1 4096 bf16` / `baseline single ×1 fc1 128 fp32`.
pub fn label(case: &Case) -> String {
    let who = case.level.map_or("baseline".to_string(), |l| format!("L{l}"));
    format!("{who} {} ×{} fc1 {} {}", case.strategy.name(), case.world_size, case.width, case.precision.name())
}

fn torch_version(python: &Path) -> Option<String> {
    let out = Command::new(python).args(["-c", "import torch; print(torch.__version__)"]).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Runs one of ours; the report and the bench-measured wall seconds, or the error's text.
fn run_ours(case: &Case, repeat: usize, paths: &Paths, timeout: Duration) -> std::result::Result<(RunFigures, f64), String> {
    let report = paths.out_dir.join("runs").join(format!("{}-r{repeat}.json", case.id));
    let log = paths.out_dir.join("logs").join(format!("{}-r{repeat}.log", case.id));
    let mut cmd = match case.level {
        None => Command::new(paths.bin_dir.join("ladder-baseline")),
        Some(n) => {
            let mut c = Command::new(paths.bin_dir.join("ladder-run"));
            c.arg("--nproc-per-node").arg(case.world_size.to_string()).arg(paths.bin_dir.join(LEVELS[usize::from(n) - 1].binary));
            c.args(["--strategy", case.strategy.name()]);
            if case.strategy != Strategy::Ddp {
                c.args(["--fsdp-min-num-params", "0"]);
            }
            if case.width != 128 {
                c.args(["--width", &case.width.to_string()]);
            }
            if case.precision == Precision::Bf16 {
                c.args(["--mixed-precision", "bf16"]);
            }
            c
        }
    };
    cmd.args(["--device", "cpu", "--log-interval", "0", "--max-steps", &case.steps.to_string(), "--metrics-json"]).arg(&report);
    cmd.current_dir(&paths.root);
    let what = label(case);
    let done = process::run_logged(&what, &mut cmd, &log, timeout).map_err(|e| e.to_string())?;
    if !report.exists() {
        return Err(Error::NoReport { what, path: report }.to_string());
    }
    let figures = RunFigures::read(&report).map_err(|e| e.to_string())?;
    Ok((figures, done.wall_s))
}

/// Runs a PyTorch peer for `steps` steps per rank and parses its JSON line; keeps the line in
/// `runs/<peer>-r<repeat>.json`.
fn run_peer(peer: Peer, steps: usize, repeat: usize, paths: &Paths, timeout: Duration) -> Result<RunFigures> {
    let reference = paths.root.join("bench").join("reference");
    let mut cmd = match peer {
        Peer::Tutorial => {
            let mut c = Command::new(&paths.python);
            c.arg(reference.join("tutorial.py"));
            c
        }
        Peer::DdpGloo { world_size } => {
            // torchrun from the same venv: `python -m torch.distributed.run`.
            let mut c = Command::new(&paths.python);
            c.args(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", &world_size.to_string()]);
            c.arg(reference.join("ddp_gloo.py"));
            c
        }
    };
    cmd.args(["--max-steps", &steps.to_string()]).current_dir(&paths.root);
    let id = peer.id();
    let log = paths.out_dir.join("logs").join(format!("{id}-r{repeat}.log"));
    let what = format!("PyTorch {id}");
    let done = process::run_logged(&what, &mut cmd, &log, timeout)?;
    let line = done
        .stdout
        .iter()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .ok_or_else(|| Error::NoPeerResult { what: what.clone(), tail: done.tail.clone() })?;
    let path = paths.out_dir.join("runs").join(format!("{id}-r{repeat}.json"));
    write_file(&path, line)?;
    RunFigures::parse(line, &path)
}

/// `mpirun -n N --bind-to none [--oversubscribe] target/release/examples/allreduce_bench --json …`.
fn run_allreduce(ranks: usize, paths: &Paths, timeout: Duration) -> Result<AllReduce> {
    let json = paths.out_dir.join(format!("allreduce-{ranks}.json"));
    let _ = std::fs::remove_file(&json);
    let mut cmd = Command::new("mpirun");
    cmd.args(["-n", &ranks.to_string(), "--bind-to", "none"]);
    // Oversubscribing makes idle ranks yield, which distorts small-message latency: only when needed.
    if ranks > std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) {
        cmd.arg("--oversubscribe");
    }
    cmd
        .arg(allreduce_binary(&paths.bin_dir))
        .arg("--json")
        .arg(&json)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .current_dir(&paths.root);
    let log = paths.out_dir.join("logs").join(format!("allreduce-{ranks}.log"));
    process::run_logged("all-reduce", &mut cmd, &log, timeout)?;
    let text = std::fs::read_to_string(&json).map_err(Error::io(&json))?;
    serde_json::from_str(&text).map_err(|source| Error::Json { path: json, source })
}

type Ours = BTreeMap<String, Vec<std::result::Result<(RunFigures, f64), String>>>;
type Theirs = BTreeMap<String, Vec<std::result::Result<RunFigures, String>>>;

/// Turns every cell's repeats into its row: spreads, ratios (repeat by repeat), level ratios.
pub fn aggregate(cases: &[Case], ours: &Ours, theirs: &Theirs) -> Vec<Row> {
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
            let mut peak: Vec<f64> = Vec::new();
            for (f, _) in &ok {
                for (i, m) in f.peak_rss_per_rank().into_iter().enumerate() {
                    if i < peak.len() {
                        peak[i] = peak[i].max(m);
                    } else {
                        peak.push(m);
                    }
                }
            }
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
            }
        })
        .collect();
    // Ratios within the run: level 2/3 over level 1, FSDP over DDP, same other coordinates.
    let medians: Vec<(Case, Option<f64>)> = rows.iter().map(|r| (r.case.clone(), r.samples_per_s.map(|s| s.median))).collect();
    let find = |pred: &dyn Fn(&Case) -> bool| medians.iter().find(|(c, _)| pred(c)).and_then(|(_, m)| *m);
    for row in &mut rows {
        let (c, ours) = (&row.case, row.samples_per_s.map(|s| s.median));
        let same = |o: &Case| o.world_size == c.world_size && o.width == c.width && o.precision == c.precision;
        if c.level.is_some_and(|l| l > 1) {
            row.vs_level1 = find(&|o| o.level == Some(1) && o.strategy == c.strategy && same(o)).zip(ours).map(|(l1, x)| x / l1);
        }
        if c.level.is_some() && !matches!(c.strategy, Strategy::Ddp | Strategy::Single) {
            row.vs_ddp = find(&|o| o.level == c.level && o.strategy == Strategy::Ddp && same(o)).zip(ours).map(|(d, x)| x / d);
        }
    }
    rows
}

fn spread_cell(s: Option<Spread>, digits: usize, suffix: &str) -> String {
    match s {
        None => "—".into(),
        Some(s) if s.n == 1 => format!("{:.digits$}{suffix}", s.median),
        Some(s) => format!("{:.digits$}{suffix} ({:.digits$}–{:.digits$})", s.median, s.min, s.max),
    }
}

fn opt(v: Option<f64>, f: impl Fn(f64) -> String) -> String {
    v.map_or("—".into(), f)
}

fn new_table(markdown: bool, header: &[&str]) -> Table {
    let mut t = Table::new();
    t.load_preset(if markdown { presets::ASCII_MARKDOWN } else { presets::UTF8_FULL_CONDENSED });
    t.set_header(header.to_vec());
    t
}

fn right_align(t: &mut Table, from: usize) {
    let n = t.column_count();
    for i in from..n {
        if let Some(c) = t.column_mut(i) {
            c.set_cell_alignment(CellAlignment::Right);
        }
    }
}

const MIB: f64 = 1024.0 * 1024.0;

/// The throughput table: every cell with its samples/s, PyTorch's, the ratio, the level ratio,
/// communication share, accuracy and evaluated images.
pub fn render_throughput(summary: &MatrixSummary, markdown: bool) -> String {
    let mut t = new_table(
        markdown,
        &[
            "level", "strategy", "ranks", "fc1", "precision", "steps", "samples/s (median, min–max)", "PyTorch samples/s",
            "ours / PyTorch", "vs level 1", "vs ddp", "comm share", "accuracy", "PyTorch accuracy", "eval samples",
        ],
    );
    for r in &summary.rows {
        let c = &r.case;
        let failed = r.samples_per_s.is_none();
        t.add_row(vec![
            c.level.map_or("baseline".into(), |l| l.to_string()),
            c.strategy.name().into(),
            c.world_size.to_string(),
            c.width.to_string(),
            c.precision.name().into(),
            c.steps.to_string(),
            if failed { "FAILED".into() } else { spread_cell(r.samples_per_s, 0, "") },
            spread_cell(r.peer_samples_per_s, 0, ""),
            spread_cell(r.ratio, 2, "×"),
            opt(r.vs_level1, |v| format!("{v:.2}×")),
            opt(r.vs_ddp, |v| format!("{v:.2}×")),
            opt(r.comm_share, |v| format!("{:.1}%", 100.0 * v)),
            opt(r.accuracy, |v| format!("{:.2}%", 100.0 * v)),
            opt(r.peer_accuracy, |v| format!("{:.2}%", 100.0 * v)),
            r.eval_samples.map_or("—".into(), |n| n.to_string()),
        ]);
    }
    right_align(&mut t, 2);
    t.to_string()
}

/// The memory table: model-state bytes of rank 0 and the peak RSS of every rank.
pub fn render_memory(summary: &MatrixSummary, markdown: bool) -> String {
    let mut t = new_table(
        markdown,
        &[
            "level", "strategy", "ranks", "fc1", "precision", "parameters MiB", "gradients MiB", "optimizer MiB",
            "gathered peak MiB", "peak RSS per rank MiB",
        ],
    );
    for r in &summary.rows {
        let c = &r.case;
        let ms = |f: fn(&ModelState) -> u64| r.model_state.map_or("—".into(), |m| format!("{:.1}", f(&m) as f64 / MIB));
        t.add_row(vec![
            c.level.map_or("baseline".into(), |l| l.to_string()),
            c.strategy.name().into(),
            c.world_size.to_string(),
            c.width.to_string(),
            c.precision.name().into(),
            ms(|m| m.parameters),
            ms(|m| m.gradients),
            ms(|m| m.optimizer),
            ms(|m| m.gathered_peak),
            if r.peak_rss_per_rank.is_empty() {
                "—".into()
            } else {
                r.peak_rss_per_rank.iter().map(|m| format!("{m:.0}")).collect::<Vec<_>>().join(" / ")
            },
        ]);
    }
    right_align(&mut t, 2);
    t.to_string()
}

/// The all-reduce table (empty string when not measured).
pub fn render_allreduce(summary: &MatrixSummary, markdown: bool) -> String {
    let Some(a) = &summary.allreduce else { return String::new() };
    let mut t = new_table(markdown, &["bytes", "ours busbw GB/s", "raw rsmpi busbw GB/s", "ours / raw", "ours µs", "raw µs"]);
    for r in &a.rows {
        t.add_row(vec![
            r.bytes.to_string(),
            format!("{:.2}", r.ours_busbw_gbps),
            format!("{:.2}", r.raw_busbw_gbps),
            format!("{:.2}", r.ratio),
            format!("{:.1}", r.ours_latency_us),
            format!("{:.1}", r.raw_latency_us),
        ]);
    }
    right_align(&mut t, 0);
    t.to_string()
}

fn render_notes(summary: &MatrixSummary) -> String {
    let mut s = String::new();
    for r in summary.rows.iter().filter(|r| !r.errors.is_empty()) {
        s.push_str(&format!("\n{} FAILED ({} of {} repeats):\n{}\n", label(&r.case), r.errors.len(), summary.repeats, r.errors[0]));
    }
    if let Some(e) = &summary.allreduce_error {
        s.push_str(&format!("\nall-reduce FAILED: {e}\n"));
    }
    if !summary.skipped.is_empty() {
        s.push_str("\nNot run:\n");
        for k in &summary.skipped {
            s.push_str(&format!("- {k}\n"));
        }
    }
    s
}

const EXPLAIN: &str = "samples/s: training samples over all ranks per second of the training loop (loading and \
evaluation excluded); ours / PyTorch: the ratio within each repeat (ours and PyTorch's run back to back), median and \
range over repeats; PyTorch peers: bench/reference/tutorial.py (single) and ddp_gloo.py under torchrun (ddp), same \
model, AdamW recipe, per-rank batch 64 and threads per rank. comm share: max over ranks of the time in collectives / \
training time. Model state: rank 0's persistent bytes (AdamW: 2 states per parameter); peak RSS: each rank's \
whole-process high-water mark, data loading included.";

/// What the terminal shows.
pub fn render_terminal(summary: &MatrixSummary) -> String {
    let mut s = format!("{}\n\nThroughput (repeats: {})\n{}\n\nMemory\n{}\n", summary.machine.line(), summary.repeats, render_throughput(summary, false), render_memory(summary, false));
    if summary.allreduce.is_some() {
        s.push_str(&format!("\nAll-reduce (f32, sum)\n{}\n", render_allreduce(summary, false)));
    }
    s.push_str(&render_notes(summary));
    s
}

/// `bench.md`.
pub fn render_markdown(summary: &MatrixSummary) -> String {
    let mut s = format!(
        "# ddp-ladder bench\n\n{}\n\n## Throughput (repeats: {})\n\n{}\n\n{EXPLAIN}\n\n## Memory\n\n{}\n",
        summary.machine.line(),
        summary.repeats,
        render_throughput(summary, true),
        render_memory(summary, true)
    );
    if let Some(a) = &summary.allreduce {
        s.push_str(&format!(
            "\n## All-reduce, {} ranks (f32, sum; busbw = algbw × 2(n−1)/n)\n\n{}\n",
            a.world_size,
            render_allreduce(summary, true)
        ));
    }
    s.push_str(&render_notes(summary));
    s
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
        // baseline 1 + level 1: 3 strategies × 3 world sizes × 2 widths (fp32 only)
        // + levels 2 and 3: 3 × 3 × 2 × 2 precisions each.
        assert_eq!(cases.len(), 1 + 18 + 2 * 36);
        assert_eq!(cases[0].id, "baseline-w1-128-fp32");
        assert_eq!(cases[0].peer, Some(Peer::Tutorial));
        // Peers: ddp at width 128 in fp32, per level and world size.
        let with_peer: Vec<&str> = cases.iter().filter(|c| c.level.is_some() && c.peer.is_some()).map(|c| c.id.as_str()).collect();
        assert_eq!(with_peer.len(), 9);
        assert!(with_peer.contains(&"l3-ddp-w4-128-fp32"));
        assert!(cases.iter().all(|c| c.steps == if c.width == 128 { 300 } else { 20 }));
        assert!(!cases.iter().any(|c| c.level == Some(1) && c.precision == Precision::Bf16));
        assert_eq!(
            skipped,
            [
                "single at width 128 bf16: ladder-baseline is the tutorial's BasicNet in fp32 only",
                "single at width 4096 fp32: ladder-baseline is the tutorial's BasicNet in fp32 only",
                "single at width 4096 bf16: ladder-baseline is the tutorial's BasicNet in fp32 only",
                "level 1 ddp bf16: level 1 has no --mixed-precision (levels 2 and 3 do)",
                "level 1 fsdp-full-shard bf16: level 1 has no --mixed-precision (levels 2 and 3 do)",
                "level 1 fsdp-shard-grad-op bf16: level 1 has no --mixed-precision (levels 2 and 3 do)",
            ]
        );
        let (cases, _) = plan(&args(&["--levels", "2", "--strategies", "ddp", "--world-sizes", "2", "--widths", "128", "--no-peers"])).unwrap();
        assert_eq!(cases.iter().map(|c| c.id.as_str()).collect::<Vec<_>>(), ["l2-ddp-w2-128-fp32", "l2-ddp-w2-128-bf16"]);
        assert!(cases.iter().all(|c| c.peer.is_none()));
    }

    fn figures(sps: f64) -> RunFigures {
        RunFigures { samples_per_s: sps, accuracy: 0.9, eval_samples: 10_000, ..Default::default() }
    }

    #[test]
    fn ratios_are_taken_repeat_by_repeat_and_levels_compared_within_the_run() {
        let (cases, _) =
            plan(&args(&["--levels", "1,2", "--strategies", "ddp,fsdp-full-shard", "--world-sizes", "2", "--widths", "128", "--precisions", "fp32"]))
                .unwrap();
        let ids: Vec<&str> = cases.iter().map(|c| c.id.as_str()).collect();
        assert_eq!(ids, ["l1-ddp-w2-128-fp32", "l2-ddp-w2-128-fp32", "l1-fsdp-full-shard-w2-128-fp32", "l2-fsdp-full-shard-w2-128-fp32"]);
        let mut ours = Ours::new();
        ours.insert(ids[0].into(), vec![Ok((figures(100.0), 1.0)), Ok((figures(120.0), 1.0)), Ok((figures(90.0), 1.0))]);
        ours.insert(ids[1].into(), vec![Ok((figures(99.0), 1.0)), Err("boom".into()), Ok((figures(117.0), 1.0))]);
        ours.insert(ids[2].into(), vec![Ok((figures(50.0), 1.0))]);
        let mut theirs = Theirs::new();
        theirs.insert("pytorch-ddp-gloo-w2".into(), vec![Ok(figures(50.0)), Ok(figures(100.0)), Ok(figures(45.0))]);
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
}
