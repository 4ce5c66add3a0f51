//! Reading a run's figures leniently: the levels' `--metrics-json` (`ladder_core::metrics::Report`,
//! which may gain fields) and the PyTorch peers' one JSON line both parse into [`RunFigures`];
//! absent fields read as zero/empty, unknown ones are ignored.

use crate::error::{Error, Result};
pub use ladder_core::timing::{PhaseTimes, RssScope, StepTiming};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// One run's figures, as the bench uses them. Field meanings follow
/// `ladder_core::metrics::Report`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RunFigures {
    /// Test accuracy, fraction in [0, 1].
    #[serde(deserialize_with = "nan_if_null")]
    pub accuracy: f64,
    /// Test images evaluated (10,000 for MNIST at any world size).
    pub eval_samples: u64,
    /// Mean test NLL.
    #[serde(deserialize_with = "nan_if_null")]
    pub test_loss: f64,
    /// Mean training loss of the last epoch.
    #[serde(deserialize_with = "nan_if_null")]
    pub train_loss: f64,
    /// Training samples/s over all ranks (train loop only).
    #[serde(deserialize_with = "nan_if_null")]
    pub samples_per_s: f64,
    /// Wall seconds the run measured itself (start-up to end of evaluation).
    #[serde(deserialize_with = "nan_if_null")]
    pub wall_s: f64,
    /// Peak RSS of the whole process, MiB (max over ranks).
    #[serde(deserialize_with = "nan_if_null")]
    pub peak_rss_mib: f64,
    /// Peak RSS of the training phase alone, MiB (max over ranks; 0 when not measured).
    #[serde(deserialize_with = "nan_if_null")]
    pub train_peak_rss_mib: f64,
    /// Training samples over all ranks and steps (warm-up included).
    pub samples: u64,
    /// Step figures of the slowest rank (`ladder_core::timing::StepTiming`; zero when absent).
    pub timing: StepTiming,
    /// Optimizer steps per rank.
    pub steps: u64,
    /// Ranks.
    pub world_size: usize,
    /// `single`, `ddp`, `fsdp-full-shard`, … (empty for the PyTorch peers).
    pub strategy: String,
    /// Per-rank figures (empty for one process and for the peers).
    pub ranks: Vec<RankFigures>,
    /// The tuned PyTorch peer's start-up choice (`fused AdamW, channels_last, …`; empty for
    /// every other run).
    pub tuned: String,
    /// The optimizer's moments on disk: what rank 0 streamed per step (absent otherwise).
    pub offload_optimizer: Option<OptimizerOffloadFigures>,
}

/// A level's `offload_optimizer` entry (DeepSpeed's optimizer offload to nvme), as the bench
/// reads it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct OptimizerOffloadFigures {
    /// Rank 0's mean per step over the run: bytes read and written, seconds streaming.
    pub per_step: ladder_core::optim::OffloadStats,
}

/// What one rank measured (`ladder_core::metrics::RankFigures`, leniently).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RankFigures {
    /// The rank.
    pub rank: usize,
    /// Peak RSS of this rank's process, MiB (whole-process high-water mark).
    #[serde(deserialize_with = "nan_if_null")]
    pub peak_rss_mib: f64,
    /// Training samples/s of this rank.
    #[serde(deserialize_with = "nan_if_null")]
    pub samples_per_s: f64,
    /// Seconds inside collectives during training.
    #[serde(deserialize_with = "nan_if_null")]
    pub comm_s: f64,
    /// Seconds of the training loop.
    #[serde(deserialize_with = "nan_if_null")]
    pub train_s: f64,
    /// Persistent model-state bytes on this rank.
    pub model_state: ModelState,
    /// This rank's step figures.
    pub timing: StepTiming,
}

/// Model-state bytes per rank (`ladder_core::memory::ModelStateBytes`, leniently).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ModelState {
    /// Parameter bytes held persistently (a shard under FSDP).
    pub parameters: u64,
    /// Gradient bytes.
    pub gradients: u64,
    /// Optimizer-state bytes (AdamW: 2 × parameters).
    pub optimizer: u64,
    /// Peak bytes of parameters gathered transiently (FSDP), 0 for DDP.
    pub gathered_peak: u64,
}

impl ModelState {
    /// Parameters + gradients + optimizer state + gathered peak, bytes.
    pub fn total(&self) -> u64 {
        self.parameters + self.gradients + self.optimizer + self.gathered_peak
    }
}

/// An f64 that may be `null`: serde_json writes NaN and ±inf as `null` (a diverged run's loss).
fn nan_if_null<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

impl RunFigures {
    /// Parses a report's JSON text; `path` names it in errors.
    ///
    /// # Errors
    /// [`Error::Json`] naming `path`.
    pub fn parse(text: &str, path: &Path) -> Result<Self> {
        serde_json::from_str(text).map_err(|source| Error::Json { path: path.to_path_buf(), source })
    }

    /// Reads a `--metrics-json` file.
    ///
    /// # Errors
    /// [`Error::Io`] / [`Error::Json`] naming `path`.
    pub fn read(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(Error::io(path))?;
        Self::parse(&text, path)
    }

    /// The share of the training loop spent in collectives: max over ranks of comm_s / train_s
    /// (`None` without per-rank figures).
    pub fn comm_share(&self) -> Option<f64> {
        self.ranks.iter().filter(|r| r.train_s > 0.0).map(|r| r.comm_s / r.train_s).reduce(f64::max)
    }

    /// Peak RSS per rank, MiB, in rank order (one entry for a single process).
    pub fn peak_rss_per_rank(&self) -> Vec<f64> {
        if self.ranks.is_empty() {
            vec![self.peak_rss_mib]
        } else {
            self.ranks.iter().map(|r| r.peak_rss_mib).collect()
        }
    }

    /// Training-phase peak RSS per rank, MiB, in rank order (one entry for a single process;
    /// empty when the run did not measure it).
    pub fn train_peak_rss_per_rank(&self) -> Vec<f64> {
        let v: Vec<f64> = if self.ranks.is_empty() {
            vec![self.train_peak_rss_mib]
        } else {
            self.ranks.iter().map(|r| r.timing.train_peak_rss_mib).collect()
        };
        if v.iter().all(|&m| m > 0.0) {
            v
        } else {
            Vec::new()
        }
    }

    /// What training added to each rank's RSS, MiB: the training-phase peak less the RSS when
    /// training started, in rank order (empty when the run did not measure both).
    pub fn train_rss_growth_per_rank(&self) -> Vec<f64> {
        let timings: Vec<StepTiming> =
            if self.ranks.is_empty() { vec![self.timing] } else { self.ranks.iter().map(|r| r.timing).collect() };
        if timings.iter().all(|t| t.train_peak_rss_mib > 0.0 && t.train_start_rss_mib > 0.0) {
            timings.iter().map(|t| (t.train_peak_rss_mib - t.train_start_rss_mib).max(0.0)).collect()
        } else {
            Vec::new()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_level_report_with_unknown_and_missing_fields() {
        let text = r#"{"accuracy":0.98,"eval_samples":10000,"samples_per_s":1300.0,
            "world_size":2,"strategy":"ddp","new_field":{"x":1},
            "test_loss":null,"ranks":[{"rank":0,"peak_rss_mib":900.0,"comm_s":1.0,"train_s":10.0},
                     {"rank":1,"peak_rss_mib":910.0,"comm_s":2.0,"train_s":10.0,"model_state":{"parameters":4}}]}"#;
        let f = RunFigures::parse(text, Path::new("m.json")).unwrap();
        assert_eq!((f.eval_samples, f.world_size, f.steps), (10_000, 2, 0));
        assert_eq!(f.comm_share(), Some(0.2));
        assert_eq!(f.peak_rss_per_rank(), vec![900.0, 910.0]);
        assert_eq!(f.ranks[1].model_state.parameters, 4);
        assert!(f.test_loss.is_nan(), "null (NaN written by serde_json) reads as NaN");
    }

    #[test]
    fn a_bad_file_is_named() {
        let e = RunFigures::parse(r#"{"accuracy": "high"}"#, Path::new("runs/x.json")).unwrap_err().to_string();
        assert!(e.starts_with("runs/x.json: not a run report"), "{e}");
    }
}
