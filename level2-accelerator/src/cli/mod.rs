//! `ladder-accelerate`, as 🤗 Accelerate's `accelerate` command: `config` writes a config file,
//! `launch` starts a program on N processes with the settings exported as Accelerate's
//! variables, `env` prints what a bug report needs, `estimate-memory` what a run will take.
//!
//! The binary is also its own rank worker: `ladder_core::launch::run` starts each rank through
//! a worker executable (`ladder-run --rank-worker`); `launch` points it at this binary, which
//! answers a leading `--rank-worker` exactly as `ladder-run` does. So an installed
//! `ladder-accelerate` needs no `ladder-run` next to it.

mod config_cmd;
mod env_cmd;
mod estimate_cmd;
mod launch_cmd;

use clap::{Parser, Subcommand};
use level2_accelerator::{Error, Result};
use std::io::Write;
use std::path::PathBuf;

/// The command line.
#[derive(Debug, Parser)]
#[command(
    name = "ladder-accelerate",
    version,
    about = "Configure, launch and inspect ddp-ladder's level 2 jobs, as 🤗 Accelerate's `accelerate` command",
    after_help = "Examples:\n  ladder-accelerate config                         (interactive)\n  ladder-accelerate config --default --num-processes 2 --mixed-precision bf16\n  ladder-accelerate launch --num-processes 2 target/release/level2-accelerator --epochs 1\n  ladder-accelerate env\n  ladder-accelerate estimate-memory --width 4096 --budget 1GiB"
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
    /// Estimate each rank's memory for every strategy before running, as `accelerate
    /// estimate-memory` (here with the batch's activations and the strategy's sharding).
    EstimateMemory(estimate_cmd::EstimateArgs),
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
        Command::EstimateMemory(a) => estimate_cmd::run(&a),
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
