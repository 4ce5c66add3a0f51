// Shared by the build scripts of every crate with binaries or tests (`include!`d): embeds an
// rpath to the libtorch that tch links (the torch==2.13.0 wheel set up by scripts/bootstrap.sh)
// and to the NCCL in the same wheel, so binaries run without LD_LIBRARY_PATH. libtorch_cuda is
// not linked: `ladder_core::device` dlopens it when CUDA is asked about (`load_torch_cuda` in src/sys.rs), so that
// CPU-only binaries do not load the CUDA libraries.
fn link_libtorch() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    let Ok(dir) = std::env::var("LIBTORCH") else { return };
    let dir = std::path::Path::new(&dir);
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.join("lib").display());
    if let Ok(nccl) = dir.join("..").join("nvidia").join("nccl").join("lib").canonicalize() {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", nccl.display());
    }
}
