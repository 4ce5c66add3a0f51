//! Level 3's `report_to="tensorboard"` (issue 27), as Transformers' `TensorBoardCallback`: the
//! event files in logging_dir hold, under `train/`, `eval/` tags, exactly the run's log
//! history (trainer_state.json); logging_dir defaults to output_dir/runs/<date>_<host>; the
//! launcher's `log_with tensorboard` is honoured; an unwritable logging_dir is refused before
//! training.

#[path = "../../shared/tests/common/mod.rs"]
mod common;
#[path = "../../shared/tests/common/tensorboard.rs"]
mod tensorboard;

use level3_trainer::output::tensorboard_scalars;
use level3_trainer::state::TrainerState;
use std::collections::BTreeMap;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_level3-trainer");

/// The binary with `args` and `envs`, the launcher's and config file's variables removed;
/// (success, output).
fn run(args: &[&str], envs: &[(&str, &str)]) -> (bool, String) {
    let mut cmd = Command::new(BIN);
    cmd.args(args).env("OMP_NUM_THREADS", "1");
    for (k, _) in std::env::vars() {
        if k.starts_with("ACCELERATE_") || k.starts_with("FSDP_") {
            cmd.env_remove(k);
        }
    }
    let out = cmd.envs(envs.iter().copied()).output().unwrap();
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

/// 4 steps, a log every 2, an evaluation at step 4: TensorBoard's reader finds in logging_dir
/// exactly the log history of trainer_state.json, each figure under Transformers' tag
/// (`train/loss`, `train/learning_rate`, `train/epoch`, `eval/loss`, `eval/accuracy`,
/// `train/train_samples_per_second`, …) at its global step, as f32.
#[test]
fn report_to_tensorboard_writes_the_log_history() {
    let dir = tempfile::tempdir().unwrap();
    let (out, tb) = (dir.path().join("out"), dir.path().join("tb"));
    let (o, t) = (out.display().to_string(), tb.display().to_string());
    let (ok, text) = run(
        &[
            "--device",
            "cpu",
            "--max-steps",
            "4",
            "--logging-steps",
            "2",
            "--eval-strategy",
            "steps",
            "--eval-steps",
            "4",
            "--save-strategy",
            "no",
            "--disable-tqdm",
            "--report-to",
            "tensorboard",
            "--logging-dir",
            &t,
            "--output-dir",
            &o,
        ],
        &[],
    );
    assert!(ok, "{text}");
    let state = TrainerState::load(&out.join("trainer_state.json")).unwrap();
    let mut expected: BTreeMap<String, Vec<(u64, f32)>> = BTreeMap::new();
    for entry in &state.log_history {
        for (tag, value) in tensorboard_scalars(entry) {
            expected.entry(tag).or_default().push((entry.step, value as f32));
        }
    }
    let scalars = tensorboard::read_scalars(&tb);
    assert_eq!(scalars, expected);
    for tag in ["train/loss", "train/learning_rate", "train/epoch", "eval/loss", "eval/accuracy", "train/train_samples_per_second"] {
        assert!(scalars.contains_key(tag), "{tag} missing: {:?}", scalars.keys());
    }
    assert_eq!(scalars["train/loss"].iter().map(|(s, _)| *s).collect::<Vec<_>>(), [2, 4]);
    assert_eq!(scalars["eval/loss"].iter().map(|(s, _)| *s).collect::<Vec<_>>(), [4]);
    let written: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("training_args.json")).unwrap()).unwrap();
    assert_eq!((written["report_to"].as_str(), written["logging_dir"].as_str()), (Some("tensorboard"), Some(t.as_str())));
}

/// Under the launcher's `log_with tensorboard` (ACCELERATE_LOG_WITH) the Trainer reports to
/// TensorBoard (report_to left at its default), in Transformers' default logging_dir:
/// output_dir/runs/<Mon DD_HH-MM-SS>_<host>. A report_to given otherwise is refused by name.
#[test]
fn the_launchers_log_with_is_report_to_tensorboard_in_the_default_logging_dir() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let o = out.display().to_string();
    let flags = ["--device", "cpu", "--max-steps", "1", "--eval-strategy", "no", "--save-strategy", "no", "--output-dir", &o];
    let (ok, text) = run(&flags, &[("ACCELERATE_LOG_WITH", "tensorboard")]);
    assert!(ok, "{text}");
    let runs: Vec<_> = std::fs::read_dir(out.join("runs")).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(runs.len(), 1, "{runs:?}");
    let name = runs[0].file_name().unwrap().to_str().unwrap().to_string();
    let host = ladder_core::tensorboard::hostname();
    // Dec02_13-25-02_<host>
    let stamp = name.strip_suffix(&format!("_{host}")).unwrap_or_else(|| panic!("{name}"));
    assert_eq!(stamp.len(), 14, "{name}");
    assert_eq!((&stamp[5..6], &stamp[8..9], &stamp[11..12]), ("_", "-", "-"), "{name}");
    let scalars = tensorboard::read_scalars(&runs[0]);
    assert!(scalars.contains_key("train/train_samples_per_second"), "{scalars:?}");
    let (ok, text) = run(&[&flags[..], &["--report-to", "jsonl"]].concat(), &[("ACCELERATE_LOG_WITH", "tensorboard")]);
    assert!(!ok);
    insta::assert_snapshot!(text.trim(), @"error: TrainingArguments.report_to = jsonl (--report-to) contradicts the launcher's tensorboard (from ACCELERATE_LOG_WITH); give the setting in one place (drop it from the launcher's flags or config, or from the arguments)");
}

/// An unwritable logging_dir is refused before the first step, naming the flag.
#[test]
fn an_unwritable_logging_dir_is_refused_before_training() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out").display().to_string();
    let (_keep, ro) = common::unwritable_dir();
    let tb = ro.join("tb").display().to_string();
    let (ok, text) =
        run(&["--device", "cpu", "--max-steps", "1", "--report-to", "tensorboard", "--logging-dir", &tb, "--output-dir", &out], &[]);
    assert!(!ok, "{text}");
    let want = format!("error: invalid value \"{tb}\" for --logging-dir: a writable directory (cannot create a file in {}: ", ro.display());
    assert!(text.contains(&want), "{text}");
    assert!(!text.contains("Running training"), "refused before training:\n{text}");
}
