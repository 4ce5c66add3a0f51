//! torchrun's `--max-restarts`: a failed attempt — every rank stopped by the supervision —
//! is followed by a fresh start of the whole group, up to `max_restarts` times, each with its
//! `TORCHELASTIC_RESTART_COUNT` (see the module docs of [`super`]).

use super::*;

/// Runs the job's attempts: the first, then one more after each rank failure while restarts
/// are left. Returns the last attempt's exit code; the last failure's summary lists every
/// attempt when there were several.
pub(super) fn run_with_restarts(cfg: &LaunchConfig) -> Result<i32> {
    let attempts = cfg.max_restarts + 1;
    let mut failed: Vec<String> = Vec::new();
    let mut restart = 0;
    loop {
        let (rank, exitcode, summary) = match run_attempt(cfg, restart) {
            Err(Error::RankFailed { rank, exitcode, summary }) => (rank, exitcode, summary),
            other => return other,
        };
        if failed.is_empty() && restart == cfg.max_restarts {
            return Err(Error::RankFailed { rank, exitcode, summary });
        }
        failed.push(format!("attempt {} of {attempts}: {}", restart + 1, summary.lines().next().unwrap_or_default()));
        if restart == cfg.max_restarts {
            let summary = format!("{summary}\nEvery attempt failed (--max-restarts {}):\n  {}", cfg.max_restarts, failed.join("\n  "));
            return Err(Error::RankFailed { rank, exitcode, summary });
        }
        let left = cfg.max_restarts - restart;
        let _ = writeln!(
            std::io::stderr(),
            "{summary}\nladder-run: attempt {} of {attempts} failed; every rank stopped; restarting all {} ranks ({left} restart{} left)",
            restart + 1,
            cfg.nproc_per_node * cfg.nnodes,
            if left == 1 { "" } else { "s" }
        );
        restart += 1;
    }
}

/// One attempt of the job (`restart` = 0 for the first): starts every rank with
/// `TORCHELASTIC_RESTART_COUNT=restart`, supervises them, returns the exit code or the failure.
fn run_attempt(cfg: &LaunchConfig, restart: usize) -> Result<i32> {
    let master_addr = cfg.master_addr.clone().unwrap_or_else(|| DEFAULT_MASTER_ADDR.to_string());
    let master_port = match cfg.master_port {
        Some(p) => p,
        None if cfg.nnodes == 1 => free_port()?,
        None => DEFAULT_MASTER_PORT,
    };
    let mut worker_args: Vec<OsString> = vec!["--rank-worker".into()];
    if cfg.no_prefix {
        worker_args.push("--no-prefix".into());
    }
    worker_args.extend(["--shutdown-timeout".into(), cfg.shutdown_timeout.to_string().into()]);
    worker_args.push("--".into());
    worker_args.extend(cfg.command.iter().map(OsString::from));
    let progress_dir = new_progress_dir();
    let mut env = vec![
        ("MASTER_ADDR".into(), master_addr.clone()),
        ("MASTER_PORT".into(), master_port.to_string()),
        (RESTART_COUNT_VAR.into(), restart.to_string()),
        (MAX_RESTARTS_VAR.into(), cfg.max_restarts.to_string()),
    ];
    if let Some(d) = &progress_dir {
        env.push((crate::dist::progress::PROGRESS_DIR_VAR.into(), d.display().to_string()));
    }
    env.extend(terminal::launcher_columns().map(|c| (TTY_COLUMNS_VAR.to_string(), c.to_string())));
    let job = Job {
        label: program_label(cfg.program()),
        worker_exe: ladder_run_exe()?,
        worker_args,
        env,
        nproc_per_node: cfg.nproc_per_node,
        nnodes: cfg.nnodes,
        node_rank: cfg.node_rank,
        hostfile: cfg.hostfile.clone(),
        hosts: match (&cfg.hostfile, cfg.backend) {
            (Some(h), LaunchBackend::Mpi) => check_hostfile(h, cfg.nnodes, cfg.nproc_per_node)?.into_iter().map(|e| e.host).collect(),
            _ => Vec::new(),
        },
        progress_dir,
        monitor_interval: Duration::from_secs_f64(cfg.monitor_interval),
        shutdown_timeout: Duration::from_secs_f64(cfg.shutdown_timeout),
    };
    let outcome = match cfg.backend {
        LaunchBackend::Mpi => job.run_mpirun(),
        LaunchBackend::Nccl => job.run_direct(),
    };
    if let Some(d) = &job.progress_dir {
        let _ = std::fs::remove_dir_all(d);
    }
    outcome?.into_code(&job.label)
}
