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

/// Runs `f` on the bytes of `t`, a contiguous CPU tensor (`numel × element size` bytes, native
/// byte order): how the offloaded optimizer fills its buffer from the moments' file and writes
/// it back without a copy (tch only copies out of or into fresh tensors).
///
/// # Panics
/// When `t` is not a contiguous CPU tensor.
pub(crate) fn with_bytes_mut<R>(t: &mut Tensor, f: impl FnOnce(&mut [u8]) -> R) -> R {
    assert!(t.device() == tch::Device::Cpu && t.is_contiguous(), "a contiguous CPU tensor");
    let len = t.numel() * t.kind().elt_size_in_bytes();
    if len == 0 {
        return f(&mut []);
    }
    // SAFETY: a contiguous CPU tensor's `numel × element size` bytes start at its data pointer
    // and belong to its storage, which `t` keeps alive; the `&mut Tensor` borrow keeps every
    // other use of `t` out for the closure's duration (the caller holds no other view it reads
    // meanwhile: the offloaded optimizer's buffers are its own).
    let bytes = unsafe { std::slice::from_raw_parts_mut(t.data_ptr().cast::<u8>(), len) };
    f(bytes)
}
