//! Compute efficiency's two halves against fixed inputs: BasicNet's training FLOPs per sample
//! against a hand count, and the peak FLOP/s derived from fixture `/proc/cpuinfo` blocks
//! (AVX2-only, AVX-512 on AMD and Intel, AMX), snapshotted with their derivation lines.

use bench::compute::{cpu_peak, layer_flops, training_flops_per_sample, CpuFacts};

fn cpuinfo(name: &str) -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/cpuinfo").join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn training_flops_per_sample_match_a_hand_count_at_widths_128_and_4096() {
    // Forward MACs per sample: conv1 32·26·26 outputs × 1·3·3 = 194,688; conv2 64·24·24 × 32·3·3
    // = 10,616,832; fc1 9216 × width; fc2 width × 10. Backward: weight and input gradients, each
    // one forward's worth, except conv1 (its input, the image, needs no gradient).
    for (width, fc1, fc2) in [(128u64, 1_179_648u64, 1_280u64), (4096, 37_748_736, 40_960)] {
        let forward = 194_688 + 10_616_832 + fc1 + fc2;
        let backward = 194_688 + 2 * (10_616_832 + fc1 + fc2);
        assert_eq!(training_flops_per_sample(width as i64), 2 * (forward + backward), "width {width}");
        let layers = layer_flops(width as i64);
        assert_eq!(layers.map(|l| l.layer), ["conv1", "conv2", "fc1", "fc2"]);
        assert_eq!(layers[2].forward_macs, fc1);
    }
    assert_eq!(training_flops_per_sample(128), 71_565_312);
    assert_eq!(training_flops_per_sample(4096), 291_217_920);
}

#[test]
fn peak_flops_from_fixture_cpu_flag_sets() {
    // (fixture, logical CPUs the process may use, fp32 FLOP/cycle/core, bf16 FLOP/cycle/core)
    let cases = [
        ("avx2-amd-zen3.txt", 2, 32.0, None),
        ("avx512-amd-zen4.txt", 2, 32.0, Some(64.0)),
        ("avx512-intel-cascadelake.txt", 4, 64.0, None),
        ("amx-intel-sapphirerapids.txt", 4, 64.0, Some(1024.0)),
    ];
    let mut lines = Vec::new();
    for (name, logical, fp32_per_cycle, bf16_per_cycle) in cases {
        let facts = CpuFacts::parse(&cpuinfo(name), logical, None);
        let peak = cpu_peak(&facts);
        let hz_cores = facts.mhz * 1e6 * facts.cores() as f64;
        assert!((peak.fp32_flops - hz_cores * fp32_per_cycle).abs() < 1.0, "{name}: {peak:?}");
        assert_eq!(peak.bf16_flops.map(|b| (b / hz_cores).round()), bf16_per_cycle, "{name}");
        lines.push(format!("{name}: {}", peak.derivation));
    }
    // Hyper-threads share a core's FMA units: 4 logical CPUs at 2 threads per core are 2 cores.
    assert_eq!(CpuFacts::parse(&cpuinfo("amx-intel-sapphirerapids.txt"), 4, None).cores(), 2);
    // cpufreq's maximum wins over the current clock when the kernel exposes it.
    let boosted = CpuFacts::parse(&cpuinfo("avx2-amd-zen3.txt"), 2, Some(3_500_000));
    assert_eq!((boosted.mhz, boosted.clock_source.as_str()), (3500.0, "cpufreq cpuinfo_max_freq"));
    insta::assert_snapshot!("peak_derivations", lines.join("\n"));
}

/// The measured clock is a clock: 0.8–7 GHz on any x86-64 server (a chain the compiler had
/// folded or vectorised would read tens of GHz), and it replaces the nominal rate in the
/// derivation, which still names the nominal one.
#[test]
fn the_clock_is_measured_where_cpufreq_is_absent() {
    let Some(mhz) = bench::compute::measure_clock_mhz(1) else { return };
    assert!((800.0..7000.0).contains(&mhz), "measured clock {mhz} MHz");
    // Other work on the cores does not lower it (the chain is timed in its thread's CPU time):
    // with four spinning threads per logical CPU, a wall-clock timing would read a fifth.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let cpus = std::thread::available_parallelism().map_or(2, usize::from);
    let spinners: Vec<_> = (0..4 * cpus)
        .map(|_| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            })
        })
        .collect();
    let loaded = bench::compute::measure_clock_mhz(cpus);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    spinners.into_iter().for_each(|h| h.join().unwrap());
    let loaded = loaded.expect("a clock under load");
    assert!(loaded > 0.7 * mhz, "under load the clock read {loaded} MHz, idle {mhz} MHz");
    let facts = CpuFacts::parse(&cpuinfo("avx512-amd-zen4.txt"), 2, None).with_measured_clock(3700.0);
    let peak = cpu_peak(&facts);
    assert!((peak.fp32_flops - 2.0 * 3.7e9 * 32.0).abs() < 1.0, "{peak:?}");
    assert!(
        peak.derivation
            .contains("× 3.700 GHz (measured with all 2 logical CPUs busy: dependent 64-bit multiply-adds, 4 cycles each; nominal "),
        "{}",
        peak.derivation
    );
}
