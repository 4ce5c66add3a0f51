//! `ladder-accelerate`, as 🤗 Accelerate's `accelerate` command: `config` writes a config file,
//! `launch` starts a program on N processes with the settings exported as Accelerate's
//! variables, `env` prints what a bug report needs.
//!
//! The binary is also its own rank worker: `ladder_core::launch::run` starts each rank through
//! a worker executable (`ladder-run --rank-worker`); `launch` points it at this binary, which
//! answers a leading `--rank-worker` exactly as `ladder-run` does. So an installed
//! `ladder-accelerate` needs no `ladder-run` next to it.

mod config_cmd;
mod env_cmd;
mod launch_cmd;

use clap::{Args, Parser, Subcommand};
use level2_accelerator::config::{AcceleratorConfig, BackwardPrefetch, DistributedType, Precision, ShardingStrategy};
use level2_accelerator::{Error, Result};
use std::io::Write;
use std::path::PathBuf;

/// The command line.
#[derive(Debug, Parser)]
#[command(
    name = "ladder-accelerate",
    version,
    about = "Configure, launch and inspect ddp-ladder's level 2 jobs, as 🤗 Accelerate's `accelerate` command",
    after_help = "Examples:\n  ladder-accelerate config                         (interactive)\n  ladder-accelerate config --default --num-processes 2 --mixed-precision bf16\n  ladder-accelerate launch --num-processes 2 target/release/level2-accelerator --epochs 1\n  ladder-accelerate env"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Write a config file: interactive prompts on a terminal, as `accelerate config`, or the
    /// settings given as flags (with --default: completed with the defaults).
    Config(config_cmd::ConfigArgs),
    /// Start PROGRAM on every process with the settings of the config file and the flags, as
    /// `accelerate launch`.
    Launch(launch_cmd::LaunchArgs),
    /// Print versions, hardware and the active config, for a bug report, as `accelerate env`.
    Env(env_cmd::EnvArgs),
}

/// The settings a user can give as flags (every one optional: not given stays `None`).
/// Accelerate's underscore spellings (`--num_processes`) are accepted too. A boolean flag
/// alone means true; `--cpu=false` gives false explicitly.
#[derive(Debug, Clone, Default, Args)]
pub struct SettingsArgs {
    /// How the job is distributed: no, multi-cpu (mpi), multi-gpu (nccl), fsdp.
    #[arg(long = "distributed-type", alias = "distributed_type", value_enum, value_parser = ladder_core::cli::choice::<DistributedType>(), value_name = "TYPE", ignore_case = true)]
    pub distributed_type: Option<DistributedType>,
    /// Total number of processes over all machines [default: 1].
    #[arg(long = "num-processes", alias = "num_processes", value_name = "N", value_parser = at_least_one)]
    pub num_processes: Option<usize>,
    /// Number of machines [default: 1].
    #[arg(long = "num-machines", alias = "num_machines", value_name = "M", value_parser = at_least_one)]
    pub num_machines: Option<usize>,
    /// This machine's index, 0..num_machines [default: 0].
    #[arg(long = "machine-rank", alias = "machine_rank", value_name = "R")]
    pub machine_rank: Option<usize>,
    /// Address of machine 0 (MASTER_ADDR) [default: 127.0.0.1].
    #[arg(long = "main-process-ip", alias = "main_process_ip", value_name = "ADDR")]
    pub main_process_ip: Option<String>,
    /// Rendezvous port on machine 0 (MASTER_PORT) [default: a free port on one machine, 29500 on several].
    #[arg(long = "main-process-port", alias = "main_process_port", value_name = "PORT", value_parser = clap::value_parser!(u16).range(1..))]
    pub main_process_port: Option<u16>,
    /// Mixed precision: no, bf16, fp16 (fp16 needs CUDA) [default: no].
    #[arg(long = "mixed-precision", alias = "mixed_precision", value_parser = ladder_core::cli::spelling::<Precision>(), value_name = "MODE")]
    pub mixed_precision: Option<Precision>,
    /// Micro-batches per optimizer step [default: 1].
    #[arg(long = "gradient-accumulation-steps", alias = "gradient_accumulation_steps", value_name = "K", value_parser = at_least_one)]
    pub gradient_accumulation_steps: Option<usize>,
    /// Train on the CPU even when a GPU is available [default: false].
    #[arg(long, alias = "use_cpu", value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = bool_value)]
    pub cpu: Option<bool>,
    /// Wrap the model in FSDP instead of DDP [default: false].
    #[arg(long = "use-fsdp", alias = "use_fsdp", value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = bool_value)]
    pub use_fsdp: Option<bool>,
    /// FSDP sharding strategy: full-shard, shard-grad-op, no-shard [default: full-shard].
    #[arg(long = "fsdp-sharding-strategy", alias = "fsdp_sharding_strategy", value_parser = ladder_core::cli::spelling::<ShardingStrategy>(), value_name = "STRATEGY")]
    pub fsdp_sharding_strategy: Option<ShardingStrategy>,
    /// FSDP auto-wrap threshold: layers with at least this many parameters get their own unit [default: 100000000].
    #[arg(long = "fsdp-min-num-params", alias = "fsdp_min_num_params", value_name = "N")]
    pub fsdp_min_num_params: Option<usize>,
    /// FSDP backward prefetch: backward-pre, backward-post, no-prefetch [default: no-prefetch].
    #[arg(long = "fsdp-backward-prefetch", alias = "fsdp_backward_prefetch", value_parser = ladder_core::cli::spelling::<BackwardPrefetch>(), value_name = "POLICY")]
    pub fsdp_backward_prefetch: Option<BackwardPrefetch>,
    /// FSDP forward prefetch: start the next unit's all-gather before the current unit's forward [default: false].
    #[arg(long = "fsdp-forward-prefetch", alias = "fsdp_forward_prefetch", value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = bool_value)]
    pub fsdp_forward_prefetch: Option<bool>,
    /// The loader's batch size is global, split between the processes [default: false].
    #[arg(long = "split-batches", alias = "split_batches", value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = bool_value)]
    pub split_batches: Option<bool>,
    /// Pad the last batches so every process gets as many [default: true].
    #[arg(long = "even-batches", alias = "even_batches", value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = bool_value)]
    pub even_batches: Option<bool>,
    /// Seed for set_seed [default: not set].
    #[arg(long, value_name = "SEED")]
    pub seed: Option<u64>,
}

impl SettingsArgs {
    /// The flags as an [`AcceleratorConfig`] (`None` where no flag was given).
    pub fn to_config(&self) -> AcceleratorConfig {
        AcceleratorConfig {
            distributed_type: self.distributed_type,
            num_processes: self.num_processes,
            num_machines: self.num_machines,
            machine_rank: self.machine_rank,
            main_process_ip: self.main_process_ip.clone(),
            main_process_port: self.main_process_port,
            mixed_precision: self.mixed_precision,
            gradient_accumulation_steps: self.gradient_accumulation_steps,
            cpu: self.cpu,
            use_fsdp: self.use_fsdp,
            fsdp_sharding_strategy: self.fsdp_sharding_strategy,
            fsdp_min_num_params: self.fsdp_min_num_params,
            fsdp_backward_prefetch: self.fsdp_backward_prefetch,
            fsdp_forward_prefetch: self.fsdp_forward_prefetch,
            split_batches: self.split_batches,
            even_batches: self.even_batches,
            seed: self.seed,
        }
    }
}

/// clap parser for counts that must be at least 1.
fn at_least_one(s: &str) -> std::result::Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err("expected a whole number of at least 1".to_string()),
    }
}

/// clap parser for booleans, as Accelerate's `str_to_bool`.
fn bool_value(s: &str) -> std::result::Result<bool, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "y" | "yes" | "t" | "true" | "on" | "1" => Ok(true),
        "n" | "no" | "f" | "false" | "off" | "0" => Ok(false),
        _ => Err("expected true or false (also 1/0, yes/no, on/off)".to_string()),
    }
}

/// The config file a command reads when `--config-file` is not given: `$ACCELERATE_CONFIG_FILE`,
/// else the user's default config when it exists.
fn implicit_config_file() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(level2_accelerator::config::CONFIG_FILE_VAR) {
        if !p.is_empty() {
            return Some(PathBuf::from(p));
        }
    }
    level2_accelerator::config::default_config_file().filter(|p| p.is_file())
}

/// Runs the command line `args` (without the program name handled specially) and returns the
/// process exit code; errors are printed to stderr as `error: …`.
pub fn main() -> i32 {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if args.get(1).is_some_and(|a| a == "--rank-worker") {
        return rank_worker(&args);
    }
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Config(a) => config_cmd::run(&a),
        Command::Launch(a) => launch_cmd::run(&a),
        Command::Env(a) => env_cmd::run(&a),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "error: {e}");
            1
        }
    }
}

/// The hidden rank-worker mode (see the module docs): the arguments are `ladder-run`'s.
fn rank_worker(args: &[std::ffi::OsString]) -> i32 {
    use ladder_core::launch::LaunchConfig;
    let argv = std::iter::once(std::ffi::OsString::from("ladder-run")).chain(args[1..].iter().cloned());
    let cfg = match LaunchConfig::try_parse_from(argv) {
        Ok(c) => c,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "error: ladder-accelerate --rank-worker: {e}");
            return 2;
        }
    };
    match ladder_core::launch::run(&cfg) {
        Ok(code) => code,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "error: {}", Error::from(e));
            1
        }
    }
}

/// The `Result` of a subcommand: the exit code.
type CmdResult = Result<i32>;
