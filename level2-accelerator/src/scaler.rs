//! Dynamic loss scaling for fp16, as `torch.amp.GradScaler` does it.
//!
//! `backward` multiplies the loss by [`GradScaler::scale`]; before the optimizer step the
//! gradients are multiplied by `1 / scale` and checked: if any rank holds an inf or NaN, the
//! step is skipped on every rank and the scale is multiplied by `backoff_factor` (0.5);
//! after `growth_interval` (2000) steps in a row without one, it is multiplied by
//! `growth_factor` (2). The initial scale is 2¹⁶.

use serde::{Deserialize, Serialize};

/// The loss scale and its update rule (PyTorch's `GradScaler` defaults).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GradScaler {
    /// The current scale the loss is multiplied by.
    pub scale: f64,
    /// Factor applied after `growth_interval` clean steps (2.0).
    pub growth_factor: f64,
    /// Factor applied after a step with inf/NaN gradients (0.5).
    pub backoff_factor: f64,
    /// Clean steps between growths (2000).
    pub growth_interval: u64,
    /// Clean steps since the last growth or backoff.
    pub growth_tracker: u64,
}

impl Default for GradScaler {
    fn default() -> Self {
        Self { scale: 65536.0, growth_factor: 2.0, backoff_factor: 0.5, growth_interval: 2000, growth_tracker: 0 }
    }
}

impl GradScaler {
    /// Records the outcome of one step (`found_inf`: some rank's gradients held inf/NaN, so
    /// the step was skipped) and updates the scale, as `GradScaler.update()`.
    pub fn update(&mut self, found_inf: bool) {
        if found_inf {
            self.scale *= self.backoff_factor;
            self.growth_tracker = 0;
        } else {
            self.growth_tracker += 1;
            if self.growth_tracker == self.growth_interval {
                self.scale *= self.growth_factor;
                self.growth_tracker = 0;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backs_off_on_overflow_and_grows_after_the_interval() {
        let mut s = GradScaler { growth_interval: 3, ..Default::default() };
        s.update(true);
        assert_eq!((s.scale, s.growth_tracker), (32768.0, 0));
        s.update(false);
        s.update(false);
        assert_eq!((s.scale, s.growth_tracker), (32768.0, 2));
        s.update(false);
        assert_eq!((s.scale, s.growth_tracker), (65536.0, 0));
        s.update(false);
        s.update(true);
        assert_eq!((s.scale, s.growth_tracker), (32768.0, 0));
    }
}
