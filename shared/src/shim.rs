//! The Rust side of `shim.h`: calls a libtorch shim function with an error buffer and turns
//! its return code into the shim's message.

use std::ffi::{c_char, c_int};

/// Calls `f(err, errlen)` — a shim entry point returning 0, or 1 with a NUL-terminated message
/// in `err` — and returns that message on failure.
pub(crate) fn call(f: impl FnOnce(*mut c_char, usize) -> c_int) -> Result<(), String> {
    let mut err = [0 as c_char; 1024];
    if f(err.as_mut_ptr(), err.len()) == 0 {
        return Ok(());
    }
    // SAFETY: the shims NUL-terminate `err` whenever they return non-zero (shim.h's `guarded`).
    Err(unsafe { std::ffi::CStr::from_ptr(err.as_ptr()) }.to_string_lossy().into_owned())
}
