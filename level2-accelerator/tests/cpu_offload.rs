//! FSDP's CPU offload at level 2, Accelerate's `fsdp_offload_params` (config key, variable
//! `FSDP_OFFLOAD_PARAMS`, flag `--fsdp-offload-params`): at 2 processes the same weights, bit
//! for bit, as the run without, the per-step copies in the metrics JSON as closed forms; with
//! DDP refused before training, named with where it was given.

#[path = "../../shared/tests/common/mod.rs"]
mod common;

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_level2-accelerator");

/// `level2-accelerator` on 2 processes under mpirun, no Accelerate setting inherited: FSDP
/// FULL_SHARD with one unit per layer, 3 steps, no evaluation.
fn two_processes() -> Command {
    let mut cmd = common::level2_on_two_processes(BIN);
    cmd.args(["--strategy", "fsdp-full-shard", "--fsdp-min-num-params", "0"]);
    cmd
}

/// Without offload, then with it asked for by the launcher's variable and by a config file's
/// key: the weights equal bit for bit; `cpu_offload.per_step` is FULL_SHARD's closed form in
/// process 0's shard bytes (two copies to the device per step, one back).
#[test]
fn offloaded_parameters_train_the_same_weights_at_two_processes() {
    let dir = tempfile::tempdir().unwrap();
    let yaml = dir.path().join("offload.yaml");
    std::fs::write(&yaml, "fsdp_offload_params: true\n").unwrap();
    let run = |name: &str, env: Option<(&str, &str)>| {
        let (weights, json) = (dir.path().join(format!("{name}.safetensors")), dir.path().join(format!("{name}.json")));
        let mut cmd = two_processes();
        cmd.arg("--save-model").arg(&weights).arg("--metrics-json").arg(&json);
        if let Some((k, v)) = env {
            cmd.env(k, v);
        }
        let (ok, text) = common::output_of(&mut cmd);
        assert!(ok, "{name}:\n{text}");
        (weights, serde_json::from_str::<serde_json::Value>(&std::fs::read_to_string(&json).unwrap()).unwrap(), text)
    };
    let (in_memory, plain, _) = run("memory", None);
    assert!(plain.get("cpu_offload").is_none(), "{plain}");
    let config = yaml.display().to_string();
    for (name, env) in [("variable", ("FSDP_OFFLOAD_PARAMS", "true")), ("config", ("ACCELERATE_CONFIG_FILE", config.as_str()))] {
        let (offloaded, report, text) = run(name, Some(env));
        common::assert_bit_identical(&format!("offloaded ({name}) vs in memory"), &offloaded, &in_memory);
        common::assert_full_shard_offload_copies(&report, &text);
        let entry = &report["cpu_offload"];
        assert_eq!(entry["total"]["steps"], 3, "{entry}");
    }
}

/// A run's flags and variables.
type Case<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)]);

/// One process, no data read: offload with DDP ends the run before training, one line naming
/// the setting, where it was given and the strategy.
#[test]
fn offload_with_ddp_is_refused_before_training() {
    let cases: [Case; 3] = [
        (&["--fsdp-offload-params"], &[]),
        (&[], &[("FSDP_OFFLOAD_PARAMS", "true")]),
        (&["--zero-stage", "1"], &[("FSDP_OFFLOAD_PARAMS", "1")]),
    ];
    let mut all = String::new();
    for (args, envs) in cases {
        let mut cmd = Command::new(BIN);
        common::without_accelerate_settings(&mut cmd);
        cmd.args(["--device", "cpu", "--max-steps", "1", "--log-interval", "0"]).args(args).envs(envs.iter().copied());
        let (ok, text) = common::output_of(&mut cmd);
        assert!(!ok && !text.contains("Train Epoch"), "{args:?} {envs:?}: refused before training:\n{text}");
        all += &format!("$ {envs:?} {args:?}\n{}\n", text.trim());
    }
    insta::assert_snapshot!(all);
}
