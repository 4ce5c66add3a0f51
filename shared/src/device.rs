//! `--device cpu|cuda` for every binary: parsing, the default (cuda if available, asked without
//! loading libtorch's CUDA libraries when no NVIDIA driver exists), and the intra-op thread count
//! each rank uses.

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
    /// [`Error::CudaUnavailable`] when `cuda` is asked for and libtorch sees no GPU; it names the
    /// choice `device` (a level renames it to its flag with [`Error::named_by`]).
    pub fn resolve(self, local_rank: usize) -> Result<Device> {
        match self {
            DeviceKind::Cpu => Ok(Device::Cpu),
            DeviceKind::Cuda => {
                let unavailable = |why: String| Error::CudaUnavailable { option: "device".into(), why, suggest_cpu: true };
                nvidia_driver().map_err(unavailable)?;
                // A libtorch built without CUDA: the CPU is not advice, it is all there is.
                load_cuda().map_err(|why| Error::CudaUnavailable { option: "device".into(), why, suggest_cpu: false })?;
                let n = tch::Cuda::device_count();
                if n <= 0 {
                    return Err(unavailable("libtorch reports 0 CUDA devices".into()));
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

/// `torch.cuda.is_available()`: when an NVIDIA driver can exist ([`nvidia_driver`]), loads the
/// CUDA backend and asks libtorch; else `false` without loading anything.
///
/// Why the driver check comes first: loading `libtorch_cuda.so` (and the cuDNN, cuBLAS, NCCL
/// libraries it pulls in) costs ~260 MiB of resident memory per process, even on a machine with
/// no GPU, only to hear "no". PyTorch's own `is_available()` asks the driver (`cuInit` through
/// `libcuda.so.1`) and never loads more when there is none; so do we.
pub fn cuda_available() -> bool {
    nvidia_driver().is_ok() && load_cuda().is_ok() && tch::Cuda::is_available()
}

/// Whether an NVIDIA driver can be present: the kernel module's `/proc/driver/nvidia`, or the
/// driver's user-space library `libcuda.so.1` (as WSL and containers provide it) loads. Cheap:
/// no CUDA library of libtorch is loaded. Checked once per process.
///
/// # Errors
/// A sentence saying what was looked for, when neither is there.
pub fn nvidia_driver() -> std::result::Result<(), String> {
    static FOUND: std::sync::OnceLock<std::result::Result<(), String>> = std::sync::OnceLock::new();
    FOUND
        .get_or_init(|| {
            if std::path::Path::new("/proc/driver/nvidia").exists() || crate::sys::libcuda_loads() {
                Ok(())
            } else {
                Err("no NVIDIA driver on this machine (/proc/driver/nvidia is absent and libcuda.so.1 does not load)".into())
            }
        })
        .clone()
}

/// glibc's `malloc` settings for a training process: allocations up to 32 MiB come from the
/// heap (`M_MMAP_THRESHOLD`) and freed heap memory is returned to the kernel only above
/// 256 MiB (`M_TRIM_THRESHOLD`). Returns true when both were accepted (always false on a libc
/// other than glibc).
///
/// Why: libtorch's CPU tensors come from `malloc`. By default glibc serves blocks above its
/// (dynamic) mmap threshold with a fresh `mmap` and hands the top of the heap back once
/// 2 × that threshold is free, so every step's activations (a 64-image batch's conv2 output
/// alone is 9.4 MB) were mapped, zero-filled page by page and unmapped again: ~5,700 page
/// faults per step on BasicNet at batch 64, measured with `perf stat -e page-faults`, and a
/// fifth of a 2-rank step's time. With these settings the steps after the first reuse the same
/// memory (no page fault per step). The peak RSS, which counts the largest step anyway, grows
/// by the heap's fragmentation (~30 MiB per rank measured). Blocks above 32 MiB are still
/// mapped and unmapped. PyTorch's CPU tuning guide makes the same
/// point by recommending jemalloc or tcmalloc; these two `mallopt` calls are the glibc form.
pub fn tune_malloc_for_training() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only changes two allocator parameters; it is called before training
        // allocates, and glibc serialises it with its arenas' locks.
        unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20) == 1 && libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

/// Parameter bytes from which [`use_huge_pages_for`] turns transparent huge pages on: glibc's
/// `mmap` threshold as [`tune_malloc_for_training`] sets it (32 MiB).
pub const HUGE_PAGES_FROM_PARAM_BYTES: u64 = 32 << 20;

/// Whether [`use_huge_pages_for`] turns transparent huge pages on for `param_bytes` of
/// parameters when the environment leaves `THP_MEM_ALLOC_ENABLE` unset: at least
/// [`HUGE_PAGES_FROM_PARAM_BYTES`] (BasicNet from fc1 width 908 on). No side effect: what the
/// memory estimate assumes unless told otherwise
/// ([`crate::memory::estimate::EstimateInput::huge_pages`]).
pub fn huge_pages_by_default(param_bytes: u64) -> bool {
    param_bytes >= HUGE_PAGES_FROM_PARAM_BYTES
}

/// Whether the levels back tensors with transparent huge pages for `param_bytes` of
/// parameters: as the user's `THP_MEM_ALLOC_ENABLE` says (`1`: on, any other value: off) where
/// it is set, else [`huge_pages_by_default`]. Reads the environment only.
pub fn huge_pages_for(param_bytes: u64) -> bool {
    match std::env::var_os("THP_MEM_ALLOC_ENABLE") {
        Some(v) => v == "1",
        None => huge_pages_by_default(param_bytes),
    }
}

/// Turns on PyTorch's `THP_MEM_ALLOC_ENABLE` (libtorch backs CPU tensors of 2 MiB and more with
/// transparent huge pages, where the kernel allows `madvise`) for a model whose parameters take
/// `param_bytes` (f32: 4 × parameters) of at least [`HUGE_PAGES_FROM_PARAM_BYTES`], unless the
/// environment already sets the variable (the user's value wins). Returns whether it is on.
/// Call it before libtorch allocates its first CPU tensor: c10 reads the variable once, then.
///
/// Why: blocks above glibc's 32 MiB mmap threshold — at fc1 width 4096, the 151 MB weight and
/// its gradient, FSDP's gathered flat parameters and flat gradients — are mapped afresh every
/// step and faulted in 4 KiB at a time: ~20% of a FULL_SHARD step in the kernel (`perf`). With
/// 2 MiB pages, 512 times fewer faults: FULL_SHARD at width 4096, 2 ranks, 173–179 → 259–308
/// samples/s, DDP 216 → 271, for 3–6% more peak RSS. A small model gains nothing and pays up to
/// 2 MiB of rounding per large tensor (~40 MiB per rank at width 128), hence the threshold.
pub fn use_huge_pages_for(param_bytes: u64) -> bool {
    const VAR: &str = "THP_MEM_ALLOC_ENABLE";
    let on = huge_pages_for(param_bytes);
    if on && std::env::var_os(VAR).is_none() {
        // Start-up, before libtorch, MPI or any other thread reads the environment.
        std::env::set_var(VAR, "1");
    }
    on
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

/// The x86 CPU flags (`/proc/cpuinfo`) of units that compute in bf16: AVX512-BF16 (Intel
/// Cooper Lake and Sapphire Rapids on, AMD Zen 4 on) and AMX-BF16 (Intel Sapphire Rapids on).
/// Without them libtorch emulates bf16 with fp32 arithmetic plus conversions.
pub const BF16_CPU_FLAGS: [&str; 2] = ["avx512_bf16", "amx_bf16"];

/// Which of [`BF16_CPU_FLAGS`] the first `flags` line of `cpuinfo` (the text of
/// `/proc/cpuinfo`) lists; `None` when it has no `flags` line (not an x86 CPU: ARM's bf16 is
/// listed elsewhere, and is not judged here).
pub fn bf16_units_in(cpuinfo: &str) -> Option<Vec<&'static str>> {
    let flags = cpuinfo.lines().find_map(|l| l.split_once(':').filter(|(k, _)| k.trim() == "flags").map(|(_, v)| v))?;
    Some(BF16_CPU_FLAGS.into_iter().filter(|f| flags.split_whitespace().any(|x| x == *f)).collect())
}

/// [`bf16_units_in`] this machine's `/proc/cpuinfo`; `None` where it cannot be read or is not
/// an x86 CPU's.
pub fn cpu_bf16_units() -> Option<Vec<&'static str>> {
    // The CPU does not change under a process: read once (the bench estimates every cell).
    static UNITS: std::sync::OnceLock<Option<Vec<&'static str>>> = std::sync::OnceLock::new();
    UNITS.get_or_init(|| bf16_units_in(&std::fs::read_to_string("/proc/cpuinfo").ok()?)).clone()
}

/// A CPU's bf16 unit: the fastest of [`BF16_CPU_FLAGS`] its flags list, which libtorch's bf16
/// kernels run on. It also decides how much of glibc's heap a bf16 step leaves resident (the
/// memory estimate's 16-bit factor, [`crate::memory::estimate::resident_per_live`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
pub enum CpuBf16Unit {
    /// AMX-BF16 tiles (`amx_bf16`: Intel Sapphire Rapids and later).
    #[serde(rename = "amx")]
    #[value(name = "amx", alias = "amx_bf16", alias = "amx-bf16")]
    Amx,
    /// AVX512-BF16 without AMX (`avx512_bf16`: Intel Cooper Lake, AMD Zen 4 and later).
    #[serde(rename = "avx512-bf16")]
    #[value(name = "avx512-bf16", alias = "avx512_bf16")]
    Avx512Bf16,
    /// Neither: libtorch emulates bf16 with fp32 arithmetic and conversions (`none`).
    #[serde(rename = "none")]
    #[value(name = "none", alias = "emulated")]
    Emulated,
}

impl CpuBf16Unit {
    /// The unit `units` ([`bf16_units_in`]) name: AMX before AVX512-BF16.
    pub fn from_units(units: &[&str]) -> Self {
        if units.contains(&"amx_bf16") {
            CpuBf16Unit::Amx
        } else if units.contains(&"avx512_bf16") {
            CpuBf16Unit::Avx512Bf16
        } else {
            CpuBf16Unit::Emulated
        }
    }

    /// This machine's unit ([`cpu_bf16_units`]); `None` where `/proc/cpuinfo` cannot be read or
    /// is not an x86 CPU's.
    pub fn of_this_machine() -> Option<Self> {
        cpu_bf16_units().map(|u| Self::from_units(&u))
    }

    /// The name `--cpu-bf16` takes: `amx`, `avx512-bf16` or `none`.
    pub fn label(self) -> &'static str {
        match self {
            CpuBf16Unit::Amx => "amx",
            CpuBf16Unit::Avx512Bf16 => "avx512-bf16",
            CpuBf16Unit::Emulated => "none",
        }
    }
}

/// What bf16 costs on a CPU without bf16 units, measured: a `--max-steps 2` run took 248 s in
/// bf16 against 15–50 s in fp32 on a 2-core AMD EPYC without AVX-512 or AMX (issue 27).
pub const BF16_EMULATED_SLOWDOWN: &str = "5-10x";

/// The start-up warning for bf16 mixed precision on a CPU whose `units` ([`cpu_bf16_units`])
/// are none: it runs several times slower than fp32 there. `None` (no warning) when the CPU
/// has a unit or is not known to lack one.
pub fn bf16_cpu_warning(units: Option<&[&str]>) -> Option<String> {
    match units {
        Some([]) => Some(format!(
            "warning: bf16 mixed precision on a CPU without bf16 units (/proc/cpuinfo lists neither avx512_bf16 nor \
             amx_bf16): libtorch emulates bf16 here, {BF16_EMULATED_SLOWDOWN} slower than fp32 (measured); its speed-up needs \
             AVX512-BF16 (Intel Cooper Lake, Sapphire Rapids and later; AMD Zen 4 and later) or AMX"
        )),
        _ => None,
    }
}

/// Prints [`bf16_cpu_warning`] for this machine to stderr, once per process: every level
/// calls it (through the wrapped model) when it trains in bf16 on the CPU, on rank 0.
pub fn warn_bf16_on_cpu() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if let Some(w) = bf16_cpu_warning(cpu_bf16_units().as_deref()) {
            eprintln!("{w}");
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::BasicNet;

    #[test]
    fn bf16_units_are_read_from_the_cpu_flags() {
        let epyc = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2 fma\n";
        let spr = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n";
        assert_eq!(bf16_units_in(epyc), Some(vec![]));
        assert_eq!(bf16_units_in(spr), Some(vec!["avx512_bf16", "amx_bf16"]));
        assert_eq!(bf16_units_in("processor\t: 0\nFeatures\t: fp asimd bf16\n"), None, "not x86: not judged");
        let w = bf16_cpu_warning(Some(&[])).unwrap();
        assert!(w.starts_with("warning: bf16 mixed precision on a CPU without bf16 units") && w.contains("5-10x slower than fp32"), "{w}");
        assert_eq!(bf16_cpu_warning(Some(&["avx512_bf16"])), None);
        assert_eq!(bf16_cpu_warning(None), None);
    }

    #[test]
    fn the_bf16_unit_is_the_fastest_the_flags_list() {
        let unit = |flags: &str| CpuBf16Unit::from_units(&bf16_units_in(&format!("flags\t: fpu {flags} sse\n")).unwrap());
        assert_eq!(unit("avx512f avx512_bf16 amx_bf16 amx_tile"), CpuBf16Unit::Amx);
        assert_eq!(unit("avx512f avx512_bf16"), CpuBf16Unit::Avx512Bf16);
        assert_eq!(unit("avx2 avx512f"), CpuBf16Unit::Emulated);
        assert_eq!([CpuBf16Unit::Amx, CpuBf16Unit::Avx512Bf16, CpuBf16Unit::Emulated].map(|u| u.label()), ["amx", "avx512-bf16", "none"]);
    }

    #[test]
    fn huge_pages_follow_the_model_size_and_the_users_setting_wins() {
        // The one test that touches THP_MEM_ALLOC_ENABLE.
        std::env::remove_var("THP_MEM_ALLOC_ENABLE");
        let (tutorial, wide) = (BasicNet::param_bytes(128), BasicNet::param_bytes(4096));
        assert!(!use_huge_pages_for(tutorial), "4.8 MB of parameters: off");
        assert!(std::env::var_os("THP_MEM_ALLOC_ENABLE").is_none(), "and the variable left unset");
        assert!(use_huge_pages_for(wide), "151 MB of parameters: on");
        assert_eq!(std::env::var("THP_MEM_ALLOC_ENABLE").as_deref(), Ok("1"));
        std::env::set_var("THP_MEM_ALLOC_ENABLE", "0");
        assert!(!use_huge_pages_for(wide), "the user's 0 wins");
        std::env::set_var("THP_MEM_ALLOC_ENABLE", "1");
        assert!(use_huge_pages_for(tutorial), "the user's 1 wins");
        std::env::remove_var("THP_MEM_ALLOC_ENABLE");
    }

    #[test]
    fn cuda_backend_loads_from_the_wheel_and_cpu_always_resolves() {
        // The torch wheel ships libtorch_cuda.so: loading it must work with or without a GPU.
        load_cuda().expect("libtorch_cuda.so loads through the rpath");
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        assert!(maps.contains("libtorch_cuda.so"), "libtorch_cuda.so is mapped after load_cuda()");
        assert_eq!(DeviceKind::Cpu.resolve(3).unwrap(), Device::Cpu);
        if nvidia_driver().is_ok() && !tch::Cuda::is_available() {
            let err = DeviceKind::Cuda.resolve(0).unwrap_err().to_string();
            assert_eq!(err, "device cuda requested but CUDA is not available (libtorch reports 0 CUDA devices; use device cpu)");
        }
    }

    #[test]
    fn without_a_driver_nothing_of_cuda_is_loaded_and_cuda_is_a_clear_error() {
        // Run as its own process, so that no other test of this binary has loaded the backend.
        if std::env::var_os("LADDER_DEVICE_CHILD").is_none() {
            let out = std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--exact", "device::tests::without_a_driver_nothing_of_cuda_is_loaded_and_cuda_is_a_clear_error", "--nocapture"])
                .env("LADDER_DEVICE_CHILD", "1")
                .output()
                .unwrap();
            assert!(out.status.success(), "child failed: {}", String::from_utf8_lossy(&out.stderr));
            assert!(String::from_utf8_lossy(&out.stdout).contains("1 passed"));
            return;
        }
        if nvidia_driver().is_ok() {
            return; // a GPU machine: tests/gpu.rs covers it
        }
        assert_eq!(DeviceKind::default_for_machine(), DeviceKind::Cpu);
        assert!(!cuda_available());
        let err = DeviceKind::Cuda.resolve(0).unwrap_err();
        assert_eq!(
            err.to_string(),
            "device cuda requested but CUDA is not available (no NVIDIA driver on this machine \
             (/proc/driver/nvidia is absent and libcuda.so.1 does not load); use device cpu)"
        );
        // A level names its own flag.
        assert_eq!(
            err.named_by(&[("device", "--device")]).to_string(),
            "--device cuda requested but CUDA is not available (no NVIDIA driver on this machine \
             (/proc/driver/nvidia is absent and libcuda.so.1 does not load); use --device cpu)"
        );
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        assert!(!maps.contains("libtorch_cuda.so"), "asking about CUDA without a driver loaded libtorch_cuda.so");
    }
}
