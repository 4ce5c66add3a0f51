//! Helpers for tests that run real ranks: the test binary re-executes one of its own ignored
//! tests under `mpirun -n N`, and that test is the rank body.
#![allow(dead_code)]

use ladder_core::model::BasicNetConfig;
use std::process::{Command, ExitStatus};
use tch::{Device, Kind, Tensor};

/// BasicNet without dropout: equivalence tests need train mode to be deterministic.
pub fn no_dropout() -> BasicNetConfig {
    BasicNetConfig { dropout: false, ..Default::default() }
}

/// The same synthetic samples on every rank: `steps` global batches of `w·b` images
/// (`[w·b, 1, 28, 28]` f32 normal, labels `[w·b]` i64 in 0..10), from a fixed seed.
pub fn global_batches(w: i64, b: i64, steps: usize) -> Vec<(Tensor, Tensor)> {
    tch::manual_seed(1234);
    (0..steps)
        .map(|_| {
            let x = Tensor::randn([w * b, 1, 28, 28], (Kind::Float, Device::Cpu));
            let y = Tensor::randint(10, [w * b], (Kind::Int64, Device::Cpu));
            (x, y)
        })
        .collect()
}

/// `a` and `b` have one shape and are allclose (rtol = atol = 1e-5), compared in f64.
pub fn assert_close(what: &str, a: &Tensor, b: &Tensor) {
    assert_close_within(what, a, b, 1e-5);
}

/// `a` and `b` have one shape and are allclose with rtol = atol = `tol`, compared in f64.
pub fn assert_close_within(what: &str, a: &Tensor, b: &Tensor, tol: f64) {
    assert_eq!(a.size(), b.size(), "{what}: shapes");
    let (a, b) = (a.to_kind(Kind::Double), b.to_kind(Kind::Double));
    let diff = (&a - &b).abs().max().double_value(&[]);
    let scale = b.abs().max().double_value(&[]);
    assert!(a.allclose(&b, tol, tol, false), "{what}: max |diff| {diff} (max |ref| {scale}, tolerance {tol})");
}

/// Runs the ignored test `body` of the current test binary as `n` MPI ranks and returns
/// everything they printed; panics with it when any rank fails or does not run the test.
pub fn mpirun(n: usize, body: &str, envs: &[(&str, &str)]) -> String {
    let (status, text, per_rank) = run_ranks(n, body, envs);
    assert!(status.success(), "mpirun -n {n} {body} failed ({status}):\n{text}");
    for (r, out) in per_rank.iter().enumerate() {
        assert!(out.contains("test result: ok. 1 passed"), "rank {r} did not pass {body} once:\n{text}");
    }
    assert_eq!(per_rank.len(), n, "expected output of {n} ranks:\n{text}");
    text
}

/// [`mpirun`] with a fresh temporary directory for the ranks to share, its path in the
/// environment variable `dir_var`; the directory is removed when the run has passed.
pub fn mpirun_with_dir(n: usize, body: &str, dir_var: &str) -> String {
    let dir = tempfile::tempdir().expect("temp dir");
    mpirun(n, body, &[(dir_var, dir.path().to_str().expect("UTF-8 temp dir"))])
}

/// `mpirun -n n <this test binary> --ignored --exact body` (as root if need be), each rank's
/// output in its own file (`--output-filename`), so that ranks never interleave within a line.
/// Returns mpirun's status, all output (mpirun's own, then each rank's under a header) and each
/// rank's stdout + stderr.
fn run_ranks(n: usize, body: &str, envs: &[(&str, &str)]) -> (ExitStatus, String, Vec<String>) {
    let exe = std::env::current_exe().expect("test binary path");
    let dir = tempfile::tempdir().expect("temp dir");
    let mut cmd = Command::new("mpirun");
    cmd.args(["-n", &n.to_string(), "--oversubscribe", "--bind-to", "none", "--output-filename"])
        .arg(dir.path())
        .arg(exe)
        .args(["--ignored", "--exact", body, "--test-threads", "1", "--nocapture"])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        // One intra-op thread per rank: the tests oversubscribe 2 cores.
        .env("OMP_NUM_THREADS", "1");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("mpirun (openmpi-bin) is installed by scripts/bootstrap.sh");
    let mut text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    // Open MPI 4 writes <dir>/1/rank.<r>/{stdout,stderr}.
    let mut per_rank = Vec::new();
    for r in 0..n {
        let rank_dir = dir.path().join("1").join(format!("rank.{r}"));
        if !rank_dir.exists() {
            continue;
        }
        let read = |f: &str| std::fs::read_to_string(rank_dir.join(f)).unwrap_or_default();
        let both = format!("{}{}", read("stdout"), read("stderr"));
        text.push_str(&format!("\n---- rank {r} ----\n{both}"));
        per_rank.push(both);
    }
    (out.status, text, per_rank)
}

/// True when this process is a rank started by [`mpirun`] (rather than the plain test run).
pub fn is_rank() -> bool {
    std::env::var_os("OMPI_COMM_WORLD_RANK").is_some()
}

/// Runs the ignored test `body` as `n` ranks expecting the job to fail; returns mpirun's output
/// and how long it took.
pub fn mpirun_failing(n: usize, body: &str, envs: &[(&str, &str)]) -> (String, std::time::Duration) {
    let start = std::time::Instant::now();
    let (status, text, _) = run_ranks(n, body, envs);
    assert!(!status.success(), "mpirun -n {n} {body} was expected to fail:\n{text}");
    (text, start.elapsed())
}

/// A directory in which no file can be created, for the writability checks: a fresh
/// directory made read-only (the temp dir that holds it, to keep it alive, comes along), or
/// — where permissions do not stop this process (root) — sysfs, which takes no new files.
pub fn unwritable_dir() -> (Option<tempfile::TempDir>, std::path::PathBuf) {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().expect("temp dir");
    let ro = tmp.path().join("read-only");
    std::fs::create_dir(&ro).unwrap();
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o555)).unwrap();
    if std::fs::File::create(ro.join("probe")).is_err() {
        return (Some(tmp), ro);
    }
    assert!(std::fs::File::create("/sys/ladder-probe").is_err(), "sysfs takes no new files");
    (None, "/sys".into())
}
