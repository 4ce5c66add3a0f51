//! Level 3 of ddp-ladder: a `Trainer` with `TrainingArguments`, as 🤗 Transformers' — the user
//! hands over a model, datasets, a collator, a `compute_loss` and the arguments; there is no
//! loop in user code. Built on the level-2 [`Accelerator`](level2_accelerator::Accelerator), as
//! Transformers is built on Accelerate.
//!
//! Modules: [`args`] (TrainingArguments), [`schedule`] (planning and learning-rate schedules),
//! [`trainer`] (the Trainer, its hooks and collator), [`state`] (TrainerState, log history),
//! [`output`] (banner, table, log writers, loss plot, progress), [`callbacks`]
//! (TrainerCallback, CallbackHandler, DefaultFlowCallback, EarlyStoppingCallback), [`checkpoints`]
//! (`checkpoint-<step>` naming and save_total_limit rotation). [`run`] is the binary's job: the
//! tutorial's Trainer example with level 1's flags mapped onto TrainingArguments.

pub mod args;
pub mod callbacks;
pub mod checkpoints;
pub mod error;
pub mod output;
pub mod schedule;
pub mod state;
pub mod trainer;

pub use args::TrainingArguments;
pub use error::{Error, Result};
pub use state::Metrics;
pub use trainer::{
    set_seed, Batch, DataCollator, DefaultDataCollator, DefaultHooks, EvalPrediction, PredictionOutput, ResumeFrom, TrainOutput, Trainer,
    TrainerHooks, TrainerModel,
};

use clap::{CommandFactory, FromArgMatches, Parser};
use ladder_core::device::DeviceKind;
use ladder_core::eval::EvalSums;
use ladder_core::metrics::{LocalFigures, Report};
use ladder_core::model::{BasicNet, BasicNetConfig};
use ladder_core::parallel::{BackwardPrefetch, Precision, Strategy};
use ladder_core::recipe::TrainArgs;
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Instant;
use tch::{nn, Device, Kind, Tensor};

/// Level 3's command line: level 1's training flags mapped onto [`TrainingArguments`], plus
/// the Trainer's own.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "level3-trainer",
    version,
    about = "Level 3: BasicNet on MNIST with a Trainer and TrainingArguments (as 🤗 Transformers) — no training loop in user code",
    after_help = format!(concat!("Launch: `target/release/level3-trainer` (1 process), `target/release/ladder-run --nproc-per-node 2 target/release/level3-trainer`, or `mpirun -n 2 target/release/level3-trainer`.\n\nBy default the recipe shared by the three levels is passed explicitly: the defaults above, plus weight_decay 0.01, a constant schedule, no warmup, no clipping and evaluation each epoch; --transformers-defaults uses Transformers' own instead. Precedence: recipe or Transformers defaults < --args-file < flags given.\n\n{}\n", "  ACCELERATE_*\n      ignored: TrainingArguments set every Accelerator setting explicitly"), ladder_core::cli::ENVIRONMENT_HELP),
    allow_negative_numbers = true
)]
pub struct Config {
    /// Level 1's training flags (`--epochs --batch-size --lr --seed --max-steps --device
    /// --metrics-json --log-interval --data-dir --save-model …`), mapped onto TrainingArguments.
    #[command(flatten)]
    pub train: TrainArgs,
    /// How the model is replicated across ranks (TrainingArguments.fsdp).
    #[arg(long, value_parser = ladder_core::cli::spelling::<Strategy>(), default_value_t = Strategy::default())]
    pub strategy: Strategy,
    /// FSDP auto-wrap threshold in parameters (TrainingArguments.fsdp_min_num_params; default
    /// the Accelerator's, 1e8: one unit). 0 wraps every layer.
    #[arg(long, value_name = "N")]
    pub fsdp_min_num_params: Option<usize>,
    /// FSDP backward prefetch (TrainingArguments.fsdp_config.backward_prefetch): when
    /// fsdp-full-shard's backward starts all-gathering the next unit [default: no-prefetch,
    /// Transformers' and Accelerate's].
    #[arg(long, value_parser = ladder_core::cli::spelling::<BackwardPrefetch>(), value_name = "POLICY")]
    pub fsdp_backward_prefetch: Option<BackwardPrefetch>,
    /// FSDP forward prefetch (TrainingArguments.fsdp_config.forward_prefetch): start the next
    /// unit's all-gather before the current unit's forward [default: off].
    #[arg(long)]
    pub fsdp_forward_prefetch: bool,
    /// Output features of BasicNet's fc1 (the tutorial's 128; 4096 gives ~38M parameters, for
    /// memory comparisons).
    #[arg(long, default_value_t = 128)]
    pub width: i64,
    /// Mixed precision (TrainingArguments.bf16): `no` or `bf16`.
    #[arg(long, value_parser = ladder_core::cli::spelling_among(&[Precision::No, Precision::Bf16]), default_value_t = Precision::No)]
    pub mixed_precision: Precision,
    /// TrainingArguments.output_dir: checkpoints, trainer_state.json, training_args.json, the
    /// loss plot, model.safetensors.
    #[arg(long, default_value = "basic-trainer", value_name = "DIR")]
    pub output_dir: PathBuf,
    /// Use Transformers' TrainingArguments defaults (learning_rate 5e-5 with linear decay,
    /// max_grad_norm 1.0, weight_decay 0, seed 42, logging_steps 500) for everything the
    /// tutorial's Trainer example does not set (it sets batch 64, 1 epoch, evaluation each
    /// epoch), instead of the shared recipe.
    #[arg(long)]
    pub transformers_defaults: bool,
    /// A JSON or TOML file of TrainingArguments laid over the recipe (flags given win).
    #[arg(long, value_name = "FILE")]
    pub args_file: Option<PathBuf>,
    /// Resume from this checkpoint directory, or with no value from the newest
    /// output_dir/checkpoint-<step>.
    #[arg(long, value_name = "DIR", num_args = 0..=1, default_missing_value = "last")]
    pub resume_from_checkpoint: Option<String>,
    /// The flags given on the command line (clap ids), as [`Config::parse_command_line`]
    /// records them; `None` (a `Config` built otherwise) counts a flag as given when its value
    /// differs from the flag's default.
    #[arg(skip)]
    pub given: Option<BTreeSet<String>>,
}

impl Config {
    /// Parses the process's command line, remembering which flags were given (so that
    /// `--args-file` values are overridden only by flags actually typed). Exits on bad flags
    /// or `--help`, as clap does.
    pub fn parse_command_line() -> Self {
        let matches = Self::command().get_matches();
        let mut cfg = Self::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
        let given = matches
            .ids()
            .filter(|id| matches!(matches.value_source(id.as_str()), Some(clap::parser::ValueSource::CommandLine)))
            .map(|id| id.as_str().to_string())
            .collect();
        cfg.given = Some(given);
        cfg
    }

    fn was_given(&self, id: &str) -> bool {
        if let Some(given) = &self.given {
            return given.contains(id);
        }
        let d = TrainArgs::default();
        match id {
            "batch_size" => self.train.batch_size != d.batch_size,
            "lr" => self.train.lr != d.lr,
            "epochs" => self.train.epochs != d.epochs,
            "seed" => self.train.seed != d.seed,
            "max_steps" => self.train.max_steps.is_some(),
            "log_interval" => self.train.log_interval != d.log_interval,
            "strategy" => self.strategy != Strategy::default(),
            "fsdp_min_num_params" => self.fsdp_min_num_params.is_some(),
            "fsdp_backward_prefetch" => self.fsdp_backward_prefetch.is_some(),
            "fsdp_forward_prefetch" => self.fsdp_forward_prefetch,
            "mixed_precision" => self.mixed_precision != Precision::No,
            _ => false,
        }
    }

    /// The TrainingArguments this command line stands for. Precedence: the shared recipe
    /// (whose values are the level-1 flags' values, defaults included) or, with
    /// `--transformers-defaults`, the tutorial's Trainer arguments over Transformers'
    /// defaults; then `--args-file`; then the flags given on the command line.
    ///
    /// # Errors
    /// An unreadable args file; a strategy TrainingArguments cannot express; invalid values.
    pub fn training_arguments(&self) -> Result<TrainingArguments> {
        self.train.validate()?;
        if self.width < 1 {
            return Err(ladder_core::Error::invalid("--width", self.width, "at least 1 output feature for fc1").into());
        }
        let base = if self.transformers_defaults {
            // The tutorial's TrainingArguments("basic-trainer", per_device_train_batch_size=64,
            // per_device_eval_batch_size=64, num_train_epochs=1, evaluation_strategy="epoch"):
            // everything else is Transformers' default.
            TrainingArguments {
                per_device_train_batch_size: 64,
                per_device_eval_batch_size: 64,
                num_train_epochs: 1.0,
                eval_strategy: args::IntervalStrategy::Epoch,
                ..TrainingArguments::default()
            }
        } else {
            let mut recipe = recipe_arguments();
            self.apply_flags(&mut recipe, |_| true)?;
            recipe
        };
        let mut a = match &self.args_file {
            Some(file) => base.overlay_file(file)?,
            None => base,
        };
        self.apply_flags(&mut a, |id| self.was_given(id))?;
        a.output_dir = self.output_dir.clone();
        a.overwrite_output_dir = self.resume_from_checkpoint.is_none();
        if self.train.device_kind() == DeviceKind::Cpu {
            a.use_cpu = true;
        }
        // --timeout (or LADDER_COLLECTIVE_TIMEOUT_S) and --allow-non-finite, when set.
        if self.train.timeout != TrainArgs::default().timeout {
            a.ddp_timeout = self.train.timeout.ceil() as u64;
        }
        a.allow_non_finite |= self.train.allow_non_finite;
        a.validate()?;
        Ok(a)
    }

    /// Writes the level-1 flags for which `apply(id)` holds onto `a`.
    fn apply_flags(&self, a: &mut TrainingArguments, apply: impl Fn(&str) -> bool) -> Result<()> {
        if apply("batch_size") {
            a.per_device_train_batch_size = self.train.batch_size;
        }
        if apply("lr") {
            a.learning_rate = self.train.lr;
        }
        if apply("epochs") {
            a.num_train_epochs = self.train.epochs as f64;
        }
        if apply("seed") {
            a.seed = self.train.seed;
        }
        if let (true, Some(m)) = (apply("max_steps"), self.train.max_steps) {
            a.max_steps = m as i64;
        }
        if apply("log_interval") {
            if self.train.log_interval == 0 {
                a.logging_strategy = args::IntervalStrategy::Epoch;
            } else {
                a.logging_strategy = args::IntervalStrategy::Steps;
                a.logging_steps = self.train.log_interval;
            }
        }
        if apply("strategy") {
            a.fsdp = self.strategy.sharding();
        }
        if apply("fsdp_min_num_params") && self.fsdp_min_num_params.is_some() {
            a.fsdp_min_num_params = self.fsdp_min_num_params;
        }
        if let (true, Some(p)) = (apply("fsdp_backward_prefetch"), self.fsdp_backward_prefetch) {
            a.fsdp_config.backward_prefetch = p;
        }
        if apply("fsdp_forward_prefetch") {
            a.fsdp_config.forward_prefetch = self.fsdp_forward_prefetch;
        }
        if apply("mixed_precision") {
            a.bf16 = self.mixed_precision == Precision::Bf16;
        }
        Ok(())
    }

    fn resume(&self) -> Option<ResumeFrom> {
        self.resume_from_checkpoint.as_deref().map(|r| if r == "last" { ResumeFrom::Last } else { ResumeFrom::Dir(r.into()) })
    }
}

// ANCHOR: user_code
/// The tutorial's `MyTrainer(Trainer)`: its `compute_loss` override, and accuracy as the metric.
#[derive(Debug)]
pub struct MyTrainer;

impl TrainerHooks for MyTrainer {
    fn compute_loss(&self, model: &mut TrainerModel<'_>, inputs: &Batch) -> Result<(Tensor, Tensor)> {
        let outputs = model.forward(&inputs.x)?;
        Ok((outputs.nll_loss(&inputs.labels), outputs))
    }
    fn compute_metrics(&self, p: &EvalPrediction) -> Metrics {
        let correct = p.predictions.argmax(-1, false).eq_tensor(&p.label_ids).sum(Kind::Int64).int64_value(&[]);
        Metrics::from([("accuracy".into(), correct as f64 / p.label_ids.size()[0].max(1) as f64)])
    }
    fn metric_names(&self) -> Vec<&'static str> {
        vec!["accuracy"]
    }
}

/// The tutorial's `collate_fn`: `{"x": images, "labels": labels}`.
pub fn collate_fn(images: Tensor, labels: Tensor) -> Batch {
    Batch { x: images, labels }
}

/// The tutorial's `TrainingArguments("basic-trainer", per_device_train_batch_size=64,
/// per_device_eval_batch_size=64, num_train_epochs=1, evaluation_strategy="epoch")`, with the
/// optimizer recipe of levels 1 and 2 passed explicitly (AdamW lr 1e-3, weight_decay 0.01, a
/// constant rate, no clipping) so that the levels compute the same thing.
pub fn recipe_arguments() -> TrainingArguments {
    TrainingArguments {
        output_dir: "basic-trainer".into(),
        per_device_train_batch_size: 64,
        per_device_eval_batch_size: 1000, // the recipe's test batch (levels 1 and 2 evaluate in 1000s)
        num_train_epochs: 1.0,
        eval_strategy: args::IntervalStrategy::Epoch,
        learning_rate: 1e-3,
        weight_decay: 0.01,
        lr_scheduler_type: args::SchedulerType::Constant,
        max_grad_norm: 0.0,
        ..TrainingArguments::default()
    }
}
// ANCHOR_END: user_code

/// Trains and evaluates as configured with the Trainer; every rank returns the run's report
/// (rank 0 also writes `--metrics-json`), with `output_dir` in its extra fields.
///
/// # Errors
/// Bad flags or arguments, data errors, process-group and collective errors.
pub fn run(cfg: &Config) -> Result<Report> {
    let start = Instant::now();
    let args = cfg.training_arguments()?;
    let mnist = cfg.train.load_mnist()?;
    // A checkpoint on SIGTERM, armed before the process group exists (see ladder_core::preempt).
    ladder_core::preempt::watch()?;

    // ANCHOR: user_code
    set_seed(args.seed);
    let vs = nn::VarStore::new(Device::Cpu);
    let model = BasicNet::new(&vs.root(), BasicNetConfig { width: cfg.width, ..Default::default() });
    let mut trainer = Trainer::new(vs, model, args, Some(mnist.train), Some(mnist.test.shallow_clone()), collate_fn, MyTrainer)?;
    let out = trainer.train(cfg.resume())?;
    trainer.save_model()?;
    // ANCHOR_END: user_code
    if let Some(path) = &cfg.train.save_model {
        if let Some(weights) = trainer.accelerator().get_state_dict()? {
            ladder_core::recipe::save_weights(path, &weights)
                .map_err(|e| e.named_by(&[(ladder_core::recipe::WEIGHTS_FILE, "--save-model")]))?;
        }
    }

    // The figures every level reports: the final weights' evaluation (the last one of
    // training when it was at the last step and nothing was reloaded since).
    let last_eval = trainer.state.log_history.iter().rev().find(|e| e.get("eval_loss").is_some()).cloned();
    let metrics = match last_eval {
        Some(e) if e.step == out.global_step && !trainer.args().load_best_model_at_end => e.values,
        _ => trainer.evaluate("eval")?,
    };
    let count = mnist.test.len() as i64;
    let accuracy = metrics.get("eval_accuracy").copied().unwrap_or(0.0);
    let eval = EvalSums {
        correct: (accuracy * count as f64).round() as i64,
        loss_sum: metrics.get("eval_loss").copied().unwrap_or(0.0) * count as f64,
        count,
    };
    let local = LocalFigures {
        samples: out.local_samples,
        train_s: out.train_s,
        train_loss: out.training_loss,
        comm_s: out.comm_s,
        model_state: out.model_state,
        timing: Default::default(), // the Accelerator's step timer fills it
    };
    let wall_s = start.elapsed().as_secs_f64();
    let mut report = trainer.accelerator().gather_report(&local, &eval, wall_s)?;
    report.steps = out.global_step;
    report.extra.insert("output_dir".into(), trainer.args().output_dir.display().to_string().into());
    if trainer.is_world_process_zero() {
        cfg.train.write_metrics_json(&report)?;
    }
    trainer.accelerator().wait_for_everyone()?;
    Ok(report)
}
