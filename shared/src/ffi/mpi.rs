//! The one value of the MPI implementation that bindgen cannot see: `MPI_IN_PLACE`, a macro
//! whose value each implementation chooses (Open MPI: `(void *) 1`), read by `mpi_shim.c` from
//! the implementation's own `mpi.h` (compiled with `mpicc` by `build.rs`).
//!
//! # Safety
//!
//! The shim takes no argument and returns a constant; [`in_place`] is safe to call. The value
//! it returns is a sentinel, never dereferenced by us: it is only passed as the send buffer of
//! an MPI collective, which then reads its input from the receive buffer. rsmpi's raw bindings
//! (`mpi::ffi`) are called in [`crate::dist::mpi`], each call with its own `SAFETY` comment.

use std::ffi::c_void;

extern "C" {
    /// `mpi_shim.c`: returns `MPI_IN_PLACE`.
    fn ladder_mpi_in_place() -> *mut c_void;
}

/// `MPI_IN_PLACE` of the MPI implementation this crate links: the send buffer that makes a
/// collective take its input from, and write its result to, the receive buffer.
#[inline]
pub(crate) fn in_place() -> *mut c_void {
    // SAFETY: the shim has no argument and no side effect; it returns a constant.
    unsafe { ladder_mpi_in_place() }
}
