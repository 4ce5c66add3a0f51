//! `bench demo` (`make demo`): the levels one after another, each for one epoch on real MNIST at
//! 2 ranks over MPI with DDP (`ladder-run --nproc-per-node 2 <level> --device cpu …`, as torchrun
//! would start it), then ONE comparison table — printed, and written as markdown and JSON.
//!
//! A level that fails (exit code, no report, missing binary) is a row marked FAILED with its
//! error; the other levels still run, and the demo reports failure at the end.

use crate::error::{Error, Result};
use crate::figures::RunFigures;
use crate::machine::Machine;
use crate::{loc, process, require_binary, write_file, Level};
use comfy_table::{presets, CellAlignment, Table};
use ladder_core::parallel::Strategy;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::process::Command;

/// `bench demo`'s options.
#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// Levels to run, comma-separated, in order (e.g. `--levels 1,3`).
    #[arg(long, value_delimiter = ',', default_values_t = [1u8, 2, 3])]
    pub levels: Vec<u8>,
    /// Ranks per level (ladder-run --nproc-per-node).
    #[arg(long, default_value_t = 2)]
    pub nproc_per_node: usize,
    /// Epochs per level.
    #[arg(long, default_value_t = 1)]
    pub epochs: usize,
    /// Stop each level after this many optimizer steps (per rank) — for quick runs and tests.
    #[arg(long)]
    pub max_steps: Option<usize>,
    /// How each level replicates the model (passed as --strategy).
    #[arg(long, value_parser = ladder_core::cli::spelling::<Strategy>(), default_value_t = Strategy::default(), hide_possible_values = true)]
    pub strategy: Strategy,
    /// Seed passed to every level.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Training-loss line every N steps in each level's log.
    #[arg(long, default_value_t = 100)]
    pub log_interval: usize,
    /// Where the table (demo.md, demo.json), the levels' reports and logs go.
    /// Default: `<root>/target/demo`.
    #[arg(long)]
    pub out_dir: Option<PathBuf>,
    /// The workspace, its binaries, the time limit.
    #[command(flatten)]
    pub launch: crate::LaunchArgs,
}

/// Whether a level's run gave figures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// It ran and reported.
    Ok,
    /// It failed; see the row's `error`.
    Failed,
}

/// One level's line of the demo table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DemoRow {
    /// 1, 2 or 3.
    pub level: u8,
    /// `raw DDP`, `Accelerator`, `Trainer`.
    pub title: String,
    /// Lines of user training code between the `user_code` anchors (`None` if not countable).
    pub user_code_lines: Option<usize>,
    /// The file(s) the lines were counted in, relative to the root (comma-separated).
    pub user_code_file: Option<String>,
    /// Why the lines could not be counted.
    pub user_code_error: Option<String>,
    /// `ok` or `failed`.
    pub status: Status,
    /// The run's error when it failed.
    pub error: Option<String>,
    /// The run's figures (defaults when it failed).
    pub figures: RunFigures,
    /// Seconds from launch to exit as the bench measured it (launcher, start-up, training,
    /// evaluation).
    pub wall_s: f64,
    /// The command line.
    pub command: String,
    /// The run's log file.
    pub log: String,
}

/// The demo's result: what `demo.json` holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DemoSummary {
    /// Where it ran.
    pub machine: Machine,
    /// Ranks per level.
    pub nproc_per_node: usize,
    /// One row per level, in the order run.
    pub rows: Vec<DemoRow>,
    /// `--max-steps`, when the runs were capped (their accuracy is then a short run's).
    #[serde(default)]
    pub max_steps: Option<usize>,
}

impl DemoSummary {
    /// Rows that failed.
    pub fn failed(&self) -> Vec<&DemoRow> {
        self.rows.iter().filter(|r| r.status == Status::Failed).collect()
    }
}

/// The table's header, in order.
pub const COLUMNS: [&str; 8] =
    ["level", "user code lines", "test accuracy", "eval samples", "test loss", "wall s", "train samples/s", "peak RSS per rank (MiB)"];

/// Renders the comparison table: comfy-table's UTF-8 look for the terminal (`markdown` false)
/// or a GitHub markdown table (`markdown` true). Failed rows read FAILED, with `—` elsewhere.
pub fn render_table(summary: &DemoSummary, markdown: bool) -> String {
    let mut table = Table::new();
    table.load_preset(if markdown { presets::ASCII_MARKDOWN } else { presets::UTF8_FULL_CONDENSED });
    table.set_header(COLUMNS);
    for r in &summary.rows {
        let lines = r.user_code_lines.map_or("—".to_string(), |n| n.to_string());
        let level = format!("{} · {}", r.level, r.title);
        let f = &r.figures;
        let cells: Vec<String> = if r.status == Status::Failed {
            vec![level, lines, "FAILED".into(), "—".into(), "—".into(), format!("{:.1}", r.wall_s), "—".into(), "—".into()]
        } else {
            vec![
                level,
                lines,
                format!("{:.2}%", 100.0 * f.accuracy),
                f.eval_samples.to_string(),
                format!("{:.4}", f.test_loss),
                format!("{:.1}", r.wall_s),
                format!("{:.0}", f.samples_per_s),
                f.peak_rss_per_rank().iter().map(|m| format!("{m:.0}")).collect::<Vec<_>>().join(" / "),
            ]
        };
        table.add_row(cells);
    }
    for i in 1..COLUMNS.len() {
        if let Some(c) = table.column_mut(i) {
            c.set_cell_alignment(CellAlignment::Right);
        }
    }
    table.to_string()
}

/// The compute-efficiency table: each level's training FLOPs per sample (BasicNet at width 128,
/// [`crate::compute::training_flops_per_sample`]), achieved GFLOP/s over all ranks and its share
/// of the CPU's fp32 peak; then the peak's derivation. Failed rows read FAILED.
pub fn render_efficiency(summary: &DemoSummary, markdown: bool) -> String {
    let mut table = Table::new();
    table.load_preset(if markdown { presets::ASCII_MARKDOWN } else { presets::UTF8_FULL_CONDENSED });
    table.set_header(["level", "training MFLOP/sample", "train samples/s", "achieved GFLOP/s", "% of fp32 peak"]);
    let per_sample = crate::compute::training_flops_per_sample(128);
    let peak = summary.machine.cpu_peak.as_ref();
    for r in &summary.rows {
        let level = format!("{} · {}", r.level, r.title);
        let mflop = format!("{:.2}", per_sample as f64 / 1e6);
        if r.status == Status::Failed {
            table.add_row(vec![level, mflop, "FAILED".into(), "—".into(), "—".into()]);
            continue;
        }
        let flops = crate::compute::achieved_flops(128, r.figures.samples_per_s);
        table.add_row(vec![
            level,
            mflop,
            format!("{:.0}", r.figures.samples_per_s),
            format!("{:.1}", flops / 1e9),
            peak.map_or("—".into(), |p| format!("{:.1}%", 100.0 * flops / p.fp32_flops)),
        ]);
    }
    for i in 1..5 {
        if let Some(c) = table.column_mut(i) {
            c.set_cell_alignment(CellAlignment::Right);
        }
    }
    let derivation = peak.map_or_else(|| "Peak: not recorded.".to_string(), |p| format!("Peak: {}.", p.derivation));
    format!(
        "{table}\n\nTraining FLOPs per sample: 2 per multiply-accumulate of conv1, conv2, fc1 and fc2, forward once and \
         backward twice (conv1 has no input gradient); activations, pooling, the loss and the optimizer left out (< 1%).\n\n{derivation}\n"
    )
}

/// The notes under the table: what each column means, line-count problems and failures.
pub fn render_notes(summary: &DemoSummary) -> String {
    let mut s = format!(
        "Each level: one run at {} ranks over MPI with DDP (`ladder-run --nproc-per-node {}`). user code lines: \
         non-blank, non-comment lines between `// ANCHOR: user_code` and `// ANCHOR_END: user_code`. \
         wall s: launch to exit. train samples/s: over all ranks, training loop only. peak RSS: whole-process \
         high-water mark of each rank.\n",
        summary.nproc_per_node, summary.nproc_per_node
    );
    if let Some(m) = summary.max_steps {
        s.push_str(&format!(
            "\nCapped: every level stopped after --max-steps {m} optimizer steps (a full epoch is 60000 / ({} × 64) \
             steps), so accuracy and loss are a short run's, not the tutorial's one epoch.\n",
            summary.nproc_per_node
        ));
    }
    for r in &summary.rows {
        if let Some(e) = &r.user_code_error {
            s.push_str(&format!("\nlevel {}: lines not counted: {e}\n", r.level));
        }
        if let Some(e) = &r.error {
            s.push_str(&format!("\nlevel {} FAILED: {e}\n(log: {})\n", r.level, r.log));
        }
    }
    s
}

/// The markdown file `demo.md`: title, machine, table, notes.
pub fn render_markdown(summary: &DemoSummary) -> String {
    format!(
        "# ddp-ladder: the three levels side by side\n\n{}\n\n{}\n\n{}\n## Compute efficiency\n\n{}",
        summary.machine.line(),
        render_table(summary, true),
        render_notes(summary),
        render_efficiency(summary, true)
    )
}

/// Runs the demo: each selected level in turn with a progress line, then prints the table and
/// writes `demo.md` and `demo.json` under the output directory. Returns the summary whether or
/// not levels failed (see [`DemoSummary::failed`]).
///
/// # Errors
/// Invalid `--levels`; [`Error::MissingBinary`] for `ladder-run`; [`Error::Io`] writing the
/// outputs. A level's own failure is a row, not an error.
pub fn run_demo(args: &DemoArgs) -> Result<DemoSummary> {
    let levels = crate::select_levels(&args.levels)?;
    if args.nproc_per_node == 0 {
        return Err(Error::InvalidValue { flag: "--nproc-per-node", value: "0".into(), expected: "at least 1 rank".into() });
    }
    let (root, bin_dir) = (args.launch.root(), args.launch.bin_dir());
    let out_dir = args.out_dir.clone().unwrap_or_else(|| root.join("target").join("demo"));
    let launcher = require_binary(bin_dir.join("ladder-run"))?;
    std::fs::create_dir_all(&out_dir).map_err(Error::io(&out_dir))?;

    let mut rows = Vec::new();
    for (i, level) in levels.iter().enumerate() {
        let row = run_level(args, level, &root, &bin_dir, &launcher, &out_dir, (i + 1, levels.len()));
        match &row.error {
            None => println!(
                "      done in {:.1} s: accuracy {:.2}% over {} test images, {:.0} samples/s{}",
                row.wall_s,
                100.0 * row.figures.accuracy,
                row.figures.eval_samples,
                row.figures.samples_per_s,
                args.max_steps.map(|m| format!(" (capped at --max-steps {m})")).unwrap_or_default()
            ),
            Some(e) => println!("      FAILED after {:.1} s: {}", row.wall_s, e.lines().next().unwrap_or("")),
        }
        rows.push(row);
    }
    let summary = DemoSummary { machine: Machine::describe(), nproc_per_node: args.nproc_per_node, rows, max_steps: args.max_steps };
    println!("\n{}\n{}\n{}", summary.machine.line(), render_table(&summary, false), render_notes(&summary));
    println!("Compute efficiency\n{}", render_efficiency(&summary, false));
    let json = serde_json::to_string_pretty(&summary).unwrap_or_default();
    write_file(&out_dir.join("demo.json"), &json)?;
    write_file(&out_dir.join("demo.md"), &render_markdown(&summary))?;
    println!("written: {} and {}", out_dir.join("demo.md").display(), out_dir.join("demo.json").display());
    Ok(summary)
}

/// Runs one level and turns whatever happened into its row.
fn run_level(
    args: &DemoArgs,
    level: &Level,
    root: &Path,
    bin_dir: &Path,
    launcher: &Path,
    out_dir: &Path,
    (i, n): (usize, usize),
) -> DemoRow {
    let (user_code_lines, user_code_file, user_code_error) = match loc::count_level(&root.join(level.crate_dir)) {
        Ok((files, lines)) => {
            let names: Vec<String> = files.iter().map(|f| f.strip_prefix(root).unwrap_or(f).display().to_string()).collect();
            (Some(lines), Some(names.join(", ")), None)
        }
        Err(e) => (None, None, Some(e.to_string())),
    };
    let report = out_dir.join(format!("level{}.json", level.number));
    let log = out_dir.join(format!("level{}.log", level.number));
    let _ = std::fs::remove_file(&report);
    let what = format!("level {} ({})", level.number, level.title);
    let mut row = DemoRow {
        level: level.number,
        title: level.title.into(),
        user_code_lines,
        user_code_file,
        user_code_error,
        status: Status::Failed,
        error: None,
        figures: RunFigures::default(),
        wall_s: 0.0,
        command: String::new(),
        log: log.display().to_string(),
    };
    let binary = match require_binary(bin_dir.join(level.binary)) {
        Ok(b) => b,
        Err(e) => {
            println!("[{i}/{n}] {what}: not run");
            row.error = Some(e.to_string());
            return row;
        }
    };
    let mut cmd = Command::new(launcher);
    cmd.arg("--nproc-per-node").arg(args.nproc_per_node.to_string()).arg(&binary);
    cmd.args(["--device", "cpu", "--strategy", args.strategy.name(), "--epochs", &args.epochs.to_string()]);
    cmd.args(["--seed", &args.seed.to_string(), "--log-interval", &args.log_interval.to_string()]);
    if let Some(m) = args.max_steps {
        cmd.args(["--max-steps", &m.to_string()]);
    }
    cmd.arg("--metrics-json").arg(&report);
    if level.number == 3 {
        // The Trainer refuses to replace a previous run unless told: the demo owns this one.
        cmd.arg("--output-dir").arg(out_dir.join("level3-output")).arg("--overwrite-output-dir");
    }
    row.command = process::describe(&cmd);
    println!("[{i}/{n}] {what}: {} ranks, {} (log: {})", args.nproc_per_node, row.command, log.display());
    let start = std::time::Instant::now();
    let result = process::run_logged(&what, &mut cmd, &log, args.launch.timeout()).and_then(|done| {
        row.wall_s = done.wall_s;
        if !report.exists() {
            return Err(Error::NoReport { what: what.clone(), path: report.clone() });
        }
        RunFigures::read(&report)
    });
    row.wall_s = start.elapsed().as_secs_f64();
    match result {
        Ok(figures) => {
            row.figures = figures;
            row.status = Status::Ok;
        }
        Err(e) => row.error = Some(e.to_string()),
    }
    row
}
