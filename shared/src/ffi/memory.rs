//! `memory_shim.cpp`: the CUDA caching allocator's statistics (see
//! [`crate::memory::cuda_allocator_bytes`]).

use std::ffi::{c_char, c_int};

extern "C" {
    /// Writes CUDA device `device`'s caching-allocator bytes, aggregate pool, into `out[0..4]`:
    /// allocated (current, peak), reserved (current, peak). Returns 0, or 1 with the message in
    /// `err` (no CUDA allocator registered: libtorch_cuda not loaded).
    ///
    /// # Safety
    /// `out` points to 4 writable `i64`; `err` points to `errlen` writable bytes.
    fn ladder_cuda_memory_stats(device: c_int, out: *mut i64, err: *mut c_char, errlen: usize) -> c_int;

    /// Resets CUDA device `device`'s allocator peaks to their current values. Returns 0, or 1
    /// with the message in `err`.
    ///
    /// # Safety
    /// `err` points to `errlen` writable bytes.
    fn ladder_cuda_reset_peak_memory_stats(device: c_int, err: *mut c_char, errlen: usize) -> c_int;
}

/// `[allocated, peak allocated, reserved, peak reserved]` bytes of CUDA device `device`.
pub(crate) fn cuda_memory_stats(device: usize) -> Result<[i64; 4], String> {
    let mut out = [0i64; 4];
    // SAFETY: `out` holds 4 i64; `call` passes a buffer of `errlen` bytes.
    super::call(|err, len| unsafe { ladder_cuda_memory_stats(device as c_int, out.as_mut_ptr(), err, len) })?;
    Ok(out)
}

/// Resets CUDA device `device`'s allocator peaks.
pub(crate) fn cuda_reset_peak_memory_stats(device: usize) -> Result<(), String> {
    // SAFETY: `call` passes a buffer of `errlen` bytes.
    super::call(|err, len| unsafe { ladder_cuda_reset_peak_memory_stats(device as c_int, err, len) })
}
