//! The `Trainer`, as 🤗 Transformers' `Trainer`: the user hands over a model, datasets, a data
//! collator, [`TrainerHooks`] (`compute_loss`, `compute_metrics`) and [`TrainingArguments`];
//! [`Trainer::train`] runs the whole distributed loop on one process or many.
//!
//! # What one optimization step does (every rank)
//! For each micro-batch of the accumulation window: seed dropout from (seed, rank, micro-batch
//! index), `compute_loss` (mean over the micro-batch), backward of that loss scaled by
//! `n_micro / n_window` (the samples of this micro-batch over the window's; 1 without
//! accumulation), with the gradient sync switched off except on the window's last
//! micro-batch. Then clip (max_grad_norm > 0), set the scheduled learning rate, AdamW step.
//! The gradient is the mean over every sample of the window on every rank — the short last
//! window of an epoch included, and the 2024 accumulation loss bug absent by construction.
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
use ladder_core::checkpoint::{self as core_ckpt, Checkpoint, TrainingState};
use ladder_core::data::{eval_shard, DataLoader, Dataset, DistributedSampler};
use ladder_core::device::DeviceKind;
use ladder_core::dist::{self, Backend, ProcessGroup, ReduceOp};
use ladder_core::memory::ModelStateBytes;
use ladder_core::model::{BasicNet, BasicNetConfig};
use ladder_core::optim::AdamW;
use ladder_core::wrapped::{WrapConfig, WrappedModel};
use std::path::{Path, PathBuf};
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
/// in train mode (dropout on, the wrapped DDP/FSDP model) or eval mode (dropout off).
#[derive(Debug)]
pub struct TrainerModel<'a> {
    inner: ModelInner<'a>,
}

#[derive(Debug)]
enum ModelInner<'a> {
    Wrapped(&'a mut WrappedModel<'static>),
    Plain(&'a BasicNet),
}

impl TrainerModel<'_> {
    /// `model(x)`: inputs `[b, 1, 28, 28]` f32 → log-probabilities `[b, 10]`.
    ///
    /// # Errors
    /// FSDP's gather errors.
    pub fn forward(&mut self, x: &Tensor) -> Result<Tensor> {
        use tch::nn::ModuleT;
        match &mut self.inner {
            ModelInner::Wrapped(m) => Ok(m.forward_t(x, true)?),
            ModelInner::Plain(net) => Ok(net.forward_t(x, false)),
        }
    }
    /// Whether the model is in train mode.
    pub fn is_training(&self) -> bool {
        matches!(self.inner, ModelInner::Wrapped(_))
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
    pg: &'static dyn ProcessGroup,
    device: Device,
    vs: nn::VarStore,
    net: BasicNet,
    train_dataset: Option<Dataset>,
    eval_dataset: Option<Dataset>,
    collator: Box<dyn DataCollator>,
    hooks: Box<dyn TrainerHooks>,
    callbacks: Vec<Box<dyn TrainerCallback>>,
    /// The run's state (global step, log history, best metric).
    pub state: TrainerState,
}

impl std::fmt::Debug for Trainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer")
            .field("args", &self.args)
            .field("rank", &self.pg.rank())
            .field("world_size", &self.pg.world_size())
            .field("device", &self.device)
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

impl Drop for Trainer {
    fn drop(&mut self) {
        // The process group was leaked to hand out 'static references; finalise it here.
        self.pg.shutdown();
    }
}

impl Trainer {
    /// A Trainer for `model` (built in `vs`, on any device: it is moved to the arguments'
    /// device), as `Trainer(model, args, train_dataset, eval_dataset, data_collator)`;
    /// `hooks` is the `Trainer` subclass's overrides. Starts the process group from the
    /// launcher's environment (world 1 without one): mpi on CPU, nccl on CUDA.
    ///
    /// # Errors
    /// Invalid arguments ([`TrainingArguments::validate`], an unknown metric_for_best_model);
    /// an unavailable device or backend; process-group errors.
    pub fn new(
        mut vs: nn::VarStore,
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
        if args.bf16 && args.fsdp.is_none() {
            return Err(Error::invalid("bf16", true, "fsdp set (bf16 mixed precision is FSDP's MixedPrecision here)"));
        }
        let kind = args.device_kind();
        let backend = match kind {
            DeviceKind::Cpu => Backend::Mpi,
            DeviceKind::Cuda => Backend::Nccl,
        };
        let pg = dist::leak(dist::init_process_group(backend)?);
        let local_rank = dist::DistEnv::from_env()?.local_rank;
        let device = kind.resolve(local_rank)?;
        vs.set_device(device);
        let is_main = pg.rank() == 0;
        Ok(Self {
            state: TrainerState { is_local_process_zero: local_rank == 0, is_world_process_zero: is_main, ..Default::default() },
            args,
            pg,
            device,
            vs,
            net,
            train_dataset: train_dataset.map(|d| d.to_device(device)),
            eval_dataset: eval_dataset.map(|d| d.to_device(device)),
            collator: Box::new(data_collator),
            hooks: Box::new(hooks),
            callbacks: Vec::new(),
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
        self.pg.rank()
    }

    /// Number of processes.
    pub fn world_size(&self) -> usize {
        self.pg.world_size()
    }

    /// Whether this is the main process (rank 0), the one that prints and writes files.
    pub fn is_world_process_zero(&self) -> bool {
        self.pg.rank() == 0
    }

    /// The device the model trains on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The process group (for figures the caller gathers itself).
    pub fn process_group(&self) -> &'static dyn ProcessGroup {
        self.pg
    }

    /// The current weights, unwrapped (`conv1.weight`, …), identical on every rank after
    /// [`train`](Self::train).
    pub fn model(&self) -> (&nn::VarStore, &BasicNet) {
        (&self.vs, &self.net)
    }

    fn say(&self, text: &str) {
        if self.pg.rank() == 0 {
            println!("{text}");
        }
    }

    /// Trains for the planned steps (see the module docs), evaluating, logging and saving as
    /// the arguments say; `resume_from_checkpoint` restores weights, optimizer, schedule,
    /// data position (mid-epoch included) and log history first. With load_best_model_at_end
    /// the best checkpoint's weights are loaded at the end. Collective: every rank calls it.
    ///
    /// # Errors
    /// No train dataset; output_dir holding checkpoints without overwrite_output_dir or a
    /// resume; unreadable checkpoints; callback refusals; data, model and collective errors.
    pub fn train(&mut self, resume_from_checkpoint: Option<ResumeFrom>) -> Result<TrainOutput> {
        let run_start = Instant::now();
        let Some(train_dataset) = self.train_dataset.as_ref().map(Dataset::shallow_clone) else {
            return Err(Error::invalid("train_dataset", "None", "a training dataset for Trainer::train"));
        };
        let (rank, world_size) = (self.pg.rank(), self.pg.world_size());
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
                let found = existing.iter().filter_map(|p| p.file_name()).map(|n| n.to_string_lossy().into_owned()).collect::<Vec<_>>().join(", ");
                return Err(Error::OutputDirNotEmpty { dir: out_dir, found });
            }
            self.pg.barrier()?;
            if rank == 0 {
                for dir in &existing {
                    std::fs::remove_dir_all(dir).map_err(|e| Error::io(dir, e))?;
                }
            }
        }
        self.pg.barrier()?;
        if rank == 0 {
            args.write_json()?;
        }

        // Plan.
        let plan = TrainingPlan::new(&args, train_dataset.len(), world_size);
        if plan.max_steps == 0 {
            return Err(Error::invalid(
                "per_device_train_batch_size",
                args.per_device_train_batch_size,
                format!("at most the {} examples each process sees per epoch (dataloader_drop_last leaves no batch)", plan.samples_per_rank),
            ));
        }
        let schedule = LrSchedule::new(&args, plan.max_steps);
        let (acc, batch) = (args.gradient_accumulation_steps, args.per_device_train_batch_size);
        let batch_len = |b: usize| -> usize {
            if args.dataloader_drop_last || b + 1 < plan.batches_per_epoch { batch } else { plan.samples_per_rank - b * batch }
        };
        self.state = TrainerState {
            max_steps: plan.max_steps as u64,
            num_train_epochs: plan.num_epochs as u64,
            logging_steps: args.logging_steps as u64,
            eval_steps: args.eval_steps() as u64,
            save_steps: args.save_steps as u64,
            train_batch_size: batch as u64,
            is_local_process_zero: self.state.is_local_process_zero,
            is_world_process_zero: rank == 0,
            ..Default::default()
        };

        // Wrap a copy of the model (DDP broadcasts rank 0's weights; FSDP shards them).
        let (wvs, wnet) = self.fresh_copy()?;
        let wrap = WrapConfig {
            strategy: args.strategy(),
            mixed_precision: args.bf16.then(ladder_core::fsdp::MixedPrecision::bf16),
            ..WrapConfig::default()
        };
        let mut model = WrappedModel::new(wvs, wnet, self.pg, &wrap)?;
        let mut opt: AdamW = model.optimizer(args.adamw())?;

        // Resume: weights, optimizer, position, state, loss accumulators.
        let mut position = TrainingState { seed: args.seed, world_size, ..Default::default() };
        let mut sums = LossSums::default();
        if let Some(dir) = &resume_dir {
            let ckpt = core_ckpt::load(dir)?;
            if ckpt.state.world_size != world_size {
                return Err(Error::BadCheckpoint {
                    file: dir.join(core_ckpt::STATE_FILE),
                    problem: format!("written by {} processes, resumed by {world_size}; resume at the same world size", ckpt.state.world_size),
                });
            }
            model.load_full_state_dict(&ckpt.model)?;
            model.load_optimizer_state_dict(&mut opt, &ckpt.optimizer)?;
            let state_file = dir.join(TRAINER_STATE_FILE);
            self.state = TrainerState::load(&state_file)?;
            self.state.is_world_process_zero = rank == 0;
            sums = LossSums::from_extra(&ckpt.state.extra, rank);
            position = ckpt.state;
            if position.global_step != self.state.global_step {
                return Err(Error::BadCheckpoint {
                    file: state_file,
                    problem: format!("global_step {} but training_state.json says {}", self.state.global_step, position.global_step),
                });
            }
            self.state.max_steps = plan.max_steps as u64;
            self.say(&format!("Resuming from {} at step {} (epoch {}, batch {} of the epoch)", dir.display(), position.global_step, position.epoch, position.step_in_epoch));
        }

        let trainable = BasicNet::num_parameters(self.net.config().width) as u64;
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
        let progress = Progress::new(plan.max_steps as u64, rank == 0, args.disable_tqdm);
        progress.set_position(self.state.global_step);

        let sampler = DistributedSampler::new(train_dataset.len(), world_size, rank, true, args.data_seed(), false)?;
        let mut loader = DataLoader::new(&train_dataset, batch, Box::new(sampler))?.drop_last(args.dataloader_drop_last);

        let mut paused_s = 0.0f64; // evaluation + checkpoint time, excluded from train_s
        let loop_start = Instant::now();
        let mut local_samples = 0u64;
        let mut global_step = position.global_step as usize;
        let mut batches_seen = position.batches_seen;
        let mut last_grad_norm: Option<f64> = None;
        let mut last_lr = schedule.rate(global_step.saturating_sub(1));
        let (start_epoch, mut skip) = (position.epoch as usize, position.step_in_epoch as usize);
        let mut stop = global_step >= plan.max_steps;

        'epochs: for epoch in start_epoch..plan.num_epochs {
            if stop {
                break;
            }
            loader.set_epoch(epoch as u64);
            let mut window_loss = 0.0f64; // Σ loss·n over this rank's micro-batches of the window
            for (b, (images, labels)) in loader.iter().enumerate().skip(skip) {
                let k = b / acc;
                let window_len = plan.batches_in_update(k, acc);
                let window_start = k * acc;
                let last_in_window = b + 1 == window_start + window_len;
                let window_samples: usize = (window_start..window_start + window_len).map(batch_len).sum();
                ladder_core::train::seed_batch(args.seed, rank, batches_seen);
                if b == window_start {
                    opt.zero_grad();
                    window_loss = 0.0;
                }
                model.set_require_backward_grad_sync(last_in_window);
                let inputs = self.collator.collate(images, labels);
                let n = inputs.len();
                let (loss, _) = self.hooks.compute_loss(&mut TrainerModel { inner: ModelInner::Wrapped(&mut model) }, &inputs)?;
                if window_len == 1 {
                    model.backward(&loss)?;
                } else {
                    model.backward(&(&loss * (n as f64 / window_samples as f64)))?;
                }
                window_loss += loss.double_value(&[]) * n as f64;
                batches_seen += 1;
                local_samples += n as u64;
                if !last_in_window {
                    continue;
                }
                // The optimizer step.
                last_grad_norm = if args.max_grad_norm > 0.0 { Some(model.clip_grad_norm(args.max_grad_norm)?) } else { None };
                last_lr = schedule.rate(global_step);
                opt.set_lr(last_lr);
                opt.step();
                global_step += 1;
                sums.add_step(window_loss / window_samples as f64);
                self.state.global_step = global_step as u64;
                self.state.epoch = global_step as f64 / plan.updates_per_epoch as f64;
                progress.set_position(global_step as u64);

                flow.on_step_end(&args, &self.state, &mut control);
                for cb in &mut self.callbacks {
                    cb.on_step_end(&args, &self.state, &mut control);
                }
                let at = Position { epoch: epoch as u64, step_in_epoch: (b + 1) as u64, batches_seen };
                let t = Instant::now();
                self.log_evaluate_save(&mut control, &mut model, &opt, &mut sums, at, last_lr, last_grad_norm, &progress, reporter.as_mut())?;
                paused_s += t.elapsed().as_secs_f64();
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
            let at = Position { epoch: epoch as u64 + 1, step_in_epoch: 0, batches_seen };
            let t = Instant::now();
            self.log_evaluate_save(&mut control, &mut model, &opt, &mut sums, at, last_lr, last_grad_norm, &progress, reporter.as_mut())?;
            paused_s += t.elapsed().as_secs_f64();
            if control.should_training_stop {
                break 'epochs;
            }
        }
        let train_s = (loop_start.elapsed().as_secs_f64() - paused_s).max(1e-9);
        progress.finish();

        // The trained weights back into the plain model, on every rank.
        self.pull_weights(&model)?;
        if args.load_best_model_at_end {
            if let Some(best) = self.state.best_model_checkpoint.clone() {
                self.say(&format!("Loading best model from {} (score: {:?}).", best.display(), self.state.best_metric));
                let ckpt = core_ckpt::load(&best)?;
                load_plain(&mut self.vs, &ckpt.model, &best)?;
            }
        }

        // Summary, as Transformers' final log entry.
        let total = sums.all_reduced_total(self.pg)?;
        let training_loss = total.0 / (world_size as f64 * total.1.max(1.0));
        let runtime = run_start.elapsed().as_secs_f64();
        let trained_steps = (global_step as u64).saturating_sub(position.global_step) as f64;
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
        self.pg.barrier()?;
        Ok(TrainOutput {
            global_step: global_step as u64,
            training_loss,
            metrics,
            local_samples,
            train_s,
            comm_s: model.comm_seconds(),
            model_state: model.memory(),
        })
    }

    /// A fresh BasicNet with the current weights, for wrapping.
    fn fresh_copy(&self) -> Result<(nn::VarStore, BasicNet)> {
        let mut vs = nn::VarStore::new(self.device);
        let net = BasicNet::new(&vs.root(), BasicNetConfig { ..self.net.config() });
        vs.copy(&self.vs)?;
        Ok((vs, net))
    }

    /// Copies the wrapped model's current weights into the plain model on every rank (FSDP:
    /// gathered on rank 0, broadcast).
    fn pull_weights(&mut self, model: &WrappedModel<'static>) -> Result<()> {
        let full = model.full_state_dict(self.pg)?;
        if let Some(full) = &full {
            load_plain(&mut self.vs, full, Path::new("the wrapped model's full state dict"))?;
        }
        if self.pg.world_size() > 1 {
            let vars = self.vs.variables();
            let mut names: Vec<&String> = vars.keys().collect();
            names.sort();
            let mut tensors: Vec<Tensor> = names.iter().map(|n| vars[*n].shallow_clone()).collect();
            tch::no_grad(|| self.pg.broadcast_coalesced(&mut tensors, 0))?;
        }
        Ok(())
    }

    fn push_log(&mut self, entry: LogEntry, progress: &Progress, reporter: Option<&mut ReportWriter>) -> Result<()> {
        if let Some(r) = reporter {
            r.write(&entry)?;
        }
        let mut control = TrainerControl::default();
        for cb in &mut self.callbacks {
            cb.on_log(&self.args, &self.state, &mut control, &entry);
        }
        if progress.is_bar() || self.pg.rank() == 0 {
            progress.println(&output::log_line(&entry));
        }
        self.state.log_history.push(entry);
        Ok(())
    }

    /// Acts on should_log / should_evaluate / should_save, in Transformers' order.
    #[allow(clippy::too_many_arguments)]
    fn log_evaluate_save(
        &mut self,
        control: &mut TrainerControl,
        model: &mut WrappedModel<'static>,
        opt: &AdamW,
        sums: &mut LossSums,
        at: Position,
        lr: f64,
        grad_norm: Option<f64>,
        progress: &Progress,
        reporter: Option<&mut ReportWriter>,
    ) -> Result<()> {
        let step = self.state.global_step;
        let mut reporter = reporter;
        if control.should_log {
            control.should_log = false;
            if sums.window_steps > 0 {
                let loss = sums.take_window(self.pg)?;
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
                self.pull_weights(model)?;
                let metrics = self.evaluate_inner("eval", progress, reporter.as_deref_mut())?;
                for cb in &mut self.callbacks {
                    cb.on_evaluate(&self.args, &self.state, control, &metrics);
                }
                new_best = self.determine_best_metric(&metrics)?;
            }
        }
        if control.should_save {
            control.should_save = false;
            self.save_checkpoint(model, opt, sums, at, new_best)?;
            for cb in &mut self.callbacks {
                cb.on_save(&self.args, &self.state, control);
            }
        }
        Ok(())
    }

    /// Updates best_metric / best_global_step; true when this evaluation is the new best.
    fn determine_best_metric(&mut self, metrics: &Metrics) -> Result<bool> {
        let Some(key) = self.args.best_metric_key() else { return Ok(false) };
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
                if self.args.greater_is_better() { value > best } else { value < best }
            }
        };
        if better {
            self.state.best_metric = Some(value);
            self.state.best_global_step = Some(self.state.global_step);
        }
        Ok(better)
    }

    /// Writes output_dir/checkpoint-<step>/ (rank 0, atomically) and rotates. Collective.
    fn save_checkpoint(&mut self, model: &WrappedModel<'static>, opt: &AdamW, sums: &LossSums, at: Position, new_best: bool) -> Result<()> {
        let dir = checkpoints::checkpoint_dir(&self.args.output_dir, self.state.global_step);
        let model_sd = model.full_state_dict(self.pg)?;
        let opt_sd = model.optimizer_state_dict(opt, self.pg)?;
        let extra = sums.to_extra(self.pg)?;
        if new_best || self.state.best_global_step == Some(self.state.global_step) {
            self.state.best_model_checkpoint = Some(dir.clone());
        }
        if self.pg.rank() == 0 {
            let ckpt = Checkpoint {
                model: model_sd.unwrap_or_default(),
                optimizer: opt_sd.unwrap_or_default(),
                state: TrainingState {
                    global_step: self.state.global_step,
                    batches_seen: at.batches_seen,
                    epoch: at.epoch,
                    step_in_epoch: at.step_in_epoch,
                    seed: self.args.seed,
                    world_size: self.pg.world_size(),
                    extra,
                },
            };
            let scheduler = serde_json::json!({ "last_epoch": self.state.global_step, "lr_scheduler_type": self.args.lr_scheduler_type });
            let files = [
                (TRAINER_STATE_FILE, serde_json::to_vec_pretty(&self.state).expect("TrainerState serialises")),
                (SCHEDULER_FILE, serde_json::to_vec_pretty(&scheduler).expect("json")),
                (TRAINING_ARGS_FILE, serde_json::to_vec_pretty(&self.args).expect("TrainingArguments serialise")),
            ];
            core_ckpt::save(&dir, &ckpt, &files)?;
            checkpoints::rotate_checkpoints(&self.args.output_dir, self.args.save_total_limit, self.state.best_model_checkpoint.as_deref())?;
        }
        self.pg.barrier()?;
        Ok(())
    }

    /// Runs the evaluation loop over the eval dataset with the plain model and logs the
    /// metrics.
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
        let progress = Progress::new(0, self.pg.rank() == 0, true);
        self.evaluate_inner(metric_key_prefix, &progress, None)
    }

    /// Predictions, labels and metrics over `dataset` (Transformers' `predict`, prefix
    /// `test`). Collective.
    ///
    /// # Errors
    /// Forward and collective errors.
    pub fn predict(&mut self, dataset: &Dataset) -> Result<PredictionOutput> {
        let data = dataset.to_device(self.device);
        self.prediction_loop(&data, "test")
    }

    fn prediction_loop(&mut self, data: &Dataset, prefix: &str) -> Result<PredictionOutput> {
        let start = Instant::now();
        let (rank, w) = (self.pg.rank(), self.pg.world_size());
        let n = data.len();
        let shard = eval_shard(n, rank, w);
        let part = data.slice(shard.clone());
        let bs = self.args.per_device_eval_batch_size;
        let (mut loss_sum, mut outputs, mut labels, mut steps) = (0.0f64, Vec::new(), Vec::new(), 0usize);
        tch::no_grad(|| -> Result<()> {
            let mut s = 0;
            while s < part.len() {
                let len = bs.min(part.len() - s);
                let p = part.slice(s..s + len);
                let inputs = self.collator.collate(p.images.shallow_clone(), p.labels.shallow_clone());
                let (loss, out) = self.hooks.compute_loss(&mut TrainerModel { inner: ModelInner::Plain(&self.net) }, &inputs)?;
                loss_sum += loss.double_value(&[]) * len as f64;
                outputs.push(out.to_kind(Kind::Float));
                labels.push(inputs.labels.to_kind(Kind::Int64));
                s += len;
                steps += 1;
            }
            Ok(())
        })?;
        let mut sums = Tensor::from_slice(&[loss_sum, part.len() as f64]).to_device(self.pg.device());
        self.pg.all_reduce(&mut sums, ReduceOp::Sum)?;
        let sums = Vec::<f64>::try_from(sums.to_device(Device::Cpu))?;
        let classes = outputs.first().map(|o| o.size()[1]).unwrap_or(10);
        let (predictions, label_ids) = self.gather_rows(&outputs, &labels, classes, n)?;
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

    /// Gathers every rank's contiguous shard of rows (outputs `[n_r, classes]`, labels `[n_r]`)
    /// into the whole set in order: each shard padded to `ceil(n / W)` rows, all-gathered, the
    /// padding removed (as `gather_for_metrics`).
    fn gather_rows(&self, outputs: &[Tensor], labels: &[Tensor], classes: i64, n: usize) -> Result<(Tensor, Tensor)> {
        let w = self.pg.world_size();
        let dev = self.pg.device();
        let cat = |ts: &[Tensor], shape: &[i64], kind: Kind| {
            if ts.is_empty() { Tensor::zeros(shape, (kind, dev)) } else { Tensor::cat(ts, 0).to_device(dev) }
        };
        let out = cat(outputs, &[0, classes], Kind::Float);
        let lab = cat(labels, &[0], Kind::Int64);
        if w == 1 {
            return Ok((out.to_device(Device::Cpu), lab.to_device(Device::Cpu)));
        }
        let rows = n.div_ceil(w) as i64;
        let pad = |t: &Tensor, row: &[i64]| -> Tensor {
            let have = t.size()[0];
            let mut shape = vec![rows - have];
            shape.extend_from_slice(row);
            Tensor::cat(&[t.shallow_clone(), Tensor::zeros(&shape, (t.kind(), dev))], 0).contiguous()
        };
        let (po, pl) = (pad(&out, &[classes]), pad(&lab, &[]));
        let mut go = Tensor::zeros([w as i64 * rows, classes], (Kind::Float, dev));
        let mut gl = Tensor::zeros([w as i64 * rows], (Kind::Int64, dev));
        self.pg.all_gather(&mut go, &po)?;
        self.pg.all_gather(&mut gl, &pl)?;
        let (mut keep_o, mut keep_l) = (Vec::new(), Vec::new());
        for r in 0..w {
            let len = eval_shard(n, r, w).len() as i64;
            keep_o.push(go.narrow(0, r as i64 * rows, len));
            keep_l.push(gl.narrow(0, r as i64 * rows, len));
        }
        Ok((Tensor::cat(&keep_o, 0).to_device(Device::Cpu), Tensor::cat(&keep_l, 0).to_device(Device::Cpu)))
    }

    /// Writes the current (unwrapped) weights to `output_dir/model.safetensors` with BasicNet's
    /// plain keys (`conv1.weight`, …), on the main process, as Transformers' `save_model()`.
    /// Collective (a barrier).
    ///
    /// # Errors
    /// [`Error::Io`] naming the directory; libtorch's serialisation errors.
    pub fn save_model(&self) -> Result<PathBuf> {
        let path = self.args.output_dir.join(core_ckpt::MODEL_FILE);
        if self.pg.rank() == 0 {
            std::fs::create_dir_all(&self.args.output_dir).map_err(|e| Error::io(&self.args.output_dir, e))?;
            let mut named: Vec<(String, Tensor)> =
                self.vs.variables().into_iter().map(|(k, t)| (k, t.detach().to_device(Device::Cpu))).collect();
            named.sort_by(|a, b| a.0.cmp(&b.0));
            let tmp = self.args.output_dir.join(".model.safetensors.tmp");
            Tensor::write_safetensors(&named, &tmp)?;
            std::fs::rename(&tmp, &path).map_err(|e| Error::io(&path, e))?;
        }
        self.pg.barrier()?;
        Ok(path)
    }
}

/// Loads plain named weights into `vs` (every key of the VarStore must be present, shapes
/// equal).
fn load_plain(vs: &mut nn::VarStore, named: &[(String, Tensor)], from: &Path) -> Result<()> {
    let vars = vs.variables();
    tch::no_grad(|| -> Result<()> {
        for (name, var) in &vars {
            let Some((_, t)) = named.iter().find(|(k, _)| k == name) else {
                return Err(Error::BadCheckpoint { file: from.into(), problem: format!("no tensor named {name}") });
            };
            if t.size() != var.size() {
                return Err(Error::BadCheckpoint {
                    file: from.into(),
                    problem: format!("{name} has shape {:?}, the model's is {:?}", t.size(), var.size()),
                });
            }
            var.shallow_clone().f_copy_(&t.to_device(var.device()).to_kind(var.kind()))?;
        }
        Ok(())
    })
}

/// Where the data stands after a step: what a checkpoint records to resume from.
#[derive(Debug, Clone, Copy)]
struct Position {
    epoch: u64,
    step_in_epoch: u64,
    batches_seen: u64,
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
    fn take_window(&mut self, pg: &dyn ProcessGroup) -> Result<f64> {
        let mut t = Tensor::from_slice(&[self.window_sum]).to_device(pg.device());
        pg.all_reduce(&mut t, ReduceOp::Sum)?;
        let loss = t.double_value(&[0]) / (pg.world_size() as f64 * self.window_steps as f64);
        self.window_sum = 0.0;
        self.window_steps = 0;
        Ok(loss)
    }

    /// `(Σ over ranks of total_sum, total_steps)`. Collective.
    fn all_reduced_total(&self, pg: &dyn ProcessGroup) -> Result<(f64, f64)> {
        let mut t = Tensor::from_slice(&[self.total_sum]).to_device(pg.device());
        pg.all_reduce(&mut t, ReduceOp::Sum)?;
        Ok((t.double_value(&[0]), self.total_steps as f64))
    }

    /// The sums over ranks, for a checkpoint. Collective.
    fn to_extra(&self, pg: &dyn ProcessGroup) -> Result<serde_json::Map<String, serde_json::Value>> {
        let mut t = Tensor::from_slice(&[self.window_sum, self.total_sum]).to_device(pg.device());
        pg.all_reduce(&mut t, ReduceOp::Sum)?;
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
