//! Build script of `bench`: links the libtorch of the cached torch venv (see
//! `shared/build_support.rs`).

include!("../shared/build_support.rs");

fn main() {
    link_libtorch();
}
