//! [`Trainer::train`], cut as Transformers' `_inner_training_loop` is laid out: check, plan,
//! resume, begin (banner, callbacks, progress), then epochs of micro-batch steps — each
//! optimization step followed by the callbacks and log / evaluate / save — and the end of
//! training (best model, summary, files).

use super::checkpointing::Resumed;
use super::loss_sums::LossSums;
use super::{Batch, Trainer, TrainerModel, TRAINER_STATE_FILE};
use crate::args::IntervalStrategy;
use crate::callbacks::TrainerControl;
use crate::error::{Error, Result};
use crate::output::{self, Progress, ReportWriter};
use crate::schedule::{LrSchedule, TrainingPlan};
use crate::state::{LogEntry, Metrics, TrainerState};
use ladder_core::data::Dataset;
use ladder_core::memory::ModelStateBytes;
use ladder_core::model::BasicNet;
use ladder_core::timing::StepTiming;
use level2_accelerator::DataLoaderOptions;
use std::path::PathBuf;
use std::time::Instant;
use tch::Tensor;

/// Where [`Trainer::train`] resumes from (Transformers' `resume_from_checkpoint`: `True` or a
/// path).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResumeFrom {
    /// The newest `checkpoint-<step>` in output_dir.
    Last,
    /// This checkpoint directory.
    Dir(PathBuf),
}

/// What [`Trainer::train`] returns (Transformers' `TrainOutput`, plus this rank's figures).
#[derive(Debug, Clone, PartialEq)]
pub struct TrainOutput {
    /// Optimization steps done.
    pub global_step: u64,
    /// Mean of all step losses of the run (Transformers' `train_loss`).
    pub training_loss: f64,
    /// `train_runtime`, `train_samples_per_second`, `train_steps_per_second`, `train_loss`,
    /// `epoch`.
    pub metrics: Metrics,
    /// Training samples this rank processed (this session; a resumed run counts from the
    /// checkpoint).
    pub local_samples: u64,
    /// Seconds of this rank's training loop, evaluation and checkpoint writing excluded.
    pub train_s: f64,
    /// Seconds this rank spent in collectives.
    pub comm_s: f64,
    /// This rank's persistent model-state bytes.
    pub model_state: ModelStateBytes,
    /// This rank's step figures, frozen when `train()` returns (before `save_model()` gathers
    /// and serialises the weights on the main process); the training-phase peak RSS is the
    /// steps' own, the evaluations and saves between and after them left out
    /// ([`ladder_core::timing`]).
    pub timing: StepTiming,
}

/// One `train()` call's running figures — what Transformers keeps as the locals of
/// `_inner_training_loop`.
pub(super) struct TrainingRun {
    /// The run's length.
    plan: TrainingPlan,
    /// The learning rate of each update.
    schedule: LrSchedule,
    /// The epoch training starts in (a resumed run's checkpoint epoch).
    start_epoch: usize,
    /// Micro-batches of the current epoch already trained before this session (resume).
    skip: usize,
    /// The current epoch's micro-batches and this rank's samples.
    shape: EpochShape,
    /// The global step training starts from.
    start_step: u64,
    /// Optimization steps done.
    global_step: usize,
    /// Training stops before the next epoch.
    stop: bool,
    /// The flags the callbacks set.
    pub(super) control: TrainerControl,
    /// The loss sums behind the logged losses.
    pub(super) sums: LossSums,
    /// Σ loss·n over this rank's micro-batches of the current accumulation window.
    window_loss: f64,
    /// The learning rate of the last update.
    pub(super) last_lr: f64,
    /// The gradient norm before clipping of the last update (with max_grad_norm > 0).
    pub(super) last_grad_norm: Option<f64>,
    /// Training samples this rank processed in this session.
    local_samples: u64,
    /// Seconds of evaluation and checkpoint writing, excluded from the training time.
    pub(super) paused_s: f64,
    /// The progress bar or plain lines.
    pub(super) progress: Progress,
    /// The report_to writer (main process).
    pub(super) reporter: Option<ReportWriter>,
}

/// One optimization step's figures, for logging.
#[derive(Debug, Clone, Copy)]
struct Update {
    /// The learning rate the update used.
    lr: f64,
    /// The gradient norm before clipping (with max_grad_norm > 0).
    grad_norm: Option<f64>,
    /// This rank's mean loss over the window's samples.
    loss: f64,
}

/// An epoch's micro-batches (the same on every rank) and this rank's samples: the plan's
/// `batches_per_epoch` and `samples_per_rank`, but for the rest of an epoch resumed at another
/// world size (`DistributedSampler`'s rule: fewer batches, shares differing by one sample).
#[derive(Debug, Clone, Copy, Default)]
struct EpochShape {
    /// Micro-batches per rank.
    batches: usize,
    /// This rank's samples.
    samples: usize,
}

/// The accumulation window micro-batch `b` (0-based within its epoch) belongs to.
#[derive(Debug, Clone, Copy)]
struct Window {
    /// Its first micro-batch.
    start: usize,
    /// Its micro-batches: `A`, except the epoch's short last window.
    len: usize,
    /// Its samples on this rank (the epoch's last micro-batch may be short).
    samples: usize,
}

impl Window {
    fn of(b: usize, epoch: EpochShape, accumulation: usize, batch_size: usize) -> Self {
        let batch_len = |b: usize| -> usize {
            if b + 1 < epoch.batches {
                batch_size
            } else {
                epoch.samples.saturating_sub(b * batch_size).min(batch_size)
            }
        };
        let k = b / accumulation;
        let start = k * accumulation;
        let len = accumulation.min(epoch.batches.saturating_sub(start));
        Self { start, len, samples: (start..start + len).map(batch_len).sum() }
    }
}

/// The plan of a run resumed at another world size than the checkpoint's: by epochs
/// (`max_steps` ≤ 0), the steps left are the rest of the interrupted epoch (`rest_batches`
/// micro-batches per rank, now) and the planned epochs after it at the new size; `max_steps`
/// > 0 stays as it is. (The learning-rate schedule follows the new total from here on.)
fn replan(mut plan: TrainingPlan, from: &Resumed, rest_batches: usize, accumulation: usize, max_steps: i64) -> TrainingPlan {
    if max_steps <= 0 {
        let later = plan.max_steps.saturating_sub((from.epoch + 1) * plan.updates_per_epoch);
        plan.max_steps = from.global_step as usize + rest_batches.div_ceil(accumulation.max(1)) + later;
    }
    plan
}

impl Trainer {
    /// Trains for the planned steps (see the module docs), evaluating, logging and saving as
    /// the arguments say; `resume_from_checkpoint` restores weights, optimizer, schedule,
    /// data position (mid-epoch included), log history and loss sums first. With
    /// load_best_model_at_end the best checkpoint is loaded at the end. Collective: every rank
    /// calls it. Runs once per Trainer.
    ///
    /// # Errors
    /// No train dataset; an eval strategy without an eval dataset; a second call; output_dir holding a previous run's
    /// files without overwrite_output_dir or a resume (nothing is written before these checks and
    /// the resume's pass); unreadable checkpoints; callback refusals; data,
    /// model and collective errors.
    pub fn train(&mut self, resume_from_checkpoint: Option<ResumeFrom>) -> Result<TrainOutput> {
        let run_start = Instant::now();
        let train_dataset = self.check_can_train()?;
        ladder_core::recipe::check_writable("output_dir", &self.args.output_dir, ladder_core::recipe::OutputKind::Dir)?;
        if let Some(dir) = self.args.logging_dir.as_ref().filter(|_| self.args.report_to == crate::args::ReportTo::Tensorboard) {
            ladder_core::recipe::check_writable("logging_dir", dir, ladder_core::recipe::OutputKind::Dir)?;
        }
        let resume_dir = self.resume_dir(resume_from_checkpoint.as_ref())?;
        self.check_output_dir(resume_dir.is_some())?;
        let plan = self.plan(train_dataset.len());
        let loader = self.accelerator.prepare_data_loader(
            &train_dataset,
            DataLoaderOptions { batch_size: self.args.per_device_train_batch_size, shuffle: true, ..Default::default() },
        )?;
        debug_assert_eq!(loader.len(), plan.batches_per_epoch);
        let (mut plan, mut resumed) = (plan, None);
        if let Some(dir) = &resume_dir {
            let from = self.resume(dir, &plan)?;
            if from.world_size_changed {
                plan = replan(plan, &from, loader.len(), self.args.gradient_accumulation_steps, self.args.max_steps);
                self.state.max_steps = plan.max_steps as u64;
            }
            resumed = Some(from);
        }
        // Only now, the run known to start, is anything written.
        self.start_output_dir(resumed.is_some())?;
        let mut run = self.begin(plan, resumed)?;
        let loop_start = Instant::now();
        for epoch in run.start_epoch..run.plan.num_epochs {
            if run.stop {
                break;
            }
            loader.set_epoch(epoch as u64);
            run.shape = EpochShape { batches: loader.len(), samples: loader.epoch_num_samples() };
            self.train_epoch(&mut run, loader.iter())?;
            if run.control.should_training_stop {
                break;
            }
        }
        let train_s = (loop_start.elapsed().as_secs_f64() - run.paused_s).max(1e-9);
        self.end_training(run, run_start, train_s)
    }

    /// The train dataset, once the run is known to be possible; marks the Trainer as trained.
    ///
    /// # Errors
    /// No train dataset; an eval strategy or load_best_model_at_end without an eval dataset;
    /// a second call.
    fn check_can_train(&mut self) -> Result<Dataset> {
        let Some(train_dataset) = self.train_dataset.as_ref().map(Dataset::shallow_clone) else {
            return Err(Error::invalid("train_dataset", "None", "a training dataset for Trainer::train"));
        };
        if self.eval_dataset.is_none() && (self.args.eval_strategy != IntervalStrategy::No || self.args.load_best_model_at_end) {
            return Err(Error::invalid(
                "eval_strategy",
                format!("{:?}", self.args.eval_strategy).to_lowercase(),
                "`no` when the Trainer has no eval_dataset (or pass one)",
            ));
        }
        if std::mem::replace(&mut self.trained, true) {
            return Err(Error::invalid("train", "a second call", "one train() per Trainer (its Accelerator holds one run's loader state)"));
        }
        Ok(train_dataset)
    }

    /// Plans the run over `num_examples` training samples and starts a fresh TrainerState
    /// for it (a resume then replaces it with the checkpoint's).
    fn plan(&mut self, num_examples: usize) -> TrainingPlan {
        let args = &self.args;
        let plan = TrainingPlan::new(args, num_examples, self.accelerator.num_processes());
        self.state = TrainerState {
            max_steps: plan.max_steps as u64,
            num_train_epochs: plan.num_epochs as u64,
            logging_steps: args.logging_steps as u64,
            eval_steps: args.eval_steps() as u64,
            save_steps: args.save_steps as u64,
            train_batch_size: args.per_device_train_batch_size as u64,
            is_local_process_zero: self.accelerator.is_local_main_process(),
            is_world_process_zero: self.accelerator.is_main_process(),
            ..Default::default()
        };
        plan
    }

    /// The banner, the report_to writer, the callbacks' `on_train_begin` and the progress
    /// bar; the run's figures from the start (or `resumed`).
    ///
    /// # Errors
    /// An unwritable report_to file; a callback's refusal.
    fn begin(&mut self, plan: TrainingPlan, resumed: Option<Resumed>) -> Result<TrainingRun> {
        let is_main = self.accelerator.is_main_process();
        let trainable = BasicNet::num_parameters(self.net_config.width) as u64;
        if is_main {
            println!("{}\n{}", output::training_banner(&self.args, &plan, trainable), self.settings_banner());
        }
        let reporter = if is_main { Some(ReportWriter::new(&self.args, resumed.is_some())?) } else { None };
        let control = self.callback_handler.on_train_begin(&self.args, &self.state, TrainerControl::default())?;
        let progress = Progress::new(plan.max_steps as u64, is_main, self.args.disable_tqdm);
        progress.set_position(self.state.global_step);
        let from = resumed.unwrap_or_default();
        let global_step = from.global_step as usize;
        let schedule = LrSchedule::new(&self.args, plan.max_steps);
        Ok(TrainingRun {
            plan,
            schedule,
            start_epoch: from.epoch,
            skip: from.step_in_epoch,
            shape: EpochShape::default(),
            start_step: from.global_step,
            global_step,
            stop: global_step >= plan.max_steps,
            control,
            sums: from.sums,
            window_loss: 0.0,
            last_lr: schedule.rate(global_step.saturating_sub(1)),
            last_grad_norm: None,
            local_samples: 0,
            paused_s: 0.0,
            progress,
            reporter,
        })
    }

    /// One epoch's micro-batches (the rest of it when resuming mid-epoch), each optimization
    /// step followed by [`Self::step_end`]; then the callbacks' `on_epoch_end` and log /
    /// evaluate / save.
    fn train_epoch(&mut self, run: &mut TrainingRun, batches: impl Iterator<Item = (Tensor, Tensor)>) -> Result<()> {
        for (i, (images, labels)) in batches.enumerate() {
            let inputs = self.collator.collate(images, labels);
            let Some(update) = self.training_step(run, run.skip + i, &inputs)? else {
                continue;
            };
            self.step_end(run, update)?;
            if run.control.should_training_stop || run.global_step >= run.plan.max_steps {
                run.stop = true;
            }
            if run.stop || run.control.should_epoch_stop {
                run.control.should_epoch_stop = false;
                break;
            }
        }
        run.skip = 0;
        run.control = self.callback_handler.on_epoch_end(&self.args, &self.state, run.control);
        self.timed_log_evaluate_save(run)
    }

    /// Micro-batch `b` of the epoch (see the module docs): `compute_loss` and backward inside
    /// `accelerator.accumulate`, the loss weighted when the window's micro-batches differ in
    /// size; at the window's end, clipping, the scheduled learning rate and the optimizer
    /// step. Returns the update when this micro-batch ended its window.
    fn training_step(&mut self, run: &mut TrainingRun, b: usize, inputs: &Batch) -> Result<Option<Update>> {
        let window = Window::of(b, run.shape, self.args.gradient_accumulation_steps, self.args.per_device_train_batch_size);
        if b == window.start {
            run.window_loss = 0.0;
        }
        let n = inputs.len();
        let (accelerator, model, hooks, optimizer) = (&self.accelerator, &self.model, &self.hooks, &mut self.optimizer);
        let (max_grad_norm, schedule, global_step, window_loss) =
            (self.args.max_grad_norm, &run.schedule, run.global_step, &mut run.window_loss);
        let step = accelerator.accumulate(model, || -> Result<Option<(f64, Option<f64>)>> {
            let (loss, _) = hooks.compute_loss(&mut TrainerModel { model, accelerator, train: true }, inputs)?;
            // The window's gradient is the mean over its samples: weight unequal
            // micro-batches (the Accelerator divides by the window's length).
            let weight = (n * window.len) as f64 / window.samples as f64;
            if weight == 1.0 {
                accelerator.backward(&loss)?;
            } else {
                accelerator.backward(&(&loss * weight))?;
            }
            *window_loss += loss.double_value(&[]) * n as f64;
            if !accelerator.sync_gradients() {
                return Ok(None);
            }
            let grad_norm = if max_grad_norm > 0.0 { accelerator.clip_grad_norm_(max_grad_norm)? } else { None };
            let lr = schedule.rate(global_step);
            optimizer.set_lr(lr);
            optimizer.step()?;
            optimizer.zero_grad();
            Ok(Some((lr, grad_norm)))
        })?;
        run.local_samples += n as u64;
        Ok(step.map(|(lr, grad_norm)| Update { lr, grad_norm, loss: run.window_loss / window.samples as f64 }))
    }

    /// After an optimization step: the counters, the state, the callbacks' `on_step_end`, then
    /// log / evaluate / save (not counted as step time).
    fn step_end(&mut self, run: &mut TrainingRun, update: Update) -> Result<()> {
        (run.last_lr, run.last_grad_norm) = (update.lr, update.grad_norm);
        run.global_step += 1;
        run.sums.add_step(update.loss);
        self.state.global_step = run.global_step as u64;
        self.state.epoch = run.global_step as f64 / run.plan.updates_per_epoch as f64;
        run.progress.set_position(run.global_step as u64);
        run.control = self.callback_handler.on_step_end(&self.args, &self.state, run.control);
        self.timed_log_evaluate_save(run)?;
        self.save_if_preempted(run)?;
        self.accelerator.restart_step_clock(); // evaluation and saving are no step's time
        Ok(())
    }

    /// A checkpoint on SIGTERM (once `ladder_core::preempt::watch` was called on every rank):
    /// the ranks agree after every optimization step (one all-reduce of one number); when any
    /// was signalled, every rank has finished this step, `checkpoint-<step>` is written (unless
    /// this step's save wrote it) and training stops with [`Error::Preempted`]. Collective.
    fn save_if_preempted(&mut self, run: &mut TrainingRun) -> Result<()> {
        if !self.accelerator.preemption_requested()? {
            return Ok(());
        }
        let dir = crate::checkpoints::checkpoint_dir(&self.args.output_dir, self.state.global_step);
        if !ladder_core::checkpoint::is_complete(&dir) {
            self.save_checkpoint(&run.sums, false)?;
        }
        ladder_core::preempt::mark_saved();
        Err(Error::Preempted { checkpoint: dir, step: self.state.global_step })
    }

    /// The end of training: the best model back (load_best_model_at_end), the summary log
    /// entry, the callbacks' `on_train_end`, the main process's files and table; then the
    /// process group is released for a normal shutdown. Collective.
    fn end_training(&mut self, mut run: TrainingRun, run_start: Instant, train_s: f64) -> Result<TrainOutput> {
        run.progress.finish();
        if self.args.load_best_model_at_end {
            if let Some(best) = self.state.best_model_checkpoint.clone() {
                let score = self.state.best_metric.map_or_else(String::new, |m| format!(" (score: {m})"));
                self.say(&format!("Loading best model from {}{score}.", best.display()));
                self.accelerator.load_state(&best)?;
            }
        }
        let (training_loss, metrics) = self.summary(&run, run_start)?;
        let entry = LogEntry { values: metrics.clone(), epoch: self.state.epoch, step: run.global_step as u64 };
        self.push_log(entry, &run.progress, run.reporter.as_mut())?;
        run.control = self.callback_handler.on_train_end(&self.args, &self.state, run.control);
        if self.accelerator.is_main_process() {
            self.write_final_outputs()?;
        }
        let mut metrics = metrics;
        metrics.insert("epoch".into(), self.state.epoch);
        self.accelerator.wait_for_everyone()?;
        // Training completed: dropping the Trainer finalises the process group normally (an
        // error before this point leaves it to the launcher to stop the other processes).
        self.accelerator.end_training();
        Ok(TrainOutput {
            global_step: run.global_step as u64,
            training_loss,
            metrics,
            local_samples: run.local_samples,
            train_s,
            comm_s: self.model.comm_seconds(),
            model_state: self.model.memory(),
            timing: self.accelerator.step_timing().unwrap_or_default(),
        })
    }

    /// The run's `train_loss` and Transformers' final log figures (`train_runtime`,
    /// `train_samples_per_second`, `train_steps_per_second`, `total_flos`, `train_loss`).
    /// Collective.
    fn summary(&self, run: &TrainingRun, run_start: Instant) -> Result<(f64, Metrics)> {
        let world_size = self.accelerator.num_processes();
        let total = run.sums.all_reduced_total(&self.accelerator)?;
        let training_loss = total.0 / (world_size as f64 * total.1.max(1.0));
        let runtime = run_start.elapsed().as_secs_f64();
        let trained_steps = (run.global_step as u64).saturating_sub(run.start_step) as f64;
        let samples_all = (run.local_samples * world_size as u64) as f64;
        let metrics: Metrics = [
            ("train_runtime".to_string(), runtime),
            ("train_samples_per_second".to_string(), samples_all / runtime.max(1e-9)),
            ("train_steps_per_second".to_string(), trained_steps / runtime.max(1e-9)),
            ("total_flos".to_string(), 0.0),
            ("train_loss".to_string(), training_loss),
        ]
        .into_iter()
        .collect();
        Ok((training_loss, metrics))
    }

    /// output_dir/trainer_state.json, output_dir/loss.svg and the evaluation table (when
    /// there was an evaluation). Main process.
    fn write_final_outputs(&self) -> Result<()> {
        let out_dir = &self.args.output_dir;
        self.state.save(&out_dir.join(TRAINER_STATE_FILE))?;
        output::plot_loss_curve(&out_dir.join("loss.svg"), &self.state.loss_curve(), &self.state.eval_loss_curve())?;
        let table = output::epoch_table(&self.state.log_history, self.args.eval_strategy != IntervalStrategy::Steps);
        if table.row_count() > 0 {
            println!("{table}");
        }
        Ok(())
    }
}
