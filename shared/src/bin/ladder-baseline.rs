//! ladder-baseline — the single-process reference: PyTorch's MNIST example loop on BasicNet,
//! one process, all cores, no process group. What the three levels are measured against.
//!
//! Launch: `ladder-baseline` (or `make demo`). One epoch reaches ~98% test accuracy.

use clap::Parser;
use ladder_core::train::{run, TrainArgs};
use std::process::ExitCode;

/// Single-process BasicNet on MNIST (the baseline every level is compared with).
#[derive(Debug, Parser)]
#[command(name = "ladder-baseline", version, allow_negative_numbers = true)]
struct Cli {
    #[command(flatten)]
    train: TrainArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = run(&cli.train);
    ladder_core::metrics::finish(result, |r| r.figures_line())
}
