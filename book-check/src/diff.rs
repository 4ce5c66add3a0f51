//! The level-to-level diffs of the user code, aligned by **statement**: each listing is cut into
//! statements (a multi-line call is one; a block's opening line is one, and so is its closing
//! `}`), and the two sequences are aligned by statement, each statement of either side
//! classified:
//!
//! * **kept** — the same text (whitespace aside); a closing `}` is kept only when the lines
//!   that opened the two blocks are the same or a rewrite of each other, so a diff never pairs
//!   one level's `}` with an unrelated `}` of the other;
//! * **rewritten** — not the same text, but the same statement respelled: at least half of the
//!   words (identifiers, keywords, numbers) of the two, in order, are shared ([`similarity`]),
//!   e.g. `let model = WrappedModel::new(vs, net, pg, &plan.wrap)?;` →
//!   `let model = accelerator.prepare_model(vs, net)?;`;
//! * **removed** / **added** — the rest.
//!
//! The alignment maximises kept statements first, then rewritten ones (a weighted longest
//! common subsequence). Written as full-context ```diff blocks the book includes: a rewritten
//! statement is its `-` lines directly followed by its `+` lines.

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
/// changes in three lines: its `user_code` spans, from the seed and the data to the end of the
/// loop, with the harness cut out as at the levels (the book's listing of the baseline is
/// `baseline-user-code.md`).
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

/// One statement of a listing: its lines and what it is compared by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Statement {
    /// The lines, as in the listing.
    pub lines: Vec<String>,
    /// What two statements must share to be the same: the text with whitespace collapsed; for a
    /// closing `}` line, also the key of the line that opened its block.
    pub key: String,
    /// A code statement (not blank, not only a comment).
    pub code: bool,
    /// The text with whitespace collapsed (without the opener, for a closing line).
    pub text: String,
    /// For a closing `}` / `)` line: the text of the line that opened its block.
    pub opener: Option<String>,
}

/// How two statements relate (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// In both, the same.
    Kept,
    /// In both, respelled: the old statement, then the new.
    Rewritten,
    /// Only in the old listing.
    Removed,
    /// Only in the new listing.
    Added,
}

/// The words of a statement — identifiers, keywords and numbers, in order — for [`similarity`].
fn words(text: &str) -> Vec<&str> {
    text.split(|c: char| !(c.is_alphanumeric() || c == '_')).filter(|w| !w.is_empty()).collect()
}

/// How alike two statements read, from 0 to 1: twice the longest common subsequence of their
/// [`words`] over the words of both (1 for two texts without words).
pub fn similarity(a: &str, b: &str) -> f64 {
    let (a, b) = (words(a), words(b));
    if a.is_empty() && b.is_empty() {
        return 1.0;
    }
    let mut row = vec![0usize; b.len() + 1];
    for wa in &a {
        let mut diag = 0;
        for (j, wb) in b.iter().enumerate() {
            let up = row[j + 1];
            row[j + 1] = if wa == wb { diag + 1 } else { up.max(row[j]) };
            diag = up;
        }
    }
    2.0 * row[b.len()] as f64 / (a.len() + b.len()) as f64
}

/// The similarity from which two statements are a rewrite of each other.
pub const REWRITE_SIMILARITY: f64 = 0.5;

/// The alignment score of pairing `a` with `b`: 3 kept, 2 rewritten, 1 the same blank or comment
/// line, 0 not to be paired.
fn score(a: &Statement, b: &Statement) -> u32 {
    match (a.code, b.code) {
        (true, true) => {}
        (false, false) => return u32::from(a.key == b.key),
        _ => return 0,
    }
    match (&a.opener, &b.opener) {
        (Some(oa), Some(ob)) => {
            if oa != ob && similarity(oa, ob) < REWRITE_SIMILARITY {
                0
            } else if a.text == b.text {
                3
            } else {
                2
            }
        }
        (None, None) if a.text == b.text => 3,
        (None, None) if similarity(&a.text, &b.text) >= REWRITE_SIMILARITY => 2,
        _ => 0,
    }
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
    let mut open: Vec<(String, String)> = Vec::new(); // (key, text) of the blocks open at this point
    let mut current: Vec<String> = Vec::new();
    let mut depth = 0;
    for line in lines {
        let t = line.trim();
        if current.is_empty() && (t.is_empty() || t.starts_with("//")) {
            let key = format!("{}{t}", if t.is_empty() { "\u{0}" } else { "" });
            out.push(Statement { lines: vec![line.clone()], key, code: false, text: t.to_string(), opener: None });
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
        let mut opener = None;
        if text.starts_with('}') || text.starts_with(')') {
            let (opener_key, opener_text) = open.pop().unwrap_or_default();
            key = format!("{text}\u{0}closes\u{0}{opener_key}");
            opener = Some(opener_text);
        }
        if text.ends_with('{') {
            open.push((key.clone(), text.clone()));
        }
        out.push(Statement { lines, key, code: true, text, opener });
    }
    if !current.is_empty() {
        let text = collapse(&current);
        out.push(Statement { lines: current, key: text.clone(), code: true, text, opener: None });
    }
    out
}

/// A statement diff of `old` against `new`, flattened to lines: a kept statement's lines as
/// [`Line::Same`] (the new listing's spelling), a rewritten one's old lines removed and new lines
/// added, removals before additions within a changed region.
pub fn diff_lines(old: &[String], new: &[String]) -> Vec<Line> {
    let (a, b) = (statements(old), statements(new));
    let mut out = Vec::new();
    for (kind, x, y) in align(&a, &b) {
        let lines = |s: Option<&Statement>| s.map(|s| s.lines.clone()).unwrap_or_default();
        match kind {
            Kind::Kept => out.extend(lines(y).into_iter().map(Line::Same)),
            Kind::Rewritten => {
                out.extend(lines(x).into_iter().map(Line::Removed));
                out.extend(lines(y).into_iter().map(Line::Added));
            }
            Kind::Removed => out.extend(lines(x).into_iter().map(Line::Removed)),
            Kind::Added => out.extend(lines(y).into_iter().map(Line::Added)),
        }
    }
    out
}

/// The alignment of statements `a` (old) and `b` (new): each step a kind with the old and/or
/// new statement (see the module docs). Blank and comment lines pair only with the same line,
/// as kept.
pub fn align<'a>(a: &'a [Statement], b: &'a [Statement]) -> Vec<(Kind, Option<&'a Statement>, Option<&'a Statement>)> {
    let (n, m) = (a.len(), b.len());
    let scores: Vec<Vec<u32>> = a.iter().map(|x| b.iter().map(|y| score(x, y)).collect()).collect();
    let mut best = vec![vec![0u32; m + 1]; n + 1];
    for i in (0..n).rev() {
        for j in (0..m).rev() {
            let pair = if scores[i][j] > 0 { scores[i][j] + best[i + 1][j + 1] } else { 0 };
            best[i][j] = pair.max(best[i + 1][j]).max(best[i][j + 1]);
        }
    }
    let (mut i, mut j, mut out) = (0, 0, Vec::with_capacity(n + m));
    while i < n || j < m {
        if i < n && j < m && scores[i][j] > 0 && best[i][j] == scores[i][j] + best[i + 1][j + 1] {
            let kind = if scores[i][j] == 2 { Kind::Rewritten } else { Kind::Kept };
            out.push((kind, Some(&a[i]), Some(&b[j])));
            (i, j) = (i + 1, j + 1);
        } else if i < n && (j == m || best[i + 1][j] >= best[i][j + 1]) {
            out.push((Kind::Removed, Some(&a[i]), None));
            i += 1;
        } else {
            out.push((Kind::Added, None, Some(&b[j])));
            j += 1;
        }
    }
    out
}

/// Counts of a statement diff: code statements kept, rewritten, removed and added.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DiffStats {
    /// Statements in both, the same.
    pub same: usize,
    /// Statements in both, respelled (each counted once).
    pub rewritten: usize,
    /// Statements only in the old text.
    pub removed: usize,
    /// Statements only in the new text.
    pub added: usize,
}

/// The statement counts of the diff from `old` to `new` (blank and comment lines not counted).
pub fn stats(old: &[String], new: &[String]) -> DiffStats {
    let (a, b) = (statements(old), statements(new));
    let mut s = DiffStats::default();
    for (kind, x, y) in align(&a, &b) {
        if !x.or(y).is_some_and(|st| st.code) {
            continue;
        }
        match kind {
            Kind::Kept => s.same += 1,
            Kind::Rewritten => s.rewritten += 1,
            Kind::Removed => s.removed += 1,
            Kind::Added => s.added += 1,
        }
    }
    s
}

/// Code lines of a listing: not blank, not only a comment (as `bench demo` counts them).
pub fn code_lines(lines: &[String]) -> usize {
    lines.iter().filter(|l| !l.trim().is_empty() && !l.trim_start().starts_with("//")).count()
}

/// The code of `level` under `root`: every span of its anchor joined and dedented, a span
/// marked `(continued)` joined to the one before it ([`anchors::joined_dedented`]).
///
/// # Errors
/// An unreadable file, no span, a span never closed, or a first span marked `(continued)`.
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
    if spans[0].continues {
        return Err(Error::AnchorContinuesNothing {
            file: PathBuf::from(level.file),
            line: spans[0].start_line,
            anchor: level.anchor.into(),
        });
    }
    Ok(anchors::joined_dedented(&spans))
}

/// The Markdown of the diff from listing `a` to listing `b`: a one-line summary and a ```diff
/// block.
pub fn diff_markdown(a: &Level, old: &[String], b: &Level, new: &[String]) -> String {
    let s = stats(old, new);
    let mut out = format!(
        "<!-- generated by `book-check generate` from the `{}` anchors of {} and the `{}` anchors of {}; do not edit -->\n\n\
         From {} to {}: {} statements kept, {} rewritten, {} removed, {} added; {} → {} lines of code \
         (not blank, not comments).\n\n```diff\n",
        a.anchor,
        a.file,
        b.anchor,
        b.file,
        a.title,
        b.title,
        s.same,
        s.rewritten,
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
/// `level2-to-level3.md` and `<level>-user-code.md` for each level (and the baseline).
///
/// # Errors
/// An unreadable source, a missing or unclosed anchor.
pub fn generated(root: &Path) -> Result<Vec<(String, String)>> {
    let code = LEVELS.iter().map(|l| user_code(root, l)).collect::<Result<Vec<_>>>()?;
    let mut out = Vec::new();
    let mut base_listing = None;
    if root.join(BASELINE.file).exists() {
        let base = user_code(root, &BASELINE)?;
        out.push((format!("{}-to-{}.md", BASELINE.key, LEVELS[1].key), diff_markdown(&BASELINE, &base, &LEVELS[1], &code[1])));
        base_listing = Some((format!("{}-user-code.md", BASELINE.key), listing_markdown(&BASELINE, &base)));
    }
    for w in 0..LEVELS.len() - 1 {
        let (a, b) = (&LEVELS[w], &LEVELS[w + 1]);
        out.push((format!("{}-to-{}.md", a.key, b.key), diff_markdown(a, &code[w], b, &code[w + 1])));
    }
    for (level, lines) in LEVELS.iter().zip(&code) {
        out.push((format!("{}-user-code.md", level.key), listing_markdown(level, lines)));
    }
    out.extend(base_listing);
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
        // block; by statement, the old loop goes as a whole and the new `if` comes as a whole.
        let old = v("for a in xs {\n    work();\n}\ndone();");
        let new = v("if ready {\n    work();\n}\ndone();");
        let d = diff_lines(&old, &new);
        assert_eq!(
            d,
            vec![
                Line::Removed("for a in xs {".into()),
                Line::Added("if ready {".into()),
                Line::Same("    work();".into()),
                Line::Removed("}".into()),
                Line::Added("}".into()),
                Line::Same("done();".into()),
            ]
        );
        assert_eq!(stats(&old, &new), DiffStats { same: 2, rewritten: 0, removed: 2, added: 2 });
    }

    #[test]
    fn a_respelled_statement_is_rewritten_and_its_block_kept() {
        let old = v("let mut model = WrappedModel::new(vs, net, pg, &plan.wrap)?;\nlet sampler = DistributedSampler::new(n, w, r)?;\n\
                     for epoch in 1..=args.epochs {\n    step();\n}");
        let new = v("let model = accelerator.prepare_model(vs, net)?;\nfor epoch in first_epoch..=args.epochs {\n    step();\n}");
        assert_eq!(
            diff_lines(&old, &new),
            vec![
                Line::Removed("let mut model = WrappedModel::new(vs, net, pg, &plan.wrap)?;".into()),
                Line::Added("let model = accelerator.prepare_model(vs, net)?;".into()),
                Line::Removed("let sampler = DistributedSampler::new(n, w, r)?;".into()),
                Line::Removed("for epoch in 1..=args.epochs {".into()),
                Line::Added("for epoch in first_epoch..=args.epochs {".into()),
                Line::Same("    step();".into()),
                // The loops are one loop respelled: their closing braces are one.
                Line::Same("}".into()),
            ]
        );
        assert_eq!(stats(&old, &new), DiffStats { same: 2, rewritten: 2, removed: 1, added: 0 });
    }

    #[test]
    fn similarity_counts_shared_words_in_order() {
        assert_eq!(similarity("let mnist = args.load_mnist()?;", "let mnist = args.load_mnist()?;"), 1.0);
        // let mnist args load_mnist shared; accelerator main_process_first added: 8 / 10.
        assert_eq!(
            similarity("let mnist = args.load_mnist()?;", "let mnist = accelerator.main_process_first(|| args.load_mnist())??;"),
            0.8
        );
        assert_eq!(similarity("cleanup(pg);", "accelerator.end_training();"), 0.0);
        assert_eq!(similarity("}", ")?;"), 1.0);
    }

    #[test]
    fn code_lines_skip_blank_and_comments() {
        assert_eq!(code_lines(&v("// c\n\nlet a = 1; // x\n  // d\nf();")), 2);
    }
}
