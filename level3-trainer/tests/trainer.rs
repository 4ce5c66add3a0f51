//! The Trainer on real MNIST subsets, each run in its own process (a process group per
//! process): resume after SIGKILL is bit-identical, loss accounting under accumulation equals
//! the large batch, save_total_limit keeps the best checkpoint and load_best_model_at_end
//! restores it bit for bit, a checkpoint loads into PyTorch's BasicNet.
//!
//! The driving tests start the ignored `body_train` test of this binary as a child process
//! (or as `mpirun -n 2` ranks), configured through `L3_*` environment variables.

#[path = "../../shared/tests/common/mod.rs"]
mod common;

use ladder_core::data::mnist::workspace_data_dir;
use ladder_core::data::Mnist;
use ladder_core::model::{BasicNet, BasicNetConfig};
use level3_trainer::args::{IntervalStrategy, SchedulerType};
use level3_trainer::callbacks::{TrainerCallback, TrainerControl};
use level3_trainer::state::TrainerState;
use level3_trainer::{set_seed, Batch, ResumeFrom, Trainer, TrainerHooks, TrainingArguments};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use tch::{nn, Device, Tensor};

/// Training examples of the subset (not a multiple of the batch: a short last batch).
const TRAIN_N: usize = 1000;
/// Evaluation examples of the subset.
const EVAL_N: usize = 500;

struct Nll;
impl TrainerHooks for Nll {
    fn compute_loss(&self, model: &mut level3_trainer::TrainerModel<'_>, inputs: &Batch) -> level3_trainer::Result<(Tensor, Tensor)> {
        let out = model.forward(&inputs.x)?;
        Ok((out.nll_loss(&inputs.labels), out))
    }
}

/// Sleeps after every step, so that a test can kill the process mid-run.
struct Slow(u64);
impl TrainerCallback for Slow {
    fn on_step_end(&mut self, _: &TrainingArguments, _: &TrainerState, _: &mut TrainerControl) {
        std::thread::sleep(Duration::from_millis(self.0));
    }
}

/// The rank body: trains on the MNIST subsets with the TrainingArguments in `L3_ARGS`
/// (JSON) into `L3_OUT`, resuming from the last checkpoint with `L3_RESUME`, then saves the
/// model. Does nothing without `L3_OUT`.
#[test]
#[ignore = "rank body: run under mpirun by the trainer tests with L3_OUT set"]
fn body_train() {
    let Some(out) = std::env::var_os("L3_OUT") else {
        return;
    };
    let mut args: TrainingArguments = serde_json::from_str(&std::env::var("L3_ARGS").unwrap()).unwrap();
    args.output_dir = PathBuf::from(out);
    args.use_cpu = true;
    if let Some(dir) = std::env::var_os("L3_PIDS") {
        let rank = std::env::var("OMPI_COMM_WORLD_RANK").unwrap_or_else(|_| "0".into());
        std::fs::write(Path::new(&dir).join(format!("rank{rank}.pid")), std::process::id().to_string()).unwrap();
    }
    if std::env::var_os("L3_WATCH").is_some() {
        ladder_core::preempt::watch().unwrap();
    }
    let mnist = Mnist::load(&workspace_data_dir()).unwrap();
    set_seed(args.seed);
    let vs = nn::VarStore::new(Device::Cpu);
    let cfg = if std::env::var_os("L3_NO_DROPOUT").is_some() {
        BasicNetConfig { dropout: false, ..Default::default() }
    } else {
        BasicNetConfig::default()
    };
    let net = BasicNet::new(&vs.root(), cfg);
    let train = mnist.train.slice(0..TRAIN_N);
    let eval_n = std::env::var("L3_EVAL_N").map_or(EVAL_N, |v| v.parse().unwrap());
    let eval = mnist.test.slice(0..eval_n);
    let mut trainer = Trainer::new(vs, net, args, Some(train), Some(eval), level3_trainer::DefaultDataCollator, Nll).unwrap();
    if let Ok(patience) = std::env::var("L3_EARLY_STOPPING_PATIENCE") {
        trainer.add_callback(level3_trainer::callbacks::EarlyStoppingCallback::new(patience.parse().unwrap(), 0.0));
    }
    if let Ok(ms) = std::env::var("L3_SLEEP_MS") {
        trainer.add_callback(Slow(ms.parse().unwrap()));
    }
    let resume = std::env::var_os("L3_RESUME").map(|_| ResumeFrom::Last);
    let out = match trainer.train(resume) {
        // Under L3_WATCH: stopped on SIGTERM after its checkpoint, as the binary exits.
        Err(e @ level3_trainer::Error::Preempted { .. }) => {
            println!("{e}");
            std::process::exit(ladder_core::preempt::PREEMPTED_EXIT_CODE)
        }
        r => r.unwrap(),
    };
    trainer.save_model().unwrap();
    if std::env::var_os("L3_CHECK_PREDICT").is_some() {
        // predict() over the eval subset: every example once, in dataset order, at any world
        // size; its loss equals evaluate()'s.
        let eval = mnist.test.slice(0..eval_n);
        let p = trainer.predict(&eval).unwrap();
        assert_eq!(p.predictions.size(), [eval_n as i64, 10]);
        assert!(p.label_ids.equal(&eval.labels), "labels out of order");
        let m = trainer.evaluate("eval").unwrap();
        assert!((p.metrics["test_loss"] - m["eval_loss"]).abs() < 1e-12);
        let direct = p.predictions.nll_loss(&p.label_ids).double_value(&[]);
        assert!((direct - m["eval_loss"]).abs() < 1e-5, "{direct} vs {}", m["eval_loss"]);
    }
    println!("trained {} steps", out.global_step);
}

fn base_args() -> TrainingArguments {
    TrainingArguments {
        per_device_train_batch_size: 32,
        per_device_eval_batch_size: 100,
        num_train_epochs: 1.0,
        learning_rate: 1e-3,
        weight_decay: 0.01,
        max_grad_norm: 0.0,
        lr_scheduler_type: SchedulerType::Constant,
        logging_steps: 4,
        save_steps: 4,
        seed: 3,
        disable_tqdm: true,
        ..TrainingArguments::default()
    }
}

fn body_command(out: &Path, args: &TrainingArguments, envs: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--ignored", "--exact", "body_train", "--test-threads", "1", "--nocapture"])
        .env("L3_OUT", out)
        .env("L3_ARGS", serde_json::to_string(args).unwrap())
        .env("OMP_NUM_THREADS", "1");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    cmd
}

/// Runs the body in one process; panics with its output when it fails.
fn train_once(out: &Path, args: &TrainingArguments, envs: &[(&str, &str)]) -> String {
    let o = body_command(out, args, envs).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success() && text.contains("test result: ok. 1 passed"), "body failed:\n{text}");
    text
}

/// Runs the body as `n` MPI ranks.
fn train_ranks(n: usize, out: &Path, args: &TrainingArguments, envs: &[(&str, &str)]) -> String {
    let json = serde_json::to_string(args).unwrap();
    let out_s = out.to_str().unwrap();
    let mut all: Vec<(&str, &str)> = vec![("L3_OUT", out_s), ("L3_ARGS", &json)];
    all.extend_from_slice(envs);
    common::mpirun(n, "body_train", &all)
}

fn state(out: &Path) -> TrainerState {
    TrainerState::load(&out.join("trainer_state.json")).unwrap()
}

/// The body as 2 MPI ranks under `mpirun`, each writing its pid into `pids` and sleeping
/// 150 ms per step (so a test can signal it between checkpoints), not yet spawned.
fn slow_two_ranks(out: &Path, args: &TrainingArguments, pids: &Path) -> Command {
    let mut cmd = Command::new("mpirun");
    cmd.args(["-n", "2", "--oversubscribe", "--bind-to", "none"])
        .arg(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "body_train", "--test-threads", "1"])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMP_NUM_THREADS", "1")
        .env("L3_OUT", out)
        .env("L3_ARGS", serde_json::to_string(args).unwrap())
        .env("L3_PIDS", pids)
        .env("L3_SLEEP_MS", "150");
    cmd
}

/// Spawns the body, SIGKILLs it (`Child::kill`) as soon as `checkpoint-<kill_after>` exists,
/// and checks it died from the kill.
fn kill_after_checkpoint(cmd: &mut Command, out: &Path, kill_after: u64, pids: Option<&Path>) {
    let mut child = cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    let target = out.join(format!("checkpoint-{kill_after}"));
    let start = Instant::now();
    while !target.exists() {
        assert!(start.elapsed() < Duration::from_secs(120), "no {} after 120 s", target.display());
        assert!(child.try_wait().unwrap().is_none(), "the run ended before checkpoint-{kill_after}");
        std::thread::sleep(Duration::from_millis(5));
    }
    match pids {
        // Under mpirun: SIGKILL rank 1 itself; the launcher then takes the job down.
        Some(dir) => {
            let pid = std::fs::read_to_string(dir.join("rank1.pid")).unwrap();
            let status = Command::new("kill").args(["-KILL", pid.trim()]).status().unwrap();
            assert!(status.success());
        }
        None => child.kill().unwrap(),
    }
    let status = child.wait().unwrap();
    assert!(!status.success(), "the killed run exited successfully");
    assert!(!out.join("model.safetensors").exists(), "the killed run finished");
}

#[test]
fn sigkill_then_resume_is_bit_identical_at_world_1() {
    let dir = tempfile::tempdir().unwrap();
    let (full, killed) = (dir.path().join("full"), dir.path().join("killed"));
    let args = TrainingArguments { max_steps: 20, ..base_args() };
    train_once(&full, &args, &[]);
    assert_eq!(state(&full).global_step, 20);

    kill_after_checkpoint(&mut body_command(&killed, &args, &[("L3_SLEEP_MS", "100")]), &killed, 8, None);
    let text = train_once(&killed, &args, &[("L3_RESUME", "1")]);
    assert!(text.contains("Resuming from"), "{text}");
    common::assert_bit_identical("resumed vs uninterrupted", &full.join("model.safetensors"), &killed.join("model.safetensors"));
    // The log history after the resume point is the uninterrupted one too (same losses).
    let (a, b) = (state(&full), state(&killed));
    let losses = |s: &TrainerState| s.loss_curve();
    assert_eq!(losses(&a).len(), 5);
    for ((sa, la), (sb, lb)) in losses(&a).iter().zip(losses(&b).iter()) {
        assert_eq!(sa, sb);
        assert!((la - lb).abs() < 1e-12, "step {sa}: {la} vs {lb}");
    }
}

#[test]
fn sigkill_then_resume_is_bit_identical_at_world_2() {
    let dir = tempfile::tempdir().unwrap();
    let (full, killed, pids) = (dir.path().join("full"), dir.path().join("killed"), dir.path().join("pids"));
    std::fs::create_dir_all(&pids).unwrap();
    let args = TrainingArguments { max_steps: 12, per_device_train_batch_size: 16, ..base_args() };
    train_ranks(2, &full, &args, &[]);
    assert_eq!(state(&full).global_step, 12);

    kill_after_checkpoint(&mut slow_two_ranks(&killed, &args, &pids), &killed, 4, Some(&pids));
    train_ranks(2, &killed, &args, &[("L3_RESUME", "1")]);
    common::assert_bit_identical("resumed vs uninterrupted (2 ranks)", &full.join("model.safetensors"), &killed.join("model.safetensors"));
}

/// A run restarted by its launcher (`ladder-run --max-restarts`: TORCHELASTIC_RESTART_COUNT
/// = 1, no resume argument) resumes from the newest checkpoint in output_dir by itself.
#[test]
fn restarted_run_resumes_by_itself() {
    let dir = tempfile::tempdir().unwrap();
    let (full, killed, pids) = (dir.path().join("full"), dir.path().join("killed"), dir.path().join("pids"));
    std::fs::create_dir_all(&pids).unwrap();
    let args = TrainingArguments { max_steps: 12, per_device_train_batch_size: 16, ..base_args() };
    train_ranks(2, &full, &args, &[]);
    kill_after_checkpoint(&mut slow_two_ranks(&killed, &args, &pids), &killed, 4, Some(&pids));
    let text = train_ranks(2, &killed, &args, &[("TORCHELASTIC_RESTART_COUNT", "1"), ("TORCHELASTIC_MAX_RESTARTS", "2")]);
    assert!(text.contains("Resuming from"), "{text}");
    common::assert_bit_identical(
        "restarted vs uninterrupted (2 ranks)",
        &full.join("model.safetensors"),
        &killed.join("model.safetensors"),
    );
}

/// SIGTERM to every rank (as Slurm's scancel sends it; twice, the second during the save):
/// each finishes its step, one checkpoint is written, the job ends with 143 within 10 s, and
/// resuming from it ends bit-identical to a run that never stopped.
#[test]
fn sigterm_writes_a_checkpoint_and_resume_is_bit_identical() {
    let dir = tempfile::tempdir().unwrap();
    let (full, stopped, pids) = (dir.path().join("full"), dir.path().join("stopped"), dir.path().join("pids"));
    std::fs::create_dir_all(&pids).unwrap();
    let args = TrainingArguments { max_steps: 12, per_device_train_batch_size: 16, ..base_args() };
    train_ranks(2, &full, &args, &[]);
    let mut cmd = slow_two_ranks(&stopped, &args, &pids);
    cmd.args(["--nocapture"]).env("L3_WATCH", "1");
    let ranks = |_: &std::process::Child| -> Vec<u32> {
        (0..2).map(|r| std::fs::read_to_string(pids.join(format!("rank{r}.pid"))).unwrap().trim().parse().unwrap()).collect()
    };
    let (status, text, took) = common::sigterm_when(&mut cmd, "checkpoint-4", || stopped.join("checkpoint-4").exists(), ranks);
    assert!(took < Duration::from_secs(10), "checkpoint and exit took {took:?}:\n{text}");
    assert_eq!(status.code(), Some(ladder_core::preempt::PREEMPTED_EXIT_CODE), "{text}");
    assert!(text.contains("preempted (SIGTERM): every rank finished step "), "{text}");
    assert!(!stopped.join("model.safetensors").exists(), "the stopped run finished:\n{text}");
    let last = level3_trainer::checkpoints::last_checkpoint(&stopped).unwrap().unwrap();
    let step = level3_trainer::checkpoints::checkpoint_step(&last).unwrap();
    assert!((4..12).contains(&step), "the preemption checkpoint is at step {step}:\n{text}");
    eprintln!("SIGTERM → checkpoint-{step} written and job ended in {took:?}");
    train_ranks(2, &stopped, &args, &[("L3_RESUME", "1")]);
    common::assert_bit_identical(
        "preempted and resumed vs uninterrupted (2 ranks)",
        &full.join("model.safetensors"),
        &stopped.join("model.safetensors"),
    );
}

/// Loss accounting: B = 16 with accumulation 4 (and W = 2 × B = 32) computes the same updates
/// as B = 64, the short last window included (1000 = 15 × 64 + 40: the last window holds 3
/// micro-batches of 16, 16 and 8), and logs the same per-step losses. No dropout. The 2-rank
/// run also checks `predict`/`evaluate` on 201 examples (rank 1's last batch of 100 is all
/// padding, and is run but not counted): every example once, in order.
#[test]
fn accumulation_and_world_size_equal_the_large_batch() {
    let dir = tempfile::tempdir().unwrap();
    let no_save = |b: usize, acc: usize| TrainingArguments {
        per_device_train_batch_size: b,
        gradient_accumulation_steps: acc,
        logging_steps: 1,
        save_strategy: IntervalStrategy::No,
        ..base_args()
    };
    let (big, acc, two) = (dir.path().join("big"), dir.path().join("acc"), dir.path().join("two"));
    train_once(&big, &no_save(64, 1), &[("L3_NO_DROPOUT", "1")]);
    train_once(&acc, &no_save(16, 4), &[("L3_NO_DROPOUT", "1")]);
    train_ranks(2, &two, &no_save(32, 1), &[("L3_NO_DROPOUT", "1"), ("L3_CHECK_PREDICT", "1"), ("L3_EVAL_N", "201")]);
    let reference = state(&big);
    assert_eq!(reference.global_step, 16); // ceil(1000 / 64)
    for (name, other) in [("accumulation 4", &acc), ("2 ranks", &two)] {
        let s = state(other);
        assert_eq!(s.global_step, 16, "{name}");
        let (la, lb) = (reference.loss_curve(), s.loss_curve());
        assert_eq!(la.len(), 16);
        for ((step, a), (_, b)) in la.iter().zip(&lb) {
            assert!((a - b).abs() < 1e-5, "{name}: step {step} loss {b} vs {a}");
        }
        let (wa, wb) =
            (common::read_safetensors(&big.join("model.safetensors")), common::read_safetensors(&other.join("model.safetensors")));
        for ((k, x), (_, y)) in wa.iter().zip(&wb) {
            let diff = (x - y).abs().max().double_value(&[]);
            assert!(diff < 1e-4, "{name}: {k} max |diff| {diff}");
        }
    }
}

/// save_total_limit 1 and 2 with the best checkpoint early (greater_is_better on eval_loss makes
/// the first evaluation the best): it survives rotation, and load_best_model_at_end restores its
/// weights bit for bit.
#[test]
fn rotation_keeps_the_early_best_and_load_best_model_at_end_restores_it() {
    for limit in [1usize, 2] {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out");
        let args = TrainingArguments {
            max_steps: 16,
            eval_strategy: IntervalStrategy::Steps,
            eval_steps: Some(4),
            save_steps: 4,
            save_total_limit: Some(limit),
            load_best_model_at_end: true,
            metric_for_best_model: Some("eval_loss".into()),
            greater_is_better: Some(true),
            report_to: level3_trainer::args::ReportTo::Jsonl,
            ..base_args()
        };
        train_once(&out, &args, &[]);
        let s = state(&out);
        let jsonl = std::fs::read_to_string(out.join("log_history.jsonl")).unwrap();
        assert_eq!(jsonl.lines().count(), s.log_history.len(), "report_to=jsonl writes every log entry");
        let evals: Vec<(u64, f64)> = s.eval_loss_curve();
        assert_eq!(evals.iter().map(|e| e.0).collect::<Vec<_>>(), [4, 8, 12, 16]);
        let best_step = evals.iter().max_by(|a, b| a.1.total_cmp(&b.1)).unwrap().0;
        assert_eq!(best_step, 4, "the first evaluation has the highest loss: {evals:?}");
        assert_eq!(s.best_global_step, Some(4));
        assert_eq!(s.best_model_checkpoint.as_deref(), Some(out.join("checkpoint-4").as_path()));
        let mut left: Vec<String> = std::fs::read_dir(&out)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("checkpoint-"))
            .collect();
        left.sort();
        // Limit 1 keeps the best and the newest (as Transformers); limit 2 the same two.
        assert_eq!(left, ["checkpoint-16", "checkpoint-4"], "limit {limit}");
        common::assert_bit_identical(
            "best checkpoint vs final model",
            &out.join("checkpoint-4/model.safetensors"),
            &out.join("model.safetensors"),
        );
    }
}

/// A checkpoint's model.safetensors loads into PyTorch's BasicNet (the tutorial's module, in
/// .venv's torch) and gives the same test accuracy and loss as the Trainer's evaluation.
#[test]
fn checkpoint_loads_into_pytorch_basicnet_with_the_same_accuracy() {
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python");
    assert!(python.exists(), "{} missing: run scripts/bootstrap.sh", python.display());
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let args =
        TrainingArguments { max_steps: 8, save_steps: 8, eval_strategy: IntervalStrategy::Steps, eval_steps: Some(8), ..base_args() };
    train_once(&out, &args, &[]);
    let s = state(&out);
    let eval = s.log_history.iter().find(|e| e.get("eval_loss").is_some()).unwrap().clone();
    let script = format!(
        r#"
import json, struct, sys, torch, torch.nn as nn, torch.nn.functional as F
import numpy as np, gzip
def load_safetensors(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n]); data = raw[8 + n:]
    out = {{}}
    for k, v in header.items():
        if k == "__metadata__": continue
        a, b = v["data_offsets"]
        assert v["dtype"] == "F32", v["dtype"]
        out[k] = torch.frombuffer(bytearray(data[a:b]), dtype=torch.float32).reshape(v["shape"])
    return out
class BasicNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1); self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25); self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128); self.fc2 = nn.Linear(128, 10); self.act = F.relu
    def forward(self, x):
        x = self.act(self.conv1(x)); x = self.act(self.conv2(x)); x = F.max_pool2d(x, 2)
        x = self.dropout1(x); x = torch.flatten(x, 1); x = self.act(self.fc1(x))
        x = self.dropout2(x); x = self.fc2(x); return F.log_softmax(x, dim=1)
model = BasicNet()
model.load_state_dict(load_safetensors(sys.argv[1]), strict=True)
model.eval()
def idx(path):
    raw = gzip.open(path).read()
    return raw
imgs = idx(sys.argv[2]); labs = idx(sys.argv[3])
n = {n}
x = torch.tensor(np.frombuffer(imgs[16:16 + n * 784], dtype=np.uint8).reshape(n, 1, 28, 28).astype(np.float32) / 255.0)
x = (x - 0.1307) / 0.3081
y = torch.tensor(np.frombuffer(labs[8:8 + n], dtype=np.uint8).astype(np.int64))
with torch.no_grad():
    out = model(x)
print(json.dumps({{"loss": F.nll_loss(out, y).item(), "accuracy": (out.argmax(1) == y).float().mean().item()}}))
"#,
        n = EVAL_N
    );
    let data = workspace_data_dir();
    let o = Command::new(&python)
        .arg("-c")
        .arg(&script)
        .arg(out.join("checkpoint-8/model.safetensors"))
        .arg(data.join("t10k-images-idx3-ubyte.gz"))
        .arg(data.join("t10k-labels-idx1-ubyte.gz"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "python failed:\n{text}");
    let v: serde_json::Value = serde_json::from_str(text.trim().lines().last().unwrap()).unwrap();
    let (loss, acc) = (v["loss"].as_f64().unwrap(), v["accuracy"].as_f64().unwrap());
    assert!((loss - eval.get("eval_loss").unwrap()).abs() < 1e-4, "PyTorch loss {loss} vs Trainer {:?}", eval.get("eval_loss"));
    // Accuracy from the Trainer is not a default metric here: compare with the Rust model's.
    let mnist = Mnist::load(&data).unwrap();
    let vs = nn::VarStore::new(Device::Cpu);
    let net = BasicNet::new(&vs.root(), BasicNetConfig::default());
    let mut vs = vs;
    vs.load(out.join("checkpoint-8/model.safetensors")).unwrap();
    let sums = ladder_core::eval::evaluate(&net, &mnist.test.slice(0..EVAL_N), 100);
    assert_eq!((acc * EVAL_N as f64).round() as i64, sums.correct, "PyTorch accuracy {acc} vs Rust {}", sums.accuracy());
}

/// The logged learning_rate of a step is the rate that step's update used: linear schedule,
/// 2 warm-up steps over 6 steps → λ(k) = 0, ½, then (6 − k)/4 for the updates k = 0..5; the
/// run ends exactly at the planned step with the schedule at its end.
#[test]
fn logged_learning_rate_is_the_rate_each_update_used() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let args = TrainingArguments {
        max_steps: 6,
        warmup_steps: 2,
        lr_scheduler_type: SchedulerType::Linear,
        logging_steps: 1,
        save_strategy: IntervalStrategy::No,
        ..base_args()
    };
    train_once(&out, &args, &[]);
    let s = state(&out);
    let lrs: Vec<(u64, f64)> = s.log_history.iter().filter_map(|e| e.get("learning_rate").map(|l| (e.step, l))).collect();
    let want = [0.0, 0.5, 1.0, 0.75, 0.5, 0.25].map(|l| l * 1e-3);
    assert_eq!(lrs.iter().map(|l| l.0).collect::<Vec<_>>(), [1, 2, 3, 4, 5, 6]);
    for ((step, got), want) in lrs.iter().zip(want) {
        assert!((got - want).abs() < 1e-18, "step {step}: {got} vs {want}");
    }
    assert_eq!(s.global_step, 6);
    assert!(std::fs::read_dir(&out).unwrap().all(|e| !e.unwrap().file_name().to_string_lossy().starts_with("checkpoint-")));
}

/// EarlyStoppingCallback(patience 1) in a real run: with greater_is_better on eval_loss the first
/// evaluation (step 4) stays the best, the second (step 8) does not improve on it, and training
/// stops there instead of at max_steps 16 — after saving, so checkpoint-8 exists.
#[test]
fn early_stopping_ends_training_at_the_first_evaluation_without_improvement() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let args = TrainingArguments {
        max_steps: 16,
        eval_strategy: IntervalStrategy::Steps,
        eval_steps: Some(4),
        save_steps: 4,
        load_best_model_at_end: true,
        greater_is_better: Some(true),
        ..base_args()
    };
    train_once(&out, &args, &[("L3_EARLY_STOPPING_PATIENCE", "1")]);
    let s = state(&out);
    assert_eq!(s.global_step, 8);
    assert_eq!(s.eval_loss_curve().iter().map(|e| e.0).collect::<Vec<_>>(), [4, 8]);
    assert_eq!(s.best_global_step, Some(4));
    assert!(out.join("checkpoint-8").exists() && out.join("checkpoint-4").exists());
}
