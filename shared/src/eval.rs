//! Evaluation: the tutorial's `test()` over the whole test set in eval mode under `no_grad`
//! ([`evaluate`]), over any forward function ([`evaluate_with`], e.g. an FSDP model's), in pieces
//! of at most [`EVAL_PIECE`] images per forward, and exact distributed evaluation
//! ([`evaluate_distributed`]): every test image counted once at any world size.

use crate::data::Dataset;
use crate::{Error, Result};
use tch::nn::ModuleT;
use tch::{Kind, Tensor};

/// Sums from evaluating part of the test set; all-reducing them over ranks gives the exact
/// figures of the whole set.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EvalSums {
    /// Images whose argmax prediction equals the label.
    pub correct: i64,
    /// Sum of the per-image negative log-likelihoods.
    pub loss_sum: f64,
    /// Images evaluated.
    pub count: i64,
}

impl EvalSums {
    /// `correct / count` (0 when nothing was evaluated).
    pub fn accuracy(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.correct as f64 / self.count as f64
        }
    }
    /// Mean negative log-likelihood.
    pub fn mean_loss(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.loss_sum / self.count as f64
        }
    }
}

/// Evaluates `model` on every image of `data` once, in eval mode under `no_grad`, in batches of
/// `batch_size`, on the dataset's device. As the tutorial's `test()` (whose test batch is 1,000);
/// each batch's forward runs in pieces of at most [`EVAL_PIECE`] images (see there).
pub fn evaluate(model: &impl ModuleT, data: &Dataset, batch_size: usize) -> EvalSums {
    evaluate_with(|x| Ok(model.forward_t(x, false)), data, batch_size).expect("a plain forward cannot fail")
}

/// The most images one evaluation forward sees at once. A batch of the tutorial's 1,000 test
/// images is run as pieces of 128 and their outputs concatenated before the loss: each image's
/// log-probabilities do not depend on which images share its forward, so the loss and the count
/// are the batch's, but the activations held at once are an eighth (BasicNet's conv2 output for
/// 1,000 images alone is 147 MB, and that evaluation was each rank's peak RSS: ~640 MiB against
/// ~280 MiB while training). Smaller pieces also ran faster on CPU (BasicNet, one thread:
/// 645 ms per 1,000 images whole, 317 ms in pieces of 128).
pub const EVAL_PIECE: usize = 128;

/// An evaluation forward of `xs` `[b, …]` in pieces of at most [`EVAL_PIECE`] along the batch
/// dimension, outputs concatenated in order (`forward(xs)` itself when `b` ≤ `EVAL_PIECE`).
///
/// # Errors
/// The first error `forward` returns.
pub fn forward_in_pieces(xs: &Tensor, mut forward: impl FnMut(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    let (n, piece) = (xs.size()[0], EVAL_PIECE as i64);
    if n <= piece {
        return forward(xs);
    }
    let outs = (0..n).step_by(EVAL_PIECE).map(|i| forward(&xs.narrow(0, i, piece.min(n - i))));
    Ok(Tensor::cat(&outs.collect::<Result<Vec<Tensor>>>()?, 0))
}

/// [`evaluate`] over any forward function (e.g. an FSDP model's, which gathers its shards):
/// `forward` maps images `[b, 1, 28, 28]` to log-probabilities `[b, 10]`; it runs under
/// `no_grad`.
///
/// # Errors
/// The first error `forward` returns.
pub fn evaluate_with(mut forward: impl FnMut(&Tensor) -> Result<Tensor>, data: &Dataset, batch_size: usize) -> Result<EvalSums> {
    let n = data.len();
    let mut sums = EvalSums::default();
    tch::no_grad(|| {
        let mut start = 0;
        while start < n {
            let len = batch_size.min(n - start);
            let part = data.slice(start..start + len);
            let out = forward_in_pieces(&part.images(), &mut forward)?;
            sums.loss_sum += out.nll_loss(&part.labels).double_value(&[]) * len as f64;
            sums.correct += out.argmax(-1, false).eq_tensor(&part.labels).sum(Kind::Int64).int64_value(&[]);
            sums.count += len as i64;
            start += len;
        }
        Ok(sums)
    })
}

/// Exact distributed evaluation: rank r evaluates the contiguous, unpadded slice
/// [`eval_shard`](crate::data::eval_shard)`(n, r, W)` of `data` and the correct counts, loss sums
/// and image counts are all-reduced (Sum). Every image is counted exactly once at any world
/// size (10,000, not the 10,002 a padding sampler would give), and the figures equal the
/// single-process [`evaluate`] of the same weights.
///
/// # Errors
/// Collective errors.
pub fn evaluate_distributed(
    pg: &dyn crate::dist::ProcessGroup,
    model: &impl ModuleT,
    data: &Dataset,
    batch_size: usize,
) -> Result<EvalSums> {
    evaluate_distributed_with(pg, |x| Ok(model.forward_t(x, false)), data, batch_size)
}

/// [`evaluate_distributed`] over any forward function (see [`evaluate_with`]).
///
/// # Errors
/// Errors of `forward`; collective errors.
// ANCHOR: exact_eval
pub fn evaluate_distributed_with(
    pg: &dyn crate::dist::ProcessGroup,
    forward: impl FnMut(&Tensor) -> Result<Tensor>,
    data: &Dataset,
    batch_size: usize,
) -> Result<EvalSums> {
    let shard = crate::data::eval_shard(data.len(), pg.rank(), pg.world_size());
    let local = evaluate_with(forward, &data.slice(shard), batch_size)?;
    let mut sums = Tensor::from_slice(&[local.correct as f64, local.loss_sum, local.count as f64]).to_device(pg.device());
    pg.all_reduce(&mut sums, crate::dist::ReduceOp::Sum)?;
    let v = Vec::<f64>::try_from(sums.to_device(tch::Device::Cpu)).map_err(Error::Torch)?;
    Ok(EvalSums { correct: v[0].round() as i64, loss_sum: v[1], count: v[2].round() as i64 })
}
// ANCHOR_END: exact_eval
