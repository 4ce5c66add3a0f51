//! Reduce-scatter latency, ours next to a raw `MPI_Reduce_scatter_block` (rsmpi), in the same run.
//!
//!   mpirun -n 3 --oversubscribe --bind-to none target/release/examples/reduce_scatter_bench
//!
//! For each message size (256 KiB … 256 MiB, ×4, and fc1's flat gradient at width 4096, 151 MB;
//! each rounded up to a whole block per rank, so that 1 MiB is at least 1 MiB at any W):
//! warm-up, then alternating timed rounds of `ProcessGroup::run(Collective::reduce_scatter(..,
//! Sum))` from a borrowed f32 input (from 3 ranks and 1 MiB: one `MPI_Reduce` per block's owner)
//! and rsmpi's `reduce_scatter_block_into` on `Vec<f32>`s; the median of each, their ratio
//! (raw / ours: above 1, ours is faster), and each one's peak RSS growth over its rounds on this
//! rank (MiB; the largest over ranks is printed).

use ladder_core::dist::mpi::MpiGroup;
use ladder_core::dist::{Collective, DistEnv, ProcessGroup, ReduceOp};
use ladder_core::memory;
use mpi::collective::SystemOperation;
use mpi::traits::*;
use std::time::Instant;
use tch::{Device, Kind, Tensor};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() -> ladder_core::Result<()> {
    let env = DistEnv::from_env()?;
    let pg = MpiGroup::init(&env)?;
    let world = pg.communicator();
    let w = pg.world_size();
    if pg.rank() == 0 {
        println!("W = {w}");
        println!("{:>10} {:>6} {:>10} {:>10} {:>7} {:>12} {:>12}", "bytes", "iters", "ours ms", "raw ms", "ratio", "ours MiB", "raw MiB");
    }
    let mut sizes: Vec<usize> = (0..6).map(|k| (256usize << 10) << (2 * k)).collect();
    sizes.push(4 * (9216 * 4096 + 4096));
    for bytes in sizes {
        let block = (bytes / 4).div_ceil(w);
        let elems = block * w;
        let bytes = 4 * elems;
        let iters = ((512usize << 20) / bytes).clamp(5, 50);
        let input = Tensor::ones([elems as i64], (Kind::Float, Device::Cpu));
        let mut out = Tensor::zeros([block as i64], (Kind::Float, Device::Cpu));
        let send = vec![1.0f32; elems];
        let mut recv = vec![0.0f32; block];
        let (mut ours, mut raw, mut ours_grew, mut raw_grew) = (Vec::new(), Vec::new(), 0u64, 0u64);
        for i in 0..iters + 2 {
            pg.barrier()?;
            memory::reset_peak_rss();
            let before = memory::current_rss_bytes().unwrap_or(0);
            let t0 = Instant::now();
            pg.run(Collective::reduce_scatter(&mut out, &input, ReduceOp::Sum))?;
            let a = t0.elapsed().as_secs_f64();
            let a_grew = memory::peak_rss_since_reset_bytes().unwrap_or(0).saturating_sub(before);
            pg.barrier()?;
            memory::reset_peak_rss();
            let before = memory::current_rss_bytes().unwrap_or(0);
            let t0 = Instant::now();
            world.reduce_scatter_block_into(&send[..], &mut recv[..], SystemOperation::sum());
            let b = t0.elapsed().as_secs_f64();
            let b_grew = memory::peak_rss_since_reset_bytes().unwrap_or(0).saturating_sub(before);
            if i >= 2 {
                ours.push(a);
                raw.push(b);
                ours_grew = ours_grew.max(a_grew);
                raw_grew = raw_grew.max(b_grew);
            }
        }
        assert_eq!(out.double_value(&[0]), w as f64, "our reduce-scatter's result");
        assert_eq!(recv[0], w as f32, "the raw reduce-scatter's result");
        // The largest growth over ranks (a 1-element max all-reduce of each).
        let mut grew = Tensor::from_slice(&[ours_grew as f64, raw_grew as f64]);
        pg.all_reduce(&mut grew, ReduceOp::Max)?;
        let (o, r) = (median(ours), median(raw));
        if pg.rank() == 0 {
            println!(
                "{bytes:>10} {iters:>6} {:>10.2} {:>10.2} {:>7.2} {:>12.1} {:>12.1}",
                o * 1e3,
                r * 1e3,
                r / o,
                grew.double_value(&[0]) / 1048576.0,
                grew.double_value(&[1]) / 1048576.0
            );
        }
    }
    Ok(())
}
