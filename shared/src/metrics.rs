//! The figures a run reports: printed for people, written as JSON (`--metrics-json`) for the
//! bench and the tests.

use crate::Result;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// One run's figures. Every training binary writes this (rank 0 only under several ranks).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// Test accuracy as a fraction in [0, 1] over `eval_samples` images.
    pub accuracy: f64,
    /// Number of test images evaluated (10,000 for the full MNIST test set at any world size).
    pub eval_samples: u64,
    /// Mean negative log-likelihood over the evaluated test images.
    pub test_loss: f64,
    /// Mean training loss over the last epoch's steps (rank 0's batches... averaged over ranks
    /// under several ranks).
    pub train_loss: f64,
    /// Training samples per second over all ranks (train loop only; excludes loading and eval).
    pub samples_per_s: f64,
    /// Wall-clock seconds of the whole run, from start-up to the end of evaluation.
    pub wall_s: f64,
    /// Peak resident set size in MiB (`VmHWM`); under several ranks, the maximum over ranks.
    pub peak_rss_mib: f64,
    /// Optimizer steps taken (per rank).
    pub steps: u64,
    /// Number of ranks.
    pub world_size: usize,
    /// `single`, `ddp`, `fsdp-full-shard`, … — how the model was replicated.
    pub strategy: String,
    /// Per-rank figures (empty for a single process).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ranks: Vec<RankFigures>,
}

/// What one rank measured.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RankFigures {
    /// The rank.
    pub rank: usize,
    /// Peak resident set size of this rank's process, MiB.
    pub peak_rss_mib: f64,
    /// Training samples per second this rank processed.
    pub samples_per_s: f64,
    /// Seconds this rank spent inside collectives during training.
    pub comm_s: f64,
    /// Seconds of the training loop on this rank.
    pub train_s: f64,
    /// Persistent model-state bytes on this rank (parameters, gradients, optimizer state).
    #[serde(default)]
    pub model_state: crate::memory::ModelStateBytes,
}

impl Report {
    /// Writes the report as pretty JSON to `path`, atomically (temp file + rename).
    ///
    /// # Errors
    /// [`Error::Io`] naming `path`.
    pub fn write_json(&self, path: &Path) -> Result<()> {
        let json = serde_json::to_string_pretty(self).expect("Report serialises");
        crate::atomic::write_atomic(path, json.as_bytes())
    }

    /// The human summary the binaries print at the end.
    pub fn summary(&self) -> String {
        format!(
            "Test set: Average loss: {:.4}, Accuracy: {}/{} ({:.2}%)\ntrain loss {:.4} | {:.0} samples/s | wall {:.1} s | peak RSS {:.0} MiB | world size {} | {}",
            self.test_loss,
            (self.accuracy * self.eval_samples as f64).round() as u64,
            self.eval_samples,
            100.0 * self.accuracy,
            self.train_loss,
            self.samples_per_s,
            self.wall_s,
            self.peak_rss_mib,
            self.world_size,
            self.strategy
        )
    }
}
