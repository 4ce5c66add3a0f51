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
/// step (optim_shim.cpp, see src/optim.rs), CPU kernels of the model (model_shim.cpp:
/// dropout's noise, a 2×2 max-pool and a channels-last clone, see src/model.rs), backward
/// with a given gradient (autograd_shim.cpp, see src/autograd.rs) and the CUDA caching
/// allocator's statistics (memory_shim.cpp, see src/memory/mod.rs). Compiled against the headers
/// of the libtorch that tch links (`LIBTORCH`, set by .cargo/config.toml), with its C++ ABI
/// (`LIBTORCH_CXX11_ABI`, default 1, as torch-sys) and with OpenMP, linked to libtorch's own
/// runtime.
fn libtorch_shims() {
    const SHIMS: [&str; 5] = [
        "src/ffi/storage_shim.cpp",
        "src/ffi/optim_shim.cpp",
        "src/ffi/model_shim.cpp",
        "src/ffi/autograd_shim.cpp",
        "src/ffi/memory_shim.cpp",
    ];
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
        // OpenMP, as libtorch is built: `at::parallel_for` in a header compiled without it
        // (no `_OPENMP`) runs its whole range on the calling thread, so the shims' kernels
        // (max-pool, dropout's noise) ran on one core whatever `torch.set_num_threads` said.
        .flag("-fopenmp")
        .files(SHIMS)
        .compile("ladder_libtorch_shims");
    link_libtorch_openmp(std::path::Path::new(&libtorch));
}

/// Links the OpenMP runtime that libtorch itself loads (the pip wheel's `torch/lib/libgomp.so.1`,
/// or a libtorch archive's `libgomp-<hash>.so.1`) by its file name, so that the process has one
/// OpenMP runtime and one thread pool, the one `at::set_num_threads` sizes. Without one in
/// `LIBTORCH/lib` (libtorch linked to the system's), the compiler's `libgomp`.
fn link_libtorch_openmp(libtorch: &std::path::Path) {
    let lib = libtorch.join("lib");
    let bundled = std::fs::read_dir(&lib).ok().and_then(|entries| {
        let mut names: Vec<String> = entries
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.starts_with("libgomp") && n.contains(".so"))
            .collect();
        names.sort();
        names.into_iter().next()
    });
    match bundled {
        Some(name) => {
            println!("cargo:rustc-link-search=native={}", lib.display());
            println!("cargo:rustc-link-lib=dylib:+verbatim={name}");
        }
        None => println!("cargo:rustc-link-lib=dylib=gomp"),
    }
}
