//! `model_shim.cpp`: two CPU kernels of BasicNet (see [`crate::model::dropout`] and
//! [`crate::model::max_pool2d_2x2`]) and the channels-last conversion ([`crate::model::channels_last`]).

use std::ffi::{c_char, c_int, c_void};
use tch::Tensor;

extern "C" {
    /// Fills a contiguous CPU tensor with dropout's noise (0 or 1/(1 − p)); the shim checks
    /// the tensor's device, layout and dtype and `p` in (0, 1). Returns 0, or 1 with the
    /// message in `err`.
    ///
    /// # Safety
    /// `noise` is a live tensor handle; `err` points to `errlen` writable bytes.
    fn ladder_dropout_noise(noise: *mut c_void, p: f64, err: *mut c_char, errlen: usize) -> c_int;

    /// Differentiable `max_pool2d(x, 2)` of an NCHW CPU tensor, assigned to the tensor of
    /// handle `out`; the shim checks `x`'s shape. Returns 0, or 1 with the message in `err`.
    ///
    /// # Safety
    /// `x` and `out` are live tensor handles; `err` points to `errlen` writable bytes.
    fn ladder_max_pool_2x2(x: *const c_void, out: *mut c_void, err: *mut c_char, errlen: usize) -> c_int;

    /// `x` in channels-last memory order (itself, or a differentiable clone), assigned to the
    /// tensor of handle `out`; the shim checks that `x` is 4-d. Returns 0, or 1 with the
    /// message in `err`.
    ///
    /// # Safety
    /// `x` and `out` are live tensor handles; `err` points to `errlen` writable bytes.
    fn ladder_channels_last(x: *const c_void, out: *mut c_void, err: *mut c_char, errlen: usize) -> c_int;

    /// Stores the state of a device's default generator (`device_type` 0: CPU, 1: CUDA
    /// `device_index`) into the tensor of handle `out`. Returns 0, or 1 with the message in `err`.
    ///
    /// # Safety
    /// `out` is a live tensor handle; `err` points to `errlen` writable bytes.
    fn ladder_rng_get_state(device_type: c_int, device_index: c_int, out: *mut c_void, err: *mut c_char, errlen: usize) -> c_int;

    /// Sets a device's default generator to `state` (what `ladder_rng_get_state` stored); the
    /// generator checks its size. Returns 0, or 1 with the message in `err`.
    ///
    /// # Safety
    /// `state` is a live tensor handle; `err` points to `errlen` writable bytes.
    fn ladder_rng_set_state(device_type: c_int, device_index: c_int, state: *const c_void, err: *mut c_char, errlen: usize) -> c_int;
}

/// `(device_type, device_index)` as the RNG shims take them: CPU, or a CUDA device.
fn rng_device(device: tch::Device) -> Result<(c_int, c_int), String> {
    match device {
        tch::Device::Cpu => Ok((0, 0)),
        tch::Device::Cuda(i) => Ok((1, c_int::try_from(i).map_err(|_| format!("CUDA device index {i} out of range"))?)),
        other => Err(format!("no generator state for device {other:?} (cpu and cuda only)")),
    }
}

/// The state of `device`'s default generator (`torch.get_rng_state()`, a uint8 CPU tensor).
pub(crate) fn rng_get_state(device: tch::Device) -> Result<Tensor, String> {
    let (kind, index) = rng_device(device)?;
    let mut out = Tensor::empty([0], (tch::Kind::Uint8, tch::Device::Cpu));
    // SAFETY: `out` is a live tensor handle borrowed mutably for the call; the shim replaces
    // its tensor by assignment (tch keeps owning the handle).
    super::call(|err, len| unsafe { ladder_rng_get_state(kind, index, out.as_mut_ptr().cast(), err, len) })?;
    Ok(out)
}

/// Sets `device`'s default generator to `state` (from [`rng_get_state`] of the same device).
pub(crate) fn rng_set_state(device: tch::Device, state: &Tensor) -> Result<(), String> {
    let (kind, index) = rng_device(device)?;
    // SAFETY: `state` is a live tensor handle borrowed for the call; the shim only reads it.
    super::call(|err, len| unsafe { ladder_rng_set_state(kind, index, state.as_ptr().cast(), err, len) })
}

/// Fills `noise` with dropout's noise for probability `p`; the shim's message on failure.
pub(crate) fn dropout_noise(noise: &mut Tensor, p: f64) -> Result<(), String> {
    // SAFETY: `noise` is a live tensor handle, borrowed mutably for the call; the shim checks
    // it is contiguous, on the CPU and of a floating dtype before writing its elements.
    super::call(|err, len| unsafe { ladder_dropout_noise(noise.as_mut_ptr().cast(), p, err, len) })
}

/// `max_pool2d(x, 2)` into `out` (its tensor replaced); the shim's message on failure.
pub(crate) fn max_pool_2x2(x: &Tensor, out: &mut Tensor) -> Result<(), String> {
    // SAFETY: both are live tensor handles borrowed for the call; the shim checks x's layout and
    // replaces `out`'s tensor by assignment (tch keeps owning the handle).
    super::call(|err, len| unsafe { ladder_max_pool_2x2(x.as_ptr().cast(), out.as_mut_ptr().cast(), err, len) })
}

/// `x` in channels-last memory order into `out` (its tensor replaced); the shim's message on failure.
pub(crate) fn channels_last(x: &Tensor, out: &mut Tensor) -> Result<(), String> {
    // SAFETY: both are live tensor handles borrowed for the call; the shim only reads `x` and
    // replaces `out`'s tensor by assignment (tch keeps owning the handle).
    super::call(|err, len| unsafe { ladder_channels_last(x.as_ptr().cast(), out.as_mut_ptr().cast(), err, len) })
}
