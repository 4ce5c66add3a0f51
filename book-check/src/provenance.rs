//! One measured run, one provenance line. `make book-data` writes the run's machine, commit,
//! date and commands into `book/src/generated/provenance.md`; every table generated from that
//! run — the README's `make demo` block, the book's small tables and plots — carries the same
//! line, built here from that file, so a table copied from another run cannot pass
//! `book-check check` unnoticed.

use crate::error::{Error, Result};
use std::path::Path;

/// The provenance table's rows: `| key | value |` → (key, value).
pub fn rows(provenance_md: &str) -> Vec<(String, String)> {
    provenance_md
        .lines()
        .filter_map(|l| {
            let t = l.trim();
            let inner = t.strip_prefix('|')?.strip_suffix('|')?;
            let (k, v) = inner.split_once('|')?;
            let (k, v) = (k.trim(), v.trim());
            (!k.is_empty() && !k.starts_with("---")).then(|| (k.to_string(), v.to_string()))
        })
        .collect()
}

/// The line every table of the run carries, from the provenance table (its date, CPU, cores and
/// commit).
///
/// # Errors
/// [`Error::Input`] naming `file` when a row is missing.
pub fn line(provenance_md: &str, file: &Path) -> Result<String> {
    let rows = rows(provenance_md);
    let get = |k: &str| {
        rows.iter().find(|(key, _)| key == k).map(|(_, v)| v.clone()).ok_or_else(|| Error::Input {
            file: file.to_path_buf(),
            problem: format!("no `| {k} | … |` row (the table `make book-data` writes)"),
        })
    };
    Ok(format!(
        "Measured by `make book-data` on {}, {}, {} cores (commit {}); figures vary by machine: compare rows of one run only.",
        get("date (UTC)")?,
        get("CPU")?,
        get("cores")?,
        get("commit")?
    ))
}

/// The README's block between `<!-- generated:NAME:begin … -->` and `<!-- generated:NAME:end -->`
/// replaced by `body`.
///
/// # Errors
/// [`Error::Input`] naming `file` when the markers are missing.
pub fn replace_block(text: &str, name: &str, body: &str, file: &Path) -> Result<String> {
    let begin_prefix = format!("<!-- generated:{name}:begin");
    let end = format!("<!-- generated:{name}:end -->");
    let missing = || Error::Input {
        file: file.to_path_buf(),
        problem: format!("no `{begin_prefix} … -->` … `{end}` block for the generated {name} table"),
    };
    let b = text.find(&begin_prefix).ok_or_else(missing)?;
    let b_end = b + text[b..].find("-->").ok_or_else(missing)? + 3;
    let e = b_end + text[b_end..].find(&end).ok_or_else(missing)?;
    Ok(format!("{}\n{}\n{}", &text[..b_end], body.trim_end(), &text[e..]))
}

/// The text of the README's `name` block, if it has one.
pub fn block<'a>(text: &'a str, name: &str) -> Option<&'a str> {
    let b = text.find(&format!("<!-- generated:{name}:begin"))?;
    let b_end = b + text[b..].find("-->")? + 3;
    let e = b_end + text[b_end..].find(&format!("<!-- generated:{name}:end -->"))?;
    Some(text[b_end..e].trim())
}

/// The README's `make demo` block: the run's line, then `demo.md` without its title.
pub fn demo_block(line: &str, demo_md: &str) -> String {
    let body = demo_md.trim();
    let body = match body.strip_prefix("# ") {
        Some(rest) => rest.split_once('\n').map_or("", |(_, b)| b).trim_start(),
        None => body,
    };
    // The block sits under a heading of the page that includes it: the demo's own section
    // headings (`## Compute efficiency`) become bold lines, not headings of that page and its
    // sidebar.
    let body: Vec<String> = body
        .lines()
        .map(|l| match l.trim_start_matches('#').strip_prefix(' ') {
            Some(title) if l.starts_with('#') => format!("**{}**", title.trim()),
            _ => l.to_string(),
        })
        .collect();
    format!("{line}\n\n{}", body.join("\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const PROV: &str = "<!-- x -->\n\n| | |\n|---|---|\n| date (UTC) | 2026-12-01T19:40:22Z |\n| commit | `7573123` |\n| CPU | AMD EPYC |\n| cores | 2 |\n";

    #[test]
    fn the_line_of_a_run() {
        assert_eq!(
            line(PROV, Path::new("p.md")).unwrap(),
            "Measured by `make book-data` on 2026-12-01T19:40:22Z, AMD EPYC, 2 cores (commit `7573123`); figures vary by machine: compare rows of one run only."
        );
        let err = line("| CPU | x |\n", Path::new("p.md")).unwrap_err().to_string();
        assert_eq!(err, "p.md: no `| date (UTC) | … |` row (the table `make book-data` writes)");
    }

    #[test]
    fn the_demo_block_drops_the_title_and_keeps_sections_as_bold_lines() {
        let demo = "# ddp-ladder: the three levels side by side\n\nmachine\n\n| a |\n\n## Compute efficiency\n\n| b |\n";
        assert_eq!(demo_block("LINE", demo), "LINE\n\nmachine\n\n| a |\n\n**Compute efficiency**\n\n| b |");
    }

    #[test]
    fn blocks_are_replaced_between_their_markers() {
        let readme = "a\n<!-- generated:demo:begin (scripts/book-data.sh) -->\nold\n<!-- generated:demo:end -->\nb\n";
        let new = replace_block(readme, "demo", "new\n", Path::new("README.md")).unwrap();
        assert_eq!(new, "a\n<!-- generated:demo:begin (scripts/book-data.sh) -->\nnew\n<!-- generated:demo:end -->\nb\n");
        assert_eq!(block(&new, "demo"), Some("new"));
        assert!(replace_block("no block", "demo", "x", Path::new("README.md")).is_err());
        assert_eq!(demo_block("L", "# title\n\nbody\n"), "L\n\nbody");
    }
}
