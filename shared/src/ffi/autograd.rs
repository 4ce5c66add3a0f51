//! `autograd_shim.cpp`: backward from a tensor with a given gradient, and setting a tensor's
//! `.grad` (see [`crate::autograd`]).

use std::ffi::{c_char, c_int, c_void};
use tch::Tensor;

extern "C" {
    /// `torch.autograd.backward([*y], [*g])`: accumulates into the `.grad` of the leaves `y`
    /// depends on, then frees the graph. Returns 0, or 1 with libtorch's message in `err`.
    ///
    /// # Safety
    /// `y` and `g` are live tensor handles; `err` points to `errlen` writable bytes.
    fn ladder_backward_with_grad(y: *const c_void, g: *const c_void, err: *mut c_char, errlen: usize) -> c_int;

    /// `torch.autograd.grad([*y], inputs, [*g], allow_unused=True)`: assigns the gradient of
    /// `inputs[i]` to the tensor of handle `results[i]`; frees the graph. Returns 0, or 1 with
    /// libtorch's message in `err`.
    ///
    /// # Safety
    /// `y`, `g` and the `n` entries of `inputs` and `results` are live tensor handles (the shim
    /// assigns each result's tensor; tch keeps owning the handles); `err` points to `errlen`
    /// writable bytes.
    fn ladder_autograd_grad(
        y: *const c_void,
        g: *const c_void,
        inputs: *const *const c_void,
        n: usize,
        results: *const *mut c_void,
        err: *mut c_char,
        errlen: usize,
    ) -> c_int;

    /// `t.grad = g`: `g` itself (not a copy) becomes `t`'s gradient, after the checks of
    /// Python's setter (same shape, dtype and device). Returns 0, or 1 with the message in `err`.
    ///
    /// # Safety
    /// `t` and `g` are live tensor handles; `err` points to `errlen` writable bytes.
    fn ladder_set_grad(t: *const c_void, g: *const c_void, err: *mut c_char, errlen: usize) -> c_int;
}

/// `y.backward(g)` through the shim; libtorch's message on failure.
pub(crate) fn backward_with_grad(y: &Tensor, g: &Tensor) -> Result<(), String> {
    // SAFETY: live tensor handles (borrowed for the call); the shim only reads them and writes
    // at most `len` bytes into `err`.
    super::call(|err, len| unsafe { ladder_backward_with_grad(y.as_ptr().cast(), g.as_ptr().cast(), err, len) })
}

/// `torch.autograd.grad([y], inputs, [g])` through the shim, each gradient assigned to the
/// tensor of the same index in `results` (`results.len() == inputs.len()`); libtorch's message
/// on failure.
pub(crate) fn grad(y: &Tensor, g: &Tensor, inputs: &[Tensor], results: &mut [Tensor]) -> Result<(), String> {
    assert_eq!(inputs.len(), results.len(), "one result per input");
    let ins: Vec<*const c_void> = inputs.iter().map(|t| t.as_ptr().cast()).collect();
    let outs: Vec<*mut c_void> = results.iter_mut().map(|t| t.as_mut_ptr().cast()).collect();
    // SAFETY: live tensor handles (borrowed, `results` mutably, for the call), `ins.len()`
    // entries in both arrays; the shim assigns each result handle's tensor and writes at most
    // `len` bytes into `err`.
    super::call(|err, len| unsafe {
        ladder_autograd_grad(y.as_ptr().cast(), g.as_ptr().cast(), ins.as_ptr(), ins.len(), outs.as_ptr(), err, len)
    })
}

/// `t.grad = g` through the shim; libtorch's message on failure.
pub(crate) fn set_grad(t: &Tensor, g: &Tensor) -> Result<(), String> {
    // SAFETY: live tensor handles (borrowed for the call); the shim replaces the gradient slot
    // of `t`'s TensorImpl (shared by every handle of it, which tch allows through `&`, as its
    // own `zero_grad`) and writes at most `len` bytes into `err`.
    super::call(|err, len| unsafe { ladder_set_grad(t.as_ptr().cast(), g.as_ptr().cast(), err, len) })
}
