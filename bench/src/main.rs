//! bench — ddp-ladder's measurements.
//!
//!   bench demo [--levels 1,2,3]     # `make demo`: the levels side by side, one epoch at 2 ranks
//!   bench run  [--levels 1 …]       # `make bench`: the matrix next to PyTorch, into bench/results/
//!
//! Both run the release binaries in target/release as processes and read their JSON reports;
//! build them first (`make build`: `cargo build --release --workspace --bins --examples`).

use clap::{Parser, Subcommand};
use std::process::ExitCode;

/// ddp-ladder's measurements: the levels side by side (demo) and the matrix next to PyTorch (run).
#[derive(Debug, Parser)]
#[command(name = "bench", version)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Run the levels one after another (one epoch, 2 ranks, DDP) and print one comparison table;
    /// writes target/demo/demo.md and demo.json.
    Demo(bench::demo::DemoArgs),
    /// Run the matrix level × strategy × world size × width × precision, repeated and interleaved
    /// with the PyTorch peers, and the all-reduce bandwidth; writes bench/results/.
    Run(Box<bench::matrix::RunArgs>),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match &cli.command {
        Cmd::Demo(args) => bench::demo::run_demo(args).and_then(|s| {
            let failed = s.failed();
            if failed.is_empty() {
                Ok(())
            } else {
                Err(bench::Error::RunsFailed {
                    failed: failed.len(),
                    total: s.rows.len(),
                    names: failed.iter().map(|r| format!("level {}", r.level)).collect::<Vec<_>>().join(", "),
                })
            }
        }),
        Cmd::Run(args) => bench::matrix::run_matrix(args).and_then(|s| s.check()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
