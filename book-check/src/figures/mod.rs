//! The book's figures from one measured run: small tables that each answer one question, the
//! full tables cut to a width a page can show, and two plots — all generated from the bench's
//! Markdown of the reference run (`book/src/generated/bench.md`, copied there by
//! `make book-data`), so no figure in them is typed by hand, and each carries the run's
//! provenance line ([`crate::provenance`]).
//!
//! The bench's tables are read by section and column *name*, so a column added later is carried
//! into the full tables as it comes, and one the small tables need but cannot find is an error
//! naming it.

use crate::error::{Error, Result};
use crate::memory::{self, thousands};
use crate::tables::{number, numbers, Table};
use std::path::{Path, PathBuf};

pub mod fit;
pub mod full;
mod network;
pub use full::{split, PAGE_CHARS};

/// The inputs of one run.
#[derive(Debug, Clone)]
pub struct Run {
    /// The provenance line every output carries (see [`crate::provenance::line`]).
    pub line: String,
    /// The bench's Markdown.
    pub bench: String,
    /// Where the bench's Markdown was read (for messages).
    pub bench_file: PathBuf,
    /// The two-host run's Markdown (`generated/cluster.md`, from `scripts/cluster-bench.sh`),
    /// when there is one.
    pub cluster: Option<String>,
}

/// The key columns of the matrix tables, in the bench's order.
const KEYS: [&str; 5] = ["level", "strategy", "ranks", "fc1", "precision"];
/// The bench's column names this module reads (besides the keys).
const SAMPLES: &str = "samples/s";
const VS_DDP: &str = "vs ddp";
const VS_L1: &str = "vs level 1";
const VS_FP32: &str = "vs fp32";
const PEER: &str = "peer";
const PEER_SAMPLES: &str = "peer samples/s";
const OURS_PEER: &str = "ours / peer";
const COMM_SHARE: &str = "comm share";
const COMM_KIB: &str = "comm KiB/step";
const PARAMS: &str = "parameters MiB";
const GRADS: &str = "gradients MiB";
const OPTIM: &str = "optimizer MiB";
const GATHERED: &str = "gathered peak MiB";
const TRAIN_RSS: &str = "training-phase peak RSS per rank MiB";
const WHOLE_RSS: &str = "whole-process peak RSS per rank MiB";
const PEER_RSS: &str = "peer training-phase / whole-process MiB";

/// A caption naming the run, for a small table in a chapter: its date and commit, and where
/// the machine and commands are.
fn caption(line: &str) -> String {
    let date = line.split(" on ").nth(1).and_then(|r| r.split('T').next()).unwrap_or("?");
    let commit = line.split("(commit ").nth(1).and_then(|r| r.split(')').next()).unwrap_or("?");
    format!(
        "<!-- {line} -->\n<small>Reference run of {date}, commit {commit}; machine and commands in \
         [Measurements](measurements.md#the-reference-run).</small>\n"
    )
}

/// The matrix tables of the run.
struct Matrix<'a> {
    run: &'a Run,
    throughput: Table,
    steps: Option<Table>,
    memory: Option<Table>,
}

impl<'a> Matrix<'a> {
    fn read(run: &'a Run) -> Result<Self> {
        let throughput = Table::in_section(&run.bench, "Throughput")
            .ok_or_else(|| Error::Input { file: run.bench_file.clone(), problem: "no `## Throughput` table".into() })?;
        Ok(Matrix { run, throughput, steps: Table::in_section(&run.bench, "Steps"), memory: Table::in_section(&run.bench, "Memory") })
    }

    fn missing(&self, table: &str, col: &str) -> Error {
        Error::Input { file: self.run.bench_file.clone(), problem: format!("the {table} table has no `{col}` column") }
    }

    /// The key of a row of `t`: the key columns it has.
    fn key(t: &Table, row: &[String]) -> Vec<String> {
        KEYS.iter().filter_map(|k| t.get(row, k).map(str::to_string)).collect()
    }

    /// The row of `t` with the same key as `row` of `from`.
    fn twin<'t>(t: &'t Table, from: &Table, row: &[String]) -> Option<&'t Vec<String>> {
        let key = Self::key(from, row);
        t.rows.iter().find(|r| Self::key(t, r) == key)
    }

    fn col(&self, t: &Table, name: &str, table: &str) -> Result<usize> {
        t.col(name).or_else(|| t.col_starting(name)).ok_or_else(|| self.missing(table, name))
    }

    /// The distinct values of a key column, in order of appearance.
    fn values(&self, key: &str) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        if let Some(c) = self.throughput.col(key) {
            for r in &self.throughput.rows {
                if !out.contains(&r[c]) {
                    out.push(r[c].clone());
                }
            }
        }
        out
    }
}

fn strategy_label(s: &str) -> &str {
    match s {
        "ddp" => "DDP",
        "zero1" => "ZeRO-1",
        "fsdp-full-shard" => "FULL_SHARD",
        "fsdp-shard-grad-op" => "SHARD_GRAD_OP",
        "fsdp-no-shard" => "NO_SHARD",
        other => other,
    }
}

fn fmt_mib(x: f64) -> String {
    if x >= 100.0 {
        format!("{x:.0}")
    } else {
        format!("{x:.1}")
    }
}

fn max_of(cell: &str) -> Option<f64> {
    numbers(cell).into_iter().reduce(f64::max)
}

/// Where the level runs against its peer: each row of the throughput table with a peer.
fn peers(m: &Matrix) -> Result<String> {
    let t = &m.throughput;
    let (s, p, ps, op) = (
        m.col(t, SAMPLES, "Throughput")?,
        m.col(t, PEER, "Throughput")?,
        m.col(t, PEER_SAMPLES, "Throughput")?,
        m.col(t, OURS_PEER, "Throughput")?,
    );
    let mut out = Table {
        header: ["level", "run", "samples/s", "peer", "peer samples/s", "ours / peer", "peak RSS per rank, MiB", "peer's peak RSS, MiB"]
            .map(String::from)
            .to_vec(),
        rows: Vec::new(),
    };
    for r in t.rows.iter().filter(|r| r[p] != "—" && !r[p].is_empty()) {
        let (rss, peer_rss) = match &m.memory {
            Some(mem) => {
                let twin = Matrix::twin(mem, t, r);
                let ours = twin.and_then(|x| mem.get(x, TRAIN_RSS)).and_then(max_of).map_or("—".into(), fmt_mib);
                let theirs = twin.and_then(|x| mem.get(x, PEER_RSS)).and_then(|c| numbers(c).first().copied()).map_or("—".into(), fmt_mib);
                (ours, theirs)
            }
            None => ("—".into(), "—".into()),
        };
        out.rows.push(vec![
            t.get(r, "level").unwrap_or("?").to_string(),
            run_label(t, r, &["strategy", "ranks", "fc1", "precision"]),
            r[s].clone(),
            r[p].clone(),
            r[ps].clone(),
            r[op].clone(),
            rss,
            peer_rss,
        ]);
    }
    if out.rows.is_empty() {
        return Ok(format!("{}\nNo PyTorch peer ran in this run.\n", caption(&m.run.line)));
    }
    // One run for every row (the usual case): say it once above the table, not in every row.
    let mut lead = String::new();
    if out.rows.iter().all(|r| r[1] == out.rows[0][1]) {
        lead = format!("Every row: {}.\n\n", out.rows[0][1]);
        out.header.remove(1);
        out.rows.iter_mut().for_each(|r| {
            r.remove(1);
        });
    }
    Ok(format!(
        "{}\n{lead}{}\nThe peers are the tutorial's program as a user of each library writes it (bench/reference/): the tutorial's \
         own one-process loop for the baseline, PyTorch DDP over gloo under torchrun for level 1, 🤗 Accelerate for level 2, 🤗 \
         Transformers' Trainer for level 3, with the same model, recipe, batch and threads per rank (the loop a speed-minded \
         PyTorch user writes, the tuned peer, is in [Measurements](measurements.md#two-peers-and-the-machines-peak)). Peak RSS is \
         the training phase's, the larger of the ranks'.\n",
        caption(&m.run.line),
        out.markdown()
    ))
}

/// `ddp ×2 · fc1 128 · fp32`: the named key columns of a row, short.
fn run_label(t: &Table, r: &[String], keys: &[&str]) -> String {
    let mut parts = Vec::new();
    for k in keys {
        if let Some(v) = t.get(r, k) {
            parts.push(match *k {
                "strategy" => strategy_label(v).to_string(),
                "ranks" => crate::plots::ranks_label(v),
                "fc1" => format!("fc1 {v}"),
                _ => v.to_string(),
            });
        }
    }
    parts.join(" · ")
}

/// What each level costs: level 2 and 3 against level 1, per strategy, width and precision.
fn levels(m: &Matrix) -> Result<String> {
    let t = &m.throughput;
    let (s, v) = (m.col(t, SAMPLES, "Throughput")?, m.col(t, VS_L1, "Throughput")?);
    let mut out = Table {
        header: ["run", "level 1 samples/s", "level 2 / level 1", "level 3 / level 1"].map(String::from).to_vec(),
        rows: Vec::new(),
    };
    for r in t.rows.iter().filter(|r| t.get(r, "level") == Some("1")) {
        let key: Vec<(&str, &str)> =
            ["strategy", "ranks", "fc1", "precision"].iter().filter_map(|k| t.get(r, k).map(|x| (*k, x))).collect();
        let other = |level: &str| {
            let mut f = key.clone();
            f.push(("level", level));
            t.select(&f).first().map(|x| x[v].clone()).unwrap_or_else(|| "—".into())
        };
        out.rows.push(vec![run_label(t, r, &["strategy", "ranks", "fc1", "precision"]), r[s].clone(), other("2"), other("3")]);
    }
    Ok(format!(
        "{}\n{}\nEach ratio is within one run: the level's samples/s over level 1's in the same cell (strategy, ranks, width, \
         precision). Read them against the run-to-run spread of a single cell on a shared machine, a few percent.\n",
        caption(&m.run.line),
        out.markdown()
    ))
}

/// What sharding saves and costs, at each width, for level 1 in fp32 (or the first precision),
/// with a sentence in words for the widest model.
fn sharding(m: &Matrix) -> Result<String> {
    let t = &m.throughput;
    let mem = m.memory.as_ref().ok_or_else(|| m.missing("Memory", "the table itself"))?;
    let (s, vd) = (m.col(t, SAMPLES, "Throughput")?, m.col(t, VS_DDP, "Throughput")?);
    let precision = if m.values("precision").iter().any(|p| p == "fp32") { "fp32".to_string() } else { m.values("precision")[0].clone() };
    let mut text = caption(&m.run.line);
    let mut words = Vec::new();
    for width in m.values("fc1") {
        let rows: Vec<&Vec<String>> = t.select(&[("level", "1"), ("fc1", &width), ("precision", &precision)]);
        if rows.is_empty() {
            continue;
        }
        let mut out = Table { header: SHARDING_HEADER.map(String::from).to_vec(), rows: Vec::new() };
        let mut ddp: Option<(f64, f64)> = None; // (peak RSS, samples/s)
        for r in &rows {
            let strategy = t.get(r, "strategy").unwrap_or("?");
            let twin = Matrix::twin(mem, t, r);
            let state: Option<f64> =
                twin.and_then(|x| [PARAMS, GRADS, OPTIM].iter().map(|c| mem.get(x, c).and_then(number)).sum::<Option<f64>>());
            let gathered = twin.and_then(|x| mem.get(x, GATHERED)).unwrap_or("—").to_string();
            let rss_cell = twin.and_then(|x| mem.get(x, TRAIN_RSS)).unwrap_or("—");
            let rss = max_of(rss_cell);
            let comm = m.steps.as_ref().and_then(|st| Matrix::twin(st, t, r).and_then(|x| st.get(x, COMM_KIB))).unwrap_or("—").to_string();
            let sps = number(&r[s]);
            if strategy == "ddp" {
                ddp = rss.zip(sps);
            } else if let (Some((d_rss, d_sps)), Some(rss), Some(sps)) = (ddp, rss, sps) {
                words.push((width.clone(), strategy.to_string(), d_rss, rss, sps / d_sps));
            }
            let state = state.map_or("—".into(), fmt_mib);
            let held = if number(&gathered).is_some_and(|g| g > 0.0) { format!("{state} + {gathered}") } else { state };
            let vs = if strategy == "ddp" { "1.00×" } else { r[vd].as_str() };
            out.rows.push(vec![
                strategy_label(strategy).to_string(),
                held,
                rss_cell.to_string(),
                format!("{} ({vs})", r[s]),
                comm,
                t.get(r, COMM_SHARE).unwrap_or("—").to_string(),
            ]);
        }
        let ranks = t.get(rows[0], "ranks").unwrap_or("?");
        text.push_str(&format!(
            "\n**fc1 {width}** ({} parameters), level 1, {ranks} ranks, {precision}:\n\n",
            thousands(memory::num_parameters(width.parse().unwrap_or(128)))
        ));
        text.push_str(&out.markdown());
    }
    text.push_str(
        "\nModel state is parameters + gradients + AdamW's two moments per rank, as the wrapper counts them; + gathered is what a \
         sharded strategy holds on top, for a while, of full parameters; peak RSS is the training phase's high-water mark of \
         each rank (rank 0 / rank 1); the payload counts each collective's full buffer (all-reduce buffer, all-gather output, \
         reduce-scatter input), not the bytes each rank sends.\n",
    );
    if let Some(widest) = m.values("fc1").into_iter().max_by_key(|w| w.parse::<u64>().unwrap_or(0)) {
        text.push_str(&in_words(&widest, &words));
    }
    Ok(text)
}

/// The columns of [`sharding`]'s tables.
const SHARDING_HEADER: [&str; 6] =
    ["strategy", "model state + gathered, MiB", "peak RSS per rank, MiB", "samples/s (vs DDP)", "payload, KiB/step", "comm share"];

/// The sentence under [`sharding`]'s tables: what each sharded strategy saves against DDP at
/// `width`, from `words` = (width, strategy, DDP's peak RSS, its peak RSS, samples/s ratio).
fn in_words(width: &str, words: &[(String, String, f64, f64, f64)]) -> String {
    let parts: Vec<String> = words
        .iter()
        .filter(|w| w.0 == width)
        .map(|(_, s, d_rss, rss, ratio)| {
            format!(
                "{} saves about {} of DDP's {} MiB per rank ({:.0}%) at {:.2}× its samples/s",
                strategy_label(s),
                round_to(d_rss - rss, 10.0),
                round_to(*d_rss, 10.0),
                100.0 * (d_rss - rss) / d_rss,
                ratio
            )
        })
        .collect();
    if parts.is_empty() {
        String::new()
    } else {
        format!("\nIn words, at fc1 {width}: {}.\n", parts.join("; "))
    }
}

fn round_to(x: f64, step: f64) -> String {
    thousands(((x / step).round() * step).max(0.0) as u64)
}

/// What bf16 buys: bf16 / fp32 samples/s per level, strategy and width.
fn bf16(m: &Matrix) -> Result<String> {
    let t = &m.throughput;
    let v = m.col(t, VS_FP32, "Throughput")?;
    let widths = m.values("fc1");
    let mut header = vec!["level".to_string(), "strategy".to_string()];
    header.extend(widths.iter().map(|w| format!("fc1 {w}: bf16 / fp32")));
    let mut out = Table { header, rows: Vec::new() };
    let mut pairs: Vec<(&str, &str)> = Vec::new();
    for r in &t.rows {
        let pair = (t.get(r, "level").unwrap_or("?"), t.get(r, "strategy").unwrap_or("?"));
        if !pairs.contains(&pair) {
            pairs.push(pair);
        }
    }
    for (level, strategy) in pairs {
        let mut row = vec![level.to_string(), strategy_label(strategy).to_string()];
        for w in &widths {
            let cell =
                t.select(&[("level", level), ("strategy", strategy), ("fc1", w), ("precision", "bf16")]).first().map(|x| x[v].clone());
            row.push(cell.unwrap_or_else(|| "—".into()));
        }
        // A run with no bf16 cell at all (the fp32-only baseline, ZeRO-1) has no line here.
        if row[2..].iter().any(|c| c != "—") {
            out.rows.push(row);
        }
    }
    Ok(format!("{}\n{}", caption(&m.run.line), out.markdown()))
}

fn mib1(x: u64) -> String {
    format!("{:.1}", x as f64 / (1024.0 * 1024.0))
}

/// The model-state columns against the arithmetic (`book-check memory`), fp32, every level.
fn model_state(m: &Matrix) -> Result<String> {
    let mem = m.memory.as_ref().ok_or_else(|| m.missing("Memory", "the table itself"))?;
    let mut out = Table { header: MODEL_STATE_HEADER.map(String::from).to_vec(), rows: Vec::new() };
    let mut mismatches = Vec::new();
    let mut seen = Vec::new();
    // The process groups' size (the one-process baseline, with no model-state accounting, aside).
    let ranks_all: Vec<&str> =
        mem.rows.iter().filter(|r| mem.get(r, "level") != Some("baseline")).filter_map(|r| mem.get(r, "ranks")).collect();
    for r in mem.rows.iter().filter(|r| mem.get(r, "precision") == Some("fp32")) {
        let (strategy, width, ranks) =
            (mem.get(r, "strategy").unwrap_or("?"), mem.get(r, "fc1").unwrap_or("?"), mem.get(r, "ranks").unwrap_or("?"));
        if seen.contains(&(strategy, width, ranks)) {
            continue;
        }
        seen.push((strategy, width, ranks));
        let (Ok(wv), Ok(w)) = (width.parse::<u64>(), ranks.parse::<u64>()) else { continue };
        let rows = memory::rows(wv, w);
        let scheme = match strategy {
            "ddp" | "fsdp-no-shard" => &rows[0],
            "fsdp-shard-grad-op" => &rows[2],
            "fsdp-full-shard" => &rows[3],
            _ => continue,
        };
        let b = scheme.bytes;
        let arith_parts: Vec<String> = [b.parameters, b.gradients, b.optimizer].into_iter().map(mib1).collect();
        // FULL_SHARD: with the prefetched neighbour (level 1's default) or without (levels 2, 3).
        let gathered = [(mib1(b.gathered), "with prefetch"), (mib1(b.gathered_no_prefetch), "without")];
        let arith_gathered = if b.gathered != b.gathered_no_prefetch {
            format!("{} with prefetch, {} without", gathered[0].0, gathered[1].0)
        } else {
            gathered[0].0.clone()
        };
        let mut row = vec![strategy_label(strategy).to_string(), width.to_string(), arith_parts.join(" / "), arith_gathered];
        for level in ["1", "2", "3"] {
            let Some(x) = mem
                .select(&[("level", level), ("strategy", strategy), ("fc1", width), ("ranks", ranks), ("precision", "fp32")])
                .first()
                .copied()
            else {
                row.push("—".into());
                continue;
            };
            let parts: Vec<String> = [PARAMS, GRADS, OPTIM].iter().map(|c| mem.get(x, c).unwrap_or("—").to_string()).collect();
            let g = mem.get(x, GATHERED).unwrap_or("—").to_string();
            let which = gathered.iter().find(|(v, _)| *v == g).map(|(_, how)| *how);
            let state = if parts == arith_parts { "equal".to_string() } else { parts.join(" / ") };
            if parts != arith_parts {
                mismatches.push(format!(
                    "level {level} {} fc1 {width}: {} against {}",
                    strategy_label(strategy),
                    parts.join(" / "),
                    arith_parts.join(" / ")
                ));
            }
            match which {
                Some(how) if b.gathered != b.gathered_no_prefetch => row.push(format!("{state}, {g} ({how})")),
                Some(_) => row.push(format!("{state}, {g}")),
                None => {
                    mismatches.push(format!("level {level} {} fc1 {width}: gathered {g}", strategy_label(strategy)));
                    row.push(format!("{state}, {g}"));
                }
            }
        }
        out.rows.push(row);
    }
    let verdict = if mismatches.is_empty() {
        ALL_EQUAL.to_string()
    } else {
        format!("These measured figures differ from the arithmetic: {}.", mismatches.join("; "))
    };
    let ranks = ranks_all.first().copied().unwrap_or("?");
    Ok(format!("{}\nRank 0 at {ranks} ranks, fp32:\n\n{}\n{verdict}\n", caption(&m.run.line), out.markdown()))
}

/// The columns of [`model_state`]'s table.
const MODEL_STATE_HEADER: [&str; 7] = [
    "strategy",
    "fc1",
    "arithmetic: parameters / gradients / AdamW, MiB",
    "arithmetic: gathered, MiB",
    "measured: level 1",
    "level 2",
    "level 3",
];

/// [`model_state`]'s verdict when every measured figure equals the arithmetic.
const ALL_EQUAL: &str = "Every measured figure equals the arithmetic at the printed digit: parameters, gradients and \
    AdamW state one by one, and the gathered peak — for FULL_SHARD the largest unit with the unit prefetched beside it at \
    level 1 (which prefetches by default, as PyTorch's FSDP does) and the largest unit alone at levels 2 and 3 (which do \
    not, as Accelerate's and Transformers' defaults).";

/// The peak RSS of each rank at the widest width, every level and strategy, fp32.
fn rss_per_rank(m: &Matrix) -> Result<String> {
    let mem = m.memory.as_ref().ok_or_else(|| m.missing("Memory", "the table itself"))?;
    let widest = m.values("fc1").into_iter().max_by_key(|w| w.parse::<u64>().unwrap_or(0)).unwrap_or_default();
    let mut out = Table {
        header: ["level", "strategy", "rank 0, MiB", "rank 1, MiB", "rank 0 − rank 1"].map(String::from).to_vec(),
        rows: Vec::new(),
    };
    for r in mem.select(&[("fc1", &widest), ("precision", "fp32")]) {
        let ranks = mem.get(r, TRAIN_RSS).map(numbers).unwrap_or_default();
        if ranks.len() < 2 {
            continue;
        }
        out.rows.push(vec![
            mem.get(r, "level").unwrap_or("?").into(),
            strategy_label(mem.get(r, "strategy").unwrap_or("?")).into(),
            format!("{:.0}", ranks[0]),
            format!("{:.0}", ranks[1]),
            format!("{:+.0}", ranks[0] - ranks[1]),
        ]);
    }
    let same = mem.col(TRAIN_RSS).zip(mem.col(WHOLE_RSS)).map(|(a, b)| mem.rows.iter().filter(|r| r[a] == r[b]).count());
    let rows = mem.rows.len();
    let note = match same {
        Some(n) if n == rows => format!(
            "In all {rows} of the run's memory rows the training-phase peak equals the whole-process peak: nothing \
             before the steps (loading MNIST, building and wrapping the model) or after them (the evaluation, level 3's \
             end-of-training checkpoint) rises above what the steps reach, so the process's high-water mark is the \
             steps'."
        ),
        Some(n) => format!(
            "In {n} of the run's {rows} memory rows the training-phase peak equals the whole-process peak; in the other \
             {} the process rose higher outside the steps — before them (loading MNIST, building and wrapping the \
             model) or after them (the evaluation, level 3's end-of-training checkpoint), which the training-phase \
             figure leaves out.",
            rows - n
        ),
        None => String::new(),
    };
    Ok(format!("{}\n**fc1 {widest}, fp32**, training-phase peak RSS:\n\n{}\n{note}\n", caption(&m.run.line), out.markdown()))
}

/// `demo.md` without its title (a chapter's heading would otherwise come from an included
/// file), with the run's caption.
fn demo_table(run: &Run) -> String {
    let demo = run.bench_file.with_file_name("demo.md");
    match std::fs::read_to_string(&demo) {
        Ok(text) => {
            let body = crate::provenance::demo_block("", &text);
            format!("{}\n{}\n", caption(&run.line), body.trim())
        }
        Err(_) => format!("{}\nThe reference run has no demo table.\n", caption(&run.line)),
    }
}

/// A note for the demo table when its "user code lines" (counted by the run) are not what the
/// `user_code` spans count now (`current`: one count per level, in the table's row order): the
/// code changed after the run. `None` when they agree or the table has no such column.
pub fn line_count_note(demo_md: &str, current: &[usize]) -> Option<String> {
    let t = Table::all(demo_md).into_iter().find(|t| t.col("user code lines").is_some())?;
    let c = t.col("user code lines")?;
    let measured: Vec<String> = t.rows.iter().map(|r| r[c].trim().to_string()).collect();
    let now: Vec<String> = current.iter().map(usize::to_string).collect();
    if measured == now {
        return None;
    }
    Some(format!(
        "\n*The user code has changed since this run: its spans count {} lines now (levels 1, 2, 3; \
         `book-check generate` counts them), against {} in the table. The next `make book-data` \
         measures the code as it is.*\n",
        now.join(", "),
        measured.join(", ")
    ))
}

/// Every file this module generates from `run`, as (file name in `book/src/generated/`, text).
///
/// # Errors
/// [`Error::Input`] naming the bench's Markdown and the section or column a table needs.
pub fn generated(run: &Run) -> Result<Vec<(String, String)>> {
    let m = Matrix::read(run)?;
    let mut out = vec![
        ("q-peers.md".to_string(), peers(&m)?),
        ("q-levels.md".to_string(), levels(&m)?),
        ("q-sharding.md".to_string(), sharding(&m)?),
        ("q-bf16.md".to_string(), bf16(&m)?),
        ("q-model-state.md".to_string(), model_state(&m)?),
        ("q-rss-per-rank.md".to_string(), rss_per_rank(&m)?),
        ("measurements-full.md".to_string(), full::full_tables(run)),
    ];
    if let Some(a) = network::allreduce(run) {
        out.push(("q-allreduce.md".to_string(), a));
    }
    if let Some(t) = network::two_hosts(&m)? {
        out.push(("q-two-hosts.md".to_string(), t));
    }
    out.push(("demo-table.md".to_string(), demo_table(run)));
    out.push(("plot-throughput.svg".to_string(), crate::plots::throughput(&m.throughput, &run.line)?));
    if let Some(mem) = &m.memory {
        out.push(("plot-memory.svg".to_string(), crate::plots::memory(mem, &run.line)?));
    }
    Ok(out)
}

/// Reads the "Will it fit?" sweep from `generated_dir` (`fit-provenance.md`, `fit.md`); `None`
/// when it has not been made.
///
/// # Errors
/// An unreadable file; a provenance table without the rows its line needs.
pub fn load_fit(generated_dir: &Path) -> Result<Option<fit::FitRun>> {
    let file = generated_dir.join("fit.md");
    if !file.exists() {
        return Ok(None);
    }
    let prov_file = generated_dir.join("fit-provenance.md");
    let prov = std::fs::read_to_string(&prov_file).map_err(|e| Error::io(&prov_file, e))?;
    let bench = std::fs::read_to_string(&file).map_err(|e| Error::io(&file, e))?;
    Ok(Some(fit::FitRun { line: crate::provenance::line(&prov, &prov_file)?, bench, file }))
}

/// Reads the run from `generated_dir` (`provenance.md`, `bench.md`); `None` when the run has
/// not been made (no `bench.md`).
///
/// # Errors
/// An unreadable file; a provenance table without the rows its line needs.
pub fn load(generated_dir: &Path) -> Result<Option<Run>> {
    let bench_file = generated_dir.join("bench.md");
    if !bench_file.exists() {
        return Ok(None);
    }
    let prov_file = generated_dir.join("provenance.md");
    let prov = std::fs::read_to_string(&prov_file).map_err(|e| Error::io(&prov_file, e))?;
    let bench = std::fs::read_to_string(&bench_file).map_err(|e| Error::io(&bench_file, e))?;
    let cluster = std::fs::read_to_string(generated_dir.join("cluster.md")).ok();
    Ok(Some(Run { line: crate::provenance::line(&prov, &prov_file)?, bench, bench_file, cluster }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_demo_table_counting_other_code_gets_a_note() {
        let demo = "| level | user code lines | wall s |\n|---|---:|---:|\n| 1 | 99 | 2 |\n| 2 | 71 | 2 |\n| 3 | 38 | 2 |\n";
        assert_eq!(line_count_note(demo, &[99, 71, 38]), None);
        let note = line_count_note(demo, &[60, 83, 38]).unwrap();
        assert!(note.contains("count 60, 83, 38 lines now") && note.contains("against 99, 71, 38"), "{note}");
        assert_eq!(line_count_note("no table", &[1]), None);
    }

    #[test]
    fn captions_name_date_and_commit() {
        let c = caption("Measured by `make book-data` on 2026-12-01T19:40:22Z, AMD EPYC, 2 cores (commit `7573123`); figures vary.");
        assert!(c.contains("Reference run of 2026-12-01, commit `7573123`"), "{c}");
    }
}
