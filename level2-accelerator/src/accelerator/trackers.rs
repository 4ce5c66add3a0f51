//! The Accelerator's trackers (Accelerate's `init_trackers`, `log`, `get_tracker`): started
//! from the `log_with` setting on the main process, closed by `end_training`.

use super::Accelerator;
use crate::tracking::{LogWith, TensorBoardTracker};
use crate::{Error, Result};

impl Accelerator {
    /// Accelerate's `init_trackers(project_name, config)`: on the main process, starts the
    /// tracker `log_with` names — TensorBoard: event files in `project_dir/project_name/` —
    /// and stores `config` with it (`project_dir/project_name/<unix time>/hparams.yml`; a
    /// `config` that serialises to nothing, such as `&()`, stores nothing). Without
    /// `log_with`, and on the other processes, it does nothing. Not collective.
    ///
    /// # Errors
    /// A second call; [`Error::Core`] (an I/O error) naming the directory or file that could
    /// not be created.
    pub fn init_trackers(&self, project_name: &str, config: &impl serde::Serialize) -> Result<()> {
        let (Some(LogWith::Tensorboard), true) = (self.config.log_with, self.is_main_process()) else { return Ok(()) };
        if !self.trackers.borrow().is_empty() {
            return Err(Error::Usage {
                op: "init_trackers",
                problem: "the trackers are started already (one init_trackers per run)".into(),
            });
        }
        // check_settings refused log_with without project_dir before the process group existed.
        let project_dir = self.config.project_dir.clone().unwrap_or_default();
        let mut tracker = TensorBoardTracker::new(project_name, &project_dir)?;
        if !matches!(serde_json::to_value(config), Ok(serde_json::Value::Null)) {
            tracker.store_init_configuration(config)?;
        }
        self.trackers.borrow_mut().push(tracker);
        Ok(())
    }

    /// Accelerate's `log(values, step)`: each value as a scalar at `step` (`None`: step 0, as
    /// TensorBoard records a missing global step) in every started tracker, on the main
    /// process; nothing elsewhere or before [`init_trackers`](Self::init_trackers). Not
    /// collective.
    ///
    /// # Errors
    /// [`Error::Core`] (an I/O error) naming the event file.
    pub fn log<K: AsRef<str>>(&self, values: impl IntoIterator<Item = (K, f64)>, step: Option<u64>) -> Result<()> {
        let mut trackers = self.trackers.borrow_mut();
        if trackers.is_empty() {
            return Ok(());
        }
        let values: Vec<(K, f64)> = values.into_iter().collect();
        let values: Vec<(&str, f64)> = values.iter().map(|(k, v)| (k.as_ref(), *v)).collect();
        for tracker in trackers.iter_mut() {
            tracker.log(&values, step.unwrap_or(0))?;
        }
        Ok(())
    }

    /// Accelerate's `get_tracker(name)`: the started tracker called `name` (`tensorboard`),
    /// given to `f`; `None` when there is none (another process, no `init_trackers`).
    pub fn get_tracker<R>(&self, name: &str, f: impl FnOnce(&TensorBoardTracker) -> R) -> Option<R> {
        self.trackers.borrow().iter().find(|t| t.name() == name).map(f)
    }
}
