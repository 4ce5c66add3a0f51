//! FSDP's CPU offload through the Trainer's `fsdp` argument, Transformers' spelling
//! `fsdp="full_shard offload"` (on the command line `--fsdp "full_shard offload"`, in an
//! arguments file also the list form): at 2 ranks the same weights, bit for bit, as
//! `--fsdp full_shard`, the per-step copies in the metrics JSON; `offload` alone refused.

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

/// `level3-trainer` for 3 steps without evaluation or checkpoints, its output_dir and files in
/// `dir` under `name`, with `args`.
fn trainer(dir: &Path, name: &str, args: &[&str]) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.args(["--device", "cpu", "--max-steps", "3", "--log-interval", "0", "--eval-strategy", "no", "--save-strategy", "no"]);
    cmd.args(["--fsdp-min-num-params", "0"]).args(args);
    cmd.arg("--output-dir").arg(dir.join(name));
    cmd.arg("--save-model").arg(dir.join(format!("{name}.safetensors")));
    cmd.arg("--metrics-json").arg(dir.join(format!("{name}.json")));
    cmd
}

#[test]
fn full_shard_offload_trains_the_same_weights_at_two_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let args_file = dir.path().join("args.json");
    std::fs::write(&args_file, r#"{"fsdp": ["full_shard", "offload"]}"#).unwrap();
    let file = args_file.display().to_string();
    let mut reports = Vec::new();
    for (name, args) in [
        ("memory", vec!["--fsdp", "full_shard"]),
        ("offloaded", vec!["--fsdp", "full_shard offload"]),
        ("file", vec!["--args-file", &file]),
    ] {
        let mut cmd = Command::new("mpirun");
        cmd.args(["-n", "2", "--oversubscribe", "--bind-to", "none", "-x", "OMP_NUM_THREADS=1"]);
        let inner = trainer(dir.path(), name, &args);
        cmd.arg(inner.get_program()).args(inner.get_args());
        let (ok, text) = run_bin(&mut cmd);
        assert!(ok, "{name}:\n{text}");
        let json = std::fs::read_to_string(dir.path().join(format!("{name}.json"))).unwrap();
        reports.push((serde_json::from_str::<serde_json::Value>(&json).unwrap(), text));
    }
    assert!(reports[0].0.get("cpu_offload").is_none(), "{}", reports[0].0);
    for (name, (report, text)) in ["offloaded", "file"].iter().zip(&reports[1..]) {
        common::assert_bit_identical(
            &format!("{name} vs in memory"),
            &dir.path().join(format!("{name}.safetensors")),
            &dir.path().join("memory.safetensors"),
        );
        common::assert_full_shard_offload_copies(report, text);
        let written: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.path().join(name).join("training_args.json")).unwrap()).unwrap();
        assert_eq!(written["fsdp"], "FULL_SHARD offload", "training_args.json says what ran");
    }
}

#[test]
fn offload_without_a_sharding_strategy_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (ok, text) = run_bin(&mut trainer(dir.path(), "refused", &["--fsdp", "offload"]));
    assert!(!ok && !text.contains("Train"), "{text}");
    assert!(text.contains("offload and auto_wrap can't work on their own; add one, e.g. \"full_shard offload\""), "{text}");
}
