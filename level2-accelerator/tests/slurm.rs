//! Level 2 as a Slurm batch job (`scripts/examples/train.sbatch`, the script the book shows) on a
//! real Slurm over two namespace hosts (`scripts/slurm.sh`): `scancel --signal=TERM` mid-run makes
//! every rank finish its step and save one checkpoint, the job ends with exit code 143, and the
//! same script submitted again resumes from it and ends bit-identical to a run never stopped.
//! A job cancelled at 4 ranks (2 per host) through its batch shell (`scancel --batch`) resumes
//! at 2 under the world-size rule.
//! Needs root (CI runs as root); elsewhere it prints why it skips.

#[path = "../../shared/tests/common/mod.rs"]
mod common;
#[path = "../../shared/tests/common/slurm.rs"]
mod slurm_cluster;

use slurm_cluster::{serial, text, Slurm};
use std::path::Path;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_level2-accelerator");
const SBATCH: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/examples/train.sbatch");
const STEPS: &str = "24";

/// Waits until job `id` has ended; returns `scontrol`'s JobState and ExitCode.
fn wait_job(slurm: &Slurm, id: &str, limit: Duration) -> (String, String) {
    let start = Instant::now();
    loop {
        let out = slurm.on_host0("scontrol", &["show", "job", id]).output().unwrap();
        let s = String::from_utf8_lossy(&out.stdout).into_owned();
        let field = |k: &str| s.split_whitespace().find_map(|w| w.strip_prefix(k)).unwrap_or_default().to_string();
        let state = field("JobState=");
        if !["PENDING", "RUNNING", "CONFIGURING", "COMPLETING", ""].contains(&state.as_str()) {
            return (state, field("ExitCode="));
        }
        assert!(start.elapsed() < limit, "job {id} still {state:?} after {limit:?}:\n{s}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `sbatch [SBATCH_ARGS] train.sbatch FLAGS...` with the state in `state`; returns the job id.
fn submit(slurm: &Slurm, state: &Path, log: &Path, sbatch: &[&str], flags: &[&str]) -> String {
    let mut args = vec!["--parsable", "-o", log.to_str().unwrap()];
    args.extend(sbatch);
    args.extend([SBATCH, "--device", "cpu", "--no-eval", "--log-interval", "0"]);
    args.extend(["--max-steps", STEPS]);
    args.extend(flags);
    let mut cmd = slurm.on_host0("sbatch", &args);
    let out = cmd.env("LADDER_BIN", BIN).env("LADDER_STATE", state).output().unwrap();
    assert!(out.status.success(), "sbatch failed: {}", text(&out));
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[test]
fn sbatch_scancel_term_saves_and_the_resubmitted_job_resumes_bit_identically() {
    if let Some(why) = slurm_cluster::unavailable() {
        eprintln!("skipped: {why}");
        return;
    }
    let _s = serial();
    let slurm = Slurm::up("l2", 2);
    let dir = tempfile::tempdir().unwrap();
    let (whole, resumed, state) = (dir.path().join("whole.st"), dir.path().join("resumed.st"), dir.path().join("state"));

    // The run never stopped, as one srun step.
    let srun = ["-N", "2", "-n", "2", "--mpi=pmix", BIN, "--device", "cpu", "--no-eval", "--log-interval", "0", "--max-steps", STEPS];
    let out = slurm.on_host0("srun", &srun).arg("--save-model").arg(&whole).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));

    // The batch job, cancelled with SIGTERM once its first checkpoint (step 4) is on disk.
    let at = submit_and_cancel(&slurm, &state, &dir.path().join("job1.out"), &[], "--quiet");

    // Submitted again: it finds the checkpoint, resumes, and ends where the whole run ended.
    let log2 = dir.path().join("job2.out");
    let id = submit(&slurm, &state, &log2, &[], &["--save-model", resumed.to_str().unwrap()]);
    let (st, code) = wait_job(&slurm, &id, Duration::from_secs(120));
    let log = std::fs::read_to_string(&log2).unwrap_or_default();
    assert_eq!((st.as_str(), code.as_str()), ("COMPLETED", "0:0"), "{log}");
    assert!(log.contains(&format!("Resuming from {} at step {at}", state.display())), "{log}");
    common::assert_bit_identical("resumed job vs uninterrupted run", &whole, &resumed);
}

/// Submits the job (saving every 4 steps), sends `scancel SCANCEL --signal=TERM` once its first
/// checkpoint is on disk, and checks that it saved mid-run and ended with code 143; returns the
/// step saved.
fn submit_and_cancel(slurm: &Slurm, state: &Path, log: &Path, sbatch: &[&str], scancel: &str) -> u64 {
    let id = submit(slurm, state, log, sbatch, &["--save-every", "4"]);
    let start = Instant::now();
    while common::checkpoint_step(state).is_none() {
        let st = slurm.job_state(&id);
        assert!(["PENDING", "RUNNING", "CONFIGURING"].contains(&st.as_str()), "job {id} is {st} before its first checkpoint");
        assert!(start.elapsed() < Duration::from_secs(120), "no checkpoint within 120 s");
        std::thread::sleep(Duration::from_millis(5));
    }
    let signalled = Instant::now();
    let out = slurm.on_host0("scancel", &[scancel, "--signal=TERM", &id]).output().unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let (st, code) = wait_job(slurm, &id, Duration::from_secs(60));
    let took = signalled.elapsed();
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let at = common::checkpoint_step(state).unwrap();
    assert!((4..24).contains(&at), "stopped at step {at}, not mid-run:\n{text}");
    assert_eq!((st.as_str(), code.as_str()), ("FAILED", "143:0"), "the job ends with the preempted code 143:\n{text}");
    let said = format!("preempted (SIGTERM): every process finished step {at} and the state was saved to {}", state.display());
    assert!(text.contains(&said), "{text}");
    eprintln!("scancel {scancel} --signal=TERM {sbatch:?}: state at step {at} saved and the job ended within {took:?}");
    at
}

/// `sbatch --ntasks-per-node=2` (4 ranks) cancelled with `scancel --batch --signal=TERM` (only
/// the batch shell is signalled: the script hands it to the ranks), then the script submitted at 1 per node
/// (2 ranks): the second job resumes from the 4-rank checkpoint and trains the rest of the
/// steps at 2 ranks — the samples counted globally: 4·64 per step before, 2·64 after.
#[test]
fn sbatch_at_4_ranks_cancelled_resumes_at_2() {
    if let Some(why) = slurm_cluster::unavailable() {
        eprintln!("skipped: {why}");
        return;
    }
    let _s = serial();
    let slurm = Slurm::up("w42", 2);
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let at = submit_and_cancel(&slurm, &state, &dir.path().join("job1.out"), &["--ntasks-per-node=2"], "--batch");
    let saved: serde_json::Value =
        serde_json::from_slice(&std::fs::read(state.join(ladder_core::checkpoint::STATE_FILE)).unwrap()).unwrap();
    assert_eq!((saved["world_size"].as_u64(), saved["samples_consumed"].as_u64()), (Some(4), Some(at * 4 * 64)), "{saved}");

    let log = dir.path().join("job2.out");
    let id = submit(&slurm, &state, &log, &[], &[]);
    let (st, code) = wait_job(&slurm, &id, Duration::from_secs(120));
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert_eq!((st.as_str(), code.as_str()), ("COMPLETED", "0:0"), "{text}");
    assert!(text.contains(&format!("Resuming from {} at step {at}", state.display())), "{text}");
    let end: serde_json::Value = serde_json::from_slice(&std::fs::read(state.join(ladder_core::checkpoint::STATE_FILE)).unwrap()).unwrap();
    let steps: u64 = STEPS.parse().unwrap();
    assert_eq!(end["global_step"].as_u64(), Some(steps), "{end}");
    assert_eq!(end["world_size"].as_u64(), Some(2), "{end}");
    assert_eq!(end["samples_consumed"].as_u64(), Some(at * 4 * 64 + (steps - at) * 2 * 64), "{end}");
}
