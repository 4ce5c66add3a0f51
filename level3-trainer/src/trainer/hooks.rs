//! The user's part of a Trainer: the batch a collator makes, the model as `compute_loss` sees
//! it, and [`TrainerHooks`] — the methods a Transformers user overrides in a `Trainer`
//! subclass (`compute_loss`, `compute_metrics`).

use crate::error::Result;
use crate::state::Metrics;
use level2_accelerator::{Accelerator, PreparedModel};
use tch::Tensor;

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
    pub(super) model: &'a PreparedModel,
    pub(super) accelerator: &'a Accelerator,
    pub(super) train: bool,
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

/// What [`Trainer::predict`](super::Trainer::predict) returns (Transformers' `PredictionOutput`).
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
