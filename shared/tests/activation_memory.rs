//! The activation-memory estimate behind the free-memory check
//! ([`ladder_core::memory::activation_bytes_per_sample`]) against what one training step
//! really takes: the shapes the forward produces, and the peak RSS growth of a step. One test
//! in this file, so that no other test's allocations share the process's RSS.

use ladder_core::memory;
use ladder_core::model::{BasicNet, BasicNetConfig, Segmented};
use tch::nn::{self, ModuleT};
use tch::{Device, Kind, Tensor};

#[test]
fn the_estimate_bounds_one_steps_measured_activation_memory() {
    tch::set_num_threads(1);
    for (width, batch) in [(128i64, 512i64), (4096, 256)] {
        let vs = nn::VarStore::new(Device::Cpu);
        let net = BasicNet::new(&vs.root(), BasicNetConfig { width, ..Default::default() });

        // 1. The formula's terms are the forward's real outputs: each segment's output size.
        let x = Tensor::randn([2, 1, 28, 28], (Kind::Float, Device::Cpu));
        let mut sizes = Vec::new();
        let mut h = x.shallow_clone();
        for i in 0..net.num_segments() {
            h = net.segment_forward(i, &h, true);
            sizes.push(h.numel() / 2);
        }
        assert_eq!(sizes, vec![32 * 26 * 26, 64 * 12 * 12, 9216, width as usize, width as usize, 10], "width {width}");

        // 2. One training step's peak RSS growth (after warm-up steps at a small batch, so
        //    the parameters' gradients and libtorch's kernels are already there).
        let step = |b: i64| {
            let x = Tensor::randn([b, 1, 28, 28], (Kind::Float, Device::Cpu));
            let y = Tensor::randint(10, [b], (Kind::Int64, Device::Cpu));
            net.forward_t(&x, true).nll_loss(&y).backward();
        };
        step(4);
        step(4);
        let before = memory::current_rss_bytes().expect("VmRSS on Linux");
        assert!(memory::reset_peak_rss(), "clear_refs must reset VmHWM");
        step(batch);
        let measured = memory::peak_rss_since_reset_bytes().unwrap().saturating_sub(before);
        let estimate = memory::activation_bytes_per_sample(width) * batch as u64;
        let ratio = estimate as f64 / measured as f64;
        eprintln!("width {width}, batch {batch}: measured {measured} B, estimate {estimate} B ({ratio:.2}×)");
        // Upper-ish: never below what a step takes, and not a fudge (within 2.2× of it: the
        // estimate counts every tensor the step creates, also those freed before the peak —
        // ~1.3× at width 128, ~1.9× at width 4096).
        assert!(estimate >= measured, "width {width}: estimate {estimate} B < measured {measured} B");
        assert!(ratio < 2.2, "width {width}: estimate {estimate} B is {ratio:.2}× the measured {measured} B");
    }
}
