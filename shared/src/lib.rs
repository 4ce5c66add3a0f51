//! `ladder-core`: everything the three levels of ddp-ladder share.
//!
//! Data flows one way: `data` → [`model`] → a level's loop → [`dist`] (through `ddp` and
//! `fsdp`) → metrics. Nothing here depends on a level crate.

pub mod device;
pub mod ddp;
pub mod dist;
pub mod error;
pub mod fsdp;
pub mod memory;
pub mod metrics;
pub mod model;

pub use error::{Error, Result};
