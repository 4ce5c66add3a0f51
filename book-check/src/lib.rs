//! `book-check`: the tooling that keeps ddp-ladder's mdBook honest.
//!
//! * [`includes::check`]: every `{{#include}}` in `book/src` names a file that exists and, with an
//!   anchor, exactly one closed, non-empty `// ANCHOR: name` … `// ANCHOR_END: name` span
//!   (mdBook itself only logs a missing file, shows nothing for a missing anchor and only the
//!   first of two spans with one name);
//! * [`diff::write_all`]: the level 1 → 2 and 2 → 3 diffs of the `user_code` anchors, as Markdown
//!   ```diff blocks, into `book/src/generated/`;
//! * [`memory::markdown`]: the per-rank memory arithmetic (DDP, ZeRO-1/2/3) for BasicNet.

pub mod anchors;
pub mod diff;
pub mod error;
pub mod includes;
pub mod memory;

pub use error::{Error, Result};
