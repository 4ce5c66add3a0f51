pub mod data;
pub mod device;
pub mod error;
pub mod memory;
pub mod model;
pub use error::{Error, Result};
