//! After a step: log, evaluate, save as the control flags say (Transformers'
//! `_maybe_log_save_evaluate`), the best metric; and evaluation itself — [`Trainer::evaluate`],
//! [`Trainer::predict`] and the prediction loop that counts every example exactly once.

use super::training::TrainingRun;
use super::{EvalPrediction, PredictionOutput, Trainer, TrainerModel};
use crate::error::{Error, Result};
use crate::output::{Progress, ReportWriter};
use crate::state::{LogEntry, Metrics};
use ladder_core::data::Dataset;
use ladder_core::dist::ReduceOp;
use level2_accelerator::DataLoaderOptions;
use std::time::Instant;
use tch::{Device, Kind, Tensor};

impl Trainer {
    /// [`Self::log_evaluate_save`], its time counted as paused (not training time).
    pub(super) fn timed_log_evaluate_save(&mut self, run: &mut TrainingRun) -> Result<()> {
        let t = Instant::now();
        self.log_evaluate_save(run)?;
        run.paused_s += t.elapsed().as_secs_f64();
        Ok(())
    }

    /// Acts on should_log / should_evaluate / should_save, in Transformers' order, resetting
    /// each flag it acts on; the callbacks' `on_evaluate` and `on_save` follow. Collective.
    fn log_evaluate_save(&mut self, run: &mut TrainingRun) -> Result<()> {
        let step = self.state.global_step;
        if run.control.should_log {
            run.control.should_log = false;
            if run.sums.window_steps > 0 {
                let loss = run.sums.take_window(&self.accelerator)?;
                let mut values = vec![("loss", loss), ("learning_rate", run.last_lr)];
                if let Some(g) = run.last_grad_norm {
                    values.push(("grad_norm", g));
                }
                self.push_log(LogEntry::new(step, self.state.epoch, values), &run.progress, run.reporter.as_mut())?;
            }
        }
        let mut new_best = false;
        if run.control.should_evaluate {
            run.control.should_evaluate = false;
            if self.eval_dataset.is_some() {
                let metrics = self.evaluate_inner("eval", &run.progress, run.reporter.as_mut())?;
                run.control = self.callback_handler.on_evaluate(&self.args, &self.state, run.control, &metrics);
                new_best = self.determine_best_metric(&metrics)?;
            }
        }
        if run.control.should_save {
            run.control.should_save = false;
            self.save_checkpoint(&run.sums, new_best)?;
            run.control = self.callback_handler.on_save(&self.args, &self.state, run.control);
        }
        Ok(())
    }

    /// Updates best_metric / best_global_step; true when this evaluation is the new best.
    fn determine_best_metric(&mut self, metrics: &Metrics) -> Result<bool> {
        let Some(key) = self.args.best_metric_key() else {
            return Ok(false);
        };
        let Some(&value) = metrics.get(&key) else {
            let available: Vec<&str> = metrics.keys().filter_map(|k| k.strip_prefix("eval_")).collect();
            return Err(Error::UnknownMetric {
                metric: self.args.metric_for_best_model.clone().unwrap_or_else(|| "loss".into()),
                available: available.join(", "),
            });
        };
        let better = match self.state.best_metric {
            None => true,
            Some(best) => {
                if self.args.greater_is_better() {
                    value > best
                } else {
                    value < best
                }
            }
        };
        if better {
            self.state.best_metric = Some(value);
            self.state.best_global_step = Some(self.state.global_step);
        }
        Ok(better)
    }

    /// Runs the evaluation loop over the eval dataset and logs the metrics.
    fn evaluate_inner(&mut self, prefix: &str, progress: &Progress, reporter: Option<&mut ReportWriter>) -> Result<Metrics> {
        let Some(data) = self.eval_dataset.as_ref().map(Dataset::shallow_clone) else {
            return Err(Error::invalid("eval_dataset", "None", "an evaluation dataset for Trainer::evaluate"));
        };
        let out = self.prediction_loop(&data, prefix)?;
        let entry = LogEntry { values: out.metrics.clone(), epoch: self.state.epoch, step: self.state.global_step };
        self.push_log(entry, progress, reporter)?;
        Ok(out.metrics)
    }

    /// Evaluates on the eval dataset (Transformers' `evaluate(metric_key_prefix=...)`):
    /// `<prefix>_loss` through `compute_loss`, the hooks' metrics with the prefix, runtime and
    /// throughput; appended to the log history. Collective.
    ///
    /// # Errors
    /// No eval dataset; forward and collective errors.
    pub fn evaluate(&mut self, metric_key_prefix: &str) -> Result<Metrics> {
        let progress = Progress::new(0, self.accelerator.is_main_process(), true);
        self.evaluate_inner(metric_key_prefix, &progress, None)
    }

    /// Predictions, labels and metrics over `dataset` (Transformers' `predict`, prefix
    /// `test`). Collective.
    ///
    /// # Errors
    /// Forward and collective errors.
    pub fn predict(&mut self, dataset: &Dataset) -> Result<PredictionOutput> {
        let data = dataset.to_device(self.accelerator.device());
        self.prediction_loop(&data, "test")
    }

    /// The evaluation loop: a loader without shuffle (padded so every process runs as many
    /// forwards, which FSDP's gathers need); on each batch, `compute_loss` over the samples
    /// that are not padding (the whole batch when all are, to keep the forwards in step, its
    /// loss then unused); loss sums all-reduced; outputs and labels through
    /// `gather_for_metrics`, which drops the padding — every example counted exactly once, in
    /// dataset order.
    fn prediction_loop(&mut self, data: &Dataset, prefix: &str) -> Result<PredictionOutput> {
        let start = Instant::now();
        let (rank, w) = (self.accelerator.process_index(), self.accelerator.num_processes());
        let n = data.len();
        // Rank r's p-th sample is dataset position p·W + r; positions ≥ n are padding.
        let real_on_rank = if rank < n { (n - rank).div_ceil(w) } else { 0 };
        let bs = self.args.per_device_eval_batch_size;
        let loader = self.accelerator.prepare_data_loader(data, DataLoaderOptions { batch_size: bs, ..Default::default() })?;
        let (mut loss_sum, mut count, mut outputs, mut labels, mut steps) = (0.0f64, 0usize, Vec::new(), Vec::new(), 0usize);
        tch::no_grad(|| -> Result<()> {
            for (b, (images, ys)) in loader.iter().enumerate() {
                let len = ys.size()[0] as usize;
                let real = real_on_rank.saturating_sub(b * bs).min(len);
                let take = if real == 0 { len } else { real };
                let inputs = self.collator.collate(images.narrow(0, 0, take as i64), ys.narrow(0, 0, take as i64));
                let mut m = TrainerModel { model: &self.model, accelerator: &self.accelerator, train: false };
                let (loss, out) = self.hooks.compute_loss(&mut m, &inputs)?;
                let out = out.to_kind(Kind::Float);
                if real > 0 {
                    loss_sum += loss.double_value(&[]) * real as f64;
                    count += real;
                }
                // Back to the batch's length for gather_for_metrics (padding rows are dropped).
                let classes = out.size()[1];
                let full = if take < len {
                    Tensor::cat(
                        &[out.narrow(0, 0, real as i64), Tensor::zeros([(len - real) as i64, classes], (Kind::Float, out.device()))],
                        0,
                    )
                } else {
                    out
                };
                outputs.push(self.accelerator.gather_for_metrics(&full)?.to_device(Device::Cpu));
                labels.push(self.accelerator.gather_for_metrics(&ys)?.to_device(Device::Cpu));
                steps += 1;
            }
            Ok(())
        })?;
        let sums =
            self.accelerator.reduce(&Tensor::from_slice(&[loss_sum, count as f64]).to_device(self.accelerator.device()), ReduceOp::Sum)?;
        let sums = Vec::<f64>::try_from(sums.to_device(Device::Cpu))?;
        let predictions = if outputs.is_empty() { Tensor::zeros([0, 10], (Kind::Float, Device::Cpu)) } else { Tensor::cat(&outputs, 0) };
        let label_ids = if labels.is_empty() { Tensor::zeros([0], (Kind::Int64, Device::Cpu)) } else { Tensor::cat(&labels, 0) };
        let eval_pred = EvalPrediction { predictions, label_ids };
        let mut metrics = Metrics::new();
        metrics.insert(format!("{prefix}_loss"), sums[0] / sums[1].max(1.0));
        for (k, v) in self.hooks.compute_metrics(&eval_pred) {
            metrics.insert(format!("{prefix}_{k}"), v);
        }
        let runtime = start.elapsed().as_secs_f64();
        metrics.insert(format!("{prefix}_runtime"), runtime);
        metrics.insert(format!("{prefix}_samples_per_second"), n as f64 / runtime.max(1e-9));
        metrics.insert(format!("{prefix}_steps_per_second"), steps as f64 / runtime.max(1e-9));
        Ok(PredictionOutput { predictions: eval_pred.predictions, label_ids: eval_pred.label_ids, metrics })
    }
}
