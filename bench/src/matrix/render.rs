//! The matrix's tables: throughput (with the ratios), memory per rank, all-reduce bandwidth; for
//! the terminal (comfy-table UTF-8) and for `bench.md` (markdown).

use super::efficiency::{efficiency_notes, render_efficiency};
use super::{label, targets, MatrixSummary, Peer, Row, StepFigures};
use crate::figures::ModelState;
use crate::stats::Spread;
use comfy_table::{presets, CellAlignment, Table};

/// A table whose first columns name the case (see [`case_cells`]), then `rest`.
fn case_table(markdown: bool, rest: &[&str]) -> Table {
    let header: Vec<&str> = ["level", "strategy", "ranks", "fc1", "precision"].into_iter().chain(rest.iter().copied()).collect();
    new_table(markdown, &header)
}

/// The cells that name a case: level, strategy, world size, width, precision (with a batch
/// size other than 64 and activation checkpointing: [`super::case::precision_and_options`]).
fn case_cells(c: &super::Case) -> [String; 5] {
    [
        c.level.map_or("baseline".into(), |l| l.to_string()),
        c.strategy.name().into(),
        c.world_size.to_string(),
        c.width.to_string(),
        super::case::precision_and_options(c),
    ]
}

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
    throughput_table(summary, markdown).to_string()
}

pub(super) fn throughput_table(summary: &MatrixSummary, markdown: bool) -> Table {
    let mut t = case_table(
        markdown,
        &[
            "steps",
            "samples/s (median, min–max)",
            "peer",
            "peer samples/s",
            "ours / peer",
            "tuned peer samples/s",
            "ours / tuned",
            "vs level 1",
            "vs ddp",
            "vs fp32",
            "comm share",
            "accuracy",
            "peer accuracy",
            "eval samples",
        ],
    );
    for r in &summary.rows {
        let c = &r.case;
        let failed = r.samples_per_s.is_none();
        t.add_row(
            case_cells(c)
                .into_iter()
                .chain([
                    c.steps.to_string(),
                    if failed { "FAILED".into() } else { spread_cell(r.samples_per_s, 0, "") },
                    c.peer.map_or("—".into(), peer_short),
                    spread_cell(r.peer_samples_per_s, 0, ""),
                    spread_cell(r.ratio, 2, "×"),
                    spread_cell(r.tuned_samples_per_s, 0, ""),
                    spread_cell(r.tuned_ratio, 2, "×"),
                    opt(r.vs_level1, |v| format!("{v:.2}×")),
                    opt(r.vs_ddp, |v| format!("{v:.2}×")),
                    opt(r.vs_fp32, |v| format!("{v:.2}×")),
                    opt(r.comm_share, |v| format!("{:.1}%", 100.0 * v)),
                    opt(r.accuracy, |v| format!("{:.2}%", 100.0 * v)),
                    opt(r.peer_accuracy, |v| format!("{:.2}%", 100.0 * v)),
                    r.eval_samples.map_or("—".into(), |n| n.to_string()),
                ])
                .collect::<Vec<String>>(),
        );
    }
    right_align(&mut t, 2);
    t
}

/// The peer's name in a table cell (plain text: comfy-table aligns emoji poorly).
fn peer_short(p: Peer) -> String {
    match p {
        Peer::Tutorial => "PyTorch tutorial",
        Peer::DdpGloo { .. } => "PyTorch DDP",
        Peer::Accelerate { .. } => "HF Accelerate",
        Peer::Trainer { .. } => "HF Trainer",
        Peer::Tuned { .. } => "PyTorch tuned",
    }
    .into()
}

fn ms(v: f64) -> String {
    format!("{:.2}", v * 1e3)
}

/// The step table: step time p50/p95, time to first step, the phases per step, communication
/// per step; the peer's p50 beside ours.
pub fn render_steps(summary: &MatrixSummary, markdown: bool) -> String {
    steps_table(summary, markdown).to_string()
}

pub(super) fn steps_table(summary: &MatrixSummary, markdown: bool) -> Table {
    let mut t = case_table(
        markdown,
        &[
            "step p50 ms",
            "step p95 ms",
            "first step ms",
            "data ms",
            "forward ms",
            "backward ms",
            "comm ms",
            "optimizer ms",
            "comm KiB/step",
            "peer step p50 ms",
            "peer first step ms",
        ],
    );
    for r in &summary.rows {
        let c = &r.case;
        let f = |g: fn(&StepFigures) -> f64| r.step.as_ref().map_or("—".into(), |s| ms(g(s)));
        t.add_row(
            case_cells(c)
                .into_iter()
                .chain([
                    f(|s| s.step_p50_s),
                    f(|s| s.step_p95_s),
                    f(|s| s.first_step_s),
                    f(|s| s.phases.data_s),
                    f(|s| s.phases.forward_s),
                    f(|s| s.phases.backward_s),
                    f(|s| s.phases.comm_s),
                    f(|s| s.phases.optimizer_s),
                    r.step.as_ref().map_or("—".into(), |s| format!("{:.0}", s.comm_bytes_per_step / 1024.0)),
                    r.peer_step.as_ref().map_or("—".into(), |s| ms(s.step_p50_s)),
                    r.peer_step.as_ref().map_or("—".into(), |s| ms(s.first_step_s)),
                ])
                .collect::<Vec<String>>(),
        );
    }
    right_align(&mut t, 2);
    t
}

/// The targets of issues #10, #11, #23 and #25, each with its measured value and whether it is met.
pub fn render_targets(summary: &MatrixSummary, markdown: bool) -> String {
    let mut t = new_table(markdown, &["issue", "target", "cell", "measured", "bound", "met"]);
    for g in summary.targets() {
        // A `|` in Markdown would split the cell (`|measured − estimated|`): escaped there.
        let what = g.what.replace('🤗', "HF");
        t.add_row(vec![
            format!("#{}", g.issue),
            if markdown { what.replace('|', "\\|") } else { what },
            g.cell.clone(),
            format!("{:.2}×", g.measured),
            g.bound(),
            if g.met { "met".into() } else { "NOT MET".into() },
        ]);
    }
    right_align(&mut t, 3);
    t.to_string()
}

fn per_rank(v: &[f64]) -> String {
    if v.is_empty() {
        "—".into()
    } else {
        v.iter().map(|m| format!("{m:.0}")).collect::<Vec<_>>().join(" / ")
    }
}

/// The memory table: model-state bytes of rank 0, the training-phase peak RSS of every rank
/// beside its whole-process peak, and the peer's.
pub fn render_memory(summary: &MatrixSummary, markdown: bool) -> String {
    memory_table(summary, markdown).to_string()
}

pub(super) fn memory_table(summary: &MatrixSummary, markdown: bool) -> Table {
    let mut t = case_table(
        markdown,
        &[
            "parameters MiB",
            "gradients MiB",
            "optimizer MiB",
            "gathered peak MiB",
            "training-phase peak RSS per rank MiB",
            "training-phase growth per rank MiB",
            "largest rank's growth MiB, median (min–max)",
            "estimated growth MiB",
            "whole-process peak RSS per rank MiB",
            "peer training-phase / whole-process MiB",
        ],
    );
    for r in &summary.rows {
        let c = &r.case;
        let ms = |f: fn(&ModelState) -> u64| r.model_state.map_or("—".into(), |m| format!("{:.1}", f(&m) as f64 / MIB));
        t.add_row(
            case_cells(c)
                .into_iter()
                .chain([
                    ms(|m| m.parameters),
                    ms(|m| m.gradients),
                    ms(|m| m.optimizer),
                    ms(|m| m.gathered_peak),
                    per_rank(&r.train_peak_rss_per_rank),
                    per_rank(&r.train_rss_growth_per_rank),
                    spread_cell(r.train_rss_growth, 0, ""),
                    opt(r.estimated_growth_mib(), |m| format!("{m:.0}")),
                    per_rank(&r.peak_rss_per_rank),
                    peer_rss(r),
                ])
                .collect::<Vec<String>>(),
        );
    }
    right_align(&mut t, 2);
    t
}

fn peer_rss(r: &Row) -> String {
    match (r.peer_train_peak_rss_mib, r.peer_peak_rss_mib) {
        (None, None) => "—".into(),
        (a, b) => format!("{} / {}", a.map_or("—".into(), |m| format!("{m:.0}")), b.map_or("—".into(), |m| format!("{m:.0}"))),
    }
}

/// The all-reduce table (empty string when not measured).
pub fn render_allreduce(summary: &MatrixSummary, markdown: bool) -> String {
    allreduce_table(summary, markdown).map_or(String::new(), |t| t.to_string())
}

pub(super) fn allreduce_table(summary: &MatrixSummary, markdown: bool) -> Option<Table> {
    let a = summary.allreduce.as_ref()?;
    let mut t = new_table(
        markdown,
        &[
            "bytes",
            "ours busbw GB/s",
            "raw rsmpi busbw GB/s",
            "ours / raw",
            "layout checked once / raw",
            "ours µs",
            "layout checked once µs",
            "raw µs",
        ],
    );
    for r in &a.rows {
        let measured = r.prechecked_latency_us > 0.0;
        t.add_row(vec![
            r.bytes.to_string(),
            format!("{:.2}", r.ours_busbw_gbps),
            format!("{:.2}", r.raw_busbw_gbps),
            format!("{:.2}", r.ratio),
            if measured { format!("{:.2}", r.prechecked_ratio) } else { "—".into() },
            format!("{:.1}", r.ours_latency_us),
            if measured { format!("{:.1}", r.prechecked_latency_us) } else { "—".into() },
            format!("{:.1}", r.raw_latency_us),
        ]);
    }
    right_align(&mut t, 0);
    Some(t)
}

/// The DDP bucket table (empty string when not measured): one row per bucket_cap_mb and the
/// one-flat-buffer reference.
pub fn render_buckets(summary: &MatrixSummary, markdown: bool) -> String {
    buckets_table(summary, markdown).map_or(String::new(), |t| t.to_string())
}

pub(super) fn buckets_table(summary: &MatrixSummary, markdown: bool) -> Option<Table> {
    let b = summary.buckets.as_ref()?;
    let mut t = new_table(markdown, &["bucket_cap_mb", "buckets", "bytes", "median ms", "p95 ms", "busbw GB/s", "vs one flat all-reduce"]);
    for r in b.rows.iter().chain(std::iter::once(&b.flat)) {
        t.add_row(vec![
            r.bucket_cap_mb.map_or("one flat all-reduce".into(), |c| format!("{c}")),
            r.buckets.to_string(),
            r.bytes.to_string(),
            format!("{:.3}", r.median_ms),
            format!("{:.3}", r.p95_ms),
            format!("{:.2}", r.busbw_gbps),
            if b.flat.median_ms > 0.0 { format!("{:.2}×", r.median_ms / b.flat.median_ms) } else { "—".into() },
        ]);
    }
    right_align(&mut t, 1);
    Some(t)
}

pub(super) fn render_notes(summary: &MatrixSummary) -> String {
    let mut s = checkpointing_costs(&summary.rows);
    s.push_str(&offload_costs(&summary.rows));
    s.push_str(&optimizer_offload_costs(&summary.rows));
    for r in summary.rows.iter().filter(|r| !r.errors.is_empty()) {
        s.push_str(&format!("\n{} FAILED ({} of {} repeats):\n{}\n", label(&r.case), r.errors.len(), summary.repeats, r.errors[0]));
    }
    if let Some(e) = &summary.allreduce_error {
        s.push_str(&format!("\nall-reduce FAILED: {e}\n"));
    }
    if let Some(e) = &summary.buckets_error {
        s.push_str(&format!("\nDDP bucket measurement FAILED: {e}\n"));
    }
    if !summary.skipped.is_empty() {
        s.push_str("\nNot run:\n");
        for k in &summary.skipped {
            s.push_str(&format!("- {k}\n"));
        }
    }
    s
}

/// What activation checkpointing costs and saves, per checkpointed cell run beside the same
/// cell without: samples/s and training-phase RSS growth (medians), as ratios.
pub(super) fn checkpointing_costs(rows: &[Row]) -> String {
    option_costs(rows, targets::without_checkpointing, "Activation checkpointing (recompute in backward)", |_| String::new())
}

/// The same for FSDP's CPU offload, each offloaded cell beside the same cell without.
pub(super) fn offload_costs(rows: &[Row]) -> String {
    option_costs(rows, targets::without_offload, "CPU offload (parameter shards, gradients and optimizer state on the host)", |_| {
        String::new()
    })
}

/// The same for the optimizer's moments on disk (DeepSpeed's `offload_optimizer` nvme), each
/// such cell beside the same cell with the moments in memory.
pub(super) fn optimizer_offload_costs(rows: &[Row]) -> String {
    option_costs(
        rows,
        targets::without_optimizer_offload,
        "Optimizer offload to disk (AdamW's moments streamed from a file per rank)",
        |r| {
            r.offload_per_step.map_or(String::new(), |o| {
                let mib = ladder_core::memory::mib;
                format!(
                    "; per step {:.1} MiB read, {:.1} MiB written, {:.3} s streaming (rank 0)",
                    mib(o.bytes_read),
                    mib(o.bytes_written),
                    o.seconds
                )
            })
        },
    )
}

/// Per cell that `twin` pairs with the same cell without the option: samples/s and
/// training-phase RSS growth (medians), as ratios, then what `more` says of the cell, under
/// `title`.
fn option_costs(rows: &[Row], twin: for<'a> fn(&Row, &'a [Row]) -> Option<&'a Row>, title: &str, more: fn(&Row) -> String) -> String {
    let mut s = String::new();
    for r in rows {
        let Some(plain) = twin(r, rows) else { continue };
        let over =
            |a: Option<f64>, b: Option<f64>| a.zip(b.filter(|&b| b > 0.0)).map_or("—".to_string(), |(a, b)| format!("{:.2}×", a / b));
        let speed = over(r.samples_per_s.map(|x| x.median), plain.samples_per_s.map(|x| x.median));
        let growth = over(r.train_rss_growth_median, plain.train_rss_growth_median);
        s.push_str(&format!("- {}: samples/s {speed}, training-phase RSS growth {growth} the run without{}\n", label(&r.case), more(r)));
    }
    if s.is_empty() {
        s
    } else {
        format!("\n{title}:\n{s}")
    }
}

const EXPLAIN: &str = "samples/s: training samples over all ranks per second of the timed steps (the first 2 \
steps are warm-up, reported as time to first step; loading and evaluation excluded); ours / peer: the ratio within \
each repeat (ours and the peer's run back to back), median and range over repeats; peers: bench/reference/tutorial.py \
(single), ddp_gloo.py under torchrun (level 1), accelerate_loop.py under accelerate launch (level 2) and trainer.py \
(HF Trainer) under torchrun (level 3), same model, AdamW recipe, per-rank batch 64 and threads per rank. comm share: \
max over ranks of the time in collectives / training time. Ratio directions: ours / peer, vs level 1, vs ddp and vs fp32 \
divide samples/s, so above 1× the cell is faster than what it is compared with.";

const EXPLAIN_STEPS: &str = "Step figures of each run's slowest rank, medians over repeats: a step runs from the end \
of the previous one to the end of its optimizer step (the clock read after its collectives; on CUDA after a device \
synchronize), so the timed steps add up to the timed interval; p95 is nearest-rank. Phases are means per timed step: \
data (batch and loop bookkeeping), forward (zero_grad, forward, loss), backward without communication, comm (time \
inside collectives, moved out of the phase it happened in), optimizer. comm KiB/step: payload bytes of the \
collectives per step (all-reduce buffer, all-gather output, reduce-scatter input). The peers report no comm phase \
(PyTorch DDP overlaps it with backward).";

const EXPLAIN_MEMORY: &str = "Model state: rank 0's persistent bytes (AdamW: 2 states per parameter). \
Training-phase peak RSS: the most any training step held (VmHWM reset through /proc/self/clear_refs when training \
starts and after each evaluation or save, read as each step ends; the peers read it when their loop ends, before \
evaluating); whole-process: the high-water mark since start-up, data loading, evaluation and saves included. Training-phase growth: the peak less the RSS when training started, per rank the most over repeats; the largest rank's, over repeats, its median (what the Targets hold against the estimate) and range: how far one run lies from another. FSDP cells wrap every layer in its own unit (`--fsdp-min-num-params 0`, as `estimate-memory \
--fsdp-min-num-params 0` estimates them; the levels' default leaves BasicNet one unit below fc1 width 10,850). \
The training-phase growth rises over a run's first tens of steps: the estimate is fitted to runs of 20 steps and more (the bench's --steps 300 at width 128 and 64 samples per rank, --wide-steps 20 elsewhere), so a shorter run measures less than it.";

/// `bench.md`.
pub fn render_markdown(summary: &MatrixSummary) -> String {
    let mut s = format!(
        "# ddp-ladder bench\n\n{}\n{}\n## Throughput (repeats: {})\n\n{}\n\n{EXPLAIN}\n\n## Steps (ms)\n\n{}\n\n{EXPLAIN_STEPS}\n\n## Memory\n\n{}\n\n{EXPLAIN_MEMORY}\n",
        summary.machine.line(),
        summary.load_warnings.iter().map(|w| format!("\n> {w}\n")).collect::<String>(),
        summary.repeats,
        render_throughput(summary, true),
        render_steps(summary, true),
        render_memory(summary, true)
    );
    s.push_str(&format!("\n## Compute efficiency\n\n{}\n\n{}\n", render_efficiency(summary, true), efficiency_notes(summary)));
    if !summary.targets().is_empty() {
        s.push_str(&format!("\n## Targets (measured in this run, met or not)\n\n{}\n", render_targets(summary, true)));
    }
    if let Some(a) = &summary.allreduce {
        s.push_str(&format!(
            "\n## All-reduce, {} ranks (f32, sum; busbw = algbw × 2(n−1)/n)\n\nours: `ProcessGroup::all_reduce`, which checks on every call that all ranks pass the same numel and dtype (one small all-reduce first); layout checked once: `Collective::all_reduce(..).prechecked()`, the path DDP's buckets take (their layout is checked once, when DDP is built); raw: rsmpi's `all_reduce_into`.\n\n{}\n",
            a.world_size,
            render_allreduce(summary, true)
        ));
    }
    if let Some(b) = &summary.buckets {
        s.push_str(&format!(
            "\n## DDP gradient all-reduce of BasicNet vs bucket_cap_mb, {} ranks\n\nOne `sync_gradients()` (pack each bucket, all-reduce(Avg), unpack), median over rounds, next to one all-reduce of every gradient in one flat buffer (`examples/ddp_buckets`).\n\n{}\n",
            b.world_size,
            render_buckets(summary, true)
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
        "peer_samples_per_s_median",
        "ratio_median",
        "ratio_min",
        "ratio_max",
        "vs_level1",
        "vs_ddp",
        "comm_share",
        "accuracy",
        "peer_accuracy",
        "eval_samples",
        "test_loss",
        "parameters_bytes",
        "gradients_bytes",
        "optimizer_bytes",
        "gathered_peak_bytes",
        "peak_rss_mib_max_rank",
        "train_peak_rss_mib_max_rank",
        "peer",
        "peer_train_peak_rss_mib",
        "peer_peak_rss_mib",
        "vs_fp32",
        "step_p50_s",
        "step_p95_s",
        "first_step_s",
        "data_s",
        "forward_s",
        "backward_s",
        "comm_s",
        "optimizer_s",
        "comm_bytes_per_step",
        "peer_step_p50_s",
        "peer_first_step_s",
        "errors",
        "tuned_peer",
        "tuned_samples_per_s_median",
        "tuned_ratio_median",
        "tuned_accuracy",
        "training_flops_per_sample",
        "batch_size",
        "activation_checkpointing",
        "train_rss_growth_mib_median",
        "estimated_growth_mib",
        "cpu_offload",
        "offload_optimizer",
        "train_rss_growth_mib_min",
        "train_rss_growth_mib_max",
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
            c.precision.label().into(),
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
            f(r.train_peak_rss_per_rank.iter().copied().reduce(f64::max)),
            c.peer.map_or(String::new(), |p| p.id()),
            f(r.peer_train_peak_rss_mib),
            f(r.peer_peak_rss_mib),
            f(r.vs_fp32),
            f(r.step.map(|s| s.step_p50_s)),
            f(r.step.map(|s| s.step_p95_s)),
            f(r.step.map(|s| s.first_step_s)),
            f(r.step.map(|s| s.phases.data_s)),
            f(r.step.map(|s| s.phases.forward_s)),
            f(r.step.map(|s| s.phases.backward_s)),
            f(r.step.map(|s| s.phases.comm_s)),
            f(r.step.map(|s| s.phases.optimizer_s)),
            f(r.step.map(|s| s.comm_bytes_per_step)),
            f(r.peer_step.map(|s| s.step_p50_s)),
            f(r.peer_step.map(|s| s.first_step_s)),
            r.errors.len().to_string(),
            c.tuned_peer.map_or(String::new(), |p| p.id()),
            f(r.tuned_samples_per_s.map(|s| s.median)),
            f(r.tuned_ratio.map(|s| s.median)),
            f(r.tuned_accuracy),
            crate::compute::training_flops_per_sample(c.width).to_string(),
            c.batch_size.to_string(),
            c.activation_checkpointing.to_string(),
            f(r.train_rss_growth_median),
            f(r.estimated_growth_mib()),
            c.cpu_offload.to_string(),
            c.offload_optimizer.to_string(),
            f(r.train_rss_growth.map(|g| g.min)),
            f(r.train_rss_growth.map(|g| g.max)),
        ];
        out.push_str(&cells.join(","));
        out.push('\n');
    }
    out
}

/// `targets.csv`: one line per target and cell (issue, what, cell, measured, threshold,
/// at_least, met).
pub fn render_targets_csv(summary: &MatrixSummary) -> String {
    let mut out = String::from("issue,what,cell,measured,threshold,at_least,met\n");
    for g in summary.targets() {
        out.push_str(&format!("{},\"{}\",\"{}\",{},{},{},{}\n", g.issue, g.what, g.cell, g.measured, g.threshold, g.at_least, g.met));
    }
    out
}
