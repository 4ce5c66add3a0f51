//! The single-process baseline on real MNIST: a 100-step smoke run learns, the binary's --help
//! and its flag errors are what a user sees.

use ladder_core::metrics::Report;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_ladder-baseline");

#[test]
fn hundred_real_steps_learn_mnist() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("m.json");
    let out = Command::new(BIN)
        .args(["--max-steps", "100", "--log-interval", "0", "--device", "cpu", "--metrics-json"])
        .arg(&json)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    let report: Report = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(report.steps, 100);
    assert_eq!(report.eval_samples, 10_000);
    assert!(report.test_loss < 0.5, "test loss {}", report.test_loss);
    assert!(report.accuracy > 0.90, "accuracy {}", report.accuracy);
    assert!(report.train_loss < 1.0 && report.train_loss > report.test_loss, "train loss {}", report.train_loss);
    // The JSON the bench reads holds the figures the run printed.
    let printed: Vec<&str> = stdout.lines().collect();
    let epoch = report.history[0];
    assert_eq!(printed, [epoch.train_line(), epoch.test_line(), report.figures_line()], "{stdout}");
}

#[test]
fn help_snapshot() {
    let out = Command::new(BIN).arg("--help").output().unwrap();
    assert!(out.status.success());
    insta::assert_snapshot!(String::from_utf8_lossy(&out.stdout));
}

#[test]
fn flag_errors_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let mut seen = String::new();
    for args in [
        vec!["--epochs", "0"],
        vec!["--batch-size", "0"],
        vec!["--lr", "0"],
        vec!["--max-steps", "0"],
        vec!["--device", "tpu"],
        vec!["--data-dir", "/nonexistent/mnist", "--device", "cpu"],
    ] {
        let out = Command::new(BIN).args(&args).env("MNIST_DIR", dir.path()).output().unwrap();
        assert!(!out.status.success(), "{args:?} must fail");
        let err = String::from_utf8_lossy(&out.stderr);
        seen.push_str(&format!("$ ladder-baseline {}\n{}\n", args.join(" "), err.trim_end()));
    }
    // The bundled copy's path depends on where the workspace is checked out.
    let bundled = ladder_core::data::mnist::workspace_data_dir().display().to_string();
    insta::assert_snapshot!(seen.replace(&bundled, "[BUNDLED]"));
}
