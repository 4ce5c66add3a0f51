//! Every `extern "C"` block of `ladder-core`, beside the C/C++ shims they declare: small functions
//! compiled against the headers of the libtorch tch links (`build.rs`), for what tch has no binding
//! for, and [`mpi`]'s `MPI_IN_PLACE` (`mpi_shim.c`, compiled against Open MPI's headers).
//!
//! | shim | declared in | what for | safe wrapper |
//! |---|---|---|---|
//! | `autograd_shim.cpp` | [`autograd`] | backward from a tensor with a given gradient; `t.grad = g` | [`crate::autograd`] |
//! | `optim_shim.cpp` | [`optim`] | AdamW's step through `at::_fused_adamw_` | [`crate::optim::AdamW`] |
//! | `model_shim.cpp` | [`model`] | dropout's noise and a 2×2 max-pool on CPU | [`crate::model::dropout`], [`crate::model::max_pool2d_2x2`] |
//! | `memory_shim.cpp` | [`memory`] | the CUDA caching allocator's statistics | [`crate::memory::cuda_allocator_bytes`] |
//! | `storage_shim.cpp` | [`storage`] | freeing and refilling a storage in place (FSDP) | `parallel::fsdp::storage` |
//! | `mpi_shim.c` | [`mpi`] | the address of `MPI_IN_PLACE` (a macro in `mpi.h`) | `dist::mpi` |
//! | — (libnccl, opened at run time) | `nccl` (cargo feature `nccl`) | NCCL's entry points, looked up in the libnccl.so.2 libtorch loaded | `dist::nccl` |
//!
//! Every shim has one C boundary (`shim.h`'s `guarded`): it returns 0, or 1 with a C++
//! exception's message in a caller's buffer, so that nothing unwinds into Rust; [`call`] turns
//! that into a `Result`. A tensor crosses as tch's handle, a pointer to libtorch's `at::Tensor`
//! (`Tensor::as_ptr`).
//!
//! # Safety
//!
//! What every declaration here asks of its caller: each tensor pointer is the handle of a tensor
//! alive for the whole call (a `&Tensor` held across it); arrays hold as many entries as the
//! count passed with them; `err` points to `errlen` writable bytes. The safe functions of
//! [`autograd`], [`optim`] and [`model`] keep these rules themselves (they take `&Tensor`s and
//! slices); [`storage::resize_bytes`] stays `unsafe`, since a storage freed under live views is
//! sound only while FSDP keeps those views unread (see its `# Safety`).

pub(crate) mod autograd;
pub(crate) mod memory;
pub(crate) mod model;
#[cfg(feature = "mpi")]
pub(crate) mod mpi;
#[cfg(feature = "nccl")]
pub(crate) mod nccl;
pub(crate) mod optim;
pub(crate) mod storage;

use std::ffi::{c_char, c_int, c_void};

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

/// The handles of `tensors`, in order (`at::Tensor *` as the shims take them).
fn handles(tensors: &[&tch::Tensor]) -> Vec<*const c_void> {
    tensors.iter().map(|t| t.as_ptr().cast()).collect()
}
