//! What a run shows and writes, as Transformers' Trainer: the `***** Running training *****`
//! banner, the `Epoch | Training Loss | Validation Loss | Accuracy` table, progress (an
//! indicatif bar on a terminal — the launcher's too, see [`bar_target`] — plain log lines
//! otherwise), the report_to writers (`log_history.jsonl` / `log_history.csv` / TensorBoard
//! event files) and the loss-curve plot (`loss.svg`).

use crate::args::{ReportTo, TrainingArguments};
use crate::error::{Error, Result};
use crate::schedule::TrainingPlan;
use crate::state::LogEntry;
use comfy_table::{presets, Cell, CellAlignment, Table};
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};

/// `1234567` → `1,234,567` (Python's `{:,}`).
pub fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// The banner Transformers logs before training (`Trainer._inner_training_loop`), with the
/// same lines and `{:,}` number formatting.
pub fn training_banner(args: &TrainingArguments, plan: &TrainingPlan, trainable_parameters: u64) -> String {
    format!(
        "***** Running training *****\n  Num examples = {}\n  Num Epochs = {}\n  Instantaneous batch size per device = {}\n  Total train batch size (w. parallel, distributed & accumulation) = {}\n  Gradient Accumulation steps = {}\n  Total optimization steps = {}\n  Number of trainable parameters = {}",
        thousands(plan.num_examples as u64),
        thousands(plan.num_epochs as u64),
        thousands(args.per_device_train_batch_size as u64),
        thousands(plan.total_train_batch_size as u64),
        thousands(args.gradient_accumulation_steps as u64),
        thousands(plan.max_steps as u64),
        thousands(trainable_parameters),
    )
}

/// The banner Transformers logs before an evaluation.
pub fn evaluation_banner(num_examples: usize, batch_size: usize) -> String {
    format!("***** Running Evaluation *****\n  Num examples = {}\n  Batch size = {batch_size}", thousands(num_examples as u64))
}

/// Metric keys that describe the evaluation run rather than the model; left out of the table.
const RUN_FIGURES: &[&str] = &["runtime", "samples_per_second", "steps_per_second"];

/// `accuracy` → `Accuracy`, `f1_macro` → `F1 Macro` (Transformers' notebook column titles).
fn title(key: &str) -> String {
    key.split('_')
        .map(|w| {
            let mut c = w.chars();
            c.next().map(|f| f.to_uppercase().chain(c).collect::<String>()).unwrap_or_default()
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// A fractional epoch as the table shows it: `1` for whole epochs, else two decimals.
fn epoch_label(epoch: f64) -> String {
    if (epoch - epoch.round()).abs() < 1e-9 {
        format!("{}", epoch.round() as i64)
    } else {
        format!("{epoch:.2}")
    }
}

/// The evaluation table of Transformers' notebook progress (`Epoch | Training Loss | Validation
/// Loss | <metric>…`; `Step` first instead with `by_epoch = false`): one row per evaluation in
/// `history`, the training loss being the last one logged since the previous evaluation
/// (`No log` if none), losses and metrics with six decimals.
pub fn epoch_table(history: &[LogEntry], by_epoch: bool) -> Table {
    let evals: Vec<&LogEntry> = history.iter().filter(|e| e.get("eval_loss").is_some()).collect();
    let mut metric_keys: Vec<String> = Vec::new();
    for e in &evals {
        for k in e.values.keys() {
            if let Some(bare) = k.strip_prefix("eval_") {
                if bare != "loss" && !RUN_FIGURES.contains(&bare) && !metric_keys.iter().any(|m| m == bare) {
                    metric_keys.push(bare.to_string());
                }
            }
        }
    }
    let mut table = Table::new();
    table.load_preset(presets::ASCII_MARKDOWN);
    let mut header = vec![if by_epoch { "Epoch" } else { "Step" }.to_string(), "Training Loss".into(), "Validation Loss".into()];
    header.extend(metric_keys.iter().map(|k| title(k)));
    table.set_header(header);
    let mut previous_step = None;
    for e in evals {
        let train = history
            .iter()
            .filter(|t| t.step <= e.step && previous_step.is_none_or(|p| t.step > p))
            .filter_map(|t| t.get("loss"))
            .next_back();
        previous_step = Some(e.step);
        let mut row = vec![
            Cell::new(if by_epoch { epoch_label(e.epoch) } else { e.step.to_string() }),
            Cell::new(train.map_or("No log".into(), |l| format!("{l:.6}"))),
            Cell::new(format!("{:.6}", e.get("eval_loss").unwrap_or(f64::NAN))),
        ];
        for k in &metric_keys {
            row.push(Cell::new(e.get(&format!("eval_{k}")).map_or("-".into(), |v| format!("{v:.6}"))));
        }
        table.add_row(row);
    }
    for i in 0..table.column_count() {
        if let Some(col) = table.column_mut(i) {
            col.set_cell_alignment(CellAlignment::Right);
        }
    }
    table
}

/// Appends every log entry to `output_dir/log_history.jsonl` (one JSON object a line),
/// `output_dir/log_history.csv` (long format `step,epoch,key,value`, one row per figure) or a
/// TensorBoard event file in `logging_dir` (see [`tensorboard_scalars`]), as report_to asks.
/// Main process only.
#[derive(Debug)]
pub struct ReportWriter {
    kind: ReportTo,
    path: Option<PathBuf>,
    tensorboard: Option<ladder_core::tensorboard::SummaryWriter>,
}

/// A log entry as Transformers' `TensorBoardCallback` writes it (`rewrite_logs`): each figure
/// under `eval/` (`eval_loss` → `eval/loss`), `test/` (`test_*`) or else `train/`
/// (`loss` → `train/loss`, `train_samples_per_second` → `train/train_samples_per_second`),
/// and the entry's epoch as `train/epoch`; all at the entry's global step.
pub fn tensorboard_scalars(entry: &LogEntry) -> Vec<(String, f64)> {
    let epoch = ("epoch".to_string(), entry.epoch);
    entry
        .values
        .iter()
        .map(|(k, v)| (k.clone(), *v))
        .chain(std::iter::once(epoch))
        .map(|(k, v)| match (k.strip_prefix("eval_"), k.strip_prefix("test_")) {
            (Some(rest), _) => (format!("eval/{rest}"), v),
            (_, Some(rest)) => (format!("test/{rest}"), v),
            _ => (format!("train/{k}"), v),
        })
        .collect()
}

impl ReportWriter {
    /// A writer for `args.report_to` in `args.output_dir`; starting afresh truncates the file,
    /// `resume` appends to it. TensorBoard starts a new event file in
    /// [`logging_dir`](TrainingArguments::logging_dir_at) either way (TensorBoard reads every
    /// file of the directory as one run).
    ///
    /// # Errors
    /// [`Error::Io`] naming the file; the event file's errors.
    pub fn new(args: &TrainingArguments, resume: bool) -> Result<Self> {
        if args.report_to == ReportTo::Tensorboard {
            let writer = ladder_core::tensorboard::SummaryWriter::new(&args.logging_dir_at(std::time::SystemTime::now()))?;
            return Ok(Self { kind: args.report_to, path: Some(writer.path().to_path_buf()), tensorboard: Some(writer) });
        }
        let path = match args.report_to {
            ReportTo::None | ReportTo::Tensorboard => None,
            ReportTo::Jsonl => Some(args.output_dir.join("log_history.jsonl")),
            ReportTo::Csv => Some(args.output_dir.join("log_history.csv")),
        };
        if let Some(p) = &path {
            std::fs::create_dir_all(&args.output_dir).map_err(|e| Error::io(&args.output_dir, e))?;
            if !resume || !p.exists() {
                let header: &[u8] = if args.report_to == ReportTo::Csv { b"step,epoch,key,value\n" } else { b"" };
                std::fs::write(p, header).map_err(|e| Error::io(p, e))?;
            }
        }
        Ok(Self { kind: args.report_to, path, tensorboard: None })
    }

    /// The file written to (`None` with report_to = none; the event file with tensorboard).
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Appends one entry.
    ///
    /// # Errors
    /// [`Error::Io`] naming the file.
    pub fn write(&mut self, entry: &LogEntry) -> Result<()> {
        if let Some(writer) = &mut self.tensorboard {
            for (tag, value) in tensorboard_scalars(entry) {
                writer.add_scalar(&tag, value, entry.step)?;
            }
            return Ok(());
        }
        let Some(path) = &self.path else {
            return Ok(());
        };
        let text = match self.kind {
            ReportTo::None | ReportTo::Tensorboard => return Ok(()),
            ReportTo::Jsonl => format!("{}\n", serde_json::to_string(entry).expect("LogEntry serialises")),
            ReportTo::Csv => entry.values.iter().map(|(k, v)| format!("{},{},{k},{v}\n", entry.step, entry.epoch)).collect(),
        };
        let mut f = std::fs::OpenOptions::new().append(true).open(path).map_err(|e| Error::io(path, e))?;
        f.write_all(text.as_bytes()).map_err(|e| Error::io(path, e))
    }
}

/// Draws the training loss (line) and the evaluation loss (points joined by a line) against
/// the global step into an SVG file.
///
/// # Errors
/// [`Error::Io`] naming `path` if plotters cannot draw or write it.
pub fn plot_loss_curve(path: &Path, train: &[(u64, f64)], eval: &[(u64, f64)]) -> Result<()> {
    use plotters::prelude::*;
    let fail = |e: String| Error::io(path, std::io::Error::other(e));
    let all = train.iter().chain(eval).copied();
    let max_step = all.clone().map(|(s, _)| s).max().unwrap_or(1).max(1);
    let max_loss = all.map(|(_, l)| l).filter(|l| l.is_finite()).fold(0.0f64, f64::max).max(1e-3) * 1.05;
    {
        let root = SVGBackend::new(path, (800, 480)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| fail(e.to_string()))?;
        let mut chart = ChartBuilder::on(&root)
            .caption("Loss", ("sans-serif", 22))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(56)
            .build_cartesian_2d(0u64..max_step, 0f64..max_loss)
            .map_err(|e| fail(e.to_string()))?;
        chart.configure_mesh().x_desc("global step").y_desc("loss").draw().map_err(|e| fail(e.to_string()))?;
        chart
            .draw_series(LineSeries::new(train.iter().copied(), &BLUE))
            .map_err(|e| fail(e.to_string()))?
            .label("training loss")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE));
        chart
            .draw_series(LineSeries::new(eval.iter().copied(), &RED))
            .map_err(|e| fail(e.to_string()))?
            .label("validation loss")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED));
        chart.draw_series(eval.iter().map(|&(s, l)| Circle::new((s, l), 4, RED.filled()))).map_err(|e| fail(e.to_string()))?;
        chart.configure_series_labels().border_style(BLACK).background_style(WHITE).draw().map_err(|e| fail(e.to_string()))?;
        root.present().map_err(|e| fail(e.to_string()))?;
    }
    Ok(())
}

/// Where the progress bar is drawn (see [`bar_target`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BarTarget {
    /// No bar: plain log lines on the main process, nothing elsewhere.
    None,
    /// This process's own terminal (indicatif's default target, stderr, as tqdm's).
    Terminal,
    /// A launcher's terminal, this many columns wide after the launcher's `[rank0]: `,
    /// reached through its line prefixer (stdout is a pipe): the bar is redrawn with carriage
    /// returns on stdout.
    Launcher(u16),
}

/// Where the Trainer's bar goes: nowhere off the main process or with `disable_tqdm`; on this
/// terminal when stdout is one; else on the launcher's terminal when `ladder-run` or
/// `ladder-accelerate launch` says its stdout is one (`launcher_columns`, from
/// `LADDER_TTY_COLUMNS`: [`ladder_core::launch::tty_columns`]); else nowhere.
pub fn bar_target(is_main_process: bool, disable_tqdm: bool, stdout_is_terminal: bool, launcher_columns: Option<u16>) -> BarTarget {
    match (is_main_process && !disable_tqdm, stdout_is_terminal, launcher_columns) {
        (false, _, _) => BarTarget::None,
        (true, true, _) => BarTarget::Terminal,
        (true, false, Some(columns)) => BarTarget::Launcher(columns),
        (true, false, None) => BarTarget::None,
    }
}

/// A terminal behind a launcher's line prefixer, for indicatif: the bar is redrawn in place
/// with `\r` (the prefixer writes its tag again after each), a line is erased with `ESC[2K`
/// before the `\r` (never after, which would erase the tag), and each draw is one write to
/// stdout starting with `\r`, which the prefixer passes through at once.
#[derive(Debug)]
struct PrefixedTerminal {
    columns: u16,
    pending: std::sync::Mutex<Vec<u8>>,
}

impl PrefixedTerminal {
    fn push(&self, bytes: &[u8]) -> std::io::Result<()> {
        self.pending.lock().map_err(|_| std::io::Error::other("poisoned"))?.extend_from_slice(bytes);
        Ok(())
    }

    fn push_move(&self, n: usize, code: char) -> std::io::Result<()> {
        if n == 0 {
            return Ok(());
        }
        self.push(format!("\x1b[{n}{code}").as_bytes())
    }
}

impl indicatif::TermLike for PrefixedTerminal {
    fn width(&self) -> u16 {
        self.columns
    }
    fn move_cursor_up(&self, n: usize) -> std::io::Result<()> {
        self.push_move(n, 'A')
    }
    fn move_cursor_down(&self, n: usize) -> std::io::Result<()> {
        self.push_move(n, 'B')
    }
    fn move_cursor_right(&self, n: usize) -> std::io::Result<()> {
        self.push_move(n, 'C')
    }
    fn move_cursor_left(&self, n: usize) -> std::io::Result<()> {
        self.push_move(n, 'D')
    }
    fn write_line(&self, s: &str) -> std::io::Result<()> {
        self.push(format!("{s}\n").as_bytes())
    }
    fn write_str(&self, s: &str) -> std::io::Result<()> {
        self.push(s.as_bytes())
    }
    fn clear_line(&self) -> std::io::Result<()> {
        self.push(b"\x1b[2K\r")
    }
    fn flush(&self) -> std::io::Result<()> {
        let mut pending = self.pending.lock().map_err(|_| std::io::Error::other("poisoned"))?;
        let mut out = std::io::stdout().lock();
        out.write_all(b"\r")?;
        out.write_all(&pending)?;
        pending.clear();
        out.flush()
    }
}

/// Training progress: an indicatif bar where [`bar_target`] says; plain log lines (on the main
/// process) otherwise; nothing elsewhere.
#[derive(Debug)]
pub struct Progress {
    bar: Option<indicatif::ProgressBar>,
    main: bool,
    /// The bar is on a launcher's terminal: its line is ended with a newline when it finishes.
    through_launcher: bool,
}

impl Progress {
    /// Progress over `total` optimization steps.
    pub fn new(total: u64, is_main_process: bool, disable_tqdm: bool) -> Self {
        let target = bar_target(is_main_process, disable_tqdm, std::io::stdout().is_terminal(), ladder_core::launch::tty_columns());
        let draw_target = match target {
            BarTarget::None => None,
            BarTarget::Terminal => Some(indicatif::ProgressDrawTarget::stderr()),
            BarTarget::Launcher(columns) => {
                let term = PrefixedTerminal { columns, pending: std::sync::Mutex::new(Vec::new()) };
                Some(indicatif::ProgressDrawTarget::term_like(Box::new(term)))
            }
        };
        let bar = draw_target.map(|t| {
            let bar = indicatif::ProgressBar::with_draw_target(Some(total), t);
            let meter = |s: &indicatif::ProgressState, w: &mut dyn std::fmt::Write| {
                let _ = w.write_str(&tqdm_meter(s.pos(), s.len().unwrap_or(0), s.elapsed().as_secs_f64(), s.per_sec()));
            };
            bar.set_style(
                indicatif::ProgressStyle::with_template("{percent:>3}%|{wide_bar}| {meter} {msg}")
                    .expect("a valid template")
                    .with_key("meter", meter)
                    .progress_chars("█▉▊▋▌▍▎▏ "),
            );
            bar
        });
        Self { bar, main: is_main_process, through_launcher: matches!(target, BarTarget::Launcher(_)) }
    }

    /// Whether a bar is drawn (else plain lines).
    pub fn is_bar(&self) -> bool {
        self.bar.is_some()
    }

    /// Moves the bar to `step` (no output without a bar).
    pub fn set_position(&self, step: u64) {
        if let Some(b) = &self.bar {
            b.set_position(step);
        }
    }

    /// Prints a line on the main process (above the bar when there is one).
    pub fn println(&self, line: &str) {
        match &self.bar {
            Some(b) => b.println(line),
            None if self.main => println!("{line}"),
            None => {}
        }
    }

    /// Leaves the bar as it ends (as tqdm does); later lines are printed plainly below it.
    pub fn finish(&mut self) {
        if let Some(b) = self.bar.take() {
            b.finish();
            if self.through_launcher {
                // The bar's line is still open in the launcher's prefixer: end it.
                let mut out = std::io::stdout().lock();
                let _ = out.write_all(b"\n").and_then(|_| out.flush());
            }
        }
    }
}

/// `mm:ss` (or `h:mm:ss`), as tqdm prints times.
fn tqdm_time(seconds: f64) -> String {
    let s = seconds.max(0.0).round() as u64;
    let (h, m, s) = (s / 3600, s / 60 % 60, s % 60);
    if h > 0 {
        format!("{h}:{m:02}:{s:02}")
    } else {
        format!("{m:02}:{s:02}")
    }
}

/// The right half of tqdm's bar, as the Trainer's progress bar reads: `26/60 [00:21<00:28,
/// 1.21it/s]` — steps done, elapsed < remaining (`?` before the first step), and the rate in
/// steps per second (`s/it` below one step per second, as tqdm).
pub fn tqdm_meter(pos: u64, total: u64, elapsed_s: f64, steps_per_s: f64) -> String {
    let (remaining, rate) = if pos == 0 || !(steps_per_s.is_finite() && steps_per_s > 0.0) {
        ("?".to_string(), "?it/s".to_string())
    } else {
        let remaining = tqdm_time(total.saturating_sub(pos) as f64 / steps_per_s);
        let rate = if steps_per_s >= 1.0 { format!("{steps_per_s:.2}it/s") } else { format!("{:.2}s/it", 1.0 / steps_per_s) };
        (remaining, rate)
    };
    format!("{pos}/{total} [{}<{remaining}, {rate}]", tqdm_time(elapsed_s))
}

/// A log entry as one plain line, in Python dict style as Transformers prints logs:
/// `{'loss': 0.2, 'learning_rate': 0.001, 'epoch': 0.5}`.
pub fn log_line(entry: &LogEntry) -> String {
    let mut parts: Vec<String> = entry.values.iter().map(|(k, v)| format!("'{k}': {}", short(*v))).collect();
    parts.push(format!("'epoch': {}", short(entry.epoch)));
    format!("{{{}}}", parts.join(", "))
}

/// As Python prints a float: integers with `.0`, others rounded to four decimals (as
/// Transformers rounds losses) in shortest form, tiny values in scientific notation.
fn short(v: f64) -> String {
    if v == v.trunc() && v.abs() < 1e15 {
        format!("{v:.1}")
    } else if v.abs() >= 1e-3 {
        format!("{}", (v * 1e4).round() / 1e4)
    } else {
        format!("{v:.4e}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thousands_separators() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1000), "1,000");
        assert_eq!(thousands(1_199_882), "1,199,882");
    }

    #[test]
    fn the_progress_meter_reads_like_tqdm() {
        assert_eq!(tqdm_meter(26, 60, 21.4, 1.2099), "26/60 [00:21<00:28, 1.21it/s]");
        assert_eq!(tqdm_meter(0, 60, 0.2, 0.0), "0/60 [00:00<?, ?it/s]");
        assert_eq!(tqdm_meter(3, 938, 12.0, 0.25), "3/938 [00:12<1:02:20, 4.00s/it]");
        assert_eq!(tqdm_meter(60, 60, 49.6, 1.21), "60/60 [00:50<00:00, 1.21it/s]");
    }

    /// The bar follows the launcher's terminal contract: drawn on the main process only, on its
    /// own terminal first, else on the launcher's when LADDER_TTY_COLUMNS says there is one.
    #[test]
    fn the_bar_is_drawn_where_a_terminal_is() {
        assert_eq!(bar_target(true, false, true, None), BarTarget::Terminal);
        assert_eq!(bar_target(true, false, true, Some(100)), BarTarget::Terminal);
        assert_eq!(bar_target(true, false, false, Some(100)), BarTarget::Launcher(100));
        assert_eq!(bar_target(true, false, false, None), BarTarget::None);
        assert_eq!(bar_target(false, false, false, Some(100)), BarTarget::None);
        assert_eq!(bar_target(false, false, true, None), BarTarget::None);
        assert_eq!(bar_target(true, true, false, Some(100)), BarTarget::None);
        assert_eq!(bar_target(true, true, true, None), BarTarget::None);
    }

    /// What indicatif writes through [`PrefixedTerminal`]: `\r`-led redraws, no cursor moves up
    /// for one bar, the erase before the `\r`.
    #[test]
    fn the_launcher_terminal_redraws_with_carriage_returns() {
        use indicatif::TermLike;
        let t = PrefixedTerminal { columns: 40, pending: std::sync::Mutex::new(Vec::new()) };
        t.move_cursor_up(0).unwrap();
        t.clear_line().unwrap();
        t.write_line("{'loss': 0.3}").unwrap();
        t.write_str(" 50%|██  | 1/2").unwrap();
        assert_eq!(t.width(), 40);
        assert_eq!(t.pending.lock().unwrap().as_slice(), "\x1b[2K\r{'loss': 0.3}\n 50%|██  | 1/2".as_bytes());
        t.move_cursor_up(2).unwrap();
        assert!(t.pending.lock().unwrap().ends_with(b"\x1b[2A"));
    }

    #[test]
    fn log_lines_read_like_transformers() {
        let e = LogEntry::new(100, 0.1066, [("loss", 0.31234), ("learning_rate", 1e-3), ("grad_norm", 2.0)]);
        assert_eq!(log_line(&e), "{'grad_norm': 2.0, 'learning_rate': 0.001, 'loss': 0.3123, 'epoch': 0.1066}");
    }

    #[test]
    fn tensorboard_tags_are_transformers_rewrite_logs() {
        let e =
            LogEntry::new(8, 0.25, [("eval_loss", 0.5), ("eval_accuracy", 0.9), ("test_loss", 0.6), ("train_samples_per_second", 99.0)]);
        let tags: Vec<(String, f64)> = tensorboard_scalars(&e);
        let expected = [
            ("eval/accuracy", 0.9),
            ("eval/loss", 0.5),
            ("test/loss", 0.6),
            ("train/train_samples_per_second", 99.0),
            ("train/epoch", 0.25),
        ];
        assert_eq!(tags, expected.map(|(k, v)| (k.to_string(), v)));
    }
}
