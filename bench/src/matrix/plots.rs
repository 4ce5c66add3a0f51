//! SVG plots of a matrix run (plotters): samples/s against world size per level and strategy,
//! with PyTorch's DDP beside them; and memory per rank, stacked as parameters / gradients /
//! optimizer / gathered / the rest of the peak RSS.

use super::{MatrixSummary, Row};
use crate::error::{Error, Result};
use ladder_core::parallel::Precision;
use plotters::prelude::*;
use std::path::Path;

const MIB: f64 = 1024.0 * 1024.0;
const PALETTE: [RGBColor; 9] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
];

fn plot_error(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::Io { path: path.to_path_buf(), source: std::io::Error::other(format!("plotting: {e}")) }
}

/// Writes `throughput.svg` and `memory.svg` into `dir`; returns the files written (a plot with
/// nothing to show is not written).
///
/// # Errors
/// [`Error::Io`] naming the SVG file.
pub fn write_plots(summary: &MatrixSummary, dir: &Path) -> Result<Vec<std::path::PathBuf>> {
    let mut written = Vec::new();
    let t = dir.join("throughput.svg");
    if throughput(summary, &t)? {
        written.push(t);
    }
    let m = dir.join("memory.svg");
    if memory(summary, &m)? {
        written.push(m);
    }
    Ok(written)
}

/// samples/s (median) against world size: one line per level × strategy at fc1 128 in fp32, and
/// one for PyTorch DDP over gloo.
fn throughput(summary: &MatrixSummary, path: &Path) -> Result<bool> {
    // The cells without options: another batch size, checkpointing or offload is another line.
    let base = |r: &&Row| r.case.width == 128 && r.case.precision == Precision::No && r.case.level.is_some() && r.case.without_options();
    let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    let mut push = |name: String, x: f64, y: f64| match series.iter_mut().find(|(n, _)| *n == name) {
        Some((_, pts)) => pts.push((x, y)),
        None => series.push((name, vec![(x, y)])),
    };
    let mut peer_done = Vec::new();
    for r in summary.rows.iter().filter(base) {
        let ws = r.case.world_size as f64;
        if let Some(s) = r.samples_per_s {
            push(format!("level {} {}", r.case.level.unwrap_or(0), r.case.strategy.name()), ws, s.median);
        }
        if let Some(p) = r.peer_samples_per_s.filter(|_| r.case.strategy.is_ddp()) {
            if !peer_done.contains(&r.case.world_size) {
                peer_done.push(r.case.world_size);
                push("PyTorch DDP (gloo)".into(), ws, p.median);
            }
        }
    }
    series.retain(|(_, pts)| !pts.is_empty());
    if series.is_empty() {
        return Ok(false);
    }
    for (_, pts) in &mut series {
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    let x_max = series.iter().flat_map(|(_, p)| p.iter().map(|q| q.0)).fold(1.0, f64::max);
    let y_max = series.iter().flat_map(|(_, p)| p.iter().map(|q| q.1)).fold(1.0, f64::max) * 1.15;
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    let e = |e: &dyn std::fmt::Display| plot_error(path, e);
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("BasicNet training throughput (fc1 128, fp32) — {}", summary.machine.cpu), ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.5..x_max + 0.5, 0.0..y_max)
        .map_err(|x| e(&x))?;
    chart
        .configure_mesh()
        .x_desc("world size (ranks)")
        .y_desc("samples/s, all ranks")
        .x_labels(x_max as usize + 1)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .draw()
        .map_err(|x| e(&x))?;
    for (i, (name, pts)) in series.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))
            .map_err(|x| e(&x))?
            .label(name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        chart.draw_series(pts.iter().map(|&p| Circle::new(p, 4, color.filled()))).map_err(|x| e(&x))?;
    }
    chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw().map_err(|x| e(&x))?;
    root.present().map_err(|x| e(&x))?;
    Ok(true)
}

/// One stacked bar per run with model-state figures: rank 0's parameters, gradients, optimizer
/// state, gathered peak, and the rest of its peak RSS, MiB.
fn memory(summary: &MatrixSummary, path: &Path) -> Result<bool> {
    let bars: Vec<(String, [f64; 5])> = summary
        .rows
        .iter()
        .filter_map(|r| {
            let m = r.model_state?;
            let parts = [m.parameters, m.gradients, m.optimizer, m.gathered_peak].map(|b| b as f64 / MIB);
            let rss = r.peak_rss_per_rank.first().copied().unwrap_or(0.0);
            let rest = (rss - parts.iter().sum::<f64>()).max(0.0);
            let c = &r.case;
            // The options too (batch size, checkpointing, offload): twins apart, not one bar.
            let options = super::case::precision_and_options(c);
            let name = format!("L{} {} ×{} fc1 {} {options}", c.level.unwrap_or(0), c.strategy.name(), c.world_size, c.width);
            Some((name, [parts[0], parts[1], parts[2], parts[3], rest]))
        })
        .collect();
    if bars.is_empty() {
        return Ok(false);
    }
    let y_max = bars.iter().map(|(_, p)| p.iter().sum::<f64>()).fold(1.0, f64::max) * 1.1;
    let height = 140 + 26 * bars.len() as u32;
    let root = SVGBackend::new(path, (1000, height)).into_drawing_area();
    let e = |e: &dyn std::fmt::Display| plot_error(path, e);
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let n = bars.len();
    let mut chart = ChartBuilder::on(&root)
        .caption("Memory per rank (rank 0): model state and the rest of the peak RSS", ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(330)
        .build_cartesian_2d(0.0..y_max, (0..n).into_segmented())
        .map_err(|x| e(&x))?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .x_desc("MiB")
        .y_labels(n)
        .y_label_formatter(&|v| match v {
            SegmentValue::CenterOf(i) => bars.get(*i).map(|b| b.0.clone()).unwrap_or_default(),
            _ => String::new(),
        })
        .draw()
        .map_err(|x| e(&x))?;
    let names = ["parameters", "gradients", "optimizer", "gathered peak", "rest of peak RSS"];
    for (k, name) in names.iter().enumerate() {
        let color = PALETTE[k];
        chart
            .draw_series(bars.iter().enumerate().map(|(i, (_, p))| {
                let x0: f64 = p[..k].iter().sum();
                Rectangle::new([(x0, SegmentValue::Exact(i)), (x0 + p[k], SegmentValue::Exact(i + 1))], color.filled())
            }))
            .map_err(|x| e(&x))?
            .label(*name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
    }
    chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw().map_err(|x| e(&x))?;
    root.present().map_err(|x| e(&x))?;
    Ok(true)
}
