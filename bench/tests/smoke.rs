//! What `make demo` and `make bench` run, in tiny form, on the real binaries and real MNIST: a
//! demo of level 1 (5 steps at 2 ranks) next to a level that fails, and a matrix of the baseline
//! and level 1 DDP at 1 and 2 ranks with their PyTorch peers and the all-reduce measurement.
//! If either make target breaks (a binary it runs not built, a peer that no longer starts, a
//! report field renamed), these fail.
//!
//! They need the binaries the bench runs in the same target directory as `bench` itself:
//! `cargo test --release --workspace` (`make test`) builds them all (bins and examples).

use std::path::{Path, PathBuf};
use std::process::Command;

const BENCH: &str = env!("CARGO_BIN_EXE_bench");

/// `target/release`: where `bench` and the binaries it runs are.
fn release_dir() -> PathBuf {
    Path::new(BENCH).parent().expect("bench has a directory").to_path_buf()
}

fn need(path: &Path) {
    assert!(path.is_file(), "{} is not built: run `cargo build --release --workspace --bins --examples` first", path.display());
}

fn json(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

/// Snapshot settings for a table whose layout is checked, not its measurements (which vary run
/// to run): `extra` filters first, then numbers become `#` and runs of spaces and dashes one.
fn masked(extra: &[(&str, &str)]) -> insta::Settings {
    let mut settings = insta::Settings::clone_current();
    for (re, with) in extra {
        settings.add_filter(re, *with);
    }
    settings.add_filter(r"\b\d+(\.\d+)?\b", "#");
    settings.add_filter(r" +", " ");
    settings.add_filter(r"-{2,}", "-");
    settings
}

#[test]
fn demo_reports_level_1_and_a_failing_level_in_one_table() {
    let rel = release_dir();
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    for name in ["ladder-run", "level1-raw-ddp"] {
        need(&rel.join(name));
        std::os::unix::fs::symlink(rel.join(name), bin.join(name)).unwrap();
    }
    // Level 2 stands in as a binary that fails the way a broken level would.
    let fake = bin.join("level2-accelerator");
    // Written by a child `sh`, not this process: a file it held open for writing can be
    // inherited by another test thread's fork, and running it then fails with ETXTBSY.
    let body = "#!/bin/sh\necho 'boom: level 2 exploded' >&2\nexit 3\n";
    let st = Command::new("sh").args(["-c", "printf '%s' \"$1\" > \"$2\" && chmod 755 \"$2\"", "sh", body]).arg(&fake).status().unwrap();
    assert!(st.success());
    let out_dir = dir.path().join("demo");
    let out = Command::new(BENCH)
        .args(["demo", "--levels", "1,2", "--max-steps", "5", "--log-interval", "1", "--bin-dir"])
        .arg(&bin)
        .arg("--out-dir")
        .arg(&out_dir)
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "a failed level makes the demo fail:\n{stdout}\n{stderr}");
    assert!(stderr.contains("error: 1 of 2 runs failed: level 2"), "{stderr}");
    assert!(stdout.contains("[1/2] level 1 (raw DDP): 2 ranks") && stdout.contains("[2/2] level 2 (Accelerator)"), "{stdout}");

    let summary = json(&out_dir.join("demo.json"));
    let rows = summary["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    let (l1, l2) = (&rows[0], &rows[1]);
    assert_eq!(l1["status"], "ok", "{stdout}");
    let f = &l1["figures"];
    assert_eq!(f["eval_samples"], 10_000);
    assert_eq!(f["steps"], 5);
    assert_eq!(f["world_size"], 2);
    assert_eq!(f["strategy"], "ddp");
    assert!(f["accuracy"].as_f64().unwrap() > 0.0 && f["samples_per_s"].as_f64().unwrap() > 0.0, "{f}");
    let ranks = f["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 2);
    for r in ranks {
        // Rank 0's DDP replica: 1,199,882 f32 parameters; the peak RSS holds at least that.
        assert_eq!(r["model_state"]["parameters"], 1_199_882 * 4);
        assert!(r["peak_rss_mib"].as_f64().unwrap() * 1048576.0 > 4.0 * 1_199_882.0 * 4.0, "{r}");
        // Samples counted = steps × batch: 5 × 64 per rank (3 of them timed after 2 warm-up steps).
        assert_eq!((r["timing"]["samples"].as_u64(), r["timing"]["timed_samples"].as_u64()), (Some(320), Some(192)), "{r}");
    }
    // The line count comes from the level's sources: a count, or an error naming the files.
    match l1["user_code_lines"].as_u64() {
        Some(n) => assert!(n > 10 && l1["user_code_file"].as_str().unwrap().starts_with("level1-raw-ddp/src/"), "{l1}"),
        None => assert!(l1["user_code_error"].as_str().unwrap().contains("level1-raw-ddp/src/main.rs"), "{l1}"),
    }
    assert_eq!(l2["status"], "failed");
    let err = l2["error"].as_str().unwrap();
    assert!(err.contains("level 2 (Accelerator) failed (exit code") && err.contains("boom: level 2 exploded"), "{err}");
    assert!(std::fs::read_to_string(out_dir.join("level1.log")).unwrap().contains("Train Epoch: 1 [0/30000"));

    // The markdown table, numbers masked; the line-count cell is masked too (it follows level
    // 1's sources, whose anchors are another crate's).
    let md = std::fs::read_to_string(out_dir.join("demo.md")).unwrap();
    let table: String =
        md.lines().skip_while(|l| !l.starts_with('|')).take_while(|l| l.starts_with('|')).map(|l| format!("{l}\n")).collect();
    // Below it, compute efficiency: level 1's achieved GFLOP/s and share of the CPU's peak, level 2 FAILED.
    let efficiency: Vec<&str> =
        md.lines().skip_while(|l| !l.starts_with("## Compute efficiency")).filter(|l| l.starts_with("| ")).collect();
    assert_eq!(efficiency.len(), 3, "{md}");
    assert!(efficiency[1].starts_with("| 1 · raw DDP") && efficiency[1].contains(" 71.57 |") && efficiency[1].ends_with("% |"), "{md}");
    assert!(efficiency[2].contains("FAILED") && md.contains("Peak: "), "{md}");
    masked(&[(r"(?m)^(\| \d · [A-Za-z ]+?\s*\|)[^|]*\|", "$1 <lines> |")]).bind(|| insta::assert_snapshot!("demo_table_masked", table));
}

/// Checks one of our runs' report (`runs/<id>-r1.json`): samples = steps × 64 × W, every rank's
/// step times add up to its training loop's time within 5% and its phases to its timed
/// interval, the training-phase peak holds the model state, DDP moves the whole model's f32
/// gradients per step at W = 2.
fn check_report(dir: &Path, id: &str, steps: u64, world_size: u64) {
    let r = json(&dir.join(format!("runs/{id}-r1.json")));
    assert_eq!((r["steps"].as_u64(), r["samples"].as_u64()), (Some(steps), Some(steps * 64 * world_size)), "{id}: {r}");
    let state = 4.0 * 1_199_882.0 * 4.0; // parameters + gradients + 2 AdamW states, f32
    let ranks: Vec<serde_json::Value> = match r["ranks"].as_array() {
        Some(ranks) => ranks.clone(),
        None => vec![serde_json::json!({ "timing": r["timing"], "train_s": r["timing"]["steps_s"] })],
    };
    assert_eq!(ranks.len() as u64, world_size.max(1), "{id}");
    for rank in &ranks {
        let t = &rank["timing"];
        let f = |k: &str| t[k].as_f64().unwrap_or_else(|| panic!("{id}: timing.{k} missing: {t}"));
        assert_eq!(
            (t["steps"].as_u64(), t["warmup_steps"].as_u64(), t["timed_steps"].as_u64()),
            (Some(steps), Some(2), Some(steps - 2)),
            "{id}"
        );
        assert_eq!((t["samples"].as_u64(), t["timed_samples"].as_u64()), (Some(steps * 64), Some((steps - 2) * 64)), "{id}");
        let train_s = rank["train_s"].as_f64().unwrap();
        assert!((f("steps_s") - train_s).abs() <= 0.05 * train_s, "{id}: step times {} vs training loop {train_s}", f("steps_s"));
        let phases: f64 =
            ["data_s", "forward_s", "backward_s", "comm_s", "optimizer_s"].iter().map(|k| t["phases"][k].as_f64().unwrap()).sum();
        assert!(
            (phases * (steps - 2) as f64 - f("timed_s")).abs() <= 1e-6 * f("timed_s").max(1.0),
            "{id}: phases {phases} × steps vs {}",
            f("timed_s")
        );
        assert!(f("step_p50_s") > 0.0 && f("step_p50_s") <= f("step_p95_s") && f("first_step_s") > 0.0, "{id}: {t}");
        assert_eq!(t["rss_scope"], "clear-refs", "{id}: VmHWM resets on Linux");
        assert!(f("train_peak_rss_mib") * 1048576.0 >= state, "{id}: training-phase peak ≥ model state: {t}");
        if world_size == 2 && id.contains("-ddp-") {
            assert_eq!(f("comm_bytes_per_step"), 1_199_882.0 * 4.0, "{id}: one f32 gradient all-reduce per step");
            assert!(t["phases"]["comm_s"].as_f64().unwrap() > 0.0, "{id}");
        }
    }
    assert!(r["peak_rss_mib"].as_f64().unwrap() >= r["train_peak_rss_mib"].as_f64().unwrap(), "{id}: whole process ≥ training phase");
}

#[test]
fn matrix_runs_every_level_next_to_its_peer_and_measures_all_reduce() {
    let rel = release_dir();
    for name in [
        "ladder-run",
        "ladder-baseline",
        "level1-raw-ddp",
        "level2-accelerator",
        "level3-trainer",
        "examples/allreduce_bench",
        "examples/ddp_buckets",
    ] {
        need(&rel.join(name));
    }
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(BENCH)
        .args(["run", "--levels", "1,2,3", "--strategies", "single,ddp", "--world-sizes", "1,2", "--widths", "128"])
        // torch.compile's trial is the tuned peer's slowest (tests/peers.rs runs the full one).
        .args(["--tuned-trial", "channels_last"])
        .args(["--precisions", "fp32", "--steps", "4", "--repeats", "1", "--bucket-iters", "5"])
        // A run that hangs fails the test in minutes, not after the default half hour.
        .args(["--timeout-s", "300", "--bin-dir"])
        .arg(&rel)
        .arg("--out-dir")
        .arg(dir.path())
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "bench run failed:\n{stdout}\n{stderr}");

    let summary = json(&dir.path().join("bench.json"));
    let rows = summary["rows"].as_array().unwrap();
    let ids: Vec<&str> = rows.iter().map(|r| r["case"]["id"].as_str().unwrap()).collect();
    let expected = [
        "baseline-w1-128-fp32",
        "l1-ddp-w1-128-fp32",
        "l1-ddp-w2-128-fp32",
        "l2-ddp-w1-128-fp32",
        "l2-ddp-w2-128-fp32",
        "l3-ddp-w1-128-fp32",
        "l3-ddp-w2-128-fp32",
    ];
    assert_eq!(ids, expected);
    // The 🤗 peers run when the venv has accelerate and transformers (`--install-peers`);
    // otherwise their rows say why they have none.
    let hf = rows[3]["case"]["peer"].is_object();
    let skipped = summary["skipped"].as_array().unwrap();
    assert_eq!(skipped.iter().filter(|s| s.as_str().unwrap().contains("--install-peers")).count(), if hf { 0 } else { 4 }, "{skipped:?}");
    for r in rows {
        assert_eq!(r["errors"].as_array().unwrap().len(), 0, "{r}");
        assert_eq!(r["eval_samples"], 10_000, "{r}");
        assert_eq!(r["samples_per_s"]["n"], 1);
        assert!(r["step"]["step_p50_s"].as_f64().unwrap() > 0.0, "{r}");
        // Every row has the tuned peer at its world size and in its precision (fp32 here): the
        // second ratio, what it chose.
        let ours = r["samples_per_s"]["median"].as_f64().unwrap();
        let w = r["case"]["world_size"].as_u64().unwrap();
        assert_eq!(r["case"]["tuned_peer"], serde_json::json!({"peer": "tuned", "world_size": w, "bf16": false}), "{r}");
        let tuned = r["tuned_samples_per_s"]["median"].as_f64().unwrap();
        assert!((r["tuned_ratio"]["median"].as_f64().unwrap() - ours / tuned).abs() < 1e-9, "{r}");
        assert!(r["tuned_choice"].as_str().unwrap().starts_with("preloaded tensors, "), "{r}");
        assert!(r["tuned_accuracy"].as_f64().unwrap() > 0.0, "{r}");
        if r["case"]["peer"].is_null() {
            continue;
        }
        // A row with a twin has it measured in the same run: a ratio and its step figures.
        let theirs = r["peer_samples_per_s"]["median"].as_f64().unwrap();
        let ratio = r["ratio"]["median"].as_f64().unwrap();
        assert!(ours > 0.0 && theirs > 0.0 && (ratio - ours / theirs).abs() < 1e-9, "{r}");
        assert!(r["peer_accuracy"].as_f64().unwrap() > 0.0);
        assert!(r["peer_step"]["step_p50_s"].as_f64().unwrap() > 0.0 && r["peer_train_peak_rss_mib"].as_f64().unwrap() > 0.0, "{r}");
    }
    for r in &rows[1..] {
        let ms = &r["model_state"];
        assert_eq!((ms["parameters"].as_u64(), ms["optimizer"].as_u64()), (Some(1_199_882 * 4), Some(2 * 1_199_882 * 4)));
        let state = ["parameters", "gradients", "optimizer"].iter().map(|k| ms[k].as_u64().unwrap()).sum::<u64>() as f64;
        for p in r["train_peak_rss_per_rank"].as_array().unwrap() {
            assert!(p.as_f64().unwrap() * 1048576.0 >= state, "training peak ≥ model state: {r}");
        }
        assert!(r["comm_share"].as_f64().unwrap() > 0.0 && r["comm_share"].as_f64().unwrap() < 1.0);
        if r["case"]["level"].as_u64() > Some(1) {
            assert!(r["vs_level1"].as_f64().unwrap() > 0.0, "{r}");
        }
    }
    // Each run's own report is kept, and its numbers are consistent.
    check_report(dir.path(), "baseline-w1-128-fp32", 4, 1);
    for id in &expected[1..] {
        check_report(dir.path(), id, 4, if id.contains("-w2-") { 2 } else { 1 });
    }
    let mut peers =
        vec!["pytorch-tutorial-r1", "pytorch-ddp-gloo-w1-r1", "pytorch-ddp-gloo-w2-r1", "pytorch-tuned-w1-r1", "pytorch-tuned-w2-r1"];
    if hf {
        peers.extend(["hf-accelerate-w1-r1", "hf-accelerate-w2-r1", "hf-trainer-w1-r1", "hf-trainer-w2-r1"]);
    }
    for peer in peers {
        let p = json(&dir.path().join(format!("runs/{peer}.json")));
        assert_eq!((p["steps"].as_u64(), p["eval_samples"].as_u64()), (Some(4), Some(10_000)), "{peer}");
        assert_eq!((p["timing"]["steps"].as_u64(), p["timing"]["timed_steps"].as_u64()), (Some(4), Some(2)), "{peer}");
        let w = p["world_size"].as_u64().unwrap();
        assert_eq!(p["samples"].as_u64(), Some(4 * 64 * w), "{peer}");
    }
    // All-reduce: 4 KiB … 64 MiB, ×4, all three paths measured (checked, layout checked once, raw).
    let ar = summary["allreduce"]["rows"].as_array().unwrap();
    let bytes: Vec<u64> = ar.iter().map(|r| r["bytes"].as_u64().unwrap()).collect();
    assert_eq!(bytes, (0..8).map(|i| 4096u64 << (2 * i)).collect::<Vec<_>>());
    assert!(ar.iter().all(|r| ["ours_latency_us", "prechecked_latency_us", "raw_latency_us"].iter().all(|k| r[k].as_f64().unwrap() > 0.0)));
    assert!(summary["machine"]["torch_version"].as_str().unwrap().starts_with("2."));
    // DDP's gradient all-reduce vs bucket_cap_mb: BasicNet's 4.58 MiB of f32 gradients in 2
    // buckets at every cap (the first bucket closes at 1 MiB with fc1.weight's 4.5 MiB in it;
    // the convolutions' 75 KB make the second), and the one-buffer reference.
    let b = &summary["buckets"];
    let caps: Vec<f64> = b["rows"].as_array().unwrap().iter().map(|r| r["bucket_cap_mb"].as_f64().unwrap()).collect();
    assert_eq!(caps, [1.0, 5.0, 25.0, 100.0]);
    for r in b["rows"].as_array().unwrap().iter().chain([&b["flat"]]) {
        assert_eq!((r["bytes"].as_u64(), r["iters"].as_u64()), (Some(1_199_882 * 4), Some(5)), "{r}");
        assert!(r["median_ms"].as_f64().unwrap() > 0.0 && r["p95_ms"].as_f64() >= r["median_ms"].as_f64(), "{r}");
    }
    assert!(b["rows"].as_array().unwrap().iter().all(|r| r["buckets"] == 2), "{b}");
    // The targets: ours / peer, ours / tuned peer and RSS for every row with a peer, level 2 and 3 over level 1.
    let targets = summary["targets"].as_array().unwrap();
    let with_peer = rows.iter().filter(|r| r["case"]["peer"].is_object()).count();
    // Every row has its tuned peer (levels 2 and 3 too, with or without the 🤗 peers): ours / tuned (#25).
    let with_tuned = rows.iter().filter(|r| r["case"]["tuned_peer"].is_object()).count();
    assert_eq!(with_tuned, rows.len());
    // And the estimator against the measured training-phase growth, one per row (#23).
    assert_eq!(targets.iter().filter(|t| t["issue"] == 23).count(), rows.len(), "{targets:?}");
    // And the share of the fp32 peak for each one-process row (the baseline, each level at one
    // rank; all at width 128 in fp32) (#25).
    let one_process = rows.iter().filter(|r| r["case"]["world_size"] == 1).count();
    assert_eq!(targets.iter().filter(|t| t["what"].as_str().is_some_and(|w| w.starts_with("fp32 FLOP/s"))).count(), one_process);
    assert_eq!(targets.len(), 2 * with_peer + with_tuned + 4 + rows.len() + one_process, "{targets:?}");

    let csv = std::fs::read_to_string(dir.path().join("bench.csv")).unwrap();
    assert_eq!(csv.lines().count(), 1 + 7, "{csv}");
    assert!(csv.lines().nth(2).unwrap().starts_with("l1-ddp-w1-128-fp32,1,ddp,1,128,fp32,4,1,"), "{csv}");
    assert_eq!(std::fs::read_to_string(dir.path().join("targets.csv")).unwrap().lines().count(), 1 + targets.len());
    for svg in ["throughput.svg", "memory.svg"] {
        assert!(std::fs::read_to_string(dir.path().join(svg)).unwrap().starts_with("<svg"), "{svg}");
    }
    let md = std::fs::read_to_string(dir.path().join("bench.md")).unwrap();
    // Compute efficiency: a line per row, with its FLOP count and a share of the recorded peak;
    // what the tuned peer chose depends on the machine, so the table stays out of the snapshot.
    let efficiency: Vec<&str> =
        md.lines().skip_while(|l| !l.starts_with("## Compute efficiency")).skip(2).take_while(|l| l.starts_with('|')).collect();
    assert_eq!(efficiency.len(), 2 + rows.len(), "{md}");
    assert!(efficiency[2..].iter().all(|l| l.contains(" 71.57 |") && l.contains("%) |")), "{efficiency:?}");
    assert!(summary["machine"]["cpu_peak"]["fp32_flops"].as_f64().unwrap() > 0.0 && md.contains("Peak: "), "{md}");
    // The tables' layout (numbers masked; the peer cells and target rows depend on whether the
    // 🤗 peers ran, so those are left out of the snapshot).
    let tables: String = md
        .lines()
        .take_while(|l| !l.starts_with("## Targets") && !l.starts_with("## Compute efficiency"))
        .filter(|l| l.starts_with('|') || l.starts_with("##"))
        .map(|l| format!("{l}\n"))
        .collect();
    masked(&[(r"HF (Accelerate|Trainer)", "<peer>")]).bind(|| {
        if hf {
            insta::assert_snapshot!("bench_tables_masked", tables)
        }
    });
}
