//! The terminal's narrow tables: the five columns that name a case (level, strategy, ranks, fc1,
//! precision) folded into one `case` cell as [`super::label`] writes it, a few columns kept
//! under short headers, and
//! medians without their min–max — so that `bench run` reads on an 80–100-column terminal. Every
//! column is in `bench.md`, and on the terminal with `bench run --all-columns`.

use super::efficiency::{efficiency_notes, efficiency_table, render_efficiency};
use super::render::{
    allreduce_table, buckets_table, memory_table, render_memory, render_notes, render_steps, render_targets, render_throughput,
    steps_table, throughput_table,
};
use super::MatrixSummary;
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

/// What the terminal shows: with `all_columns`, every column of `bench.md`'s tables; otherwise
/// each table narrowed to its case and the figures most read (medians only, see
/// [`super::narrow`]), about 80 columns wide.
pub fn render_terminal(summary: &MatrixSummary, all_columns: bool) -> String {
    let tables = if all_columns {
        [render_throughput(summary, false), render_steps(summary, false), render_memory(summary, false), render_efficiency(summary, false)]
    } else {
        [
            narrow(
                &throughput_table(summary, false),
                5,
                &[
                    ("samples/s (median, min–max)", "samples/s"),
                    ("ours / peer", "ours/peer"),
                    ("ours / tuned", "ours/tuned"),
                    ("accuracy", "accuracy"),
                ],
            ),
            narrow(
                &steps_table(summary, false),
                5,
                &[
                    ("step p50 ms", "step p50"),
                    ("forward ms", "forward"),
                    ("backward ms", "backward"),
                    ("comm ms", "comm"),
                    ("optimizer ms", "optimizer"),
                ],
            ),
            narrow(
                &memory_table(summary, false),
                5,
                &[("training-phase growth per rank MiB", "growth per rank MiB"), ("estimated growth MiB", "estimate MiB")],
            ),
            narrow(
                &efficiency_table(summary, false),
                5,
                &[("ours GFLOP/s (% of peak)", "ours GFLOP/s (% of peak)"), ("tuned peer GFLOP/s (% of peak)", "tuned peer")],
            ),
        ]
    };
    let [throughput, steps, memory, efficiency] = tables;
    let peers = if all_columns {
        String::new()
    } else {
        "; peer: PyTorch tutorial (baseline), PyTorch DDP (level 1), HF Accelerate (2), HF Trainer (3); tuned: PyTorch tuned".into()
    };
    let mut s = format!(
        "{}\n\nThroughput (repeats: {}; the ratios divide samples/s: above 1× is faster{peers})\n{throughput}\n\nSteps (ms)\n{steps}\n\nMemory\n{memory}\n",
        summary.machine.line(),
        summary.repeats,
    );
    s.push_str(&format!("\nCompute efficiency\n{efficiency}\n{}\n", efficiency_notes(summary)));
    if let Some(t) = allreduce_table(summary, false) {
        let table = if all_columns {
            t.to_string()
        } else {
            let keep = [
                ("bytes", "bytes"),
                ("ours busbw GB/s", "ours busbw GB/s"),
                ("raw rsmpi busbw GB/s", "raw rsmpi"),
                ("ours / raw", "ours / raw"),
            ];
            narrow(&t, 0, &keep)
        };
        s.push_str(&format!("\nAll-reduce (f32, sum; the ratios divide bus bandwidths: above 1× is faster)\n{table}\n"));
    }
    if let (Some(b), Some(t)) = (&summary.buckets, buckets_table(summary, false)) {
        let table = if all_columns {
            t.to_string()
        } else {
            let keep = [
                ("bucket_cap_mb", "bucket_cap_mb"),
                ("buckets", "buckets"),
                ("median ms", "median ms"),
                ("vs one flat all-reduce", "vs flat"),
            ];
            narrow(&t, 0, &keep)
        };
        let column = if all_columns { "vs one flat all-reduce" } else { "vs flat" };
        s.push_str(&format!(
            "\nDDP gradient all-reduce of BasicNet vs bucket_cap_mb ({} ranks; time of one sync; {column} divides times: above 1× is slower)\n{table}\n",
            b.world_size,
        ));
    }
    let all = summary.targets();
    if all_columns && !all.is_empty() {
        s.push_str(&format!("\nTargets (measured in this run, met or not)\n{}\n", render_targets(summary, false)));
    } else if !all.is_empty() {
        let met = all.iter().filter(|t| t.met).count();
        s.push_str(&format!(
            "\nTargets: {met} of {} met in this run (each with its measured value and bound: bench.md, or --all-columns)\n",
            all.len()
        ));
    }
    s.push_str(&render_notes(summary));
    s
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
