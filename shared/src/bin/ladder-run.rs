//! `ladder-run`: start PROGRAM as several ranks with the torchrun environment, as `torchrun`.
//!
//! ```text
//! ladder-run --nproc-per-node 2 target/release/level1-raw-ddp            # 2 ranks through mpirun
//! ladder-run --nproc-per-node 2 --backend nccl target/release/level1-raw-ddp --device cuda
//! ```
//!
//! Exit code: 0 when every rank succeeded; 1 (with torchrun's error summary on stderr) when a
//! rank failed or the launch could not start; when interrupted (SIGTERM, SIGINT, SIGHUP, which
//! are forwarded to every rank), the ranks' exit code if they agree (143 after a checkpoint on
//! SIGTERM), else 128 + signal.

use clap::Parser;
use ladder_core::launch::{run, LaunchConfig};
use std::io::Write;

fn main() {
    let cfg = LaunchConfig::parse();
    match run(&cfg) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            // Not eprintln!: a closed stderr (e.g. `| head`) must not turn into a panic.
            let _ = writeln!(std::io::stderr(), "ladder-run: error: {e}");
            std::process::exit(1);
        }
    }
}
