//! `ladder-run` as a real process: environments, prefixes, failure drills, signals.
//!
//! PROGRAM is `sh -c '...'` or `python3 -c '...'`; no GPU is needed (backend nccl only decides
//! how the ranks are spawned). Tests that start jobs run one at a time (2-core machine) so the
//! generous time bounds stay meaningful.

use clap::Parser;
use ladder_core::launch::{run, LaunchBackend, LaunchConfig};
use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_ladder-run");
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

#[derive(Debug)]
struct Output {
    code: Option<i32>,
    stdout: String,
    stderr: String,
    elapsed: Duration,
}

/// Runs ladder-run with `args`; fails the test if it runs past `limit`.
fn ladder_run(args: &[&str], limit: Duration) -> Output {
    let start = Instant::now();
    let mut child =
        Command::new(BIN).args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("start ladder-run");
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let t_out = std::thread::spawn(move || {
        let mut s = String::new();
        out.read_to_string(&mut s).unwrap();
        s
    });
    let t_err = std::thread::spawn(move || {
        let mut s = String::new();
        err.read_to_string(&mut s).unwrap();
        s
    });
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!("ladder-run {args:?} still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let elapsed = start.elapsed();
    Output { code: status.code(), stdout: t_out.join().unwrap(), stderr: t_err.join().unwrap(), elapsed }
}

/// A number unique to this test run, usable as `sleep`'s argument and found in /proc.
fn marker() -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    format!("60.{}{:03}", std::process::id(), N.fetch_add(1, Ordering::SeqCst))
}

/// Live (non-zombie) processes whose command line contains `marker`.
fn processes_with(marker: &str) -> Vec<String> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else { continue };
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if !cmdline.contains(marker) {
            continue;
        }
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        let zombie = stat.rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with('Z'));
        if !zombie {
            found.push(format!("{name}: {cmdline}"));
        }
    }
    found
}

/// Asserts that no process of the job is left (they get a moment to be reaped).
fn assert_no_leftovers(marker: &str) {
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let left = processes_with(marker);
        if left.is_empty() {
            return;
        }
        if Instant::now() > deadline {
            panic!("processes of the job are still alive: {left:#?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn sorted_lines(s: &str) -> Vec<String> {
    let mut v: Vec<String> = s.lines().map(str::to_string).collect();
    v.sort();
    v
}

const ENV_SCRIPT: &str = r#"echo "RANK=$RANK WORLD_SIZE=$WORLD_SIZE LOCAL_RANK=$LOCAL_RANK LOCAL_WORLD_SIZE=$LOCAL_WORLD_SIZE OMPI_COMM_WORLD_RANK=$OMPI_COMM_WORLD_RANK MASTER=$MASTER_ADDR:$MASTER_PORT"; echo "stderr of $RANK" >&2"#;

fn check_env_run(backend: &str, n: usize) {
    let port = std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap().local_addr().unwrap().port().to_string();
    let np = n.to_string();
    let out = ladder_run(
        &["--backend", backend, "--nproc-per-node", &np, "--master-port", &port, "sh", "-c", ENV_SCRIPT],
        Duration::from_secs(60),
    );
    assert_eq!(out.code, Some(0), "{out:#?}");
    let expected: Vec<String> = (0..n)
        .map(|r| {
            let ompi = if backend == "mpi" { r.to_string() } else { String::new() };
            format!(
                "[rank{r}]: RANK={r} WORLD_SIZE={n} LOCAL_RANK={r} LOCAL_WORLD_SIZE={n} OMPI_COMM_WORLD_RANK={ompi} MASTER=127.0.0.1:{port}"
            )
        })
        .collect();
    assert_eq!(sorted_lines(&out.stdout), expected, "{out:#?}");
    let expected_err: Vec<String> = (0..n).map(|r| format!("[rank{r}]: stderr of {r}")).collect();
    assert_eq!(sorted_lines(&out.stderr), expected_err, "{out:#?}");
}

#[test]
fn mpi_two_ranks_get_the_mpirun_and_torchrun_environment() {
    let _g = serial();
    check_env_run("mpi", 2);
}

#[test]
fn mpi_three_ranks_oversubscribe_two_cores() {
    let _g = serial();
    check_env_run("mpi", 3);
}

#[test]
fn nccl_backend_spawns_ranks_with_the_torchrun_environment() {
    let _g = serial();
    check_env_run("nccl", 3);
}

#[test]
fn a_free_master_port_is_picked_and_shared() {
    let _g = serial();
    for backend in ["mpi", "nccl"] {
        let out = ladder_run(
            &["--backend", backend, "--nproc_per_node", "2", "sh", "-c", "echo $MASTER_ADDR $MASTER_PORT"],
            Duration::from_secs(60),
        );
        assert_eq!(out.code, Some(0), "{out:#?}");
        let ports: Vec<u16> =
            out.stdout.lines().map(|l| l.rsplit(' ').next().unwrap().parse().unwrap_or_else(|_| panic!("no port in {l:?}"))).collect();
        assert_eq!(ports.len(), 2, "{out:#?}");
        assert_eq!(ports[0], ports[1], "{out:#?}");
        assert!(out.stdout.lines().all(|l| l.contains(" 127.0.0.1 ")), "{out:#?}");
    }
}

#[test]
fn no_prefix_leaves_lines_alone() {
    let _g = serial();
    let out = ladder_run(&["--no-prefix", "--nproc-per-node", "2", "sh", "-c", "echo plain; printf 'no newline'"], Duration::from_secs(60));
    assert_eq!(out.code, Some(0), "{out:#?}");
    assert_eq!(sorted_lines(&out.stdout), vec!["no newline", "no newline", "plain", "plain"], "{out:#?}");
}

/// Runs a job in which rank 1 fails and the others sleep; checks the summary, the time bound
/// and that nothing of the job survives.
fn failure_drill(backend: &str, n: usize, fail: &str, expect: &[&str]) {
    let m = marker();
    let script = format!(r#"if [ "$RANK" = 1 ]; then sleep 0.5; {fail}; else sleep {m}; fi"#);
    let np = n.to_string();
    let out = ladder_run(&["--backend", backend, "--nproc-per-node", &np, "sh", "-c", &script], Duration::from_secs(60));
    assert_eq!(out.code, Some(1), "{out:#?}");
    assert!(out.elapsed < Duration::from_secs(10), "took {:?}: {out:#?}", out.elapsed);
    assert!(out.stderr.contains("ladder-run: error: rank 1 (local_rank 1, host "), "{}", out.stderr);
    assert!(out.stderr.contains("Root Cause (first observed failure):"), "{}", out.stderr);
    assert!(out.stderr.contains("  rank      : 1 (local_rank: 1)"), "{}", out.stderr);
    assert!(out.stderr.contains("<NO_OTHER_FAILURES>"), "only rank 1 failed on its own: {}", out.stderr);
    for e in expect {
        assert!(out.stderr.contains(e), "expected {e:?} in:\n{}", out.stderr);
    }
    assert!(!out.stderr.contains("@@ladder-run-failure@@"), "the failure record is consumed: {}", out.stderr);
    assert_no_leftovers(&m);
}

#[test]
fn mpi_rank_exiting_3_stops_the_job() {
    let _g = serial();
    failure_drill("mpi", 3, "echo boom >&2; exit 3", &["exitcode  : 3 (pid: ", "    boom\n", "[rank1]: boom"]);
}

#[test]
fn mpi_rank_killed_by_sigkill_stops_the_job() {
    let _g = serial();
    failure_drill("mpi", 2, "echo 'about to die' >&2; kill -9 $$", &["exitcode  : -9 (SIGKILL) (pid: ", "    about to die\n"]);
}

#[test]
fn nccl_rank_exiting_3_stops_the_job() {
    let _g = serial();
    failure_drill("nccl", 3, "echo boom >&2; exit 3", &["exitcode  : 3 (pid: ", "    boom\n"]);
}

#[test]
fn nccl_rank_killed_by_sigkill_stops_the_job() {
    let _g = serial();
    failure_drill("nccl", 2, "kill -9 $$", &["exitcode  : -9 (SIGKILL) (pid: ", "stderr    : <empty>"]);
}

#[test]
fn rank_raising_mid_run_is_reported_with_its_traceback() {
    let _g = serial();
    let m = marker();
    let code = format!(
        "import os, time\nr = int(os.environ['RANK'])\nprint('step 1 on', r, flush=True)\nif r == 1:\n    time.sleep(0.5)\n    raise RuntimeError('loss is NaN at step 2')\ntime.sleep({m})\n"
    );
    let out = ladder_run(&["--backend", "nccl", "--nproc-per-node", "2", "python3", "-c", &code], Duration::from_secs(60));
    assert_eq!(out.code, Some(1), "{out:#?}");
    assert!(out.elapsed < Duration::from_secs(10), "took {:?}", out.elapsed);
    assert!(out.stdout.contains("[rank1]: step 1 on 1"), "{out:#?}");
    assert!(out.stderr.contains("exitcode  : 1 (pid: "), "{}", out.stderr);
    assert!(out.stderr.contains("    RuntimeError: loss is NaN at step 2\n"), "{}", out.stderr);
    assert!(out.stderr.contains("    Traceback (most recent call last):\n"), "{}", out.stderr);
    assert_no_leftovers(&m);
}

/// Starts ladder-run with `args`, waits for `ready` lines ending in `]: ready` on its stdout,
/// sends it `signal` (`TERM`, `INT`) and waits (at most 30 s) for it to end: its output, and
/// the time from the signal to its end in `elapsed`.
fn interrupt(args: &[&str], ready: usize, signal: &str) -> Output {
    let mut child =
        Command::new(BIN).args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("start ladder-run");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut stdout = String::new();
    for _ in 0..ready {
        let l = lines.next().expect("a rank's ready line").unwrap();
        assert!(l.ends_with("]: ready"), "{l}");
        stdout.push_str(&l);
        stdout.push('\n');
    }
    let start = Instant::now();
    // Signalled through the kill command.
    let st = Command::new("kill").args([&format!("-{signal}"), &child.id().to_string()]).status().unwrap();
    assert!(st.success());
    let rest = std::thread::spawn(move || lines.map_while(|l| l.ok()).map(|l| l + "\n").collect::<String>());
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if start.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            panic!("ladder-run did not stop within 30 s of SIG{signal}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let elapsed = start.elapsed();
    let mut stderr = String::new();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    stdout.push_str(&rest.join().unwrap());
    Output { code: status.code(), stdout, stderr, elapsed }
}

/// SIGTERM to the launcher reaches every rank, which dies of it; ladder-run exits 128 + 15 and
/// leaves nothing behind.
fn signal_drill(backend: &str) {
    let m = marker();
    let script = format!("echo ready; sleep {m}");
    let out = interrupt(&["--backend", backend, "--nproc-per-node", "2", "sh", "-c", &script], 2, "TERM");
    assert_eq!(out.code, Some(128 + 15), "{out:#?}");
    assert!(out.elapsed < Duration::from_secs(8), "took {:?}", out.elapsed);
    assert!(
        out.stderr.contains("ladder-run: received SIGTERM; forwarded it to all 2 ranks, which were ended by SIGTERM; exiting with 143\n"),
        "{}",
        out.stderr
    );
    assert_no_leftovers(&m);
}

/// A rank program that, on SIGTERM, takes 1.5 s to write its checkpoint then exits 143 (as the
/// levels do), and on SIGINT exits 130.
fn preempted_script(m: &str) -> String {
    format!(
        r#"trap 'sleep 1.5; echo "saved by $RANK after restart $TORCHELASTIC_RESTART_COUNT"; kill $! 2>/dev/null; exit 143' TERM
trap 'echo "SIGINT reached $RANK"; kill $! 2>/dev/null; exit 130' INT
echo ready; sleep {m} & wait"#
    )
}

/// As torchrun: SIGTERM to the launcher is forwarded to every rank, which gets the shutdown
/// timeout to save — longer than mpirun's own one second before SIGKILL — and the launcher exits
/// with the ranks' code, 143, without restarting them under --max-restarts. SIGINT is forwarded
/// as SIGINT.
fn preemption_drill(backend: &str) {
    let m = marker();
    let script = preempted_script(&m);
    let args = ["--backend", backend, "--nproc-per-node", "2", "--max-restarts", "2", "sh", "-c", &script];
    let out = interrupt(&args, 2, "TERM");
    assert_eq!(out.code, Some(143), "{out:#?}");
    for r in 0..2 {
        assert!(out.stdout.contains(&format!("[rank{r}]: saved by {r} after restart 0\n")), "{out:#?}");
    }
    assert_eq!(out.stdout.matches("]: ready").count(), 2, "the ranks were restarted: {out:#?}");
    assert!(!out.stderr.contains("restarting"), "{}", out.stderr);
    assert!(out.stderr.contains("ladder-run: forwarding SIGTERM to the 2 ranks; they get 30 s to exit before SIGKILL"), "{}", out.stderr);
    assert!(
        out.stderr.contains("ladder-run: received SIGTERM; forwarded it to all 2 ranks, which exited with 143; exiting with 143\n"),
        "{}",
        out.stderr
    );
    assert_no_leftovers(&m);

    let m = marker();
    let script = preempted_script(&m);
    let out = interrupt(&["--backend", backend, "--nproc-per-node", "2", "sh", "-c", &script], 2, "INT");
    assert_eq!(out.code, Some(130), "{out:#?}");
    for r in 0..2 {
        assert!(out.stdout.contains(&format!("[rank{r}]: SIGINT reached {r}\n")), "{out:#?}");
    }
    assert!(
        out.stderr.contains("ladder-run: received SIGINT; forwarded it to all 2 ranks, which exited with 130; exiting with 130"),
        "{}",
        out.stderr
    );
    assert_no_leftovers(&m);
}

/// Ranks that ignore SIGTERM are killed once --shutdown-timeout has passed; the launcher exits
/// with their code, 128 + SIGKILL.
fn shutdown_timeout_drill(backend: &str) {
    let m = marker();
    let script = format!("trap '' TERM; echo ready; sleep {m}");
    let out = interrupt(&["--backend", backend, "--nproc-per-node", "2", "--shutdown-timeout", "1", "sh", "-c", &script], 2, "TERM");
    assert_eq!(out.code, Some(128 + 9), "{out:#?}");
    assert!(
        out.stderr.contains(
            "ladder-run: received SIGTERM; forwarded it to all 2 ranks, which were killed by SIGKILL (after the 1 s shutdown timeout); exiting with 137"
        ),
        "{}",
        out.stderr
    );
    assert!(out.elapsed >= Duration::from_secs(1), "killed before the timeout: {:?}", out.elapsed);
    assert_no_leftovers(&m);
}

#[test]
fn sigterm_is_forwarded_for_a_checkpoint_and_not_restarted_mpi() {
    let _g = serial();
    preemption_drill("mpi");
}

#[test]
fn sigterm_is_forwarded_for_a_checkpoint_and_not_restarted_nccl() {
    let _g = serial();
    preemption_drill("nccl");
}

#[test]
fn ranks_outliving_the_shutdown_timeout_are_killed_mpi() {
    let _g = serial();
    shutdown_timeout_drill("mpi");
}

#[test]
fn ranks_outliving_the_shutdown_timeout_are_killed_nccl() {
    let _g = serial();
    shutdown_timeout_drill("nccl");
}

/// Issue 27: under a terminal (a pseudo-terminal from script(1), 100 columns), the ranks learn
/// its width less their `[rankN]: ` prefix (LADDER_TTY_COLUMNS), and a carriage-return redraw
/// reaches the terminal as it is written, the prefix after each `\r`; without a terminal the
/// variable is not set.
#[test]
fn a_terminal_launcher_passes_its_width_and_redraws_through() {
    let _g = serial();
    let program = r#"echo "cols=$LADDER_TTY_COLUMNS"; if [ "$RANK" = 0 ]; then printf '\r 50%%'; sleep 0.3; printf '\r100%%\n'; fi"#;
    let inner = format!("stty cols 100 rows 30; {BIN} --nproc-per-node 2 sh -c '{}'", program.replace('\'', r"'\''"));
    let out = Command::new("script").args(["-qec", &inner, "/dev/null"]).stdin(Stdio::null()).output().expect("script(1), from util-linux");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    for r in 0..2 {
        assert!(text.contains(&format!("[rank{r}]: cols=91\r\n")), "{text:?}");
    }
    assert!(text.contains("\r[rank0]:  50%") && text.contains("\r[rank0]: 100%\r\n"), "{text:?}");

    let out = ladder_run(&["--nproc-per-node", "2", "sh", "-c", program], Duration::from_secs(30));
    assert_eq!(out.code, Some(0), "{out:#?}");
    assert!(out.stdout.contains("[rank0]: cols=\n") && out.stdout.contains("[rank1]: cols=\n"), "{out:#?}");
}

#[test]
fn sigterm_to_the_launcher_reaches_every_mpi_rank() {
    let _g = serial();
    signal_drill("mpi");
}

#[test]
fn sigterm_to_the_launcher_reaches_every_nccl_rank() {
    let _g = serial();
    signal_drill("nccl");
}

/// `--max-restarts 2`: rank 1 fails in the first two attempts; every rank of each attempt
/// sees its restart count, the job then succeeds. With every attempt failing, the summary
/// lists each attempt and the launcher exits 1.
fn restart_drill(backend: &str) {
    let script = r#"echo "count $TORCHELASTIC_RESTART_COUNT of $TORCHELASTIC_MAX_RESTARTS"; if [ "$RANK" = 1 ] && [ "$TORCHELASTIC_RESTART_COUNT" -lt 2 ]; then sleep 0.3; echo "fail $TORCHELASTIC_RESTART_COUNT" >&2; exit 3; fi"#;
    let out =
        ladder_run(&["--backend", backend, "--nproc-per-node", "2", "--max-restarts", "2", "sh", "-c", script], Duration::from_secs(60));
    assert_eq!(out.code, Some(0), "{out:#?}");
    for attempt in 0..3 {
        assert!(out.stdout.contains(&format!("[rank1]: count {attempt} of 2")), "attempt {attempt}: {out:#?}");
    }
    assert!(out.stdout.contains("[rank0]: count 2 of 2"), "{out:#?}");
    assert!(
        out.stderr.contains("ladder-run: attempt 1 of 3 failed; every rank stopped; restarting all 2 ranks (2 restarts left)"),
        "{}",
        out.stderr
    );
    assert!(
        out.stderr.contains("ladder-run: attempt 2 of 3 failed; every rank stopped; restarting all 2 ranks (1 restart left)"),
        "{}",
        out.stderr
    );
    assert!(out.stderr.contains("[rank1]: fail 1"), "{}", out.stderr);

    let script = r#"if [ "$RANK" = 1 ]; then sleep 0.3; exit 3; fi; sleep 5"#;
    let out =
        ladder_run(&["--backend", backend, "--nproc-per-node", "2", "--max-restarts", "1", "sh", "-c", script], Duration::from_secs(60));
    assert_eq!(out.code, Some(1), "{out:#?}");
    assert!(out.elapsed < Duration::from_secs(20), "took {:?}", out.elapsed);
    assert!(
        out.stderr.contains("Every attempt failed (--max-restarts 1):\n  attempt 1 of 2: rank 1 (local_rank 1, host "),
        "{}",
        out.stderr
    );
    assert!(out.stderr.contains("\n  attempt 2 of 2: rank 1 (local_rank 1, host "), "{}", out.stderr);
}

#[test]
fn max_restarts_restarts_every_mpi_rank() {
    let _g = serial();
    restart_drill("mpi");
}

#[test]
fn max_restarts_restarts_every_nccl_rank() {
    let _g = serial();
    restart_drill("nccl");
}

#[test]
fn program_not_found_is_named() {
    let out = ladder_run(&["--nproc-per-node", "2", "no-such-program-7f3a"], Duration::from_secs(20));
    assert_eq!(out.code, Some(1), "{out:#?}");
    assert!(
        out.stderr
            .starts_with("ladder-run: error: invalid value \"no-such-program-7f3a\" for PROGRAM: not found; expected a program in PATH ("),
        "{}",
        out.stderr
    );
    let out = ladder_run(&["./no/such/dir/train"], Duration::from_secs(20));
    assert_eq!(out.code, Some(1), "{out:#?}");
    assert!(out.stderr.contains("./no/such/dir/train does not exist; expected a path to an executable file"), "{}", out.stderr);
}

/// Issue 27: `--nproc-per-node auto` (torchrun's) counts the CUDA devices, else the cores; a
/// program named without a path that is not in PATH but here is named as such.
#[test]
fn nproc_auto_and_a_program_here() {
    let parse = |n: &str| LaunchConfig::try_parse_from(["ladder-run", "--nproc-per-node", n, "p"]).map(|c| c.nproc_per_node);
    let gpus = if ladder_core::device::cuda_available() { tch::Cuda::device_count() as usize } else { 0 };
    assert_eq!(parse("auto").unwrap(), if gpus > 0 { gpus } else { ladder_core::device::cores() });
    assert_eq!(parse("cpu").unwrap(), ladder_core::device::cores());
    assert_eq!(parse("gpu").is_ok(), gpus > 0);
    assert_eq!(parse("3").unwrap(), 3);

    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("t.py"), "print(1)\n").unwrap();
    let out = Command::new(BIN).args(["--nproc-per-node", "2", "t.py"]).current_dir(dir.path()).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).trim(),
        "ladder-run: error: invalid value \"t.py\" for PROGRAM: not found in PATH; ./t.py exists here but is not executable \
         (chmod +x t.py), and a name without '/' is looked up in PATH only"
    );
}

#[test]
fn help_snapshot() {
    let out = ladder_run(&["--help"], Duration::from_secs(20));
    assert_eq!(out.code, Some(0));
    assert!(!out.stdout.contains("rank-worker"), "the worker mode is hidden");
    insta::assert_snapshot!(out.stdout);
}

#[test]
fn command_line_parsing() {
    // Everything after PROGRAM belongs to PROGRAM, flags included.
    let cfg = LaunchConfig::try_parse_from(["ladder-run", "--nproc_per_node", "4", "--master_port", "1234", "train", "--help", "-n", "3"])
        .unwrap();
    assert_eq!(cfg.nproc_per_node, 4);
    assert_eq!(cfg.master_port, Some(1234));
    assert_eq!(cfg.program(), "train");
    assert_eq!(cfg.args(), ["--help", "-n", "3"]);
    assert_eq!(cfg.backend, LaunchBackend::Mpi);
    let cfg =
        LaunchConfig::try_parse_from(["ladder-run", "--node_rank", "1", "--nnodes", "2", "--master_addr", "n0", "--backend", "nccl", "p"])
            .unwrap();
    assert_eq!((cfg.node_rank, cfg.nnodes, cfg.master_addr.as_deref(), cfg.backend), (1, 2, Some("n0"), LaunchBackend::Nccl));
    // torchrun's --shutdown-timeout, default 30 s.
    assert_eq!(cfg.shutdown_timeout, 30.0);
    let cfg = LaunchConfig::try_parse_from(["ladder-run", "--shutdown_timeout", "2.5", "p"]).unwrap();
    assert_eq!(cfg.shutdown_timeout, 2.5);
    // As a config file: missing fields take the defaults.
    let cfg: LaunchConfig = serde_json::from_str(r#"{"nproc_per_node": 2, "backend": "nccl", "command": ["true", "-x"]}"#).unwrap();
    assert_eq!((cfg.nproc_per_node, cfg.nnodes, cfg.backend, cfg.no_prefix), (2, 1, LaunchBackend::Nccl, false));
    assert_eq!((cfg.program(), cfg.args()), ("true", &["-x".to_string()][..]));
}

/// Bad flags: clap's messages and the launcher's own checks (which fail before starting
/// anything).
#[test]
fn configuration_errors_snapshot() {
    let mut report = String::new();
    for argv in [
        &["ladder-run", "--nproc-per-node", "0", "p"][..],
        &["ladder-run", "--nnodes", "x", "p"],
        &["ladder-run", "--master-port", "0", "p"],
        &["ladder-run", "--backend", "gloo", "p"],
        &["ladder-run", "--nproc-per-node", "2"],
        &["ladder-run", "--nproc-per-node", "many", "p"],
        &["ladder-run", "--shutdown-timeout", "soon", "p"],
    ] {
        let e = LaunchConfig::try_parse_from(argv).unwrap_err();
        let text = e.render().to_string();
        let text: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
        report.push_str(&format!("{argv:?}\n  {}\n", text.join("\n  ")));
    }
    let base = LaunchConfig { command: vec!["true".into()], ..LaunchConfig::default() };
    let cases = [
        (
            "node rank outside nnodes",
            LaunchConfig { nnodes: 2, node_rank: 2, backend: LaunchBackend::Nccl, master_addr: Some("n0".into()), ..base.clone() },
        ),
        ("mpi over nodes without hostfile", LaunchConfig { nnodes: 2, ..base.clone() }),
        ("mpi with a node rank", LaunchConfig { nnodes: 2, node_rank: 1, hostfile: Some("/etc/hostname".into()), ..base.clone() }),
        ("missing hostfile", LaunchConfig { nnodes: 2, hostfile: Some("/no/such/hostfile".into()), ..base.clone() }),
        ("nccl with a hostfile", LaunchConfig { backend: LaunchBackend::Nccl, hostfile: Some("/etc/hostname".into()), ..base.clone() }),
        ("nccl over nodes without master addr", LaunchConfig { backend: LaunchBackend::Nccl, nnodes: 2, ..base.clone() }),
        ("no program", LaunchConfig { command: vec![], ..base.clone() }),
        // Issue 27: a flag ladder-run does not know lands where PROGRAM belongs.
        ("torchrun's --standalone", LaunchConfig { command: vec!["--standalone".into(), "p".into()], ..base.clone() }),
        ("torchrun's --rdzv_endpoint=VALUE", LaunchConfig { command: vec!["--rdzv_endpoint=n0:29400".into(), "p".into()], ..base.clone() }),
        ("a near miss", LaunchConfig { command: vec!["--nproc-per-nod".into(), "2".into(), "p".into()], ..base.clone() }),
        ("no flag of ladder-run", LaunchConfig { command: vec!["--frobnicate".into(), "p".into()], ..base.clone() }),
    ];
    for (what, cfg) in cases {
        let e = run(&cfg).expect_err(what);
        report.push_str(&format!("{what}\n  {e}\n"));
    }
    insta::assert_snapshot!(report);
}

/// `ladder-run … | head -3`: once the reader closes ladder-run's stdout, the job ends (exit
/// 141, as a program killed by SIGPIPE) and no process of it is left.
#[test]
fn closed_stdout_ends_the_job() {
    let _g = serial();
    let m = marker();
    let script = format!("while true; do echo line; sleep 0.01; done; sleep {m}");
    let start = Instant::now();
    let mut child = Command::new(BIN)
        .args(["--nproc-per-node", "2", "sh", "-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    for _ in 0..3 {
        line.clear();
        std::io::BufRead::read_line(&mut out, &mut line).unwrap();
        assert!(line.contains("line"), "{line:?}");
    }
    drop(out); // as `head -3` does
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if start.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            panic!("ladder-run still runs 30 s after its stdout was closed");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert_eq!(status.code(), Some(141), "{err}");
    assert!(err.contains("ladder-run: its standard output was closed (SIGPIPE); forwarded SIGTERM to all 2 ranks"), "{err}");
    assert!(start.elapsed() < Duration::from_secs(10), "took {:?}", start.elapsed());
    assert_no_leftovers(&m);
}
