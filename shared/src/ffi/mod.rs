//! Every `extern "C"` block of the crate and the C/C++ shims behind them, each module with its
//! `# Safety`: the rest of the crate calls the safe wrappers here.

#[cfg(feature = "mpi")]
pub(crate) mod mpi;
