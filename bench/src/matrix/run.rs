//! Running the matrix: our binaries, the PyTorch peers, the all-reduce example — each a process
//! whose report the bench reads back.

use super::narrow::render_terminal;
use super::render::render_markdown;
use super::{aggregate, label, plan, AllReduce, Case, MatrixSummary, Ours, Peer, RunArgs, Theirs};
use crate::error::{Error, Result};
use crate::figures::RunFigures;
use crate::machine::Machine;
use crate::{process, require_binary, write_file, LEVELS};
use ladder_core::parallel::{OffloadDevice, Precision};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

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
    let (cases, mut skipped) = plan(args)?;
    let root = args.launch.root();
    let paths = Paths {
        // Absolute: the runs start in --root, and their reports, logs and moment files are
        // named from here.
        out_dir: std::path::absolute(args.out_dir.clone().unwrap_or_else(|| root.join("bench").join("results")))
            .map_err(Error::io(args.out_dir.clone().unwrap_or_default()))?,
        python: args.python.clone().unwrap_or_else(|| root.join(".venv").join("bin").join("python")),
        bin_dir: args.launch.bin_dir(),
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
    // A level binary that lacks a flag a cell needs: the cell is not run, and says why.
    let mut flags: std::collections::BTreeMap<u8, Vec<String>> = std::collections::BTreeMap::new();
    let cases: Vec<Case> = cases
        .into_iter()
        .filter(|c| {
            let Some(n) = c.level else { return true };
            let binary = LEVELS[usize::from(n) - 1].binary;
            let known = flags.entry(n).or_insert_with(|| help_flags(&paths.bin_dir.join(binary)));
            match needed_flags(c).into_iter().find(|f| !known.contains(f)) {
                None => true,
                Some(missing) => {
                    skipped.push(format!("{}: {binary} has no {missing} flag", label(c)));
                    false
                }
            }
        })
        .collect();
    if cases.iter().any(|c| c.peer.is_some() || c.tuned_peer.is_some()) {
        require_binary(paths.python.clone())?;
    }
    // 🤗 peers: install accelerate + transformers when asked; without them, those rows run
    // without a peer and say so.
    let mut cases = cases;
    if cases.iter().any(|c| c.peer.is_some_and(Peer::needs_hf)) {
        if args.install_peers && !hf_available(&paths.python) {
            install_hf(&paths.python)?;
        }
        if !hf_available(&paths.python) {
            for c in cases.iter_mut().filter(|c| c.peer.is_some_and(Peer::needs_hf)) {
                let peer = c.peer.take().map(Peer::title).unwrap_or_default();
                skipped.push(format!(
                    "{}: no {peer} peer — accelerate and transformers are not in {}; `bench run --install-peers` installs them",
                    label(c),
                    paths.python.display()
                ));
            }
        }
    }
    let cases = cases;
    if !args.no_allreduce {
        require_binary(allreduce_binary(&paths.bin_dir))?;
        require_binary(paths.bin_dir.join("examples").join("ddp_buckets"))?;
    }
    // The load is read once every flag and file has been checked, so an error is the first
    // (and only) thing a user with a mistyped flag or an unbuilt binary sees.
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let load_at_start = Machine::load_warning(Machine::load_average(), cores, 0, "at the start of the run");
    if let Some(w) = &load_at_start {
        eprintln!("{w}");
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
        let mut p: Vec<Peer> = cases.iter().flat_map(|c| [c.peer, c.tuned_peer]).flatten().collect();
        p.sort();
        p.dedup();
        p.len()
    };
    let repeats_of = |c: &Case| if c.width == 128 { args.repeats } else { args.wide_repeats.min(args.repeats) };
    let total = args.repeats * peers_per_repeat + cases.iter().map(repeats_of).sum::<usize>();
    let timeout = args.launch.timeout();
    let mut ours = Ours::new();
    let mut theirs = Theirs::new();
    let mut k = 0;
    for r in 1..=args.repeats {
        let mut peers_done = Vec::new();
        for case in cases.iter().filter(|c| r <= repeats_of(c)) {
            k += 1;
            println!("[{k}/{total}] {} (repeat {r}/{})", label(case), args.repeats);
            let result = run_ours(case, r, &paths, timeout);
            match &result {
                Ok((f, _)) => println!("      {:.0} samples/s, accuracy {:.2}%", f.samples_per_s, 100.0 * f.accuracy),
                Err(e) => println!("      FAILED: {}", e.lines().next().unwrap_or("")),
            }
            ours.entry(case.id.clone()).or_default().push(result);
            for peer in [case.peer, case.tuned_peer].into_iter().flatten().filter(|p| !peers_done.contains(p)).collect::<Vec<_>>() {
                peers_done.push(peer);
                k += 1;
                println!("[{k}/{total}] PyTorch peer {} (repeat {r}/{})", peer.id(), args.repeats);
                let result = run_peer(peer, case.steps, r, &paths, timeout, &args.tuned_trial).map_err(|e| e.to_string());
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
    let (buckets, buckets_error) = if args.no_allreduce {
        (None, None)
    } else {
        println!("DDP gradient all-reduce of BasicNet vs bucket_cap_mb, {} ranks", args.allreduce_ranks);
        match run_buckets(args.allreduce_ranks, args.bucket_iters, &paths, timeout) {
            Ok(b) => (Some(b), None),
            Err(e) => {
                println!("      FAILED: {}", e.to_string().lines().next().unwrap_or(""));
                (None, Some(e.to_string()))
            }
        }
    };
    let rows = aggregate(&cases, &ours, &theirs);
    let targets = super::targets(&rows, machine.cpu_peak.as_ref());
    // The last minute's average holds the bench's own ranks: at most the most it runs at once.
    let own = cases.iter().map(|c| c.world_size).chain((!args.no_allreduce).then_some(args.allreduce_ranks)).max().unwrap_or(0);
    let load_warnings: Vec<String> =
        load_at_start.into_iter().chain(Machine::load_warning(Machine::load_average(), cores, own, "at the end of the run")).collect();
    let summary = MatrixSummary {
        machine,
        repeats: args.repeats,
        rows,
        skipped,
        allreduce,
        allreduce_error,
        targets,
        buckets,
        buckets_error,
        load_warnings: load_warnings.clone(),
    };
    println!("\n{}", render_terminal(&summary, args.all_columns));
    // After the tables, where it is read: the load at the start, and at the end.
    for w in load_warnings {
        eprintln!("{w}");
    }
    write_file(&paths.out_dir.join("bench.json"), &serde_json::to_string_pretty(&summary).unwrap_or_default())?;
    write_file(&paths.out_dir.join("bench.md"), &render_markdown(&summary))?;
    write_file(&paths.out_dir.join("bench.csv"), &super::render_csv(&summary))?;
    write_file(&paths.out_dir.join("targets.csv"), &super::render_targets_csv(&summary))?;
    let plots = super::write_plots(&summary, &paths.out_dir)?;
    for f in ["bench.md", "bench.json", "bench.csv", "targets.csv"] {
        println!("written: {}", paths.out_dir.join(f).display());
    }
    for p in plots {
        println!("written: {}", p.display());
    }
    Ok(summary)
}

/// A TCP port free on this machine now (for `accelerate launch --main_process_port`).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map_or(29500, |a| a.port())
}

/// Whether `python` imports accelerate and transformers.
fn hf_available(python: &Path) -> bool {
    Command::new(python).args(["-c", "import accelerate, transformers"]).output().is_ok_and(|o| o.status.success())
}

/// `python -m pip install accelerate transformers` (from PyPI).
///
/// # Errors
/// [`Error::PeerInstall`] with pip's last lines.
fn install_hf(python: &Path) -> Result<()> {
    println!("installing accelerate and transformers into {} (pip, PyPI)", python.display());
    let out = Command::new(python)
        .args(["-m", "pip", "install", "--disable-pip-version-check", "accelerate", "transformers"])
        .output()
        .map_err(Error::io(python))?;
    if out.status.success() {
        return Ok(());
    }
    let text = String::from_utf8_lossy(&out.stderr);
    let tail: Vec<&str> = text.lines().rev().take(5).collect();
    Err(Error::PeerInstall { python: python.to_path_buf(), tail: tail.into_iter().rev().collect::<Vec<_>>().join("\n") })
}

fn allreduce_binary(bin_dir: &Path) -> PathBuf {
    bin_dir.join("examples").join("allreduce_bench")
}

fn torch_version(python: &Path) -> Option<String> {
    let out = Command::new(python).args(["-c", "import torch; print(torch.__version__)"]).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The flags a level binary must take for `case`, beyond the common training ones.
fn needed_flags(case: &Case) -> Vec<String> {
    level_args(case, Path::new("nvme")).into_iter().filter(|a| a.starts_with("--")).collect()
}

/// The level's own flags for `case`'s strategy and options (level 1's names, Accelerate's at
/// level 2, Transformers' at level 3): `--strategy ddp`, ZeRO-1 (`--zero-redundancy-optimizer`,
/// `--zero-stage 1`, `--deepspeed` with `zero_optimization.stage` 1), `--fsdp-min-num-params 0`,
/// `--width`, `--mixed-precision`, the batch size, activation checkpointing, CPU offload
/// (level 3 names the strategy and the offload in one `--fsdp "FULL_SHARD offload"`, as
/// Transformers' `fsdp` argument) and the optimizer's moments on disk under `nvme_path`
/// (level 1 `--offload-optimizer-nvme-path`, Accelerate's `--offload-optimizer-device nvme`,
/// Transformers' `--deepspeed` with `zero_optimization.offload_optimizer`, in the same JSON
/// as ZeRO-1's stage).
fn level_args(case: &Case, nvme_path: &Path) -> Vec<String> {
    let level = case.level.unwrap_or(1);
    let Some(strategy) = case.strategy.strategy() else { return Vec::new() };
    let mut a: Vec<String> = match (case.cpu_offload, case.strategy.sharding()) {
        (true, Some(sharding)) if level == 3 => {
            vec!["--fsdp".into(), format!("{} offload", ladder_core::parallel::Choice::name(sharding))]
        }
        _ => vec!["--strategy".into(), ladder_core::parallel::Choice::name(strategy).into()],
    };
    if case.cpu_offload && level < 3 {
        a.push(if level == 1 { "--cpu-offload" } else { "--fsdp-offload-params" }.into());
    }
    let on_disk = case.offload_optimizer == OffloadDevice::Nvme;
    if case.strategy.is_zero1() && level < 3 {
        a.extend(match level {
            1 => vec!["--zero-redundancy-optimizer".to_string()],
            _ => vec!["--zero-stage".into(), "1".into()],
        });
    }
    if on_disk && level < 3 {
        let path = nvme_path.display().to_string();
        a.extend(match level {
            1 => vec!["--offload-optimizer-nvme-path".to_string(), path],
            _ => vec!["--offload-optimizer-device".into(), "nvme".into(), "--offload-optimizer-nvme-path".into(), path],
        });
    }
    if level == 3 && (case.strategy.is_zero1() || on_disk) {
        // One DeepSpeed config: ZeRO-1's stage (0 otherwise: the strategy stays --strategy's
        // or --fsdp's) and the moments' device.
        let mut zero = serde_json::json!({ "stage": u8::from(case.strategy.is_zero1()) });
        if on_disk {
            zero["offload_optimizer"] = serde_json::json!({ "device": "nvme", "nvme_path": nvme_path });
        }
        a.extend(["--deepspeed".into(), serde_json::json!({ "zero_optimization": zero }).to_string()]);
    }
    if case.strategy.sharding().is_some() {
        a.extend(["--fsdp-min-num-params".into(), "0".into()]);
    }
    if case.width != 128 {
        a.extend(["--width".into(), case.width.to_string()]);
    }
    if case.precision != Precision::No {
        a.extend(["--mixed-precision".into(), case.precision.to_string()]);
    }
    if case.batch_size != super::case::BATCH_SIZE {
        let flag = if level == 3 { "--per-device-train-batch-size" } else { "--batch-size" };
        a.extend([flag.into(), case.batch_size.to_string()]);
    }
    if case.activation_checkpointing {
        a.push(
            ["--activation-checkpointing", "--fsdp-activation-checkpointing", "--gradient-checkpointing"]
                [usize::from(level.clamp(1, 3)) - 1]
                .into(),
        );
    }
    a
}

/// The long flags `binary --help` lists (empty if it cannot be run: the run then fails and
/// says why).
fn help_flags(binary: &Path) -> Vec<String> {
    let Ok(out) = Command::new(binary).arg("--help").output() else { return Vec::new() };
    let text = String::from_utf8_lossy(&out.stdout);
    let mut flags: Vec<String> = text
        .split(|c: char| c.is_whitespace() || c == ',' || c == '=' || c == '[' || c == ']')
        .filter(|w| w.starts_with("--") && w.len() > 2)
        .map(|w| w.trim_end_matches(|c: char| !c.is_ascii_alphanumeric()).to_string())
        .collect();
    flags.sort();
    flags.dedup();
    flags
}

/// Runs one of ours; the report and the bench-measured wall seconds, or the error's text.
fn run_ours(case: &Case, repeat: usize, paths: &Paths, timeout: Duration) -> std::result::Result<(RunFigures, f64), String> {
    let report = paths.out_dir.join("runs").join(format!("{}-r{repeat}.json", case.id));
    let log = paths.out_dir.join("logs").join(format!("{}-r{repeat}.log", case.id));
    // The moments' files of an optimizer offloaded to disk: a directory of the run's own, made
    // before and removed after (the levels remove their files at exit; a killed run's stay).
    let nvme_dir = paths.out_dir.join("nvme").join(format!("{}-r{repeat}", case.id));
    let trainer_dir = paths.out_dir.join("trainer-output").join(format!("{}-r{repeat}", case.id));
    if case.offload_optimizer == OffloadDevice::Nvme {
        std::fs::create_dir_all(&nvme_dir).map_err(|e| format!("creating {}: {e}", nvme_dir.display()))?;
    }
    let mut cmd = match case.level {
        None => Command::new(paths.bin_dir.join("ladder-baseline")),
        Some(n) => {
            let mut c = Command::new(paths.bin_dir.join("ladder-run"));
            c.arg("--nproc-per-node").arg(case.world_size.to_string()).arg(paths.bin_dir.join(LEVELS[usize::from(n) - 1].binary));
            c.args(level_args(case, &nvme_dir));
            if n == 3 {
                // The Trainer refuses to replace a previous run unless told: the bench owns this one.
                c.arg("--output-dir").arg(&trainer_dir);
                c.arg("--overwrite-output-dir");
            }
            c
        }
    };
    cmd.args(["--device", "cpu", "--log-interval", "0", "--max-steps", &case.steps.to_string(), "--metrics-json"]).arg(&report);
    cmd.current_dir(&paths.root);
    let what = label(case);
    let done = process::run_logged(&what, &mut cmd, &log, timeout).map_err(|e| e.to_string());
    if case.offload_optimizer == OffloadDevice::Nvme {
        // Best effort: what is left there is the run's own, and the run's result stands either way.
        let _ = std::fs::remove_dir_all(&nvme_dir);
        // `nvme/` itself too, once no run's directory is left in it (remove_dir fails otherwise).
        let _ = nvme_dir.parent().map(std::fs::remove_dir);
    }
    if case.level == Some(3) {
        remove_weights(&trainer_dir);
    }
    let done = done?;
    if !report.exists() {
        return Err(Error::NoReport { what, path: report }.to_string());
    }
    let figures = RunFigures::read(&report).map_err(|e| e.to_string())?;
    Ok((figures, done.wall_s))
}

/// Removes what a Trainer run of the bench leaves that weighs: its `checkpoint-*` directories and
/// `*.safetensors` files (the weights and AdamW moments: ~450 MB at width 4096, per cell and
/// repeat), keeping its small `trainer_state.json`, `training_args.json` and `loss.svg`. Best
/// effort: the run's figures are in its report either way.
fn remove_weights(trainer_dir: &Path) {
    let Ok(entries) = std::fs::read_dir(trainer_dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if path.is_dir() && name.starts_with("checkpoint-") {
            let _ = std::fs::remove_dir_all(&path);
        } else if name.ends_with(".safetensors") {
            let _ = std::fs::remove_file(&path);
        }
    }
}

/// Runs a PyTorch peer for `steps` steps per rank and parses its JSON line; keeps the line in
/// `runs/<peer>-r<repeat>.json`. `tune`: the tuned peer's `--tune` (what its trial may try).
fn run_peer(peer: Peer, steps: usize, repeat: usize, paths: &Paths, timeout: Duration, tune: &str) -> Result<RunFigures> {
    let reference = paths.root.join("bench").join("reference");
    let mut cmd = match peer {
        Peer::Tutorial | Peer::Tuned { world_size: 1, .. } => {
            let mut c = Command::new(&paths.python);
            c.arg(reference.join(if peer == Peer::Tutorial { "tutorial.py" } else { "tuned.py" }));
            c
        }
        Peer::Tuned { world_size, .. } => {
            let mut c = Command::new(&paths.python);
            c.args(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", &world_size.to_string()]);
            c.arg(reference.join("tuned.py"));
            c
        }
        Peer::DdpGloo { world_size } | Peer::Trainer { world_size } => {
            // torchrun from the same venv: `python -m torch.distributed.run`.
            let mut c = Command::new(&paths.python);
            c.args(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", &world_size.to_string()]);
            c.arg(reference.join(if matches!(peer, Peer::Trainer { .. }) { "trainer.py" } else { "ddp_gloo.py" }));
            c
        }
        Peer::Accelerate { world_size } => {
            // `accelerate launch` from the same venv. W > 1: its torchrun launcher (`--multi_gpu`),
            // which the script's Accelerator(cpu=True) turns into W processes over gloo; W = 1:
            // one plain CPU process.
            let mut c = Command::new(&paths.python);
            c.args(["-m", "accelerate.commands.launch", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]);
            if world_size > 1 {
                c.args(["--multi_gpu", "--main_process_port", &free_port().to_string()]);
            } else {
                c.arg("--cpu");
            }
            c.args(["--num_processes", &world_size.to_string()]);
            c.arg(reference.join("accelerate_loop.py"));
            c
        }
    };
    cmd.args(["--max-steps", &steps.to_string()]).current_dir(&paths.root);
    if let Peer::Tuned { bf16, .. } = peer {
        cmd.args(["--tune", tune, "--precision", if bf16 { "bf16" } else { "fp32" }]);
    }
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

/// `mpirun -n N … target/release/examples/ddp_buckets --iters I --json …`.
fn run_buckets(ranks: usize, iters: usize, paths: &Paths, timeout: Duration) -> Result<super::Buckets> {
    let json = paths.out_dir.join(format!("ddp-buckets-{ranks}.json"));
    let _ = std::fs::remove_file(&json);
    let mut cmd = mpirun(ranks);
    cmd.arg(paths.bin_dir.join("examples").join("ddp_buckets")).args(["--iters", &iters.to_string(), "--json"]).arg(&json);
    cmd.current_dir(&paths.root);
    let log = paths.out_dir.join("logs").join(format!("ddp-buckets-{ranks}.log"));
    process::run_logged("DDP buckets", &mut cmd, &log, timeout)?;
    let text = std::fs::read_to_string(&json).map_err(Error::io(&json))?;
    serde_json::from_str(&text).map_err(|source| Error::Json { path: json, source })
}

/// `mpirun -n N --bind-to none [--oversubscribe]`, allowed to run as root.
fn mpirun(ranks: usize) -> Command {
    let mut cmd = Command::new("mpirun");
    cmd.args(["-n", &ranks.to_string(), "--bind-to", "none"]);
    // Oversubscribing makes idle ranks yield, which distorts small-message latency: only when needed.
    if ranks > std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) {
        cmd.arg("--oversubscribe");
    }
    cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1").env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    cmd
}

/// `mpirun -n N --bind-to none [--oversubscribe] target/release/examples/allreduce_bench --json …`.
fn run_allreduce(ranks: usize, paths: &Paths, timeout: Duration) -> Result<AllReduce> {
    let json = paths.out_dir.join(format!("allreduce-{ranks}.json"));
    let _ = std::fs::remove_file(&json);
    let mut cmd = mpirun(ranks);
    cmd.arg(allreduce_binary(&paths.bin_dir)).arg("--json").arg(&json).current_dir(&paths.root);
    let log = paths.out_dir.join("logs").join(format!("allreduce-{ranks}.log"));
    process::run_logged("all-reduce", &mut cmd, &log, timeout)?;
    let text = std::fs::read_to_string(&json).map_err(Error::io(&json))?;
    serde_json::from_str(&text).map_err(|source| Error::Json { path: json, source })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matrix::case::{Replication, BATCH_SIZE};
    use ladder_core::parallel::{ShardingStrategy, Strategy};

    /// A level's cell at W = 2, width 128, fp32, batch 64, without options.
    fn plain_case(level: u8, strategy: Replication) -> Case {
        Case {
            id: String::new(),
            level: Some(level),
            strategy,
            world_size: 2,
            width: 128,
            precision: Precision::No,
            steps: 1,
            batch_size: BATCH_SIZE,
            activation_checkpointing: false,
            cpu_offload: false,
            offload_optimizer: OffloadDevice::None,
            peer: None,
            tuned_peer: None,
        }
    }

    /// A Trainer cell's output keeps its small files and loses its checkpoints and weights (what
    /// a level-3 run of the bench writes: `checkpoint-N/` with the moments, `model.safetensors`).
    #[test]
    fn a_trainer_cells_weights_and_checkpoints_are_removed_and_its_state_kept() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path();
        std::fs::create_dir_all(run.join("checkpoint-4")).unwrap();
        for file in [
            "checkpoint-4/optimizer.safetensors",
            "checkpoint-4/trainer_state.json",
            "model.safetensors",
            "trainer_state.json",
            "training_args.json",
            "loss.svg",
        ] {
            std::fs::write(run.join(file), b"x").unwrap();
        }
        remove_weights(run);
        let mut left: Vec<String> =
            std::fs::read_dir(run).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        left.sort();
        assert_eq!(left, ["loss.svg", "trainer_state.json", "training_args.json"]);
        remove_weights(&run.join("absent")); // nothing there: nothing happens
    }

    /// Each level's spelling of CPU offload: level 1's `--cpu-offload`, Accelerate's
    /// `--fsdp-offload-params`, Transformers' `--fsdp "FULL_SHARD offload"` (which names the
    /// strategy too, so no `--strategy`).
    #[test]
    fn each_level_spells_cpu_offload_its_own_way() {
        let sgo = Replication::from(Strategy::fsdp(ShardingStrategy::ShardGradOp));
        let case = |level: u8| Case { cpu_offload: true, ..plain_case(level, sgo) };
        let args = |level| level_args(&case(level), Path::new("/x")).join(" ");
        assert_eq!(args(1), "--strategy fsdp-shard-grad-op --cpu-offload --fsdp-min-num-params 0");
        assert_eq!(args(2), "--strategy fsdp-shard-grad-op --fsdp-offload-params --fsdp-min-num-params 0");
        assert_eq!(args(3), "--fsdp SHARD_GRAD_OP offload --fsdp-min-num-params 0");
        let plain = Case { cpu_offload: false, ..case(3) };
        assert_eq!(level_args(&plain, Path::new("/x")).join(" "), "--strategy fsdp-shard-grad-op --fsdp-min-num-params 0");
    }

    /// Each level's spelling of the moments on disk: level 1's `--offload-optimizer-nvme-path`,
    /// Accelerate's `--offload-optimizer-device nvme` with its path, Transformers' `--deepspeed`
    /// JSON (stage 1 for ZeRO-1 in the same object, 0 beside another strategy).
    #[test]
    fn each_level_spells_the_optimizer_on_disk_its_own_way() {
        let case = |level: u8, strategy: Replication| Case { offload_optimizer: OffloadDevice::Nvme, ..plain_case(level, strategy) };
        let zero1: Replication = "zero1".parse().unwrap();
        let ddp = Replication::from(Strategy::Ddp(ladder_core::parallel::DdpOptions::DEFAULT));
        let args = |level, s| level_args(&case(level, s), Path::new("/tmp/off")).join(" ");
        assert_eq!(args(1, zero1), "--strategy ddp --zero-redundancy-optimizer --offload-optimizer-nvme-path /tmp/off");
        assert_eq!(args(2, ddp), "--strategy ddp --offload-optimizer-device nvme --offload-optimizer-nvme-path /tmp/off");
        assert_eq!(
            args(3, zero1),
            r#"--strategy ddp --deepspeed {"zero_optimization":{"offload_optimizer":{"device":"nvme","nvme_path":"/tmp/off"},"stage":1}}"#
        );
        assert_eq!(
            args(3, ddp),
            r#"--strategy ddp --deepspeed {"zero_optimization":{"offload_optimizer":{"device":"nvme","nvme_path":"/tmp/off"},"stage":0}}"#
        );
        let in_memory = Case { offload_optimizer: OffloadDevice::None, ..case(3, zero1) };
        assert_eq!(
            level_args(&in_memory, Path::new("/tmp/off")).join(" "),
            r#"--strategy ddp --deepspeed {"zero_optimization":{"stage":1}}"#
        );
    }
}
