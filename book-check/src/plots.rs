//! The book's two plots (plotters, SVG), from the bench's tables of the reference run: bars,
//! one per run that was made, each labelled with its value — no axis implies a world size that
//! was not run.

use crate::error::{Error, Result};
use crate::tables::{number, numbers, Table};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

const STRATEGY_COLOURS: [(&str, RGBColor); 6] = [
    ("single", RGBColor(140, 86, 75)),
    ("zero1", RGBColor(23, 190, 207)),
    ("ddp", RGBColor(31, 119, 180)),
    ("fsdp-full-shard", RGBColor(230, 120, 20)),
    ("fsdp-shard-grad-op", RGBColor(44, 160, 44)),
    ("fsdp-no-shard", RGBColor(148, 103, 189)),
];
const PEER_COLOUR: RGBColor = RGBColor(150, 150, 150);
/// The tuned PyTorch peer's bars: darker than the tutorial peers'.
const TUNED_COLOUR: RGBColor = RGBColor(90, 90, 90);
const KIND_COLOURS: [RGBColor; 5] =
    [RGBColor(31, 119, 180), RGBColor(100, 170, 230), RGBColor(44, 160, 44), RGBColor(230, 120, 20), RGBColor(205, 205, 205)];
const FONT: &str = "sans-serif";

fn plot_error(e: impl std::fmt::Display) -> Error {
    Error::Input { file: "plot".into(), problem: format!("plotting: {e}") }
}

/// `1 rank`, `2 ranks`.
pub(crate) fn ranks_label(ranks: &str) -> String {
    if ranks == "1" {
        "1 rank".into()
    } else {
        format!("{ranks} ranks")
    }
}

fn colour_of(strategy: &str) -> RGBColor {
    STRATEGY_COLOURS.iter().find(|(s, _)| *s == strategy).map_or(RGBColor(120, 120, 120), |(_, c)| *c)
}

fn short(strategy: &str) -> &str {
    match strategy {
        "ddp" => "DDP",
        "fsdp-full-shard" => "FULL_SHARD",
        "fsdp-shard-grad-op" => "SHARD_GRAD_OP",
        "fsdp-no-shard" => "NO_SHARD",
        s => s,
    }
}

/// One horizontal bar: its label, its stacked parts (value, colour) and the text at its end.
struct Bar {
    label: String,
    parts: Vec<(f64, RGBColor)>,
    value: String,
}

/// Horizontal bars, top to bottom, with a title, an x-axis description and a legend drawn
/// below the chart.
fn bars(title: &str, x_desc: &str, bars: &[Bar], legend: &[(String, RGBColor)]) -> Result<String> {
    let n = bars.len();
    let (width, row, top, legend_h) = (820u32, 34u32, 60u32, if legend.is_empty() { 0 } else { 40 });
    let height = top + row * n as u32 + 60 + legend_h;
    let x_max = bars.iter().map(|b| b.parts.iter().map(|p| p.0).sum::<f64>()).fold(1.0, f64::max) * 1.22;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (width, height)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_error)?;
        let (chart_area, legend_area) = root.split_vertically(height - legend_h);
        let mut chart = ChartBuilder::on(&chart_area)
            .caption(title, (FONT, 19))
            .margin(12)
            .margin_right(24)
            .x_label_area_size(44)
            .y_label_area_size(230)
            .build_cartesian_2d(0.0..x_max, 0.0..n as f64)
            .map_err(plot_error)?;
        chart
            .configure_mesh()
            .disable_y_mesh()
            .y_labels(0)
            .x_desc(x_desc)
            .axis_desc_style((FONT, 16))
            .label_style((FONT, 15))
            .x_label_formatter(&|x| format!("{x:.0}"))
            .draw()
            .map_err(plot_error)?;
        let label_style = TextStyle::from((FONT, 15).into_font()).pos(Pos::new(HPos::Right, VPos::Center));
        let value_style = TextStyle::from((FONT, 15).into_font()).pos(Pos::new(HPos::Left, VPos::Center));
        for (k, b) in bars.iter().enumerate() {
            let y = (n - 1 - k) as f64; // the first bar on top
            let mut x0 = 0.0;
            for &(v, colour) in &b.parts {
                chart
                    .draw_series(std::iter::once(Rectangle::new([(x0, y + 0.14), (x0 + v, y + 0.86)], colour.filled())))
                    .map_err(plot_error)?;
                x0 += v;
            }
            chart
                .draw_series(std::iter::once(Text::new(format!(" {}", b.value), (x0, y + 0.5), value_style.clone())))
                .map_err(plot_error)?;
            // The bar's name left of the axis, on the whole area (the plotting area clips).
            let (px, py) = chart.backend_coord(&(0.0, y + 0.5));
            root.draw(&Text::new(b.label.clone(), (px - 8, py), label_style.clone())).map_err(plot_error)?;
        }
        let mut x = 20i32;
        for (name, colour) in legend {
            legend_area.draw(&Rectangle::new([(x, 12), (x + 16, 28)], colour.filled())).map_err(plot_error)?;
            legend_area.draw(&Text::new(name.clone(), (x + 22, 13), (FONT, 15))).map_err(plot_error)?;
            // At 15 px, capitals and `_` are ~10 px wide, the rest ~8 (FULL_SHARD's name ran
            // into the next swatch at 8 for all).
            x += 30 + name.chars().map(|c| if c.is_ascii_uppercase() || c == '_' { 10 } else { 8 }).sum::<i32>();
        }
        root.present().map_err(plot_error)?;
    }
    Ok(svg + "\n")
}

/// Training samples/s of every level and strategy at the tutorial's width in fp32, with each
/// level's PyTorch peer and the tuned PyTorch peer (once per world size), one bar per run made
/// (the world sizes in the labels).
///
/// # Errors
/// A plotting failure.
pub fn throughput(t: &Table, _line: &str) -> Result<String> {
    let widths: Vec<u64> = t.rows.iter().filter_map(|r| t.get(r, "fc1").and_then(|w| w.parse().ok())).collect();
    let width = widths.iter().copied().min().unwrap_or(128).to_string();
    let precision = if t.rows.iter().any(|r| t.get(r, "precision") == Some("fp32")) { "fp32" } else { "bf16" };
    let samples = t.col_starting("samples/s");
    let mut out = Vec::new();
    let mut ranks_seen: Vec<String> = Vec::new();
    let mut levels: Vec<String> = Vec::new();
    for r in t.select(&[("fc1", &width), ("precision", precision)]) {
        let level = t.get(r, "level").unwrap_or("?").to_string();
        if !levels.contains(&level) {
            levels.push(level);
        }
    }
    for level in &levels {
        let rows = t.select(&[("level", level), ("fc1", &width), ("precision", precision)]);
        for r in &rows {
            let (strategy, ranks) = (t.get(r, "strategy").unwrap_or("?"), t.get(r, "ranks").unwrap_or("?"));
            if !ranks_seen.iter().any(|x| x == ranks) {
                ranks_seen.push(ranks.to_string());
            }
            if let Some(v) = samples.and_then(|c| number(&r[c])) {
                // The one-process baseline is no level: `baseline · single · 1 rank`.
                let name = if level == "baseline" { level.clone() } else { format!("level {level}") };
                out.push(Bar {
                    label: format!("{name} · {} · {}", short(strategy), ranks_label(ranks)),
                    parts: vec![(v, colour_of(strategy))],
                    value: format!("{v:.0}"),
                });
            }
        }
        for r in &rows {
            let (peer, ranks) = (t.get(r, "peer").unwrap_or("—"), t.get(r, "ranks").unwrap_or("?"));
            if let Some(v) = t.get(r, "peer samples/s").and_then(number).filter(|_| peer != "—") {
                out.push(Bar {
                    label: format!("{peer} · {}", ranks_label(ranks)),
                    parts: vec![(v, PEER_COLOUR)],
                    value: format!("{v:.0}"),
                });
            }
        }
    }
    // The tuned peer (bench/reference/tuned.py) is one loop for every level: one bar per world
    // size, after the levels.
    let mut tuned_ranks: Vec<String> = Vec::new();
    for r in t.select(&[("fc1", &width), ("precision", precision)]) {
        let ranks = t.get(r, "ranks").unwrap_or("?");
        if let Some(v) = t.get(r, "tuned peer samples/s").and_then(number).filter(|_| !tuned_ranks.iter().any(|x| x == ranks)) {
            tuned_ranks.push(ranks.to_string());
            out.push(Bar {
                label: format!("PyTorch tuned · {}", ranks_label(ranks)),
                parts: vec![(v, TUNED_COLOUR)],
                value: format!("{v:.0}"),
            });
        }
    }
    let mut legend: Vec<(String, RGBColor)> = Vec::new();
    for r in t.select(&[("fc1", &width), ("precision", precision)]) {
        let s = t.get(r, "strategy").unwrap_or("?");
        if !legend.iter().any(|(n, _)| n == short(s)) {
            legend.push((short(s).to_string(), colour_of(s)));
        }
    }
    legend.push(("PyTorch peer".into(), PEER_COLOUR));
    if !tuned_ranks.is_empty() {
        legend.push(("PyTorch tuned".into(), TUNED_COLOUR));
    }
    let title = format!("Training samples/s, fc1 {width}, {precision}, at {} ranks (the world sizes run)", ranks_seen.join(", "));
    bars(&title, "samples/s over all ranks (higher is better)", &out, &legend)
}

/// Rank 0's memory at level 1 in fp32, at each width, per strategy: the model state by kind,
/// the gathered peak, and the rest of the training phase's peak RSS.
///
/// # Errors
/// A plotting failure.
pub fn memory(m: &Table, _line: &str) -> Result<String> {
    let get = |r: &[String], c: &str| m.get(r, c).and_then(number).unwrap_or(0.0);
    let mut out = Vec::new();
    let rows = m.select(&[("level", "1"), ("precision", "fp32")]);
    // The plotted rows' world size (the table's first row is the single-process baseline's).
    let ranks = rows.first().and_then(|r| m.get(r, "ranks")).unwrap_or("?").to_string();
    for r in rows {
        let parts = ["parameters MiB", "gradients MiB", "optimizer MiB", "gathered peak MiB"].map(|c| get(r, c));
        let rss = m.get(r, "training-phase peak RSS per rank MiB").map(numbers).and_then(|v| v.first().copied()).unwrap_or(0.0);
        let rest = (rss - parts.iter().sum::<f64>()).max(0.0);
        let mut stacked: Vec<(f64, RGBColor)> = parts.iter().copied().zip(KIND_COLOURS).collect();
        stacked.push((rest, KIND_COLOURS[4]));
        out.push(Bar {
            label: format!("fc1 {} · {}", m.get(r, "fc1").unwrap_or("?"), short(m.get(r, "strategy").unwrap_or("?"))),
            parts: stacked,
            value: format!("{rss:.0} MiB"),
        });
    }
    out.sort_by_key(|b| b.label.starts_with("fc1 4096"));
    let legend = ["parameters", "gradients", "AdamW state", "gathered", "rest of peak RSS"]
        .iter()
        .zip(KIND_COLOURS)
        .map(|(n, c)| (n.to_string(), c))
        .collect::<Vec<_>>();
    bars(&format!("Rank 0's memory, level 1, fp32, {ranks} ranks: model state and peak RSS"), "MiB", &out, &legend)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The baseline at 1 rank and two levels at 2 ranks with their peers and the tuned peer, one
    /// width-4096 row: one bar per run and per tutorial peer, the tuned peer once per world size,
    /// nothing at width 4096.
    #[test]
    fn throughput_has_each_level_its_peer_and_the_tuned_peer_once() {
        let md = "\
| level | strategy | ranks | fc1 | precision | samples/s (median, min–max) | peer | peer samples/s | tuned peer samples/s |
|---|---|---|---|---|---|---|---|---|
| baseline | single | 1 | 128 | fp32 | 2683 | PyTorch tutorial | 1288 | 1409 |
| 1 | ddp | 2 | 128 | fp32 | 2586 | PyTorch DDP | 1290 | 1372 |
| 2 | ddp | 2 | 128 | fp32 | 2113 | HF Accelerate | 1196 | 1372 |
| 1 | ddp | 2 | 4096 | fp32 | 100 | PyTorch DDP | 50 | 60 |
";
        let t = Table::all(md).remove(0);
        let svg = throughput(&t, "").unwrap();
        let count = |s: &str| svg.matches(s).count();
        assert_eq!((count("level 1 · "), count("level 2 · ")), (1, 1), "one bar per level");
        assert_eq!((count("PyTorch DDP · 2 ranks"), count("HF Accelerate · 2 ranks")), (1, 1));
        assert_eq!(count("PyTorch tuned · 2 ranks"), 1, "the tuned peer once");
        let text_lines = |s: &str| svg.lines().filter(|l| l.trim() == s).count();
        assert_eq!(
            (text_lines("baseline · single · 1 rank"), text_lines("PyTorch tutorial · 1 rank"), text_lines("PyTorch tuned · 1 rank")),
            (1, 1, 1)
        );
        assert_eq!((text_lines("1372"), text_lines("60")), (1, 0), "its value, width 128 only");
        assert_eq!(count("PyTorch tuned"), 3, "its two bars and its legend entry");
    }
}
