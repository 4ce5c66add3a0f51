//! The compute-efficiency table: every cell's achieved FLOP/s (training FLOPs per sample from
//! BasicNet's layer shapes × samples/s) and its share of the machine's peak, ours beside the
//! peers'.

use super::MatrixSummary;
use crate::compute::{achieved_flops, training_flops_per_sample, Peak};
use comfy_table::{presets, CellAlignment, Table};
use ladder_core::parallel::Precision;

/// `12.3 GFLOP/s (7.4%)`: achieved FLOP/s at `samples_per_s` and its share of `peak` for the
/// row's precision; `—` without a figure.
fn cell(width: i64, samples_per_s: Option<f64>, peak: Option<&Peak>, bf16: bool) -> String {
    let Some(sps) = samples_per_s.filter(|s| *s > 0.0) else { return "—".into() };
    let flops = achieved_flops(width, sps);
    match peak {
        Some(p) => format!("{:.1} ({:.1}%)", flops / 1e9, 100.0 * flops / p.for_precision(bf16)),
        None => format!("{:.1}", flops / 1e9),
    }
}

/// The table: one line per cell with training MFLOP per sample, then GFLOP/s and % of peak for
/// ours, the tutorial peer and the tuned peer.
pub fn render_efficiency(summary: &MatrixSummary, markdown: bool) -> String {
    efficiency_table(summary, markdown).to_string()
}

/// [`render_efficiency`]'s table.
pub(super) fn efficiency_table(summary: &MatrixSummary, markdown: bool) -> Table {
    let mut t = Table::new();
    t.load_preset(if markdown { presets::ASCII_MARKDOWN } else { presets::UTF8_FULL_CONDENSED });
    t.set_header(vec![
        "level",
        "strategy",
        "ranks",
        "fc1",
        "precision",
        "training MFLOP/sample",
        "ours GFLOP/s (% of peak)",
        "peer GFLOP/s (% of peak)",
        "tuned peer GFLOP/s (% of peak)",
        "tuned peer accuracy",
        "tuned peer chose",
    ]);
    let peak = summary.machine.cpu_peak.as_ref();
    for r in &summary.rows {
        let c = &r.case;
        let bf16 = c.precision == Precision::Bf16;
        let median = |s: Option<crate::stats::Spread>| s.map(|s| s.median);
        t.add_row(vec![
            c.level.map_or("baseline".into(), |l| l.to_string()),
            c.strategy.name().into(),
            c.world_size.to_string(),
            c.width.to_string(),
            super::case::precision_and_options(c),
            format!("{:.2}", training_flops_per_sample(c.width) as f64 / 1e6),
            cell(c.width, median(r.samples_per_s), peak, bf16),
            // The tutorial peers train in fp32; the tuned one in the row's precision.
            cell(c.width, median(r.peer_samples_per_s), peak, false),
            cell(c.width, median(r.tuned_samples_per_s), peak, bf16),
            r.tuned_accuracy.map_or("—".into(), |a| format!("{:.2}%", 100.0 * a)),
            r.tuned_choice.clone().unwrap_or_else(|| "—".into()),
        ]);
    }
    for i in 2..t.column_count() - 1 {
        if let Some(col) = t.column_mut(i) {
            col.set_cell_alignment(CellAlignment::Right);
        }
    }
    t
}

/// What the table counts and the peak it divides by, under the table.
pub fn efficiency_notes(summary: &MatrixSummary) -> String {
    let peak = summary.machine.cpu_peak.as_ref().map_or_else(
        || "Peak: not recorded for this run (a report from before it was measured).".to_string(),
        |p| format!("Peak: {}.", p.derivation),
    );
    format!("{EXPLAIN_EFFICIENCY}\n\n{peak}")
}

const EXPLAIN_EFFICIENCY: &str = "Training FLOPs per sample, counted from BasicNet's layer shapes: 2 FLOPs per \
multiply-accumulate of conv1, conv2, fc1 and fc2, forward once and backward twice (weight and input gradients; conv1 \
has no input gradient) — 71.57 MFLOP at width 128; biases, activations, pooling, dropout, the loss and the optimizer \
are left out (< 1%). GFLOP/s: that × the median samples/s over all ranks. % of peak: of the fp32 peak, or for bf16 \
rows (ours and the tuned peer's) of the bf16 peak where the CPU has bf16 instructions. The tuned peer \
(bench/reference/tuned.py, one process at 1 rank, DDP over gloo under torchrun above) is the loop a speed-minded \
PyTorch user writes: images decoded and normalised once into one tensor, batches by index from a per-epoch \
permutation (DistributedSampler's rule), AdamW(fused=True) where the build has it, zero_grad(set_to_none=True), in the \
row's precision (fp32, or bf16 autocast for a bf16 row), and each of channels_last and torch.compile that a short \
timed trial at start-up measures faster and whose gradients agree with eager fp32's (PyTorch 2.13.0's compiled BasicNet on CPU gets zero conv gradients and is \
rejected) — what it chose is in the last column. Levels 2 and 3 are measured against the same loop (it has no Accelerate or Trainer \
layer).";
