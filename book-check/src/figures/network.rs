//! The figures about the network: the all-reduce bandwidth of the reference run, and what two
//! hosts would reach with today's step and the two-host run's TCP bandwidth.

use super::{caption, thousands, Matrix, Run};
use crate::error::Result;
use crate::memory;
use crate::tables::{self, number, Table};

/// The all-reduce table, four columns.
pub(super) fn allreduce(run: &Run) -> Option<String> {
    let sec = tables::section(&run.bench, "All-reduce")?;
    let t = Table::all(sec).into_iter().next()?;
    let pick = ["bytes", "ours busbw GB/s", "raw rsmpi busbw GB/s", "ours / raw"];
    let cols: Vec<usize> = pick.iter().filter_map(|c| t.col(c)).collect();
    if cols.len() != pick.len() {
        return None;
    }
    let small = Table {
        header: pick.map(String::from).to_vec(),
        rows: t.rows.iter().map(|r| cols.iter().map(|&c| r[c].clone()).collect()).collect(),
    };
    let title =
        run.bench.lines().find(|l| l.starts_with("## All-reduce")).map(|l| l.trim_start_matches("## ").to_string()).unwrap_or_default();
    Some(format!("{}\n**{title}**\n\n{}", caption(&run.line), small.markdown()))
}

/// What two hosts would reach today: the reference run's DDP step at the tutorial's width, with
/// its all-reduce replaced by one of the gradients at the TCP bandwidth the two-host run
/// measured (`generated/cluster.md`). `None` without a two-host run.
pub(super) fn two_hosts(m: &Matrix) -> Result<Option<String>> {
    let Some(cluster) = &m.run.cluster else { return Ok(None) };
    let Some(bw) = Table::all(cluster).into_iter().find(|t| t.header.first().map(String::as_str) == Some("bytes")) else {
        return Ok(None);
    };
    let Some(tcp) = bw.rows.iter().find(|r| r[0].contains("TCP")) else { return Ok(None) };
    let Some(col) = bw.col("4 MiB") else { return Ok(None) };
    let Some(busbw) = number(&tcp[col]) else { return Ok(None) };
    let steps = m.steps.as_ref().ok_or_else(|| m.missing("Steps", "the table itself"))?;
    let Some(r) = steps.select(&[("level", "1"), ("strategy", "ddp"), ("fc1", "128"), ("precision", "fp32")]).first().copied() else {
        return Ok(None);
    };
    let (Some(step), Some(comm)) = (steps.get(r, "step p50 ms").and_then(number), steps.get(r, "comm ms").and_then(number)) else {
        return Err(m.missing("Steps", "step p50 ms` or `comm ms"));
    };
    let ranks: f64 = steps.get(r, "ranks").and_then(number).unwrap_or(2.0);
    let bytes = 4 * memory::num_parameters(128);
    // algbw = busbw · n / (2(n − 1)); the all-reduce takes bytes / algbw.
    let algbw = busbw * ranks / (2.0 * (ranks - 1.0)).max(1.0);
    let tcp_ms = bytes as f64 / (algbw * 1e9) * 1e3;
    let ratio = step / (step - comm + tcp_ms);
    let source = cluster.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
    // The two-host run's date, from its caption (`…, 2026-11-30 (…`).
    let date = source
        .split(|c: char| c == ',' || c == '(' || c.is_whitespace())
        .find(|w| w.len() == 10 && w.as_bytes()[4] == b'-' && w.as_bytes()[7] == b'-' && w[..4].parse::<u32>().is_ok())
        .unwrap_or("an earlier date");
    Ok(Some(format!(
        "{}\nToday's level-1 DDP step at the tutorial's width takes {step:.1} ms at {ranks:.0} ranks on one host, {comm:.2} ms of \
         it in the gradient all-reduce (the reference run). The two-host run measured {busbw:.2} GB/s of bus bandwidth over TCP \
         at 4 MiB; at that rate the {} bytes of BasicNet's gradients take about {tcp_ms:.0} ms, so a step across two hosts would \
         take about {:.0} ms and two hosts would reach about **{ratio:.2}×** the samples/s of one (an estimate from the two runs, \
         not a measurement; the two-host run is of {date}).\n",
        caption(&m.run.line),
        thousands(bytes),
        step - comm + tcp_ms
    )))
}
