//! Level 3 of ddp-ladder: a `Trainer` with `TrainingArguments`, as 🤗 Transformers' — the user
//! hands over a model, datasets, a `compute_loss` and the arguments; there is no loop in user
//! code. Built on the level-2 `Accelerator`, as Transformers is built on Accelerate.
//!
//! Modules: [`args`] (TrainingArguments), [`schedule`] (planning and learning-rate schedules),
//! [`state`] (TrainerState, log history), [`output`] (banner, table, log writers, loss plot,
//! progress), [`callbacks`] (TrainerCallback, EarlyStoppingCallback), [`checkpoints`]
//! (checkpoint-<step> naming and save_total_limit rotation).

pub mod args;
pub mod callbacks;
pub mod checkpoints;
pub mod error;
pub mod output;
pub mod schedule;
pub mod state;

pub use args::TrainingArguments;
pub use error::{Error, Result};
