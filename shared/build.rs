//! Embeds an rpath to the libtorch that tch links (the torch==2.13.0 wheel set up by
//! scripts/bootstrap.sh), so binaries and tests run without LD_LIBRARY_PATH, and keeps
//! libtorch_cuda linked even though no symbol of it is referenced directly (`--no-as-needed`),
//! so that `tch::Cuda::is_available()` turns true on a GPU machine.
fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    if let Ok(dir) = std::env::var("LIBTORCH") {
        let dir = std::path::Path::new(&dir);
        let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.join("lib").display());
        // NCCL ships in the same wheel (nvidia/nccl/lib); cudarc dlopens it by name.
        let nccl = dir.join("..").join("nvidia").join("nccl").join("lib");
        if let Ok(nccl) = nccl.canonicalize() {
            println!("cargo:rustc-link-arg=-Wl,-rpath,{}", nccl.display());
        }
        if dir.join("lib").join("libtorch_cuda.so").exists() {
            println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
            println!("cargo:rustc-link-arg=-ltorch_cuda");
        }
    }
    // MPI_IN_PLACE, read from the MPI implementation's own header (see src/dist/mpi_shim.c).
    #[cfg(feature = "mpi")]
    {
        println!("cargo:rerun-if-changed=src/dist/mpi_shim.c");
        cc::Build::new().compiler("mpicc").file("src/dist/mpi_shim.c").compile("ladder_mpi_shim");
    }
    // The workspace's data directory, the last fallback for the MNIST files.
    let manifest = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_default();
    let data = std::path::Path::new(&manifest).join("..").join("data").join("mnist");
    println!("cargo:rustc-env=LADDER_WORKSPACE_MNIST={}", data.display());
}
