//! Build script of `ladder-core`: embeds an rpath to the libtorch that tch links
//! (`build_support.rs`), compiles the C++ shims of `src/ffi/` against its headers and the MPI
//! shim of `src/ffi/` with `mpicc`, and records the workspace's MNIST directory
//! (`LADDER_WORKSPACE_MNIST`), the data's last fallback.

include!("build_support.rs");

fn main() {
    link_libtorch();
    libtorch_shims();
    // MPI_IN_PLACE, read from the MPI implementation's own header (see src/ffi/mpi_shim.c).
    #[cfg(feature = "mpi")]
    {
        println!("cargo:rerun-if-changed=src/ffi/mpi_shim.c");
        cc::Build::new().compiler("mpicc").file("src/ffi/mpi_shim.c").compile("ladder_mpi_shim");
    }
    // The workspace's data directory, the last fallback for the MNIST files.
    let manifest = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_default();
    let data = std::path::Path::new(&manifest).join("..").join("data").join("mnist");
    println!("cargo:rustc-env=LADDER_WORKSPACE_MNIST={}", data.display());
}

/// The C++ shims over libtorch for what tch has no binding for, all in src/ffi/ beside the Rust
/// declarations of their entry points (src/ffi/*.rs): FSDP's storage shim (storage_shim.cpp:
/// frees and re-allocates a storage in place, see src/parallel/fsdp/storage.rs), AdamW's fused
/// step (optim_shim.cpp, see src/optim.rs), two CPU kernels of the model (model_shim.cpp:
/// dropout's noise and a 2×2 max-pool, see src/model.rs) and backward with a given gradient
/// (autograd_shim.cpp, see src/autograd.rs). Compiled against the headers of the libtorch that
/// tch links (`LIBTORCH`, set by .cargo/config.toml), with its C++ ABI (`LIBTORCH_CXX11_ABI`,
/// default 1, as torch-sys).
fn libtorch_shims() {
    const SHIMS: [&str; 4] = ["src/ffi/storage_shim.cpp", "src/ffi/optim_shim.cpp", "src/ffi/model_shim.cpp", "src/ffi/autograd_shim.cpp"];
    for file in SHIMS.iter().chain(&["src/ffi/shim.h"]) {
        println!("cargo:rerun-if-changed={file}");
    }
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    let libtorch =
        std::env::var("LIBTORCH").expect("LIBTORCH must name the libtorch tch links (scripts/bootstrap.sh and .cargo/config.toml set it)");
    let include = std::path::Path::new(&libtorch).join("include");
    let abi = std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".to_owned());
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .define("_GLIBCXX_USE_CXX11_ABI", abi.as_str())
        .include(&include)
        .warnings(false)
        // The model's kernels rely on the compiler's vectorisation: optimise them in dev and
        // test builds too (workspace members build at -O0 there).
        .opt_level(3)
        .flag_if_supported("-w")
        .files(SHIMS)
        .compile("ladder_libtorch_shims");
}
