// Shared by the build scripts of every crate with binaries or tests (`include!`d): embeds an
// rpath to the libtorch that tch links (the torch==2.13.0 wheel set up by scripts/bootstrap.sh)
// and to the NCCL in the same wheel, so binaries run without LD_LIBRARY_PATH; and keeps
// libtorch_cuda linked although no symbol of it is referenced directly (`--no-as-needed`), so
// that `tch::Cuda::is_available()` turns true on a GPU machine.
fn link_libtorch() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    let Ok(dir) = std::env::var("LIBTORCH") else { return };
    let dir = std::path::Path::new(&dir);
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.join("lib").display());
    if let Ok(nccl) = dir.join("..").join("nvidia").join("nccl").join("lib").canonicalize() {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", nccl.display());
    }
    if dir.join("lib").join("libtorch_cuda.so").exists() {
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-arg=-ltorch_cuda");
    }
}
