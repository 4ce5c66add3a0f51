//! DDP's bucketed gradient all-reduce of BasicNet (1,199,882 f32 gradients, 4.58 MiB) against
//! `bucket_cap_mb`, next to one all-reduce of all gradients in a single flat buffer.
//!
//!   mpirun -n 2 --bind-to none target/release/examples/ddp_buckets [--iters N] [--json PATH]
//!
//! For each cap (1, 5, 25, 100 MiB; the first bucket is 1 MiB, as PyTorch's): a fresh
//! `DistributedDataParallel`, one backward under `no_sync` to create the gradients, then
//! `--iters` (default 30) timed rounds of `sync_gradients()` — pack each bucket, all-reduce(Avg),
//! unpack — after 3 warm-up rounds, each round after a barrier. Rank 0 prints a criterion-like
//! table (median, p95, buckets, bus bandwidth = bytes / median × 2(n−1)/n) and writes the rows
//! as JSON. A plain harness rather than criterion: every rank must run the same rounds in
//! lock-step, which criterion's adaptive sampling on one rank would break.

use ladder_core::dist::{self, Backend, ProcessGroup, ReduceOp};
use ladder_core::model::{BasicNet, BasicNetConfig};
use ladder_core::parallel::{DdpOptions, DistributedDataParallel, GradSync};
use std::time::Instant;
use tch::{nn, Device, Kind, Tensor};

fn arg(name: &str) -> Option<String> {
    std::env::args().skip_while(|a| a != name).nth(1)
}

/// Median and 95th percentile (nearest rank) of `v`, seconds.
fn median_p95(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    (v[(n - 1) / 2], v[((0.95 * n as f64).ceil() as usize).clamp(1, n) - 1])
}

/// Times `iters` rounds of `f` (after 3 warm-up rounds), each after a barrier.
fn time_rounds(pg: &dyn ProcessGroup, iters: usize, mut f: impl FnMut() -> ladder_core::Result<()>) -> ladder_core::Result<Vec<f64>> {
    let mut times = Vec::with_capacity(iters);
    for i in 0..iters + 3 {
        pg.barrier()?;
        let t0 = Instant::now();
        f()?;
        if i >= 3 {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    Ok(times)
}

fn main() -> ladder_core::Result<()> {
    let iters: usize = arg("--iters").and_then(|s| s.parse().ok()).unwrap_or(30).max(1);
    let json = arg("--json");
    let pg = dist::leak(dist::init_process_group(Backend::Mpi)?);
    let n = pg.world_size() as f64;
    let factor = 2.0 * (n - 1.0) / n;
    let (x, y) = {
        tch::manual_seed(0);
        (Tensor::randn([64, 1, 28, 28], (Kind::Float, Device::Cpu)), Tensor::randint(10, [64], (Kind::Int64, Device::Cpu)))
    };
    if pg.rank() == 0 {
        println!("DDP gradient all-reduce of BasicNet, {} ranks, {iters} rounds each", pg.world_size());
        println!("{:<22} {:>8} {:>12} {:>12} {:>12} {:>14}", "bucket_cap_mb", "buckets", "bytes", "median ms", "p95 ms", "busbw GB/s");
    }
    let mut rows = Vec::new();
    let mut bytes_total = 0u64;
    for cap in [1.0, 5.0, 25.0, 100.0] {
        tch::manual_seed(1);
        let vs = nn::VarStore::new(Device::Cpu);
        let net = BasicNet::new(&vs.root(), BasicNetConfig::default());
        let mut ddp = DistributedDataParallel::new(net, pg, DdpOptions { bucket_cap_mb: cap, ..DdpOptions::default() })?;
        let loss = ddp.forward_t(&x, true).nll_loss(&y);
        ddp.no_sync(|d| d.backward(&loss))?;
        let buckets = ddp.buckets().len();
        let bytes: u64 = ddp.buckets().iter().map(|b| b.bytes).sum();
        bytes_total = bytes;
        let (med, p95) = median_p95(time_rounds(pg, iters, || ddp.sync_gradients())?);
        let busbw = bytes as f64 / med * factor / 1e9;
        if pg.rank() == 0 {
            println!("{:<22} {buckets:>8} {bytes:>12} {:>12.3} {:>12.3} {busbw:>14.2}", format!("{cap}"), med * 1e3, p95 * 1e3);
        }
        rows.push(serde_json::json!({
            "bucket_cap_mb": cap, "buckets": buckets, "bytes": bytes, "iters": iters,
            "median_ms": med * 1e3, "p95_ms": p95 * 1e3, "busbw_gbps": busbw,
        }));
    }
    // The reference: every gradient in one flat buffer, one all-reduce, no packing.
    let mut flat = Tensor::ones([(bytes_total / 4) as i64], (Kind::Float, Device::Cpu));
    let (med, p95) = median_p95(time_rounds(pg, iters, || pg.all_reduce(&mut flat, ReduceOp::Avg))?);
    let busbw = bytes_total as f64 / med * factor / 1e9;
    if pg.rank() == 0 {
        println!("{:<22} {:>8} {bytes_total:>12} {:>12.3} {:>12.3} {busbw:>14.2}", "one flat all-reduce", 1, med * 1e3, p95 * 1e3);
    }
    let flat_row = serde_json::json!({
        "buckets": 1, "bytes": bytes_total, "iters": iters, "median_ms": med * 1e3, "p95_ms": p95 * 1e3, "busbw_gbps": busbw,
    });
    if let (Some(path), 0) = (json, pg.rank()) {
        let doc = serde_json::json!({ "world_size": pg.world_size(), "rows": rows, "flat": flat_row });
        ladder_core::atomic::write_atomic(std::path::Path::new(&path), serde_json::to_string_pretty(&doc).expect("json").as_bytes())?;
    }
    pg.barrier()?;
    pg.shutdown();
    Ok(())
}
