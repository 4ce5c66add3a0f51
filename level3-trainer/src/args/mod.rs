//! `TrainingArguments`: every knob of the [`Trainer`](crate::Trainer), with 🤗 Transformers'
//! names and defaults (`transformers/training_args.py`, v4.5x/v5).
//!
//! Three sources, in increasing priority: the defaults ([`TrainingArguments::default`]), an
//! arguments file (`--args-file`, JSON or TOML, keys are the field names), and command-line
//! flags (`--per-device-train-batch-size 64`, …). [`TrainingArguments::validate`] checks what
//! clap and serde cannot and names the field at fault; [`TrainingArguments::write_json`] writes
//! the resolved arguments to `output_dir/training_args.json` at the start of training.
//!
//! Files: this one holds the struct, its defaults and the values derived from it;
//! `fsdp_config` the `fsdp_config` object; `sources` the argument file and command-line
//! merging and `training_args.json`; `spellings` Transformers' other spellings (snake_case
//! flags, renamed fields, list forms); `validate` the checks.

mod deepspeed;
mod fsdp_arg;
mod fsdp_config;
mod sources;
pub mod spellings;
mod validate;

pub use deepspeed::{DeepSpeedConfig, HONOURED_KEYS as DEEPSPEED_HONOURED_KEYS};
pub use fsdp_arg::FsdpArg;
pub use fsdp_config::FsdpConfig;

use clap::Parser;
use ladder_core::parallel::Strategy;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// When to evaluate, log or save (Transformers' `IntervalStrategy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum IntervalStrategy {
    /// Never.
    No,
    /// Every `*_steps` optimization steps.
    Steps,
    /// At the end of every epoch.
    Epoch,
}

/// The learning-rate schedule (Transformers' `SchedulerType`, the four this Trainer has); see
/// [`crate::schedule`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum SchedulerType {
    /// Linear warm-up from 0, then linear decay to 0 at the last step (Transformers' default).
    Linear,
    /// Linear warm-up, then half a cosine wave down to 0.
    Cosine,
    /// The learning rate throughout (warm-up ignored, as Transformers' `constant`).
    Constant,
    /// Linear warm-up, then constant.
    #[value(name = "constant_with_warmup")]
    ConstantWithWarmup,
}

/// Where the log history goes besides `trainer_state.json`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum ReportTo {
    /// Nowhere else (Transformers 5's default).
    None,
    /// One JSON object per log entry in `output_dir/log_history.jsonl`.
    Jsonl,
    /// `output_dir/log_history.csv`, one row per log entry.
    Csv,
    /// TensorBoard event files in `logging_dir`, as Transformers' `TensorBoardCallback`: every
    /// figure under `train/`, `eval/` (`eval_loss` → `eval/loss`) or `test/`, at the global
    /// step.
    Tensorboard,
}

/// The arguments of a [`Trainer`](crate::Trainer) run, as Transformers' `TrainingArguments`.
///
/// Defaults are Transformers' (`per_device_train_batch_size` 8, `learning_rate` 5e-5 with
/// linear decay, `max_grad_norm` 1.0, `seed` 42, …); the level-3 binary passes the recipe
/// shared by the three levels explicitly instead (see its `--transformers-defaults`).
#[derive(Debug, Clone, PartialEq, Parser, Serialize, Deserialize)]
#[command(name = "training-args", about = "TrainingArguments (🤗 Transformers' names and defaults)", allow_negative_numbers = true)]
#[serde(default, deny_unknown_fields)]
pub struct TrainingArguments {
    /// A JSON or TOML file of TrainingArguments (keys are the field names); flags given on the
    /// command line override it.
    #[arg(long, value_name = "FILE")]
    #[serde(skip)]
    pub args_file: Option<PathBuf>,
    /// Where checkpoints, trainer_state.json, training_args.json, logs and the loss plot go.
    #[arg(long, default_value = "trainer_output", value_name = "DIR")]
    pub output_dir: PathBuf,
    /// Replace a previous run in output_dir: its checkpoints, model, state and logs are removed
    /// when training starts (other files are kept). Without it, or a resume, an output_dir
    /// holding a previous run is refused (as Transformers' example scripts).
    #[arg(long)]
    pub overwrite_output_dir: bool,
    /// Training samples per process per forward/backward (one micro-batch).
    #[arg(long, default_value_t = 8)]
    pub per_device_train_batch_size: usize,
    /// Evaluation samples per process per forward.
    #[arg(long, default_value_t = 8)]
    pub per_device_eval_batch_size: usize,
    /// Passes over the training set (fractional: the last one is cut short). Ignored when
    /// max_steps > 0.
    #[arg(long, default_value_t = 3.0)]
    pub num_train_epochs: f64,
    /// Total optimization steps; overrides num_train_epochs when > 0 (-1: use the epochs).
    #[arg(long, default_value_t = -1)]
    pub max_steps: i64,
    /// Peak learning rate of AdamW.
    #[arg(long, default_value_t = 5e-5)]
    pub learning_rate: f64,
    /// AdamW's decoupled weight decay.
    #[arg(long, default_value_t = 0.0)]
    pub weight_decay: f64,
    /// AdamW's beta1.
    #[arg(long, default_value_t = 0.9)]
    pub adam_beta1: f64,
    /// AdamW's beta2.
    #[arg(long, default_value_t = 0.999)]
    pub adam_beta2: f64,
    /// AdamW's epsilon.
    #[arg(long, default_value_t = 1e-8)]
    pub adam_epsilon: f64,
    /// Clip the global gradient norm to this before each update (0: no clipping).
    #[arg(long, default_value_t = 1.0)]
    pub max_grad_norm: f64,
    /// The learning-rate schedule.
    #[arg(long, value_enum, value_parser = ladder_core::cli::choice::<SchedulerType>(), default_value_t = SchedulerType::Linear)]
    pub lr_scheduler_type: SchedulerType,
    /// Warm-up steps (takes precedence over warmup_ratio when > 0).
    #[arg(long, default_value_t = 0)]
    pub warmup_steps: usize,
    /// Warm-up as a fraction of the total optimization steps, in [0, 1]: ceil(ratio × total).
    #[arg(long, default_value_t = 0.0)]
    pub warmup_ratio: f64,
    /// Micro-batches whose gradients are summed before one optimization step.
    #[arg(long, default_value_t = 1)]
    pub gradient_accumulation_steps: usize,
    /// When to evaluate on the eval dataset.
    #[arg(long, value_enum, value_parser = ladder_core::cli::choice::<IntervalStrategy>(), default_value_t = IntervalStrategy::No)]
    pub eval_strategy: IntervalStrategy,
    /// Optimization steps between evaluations with eval_strategy=steps (default: logging_steps).
    #[arg(long)]
    pub eval_steps: Option<usize>,
    /// TensorBoard's log directory, with report_to tensorboard (default:
    /// output_dir/runs/<Mon DD_HH-MM-SS>_<host>, as Transformers; the time in UTC).
    #[arg(long, value_name = "DIR")]
    pub logging_dir: Option<PathBuf>,
    /// When to log the training loss and learning rate.
    #[arg(long, value_enum, value_parser = ladder_core::cli::choice::<IntervalStrategy>(), default_value_t = IntervalStrategy::Steps)]
    pub logging_strategy: IntervalStrategy,
    /// Optimization steps between logs with logging_strategy=steps.
    #[arg(long, default_value_t = 500)]
    pub logging_steps: usize,
    /// Also log after the first optimization step (that one step's loss).
    #[arg(long)]
    pub logging_first_step: bool,
    /// When to write a checkpoint.
    #[arg(long, value_enum, value_parser = ladder_core::cli::choice::<IntervalStrategy>(), default_value_t = IntervalStrategy::Steps)]
    pub save_strategy: IntervalStrategy,
    /// Optimization steps between checkpoints with save_strategy=steps.
    #[arg(long, default_value_t = 500)]
    pub save_steps: usize,
    /// Keep at most this many checkpoints (oldest deleted first; the best one and the newest
    /// one are always kept, so 1 may keep 2).
    #[arg(long)]
    pub save_total_limit: Option<usize>,
    /// Restore the best checkpoint (by metric_for_best_model) when training ends. Needs
    /// matching eval and save strategies.
    #[arg(long)]
    pub load_best_model_at_end: bool,
    /// The metric that picks the best checkpoint, with or without the `eval_` prefix
    /// (default with load_best_model_at_end: `loss`).
    #[arg(long)]
    pub metric_for_best_model: Option<String>,
    /// Whether a larger metric is better (default: false for metrics ending in `loss`, else
    /// true).
    #[arg(long)]
    pub greater_is_better: Option<bool>,
    /// Seed of the weights' initialisation, dropout and (without data_seed) the shuffle.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Seed of the data shuffle (default: seed).
    #[arg(long)]
    pub data_seed: Option<u64>,
    /// Train in bfloat16 autocast-style mixed precision (on CUDA).
    #[arg(long)]
    pub bf16: bool,
    /// Gradient checkpointing: keep each layer's input and recompute the rest in backward (the
    /// Accelerator's activation checkpointing; DDP and FSDP alike). Fewer activations kept for
    /// one more forward per step; the same weights. On BasicNet it saves little or nothing: at
    /// the tutorial's width the peak is conv2's backward, which the recompute brings back, and
    /// on a CPU the heap keeps the peak of the run without (the book's "Will it fit?").
    #[arg(long)]
    pub gradient_checkpointing: bool,
    /// Drop each epoch's last incomplete batch.
    #[arg(long)]
    pub dataloader_drop_last: bool,
    /// No progress bar (plain log lines instead).
    #[arg(long)]
    pub disable_tqdm: bool,
    /// Where to report the log history besides trainer_state.json (in an args file also
    /// Transformers' list form, `["jsonl"]`; `[]` is none).
    #[arg(long, value_enum, value_parser = ladder_core::cli::choice::<ReportTo>(), default_value_t = ReportTo::None)]
    #[serde(deserialize_with = "spellings::report_to_one_or_list")]
    pub report_to: ReportTo,
    /// Shard the model with FSDP instead of replicating it with DDP: Transformers' fsdp, a
    /// sharding strategy — full_shard (ZeRO-3), shard_grad_op (ZeRO-2), no_shard, hybrid_shard,
    /// hybrid_shard_zero2 — with, space-separated, offload (FSDP's CPU offload: parameter
    /// shards, gradients and optimizer state in host memory, PyTorch's
    /// CPUOffload(offload_params=True)) and auto_wrap (accepted; units follow
    /// fsdp_min_num_params), e.g. "full_shard offload".
    #[arg(long, value_name = "OPTIONS", value_parser = FsdpArg::from_arg)]
    pub fsdp: Option<FsdpArg>,
    /// FSDP auto-wrap: a layer with at least this many parameters becomes its own unit
    /// (Transformers' `fsdp_min_num_params` / `fsdp_config.min_num_params`; default: the
    /// Accelerator's, 1e8, i.e. one unit for BasicNet). 0 wraps every layer.
    #[arg(long)]
    pub fsdp_min_num_params: Option<usize>,
    /// Transformers' fsdp_config, as a JSON object or the path of a JSON file holding one:
    /// `backward_prefetch` (backward_pre | backward_post; absent: no prefetch, Transformers'
    /// default) and `forward_prefetch` (true | false; default false). Used with fsdp.
    #[arg(long, value_name = "JSON|FILE", value_parser = FsdpConfig::from_arg, default_value = "{}", hide_default_value = true)]
    pub fsdp_config: FsdpConfig,
    /// HSDP's shard-group size, Transformers' `parallelism_config=ParallelismConfig(dp_shard_size=N)`:
    /// fsdp hybrid_shard / hybrid_shard_zero2 shard over runs of N consecutive ranks and
    /// replicate across the world_size / N runs; N must divide the world size (default: the
    /// Accelerator's, LOCAL_WORLD_SIZE — the ranks of one node). Used with the hybrid strategies.
    #[arg(long, value_name = "N")]
    pub dp_shard_size: Option<usize>,
    /// A DeepSpeed JSON config (a file, or an object inline). Honoured:
    /// zero_optimization.stage — 1 is ZeRO-1 (DDP with the AdamW state sharded over ranks), 2
    /// fsdp shard_grad_op, 3 fsdp full_shard, run on the Accelerator's strategies —
    /// zero_optimization.offload_optimizer.device "none" or "nvme" with nvme_path (DeepSpeed's
    /// optimizer offload: AdamW's moments in a file per rank there, the same weights bit for
    /// bit; the directory is checked before training), and "auto" for train_batch_size,
    /// train_micro_batch_size_per_gpu, gradient_accumulation_steps, gradient_clipping,
    /// bf16.enabled and fp16.enabled. Any other key is refused by name. Not with fsdp.
    #[arg(long, value_name = "FILE|JSON", value_parser = DeepSpeedConfig::from_arg)]
    pub deepspeed: Option<DeepSpeedConfig>,
    /// Train on the CPU even when CUDA is available.
    #[arg(long)]
    pub use_cpu: bool,
    /// Seconds a collective may wait for the other processes before the job fails with an
    /// error naming the ones that did not arrive (Transformers' ddp_timeout, passed to
    /// init_process_group(timeout=...)).
    #[arg(long, default_value_t = 600)]
    pub ddp_timeout: u64,
    /// The size of DDP's gradient buckets, MiB (Transformers' ddp_bucket_cap_mb, passed to
    /// DistributedDataParallel(bucket_cap_mb=...); default: PyTorch's 25). DDP and ZeRO-1 only:
    /// refused together with fsdp or deepspeed stage 2 or 3, which have no buckets.
    #[arg(long, value_name = "MB")]
    pub ddp_bucket_cap_mb: Option<f64>,
    /// Keep training when the loss or a gradient is NaN or infinite (default: stop every
    /// process with an error naming the step and the process where it appeared).
    #[arg(long)]
    pub allow_non_finite: bool,
}

impl Default for TrainingArguments {
    fn default() -> Self {
        Self {
            args_file: None,
            output_dir: PathBuf::from("trainer_output"),
            overwrite_output_dir: false,
            per_device_train_batch_size: 8,
            per_device_eval_batch_size: 8,
            num_train_epochs: 3.0,
            max_steps: -1,
            learning_rate: 5e-5,
            weight_decay: 0.0,
            adam_beta1: 0.9,
            adam_beta2: 0.999,
            adam_epsilon: 1e-8,
            max_grad_norm: 1.0,
            lr_scheduler_type: SchedulerType::Linear,
            warmup_steps: 0,
            warmup_ratio: 0.0,
            gradient_accumulation_steps: 1,
            eval_strategy: IntervalStrategy::No,
            eval_steps: None,
            logging_dir: None,
            logging_strategy: IntervalStrategy::Steps,
            logging_steps: 500,
            logging_first_step: false,
            save_strategy: IntervalStrategy::Steps,
            save_steps: 500,
            save_total_limit: None,
            load_best_model_at_end: false,
            metric_for_best_model: None,
            greater_is_better: None,
            seed: 42,
            data_seed: None,
            bf16: false,
            gradient_checkpointing: false,
            dataloader_drop_last: false,
            disable_tqdm: false,
            report_to: ReportTo::None,
            fsdp: None,
            fsdp_min_num_params: None,
            fsdp_config: FsdpConfig::default(),
            dp_shard_size: None,
            deepspeed: None,
            use_cpu: false,
            ddp_timeout: 600,
            ddp_bucket_cap_mb: None,
            allow_non_finite: false,
        }
    }
}

/// The metric names the default evaluation produces (without the `eval_` prefix).
pub const DEFAULT_METRICS: &[&str] = &["loss"];

impl TrainingArguments {
    /// `TrainingArguments` for `output_dir`, everything else at its default (as
    /// `TrainingArguments("basic-trainer")`).
    pub fn new(output_dir: impl Into<PathBuf>) -> Self {
        Self { output_dir: output_dir.into(), ..Self::default() }
    }

    /// The evaluation interval with eval_strategy=steps: eval_steps, else logging_steps (as
    /// Transformers).
    pub fn eval_steps(&self) -> usize {
        self.eval_steps.unwrap_or(self.logging_steps)
    }

    /// The device kind to train on: cpu with use_cpu, else cuda when available, else cpu (as
    /// Transformers' `args.device`).
    pub fn device_kind(&self) -> ladder_core::device::DeviceKind {
        if self.use_cpu {
            ladder_core::device::DeviceKind::Cpu
        } else {
            ladder_core::device::DeviceKind::default_for_machine()
        }
    }

    /// The replication strategy: DDP, or FSDP with the sharding strategy `fsdp` names (and
    /// its CPU offload with `offload`).
    pub fn strategy(&self) -> Strategy {
        self.fsdp.map_or_else(Strategy::default, |f| f.strategy())
    }

    /// AdamW's hyper-parameters (`learning_rate` is the schedule's peak).
    pub fn adamw(&self) -> ladder_core::optim::AdamWConfig {
        ladder_core::optim::AdamWConfig {
            lr: self.learning_rate,
            beta1: self.adam_beta1,
            beta2: self.adam_beta2,
            eps: self.adam_epsilon,
            weight_decay: self.weight_decay,
        }
    }

    /// TensorBoard's log directory: logging_dir, else Transformers' default
    /// `output_dir/runs/<Mon DD_HH-MM-SS>_<host>` for the time `now` (e.g.
    /// `runs/Dec02_13-25-02_node1`; Transformers takes the local time, here UTC).
    pub fn logging_dir_at(&self, now: std::time::SystemTime) -> PathBuf {
        if let Some(dir) = &self.logging_dir {
            return dir.clone();
        }
        let secs = now.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64);
        let t = time::OffsetDateTime::from_unix_timestamp(secs).unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
        let month: String = t.month().to_string().chars().take(3).collect();
        let stamp = format!("{month}{:02}_{:02}-{:02}-{:02}", t.day(), t.hour(), t.minute(), t.second());
        self.output_dir.join("runs").join(format!("{stamp}_{}", ladder_core::tensorboard::hostname()))
    }

    /// The shuffle's seed: data_seed, else seed.
    pub fn data_seed(&self) -> u64 {
        self.data_seed.unwrap_or(self.seed)
    }

    /// The metric that picks the best checkpoint, as the key it has in evaluation results
    /// (always with the `eval_` prefix: `loss` and `eval_loss` both give `eval_loss`), or
    /// `None` when no best model is tracked. With load_best_model_at_end and no metric given
    /// it is `eval_loss`, as Transformers. This is the one place the prefix is normalised.
    pub fn best_metric_key(&self) -> Option<String> {
        let name = match (&self.metric_for_best_model, self.load_best_model_at_end) {
            (Some(m), _) => m.as_str(),
            (None, true) => "loss",
            (None, false) => return None,
        };
        Some(if name.starts_with("eval_") { name.to_string() } else { format!("eval_{name}") })
    }

    /// Whether a larger best-model metric is better: greater_is_better, else false for a
    /// metric ending in `loss` and true otherwise (as Transformers).
    pub fn greater_is_better(&self) -> bool {
        self.greater_is_better.unwrap_or_else(|| !self.best_metric_key().is_some_and(|m| m.ends_with("loss")))
    }
}
