//! `storage_shim.cpp`: freeing and refilling a tensor's storage in place — FSDP's gathered
//! `FlatParameter` (see `parallel::fsdp::storage`).

use std::ffi::{c_char, c_int, c_void};
use tch::Tensor;

extern "C" {
    /// Sets the byte size of the tensor's storage (0 frees its memory; the storage and every
    /// view of it stay). Returns 0, or 1 with libtorch's message in `err`.
    ///
    /// # Safety
    /// `t` is a live tensor handle; `err` points to `errlen` writable bytes; and see
    /// [`resize_bytes`].
    fn ladder_storage_resize_bytes(t: *const c_void, nbytes: usize, err: *mut c_char, errlen: usize) -> c_int;
}

/// Sets the byte size of `t`'s storage to `nbytes` (0 frees its memory, as PyTorch's
/// `untyped_storage().resize_(0)`); libtorch's message on failure (a storage libtorch did not
/// allocate).
///
/// # Safety
/// After a resize to 0, every view of the storage — `t`, the tensors autograd saved from it,
/// any the caller made — points to freed memory: none may be read until a resize back to its
/// size refills it. `parallel::fsdp::storage` keeps that rule (its module's `# Safety`).
pub(crate) unsafe fn resize_bytes(t: &Tensor, nbytes: usize) -> Result<(), String> {
    // SAFETY: `t` is a live tensor handle borrowed for the call; the shim only touches that
    // tensor's StorageImpl and writes at most `len` bytes (NUL included) into `err`. The views'
    // rule is the caller's (above).
    super::call(|err, len| unsafe { ladder_storage_resize_bytes(t.as_ptr().cast(), nbytes, err, len) })
}
