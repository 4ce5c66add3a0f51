//! `--device cpu|cuda` for every binary: parsing, the default (cuda if available), and the
//! intra-op thread count each rank uses.

use crate::{Error, Result};
use tch::Device;

/// A device as the user names it on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    /// The CPU (libtorch's intra-op thread pool).
    Cpu,
    /// A CUDA GPU; under several ranks, GPU `local_rank`.
    Cuda,
}

impl DeviceKind {
    /// `cuda` when libtorch sees a CUDA device, else `cpu` — PyTorch's usual
    /// `"cuda" if torch.cuda.is_available() else "cpu"`.
    pub fn default_for_machine() -> Self {
        if cuda_available() {
            DeviceKind::Cuda
        } else {
            DeviceKind::Cpu
        }
    }

    /// The tch device for this rank: CUDA device `local_rank` (modulo the device count).
    ///
    /// # Errors
    /// [`Error::CudaUnavailable`] when `cuda` is asked for and libtorch sees no GPU.
    pub fn resolve(self, local_rank: usize) -> Result<Device> {
        match self {
            DeviceKind::Cpu => Ok(Device::Cpu),
            DeviceKind::Cuda => {
                if let Err(why) = load_cuda() {
                    return Err(Error::CudaUnavailable { requested: "--device cuda".into(), why });
                }
                let n = tch::Cuda::device_count();
                if n <= 0 {
                    return Err(Error::CudaUnavailable {
                        requested: "--device cuda".into(),
                        why: "libtorch reports 0 CUDA devices; use --device cpu".into(),
                    });
                }
                Ok(Device::Cuda(local_rank % n as usize))
            }
        }
    }
}

impl std::fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Cuda => "cuda",
        })
    }
}

/// Loads libtorch's CUDA backend once per process (tch does not link it; see `sys`).
///
/// # Errors
/// The dynamic loader's message when `libtorch_cuda.so` cannot be loaded (a CPU-only libtorch).
pub fn load_cuda() -> std::result::Result<(), String> {
    static LOADED: std::sync::OnceLock<std::result::Result<(), String>> = std::sync::OnceLock::new();
    LOADED.get_or_init(crate::sys::load_torch_cuda).clone()
}

/// `torch.cuda.is_available()`: loads the CUDA backend, then asks libtorch.
pub fn cuda_available() -> bool {
    load_cuda().is_ok() && tch::Cuda::is_available()
}

/// Logical cores of this machine (`std::thread::available_parallelism`, 1 if unknown).
pub fn cores() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

/// Intra-op threads for one rank: `cores / local_world_size`, at least 1 (DESIGN: Threads).
pub fn threads_per_rank(local_world_size: usize) -> usize {
    (cores() / local_world_size.max(1)).max(1)
}

/// Sets libtorch's intra-op thread count to [`threads_per_rank`] and returns it.
pub fn set_threads_per_rank(local_world_size: usize) -> usize {
    let n = threads_per_rank(local_world_size);
    tch::set_num_threads(n as i32);
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_backend_loads_from_the_wheel_and_cpu_always_resolves() {
        // The torch wheel ships libtorch_cuda.so: loading it must work with or without a GPU.
        load_cuda().expect("libtorch_cuda.so loads through the rpath");
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        assert!(maps.contains("libtorch_cuda.so"), "libtorch_cuda.so is mapped after load_cuda()");
        assert_eq!(DeviceKind::Cpu.resolve(3).unwrap(), Device::Cpu);
        if !tch::Cuda::is_available() {
            let err = DeviceKind::Cuda.resolve(0).unwrap_err().to_string();
            assert_eq!(err, "device --device cuda requested but CUDA is not available (libtorch reports 0 CUDA devices; use --device cpu)");
            assert_eq!(DeviceKind::default_for_machine(), DeviceKind::Cpu);
        }
    }
}
