//! DeepSpeed's optimizer offload through the Trainer's `deepspeed` argument
//! (`zero_optimization.offload_optimizer: {"device": "nvme", "nvme_path": DIR}`): at 2 ranks
//! the same weights, bit for bit, as the run with the moments in memory, the per-step transfers
//! in the metrics JSON; bad offload settings refused before training, by name.

#[path = "../../shared/tests/common/mod.rs"]
mod common;

use std::path::Path;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_level3-trainer");

/// Runs `cmd` with no Accelerate setting inherited; its success and its output.
fn run_bin(cmd: &mut Command) -> (bool, String) {
    common::output_of(
        common::without_accelerate_settings(cmd).env("OMPI_ALLOW_RUN_AS_ROOT", "1").env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"),
    )
}

/// `level3-trainer` for 3 steps without evaluation, with `deepspeed` as given, its output_dir
/// and files in `dir` under `name`.
fn trainer(dir: &Path, name: &str, deepspeed: &str) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.args(["--device", "cpu", "--max-steps", "3", "--log-interval", "0", "--eval-strategy", "no", "--deepspeed", deepspeed]);
    cmd.arg("--output-dir").arg(dir.join(name));
    cmd.arg("--save-model").arg(dir.join(format!("{name}.safetensors")));
    cmd.arg("--metrics-json").arg(dir.join(format!("{name}.json")));
    cmd
}

/// At 2 ranks with ZeRO-1 (stage 1: each rank steps its half of the parameters): the weights
/// equal the in-memory run's bit for bit; rank 0 writes both fp32 moments of its half each step
/// (at most 2 × 64-element alignment over half of BasicNet's 1,199,882 parameters) and reads
/// them back from the second step on; the moments are counted on disk; no file is left.
#[test]
fn offloaded_optimizer_trains_the_same_weights_at_two_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let nvme = dir.path().join("nvme");
    std::fs::create_dir(&nvme).unwrap();
    let offloaded =
        format!(r#"{{"zero_optimization": {{"stage": 1, "offload_optimizer": {{"device": "nvme", "nvme_path": "{}"}}}}}}"#, nvme.display());
    let mut reports = Vec::new();
    for (name, deepspeed) in [("memory", r#"{"zero_optimization": {"stage": 1}}"#), ("offloaded", offloaded.as_str())] {
        let mut cmd = Command::new("mpirun");
        cmd.args(["-n", "2", "--oversubscribe", "--bind-to", "none", "-x", "OMP_NUM_THREADS=1"]);
        let inner = trainer(dir.path(), name, deepspeed);
        cmd.arg(inner.get_program()).args(inner.get_args());
        let (ok, text) = run_bin(&mut cmd);
        assert!(ok, "{name}:\n{text}");
        let json = std::fs::read_to_string(dir.path().join(format!("{name}.json"))).unwrap();
        reports.push((serde_json::from_str::<serde_json::Value>(&json).unwrap(), text));
    }
    let (memory, offloaded_run) = (&reports[0].0, &reports[1]);
    let (report, text) = offloaded_run;
    common::assert_bit_identical(
        "offloaded vs in memory",
        &dir.path().join("offloaded.safetensors"),
        &dir.path().join("memory.safetensors"),
    );
    assert!(text.contains("offload_optimizer (nvme): per step"), "{text}");
    assert!(memory.get("offload_optimizer").is_none(), "{memory}");
    let per_step = &report["offload_optimizer"]["per_step"];
    let written = per_step["bytes_written"].as_u64().unwrap();
    let half = 2 * 4 * 1_199_882u64 / 2;
    assert!((half - 8 * 64..=half + 8 * 64).contains(&written), "rank 0 steps its half: {per_step}");
    assert_eq!(per_step["bytes_read"].as_u64().unwrap(), 2 * written / 3, "{per_step}: nothing read at the first step");
    let (placed, in_memory) = (&report["ranks"][0]["model_state"], &memory["ranks"][0]["model_state"]);
    assert_eq!(placed["optimizer_on_disk"], in_memory["optimizer"], "the moments are on disk: {placed}");
    assert_eq!(std::fs::read_dir(&nvme).unwrap().count(), 0, "the moments' files are removed");
}

/// Bad `offload_optimizer` settings end the run before training, each with one line naming
/// the DeepSpeed key and what it accepts.
#[test]
fn bad_offload_settings_are_refused_before_training() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        r#"{"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}"#,
        r#"{"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/dev/null"}}}"#,
        r#"{"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/nonexistent/ladder"}}}"#,
        r#"{"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}"#,
        r#"{"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp", "pin_memory": true}}}"#,
    ];
    let mut all = String::new();
    for (i, deepspeed) in cases.into_iter().enumerate() {
        let (ok, text) = run_bin(&mut trainer(dir.path(), &format!("run{i}"), deepspeed));
        assert!(!ok && !text.contains("'loss':") && !text.contains("Running training"), "{deepspeed}: refused before training:\n{text}");
        all += &format!("$ --deepspeed '{deepspeed}'\n{}\n", text.trim());
    }
    insta::assert_snapshot!(all);
}
