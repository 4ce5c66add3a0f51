//! The running loss sums behind the logged `loss` and the run's `train_loss`, carried through
//! checkpoints so that a resumed run logs what an uninterrupted one would.

use crate::error::Result;
use ladder_core::dist::ReduceOp;
use level2_accelerator::Accelerator;
use tch::{Device, Tensor};

/// Running sums of per-step losses: this rank's `Σ_k (Σ_b l_b·n_b / Σ_b n_b)` over the logging
/// window and over the run. With equal per-rank step sizes (the padded sampler), the mean over
/// ranks of these equals the mean over all samples of every step.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct LossSums {
    window_sum: f64,
    pub(super) window_steps: u64,
    total_sum: f64,
    total_steps: u64,
}

impl LossSums {
    /// Counts one optimization step: this rank's mean loss over its samples of the window.
    pub(super) fn add_step(&mut self, local_step_loss: f64) {
        self.window_sum += local_step_loss;
        self.window_steps += 1;
        self.total_sum += local_step_loss;
        self.total_steps += 1;
    }

    /// The window's mean step loss over all ranks; resets the window. Collective.
    pub(super) fn take_window(&mut self, acc: &Accelerator) -> Result<f64> {
        let t = acc.reduce(&Tensor::from_slice(&[self.window_sum]).to_device(acc.device()), ReduceOp::Sum)?;
        let loss = t.double_value(&[0]) / (acc.num_processes() as f64 * self.window_steps as f64);
        self.window_sum = 0.0;
        self.window_steps = 0;
        Ok(loss)
    }

    /// `(Σ over ranks of total_sum, total_steps)`. Collective.
    pub(super) fn all_reduced_total(&self, acc: &Accelerator) -> Result<(f64, f64)> {
        let t = acc.reduce(&Tensor::from_slice(&[self.total_sum]).to_device(acc.device()), ReduceOp::Sum)?;
        Ok((t.double_value(&[0]), self.total_steps as f64))
    }

    /// The sums over ranks, for a checkpoint. Collective.
    pub(super) fn checkpoint_extra(&self, acc: &Accelerator) -> Result<serde_json::Map<String, serde_json::Value>> {
        let t = acc.reduce(&Tensor::from_slice(&[self.window_sum, self.total_sum]).to_device(acc.device()), ReduceOp::Sum)?;
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
    pub(super) fn from_extra(extra: &serde_json::Map<String, serde_json::Value>, rank: usize) -> Self {
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
