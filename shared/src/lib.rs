//! `ladder-core`: everything the three levels of ddp-ladder share.
//!
//! Data flows one way: [`data`] → [`model`] → a level's loop ([`train`] holds the shared
//! pieces) → [`dist`] (through [`parallel`]'s DDP and FSDP) → [`metrics`]. Nothing here depends on a
//! level crate.

pub mod atomic;
pub mod autograd;
pub mod checkpoint;
pub mod cli;
pub mod data;
pub mod device;
pub mod dist;
pub mod error;
mod ffi;
pub mod launch;
pub mod memory;
pub mod metrics;
pub mod model;
pub mod optim;
pub mod parallel;
mod shim;
pub(crate) mod sys;
pub mod timing;
pub mod train;

pub use error::{Error, Result};
