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
//! Through the same `compute_loss` as training (no `label_names` trap), over the Accelerator's
//! unshuffled loader: rank r's p-th example is dataset position `p·W + r`, padded so that every
//! process runs as many forwards; padding is run but not counted. Loss sums and counts are
//! all-reduced and predictions gathered (`gather_for_metrics`), so every example is counted
//! exactly once, in dataset order, at any world size.
//!
//! # Where things are
//! `hooks` — the user's part ([`TrainerHooks`], [`DataCollator`], [`TrainerModel`]);
//! `training` — [`Trainer::train`] cut into plan, resume, epoch, step and the end of training
//! (Transformers' `_inner_training_loop`); `evaluation` — log / evaluate / save after a step,
//! the best metric, [`Trainer::evaluate`] and [`Trainer::predict`]; `checkpointing` — the
//! output directory, `checkpoint-<step>` writing and resuming; `loss_sums` — the running loss
//! sums behind the logged losses. Callbacks are called through one [`CallbackHandler`].

mod checkpointing;
mod evaluation;
mod hooks;
mod launcher;
mod loss_sums;
mod training;

pub use hooks::{Batch, DataCollator, DefaultDataCollator, DefaultHooks, EvalPrediction, PredictionOutput, TrainerHooks, TrainerModel};
pub use training::{ResumeFrom, TrainOutput};

use crate::args::TrainingArguments;
use crate::callbacks::{CallbackHandler, TrainerCallback, TrainerControl};
use crate::error::{Error, Result};
use crate::output::{self, Progress, ReportWriter};
use crate::state::{LogEntry, TrainerState};
use ladder_core::checkpoint as core_ckpt;
use ladder_core::data::Dataset;
use ladder_core::model::{BasicNet, BasicNetConfig};
use level2_accelerator::{AcceleratedOptimizer, Accelerator, PreparedModel};
use std::path::PathBuf;
use tch::{nn, Device};

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
    callback_handler: CallbackHandler,
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
        Self::check_arguments(&args, &hooks)?;
        let defaults = serde_json::to_value(TrainingArguments::default()).expect("TrainingArguments serialise");
        let given = serde_json::to_value(&args).expect("TrainingArguments serialise");
        let non_default = |field: &str| (given.get(field) != defaults.get(field)).then(|| "set, not the default".to_string());
        Self::check_launcher_settings(&args, non_default, |k| std::env::var(k).ok())?;
        let init = level2_accelerator::InitProcessGroupKwargs { timeout: Some(std::time::Duration::from_secs(args.ddp_timeout)) };
        let mut ddp = level2_accelerator::DistributedDataParallelKwargs::default();
        if let Some(mb) = args.ddp_bucket_cap_mb {
            ddp.bucket_cap_mb = mb;
        }
        let accelerator = Accelerator::with_kwargs_handlers(Self::accelerator_config(&args), ddp, init)?;
        let mut args = Self::effective_arguments(args, accelerator.config());
        if args.report_to == crate::args::ReportTo::Tensorboard {
            // As Transformers' __post_init__: the default is fixed once, with the start time.
            args.logging_dir = Some(args.logging_dir_at(std::time::SystemTime::now()));
        }
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
            callback_handler: CallbackHandler::default(),
            trained: false,
        })
    }

    /// The checks of [`Trainer::new`] on the arguments alone: [`TrainingArguments::validate`],
    /// metric_for_best_model among the hooks' metrics, what the Accelerator's loaders cannot do.
    fn check_arguments(args: &TrainingArguments, hooks: &impl TrainerHooks) -> Result<()> {
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
        Ok(())
    }

    /// Adds a callback (called after [`DefaultFlowCallback`](crate::callbacks::DefaultFlowCallback),
    /// in the order added).
    pub fn add_callback(&mut self, callback: impl TrainerCallback + 'static) {
        self.callback_handler.add_callback(callback);
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

    /// Appends `entry` to the log history: the report_to file, the callbacks' `on_log`, the
    /// printed line. A log entry steers nothing: `on_log` gets a control of its own, whose
    /// flags are not acted on.
    fn push_log(&mut self, entry: LogEntry, progress: &Progress, reporter: Option<&mut ReportWriter>) -> Result<()> {
        if let Some(r) = reporter {
            r.write(&entry)?;
        }
        let _ = self.callback_handler.on_log(&self.args, &self.state, TrainerControl::default(), &entry);
        progress.println(&output::log_line(&entry));
        self.state.log_history.push(entry);
        Ok(())
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
