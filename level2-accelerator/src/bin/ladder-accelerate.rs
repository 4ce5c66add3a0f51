//! `ladder-accelerate`: `config`, `launch`, `env` and `estimate-memory`, as 🤗 Accelerate's
//! `accelerate` command.
//!
//! ```text
//! ladder-accelerate config --default --num-processes 2           # writes the default config
//! ladder-accelerate launch --num-processes 2 target/release/level2-accelerator --epochs 1
//! ladder-accelerate env                                          # for a bug report
//! ladder-accelerate estimate-memory --width 4096 --budget 1GiB    # will it fit?
//! ```
//!
//! Exit code: 0 on success; launch: the job's (1 with torchrun's summary when a rank failed,
//! 128 + signal when interrupted); 1 with `error: …` on stderr for a bad setting; 2 for a bad
//! command line.

#[path = "../cli/mod.rs"]
mod cli;

fn main() {
    std::process::exit(cli::main());
}
