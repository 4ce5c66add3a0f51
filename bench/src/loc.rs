//! "Lines of user training code": what a user of each level writes, counted between mdBook
//! anchor comments — the same spans the book `{{#include}}`s — so the table and the book agree.

use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

/// The anchor around each level's user code: `// ANCHOR: user_code` … `// ANCHOR_END: user_code`.
pub const USER_CODE_ANCHOR: &str = "user_code";

/// Counts the code lines between every `// ANCHOR: {anchor}` and the next
/// `// ANCHOR_END: {anchor}` in `text` (several spans add up; mdBook itself would include only
/// the first span of a repeated anchor, so the book shows a generated listing of all of them).
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

/// Counts a level crate's user-code lines: the spans of every `.rs` file under `src/` that has
/// them (`src/main.rs`, then `src/lib.rs`, then the others in path order), added up. Returns the
/// files that held spans (in that order) and the total.
///
/// # Errors
/// [`Error::AnchorMissing`] naming `src/main.rs`, `src/lib.rs` and the count of other files
/// searched when none has the anchors; [`Error::AnchorUnbalanced`] / [`Error::Io`] naming the
/// file at fault.
pub fn count_level(crate_dir: &Path) -> Result<(Vec<PathBuf>, usize)> {
    let src = crate_dir.join("src");
    let (main, lib) = (src.join("main.rs"), src.join("lib.rs"));
    let mut files = vec![main.clone(), lib.clone()];
    let mut others = Vec::new();
    collect_rs(&src, &mut others)?;
    others.sort();
    others.retain(|f| *f != main && *f != lib);
    let searched_others = others.len();
    files.extend(others);
    let (mut found, mut total) = (Vec::new(), 0);
    for file in &files {
        let text = match std::fs::read_to_string(file) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(Error::Io { path: file.clone(), source: e }),
        };
        match count_between_anchors(&text, USER_CODE_ANCHOR, file) {
            Ok(n) => {
                found.push(file.clone());
                total += n;
            }
            Err(Error::AnchorMissing { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    if found.is_empty() {
        return Err(Error::AnchorMissing {
            file: format!("{}, {} and {searched_others} other .rs file(s) under {}", main.display(), lib.display(), src.display()),
            anchor: USER_CODE_ANCHOR.to_string(),
        });
    }
    Ok((found, total))
}

/// Every `.rs` file under `dir`, recursively (a missing `dir` holds none).
fn collect_rs(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::Io { path: dir.to_path_buf(), source: e }),
    };
    for entry in entries {
        let path = entry.map_err(Error::io(dir))?.path();
        if path.is_dir() {
            collect_rs(&path, out)?;
        } else if path.extension().is_some_and(|x| x == "rs") {
            out.push(path);
        }
    }
    Ok(())
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

    /// A span cut around the harness's lines and continued (`// ANCHOR: user_code (continued)`,
    /// as book-check joins them): the user's lines count, the cut ones do not.
    #[test]
    fn a_continued_span_counts_the_user_lines_only() {
        let text = "    // ANCHOR: user_code\n    let loss = model.forward(&x);\n    // ANCHOR_END: user_code\n    timer.lap(Phase::Forward);\n    \
                    // ANCHOR: user_code (continued)\n    model.backward(&loss);\n    // ANCHOR_END: user_code\n";
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
    fn a_crate_without_anchors_names_what_was_searched() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("src/bin")).unwrap();
        std::fs::write(dir.path().join("src/main.rs"), "fn main() {}\n").unwrap();
        std::fs::write(dir.path().join("src/bin/tool.rs"), "fn main() {}\n").unwrap();
        let e = count_level(dir.path()).unwrap_err().to_string();
        let src = dir.path().join("src");
        assert_eq!(
            e.replace(&src.display().to_string(), "<src>"),
            "<src>/main.rs, <src>/lib.rs and 1 other .rs file(s) under <src>: no `// ANCHOR: user_code` … \
             `// ANCHOR_END: user_code` pair (expected the user's training code between those two mdBook anchor comments)"
        );
    }

    #[test]
    fn spans_of_every_file_under_src_add_up() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("src")).unwrap();
        let span = |n: usize| format!("// ANCHOR: user_code\n{}// ANCHOR_END: user_code\n", "f();\n".repeat(n));
        std::fs::write(dir.path().join("src/main.rs"), "fn main() {}\n").unwrap();
        std::fs::write(dir.path().join("src/train.rs"), span(3)).unwrap();
        std::fs::write(dir.path().join("src/lib.rs"), span(2) + &span(1)).unwrap();
        let (files, n) = count_level(dir.path()).unwrap();
        assert_eq!(n, 6);
        assert_eq!(files, [dir.path().join("src/lib.rs"), dir.path().join("src/train.rs")]);
        std::fs::write(dir.path().join("src/train.rs"), "// ANCHOR: user_code\n").unwrap();
        assert!(count_level(dir.path()).unwrap_err().to_string().contains("train.rs:1: `ANCHOR: user_code` never closed"));
    }
}
