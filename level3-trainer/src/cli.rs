//! The `level3-trainer` binary's command line: every [`TrainingArguments`] field as a flag with
//! Transformers' name (`--per-device-train-batch-size`, `--eval-strategy`, …; generated from
//! the struct by `#[command(flatten)]`, so the args file, the flags and `--help` cannot drift;
//! `HfArgumentParser`'s snake_case spellings and the older names are accepted too), level 1's
//! names for the same settings (`--batch-size`, `--lr`, …: giving both names of one setting is
//! an error naming both), and the program's own flags (data, device, width, reports).
//!
//! Precedence: the recipe shared by the three levels (or, with `--transformers-defaults`,
//! Transformers' defaults under the tutorial's arguments) < `LADDER_COLLECTIVE_TIMEOUT_S` <
//! `--args-file` < the flags typed.

use crate::args::{spellings, IntervalStrategy, TrainingArguments};
use crate::error::{Error, Result};
use crate::{recipe_arguments, ResumeFrom};
use clap::parser::ValueSource;
use clap::{Arg, ArgMatches, Command, CommandFactory, FromArgMatches, Parser};
use ladder_core::device::DeviceKind;
use ladder_core::parallel::{BackwardPrefetch, Precision, Strategy};
use ladder_core::recipe::TrainArgs;
use std::collections::BTreeSet;
use std::path::PathBuf;

/// The help heading of the TrainingArguments flags.
const ARGS_HEADING: &str = "TrainingArguments (🤗 Transformers' names; also --snake_case; defaults: the shared recipe)";

/// Level 3's command line (see the module docs).
#[derive(Debug, Clone, Parser)]
#[command(
    name = "level3-trainer",
    version,
    about = "Level 3: BasicNet on MNIST with a Trainer and TrainingArguments (as 🤗 Transformers) — no training loop in user code",
    after_help = format!(concat!("Launch: `target/release/level3-trainer` (1 process), `target/release/ladder-run --nproc-per-node 2 target/release/level3-trainer`, `mpirun -n 2 target/release/level3-trainer`, or `ladder-accelerate launch --num-processes 2 target/release/level3-trainer`.\n\nEvery TrainingArguments field is a flag (Transformers' name) and a key of --args-file (JSON or TOML). By default the recipe shared by the three levels is passed explicitly (the defaults shown: weight_decay 0.01, a constant schedule, no warmup, no clipping, evaluation each epoch, seed 1); --transformers-defaults uses Transformers' own instead. Precedence: recipe or Transformers defaults < LADDER_COLLECTIVE_TIMEOUT_S < --args-file < flags given. A re-run into an output_dir holding a previous run is refused unless overwrite_output_dir or --resume-from-checkpoint is given.\n\n{}\n", "  ACCELERATE_MIXED_PRECISION, ACCELERATE_USE_FSDP, FSDP_*, ACCELERATE_GRADIENT_ACCUMULATION_STEPS,\n  ACCELERATE_LOG_WITH (tensorboard: report_to tensorboard)\n      the launcher's settings (ladder-accelerate launch): used where TrainingArguments leave\n      them at their default; one that contradicts an argument given is an error naming both"), ladder_core::cli::ENVIRONMENT_HELP),
    allow_negative_numbers = true
)]
pub struct Config {
    /// Every TrainingArguments field, as a flag.
    #[command(flatten, next_help_heading = ARGS_HEADING)]
    pub args: TrainingArguments,
    /// Level 1's names for TrainingArguments settings.
    #[command(flatten, next_help_heading = "Level 1's names (each sets a TrainingArguments field; giving both names is an error)")]
    pub level1: Level1Names,
    /// Output features of BasicNet's fc1 (the tutorial's 128; 4096 gives ~38M parameters, for
    /// memory comparisons).
    #[arg(long, default_value_t = 128, help_heading = "The program")]
    pub width: i64,
    /// Use Transformers' TrainingArguments defaults (learning_rate 5e-5 with linear decay,
    /// max_grad_norm 1.0, weight_decay 0, seed 42, logging_steps 500) for everything the
    /// tutorial's Trainer example does not set (it sets batch 64, 1 epoch, evaluation each
    /// epoch), instead of the shared recipe.
    #[arg(long, help_heading = "The program")]
    pub transformers_defaults: bool,
    /// Resume from this checkpoint directory, or with no value from the newest
    /// output_dir/checkpoint-<step> (Transformers' resume_from_checkpoint).
    #[arg(long, value_name = "DIR", num_args = 0..=1, default_missing_value = "last", help_heading = "The program")]
    pub resume_from_checkpoint: Option<String>,
    /// Device to train on (cpu sets use_cpu; cuda is refused where CUDA is not available).
    /// Default: cuda if available, else cpu.
    #[arg(long, value_enum, value_parser = ladder_core::cli::choice::<DeviceKind>(), conflicts_with = "use_cpu", help_heading = "The program")]
    pub device: Option<DeviceKind>,
    /// Directory holding the four MNIST IDX files (.gz or raw). Default: $MNIST_DIR, else
    /// ./data/mnist, else the workspace's data/mnist.
    #[arg(long, help_heading = "The program")]
    pub data_dir: Option<PathBuf>,
    /// Download missing MNIST files into the data directory (as torchvision's download=True).
    #[arg(long, help_heading = "The program")]
    pub download: bool,
    /// Mirror to download from (repeatable; tried in order). Default: $MNIST_MIRRORS
    /// (comma-separated), else the canonical public mirrors.
    #[arg(long = "mirror", value_name = "URL", help_heading = "The program")]
    pub mirrors: Vec<String>,
    /// Write the run's figures as JSON to this file.
    #[arg(long, value_name = "PATH", help_heading = "The program")]
    pub metrics_json: Option<PathBuf>,
    /// Also save the trained weights to this file as safetensors, with the unwrapped model's
    /// keys (`conv1.weight`, …), as the tutorial's `--save-model` (written by rank 0).
    #[arg(long, value_name = "PATH", help_heading = "The program")]
    pub save_model: Option<PathBuf>,
    /// The clap ids of the flags typed on the command line ([`Config::try_parse_command_line`]
    /// records them); empty for a `Config` built otherwise, where a TrainingArguments flag
    /// counts as typed when its value differs from its default.
    #[arg(skip)]
    pub given: BTreeSet<String>,
}

/// Level 1's flags, each another name for a TrainingArguments setting; `None` when not given.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct Level1Names {
    /// Samples per optimizer step per rank: per_device_train_batch_size.
    #[arg(long, value_name = "N", conflicts_with = "per_device_train_batch_size")]
    pub batch_size: Option<usize>,
    /// AdamW learning rate: learning_rate.
    #[arg(long, value_name = "LR", conflicts_with = "learning_rate")]
    pub lr: Option<f64>,
    /// Passes over the training images: num_train_epochs.
    #[arg(long, value_name = "N", conflicts_with = "num_train_epochs")]
    pub epochs: Option<usize>,
    /// Log the training loss every N steps (0: once per epoch): logging_steps and
    /// logging_strategy.
    #[arg(long, value_name = "N", conflicts_with_all = ["logging_steps", "logging_strategy"])]
    pub log_interval: Option<usize>,
    /// How the model is replicated across ranks: fsdp (ddp: none).
    #[arg(long, value_parser = ladder_core::cli::spelling::<Strategy>(), conflicts_with = "fsdp")]
    pub strategy: Option<Strategy>,
    /// FSDP backward prefetch: fsdp_config.backward_prefetch [default: no-prefetch,
    /// Transformers' and Accelerate's].
    #[arg(long, value_parser = ladder_core::cli::spelling::<BackwardPrefetch>(), value_name = "POLICY", conflicts_with = "fsdp_config")]
    pub fsdp_backward_prefetch: Option<BackwardPrefetch>,
    /// FSDP forward prefetch: fsdp_config.forward_prefetch.
    #[arg(long, conflicts_with = "fsdp_config")]
    pub fsdp_forward_prefetch: bool,
    /// Mixed precision, `no` or `bf16`: bf16.
    #[arg(long, value_parser = ladder_core::cli::spelling_among(&[Precision::No, Precision::Bf16]), conflicts_with = "bf16")]
    pub mixed_precision: Option<Precision>,
    /// Seconds a collective may wait for the other processes: ddp_timeout (default from
    /// LADDER_COLLECTIVE_TIMEOUT_S when set).
    #[arg(long, value_name = "SECONDS", value_parser = parse_seconds, conflicts_with = "ddp_timeout")]
    pub timeout: Option<f64>,
}

/// clap parser for `--timeout`: a positive number of seconds.
fn parse_seconds(s: &str) -> std::result::Result<f64, String> {
    ladder_core::dist::parse_timeout("--timeout", s).map(|d| d.as_secs_f64()).map_err(|e| e.to_string())
}

/// The recipe's arguments as the binary passes them: [`recipe_arguments`] with level 1's
/// defaults for what that leaves to them (seed 1, a log line every 100 steps).
fn recipe_base() -> TrainingArguments {
    let d = TrainArgs::default();
    TrainingArguments { seed: d.seed, logging_steps: d.log_interval, ..recipe_arguments() }
}

/// The tutorial's TrainingArguments("basic-trainer", per_device_train_batch_size=64,
/// per_device_eval_batch_size=64, num_train_epochs=1, evaluation_strategy="epoch"), everything
/// else Transformers' default.
fn transformers_base() -> TrainingArguments {
    TrainingArguments {
        per_device_train_batch_size: 64,
        per_device_eval_batch_size: 64,
        num_train_epochs: 1.0,
        eval_strategy: IntervalStrategy::Epoch,
        ..TrainingArguments::new("basic-trainer")
    }
}

/// The TrainingArguments flags of `cmd` showing the recipe's value as their default where it
/// differs from Transformers' (`[default: 0.001; Transformers': 5e-5]`), for `--help`.
fn with_recipe_defaults(cmd: Command) -> Command {
    let recipe = serde_json::to_value(recipe_base()).expect("TrainingArguments serialise");
    let transformers = serde_json::to_value(TrainingArguments::default()).expect("TrainingArguments serialise");
    let show = |v: &serde_json::Value| match v {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    cmd.mut_args(|arg: Arg| {
        let id = arg.get_id().as_str().to_string();
        match (recipe.get(&id), transformers.get(&id)) {
            (Some(r), Some(t)) if r != t && !r.is_boolean() && !r.is_null() => {
                let note = format!(" [default: {}; Transformers': {}]", show(r), show(t));
                let help = arg.get_help().map(|h| format!("{h}{note}")).unwrap_or_else(|| note.trim().to_string());
                let long = arg.get_long_help().map(|h| format!("{h}{note}"));
                let arg = arg.hide_default_value(true).help(help);
                match long {
                    Some(l) => arg.long_help(l),
                    None => arg,
                }
            }
            _ => arg,
        }
    })
}

impl Config {
    /// The command `level3-trainer` parses: [`Config`]'s, with the recipe's defaults shown and
    /// the snake_case spellings of every flag accepted.
    pub fn command_line() -> Command {
        spellings::with_snake_case_flags(with_recipe_defaults(Self::command()))
    }

    /// Parses command-line words (the first is the program name), with Transformers' older
    /// flag names read as the new ones (a deprecation warning each), recording which flags
    /// were typed.
    ///
    /// # Errors
    /// clap's error (unknown flag, bad value, two names of one setting, `--help`).
    pub fn try_parse_command_line<T: Into<std::ffi::OsString>>(words: impl IntoIterator<Item = T>) -> clap::error::Result<Self> {
        let (words, warnings) = spellings::rewrite_renamed_flags(words);
        let matches = Self::command_line().try_get_matches_from(words)?;
        warnings.iter().for_each(|w| spellings::warn(w));
        let mut cfg = Self::from_arg_matches(&matches)?;
        cfg.given = typed(&matches);
        Ok(cfg)
    }

    /// Parses the process's command line ([`Self::try_parse_command_line`]); exits on bad
    /// flags or `--help`, as clap does.
    pub fn parse_command_line() -> Self {
        Self::try_parse_command_line(std::env::args_os()).unwrap_or_else(|e| e.exit())
    }

    /// Whether the TrainingArguments flag `field` was typed.
    fn typed(&self, field: &str) -> bool {
        if !self.given.is_empty() {
            return self.given.contains(field);
        }
        let (now, default) = (serde_json::to_value(&self.args), serde_json::to_value(TrainingArguments::default()));
        match (now, default) {
            (Ok(now), Ok(default)) => now.get(field) != default.get(field),
            _ => false,
        }
    }

    /// Level 1's flags for the data, the device and the reports (what [`TrainArgs`]' helpers
    /// read: `load_mnist`, `check_device`, `write_metrics_json`).
    pub fn train_args(&self) -> TrainArgs {
        TrainArgs {
            data_dir: self.data_dir.clone(),
            download: self.download,
            mirrors: self.mirrors.clone(),
            device: self.device,
            metrics_json: self.metrics_json.clone(),
            save_model: self.save_model.clone(),
            ..TrainArgs::default()
        }
    }

    /// The TrainingArguments this command line stands for (see the module docs for the
    /// precedence), validated; errors name the flag typed where one was.
    ///
    /// # Errors
    /// `--width` below 1, an unwritable `--metrics-json`/`--save-model` path, `--device cuda`
    /// without CUDA, an unreadable args file, invalid values.
    pub fn training_arguments(&self) -> Result<TrainingArguments> {
        if self.width < 1 {
            return Err(ladder_core::Error::invalid("--width", self.width, "at least 1 output feature for fc1").into());
        }
        let train = self.train_args();
        train.validate()?;
        train.check_device()?;
        let mut a = if self.transformers_defaults { transformers_base() } else { recipe_base() };
        if let Ok(t) = std::env::var(ladder_core::dist::TIMEOUT_VAR) {
            let t = ladder_core::dist::parse_timeout(ladder_core::dist::TIMEOUT_VAR, &t)?;
            a.ddp_timeout = t.as_secs_f64().ceil() as u64;
        }
        if let Some(file) = &self.args.args_file {
            a = a.overlay_file(file)?;
        }
        a = a.overlay_given(&self.args, |field| self.typed(field));
        self.apply_level1(&mut a);
        if self.device == Some(DeviceKind::Cpu) {
            a.use_cpu = true;
        }
        a.validate().map_err(|e| self.name_error(e))?;
        Ok(a)
    }

    /// Writes the level-1 flags given onto `a`.
    fn apply_level1(&self, a: &mut TrainingArguments) {
        let l = &self.level1;
        if let Some(b) = l.batch_size {
            a.per_device_train_batch_size = b;
        }
        if let Some(lr) = l.lr {
            a.learning_rate = lr;
        }
        if let Some(e) = l.epochs {
            a.num_train_epochs = e as f64;
        }
        match l.log_interval {
            Some(0) => a.logging_strategy = IntervalStrategy::Epoch,
            Some(n) => (a.logging_strategy, a.logging_steps) = (IntervalStrategy::Steps, n),
            None => {}
        }
        if let Some(s) = &l.strategy {
            a.fsdp = s.sharding().map(crate::args::FsdpArg::from);
        }
        if let Some(p) = l.fsdp_backward_prefetch {
            a.fsdp_config.backward_prefetch = p;
        }
        if l.fsdp_forward_prefetch {
            a.fsdp_config.forward_prefetch = true;
        }
        if let Some(p) = l.mixed_precision {
            a.bf16 = p == Precision::Bf16;
        }
        if let Some(t) = l.timeout {
            a.ddp_timeout = t.ceil() as u64;
        }
    }

    /// The flag the user typed for TrainingArguments field `field` (its own or level 1's
    /// name), if one was.
    pub fn flag_for(&self, field: &str) -> Option<String> {
        let l = &self.level1;
        let level1 = match field {
            "per_device_train_batch_size" => l.batch_size.map(|_| "--batch-size"),
            "learning_rate" => l.lr.map(|_| "--lr"),
            "num_train_epochs" => l.epochs.map(|_| "--epochs"),
            "logging_steps" | "logging_strategy" => l.log_interval.map(|_| "--log-interval"),
            "fsdp" => l.strategy.as_ref().map(|_| "--strategy"),
            "bf16" => l.mixed_precision.map(|_| "--mixed-precision"),
            "ddp_timeout" => l.timeout.map(|_| "--timeout"),
            _ => None,
        };
        level1.map(str::to_string).or_else(|| self.typed(field).then(|| format!("--{}", field.replace('_', "-"))))
    }

    /// How the user set TrainingArguments field `field`: the flag typed, else `field in FILE`
    /// when the args file holds it; `None` when it was left to the recipe (or Transformers').
    pub fn set_by(&self, field: &str) -> Option<String> {
        if let Some(flag) = self.flag_for(field) {
            return Some(flag);
        }
        let file = self.args.args_file.as_ref()?;
        let fields = TrainingArguments::fields_in_file(file).ok()?;
        fields.iter().any(|f| f == field).then(|| format!("{field} in {}", file.display()))
    }

    /// `e` with a TrainingArguments field's name replaced by the flag the user typed for it
    /// (`--batch-size 70000` is reported as `--batch-size`, not per_device_train_batch_size);
    /// unchanged when the value came from the args file or a default.
    pub fn name_error(&self, mut e: Error) -> Error {
        use ladder_core::Error as Core;
        match &mut e {
            Error::InvalidArgument { field, value, expected } => {
                if let Some(flag) = self.flag_for(field) {
                    return Core::InvalidValue { name: flag, value: std::mem::take(value), expected: std::mem::take(expected) }.into();
                }
            }
            Error::Core(Core::InvalidValue { name, .. } | Core::BatchTooLargeForMemory { flag: name, .. }) => {
                if let Some(flag) = self.flag_for(name) {
                    *name = flag;
                }
            }
            _ => {}
        }
        e
    }

    /// Where to resume from: `--resume-from-checkpoint` (no value: the newest checkpoint).
    pub fn resume(&self) -> Option<ResumeFrom> {
        self.resume_from_checkpoint.as_deref().map(|r| if r == "last" { ResumeFrom::Last } else { ResumeFrom::Dir(r.into()) })
    }
}

/// The ids of the arguments typed on the command line.
fn typed(matches: &ArgMatches) -> BTreeSet<String> {
    matches
        .ids()
        .filter(|id| matches!(matches.value_source(id.as_str()), Some(ValueSource::CommandLine)))
        .map(|id| id.as_str().to_string())
        .collect()
}
