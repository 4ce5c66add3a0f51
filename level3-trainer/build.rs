//! Build script of level3-trainer: embeds an rpath to the libtorch that tch links (see
//! shared/build_support.rs), so the binary and the tests run without LD_LIBRARY_PATH.

include!("../shared/build_support.rs");

fn main() {
    link_libtorch();
}
