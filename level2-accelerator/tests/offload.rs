//! Accelerate's DeepSpeed optimizer offload (`offload_optimizer_device: nvme` with
//! `offload_optimizer_nvme_path`) at level 2: the same weights, bit for bit, as the run with the
//! moments in memory, at 2 processes with DDP and ZeRO-3; the per-step transfers in the metrics
//! JSON; bad settings refused before training, named with where they were given.

#[path = "../../shared/tests/common/mod.rs"]
mod common;

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_level2-accelerator");

/// `level2-accelerator` on 2 processes under mpirun, no Accelerate setting inherited: 3 steps,
/// no evaluation.
fn two_processes() -> Command {
    common::level2_on_two_processes(BIN)
}

/// At 2 processes, with DDP (the offload asked for by the launcher's variables) and with
/// DeepSpeed ZeRO-3 (by the flags): the weights equal the in-memory run's bit for bit; the
/// report's `offload_optimizer.per_step` holds the closed forms for DDP (every process writes
/// both fp32 moments of BasicNet's 1,199,882 parameters each step and reads them back from the
/// second step on; ZeRO-3: its half of the FlatParameter, padded to 2 × 64-element alignment at
/// most) and the model state counts the moments on disk; no moment file is left behind.
#[test]
fn offloaded_optimizer_trains_the_same_weights_at_two_processes() {
    let dir = tempfile::tempdir().unwrap();
    let nvme = dir.path().join("nvme");
    std::fs::create_dir(&nvme).unwrap();
    let moments = 2 * 4 * 1_199_882u64;
    for (strategy, by_env) in [(&[][..], true), (&["--zero-stage", "3"][..], false)] {
        let run = |name: &str, offload: bool| {
            let (weights, json) = (dir.path().join(format!("{name}.safetensors")), dir.path().join(format!("{name}.json")));
            let mut cmd = two_processes();
            cmd.args(strategy).arg("--save-model").arg(&weights).arg("--metrics-json").arg(&json);
            match (offload, by_env) {
                (false, _) => {}
                (true, true) => {
                    cmd.env("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "nvme")
                        .env("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH", &nvme);
                }
                (true, false) => {
                    cmd.args(["--offload-optimizer-device", "nvme", "--offload-optimizer-nvme-path"]).arg(&nvme);
                }
            }
            let (ok, text) = common::output_of(&mut cmd);
            assert!(ok, "{strategy:?} offload {offload}:\n{text}");
            (weights, serde_json::from_str::<serde_json::Value>(&std::fs::read_to_string(&json).unwrap()).unwrap(), text)
        };
        let (in_memory, memory_report, _) = run("memory", false);
        let (offloaded, report, text) = run("offloaded", true);
        common::assert_bit_identical(&format!("offloaded vs in memory {strategy:?}"), &offloaded, &in_memory);
        assert!(text.contains("offload_optimizer (nvme): per step"), "{text}");
        assert!(memory_report.get("offload_optimizer").is_none(), "{memory_report}");
        assert_eq!(report["offload_optimizer"]["nvme_path"], nvme.display().to_string());
        let per_step = &report["offload_optimizer"]["per_step"];
        let written = per_step["bytes_written"].as_u64().unwrap();
        if strategy.is_empty() {
            assert_eq!(written, moments, "{per_step}");
            assert_eq!(per_step["bytes_read"], 2 * moments / 3, "{per_step}: nothing read at the first step");
        } else {
            assert!((moments / 2..=moments / 2 + 8 * 64).contains(&written), "process 0 steps its half: {per_step}");
        }
        assert_eq!(per_step["bytes_read"].as_u64().unwrap(), 2 * written / 3, "{per_step}: nothing read at the first step");
        let (placed, in_memory_state) = (&report["ranks"][0]["model_state"], &memory_report["ranks"][0]["model_state"]);
        assert_eq!(placed["optimizer_on_disk"], in_memory_state["optimizer"], "the moments are on disk: {placed}");
        assert_eq!(placed["optimizer"], 8 << 20, "the resident buffer, 2 fp32 moments × 2^20 elements: {placed}");
        assert_eq!(std::fs::read_dir(&nvme).unwrap().count(), 0, "the moments' files are removed");
    }
}

/// A run's flags and variables.
type Case<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)]);

/// One process, no data read: the offload's bad settings each end the run before training
/// with one line naming the setting, its value and where it was given.
#[test]
fn bad_offload_settings_are_refused_before_training() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("offload.yaml");
    std::fs::write(&file, "offload_optimizer_device: nvme\noffload_optimizer_nvme_path: /nonexistent/ladder\n").unwrap();
    let config = file.display().to_string();
    let cases: [Case; 5] = [
        (&["--offload-optimizer-device", "nvme"], &[]),
        (&["--offload-optimizer-device", "nvme", "--offload-optimizer-nvme-path", "/dev/null"], &[]),
        (&[], &[("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "nvme")]),
        (&[], &[("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "cpu")]),
        (&[], &[("ACCELERATE_CONFIG_FILE", config.as_str())]),
    ];
    let mut all = String::new();
    for (args, envs) in cases {
        let mut cmd = Command::new(BIN);
        common::without_accelerate_settings(&mut cmd);
        cmd.args(["--device", "cpu", "--max-steps", "1", "--log-interval", "0"]).args(args).envs(envs.iter().copied());
        let (ok, text) = common::output_of(&mut cmd);
        assert!(!ok && !text.contains("Train Epoch"), "{args:?} {envs:?}: refused before training:\n{text}");
        all += &format!("$ {envs:?} {args:?}\n{}\n", text.trim()).replace(&config, "[CONFIG]");
    }
    insta::assert_snapshot!(all);
}

/// The flag takes the vocabulary's values: `cpu` is refused by the flag parser, which lists them.
#[test]
fn the_flag_lists_none_and_nvme() {
    let (ok, text) = common::output_of(Command::new(BIN).args(["--offload-optimizer-device", "cpu"]));
    assert!(!ok && text.contains("invalid value 'cpu' for '--offload-optimizer-device <DEVICE>'"), "{text}");
    assert!(text.contains("[possible values: none, nvme]"), "{text}");
}
