//! Helpers for tests that run real ranks: the test binary re-executes one of its own ignored
//! tests under `mpirun -n N`, and that test is the rank body.
#![allow(dead_code)]

use std::process::{Command, Output};

/// Runs the ignored test `body` of the current test binary as `n` MPI ranks and returns the
/// output; panics with everything mpirun printed when any rank fails.
pub fn mpirun(n: usize, body: &str, envs: &[(&str, &str)]) -> Output {
    let out = rank_command(n, body, envs).output().expect("mpirun (openmpi-bin) is installed by scripts/bootstrap.sh");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "mpirun -n {n} {body} failed ({}):\n{text}", out.status);
    let passed = text.matches("test result: ok. 1 passed").count();
    assert_eq!(passed, n, "expected {n} ranks to each pass {body} once:\n{text}");
    out
}

/// `mpirun -n n <this test binary> --ignored --exact body`, as root if need be.
fn rank_command(n: usize, body: &str, envs: &[(&str, &str)]) -> Command {
    let exe = std::env::current_exe().expect("test binary path");
    let mut cmd = Command::new("mpirun");
    cmd.args(["-n", &n.to_string(), "--oversubscribe", "--bind-to", "none"])
        .arg(exe)
        .args(["--ignored", "--exact", body, "--test-threads", "1", "--nocapture"])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        // One intra-op thread per rank: the tests oversubscribe 2 cores.
        .env("OMP_NUM_THREADS", "1");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    cmd
}

/// True when this process is a rank started by [`mpirun`] (rather than the plain test run).
pub fn is_rank() -> bool {
    std::env::var_os("OMPI_COMM_WORLD_RANK").is_some()
}

/// Runs the ignored test `body` as `n` ranks expecting the job to fail; returns mpirun's output
/// and how long it took.
pub fn mpirun_failing(n: usize, body: &str, envs: &[(&str, &str)]) -> (String, std::time::Duration) {
    let start = std::time::Instant::now();
    let out = rank_command(n, body, envs).output().expect("mpirun");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "mpirun -n {n} {body} was expected to fail:\n{text}");
    (text, start.elapsed())
}
