//! The prepared optimizer, and what guards its step: it steps when the run's gradient state
//! says the accumulation window ends; under fp16 it unscales the gradients and skips a step
//! whose gradients overflowed on any process (`GradScaler`); and it stops the run on a NaN/inf
//! loss or gradient.

use super::state::Shared;
use crate::scaler::GradScaler;
use crate::Result;
use ladder_core::parallel::WrappedModel;
use std::rc::Rc;
use tch::Tensor;

/// What guards an optimizer step: fp16 loss scaling and the divergence check.
#[derive(Debug)]
pub(crate) struct StepGuard {
    /// The loss scaler (fp16), if any.
    pub scaler: Option<GradScaler>,
    /// The window's gradients were unscaled already.
    unscaled: bool,
    /// The last step was skipped (fp16 overflow).
    pub step_was_skipped: bool,
    /// Stop on a NaN/inf loss or gradient.
    pub check_finite: bool,
    /// The window's loss for that check: the first non-finite one, else the last.
    window_loss: f64,
}

impl StepGuard {
    /// Loss scaling when `scaler` is given; the divergence check on.
    pub fn new(scaler: Option<GradScaler>) -> Self {
        StepGuard { scaler, unscaled: false, step_was_skipped: false, check_finite: true, window_loss: 0.0 }
    }

    /// The loss `backward` differentiates: divided by the window's length, multiplied by the
    /// loss scale under fp16 (a new tensor: the caller's loss keeps its value). Records the
    /// loss for the divergence check.
    pub fn loss_to_backward(&mut self, loss: &Tensor, window: usize) -> Tensor {
        let per_window = if window > 1 { loss / window as f64 } else { loss.shallow_clone() };
        let scaled = match self.scaler {
            Some(s) => &per_window * s.scale,
            None => per_window,
        };
        self.unscaled = false;
        if self.check_finite {
            let l = loss.double_value(&[]);
            if self.window_loss.is_finite() {
                self.window_loss = l;
            }
        }
        scaled
    }

    /// Unscales the gradients once per window under fp16 (`GradScaler.unscale_`).
    ///
    /// # Errors
    /// FSDP collective errors.
    pub fn unscale(&mut self, model: &WrappedModel<'static>) -> Result<()> {
        if let Some(s) = self.scaler {
            if !std::mem::replace(&mut self.unscaled, true) {
                model.scale_grads(1.0 / s.scale)?;
            }
        }
        Ok(())
    }

    /// Before optimizer step number `step`: the divergence check, then (fp16) unscaling and the
    /// overflow check agreed by every process, and the scale's update. Returns whether the
    /// step must be skipped.
    ///
    /// # Errors
    /// A NaN/inf loss or gradient (named with the step and process); collective errors.
    fn before_step(&mut self, model: &WrappedModel<'static>, step: u64) -> Result<bool> {
        if self.check_finite {
            let loss = std::mem::take(&mut self.window_loss);
            // Under fp16 loss scaling an infinite gradient is the scaler's business.
            if self.scaler.is_none() {
                model.check_finite(step, loss)?;
            } else {
                model.check_finite_loss(step, loss)?;
            }
        }
        let found_inf = if self.scaler.is_some() {
            self.unscale(model)?;
            !model.grads_finite()?
        } else {
            false
        };
        if let Some(s) = self.scaler.as_mut() {
            s.update(found_inf);
        }
        self.step_was_skipped = found_inf;
        Ok(found_inf)
    }
}

/// The prepared optimizer: AdamW over what this process owns of the model; it steps and zeroes
/// gradients only at accumulation boundaries; under fp16 it unscales, and skips a step whose
/// gradients overflowed on any process.
#[derive(Debug)]
pub struct AcceleratedOptimizer {
    pub(crate) shared: Rc<Shared>,
}

impl AcceleratedOptimizer {
    /// One optimizer step, at an accumulation boundary only (elsewhere a no-op).
    ///
    /// # Errors
    /// A NaN/inf loss or gradient (with the divergence check on); collective errors (the fp16
    /// overflow check).
    pub fn step(&mut self) -> Result<()> {
        let shared = &*self.shared;
        {
            let mut state = shared.state.borrow_mut();
            if !state.gradient.sync_gradients() {
                return Ok(());
            }
            let step = state.gradient.global_step + 1;
            let skip = state.guard.before_step(&shared.prepared_model().borrow(), step)?;
            if !skip {
                self.opt().borrow_mut().step();
            }
            state.gradient.global_step = step;
        }
        shared.end_step();
        Ok(())
    }

    /// Zeroes the gradients, at an accumulation boundary only.
    pub fn zero_grad(&mut self) {
        if self.shared.state.borrow().gradient.sync_gradients() {
            self.opt().borrow_mut().zero_grad();
        }
    }

    /// The learning rate.
    pub fn lr(&self) -> f64 {
        self.opt().borrow().lr()
    }

    /// Sets the learning rate of the next steps (a scheduler's job).
    pub fn set_lr(&mut self, lr: f64) {
        self.opt().borrow_mut().set_lr(lr);
    }

    fn opt(&self) -> &std::cell::RefCell<ladder_core::optim::AdamW> {
        self.shared.prepared_optimizer()
    }
}
