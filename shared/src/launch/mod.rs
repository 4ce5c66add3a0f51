//! `ladder-run`, the torchrun analogue, and [`launch`], the `notebook_launcher` analogue.
//!
//! This file holds the command line and the two entry points; `supervise.rs` the top launcher
//! (starting, relaying, stopping), `worker.rs` the per-rank worker, `summary.rs` the failure
//! summary.
//!
//! # How a job is started
//!
//! ```text
//! ladder-run --backend mpi                      ladder-run --backend nccl
//!   └─ mpirun -n N … (own process group)          ├─ ladder-run --rank-worker (rank 0, own group)
//!        ├─ ladder-run --rank-worker  (rank 0)    │    └─ PROGRAM ARGS
//!        │    └─ PROGRAM ARGS                     └─ ladder-run --rank-worker (rank 1, own group)
//!        └─ ladder-run --rank-worker  (rank 1)         └─ PROGRAM ARGS
//!             └─ PROGRAM ARGS
//! ```
//!
//! The hidden *rank worker* leads its own process group, sets the torchrun variables (`RANK`,
//! `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`; under mpirun
//! from `OMPI_COMM_WORLD_*`, which PROGRAM also inherits so `MPI_Init` works), prefixes every
//! output line of PROGRAM with `[rank{r}]: `, and keeps PROGRAM's last stderr lines. When
//! PROGRAM exits non-zero or is killed by a signal it was not asked to stop by, the worker
//! prints one machine-readable failure line (a marker and JSON) on stderr and exits non-zero;
//! the top launcher hides that line and turns it into torchrun's error summary.
//!
//! # Failure and signals
//!
//! When any rank fails, the others are stopped within 5 s: mpirun tears its job down itself
//! (SIGTERM, then SIGKILL to each rank's process group); in `nccl` mode the launcher sends
//! SIGTERM to every rank's process group and SIGKILL 2 s later (and if mpirun is still busy
//! 2.5 s after a failure, it gets the same treatment, which its ranks notice through
//! `PR_SET_PDEATHSIG`). Every child gets `PR_SET_PDEATHSIG`, so a launcher killed outright
//! takes its job with it.
//!
//! SIGTERM, SIGINT or SIGHUP to the launcher is forwarded to every rank as torchrun forwards
//! it (its `--signals-to-handle` default, less SIGQUIT): each PROGRAM receives the same
//! signal, and gets `--shutdown-timeout` seconds (torchrun's flag and its
//! `TORCH_ELASTIC_SHUTDOWN_TIMEOUT`, default 30) to exit — time for a level 2 or 3 program to
//! finish its step and write its checkpoint (see [`crate::preempt`]) — before SIGKILL. mpirun
//! answers these signals itself (SIGTERM to its ranks, SIGKILL one second later), so under
//! mpirun the launcher sends a stand-in that mpirun forwards as it is (SIGUSR1 for SIGTERM,
//! SIGUSR2 for SIGINT, SIGALRM for SIGHUP) and each rank worker delivers the signal it stands
//! for. The launcher then exits with the code the ranks exited with when they all agree (143
//! when every rank wrote its checkpoint and exited 143, as the levels do), else 128 + the
//! signal; unlike torchrun, which raises `SignalException` and exits 1. An interrupted
//! launcher is never restarted, as torchrun's is not.
//!
//! # Restarts
//!
//! With `--max-restarts N` (torchrun's), a failed attempt — every rank stopped as above — is
//! followed by a fresh start of the whole group, up to N times; each attempt's ranks see
//! `TORCHELASTIC_RESTART_COUNT` (0 for the first) and `TORCHELASTIC_MAX_RESTARTS`, and the
//! levels resume from their last checkpoint when the count is > 0 ([`restart_count`]). Each
//! failed attempt's summary is printed; the last one lists every attempt. An interrupted
//! launcher (SIGINT, SIGTERM, SIGHUP) is not restarted. `--max-restarts 0` fails fast.
//!
//! # Output
//!
//! Every line a rank writes is prefixed and written whole; a progress bar's carriage-return
//! redraws pass through as they come, and when the launcher's stdout is a terminal the ranks
//! learn its width through [`TTY_COLUMNS_VAR`] (see `terminal.rs`).

mod hostfile;
mod program;
mod restart;
mod summary;
mod supervise;
mod terminal;
mod worker;

pub use hostfile::{check_hostfile, HostfileEntry};
pub use program::{check_not_a_flag, not_in_path_but_here, FlagHint, TORCHRUN_HINTS};
pub use terminal::{tty_columns, TTY_COLUMNS_VAR};

use crate::dist::env::{DistEnv, DEFAULT_MASTER_ADDR, VARS};
use crate::{sys, Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::ffi::{OsStr, OsString};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use summary::summary;
use supervise::{exitcode, join_all, Job};
use worker::{report_exit, worker};

/// The process-group backend the ranks will use — the same values, and the same meaning, as
/// the level binaries' `--backend` — which decides how `ladder-run` starts them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LaunchBackend {
    /// The `mpi` process group: ranks started through Open MPI's `mpirun` (MPI_Init needs it;
    /// several nodes via --hostfile).
    #[default]
    Mpi,
    /// The `nccl` process group: ranks spawned directly with the torchrun variables, as
    /// torchrun does (several nodes by running ladder-run on each with --node-rank).
    Nccl,
}

/// The `ladder-run` command line: torchrun's flags (underscore spellings such as
/// `--nproc_per_node` are accepted too).
#[derive(Debug, Clone, clap::Parser, Serialize, Deserialize)]
#[serde(default)]
#[command(
    name = "ladder-run",
    version,
    override_usage = "ladder-run [OPTIONS] PROGRAM [ARGS]...",
    about = "Start PROGRAM as several ranks with the torchrun environment (RANK, WORLD_SIZE, ...), as torchrun does",
    after_help = "Examples:\n  ladder-run --nproc-per-node 2 target/release/level1-raw-ddp --epochs 1\n  ladder-run --nproc-per-node 4 --backend nccl target/release/level1-raw-ddp --device cuda\n  ladder-run --nproc-per-node 2 --nnodes 2 --hostfile hosts.txt PROGRAM    (mpi, run once)\n  ladder-run --nproc-per-node 4 --nnodes 2 --node-rank R --master-addr node0 --backend nccl PROGRAM    (on every node)\n\nEvery rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK (its node's index), MASTER_ADDR and MASTER_PORT; over mpirun, PATH and LD_LIBRARY_PATH are forwarded to the other nodes. If a rank fails, the others are stopped and ladder-run exits 1 with a summary naming the rank, its host and, when ranks were left waiting, where each was last seen (step, collective). SIGTERM, SIGINT and SIGHUP are forwarded to every rank, which get --shutdown-timeout seconds to exit (time for a checkpoint) before SIGKILL; ladder-run then exits with the ranks' code when they agree (143 after a checkpoint), else 128 + the signal, and is not restarted. Closing ladder-run's stdout (| head) stops the job (exit 141). Ranks see LADDER_PROGRESS_DIR (their progress records), and LADDER_TTY_COLUMNS when ladder-run's stdout is a terminal (its width less the [rankN]: prefix: rank 0 of level 3 draws its progress bar there); the collective timeout is the program's (--timeout, LADDER_COLLECTIVE_TIMEOUT_S, default 600 s).\n\nEnvironment:\n  PATH\n      where PROGRAM and mpirun are looked up\n  OMPI_MCA_*\n      Open MPI's settings, read by mpirun (e.g. OMPI_MCA_plm_rsh_agent,\n      OMPI_MCA_btl_tcp_if_include)"
)]
pub struct LaunchConfig {
    /// Number of ranks to start on each node: a number, or as torchrun's `auto` (the CUDA
    /// devices if there are any, else the CPU cores), `gpu` (the CUDA devices) or `cpu` (the
    /// CPU cores).
    #[arg(long = "nproc-per-node", alias = "nproc_per_node", value_name = "N", default_value_t = 1,
          value_parser = nproc_per_node)]
    pub nproc_per_node: usize,
    /// Number of nodes in the job.
    #[arg(long, value_name = "M", default_value_t = 1, value_parser = at_least_one)]
    pub nnodes: usize,
    /// This node's index, 0..nnodes (backend nccl: run ladder-run once on every node).
    #[arg(long = "node-rank", alias = "node_rank", value_name = "R", default_value_t = 0)]
    pub node_rank: usize,
    /// Address of the rank-0 node, for the rendezvous (MASTER_ADDR) [default: 127.0.0.1].
    #[arg(long = "master-addr", alias = "master_addr", value_name = "ADDR")]
    pub master_addr: Option<String>,
    /// Port of the rendezvous (MASTER_PORT) [default: a free port on one node, 29500 on several].
    #[arg(long = "master-port", alias = "master_port", value_name = "PORT", value_parser = clap::value_parser!(u16).range(1..))]
    pub master_port: Option<u16>,
    /// The process-group backend the ranks use, as PROGRAM's own --backend (pass the same
    /// value to both): mpi starts them through mpirun, nccl spawns them directly.
    #[arg(long, value_enum, value_parser = crate::cli::choice::<LaunchBackend>(), default_value_t = LaunchBackend::Mpi)]
    pub backend: LaunchBackend,
    /// Open MPI hostfile (lines `host slots=N`) listing the nodes; backend mpi with --nnodes > 1.
    #[arg(long, value_name = "FILE")]
    pub hostfile: Option<PathBuf>,
    /// Do not prefix output lines with `[rank{r}]: `.
    #[arg(long = "no-prefix", alias = "no_prefix")]
    pub no_prefix: bool,
    /// When a rank fails, stop every rank and restart the whole group, up to this many times
    /// (torchrun's --max-restarts); each attempt's ranks see TORCHELASTIC_RESTART_COUNT (0, 1,
    /// …) and TORCHELASTIC_MAX_RESTARTS. 0 fails fast.
    #[arg(long = "max-restarts", alias = "max_restarts", value_name = "N", default_value_t = 0)]
    pub max_restarts: usize,
    /// Seconds between two looks at the ranks' state (torchrun's --monitor-interval).
    #[arg(long = "monitor-interval", alias = "monitor_interval", value_name = "SECONDS", default_value_t = DEFAULT_MONITOR_INTERVAL_S,
          value_parser = positive_seconds)]
    pub monitor_interval: f64,
    /// Seconds the ranks get to exit after ladder-run forwards SIGTERM, SIGINT or SIGHUP to
    /// them (time to write a checkpoint), before SIGKILL (torchrun's --shutdown-timeout).
    #[arg(long = "shutdown-timeout", alias = "shutdown_timeout", value_name = "SECONDS", env = SHUTDOWN_TIMEOUT_VAR,
          default_value_t = DEFAULT_SHUTDOWN_TIMEOUT_S, value_parser = shutdown_seconds)]
    pub shutdown_timeout: f64,
    /// Internal: run as the per-rank worker (started by mpirun or by ladder-run itself).
    #[arg(long = "rank-worker", hide = true)]
    pub rank_worker: bool,
    /// PROGRAM and its ARGS: what every rank runs (a path, or a name looked up in PATH);
    /// everything after PROGRAM is passed to it, flags included.
    #[arg(value_name = "PROGRAM", required = true, num_args = 1.., trailing_var_arg = true, allow_hyphen_values = true)]
    pub command: Vec<String>,
}

impl LaunchConfig {
    /// PROGRAM, the first word of [`LaunchConfig::command`] (empty when there is none).
    pub fn program(&self) -> &str {
        self.command.first().map(String::as_str).unwrap_or("")
    }

    /// PROGRAM's arguments, the rest of [`LaunchConfig::command`].
    pub fn args(&self) -> &[String] {
        self.command.get(1..).unwrap_or(&[])
    }
}

impl Default for LaunchConfig {
    /// torchrun's defaults: one rank on one node, node rank 0, backend mpi, prefixed output,
    /// no restarts, a 30 s shutdown timeout; `command` empty (must be set).
    fn default() -> Self {
        LaunchConfig {
            nproc_per_node: 1,
            nnodes: 1,
            node_rank: 0,
            master_addr: None,
            master_port: None,
            backend: LaunchBackend::Mpi,
            hostfile: None,
            no_prefix: false,
            max_restarts: 0,
            monitor_interval: DEFAULT_MONITOR_INTERVAL_S,
            shutdown_timeout: DEFAULT_SHUTDOWN_TIMEOUT_S,
            rank_worker: false,
            command: Vec::new(),
        }
    }
}

/// torchrun's default `--monitor-interval`, in seconds.
pub const DEFAULT_MONITOR_INTERVAL_S: f64 = 0.1;
/// torchrun's default `--shutdown-timeout`, in seconds.
pub const DEFAULT_SHUTDOWN_TIMEOUT_S: f64 = 30.0;
/// The variable `--shutdown-timeout` defaults to, as torchrun's.
pub const SHUTDOWN_TIMEOUT_VAR: &str = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT";
/// The restart count of the current attempt, set for every rank (torchelastic's variable).
pub const RESTART_COUNT_VAR: &str = "TORCHELASTIC_RESTART_COUNT";
/// The `--max-restarts` of the job, set for every rank (torchelastic's variable).
pub const MAX_RESTARTS_VAR: &str = "TORCHELASTIC_MAX_RESTARTS";

/// The restart count this process runs under: `TORCHELASTIC_RESTART_COUNT`, 0 when unset or
/// not a number. A program resumes from its last checkpoint when it is > 0.
pub fn restart_count() -> u64 {
    std::env::var(RESTART_COUNT_VAR).ok().and_then(|v| v.trim().parse().ok()).unwrap_or(0)
}

/// clap parser for an interval in seconds: a finite number > 0 (at most a day).
fn positive_seconds(s: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v <= 86_400.0 => Ok(v),
        _ => Err(format!("expected a number of seconds > 0 (e.g. 0.1), got {s:?}")),
    }
}

/// clap parser for `--shutdown-timeout`: a finite number of seconds ≥ 0 (at most a day).
fn shutdown_seconds(s: &str) -> std::result::Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && (0.0..=86_400.0).contains(&v) => Ok(v),
        _ => Err(format!("expected a number of seconds ≥ 0 (e.g. 30), got {s:?}")),
    }
}

/// The shutdown timeout a launcher without the flag uses (`ladder-accelerate launch`, as
/// Accelerate's launcher on torch's): [`SHUTDOWN_TIMEOUT_VAR`] when set, else 30 s.
///
/// # Errors
/// [`Error::InvalidValue`] naming the variable when it is not a number of seconds ≥ 0.
pub fn shutdown_timeout_from_env() -> Result<f64> {
    match std::env::var(SHUTDOWN_TIMEOUT_VAR) {
        Ok(v) => shutdown_seconds(&v).map_err(|_| Error::invalid(SHUTDOWN_TIMEOUT_VAR, v, "a number of seconds ≥ 0 (e.g. 30)")),
        Err(_) => Ok(DEFAULT_SHUTDOWN_TIMEOUT_S),
    }
}

/// clap parser for counts that must be at least 1.
fn at_least_one(s: &str) -> std::result::Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("expected a whole number of at least 1, got {s:?}")),
    }
}

/// clap parser for `--nproc-per-node`: a count of at least 1, or torchrun's `auto`, `gpu`,
/// `cpu` (see [`LaunchConfig::nproc_per_node`]).
fn nproc_per_node(s: &str) -> std::result::Result<usize, String> {
    let gpus = || if crate::device::cuda_available() { tch::Cuda::device_count().max(0) as usize } else { 0 };
    match s.to_ascii_lowercase().as_str() {
        "auto" => Ok(Some(gpus()).filter(|n| *n > 0).unwrap_or_else(crate::device::cores)),
        "cpu" => Ok(crate::device::cores()),
        "gpu" => match gpus() {
            0 => Err("gpu: no CUDA device is available here (use a number, cpu or auto)".into()),
            n => Ok(n),
        },
        _ => at_least_one(s).map_err(|_| format!("expected a whole number of at least 1, or auto, gpu, cpu (as torchrun), got {s:?}")),
    }
}

/// The marker that starts a rank worker's machine-readable failure line on stderr.
const FAILURE_MARKER: &str = "@@ladder-run-failure@@ ";
/// The marker of a rank worker's last line on stderr, `@@ladder-run-exit@@ RANK`: the rank's
/// word that it has ended (how is in its failure line, if any). Over several hosts, ranks
/// whose word never arrives are named: their host may be unreachable.
const EXIT_MARKER: &str = "@@ladder-run-exit@@ ";
/// The environment variable that tells a binary re-executed by [`launch`] its role.
const ROLE_VAR: &str = "LADDER_LAUNCH_ROLE";
/// Environment variable naming the `ladder-run` binary to use as rank worker.
pub const LADDER_RUN_BIN_VAR: &str = "LADDER_RUN_BIN";
/// How many of PROGRAM's last stderr lines a failure report keeps, and their length cap.
const KEEP_LINES: usize = 10;
const KEEP_CHARS: usize = 400;
/// The signals a launcher forwards, each with the stand-in mpirun forwards for it (see the
/// module docs): (signal, carrier).
const CARRIERS: [(i32, i32); 3] = [(sys::SIGTERM, sys::SIGUSR1), (sys::SIGINT, sys::SIGUSR2), (sys::SIGHUP, sys::SIGALRM)];
/// How long a rank gets between SIGTERM and SIGKILL when another rank failed.
const TERM_GRACE: Duration = Duration::from_secs(2);
/// How long mpirun gets to tear its job down after a failure before the launcher steps in.
const MPIRUN_GRACE: Duration = Duration::from_millis(2500);
/// How often [`launch`] looks at its ranks.
const LAUNCH_MONITOR_INTERVAL: Duration = Duration::from_millis(20);
/// torchrun's default MASTER_PORT.
const DEFAULT_MASTER_PORT: u16 = 29500;

/// What a rank worker reports when PROGRAM fails.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct FailureRecord {
    rank: usize,
    local_rank: usize,
    host: String,
    pid: u32,
    /// Exit code, or minus the signal number (torchrun's convention).
    exitcode: i32,
    /// Why PROGRAM could not run at all (not found, not executable, bad environment).
    error: Option<String>,
    program: String,
    last_stderr: Vec<String>,
}

/// Runs `ladder-run` as configured (restarting the whole group after a failure up to
/// `max_restarts` times) and returns its exit code: 0 when every rank succeeded; when the
/// launcher was interrupted (SIGINT, SIGTERM, SIGHUP, forwarded to every rank; never
/// restarted), the code the ranks exited with if they agree (143 after a checkpoint on
/// SIGTERM), else `128 + signal`. In worker mode (`--rank-worker`) runs one rank and returns
/// its code (0 when it was stopped on request).
///
/// The rank workers are the `ladder-run` binary: the current executable when it is
/// `ladder-run`, else `$LADDER_RUN_BIN`, else a `ladder-run` next to the current executable
/// (or one directory up, for cargo's `deps/`), else the one in `PATH`.
///
/// # Errors
/// [`Error::RankFailed`] with torchrun's error summary when a rank exits non-zero or is
/// killed; [`Error::InvalidValue`] naming the flag for a bad configuration, or naming PROGRAM
/// when it is not found; [`Error::Launch`] when mpirun or the ladder-run binary cannot be
/// found or mpirun fails without any rank reporting a failure.
pub fn run(cfg: &LaunchConfig) -> Result<i32> {
    if cfg.rank_worker {
        let args: Vec<OsString> = cfg.args().iter().map(OsString::from).collect();
        let ended = worker(OsStr::new(cfg.program()), &args, &[], !cfg.no_prefix, Duration::from_secs_f64(cfg.shutdown_timeout));
        report_exit(ended.program);
        return Ok(ended.code);
    }
    validate(cfg)?;
    find_program(cfg.program())?;
    restart::run_with_restarts(cfg)
}

/// A fresh per-job progress directory under /dev/shm (else the temporary directory), or
/// `None` when none can be made (progress is then not recorded).
fn new_progress_dir() -> Option<PathBuf> {
    let dir = crate::dist::progress::shm_base().join(format!("ladder-progress-run-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).ok().map(|_| dir)
}

/// Runs `f` in `num_processes` ranks, as Accelerate's `notebook_launcher`.
///
/// The current executable is re-executed through `mpirun -n num_processes` (with the same
/// arguments, through a rank worker as in `ladder-run`, so output is prefixed `[rank{r}]: `);
/// an environment marker makes `launch` in the re-executed ranks run `f` instead of starting
/// ranks again. Everything `main` does before calling `launch` therefore runs in every rank
/// too, as with Python's multiprocessing. Inside `f`, `DistEnv::from_env()` (and
/// `init_process_group`) see the mpirun environment.
///
/// With `num_processes == 1`, `f` simply runs in this process (world size 1).
///
/// In the parent returns `Ok(())` when all ranks succeeded. In a rank, `launch` does not
/// return: it runs `f` and exits the process (0 on `Ok`; 1 after printing the error on `Err`;
/// 101 after printing the message on a panic, as Rust's default).
///
/// # Errors
/// [`Error::RankFailed`] naming the first rank that failed, with its exit code and last
/// stderr lines; [`Error::InvalidValue`] when `num_processes` is 0; [`Error::Launch`] when
/// mpirun is missing, fails on its own, or the launch was interrupted by a signal.
pub fn launch<F: FnOnce() -> Result<()>>(num_processes: usize, f: F) -> Result<()> {
    match std::env::var(ROLE_VAR).as_deref() {
        Ok("rank") => {
            // Messages are written to the file descriptor directly, past any output capture
            // (a test harness's), so that they reach the failure report.
            let code = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
                Ok(Ok(())) => 0,
                Ok(Err(e)) => {
                    let _ = writeln!(std::io::stderr(), "error: {e}");
                    1
                }
                Err(panic) => {
                    let msg = panic
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "(non-string panic payload)".into());
                    let _ = writeln!(std::io::stderr(), "panicked: {msg}");
                    101
                }
            };
            std::process::exit(code)
        }
        Ok("worker") => {
            let exe = std::env::current_exe().map_err(|e| Error::Launch(format!("launch: cannot find the current executable: {e}")))?;
            let args: Vec<OsString> = std::env::args_os().skip(1).collect();
            let shutdown = Duration::from_secs_f64(DEFAULT_SHUTDOWN_TIMEOUT_S);
            std::process::exit(worker(exe.as_os_str(), &args, &[(ROLE_VAR, "rank".to_string())], true, shutdown).code)
        }
        Ok(other) => Err(Error::invalid(ROLE_VAR, other, "\"worker\" or \"rank\" (set by launch itself), or unset")),
        Err(_) => {
            if num_processes == 0 {
                return Err(Error::invalid("num_processes", 0, "at least 1"));
            }
            if num_processes == 1 {
                return f();
            }
            let exe = std::env::current_exe().map_err(|e| Error::Launch(format!("launch: cannot find the current executable: {e}")))?;
            let mut env = vec![
                (ROLE_VAR.into(), "worker".into()),
                ("MASTER_ADDR".into(), DEFAULT_MASTER_ADDR.into()),
                ("MASTER_PORT".into(), free_port()?.to_string()),
            ];
            env.extend(terminal::launcher_columns().map(|c| (TTY_COLUMNS_VAR.to_string(), c.to_string())));
            let job = Job {
                label: program_label(&exe.to_string_lossy()),
                worker_exe: exe,
                worker_args: std::env::args_os().skip(1).collect(),
                env,
                nproc_per_node: num_processes,
                nnodes: 1,
                node_rank: 0,
                hostfile: None,
                hosts: Vec::new(),
                progress_dir: None,
                monitor_interval: LAUNCH_MONITOR_INTERVAL,
                shutdown_timeout: Duration::from_secs_f64(DEFAULT_SHUTDOWN_TIMEOUT_S),
            };
            match job.run_mpirun()?.into_code(&job.label)? {
                0 => Ok(()),
                code => Err(Error::Launch(format!(
                    "launch: interrupted by {} ({code}); all {num_processes} ranks were stopped",
                    sys::signal_name(code - 128)
                ))),
            }
        }
    }
}

fn validate(cfg: &LaunchConfig) -> Result<()> {
    if cfg.program().is_empty() {
        return Err(Error::invalid("PROGRAM", "", "expected the program every rank runs (the command is empty)"));
    }
    let known: Vec<String> = <LaunchConfig as clap::CommandFactory>::command()
        .get_arguments()
        .filter(|a| !a.is_hide_set())
        .filter_map(|a| a.get_long())
        .map(String::from)
        .collect();
    check_not_a_flag("ladder-run", cfg.program(), &known, TORCHRUN_HINTS)?;
    if cfg.nproc_per_node == 0 {
        return Err(Error::invalid("--nproc-per-node", 0, "at least 1"));
    }
    if cfg.nnodes == 0 {
        return Err(Error::invalid("--nnodes", 0, "at least 1"));
    }
    if cfg.node_rank >= cfg.nnodes {
        return Err(Error::invalid("--node-rank", cfg.node_rank, format!("a node index in 0..{} (--nnodes {})", cfg.nnodes, cfg.nnodes)));
    }
    match cfg.backend {
        LaunchBackend::Mpi => {
            if cfg.nnodes > 1 && cfg.hostfile.is_none() {
                return Err(Error::invalid(
                    "--hostfile",
                    "(not given)",
                    format!("an Open MPI hostfile listing the {} nodes: with --backend mpi, one ladder-run starts every node's ranks through mpirun", cfg.nnodes),
                ));
            }
            if cfg.node_rank != 0 {
                return Err(Error::invalid(
                    "--node-rank",
                    cfg.node_rank,
                    "0 with --backend mpi (mpirun starts the ranks of every node from the first one); --node-rank is for --backend nccl",
                ));
            }
            if let Some(h) = &cfg.hostfile {
                if !h.is_file() {
                    return Err(Error::invalid("--hostfile", h.display(), "an existing Open MPI hostfile (lines `host slots=N`)"));
                }
                check_hostfile(h, cfg.nnodes, cfg.nproc_per_node)?;
            }
        }
        LaunchBackend::Nccl => {
            if cfg.hostfile.is_some() {
                return Err(Error::invalid(
                    "--hostfile",
                    cfg.hostfile.as_ref().map(|h| h.display().to_string()).unwrap_or_default(),
                    "no hostfile with --backend nccl: run ladder-run on every node with --node-rank",
                ));
            }
            if cfg.nnodes > 1 && cfg.master_addr.is_none() {
                return Err(Error::invalid(
                    "--master-addr",
                    "(not given)",
                    format!("the address of node 0, reachable from all {} nodes, when --nnodes > 1", cfg.nnodes),
                ));
            }
        }
    }
    Ok(())
}

/// Checks that `program` names an executable file: a path, or a name found in `PATH` (through
/// the `which` crate, as the shell's `which`).
fn find_program(program: &str) -> Result<PathBuf> {
    if program.contains('/') {
        let p = PathBuf::from(program);
        if which::which(&p).is_ok() {
            return Ok(p);
        }
        let why = if p.exists() { "exists but is not an executable file" } else { "does not exist" };
        return Err(Error::invalid("PROGRAM", program, format!("{program} {why}; expected a path to an executable file")));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    which::which_in(program, Some(&path), ".").map_err(|_| {
        let why = match not_in_path_but_here(program) {
            Some(here) => format!("not found in PATH; {here}"),
            None => format!("not found; expected a program in PATH ({}) or a path to an executable file", path.to_string_lossy()),
        };
        Error::invalid("PROGRAM", program, why)
    })
}

/// The `ladder-run` binary that serves as rank worker (see [`run`]).
fn ladder_run_exe() -> Result<PathBuf> {
    let current = std::env::current_exe().ok();
    if let Some(c) = &current {
        if c.file_name().is_some_and(|n| n == "ladder-run") {
            return Ok(c.clone());
        }
    }
    if let Some(p) = std::env::var_os(LADDER_RUN_BIN_VAR) {
        return Ok(PathBuf::from(p));
    }
    if let Some(dir) = current.as_ref().and_then(|c| c.parent()) {
        for cand in [dir.join("ladder-run"), dir.join("..").join("ladder-run")] {
            if cand.is_file() {
                return Ok(cand);
            }
        }
    }
    find_program("ladder-run").map_err(|_| {
        Error::Launch(format!(
            "cannot find the ladder-run binary, which runs each rank: not next to {} and not in PATH; build it (cargo build -p ladder-core --bin ladder-run) or set {LADDER_RUN_BIN_VAR}",
            current.map(|c| c.display().to_string()).unwrap_or_else(|| "the current executable".into())
        ))
    })
}

/// A free TCP port on the loopback interface (bound, then released).
fn free_port() -> Result<u16> {
    std::net::TcpListener::bind(("127.0.0.1", 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| Error::Launch(format!("cannot pick a free MASTER_PORT on 127.0.0.1: {e}")))
}

fn program_label(program: &str) -> String {
    Path::new(program).file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| program.to_string())
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_string()).unwrap_or_else(|_| "localhost".into())
}
