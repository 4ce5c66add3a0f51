include!("build_support.rs");

fn main() {
    link_libtorch();
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
