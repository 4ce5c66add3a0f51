//! The level-to-level diffs of the user code, aligned by **statement**: each listing is cut into
//! statements (a multi-line call is one; a block's opening line is one, and its closing `}` is
//! one that only matches the closing `}` of the *same* opening line), and the longest common
//! subsequence is taken over statements, so a diff never pairs one level's `}` with an
//! unrelated `}` of the other. Written as full-context ```diff blocks the book includes.

use crate::anchors;
use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

/// The anchor around each level's user code (the one `bench demo` counts lines of).
pub const USER_CODE: &str = "user_code";

/// One listing of user code: where it lives and what the book calls it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Level {
    /// Short name for file names, e.g. `level1`.
    pub key: &'static str,
    /// Title for the book, e.g. `level 1 (raw DDP)`.
    pub title: &'static str,
    /// Source file holding the anchored span(s), relative to the workspace root.
    pub file: &'static str,
    /// The anchor; every span of it in `file` is joined, in order.
    pub anchor: &'static str,
}

/// The three levels, in order.
pub const LEVELS: [Level; 3] = [
    Level { key: "level1", title: "level 1 (raw DDP)", file: "level1-raw-ddp/src/lib.rs", anchor: USER_CODE },
    Level { key: "level2", title: "level 2 (Accelerator)", file: "level2-accelerator/src/train.rs", anchor: USER_CODE },
    Level { key: "level3", title: "level 3 (Trainer)", file: "level3-trainer/src/lib.rs", anchor: USER_CODE },
];

/// The single-process program the tutorial starts from, which the tutorial says Accelerate
/// changes in three lines: its `user_code` span, from the seed and the data to the end of the
/// loop, as the levels' spans (the book's listing of the loop alone is `baseline_loop`, inside).
pub const BASELINE: Level =
    Level { key: "baseline", title: "the single-process baseline", file: "shared/src/bin/ladder-baseline.rs", anchor: USER_CODE };

/// One side of a diff entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Line {
    /// In both.
    Same(String),
    /// Only in the old text.
    Removed(String),
    /// Only in the new text.
    Added(String),
}

/// One statement of a listing: its lines and the key it is compared by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Statement {
    /// The lines, as in the listing.
    pub lines: Vec<String>,
    /// What two statements must share to be the same: the text with whitespace collapsed; for a
    /// closing `}` line, also the key of the line that opened its block.
    pub key: String,
    /// A code statement (not blank, not only a comment).
    pub code: bool,
}

/// Parentheses and brackets opened minus closed on `line`, outside string literals and
/// outside a trailing `//` comment; and the line's code without that comment.
fn scan(line: &str) -> (i32, &str) {
    let (mut depth, mut in_str, mut escaped) = (0, false, false);
    let bytes = line.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        if in_str {
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_str = false,
                _ => {}
            }
        } else {
            match c {
                b'"' => in_str = true,
                b'(' | b'[' => depth += 1,
                b')' | b']' => depth -= 1,
                b'/' if bytes.get(i + 1) == Some(&b'/') => return (depth, line[..i].trim_end()),
                _ => {}
            }
        }
        i += 1;
    }
    (depth, line.trim_end())
}

fn collapse(lines: &[String]) -> String {
    lines.iter().flat_map(|l| l.split_whitespace()).collect::<Vec<_>>().join(" ")
}

/// `lines` cut into statements (see the module docs).
pub fn statements(lines: &[String]) -> Vec<Statement> {
    let mut out = Vec::new();
    let mut open: Vec<String> = Vec::new(); // keys of the blocks open at this point
    let mut current: Vec<String> = Vec::new();
    let mut depth = 0;
    for line in lines {
        let t = line.trim();
        if current.is_empty() && (t.is_empty() || t.starts_with("//")) {
            out.push(Statement { lines: vec![line.clone()], key: format!("{}{t}", if t.is_empty() { "\u{0}" } else { "" }), code: false });
            continue;
        }
        current.push(line.clone());
        let (d, code) = scan(line);
        depth += d;
        let ends = depth <= 0 && (code.ends_with(';') || code.ends_with('{') || code.ends_with('}') || code.ends_with(','));
        if !ends {
            continue;
        }
        depth = 0;
        let lines = std::mem::take(&mut current);
        let text = collapse(&lines);
        let mut key = text.clone();
        if text.starts_with('}') || text.starts_with(')') {
            let opener = open.pop().unwrap_or_default();
            key = format!("{text}\u{0}closes\u{0}{opener}");
        }
        if text.ends_with('{') {
            open.push(key.clone());
        }
        out.push(Statement { lines, key, code: true });
    }
    if !current.is_empty() {
        let key = collapse(&current);
        out.push(Statement { lines: current, key, code: true });
    }
    out
}

/// A statement diff of `old` against `new` (longest common subsequence of statement keys;
/// removals before additions within a changed region), flattened to lines.
pub fn diff_lines(old: &[String], new: &[String]) -> Vec<Line> {
    let (a, b) = (statements(old), statements(new));
    diff_statements(&a, &b).into_iter().flat_map(|(kind, s)| s.lines.iter().map(move |l| kind(l.clone())).collect::<Vec<_>>()).collect()
}

type Kind = fn(String) -> Line;

fn diff_statements<'a>(a: &'a [Statement], b: &'a [Statement]) -> Vec<(Kind, &'a Statement)> {
    let (n, m) = (a.len(), b.len());
    let mut lcs = vec![vec![0u32; m + 1]; n + 1];
    for i in (0..n).rev() {
        for j in (0..m).rev() {
            lcs[i][j] = if a[i].key == b[j].key { lcs[i + 1][j + 1] + 1 } else { lcs[i + 1][j].max(lcs[i][j + 1]) };
        }
    }
    let (mut i, mut j, mut out) = (0, 0, Vec::with_capacity(n + m));
    while i < n || j < m {
        if i < n && j < m && a[i].key == b[j].key {
            out.push((Line::Same as Kind, &a[i]));
            (i, j) = (i + 1, j + 1);
        } else if i < n && (j == m || lcs[i + 1][j] >= lcs[i][j + 1]) {
            out.push((Line::Removed as Kind, &a[i]));
            i += 1;
        } else {
            out.push((Line::Added as Kind, &b[j]));
            j += 1;
        }
    }
    out
}

/// Counts of a statement diff: code statements kept, removed and added.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DiffStats {
    /// Statements in both.
    pub same: usize,
    /// Statements only in the old text.
    pub removed: usize,
    /// Statements only in the new text.
    pub added: usize,
}

/// The statement counts of the diff from `old` to `new` (blank and comment lines not counted).
pub fn stats(old: &[String], new: &[String]) -> DiffStats {
    let (a, b) = (statements(old), statements(new));
    let mut s = DiffStats::default();
    for (kind, st) in diff_statements(&a, &b) {
        if !st.code {
            continue;
        }
        match kind(String::new()) {
            Line::Same(_) => s.same += 1,
            Line::Removed(_) => s.removed += 1,
            Line::Added(_) => s.added += 1,
        }
    }
    s
}

/// Code lines of a listing: not blank, not only a comment (as `bench demo` counts them).
pub fn code_lines(lines: &[String]) -> usize {
    lines.iter().filter(|l| !l.trim().is_empty() && !l.trim_start().starts_with("//")).count()
}

/// The code of `level` under `root`: every span of its anchor joined and dedented.
///
/// # Errors
/// An unreadable file, no span, or a span never closed.
pub fn user_code(root: &Path, level: &Level) -> Result<Vec<String>> {
    let file = root.join(level.file);
    let text = std::fs::read_to_string(&file).map_err(|e| Error::io(&file, e))?;
    let spans = anchors::spans(&text, level.anchor);
    if spans.is_empty() {
        return Err(Error::AnchorMissing { file: PathBuf::from(level.file), anchor: level.anchor.into() });
    }
    if let Some(s) = spans.iter().find(|s| !s.closed) {
        return Err(Error::AnchorUnclosed { file: PathBuf::from(level.file), line: s.start_line, anchor: level.anchor.into() });
    }
    Ok(anchors::joined_dedented(&spans))
}

/// The Markdown of the diff from listing `a` to listing `b`: a one-line summary and a ```diff
/// block.
pub fn diff_markdown(a: &Level, old: &[String], b: &Level, new: &[String]) -> String {
    let s = stats(old, new);
    let mut out = format!(
        "<!-- generated by `book-check generate` from the `{}` anchors of {} and the `{}` anchors of {}; do not edit -->\n\n\
         From {} to {}: {} statements kept, {} removed, {} added; {} → {} lines of code \
         (not blank, not comments).\n\n```diff\n",
        a.anchor,
        a.file,
        b.anchor,
        b.file,
        a.title,
        b.title,
        s.same,
        s.removed,
        s.added,
        code_lines(old),
        code_lines(new)
    );
    for l in diff_lines(old, new) {
        let (sign, text) = match &l {
            Line::Same(t) => (' ', t),
            Line::Removed(t) => ('-', t),
            Line::Added(t) => ('+', t),
        };
        out.push(sign);
        out.push(' ');
        out.push_str(text);
        out.push('\n');
    }
    out.push_str("```\n");
    out
}

/// The Markdown listing of one level's whole user code (every span, joined), for levels whose
/// user code comes in more than one span (mdBook's `{{#include}}` shows only the first).
pub fn listing_markdown(level: &Level, lines: &[String]) -> String {
    let mut out = format!(
        "<!-- generated by `book-check generate` from every `{}` span of {}; do not edit -->\n\n```rust,ignore\n",
        level.anchor, level.file
    );
    for l in lines {
        out.push_str(l);
        out.push('\n');
    }
    out.push_str("```\n");
    out
}

/// The generated files, as (name, Markdown): `baseline-to-level2.md`, `level1-to-level2.md`,
/// `level2-to-level3.md` and `<level>-user-code.md` for each level.
///
/// # Errors
/// An unreadable source, a missing or unclosed anchor.
pub fn generated(root: &Path) -> Result<Vec<(String, String)>> {
    let code = LEVELS.iter().map(|l| user_code(root, l)).collect::<Result<Vec<_>>>()?;
    let mut out = Vec::new();
    if root.join(BASELINE.file).exists() {
        let base = user_code(root, &BASELINE)?;
        out.push((format!("{}-to-{}.md", BASELINE.key, LEVELS[1].key), diff_markdown(&BASELINE, &base, &LEVELS[1], &code[1])));
    }
    for w in 0..LEVELS.len() - 1 {
        let (a, b) = (&LEVELS[w], &LEVELS[w + 1]);
        out.push((format!("{}-to-{}.md", a.key, b.key), diff_markdown(a, &code[w], b, &code[w + 1])));
    }
    for (level, lines) in LEVELS.iter().zip(&code) {
        out.push((format!("{}-user-code.md", level.key), listing_markdown(level, lines)));
    }
    Ok(out)
}

/// Writes what [`generated`] returns into `out_dir`; returns the files written.
///
/// # Errors
/// As [`generated`]; an unwritable output directory.
pub fn write_all(root: &Path, out_dir: &Path) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(out_dir).map_err(|e| Error::io(out_dir, e))?;
    let mut written = Vec::new();
    for (name, text) in generated(root)? {
        let path = out_dir.join(name);
        std::fs::write(&path, text).map_err(|e| Error::io(&path, e))?;
        written.push(path);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(s: &str) -> Vec<String> {
        s.lines().map(str::to_string).collect()
    }

    fn keys(s: &str) -> Vec<String> {
        statements(&v(s)).into_iter().map(|s| s.lines.join("\n")).collect()
    }

    #[test]
    fn a_multi_line_call_is_one_statement() {
        let text = "println!(\n    \"a ({}) b\",\n    x,\n);\nlet y = 1;";
        assert_eq!(keys(text), ["println!(\n    \"a ({}) b\",\n    x,\n);", "let y = 1;"]);
        // A parenthesis in a string or a comment does not open anything.
        assert_eq!(keys("let s = \"(\"; // (\nlet t = 2;"), ["let s = \"(\"; // (", "let t = 2;"]);
    }

    #[test]
    fn diff_of_equal_and_empty() {
        assert_eq!(diff_lines(&v("a;\nb;"), &v("a;\nb;")), vec![Line::Same("a;".into()), Line::Same("b;".into())]);
        assert_eq!(diff_lines(&[], &v("x;")), vec![Line::Added("x;".into())]);
        assert_eq!(diff_lines(&v("x;"), &[]), vec![Line::Removed("x;".into())]);
    }

    #[test]
    fn a_closing_brace_matches_only_the_same_block() {
        // Line by line, the two `}` would pair up and `work();` would look kept inside another
        // loop; by statement, the old loop goes as a whole and the new one comes as a whole.
        let old = v("for a in xs {\n    work();\n}\ndone();");
        let new = v("for b in ys {\n    work();\n}\ndone();");
        let d = diff_lines(&old, &new);
        assert_eq!(
            d,
            vec![
                Line::Removed("for a in xs {".into()),
                Line::Added("for b in ys {".into()),
                Line::Same("    work();".into()),
                Line::Removed("}".into()),
                Line::Added("}".into()),
                Line::Same("done();".into()),
            ]
        );
        assert_eq!(stats(&old, &new), DiffStats { same: 2, removed: 2, added: 2 });
    }

    #[test]
    fn code_lines_skip_blank_and_comments() {
        assert_eq!(code_lines(&v("// c\n\nlet a = 1; // x\n  // d\nf();")), 2);
    }
}
