//! Level 2's TensorBoard tracker (issue 27: Accelerate's `log_with="tensorboard"` with
//! `project_dir`): the event files land where Accelerate's `TensorBoardTracker` puts them and
//! TensorBoard's own reader finds in them exactly the run's figures; a tracker without a
//! writable project_dir is refused before training.

#[path = "../../shared/tests/common/mod.rs"]
mod common;
#[path = "../../shared/tests/common/tensorboard.rs"]
mod tensorboard;

use ladder_core::metrics::Report;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_level2-accelerator");

/// The binary with `args`, the launcher's and config file's variables removed; (success, output).
fn run(args: &[&str]) -> (bool, String) {
    let mut cmd = Command::new(BIN);
    cmd.args(args).env("OMP_NUM_THREADS", "1");
    for (k, _) in std::env::vars() {
        if k.starts_with("ACCELERATE_") || k.starts_with("FSDP_") {
            cmd.env_remove(k);
        }
    }
    let out = cmd.output().unwrap();
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

/// `--log-with tensorboard --project-dir P`: one event file in `P/level2-accelerator/` (and the
/// run's flags in `P/level2-accelerator/<time>/hparams.yml`) holding `train_loss` and `lr` at
/// every logged step, `eval_loss` and `accuracy` after the evaluation and
/// `train_samples_per_second` at the end — exactly the figures the run printed and wrote to
/// its metrics JSON (as f32, TensorBoard's scalar type).
#[test]
fn log_with_tensorboard_writes_the_runs_figures() {
    let dir = tempfile::tempdir().unwrap();
    let project = dir.path().join("tb");
    let json = dir.path().join("m.json");
    let (p, j) = (project.display().to_string(), json.display().to_string());
    let args = ["--device", "cpu", "--max-steps", "3", "--log-interval", "1", "--log-with", "tensorboard", "--project-dir", &p];
    let (ok, text) = run(&[&args[..], &["--metrics-json", &j]].concat());
    assert!(ok, "{text}");
    let report: Report = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();

    let run_dir = project.join("level2-accelerator");
    let mut files: Vec<String> = std::fs::read_dir(&run_dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    files.sort();
    assert_eq!(files.len(), 2, "{files:?}");
    assert!(files.iter().any(|f| f.starts_with("events.out.tfevents.")), "{files:?}");
    let hparams_dir = files.iter().find(|f| !f.starts_with("events.")).unwrap();
    let hparams = std::fs::read_to_string(run_dir.join(hparams_dir).join("hparams.yml")).unwrap();
    assert!(hparams.contains("max_steps: 3") && hparams.contains("log_with: tensorboard"), "{hparams}");

    let scalars = tensorboard::read_scalars(&run_dir);
    let tags: Vec<&str> = scalars.keys().map(String::as_str).collect();
    assert_eq!(tags, ["accuracy", "eval_loss", "lr", "train_loss", "train_samples_per_second"]);
    // The losses the run printed (`Loss: 2.301234`, six decimals), at optimizer steps 1, 2, 3.
    let printed: Vec<f64> = text.lines().filter_map(|l| l.split("Loss: ").nth(1)).map(|v| v.trim().parse().unwrap()).collect();
    assert_eq!(printed.len(), 3, "{text}");
    let logged = &scalars["train_loss"];
    assert_eq!(logged.iter().map(|(s, _)| *s).collect::<Vec<_>>(), [1, 2, 3]);
    for ((_, v), p) in logged.iter().zip(&printed) {
        assert!((f64::from(*v) - p).abs() <= 5e-7 + 1e-6 * p.abs(), "logged {v} vs printed {p}");
    }
    // Their mean is the epoch's train loss in the metrics JSON (one process: no averaging).
    let mean = logged.iter().map(|(_, v)| f64::from(*v)).sum::<f64>() / 3.0;
    assert!((mean - report.history[0].train_loss).abs() < 1e-6, "{mean} vs {}", report.history[0].train_loss);
    assert_eq!(scalars["lr"], [(1, 1e-3f32), (2, 1e-3), (3, 1e-3)]);
    assert_eq!(scalars["eval_loss"], [(3, report.test_loss as f32)]);
    assert_eq!(scalars["accuracy"], [(3, report.accuracy as f32)]);
    assert_eq!(report.eval_samples, 10_000);
    assert_eq!(scalars["train_samples_per_second"], [(3, report.samples_per_s as f32)]);
}

/// A tracker needs a project_dir that can be written: without one, or with one where no file
/// can be created, the run is refused before any training line, naming the flag.
#[test]
fn log_with_needs_a_writable_project_dir() {
    let (ok, text) = run(&["--device", "cpu", "--max-steps", "1", "--log-with", "tensorboard"]);
    assert!(!ok && !text.contains("Train Epoch"), "{text}");
    insta::assert_snapshot!(text.trim(), @"error: log_with tensorboard (flag --log-with) conflicts with an unset project_dir: the TensorBoard tracker writes its event files in project_dir/<project name>; give project_dir (--project-dir, ACCELERATE_PROJECT_DIR or the config file's project_dir)");
    let (_keep, ro) = common::unwritable_dir();
    let p = ro.join("tb").display().to_string();
    let (ok, text) = run(&["--device", "cpu", "--max-steps", "1", "--log-with", "tensorboard", "--project-dir", &p]);
    assert!(!ok && !text.contains("Train Epoch"), "{text}");
    let want = format!(
        "error: invalid value \"{p}\" for project_dir (flag --project-dir): expected a writable directory (cannot create a file in {}: ",
        ro.display()
    );
    assert!(text.starts_with(&want), "{text}");
    let (ok, text) = run(&["--log-with", "wandb"]);
    assert!(!ok);
    insta::assert_snapshot!(text.trim(), @r"
    error: invalid value 'wandb' for '--log-with <TRACKER>'
      [possible values: tensorboard]

      tip: 'wandb' is refused: Accelerate's other trackers are not implemented here

    For more information, try '--help'.
    ");
}

/// Accelerate's other trackers, given in a config file or a variable, are refused by name.
#[test]
fn other_trackers_are_refused_by_name() {
    use level2_accelerator::{AcceleratorConfig, ResolvedConfig};
    let env = |k: &str| (k == "ACCELERATE_LOG_WITH").then(|| "wandb".to_string());
    let err = ResolvedConfig::resolve(&AcceleratorConfig::default(), env).unwrap_err().to_string();
    insta::assert_snapshot!(err, @r#"invalid value "wandb" for log_with (environment variable ACCELERATE_LOG_WITH): expected tensorboard (Accelerate's other trackers are not implemented here)"#);
}
