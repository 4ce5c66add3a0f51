//! `ladder-accelerate launch`: `accelerate launch` on the core launcher.
//!
//! The config file (`--config-file`, else `$ACCELERATE_CONFIG_FILE`, else the user's default
//! config when it exists) with the flags over it gives the settings; they are exported as
//! Accelerate's variables (`ACCELERATE_MIXED_PRECISION`, …, only the settings somebody gave)
//! and the ranks are started by `ladder_core::launch::run`: under mpirun (backend mpi, the CPU
//! path) or spawned directly with the torchrun variables (backend nccl). Unlike Accelerate's
//! `launch --cpu --num_processes 2`, which starts one process, two processes are started.

use super::{implicit_config_file, CmdResult};
use ladder_core::launch::{LaunchBackend, LaunchConfig};
use level2_accelerator::config::{env_var, AcceleratorConfig, DistributedType, Origin, ResolvedConfig, CONFIG_FILE_VAR, SETTINGS};
use level2_accelerator::{Error, Result};
use std::path::PathBuf;

/// `ladder-accelerate launch` flags.
#[derive(Debug, clap::Args)]
#[command(
    override_usage = "ladder-accelerate launch [OPTIONS] PROGRAM [ARGS]...",
    after_help = "Precedence: flags > the config file (--config-file, else $ACCELERATE_CONFIG_FILE, else the default config if it exists) > variables already set in the environment > defaults. The settings are exported as Accelerate's variables (ACCELERATE_MIXED_PRECISION, ACCELERATE_USE_FSDP, FSDP_SHARDING_STRATEGY, ...).\n\nExamples:\n  ladder-accelerate launch --num-processes 2 target/release/level2-accelerator --epochs 1\n  ladder-accelerate launch --num-processes 2 --mixed-precision bf16 --use-fsdp \\\n      --fsdp-sharding-strategy full-shard PROGRAM\n  ladder-accelerate launch --num-processes 8 --num-machines 2 --machine-rank 1 \\\n      --main-process-ip 10.0.0.1 --backend nccl PROGRAM    (on every machine)"
)]
pub struct LaunchArgs {
    /// The config file to read [default: $ACCELERATE_CONFIG_FILE, else the default config if it exists].
    #[arg(long = "config-file", alias = "config_file", value_name = "FILE")]
    pub config_file: Option<PathBuf>,
    /// How the ranks are started: mpi (through mpirun, the CPU backend) or nccl (spawned directly
    /// with the torchrun variables, the GPU backend) [default: nccl for multi-gpu, and for fsdp
    /// with CUDA and without --cpu; else mpi].
    #[arg(long, value_enum, value_parser = ladder_core::cli::choice::<LaunchBackend>(), hide_possible_values = true)]
    pub backend: Option<LaunchBackend>,
    /// Open MPI hostfile listing the machines (backend mpi with --num-machines > 1).
    #[arg(long, value_name = "FILE")]
    pub hostfile: Option<PathBuf>,
    /// Do not prefix output lines with `[rank{r}]: `.
    #[arg(long = "no-prefix", alias = "no_prefix")]
    pub no_prefix: bool,
    /// When a process fails, stop them all and restart the group up to N times (Accelerate's
    /// --max_restarts, torchrun's); a restarted level 2 or 3 program resumes from its last
    /// checkpoint (--save-state's directory, output_dir/checkpoint-*).
    #[arg(long = "max-restarts", alias = "max_restarts", value_name = "N", default_value_t = 0)]
    pub max_restarts: usize,
    /// Seconds between two looks at the processes' state (Accelerate's --monitor_interval).
    #[arg(long = "monitor-interval", alias = "monitor_interval", value_name = "SECONDS",
          default_value_t = ladder_core::launch::DEFAULT_MONITOR_INTERVAL_S, value_parser = positive_seconds)]
    pub monitor_interval: f64,
    #[command(flatten)]
    pub settings: AcceleratorConfig,
    /// PROGRAM and its ARGS: what every rank runs; everything after PROGRAM goes to it.
    #[arg(value_name = "PROGRAM", required = true, num_args = 1.., trailing_var_arg = true, allow_hyphen_values = true)]
    pub command: Vec<String>,
}

/// clap parser for --monitor-interval: a finite number of seconds > 0 (at most a day).
fn positive_seconds(s: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 && v <= 86_400.0 => Ok(v),
        _ => Err(format!("expected a number of seconds > 0 (e.g. 0.1), got {s:?}")),
    }
}

/// Where a launch setting came from, in the launcher's words.
fn origin_of(setting: &str, flags: &AcceleratorConfig, file: &AcceleratorConfig, file_path: Option<&PathBuf>) -> String {
    let given = |c: &AcceleratorConfig| c.with_implied().is_given(setting);
    if given(flags) {
        format!("flag --{}", setting.replace('_', "-"))
    } else if given(file) {
        format!("config file {}", file_path.map(|p| p.display().to_string()).unwrap_or_default())
    } else if let Some(var) = env_var(setting).filter(|v| std::env::var_os(v).is_some()) {
        format!("{var} in the environment")
    } else {
        "default".to_string()
    }
}

/// The backend: `--backend`, else nccl for `MULTI_GPU`, and for `FSDP` when CUDA is usable
/// and `cpu` is not set; else mpi.
fn backend_for(args: &LaunchArgs, cfg: &AcceleratorConfig) -> LaunchBackend {
    if let Some(b) = args.backend {
        return b;
    }
    match cfg.distributed_type {
        Some(DistributedType::MultiGpu) => LaunchBackend::Nccl,
        Some(DistributedType::Fsdp) if cfg.cpu != Some(true) && ladder_core::device::cuda_available() => LaunchBackend::Nccl,
        _ => LaunchBackend::Mpi,
    }
}

/// Checks the machine settings for the backend, naming this command's flags.
fn check_machines(backend: LaunchBackend, cfg: &AcceleratorConfig, hostfile: Option<&PathBuf>) -> Result<()> {
    let machines = cfg.num_machines.unwrap_or(1);
    let rank = cfg.machine_rank.unwrap_or(0);
    let invalid = |setting: &str, value: String, expected: String| Error::InvalidSetting {
        setting: setting.to_string(),
        value,
        origin: format!("flag --{}", setting.replace('_', "-")),
        expected,
    };
    match backend {
        LaunchBackend::Mpi => {
            if machines > 1 && hostfile.is_none() {
                return Err(invalid(
                    "hostfile",
                    "(not given)".into(),
                    format!("an Open MPI hostfile listing the {machines} machines (--num-machines {machines} with backend mpi: one launch starts every machine's ranks through mpirun); or --backend nccl, run on every machine"),
                ));
            }
            if rank != 0 {
                return Err(invalid(
                    "machine_rank",
                    rank.to_string(),
                    "0 with backend mpi (mpirun starts every machine's ranks from machine 0); --machine-rank is for --backend nccl".into(),
                ));
            }
        }
        LaunchBackend::Nccl => {
            if machines > 1 && cfg.main_process_ip.is_none() {
                return Err(invalid(
                    "main_process_ip",
                    "(not given)".into(),
                    format!("the address of machine 0, reachable from all {machines} machines, when --num-machines > 1"),
                ));
            }
        }
    }
    Ok(())
}

/// `accelerate launch`'s flags that this launcher does not take, and what does their job here.
const ACCELERATE_HINTS: &[ladder_core::launch::FlagHint] = &[
    ("--multi-gpu", "implied: --num-processes N starts N processes (add --backend nccl for one process per GPU)"),
    (
        "--num-cpu-threads-per-process",
        "each process already uses the machine's cores / its processes as intra-op threads (set OMP_NUM_THREADS to choose)",
    ),
    ("--main-training-function", "not needed: PROGRAM is an executable, run as it is"),
    ("--gpu-ids", "not a flag here: choose the devices with CUDA_VISIBLE_DEVICES"),
    ("--module", "ladder-accelerate launch runs an executable, not a Python module: give its path"),
    ("-m", "ladder-accelerate launch runs an executable, not a Python module: give its path"),
    ("--no-python", "not needed: PROGRAM always runs as an executable"),
];

/// Checks, before anything is printed or started, that PROGRAM is no flag this command does not
/// know (with `accelerate launch`'s equivalent, or the nearest flag) and names an executable
/// file: a path, or a name found in `PATH` (the core launcher checks it again).
fn check_program(program: &str) -> Result<()> {
    use clap::Args;
    use std::os::unix::fs::PermissionsExt;
    let known: Vec<String> =
        LaunchArgs::augment_args(clap::Command::new("launch")).get_arguments().filter_map(|a| a.get_long()).map(String::from).collect();
    ladder_core::launch::check_not_a_flag("ladder-accelerate launch", program, &known, ACCELERATE_HINTS)?;
    let executable =
        |p: &std::path::Path| std::fs::metadata(p).map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0).unwrap_or(false);
    let found = if program.contains('/') {
        executable(std::path::Path::new(program))
    } else {
        std::env::var_os("PATH").is_some_and(|path| std::env::split_paths(&path).any(|d| executable(&d.join(program))))
    };
    if found || program.is_empty() {
        return Ok(());
    }
    let why = if program.contains('/') {
        if std::path::Path::new(program).exists() {
            "exists but is not an executable file"
        } else {
            "does not exist"
        }
    } else {
        "is not in PATH"
    };
    let why = match ladder_core::launch::not_in_path_but_here(program) {
        Some(here) => format!("{program} {why}; {here}"),
        None => format!("{program} {why}"),
    };
    Err(Error::InvalidSetting {
        setting: "PROGRAM".into(),
        value: program.into(),
        origin: "the program every rank runs".into(),
        expected: format!("a path to an executable file, or the name of one in PATH ({why})"),
    })
}

/// What every rank runs. Locally started ranks inherit this process's environment; ranks that
/// mpirun starts on other machines (a hostfile) get only the variables mpirun forwards, so
/// there PROGRAM runs as `env K=V… PROGRAM ARGS` with the exported settings.
///
/// # Errors
/// [`Error::InvalidSetting`] for a PROGRAM holding `=` in that case (`env` would read it as
/// one more assignment).
fn rank_command(backend: LaunchBackend, hostfile: bool, exported: &[(&str, String)], command: &[String]) -> Result<Vec<String>> {
    if backend != LaunchBackend::Mpi || !hostfile || exported.is_empty() {
        return Ok(command.to_vec());
    }
    if let Some(p) = command.first().filter(|p| p.contains('=')) {
        return Err(Error::InvalidSetting {
            setting: "PROGRAM".into(),
            value: p.clone(),
            origin: "the program every rank runs".into(),
            expected: "a path without '=' with --hostfile (the settings reach other machines as `env K=V PROGRAM`)".into(),
        });
    }
    let mut wrapped = vec!["env".to_string()];
    wrapped.extend(exported.iter().map(|(k, v)| format!("{k}={v}")));
    wrapped.extend(command.iter().cloned());
    Ok(wrapped)
}

/// Runs `launch`: resolves the settings, prints the ranks and the settings, exports the
/// variables and starts the job; returns the launcher's exit code.
pub fn run(args: &LaunchArgs) -> CmdResult {
    let flags = args.settings.clone();
    flags.validate(&Origin::Flags)?;
    let file_path = args.config_file.clone().or_else(implicit_config_file);
    let file = match &file_path {
        Some(p) => AcceleratorConfig::load(p)?,
        None => AcceleratorConfig::default(),
    };
    let cfg = flags.merged_over(&file);
    cfg.validate(&Origin::Launch { flags: Box::new(flags.clone()), file: file_path.clone() })?;

    let num_processes = cfg.num_processes.unwrap_or(1);
    let num_machines = cfg.num_machines.unwrap_or(1);
    let backend = backend_for(args, &cfg);
    check_machines(backend, &cfg, args.hostfile.as_ref())?;

    // The ranks' environment: what is set here, the config file folded into variables, and the
    // settings somebody gave on top.
    let exported = cfg.to_env_vars();
    let lookup = |k: &str| -> Option<String> {
        if k == CONFIG_FILE_VAR {
            return None;
        }
        exported.iter().find(|(v, _)| *v == k).map(|(_, val)| val.clone()).or_else(|| std::env::var(k).ok())
    };
    // Resolving here checks the inherited variables too, once, before any rank starts.
    let resolved = ResolvedConfig::resolve(&AcceleratorConfig::default(), lookup)?;

    let program = args.command.first().map(String::as_str).unwrap_or("");
    check_program(program)?;
    let command = rank_command(backend, args.hostfile.is_some(), &exported, &args.command)?;
    let shutdown_timeout = ladder_core::launch::shutdown_timeout_from_env()?; // torch's variable: Accelerate has no flag
    let mut banner = format!(
        "ladder-accelerate launch: {num_processes} rank{} ({} per machine × {num_machines} machine{}, machine rank {}, backend {}) running {program}\n",
        if num_processes == 1 { "" } else { "s" },
        num_processes / num_machines,
        if num_machines == 1 { "" } else { "s" },
        cfg.machine_rank.unwrap_or(0),
        match backend {
            LaunchBackend::Mpi => "mpi",
            LaunchBackend::Nccl => "nccl",
        },
    );
    for (setting, _) in SETTINGS {
        banner.push_str(&format!(
            "  {setting}: {} ({})\n",
            resolved.value_of(setting),
            origin_of(setting, &flags, &file, file_path.as_ref())
        ));
    }
    eprint!("{banner}");

    // Exported before any thread starts: the launcher's children (mpirun or the rank workers,
    // then PROGRAM) inherit them.
    std::env::remove_var(CONFIG_FILE_VAR);
    for (k, v) in &exported {
        std::env::set_var(k, v);
    }
    if std::env::var_os(ladder_core::launch::LADDER_RUN_BIN_VAR).is_none() {
        if let Ok(me) = std::env::current_exe() {
            std::env::set_var(ladder_core::launch::LADDER_RUN_BIN_VAR, me);
        }
    }
    let launch = LaunchConfig {
        nproc_per_node: num_processes / num_machines,
        nnodes: num_machines,
        node_rank: cfg.machine_rank.unwrap_or(0),
        master_addr: cfg.main_process_ip.clone(),
        master_port: cfg.main_process_port,
        backend,
        hostfile: args.hostfile.clone(),
        no_prefix: args.no_prefix,
        max_restarts: args.max_restarts,
        monitor_interval: args.monitor_interval,
        shutdown_timeout,
        rank_worker: false,
        command,
    };
    Ok(ladder_core::launch::run(&launch)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_on_other_machines_get_the_settings_through_env() {
        let cmd = vec!["prog".to_string(), "--x".to_string()];
        let vars = vec![("ACCELERATE_MIXED_PRECISION", "bf16".to_string())];
        // Local ranks inherit the environment: PROGRAM runs as given.
        assert_eq!(rank_command(LaunchBackend::Mpi, false, &vars, &cmd).unwrap(), cmd);
        assert_eq!(rank_command(LaunchBackend::Nccl, true, &vars, &cmd).unwrap(), cmd);
        assert_eq!(rank_command(LaunchBackend::Mpi, true, &[], &cmd).unwrap(), cmd);
        // mpirun with a hostfile: through env.
        assert_eq!(rank_command(LaunchBackend::Mpi, true, &vars, &cmd).unwrap(), ["env", "ACCELERATE_MIXED_PRECISION=bf16", "prog", "--x"]);
        let odd = vec!["./a=b".to_string()];
        let err = rank_command(LaunchBackend::Mpi, true, &vars, &odd).unwrap_err().to_string();
        assert!(err.starts_with("invalid value \"./a=b\" for PROGRAM"), "{err}");
    }
}
