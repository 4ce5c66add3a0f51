//! All-reduce latency and bus bandwidth, ours next to a raw rsmpi call, in the same run.
//!
//!   mpirun -n 2 --bind-to none target/release/examples/allreduce_bench [--json PATH]
//!
//! For each message size (4 KiB … 64 MiB, ×4): warm-up, then alternating timed rounds of
//! `ProcessGroup::all_reduce(Sum)` on an f32 tensor (in place, with its cross-rank numel/dtype
//! check on every call), `Collective::all_reduce(.., Sum).prechecked()` (the same without the
//! per-call check: the path DDP's buckets take, their layout checked once when DDP is built)
//! and rsmpi's `all_reduce_into` on a `Vec<f32>`; the median of each is reported. Below 1 MiB a
//! timed sample is several calls back to back (up to 32), divided by their number, so that how
//! unevenly ranks leave the preceding barrier (about a microsecond) does not swamp the call.
//! busbw = algbw × 2(n−1)/n, as nccl-tests reports it; algbw = bytes / time.

use ladder_core::dist::mpi::MpiGroup;
use ladder_core::dist::{Collective, DistEnv, ProcessGroup, ReduceOp};
use mpi::collective::SystemOperation;
use mpi::traits::*;
use std::time::Instant;
use tch::{Device, Kind, Tensor};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() -> ladder_core::Result<()> {
    let json = std::env::args().skip_while(|a| a != "--json").nth(1);
    let env = DistEnv::from_env()?;
    let pg = MpiGroup::init(&env)?;
    let world = pg.communicator();
    let n = pg.world_size() as f64;
    let factor = 2.0 * (n - 1.0) / n;
    let mut rows = Vec::new();
    if pg.rank() == 0 {
        println!(
            "{:>10} {:>6} {:>10} {:>12} {:>8} {:>12} {:>12} {:>7} {:>11}",
            "bytes", "iters", "ours us", "prechk us", "raw us", "ours busbw", "raw busbw", "ratio", "prechk ratio"
        );
    }
    let mut bytes = 4usize << 10;
    while bytes <= 64 << 20 {
        let elems = bytes / 4;
        let iters = ((256usize << 20) / bytes).clamp(5, 200);
        // Small messages: each sample times `reps` calls back to back, so that the skew with
        // which ranks leave the barrier (about a microsecond) does not swamp a 1 µs call.
        let reps = ((1usize << 20) / bytes).clamp(1, 32);
        let mut t = Tensor::ones([elems as i64], (Kind::Float, Device::Cpu));
        let send = vec![1.0f32; elems];
        let mut recv = vec![0.0f32; elems];
        let (mut ours, mut pre, mut raw) = (Vec::new(), Vec::new(), Vec::new());
        for i in 0..iters + 3 {
            pg.barrier()?;
            let t0 = Instant::now();
            for _ in 0..reps {
                pg.all_reduce(&mut t, ReduceOp::Sum)?;
            }
            let a = t0.elapsed().as_secs_f64() / reps as f64;
            let _ = t.fill_(1.0);
            pg.barrier()?;
            let t0 = Instant::now();
            for _ in 0..reps {
                pg.run(Collective::all_reduce(&mut t, ReduceOp::Sum).prechecked())?;
            }
            let p = t0.elapsed().as_secs_f64() / reps as f64;
            let (got, want) = (t.double_value(&[0]), n.powi(reps as i32)); // each call multiplies by n
            assert!((got - want).abs() <= want * 1e-6, "prechecked all-reduce result {got}, expected {want}");
            let _ = t.fill_(1.0);
            pg.barrier()?;
            let t0 = Instant::now();
            for _ in 0..reps {
                world.all_reduce_into(&send[..], &mut recv[..], SystemOperation::sum());
            }
            let b = t0.elapsed().as_secs_f64() / reps as f64;
            if i >= 3 {
                ours.push(a);
                pre.push(p);
                raw.push(b);
            }
        }
        assert_eq!(recv[0], n as f32, "raw all-reduce result");
        let (o, p, r) = (median(ours), median(pre), median(raw));
        let busbw = |secs: f64| bytes as f64 / secs * factor / 1e9;
        let (ob, pb, rb) = (busbw(o), busbw(p), busbw(r));
        if pg.rank() == 0 {
            println!(
                "{bytes:>10} {iters:>6} {:>10.1} {:>12.1} {:>8.1} {:>7.2} GB/s {:>7.2} GB/s {:>7.2} {:>11.2}",
                o * 1e6,
                p * 1e6,
                r * 1e6,
                ob,
                rb,
                ob / rb,
                pb / rb
            );
        }
        rows.push(serde_json::json!({
            "bytes": bytes, "iters": iters, "ours_latency_us": o * 1e6, "raw_latency_us": r * 1e6,
            "ours_busbw_gbps": ob, "raw_busbw_gbps": rb, "ratio": ob / rb,
            "prechecked_latency_us": p * 1e6, "prechecked_busbw_gbps": pb, "prechecked_ratio": pb / rb,
        }));
        bytes *= 4;
    }
    if let (Some(path), 0) = (json, pg.rank()) {
        let doc = serde_json::json!({ "world_size": pg.world_size(), "dtype": "f32", "op": "sum", "rows": rows });
        ladder_core::atomic::write_atomic(std::path::Path::new(&path), serde_json::to_string_pretty(&doc).unwrap().as_bytes())?;
    }
    Ok(())
}
