//! Level 1: the tutorial's `train_ddp`, with every distributed step written out — set-up of the
//! process group, the `DistributedSampler`, the `DistributedDataParallel` wrapper, the loop,
//! exact distributed evaluation, clean-up — and the tutorial's bugs fixed by design:
//!
//! * the optimizer is built over the *wrapped* model's parameters (the tutorial trained the
//!   unwrapped one);
//! * training data goes through a `DistributedSampler` with `set_epoch` every epoch (the
//!   tutorial built none, so every rank trained on the same batches);
//! * evaluation counts each test image exactly once (the tutorial's padded sampler counted
//!   10,002 images at 3 ranks).

use clap::Parser;
use ladder_core::data::{DataLoader, DistributedSampler};
use ladder_core::ddp::{DdpConfig, DistributedDataParallel};
use ladder_core::device::DeviceKind;
use ladder_core::dist::{self, Backend, DistEnv, ProcessGroup};
use ladder_core::metrics::{RankFigures, Report};
use ladder_core::model::{BasicNet, BasicNetConfig};
use ladder_core::train::{adamw, evaluate_distributed, TrainArgs};
use ladder_core::{Error, Result};
use serde::{Deserialize, Serialize};
use std::time::Instant;
use tch::nn;
use tch::{Device, Kind, Tensor};

/// How the model is replicated across ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Strategy {
    /// DistributedDataParallel: a full replica per rank, gradients all-reduced in buckets.
    Ddp,
}

impl Strategy {
    /// The name used in reports (`ddp`, …).
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Ddp => "ddp",
        }
    }
}

/// Level 1's command line: the baseline's training flags plus the distributed ones.
#[derive(Debug, Clone, Parser, Serialize, Deserialize)]
#[command(
    name = "level1-raw-ddp",
    version,
    about = "Level 1: BasicNet on MNIST with a raw process group, a DistributedSampler and DistributedDataParallel",
    after_help = "Launch: `level1-raw-ddp` (1 process), `ladder-run --nproc-per-node 2 level1-raw-ddp`, or `mpirun -n 2 level1-raw-ddp`."
)]
pub struct Config {
    #[command(flatten)]
    pub train: TrainArgs,
    /// Communication backend. Default: nccl when training on cuda, else mpi (as
    /// torch.distributed picks nccl for GPUs and gloo for CPUs).
    #[arg(long, value_enum)]
    pub backend: Option<Backend>,
    /// How the model is replicated across ranks.
    #[arg(long, value_enum, default_value_t = Strategy::Ddp)]
    pub strategy: Strategy,
    /// DDP gradient bucket size cap in MiB (PyTorch's bucket_cap_mb; the first bucket is 1 MiB).
    #[arg(long, default_value_t = 25.0, value_name = "MIB")]
    pub bucket_cap_mb: f64,
    /// Print the gradient bucket layout at start-up (rank 0).
    #[arg(long)]
    pub explain: bool,
    /// After training, check that every rank holds bit-identical parameters (one Max and one
    /// Min all-reduce of all parameters).
    #[arg(long)]
    pub check_sync: bool,
}

/// `setup(rank, world_size)` of the tutorial: initialise the process group from the launcher's
/// environment (RANK, WORLD_SIZE, … or mpirun's) and set this rank's intra-op threads.
///
/// # Errors
/// A contradictory environment, an unavailable backend.
pub fn setup(backend: Backend) -> Result<Box<dyn ProcessGroup>> {
    dist::init_process_group(backend)
}

/// `cleanup()` of the tutorial: `destroy_process_group()`.
pub fn cleanup(pg: Box<dyn ProcessGroup>) {
    dist::destroy_process_group(pg);
}

/// Trains and evaluates as configured; rank 0's report carries every rank's figures.
///
/// # Errors
/// Bad flags, data errors, process-group and collective errors.
pub fn run(cfg: &Config) -> Result<Report> {
    let start = Instant::now();
    cfg.train.validate()?;
    let device_kind = cfg.train.device_kind();
    let backend = cfg.backend.unwrap_or(match device_kind {
        DeviceKind::Cuda => Backend::Nccl,
        DeviceKind::Cpu => Backend::Mpi,
    });
    if backend == Backend::Mpi && device_kind == DeviceKind::Cuda {
        return Err(Error::invalid("--backend", "mpi", "nccl with --device cuda (the mpi backend moves CPU tensors)"));
    }

    // 1. setup(): the process group. Every rank runs this same code.
    let pg = setup(backend)?;
    let (rank, world_size) = (pg.rank(), pg.world_size());
    let local_rank = DistEnv::from_env()?.local_rank;
    let device = device_kind.resolve(local_rank)?;

    // 2. The model, the same seed everywhere (DDP also broadcasts rank 0's weights).
    tch::manual_seed(cfg.train.seed as i64);
    let mnist = cfg.train.load_mnist()?;
    let (train, test) = (mnist.train.to_device(device), mnist.test.to_device(device));
    let vs = nn::VarStore::new(device);
    let net = BasicNet::new(&vs.root(), BasicNetConfig::default());

    // 3. Wrap it: broadcast from rank 0, gradient buckets.
    let mut model = DistributedDataParallel::new(net, &*pg, DdpConfig { bucket_cap_mb: cfg.bucket_cap_mb })?;
    if cfg.explain && rank == 0 {
        println!("{}\n", model.explain());
    }
    // 4. The optimizer over the wrapped model's parameters (they live in `vs`).
    let mut optimizer = adamw(&vs, cfg.train.lr)?;
    // Dropout masks differ per rank, as independent workers' would.
    tch::manual_seed(cfg.train.seed as i64 + rank as i64);

    // 5. A DistributedSampler: each rank sees its own 1/W of every epoch.
    let sampler = DistributedSampler::new(train.len(), world_size, rank, true, cfg.train.seed, false)?;
    let mut loader = DataLoader::new(&train, cfg.train.batch_size, Box::new(sampler))?;

    // 6. The loop: zero_grad → forward → backward + gradient all-reduce → step.
    let (mut steps, mut samples, mut train_s, mut train_loss) = (0usize, 0usize, 0.0f64, 0.0f64);
    'epochs: for epoch in 1..=cfg.train.epochs {
        loader.set_epoch(epoch as u64 - 1);
        let t0 = Instant::now();
        let (mut loss_sum, mut n) = (0.0, 0usize);
        for (batch_idx, (images, labels)) in loader.iter().enumerate() {
            optimizer.zero_grad();
            let loss = model.forward_t(&images, true).nll_loss(&labels);
            model.backward(&loss)?;
            optimizer.step();
            let l = loss.double_value(&[]);
            (loss_sum, n, steps, samples) = (loss_sum + l, n + 1, steps + 1, samples + images.size()[0] as usize);
            if rank == 0 && cfg.train.log_interval > 0 && batch_idx % cfg.train.log_interval == 0 {
                println!(
                    "Train Epoch: {epoch} [{}/{} ({:.0}%)]\tLoss: {l:.6}\t(rank 0 of {world_size})",
                    batch_idx * cfg.train.batch_size,
                    loader.num_samples(),
                    100.0 * batch_idx as f64 / loader.len() as f64
                );
            }
            if cfg.train.max_steps.is_some_and(|m| steps >= m) {
                train_s += t0.elapsed().as_secs_f64();
                train_loss = loss_sum / n as f64;
                break 'epochs;
            }
        }
        train_s += t0.elapsed().as_secs_f64();
        train_loss = loss_sum / n.max(1) as f64;
    }
    if cfg.check_sync {
        model.check_parameters_in_sync()?;
        if rank == 0 {
            println!("check-sync: parameters are bit-identical on all {world_size} ranks");
        }
    }

    // 7. Exact evaluation: disjoint slices, counts all-reduced.
    let eval = evaluate_distributed(&*pg, model.module(), &test, 1000)?;

    // 8. Figures: mean train loss over ranks, every rank's own figures gathered to all.
    let peak_rss_mib = ladder_core::memory::peak_rss_bytes().map(ladder_core::memory::mib).unwrap_or(0.0);
    let mine = [peak_rss_mib, samples as f64 / train_s.max(1e-9), model.comm_seconds(), train_s, train_loss];
    let mut all = Tensor::zeros([world_size as i64 * 5], (Kind::Double, pg.device()));
    pg.all_gather(&mut all, &Tensor::from_slice(&mine).to_device(pg.device()))?;
    let all = Vec::<f64>::try_from(all.to_device(Device::Cpu)).map_err(Error::Torch)?;
    let ranks: Vec<RankFigures> = all
        .chunks(5)
        .enumerate()
        .map(|(r, f)| RankFigures {
            rank: r,
            peak_rss_mib: f[0],
            samples_per_s: f[1],
            comm_s: f[2],
            train_s: f[3],
            model_state: Default::default(),
        })
        .collect();
    let slowest = ranks.iter().map(|r| r.train_s).fold(0.0, f64::max);
    let report = Report {
        accuracy: eval.accuracy(),
        eval_samples: eval.count as u64,
        test_loss: eval.mean_loss(),
        train_loss: all.chunks(5).map(|f| f[4]).sum::<f64>() / world_size as f64,
        samples_per_s: (samples * world_size) as f64 / slowest.max(1e-9),
        wall_s: start.elapsed().as_secs_f64(),
        peak_rss_mib: ranks.iter().map(|r| r.peak_rss_mib).fold(0.0, f64::max),
        steps: steps as u64,
        world_size,
        strategy: cfg.strategy.name().into(),
        ranks,
    };
    if rank == 0 {
        if let Some(path) = &cfg.train.metrics_json {
            report.write_json(path)?;
        }
    }
    pg.barrier()?;
    // 9. cleanup()
    cleanup(pg);
    Ok(report)
}
