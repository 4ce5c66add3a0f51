//! No job hangs, no error is swallowed — level 1 under `ladder-run` as a user runs it: a rank
//! frozen with SIGSTOP mid-epoch ends the whole job within the collective timeout + 10 s with
//! the frozen rank named and no process left; a diverging run stops naming step and rank; a
//! batch larger than a rank's share, or too large for free memory, is refused; a non-finite value
//! one rank alone sees is named alike on every rank; a rank stopped and continued within the
//! timeout costs nothing; a failed bare-mpirun job leaves no progress files.

use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_level1-raw-ddp");

/// `ladder-run`, built next to the level binaries by `cargo build --workspace --bins` (and by
/// `cargo test --workspace`).
fn ladder_run() -> PathBuf {
    let p = PathBuf::from(BIN).with_file_name("ladder-run");
    assert!(p.is_file(), "{} is missing: build it with `cargo build --release -p ladder-core --bin ladder-run`", p.display());
    p
}

/// Live, non-zombie processes whose command line contains `marker`: (pid, cmdline).
fn processes_with(marker: &str) -> Vec<(u32, String)> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else { continue };
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        let zombie = stat.rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with('Z'));
        if cmdline.contains(marker) && !zombie {
            found.push((pid, cmdline));
        }
    }
    found
}

/// The pid of the level-1 process of rank `rank` in the job marked `marker`.
fn rank_pid(marker: &str, rank: usize) -> Option<u32> {
    processes_with(marker).into_iter().find_map(|(pid, cmd)| {
        let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
        let environ = String::from_utf8_lossy(&environ);
        let is_rank = environ.split('\0').any(|v| v == format!("RANK={rank}"));
        (cmd.starts_with(BIN) && is_rank).then_some(pid)
    })
}

fn assert_no_leftovers(marker: &str) {
    let deadline = Instant::now() + Duration::from_secs(3);
    while !processes_with(marker).is_empty() {
        assert!(Instant::now() < deadline, "processes of the job are still alive: {:#?}", processes_with(marker));
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A level-1 job under `ladder-run` at `w` ranks with `args`, its stdout read line by line and
/// its stderr collected by a thread (joined for the failure messages).
struct Job {
    child: std::process::Child,
    out: Option<BufReader<std::process::ChildStdout>>,
    err: Option<std::thread::JoinHandle<String>>,
}

impl Job {
    fn start(w: usize, args: &[&str]) -> Job {
        let mut child = Command::new(ladder_run())
            .args(["--nproc-per-node", &w.to_string()])
            .arg(BIN)
            .args(args)
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut err = child.stderr.take().unwrap();
        let err = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = err.read_to_string(&mut s);
            s
        });
        let out = Some(BufReader::new(child.stdout.take().unwrap()));
        Job { child, out, err: Some(err) }
    }

    /// Reads stdout until rank 0 has logged `n` training steps; returns what it read.
    fn wait_steps(&mut self, n: usize) -> String {
        let (mut line, mut read, mut steps) = (String::new(), String::new(), 0);
        while steps < n {
            line.clear();
            if self.out.as_mut().expect("stdout not yet handed off").read_line(&mut line).unwrap() == 0 {
                panic!("the job ended before training: {}", self.stderr());
            }
            read.push_str(&line);
            steps += usize::from(line.contains("Train Epoch"));
        }
        read
    }

    /// Hands the rest of stdout to a thread that reads it to the end (so the job never blocks on
    /// a full pipe); the thread returns `read` followed by the rest.
    fn rest_of_stdout(&mut self, mut read: String) -> std::thread::JoinHandle<String> {
        let mut out = self.out.take().expect("stdout not yet handed off");
        std::thread::spawn(move || {
            let _ = out.read_to_string(&mut read);
            read
        })
    }

    /// Waits for the job to end; kills it and panics with `what` after `limit`.
    fn wait(&mut self, limit: Duration, what: &str) -> std::process::ExitStatus {
        let start = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st;
            }
            if start.elapsed() > limit {
                let _ = self.child.kill();
                panic!("{what}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The whole stderr (once the job has ended).
    fn stderr(&mut self) -> String {
        self.err.take().map(|t| t.join().unwrap()).unwrap_or_default()
    }
}

/// Freezes rank `victim` (SIGSTOP) after a few logged steps of a W-rank job with a 4 s
/// collective timeout; the job must end within timeout + 10 s, naming the frozen rank.
fn sigstop_drill(w: usize, victim: usize) {
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join(format!("sigstop-{w}-{}.json", std::process::id()));
    let marker = marker.to_str().unwrap().to_string();
    let mut job = Job::start(w, &["--device", "cpu", "--timeout", "4", "--log-interval", "1", "--metrics-json", &marker]);
    // Wait for rank 0 to log its 4th step, then freeze the victim.
    job.wait_steps(4);
    let pid = rank_pid(&marker, victim).expect("the victim's process");
    assert_eq!(unsafe_free_kill(pid, "STOP"), 0);
    let frozen = Instant::now();
    let _ = job.rest_of_stdout(String::new());
    let status = loop {
        if let Some(st) = job.child.try_wait().unwrap() {
            break st;
        }
        if frozen.elapsed() > Duration::from_secs(60) {
            let _ = job.child.kill();
            let _ = unsafe_free_kill(pid, "KILL");
            panic!("the job still runs 60 s after rank {victim} was frozen");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let took = frozen.elapsed();
    let stderr = job.stderr();
    eprintln!("W={w}: the job ended {took:?} after rank {victim} was frozen");
    assert!(!status.success(), "{stderr}");
    assert!(took < Duration::from_secs(4 + 10), "took {took:?}:\n{stderr}");
    assert!(stderr.contains("did not complete within the collective timeout of 4 s"), "{stderr}");
    assert!(stderr.contains(&format!("rank {victim} last seen at step ")), "{stderr}");
    assert!(stderr.contains("is stopped: SIGSTOP or a debugger"), "{stderr}");
    assert!(stderr.contains("Where the ranks were (progress records):"), "the summary names the stuck rank:\n{stderr}");
    assert_no_leftovers(&marker);
}

/// `kill -SIG pid` through the kill(1) command (no unsafe in tests).
fn unsafe_free_kill(pid: u32, sig: &str) -> i32 {
    Command::new("kill").arg(format!("-{sig}")).arg(pid.to_string()).status().map(|s| s.code().unwrap_or(1)).unwrap_or(1)
}

#[test]
fn a_frozen_rank_ends_the_job_at_two_ranks() {
    sigstop_drill(2, 1);
}

#[test]
fn a_frozen_rank_ends_the_job_at_three_ranks() {
    sigstop_drill(3, 2);
}

/// A rank stopped (SIGSTOP) for 2 s and continued (SIGCONT) well within the 10 s collective
/// timeout — a debugger's breakpoint, a `kill -STOP` by mistake — costs the job 2 s, not its
/// life: it completes, exit 0, with the test-set line.
#[test]
fn a_rank_stopped_and_continued_within_the_timeout_does_not_end_the_job() {
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join(format!("sigcont-{}.json", std::process::id()));
    let marker = marker.to_str().unwrap().to_string();
    let mut job =
        Job::start(2, &["--device", "cpu", "--timeout", "10", "--log-interval", "1", "--max-steps", "30", "--metrics-json", &marker]);
    let stdout = job.wait_steps(4);
    let pid = rank_pid(&marker, 1).expect("rank 1's process");
    assert_eq!(unsafe_free_kill(pid, "STOP"), 0);
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(unsafe_free_kill(pid, "CONT"), 0);
    let t_out = job.rest_of_stdout(stdout);
    let status = job.wait(Duration::from_secs(120), "the job still runs 120 s after rank 1 was continued");
    let (stdout, stderr) = (t_out.join().unwrap(), job.stderr());
    assert!(status.success(), "{status}:\n{stdout}\n{stderr}");
    assert!(stdout.contains("Test set: Average loss: ") && stdout.contains("(rank 0 of 2)"), "{stdout}\n{stderr}");
    assert!(!stderr.contains("timed out") && !stderr.contains("did not complete"), "{stderr}");
    assert_no_leftovers(&marker);
}

fn mpirun(n: usize) -> Command {
    let mut cmd = Command::new("mpirun");
    cmd.args(["-n", &n.to_string(), "--oversubscribe", "--bind-to", "none"])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    cmd
}

#[test]
fn a_diverging_run_stops_naming_step_and_rank() {
    let start = Instant::now();
    let out = mpirun(2).arg(BIN).args(["--device", "cpu", "--lr", "1e9", "--log-interval", "0", "--max-steps", "50"]).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("training diverged: the loss is ") && text.contains(" at step "), "{text}");
    assert!(text.contains(" on rank 0 ") || text.contains(" on rank 1 "), "{text}");
    assert!(!text.contains("Test set"), "no evaluation of a diverged model:\n{text}");
    assert!(start.elapsed() < Duration::from_secs(30), "{text}");
    // Turned off, the same run trains on (to a NaN loss) and ends normally.
    let out = mpirun(2)
        .arg(BIN)
        .args(["--device", "cpu", "--lr", "1e9", "--log-interval", "0", "--max-steps", "5", "--allow-non-finite"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn a_batch_larger_than_a_ranks_share_is_refused() {
    let out = mpirun(2).arg(BIN).args(["--device", "cpu", "--batch-size", "30001"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("invalid value \"30001\" for --batch-size: at most 30000, one rank's share of the 60000 training images at world size 2 (60000 / 2)"),
        "{text}"
    );
}

/// A non-finite value that one rank alone sees — its loss, or under FSDP its gradient shard —
/// stops every rank with the same error naming that rank and the step (the ranks agree with
/// one 8-byte all-reduce per step), and the job exits non-zero. The value is injected on one
/// rank through the test-only `LADDER_TEST_NONFINITE`, set for it alone (mpirun's MPMD form).
#[test]
fn a_non_finite_value_on_one_rank_is_named_alike_on_every_rank() {
    let cases = [
        (2, 1, "fsdp-full-shard", "loss@3", "training diverged: the loss is NaN at step 3 on rank 1;"),
        (
            3,
            2,
            "fsdp-full-shard",
            "gradient@4",
            "training diverged: the gradient is NaN or infinite at step 4 on rank 2 (its gradient, or its shard of the reduced gradients; the loss was finite on every rank);",
        ),
        (3, 1, "ddp", "loss@2", "training diverged: the loss is NaN at step 2 on rank 1;"),
    ];
    for (w, victim, strategy, inject, expected) in cases {
        let args = ["--device", "cpu", "--strategy", strategy, "--max-steps", "20", "--log-interval", "0"];
        let mut cmd = mpmd_with_env_on(w, victim, &format!("LADDER_TEST_NONFINITE={inject}"), &[], &args);
        let out = cmd.output().unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        let case = format!("W={w} {strategy} {inject} on rank {victim}");
        assert!(!out.status.success(), "{case}:\n{text}");
        // Every rank prints the same error, prefixed with its own rank.
        let errors: Vec<&str> = text.lines().filter(|l| l.starts_with("error on rank ")).collect();
        for r in 0..w {
            let line = errors.iter().find(|l| l.starts_with(&format!("error on rank {r} of {w}: ")));
            let line = line.unwrap_or_else(|| panic!("{case}: rank {r} printed no error:\n{text}"));
            assert!(line.contains(expected), "{case}: rank {r}: {line}\n{text}");
        }
        assert!(!text.contains("Test set"), "{case}: no evaluation of a diverged model:\n{text}");
    }
}

/// A batch whose activations cannot fit in this machine's free memory is refused before it is
/// allocated, with the estimate and the largest batch that fits — not ended by the OOM killer.
/// `--batch-size 30000` at 2 ranks needs ~57 GiB at width 128; on a machine with more free
/// memory than that, a wider fc1 (`--width`) makes it clearly too large. Nothing is allocated.
#[test]
fn a_batch_too_large_for_free_memory_is_refused_before_it_is_allocated() {
    use ladder_core::memory::{activation_bytes_per_sample, mem_available_bytes};
    let available = mem_available_bytes().expect("MemAvailable on Linux");
    let width = [128i64, 4096, 65_536]
        .into_iter()
        .find(|&w| 2 * 30_000 * activation_bytes_per_sample(w) > 2 * available)
        .expect("a width that cannot fit");
    let start = Instant::now();
    let out = mpirun(2)
        .arg(BIN)
        .args(["--device", "cpu", "--batch-size", "30000", "--width", &width.to_string(), "--log-interval", "0"])
        .output()
        .unwrap();
    let took = start.elapsed();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("--batch-size 30000 does not fit in memory: one training step's activations"), "{text}");
    assert!(text.contains(&format!("fc1 width {width};")) && text.contains("for the 2 rank(s) on this node"), "{text}");
    assert!(text.contains("MiB is available (MemAvailable); the largest --batch-size that fits is "), "{text}");
    assert!(!text.contains("Killed") && out.status.code() != Some(137), "{text}");
    assert!(took < Duration::from_secs(30), "took {took:?}: {text}");
}

/// `mpirun` (MPMD form) of a `w`-rank level-1 job with `args`, in which rank `victim` alone gets
/// the environment variable `var` (`NAME=value`); each rank's command is `prefix` + level 1.
fn mpmd_with_env_on(w: usize, victim: usize, var: &str, prefix: &[&str], args: &[&str]) -> Command {
    let mut cmd = Command::new("mpirun");
    cmd.args(["--oversubscribe", "--bind-to", "none"]);
    for r in 0..w {
        if r > 0 {
            cmd.arg(":");
        }
        cmd.args(["-n", "1"]);
        if r == victim {
            cmd.args(["-x", var]);
        }
        cmd.args(prefix).arg(BIN).args(args);
    }
    cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1").env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1").env("OMP_NUM_THREADS", "1");
    cmd
}

/// Level 1 for two steps, quietly.
const TWO_STEPS: [&str; 6] = ["--device", "cpu", "--max-steps", "2", "--log-interval", "0"];

/// An error only rank `victim` meets after set-up (its MNIST_DIR, set for it alone through
/// mpirun's MPMD form, is empty) is printed at once with that rank, and the job ends without
/// the shutdown wait: at W = 2 and 3, for rank 0 and for rank 1.
#[test]
fn one_ranks_error_after_setup_is_printed_with_its_rank_and_ends_the_job() {
    let empty = tempfile::tempdir().unwrap();
    for (w, victim) in [(2, 0), (2, 1), (3, 0), (3, 1)] {
        let mut cmd = mpmd_with_env_on(w, victim, &format!("MNIST_DIR={}", empty.path().display()), &[], &TWO_STEPS);
        let start = Instant::now();
        let out = cmd.output().unwrap();
        let took = start.elapsed();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(!out.status.success(), "W={w} victim {victim}:\n{text}");
        assert!(
            text.contains(&format!("error on rank {victim} of {w}")) && text.contains("file not found"),
            "W={w} victim {victim}:\n{text}"
        );
        assert!(took < Duration::from_secs(25), "W={w} victim {victim}: took {took:?} (the shutdown wait is 30 s)");
    }
}

/// A failed job under a bare `mpirun` leaves no progress record behind: the rank that fails
/// removes its own at exit, the ranks mpirun then stops with SIGTERM remove theirs in a signal
/// handler (ladder-run removes its own directory; SIGKILLed jobs are swept by the next one —
/// see `ladder_core::dist::progress`). Each rank is started through `sh`, which prints the
/// Open MPI job id that names the job's directory, `/dev/shm/ladder-progress-<job id>`.
#[test]
fn a_failed_bare_mpirun_job_leaves_no_progress_files() {
    let empty = tempfile::tempdir().unwrap();
    let base = ladder_core::dist::progress::shm_base();
    for (w, victim) in [(2, 1), (3, 0)] {
        let wrapper = ["sh", "-c", "echo \"job id $OMPI_MCA_ess_base_jobid\" >&2; exec \"$0\" \"$@\""];
        let mut cmd = mpmd_with_env_on(w, victim, &format!("MNIST_DIR={}", empty.path().display()), &wrapper, &TWO_STEPS);
        let out = cmd.output().unwrap();
        let text = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && text.contains(&format!("error on rank {victim} of {w}")), "W={w}:\n{text}");
        let job = text.lines().find_map(|l| l.strip_prefix("job id ")).expect("the job id").trim().to_string();
        assert!(!job.is_empty() && job.chars().all(|c| c.is_ascii_alphanumeric()), "job id {job:?}");
        let dir = base.join(format!("ladder-progress-{job}"));
        assert!(
            !dir.exists(),
            "W={w}, error on rank {victim}: {} is left: {:?}",
            dir.display(),
            std::fs::read_dir(&dir).map(|d| d.flatten().map(|e| e.file_name()).collect::<Vec<_>>())
        );
    }
}
