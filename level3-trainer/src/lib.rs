//! Level 3 of ddp-ladder: a `Trainer` with `TrainingArguments`, as 🤗 Transformers' — the user
//! hands over a model, datasets, a collator, a `compute_loss` and the arguments; there is no
//! loop in user code. Built on the level-2 [`Accelerator`](level2_accelerator::Accelerator), as
//! Transformers is built on Accelerate.
//!
//! Modules: [`args`] (TrainingArguments), [`schedule`] (planning and learning-rate schedules),
//! [`trainer`] (the Trainer, its hooks and collator), [`state`] (TrainerState, log history),
//! [`output`] (banner, table, log writers, loss plot, progress), [`callbacks`]
//! (TrainerCallback, CallbackHandler, DefaultFlowCallback, EarlyStoppingCallback), [`checkpoints`]
//! (`checkpoint-<step>` naming and save_total_limit rotation), [`cli`] (the binary's command
//! line: every TrainingArguments field as a flag, and level 1's names). [`run`] is the binary's
//! job: the tutorial's Trainer example.

pub mod args;
pub mod callbacks;
pub mod checkpoints;
pub mod cli;
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

pub use cli::Config;

use ladder_core::eval::EvalSums;
use ladder_core::metrics::{LocalFigures, Report};
use ladder_core::model::{BasicNet, BasicNetConfig};
use std::time::Instant;
use tch::{nn, Device, Kind, Tensor};

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
    run_named(cfg).map_err(|e| cfg.name_error(e))
}

/// [`run`], its errors naming TrainingArguments fields.
fn run_named(cfg: &Config) -> Result<Report> {
    let start = Instant::now();
    let args = cfg.training_arguments()?;
    // The launcher's settings: used where the arguments leave them; one given both ways differently, refused.
    Trainer::check_launcher_settings(&args, |field| cfg.set_by(field), |k| std::env::var(k).ok())?;
    let train_args = cfg.train_args();
    // A checkpoint on SIGTERM, armed before the process group exists (see ladder_core::preempt).
    ladder_core::preempt::watch()?;

    // ANCHOR: user_code
    set_seed(args.seed);
    let mnist = train_args.load_mnist()?;
    let vs = nn::VarStore::new(Device::Cpu);
    let model = BasicNet::new(&vs.root(), BasicNetConfig { width: cfg.width, ..Default::default() });
    let mut trainer = Trainer::new(vs, model, args, Some(mnist.train), Some(mnist.test.shallow_clone()), collate_fn, MyTrainer)?;
    let out = trainer.train(cfg.resume())?;
    trainer.save_model()?;
    // ANCHOR_END: user_code
    if let Some(path) = &cfg.save_model {
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
        timing: out.timing, // the training steps: train()'s evaluations and saves, and save_model(), not included
    };
    let wall_s = start.elapsed().as_secs_f64();
    let mut report = trainer.accelerator().gather_report(&local, &eval, wall_s)?;
    report.steps = out.global_step;
    report.extra.insert("output_dir".into(), trainer.args().output_dir.display().to_string().into());
    if trainer.is_world_process_zero() {
        train_args.write_metrics_json(&report)?;
    }
    trainer.accelerator().wait_for_everyone()?;
    Ok(report)
}
