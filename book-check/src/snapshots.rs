//! The tests' insta snapshots as the book shows them: without insta's header.
//!
//! A `.snap` file opens with a YAML header between two `---` lines (`source`, `assertion_line`,
//! `expression`, …) that is insta's bookkeeping, not the program's output; included as it is,
//! the header shows in the listing, and in a Markdown list its `---` even closes the list and
//! turns the line before into a heading. So a chapter includes
//! `generated/snapshots/<crate>/<name>.txt`, which `book-check generate` writes from
//! `<crate>/tests/snapshots/<name>.snap` with the header removed (and `book-check check` finds
//! stale when the snapshot changed).

use crate::error::{Error, Result};
use crate::includes::{find_includes, markdown_files};
use std::path::{Path, PathBuf};

/// Where the header-less copies live, relative to the book's `src/`.
pub const DIR: &str = "generated/snapshots";

/// `text` without insta's leading `---` … `---` header; unchanged when it has none.
pub fn strip_header(text: &str) -> &str {
    let Some(rest) = text.strip_prefix("---\n") else { return text };
    let mut offset = 4;
    for line in rest.split_inclusive('\n') {
        offset += line.len();
        if line.trim_end() == "---" {
            return &text[offset..];
        }
    }
    text
}

/// The snapshot a header-less copy comes from: `generated/snapshots/<crate>/<name>.txt` (as
/// written in an include, relative to `src/`) → `<crate>/tests/snapshots/<name>.snap` (relative
/// to the workspace root). `None` for any other path.
pub fn source_of(include_path: &str) -> Option<PathBuf> {
    let rest = include_path.strip_prefix(DIR)?.strip_prefix('/')?;
    let (krate, file) = rest.split_once('/')?;
    let name = file.strip_suffix(".txt")?;
    if krate.is_empty() || name.is_empty() || name.contains('/') {
        return None;
    }
    Some(Path::new(krate).join("tests/snapshots").join(format!("{name}.snap")))
}

/// Every header-less copy the book's chapters include, as (path relative to the workspace root,
/// contents), from the snapshots under `root`. `src` is the book's `src/` directory.
///
/// # Errors
/// An unreadable chapter; a snapshot named by an include that does not exist (naming the
/// chapter, its line and the snapshot).
pub fn generated(root: &Path, src: &Path) -> Result<Vec<(PathBuf, String)>> {
    let mut out: Vec<(PathBuf, String)> = Vec::new();
    let mut problems = Vec::new();
    for md in markdown_files(src)? {
        if md.starts_with(src.join("generated")) {
            continue;
        }
        let text = std::fs::read_to_string(&md).map_err(|e| Error::io(&md, e))?;
        for inc in find_includes(&md, &text) {
            let Some(snap) = source_of(&inc.path) else { continue };
            let dest = src.join(&inc.path);
            let dest = dest.strip_prefix(root).map(Path::to_path_buf).unwrap_or(dest);
            if out.iter().any(|(p, _)| *p == dest) {
                continue;
            }
            match std::fs::read_to_string(root.join(&snap)) {
                Ok(s) => out.push((dest, strip_header(&s).to_string())),
                Err(e) => problems.push(format!("{}:{}: {{{{#include {}}}}}: {}: {e}", md.display(), inc.line, inc.path, snap.display())),
            }
        }
    }
    if problems.is_empty() {
        Ok(out)
    } else {
        Err(Error::Includes { problems })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_goes_body_stays() {
        let snap = "---\nsource: shared/tests/data_errors.rs\nassertion_line: 12\nexpression: err.to_string()\n---\nfile: checksum mismatch\n---\nnot a header\n";
        assert_eq!(strip_header(snap), "file: checksum mismatch\n---\nnot a header\n");
        assert_eq!(strip_header("plain\n"), "plain\n");
        assert_eq!(strip_header("---\nunclosed\n"), "---\nunclosed\n");
    }

    #[test]
    fn include_paths_map_to_snapshots() {
        assert_eq!(
            source_of("generated/snapshots/shared/data_errors__checksum_mismatch.txt"),
            Some(PathBuf::from("shared/tests/snapshots/data_errors__checksum_mismatch.snap"))
        );
        assert_eq!(source_of("generated/demo.md"), None);
        assert_eq!(source_of("generated/snapshots/x.txt"), None);
        assert_eq!(source_of("generated/snapshots/a/b/c.txt"), None);
    }
}
