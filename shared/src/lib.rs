//! `ladder-core`: everything the three levels of ddp-ladder share.
//!
//! Data flows one way: [`data`] → [`model`] → a level's loop ([`recipe`] holds the shared
//! training recipe, [`eval`] the exact evaluation) → [`dist`] (through [`parallel`]'s DDP and
//! FSDP) → [`metrics`]. Nothing here depends on a level crate. The single-process baseline is
//! the `ladder-baseline` binary (`src/bin/`).

pub mod atomic;
pub mod autograd;
pub mod checkpoint;
pub mod cli;
pub mod data;
pub mod device;
pub mod dist;
pub mod error;
pub mod eval;
mod ffi;
pub mod launch;
pub mod memory;
pub mod metrics;
pub mod model;
pub mod optim;
pub mod parallel;
pub mod preempt;
pub mod recipe;
pub mod safetensors_file;
pub(crate) mod sys;
pub mod tensorboard;
pub mod timing;

pub use error::{Error, Result};
