//! Level 1 as a user runs it: the real binary under mpirun at 2 and 3 ranks on real MNIST, exact
//! distributed evaluation at world sizes 1, 2, 3 on one fixed checkpoint, and the snapshots of
//! its --help and --explain.

#[path = "../../shared/tests/common/mod.rs"]
mod common;

use ladder_core::data::Mnist;
use ladder_core::dist::{init_process_group, Backend};
use ladder_core::eval::{evaluate, evaluate_distributed};
use ladder_core::metrics::Report;
use ladder_core::model::{BasicNet, BasicNetConfig};
use std::process::Command;
use tch::{nn, Device};

const BIN: &str = env!("CARGO_BIN_EXE_level1-raw-ddp");

fn mpirun(n: usize) -> Command {
    let mut cmd = Command::new("mpirun");
    cmd.args(["-n", &n.to_string(), "--oversubscribe", "--bind-to", "none"])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    cmd
}

fn run_ok(mut cmd: Command) -> String {
    let out = cmd.output().expect("spawn");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{:?} failed ({}):\n{text}", cmd, out.status);
    text
}

/// A short real-data run at world size `n`: parameters bit-identical on every rank afterwards
/// (--check-sync), the report carries every rank, evaluation covers exactly 10,000 images.
fn short_run(n: usize, strategy: &str) {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("m.json");
    let mut cmd = mpirun(n);
    cmd.arg(BIN)
        .args(["--device", "cpu", "--max-steps", "30", "--log-interval", "0", "--check-sync", "--strategy", strategy])
        .arg("--metrics-json")
        .arg(&json);
    if strategy != "ddp" {
        // One FlatParameter per layer (a flag only the FSDP strategies take).
        cmd.args(["--fsdp-min-num-params", "0"]);
    }
    let text = run_ok(cmd);
    assert!(text.contains(&format!("check-sync: parameters are bit-identical on all {n} ranks")), "{text}");
    let report: Report = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(report.world_size, n);
    assert_eq!(report.strategy, strategy);
    assert_eq!(report.eval_samples, 10_000);
    assert_eq!(report.steps, 30);
    assert_eq!(report.ranks.len(), n);
    assert_eq!(report.ranks.iter().map(|r| r.rank).collect::<Vec<_>>(), (0..n).collect::<Vec<_>>());
    assert!(report.ranks.iter().all(|r| r.comm_s > 0.0 && r.train_s > r.comm_s && r.peak_rss_mib > 100.0));
    // Model state per rank: DDP holds all 1,199,882 parameters (+ gradients + 2 AdamW states);
    // a sharding FSDP strategy holds 1/n of each FlatParameter (padded to a multiple of n).
    let full = 1_199_882u64 * 4;
    for r in &report.ranks {
        let ms = r.model_state;
        if strategy == "ddp" || strategy == "fsdp-no-shard" {
            assert_eq!((ms.parameters, ms.gradients, ms.optimizer), (full, full, 2 * full), "{strategy}");
        } else {
            assert!(ms.parameters * n as u64 >= full && ms.parameters * n as u64 <= full + 4 * 4 * n as u64, "{ms:?}");
            assert_eq!((ms.gradients, ms.optimizer), (ms.parameters, 2 * ms.parameters));
            assert!(ms.gathered_peak > 0);
        }
    }
    // 30 steps × 64 × n samples is enough to be well past chance.
    assert!(report.accuracy > 0.7, "accuracy {}", report.accuracy);
    assert!(text.contains("Accuracy: "), "{text}");
}

#[test]
fn two_ranks_train_in_sync_and_evaluate_all_10000_images() {
    short_run(2, "ddp");
}

#[test]
fn three_ranks_train_in_sync_and_evaluate_all_10000_images() {
    short_run(3, "ddp");
}

#[test]
fn fsdp_full_shard_at_two_ranks_trains_in_sync_with_half_the_model_state_per_rank() {
    short_run(2, "fsdp-full-shard");
}

#[test]
fn fsdp_shard_grad_op_at_three_ranks_trains_in_sync() {
    short_run(3, "fsdp-shard-grad-op");
}

#[test]
fn exact_eval_gives_identical_counts_at_world_sizes_1_2_3() {
    // One fixed checkpoint: seeded initialisation, saved once, evaluated at W = 1, 2, 3.
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt.safetensors");
    tch::manual_seed(3);
    let vs = nn::VarStore::new(Device::Cpu);
    let net = BasicNet::new(&vs.root(), BasicNetConfig::default());
    vs.save(&ckpt).unwrap();
    let test = Mnist::load(&ladder_core::data::resolve_data_dir(None)).unwrap().test;
    let single = evaluate(&net, &test, 1000);
    assert_eq!(single.count, 10_000);
    for n in [1, 2, 3] {
        let expect = format!("{} {}", single.correct, single.loss_sum);
        let ckpt = ckpt.to_str().unwrap();
        common::mpirun(n, "rank_exact_eval", &[("LADDER_TEST_CKPT", ckpt), ("LADDER_TEST_EXPECT", &expect)]);
    }
}

#[test]
#[ignore = "rank body: run under mpirun by exact_eval_gives_identical_counts_at_world_sizes_1_2_3"]
fn rank_exact_eval() {
    let pg = init_process_group(Backend::Mpi).unwrap();
    let mut vs = nn::VarStore::new(Device::Cpu);
    let net = BasicNet::new(&vs.root(), BasicNetConfig::default());
    vs.load(std::env::var("LADDER_TEST_CKPT").unwrap()).unwrap();
    let test = Mnist::load(&ladder_core::data::resolve_data_dir(None)).unwrap().test;
    let sums = evaluate_distributed(&*pg, &net, &test, 1000).unwrap();
    let expect = std::env::var("LADDER_TEST_EXPECT").unwrap();
    let mut it = expect.split(' ');
    let correct: i64 = it.next().unwrap().parse().unwrap();
    let loss_sum: f64 = it.next().unwrap().parse().unwrap();
    assert_eq!(sums.count, 10_000, "rank {} of {}", pg.rank(), pg.world_size());
    assert_eq!(sums.correct, correct, "world size {}", pg.world_size());
    assert!((sums.loss_sum - loss_sum).abs() < 1e-6 * loss_sum.abs(), "{} vs {loss_sum}", sums.loss_sum);
}

#[test]
fn help_snapshot() {
    // No terminal here: clap wraps at $COLUMNS, pinned so the snapshot does not follow the shell.
    let out = Command::new(BIN).arg("--help").env("COLUMNS", "100").output().unwrap();
    assert!(out.status.success());
    insta::assert_snapshot!(String::from_utf8_lossy(&out.stdout));
}

/// Help wraps at the terminal's width (clap's `wrap_help`; without a terminal, `$COLUMNS`), for
/// every binary a user starts.
#[test]
fn help_wraps_at_the_terminal_width() {
    let dir = std::path::Path::new(BIN).parent().unwrap();
    for bin in ["ladder-run", "ladder-baseline", "level1-raw-ddp"] {
        let path = dir.join(bin);
        assert!(path.is_file(), "{} is not built: cargo build --release --workspace --bins", path.display());
        for (flag, width) in [("-h", 60), ("--help", 60), ("--help", 80)] {
            let out = Command::new(&path).arg(flag).env("COLUMNS", width.to_string()).output().unwrap();
            let text = String::from_utf8_lossy(&out.stdout);
            // Only a word longer than the width (a path, a URL) may stick out.
            let long: Vec<&str> = text.lines().filter(|l| l.chars().count() > width && l.trim().contains(' ')).collect();
            assert!(long.is_empty(), "{bin} {flag} at {width} columns has longer lines: {long:#?}");
        }
    }
}

#[test]
fn explain_snapshot() {
    // --explain at world size 1, one step: the bucket layout is the same at every world size.
    let out = Command::new(BIN).args(["--device", "cpu", "--explain", "--max-steps", "1", "--log-interval", "0"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let table: String = text.lines().take_while(|l| !l.is_empty()).collect::<Vec<_>>().join("\n");
    insta::assert_snapshot!(table);
}

#[test]
fn bad_flags_are_clear_errors() {
    for (args, want) in [
        (vec!["--batch-size", "0"], "error: invalid value \"0\" for --batch-size: at least 1"),
        (vec!["--width", "0"], "error: invalid value \"0\" for --width: at least 1 output feature for fc1"),
        (vec!["--bucket-cap-mb=-1"], "error: invalid value \"-1\" for --bucket-cap-mb: a positive number of MiB"),
        (
            vec!["--strategy", "ddp", "--fsdp-min-num-params", "0"],
            "error: --fsdp-min-num-params does not apply to --strategy ddp: it is an option of the FSDP strategies (fsdp-full-shard, fsdp-shard-grad-op, fsdp-no-shard, fsdp-hybrid-shard, fsdp-hybrid-shard-zero2)",
        ),
        (
            vec!["--fsdp-backward-prefetch", "backward-post"],
            "error: --fsdp-backward-prefetch does not apply to --strategy ddp: it is an option of the FSDP strategies",
        ),
        (
            vec!["--fsdp-forward-prefetch"],
            "error: --fsdp-forward-prefetch does not apply to --strategy ddp: it is an option of the FSDP strategies",
        ),
        (
            vec!["--strategy", "fsdp-full-shard", "--fsdp-backward-prefetch", "backward-later"],
            "error: invalid value 'backward-later' for '--fsdp-backward-prefetch",
        ),
        (
            vec!["--strategy", "fsdp-full-shard", "--bucket-cap-mb", "5"],
            "error: --bucket-cap-mb does not apply to --strategy fsdp-full-shard: it is an option of ddp (gradient buckets are DDP's; FSDP reduces one FlatParameter per unit)",
        ),
        (
            vec!["--strategy", "fsdp-full-shard", "--zero-redundancy-optimizer"],
            "error: --zero-redundancy-optimizer does not apply to --strategy fsdp-full-shard: it is an option of ddp (ZeRO-1 shards the optimizer state of replicated parameters; FSDP already shards it)",
        ),
        (
            vec!["--zero-redundancy-optimizer", "--mixed-precision", "bf16"],
            "error: --zero-redundancy-optimizer does not apply to --mixed-precision bf16: it is an option of ddp in fp32",
        ),
        (
            vec!["--cpu-offload"],
            "error: --cpu-offload does not apply to --strategy ddp: it is an option of the FSDP strategies (fsdp-full-shard, fsdp-shard-grad-op, fsdp-no-shard, fsdp-hybrid-shard, fsdp-hybrid-shard-zero2): CPUOffload(offload_params=True)",
        ),
        (
            vec!["--strategy", "ddp", "--dp-shard-size", "2"],
            "error: --dp-shard-size does not apply to --strategy ddp: it is an option of the FSDP strategies",
        ),
        (
            vec!["--device", "cpu", "--strategy", "fsdp-hybrid-shard", "--dp-shard-size", "3", "--max-steps", "1", "--log-interval", "0", "--no-eval"],
            "error: invalid value \"3\" for --dp-shard-size: a divisor of the world size 1",
        ),
        (
            vec!["--offload-optimizer-nvme-path", "/nonexistent/ladder"],
            "error: invalid value \"/nonexistent/ladder\" for --offload-optimizer-nvme-path: an existing directory (No such file or directory",
        ),
        (
            vec!["--offload-optimizer-nvme-path", "/dev/null"],
            "error: invalid value \"/dev/null\" for --offload-optimizer-nvme-path: a directory (it is a file)",
        ),
        (
            vec!["--device", "cpu", "--batch-size", "60001"],
            "error: invalid value \"60001\" for --batch-size: at most the 60000 training images",
        ),
        (
            vec!["--device", "cpu", "--backend", "nccl"],
            "error: invalid value \"nccl\" for --backend: mpi with --device cpu (nccl moves CUDA tensors only)",
        ),
        (
            vec!["--device", "cpu", "--max-steps", "1", "--log-interval", "0", "--metrics-json", "/dev/null/m.json"],
            "error: invalid value \"/dev/null/m.json\" for --metrics-json: a writable file (/dev/null is not a directory)",
        ),
    ] {
        let out = Command::new(BIN).args(&args).output().unwrap();
        assert!(!out.status.success(), "{args:?} must fail");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.starts_with(want), "{args:?}: {err}");
    }
}

#[test]
#[ignore = "rank body: the baseline, for baseline_and_level_1_are_one_computation"]
fn baseline_body() {
    let out = std::env::var("LADDER_TEST_OUT").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("m.json");
    // The baseline is its own binary; this rank runs it as a user would, in this rank's environment.
    let baseline = std::path::Path::new(BIN).with_file_name("ladder-baseline");
    assert!(baseline.is_file(), "{} is not built: cargo build --release --workspace --bins", baseline.display());
    let status = Command::new(&baseline)
        .args(["--device", "cpu", "--max-steps", "25", "--log-interval", "0", "--save-model", &out, "--metrics-json"])
        .arg(&json)
        .status()
        .unwrap();
    assert!(status.success(), "{} failed ({status})", baseline.display());
    let report: Report = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!((report.history.len(), report.history[0].steps), (1, 25));
}

#[test]
#[ignore = "rank body: level 1, for baseline_and_level_1_are_one_computation"]
fn level1_body() {
    let out = std::env::var("LADDER_TEST_OUT").unwrap();
    let cfg = <level1_raw_ddp::Config as clap::Parser>::try_parse_from([
        "level1-raw-ddp",
        "--device",
        "cpu",
        "--max-steps",
        "25",
        "--log-interval",
        "0",
        "--save-model",
        &out,
    ])
    .unwrap();
    level1_raw_ddp::run(&cfg).unwrap();
}

/// At world size 1 the single-process baseline and level 1 are one computation: the same
/// shuffle, the same dropout masks, the same optimizer — bit-identical weights.
#[test]
fn baseline_and_level_1_are_one_computation() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("baseline.st"), dir.path().join("level1.st"));
    common::mpirun(1, "baseline_body", &[("LADDER_TEST_OUT", a.to_str().unwrap())]);
    common::mpirun(1, "level1_body", &[("LADDER_TEST_OUT", b.to_str().unwrap())]);
    let (mut wa, mut wb) = (tch::Tensor::read_safetensors(&a).unwrap(), tch::Tensor::read_safetensors(&b).unwrap());
    wa.sort_by(|x, y| x.0.cmp(&y.0));
    wb.sort_by(|x, y| x.0.cmp(&y.0));
    assert_eq!(wa.len(), 8);
    for ((ka, ta), (kb, tb)) in wa.iter().zip(&wb) {
        assert_eq!(ka, kb);
        assert!(ta.equal(tb), "{ka} differs between the baseline and level 1");
    }
}

/// Every epoch ends with the tutorial's lines and an entry in the JSON history; the top-level
/// figures are the last epoch's (here the epoch --max-steps ends; full epochs are `make demo`'s).
#[test]
fn every_epoch_is_evaluated_and_kept_in_the_history() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("m.json");
    let mut cmd = mpirun(2);
    cmd.arg(BIN)
        .args(["--device", "cpu", "--epochs", "3", "--max-steps", "12", "--batch-size", "32", "--log-interval", "0"])
        .arg("--metrics-json")
        .arg(&json);
    let text = run_ok(cmd);
    let report: Report = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    // 60,000 images / 2 ranks / 32 = 938 steps an epoch: --max-steps 12 ends epoch 1.
    assert_eq!(report.history.len(), 1, "{text}");
    let h = report.history[0];
    assert_eq!((h.epoch, h.steps, h.eval_samples), (1, 12, 10_000));
    assert_eq!((h.accuracy, h.test_loss, h.train_loss), (report.accuracy, report.test_loss, report.train_loss));
    assert!(text.contains("Epoch 1: mean train loss ") && text.contains(" over 12 steps"), "{text}");
}

/// A --metrics-json that cannot be written (a directory) is refused before training, not after
/// the epoch: the error names the flag and the cause, and no training line is printed.
#[test]
fn an_unwritable_metrics_json_is_refused_before_training() {
    let dir = tempfile::tempdir().unwrap();
    let start = std::time::Instant::now();
    let mut cmd = mpirun(2);
    cmd.arg(BIN).args(["--device", "cpu", "--max-steps", "1", "--log-interval", "0", "--metrics-json"]).arg(dir.path());
    let out = cmd.output().unwrap();
    let took = start.elapsed();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("for --metrics-json: a writable file") && text.contains("Is a directory"), "{text}");
    assert!(!text.contains("Test set: Average loss"), "refused before training:\n{text}");
    assert!(took < std::time::Duration::from_secs(25), "took {took:?} (the shutdown wait is 30 s)");
}

/// A --save-model in a directory where no file can be created (read-only) is refused before
/// training, not after the epoch (issue 27, bug 8): the error names the flag, the path and the
/// directory, and no training line is printed.
#[test]
fn an_unwritable_save_model_is_refused_before_training() {
    let (_keep, ro) = common::unwritable_dir();
    let path = ro.join("m.safetensors");
    let out =
        Command::new(BIN).args(["--device", "cpu", "--max-steps", "1", "--log-interval", "0", "--save-model"]).arg(&path).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "{text}");
    let want = format!(
        "error: invalid value \"{}\" for --save-model: a writable file (cannot create a file in {}: ",
        path.display(),
        ro.display()
    );
    assert!(text.starts_with(&want), "{text}");
    assert!(!text.contains("Train Epoch") && !text.contains("Test set"), "refused before training:\n{text}");
}

/// `--no-eval` (issue 27: quick checks cost a full evaluation): nothing is evaluated, the test
/// line says so and the report counts 0 images.
#[test]
fn no_eval_skips_the_evaluation() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("m.json");
    let mut cmd = Command::new(BIN);
    cmd.args(["--device", "cpu", "--max-steps", "1", "--log-interval", "0", "--no-eval", "--metrics-json"]).arg(&json);
    let text = run_ok(cmd);
    assert!(text.contains("Epoch 1: mean train loss ") && text.contains("\nTest set: not evaluated\n"), "{text}");
    let report: Report = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!((report.eval_samples, report.history[0].eval_samples, report.history[0].steps), (0, 0, 1));
}

/// `--offload-optimizer-nvme-path` (DeepSpeed's offload_optimizer nvme) at 2 ranks, with DDP and
/// with ZeRO-1: the same weights, bit for bit, as the run with the moments in memory; the
/// report's per-step transfers are the closed forms (DDP: every rank writes both moments of all
/// 1,199,882 fp32 parameters each step and reads them back from the second step on); no file is
/// left behind.
#[test]
fn offloaded_optimizer_trains_the_same_weights() {
    let dir = tempfile::tempdir().unwrap();
    let nvme = dir.path().join("nvme");
    std::fs::create_dir(&nvme).unwrap();
    for extra in [&[][..], &["--zero-redundancy-optimizer"][..]] {
        let run = |name: &str, offload: bool| {
            let (weights, json) = (dir.path().join(format!("{name}.safetensors")), dir.path().join(format!("{name}.json")));
            let mut cmd = mpirun(2);
            cmd.arg(BIN).args(["--device", "cpu", "--max-steps", "3", "--log-interval", "0", "--no-eval"]).args(extra);
            cmd.arg("--save-model").arg(&weights).arg("--metrics-json").arg(&json);
            if offload {
                cmd.arg("--offload-optimizer-nvme-path").arg(&nvme);
            }
            let text = run_ok(cmd);
            (weights, serde_json::from_str::<serde_json::Value>(&std::fs::read_to_string(&json).unwrap()).unwrap(), text)
        };
        let (in_memory, _, _) = run("memory", false);
        let (offloaded, report, text) = run("offloaded", true);
        common::assert_bit_identical(&format!("offloaded vs in memory {extra:?}"), &offloaded, &in_memory);
        assert!(text.contains("offload_optimizer (nvme): per step"), "{text}");
        // The report names ZeRO-1 (the summary line and the JSON), not plain DDP.
        let label = if extra.is_empty() { "ddp" } else { "zero1" };
        assert_eq!(report["strategy"], label);
        assert!(text.contains(&format!("| world size 2 | {label}")), "{text}");
        let per_step = &report["offload_optimizer"]["per_step"];
        if extra.is_empty() {
            let moments = 2 * 4 * 1_199_882u64;
            assert_eq!(per_step["bytes_written"], moments, "{per_step}");
            assert_eq!(per_step["bytes_read"], 2 * moments / 3, "{per_step}: nothing read at the first step");
        } else {
            let written = per_step["bytes_written"].as_u64().unwrap();
            assert!(written < 2 * 4 * 1_199_882 / 2 + 8 * 64 * 9, "rank 0 steps its half of the parameters: {per_step}");
        }
        assert_eq!(std::fs::read_dir(&nvme).unwrap().count(), 0, "the moments' files are removed");
    }
}

/// `--cpu-offload` (FSDP's CPUOffload(offload_params=True)) at 2 ranks, FULL_SHARD with one unit
/// per layer: the weights equal the run without, bit for bit; the metrics JSON's
/// `cpu_offload.per_step` holds the closed forms — every unit's shard copied to the device
/// before each of FULL_SHARD's two all-gathers, the gradient shard copied back once — in rank
/// 0's shard bytes (its model state's parameters); the line is printed.
#[test]
fn cpu_offload_trains_the_same_weights() {
    let dir = tempfile::tempdir().unwrap();
    let run = |name: &str, offload: bool| {
        let (weights, json) = (dir.path().join(format!("{name}.safetensors")), dir.path().join(format!("{name}.json")));
        let mut cmd = mpirun(2);
        cmd.arg(BIN).args(["--device", "cpu", "--max-steps", "3", "--log-interval", "0", "--no-eval"]);
        cmd.args(["--strategy", "fsdp-full-shard", "--fsdp-min-num-params", "0"]);
        cmd.arg("--save-model").arg(&weights).arg("--metrics-json").arg(&json);
        if offload {
            cmd.arg("--cpu-offload");
        }
        let text = run_ok(cmd);
        (weights, serde_json::from_str::<serde_json::Value>(&std::fs::read_to_string(&json).unwrap()).unwrap(), text)
    };
    let (in_memory, plain, _) = run("memory", false);
    let (offloaded, report, text) = run("offloaded", true);
    common::assert_bit_identical("--cpu-offload vs without", &offloaded, &in_memory);
    assert!(plain.get("cpu_offload").is_none(), "{plain}");
    assert!(text.contains("cpu_offload (offload_params): per step"), "{text}");
    let shard = report["ranks"][0]["model_state"]["parameters"].as_u64().unwrap();
    assert!(shard * 2 >= 1_199_882 * 4 && shard * 2 <= 1_199_882 * 4 + 4 * 4 * 2, "half the model: {shard}");
    let entry = &report["cpu_offload"];
    assert_eq!(entry["per_step"]["h2d_bytes"], 2 * shard, "{entry}");
    assert_eq!(entry["per_step"]["d2h_bytes"], shard, "{entry}");
    assert_eq!(entry["total"]["steps"], 3, "{entry}");
    assert_eq!(entry["host_bytes"], 4 * shard, "shards, gradients and both moments: {entry}");
}
