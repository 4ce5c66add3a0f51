include!("../shared/build_support.rs");

fn main() {
    link_libtorch();
}
