//! `save_state` at one world size, `load_state` at another (2 → 3, 3 → 2, 2 → 1, 1 → 2), for
//! DDP and each FSDP strategy: the model and optimizer state are bit-exact after the load, and
//! the rest of the interrupted epoch trains each unseen sample exactly once (counted through
//! the indices the samples carry). The refusals (another model width, no optimizer state, a
//! rest the new world cannot split evenly) are snapshotted.

#[path = "../../shared/tests/common/mod.rs"]
mod common;

use ladder_core::data::Dataset;
use ladder_core::dist::{self, Backend};
use ladder_core::model::{BasicNet, BasicNetConfig};
use ladder_core::optim::AdamWConfig;
use level2_accelerator::config::{AcceleratorConfig, ShardingStrategy};
use level2_accelerator::{Accelerator, DataLoaderOptions, DistributedDataParallelKwargs};
use std::path::{Path, PathBuf};
use tch::{nn, Device, Tensor};

/// Samples in the synthetic dataset; batches of [`BATCH`] per rank; [`SAVED_AFTER`] batches
/// run before the save.
const SAMPLES: i64 = 52;
const BATCH: usize = 4;
const SAVED_AFTER: usize = 3;
const STRATEGIES: [&str; 4] = ["ddp", "full_shard", "shard_grad_op", "no_shard"];

fn config(strategy: &str) -> AcceleratorConfig {
    let sharding = match strategy {
        "full_shard" => Some(ShardingStrategy::FullShard),
        "shard_grad_op" => Some(ShardingStrategy::ShardGradOp),
        "no_shard" => Some(ShardingStrategy::NoShard),
        _ => None,
    };
    AcceleratorConfig {
        cpu: Some(true),
        use_fsdp: Some(sharding.is_some()),
        fsdp_sharding_strategy: sharding,
        fsdp_min_num_params: Some(0),
        seed: Some(5),
        ..Default::default()
    }
}

/// Trains on `batches` (all of the epoch's if `None`), returning the sample indices this rank
/// trained on.
fn train(
    acc: &Accelerator,
    init_seed: i64,
    width: i64,
    resume: Option<&Path>,
    batches: Option<usize>,
) -> level2_accelerator::Result<Vec<i64>> {
    tch::manual_seed(init_seed);
    let vs = nn::VarStore::new(Device::Cpu);
    let net = BasicNet::new(&vs.root(), BasicNetConfig { width, ..Default::default() });
    let model = acc.prepare_model(vs, net)?;
    let mut opt = acc.prepare_optimizer(&model, AdamWConfig::default())?;
    let data = Dataset::indexed(SAMPLES);
    let loader = acc.prepare_data_loader(&data, DataLoaderOptions { batch_size: BATCH, shuffle: true, ..Default::default() })?;
    if let Some(dir) = resume {
        acc.load_state(dir)?;
    }
    let mut seen = Vec::new();
    for (x, y) in loader.iter().take(batches.unwrap_or(usize::MAX)) {
        seen.extend(Vec::<f32>::try_from(x.select(1, 0).select(1, 0).select(1, 0)).unwrap().into_iter().map(|v| v as i64));
        acc.accumulate(&model, || -> level2_accelerator::Result<()> {
            let loss = model.forward_t(&x, true)?.nll_loss(&y);
            acc.backward(&loss)?;
            opt.step()?;
            opt.zero_grad();
            Ok(())
        })?;
    }
    Ok(seen)
}

fn root() -> PathBuf {
    PathBuf::from(std::env::var("RESUME_DIR").expect("RESUME_DIR"))
}

#[test]
#[ignore = "rank body: run by resuming_at_another_world_size_* under mpirun"]
fn resume_body() {
    let pg = dist::leak(dist::init_process_group(Backend::Mpi).unwrap());
    let (rank, w) = (pg.rank(), pg.world_size());
    let phase = std::env::var("RESUME_PHASE").expect("RESUME_PHASE");
    for strategy in STRATEGIES {
        let dir = root().join(strategy);
        let acc = Accelerator::with_group(config(strategy), DistributedDataParallelKwargs::default(), pg).unwrap();
        let seen = if phase == "save" {
            let seen = train(&acc, 1, 128, None, Some(SAVED_AFTER)).unwrap();
            acc.save_state(&dir.join("ckpt")).unwrap();
            seen
        } else {
            // Other initial weights: everything must come from the checkpoint.
            let seen = train(&acc, 2, 128, Some(&dir.join("ckpt")), None).unwrap();
            let acc2 = Accelerator::with_group(config(strategy), DistributedDataParallelKwargs::default(), pg).unwrap();
            train(&acc2, 3, 128, Some(&dir.join("ckpt")), Some(0)).unwrap();
            acc2.save_state(&dir.join("reloaded")).unwrap();
            seen
        };
        std::fs::write(dir.join(format!("seen-{phase}-{w}-{rank}.json")), serde_json::to_vec(&seen).unwrap()).unwrap();
    }
    pg.shutdown();
}

fn read_tensors(path: &Path) -> Vec<(String, Tensor)> {
    let mut t = Tensor::read_safetensors(path).unwrap();
    t.sort_by(|a, b| a.0.cmp(&b.0));
    t
}

fn seen(dir: &Path, phase: &str, w: usize) -> Vec<i64> {
    (0..w)
        .flat_map(|r| serde_json::from_slice::<Vec<i64>>(&std::fs::read(dir.join(format!("seen-{phase}-{w}-{r}.json"))).unwrap()).unwrap())
        .collect()
}

/// Saves at `w`, resumes at `w2`, and checks the state and the data order for every strategy.
fn save_then_resume(w: usize, w2: usize) {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().to_str().unwrap();
    for s in STRATEGIES {
        std::fs::create_dir_all(root.path().join(s)).unwrap();
    }
    common::mpirun(w, "resume_body", &[("RESUME_PHASE", "save"), ("RESUME_DIR", dir)]);
    common::mpirun(w2, "resume_body", &[("RESUME_PHASE", "load"), ("RESUME_DIR", dir)]);
    for s in STRATEGIES {
        let d = root.path().join(s);
        for file in [ladder_core::checkpoint::MODEL_FILE, ladder_core::checkpoint::OPTIMIZER_FILE] {
            let (a, b) = (read_tensors(&d.join("ckpt").join(file)), read_tensors(&d.join("reloaded").join(file)));
            assert_eq!(a.len(), b.len(), "{s} {w}->{w2} {file}: keys");
            assert!(!a.is_empty(), "{s} {w}->{w2} {file}: empty");
            for ((ka, ta), (kb, tb)) in a.iter().zip(&b) {
                assert_eq!(ka, kb, "{s} {w}->{w2} {file}");
                assert!(ta.equal(tb), "{s} {w}->{w2} {file} {ka}: not bit-identical after load");
            }
        }
        let state = |name: &str| -> serde_json::Value {
            serde_json::from_slice(&std::fs::read(d.join(name).join(ladder_core::checkpoint::STATE_FILE)).unwrap()).unwrap()
        };
        let (saved, reloaded) = (state("ckpt"), state("reloaded"));
        let consumed = (SAVED_AFTER * BATCH * w) as u64;
        assert_eq!(saved["samples_consumed"], consumed, "{s}: {saved}");
        assert_eq!(reloaded["samples_consumed"], consumed, "{s}: {reloaded}");
        assert_eq!(reloaded["global_step"], saved["global_step"], "{s}");
        let before = seen(&d, "save", w);
        let after = seen(&d, "load", w2);
        assert_eq!(before.len() as u64, consumed, "{s} {w}->{w2}: trained before the save");
        let mut all: Vec<i64> = before.iter().chain(&after).copied().collect();
        all.sort_unstable();
        assert_eq!(all, (0..SAMPLES).collect::<Vec<_>>(), "{s} {w}->{w2}: every sample of the epoch exactly once");
    }
}

#[test]
fn resuming_at_another_world_size_2_to_3() {
    save_then_resume(2, 3);
}

#[test]
fn resuming_at_another_world_size_3_to_2() {
    save_then_resume(3, 2);
}

#[test]
fn resuming_at_another_world_size_2_to_1() {
    save_then_resume(2, 1);
}

#[test]
fn resuming_at_another_world_size_1_to_2() {
    save_then_resume(1, 2);
}

#[test]
#[ignore = "rank body: run by refusals_are_named under mpirun"]
fn refusal_body() {
    let pg = dist::leak(dist::init_process_group(Backend::Mpi).unwrap());
    let dir = root();
    let mut lines = Vec::new();
    let acc = || Accelerator::with_group(config("ddp"), DistributedDataParallelKwargs::default(), pg).unwrap();
    // Saved at width 128 after 3 batches on 3 ranks (36 samples consumed, 16 left).
    let a = acc();
    train(&a, 1, 128, None, Some(SAVED_AFTER)).unwrap();
    a.save_state(&dir.join("w128")).unwrap();
    let err = |e: level2_accelerator::Error| e.to_string().replace(dir.to_str().unwrap(), "<dir>");
    lines.push(format!("another width: {}", err(train(&acc(), 1, 64, Some(&dir.join("w128")), Some(0)).unwrap_err())));
    if pg.rank() == 0 {
        // The same checkpoint with its optimizer state gone.
        std::fs::create_dir_all(dir.join("no-optimizer")).unwrap();
        for f in [ladder_core::checkpoint::MODEL_FILE, ladder_core::checkpoint::STATE_FILE] {
            std::fs::copy(dir.join("w128").join(f), dir.join("no-optimizer").join(f)).unwrap();
        }
        Tensor::write_safetensors(&[] as &[(String, Tensor)], dir.join("no-optimizer").join(ladder_core::checkpoint::OPTIMIZER_FILE))
            .unwrap();
        // 26 consumed at 2 ranks: at 3 ranks the last global batch of the 26 left holds 2.
        std::fs::create_dir_all(dir.join("uneven")).unwrap();
        for f in [ladder_core::checkpoint::MODEL_FILE, ladder_core::checkpoint::OPTIMIZER_FILE] {
            std::fs::copy(dir.join("w128").join(f), dir.join("uneven").join(f)).unwrap();
        }
        let mut state: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("w128").join(ladder_core::checkpoint::STATE_FILE)).unwrap()).unwrap();
        state["samples_consumed"] = 26.into();
        state["world_size"] = 2.into();
        std::fs::write(dir.join("uneven").join(ladder_core::checkpoint::STATE_FILE), serde_json::to_vec(&state).unwrap()).unwrap();
    }
    pg.barrier().unwrap();
    lines.push(format!("no optimizer state: {}", err(train(&acc(), 1, 128, Some(&dir.join("no-optimizer")), Some(0)).unwrap_err())));
    lines.push(format!("uneven rest: {}", err(train(&acc(), 1, 128, Some(&dir.join("uneven")), Some(0)).unwrap_err())));
    if pg.rank() == 0 {
        std::fs::write(dir.join("refusals.txt"), lines.join("\n")).unwrap();
    }
    pg.barrier().unwrap();
    pg.shutdown();
}

#[test]
fn refusals_are_named() {
    let root = tempfile::tempdir().unwrap();
    common::mpirun(3, "refusal_body", &[("RESUME_DIR", root.path().to_str().unwrap())]);
    insta::assert_snapshot!(std::fs::read_to_string(root.path().join("refusals.txt")).unwrap());
}

const BIN: &str = env!("CARGO_BIN_EXE_level2-accelerator");
const LAUNCH: &str = env!("CARGO_BIN_EXE_ladder-accelerate");

fn launch(w: usize, max_restarts: usize, bin_args: &[&std::ffi::OsStr]) -> std::process::Command {
    launch_steps(w, max_restarts, 40, bin_args)
}

/// `ladder-accelerate launch` of level 2 on `w` processes for `steps` steps.
fn launch_steps(w: usize, max_restarts: usize, steps: u64, bin_args: &[&std::ffi::OsStr]) -> std::process::Command {
    let mut cmd = std::process::Command::new(LAUNCH);
    cmd.args(["launch", "--num-processes", &w.to_string(), "--cpu", "--max-restarts", &max_restarts.to_string(), BIN])
        .args(["--device", "cpu", "--log-interval", "0", "--max-steps", &steps.to_string()])
        .args(bin_args)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMP_NUM_THREADS", "1");
    cmd
}

/// `ladder-accelerate launch --max-restarts 2`: rank 1 SIGKILLed after the checkpoint at step
/// 10; the group is restarted, resumes from --save-state's directory by itself, and ends with
/// the weights of a run that never stopped.
fn killed_rank_is_restarted(w: usize) {
    let dir = tempfile::tempdir().unwrap();
    let (whole, restarted, state) = (dir.path().join("whole.st"), dir.path().join("restarted.st"), dir.path().join("state"));
    let out = launch(w, 0, &["--save-model".as_ref(), whole.as_os_str()]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    let mut cmd = launch(
        w,
        2,
        &[
            "--save-state".as_ref(),
            state.as_os_str(),
            "--save-every".as_ref(),
            "10".as_ref(),
            "--save-model".as_ref(),
            restarted.as_os_str(),
        ],
    );
    let child = cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(180);
    let pid = loop {
        if common::checkpoint_step(&state).is_some_and(|s| (10..40).contains(&s)) {
            if let Some(&pid) = common::pids_of(BIN, &state, Some(1)).first() {
                break pid;
            }
        }
        assert!(std::time::Instant::now() < deadline, "no checkpoint within 180 s");
        std::thread::sleep(std::time::Duration::from_millis(5));
    };
    let killed = std::process::Command::new("kill").args(["-KILL", &pid.to_string()]).status().unwrap();
    assert!(killed.success());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the restarted job failed ({}):\n{stderr}", out.status);
    assert!(stderr.contains("attempt 1 of 3 failed"), "{stderr}");
    let (a, b) = (read_tensors(&whole), read_tensors(&restarted));
    assert_eq!(a.len(), 8, "BasicNet's 8 parameters");
    for ((k, ta), (_, tb)) in a.iter().zip(&b) {
        assert!(ta.equal(tb), "{k}: the restarted run's weights differ from the uninterrupted run's (W={w})");
    }
}

#[test]
fn killed_rank_is_restarted_and_resumes_bit_identically_world_2() {
    killed_rank_is_restarted(2);
}

#[test]
fn killed_rank_is_restarted_and_resumes_bit_identically_world_3() {
    killed_rank_is_restarted(3);
}

/// SIGTERM to `ladder-accelerate launch --max-restarts 2` (the signal a scheduler sends to
/// torchrun's agent) once a checkpoint at step ≥ 4 is on disk: the launcher forwards it to both
/// ranks, which finish their step, save the state and exit 143; the launcher exits 143 without
/// restarting them, and resuming from the state ends bit-identical to a run that never stopped.
#[test]
fn sigterm_to_the_launcher_saves_the_state_and_is_not_restarted() {
    let dir = tempfile::tempdir().unwrap();
    let (whole, stopped, resumed, state) =
        (dir.path().join("whole.st"), dir.path().join("stopped.st"), dir.path().join("resumed.st"), dir.path().join("state"));
    let no_eval: &std::ffi::OsStr = "--no-eval".as_ref();
    let out = launch_steps(2, 0, 16, &[no_eval, "--save-model".as_ref(), whole.as_os_str()]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    let save = ["--save-state".as_ref(), state.as_os_str(), "--save-every".as_ref(), "4".as_ref()];
    let mut cmd = launch_steps(2, 2, 16, &[&[no_eval, "--save-model".as_ref(), stopped.as_os_str()], &save[..]].concat());
    let checkpoint = || common::checkpoint_step(&state).is_some_and(|s| s >= 4);
    let (status, text, took) = common::sigterm_when(&mut cmd, "a checkpoint at step 4", checkpoint, |launcher| vec![launcher.id()]);
    let at = common::checkpoint_step(&state).unwrap();
    assert!((4..16).contains(&at) && !stopped.exists(), "stopped at step {at}, not mid-run:\n{text}");
    assert_eq!(status.code(), Some(ladder_core::preempt::PREEMPTED_EXIT_CODE), "{text}");
    assert!(text.contains("ladder-run: received SIGTERM; forwarded it to all 2 ranks, which exited with 143; exiting with 143"), "{text}");
    assert!(text.contains(&format!("[rank0]: preempted (SIGTERM): every process finished step {at} and the state was saved")), "{text}");
    assert!(!text.contains("restarting"), "a signalled launcher restarted its ranks:\n{text}");
    eprintln!("SIGTERM to the launcher: state at step {at} saved and the job ended in {took:?}");

    let out = launch_steps(2, 0, 16, &[no_eval, "--resume-from".as_ref(), state.as_os_str(), "--save-model".as_ref(), resumed.as_os_str()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    common::assert_bit_identical("preempted through the launcher and resumed vs uninterrupted", &whole, &resumed);
}
