//! "Will it fit?": the memory sweep of `make book-data` (`generated/fit.md`, a `bench run` over
//! strategy × fc1 width × batch size at 2 ranks, with its own provenance in
//! `generated/fit-provenance.md`), as one table per width — each strategy's measured
//! training-phase RSS growth per rank beside the estimator's, and its samples/s.

use super::{caption, max_of, strategy_label, Error, Result};
use crate::tables::{number, Table};
use std::path::PathBuf;

/// The sweep's inputs: its provenance line and the bench's Markdown.
#[derive(Debug, Clone)]
pub struct FitRun {
    /// The provenance line of the sweep (`fit-provenance.md`).
    pub line: String,
    /// The bench's Markdown of the sweep.
    pub bench: String,
    /// Where it was read (for messages).
    pub file: PathBuf,
}

/// The batch size a precision cell names (`fp32 batch 512` → 512; `fp32` → the bench's 64).
fn batch_of(precision: &str) -> u64 {
    precision.split_once("batch ").and_then(|(_, b)| b.split_whitespace().next()?.parse().ok()).unwrap_or(64)
}

const GROWTH: &str = "training-phase growth per rank MiB";
const ESTIMATE: &str = "estimated growth MiB";

/// `q-fit.md`: per fc1 width, a row per batch size and a column per strategy, each cell the
/// largest rank's measured training-phase growth, the estimate and the samples/s:
/// `612 (est. 598) · 140/s`.
///
/// # Errors
/// [`Error::Input`] naming the file when its Memory table lacks the growth or estimate column.
pub fn fit_tables(run: &FitRun) -> Result<String> {
    let missing = |what: &str| Error::Input { file: run.file.clone(), problem: format!("the fit sweep has no {what}") };
    let mem = Table::in_section(&run.bench, "Memory").ok_or_else(|| missing("`## Memory` table"))?;
    let speed = Table::in_section(&run.bench, "Throughput");
    for col in [GROWTH, ESTIMATE, "strategy", "fc1", "precision"] {
        mem.col(col).ok_or_else(|| missing(&format!("`{col}` column in its Memory table")))?;
    }
    let get = |r: &[String], c: &str| mem.get(r, c).unwrap_or("").to_string();
    let mut strategies: Vec<String> = Vec::new();
    let mut widths: Vec<u64> = Vec::new();
    for r in &mem.rows {
        let s = get(r, "strategy");
        if !strategies.contains(&s) {
            strategies.push(s);
        }
        let w = get(r, "fc1").parse().unwrap_or(0);
        if !widths.contains(&w) {
            widths.push(w);
        }
    }
    let samples = |r: &[String]| {
        let t = speed.as_ref()?;
        let key =
            |t: &Table, r: &[String]| ["level", "strategy", "ranks", "fc1", "precision"].map(|k| t.get(r, k).unwrap_or("").to_string());
        let twin = t.rows.iter().find(|o| key(t, o) == key(&mem, r))?;
        let c = t.col("samples/s").or_else(|| t.col_starting("samples/s"))?;
        twin.get(c).and_then(|v| number(v))
    };
    let mut out = format!("{}\n", caption(&run.line));
    // The bench's own load warnings (a loaded machine's samples/s mean little; memory holds).
    for w in run.bench.lines().filter(|l| l.starts_with("> warning: load average")) {
        out.push_str(&format!("\n{w} — the memory figures hold; the samples/s do not.\n"));
    }
    for w in widths {
        let rows: Vec<&Vec<String>> = mem.rows.iter().filter(|r| get(r, "fc1") == w.to_string()).collect();
        let mut batches: Vec<u64> = rows.iter().map(|r| batch_of(&get(r, "precision"))).collect();
        batches.sort_unstable();
        batches.dedup();
        let mut header = vec!["batch per rank".to_string()];
        header.extend(strategies.iter().map(|s| strategy_label(s).to_string()));
        let mut t = Table { header, rows: Vec::new() };
        for b in batches {
            let mut row = vec![b.to_string()];
            for s in &strategies {
                let cell = rows.iter().find(|r| &get(r, "strategy") == s && batch_of(&get(r, "precision")) == b);
                row.push(cell.map_or("—".into(), |r| {
                    let grown = max_of(&get(r, GROWTH)).map_or("—".into(), |g| format!("{g:.0}"));
                    let est = number(&get(r, ESTIMATE)).map_or("—".into(), |e| format!("{e:.0}"));
                    let sps = samples(r).map_or(String::new(), |s| format!(" · {s:.0}/s"));
                    format!("{grown} (est. {est}){sps}")
                }));
            }
            t.rows.push(row);
        }
        out.push_str(&format!("\n**fc1 {w}**, training-phase RSS growth per rank, MiB (estimate), samples/s:\n\n{}", t.markdown()));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sweep_becomes_one_table_per_width() {
        let bench =
            "## Throughput\n\n| level | strategy | ranks | fc1 | precision | samples/s (median, min–max) |\n|---|---|---|---|---|---|\n\
            | 1 | ddp | 2 | 4096 | fp32 | 120 |\n| 1 | ddp | 2 | 4096 | fp32 batch 512 | 90 |\n| 1 | zero1 | 2 | 4096 | fp32 | 110 |\n\n\
            ## Memory\n\n| level | strategy | ranks | fc1 | precision | training-phase growth per rank MiB | estimated growth MiB |\n\
            |---|---|---|---|---|---|---|\n| 1 | ddp | 2 | 4096 | fp32 | 600 / 612 | 598 |\n\
            | 1 | ddp | 2 | 4096 | fp32 batch 512 | 900 / 880 | 950 |\n| 1 | zero1 | 2 | 4096 | fp32 | 480 / 470 | 455 |\n";
        let run = FitRun {
            line: "Measured by `make book-data` on 2026-12-02T18:00:00Z, AMD EPYC, 2 cores (commit `abc1234`); figures vary.".into(),
            bench: bench.into(),
            file: "fit.md".into(),
        };
        let text = fit_tables(&run).unwrap();
        assert!(!text.contains("warning"), "{text}");
        let loaded = FitRun {
            bench: format!("# b\n\n> warning: load average 7.5 on 2 cores at the start of the run: …\n\n{bench}"),
            ..run.clone()
        };
        assert!(fit_tables(&loaded).unwrap().contains(
            "\n> warning: load average 7.5 on 2 cores at the start of the run: … — the memory figures hold; the samples/s do not.\n"
        ));
        assert!(text.contains("Reference run of 2026-12-02, commit `abc1234`"), "{text}");
        assert!(text.contains("| batch per rank | DDP | ZeRO-1 |"), "{text}");
        assert!(text.contains("| 64 | 612 (est. 598) · 120/s | 480 (est. 455) · 110/s |"), "{text}");
        assert!(text.contains("| 512 | 900 (est. 950) · 90/s | — |"), "{text}");
        let err = fit_tables(&FitRun { bench: "## Memory\n\n| strategy |\n|---|\n| ddp |\n".into(), ..run }).unwrap_err().to_string();
        assert!(err.contains("fit.md") && err.contains(GROWTH), "{err}");
    }
}
