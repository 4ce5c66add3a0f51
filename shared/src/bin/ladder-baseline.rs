//! ladder-baseline — the single-process reference: PyTorch's MNIST example loop on BasicNet,
//! one process, all cores, no process group. What the three levels are measured against.
//!
//! Launch: `ladder-baseline` (or `make demo`). One epoch reaches ~98% test accuracy.

use clap::Parser;
use ladder_core::train::{run, TrainArgs};
use std::process::ExitCode;

/// Single-process BasicNet on MNIST (the baseline every level is compared with).
#[derive(Debug, Parser)]
#[command(
    name = "ladder-baseline",
    version,
    allow_negative_numbers = true,
    // The shared flags' texts mention ranks; the baseline has none.
    mut_arg("batch_size", |a| a.help("Samples per optimizer step")),
    mut_arg("device", |a| a.help("Device to train on: cpu, or cuda (the first GPU). Default: cuda if available, else cpu").hide_possible_values(true)),
    // One process: no collective to time out; the tutorial's loop has no divergence check.
    mut_arg("timeout", |a| a.hide(true)),
    mut_arg("allow_non_finite", |a| a.hide(true)),
    mut_arg("save_model", |a| a.help("Save the trained weights to this file as safetensors (keys `conv1.weight`, …), as the tutorial's `--save-model`")),
    after_help = "Environment:\n  MNIST_DIR, MNIST_MIRRORS\n      see --data-dir and --mirror\n  WORLD_SIZE\n      above 1 (set by a launcher), refused: the baseline is one process;\n      level1-raw-ddp trains with several"
)]
struct Cli {
    #[command(flatten)]
    train: TrainArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = run(&cli.train);
    ladder_core::metrics::finish(result, |r| r.figures_line())
}
