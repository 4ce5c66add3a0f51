//! The Accelerator as a user runs it: accumulation equals one large batch (DDP and FSDP, a short
//! last window), gather_for_metrics is exact at W = 2 and 3, level 2 trains the same weights as
//! level 1 bit for bit, a SIGKILLed run resumes bit-identically, so does one stopped by SIGTERM
//! after saving its state, and `ladder-accelerate launch` starts agreeing ranks.

#[path = "../../shared/tests/common/mod.rs"]
mod common;

use ladder_core::data::Dataset;
use ladder_core::dist::{self, Backend};
use ladder_core::model::{BasicNet, BasicNetConfig};
use ladder_core::optim::AdamWConfig;
use level2_accelerator::config::{AcceleratorConfig, ShardingStrategy};
use level2_accelerator::{Accelerator, DataLoaderOptions, DistributedDataParallelKwargs};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use tch::{nn, Device, Kind, Tensor};

const BIN: &str = env!("CARGO_BIN_EXE_level2-accelerator");
const LAUNCH: &str = env!("CARGO_BIN_EXE_ladder-accelerate");

fn config(k: usize, fsdp: bool) -> AcceleratorConfig {
    AcceleratorConfig {
        gradient_accumulation_steps: Some(k),
        cpu: Some(true),
        use_fsdp: Some(fsdp),
        fsdp_sharding_strategy: fsdp.then_some(ShardingStrategy::FullShard),
        fsdp_min_num_params: Some(0),
        seed: Some(5),
        ..Default::default()
    }
}

/// Trains one epoch over `data` with batches of `b` and accumulation `k` (dropout off) and
/// returns the gradients at every optimizer step and the final parameters' gradients' shapes.
fn gradients_per_step(pg: &'static dyn dist::ProcessGroup, data: &Dataset, b: usize, k: usize, fsdp: bool) -> Vec<Vec<Tensor>> {
    let acc = Accelerator::with_group(config(k, fsdp), DistributedDataParallelKwargs::default(), pg).unwrap();
    tch::manual_seed(5);
    let vs = nn::VarStore::new(Device::Cpu);
    let net = BasicNet::new(&vs.root(), BasicNetConfig { dropout: false, ..Default::default() });
    let model = acc.prepare_model(vs, net).unwrap();
    let mut opt = acc.prepare_optimizer(&model, AdamWConfig::default()).unwrap();
    let loader = acc.prepare_data_loader(data, DataLoaderOptions { batch_size: b, ..Default::default() }).unwrap();
    let mut steps = Vec::new();
    let mut micro = 0;
    for (x, y) in loader.iter() {
        acc.accumulate(&model, || {
            let loss = model.forward_t(&x, true).unwrap().nll_loss(&y);
            acc.backward(&loss).unwrap();
            micro += 1;
            if acc.sync_gradients() {
                steps.push(model.gradients());
            } else if pg.world_size() > 1 && !fsdp && micro == 1 {
                // Inside the window no sync happened: the ranks' gradients still differ.
                let named: Vec<(String, Tensor)> = model.gradients().into_iter().map(|g| ("grad".to_string(), g)).collect();
                assert!(ladder_core::parallel::ddp::check_in_sync(pg, &named).is_err(), "gradients were synced inside the window");
            }
            opt.step().unwrap();
            opt.zero_grad();
        });
    }
    assert_eq!(acc.global_step(), steps.len() as u64);
    steps
}

#[test]
#[ignore = "rank body: run by accumulation_equals_one_large_batch under mpirun"]
fn accumulation_body() {
    let pg = dist::leak(dist::init_process_group(Backend::Mpi).unwrap());
    let w = pg.world_size() as i64;
    // 5 micro-batches of 8 per rank: one window of 4, then a short window of 1.
    let data = Dataset::indexed(40 * w);
    for fsdp in [false, true] {
        let accumulated = gradients_per_step(pg, &data, 8, 4, fsdp);
        let large = gradients_per_step(pg, &data, 32, 1, fsdp);
        assert_eq!((accumulated.len(), large.len()), (2, 2), "two optimizer steps each (fsdp {fsdp})");
        for (step, (a, b)) in accumulated.iter().zip(&large).enumerate() {
            for (i, (ga, gb)) in a.iter().zip(b).enumerate() {
                common::assert_close(&format!("fsdp {fsdp} step {step} tensor {i}"), ga, gb);
            }
        }
    }
    pg.shutdown();
}

#[test]
fn accumulation_equals_one_large_batch() {
    common::mpirun(1, "accumulation_body", &[]);
    common::mpirun(2, "accumulation_body", &[]);
}

#[test]
#[ignore = "rank body: run by gather_for_metrics_counts_every_sample_once under mpirun"]
fn gather_body() {
    let pg = dist::leak(dist::init_process_group(Backend::Mpi).unwrap());
    let n = 10_000;
    let data = Dataset::indexed(n);
    let w = pg.world_size() as i64;
    for (b, shuffle, drop_last) in [(1000, false, false), (333, false, false), (64, true, false), (7, false, false), (64, false, true)] {
        let acc = Accelerator::with_group(config(1, false), DistributedDataParallelKwargs::default(), pg).unwrap();
        let loader = acc.prepare_data_loader(&data, DataLoaderOptions { batch_size: b, shuffle, drop_last }).unwrap();
        let mut seen: Vec<i64> = Vec::new();
        for (x, _) in loader.iter() {
            let ids = x.select(1, 0).select(1, 0).select(1, 0).to_kind(Kind::Int64);
            seen.extend(Vec::<i64>::try_from(acc.gather_for_metrics(&ids).unwrap()).unwrap());
        }
        if drop_last {
            // Only full batches: (per-rank samples / b) · b positions per rank, all before the
            // padding at these world sizes, so exactly that many · W items, in order.
            let kept = (((n + w - 1) / w) / b as i64) * b as i64 * w;
            assert_eq!(seen, (0..kept).collect::<Vec<_>>(), "drop_last, batch {b}");
            continue;
        }
        assert_eq!(seen.len() as i64, n, "batch {b}, shuffle {shuffle}: {} items", seen.len());
        if !shuffle {
            assert_eq!(seen, (0..n).collect::<Vec<_>>(), "batch {b}: the dataset's order");
        }
        seen.sort_unstable();
        assert_eq!(seen, (0..n).collect::<Vec<_>>(), "batch {b}, shuffle {shuffle}: every index once");
    }
    pg.shutdown();
}

#[test]
fn gather_for_metrics_counts_every_sample_once() {
    common::mpirun(2, "gather_body", &[]);
    common::mpirun(3, "gather_body", &[]);
}

#[test]
#[ignore = "rank body: run by an_overflowing_step_is_skipped_on_every_rank under mpirun"]
fn overflow_body() {
    let pg = dist::leak(dist::init_process_group(Backend::Mpi).unwrap());
    let acc = Accelerator::with_group(config(1, false), DistributedDataParallelKwargs::default(), pg).unwrap();
    tch::manual_seed(5);
    let vs = nn::VarStore::new(Device::Cpu);
    let net = BasicNet::new(&vs.root(), BasicNetConfig::default());
    let model = acc.prepare_model(vs, net).unwrap();
    let mut opt = acc.prepare_optimizer(&model, AdamWConfig::default()).unwrap();
    let data = Dataset::indexed(16 * pg.world_size() as i64);
    let loader = acc.prepare_data_loader(&data, DataLoaderOptions { batch_size: 8, shuffle: true, ..Default::default() }).unwrap();
    // A copy: a state dict's tensors are the parameters themselves (torch's state_dict()).
    let before = acc.get_state_dict().unwrap().map(|sd| sd.into_iter().map(|(n, t)| (n, t.copy())).collect::<Vec<_>>());
    // Rank 0 alone overflows (its scaled loss is inf); every rank must skip the step.
    let scale = if pg.rank() == 0 { 1e39 } else { 1024.0 };
    acc.set_grad_scaler(Some(level2_accelerator::scaler::GradScaler { scale, ..Default::default() }));
    let mut skipped = Vec::new();
    for (x, y) in loader.iter() {
        acc.accumulate(&model, || {
            let loss = model.forward_t(&x, true).unwrap().nll_loss(&y);
            acc.backward(&loss).unwrap();
            opt.step().unwrap();
            opt.zero_grad();
        });
        skipped.push(acc.optimizer_step_was_skipped());
        if skipped.len() == 1 {
            // Skipped everywhere, the scale backed off, the weights untouched.
            assert_eq!(acc.grad_scaler().unwrap().scale, scale / 2.0);
            if let (Some(a), Some(b)) = (&before, acc.get_state_dict().unwrap()) {
                assert!(a.iter().zip(&b).all(|((_, x), (_, y))| x.equal(y)), "a skipped step changed the weights");
            }
            acc.set_grad_scaler(Some(level2_accelerator::scaler::GradScaler { scale: 1024.0, ..Default::default() }));
        }
    }
    assert_eq!(skipped, vec![true, false]);
    assert_eq!(acc.global_step(), 2);
    model.check_parameters_in_sync().unwrap();
    pg.shutdown();
}

#[test]
fn an_overflowing_step_is_skipped_on_every_rank() {
    common::mpirun(2, "overflow_body", &[]);
}

#[test]
fn split_batches_names_both_numbers() {
    // World size 1 divides everything; the check itself is exercised at W = 3.
    common::mpirun(3, "split_batches_body", &[]);
}

#[test]
#[ignore = "rank body: run by split_batches_names_both_numbers under mpirun"]
fn split_batches_body() {
    let pg = dist::leak(dist::init_process_group(Backend::Mpi).unwrap());
    let cfg = AcceleratorConfig { split_batches: Some(true), ..config(1, false) };
    let acc = Accelerator::with_group(cfg, DistributedDataParallelKwargs::default(), pg).unwrap();
    let data = Dataset::indexed(30);
    let err =
        acc.prepare_data_loader(&data, DataLoaderOptions { batch_size: 64, shuffle: true, ..Default::default() }).unwrap_err().to_string();
    assert_eq!(
        err,
        "split_batches=true (set by the program) conflicts with batch_size 64: the global batch of 64 cannot be split evenly between 3 processes; use a multiple of 3"
    );
    let loader = acc.prepare_data_loader(&data, DataLoaderOptions { batch_size: 6, shuffle: true, ..Default::default() }).unwrap();
    assert_eq!((loader.batch_size(), loader.len()), (2, 5));
    pg.shutdown();
}

fn load_weights(path: &Path) -> Vec<(String, Tensor)> {
    let mut w = Tensor::read_safetensors(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    w.sort_by(|a, b| a.0.cmp(&b.0));
    w
}

fn assert_bit_identical(a: &Path, b: &Path) {
    let (wa, wb) = (load_weights(a), load_weights(b));
    assert_eq!(wa.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>(), wb.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>());
    assert_eq!(wa.len(), 8, "BasicNet's 8 parameters");
    for ((k, ta), (_, tb)) in wa.iter().zip(&wb) {
        assert!(ta.equal(tb), "{k} differs between {} and {}", a.display(), b.display());
    }
}

#[test]
#[ignore = "rank body: level 1's run, for same_weights_as_level_1"]
fn level1_body() {
    let out = std::env::var("LADDER_TEST_OUT").unwrap();
    let strategy = std::env::var("LADDER_TEST_STRATEGY").unwrap();
    let precision = std::env::var("LADDER_TEST_PRECISION").unwrap();
    let cfg = level1_raw_ddp::Config::try_parse_from([
        "level1-raw-ddp",
        "--device",
        "cpu",
        "--max-steps",
        "12",
        "--log-interval",
        "0",
        "--strategy",
        &strategy,
        "--save-model",
        &out,
        "--mixed-precision",
        &precision,
    ])
    .unwrap();
    level1_raw_ddp::run(&cfg).unwrap();
}

#[test]
#[ignore = "rank body: level 2's run, for same_weights_as_level_1"]
fn level2_body() {
    let out = std::env::var("LADDER_TEST_OUT").unwrap();
    let strategy = std::env::var("LADDER_TEST_STRATEGY").unwrap();
    let precision = std::env::var("LADDER_TEST_PRECISION").unwrap();
    let cfg = level2_accelerator::Config::try_parse_from([
        "level2-accelerator",
        "--device",
        "cpu",
        "--max-steps",
        "12",
        "--log-interval",
        "0",
        "--strategy",
        &strategy,
        "--save-model",
        &out,
        "--mixed-precision",
        &precision,
    ])
    .unwrap();
    level2_accelerator::run(&cfg).unwrap();
}

use clap::Parser;

#[test]
fn same_weights_as_level_1() {
    let dir = tempfile::tempdir().unwrap();
    // bf16: level 1's --mixed-precision and the Accelerator's are one core policy, so the
    // weights agree bit for bit too, and the saved (master) weights stay f32.
    for (w, strategy, precision) in [(1, "ddp", "no"), (2, "ddp", "no"), (2, "fsdp-full-shard", "no"), (2, "ddp", "bf16")] {
        let (a, b) =
            (dir.path().join(format!("l1-{w}-{strategy}-{precision}.st")), dir.path().join(format!("l2-{w}-{strategy}-{precision}.st")));
        let (sa, sb) = (a.display().to_string(), b.display().to_string());
        let vars = |out: &'static str, path: &str| {
            [(out, path.to_string()), ("LADDER_TEST_STRATEGY", strategy.to_string()), ("LADDER_TEST_PRECISION", precision.to_string())]
        };
        let (va, vb) = (vars("LADDER_TEST_OUT", &sa), vars("LADDER_TEST_OUT", &sb));
        common::mpirun(w, "level1_body", &va.iter().map(|(k, v)| (*k, v.as_str())).collect::<Vec<_>>());
        common::mpirun(w, "level2_body", &vb.iter().map(|(k, v)| (*k, v.as_str())).collect::<Vec<_>>());
        assert_bit_identical(&a, &b);
        assert!(load_weights(&a).iter().all(|(_, t)| t.kind() == tch::Kind::Float), "master weights stay f32 ({precision})");
    }
}

fn mpirun_cmd(n: usize) -> Command {
    let mut cmd = Command::new("mpirun");
    cmd.args(["-n", &n.to_string(), "--oversubscribe", "--bind-to", "none"])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMP_NUM_THREADS", "1");
    cmd
}

fn level2(n: usize) -> Command {
    level2_steps(n, 40)
}

/// `level2-accelerator` on `n` processes (under mpirun when `n` > 1) for `steps` steps.
fn level2_steps(n: usize, steps: u64) -> Command {
    let mut cmd = if n == 1 { Command::new(BIN) } else { mpirun_cmd(n) };
    if n > 1 {
        cmd.arg(BIN);
    }
    cmd.args(["--device", "cpu", "--log-interval", "0", "--max-steps", &steps.to_string()]);
    cmd
}

fn run_ok(mut cmd: Command) -> String {
    let out = cmd.output().expect("spawn");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{cmd:?} failed ({}):\n{text}", out.status);
    text
}

/// SIGKILL of the job started as `pid` (the binary, or mpirun and its ranks) at once. Open MPI
/// makes each rank lead a process group of its own, so a signal to mpirun's group left the
/// ranks running until they noticed mpirun was gone — on a fast CPU (AMD EPYC of family 26, Zen 5) long
/// enough to write the next checkpoint, which the resume then took. Each of its children is
/// killed by pid, then its group, and the children are waited for (gone, or zombies) before
/// anything reads the checkpoint.
fn kill_job(pid: u32) {
    let out = Command::new("pgrep").args(["-P", &pid.to_string()]).output().expect("pgrep");
    let children: Vec<String> = String::from_utf8_lossy(&out.stdout).split_whitespace().map(str::to_owned).collect();
    for child in &children {
        let _ = Command::new("kill").args(["-KILL", child]).status();
    }
    assert!(Command::new("kill").args(["-KILL", "--", &format!("-{pid}")]).status().unwrap().success());
    let dead = |p: &String| {
        std::fs::read_to_string(format!("/proc/{p}/stat"))
            .map_or(true, |st| st.rsplit(')').next().is_some_and(|rest| rest.trim_start().starts_with('Z')))
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while !children.iter().all(dead) {
        assert!(Instant::now() < deadline, "ranks {children:?} still alive 30 s after SIGKILL");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// SIGKILL (mpirun and its ranks) once a checkpoint at step ≥ 10 is on disk, resume from it,
/// and compare with a run that never stopped.
fn kill_and_resume(n: usize) {
    let dir = tempfile::tempdir().unwrap();
    let (whole, resumed, state) = (dir.path().join("whole.st"), dir.path().join("resumed.st"), dir.path().join("state"));
    let mut cmd = level2(n);
    cmd.arg("--save-model").arg(&whole);
    let whole_text = run_ok(cmd);

    let mut cmd = level2(n);
    cmd.arg("--save-state").arg(&state).args(["--save-every", "10"]);
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    let mut child = cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if common::checkpoint_step(&state).is_some_and(|s| (10..40).contains(&s)) {
            break;
        }
        assert!(child.try_wait().unwrap().is_none(), "the run ended before a checkpoint could be killed");
        assert!(Instant::now() < deadline, "no checkpoint within 120 s");
        std::thread::sleep(Duration::from_millis(5));
    }
    kill_job(child.id());
    let _ = child.wait();
    let at = common::checkpoint_step(&state).unwrap();
    assert!(at < 40, "killed at step {at}, before the end");

    let mut cmd = level2(n);
    cmd.arg("--resume-from").arg(&state).arg("--save-model").arg(&resumed);
    let text = run_ok(cmd);
    assert_bit_identical(&whole, &resumed);
    // Issue 27: the resume says so, and the epoch's line counts the whole epoch's steps and
    // loss, not only the resumed part.
    assert!(
        text.contains(&format!("Resuming from {} at step {at} (epoch 1, after micro-batch {at} of the epoch)", state.display())),
        "{text}"
    );
    let epoch_line = |t: &str| t.lines().find(|l| l.contains("Epoch 1: mean train loss")).map(|l| l.trim().to_string());
    assert_eq!(epoch_line(&text), epoch_line(&whole_text), "{text}");
}

/// Issue 27: the resumed log goes on at the right sample count (the first resumed line is not
/// `[0/…]`).
#[test]
fn a_resumed_log_goes_on_where_it_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state").display().to_string();
    let (ok, text) = run_plain(&["--device", "cpu", "--max-steps", "5", "--log-interval", "0", "--no-eval", "--save-state", &state], &[]);
    assert!(ok, "{text}");
    let (ok, text) = run_plain(&["--device", "cpu", "--max-steps", "7", "--log-interval", "1", "--no-eval", "--resume-from", &state], &[]);
    assert!(ok, "{text}");
    assert!(text.contains("Resuming from ") && text.contains(" at step 5 (epoch 1, after micro-batch 5 of the epoch)"), "{text}");
    let first = text.lines().find(|l| l.starts_with("Train Epoch")).unwrap_or_default();
    assert!(first.starts_with("Train Epoch: 1 [320/60000 (1%)]"), "{text}");
    assert!(text.contains("Epoch 1: mean train loss ") && text.contains(" over 7 steps"), "{text}");
}

/// SIGTERM to each rank (as Slurm's scancel sends it; twice, the second during the save) once
/// a checkpoint at step ≥ 4 is on disk: every process finishes its step, the state is saved,
/// the job exits 143, and resuming from it ends bit-identical to a run that never stopped.
#[test]
fn sigterm_then_resume_is_bit_identical_world_2() {
    let dir = tempfile::tempdir().unwrap();
    let (whole, resumed, state) = (dir.path().join("whole.st"), dir.path().join("resumed.st"), dir.path().join("state"));
    let mut cmd = level2_steps(2, 16);
    cmd.arg("--no-eval").arg("--save-model").arg(&whole);
    run_ok(cmd);

    let mut cmd = level2_steps(2, 16);
    cmd.arg("--no-eval").arg("--save-state").arg(&state).args(["--save-every", "4"]);
    let checkpoint = || common::checkpoint_step(&state).is_some_and(|s| s >= 4);
    let (status, text, took) = common::sigterm_when(&mut cmd, "a checkpoint at step 4", checkpoint, |_| common::pids_of(BIN, &state, None));
    let at = common::checkpoint_step(&state).unwrap();
    assert!((4..16).contains(&at), "stopped at step {at}, not mid-run:\n{text}");
    assert_eq!(status.code(), Some(ladder_core::preempt::PREEMPTED_EXIT_CODE), "{text}");
    let said = format!("preempted (SIGTERM): every process finished step {at} and the state was saved to {}", state.display());
    assert!(text.contains(&said), "{text}");
    eprintln!("SIGTERM to both ranks: state at step {at} saved and the job ended in {took:?}");

    let mut cmd = level2_steps(2, 16);
    cmd.arg("--no-eval").arg("--resume-from").arg(&state).arg("--save-model").arg(&resumed);
    run_ok(cmd);
    assert_bit_identical(&whole, &resumed);
}

#[test]
fn sigkill_then_resume_is_bit_identical_world_1() {
    kill_and_resume(1);
}

#[test]
fn sigkill_then_resume_is_bit_identical_world_2() {
    kill_and_resume(2);
}

#[test]
fn launch_starts_two_agreeing_processes() {
    let out = Command::new(LAUNCH)
        .args(["launch", "--num-processes", "2", "--cpu", BIN, "--max-steps", "5", "--log-interval", "0", "--check-sync"])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{text}");
    assert!(text.contains("check-sync: parameters are bit-identical on all 2 processes"), "{text}");
    assert!(text.contains("Accuracy: ") && text.contains("/10000"), "{text}");
}

/// `level2-accelerator ARGS` as one plain process (world 1), no Accelerate setting inherited
/// except `envs`; its success and its output.
fn run_plain(args: &[&str], envs: &[(&str, &str)]) -> (bool, String) {
    let mut cmd = Command::new(BIN);
    cmd.args(args).env("OMP_NUM_THREADS", "1");
    for (k, _) in std::env::vars() {
        if k.starts_with("ACCELERATE_") || k.starts_with("FSDP_") {
            cmd.env_remove(k);
        }
    }
    cmd.envs(envs.iter().copied());
    let out = cmd.output().unwrap();
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

/// The FSDP-only flags (auto-wrap threshold, backward and forward prefetch) given with a
/// strategy that resolves to DDP are refused before any data is read, naming the first one, as
/// level 1 refuses them; with FSDP from the launcher's variables they are accepted.
#[test]
fn fsdp_only_flags_are_refused_under_ddp() {
    let empty = tempfile::tempdir().unwrap();
    let mnist = empty.path().display().to_string();
    for (args, flag) in [
        (vec!["--strategy", "ddp", "--fsdp-backward-prefetch", "backward-pre"], "--fsdp-backward-prefetch"),
        (vec!["--fsdp-forward-prefetch"], "--fsdp-forward-prefetch"),
        (vec!["--fsdp-forward-prefetch=false"], "--fsdp-forward-prefetch"),
        (vec!["--fsdp-backward-prefetch", "no-prefetch", "--fsdp-min-num-params", "0"], "--fsdp-min-num-params"),
    ] {
        let mut all = vec!["--device", "cpu", "--data-dir", &mnist];
        all.extend(&args);
        let (ok, text) = run_plain(&all, &[]);
        assert!(!ok, "{args:?} must fail:\n{text}");
        assert!(text.contains(&format!("{flag} does not apply to the resolved strategy ddp (use_fsdp false")), "{args:?}:\n{text}");
        assert!(text.contains("the FSDP strategies"), "{text}");
    }
    // DeepSpeed's stage 1 (DDP with ZeRO-1): named zero1, the stage given as the source.
    let (ok, text) = run_plain(&["--device", "cpu", "--data-dir", &mnist, "--zero-stage", "1", "--fsdp-min-num-params", "0"], &[]);
    assert!(!ok && text.contains("--fsdp-min-num-params does not apply to the resolved strategy zero1 (zero_stage 1, "), "{text}");
    // FSDP from the launcher: the flags pass the check (the run then stops at the empty data dir).
    let args = ["--device", "cpu", "--data-dir", &mnist, "--fsdp-backward-prefetch", "backward-post", "--fsdp-forward-prefetch"];
    let (ok, text) = run_plain(&args, &[("ACCELERATE_USE_FSDP", "true")]);
    assert!(!ok && !text.contains("does not apply to"), "{text}");
    assert!(text.contains("file not found"), "{text}");
    // A bad value is refused by the flag parser, with the accepted values.
    let (ok, text) = run_plain(&["--fsdp-backward-prefetch", "pre"], &[]);
    assert!(!ok && text.contains("[possible values: backward-pre, backward-post, no-prefetch]"), "{text}");
}

#[test]
fn help_is_stable() {
    let out = Command::new(BIN).arg("--help").output().unwrap();
    insta::assert_snapshot!(String::from_utf8_lossy(&out.stdout));
}

/// An error one process meets after set-up (its MNIST_DIR, set for it alone through mpirun's
/// MPMD form, is empty) reaches the user at once, prefixed with its rank, and the job ends
/// without the shutdown wait (the Accelerator leaves the group to the launcher when training
/// did not end) — for process 0 and process 1 alike.
#[test]
fn one_processs_error_is_printed_and_ends_the_job_quickly() {
    let empty = tempfile::tempdir().unwrap();
    for victim in [0, 1] {
        // mpirun [-n 1 -x MNIST_DIR=empty BIN …] : [-n 1 BIN …]: ranks follow the segments.
        let segment = |bad: bool| {
            let mut v: Vec<String> = vec!["-n".into(), "1".into()];
            if bad {
                v.extend(["-x".into(), format!("MNIST_DIR={}", empty.path().display())]);
            }
            v.push(BIN.into());
            v.extend(["--device", "cpu", "--max-steps", "1", "--log-interval", "0"].map(String::from));
            v
        };
        let mut cmd = Command::new("mpirun");
        cmd.args(["--oversubscribe", "--bind-to", "none"]).args(segment(victim == 0)).arg(":").args(segment(victim == 1));
        cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1").env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1").env("OMP_NUM_THREADS", "1");
        let start = Instant::now();
        let out = cmd.output().unwrap();
        let took = start.elapsed();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(!out.status.success(), "{text}");
        assert!(text.contains(&format!("rank {victim} of 2")) && text.contains("file not found"), "victim {victim}:\n{text}");
        assert!(took < Duration::from_secs(25), "victim {victim}: took {took:?} (the shutdown wait is 30 s)");
    }
}

/// Level 2's outputs are probed before the first step (issue 27, bug 8): a --save-state or a
/// --save-model in a read-only directory is refused, naming the flag and the path, before any
/// training line (today's main failed only at the first save).
#[test]
fn unwritable_outputs_are_refused_before_training() {
    let (_keep, ro) = common::unwritable_dir();
    for (flag, path, what) in [
        ("--save-state", ro.join("state"), "a writable directory"),
        ("--save-model", ro.join("m.safetensors"), "a writable file"),
        ("--metrics-json", ro.join("sub/m.json"), "a writable file"),
    ] {
        let p = path.display().to_string();
        let (ok, text) = run_plain(&["--device", "cpu", "--max-steps", "1", "--log-interval", "0", flag, &p], &[]);
        assert!(!ok, "{flag}: {text}");
        let want = format!("error: invalid value \"{p}\" for {flag}: {what} (cannot create a file in {}: ", ro.display());
        assert!(text.starts_with(&want), "{flag}: {text}");
        assert!(!text.contains("Train Epoch"), "{flag}: refused before training:\n{text}");
    }
}

/// The config file's (or the launcher's) `seed` trains when `--seed` is not typed (issue 27,
/// bug 5; today's main trained seed 1, the flag's default, over it): a run with `seed: 7` in
/// ACCELERATE_CONFIG_FILE ends with the weights of `--seed 7`, bit for bit. A `--seed` typed
/// wins over the variable, even at its default value.
#[test]
fn the_config_files_seed_trains_unless_seed_is_given() {
    use level2_accelerator::config::ResolvedConfig;
    let parse = |args: &[&str]| {
        level2_accelerator::Config::try_parse_command_line_from(std::iter::once("level2-accelerator").chain(args.iter().copied())).unwrap()
    };
    let seven = |k: &str| (k == "ACCELERATE_SEED").then(|| "7".to_string());
    assert_eq!(parse(&[]).accelerator_config().seed, None, "a flag not given gives nothing");
    assert_eq!(ResolvedConfig::resolve(&parse(&[]).accelerator_config(), seven).unwrap().seed, Some(7));
    assert_eq!(ResolvedConfig::resolve(&parse(&["--seed", "1"]).accelerator_config(), seven).unwrap().seed, Some(1));

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("c.yaml");
    std::fs::write(&file, "seed: 7\n").unwrap();
    let (a, b) = (dir.path().join("file.safetensors"), dir.path().join("flag.safetensors"));
    let run = |out: &Path, extra: &[&str], envs: &[(&str, &str)]| {
        let mut args = vec!["--device", "cpu", "--max-steps", "2", "--log-interval", "0"];
        args.extend(extra);
        let out = out.display().to_string();
        args.extend(["--save-model", &out]);
        let (ok, text) = run_plain(&args, envs);
        assert!(ok, "{args:?}:\n{text}");
    };
    run(&a, &[], &[("ACCELERATE_CONFIG_FILE", &file.display().to_string())]);
    run(&b, &["--seed", "7"], &[]);
    assert_bit_identical(&a, &b);
}

/// Errors about a setting given as a flag name the flag (issue 27: `--mixed-precision fp16` on
/// a CPU said "(set by the program)").
#[test]
fn setting_errors_name_the_flags() {
    let (ok, text) = run_plain(&["--device", "cpu", "--mixed-precision", "fp16"], &[]);
    assert!(!ok);
    assert_eq!(
        text.trim(),
        "error: mixed_precision fp16 (flag --mixed-precision) conflicts with cpu true (flag --device cpu): fp16 needs CUDA; use \
         mixed_precision bf16 on the CPU"
    );
    let (ok, text) = run_plain(&["--device", "cpu", "--gradient-accumulation-steps", "0"], &[]);
    assert!(!ok);
    assert!(
        text.starts_with("error: invalid value \"0\" for gradient_accumulation_steps (flag --gradient-accumulation-steps): expected"),
        "{text}"
    );
}

/// `--no-eval` (issue 27: quick checks cost a full evaluation): nothing is evaluated, the test
/// line says so and the report counts 0 images.
#[test]
fn no_eval_skips_the_evaluation() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("m.json").display().to_string();
    let (ok, text) = run_plain(&["--device", "cpu", "--max-steps", "1", "--log-interval", "0", "--no-eval", "--metrics-json", &json], &[]);
    assert!(ok, "{text}");
    assert!(text.contains("\nTest set: not evaluated\n"), "{text}");
    let report: ladder_core::metrics::Report = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!((report.eval_samples, report.history[0].eval_samples), (0, 0));
}
