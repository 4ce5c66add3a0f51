//! A cell's repeats turned into its row: spreads over repeats, ratios to the PyTorch peer
//! (repeat by repeat) and within the run (level 2/3 over level 1, FSDP over DDP, bf16 over fp32).

use super::case::Case;
use crate::figures::{ModelState, PhaseTimes, RunFigures, StepTiming};
use crate::stats::Spread;
use ladder_core::parallel::Precision;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// A matrix cell's figures over its repeats.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Row {
    /// The cell.
    pub case: Case,
    /// Errors of failed repeats (the row still shows the repeats that ran).
    pub errors: Vec<String>,
    /// Training samples/s over all ranks, per repeat.
    pub samples_per_s: Option<Spread>,
    /// The PyTorch twin's samples/s, per repeat.
    pub peer_samples_per_s: Option<Spread>,
    /// Ours / PyTorch, per repeat pair (same repeat = minutes apart).
    pub ratio: Option<Spread>,
    /// This level's median samples/s over level 1's at the same strategy, world size, width and
    /// precision (levels 2 and 3).
    pub vs_level1: Option<f64>,
    /// This FSDP strategy's median samples/s over DDP's at the same level, world size, width and
    /// precision.
    #[serde(default)]
    pub vs_ddp: Option<f64>,
    /// Median test accuracy (fraction).
    pub accuracy: Option<f64>,
    /// The peer's median test accuracy.
    pub peer_accuracy: Option<f64>,
    /// Test images evaluated (the last successful repeat's).
    pub eval_samples: Option<u64>,
    /// Median mean test NLL.
    pub test_loss: Option<f64>,
    /// Median over repeats of the max over ranks of comm_s / train_s.
    pub comm_share: Option<f64>,
    /// Rank 0's model-state bytes (the last successful repeat's).
    pub model_state: Option<ModelState>,
    /// With the optimizer's moments on disk, rank 0's mean traffic per step (the last
    /// successful repeat's).
    #[serde(default)]
    pub offload_per_step: Option<ladder_core::optim::OffloadStats>,
    /// Peak RSS per rank, MiB: per rank, the max over repeats (whole-process high-water mark).
    pub peak_rss_per_rank: Vec<f64>,
    /// Wall seconds per run (launch to exit), per repeat.
    pub wall_s: Option<Spread>,
    /// Training-phase peak RSS per rank, MiB (the most any training step held,
    /// `ladder_core::timing`): per rank, the max over repeats (empty when not measured).
    #[serde(default)]
    pub train_peak_rss_per_rank: Vec<f64>,
    /// The peer's training-phase peak RSS, MiB (max over its ranks and repeats).
    #[serde(default)]
    pub peer_train_peak_rss_mib: Option<f64>,
    /// The peer's whole-process peak RSS, MiB (max over its ranks and repeats).
    #[serde(default)]
    pub peer_peak_rss_mib: Option<f64>,
    /// Step figures (the slowest rank's), medians over repeats.
    #[serde(default)]
    pub step: Option<StepFigures>,
    /// The peer's step figures, medians over repeats.
    #[serde(default)]
    pub peer_step: Option<StepFigures>,
    /// This bf16 cell's median samples/s over the fp32 cell's at the same level, strategy,
    /// world size and width.
    #[serde(default)]
    pub vs_fp32: Option<f64>,
    /// What training added to each rank's RSS, MiB: per rank, the max over repeats of the
    /// training-phase peak less the RSS when training started (empty when not measured).
    #[serde(default)]
    pub train_rss_growth_per_rank: Vec<f64>,
    /// Median over repeats of the largest per-rank training RSS growth, MiB.
    #[serde(default)]
    pub train_rss_growth_median: Option<f64>,
    /// The largest per-rank training RSS growth over repeats, MiB: median (as
    /// [`train_rss_growth_median`](Self::train_rss_growth_median)), min and max — how far one
    /// run's figure may lie from another's.
    #[serde(default)]
    pub train_rss_growth: Option<Spread>,
    /// The tuned PyTorch peer's samples/s, per repeat (`bench/reference/tuned.py`).
    #[serde(default)]
    pub tuned_samples_per_s: Option<Spread>,
    /// Ours / the tuned peer, per repeat pair.
    #[serde(default)]
    pub tuned_ratio: Option<Spread>,
    /// The tuned peer's median test accuracy.
    #[serde(default)]
    pub tuned_accuracy: Option<f64>,
    /// What the tuned peer chose at start-up (its last successful repeat's `tuned` field, e.g.
    /// `fused AdamW, channels_last`).
    #[serde(default)]
    pub tuned_choice: Option<String>,
    /// Median over repeats of the largest per-rank whole-process peak RSS, MiB.
    #[serde(default)]
    pub peak_rss_median: Option<f64>,
    /// This FSDP strategy's [`train_rss_growth_median`](Self::train_rss_growth_median) over
    /// DDP's at the same level, world size, width and precision.
    #[serde(default)]
    pub vs_ddp_rss_growth: Option<f64>,
    /// This FSDP strategy's [`peak_rss_median`](Self::peak_rss_median) over DDP's at the same
    /// level, world size, width and precision.
    #[serde(default)]
    pub vs_ddp_peak_rss: Option<f64>,
    /// The estimator's expected training-phase peak RSS growth, MiB (the largest rank's;
    /// [`estimate_growth_mib`]).
    #[serde(default)]
    pub estimate_mib: Option<f64>,
}

impl Row {
    /// [`estimate_mib`](Self::estimate_mib), or computed from the cell when the row was read
    /// from a report written before the estimator (the CPU's bf16 unit not known).
    pub fn estimated_growth_mib(&self) -> Option<f64> {
        self.estimate_mib.or_else(|| estimate_growth_mib(&self.case, false))
    }
}

/// What `ladder_core::memory::estimate` expects a cell's training phase to add to a rank's
/// RSS, MiB (the largest rank's): the cell's strategy (ZeRO-1 among DDP's), world size, width,
/// precision, batch size, activation checkpointing, CPU offload and optimizer offload, FSDP with
/// one unit per layer (`--fsdp-min-num-params 0`, as the bench runs it); `this_machine`: with
/// this machine's bf16 unit and the environment's `THP_MEM_ALLOC_ENABLE` (a run's cells), else
/// with the levels' default huge pages and the larger bf16 factor (a report read back). The
/// single-process baseline is estimated as DDP at W = 1 (the same tensors, less one bucket's
/// copy).
pub fn estimate_growth_mib(case: &Case, this_machine: bool) -> Option<f64> {
    use ladder_core::parallel::Strategy;
    let strategy = match case.strategy {
        super::case::Replication::Single => Strategy::default(),
        super::case::Replication::Parallel(Strategy::Fsdp(o)) => {
            Strategy::Fsdp(ladder_core::parallel::FsdpOptions { min_num_params: 0, offload_params: case.cpu_offload, ..o })
        }
        super::case::Replication::Parallel(s) => s,
    };
    let wrap = ladder_core::parallel::WrapConfig {
        strategy,
        mixed_precision: case.precision,
        activation_checkpointing: case.activation_checkpointing,
    };
    let input = ladder_core::memory::estimate::EstimateInput {
        wrap,
        world_size: case.world_size,
        width: case.width,
        batch_size: case.batch_size,
        offload_optimizer: case.offload_optimizer,
        // The measured peak is the steps' (ladder_core::timing): level 3's checkpoint-N, written
        // after the last step, is not in it.
        save_checkpoint: false,
        // The cells run on this machine with the bench's environment (its THP_MEM_ALLOC_ENABLE,
        // if any); a report read back assumes the levels' defaults and the larger bf16 factor.
        cpu_bf16: if this_machine { ladder_core::device::CpuBf16Unit::of_this_machine() } else { None },
        huge_pages: this_machine.then(|| ladder_core::device::huge_pages_for(ladder_core::model::BasicNet::param_bytes(case.width))),
    };
    let ranks = ladder_core::memory::estimate::estimate(&input).ok()?;
    ranks.iter().map(|r| r.peak_growth).max().map(ladder_core::memory::mib)
}

/// A cell's step figures, each the median over repeats of the run's slowest rank's: seconds,
/// bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct StepFigures {
    /// Median step time over the timed steps, seconds.
    pub step_p50_s: f64,
    /// 95th-percentile step time, seconds.
    pub step_p95_s: f64,
    /// Time from the start of training to the end of the first step, seconds.
    pub first_step_s: f64,
    /// Mean seconds per step by phase (data, forward, backward without communication,
    /// communication, optimizer).
    pub phases: PhaseTimes,
    /// Mean communication payload bytes per step.
    pub comm_bytes_per_step: f64,
    /// Timed steps per run (the last repeat's).
    pub timed_steps: u64,
}

impl StepFigures {
    /// Medians over `runs` of their step figures; `None` when no run timed a step.
    pub fn median_of(runs: &[&RunFigures]) -> Option<StepFigures> {
        let timed: Vec<&StepTiming> = runs.iter().map(|f| &f.timing).filter(|t| t.timed_steps > 0).collect();
        let last = timed.last()?;
        let med = |g: &dyn Fn(&StepTiming) -> f64| Spread::of(&timed.iter().map(|t| g(t)).collect::<Vec<_>>()).map_or(0.0, |s| s.median);
        Some(StepFigures {
            step_p50_s: med(&|t| t.step_p50_s),
            step_p95_s: med(&|t| t.step_p95_s),
            first_step_s: med(&|t| t.first_step_s),
            phases: PhaseTimes {
                data_s: med(&|t| t.phases.data_s),
                forward_s: med(&|t| t.phases.forward_s),
                backward_s: med(&|t| t.phases.backward_s),
                comm_s: med(&|t| t.phases.comm_s),
                optimizer_s: med(&|t| t.phases.optimizer_s),
            },
            comm_bytes_per_step: med(&|t| t.comm_bytes_per_step),
            timed_steps: last.timed_steps,
        })
    }
}

/// Our runs per cell id, one entry per repeat: figures and bench-measured wall seconds, or the error.
pub type Ours = BTreeMap<String, Vec<std::result::Result<(RunFigures, f64), String>>>;

/// The peers' runs per peer id, one entry per repeat.
pub type Theirs = BTreeMap<String, Vec<std::result::Result<RunFigures, String>>>;

/// Turns every cell's repeats into its row: spreads, ratios (repeat by repeat), level ratios.
pub fn aggregate(cases: &[Case], ours: &Ours, theirs: &Theirs) -> Vec<Row> {
    // The largest of a measured per-rank list (`None` when it is empty: not measured).
    let max_of = |v: &[f64]| v.iter().copied().reduce(f64::max);
    let mut rows: Vec<Row> = cases
        .iter()
        .map(|case| {
            let runs = ours.get(&case.id).map(Vec::as_slice).unwrap_or(&[]);
            let peer_runs = case.peer.and_then(|p| theirs.get(&p.id())).map(Vec::as_slice).unwrap_or(&[]);
            let ok: Vec<&(RunFigures, f64)> = runs.iter().filter_map(|r| r.as_ref().ok()).collect();
            let peer_ok: Vec<&RunFigures> = peer_runs.iter().filter_map(|r| r.as_ref().ok()).collect();
            let mut errors: Vec<String> = runs.iter().filter_map(|r| r.as_ref().err().cloned()).collect();
            errors.extend(peer_runs.iter().filter_map(|r| r.as_ref().err().map(|e| format!("PyTorch peer: {e}"))));
            let tuned_runs = case.tuned_peer.and_then(|p| theirs.get(&p.id())).map(Vec::as_slice).unwrap_or(&[]);
            let tuned_ok: Vec<&RunFigures> = tuned_runs.iter().filter_map(|r| r.as_ref().ok()).collect();
            errors.extend(tuned_runs.iter().filter_map(|r| r.as_ref().err().map(|e| format!("tuned PyTorch peer: {e}"))));
            let ratios = ratios_by_repeat(runs, peer_runs);
            let med = |v: Vec<f64>| Spread::of(&v).map(|s| s.median);
            let last = ok.last().map(|(f, _)| f);
            let per_rank_max = |get: &dyn Fn(&RunFigures) -> Vec<f64>| {
                let mut peak: Vec<f64> = Vec::new();
                for (f, _) in &ok {
                    for (i, m) in get(f).into_iter().enumerate() {
                        if i < peak.len() {
                            peak[i] = peak[i].max(m);
                        } else {
                            peak.push(m);
                        }
                    }
                }
                peak
            };
            let peak = per_rank_max(&RunFigures::peak_rss_per_rank);
            let train_peak = per_rank_max(&RunFigures::train_peak_rss_per_rank);
            let growth = per_rank_max(&RunFigures::train_rss_growth_per_rank);
            // The largest rank's growth per repeat: a measured 0 counts (FULL_SHARD at its best),
            // an unmeasured one does not.
            let largest = Spread::of(&ok.iter().filter_map(|(f, _)| max_of(&f.train_rss_growth_per_rank())).collect::<Vec<_>>());
            let peer_max = |get: &dyn Fn(&RunFigures) -> f64| peer_ok.iter().map(|f| get(f)).filter(|&m| m > 0.0).reduce(f64::max);
            Row {
                case: case.clone(),
                errors,
                samples_per_s: Spread::of(&ok.iter().map(|(f, _)| f.samples_per_s).collect::<Vec<_>>()),
                peer_samples_per_s: Spread::of(&peer_ok.iter().map(|f| f.samples_per_s).collect::<Vec<_>>()),
                ratio: Spread::of(&ratios),
                vs_level1: None,
                vs_ddp: None,
                accuracy: med(ok.iter().map(|(f, _)| f.accuracy).collect()),
                peer_accuracy: med(peer_ok.iter().map(|f| f.accuracy).collect()),
                eval_samples: last.map(|f| f.eval_samples),
                test_loss: med(ok.iter().map(|(f, _)| f.test_loss).collect()),
                comm_share: med(ok.iter().filter_map(|(f, _)| f.comm_share()).collect()),
                model_state: last.and_then(|f| f.ranks.first()).map(|r| r.model_state),
                offload_per_step: last.and_then(|f| f.offload_optimizer).map(|o| o.per_step),
                peak_rss_per_rank: peak,
                wall_s: Spread::of(&ok.iter().map(|(_, w)| *w).collect::<Vec<_>>()),
                train_peak_rss_per_rank: train_peak,
                peer_train_peak_rss_mib: peer_max(&|f| f.train_peak_rss_mib),
                peer_peak_rss_mib: peer_max(&|f| f.peak_rss_mib),
                step: StepFigures::median_of(&ok.iter().map(|(f, _)| f).collect::<Vec<_>>()),
                peer_step: StepFigures::median_of(&peer_ok),
                vs_fp32: None,
                train_rss_growth_per_rank: growth,
                train_rss_growth_median: largest.map(|g| g.median),
                train_rss_growth: largest,
                peak_rss_median: med(ok.iter().filter_map(|(f, _)| max_of(&f.peak_rss_per_rank()).filter(|&m| m > 0.0)).collect()),
                vs_ddp_rss_growth: None,
                vs_ddp_peak_rss: None,
                tuned_samples_per_s: Spread::of(&tuned_ok.iter().map(|f| f.samples_per_s).collect::<Vec<_>>()),
                tuned_ratio: Spread::of(&ratios_by_repeat(runs, tuned_runs)),
                tuned_accuracy: med(tuned_ok.iter().map(|f| f.accuracy).collect()),
                tuned_choice: tuned_ok.last().map(|f| f.tuned.clone()).filter(|t| !t.is_empty()),
                estimate_mib: estimate_growth_mib(case, true),
            }
        })
        .collect();
    // Ratios within the run: level 2/3 over level 1, FSDP over DDP, same other coordinates.
    let before = rows.clone();
    let twin = |pred: &dyn Fn(&Case) -> bool| before.iter().find(|r| pred(&r.case));
    let median = |r: &Row| r.samples_per_s.map(|s| s.median);
    let over = |x: Option<f64>, d: Option<f64>| x.zip(d.filter(|&d| d > 0.0)).map(|(x, d)| x / d);
    for row in &mut rows {
        let (c, ours) = (&row.case, median(row));
        let same = |o: &Case| super::case::same_setting(o, c);
        if c.level.is_some_and(|l| l > 1) {
            row.vs_level1 = over(ours, twin(&|o| o.level == Some(1) && o.strategy == c.strategy && same(o)).and_then(median));
        }
        if c.level.is_some() && (c.strategy.sharding().is_some() || c.strategy.is_zero1()) {
            if let Some(ddp) = twin(&|o| o.level == c.level && o.strategy.is_ddp() && same(o)) {
                row.vs_ddp = over(ours, median(ddp));
                row.vs_ddp_rss_growth = over(row.train_rss_growth_median, ddp.train_rss_growth_median);
                row.vs_ddp_peak_rss = over(row.peak_rss_median, ddp.peak_rss_median);
            }
        }
        if c.precision == Precision::Bf16 {
            let fp32 = twin(&|o| {
                o.level == c.level
                    && o.strategy == c.strategy
                    && o.precision == Precision::No
                    && super::case::same_setting(o, &Case { precision: Precision::No, ..c.clone() })
            });
            row.vs_fp32 = over(ours, fp32.and_then(median));
        }
    }
    rows
}

/// Ours / theirs within each repeat (same index: run back to back), where both ran.
fn ratios_by_repeat(
    ours: &[std::result::Result<(RunFigures, f64), String>],
    theirs: &[std::result::Result<RunFigures, String>],
) -> Vec<f64> {
    ours.iter()
        .zip(theirs)
        .filter_map(|(a, b)| match (a, b) {
            (Ok((a, _)), Ok(b)) if b.samples_per_s > 0.0 => Some(a.samples_per_s / b.samples_per_s),
            _ => None,
        })
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::matrix::plan::{args, plan};
    use crate::matrix::Peer;

    /// A run at `sps` samples/s, 90% accurate over 10,000 images.
    pub(crate) fn figures(sps: f64) -> RunFigures {
        RunFigures { samples_per_s: sps, accuracy: 0.9, eval_samples: 10_000, ..Default::default() }
    }

    #[test]
    fn ratios_are_taken_repeat_by_repeat_and_levels_compared_within_the_run() {
        let (cases, _) = plan(&args(&[
            "--levels",
            "1,2",
            "--strategies",
            "ddp,fsdp-full-shard",
            "--world-sizes",
            "2",
            "--widths",
            "128",
            "--precisions",
            "fp32",
        ]))
        .unwrap();
        let ids: Vec<&str> = cases.iter().map(|c| c.id.as_str()).collect();
        assert_eq!(ids, ["l1-ddp-w2-128-fp32", "l2-ddp-w2-128-fp32", "l1-fsdp-full-shard-w2-128-fp32", "l2-fsdp-full-shard-w2-128-fp32"]);
        let mut ours = Ours::new();
        ours.insert(ids[0].into(), vec![Ok((figures(100.0), 1.0)), Ok((figures(120.0), 1.0)), Ok((figures(90.0), 1.0))]);
        ours.insert(ids[1].into(), vec![Ok((figures(99.0), 1.0)), Err("boom".into()), Ok((figures(117.0), 1.0))]);
        ours.insert(ids[2].into(), vec![Ok((figures(50.0), 1.0))]);
        let mut theirs = Theirs::new();
        theirs.insert("pytorch-ddp-gloo-w2".into(), vec![Ok(figures(50.0)), Ok(figures(100.0)), Ok(figures(45.0))]);
        // Level 2's twin is 🤗 Accelerate, level 1's PyTorch DDP.
        assert_eq!((cases[0].peer, cases[1].peer), (Some(Peer::DdpGloo { world_size: 2 }), Some(Peer::Accelerate { world_size: 2 })));
        theirs.insert("hf-accelerate-w2".into(), vec![Ok(figures(50.0)), Ok(figures(100.0)), Ok(figures(45.0))]);
        let rows = aggregate(&cases, &ours, &theirs);
        // Level 1: ratios 2.0, 1.2, 2.0 → median 2.0; not the ratio of the medians (100 / 50).
        assert_eq!(rows[0].ratio, Some(Spread { median: 2.0, min: 1.2, max: 2.0, n: 3 }));
        assert_eq!(rows[0].samples_per_s, Some(Spread { median: 100.0, min: 90.0, max: 120.0, n: 3 }));
        // Level 2: the failed repeat drops out of its pairs; it is reported.
        assert_eq!(rows[1].ratio, Some(Spread { median: (1.98 + 2.6) / 2.0, min: 1.98, max: 2.6, n: 2 }));
        assert_eq!(rows[1].errors, ["boom"]);
        assert_eq!(rows[1].vs_level1, Some(108.0 / 100.0));
        assert_eq!(rows[2].vs_ddp, Some(0.5));
        assert_eq!((rows[2].ratio, rows[2].vs_level1), (None, None));
        // A cell that never ran has no figures.
        assert_eq!((rows[3].samples_per_s, rows[3].vs_ddp, rows[3].eval_samples), (None, None, None));
    }
}
