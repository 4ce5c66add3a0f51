//! What Open MPI's all-reduce of a large message adds to a rank's resident memory, measured
//! (real ranks under mpirun at W = 2 and 3): the memory estimator
//! ([`ladder_core::memory::estimate::allreduce_scratch_bytes`]) counts it in DDP's gradient
//! reduction, where one bucket (at width ≥ 128, fc1's weight: most of the model) is all-reduced
//! in place.
//!
//! Open MPI 4.1's `tuned` component picks Rabenseifner's algorithm for large messages on few
//! ranks (a reduce-scatter by recursive halving, then an all-gather): at W = 2 each rank
//! receives the half of the message it reduces into a scratch buffer, so half the message
//! becomes resident; the all-gather writes straight into the result.

mod common;

use ladder_core::dist::{init_process_group, Backend, ReduceOp};
use ladder_core::memory::{self, estimate};
use tch::{Device, Kind, Tensor};

/// 64 MiB of f32: far above every small-message threshold, and above glibc's mmap threshold
/// (the scratch buffer is mapped fresh and returned at once, so the peak shows it).
const NUMEL: i64 = 16 << 20;

#[test]
fn allreduce_scratch_at_world_size_2() {
    common::mpirun(2, "rank_allreduce_scratch", &[]);
}

#[test]
fn allreduce_scratch_at_world_size_3() {
    common::mpirun(3, "rank_allreduce_scratch", &[]);
}

#[test]
#[ignore = "rank body: run under mpirun by allreduce_scratch_at_world_size_{2,3}"]
fn rank_allreduce_scratch() {
    let pg = init_process_group(Backend::Mpi).unwrap();
    let (rank, w) = (pg.rank(), pg.world_size());
    let mut t = Tensor::full([NUMEL], 1.0 + rank as f64, (Kind::Float, Device::Cpu));
    // A first all-reduce of another buffer: Open MPI's first-use buffers out of the figure.
    let mut warm = Tensor::ones([NUMEL / 64], (Kind::Float, Device::Cpu));
    pg.all_reduce(&mut warm, ReduceOp::Avg).unwrap();
    pg.barrier().unwrap();
    assert!(memory::reset_peak_rss(), "clear_refs must reset VmHWM");
    let before = memory::current_rss_bytes().unwrap();
    pg.all_reduce(&mut t, ReduceOp::Avg).unwrap();
    let grew = memory::peak_rss_since_reset_bytes().unwrap().saturating_sub(before);
    let message = 4 * NUMEL as u64;
    let fraction = grew as f64 / message as f64;
    let expected = estimate::allreduce_scratch_bytes(message, w) as f64 / message as f64;
    println!(
        "rank {rank} of {w}: all_reduce of {} MiB grew the RSS by {:.1} MiB ({fraction:.3} of the message; estimated {expected:.3})",
        message >> 20,
        memory::mib(grew)
    );
    assert_eq!(f64::try_from(t.get(0)).unwrap(), (w as f64 + 1.0) / 2.0);
    assert!((fraction - expected).abs() <= 0.1, "rank {rank} of {w}: {fraction:.3} of the message, estimated {expected:.3}");
}
