//! AdamW whose state can be read, saved and restored.
//!
//! tch's `nn::AdamW` wraps libtorch's `torch::optim::AdamW`, whose moments are out of reach from
//! Rust, so a run that used it cannot be checkpointed and resumed exactly. This AdamW holds its
//! moments as tensors we own and steps through libtorch's fused kernel, `at::_fused_adamw_` —
//! what `torch.optim.AdamW(fused=True)` runs, on CPU and CUDA — through a short C++ shim
//! (`ffi/optim_shim.cpp`; tch has no binding for in-place ops over tensor lists). Per element, with
//! `t` the parameter's step count after this step:
//!
//! ```text
//! p      ← p · (1 − lr · weight_decay)                  (decoupled weight decay)
//! m      ← m + (1 − β₁) · (g − m)                       (lerp: β₁ · m + (1 − β₁) · g)
//! v      ← β₂ · v + (1 − β₂) · g²
//! denom  ← √v / √(1 − β₂ᵗ) + ε
//! p      ← p − lr / (1 − β₁ᵗ) · m / denom
//! ```
//!
//! Why fused: the op-by-op form (libtorch's C++ `AdamW::step`, `torch.optim.AdamW` with
//! `foreach=False`) reads and writes each of the 1.2M parameters a dozen times and allocates a
//! fresh temporary for half of those ops; measured on BasicNet at 2 ranks (one core each), the
//! fused step takes a fifth of the time (see the bench's optimizer phase). The fused kernel
//! rounds differently from the op-by-op form (a lerp instead of a multiply-then-add): the two
//! agree to float rounding, not bit for bit, and this AdamW is bit-identical to PyTorch's own
//! `torch.optim.AdamW(fused=True)` (tests/optim.rs checks both).
//!
//! A step on a parameter without a gradient leaves it, and its state, untouched (as PyTorch).
//!
//! With [`AdamW::with_offload`] the two moments live in a file on disk instead of memory
//! (DeepSpeed's `offload_optimizer: {"device": "nvme"}`), streamed through a bounded buffer at
//! each step with the same kernel — bit-identical weights; see [`nvme`].

mod nvme;

pub use nvme::OffloadStats;

use crate::parallel::offload::OptimizerOffload;
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

/// Per-parameter state, created at the parameter's first step (as PyTorch).
#[derive(Debug)]
struct ParamState {
    step: i64,
    /// `step` as the 0-d f32 tensor on the parameter's device that the fused kernel reads
    /// (PyTorch's `state["step"]` for `fused=True`).
    step_t: Tensor,
    /// The moments in memory; undefined tensors when they are in the [`nvme::MomentFile`].
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
}

impl ParamState {
    fn new(step: i64, exp_avg: Tensor, exp_avg_sq: Tensor, device: tch::Device) -> Self {
        let step_t = Tensor::from(step as f32).to_device(device);
        Self { step, step_t, exp_avg, exp_avg_sq }
    }
}

/// AdamW over a fixed list of parameters (leaf tensors with `requires_grad`), in a fixed order.
#[derive(Debug)]
pub struct AdamW {
    params: Vec<Tensor>,
    state: Vec<Option<ParamState>>,
    config: AdamWConfig,
    /// The moments' file when they are offloaded.
    offload: Option<nvme::MomentFile>,
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
        Ok(Self { params, state, config, offload: None })
    }

    /// AdamW over `params` whose moments live where `offload` says: with
    /// [`OptimizerOffload::Nvme`], in a file created for rank `rank` under its `nvme_path`
    /// (`ladder-adamw-rank{rank}-XXXXXX.moments`, removed when the optimizer is dropped),
    /// `2 · Σ numel` elements of the parameters' dtypes, streamed through a buffer of
    /// `buffer_size` elements per moment at each step (see [`nvme`]). The weights are the
    /// in-memory optimizer's, bit for bit. Only the buffer is resident; the operating system's
    /// page cache may still hold the file, which the process's RSS does not count.
    ///
    /// # Errors
    /// [`Error::InvalidValue`] for an out-of-range hyper-parameter; [`Error::Io`] when the file
    /// cannot be created.
    pub fn with_offload(params: Vec<Tensor>, config: AdamWConfig, offload: &OptimizerOffload, rank: usize) -> Result<Self> {
        let mut opt = Self::new(params, config)?;
        if let OptimizerOffload::Nvme(o) = offload {
            opt.offload = Some(nvme::MomentFile::create(&opt.params, o, rank)?);
        }
        Ok(opt)
    }

    /// The moments' file, when offloaded.
    pub fn offload_path(&self) -> Option<std::path::PathBuf> {
        self.offload.as_ref().map(nvme::MomentFile::path)
    }

    /// Elements per moment held in memory while stepping, when offloaded.
    pub fn offload_buffer_size(&self) -> Option<i64> {
        self.offload.as_ref().map(nvme::MomentFile::buffer_size)
    }

    /// `m` (the wrapped model's accounting, [`crate::parallel::WrappedModel::memory`]) with this
    /// optimizer's state placed where it is: unchanged in memory; offloaded, the moments counted
    /// in `optimizer_on_disk` and the buffer in `optimizer`.
    pub fn placed(&self, m: crate::memory::ModelStateBytes) -> crate::memory::ModelStateBytes {
        match &self.offload {
            Some(file) => {
                let kinds: std::collections::BTreeSet<usize> = self.params.iter().map(|p| p.kind().elt_size_in_bytes()).collect();
                let buffer = kinds.iter().map(|&e| crate::memory::offload_buffer_bytes(file.buffer_size() as usize, e as u64)).sum();
                m.with_optimizer_offload(buffer)
            }
            None => m,
        }
    }

    /// When offloaded: the last step's bytes read and written and seconds, and the totals since
    /// creation (`None` in memory).
    pub fn offload_stats(&self) -> Option<(OffloadStats, OffloadStats)> {
        self.offload.as_ref().map(nvme::MomentFile::stats)
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

    /// Parameter `i`'s moments as this optimizer holds them (`exp_avg`, `exp_avg_sq`); `None`
    /// before its first step, or when the moments are on disk.
    pub fn moments(&self, i: usize) -> Option<(&Tensor, &Tensor)> {
        let s = self.state.get(i)?.as_ref()?;
        s.exp_avg.defined().then_some((&s.exp_avg, &s.exp_avg_sq))
    }

    /// Zeroes every parameter's gradient in place (tch has no way to set a gradient to none;
    /// the next backward accumulates into the zeros, which gives the same values).
    pub fn zero_grad(&mut self) {
        for p in &mut self.params {
            p.zero_grad();
        }
    }

    /// One AdamW update of every parameter that has a gradient: one call of libtorch's fused
    /// kernel per (device, dtype) group of parameters, as `torch.optim.AdamW(fused=True)`.
    ///
    /// # Panics
    /// If libtorch refuses the step — a gradient whose shape, dtype or device differs from its
    /// parameter's, which backward never produces. [`try_step`](Self::try_step) returns it.
    pub fn step(&mut self) {
        if let Err(e) = self.try_step() {
            panic!("{e}");
        }
    }

    /// [`step`](Self::step), returning libtorch's refusal instead of panicking.
    ///
    /// # Errors
    /// [`Error::InvalidValue`] with libtorch's message (a gradient that does not match its
    /// parameter).
    // ANCHOR: adamw_step
    pub fn try_step(&mut self) -> Result<()> {
        let c = self.config;
        // The parameters with a gradient, grouped by (device, dtype): one kernel call per group.
        let mut groups: Vec<(tch::Device, Kind, Vec<usize>)> = Vec::new();
        let mut grads = Vec::with_capacity(self.params.len());
        let mut fresh = vec![false; self.params.len()];
        let offloaded = self.offload.is_some();
        for (i, (p, state)) in self.params.iter().zip(self.state.iter_mut()).enumerate() {
            let grad = p.grad();
            if grad.defined() {
                fresh[i] = state.is_none();
                let s = state.get_or_insert_with(|| {
                    let zeros = || if offloaded { Tensor::new() } else { p.zeros_like() };
                    ParamState::new(0, zeros(), zeros(), p.device())
                });
                s.step += 1;
                let _ = s.step_t.fill_(s.step as f64); // the kernel reads the step after this one
                match groups.iter_mut().find(|(d, k, _)| *d == p.device() && *k == p.kind()) {
                    Some(g) => g.2.push(i),
                    None => groups.push((p.device(), p.kind(), vec![i])),
                }
            }
            grads.push(grad);
        }
        if let Some(file) = self.offload.as_mut() {
            let t0 = file.begin_step();
            for (_, _, idx) in &groups {
                for &i in idx {
                    let step_t = &self.state[i].as_ref().expect("created above").step_t;
                    file.step_param(i, &self.params[i], &grads[i], step_t, fresh[i], &c)?;
                }
            }
            file.end_step(t0);
            return Ok(());
        }
        for (_, _, idx) in &groups {
            let states: Vec<&ParamState> = idx.iter().map(|&i| self.state[i].as_ref().expect("created above")).collect();
            let tensors = crate::ffi::optim::FusedAdamW {
                params: &idx.iter().map(|&i| &self.params[i]).collect::<Vec<_>>(),
                grads: &idx.iter().map(|&i| &grads[i]).collect::<Vec<_>>(),
                exp_avgs: &states.iter().map(|s| &s.exp_avg).collect::<Vec<_>>(),
                exp_avg_sqs: &states.iter().map(|s| &s.exp_avg_sq).collect::<Vec<_>>(),
                steps: &states.iter().map(|s| &s.step_t).collect::<Vec<_>>(),
            };
            crate::ffi::optim::fused_adamw(&tensors, &c)
                .map_err(|msg| Error::invalid("optimizer step", "AdamW", format!("gradients libtorch's fused AdamW accepts ({msg})")))?;
        }
        Ok(())
    }
    // ANCHOR_END: adamw_step

    /// Number of steps taken (the largest per-parameter step count; 0 before the first step).
    pub fn step_count(&self) -> i64 {
        self.state.iter().flatten().map(|s| s.step).max().unwrap_or(0)
    }

    /// The state as named tensors: for parameter `names[i]`, `{name}.exp_avg`,
    /// `{name}.exp_avg_sq` (the parameter's shape and dtype) and `{name}.step` (a 0-d i64), for
    /// every parameter that has taken a step. The moments are the live tensors, not copies, as
    /// torch's `Optimizer.state_dict()` (read from the file when offloaded): copy them to keep a
    /// snapshot across steps.
    ///
    /// # Panics
    /// When offloaded and the moments' file cannot be read; [`try_state_dict`](Self::try_state_dict)
    /// returns that error. `names` shorter than the parameter list simply names fewer entries.
    pub fn state_dict(&self, names: &[String]) -> Vec<(String, Tensor)> {
        self.try_state_dict(names).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`state_dict`](Self::state_dict), returning a file error instead of panicking.
    ///
    /// # Errors
    /// [`Error::Io`] naming the moments' file.
    pub fn try_state_dict(&self, names: &[String]) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        for (i, (name, s)) in names.iter().zip(&self.state).enumerate() {
            if let Some(s) = s {
                let (m, v) = match &self.offload {
                    Some(file) => {
                        let shape = self.params[i].size();
                        let (m, v) = file.load(i)?;
                        (m.view(shape.as_slice()), v.view(shape.as_slice()))
                    }
                    None => (s.exp_avg.shallow_clone(), s.exp_avg_sq.shallow_clone()),
                };
                out.push((format!("{name}.exp_avg"), m));
                out.push((format!("{name}.exp_avg_sq"), v));
                out.push((format!("{name}.step"), Tensor::from(s.step)));
            }
        }
        Ok(out)
    }

    /// Loads what [`state_dict`](Self::state_dict) returned (same names, same parameter shapes).
    /// A parameter with no entries gets no state (it has not stepped yet). As torch's, the
    /// moments are kept, not copied, where their dtype and device are the parameter's: a dict
    /// taken from another optimizer's `state_dict()` then shares that optimizer's moments.
    ///
    /// # Errors
    /// [`Error::StateDict`] naming an unexpected key, a parameter with only part of its state, or
    /// a shape that differs from the parameter's; [`Error::Io`] when offloaded and the moments'
    /// file cannot be written (the state is then that of the parameters written so far).
    pub fn load_state_dict(&mut self, names: &[String], state_dict: &[(String, Tensor)]) -> Result<()> {
        let map: std::collections::BTreeMap<&str, &Tensor> = state_dict.iter().map(|(k, t)| (k.as_str(), t)).collect();
        let known: std::collections::BTreeSet<String> =
            names.iter().flat_map(|n| ["exp_avg", "exp_avg_sq", "step"].map(|s| format!("{n}.{s}"))).collect();
        let unexpected: Vec<&str> = map.keys().copied().filter(|k| !known.contains(*k)).collect();
        if !unexpected.is_empty() {
            return Err(Error::StateDict(format!(
                "optimizer: unexpected keys {unexpected:?}; expected <parameter>.exp_avg / .exp_avg_sq / .step"
            )));
        }
        let mut new_state = Vec::with_capacity(self.params.len());
        for (name, p) in names.iter().zip(&self.params) {
            let get = |s: &str| map.get(format!("{name}.{s}").as_str()).copied();
            match (get("exp_avg"), get("exp_avg_sq"), get("step")) {
                (None, None, None) => new_state.push(None),
                (Some(m), Some(v), Some(step)) => {
                    for (what, t) in [("exp_avg", m), ("exp_avg_sq", v)] {
                        if t.size() != p.size() {
                            return Err(Error::StateDict(format!(
                                "optimizer: {name}.{what} has shape {:?}, expected {:?}",
                                t.size(),
                                p.size()
                            )));
                        }
                    }
                    let (m, v) = if self.offload.is_some() {
                        (m.shallow_clone(), v.shallow_clone()) // written to the file below
                    } else {
                        // Kept, not copied, where dtype and device match (torch's `value.to(...)`).
                        (m.to_device(p.device()).to_kind(p.kind()), v.to_device(p.device()).to_kind(p.kind()))
                    };
                    new_state.push(Some(ParamState::new(step.int64_value(&[]), m, v, p.device())));
                }
                _ => {
                    return Err(Error::StateDict(format!(
                        "optimizer: parameter {name} has only part of its state (needs exp_avg, exp_avg_sq and step)"
                    )))
                }
            }
        }
        if let Some(file) = self.offload.as_mut() {
            for (i, s) in new_state.iter_mut().enumerate() {
                if let Some(s) = s {
                    file.store(i, &s.exp_avg, &s.exp_avg_sq)?;
                    (s.exp_avg, s.exp_avg_sq) = (Tensor::new(), Tensor::new());
                }
            }
        }
        self.state = new_state;
        Ok(())
    }
}
