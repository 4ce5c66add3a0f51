//! `TrainingArguments`: every knob of the [`Trainer`](crate::Trainer), with 🤗 Transformers'
//! names and defaults (`transformers/training_args.py`, v4.5x/v5).
//!
//! Three sources, in increasing priority: the defaults ([`TrainingArguments::default`]), an
//! arguments file (`--args-file`, JSON or TOML, keys are the field names), and command-line
//! flags (`--per-device-train-batch-size 64`, …). [`TrainingArguments::validate`] checks what
//! clap and serde cannot and names the field at fault; [`TrainingArguments::write_json`] writes
//! the resolved arguments to `output_dir/training_args.json` at the start of training.

use crate::error::{Error, Result};
use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, FromArgMatches, Parser};
use ladder_core::parallel::{BackwardPrefetch, ShardingStrategy, Strategy};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

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
}

/// `backward_prefetch` as Transformers reads it (it upper-cases the text and hands it to
/// Accelerate: `backward_pre`, `backward_post`, `no_prefetch`, any spelling of the core's
/// [`BackwardPrefetch`]); `null` is no prefetch, as leaving the key out.
fn backward_prefetch_from_text<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<BackwardPrefetch, D::Error> {
    let text: Option<String> = Option::deserialize(d)?;
    let Some(text) = text else { return Ok(BackwardPrefetch::NoPrefetch) };
    ladder_core::parallel::choice::parse(&text).map_err(|e: ladder_core::parallel::ChoiceError| {
        serde::de::Error::custom(format!(
            "invalid value {text:?} for fsdp_config.backward_prefetch: expected {} (no key: no prefetch)",
            e.expected.replace('-', "_")
        ))
    })
}

fn is_no_prefetch(p: &BackwardPrefetch) -> bool {
    *p == BackwardPrefetch::NoPrefetch
}

/// Transformers' `TrainingArguments.fsdp_config`: FSDP settings beside `fsdp`, with
/// Transformers' key names (an `fsdp_` prefix is accepted too, as Transformers strips it).
/// The keys this Trainer implements; any other key is an error. Used when `fsdp` is set.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FsdpConfig {
    /// `backward_prefetch`: `backward_pre` or `backward_post`. Absent (or `no_prefetch`): no
    /// prefetch, Transformers' and Accelerate's default (PyTorch's own is `backward_pre`).
    #[serde(alias = "fsdp_backward_prefetch", deserialize_with = "backward_prefetch_from_text", skip_serializing_if = "is_no_prefetch")]
    pub backward_prefetch: BackwardPrefetch,
    /// `forward_prefetch`: start the next unit's all-gather before the current unit's forward
    /// computation. Default false, Transformers'.
    #[serde(alias = "fsdp_forward_prefetch")]
    pub forward_prefetch: bool,
}

impl Default for FsdpConfig {
    fn default() -> Self {
        Self { backward_prefetch: BackwardPrefetch::NoPrefetch, forward_prefetch: false }
    }
}

impl FsdpConfig {
    /// The `--fsdp-config` value, as Transformers reads `fsdp_config` given as text: a JSON
    /// object (`{"backward_prefetch": "backward_pre"}`), else the path of a JSON file holding
    /// one.
    ///
    /// # Errors
    /// An unreadable file; malformed JSON, an unknown key or a bad value, named.
    pub fn from_arg(text: &str) -> std::result::Result<Self, String> {
        let json = if text.trim_start().starts_with('{') {
            text.to_string()
        } else {
            std::fs::read_to_string(text).map_err(|e| {
                format!("cannot read {text}: {e} (expected a JSON object such as {{\"backward_prefetch\": \"backward_pre\"}}, or the path of a JSON file holding one)")
            })?
        };
        serde_json::from_str(&json).map_err(|e| format!("fsdp_config: {e}"))
    }
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
    /// Start afresh even if output_dir already holds checkpoints.
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
    /// Drop each epoch's last incomplete batch.
    #[arg(long)]
    pub dataloader_drop_last: bool,
    /// No progress bar (plain log lines instead).
    #[arg(long)]
    pub disable_tqdm: bool,
    /// Where to report the log history besides trainer_state.json.
    #[arg(long, value_enum, value_parser = ladder_core::cli::choice::<ReportTo>(), default_value_t = ReportTo::None)]
    pub report_to: ReportTo,
    /// Shard the model with FSDP instead of replicating it with DDP.
    #[arg(long, value_parser = ladder_core::cli::spelling::<ShardingStrategy>())]
    pub fsdp: Option<ShardingStrategy>,
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
    /// Train on the CPU even when CUDA is available.
    #[arg(long)]
    pub use_cpu: bool,
    /// Seconds a collective may wait for the other processes before the job fails with an
    /// error naming the ones that did not arrive (Transformers' ddp_timeout, passed to
    /// init_process_group(timeout=...)) [default: 600].
    #[arg(long, default_value_t = 600)]
    pub ddp_timeout: u64,
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
            dataloader_drop_last: false,
            disable_tqdm: false,
            report_to: ReportTo::None,
            fsdp: None,
            fsdp_min_num_params: None,
            fsdp_config: FsdpConfig::default(),
            use_cpu: false,
            ddp_timeout: 600,
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

    /// Parses command-line arguments (the first item is the program name), reading
    /// `--args-file` if given: defaults < file < flags given on the command line.
    ///
    /// # Errors
    /// [`Error::CommandLine`] for unknown flags or bad values, [`Error::ArgsFile`] for an unreadable or unknown-key file, and
    /// [`TrainingArguments::validate`]'s errors.
    pub fn parse_from_cli<I, T>(args: I) -> Result<Self>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        let matches = Self::command().try_get_matches_from(args).map_err(|e| Error::CommandLine { message: e.render().to_string() })?;
        Self::from_matches(&matches)
    }

    /// [`Self::parse_from_cli`] from clap matches of a command that flattens
    /// `TrainingArguments` (`#[command(flatten)]`): the file (if any) with every flag whose
    /// value came from the command line laid over it.
    ///
    /// # Errors
    /// As [`Self::parse_from_cli`].
    pub fn from_matches(matches: &ArgMatches) -> Result<Self> {
        let cli =
            <Self as FromArgMatches>::from_arg_matches(matches).map_err(|e| Error::CommandLine { message: e.render().to_string() })?;
        let args = match &cli.args_file {
            None => cli,
            Some(file) => {
                let mut merged = serde_json::to_value(Self::from_file(file)?).expect("TrainingArguments serialise");
                let given = serde_json::to_value(&cli).expect("TrainingArguments serialise");
                let (merged_map, given_map) = (merged.as_object_mut().expect("an object"), given.as_object().expect("an object"));
                for (key, value) in given_map {
                    if matches!(matches.value_source(key), Some(ValueSource::CommandLine)) {
                        merged_map.insert(key.clone(), value.clone());
                    }
                }
                let mut args: Self = serde_json::from_value(merged).expect("a merge of two valid argument sets");
                args.args_file = cli.args_file.clone();
                args
            }
        };
        args.validate()?;
        Ok(args)
    }

    /// Reads arguments from a JSON file, or a TOML file when the name ends in `.toml`; missing
    /// keys take their defaults, unknown keys are errors. Not validated.
    ///
    /// # Errors
    /// [`Error::ArgsFile`] naming the file and the parser's complaint.
    pub fn from_file(file: &Path) -> Result<Self> {
        Self::default().overlay_file(file)
    }

    /// These arguments with every key present in `file` (JSON, or TOML when the name ends in
    /// `.toml`) replaced by the file's value. Not validated.
    ///
    /// # Errors
    /// [`Error::ArgsFile`] naming the file and the parser's complaint (unknown key, bad value).
    pub fn overlay_file(&self, file: &Path) -> Result<Self> {
        let bad = |problem: String| Error::ArgsFile { file: file.into(), problem };
        let text = std::fs::read_to_string(file).map_err(|e| bad(e.to_string()))?;
        let value: serde_json::Value = if file.extension().is_some_and(|e| e == "toml") {
            let t: toml::Value = toml::from_str(&text).map_err(|e| bad(e.message().to_string()))?;
            serde_json::to_value(t).map_err(|e| bad(e.to_string()))?
        } else {
            serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?
        };
        let serde_json::Value::Object(keys) = value else {
            return Err(bad("expected a table of TrainingArguments fields".into()));
        };
        // Unknown keys and bad values, reported against the file alone.
        serde_json::from_value::<Self>(serde_json::Value::Object(keys.clone())).map_err(|e| bad(e.to_string()))?;
        let mut merged = serde_json::to_value(self).expect("TrainingArguments serialise");
        let map = merged.as_object_mut().expect("an object");
        for (k, v) in keys {
            map.insert(k, v);
        }
        let mut out: Self = serde_json::from_value(merged).map_err(|e| bad(e.to_string()))?;
        out.args_file = self.args_file.clone();
        Ok(out)
    }

    /// Writes the arguments as pretty JSON to `output_dir/training_args.json` (atomically),
    /// creating output_dir.
    ///
    /// # Errors
    /// [`Error::Io`] naming the directory or file.
    pub fn write_json(&self) -> Result<PathBuf> {
        std::fs::create_dir_all(&self.output_dir).map_err(|e| Error::io(&self.output_dir, e))?;
        let path = self.output_dir.join("training_args.json");
        let json = serde_json::to_string_pretty(self).expect("TrainingArguments serialise");
        ladder_core::atomic::write_atomic(&path, json.as_bytes())?;
        Ok(path)
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

    /// The replication strategy: DDP, or FSDP with the sharding strategy `fsdp` names.
    pub fn strategy(&self) -> Strategy {
        self.fsdp.map_or_else(Strategy::default, Strategy::fsdp)
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

    /// Checks that metric_for_best_model (if any) names one of `available` (without the
    /// `eval_` prefix, e.g. `["loss", "accuracy"]`).
    ///
    /// # Errors
    /// [`Error::UnknownMetric`] listing the available names.
    pub fn validate_metric(&self, available: &[&str]) -> Result<()> {
        if let Some(key) = self.best_metric_key() {
            let bare = key.strip_prefix("eval_").unwrap_or(&key);
            if !available.contains(&bare) {
                return Err(Error::UnknownMetric {
                    metric: self.metric_for_best_model.clone().unwrap_or_else(|| "loss".into()),
                    available: available.iter().map(|m| format!("{m} (or eval_{m})")).collect::<Vec<_>>().join(", "),
                });
            }
        }
        Ok(())
    }

    /// Checks the values clap and serde cannot, as Transformers' `__post_init__` does.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the first field at fault and what it accepts.
    pub fn validate(&self) -> Result<()> {
        if self.ddp_timeout == 0 {
            return Err(Error::invalid("ddp_timeout", 0, "a positive number of seconds (default 600)"));
        }
        let positive = |field: &'static str, v: usize| {
            if v == 0 {
                Err(Error::invalid(field, v, "at least 1"))
            } else {
                Ok(())
            }
        };
        positive("per_device_train_batch_size", self.per_device_train_batch_size)?;
        positive("per_device_eval_batch_size", self.per_device_eval_batch_size)?;
        positive("gradient_accumulation_steps", self.gradient_accumulation_steps)?;
        if self.max_steps == 0 || self.max_steps < -1 {
            return Err(Error::invalid(
                "max_steps",
                self.max_steps,
                "a positive number of optimization steps, or -1 to use num_train_epochs",
            ));
        }
        if self.max_steps < 0 && !(self.num_train_epochs.is_finite() && self.num_train_epochs > 0.0) {
            return Err(Error::invalid(
                "num_train_epochs",
                self.num_train_epochs,
                "a positive, finite number of epochs (or set max_steps)",
            ));
        }
        if !(self.learning_rate.is_finite() && self.learning_rate >= 0.0) {
            return Err(Error::invalid("learning_rate", self.learning_rate, "a finite learning rate ≥ 0"));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return Err(Error::invalid("weight_decay", self.weight_decay, "a finite weight decay ≥ 0"));
        }
        for (field, beta) in [("adam_beta1", self.adam_beta1), ("adam_beta2", self.adam_beta2)] {
            if !(0.0..1.0).contains(&beta) {
                return Err(Error::invalid(field, beta, "a value in [0, 1)"));
            }
        }
        if !(self.adam_epsilon.is_finite() && self.adam_epsilon > 0.0) {
            return Err(Error::invalid("adam_epsilon", self.adam_epsilon, "a positive, finite epsilon"));
        }
        if !(self.max_grad_norm.is_finite() && self.max_grad_norm >= 0.0) {
            return Err(Error::invalid("max_grad_norm", self.max_grad_norm, "a finite norm ≥ 0 (0: no clipping)"));
        }
        if !(0.0..=1.0).contains(&self.warmup_ratio) {
            return Err(Error::invalid("warmup_ratio", self.warmup_ratio, "a fraction of the total steps in [0, 1]"));
        }
        if self.logging_strategy == IntervalStrategy::Steps {
            positive("logging_steps", self.logging_steps)?;
        }
        if self.eval_strategy == IntervalStrategy::Steps && self.eval_steps() == 0 {
            return Err(Error::invalid("eval_steps", self.eval_steps(), "at least 1 with eval_strategy=steps"));
        }
        if self.save_strategy == IntervalStrategy::Steps {
            positive("save_steps", self.save_steps)?;
        }
        if self.save_total_limit == Some(0) {
            return Err(Error::invalid("save_total_limit", 0, "at least 1 checkpoint kept (or leave it unset to keep all)"));
        }
        if self.load_best_model_at_end {
            if self.eval_strategy == IntervalStrategy::No {
                return Err(Error::invalid(
                    "load_best_model_at_end",
                    true,
                    "an eval_strategy other than `no` (the best model is chosen by evaluation)",
                ));
            }
            if self.eval_strategy != self.save_strategy {
                return Err(Error::invalid(
                    "load_best_model_at_end",
                    true,
                    format!("save_strategy equal to eval_strategy (they are {:?} and {:?})", self.save_strategy, self.eval_strategy),
                ));
            }
            if self.eval_strategy == IntervalStrategy::Steps && self.save_steps % self.eval_steps() != 0 {
                return Err(Error::invalid(
                    "save_steps",
                    self.save_steps,
                    format!("a round multiple of eval_steps ({}) with load_best_model_at_end", self.eval_steps()),
                ));
            }
        }
        if let Some(m) = &self.metric_for_best_model {
            if m.is_empty() || m == "eval_" {
                return Err(Error::invalid("metric_for_best_model", format!("{m:?}"), "a metric name such as `loss` or `eval_accuracy`"));
            }
        }
        if self.output_dir.as_os_str().is_empty() {
            return Err(Error::invalid("output_dir", "\"\"", "a directory path"));
        }
        Ok(())
    }
}
