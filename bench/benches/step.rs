//! One training step of BasicNet (batch 64, AdamW) — the hot path every level runs — plain and
//! wrapped in `DistributedDataParallel` at world size 1, so that DDP's own per-step cost
//! (gradient bucketing, the all-reduce call path) shows next to the step it wraps.
//!
//!   cargo bench -p bench --bench step
//!
//! At world size 1 the process group is the local one (no MPI): the difference between the two
//! is DDP's bookkeeping, not communication; `bench run` measures communication at 2 and 4 ranks.

use criterion::{criterion_main, Criterion};
use ladder_core::dist::{init_with_env, Backend, DistEnv};
use ladder_core::model::{BasicNet, BasicNetConfig};
use ladder_core::parallel::{DdpOptions, DistributedDataParallel};
use ladder_core::recipe::adamw;
use tch::{nn, Device, Kind, Tensor};

fn batch() -> (Tensor, Tensor) {
    tch::manual_seed(0);
    (Tensor::randn([64, 1, 28, 28], (Kind::Float, Device::Cpu)), Tensor::randint(10, [64], (Kind::Int64, Device::Cpu)))
}

fn step(c: &mut Criterion) {
    let (x, y) = batch();
    let mut group = c.benchmark_group("basicnet_step_batch64");
    group.sample_size(30);

    let vs = nn::VarStore::new(Device::Cpu);
    let net = BasicNet::new(&vs.root(), BasicNetConfig::default());
    let mut opt = adamw(&vs, 1e-3).expect("AdamW");
    group.bench_function("plain", |b| {
        b.iter(|| {
            opt.zero_grad();
            let loss = nn::ModuleT::forward_t(&net, &x, true).nll_loss(&y);
            loss.backward();
            opt.step();
        })
    });

    let env = DistEnv::from_env().expect("world size 1 environment");
    let pg = init_with_env(Backend::Mpi, &env).expect("local process group");
    let vs = nn::VarStore::new(Device::Cpu);
    let net = BasicNet::new(&vs.root(), BasicNetConfig::default());
    let mut opt = adamw(&vs, 1e-3).expect("AdamW");
    let mut ddp = DistributedDataParallel::new(net, &*pg, DdpOptions::default()).expect("DDP");
    group.bench_function("ddp_world_size_1", |b| {
        b.iter(|| {
            opt.zero_grad();
            let loss = ddp.forward_t(&x, true).nll_loss(&y);
            ddp.backward(&loss).expect("backward + gradient all-reduce");
            opt.step();
        })
    });
    group.finish();
}

/// criterion's group of this file (a private module: the function it generates is not API).
mod group {
    criterion::criterion_group!(benches, super::step);
}
criterion_main!(group::benches);
