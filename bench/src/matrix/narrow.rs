//! The terminal's narrow tables: the five columns that name a case (level, strategy, ranks, fc1,
//! precision) folded into one `case` cell as [`super::label`] writes it, a few columns kept
//! under short headers, and
//! medians without their min–max — so that `bench run` reads on an 80–100-column terminal. Every
//! column is in `bench.md`, and on the terminal with `bench run --all-columns`.

use comfy_table::{presets, CellAlignment, Table};

/// The case of a full table's first five cells as [`super::label`] names it elsewhere (the
/// failures, the targets): `L1 fsdp-full-shard ×2 fc1 4096 bf16`, `baseline single ×1 fc1 128 fp32`.
fn case_label(cells: &[String]) -> String {
    let level = match cells[0].as_str() {
        "baseline" => "baseline".to_string(),
        l => format!("L{l}"),
    };
    format!("{level} {} ×{} fc1 {} {}", cells[1], cells[2], cells[3], cells[4])
}

/// `1364 (1301–1398)` → `1364`: the median of a spread cell; other cells unchanged.
fn median_only(cell: &str) -> String {
    match cell.split_once(" (") {
        Some((median, rest)) if rest.ends_with(')') && rest.contains('–') => median.to_string(),
        _ => cell.to_string(),
    }
}

/// `full` cut to the columns `keep` names, `(full header, short header)`, in that order, after
/// one `case` column folded from its first `case_columns` (5: level, strategy, ranks, fc1,
/// precision; any other number counts as 5; 0: no case column). A header `full` lacks is left
/// out (an older report).
pub(super) fn narrow(full: &Table, case_columns: usize, keep: &[(&str, &str)]) -> String {
    let cells = |row: &comfy_table::Row| row.cell_iter().map(|c| c.content()).collect::<Vec<String>>();
    let header = full.header().map(cells).unwrap_or_default();
    let columns: Vec<(usize, &str)> =
        keep.iter().filter_map(|(name, short)| header.iter().position(|h| h == name).map(|i| (i, *short))).collect();
    let mut t = Table::new();
    t.load_preset(presets::UTF8_FULL_CONDENSED);
    let case = (case_columns > 0).then_some("case");
    t.set_header(case.into_iter().chain(columns.iter().map(|(_, short)| *short)).collect::<Vec<_>>());
    for row in full.row_iter() {
        let row = cells(row);
        if case_columns > 0 && row.len() < 5 {
            continue;
        }
        let case = (case_columns > 0).then(|| case_label(&row));
        t.add_row(
            case.into_iter()
                .chain(columns.iter().map(|(i, _)| row.get(*i).map_or("—".into(), |c| median_only(c))))
                .collect::<Vec<String>>(),
        );
    }
    for i in usize::from(case_columns > 0)..t.column_count() {
        if let Some(c) = t.column_mut(i) {
            c.set_cell_alignment(CellAlignment::Right);
        }
    }
    t.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cases_fold_and_spreads_lose_their_range() {
        let cells = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(case_label(&cells(&["1", "fsdp-full-shard", "2", "4096", "bf16"])), "L1 fsdp-full-shard ×2 fc1 4096 bf16");
        assert_eq!(case_label(&cells(&["baseline", "single", "1", "128", "fp32"])), "baseline single ×1 fc1 128 fp32");
        assert_eq!(median_only("1364 (1301–1398)"), "1364");
        assert_eq!(median_only("1.26× (1.10–1.34)"), "1.26×");
        assert_eq!(median_only("12.3 (7.4%)"), "12.3 (7.4%)");
        assert_eq!(median_only("612 / 598"), "612 / 598");
    }
}
