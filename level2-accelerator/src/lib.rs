//! Level 2 (skeleton; being built).
pub mod config;
pub mod error;
pub use error::{Error, Result};
