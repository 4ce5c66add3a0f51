//! Compute efficiency: BasicNet's training FLOPs per sample counted from its layer shapes, and
//! the machine's peak FLOP/s derived from what the CPU (or GPU) says it is — so that every
//! samples/s figure can be read as a share of what the hardware can do.
//!
//! What is counted ([`layer_flops`]): the multiply-accumulates (MACs) of the four layers with
//! weights — conv1, conv2, fc1, fc2 — at 2 FLOPs each. Forward: one MAC per weight use. Backward:
//! the weight gradient costs what the forward did, and so does the input gradient — except
//! conv1's, which nobody computes (the images need no gradient). Training FLOPs per sample are
//! therefore `2 × (3 × forward MACs − conv1's MACs)`, about the usual "3 × forward". Left out
//! (each well under 1% of the total): biases, ReLU, max-pool, dropout, log-softmax and the loss,
//! and the optimizer step (per step, not per sample).
//!
//! The peak ([`cpu_peak`]): physical cores × clock × fp32 FLOP per cycle per core, where FLOP per
//! cycle is FMA pipes × f32 lanes × 2 from the vector units the CPU flags advertise (AVX2 + FMA,
//! AVX-512 and how wide the core executes it, AVX512-BF16, AMX); [`Peak::derivation`] says which
//! rule applied. A GPU's comes from its model name ([`gpu_peak`]).

use serde::{Deserialize, Serialize};

/// One layer's multiply-accumulates per sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerFlops {
    /// `conv1`, `conv2`, `fc1`, `fc2`.
    pub layer: &'static str,
    /// Forward MACs per sample: output elements × inputs per output.
    pub forward_macs: u64,
    /// Backward MACs per sample: the weight gradient (= forward) plus the input gradient
    /// (= forward, except for conv1, whose input needs no gradient).
    pub backward_macs: u64,
}

/// BasicNet's layers with weights at fc1 width `width`, for one sample (`[1, 28, 28]` in,
/// 10 classes out): conv1 1→32 3×3 (26×26 out), conv2 32→64 3×3 (24×24 out), fc1 9216→`width`,
/// fc2 `width`→10. A width below 1 counts as 0 (no such network; the bench refuses it earlier).
pub fn layer_flops(width: i64) -> [LayerFlops; 4] {
    let w = u64::try_from(width).unwrap_or(0);
    let conv1 = 32 * 26 * 26 * 9;
    let conv2 = 64 * 24 * 24 * (32 * 9);
    let fc1 = 9216 * w;
    let fc2 = w * 10;
    [
        LayerFlops { layer: "conv1", forward_macs: conv1, backward_macs: conv1 },
        LayerFlops { layer: "conv2", forward_macs: conv2, backward_macs: 2 * conv2 },
        LayerFlops { layer: "fc1", forward_macs: fc1, backward_macs: 2 * fc1 },
        LayerFlops { layer: "fc2", forward_macs: fc2, backward_macs: 2 * fc2 },
    ]
}

/// Training FLOPs per sample at fc1 width `width`: 2 × the forward and backward MACs of
/// [`layer_flops`] (71,565,312 at width 128).
pub fn training_flops_per_sample(width: i64) -> u64 {
    layer_flops(width).iter().map(|l| 2 * (l.forward_macs + l.backward_macs)).sum()
}

/// A device's peak arithmetic rate and how it was derived.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Peak {
    /// Peak fp32 FLOP/s.
    pub fp32_flops: f64,
    /// Peak bf16 FLOP/s where the device has bf16 arithmetic (AVX512-BF16, AMX, tensor cores);
    /// `None` when bf16 runs on the fp32 units.
    pub bf16_flops: Option<f64>,
    /// How the figures were derived, in one line: cores, clock, FLOP per cycle and the rule.
    pub derivation: String,
}

impl Peak {
    /// The peak a run in `precision` is measured against: the bf16 peak for bf16 runs where
    /// there is one, else the fp32 peak.
    pub fn for_precision(&self, bf16: bool) -> f64 {
        if bf16 {
            self.bf16_flops.unwrap_or(self.fp32_flops)
        } else {
            self.fp32_flops
        }
    }
}

/// The achieved FLOP/s of a run at `samples_per_s` on BasicNet at fc1 width `width`.
pub fn achieved_flops(width: i64, samples_per_s: f64) -> f64 {
    training_flops_per_sample(width) as f64 * samples_per_s
}

/// What the peak derivation reads about a CPU (from `/proc/cpuinfo`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CpuFacts {
    /// `vendor_id`: `GenuineIntel`, `AuthenticAMD`, …
    pub vendor: String,
    /// `cpu family` (25 = AMD Zen 3/4, 26 = Zen 5; 6 = Intel Core/Xeon).
    pub family: u32,
    /// `model`.
    pub model: u32,
    /// `model name`.
    pub model_name: String,
    /// `flags`.
    pub flags: Vec<String>,
    /// Logical CPUs this process may use.
    pub logical_cpus: usize,
    /// Hardware threads per core: `siblings` / `cpu cores` (1 when not stated).
    pub threads_per_core: usize,
    /// Clock, MHz: the maximum (cpufreq's `cpuinfo_max_freq`) when known, else `cpu MHz`.
    pub mhz: f64,
    /// Where [`mhz`](Self::mhz) came from.
    pub clock_source: String,
}

impl CpuFacts {
    /// Reads the first processor's block of `/proc/cpuinfo` text; `logical_cpus` is what this
    /// process may use, `max_khz` cpufreq's `cpuinfo_max_freq` when the kernel exposes it.
    pub fn parse(cpuinfo: &str, logical_cpus: usize, max_khz: Option<u64>) -> CpuFacts {
        let field = |key: &str| {
            cpuinfo
                .lines()
                .take_while(|l| !l.trim().is_empty())
                .find_map(|l| l.split_once(':').filter(|(k, _)| k.trim() == key).map(|(_, v)| v.trim().to_string()))
                .unwrap_or_default()
        };
        let num = |key: &str| field(key).parse::<u32>().unwrap_or(0);
        let (siblings, cores) = (num("siblings"), num("cpu cores"));
        let threads_per_core = if siblings > 0 && cores > 0 { (siblings / cores).max(1) as usize } else { 1 };
        let (mhz, clock_source) = match max_khz {
            Some(khz) if khz > 0 => (khz as f64 / 1000.0, "cpufreq cpuinfo_max_freq".to_string()),
            // Without cpufreq (a VM): the nominal rate; boost clocks above it are not visible.
            _ => (field("cpu MHz").parse().unwrap_or(0.0), "/proc/cpuinfo cpu MHz, nominal: boost not visible".to_string()),
        };
        CpuFacts {
            vendor: field("vendor_id"),
            family: num("cpu family"),
            model: num("model"),
            model_name: field("model name"),
            flags: field("flags").split_whitespace().map(str::to_string).collect(),
            logical_cpus,
            threads_per_core,
            mhz,
            clock_source,
        }
    }

    /// This machine's facts: `/proc/cpuinfo`, the CPUs this process may use, cpufreq's maximum;
    /// where the kernel exposes no cpufreq (a VM), the clock is measured ([`measure_clock_mhz`]
    /// with every core busy), since a boosting CPU runs well above the nominal `cpu MHz` and a
    /// peak from it would be exceeded by a real run.
    pub fn of_this_machine() -> CpuFacts {
        let text = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let max_khz =
            std::fs::read_to_string("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq").ok().and_then(|s| s.trim().parse().ok());
        let facts = CpuFacts::parse(&text, std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1), max_khz);
        match max_khz {
            Some(khz) if khz > 0 => facts,
            _ => match measure_clock_mhz(facts.logical_cpus) {
                Some(mhz) => facts.with_measured_clock(mhz),
                None => facts,
            },
        }
    }

    /// These facts with the clock `mhz` measured by [`measure_clock_mhz`] over every logical
    /// CPU; the nominal `cpu MHz` stays in [`clock_source`](Self::clock_source).
    pub fn with_measured_clock(self, mhz: f64) -> CpuFacts {
        let clock_source = format!(
            "measured with all {} logical CPUs busy: dependent 64-bit multiply-adds, 4 cycles each; nominal {:.3} GHz",
            self.logical_cpus,
            self.mhz / 1e3
        );
        CpuFacts { mhz, clock_source, ..self }
    }

    fn has(&self, flag: &str) -> bool {
        self.flags.iter().any(|f| f == flag)
    }

    /// Physical cores this process may use: logical CPUs / threads per core (at least 1).
    pub fn cores(&self) -> usize {
        (self.logical_cpus / self.threads_per_core.max(1)).max(1)
    }
}

/// The clock a core runs at while `threads` cores are busy, MHz (the median over threads);
/// `None` off x86-64 or when a thread cannot be started.
///
/// Each thread times 50 million links of `x = x · a + b` on 64-bit integers: every link waits
/// for the one before, and costs a multiply (3 cycles latency) and an add (1 cycle) on every
/// x86-64 core since Intel Sandy Bridge and AMD Zen, so cycles per second = links per second ×
/// 4 — the clock as the core runs it, boost included. About 0.1 s at 2 GHz, after 0.01 s of
/// warm-up. The time is the thread's own CPU time (`CLOCK_THREAD_CPUTIME_ID`), not the wall
/// clock, so other processes sharing the cores do not make the clock read low: a thread that
/// waits for a core accumulates no CPU time.
pub fn measure_clock_mhz(threads: usize) -> Option<f64> {
    if !cfg!(target_arch = "x86_64") {
        return None;
    }
    fn links_per_second(n: u64) -> f64 {
        use std::hint::black_box;
        let (a, b) = (black_box(6_364_136_223_846_793_005_u64), black_box(1_442_695_040_888_963_407_u64));
        let mut x = black_box(1_u64);
        let start = thread_cpu_seconds();
        for _ in 0..black_box(n) {
            x = x.wrapping_mul(a).wrapping_add(b);
        }
        black_box(x);
        n as f64 / (thread_cpu_seconds() - start)
    }
    let handles: Vec<_> = (0..threads.max(1))
        .map(|_| {
            std::thread::Builder::new().spawn(|| {
                links_per_second(5_000_000);
                links_per_second(50_000_000) * 4.0 / 1e6
            })
        })
        .collect::<std::io::Result<_>>()
        .ok()?;
    let mut mhz: Vec<f64> = handles.into_iter().map(|h| h.join().ok()).collect::<Option<_>>()?;
    if mhz.iter().any(|m| !m.is_finite() || *m <= 0.0) {
        return None;
    }
    mhz.sort_by(f64::total_cmp);
    Some(mhz[mhz.len() / 2])
}

/// CPU time this thread has run, seconds (`clock_gettime(CLOCK_THREAD_CPUTIME_ID)`).
fn thread_cpu_seconds() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec; the clock id is a constant Linux defines.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return f64::NAN;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// fp32 FLOP per cycle per core, the bf16 factor over it, and the rule that gave them.
fn per_cycle(cpu: &CpuFacts) -> (f64, Option<f64>, String) {
    let amd = cpu.vendor == "AuthenticAMD";
    // (FMA pipes, vector bits each executes per cycle, what it is)
    let (pipes, bits, unit) = if cpu.has("avx512f") {
        if amd && cpu.family < 26 {
            (2, 256, "AVX-512 on AMD Zen 4 (executed as 2 × 256-bit: two 256-bit FMA pipes)")
        } else {
            (2, 512, "AVX-512 (two 512-bit FMA units)")
        }
    } else if cpu.has("avx2") && cpu.has("fma") {
        if amd && cpu.family == 23 && cpu.model < 0x30 {
            (2, 128, "AVX2 + FMA on AMD Zen 1 (two 128-bit FMA pipes)")
        } else {
            (2, 256, "AVX2 + FMA (two 256-bit FMA pipes)")
        }
    } else if cpu.has("avx") {
        (1, 256, "AVX without FMA (one 256-bit add + one multiply port, counted as one FMA)")
    } else {
        (1, 128, "SSE (one 128-bit add + one multiply port, counted as one FMA)")
    };
    let fp32 = f64::from(pipes * bits / 32 * 2);
    let rule = format!("{fp32} FLOP/cycle = {pipes} × {} f32 lanes × 2 (FMA), {unit}", bits / 32);
    let (bf16, bf16_rule) = if cpu.has("amx_bf16") {
        (Some(1024.0 / fp32), "bf16: AMX TMUL, 1024 FLOP/cycle".to_string())
    } else if cpu.has("avx512_bf16") {
        (Some(2.0), format!("bf16: AVX512-BF16 VDPBF16PS, 2 × {fp32} = {} FLOP/cycle", 2.0 * fp32))
    } else {
        (None, "bf16: no bf16 instructions (runs on the fp32 units)".to_string())
    };
    (fp32, bf16, format!("{rule}; {bf16_rule}"))
}

/// The CPU's peak: physical cores × clock × FLOP/cycle ([`per_cycle`]'s rule), with its
/// derivation, e.g. `AMD EPYC: 2 cores × 2.596 GHz (/proc/cpuinfo cpu MHz) × 32 FLOP/cycle = …`.
pub fn cpu_peak(cpu: &CpuFacts) -> Peak {
    let (fp32_per_cycle, bf16_factor, rule) = per_cycle(cpu);
    let cores = cpu.cores();
    let hz = cpu.mhz * 1e6;
    let fp32 = cores as f64 * hz * fp32_per_cycle;
    let bf16 = bf16_factor.map(|f| fp32 * f);
    let smt = if cpu.threads_per_core > 1 {
        format!(" ({} logical CPUs, {} threads per core)", cpu.logical_cpus, cpu.threads_per_core)
    } else {
        String::new()
    };
    let derivation = format!(
        "{} ({} family {} model {}): {cores} core{}{smt} × {:.3} GHz ({}) × {fp32_per_cycle} FLOP/cycle = {:.1} GFLOP/s fp32{}; {rule}",
        if cpu.model_name.is_empty() { "unknown CPU" } else { cpu.model_name.as_str() },
        cpu.vendor,
        cpu.family,
        cpu.model,
        if cores == 1 { "" } else { "s" },
        cpu.mhz / 1e3,
        cpu.clock_source,
        fp32 / 1e9,
        bf16.map_or(String::new(), |b| format!(", {:.1} GFLOP/s bf16", b / 1e9)),
    );
    Peak { fp32_flops: fp32, bf16_flops: bf16, derivation }
}

/// Dense peaks from the vendors' data sheets: (name fragment, fp32 TFLOP/s, bf16 tensor-core
/// TFLOP/s without sparsity). The first fragment the model name contains wins.
const GPUS: [(&str, f64, Option<f64>); 9] = [
    ("H200", 67.0, Some(989.4)),
    ("H100 PCIe", 51.2, Some(756.0)),
    ("H100", 67.0, Some(989.4)),
    ("A100", 19.5, Some(312.0)),
    ("L40S", 91.6, Some(362.1)),
    ("L4", 30.3, Some(121.0)),
    ("A10", 31.2, Some(125.0)),
    ("V100", 15.7, None),
    ("T4", 8.1, None),
];

/// A GPU's peak from its model name (`nvidia-smi -L`'s, e.g. `NVIDIA H200`): the data sheet's
/// dense fp32 and bf16 tensor-core figures; `None` for a model not in the table.
pub fn gpu_peak(name: &str) -> Option<Peak> {
    let (fragment, fp32, bf16) = GPUS.iter().find(|(f, _, _)| name.contains(f))?;
    Some(Peak {
        fp32_flops: fp32 * 1e12,
        bf16_flops: bf16.map(|b| b * 1e12),
        derivation: format!(
            "{name}: data-sheet peak of the {fragment}, {fp32} TFLOP/s fp32{}",
            bf16.map_or(String::new(), |b| format!(", {b} TFLOP/s bf16 (tensor cores, dense)"))
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn training_flops_are_the_hand_count() {
        // conv1: 32 × 26 × 26 outputs × 9 MACs = 194,688; conv2: 64 × 24 × 24 × 288 = 10,616,832;
        // fc1: 9216 × 128 = 1,179,648; fc2: 128 × 10 = 1,280. Forward 11,992,448 MACs.
        let fwd: u64 = layer_flops(128).iter().map(|l| l.forward_macs).sum();
        assert_eq!(fwd, 11_992_448);
        // 2 FLOPs × (3 × 11,992,448 − 194,688) = 71,565,312.
        assert_eq!(training_flops_per_sample(128), 71_565_312);
        // Width 4096: fc1 37,748,736, fc2 40,960 → forward 48,601,216 MACs;
        // 2 × (3 × 48,601,216 − 194,688) = 291,217,920.
        assert_eq!(layer_flops(4096).iter().map(|l| l.forward_macs).sum::<u64>(), 48_601_216);
        assert_eq!(training_flops_per_sample(4096), 291_217_920);
        assert!((achieved_flops(128, 1000.0) - 71_565_312_000.0).abs() < 1.0);
    }

    #[test]
    fn gpu_models_are_matched_most_specific_first() {
        assert_eq!(gpu_peak("GPU 0: NVIDIA H100 PCIe (UUID: x)").unwrap().fp32_flops, 51.2e12);
        assert_eq!(gpu_peak("GPU 0: NVIDIA H200 (UUID: x)").unwrap().bf16_flops, Some(989.4e12));
        assert_eq!(gpu_peak("GPU 0: Tesla T4").unwrap().bf16_flops, None);
        assert!(gpu_peak("GPU 0: NVIDIA Quadro K2000").is_none());
    }
}
