//! `TrainerState` (saved as `trainer_state.json` in output_dir and in every checkpoint) and
//! its log history, with Transformers' field names.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Evaluation results by key (`eval_loss`, `eval_accuracy`, `eval_runtime`, …), sorted.
pub type Metrics = BTreeMap<String, f64>;

/// One entry of the log history: a training log (`loss`, `learning_rate`, `grad_norm`), an
/// evaluation (`eval_loss`, `eval_accuracy`, `eval_runtime`, …) or the end-of-training summary
/// (`train_runtime`, `train_samples_per_second`, `train_loss`, …), each with the epoch (a
/// fraction: updates done / updates per epoch) and the global step, as Transformers'
/// `state.log_history` dicts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LogEntry {
    /// The figures, by Transformers' key names (sorted).
    #[serde(flatten)]
    pub values: BTreeMap<String, f64>,
    /// Fractional epoch when the entry was made.
    pub epoch: f64,
    /// Optimization steps done when the entry was made.
    pub step: u64,
}

impl LogEntry {
    /// An entry at `step` / `epoch` with `values`.
    pub fn new(step: u64, epoch: f64, values: impl IntoIterator<Item = (impl Into<String>, f64)>) -> Self {
        Self { values: values.into_iter().map(|(k, v)| (k.into(), v)).collect(), epoch, step }
    }

    /// A figure by key (`loss`, `eval_loss`, …).
    pub fn get(&self, key: &str) -> Option<f64> {
        self.values.get(key).copied()
    }
}

/// The Trainer's progress, as Transformers' `TrainerState` (`trainer_state.json`).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct TrainerState {
    /// Fractional epochs done (updates done / updates per epoch).
    pub epoch: f64,
    /// Optimization steps done.
    pub global_step: u64,
    /// Total optimization steps planned.
    pub max_steps: u64,
    /// Epochs planned.
    pub num_train_epochs: u64,
    /// logging_steps of the run.
    pub logging_steps: u64,
    /// eval_steps of the run.
    pub eval_steps: u64,
    /// save_steps of the run.
    pub save_steps: u64,
    /// per_device_train_batch_size of the run.
    pub train_batch_size: u64,
    /// Every log entry so far.
    pub log_history: Vec<LogEntry>,
    /// The best value of metric_for_best_model so far.
    pub best_metric: Option<f64>,
    /// The global step of the best evaluation so far.
    pub best_global_step: Option<u64>,
    /// The checkpoint written at the best evaluation (`output_dir/checkpoint-<step>`).
    pub best_model_checkpoint: Option<PathBuf>,
    /// Whether this process is the local main process.
    pub is_local_process_zero: bool,
    /// Whether this process is the global main process (rank 0).
    pub is_world_process_zero: bool,
    /// Floating-point operations (not counted here; kept for Transformers' format).
    pub total_flos: f64,
}

impl TrainerState {
    /// Writes the state as pretty JSON to `path` (atomically).
    ///
    /// # Errors
    /// [`Error::Io`] naming `path`.
    pub fn save(&self, path: &Path) -> Result<()> {
        let json = serde_json::to_string_pretty(self).expect("TrainerState serialises");
        ladder_core::atomic::write_atomic(path, json.as_bytes())?;
        Ok(())
    }

    /// Reads a state written by [`TrainerState::save`].
    ///
    /// # Errors
    /// [`Error::Io`] if unreadable, [`Error::BadCheckpoint`] if it is not a TrainerState.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        serde_json::from_str(&text).map_err(|e| Error::BadCheckpoint { file: path.into(), problem: e.to_string() })
    }

    /// The training-loss entries (`loss` logged at `step`), in order: what the loss curve
    /// plots.
    pub fn loss_curve(&self) -> Vec<(u64, f64)> {
        self.log_history.iter().filter_map(|e| e.get("loss").map(|l| (e.step, l))).collect()
    }

    /// The evaluation-loss entries (`eval_loss` at `step`), in order.
    pub fn eval_loss_curve(&self) -> Vec<(u64, f64)> {
        self.log_history.iter().filter_map(|e| e.get("eval_loss").map(|l| (e.step, l))).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_entries_serialise_flat_with_transformers_keys() {
        let e = LogEntry::new(10, 0.5, [("loss", 0.25), ("learning_rate", 1e-3)]);
        let json = serde_json::to_string(&e).unwrap();
        assert_eq!(json, r#"{"learning_rate":0.001,"loss":0.25,"epoch":0.5,"step":10}"#);
        assert_eq!(serde_json::from_str::<LogEntry>(&json).unwrap(), e);
    }

    #[test]
    fn state_round_trips_through_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = TrainerState { global_step: 3, best_metric: Some(0.1), ..Default::default() };
        s.log_history.push(LogEntry::new(1, 0.1, [("loss", 2.0)]));
        s.log_history.push(LogEntry::new(3, 0.3, [("eval_loss", 1.5)]));
        let p = dir.path().join("trainer_state.json");
        s.save(&p).unwrap();
        let back = TrainerState::load(&p).unwrap();
        assert_eq!(back, s);
        assert_eq!(back.loss_curve(), vec![(1, 2.0)]);
        assert_eq!(back.eval_loss_curve(), vec![(3, 1.5)]);
        let text = std::fs::read_to_string(&p).unwrap();
        for key in ["\"log_history\"", "\"global_step\"", "\"best_metric\"", "\"best_model_checkpoint\"", "\"epoch\""] {
            assert!(text.contains(key), "{key} missing in {text}");
        }
    }
}
