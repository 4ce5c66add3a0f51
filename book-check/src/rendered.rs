//! Checks of the book as mdBook rendered it (`book/book/*.html`), for the faults a Markdown
//! check cannot see because they only appear once includes are expanded and the page is
//! parsed — each seen in this book before:
//!
//! * **a stray fence**: a literal ```` ``` ```` on the page, where a fence the author opened was
//!   closed early (an included file's `---` ended the list holding it) and the rest of the
//!   chapter became one code block;
//! * **a raw `{{#`**: an include or other mdBook directive that was not expanded (more of them
//!   than the chapter escapes on purpose with `\{{#`);
//! * **a snapshot header**: insta's `source:` / `assertion_line:` / `expression:` lines on the
//!   page (include `generated/snapshots/…`, see [`crate::snapshots`]);
//! * **a heading from an included file**: a heading on the page (and so in the sidebar) that the
//!   chapter's own Markdown does not have;
//! * **a flag turned into a dash**: `--flag` written outside code, which mdBook's smart
//!   punctuation renders as `–flag` (a reader who copies it gets an en dash, not a flag);
//! * **a stale page**: a page older than its chapter or a file the chapter includes (the book
//!   was not rebuilt after the change).

use crate::error::{Error, Result};
use crate::includes::find_includes;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// The chapters of a book: the `.md` paths (relative to `src/`) that `SUMMARY.md` links to, in
/// order.
pub fn chapters(summary: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in summary.lines() {
        let mut rest = line;
        while let Some(pos) = rest.find("](") {
            let after = &rest[pos + 2..];
            let Some(close) = after.find(')') else { break };
            let target = after[..close].trim();
            if target.ends_with(".md") && !target.contains("://") && !out.iter().any(|c| c == target) {
                out.push(target.to_string());
            }
            rest = &after[close..];
        }
    }
    out
}

/// The `<main>` element's inner HTML of a rendered mdBook page (the whole text if it has none).
pub fn main_html(page: &str) -> &str {
    match (page.find("<main>"), page.rfind("</main>")) {
        (Some(a), Some(b)) if a < b => &page[a + "<main>".len()..b],
        _ => page,
    }
}

/// HTML to text: tags removed, the five entities mdBook writes (and `&#39;`, `&#x27;`) decoded.
pub fn text_of(html: &str) -> String {
    let mut out = String::with_capacity(html.len());
    let mut in_tag = false;
    for c in html.chars() {
        match (in_tag, c) {
            (false, '<') => in_tag = true,
            (true, '>') => in_tag = false,
            (false, c) => out.push(c),
            _ => {}
        }
    }
    out.replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", "\"").replace("&#39;", "'").replace("&#x27;", "'").replace("&amp;", "&")
}

/// The headings of a rendered page's `<main>`: (level, text).
pub fn html_headings(main: &str) -> Vec<(u8, String)> {
    let mut out = Vec::new();
    let mut rest = main;
    while let Some(pos) = rest.find("<h") {
        let after = &rest[pos + 2..];
        let level = after.as_bytes().first().copied().unwrap_or(0);
        if !(b'1'..=b'6').contains(&level) || !matches!(after.as_bytes().get(1), Some(b' ' | b'>')) {
            rest = after;
            continue;
        }
        let close = format!("</h{}>", level as char);
        let Some(end) = after.find(&close) else { break };
        let inner = &after[after.find('>').map_or(0, |i| i + 1)..end];
        out.push((level - b'0', text_of(inner).split_whitespace().collect::<Vec<_>>().join(" ")));
        rest = &after[end..];
    }
    out
}

/// The ATX headings (`#` … `######`) of a chapter's own Markdown, outside fenced blocks:
/// (level, text with inline Markdown removed).
pub fn markdown_headings(md: &str) -> Vec<(u8, String)> {
    let mut out = Vec::new();
    let mut fence: Option<&str> = None;
    for line in md.lines() {
        let t = line.trim_start();
        let marker = if t.starts_with("```") {
            Some("```")
        } else if t.starts_with("~~~") {
            Some("~~~")
        } else {
            None
        };
        match (fence, marker) {
            (None, Some(m)) => {
                fence = Some(m);
                continue;
            }
            (Some(f), Some(m)) if f == m => {
                fence = None;
                continue;
            }
            _ => {}
        }
        if fence.is_some() || line.starts_with("    ") {
            continue;
        }
        let hashes = t.chars().take_while(|&c| c == '#').count();
        if (1..=6).contains(&hashes) && t[hashes..].starts_with(' ') {
            let text = t[hashes..].trim().trim_end_matches('#').trim();
            out.push((hashes as u8, strip_inline(text)));
        }
    }
    out
}

/// Inline Markdown removed: code ticks, emphasis marks, `[text](target)` → text, `\` escapes.
fn strip_inline(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(open) = rest.find('[') {
        out.push_str(&rest[..open]);
        let after = &rest[open + 1..];
        match after.find("](").and_then(|mid| after[mid..].find(')').map(|end| (mid, mid + end))) {
            Some((mid, end)) => {
                out.push_str(&after[..mid]);
                rest = &after[end + 1..];
            }
            None => {
                out.push('[');
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out.chars().filter(|c| !matches!(c, '`' | '*' | '\\')).collect()
}

/// Heading text reduced to what both sides agree on: lowercase letters and digits.
fn normalised(text: &str) -> String {
    text.chars().filter(|c| c.is_alphanumeric()).flat_map(char::to_lowercase).collect()
}

/// The problems of one rendered chapter: `md` is the chapter's Markdown, `page` its HTML, `name`
/// how to call it in messages. (Staleness is checked by [`check`], which knows the files.)
pub fn problems_of(name: &str, md: &str, page: &str) -> Vec<String> {
    let main = main_html(page);
    let text = text_of(main);
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.contains("```") {
            out.push(format!(
                "{name}: a stray code fence on the page (rendered text line {}: \"{}\"): a fence was closed early or never opened — \
                 an included file's `---` or unindented line ends a list and the fence in it",
                i + 1,
                line.trim()
            ));
            break;
        }
    }
    let raw = text.matches("{{#").count();
    let escaped = md.matches("\\{{#").count();
    if raw > escaped {
        out.push(format!(
            "{name}: {raw} raw `{{{{#` on the page but {escaped} escaped in the chapter: a directive mdBook did not expand (a misspelt or missing include)"
        ));
    }
    for line in text.lines() {
        let t = line.trim();
        let header = t.starts_with("assertion_line:")
            || t.starts_with("snapshot_kind:")
            || t.starts_with("expression:")
            || (t.starts_with("source:") && t.split_whitespace().nth(1).is_some_and(|p| p.ends_with(".rs")))
            || (t.contains("source: ") && t.contains(".rs expression: "));
        if header {
            out.push(format!(
                "{name}: insta's snapshot header on the page (`{t}`): include `generated/snapshots/<crate>/<name>.txt` (written without it by `book-check generate`) instead of the .snap"
            ));
            break;
        }
    }
    // `--flag` outside code: smart punctuation makes it an en dash glued to the word.
    let chars: Vec<char> = text.chars().collect();
    if let Some(i) = (1..chars.len().saturating_sub(1))
        .find(|&i| chars[i] == '–' && (chars[i - 1].is_whitespace() || chars[i - 1] == '(') && chars[i + 1].is_ascii_lowercase())
    {
        let flag: String = chars[i..].iter().take_while(|c| !c.is_whitespace() && !matches!(c, ')' | ',' | '.')).collect();
        out.push(format!(
            "{name}: \"{flag}\" on the page: a `--{}` outside code, which mdBook's smart punctuation turned into a dash — put it in backticks",
            &flag['–'.len_utf8()..]
        ));
    }
    let own: Vec<String> = markdown_headings(md).into_iter().map(|(_, t)| normalised(&t)).collect();
    let mut unmatched = own.clone();
    for (level, heading) in html_headings(main) {
        let key = normalised(&heading);
        match unmatched.iter().position(|k| *k == key) {
            Some(i) => {
                unmatched.remove(i);
            }
            None => out.push(format!(
                "{name}: heading h{level} \"{heading}\" on the page (and in the sidebar) is not one of the chapter's own headings: \
                 it came from an included file or from a line that `---` turned into a heading"
            )),
        }
    }
    out
}

/// What the rendered check looked at.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RenderedSummary {
    /// Chapters checked.
    pub pages: usize,
    /// Headings on those pages, each matched to its chapter's Markdown.
    pub headings: usize,
}

fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

/// Checks every chapter of the book at `book_dir` (holding `src/` and mdBook's output
/// `book/`): the faults listed in the module docs. Problems are collected, each naming the
/// page.
///
/// # Errors
/// [`Error::Rendered`] with every problem; [`Error::Io`] when `src/SUMMARY.md` cannot be read.
pub fn check(book_dir: &Path) -> Result<RenderedSummary> {
    let src = book_dir.join("src");
    let out_dir = book_dir.join("book");
    let summary_path = src.join("SUMMARY.md");
    let summary = std::fs::read_to_string(&summary_path).map_err(|e| Error::io(&summary_path, e))?;
    let mut problems = Vec::new();
    let mut stats = RenderedSummary::default();
    for chapter in chapters(&summary) {
        let md_path = src.join(&chapter);
        let page_path: PathBuf = out_dir.join(Path::new(&chapter).with_extension("html"));
        let name = page_path.display().to_string();
        let md = match std::fs::read_to_string(&md_path) {
            Ok(t) => t,
            Err(e) => {
                problems.push(format!("{}: {e}", md_path.display()));
                continue;
            }
        };
        let page = match std::fs::read_to_string(&page_path) {
            Ok(t) => t,
            Err(e) => {
                problems.push(format!("{name}: {e} (run `mdbook build {}`)", book_dir.display()));
                continue;
            }
        };
        stats.pages += 1;
        stats.headings += html_headings(main_html(&page)).len();
        problems.extend(problems_of(&name, &md, &page));
        if let Some(built) = modified(&page_path) {
            let base = md_path.parent().unwrap_or(&src).to_path_buf();
            let sources = std::iter::once(md_path.clone()).chain(find_includes(&md_path, &md).into_iter().map(|i| base.join(i.path)));
            for s in sources {
                if modified(&s).is_some_and(|m| m > built) {
                    problems.push(format!(
                        "{name}: older than {} (changed after the book was built): run `mdbook build {}`",
                        s.display(),
                        book_dir.display()
                    ));
                }
            }
        }
    }
    if problems.is_empty() {
        Ok(stats)
    } else {
        Err(Error::Rendered { problems })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chapters_from_summary() {
        let s = "# Summary\n\n[Intro](introduction.md)\n\n# Part\n\n- [A](a.md)\n  - [B](sub/b.md)\n- [Web](https://x.y/z.md)\n";
        assert_eq!(chapters(s), ["introduction.md", "a.md", "sub/b.md"]);
    }

    #[test]
    fn headings_both_ways() {
        let md = "# Title\n\n```text\n# not a heading\n```\n\n## The `DistributedSampler`, and [why](x.md)\n    # indented code\n";
        assert_eq!(markdown_headings(md), vec![(1, "Title".to_string()), (2, "The DistributedSampler, and why".to_string())]);
        let html = "<main><h1 id=\"t\"><a class=\"header\" href=\"#t\">Title</a></h1><p>x</p><h2 id=\"d\"><a href=\"#d\">The <code>DistributedSampler</code>, and why</a></h2><hr></main>";
        assert_eq!(html_headings(main_html(html)), vec![(1, "Title".to_string()), (2, "The DistributedSampler, and why".to_string())]);
        assert!(problems_of("p", md, html).is_empty());
    }

    #[test]
    fn a_flag_outside_code_is_caught_as_the_dash_it_became() {
        let md = "# T\n";
        let page = "<main><h1>T</h1><p>run (ladder-run –nproc-per-node 2) now</p></main>";
        let problems = problems_of("t.html", md, page);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].contains("\"–nproc-per-node\"") && problems[0].contains("`--nproc-per-node`"), "{}", problems[0]);
        // A dash between words, and the flag in code, are fine.
        assert!(problems_of("t.html", md, "<main><h1>T</h1><p>10–20 ms – fine <code>--nproc-per-node</code></p></main>").is_empty());
    }

    #[test]
    fn entities_and_tags() {
        assert_eq!(text_of("<p>a &lt;b&gt; &amp;&quot;</p>"), "a <b> &\"");
    }
}
