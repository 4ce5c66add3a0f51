//! "Lines of user training code": what a user of each level writes, counted between mdBook
//! anchor comments — the same spans the book `{{#include}}`s — so the table and the book agree.

use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

/// The anchor around each level's user code: `// ANCHOR: user_code` … `// ANCHOR_END: user_code`.
pub const USER_CODE_ANCHOR: &str = "user_code";

/// Counts the code lines between every `// ANCHOR: {anchor}` and the next
/// `// ANCHOR_END: {anchor}` in `text` (several spans add up, as mdBook concatenates them).
///
/// Counted: non-blank lines that are not comments. Not counted: blank lines, `//`, `///`, `//!`
/// comment lines, lines inside `/* … */` block comments, and the anchor lines themselves (mdBook
/// drops every `ANCHOR:` line from a listing). A line with code and a trailing comment counts.
///
/// `file` only names the source in errors.
///
/// # Errors
/// [`Error::AnchorMissing`] when no span exists; [`Error::AnchorUnbalanced`] for an `ANCHOR_END`
/// without its `ANCHOR`, a second `ANCHOR` before the `ANCHOR_END`, or an unclosed span.
pub fn count_between_anchors(text: &str, anchor: &str, file: &Path) -> Result<usize> {
    let unbalanced = |line: usize, problem: &str| Error::AnchorUnbalanced {
        file: file.to_path_buf(),
        line,
        anchor: anchor.to_string(),
        problem: problem.to_string(),
    };
    let (mut open, mut spans, mut count, mut in_block) = (None::<usize>, 0usize, 0usize, false);
    for (i, line) in text.lines().enumerate() {
        let t = line.trim();
        if is_anchor(t, "ANCHOR:", anchor) {
            if let Some(first) = open {
                return Err(unbalanced(i + 1, &format!("second `ANCHOR: {anchor}` while the one of line {first} is open")));
            }
            open = Some(i + 1);
            continue;
        }
        if is_anchor(t, "ANCHOR_END:", anchor) {
            if open.take().is_none() {
                return Err(unbalanced(i + 1, &format!("`ANCHOR_END: {anchor}` without an opening `ANCHOR: {anchor}`")));
            }
            spans += 1;
            continue;
        }
        if open.is_none() {
            continue;
        }
        if in_block {
            if t.contains("*/") {
                in_block = false;
                let rest = t.split_once("*/").map_or("", |(_, r)| r).trim();
                if !rest.is_empty() && !rest.starts_with("//") {
                    count += 1;
                }
            }
            continue;
        }
        if t.is_empty() || t.starts_with("//") || t.contains("ANCHOR:") || t.contains("ANCHOR_END:") {
            continue;
        }
        if t.starts_with("/*") {
            in_block = !t.contains("*/");
            continue;
        }
        count += 1;
    }
    if let Some(line) = open {
        return Err(unbalanced(line, &format!("`ANCHOR: {anchor}` never closed by `ANCHOR_END: {anchor}`")));
    }
    if spans == 0 {
        return Err(Error::AnchorMissing { file: file.display().to_string(), anchor: anchor.to_string() });
    }
    Ok(count)
}

/// True for an mdBook anchor comment `// ANCHOR: name` (or `ANCHOR_END:`) naming exactly `name`.
fn is_anchor(trimmed: &str, kind: &str, name: &str) -> bool {
    let Some(rest) = trimmed.strip_prefix("//") else { return false };
    let Some(rest) = rest.trim_start().strip_prefix(kind) else { return false };
    rest.split_whitespace().next() == Some(name)
}

/// Reads `file` and counts its user-code lines (see [`count_between_anchors`]).
///
/// # Errors
/// [`Error::Io`] naming the file; the anchor errors of [`count_between_anchors`].
pub fn count_file(file: &Path) -> Result<usize> {
    let text = std::fs::read_to_string(file).map_err(Error::io(file))?;
    count_between_anchors(&text, USER_CODE_ANCHOR, file)
}

/// Counts a level crate's user-code lines: `src/main.rs` if it holds the anchors, else
/// `src/lib.rs`. Returns the file counted and the count.
///
/// # Errors
/// [`Error::AnchorMissing`] naming both files when neither has the anchors (or exists);
/// [`Error::AnchorUnbalanced`] / [`Error::Io`] from the file that has them.
pub fn count_level(crate_dir: &Path) -> Result<(PathBuf, usize)> {
    let candidates = [crate_dir.join("src").join("main.rs"), crate_dir.join("src").join("lib.rs")];
    for file in &candidates {
        match std::fs::read_to_string(file) {
            Ok(text) => match count_between_anchors(&text, USER_CODE_ANCHOR, file) {
                Ok(n) => return Ok((file.clone(), n)),
                Err(Error::AnchorMissing { .. }) => continue,
                Err(e) => return Err(e),
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(Error::Io { path: file.clone(), source: e }),
        }
    }
    Err(Error::AnchorMissing {
        file: format!("{} and {}", candidates[0].display(), candidates[1].display()),
        anchor: USER_CODE_ANCHOR.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/user_code.rs")
    }

    /// The fixture's spans hold exactly 7 code lines (see the comments in the file).
    #[test]
    fn counts_code_lines_of_every_span_in_the_fixture() {
        assert_eq!(count_file(&fixture()).unwrap(), 7);
    }

    #[test]
    fn other_anchors_and_trailing_comments() {
        let text = "// ANCHOR: setup\nlet a = 1;\n// ANCHOR_END: setup\n// ANCHOR: user_code\nlet b = 2; // why\n\n   // note\n// ANCHOR: user_code_extra\nlet c = 3;\n// ANCHOR_END: user_code_extra\n// ANCHOR_END: user_code\n";
        assert_eq!(count_between_anchors(text, "user_code", Path::new("x.rs")).unwrap(), 2);
    }

    #[test]
    fn missing_anchors_name_the_file() {
        let e = count_between_anchors("fn main() {}\n", "user_code", Path::new("level9/src/lib.rs")).unwrap_err();
        insta::assert_snapshot!(e.to_string(), @"level9/src/lib.rs: no `// ANCHOR: user_code` … `// ANCHOR_END: user_code` pair (expected the user's training code between those two mdBook anchor comments)");
    }

    #[test]
    fn unbalanced_anchors_name_file_and_line() {
        let e = count_between_anchors("x\n// ANCHOR: user_code\ny\n", "user_code", Path::new("a.rs")).unwrap_err();
        insta::assert_snapshot!(e.to_string(), @"a.rs:2: `ANCHOR: user_code` never closed by `ANCHOR_END: user_code` (anchors must come in `// ANCHOR: user_code` … `// ANCHOR_END: user_code` pairs)");
        let e = count_between_anchors("// ANCHOR_END: user_code\n", "user_code", Path::new("a.rs")).unwrap_err();
        assert!(e.to_string().starts_with("a.rs:1: `ANCHOR_END: user_code` without an opening"), "{e}");
    }

    #[test]
    fn a_crate_without_anchors_names_both_files() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("src")).unwrap();
        std::fs::write(dir.path().join("src/main.rs"), "fn main() {}\n").unwrap();
        let e = count_level(dir.path()).unwrap_err().to_string();
        assert!(e.contains("src/main.rs and ") && e.contains("src/lib.rs: no `// ANCHOR: user_code`"), "{e}");
        std::fs::write(dir.path().join("src/lib.rs"), "// ANCHOR: user_code\nfn f() {}\n// ANCHOR_END: user_code\n").unwrap();
        assert_eq!(count_level(dir.path()).unwrap(), (dir.path().join("src/lib.rs"), 1));
    }
}
