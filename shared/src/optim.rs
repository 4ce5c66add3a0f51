//! AdamW whose state can be read, saved and restored.
//!
//! tch's `nn::AdamW` wraps libtorch's `torch::optim::AdamW`, whose moments are out of reach from
//! Rust, so a run that used it cannot be checkpointed and resumed exactly. This is the same
//! algorithm, op for op, as libtorch's C++ `AdamW::step` (and `torch.optim.AdamW` with
//! `foreach=False`), over tensors we hold:
//!
//! ```text
//! p      ← p · (1 − lr · weight_decay)                  (decoupled weight decay)
//! m      ← β₁ · m + (1 − β₁) · g
//! v      ← β₂ · v + (1 − β₂) · g²
//! denom  ← √v / √(1 − β₂ᵗ) + ε
//! p      ← p − lr / (1 − β₁ᵗ) · m / denom
//! ```
//!
//! A step on a parameter without a gradient leaves it, and its state, untouched (as libtorch).
//! Its results are bit-identical to `nn::AdamW` (a test checks this), so switching a loop from
//! one to the other changes no weight.

use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

/// AdamW hyper-parameters, with PyTorch's defaults (`torch.optim.AdamW`: lr 1e-3, betas
/// (0.9, 0.999), eps 1e-8, weight_decay 0.01).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AdamWConfig {
    /// Learning rate.
    pub lr: f64,
    /// Coefficient of the running mean of gradients (β₁).
    pub beta1: f64,
    /// Coefficient of the running mean of squared gradients (β₂).
    pub beta2: f64,
    /// Added to the denominator for numerical stability.
    pub eps: f64,
    /// Decoupled weight decay (multiplies `lr`).
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 }
    }
}

impl AdamWConfig {
    /// Checks every value is in range.
    ///
    /// # Errors
    /// [`Error::InvalidValue`] naming the hyper-parameter.
    pub fn validate(&self) -> Result<()> {
        if !(self.lr.is_finite() && self.lr >= 0.0) {
            return Err(Error::invalid("learning_rate", self.lr, "a finite, non-negative learning rate"));
        }
        for (name, b) in [("adam_beta1", self.beta1), ("adam_beta2", self.beta2)] {
            if !(0.0..1.0).contains(&b) {
                return Err(Error::invalid(name, b, "a value in [0, 1)"));
            }
        }
        if !(self.eps.is_finite() && self.eps >= 0.0) {
            return Err(Error::invalid("adam_epsilon", self.eps, "a finite, non-negative epsilon"));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return Err(Error::invalid("weight_decay", self.weight_decay, "a finite, non-negative weight decay"));
        }
        Ok(())
    }
}

/// Per-parameter state, created at the parameter's first step (as libtorch).
#[derive(Debug)]
struct ParamState {
    step: i64,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
}

/// AdamW over a fixed list of parameters (leaf tensors with `requires_grad`), in a fixed order.
#[derive(Debug)]
pub struct AdamW {
    params: Vec<Tensor>,
    state: Vec<Option<ParamState>>,
    config: AdamWConfig,
}

impl AdamW {
    /// AdamW over `params` (e.g. `vs.trainable_variables()`, whose order is the order the
    /// variables were created in).
    ///
    /// # Errors
    /// [`Error::InvalidValue`] for an out-of-range hyper-parameter.
    pub fn new(params: Vec<Tensor>, config: AdamWConfig) -> Result<Self> {
        config.validate()?;
        let state = params.iter().map(|_| None).collect();
        Ok(Self { params, state, config })
    }

    /// The hyper-parameters in use.
    pub fn config(&self) -> &AdamWConfig {
        &self.config
    }

    /// The current learning rate.
    pub fn lr(&self) -> f64 {
        self.config.lr
    }

    /// Sets the learning rate for the next steps (what a scheduler does).
    pub fn set_lr(&mut self, lr: f64) {
        self.config.lr = lr;
    }

    /// The parameters this optimizer updates, in order.
    pub fn params(&self) -> &[Tensor] {
        &self.params
    }

    /// Zeroes every parameter's gradient in place (tch has no way to set a gradient to none;
    /// the next backward accumulates into the zeros, which gives the same values).
    pub fn zero_grad(&mut self) {
        for p in &mut self.params {
            p.zero_grad();
        }
    }

    /// One AdamW update of every parameter that has a gradient.
    // ANCHOR: adamw_step
    pub fn step(&mut self) {
        let c = self.config;
        tch::no_grad(|| {
            for (p, state) in self.params.iter_mut().zip(self.state.iter_mut()) {
                let grad = p.grad();
                if !grad.defined() {
                    continue;
                }
                if c.weight_decay != 0.0 {
                    let _ = p.g_mul_scalar_(1.0 - c.lr * c.weight_decay);
                }
                let s = state.get_or_insert_with(|| ParamState {
                    step: 0,
                    exp_avg: p.zeros_like(),
                    exp_avg_sq: p.zeros_like(),
                });
                s.step += 1;
                let bias_correction1 = 1.0 - c.beta1.powi(s.step as i32);
                let bias_correction2 = 1.0 - c.beta2.powi(s.step as i32);
                // libtorch: exp_avg.mul_(β₁).add_(grad, 1 − β₁), whose add is a fused
                // multiply-add (one rounding). tch's add has no alpha, so the sum is formed in
                // f64 — the product of two f32 is exact there — and rounded once to the
                // parameter's dtype.
                let _ = s.exp_avg.g_mul_scalar_(c.beta1);
                let alpha = f64::from((1.0 - c.beta1) as f32);
                let fused = s.exp_avg.to_kind(Kind::Double) + grad.to_kind(Kind::Double) * alpha;
                let _ = s.exp_avg.copy_(&fused);
                let _ = s.exp_avg_sq.g_mul_scalar_(c.beta2).addcmul_(&grad, &(&grad * (1.0 - c.beta2)));
                let denom = (s.exp_avg_sq.sqrt() / bias_correction2.sqrt()).g_add_scalar_(c.eps);
                let step_size = c.lr / bias_correction1;
                let _ = p.addcdiv_(&(&s.exp_avg * -step_size), &denom);
            }
        });
    }
    // ANCHOR_END: adamw_step

    /// Number of steps taken (the largest per-parameter step count; 0 before the first step).
    pub fn step_count(&self) -> i64 {
        self.state.iter().flatten().map(|s| s.step).max().unwrap_or(0)
    }

    /// The state as named tensors: for parameter `names[i]`, `{name}.exp_avg`,
    /// `{name}.exp_avg_sq` (the parameter's shape and dtype) and `{name}.step` (a 0-d i64), for
    /// every parameter that has taken a step. Copies.
    ///
    /// # Panics
    /// Never; `names` shorter than the parameter list simply names fewer entries.
    pub fn state_dict(&self, names: &[String]) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        for (name, s) in names.iter().zip(&self.state) {
            if let Some(s) = s {
                out.push((format!("{name}.exp_avg"), s.exp_avg.copy()));
                out.push((format!("{name}.exp_avg_sq"), s.exp_avg_sq.copy()));
                out.push((format!("{name}.step"), Tensor::from(s.step)));
            }
        }
        out
    }

    /// Loads what [`state_dict`](Self::state_dict) returned (same names, same parameter shapes).
    /// A parameter with no entries gets no state (it has not stepped yet).
    ///
    /// # Errors
    /// [`Error::StateDict`] naming an unexpected key, a parameter with only part of its state, or
    /// a shape that differs from the parameter's.
    pub fn load_state_dict(&mut self, names: &[String], state_dict: &[(String, Tensor)]) -> Result<()> {
        let map: std::collections::BTreeMap<&str, &Tensor> = state_dict.iter().map(|(k, t)| (k.as_str(), t)).collect();
        let known: std::collections::BTreeSet<String> =
            names.iter().flat_map(|n| ["exp_avg", "exp_avg_sq", "step"].map(|s| format!("{n}.{s}"))).collect();
        let unexpected: Vec<&str> = map.keys().copied().filter(|k| !known.contains(*k)).collect();
        if !unexpected.is_empty() {
            return Err(Error::StateDict(format!("optimizer: unexpected keys {unexpected:?}; expected <parameter>.exp_avg / .exp_avg_sq / .step")));
        }
        let mut new_state = Vec::with_capacity(self.params.len());
        for (name, p) in names.iter().zip(&self.params) {
            let get = |s: &str| map.get(format!("{name}.{s}").as_str()).copied();
            match (get("exp_avg"), get("exp_avg_sq"), get("step")) {
                (None, None, None) => new_state.push(None),
                (Some(m), Some(v), Some(step)) => {
                    for (what, t) in [("exp_avg", m), ("exp_avg_sq", v)] {
                        if t.size() != p.size() {
                            return Err(Error::StateDict(format!("optimizer: {name}.{what} has shape {:?}, expected {:?}", t.size(), p.size())));
                        }
                    }
                    new_state.push(Some(ParamState {
                        step: step.int64_value(&[]),
                        exp_avg: m.to_device(p.device()).to_kind(p.kind()),
                        exp_avg_sq: v.to_device(p.device()).to_kind(p.kind()),
                    }));
                }
                _ => {
                    return Err(Error::StateDict(format!("optimizer: parameter {name} has only part of its state (needs exp_avg, exp_avg_sq and step)")))
                }
            }
        }
        self.state = new_state;
        Ok(())
    }
}
