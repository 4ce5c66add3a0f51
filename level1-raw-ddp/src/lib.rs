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
use ladder_core::data::{DataLoader, Dataset, DistributedSampler};
use ladder_core::ddp::{DdpConfig, DistributedDataParallel};
use ladder_core::device::DeviceKind;
use ladder_core::dist::{self, Backend, DistEnv, ProcessGroup};
use ladder_core::fsdp::{FsdpConfig, FullyShardedDataParallel, ShardingStrategy};
use ladder_core::memory::ModelStateBytes;
use ladder_core::metrics::{RankFigures, Report};
use ladder_core::model::{BasicNet, BasicNetConfig};
use ladder_core::train::{adamw, evaluate_distributed, evaluate_distributed_with, EvalSums, TrainArgs};
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
    /// FSDP FULL_SHARD (ZeRO-3): parameters, gradients and optimizer state sharded; parameters
    /// gathered for forward, freed, gathered again for backward.
    FsdpFullShard,
    /// FSDP SHARD_GRAD_OP (ZeRO-2): gathered parameters kept from forward to backward.
    FsdpShardGradOp,
    /// FSDP NO_SHARD: full replicas, gradients all-reduced (DDP's behaviour, FSDP's code path).
    FsdpNoShard,
}

impl Strategy {
    /// The name used in reports (`ddp`, `fsdp-full-shard`, …).
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Ddp => "ddp",
            Strategy::FsdpFullShard => "fsdp-full-shard",
            Strategy::FsdpShardGradOp => "fsdp-shard-grad-op",
            Strategy::FsdpNoShard => "fsdp-no-shard",
        }
    }

    fn sharding(self) -> Option<ShardingStrategy> {
        match self {
            Strategy::Ddp => None,
            Strategy::FsdpFullShard => Some(ShardingStrategy::FullShard),
            Strategy::FsdpShardGradOp => Some(ShardingStrategy::ShardGradOp),
            Strategy::FsdpNoShard => Some(ShardingStrategy::NoShard),
        }
    }
}

/// The wrapped model: DDP or FSDP, one interface for the loop.
enum Wrapped<'pg> {
    Ddp { model: DistributedDataParallel<'pg, BasicNet>, vs: nn::VarStore },
    Fsdp(FullyShardedDataParallel<'pg, BasicNet>),
}

impl<'pg> Wrapped<'pg> {
    fn new(cfg: &Config, vs: nn::VarStore, net: BasicNet, pg: &'pg dyn ProcessGroup) -> Result<Self> {
        Ok(match cfg.strategy.sharding() {
            None => Wrapped::Ddp {
                model: DistributedDataParallel::new(net, pg, DdpConfig { bucket_cap_mb: cfg.bucket_cap_mb })?,
                vs,
            },
            Some(sharding_strategy) => Wrapped::Fsdp(FullyShardedDataParallel::new(
                vs,
                net,
                pg,
                FsdpConfig { sharding_strategy, min_num_params: cfg.fsdp_min_num_params, ..FsdpConfig::default() },
            )?),
        })
    }
    /// The optimizer over the wrapped model's parameters — for FSDP, over this rank's shards.
    fn optimizer(&self, lr: f64) -> Result<nn::Optimizer> {
        match self {
            Wrapped::Ddp { vs, .. } => adamw(vs, lr),
            Wrapped::Fsdp(m) => m.adamw(lr),
        }
    }
    fn forward_t(&mut self, xs: &Tensor, train: bool) -> Result<Tensor> {
        match self {
            Wrapped::Ddp { model, .. } => Ok(model.forward_t(xs, train)),
            Wrapped::Fsdp(m) => m.forward_t(xs, train),
        }
    }
    fn backward(&mut self, loss: &Tensor) -> Result<()> {
        match self {
            Wrapped::Ddp { model, .. } => model.backward(loss),
            Wrapped::Fsdp(m) => m.backward(loss),
        }
    }
    fn explain(&self) -> String {
        match self {
            Wrapped::Ddp { model, .. } => model.explain(),
            Wrapped::Fsdp(m) => m.explain(),
        }
    }
    fn check_parameters_in_sync(&self) -> Result<()> {
        match self {
            Wrapped::Ddp { model, .. } => model.check_parameters_in_sync(),
            Wrapped::Fsdp(m) => m.check_parameters_in_sync(),
        }
    }
    fn comm_seconds(&self) -> f64 {
        match self {
            Wrapped::Ddp { model, .. } => model.comm_seconds(),
            Wrapped::Fsdp(m) => m.comm_seconds(),
        }
    }
    /// Bytes of model state this rank holds (AdamW: two state tensors per parameter).
    fn memory(&self) -> ModelStateBytes {
        match self {
            Wrapped::Ddp { model, .. } => {
                let bytes: u64 =
                    model.named_parameters().iter().map(|(_, t)| (t.numel() * t.kind().elt_size_in_bytes()) as u64).sum();
                ModelStateBytes { parameters: bytes, gradients: bytes, optimizer: 2 * bytes, gathered_peak: 0 }
            }
            Wrapped::Fsdp(m) => m.memory(),
        }
    }
    fn evaluate(&mut self, pg: &dyn ProcessGroup, test: &Dataset) -> Result<EvalSums> {
        match self {
            Wrapped::Ddp { model, .. } => evaluate_distributed(pg, model.module(), test, 1000),
            Wrapped::Fsdp(m) => evaluate_distributed_with(pg, |x| m.forward_t(x, false), test, 1000),
        }
    }
}

/// Level 1's command line: the baseline's training flags plus the distributed ones.
#[derive(Debug, Clone, Parser, Serialize, Deserialize)]
#[command(
    name = "level1-raw-ddp",
    version,
    about = "Level 1: BasicNet on MNIST with a raw process group, a DistributedSampler and DistributedDataParallel",
    after_help = "Launch: `target/release/level1-raw-ddp` (1 process), `target/release/ladder-run --nproc-per-node 2 target/release/level1-raw-ddp`, or `mpirun -n 2 target/release/level1-raw-ddp`.",
    allow_negative_numbers = true
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
    /// FSDP auto-wrap: a layer with at least this many parameters gets its own FlatParameter;
    /// the rest share the root one (PyTorch's size_based_auto_wrap_policy; default 1e8, i.e.
    /// the whole model is one unit). 0 wraps every layer.
    #[arg(long, default_value_t = 100_000_000, value_name = "N")]
    pub fsdp_min_num_params: usize,
    /// Output features of BasicNet's fc1 (the tutorial's 128; 4096 gives ~38M parameters, for
    /// memory comparisons).
    #[arg(long, default_value_t = 128)]
    pub width: i64,
    /// Print the gradient bucket layout (DDP) or the FlatParameter shard layout (FSDP) at
    /// start-up (rank 0).
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
    if cfg.width < 1 {
        return Err(Error::invalid("--width", cfg.width, "at least 1 output feature for fc1"));
    }
    let device_kind = cfg.train.device_kind();
    let backend = cfg.backend.unwrap_or(match device_kind {
        DeviceKind::Cuda => Backend::Nccl,
        DeviceKind::Cpu => Backend::Mpi,
    });
    match (backend, device_kind) {
        (Backend::Mpi, DeviceKind::Cuda) => {
            return Err(Error::invalid("--backend", "mpi", "nccl with --device cuda (the mpi backend moves CPU tensors)"))
        }
        (Backend::Nccl, DeviceKind::Cpu) => {
            return Err(Error::invalid("--backend", "nccl", "mpi with --device cpu (nccl moves CUDA tensors only)"))
        }
        _ => {}
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
    let net = BasicNet::new(&vs.root(), BasicNetConfig { width: cfg.width, ..Default::default() });

    // 3. Wrap it. DDP: broadcast from rank 0, gradient buckets. FSDP: FlatParameters, shards.
    let mut model = Wrapped::new(cfg, vs, net, &*pg)?;
    if cfg.explain && rank == 0 {
        println!("{}\n", model.explain());
    }
    // 4. The optimizer over the wrapped model's parameters (for FSDP: this rank's shards only).
    let mut optimizer = model.optimizer(cfg.train.lr)?;
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
            let loss = model.forward_t(&images, true)?.nll_loss(&labels);
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
    let eval = model.evaluate(&*pg, &test)?;

    // 8. Figures: mean train loss over ranks, every rank's own figures gathered to all.
    let peak_rss_mib = ladder_core::memory::peak_rss_bytes().map(ladder_core::memory::mib).unwrap_or(0.0);
    let m = model.memory();
    let mine = [
        peak_rss_mib,
        samples as f64 / train_s.max(1e-9),
        model.comm_seconds(),
        train_s,
        train_loss,
        m.parameters as f64,
        m.gradients as f64,
        m.optimizer as f64,
        m.gathered_peak as f64,
    ];
    const N: usize = 9;
    let mut all = Tensor::zeros([(world_size * N) as i64], (Kind::Double, pg.device()));
    pg.all_gather(&mut all, &Tensor::from_slice(&mine).to_device(pg.device()))?;
    let all = Vec::<f64>::try_from(all.to_device(Device::Cpu)).map_err(Error::Torch)?;
    let ranks: Vec<RankFigures> = all
        .chunks(N)
        .enumerate()
        .map(|(r, f)| RankFigures {
            rank: r,
            peak_rss_mib: f[0],
            samples_per_s: f[1],
            comm_s: f[2],
            train_s: f[3],
            model_state: ModelStateBytes {
                parameters: f[5] as u64,
                gradients: f[6] as u64,
                optimizer: f[7] as u64,
                gathered_peak: f[8] as u64,
            },
        })
        .collect();
    let slowest = ranks.iter().map(|r| r.train_s).fold(0.0, f64::max);
    let report = Report {
        accuracy: eval.accuracy(),
        eval_samples: eval.count as u64,
        test_loss: eval.mean_loss(),
        train_loss: all.chunks(N).map(|f| f[4]).sum::<f64>() / world_size as f64,
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
            report.write_json(path).map_err(|e| Error::invalid("--metrics-json", path.display(), format!("a writable file ({e})")))?;
        }
    }
    pg.barrier()?;
    // 9. cleanup()
    cleanup(pg);
    Ok(report)
}
