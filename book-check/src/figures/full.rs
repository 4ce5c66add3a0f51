//! The full tables of the reference run for the Measurements chapter: every section of the
//! bench's Markdown but the Targets, each matrix table grouped by width and precision and cut
//! into tables a page 1280 px wide shows whole.

use super::{caption, Run};
use crate::tables::{self, Table};

/// Approximate rendered width of a column, in characters: its longest cell, or its header's
/// longest word (headers wrap), plus the cell padding.
fn column_width(t: &Table, c: usize) -> usize {
    let cells = t.rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0);
    let head = t.header[c].split_whitespace().map(|w| w.chars().count()).max().unwrap_or(0);
    cells.max(head) + 3
}

/// The width, in characters, one table may take on a page 1280 px wide (mdBook's content
/// column at the default font size).
pub const PAGE_CHARS: usize = 88;

/// `t` cut into tables that each fit [`PAGE_CHARS`]: the `keys` columns repeated in each, the
/// other columns in order. Columns whose every cell is the same (or `—`) are left out and
/// returned as `name: value` for the caption.
pub fn split(t: &Table, keys: &[usize]) -> (Vec<Table>, Vec<String>) {
    let mut constant = Vec::new();
    let mut rest = Vec::new();
    for c in 0..t.header.len() {
        if keys.contains(&c) {
            continue;
        }
        let first = t.rows.first().map(|r| r[c].as_str()).unwrap_or("");
        if t.rows.iter().all(|r| r[c] == first) {
            if first != "—" && !first.is_empty() {
                constant.push(format!("{} {first}", t.header[c]));
            }
            continue;
        }
        if t.rows.iter().all(|r| r[c] == "—" || r[c].is_empty()) {
            continue;
        }
        rest.push(c);
    }
    let key_width: usize = keys.iter().map(|&c| column_width(t, c)).sum();
    let mut chunks: Vec<Vec<usize>> = Vec::new();
    let mut width = key_width;
    for c in rest {
        let w = column_width(t, c);
        match chunks.last_mut() {
            Some(chunk) if width + w <= PAGE_CHARS => chunk.push(c),
            _ => {
                chunks.push(vec![c]);
                width = key_width;
            }
        }
        width += w;
    }
    let tables = chunks
        .into_iter()
        .map(|chunk| {
            let cols: Vec<usize> = keys.iter().copied().chain(chunk).collect();
            Table {
                header: cols.iter().map(|&c| t.header[c].clone()).collect(),
                rows: t.rows.iter().map(|r| cols.iter().map(|&c| r[c].clone()).collect()).collect(),
            }
        })
        .collect();
    (tables, constant)
}

/// The full tables of the run for the Measurements chapter: every section of the bench's
/// Markdown but the Targets (those are the developers', in `bench/results/`), each matrix table
/// grouped by width and precision and cut to the page's width, with the bench's note on its
/// columns.
pub(super) fn full_tables(run: &Run) -> String {
    let mut out = caption(&run.line);
    let mut sections = Vec::new();
    for line in run.bench.lines() {
        if let Some(title) = line.strip_prefix("## ") {
            sections.push(title.trim().to_string());
        }
    }
    for title in sections.iter().filter(|t| !t.starts_with("Targets")) {
        let Some(sec) = tables::section(&run.bench, title) else { continue };
        let Some(t) = Table::all(sec).into_iter().next() else { continue };
        out.push_str(&format!("\n**{title}**\n\n"));
        let is_matrix = ["fc1", "precision"].iter().all(|k| t.col(k).is_some());
        if is_matrix {
            let (fc1, prec) = (t.col("fc1").unwrap_or(0), t.col("precision").unwrap_or(0));
            let keys: Vec<usize> = ["level", "strategy"].iter().filter_map(|k| t.col(k)).collect();
            let mut groups: Vec<(String, String)> = Vec::new();
            for r in &t.rows {
                let g = (r[fc1].clone(), r[prec].clone());
                if !groups.contains(&g) {
                    groups.push(g);
                }
            }
            for (w, p) in groups {
                let sub =
                    Table { header: t.header.clone(), rows: t.rows.iter().filter(|r| r[fc1] == w && r[prec] == p).cloned().collect() };
                let sub_without: Table = Table {
                    header: sub.header.iter().enumerate().filter(|(c, _)| *c != fc1 && *c != prec).map(|(_, h)| h.clone()).collect(),
                    rows: sub
                        .rows
                        .iter()
                        .map(|r| r.iter().enumerate().filter(|(c, _)| *c != fc1 && *c != prec).map(|(_, v)| v.clone()).collect())
                        .collect(),
                };
                let keys2: Vec<usize> = keys.iter().map(|&k| k - usize::from(k > fc1) - usize::from(k > prec)).collect();
                let (parts, constant) = split(&sub_without, &keys2);
                let mut head = format!("fc1 {w}, {p}");
                if !constant.is_empty() {
                    head.push_str(&format!(" (every row: {})", constant.join(", ")));
                }
                out.push_str(&format!("*{head}*\n\n"));
                for part in parts {
                    out.push_str(&part.markdown());
                    out.push('\n');
                }
            }
        } else {
            let (parts, constant) = split(&t, &[0]);
            if !constant.is_empty() {
                out.push_str(&format!("*every row: {}*\n\n", constant.join(", ")));
            }
            for part in parts {
                out.push_str(&part.markdown());
                out.push('\n');
            }
        }
        if let Some(note) = tables::note_after_table(sec) {
            out.push_str(&format!("{note}\n"));
        }
        // The sentence before the table, when the bench writes one (the all-reduce's legend).
        if let Some(before) = sec.split("\n|").next() {
            let b = before.trim();
            if !b.is_empty() && !b.starts_with('|') {
                out.push_str(&format!("\n{b}\n"));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_keeps_keys_and_drops_constants() {
        let t = Table {
            header: ["level", "a", "b", "eval samples", "peer"].map(String::from).to_vec(),
            rows: vec![["1", "x", "1", "10000", "—"].map(String::from).to_vec(), ["2", "y", "2", "10000", "—"].map(String::from).to_vec()],
        };
        let (parts, constant) = split(&t, &[0]);
        assert_eq!(constant, ["eval samples 10000"]);
        assert_eq!(parts.len(), 1);
        assert_eq!(parts[0].header, ["level", "a", "b"]);
    }
}
