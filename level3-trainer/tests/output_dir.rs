//! The output-directory policy of the `level3-trainer` binary, as a user meets it (issue #27,
//! bugs 1, 3 and 9): a re-run never deletes or replaces a previous run unless asked
//! (`overwrite_output_dir` from a flag or the args file, or a resume); `output_dir` is read from
//! the args file; nothing is written before the run is known to start; overwriting replaces the
//! previous run's files (no stale `log_history.jsonl` beside a new `trainer_state.json`) and
//! leaves other files alone.

use std::path::Path;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_level3-trainer");

/// Runs the binary in `cwd` with `flags`: (success, stdout + stderr).
fn run_in(cwd: &Path, flags: &[&str]) -> (bool, String) {
    let out = Command::new(BIN).current_dir(cwd).args(["--device", "cpu"]).args(flags).output().expect("spawn");
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

fn write(path: &Path, text: &str) -> String {
    std::fs::write(path, text).unwrap();
    path.to_str().unwrap().to_string()
}

/// A first run of 2 steps without evaluation into `out`: checkpoint-2, model.safetensors and
/// log_history.jsonl.
fn first_run(cwd: &Path, out: &Path) {
    let a = write(&cwd.join("first.json"), r#"{"max_steps": 2, "eval_strategy": "no", "report_to": "jsonl"}"#);
    let (ok, text) = run_in(cwd, &["--args-file", &a, "--output-dir", out.to_str().unwrap()]);
    assert!(ok, "{text}");
    for f in ["checkpoint-2", "model.safetensors", "log_history.jsonl", "training_args.json"] {
        assert!(out.join(f).exists(), "{f} missing after the first run");
    }
}

#[test]
fn a_rerun_without_overwrite_output_dir_changes_nothing_and_says_how_to_go_on() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    first_run(dir.path(), &out);
    let model = std::fs::read(out.join("model.safetensors")).unwrap();
    let args_json = std::fs::read(out.join("training_args.json")).unwrap();
    // The issue's command: the file says overwrite_output_dir false.
    let a = write(
        &dir.path().join("a.json"),
        r#"{"overwrite_output_dir": false, "max_steps": 1, "eval_strategy": "no", "save_strategy": "no"}"#,
    );
    let (ok, text) = run_in(dir.path(), &["--args-file", &a, "--output-dir", out.to_str().unwrap()]);
    assert!(!ok, "a re-run into a previous run's output_dir succeeded:\n{text}");
    insta::assert_snapshot!(text.trim().replace(out.to_str().unwrap(), "<out>"), @r#"error: output_dir <out> already holds a previous run (checkpoint-2, training_args.json, trainer_state.json, model.safetensors, loss.svg, log_history.jsonl); nothing was changed. To replace that run's files, set overwrite_output_dir (--overwrite-output-dir, or "overwrite_output_dir": true in the args file); to continue it, resume_from_checkpoint (--resume-from-checkpoint); or choose another output_dir"#);
    assert!(out.join("checkpoint-2").join("model.safetensors").exists(), "the previous checkpoint was deleted");
    assert_eq!(std::fs::read(out.join("model.safetensors")).unwrap(), model, "the previous model was replaced");
    assert_eq!(std::fs::read(out.join("training_args.json")).unwrap(), args_json, "training_args.json was rewritten");
    // Without a file either (the binary used to set overwrite_output_dir = !resume).
    let (ok, text) = run_in(dir.path(), &["--max-steps", "1", "--output-dir", out.to_str().unwrap()]);
    assert!(!ok && text.contains("already holds a previous run"), "{text}");
    assert!(out.join("checkpoint-2").exists());
}

#[test]
fn overwrite_output_dir_from_the_args_file_replaces_the_previous_run_and_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    first_run(dir.path(), &out);
    std::fs::write(out.join("notes.txt"), "mine").unwrap();
    let a = write(
        &dir.path().join("a.json"),
        r#"{"overwrite_output_dir": true, "max_steps": 1, "eval_strategy": "no", "save_strategy": "no"}"#,
    );
    let (ok, text) = run_in(dir.path(), &["--args-file", &a, "--output-dir", out.to_str().unwrap()]);
    assert!(ok, "{text}");
    assert!(!out.join("checkpoint-2").exists(), "the previous run's checkpoint is left beside the new run");
    assert!(!out.join("log_history.jsonl").exists(), "the previous run's log_history.jsonl is left beside the new trainer_state.json");
    assert_eq!(std::fs::read_to_string(out.join("notes.txt")).unwrap(), "mine", "a file the Trainer did not write was touched");
    let state: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("trainer_state.json")).unwrap()).unwrap();
    assert_eq!(state["global_step"], 1);
    let written: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("training_args.json")).unwrap()).unwrap();
    assert_eq!(written["overwrite_output_dir"], true);
}

#[test]
fn output_dir_comes_from_the_args_file_and_the_flag_wins_over_it() {
    let dir = tempfile::tempdir().unwrap();
    let a =
        write(&dir.path().join("a.json"), r#"{"output_dir": "fromfile", "max_steps": 1, "eval_strategy": "no", "save_strategy": "no"}"#);
    let (ok, text) = run_in(dir.path(), &["--args-file", &a]);
    assert!(ok, "{text}");
    assert!(dir.path().join("fromfile").join("trainer_state.json").exists(), "output_dir from the args file ignored");
    assert!(!dir.path().join("basic-trainer").exists(), "wrote to the default output_dir");
    let (ok, text) = run_in(dir.path(), &["--args-file", &a, "--output-dir", "fromflag"]);
    assert!(ok, "{text}");
    assert!(dir.path().join("fromflag").join("trainer_state.json").exists());
}

#[test]
fn a_refused_resume_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let missing = dir.path().join("no-such-checkpoint");
    let (ok, text) = run_in(
        dir.path(),
        &["--max-steps", "1", "--output-dir", out.to_str().unwrap(), "--resume-from-checkpoint", missing.to_str().unwrap()],
    );
    assert!(!ok, "{text}");
    assert!(text.contains("no-such-checkpoint"), "{text}");
    let left: Vec<_> = std::fs::read_dir(&out).map(|d| d.map(|e| e.unwrap().file_name()).collect()).unwrap_or_default();
    assert!(left.is_empty(), "a refused resume wrote {left:?} into output_dir");
}
