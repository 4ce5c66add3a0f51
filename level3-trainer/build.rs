//! Build script of `level3-trainer`: embeds an rpath to the libtorch that tch links (and to the NCCL of
//! the same wheel), so that its binaries and tests run without `LD_LIBRARY_PATH`
//! (`shared/build_support.rs`).

include!("../shared/build_support.rs");

fn main() {
    link_libtorch();
}
