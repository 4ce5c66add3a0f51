//! Markdown pipe tables: read the bench's generated Markdown (`book/src/generated/bench.md`,
//! `demo.md`) by section and column name, and write narrower tables back. The bench writes its
//! tables with `comfy-table`'s Markdown preset: a header row, a `|---|` rule, one row per line.

/// One Markdown table: its header cells and rows of cells (trimmed, as written).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Table {
    /// Column names.
    pub header: Vec<String>,
    /// Rows, each with as many cells as the header.
    pub rows: Vec<Vec<String>>,
}

fn cells(line: &str) -> Vec<String> {
    let inner = line.trim().trim_start_matches('|').trim_end_matches('|');
    inner.split('|').map(|c| c.trim().to_string()).collect()
}

fn is_rule(line: &str) -> bool {
    let t = line.trim();
    t.starts_with('|') && t.chars().all(|c| matches!(c, '|' | '-' | ':' | ' '))
}

impl Table {
    /// Every table of `text`, in order: a `|` line followed by a rule line starts one; it runs to
    /// the first line that does not start with `|`. Rows with a different number of cells than
    /// the header are padded or cut to the header's width.
    pub fn all(text: &str) -> Vec<Table> {
        let lines: Vec<&str> = text.lines().collect();
        let mut out = Vec::new();
        let mut i = 0;
        while i + 1 < lines.len() {
            if lines[i].trim_start().starts_with('|') && is_rule(lines[i + 1]) {
                let header = cells(lines[i]);
                let mut rows = Vec::new();
                let mut j = i + 2;
                while j < lines.len() && lines[j].trim_start().starts_with('|') {
                    let mut row = cells(lines[j]);
                    row.resize(header.len(), String::new());
                    rows.push(row);
                    j += 1;
                }
                out.push(Table { header, rows });
                i = j;
            } else {
                i += 1;
            }
        }
        out
    }

    /// The first table under the `## ` heading that starts with `title` in `md` (up to the next
    /// `## ` heading).
    pub fn in_section(md: &str, title: &str) -> Option<Table> {
        section(md, title).and_then(|s| Table::all(s).into_iter().next())
    }

    /// The index of the column named `name` (exact, after trimming).
    pub fn col(&self, name: &str) -> Option<usize> {
        self.header.iter().position(|h| h == name)
    }

    /// The index of the first column whose name starts with `prefix`.
    pub fn col_starting(&self, prefix: &str) -> Option<usize> {
        self.header.iter().position(|h| h.starts_with(prefix))
    }

    /// The cell of `row` in column `name`, or `None` without such a column.
    pub fn get<'a>(&self, row: &'a [String], name: &str) -> Option<&'a str> {
        self.col(name).and_then(|c| row.get(c)).map(String::as_str)
    }

    /// Rows whose cells equal the given (column, value) pairs.
    pub fn select(&self, filter: &[(&str, &str)]) -> Vec<&Vec<String>> {
        self.rows.iter().filter(|r| filter.iter().all(|(c, v)| self.get(r, c) == Some(*v))).collect()
    }

    /// The Markdown of this table; columns whose every cell parses as a number (after removing
    /// `,`, `×`, `%` and a leading sign) are right-aligned.
    pub fn markdown(&self) -> String {
        let numeric: Vec<bool> = (0..self.header.len())
            .map(|c| {
                let mut any = false;
                let all = self.rows.iter().all(|r| {
                    let v = r[c].trim();
                    if v.is_empty() || v == "—" {
                        return true;
                    }
                    any = true;
                    number(v).is_some()
                });
                all && any
            })
            .collect();
        let mut out = String::new();
        out.push_str(&format!("| {} |\n", self.header.join(" | ")));
        out.push('|');
        for &n in &numeric {
            out.push_str(if n { "---:|" } else { "---|" });
        }
        out.push('\n');
        for r in &self.rows {
            out.push_str(&format!("| {} |\n", r.join(" | ")));
        }
        out
    }
}

/// The text of the `## ` section whose title starts with `title`, without its heading line, up
/// to the next `## ` heading or the end.
pub fn section<'a>(md: &'a str, title: &str) -> Option<&'a str> {
    let mut start = None;
    let mut offset = 0;
    for line in md.split_inclusive('\n') {
        let heading = line.strip_prefix("## ").map(str::trim_end);
        match (start, heading) {
            (None, Some(h)) if h.starts_with(title) => start = Some(offset + line.len()),
            (Some(s), Some(_)) => return Some(&md[s..offset]),
            _ => {}
        }
        offset += line.len();
    }
    start.map(|s| &md[s..])
}

/// The first paragraph after the first table of a section: the bench's note on its columns.
pub fn note_after_table(section_text: &str) -> Option<String> {
    let mut seen_table = false;
    let mut para = Vec::new();
    for line in section_text.lines() {
        if line.trim_start().starts_with('|') {
            seen_table = true;
            continue;
        }
        if !seen_table {
            continue;
        }
        if line.trim().is_empty() {
            if !para.is_empty() {
                break;
            }
            continue;
        }
        para.push(line.trim());
    }
    (!para.is_empty()).then(|| para.join(" "))
}

/// A cell read as a number: `3,275` → 3275, `1.79×` → 1.79, `4.1%` → 4.1, `97.74%` → 97.74.
/// `—`, empty or text → `None`. For `min–max` cells (`3275 (3100–3300)`), the first number.
pub fn number(cell: &str) -> Option<f64> {
    let first = cell.split_whitespace().next()?;
    let t: String = first.chars().filter(|c| !matches!(c, ',' | '×' | '%')).collect();
    t.parse::<f64>().ok().filter(|x| x.is_finite())
}

/// `a / b` cells (per-rank figures, `317 / 320`): each number.
pub fn numbers(cell: &str) -> Vec<f64> {
    cell.split('/').filter_map(|p| number(p.trim())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MD: &str = "# t\n\n## Throughput (repeats: 1)\n\n| level | strategy | samples/s |\n|-------|---|---:|\n| 1 | ddp | 3,275 |\n| 2 | ddp | — |\n\nsamples/s: a note\nthat wraps.\n\nmore\n\n## Memory\n\n| a | b |\n|---|---|\n| x | 317 / 320 |\n";

    #[test]
    fn tables_by_section_and_column() {
        let t = Table::in_section(MD, "Throughput").unwrap();
        assert_eq!(t.header, ["level", "strategy", "samples/s"]);
        assert_eq!(t.rows.len(), 2);
        assert_eq!(t.get(&t.rows[0], "samples/s"), Some("3,275"));
        assert_eq!(number("3,275"), Some(3275.0));
        assert_eq!(number("—"), None);
        assert_eq!(t.select(&[("level", "2")]).len(), 1);
        let m = Table::in_section(MD, "Memory").unwrap();
        assert_eq!(numbers(&m.rows[0][1]), vec![317.0, 320.0]);
        assert_eq!(note_after_table(section(MD, "Throughput").unwrap()).as_deref(), Some("samples/s: a note that wraps."));
        assert!(Table::in_section(MD, "Targets").is_none());
    }

    #[test]
    fn markdown_aligns_numbers_right() {
        let t =
            Table { header: vec!["run".into(), "x".into()], rows: vec![vec!["a".into(), "1.5×".into()], vec!["b".into(), "—".into()]] };
        assert_eq!(t.markdown(), "| run | x |\n|---|---:|\n| a | 1.5× |\n| b | — |\n");
    }
}
