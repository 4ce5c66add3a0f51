//! The matrix's tables: throughput (with the ratios), memory per rank, all-reduce bandwidth; for
//! the terminal (comfy-table UTF-8) and for `bench.md` (markdown).

use super::{label, MatrixSummary};
use crate::figures::ModelState;
use crate::stats::Spread;
use comfy_table::{presets, CellAlignment, Table};

fn spread_cell(s: Option<Spread>, digits: usize, suffix: &str) -> String {
    match s {
        None => "—".into(),
        Some(s) if s.n == 1 => format!("{:.digits$}{suffix}", s.median),
        Some(s) => format!("{:.digits$}{suffix} ({:.digits$}–{:.digits$})", s.median, s.min, s.max),
    }
}

fn opt(v: Option<f64>, f: impl Fn(f64) -> String) -> String {
    v.map_or("—".into(), f)
}

fn new_table(markdown: bool, header: &[&str]) -> Table {
    let mut t = Table::new();
    t.load_preset(if markdown { presets::ASCII_MARKDOWN } else { presets::UTF8_FULL_CONDENSED });
    t.set_header(header.to_vec());
    t
}

fn right_align(t: &mut Table, from: usize) {
    let n = t.column_count();
    for i in from..n {
        if let Some(c) = t.column_mut(i) {
            c.set_cell_alignment(CellAlignment::Right);
        }
    }
}

const MIB: f64 = 1024.0 * 1024.0;

/// The throughput table: every cell with its samples/s, PyTorch's, the ratio, the level ratio,
/// communication share, accuracy and evaluated images.
pub fn render_throughput(summary: &MatrixSummary, markdown: bool) -> String {
    let mut t = new_table(
        markdown,
        &[
            "level",
            "strategy",
            "ranks",
            "fc1",
            "precision",
            "steps",
            "samples/s (median, min–max)",
            "PyTorch samples/s",
            "ours / PyTorch",
            "vs level 1",
            "vs ddp",
            "comm share",
            "accuracy",
            "PyTorch accuracy",
            "eval samples",
        ],
    );
    for r in &summary.rows {
        let c = &r.case;
        let failed = r.samples_per_s.is_none();
        t.add_row(vec![
            c.level.map_or("baseline".into(), |l| l.to_string()),
            c.strategy.name().into(),
            c.world_size.to_string(),
            c.width.to_string(),
            c.precision.name().into(),
            c.steps.to_string(),
            if failed { "FAILED".into() } else { spread_cell(r.samples_per_s, 0, "") },
            spread_cell(r.peer_samples_per_s, 0, ""),
            spread_cell(r.ratio, 2, "×"),
            opt(r.vs_level1, |v| format!("{v:.2}×")),
            opt(r.vs_ddp, |v| format!("{v:.2}×")),
            opt(r.comm_share, |v| format!("{:.1}%", 100.0 * v)),
            opt(r.accuracy, |v| format!("{:.2}%", 100.0 * v)),
            opt(r.peer_accuracy, |v| format!("{:.2}%", 100.0 * v)),
            r.eval_samples.map_or("—".into(), |n| n.to_string()),
        ]);
    }
    right_align(&mut t, 2);
    t.to_string()
}

/// The memory table: model-state bytes of rank 0 and the peak RSS of every rank.
pub fn render_memory(summary: &MatrixSummary, markdown: bool) -> String {
    let mut t = new_table(
        markdown,
        &[
            "level",
            "strategy",
            "ranks",
            "fc1",
            "precision",
            "parameters MiB",
            "gradients MiB",
            "optimizer MiB",
            "gathered peak MiB",
            "peak RSS per rank MiB",
        ],
    );
    for r in &summary.rows {
        let c = &r.case;
        let ms = |f: fn(&ModelState) -> u64| r.model_state.map_or("—".into(), |m| format!("{:.1}", f(&m) as f64 / MIB));
        t.add_row(vec![
            c.level.map_or("baseline".into(), |l| l.to_string()),
            c.strategy.name().into(),
            c.world_size.to_string(),
            c.width.to_string(),
            c.precision.name().into(),
            ms(|m| m.parameters),
            ms(|m| m.gradients),
            ms(|m| m.optimizer),
            ms(|m| m.gathered_peak),
            if r.peak_rss_per_rank.is_empty() {
                "—".into()
            } else {
                r.peak_rss_per_rank.iter().map(|m| format!("{m:.0}")).collect::<Vec<_>>().join(" / ")
            },
        ]);
    }
    right_align(&mut t, 2);
    t.to_string()
}

/// The all-reduce table (empty string when not measured).
pub fn render_allreduce(summary: &MatrixSummary, markdown: bool) -> String {
    let Some(a) = &summary.allreduce else { return String::new() };
    let mut t = new_table(markdown, &["bytes", "ours busbw GB/s", "raw rsmpi busbw GB/s", "ours / raw", "ours µs", "raw µs"]);
    for r in &a.rows {
        t.add_row(vec![
            r.bytes.to_string(),
            format!("{:.2}", r.ours_busbw_gbps),
            format!("{:.2}", r.raw_busbw_gbps),
            format!("{:.2}", r.ratio),
            format!("{:.1}", r.ours_latency_us),
            format!("{:.1}", r.raw_latency_us),
        ]);
    }
    right_align(&mut t, 0);
    t.to_string()
}

fn render_notes(summary: &MatrixSummary) -> String {
    let mut s = String::new();
    for r in summary.rows.iter().filter(|r| !r.errors.is_empty()) {
        s.push_str(&format!("\n{} FAILED ({} of {} repeats):\n{}\n", label(&r.case), r.errors.len(), summary.repeats, r.errors[0]));
    }
    if let Some(e) = &summary.allreduce_error {
        s.push_str(&format!("\nall-reduce FAILED: {e}\n"));
    }
    if !summary.skipped.is_empty() {
        s.push_str("\nNot run:\n");
        for k in &summary.skipped {
            s.push_str(&format!("- {k}\n"));
        }
    }
    s
}

const EXPLAIN: &str = "samples/s: training samples over all ranks per second of the training loop (loading and \
evaluation excluded); ours / PyTorch: the ratio within each repeat (ours and PyTorch's run back to back), median and \
range over repeats; PyTorch peers: bench/reference/tutorial.py (single) and ddp_gloo.py under torchrun (ddp), same \
model, AdamW recipe, per-rank batch 64 and threads per rank. comm share: max over ranks of the time in collectives / \
training time. Model state: rank 0's persistent bytes (AdamW: 2 states per parameter); peak RSS: each rank's \
whole-process high-water mark, data loading included.";

/// What the terminal shows.
pub fn render_terminal(summary: &MatrixSummary) -> String {
    let mut s = format!(
        "{}\n\nThroughput (repeats: {})\n{}\n\nMemory\n{}\n",
        summary.machine.line(),
        summary.repeats,
        render_throughput(summary, false),
        render_memory(summary, false)
    );
    if summary.allreduce.is_some() {
        s.push_str(&format!("\nAll-reduce (f32, sum)\n{}\n", render_allreduce(summary, false)));
    }
    s.push_str(&render_notes(summary));
    s
}

/// `bench.md`.
pub fn render_markdown(summary: &MatrixSummary) -> String {
    let mut s = format!(
        "# ddp-ladder bench\n\n{}\n\n## Throughput (repeats: {})\n\n{}\n\n{EXPLAIN}\n\n## Memory\n\n{}\n",
        summary.machine.line(),
        summary.repeats,
        render_throughput(summary, true),
        render_memory(summary, true)
    );
    if let Some(a) = &summary.allreduce {
        s.push_str(&format!(
            "\n## All-reduce, {} ranks (f32, sum; busbw = algbw × 2(n−1)/n)\n\n{}\n",
            a.world_size,
            render_allreduce(summary, true)
        ));
    }
    s.push_str(&render_notes(summary));
    s
}

/// `bench.csv`: one line per cell, every figure in base units (samples/s, fractions, bytes, MiB
/// for RSS); empty fields where there is no figure. Columns as the header line says.
pub fn render_csv(summary: &MatrixSummary) -> String {
    let header = [
        "id",
        "level",
        "strategy",
        "world_size",
        "width",
        "precision",
        "steps",
        "repeats_ok",
        "samples_per_s_median",
        "samples_per_s_min",
        "samples_per_s_max",
        "pytorch_samples_per_s_median",
        "ratio_median",
        "ratio_min",
        "ratio_max",
        "vs_level1",
        "vs_ddp",
        "comm_share",
        "accuracy",
        "pytorch_accuracy",
        "eval_samples",
        "test_loss",
        "parameters_bytes",
        "gradients_bytes",
        "optimizer_bytes",
        "gathered_peak_bytes",
        "peak_rss_mib_max_rank",
        "errors",
    ];
    let f = |v: Option<f64>| v.map_or(String::new(), |x| format!("{x}"));
    let mut out = header.join(",") + "\n";
    for r in &summary.rows {
        let c = &r.case;
        let ms = r.model_state;
        let cells = [
            c.id.clone(),
            c.level.map_or("baseline".into(), |l| l.to_string()),
            c.strategy.name().into(),
            c.world_size.to_string(),
            c.width.to_string(),
            c.precision.name().into(),
            c.steps.to_string(),
            r.samples_per_s.map_or(0, |s| s.n).to_string(),
            f(r.samples_per_s.map(|s| s.median)),
            f(r.samples_per_s.map(|s| s.min)),
            f(r.samples_per_s.map(|s| s.max)),
            f(r.peer_samples_per_s.map(|s| s.median)),
            f(r.ratio.map(|s| s.median)),
            f(r.ratio.map(|s| s.min)),
            f(r.ratio.map(|s| s.max)),
            f(r.vs_level1),
            f(r.vs_ddp),
            f(r.comm_share),
            f(r.accuracy),
            f(r.peer_accuracy),
            r.eval_samples.map_or(String::new(), |n| n.to_string()),
            f(r.test_loss),
            ms.map_or(String::new(), |m| m.parameters.to_string()),
            ms.map_or(String::new(), |m| m.gradients.to_string()),
            ms.map_or(String::new(), |m| m.optimizer.to_string()),
            ms.map_or(String::new(), |m| m.gathered_peak.to_string()),
            f(r.peak_rss_per_rank.iter().copied().reduce(f64::max)),
            r.errors.len().to_string(),
        ];
        out.push_str(&cells.join(","));
        out.push('\n');
    }
    out
}
