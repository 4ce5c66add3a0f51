pub mod device;
pub mod error;
pub mod launch;
pub mod memory;
pub mod model;
pub(crate) mod sys;
pub use error::{Error, Result};

/// Worktree shim (launch branch only): the lead's real `dist/mod.rs` replaces this.
pub mod dist {
    pub mod env;
    pub mod rendezvous;
}
