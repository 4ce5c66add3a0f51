//! Experiment trackers, as Accelerate's `accelerate.tracking`: the Accelerator's `log_with`
//! setting names them, [`Accelerator::init_trackers`](crate::Accelerator::init_trackers) starts
//! them, [`Accelerator::log`](crate::Accelerator::log) writes to them and
//! [`Accelerator::end_training`](crate::Accelerator::end_training) closes them — on the main
//! process only, as Accelerate's `@on_main_process` trackers.
//!
//! One tracker here: [`TensorBoardTracker`], Accelerate's, writing TensorBoard event files
//! through the core's [`SummaryWriter`] (the writer level 3's `report_to="tensorboard"` uses
//! too).

pub use crate::config::LogWith;

use crate::config::{ResolvedConfig, Source};
use crate::{Error, Result};
use ladder_core::recipe::{check_writable, OutputKind};
use ladder_core::tensorboard::SummaryWriter;
use std::path::{Path, PathBuf};

/// Accelerate's `TensorBoardTracker(run_name, logging_dir)`: event files in
/// `logging_dir/run_name/` (`events.out.tfevents.*`, one per tracker), one scalar per value
/// logged, flushed as written.
#[derive(Debug)]
pub struct TensorBoardTracker {
    run_name: String,
    logging_dir: PathBuf,
    writer: SummaryWriter,
}

impl TensorBoardTracker {
    /// Starts the tracker: creates `logging_dir/run_name` and its event file (Accelerate's
    /// `TensorBoardTracker.start`: `SummaryWriter(os.path.join(logging_dir, run_name))`).
    ///
    /// # Errors
    /// [`Error::Core`] (an I/O error) naming the directory or file that could not be created.
    pub fn new(run_name: &str, logging_dir: &Path) -> Result<Self> {
        let logging_dir = logging_dir.join(run_name);
        let writer = SummaryWriter::new(&logging_dir)?;
        Ok(Self { run_name: run_name.to_string(), logging_dir, writer })
    }

    /// `tensorboard`, the tracker's name in `log_with`.
    pub fn name(&self) -> &'static str {
        "tensorboard"
    }

    /// The run's name (`init_trackers`' project name).
    pub fn run_name(&self) -> &str {
        &self.run_name
    }

    /// The directory the event file is in: `project_dir/<project name>`.
    pub fn logging_dir(&self) -> &Path {
        &self.logging_dir
    }

    /// The event file written.
    pub fn event_file(&self) -> &Path {
        self.writer.path()
    }

    /// Saves the run's configuration as Accelerate's `store_init_configuration` saves it: YAML in
    /// `logging_dir/<unix time>/hparams.yml`. Returns the file written.
    ///
    /// # Errors
    /// A value that YAML cannot hold; [`Error::Core`] (an I/O error) naming the file.
    pub fn store_init_configuration(&mut self, values: &impl serde::Serialize) -> Result<PathBuf> {
        let yaml = serde_norway::to_string(values).map_err(|e| Error::Usage { op: "init_trackers", problem: format!("config: {e}") })?;
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        let dir = self.logging_dir.join(now.to_string());
        std::fs::create_dir_all(&dir).map_err(|e| ladder_core::Error::io(&dir, e))?;
        let path = dir.join("hparams.yml");
        std::fs::write(&path, yaml).map_err(|e| ladder_core::Error::io(&path, e))?;
        Ok(path)
    }

    /// Writes each value as a scalar at `step` (Accelerate's `log`: `add_scalar(k, v,
    /// global_step=step)`; stored as `f32`).
    ///
    /// # Errors
    /// [`Error::Core`] (an I/O error) naming the event file.
    pub fn log(&mut self, values: &[(&str, f64)], step: u64) -> Result<()> {
        for (tag, value) in values {
            self.writer.add_scalar(tag, *value, step)?;
        }
        Ok(())
    }
}

/// Checks the tracking settings before training (every process, before the process group):
/// `log_with tensorboard` needs a `project_dir` (as Accelerate's "Logging with `tensorboard`
/// requires a `logging_dir`"), and that directory must be writable
/// ([`check_writable`]).
///
/// # Errors
/// [`Error::Conflict`] for a tracker without a project_dir; [`Error::InvalidSetting`] naming
/// project_dir, where it was given and why it cannot be written.
pub fn check_settings(config: &ResolvedConfig) -> Result<()> {
    let Some(log_with) = config.log_with else { return Ok(()) };
    let Some(dir) = &config.project_dir else {
        return Err(Error::Conflict {
            first: format!("log_with {log_with} ({})", config.describe_source("log_with")),
            second: "an unset project_dir".into(),
            why: "the TensorBoard tracker writes its event files in project_dir/<project name>; give project_dir \
                  (--project-dir, ACCELERATE_PROJECT_DIR or the config file's project_dir)"
                .into(),
        });
    };
    check_writable("project_dir", dir, OutputKind::Dir).map_err(|e| match e {
        ladder_core::Error::InvalidValue { value, expected, .. } => Error::InvalidSetting {
            setting: "project_dir".into(),
            value,
            origin: match config.source("project_dir") {
                Source::Builder => "builder setting project_dir".into(),
                _ => config.describe_source("project_dir"),
            },
            expected,
        },
        other => other.into(),
    })
}
