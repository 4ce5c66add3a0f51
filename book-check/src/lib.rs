//! `book-check`: the tooling that keeps ddp-ladder's mdBook honest.
//!
//! * [`includes::check`]: every `{{#include}}` in `book/src` names a file that exists and, with an
//!   anchor, exactly one closed, non-empty `// ANCHOR: name` … `// ANCHOR_END: name` span
//!   (mdBook itself only logs a missing file, shows nothing for a missing anchor and only the
//!   first of two spans with one name); no chapter includes a `.snap` with insta's header;
//!   every relative link and named test exists;
//! * [`generate`]: every generated file — the level listings and statement diffs ([`diff`]),
//!   the memory arithmetic ([`memory`]), the snapshots without their header ([`snapshots`]),
//!   the tables and plots of the reference run ([`figures`], [`plots`]) and the README's
//!   `make demo` block ([`provenance`]) — written by `book-check generate` and found stale by
//!   `book-check check`;
//! * [`rendered::check`]: the book as mdBook rendered it — no stray fence, raw `{{#`, snapshot
//!   header, heading from an included file, or page older than its sources.

pub mod anchors;
pub mod diff;
pub mod error;
pub mod figures;
pub mod generate;
pub mod includes;
pub mod memory;
pub mod plots;
pub mod provenance;
pub mod rendered;
pub mod snapshots;
pub mod tables;

pub use error::{Error, Result};
