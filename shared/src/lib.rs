//! `ladder-core`: everything the three levels of ddp-ladder share.
//!
//! Data flows one way: [`data`] → [`model`] → a level's loop ([`train`] holds the shared
//! pieces) → [`dist`] (through [`ddp`] and [`fsdp`]) → [`metrics`]. Nothing here depends on a
//! level crate.

pub mod atomic;
pub mod autograd;
pub mod checkpoint;
pub mod cli;
pub mod data;
pub mod ddp;
pub mod device;
pub mod dist;
pub mod error;
pub mod fsdp;
pub mod launch;
pub mod memory;
pub mod metrics;
pub mod model;
pub mod optim;
mod shim;
pub(crate) mod sys;
pub mod timing;
pub mod train;
pub mod wrapped;

pub use error::{Error, Result};
