//! The figures a run reports: printed for people, written as JSON (`--metrics-json`) for the
//! bench and the tests.

use crate::timing::{PhaseTimes, RssScope, StepTiming};
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
    /// Training samples per second over all ranks: the timed steps' samples (warm-up steps
    /// excluded, see [`crate::timing`]) over the slowest rank's timed interval; over the whole
    /// train loop when no step was timed. Excludes loading and evaluation.
    pub samples_per_s: f64,
    /// Wall-clock seconds of the whole run, from start-up to the end of evaluation.
    pub wall_s: f64,
    /// Peak resident set size of the whole process in MiB (`VmHWM`, data loading included);
    /// under several ranks, the maximum over ranks.
    pub peak_rss_mib: f64,
    /// Peak resident set size of the training steps alone in MiB (the most any step held, see
    /// [`crate::timing::StepTiming::train_peak_rss_mib`]); the maximum over ranks.
    #[serde(default)]
    pub train_peak_rss_mib: f64,
    /// On CUDA, the caching allocator's peak of allocated bytes over the training steps, MiB
    /// (`torch.cuda.max_memory_allocated`, see
    /// [`crate::timing::StepTiming::train_cuda_peak_mib`]); the maximum over ranks; 0 on CPU.
    #[serde(default)]
    pub cuda_peak_mib: f64,
    /// Training samples over all ranks and steps (warm-up included).
    #[serde(default)]
    pub samples: u64,
    /// Step figures of the slowest rank (the largest timed interval): step p50/p95, time to
    /// first step, phases, communication per step. Per-rank ones are in `ranks`.
    #[serde(default)]
    pub timing: StepTiming,
    /// Optimizer steps taken (per rank).
    pub steps: u64,
    /// Number of ranks.
    pub world_size: usize,
    /// `single`, `ddp`, `zero1`, `fsdp-full-shard`, … — how the model was replicated
    /// ([`crate::parallel::Strategy::label`]).
    pub strategy: String,
    /// Per-rank figures (empty for a single process).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ranks: Vec<RankFigures>,
    /// Per-epoch figures, in order; the top-level figures are the last epoch's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub history: Vec<EpochFigures>,
    /// What a level adds (level 2: `mixed_precision`, `gradient_accumulation_steps`,
    /// `num_processes`; level 3: `output_dir`), written as top-level fields.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
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
    /// This rank's step figures.
    #[serde(default)]
    pub timing: StepTiming,
}

/// One epoch's figures (the tutorial's per-epoch `test()`), the same on every rank.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct EpochFigures {
    /// The epoch, from 1.
    pub epoch: usize,
    /// Optimizer steps taken in the epoch (fewer than a full epoch's when --max-steps ended it).
    pub steps: usize,
    /// Mean training loss over the epoch's steps, averaged over ranks.
    pub train_loss: f64,
    /// Mean test loss after the epoch.
    pub test_loss: f64,
    /// Test accuracy after the epoch, a fraction in [0, 1].
    pub accuracy: f64,
    /// Test images evaluated (10,000 at any world size).
    pub eval_samples: u64,
}

impl EpochFigures {
    /// The epoch's line: `Epoch 1: mean train loss 0.2169 over 469 steps`.
    pub fn train_line(&self) -> String {
        format!("Epoch {}: mean train loss {:.4} over {} steps", self.epoch, self.train_loss, self.steps)
    }

    /// The tutorial's test line: `Test set: Average loss: 0.0503, Accuracy: 9831/10000 (98.31%)`;
    /// `Test set: not evaluated` when no image was (evaluation skipped).
    pub fn test_line(&self) -> String {
        if self.eval_samples == 0 {
            return "Test set: not evaluated".into();
        }
        format!(
            "Test set: Average loss: {:.4}, Accuracy: {}/{} ({:.2}%)",
            self.test_loss,
            (self.accuracy * self.eval_samples as f64).round() as u64,
            self.eval_samples,
            100.0 * self.accuracy
        )
    }
}

/// What one rank measured during a run, before [`gather_report`] collects every rank's.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LocalFigures {
    /// Training samples this rank processed.
    pub samples: u64,
    /// Seconds of this rank's training loop (excluding loading and evaluation).
    pub train_s: f64,
    /// This rank's mean training loss over the last epoch's steps.
    pub train_loss: f64,
    /// Seconds this rank spent inside collectives during training.
    pub comm_s: f64,
    /// Persistent model-state bytes on this rank.
    pub model_state: crate::memory::ModelStateBytes,
    /// This rank's step figures ([`crate::timing::StepTimer::finish`]; default when untimed).
    pub timing: StepTiming,
}

/// Gathers every rank's [`LocalFigures`] (one all-gather; every rank calls it) into the run's
/// [`Report`]: training loss averaged over ranks, samples/s over all ranks against the slowest
/// rank's loop time, peak RSS the maximum over ranks (each rank's own `VmHWM`, read here), and
/// the per-rank figures. `extra` is left empty for the level to fill.
///
/// # Errors
/// Collective errors.
pub fn gather_report(
    pg: &dyn crate::dist::ProcessGroup,
    local: &LocalFigures,
    eval: &crate::eval::EvalSums,
    steps: u64,
    strategy: &str,
    wall_s: f64,
) -> Result<Report> {
    use tch::{Device, Kind, Tensor};
    let world_size = pg.world_size();
    let peak_rss_mib = crate::memory::peak_rss_bytes().map(crate::memory::mib).unwrap_or(0.0);
    let m = local.model_state;
    let mine = [
        peak_rss_mib,
        local.samples as f64,
        local.comm_s,
        local.train_s,
        local.train_loss,
        m.parameters as f64,
        m.gradients as f64,
        m.optimizer as f64,
        m.gathered_peak as f64,
        m.optimizer_on_disk as f64,
    ];
    let t = &local.timing;
    let p = &t.phases;
    let rss_scope = match t.rss_scope {
        RssScope::None => 0.0,
        RssScope::ClearRefs => 1.0,
        RssScope::Sampled => 2.0,
    };
    let timing = [
        t.steps as f64,
        t.warmup_steps as f64,
        t.timed_steps as f64,
        t.samples as f64,
        t.timed_samples as f64,
        t.steps_s,
        t.timed_s,
        t.first_step_s,
        t.step_p50_s,
        t.step_p95_s,
        p.data_s,
        p.forward_s,
        p.backward_s,
        p.comm_s,
        p.optimizer_s,
        t.comm_bytes_per_step,
        t.train_peak_rss_mib,
        rss_scope,
        t.train_start_rss_mib,
        t.train_cuda_peak_mib,
        t.train_cuda_start_mib,
    ];
    let mine: Vec<f64> = mine.into_iter().chain(timing).collect();
    const N: usize = 10 + 21;
    let mut all = Tensor::zeros([(world_size * N) as i64], (Kind::Double, pg.device()));
    pg.all_gather(&mut all, &Tensor::from_slice(&mine).to_device(pg.device()))?;
    let all = Vec::<f64>::try_from(all.to_device(Device::Cpu)).map_err(crate::Error::Torch)?;
    let ranks: Vec<RankFigures> = all
        .chunks(N)
        .enumerate()
        .map(|(r, f)| (r, f, timing_of(&f[10..])))
        .map(|(r, f, timing)| RankFigures {
            rank: r,
            peak_rss_mib: f[0],
            samples_per_s: if timing.timed_steps > 0 { timing.samples_per_s() } else { f[1] / f[3].max(1e-9) },
            comm_s: f[2],
            train_s: f[3],
            model_state: crate::memory::ModelStateBytes {
                parameters: f[5] as u64,
                gradients: f[6] as u64,
                optimizer: f[7] as u64,
                gathered_peak: f[8] as u64,
                optimizer_on_disk: f[9] as u64,
            },
            timing,
        })
        .collect();
    let slowest = ranks.iter().map(|r| r.train_s).fold(0.0, f64::max);
    let samples: f64 = all.chunks(N).map(|f| f[1]).sum();
    // Throughput over the timed steps when every rank timed some (warm-up excluded).
    let timed = ranks.iter().all(|r| r.timing.timed_steps > 0);
    let slowest_timed = ranks.iter().max_by(|a, b| a.timing.timed_s.total_cmp(&b.timing.timed_s)).map(|r| r.timing).unwrap_or_default();
    let samples_per_s = if timed {
        ranks.iter().map(|r| r.timing.timed_samples as f64).sum::<f64>() / slowest_timed.timed_s.max(1e-9)
    } else {
        samples / slowest.max(1e-9)
    };
    Ok(Report {
        accuracy: eval.accuracy(),
        eval_samples: eval.count as u64,
        test_loss: eval.mean_loss(),
        train_loss: all.chunks(N).map(|f| f[4]).sum::<f64>() / world_size as f64,
        samples_per_s,
        wall_s,
        peak_rss_mib: ranks.iter().map(|r| r.peak_rss_mib).fold(0.0, f64::max),
        train_peak_rss_mib: ranks.iter().map(|r| r.timing.train_peak_rss_mib).fold(0.0, f64::max),
        cuda_peak_mib: ranks.iter().map(|r| r.timing.train_cuda_peak_mib).fold(0.0, f64::max),
        samples: samples as u64,
        timing: slowest_timed,
        steps,
        world_size,
        strategy: strategy.into(),
        ranks,
        history: Vec::new(),
        extra: serde_json::Map::new(),
    })
}

/// The [`StepTiming`] of one rank's gathered figures (the order `gather_report` packs them in).
fn timing_of(f: &[f64]) -> StepTiming {
    StepTiming {
        steps: f[0] as u64,
        warmup_steps: f[1] as u64,
        timed_steps: f[2] as u64,
        samples: f[3] as u64,
        timed_samples: f[4] as u64,
        steps_s: f[5],
        timed_s: f[6],
        first_step_s: f[7],
        step_p50_s: f[8],
        step_p95_s: f[9],
        phases: PhaseTimes { data_s: f[10], forward_s: f[11], backward_s: f[12], comm_s: f[13], optimizer_s: f[14] },
        comm_bytes_per_step: f[15],
        train_peak_rss_mib: f[16],
        rss_scope: match f[17] as u8 {
            1 => RssScope::ClearRefs,
            2 => RssScope::Sampled,
            _ => RssScope::None,
        },
        train_start_rss_mib: f[18],
        train_cuda_peak_mib: f[19],
        train_cuda_start_mib: f[20],
    }
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

    /// The human summary printed at the end by a binary that has not printed the test line
    /// itself: the tutorial's test line, then [`figures_line`](Self::figures_line).
    pub fn summary(&self) -> String {
        let test =
            EpochFigures { test_loss: self.test_loss, accuracy: self.accuracy, eval_samples: self.eval_samples, ..Default::default() };
        format!("{}\n{}", test.test_line(), self.figures_line())
    }

    /// `train loss 0.2169 | 1328 samples/s | wall 49.5 s | peak RSS 973 MiB | world size 2 | ddp`.
    pub fn figures_line(&self) -> String {
        format!(
            "train loss {:.4} | {:.0} samples/s | wall {:.1} s | peak RSS {:.0} MiB | world size {} | {}",
            self.train_loss, self.samples_per_s, self.wall_s, self.peak_rss_mib, self.world_size, self.strategy
        )
    }
}

/// The end of every training binary's `main`: on success, rank 0 (or a single process) prints
/// `line(&report)`; on failure, the error goes to stderr as `error: …`, named by rank when
/// several ranks run (`error on rank 1 of 2: …`). Returns the process's exit code: 0, 1, or
/// [`crate::preempt::PREEMPTED_EXIT_CODE`] (143) for a run stopped by SIGTERM after writing
/// its checkpoint (its message printed by rank 0 alone).
pub fn finish<E: std::fmt::Display>(result: std::result::Result<Report, E>, line: impl Fn(&Report) -> String) -> std::process::ExitCode {
    let env = crate::dist::DistEnv::from_env().ok();
    match result {
        Ok(report) => {
            if env.as_ref().is_none_or(|e| e.rank == 0) {
                println!("{}", line(&report));
            }
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            let rank0 = env.as_ref().is_none_or(|e| e.rank == 0);
            let text = match env.filter(|e| e.world_size > 1) {
                Some(env) => format!("error on rank {} of {}: {e}\n", env.rank, env.world_size),
                None => format!("error: {e}\n"),
            };
            // One write: ranks printing at the same moment (an error every rank returns) must
            // not interleave their lines in the launcher's output.
            use std::io::Write;
            if crate::preempt::saved() {
                // Stopped on SIGTERM with its checkpoint written: not a failure; said once.
                if rank0 {
                    let _ = std::io::stderr().lock().write_all(format!("{e}\n").as_bytes());
                }
                return std::process::ExitCode::from(crate::preempt::PREEMPTED_EXIT_CODE as u8);
            }
            let _ = std::io::stderr().lock().write_all(text.as_bytes());
            std::process::ExitCode::FAILURE
        }
    }
}
