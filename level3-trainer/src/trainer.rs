//! The `Trainer`, as 🤗 Transformers' `Trainer`: the user hands over a model, datasets, a data
//! collator, [`TrainerHooks`] (`compute_loss`, `compute_metrics`) and [`TrainingArguments`];
//! [`Trainer::train`] runs the whole distributed loop on one process or many. It is built on
//! the level-2 [`Accelerator`], as Transformers' Trainer is built on Accelerate: the Trainer
//! turns TrainingArguments into an `AcceleratorConfig`, prepares the model, optimizer and
//! loaders, and writes its loop with `accumulate` / `backward` / `clip_grad_norm_` /
//! `gather_for_metrics` / `save_state` / `load_state`.
//!
//! # What one optimization step does (every rank)
//! For each micro-batch of the accumulation window (`accelerator.accumulate`): the loader seeds
//! dropout from (seed, rank, micro-batch index); `compute_loss` (mean over the micro-batch);
//! `accelerator.backward`, which divides by the window's length and syncs gradients on the
//! window's last micro-batch only. When a window holds micro-batches of unequal sizes (the
//! epoch's short last batch), the loss is first weighted by `n_micro · len / n_window`, so the
//! gradient is the mean over every sample of the window on every rank — the large batch's —
//! and the 2024 accumulation loss bug is absent by construction. Then clip (max_grad_norm >
//! 0), set the scheduled learning rate, AdamW step.
//!
//! # Logged figures
//! A step's loss is the mean over all its samples across accumulation and ranks; the logged
//! `loss` is the mean of the step losses since the previous log (a first-step log is that one
//! step's loss); `learning_rate` is the rate the logged step's update used.
//!
//! # Evaluation
//! Rank r evaluates the contiguous, unpadded slice `eval_shard(n, r, W)`, through the same
//! `compute_loss` as training (no `label_names` trap); loss sums and counts are all-reduced and
//! predictions gathered, so every example is counted exactly once at any world size.

use crate::args::{IntervalStrategy, TrainingArguments};
use crate::callbacks::{DefaultFlowCallback, TrainerCallback, TrainerControl};
use crate::checkpoints;
use crate::error::{Error, Result};
use crate::output::{self, Progress, ReportWriter};
use crate::schedule::{LrSchedule, TrainingPlan};
use crate::state::{LogEntry, Metrics, TrainerState};
use ladder_core::checkpoint as core_ckpt;
use ladder_core::data::Dataset;
use ladder_core::memory::ModelStateBytes;
use ladder_core::model::{BasicNet, BasicNetConfig};
use ladder_core::parallel::Precision;
use level2_accelerator::{AcceleratedOptimizer, Accelerator, AcceleratorConfig, PreparedModel};
use std::path::PathBuf;
use std::time::Instant;
use tch::{nn, Device, Kind, Tensor};

/// One collated batch, as the tutorial's collator returns `{"x": …, "labels": …}`.
#[derive(Debug)]
pub struct Batch {
    /// Inputs `[b, 1, 28, 28]` f32 (normalised MNIST images).
    pub x: Tensor,
    /// Class labels `[b]` i64.
    pub labels: Tensor,
}

impl Batch {
    /// Examples in the batch.
    pub fn len(&self) -> usize {
        self.labels.size().first().copied().unwrap_or(0) as usize
    }
    /// Whether the batch is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Turns the data loader's `(images, labels)` into a [`Batch`] (Transformers' `data_collator`).
pub trait DataCollator {
    /// Collates one batch.
    fn collate(&self, images: Tensor, labels: Tensor) -> Batch;
}

/// `{x: images, labels: labels}` unchanged (Transformers' `DefaultDataCollator`).
#[derive(Debug, Clone, Copy, Default)]
pub struct DefaultDataCollator;

impl DataCollator for DefaultDataCollator {
    fn collate(&self, images: Tensor, labels: Tensor) -> Batch {
        Batch { x: images, labels }
    }
}

impl<F: Fn(Tensor, Tensor) -> Batch> DataCollator for F {
    fn collate(&self, images: Tensor, labels: Tensor) -> Batch {
        self(images, labels)
    }
}

/// The model as `compute_loss` sees it: call [`TrainerModel::forward`]; the Trainer has put it
/// in train mode (dropout on) or eval mode (dropout off, under `no_grad`).
#[derive(Debug)]
pub struct TrainerModel<'a> {
    model: &'a PreparedModel,
    accelerator: &'a Accelerator,
    train: bool,
}

impl TrainerModel<'_> {
    /// `model(x)`: inputs `[b, 1, 28, 28]` f32 → log-probabilities `[b, 10]` f32 (under the
    /// Accelerator's autocast with bf16).
    ///
    /// # Errors
    /// FSDP's gather errors.
    pub fn forward(&mut self, x: &Tensor) -> Result<Tensor> {
        Ok(self.accelerator.autocast(|| self.model.forward_t(x, self.train))?)
    }
    /// Whether the model is in train mode.
    pub fn is_training(&self) -> bool {
        self.train
    }
}

/// Evaluation outputs handed to `compute_metrics` (Transformers' `EvalPrediction`), over the
/// whole evaluation set in order, gathered from every rank.
#[derive(Debug)]
pub struct EvalPrediction {
    /// The model's outputs `[n, classes]` (here log-probabilities), on the CPU.
    pub predictions: Tensor,
    /// The labels `[n]` i64, on the CPU.
    pub label_ids: Tensor,
}

/// What [`Trainer::predict`] returns (Transformers' `PredictionOutput`).
#[derive(Debug)]
pub struct PredictionOutput {
    /// Outputs `[n, classes]` over the whole dataset, in order, on the CPU.
    pub predictions: Tensor,
    /// Labels `[n]`, on the CPU.
    pub label_ids: Tensor,
    /// `<prefix>_loss`, the metrics, `<prefix>_runtime`, `…_samples_per_second`,
    /// `…_steps_per_second`.
    pub metrics: Metrics,
}

/// The user's part of a Trainer, as the methods a Transformers user overrides in a `Trainer`
/// subclass.
pub trait TrainerHooks {
    /// The loss of one batch (mean over its examples, a 0-d tensor) and the model's outputs.
    /// Used for training and for evaluation alike. The tutorial's `MyTrainer.compute_loss`:
    /// `nll_loss(model(inputs["x"]), inputs["labels"])`.
    ///
    /// # Errors
    /// Whatever the forward pass returns.
    fn compute_loss(&self, model: &mut TrainerModel<'_>, inputs: &Batch) -> Result<(Tensor, Tensor)>;

    /// Metrics over the whole evaluation set (keys without the `eval_` prefix, e.g.
    /// `accuracy`). Default: none.
    fn compute_metrics(&self, _eval_pred: &EvalPrediction) -> Metrics {
        Metrics::new()
    }

    /// The names [`compute_metrics`](Self::compute_metrics) returns, so that a wrong
    /// metric_for_best_model is refused before training. Default: none.
    fn metric_names(&self) -> Vec<&'static str> {
        Vec::new()
    }
}

/// Default hooks: `compute_loss` = `nll_loss(model(x), labels)`, no metrics.
#[derive(Debug, Clone, Copy, Default)]
pub struct DefaultHooks;

impl TrainerHooks for DefaultHooks {
    fn compute_loss(&self, model: &mut TrainerModel<'_>, inputs: &Batch) -> Result<(Tensor, Tensor)> {
        let outputs = model.forward(&inputs.x)?;
        Ok((outputs.nll_loss(&inputs.labels), outputs))
    }
}

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
}

/// Seeds libtorch's generator (weights' initialisation), as `transformers.set_seed`. Call it
/// before building the model.
pub fn set_seed(seed: u64) {
    tch::manual_seed(seed as i64);
}

/// File the scheduler's position goes to in a checkpoint.
const SCHEDULER_FILE: &str = "scheduler.json";
/// File the TrainerState goes to (output_dir and checkpoints).
const TRAINER_STATE_FILE: &str = "trainer_state.json";
/// File the TrainingArguments go to (output_dir and checkpoints).
const TRAINING_ARGS_FILE: &str = "training_args.json";

/// The Trainer (see the module docs).
pub struct Trainer {
    args: TrainingArguments,
    accelerator: Accelerator,
    model: PreparedModel,
    optimizer: AcceleratedOptimizer,
    net_config: BasicNetConfig,
    train_dataset: Option<Dataset>,
    eval_dataset: Option<Dataset>,
    collator: Box<dyn DataCollator>,
    hooks: Box<dyn TrainerHooks>,
    callbacks: Vec<Box<dyn TrainerCallback>>,
    trained: bool,
    /// The run's state (global step, log history, best metric).
    pub state: TrainerState,
}

impl std::fmt::Debug for Trainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer")
            .field("args", &self.args)
            .field("accelerator", &self.accelerator)
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

impl Trainer {
    /// The Accelerator settings these arguments stand for (Transformers builds its
    /// `Accelerator` the same way): cpu from use_cpu, bf16 mixed precision, the accumulation
    /// steps, FSDP, its sharding strategy and auto-wrap threshold, fsdp_config's backward
    /// prefetch (absent: `NO_PREFETCH`) and forward prefetch, the seed. Launcher variables
    /// (`ACCELERATE_*`, `FSDP_BACKWARD_PREFETCH`, …) and config files cannot override them: the
    /// arguments set each explicitly, as Transformers exports `fsdp_config` over the launcher's
    /// variables (`fsdp_min_num_params` excepted: when not given, theirs applies).
    pub fn accelerator_config(args: &TrainingArguments) -> AcceleratorConfig {
        AcceleratorConfig {
            cpu: Some(args.use_cpu),
            mixed_precision: Some(if args.bf16 { Precision::Bf16 } else { Precision::No }),
            gradient_accumulation_steps: Some(args.gradient_accumulation_steps),
            use_fsdp: Some(args.fsdp.is_some()),
            fsdp_sharding_strategy: args.fsdp,
            fsdp_min_num_params: args.fsdp_min_num_params,
            fsdp_backward_prefetch: Some(args.fsdp_config.backward_prefetch),
            fsdp_forward_prefetch: Some(args.fsdp_config.forward_prefetch),
            seed: Some(args.seed),
            ..AcceleratorConfig::default()
        }
    }

    /// A Trainer for `model` (built in `vs`, on any device), as `Trainer(model, args,
    /// train_dataset, eval_dataset, data_collator)`; `hooks` is the `Trainer` subclass's
    /// overrides. Builds the [`Accelerator`] (the process group from the launcher's
    /// environment; world 1 without one) and prepares the model (moved to the device, wrapped
    /// in DDP or FSDP) and AdamW.
    ///
    /// # Errors
    /// Invalid arguments ([`TrainingArguments::validate`], an unknown metric_for_best_model,
    /// a data_seed other than seed, dataloader_drop_last); Accelerator errors (settings,
    /// device, process group).
    pub fn new(
        vs: nn::VarStore,
        net: BasicNet,
        args: TrainingArguments,
        train_dataset: Option<Dataset>,
        eval_dataset: Option<Dataset>,
        data_collator: impl DataCollator + 'static,
        hooks: impl TrainerHooks + 'static,
    ) -> Result<Self> {
        args.validate()?;
        let mut available: Vec<&str> = crate::args::DEFAULT_METRICS.to_vec();
        available.extend(hooks.metric_names());
        args.validate_metric(&available)?;
        if args.data_seed.is_some_and(|d| d != args.seed) {
            return Err(Error::invalid(
                "data_seed",
                args.data_seed.unwrap_or_default(),
                format!("unset or equal to seed ({}): the Accelerator's loaders shuffle with the run's seed", args.seed),
            ));
        }
        if args.dataloader_drop_last {
            return Err(Error::invalid(
                "dataloader_drop_last",
                true,
                "false: the Accelerator's loaders pad the last batch so every process runs as many (even_batches)",
            ));
        }
        let init = level2_accelerator::InitProcessGroupKwargs { timeout: Some(std::time::Duration::from_secs(args.ddp_timeout)) };
        let accelerator = Accelerator::with_kwargs_handlers(Self::accelerator_config(&args), Default::default(), init)?;
        accelerator.set_check_finite(!args.allow_non_finite);
        if let Some(train) = &train_dataset {
            ladder_core::recipe::check_batch_size(
                "per_device_train_batch_size",
                args.per_device_train_batch_size,
                train.len(),
                accelerator.num_processes(),
            )?;
            ladder_core::recipe::check_batch_fits_memory(
                "per_device_train_batch_size",
                args.per_device_train_batch_size,
                net.config().width,
                accelerator.local_num_processes(),
                accelerator.device(),
            )?;
        }
        let net_config = net.config();
        let model = accelerator.prepare_model(vs, net)?;
        let optimizer = accelerator.prepare_optimizer(&model, args.adamw())?;
        let device = accelerator.device();
        let move_to = |d: Dataset| {
            if d.device() == device {
                d
            } else {
                d.to_device(device)
            }
        };
        Ok(Self {
            state: TrainerState {
                is_local_process_zero: accelerator.is_local_main_process(),
                is_world_process_zero: accelerator.is_main_process(),
                ..Default::default()
            },
            args,
            accelerator,
            model,
            optimizer,
            net_config,
            train_dataset: train_dataset.map(move_to),
            eval_dataset: eval_dataset.map(move_to),
            collator: Box::new(data_collator),
            hooks: Box::new(hooks),
            callbacks: Vec::new(),
            trained: false,
        })
    }

    /// Adds a callback (called after [`DefaultFlowCallback`], in the order added).
    pub fn add_callback(&mut self, callback: impl TrainerCallback + 'static) {
        self.callbacks.push(Box::new(callback));
    }

    /// The arguments.
    pub fn args(&self) -> &TrainingArguments {
        &self.args
    }

    /// This process's rank.
    pub fn process_index(&self) -> usize {
        self.accelerator.process_index()
    }

    /// Number of processes.
    pub fn world_size(&self) -> usize {
        self.accelerator.num_processes()
    }

    /// Whether this is the main process (rank 0), the one that prints and writes files.
    pub fn is_world_process_zero(&self) -> bool {
        self.accelerator.is_main_process()
    }

    /// The device the model trains on.
    pub fn device(&self) -> Device {
        self.accelerator.device()
    }

    /// The Accelerator the Trainer runs on (as `trainer.accelerator` in Transformers).
    pub fn accelerator(&self) -> &Accelerator {
        &self.accelerator
    }

    /// The prepared (wrapped) model.
    pub fn model(&self) -> &PreparedModel {
        &self.model
    }

    fn say(&self, text: &str) {
        self.accelerator.print(text);
    }

    /// Trains for the planned steps (see the module docs), evaluating, logging and saving as
    /// the arguments say; `resume_from_checkpoint` restores weights, optimizer, schedule,
    /// data position (mid-epoch included), log history and loss sums first. With
    /// load_best_model_at_end the best checkpoint is loaded at the end. Collective: every rank
    /// calls it. Runs once per Trainer.
    ///
    /// # Errors
    /// No train dataset; an eval strategy without an eval dataset; a second call; output_dir holding checkpoints without
    /// overwrite_output_dir or a resume; unreadable checkpoints; callback refusals; data,
    /// model and collective errors.
    pub fn train(&mut self, resume_from_checkpoint: Option<ResumeFrom>) -> Result<TrainOutput> {
        let run_start = Instant::now();
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
        let (rank, world_size) = (self.accelerator.process_index(), self.accelerator.num_processes());
        let args = self.args.clone();
        let out_dir = args.output_dir.clone();

        // Where to resume from, and whether output_dir may be written.
        let resume_dir = match &resume_from_checkpoint {
            None => None,
            Some(ResumeFrom::Dir(d)) => Some(d.clone()),
            Some(ResumeFrom::Last) => {
                Some(checkpoints::last_checkpoint(&out_dir)?.ok_or_else(|| Error::NoCheckpoint { dir: out_dir.clone() })?)
            }
        };
        let existing = checkpoints::sorted_checkpoints(&out_dir, None)?;
        if resume_dir.is_none() && !existing.is_empty() {
            if !args.overwrite_output_dir {
                let found =
                    existing.iter().filter_map(|p| p.file_name()).map(|n| n.to_string_lossy().into_owned()).collect::<Vec<_>>().join(", ");
                return Err(Error::OutputDirNotEmpty { dir: out_dir, found });
            }
            self.accelerator.wait_for_everyone()?;
            if rank == 0 {
                for dir in &existing {
                    std::fs::remove_dir_all(dir).map_err(|e| Error::io(dir, e))?;
                }
            }
        }
        self.accelerator.wait_for_everyone()?;
        if rank == 0 {
            args.write_json()?;
        }

        // Plan.
        let plan = TrainingPlan::new(&args, train_dataset.len(), world_size);
        let schedule = LrSchedule::new(&args, plan.max_steps);
        let (acc, batch) = (args.gradient_accumulation_steps, args.per_device_train_batch_size);
        let batch_len = |b: usize| -> usize {
            if b + 1 < plan.batches_per_epoch {
                batch
            } else {
                plan.samples_per_rank - b * batch
            }
        };
        self.state = TrainerState {
            max_steps: plan.max_steps as u64,
            num_train_epochs: plan.num_epochs as u64,
            logging_steps: args.logging_steps as u64,
            eval_steps: args.eval_steps() as u64,
            save_steps: args.save_steps as u64,
            train_batch_size: batch as u64,
            is_local_process_zero: self.accelerator.is_local_main_process(),
            is_world_process_zero: rank == 0,
            ..Default::default()
        };

        let loader = self.accelerator.prepare_data_loader(&train_dataset, batch, true)?;
        debug_assert_eq!(loader.len(), plan.batches_per_epoch);

        // Resume: weights, optimizer, loader position and counters (the Accelerator), then the
        // Trainer's own state and loss sums.
        let mut sums = LossSums::default();
        let (mut start_epoch, mut skip, mut start_step) = (0usize, 0usize, 0u64);
        if let Some(dir) = &resume_dir {
            let position = self.accelerator.load_state(dir)?;
            let state_file = dir.join(TRAINER_STATE_FILE);
            self.state = TrainerState::load(&state_file)?;
            self.state.is_world_process_zero = rank == 0;
            self.state.max_steps = plan.max_steps as u64;
            if position.global_step != self.state.global_step {
                return Err(Error::BadCheckpoint {
                    file: state_file,
                    problem: format!("global_step {} but training_state.json says {}", self.state.global_step, position.global_step),
                });
            }
            sums = LossSums::from_extra(&position.extra, rank);
            (start_epoch, skip, start_step) = (position.epoch as usize, position.step_in_epoch as usize, position.global_step);
            self.say(&format!(
                "Resuming from {} at step {} (epoch {}, batch {} of the epoch)",
                dir.display(),
                position.global_step,
                position.epoch,
                position.step_in_epoch
            ));
        }

        let trainable = BasicNet::num_parameters(self.net_config.width) as u64;
        if rank == 0 {
            println!("{}", output::training_banner(&args, &plan, trainable));
        }
        let mut reporter = if rank == 0 { Some(ReportWriter::new(&args, resume_dir.is_some())?) } else { None };
        let mut control = TrainerControl::default();
        let mut flow = DefaultFlowCallback;
        flow.on_train_begin(&args, &self.state, &mut control)?;
        for cb in &mut self.callbacks {
            cb.on_train_begin(&args, &self.state, &mut control)?;
        }
        let mut progress = Progress::new(plan.max_steps as u64, rank == 0, args.disable_tqdm);
        progress.set_position(self.state.global_step);

        let mut paused_s = 0.0f64; // evaluation + checkpoint time, excluded from train_s
        let loop_start = Instant::now();
        let mut local_samples = 0u64;
        let mut global_step = start_step as usize;
        let mut last_grad_norm: Option<f64> = None;
        let mut last_lr = schedule.rate(global_step.saturating_sub(1));
        let mut stop = global_step >= plan.max_steps;
        let mut window_loss = 0.0f64; // Σ loss·n over this rank's micro-batches of the window

        for epoch in start_epoch..plan.num_epochs {
            if stop {
                break;
            }
            loader.set_epoch(epoch as u64);
            for (i, (images, labels)) in loader.iter().enumerate() {
                let b = skip + i;
                let k = b / acc;
                let window_start = k * acc;
                let window_len = plan.batches_in_update(k, acc);
                if b == window_start {
                    window_loss = 0.0;
                }
                let window_samples: usize = (window_start..window_start + window_len).map(batch_len).sum();
                let inputs = self.collator.collate(images, labels);
                let n = inputs.len();
                let (accelerator, model, hooks) = (&self.accelerator, &self.model, &self.hooks);
                let optimizer = &mut self.optimizer;
                let step = accelerator.accumulate(model, || -> Result<Option<(f64, Option<f64>)>> {
                    let (loss, _) = hooks.compute_loss(&mut TrainerModel { model, accelerator, train: true }, &inputs)?;
                    // The window's gradient is the mean over its samples: weight unequal
                    // micro-batches (the Accelerator divides by the window's length).
                    let weight = (n * window_len) as f64 / window_samples as f64;
                    if weight == 1.0 {
                        accelerator.backward(&loss)?;
                    } else {
                        accelerator.backward(&(&loss * weight))?;
                    }
                    window_loss += loss.double_value(&[]) * n as f64;
                    if !accelerator.sync_gradients() {
                        return Ok(None);
                    }
                    let grad_norm = if args.max_grad_norm > 0.0 { accelerator.clip_grad_norm_(args.max_grad_norm)? } else { None };
                    let lr = schedule.rate(global_step);
                    optimizer.set_lr(lr);
                    optimizer.step()?;
                    optimizer.zero_grad();
                    Ok(Some((lr, grad_norm)))
                })?;
                local_samples += n as u64;
                let Some((lr, grad_norm)) = step else {
                    continue;
                };
                (last_lr, last_grad_norm) = (lr, grad_norm);
                global_step += 1;
                sums.add_step(window_loss / window_samples as f64);
                self.state.global_step = global_step as u64;
                self.state.epoch = global_step as f64 / plan.updates_per_epoch as f64;
                progress.set_position(global_step as u64);

                flow.on_step_end(&args, &self.state, &mut control);
                for cb in &mut self.callbacks {
                    cb.on_step_end(&args, &self.state, &mut control);
                }
                let t = Instant::now();
                self.log_evaluate_save(&mut control, &mut sums, last_lr, last_grad_norm, &progress, reporter.as_mut())?;
                paused_s += t.elapsed().as_secs_f64();
                self.accelerator.restart_step_clock(); // evaluation and saving are no step's time
                if control.should_training_stop || global_step >= plan.max_steps {
                    stop = true;
                }
                if stop || control.should_epoch_stop {
                    control.should_epoch_stop = false;
                    break;
                }
            }
            skip = 0;
            flow.on_epoch_end(&args, &self.state, &mut control);
            for cb in &mut self.callbacks {
                cb.on_epoch_end(&args, &self.state, &mut control);
            }
            let t = Instant::now();
            self.log_evaluate_save(&mut control, &mut sums, last_lr, last_grad_norm, &progress, reporter.as_mut())?;
            paused_s += t.elapsed().as_secs_f64();
            if control.should_training_stop {
                break;
            }
        }
        let train_s = (loop_start.elapsed().as_secs_f64() - paused_s).max(1e-9);
        progress.finish();

        if args.load_best_model_at_end {
            if let Some(best) = self.state.best_model_checkpoint.clone() {
                self.say(&format!("Loading best model from {} (score: {:?}).", best.display(), self.state.best_metric));
                self.accelerator.load_state(&best)?;
            }
        }

        // Summary, as Transformers' final log entry.
        let total = sums.all_reduced_total(&self.accelerator)?;
        let training_loss = total.0 / (world_size as f64 * total.1.max(1.0));
        let runtime = run_start.elapsed().as_secs_f64();
        let trained_steps = (global_step as u64).saturating_sub(start_step) as f64;
        let samples_all = (local_samples * world_size as u64) as f64;
        let metrics: Metrics = [
            ("train_runtime".to_string(), runtime),
            ("train_samples_per_second".to_string(), samples_all / runtime.max(1e-9)),
            ("train_steps_per_second".to_string(), trained_steps / runtime.max(1e-9)),
            ("total_flos".to_string(), 0.0),
            ("train_loss".to_string(), training_loss),
        ]
        .into_iter()
        .collect();
        let entry = LogEntry { values: metrics.clone(), epoch: self.state.epoch, step: global_step as u64 };
        self.push_log(entry, &progress, reporter.as_mut())?;
        flow.on_train_end(&args, &self.state, &mut control);
        for cb in &mut self.callbacks {
            cb.on_train_end(&args, &self.state, &mut control);
        }
        if rank == 0 {
            self.state.save(&out_dir.join(TRAINER_STATE_FILE))?;
            output::plot_loss_curve(&out_dir.join("loss.svg"), &self.state.loss_curve(), &self.state.eval_loss_curve())?;
            let table = output::epoch_table(&self.state.log_history, args.eval_strategy != IntervalStrategy::Steps);
            if table.row_count() > 0 {
                println!("{table}");
            }
        }
        let mut metrics = metrics;
        metrics.insert("epoch".into(), self.state.epoch);
        self.accelerator.wait_for_everyone()?;
        // Training completed: dropping the Trainer finalises the process group normally (an
        // error before this point leaves it to the launcher to stop the other processes).
        self.accelerator.end_training();
        Ok(TrainOutput {
            global_step: global_step as u64,
            training_loss,
            metrics,
            local_samples,
            train_s,
            comm_s: self.model.comm_seconds(),
            model_state: self.model.memory(),
        })
    }

    fn push_log(&mut self, entry: LogEntry, progress: &Progress, reporter: Option<&mut ReportWriter>) -> Result<()> {
        if let Some(r) = reporter {
            r.write(&entry)?;
        }
        let mut control = TrainerControl::default();
        for cb in &mut self.callbacks {
            cb.on_log(&self.args, &self.state, &mut control, &entry);
        }
        progress.println(&output::log_line(&entry));
        self.state.log_history.push(entry);
        Ok(())
    }

    /// Acts on should_log / should_evaluate / should_save, in Transformers' order.
    fn log_evaluate_save(
        &mut self,
        control: &mut TrainerControl,
        sums: &mut LossSums,
        lr: f64,
        grad_norm: Option<f64>,
        progress: &Progress,
        mut reporter: Option<&mut ReportWriter>,
    ) -> Result<()> {
        let step = self.state.global_step;
        if control.should_log {
            control.should_log = false;
            if sums.window_steps > 0 {
                let loss = sums.take_window(&self.accelerator)?;
                let mut values = vec![("loss", loss), ("learning_rate", lr)];
                if let Some(g) = grad_norm {
                    values.push(("grad_norm", g));
                }
                self.push_log(LogEntry::new(step, self.state.epoch, values), progress, reporter.as_deref_mut())?;
            }
        }
        let mut new_best = false;
        if control.should_evaluate {
            control.should_evaluate = false;
            if self.eval_dataset.is_some() {
                let metrics = self.evaluate_inner("eval", progress, reporter)?;
                for cb in &mut self.callbacks {
                    cb.on_evaluate(&self.args, &self.state, control, &metrics);
                }
                new_best = self.determine_best_metric(&metrics)?;
            }
        }
        if control.should_save {
            control.should_save = false;
            self.save_checkpoint(sums, new_best)?;
            for cb in &mut self.callbacks {
                cb.on_save(&self.args, &self.state, control);
            }
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

    /// Writes output_dir/checkpoint-<step>/ through `accelerator.save_state` (the main
    /// process, atomically) with trainer_state.json, scheduler.json and training_args.json,
    /// then rotates. Collective.
    fn save_checkpoint(&mut self, sums: &LossSums, new_best: bool) -> Result<()> {
        let dir = checkpoints::checkpoint_dir(&self.args.output_dir, self.state.global_step);
        let extra = sums.checkpoint_extra(&self.accelerator)?;
        if new_best || self.state.best_global_step == Some(self.state.global_step) {
            self.state.best_model_checkpoint = Some(dir.clone());
        }
        let scheduler = serde_json::json!({ "last_epoch": self.state.global_step, "lr_scheduler_type": self.args.lr_scheduler_type });
        let files = [
            (TRAINER_STATE_FILE, serde_json::to_vec_pretty(&self.state).expect("TrainerState serialises")),
            (SCHEDULER_FILE, serde_json::to_vec_pretty(&scheduler).expect("json")),
            (TRAINING_ARGS_FILE, serde_json::to_vec_pretty(&self.args).expect("TrainingArguments serialise")),
        ];
        self.accelerator.save_state_with(&dir, extra, &files)?;
        if self.accelerator.is_main_process() {
            checkpoints::rotate_checkpoints(
                &self.args.output_dir,
                self.args.save_total_limit,
                self.state.best_model_checkpoint.as_deref(),
            )?;
        }
        self.accelerator.wait_for_everyone()?;
        Ok(())
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
        let loader = self.accelerator.prepare_data_loader(data, bs, false)?;
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
        let sums = self.accelerator.reduce(&Tensor::from_slice(&[loss_sum, count as f64]).to_device(self.accelerator.device()), "sum")?;
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

    /// Writes the model's weights to `output_dir/model.safetensors` with BasicNet's plain keys
    /// (`conv1.weight`, …; FSDP gathers them), on the main process, as Transformers'
    /// `save_model()`. Collective.
    ///
    /// # Errors
    /// [`Error::Io`] naming the directory; an invalid value naming `output_dir/model.safetensors`
    /// when the file cannot be written.
    pub fn save_model(&self) -> Result<PathBuf> {
        let path = self.args.output_dir.join(core_ckpt::MODEL_FILE);
        if let Some(weights) = self.accelerator.get_state_dict()? {
            std::fs::create_dir_all(&self.args.output_dir).map_err(|e| Error::io(&self.args.output_dir, e))?;
            ladder_core::recipe::save_weights(&path, &weights)
                .map_err(|e| e.named_by(&[(ladder_core::recipe::WEIGHTS_FILE, "output_dir/model.safetensors")]))?;
        }
        self.accelerator.wait_for_everyone()?;
        Ok(path)
    }

    /// The trained model unwrapped on the CPU (a plain BasicNet with its VarStore), on the main
    /// process; `None` on the others. Collective.
    ///
    /// # Errors
    /// Collective errors.
    pub fn unwrap_model(&self) -> Result<Option<(nn::VarStore, BasicNet)>> {
        Ok(self.accelerator.unwrap_model(self.net_config)?)
    }
}

/// Running sums of per-step losses: this rank's `Σ_k (Σ_b l_b·n_b / Σ_b n_b)` over the logging
/// window and over the run. With equal per-rank step sizes (the padded sampler), the mean over
/// ranks of these equals the mean over all samples of every step.
#[derive(Debug, Clone, Copy, Default)]
struct LossSums {
    window_sum: f64,
    window_steps: u64,
    total_sum: f64,
    total_steps: u64,
}

impl LossSums {
    fn add_step(&mut self, local_step_loss: f64) {
        self.window_sum += local_step_loss;
        self.window_steps += 1;
        self.total_sum += local_step_loss;
        self.total_steps += 1;
    }

    /// The window's mean step loss over all ranks; resets the window. Collective.
    fn take_window(&mut self, acc: &Accelerator) -> Result<f64> {
        let t = acc.reduce(&Tensor::from_slice(&[self.window_sum]).to_device(acc.device()), "sum")?;
        let loss = t.double_value(&[0]) / (acc.num_processes() as f64 * self.window_steps as f64);
        self.window_sum = 0.0;
        self.window_steps = 0;
        Ok(loss)
    }

    /// `(Σ over ranks of total_sum, total_steps)`. Collective.
    fn all_reduced_total(&self, acc: &Accelerator) -> Result<(f64, f64)> {
        let t = acc.reduce(&Tensor::from_slice(&[self.total_sum]).to_device(acc.device()), "sum")?;
        Ok((t.double_value(&[0]), self.total_steps as f64))
    }

    /// The sums over ranks, for a checkpoint. Collective.
    fn checkpoint_extra(&self, acc: &Accelerator) -> Result<serde_json::Map<String, serde_json::Value>> {
        let t = acc.reduce(&Tensor::from_slice(&[self.window_sum, self.total_sum]).to_device(acc.device()), "sum")?;
        let v = Vec::<f64>::try_from(t.to_device(Device::Cpu))?;
        let mut m = serde_json::Map::new();
        m.insert("loss_window_sum".into(), v[0].into());
        m.insert("loss_window_steps".into(), self.window_steps.into());
        m.insert("loss_total_sum".into(), v[1].into());
        m.insert("loss_total_steps".into(), self.total_steps.into());
        Ok(m)
    }

    /// Restores from a checkpoint: rank 0 carries the summed values, the others start at 0,
    /// so the sums over ranks are preserved.
    fn from_extra(extra: &serde_json::Map<String, serde_json::Value>, rank: usize) -> Self {
        let f = |k: &str| extra.get(k).and_then(|v| v.as_f64()).unwrap_or(0.0);
        let u = |k: &str| extra.get(k).and_then(|v| v.as_u64()).unwrap_or(0);
        let main = if rank == 0 { 1.0 } else { 0.0 };
        Self {
            window_sum: f("loss_window_sum") * main,
            window_steps: u("loss_window_steps"),
            total_sum: f("loss_total_sum") * main,
            total_steps: u("loss_total_steps"),
        }
    }
}
