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

/// Polls `ready` every 5 ms until it holds; panics, naming `what`, when `child` ends first or
/// after `limit`.
pub fn wait_until(child: &mut std::process::Child, what: &str, limit: std::time::Duration, mut ready: impl FnMut() -> bool) {
    let start = std::time::Instant::now();
    while !ready() {
        assert!(start.elapsed() < limit, "{what}: not after {limit:?}");
        if let Some(st) = child.try_wait().expect("the run's status") {
            panic!("{what}: the run ended first ({st})");
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// Sends SIGTERM to each of `pids`, `times` rounds 30 ms apart (a second one lands during the
/// save, as an impatient scheduler's would), then waits for `child` (its stdout and stderr
/// piped). Returns its status, everything it printed, and the time from the first signal to
/// its end.
pub fn sigterm_and_wait(child: std::process::Child, pids: &[u32], times: usize) -> (ExitStatus, String, std::time::Duration) {
    let signalled = std::time::Instant::now();
    for round in 0..times {
        if round > 0 {
            std::thread::sleep(std::time::Duration::from_millis(30));
        }
        for pid in pids {
            let sent = Command::new("kill").args(["-TERM", &pid.to_string()]).status().expect("kill(1)");
            assert!(sent.success() || round > 0, "SIGTERM to {pid} failed");
        }
    }
    let out = child.wait_with_output().expect("the run's output");
    let took = signalled.elapsed();
    (out.status, format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)), took)
}

/// The pids of the processes running `exe` with `tag` among their arguments and, when `rank`
/// is given, that rank in their environment (`RANK` or mpirun's `OMPI_COMM_WORLD_RANK`).
pub fn pids_of(exe: &str, tag: &std::path::Path, rank: Option<usize>) -> Vec<u32> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else { return found };
    for entry in entries.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else { continue };
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        if args.first() != Some(&exe.as_bytes()) || !args.contains(&tag.as_os_str().as_encoded_bytes()) {
            continue;
        }
        if let Some(r) = rank {
            let Ok(environ) = std::fs::read(entry.path().join("environ")) else { continue };
            let wanted = [format!("RANK={r}"), format!("OMPI_COMM_WORLD_RANK={r}")];
            if !environ.split(|b| *b == 0).any(|v| wanted.iter().any(|w| v == w.as_bytes())) {
                continue;
            }
        }
        found.push(pid);
    }
    found
}

/// The `global_step` of the checkpoint directory `dir` (its training state), if it holds one.
pub fn checkpoint_step(dir: &std::path::Path) -> Option<u64> {
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join(ladder_core::checkpoint::STATE_FILE)).ok()?).ok()?;
    v["global_step"].as_u64()
}

/// The tensors of a safetensors file, sorted by name.
pub fn read_safetensors(path: &std::path::Path) -> Vec<(String, Tensor)> {
    let mut v = Tensor::read_safetensors(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// The two safetensors files hold the same names and bit-identical tensors.
pub fn assert_bit_identical(what: &str, a: &std::path::Path, b: &std::path::Path) {
    let (ta, tb) = (read_safetensors(a), read_safetensors(b));
    assert_eq!(
        ta.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>(),
        tb.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>(),
        "{what}: keys"
    );
    for ((k, x), (_, y)) in ta.iter().zip(&tb) {
        assert!(x.equal(y), "{what}: {k} differs (max |diff| {})", (x - y).abs().max().double_value(&[]));
    }
}

/// Starts `cmd` with its output piped, waits (up to 180 s) until `ready` — a checkpoint is on
/// disk — then sends SIGTERM twice to the processes `targets` names (the ranks, as Slurm's
/// scancel signals them, or the launcher) and waits for the run to end: see
/// [`sigterm_and_wait`].
pub fn sigterm_when(
    cmd: &mut Command,
    what: &str,
    ready: impl FnMut() -> bool,
    targets: impl FnOnce(&std::process::Child) -> Vec<u32>,
) -> (ExitStatus, String, std::time::Duration) {
    let mut child = cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().expect("start the run");
    wait_until(&mut child, what, std::time::Duration::from_secs(180), ready);
    let pids = targets(&child);
    assert!(!pids.is_empty(), "{what}: no process to signal");
    sigterm_and_wait(child, &pids, 2)
}

/// Removes the Accelerate and FSDP variables this process may have inherited from `cmd`'s
/// environment, so that a level-2 or level-3 run sees only the settings a test gives it.
pub fn without_accelerate_settings(cmd: &mut Command) -> &mut Command {
    for (k, _) in std::env::vars() {
        if k.starts_with("ACCELERATE_") || k.starts_with("FSDP_") {
            cmd.env_remove(k);
        }
    }
    cmd
}

/// Runs `cmd`: whether it succeeded, and its stdout then stderr.
pub fn output_of(cmd: &mut Command) -> (bool, String) {
    let out = cmd.output().expect("spawn");
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

/// A FULL_SHARD run's `cpu_offload` entry holds the closed form in rank 0's shard bytes (two
/// copies to the device per step — forward's and backward's all-gathers — and one back) and
/// the run printed its summary line.
pub fn assert_full_shard_offload_copies(report: &serde_json::Value, text: &str) {
    assert!(text.contains("cpu_offload (offload_params): per step"), "{text}");
    let shard = report["ranks"][0]["model_state"]["parameters"].as_u64().unwrap();
    let entry = &report["cpu_offload"];
    assert_eq!(
        (entry["per_step"]["h2d_bytes"].as_u64(), entry["per_step"]["d2h_bytes"].as_u64()),
        (Some(2 * shard), Some(shard)),
        "{entry}"
    );
}

/// Loads a state dict saved as weights and AdamW state together (the optimizer's entries are
/// the `.exp_avg`, `.exp_avg_sq` and `.step` keys) into `model` and `opt`: a resume.
pub fn load_training_state(
    model: &mut ladder_core::parallel::WrappedModel,
    opt: &mut ladder_core::optim::AdamW,
    state: &[(String, Tensor)],
) {
    let (weights, optim): (Vec<_>, Vec<_>) =
        state.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).partition(|(n, _)| !n.contains(".exp_avg") && !n.ends_with(".step"));
    model.load_full_state_dict(&weights).unwrap();
    model.load_optimizer_state_dict(opt, &optim).unwrap();
}

/// `bin` on 2 processes under mpirun (oversubscribed, unbound, one intra-op thread each, root
/// allowed), no Accelerate setting inherited: a level-2 run for 3 steps without evaluation or
/// logging; the caller adds its own flags.
pub fn level2_on_two_processes(bin: &str) -> Command {
    let mut cmd = Command::new("mpirun");
    cmd.args(["-n", "2", "--oversubscribe", "--bind-to", "none"])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMP_NUM_THREADS", "1");
    without_accelerate_settings(&mut cmd);
    cmd.arg(bin).args(["--device", "cpu", "--max-steps", "3", "--log-interval", "0", "--no-eval"]);
    cmd
}
