//! The include check: every `{{#include PATH[:ANCHOR|:LINES]}}` (and `#rustdoc_include`) in the
//! book's Markdown names a file that exists and, for an anchor, a span that exists once, is
//! closed and is not empty. mdBook itself only logs a missing file and shows an empty listing for
//! a missing anchor, and silently shows only the first of two spans with one name: each of those
//! is an error here.

use crate::anchors;
use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

/// One `{{#include …}}` found in a Markdown file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Include {
    /// The Markdown file it is in.
    pub md: PathBuf,
    /// 1-based line in that file.
    pub line: usize,
    /// The path as written (relative to the Markdown file's directory).
    pub path: String,
    /// The anchor name, when the part after the path is not a line range.
    pub anchor: Option<String>,
}

impl Include {
    fn describe(&self) -> String {
        match &self.anchor {
            Some(a) => format!("{}:{}: {{{{#include {}:{a}}}}}", self.md.display(), self.line, self.path),
            None => format!("{}:{}: {{{{#include {}}}}}", self.md.display(), self.line, self.path),
        }
    }
}

/// The includes of one Markdown text, as mdBook's link regex finds them (an escaped
/// `\{{#include …}}` is text, not an include).
pub fn find_includes(md: &Path, text: &str) -> Vec<Include> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let mut rest = line;
        let mut offset = 0;
        while let Some(pos) = rest.find("{{") {
            let escaped = pos > 0 && rest[..pos].ends_with('\\');
            let after = &rest[pos + 2..];
            let Some(close) = after.find("}}") else { break };
            let inner = after[..close].trim();
            offset += pos + 2 + close + 2;
            rest = &line[offset..];
            if escaped {
                continue;
            }
            let Some(body) = inner.strip_prefix("#include").or_else(|| inner.strip_prefix("#rustdoc_include")) else { continue };
            if !body.starts_with(char::is_whitespace) {
                continue;
            }
            let target = body.split_whitespace().next().unwrap_or("");
            let mut parts = target.splitn(2, ':');
            let path = parts.next().unwrap_or("").to_string();
            let anchor = parts.next().and_then(|spec| {
                let first = spec.split(':').next().unwrap_or("");
                // A line range (`:5`, `:5:10`, `::10`) is not an anchor.
                if first.is_empty() || first.parse::<usize>().is_ok() {
                    None
                } else {
                    Some(first.to_string())
                }
            });
            out.push(Include { md: md.to_path_buf(), line: i + 1, path, anchor });
        }
    }
    out
}

/// Every `.md` file under `dir`, sorted.
pub fn markdown_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).map_err(|e| Error::io(&d, e))? {
            let path = entry.map_err(|e| Error::io(&d, e))?.path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                out.push(path);
            }
        }
    }
    out.sort();
    Ok(out)
}

/// What the check looked at, for its summary line.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CheckSummary {
    /// Markdown files read.
    pub files: usize,
    /// Includes checked.
    pub includes: usize,
    /// Of them, includes with an anchor.
    pub anchors: usize,
    /// Relative links and images checked.
    pub links: usize,
    /// Tests named (`file.rs::test`) and found.
    pub tests: usize,
}

/// Relative link and image targets of a Markdown text, with their 1-based lines: the `(…)` of
/// `[text](target)` that is not a URL, not an in-page anchor, without its `#fragment`. Code
/// spans and fenced blocks are skipped.
pub fn find_links(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut fenced = false;
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        let line = strip_code_spans(line);
        let mut rest = line.as_str();
        while let Some(pos) = rest.find("](") {
            let after = &rest[pos + 2..];
            let Some(close) = after.find(')') else { break };
            let target = after[..close].split_whitespace().next().unwrap_or("");
            let target = target.split('#').next().unwrap_or("");
            if !target.is_empty() && !target.contains("://") && !target.starts_with("mailto:") {
                out.push((i + 1, target.to_string()));
            }
            rest = &after[close..];
        }
    }
    out
}

/// Tests named in code spans as `` `path/to/file.rs::test_name` ``, with their 1-based lines.
pub fn find_test_refs(text: &str) -> Vec<(usize, String, String)> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        for (k, span) in line.split('`').enumerate() {
            if k % 2 == 0 {
                continue; // outside a code span
            }
            if let Some((file, name)) = span.split_once(".rs::") {
                let ident = !name.is_empty() && name.chars().all(|c| c.is_alphanumeric() || c == '_');
                if ident && !file.is_empty() && !file.contains(char::is_whitespace) {
                    out.push((i + 1, format!("{file}.rs"), name.to_string()));
                }
            }
        }
    }
    out
}

/// True when `code` defines a function `name` (`fn name(` or `fn name<`).
fn defines_fn(code: &str, name: &str) -> bool {
    code.match_indices(&format!("fn {name}")).any(|(at, m)| {
        let next = code[at + m.len()..].chars().next();
        matches!(next, Some('(') | Some('<'))
    })
}

fn strip_code_spans(line: &str) -> String {
    line.split('`').enumerate().filter(|(k, _)| k % 2 == 0).map(|(_, s)| s).collect::<Vec<_>>().join("")
}

/// Checks every Markdown file under `src` (the book's `src/`): every include (see the module
/// docs); every relative link or image (`[t](generated/x.svg)`) names a file that exists; every
/// test named as `` `path/to/file.rs::test_name` `` exists as `fn test_name` in that file under
/// `root` (the workspace). Problems are collected, not stopped at: the error lists each, naming
/// the .md file, line, path and anchor or test.
///
/// # Errors
/// [`Error::Includes`] with every problem; [`Error::Io`] when `src` cannot be listed.
pub fn check(src: &Path, root: &Path) -> Result<CheckSummary> {
    let mut summary = CheckSummary::default();
    let mut problems = Vec::new();
    for md in markdown_files(src)? {
        let text = std::fs::read_to_string(&md).map_err(|e| Error::io(&md, e))?;
        summary.files += 1;
        for inc in find_includes(&md, &text) {
            summary.includes += 1;
            summary.anchors += usize::from(inc.anchor.is_some());
            if let Err(p) = check_one(&inc) {
                problems.push(format!("{}: {p}", inc.describe()));
            } else if inc.path.ends_with(".snap") {
                let name = Path::new(&inc.path).file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
                let krate = inc.path.split("/tests/snapshots/").next().filter(|_| inc.path.contains("/tests/snapshots/"));
                let krate = krate.and_then(|k| k.rsplit('/').next()).unwrap_or("<crate>");
                problems.push(format!(
                    "{}: a .snap shows insta's header (`source:`, `expression:`, …) on the page: include `{}/{krate}/{name}.txt` (written without it by `book-check generate`)",
                    inc.describe(),
                    crate::snapshots::DIR
                ));
            }
        }
        for (line, target) in find_links(&text) {
            summary.links += 1;
            // A generated snippet is included into a chapter in `src/`, so its links are the
            // chapter's: relative to `src/`, not to `src/generated/`.
            let base = if md.starts_with(src.join("generated")) { src } else { md.parent().unwrap_or(Path::new(".")) };
            let path = base.join(&target);
            if !path.exists() {
                let hint = if target.contains("generated/") { " (run `make book-data`)" } else { "" };
                problems.push(format!("{}:{line}: link ({target}): {} does not exist{hint}", md.display(), path.display()));
            }
        }
        for (line, file, test) in find_test_refs(&text) {
            summary.tests += 1;
            let path = root.join(&file);
            match std::fs::read_to_string(&path) {
                Err(_) => problems.push(format!("{}:{line}: test `{file}::{test}`: {} does not exist", md.display(), path.display())),
                Ok(code) if !defines_fn(&code, &test) => {
                    problems.push(format!("{}:{line}: test `{file}::{test}`: no `fn {test}` in {}", md.display(), path.display()))
                }
                Ok(_) => {}
            }
        }
    }
    if problems.is_empty() {
        Ok(summary)
    } else {
        Err(Error::Includes { problems })
    }
}

fn check_one(inc: &Include) -> std::result::Result<(), String> {
    let base = inc.md.parent().unwrap_or(Path::new("."));
    let target = base.join(&inc.path);
    if inc.path.is_empty() {
        return Err("no path given".into());
    }
    let text = match std::fs::read_to_string(&target) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let hint = if inc.path.contains("generated/") { " (run `make book-data`)" } else { "" };
            return Err(format!("{} does not exist{hint}", target.display()));
        }
        Err(e) => return Err(format!("{} cannot be read: {e}", target.display())),
    };
    let Some(anchor) = &inc.anchor else {
        return if text.trim().is_empty() { Err(format!("{} is empty", target.display())) } else { Ok(()) };
    };
    let spans = anchors::spans(&text, anchor);
    match spans.as_slice() {
        [] => {
            Err(format!("anchor `{anchor}` not found in {} (expected `// ANCHOR: {anchor}` … `// ANCHOR_END: {anchor}`)", target.display()))
        }
        [s] if !s.closed => {
            Err(format!("anchor `{anchor}` opened at {}:{} is never closed by `ANCHOR_END: {anchor}`", target.display(), s.start_line))
        }
        [s] if s.is_blank() => Err(format!("anchor `{anchor}` at {}:{} is empty", target.display(), s.start_line)),
        [_] => Ok(()),
        many => Err(format!(
            "anchor `{anchor}` opens {} times in {} (lines {}); mdBook shows only the first span: give each span its own name",
            many.len(),
            target.display(),
            many.iter().map(|s| s.start_line.to_string()).collect::<Vec<_>>().join(", ")
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_includes_anchors_ranges_and_skips_escaped() {
        let md = Path::new("ch.md");
        let text = "x {{#include ../../a/src/lib.rs:user_code}} y {{#include gen/t.md}}\n\
                    \\{{#include not/this.rs:x}}\n{{#rustdoc_include f.rs:5:10}} {{#include g.rs::3}}\n{{#title T}}\n";
        let found = find_includes(md, text);
        let got: Vec<_> = found.iter().map(|i| (i.line, i.path.as_str(), i.anchor.as_deref())).collect();
        assert_eq!(got, vec![(1, "../../a/src/lib.rs", Some("user_code")), (1, "gen/t.md", None), (3, "f.rs", None), (3, "g.rs", None)]);
    }

    #[test]
    fn links_and_test_refs() {
        let text = "See [ch](level1.md#x), ![plot](generated/p.svg \"t\"), [web](https://a.b/c), [top](#t).\n\
                    `[not](a link)` and `shared/tests/ddp.rs::no_sync_leaves_gradients_different_across_ranks`.\n\
                    ```text\n[fenced](x.md)\n```\n`a b.rs::c` `x.rs::` `y.rs::ok_1`\n";
        assert_eq!(find_links(text), vec![(1, "level1.md".to_string()), (1, "generated/p.svg".to_string())]);
        let refs = find_test_refs(text);
        assert_eq!(
            refs,
            vec![
                (2, "shared/tests/ddp.rs".to_string(), "no_sync_leaves_gradients_different_across_ranks".to_string()),
                (6, "y.rs".to_string(), "ok_1".to_string())
            ]
        );
        assert!(defines_fn("fn a_b() {}\nfn a_bc() {}", "a_b"));
        assert!(!defines_fn("fn a_bc() {}", "a_b"));
    }
}
