//! `bench`'s user-visible text that needs no run: --help of every subcommand and the errors for
//! bad flags and unbuilt binaries (each names the flag or file and what was expected).

use std::process::Command;

const BENCH: &str = env!("CARGO_BIN_EXE_bench");

fn run(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(BENCH).args(args).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn help_texts() {
    for (name, args) in [("help", &["--help"][..]), ("demo_help", &["demo", "--help"]), ("run_help", &["run", "--help"])] {
        let (ok, stdout, _) = run(args);
        assert!(ok);
        insta::assert_snapshot!(name, stdout);
    }
}

#[test]
fn an_unknown_level_is_named() {
    let (ok, _, stderr) = run(&["demo", "--levels", "1,4"]);
    assert!(!ok);
    insta::assert_snapshot!(stderr, @"error: --levels 4: expected level numbers among 1, 2, 3 (comma-separated, e.g. --levels 1,3)");
}

#[test]
fn an_unknown_strategy_is_refused_before_anything_runs() {
    let (ok, _, stderr) = run(&["demo", "--strategy", "zero3"]);
    assert!(!ok && stderr.contains("invalid value 'zero3' for '--strategy <STRATEGY>'"), "{stderr}");
    assert!(
        stderr.contains(
            "[possible values: ddp, fsdp-full-shard, fsdp-shard-grad-op, fsdp-no-shard, fsdp-hybrid-shard, fsdp-hybrid-shard-zero2]"
        ),
        "{stderr}"
    );
}

#[test]
fn matrix_flags_are_checked_before_anything_runs() {
    let (ok, _, stderr) = run(&["run", "--levels", "1", "--world-sizes", "0,2"]);
    assert!(!ok);
    insta::assert_snapshot!(stderr, @"error: --world-sizes [0, 2]: expected one or more world sizes of at least 1");
    let (ok, _, stderr) = run(&["run", "--repeats", "0"]);
    assert!(!ok);
    insta::assert_snapshot!(stderr, @"error: --repeats 0 / --wide-repeats 1: expected at least 1 repeat");
    let (ok, _, stderr) = run(&["run", "--strategies", "zero3"]);
    assert!(!ok && stderr.contains("invalid value 'zero3' for '--strategies"), "{stderr}");
}

#[test]
fn unbuilt_binaries_are_named_with_the_build_command() {
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().display().to_string();
    let (ok, _, stderr) = run(&["demo", "--levels", "1", "--bin-dir", &bin, "--out-dir", &bin]);
    assert!(!ok);
    assert_eq!(
        stderr.replace(&bin, "<bin>"),
        "error: <bin>/ladder-run not found: build it first with `cargo build --release --workspace --bins --examples` (what `make build` runs)\n"
    );
    let (ok, _, stderr) = run(&["run", "--levels", "1", "--strategies", "ddp", "--bin-dir", &bin, "--out-dir", &bin]);
    assert!(!ok && stderr.replace(&bin, "<bin>").starts_with("error: <bin>/ladder-run not found"), "{stderr}");
}
