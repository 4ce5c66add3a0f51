//! `optim_shim.cpp`: AdamW's step through libtorch's fused kernel (see [`crate::optim`]).

use std::ffi::{c_char, c_int, c_void};
use tch::Tensor;

extern "C" {
    /// `at::_fused_adamw_` over `n` parameters (no AMSGrad, no maximize), under no_grad: updates
    /// `params`, `exp_avgs` and `exp_avg_sqs` in place; `steps` are 0-d f32 tensors holding
    /// each parameter's step count after this step. Returns 0, or 1 with libtorch's message in
    /// `err`.
    ///
    /// # Safety
    /// The five arrays hold `n` live tensor handles each; `err` points to `errlen` writable
    /// bytes.
    #[allow(clippy::too_many_arguments)]
    fn ladder_fused_adamw(
        params: *const *const c_void,
        grads: *const *const c_void,
        exp_avgs: *const *const c_void,
        exp_avg_sqs: *const *const c_void,
        steps: *const *const c_void,
        n: usize,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
        err: *mut c_char,
        errlen: usize,
    ) -> c_int;
}

/// The tensors of one fused AdamW call, one entry per parameter (every slice as long as
/// `params`).
#[derive(Debug)]
pub(crate) struct FusedAdamW<'a> {
    /// The parameters, updated in place.
    pub params: &'a [&'a Tensor],
    /// Their gradients.
    pub grads: &'a [&'a Tensor],
    /// First moments, updated in place.
    pub exp_avgs: &'a [&'a Tensor],
    /// Second moments, updated in place.
    pub exp_avg_sqs: &'a [&'a Tensor],
    /// 0-d f32 step counts, after this step.
    pub steps: &'a [&'a Tensor],
}

/// One `at::_fused_adamw_` call with the hyper-parameters of `config`; libtorch's message on
/// failure (a gradient that does not match its parameter).
pub(crate) fn fused_adamw(t: &FusedAdamW<'_>, config: &crate::optim::AdamWConfig) -> Result<(), String> {
    let n = t.params.len();
    assert!([t.grads, t.exp_avgs, t.exp_avg_sqs, t.steps].iter().all(|s| s.len() == n), "one entry per parameter");
    let (p, g, m, v, s) = (
        super::handles(t.params),
        super::handles(t.grads),
        super::handles(t.exp_avgs),
        super::handles(t.exp_avg_sqs),
        super::handles(t.steps),
    );
    let c = config;
    // SAFETY: every pointer is the handle of a tensor borrowed for the call; the five arrays
    // hold `n` entries each; the shim writes at most `len` bytes, NUL included, into `err`.
    super::call(|err, len| unsafe {
        ladder_fused_adamw(
            p.as_ptr(),
            g.as_ptr(),
            m.as_ptr(),
            v.as_ptr(),
            s.as_ptr(),
            n,
            c.lr,
            c.beta1,
            c.beta2,
            c.weight_decay,
            c.eps,
            err,
            len,
        )
    })
}
