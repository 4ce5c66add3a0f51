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
use ladder_core::data::{DataLoader, DistributedSampler, DistributedSamplerOptions};
use ladder_core::device::DeviceKind;
use ladder_core::dist::{self, Backend, DistEnv, ProcessGroup};
use ladder_core::eval::EvalSums;
use ladder_core::metrics::{gather_report, EpochFigures, LocalFigures, Report};
use ladder_core::model::{BasicNet, BasicNetConfig};
use ladder_core::optim::{AdamW, AdamWConfig, OffloadStats};
use ladder_core::parallel::{BackwardPrefetch, NvmeOffload, OptimizerOffload, Precision, StrategyOptions, WrapConfig, WrappedModel};
use ladder_core::recipe::{end_of_epoch, seed_batch, TrainArgs};
use ladder_core::timing::{Phase, StepTimer};
use ladder_core::{Error, Result};
use serde::{Deserialize, Serialize};
use std::time::Instant;
use tch::nn;

pub use ladder_core::parallel::Strategy;

/// Level 1's command line: the baseline's training flags plus the distributed ones.
#[derive(Debug, Clone, Parser, Serialize, Deserialize)]
#[command(
    name = "level1-raw-ddp",
    version,
    about = "Level 1: BasicNet on MNIST with a raw process group, a DistributedSampler and DistributedDataParallel",
    after_help = format!("Launch: `target/release/level1-raw-ddp` (1 process), `target/release/ladder-run --nproc-per-node 2 target/release/level1-raw-ddp`, or `mpirun -n 2 target/release/level1-raw-ddp`.\n\n{}", ladder_core::cli::ENVIRONMENT_HELP),
    allow_negative_numbers = true
)]
pub struct Config {
    /// The baseline's training flags (data, batch size, epochs, seed, device, outputs).
    #[command(flatten)]
    pub train: TrainArgs,
    /// Communication backend (the process group). Default: nccl when training on cuda, else
    /// mpi (as torch.distributed picks nccl for GPUs and gloo for CPUs). Under ladder-run, pass
    /// ladder-run the same --backend: it starts the ranks the way this backend needs.
    #[arg(long, value_enum, value_parser = ladder_core::cli::choice::<Backend>())]
    pub backend: Option<Backend>,
    /// How the model is replicated across ranks.
    #[arg(long, value_parser = ladder_core::cli::spelling::<Strategy>(), default_value_t = Strategy::default())]
    pub strategy: Strategy,
    /// DDP gradient bucket size cap in MiB (PyTorch's bucket_cap_mb; the first bucket is 1 MiB)
    /// [default: 25; --strategy ddp only].
    #[arg(long, value_name = "MIB")]
    pub bucket_cap_mb: Option<f64>,
    /// ZeRO-1: wrap AdamW as PyTorch's ZeroRedundancyOptimizer — each rank keeps and steps the
    /// optimizer state of its 1/W of the parameters (a flat, contiguous partition), then every
    /// rank's updated block is broadcast [--strategy ddp only].
    #[arg(long)]
    #[serde(default)]
    pub zero_redundancy_optimizer: bool,
    /// FSDP auto-wrap: a layer with at least this many parameters gets its own FlatParameter;
    /// the rest share the root one (PyTorch's size_based_auto_wrap_policy). 0 wraps every
    /// layer [default: 100000000, i.e. the whole model is one unit; FSDP strategies only].
    #[arg(long, value_name = "N")]
    pub fsdp_min_num_params: Option<usize>,
    /// FSDP's backward_prefetch: when FULL_SHARD's backward starts all-gathering the next
    /// unit [default: backward-pre, PyTorch's, where levels 2 and 3 follow Accelerate's
    /// no-prefetch; FSDP strategies only].
    #[arg(long, value_parser = ladder_core::cli::spelling::<BackwardPrefetch>())]
    pub fsdp_backward_prefetch: Option<BackwardPrefetch>,
    /// FSDP's forward_prefetch: start the next unit's all-gather before the current unit's
    /// forward [default: off, PyTorch's; FSDP strategies only].
    #[arg(long)]
    #[serde(default)]
    pub fsdp_forward_prefetch: bool,
    /// HSDP's shard-group size (Accelerate's ParallelismConfig dp_shard_size): the hybrid
    /// strategies shard over runs of this many consecutive ranks and replicate across the
    /// world_size / N runs (dp_replicate_size); it must divide the world size [default:
    /// LOCAL_WORLD_SIZE, the ranks of one node; fsdp-hybrid-shard(-zero2) only].
    #[arg(long, value_name = "N")]
    #[serde(default)]
    pub dp_shard_size: Option<usize>,
    /// FSDP CPU offload, as PyTorch's CPUOffload(offload_params=True): the parameter shards,
    /// their gradients and AdamW's moments live in host memory (pinned with --device cuda) and
    /// the optimizer steps there; each unit's shard is copied to the device before each
    /// all-gather and the reduced gradient shard back after it — less GPU memory for host-device
    /// traffic (on --device cpu, host-to-host copies: the same weights, counted in the metrics
    /// JSON's cpu_offload) [FSDP strategies only].
    #[arg(long)]
    #[serde(default)]
    pub cpu_offload: bool,
    /// Output features of BasicNet's fc1 (the tutorial's 128; 4096 gives ~38M parameters, for
    /// memory comparisons).
    #[arg(long, default_value_t = 128)]
    pub width: i64,
    /// Mixed precision: no (fp32), or bf16 — forward and backward in bf16 with fp32 master
    /// weights, fp32 AdamW state and fp32 gradient reduction (FSDP's
    /// `MixedPrecision(param_dtype=bfloat16, reduce_dtype=float32)`; with --strategy ddp it runs
    /// on FSDP's NO_SHARD path). The same policy as the Accelerator's and the Trainer's bf16.
    #[arg(long, value_parser = ladder_core::cli::spelling_among(&[Precision::No, Precision::Bf16]), default_value_t = Precision::No)]
    #[serde(default)]
    pub mixed_precision: Precision,
    /// Activation checkpointing (torch.utils.checkpoint, non-reentrant, around each of
    /// BasicNet's segments): forward keeps each segment's input only, backward recomputes the
    /// segment, dropout replaying its mask — fewer activations kept for one more forward per
    /// step, the same weights. Any strategy. On BasicNet it saves little or nothing: at the
    /// tutorial's width the peak is conv2's backward, which the recompute brings back, and on a
    /// CPU the heap keeps the peak of the run without (the book's "Will it fit?").
    #[arg(long)]
    #[serde(default)]
    pub activation_checkpointing: bool,
    /// Optimizer offload to disk, as DeepSpeed's `offload_optimizer: {"device": "nvme",
    /// "nvme_path": DIR}` (PyTorch has no such option): AdamW's two moments live in one file per
    /// rank under DIR (an existing, writable directory; removed at exit), streamed through a
    /// 4 MiB buffer per moment at each step — less memory for disk traffic, the same weights.
    /// Any strategy (with ZeRO-1 or FSDP, each rank's shard).
    #[arg(long, value_name = "DIR")]
    #[serde(default)]
    pub offload_optimizer_nvme_path: Option<std::path::PathBuf>,
    /// Print the gradient bucket layout (DDP) or the FlatParameter shard layout (FSDP) at
    /// start-up (rank 0).
    #[arg(long)]
    pub explain: bool,
    /// After training, check that every rank holds bit-identical parameters (one Max and one
    /// Min all-reduce of all parameters).
    #[arg(long)]
    pub check_sync: bool,
    /// Skip the evaluation after each epoch, for quick checks (Transformers' `eval_strategy
    /// no`): the test figures are then reported over 0 images.
    #[arg(long)]
    #[serde(default)]
    pub no_eval: bool,
}

/// Level 1's flag for each option [`Strategy::with_options`] and the core name (the
/// core's errors say `bucket_cap_mb`; the user typed `--bucket-cap-mb`).
pub const FLAG_NAMES: &[(&str, &str)] = &[
    ("bucket_cap_mb", "--bucket-cap-mb"),
    ("min_num_params", "--fsdp-min-num-params"),
    ("backward_prefetch", "--fsdp-backward-prefetch"),
    ("forward_prefetch", "--fsdp-forward-prefetch"),
    ("zero_redundancy_optimizer", "--zero-redundancy-optimizer"),
    ("dp_shard_size", "--dp-shard-size"),
    ("offload_params", "--cpu-offload"),
];

impl Config {
    /// The strategy these flags stand for: `--strategy` with the DDP or FSDP flags given laid
    /// over its defaults (PyTorch's: `bucket_cap_mb` 25; one FSDP unit, `BACKWARD_PRE`).
    ///
    /// # Errors
    /// A flag of the other kind of strategy, or a bad `--bucket-cap-mb`, named by its flag.
    pub fn wrap_config(&self) -> Result<WrapConfig> {
        let given = StrategyOptions {
            bucket_cap_mb: self.bucket_cap_mb,
            min_num_params: self.fsdp_min_num_params,
            backward_prefetch: self.fsdp_backward_prefetch,
            forward_prefetch: self.fsdp_forward_prefetch.then_some(true),
            zero_redundancy_optimizer: self.zero_redundancy_optimizer.then_some(true),
            dp_shard_size: self.dp_shard_size,
            offload_params: self.cpu_offload.then_some(true),
        };
        let strategy = self.strategy.with_options(&given).map_err(|e| match e.named_by(FLAG_NAMES) {
            Error::OptionNotForStrategy { option, belongs_to, .. } => {
                Error::OptionNotForStrategy { option, strategy: format!("--strategy {}", self.strategy), belongs_to }
            }
            other => other,
        })?;
        let wrap = WrapConfig { strategy, mixed_precision: self.mixed_precision, activation_checkpointing: self.activation_checkpointing };
        wrap.validate().map_err(|e| match e.named_by(FLAG_NAMES) {
            Error::OptionNotForStrategy { option, belongs_to, .. } => {
                Error::OptionNotForStrategy { option, strategy: format!("--mixed-precision {}", self.mixed_precision), belongs_to }
            }
            other => other,
        })?;
        Ok(wrap)
    }
}

/// `setup(rank, world_size)` of the tutorial: initialise the process group from the launcher's
/// environment (RANK, WORLD_SIZE, … or mpirun's) and set this rank's intra-op threads.
///
/// The group lives until [`cleanup`]. A rank that leaves early with an error never reaches
/// it: the group is then left unfinalised, so the rank reports its error at once and exits,
/// and the launcher (mpirun) stops the ranks still waiting for it — instead of this rank
/// waiting for them at shutdown.
///
/// `timeout` bounds every collective (`init_process_group(backend, timeout=...)`): a rank
/// that waits longer for the others fails with an error naming the ranks that did not arrive,
/// and the job ends.
///
/// # Errors
/// A contradictory environment, an unavailable backend.
pub fn setup(backend: Backend, timeout: std::time::Duration) -> Result<&'static dyn ProcessGroup> {
    Ok(dist::leak(dist::init_process_group_with_timeout(backend, timeout)?))
}

/// `cleanup()` of the tutorial: `destroy_process_group()` (waits for the other ranks, at most
/// `LADDER_SHUTDOWN_TIMEOUT_S`).
pub fn cleanup(pg: &dyn ProcessGroup) {
    pg.shutdown();
}

/// Trains and evaluates as configured; rank 0's report carries every rank's figures.
///
/// # Errors
/// Bad flags, data errors, process-group and collective errors.
pub fn run(cfg: &Config) -> Result<Report> {
    let start = Instant::now();
    let plan = Plan::new(cfg)?;
    // The wrapper checks what needs the world size (HSDP's --dp-shard-size): name its flags.
    train_ddp(cfg, &cfg.train, &plan, start).map_err(|e| e.named_by(FLAG_NAMES))
}

/// What is settled before the tutorial's code runs: the flags checked, the strategy with its
/// options, the backend for the device.
struct Plan {
    wrap: WrapConfig,
    offload: OptimizerOffload,
    backend: Backend,
    device_kind: DeviceKind,
}

impl Plan {
    /// # Errors
    /// A bad flag, named; a backend that cannot move the device's tensors.
    fn new(cfg: &Config) -> Result<Self> {
        cfg.train.validate()?;
        if cfg.width < 1 {
            return Err(Error::invalid("--width", cfg.width, "at least 1 output feature for fc1"));
        }
        let wrap = cfg.wrap_config()?;
        let offload = match &cfg.offload_optimizer_nvme_path {
            Some(dir) => OptimizerOffload::Nvme(NvmeOffload::new(dir)),
            None => OptimizerOffload::None,
        };
        offload.validate().map_err(|e| e.named_by(&[("nvme_path", "--offload-optimizer-nvme-path")]))?;
        cfg.train.check_device()?; // before setup() asks the backend for it, so that the error names --device
        let device_kind = cfg.train.device_kind();
        let backend = cfg.backend.unwrap_or(match device_kind {
            DeviceKind::Cuda => Backend::Nccl,
            DeviceKind::Cpu => Backend::Mpi,
        });
        match (backend, device_kind) {
            (Backend::Mpi, DeviceKind::Cuda) => {
                Err(Error::invalid("--backend", "mpi", "nccl with --device cuda (the mpi backend moves CPU tensors)"))
            }
            (Backend::Nccl, DeviceKind::Cpu) => {
                Err(Error::invalid("--backend", "nccl", "mpi with --device cpu (nccl moves CUDA tensors only)"))
            }
            _ => Ok(Plan { wrap, offload, backend, device_kind }),
        }
    }
}

/// The tutorial's `train_ddp`: what a level-1 user writes is between the `user_code` anchors
/// (the book's listing, the demo's line count; a `(continued)` span goes on from the one
/// before). What the harness adds is cut out of the spans, as at every level: the flag checks,
/// `--explain`, the step timer and its laps, and [`finish`] between the last evaluation and
/// `cleanup()`.
fn train_ddp(cfg: &Config, args: &TrainArgs, plan: &Plan, start: Instant) -> Result<Report> {
    // ANCHOR: user_code
    // 1. setup(): the process group. Every rank runs this same code.
    let pg = setup(plan.backend, args.collective_timeout())?;
    let (rank, world_size, env) = (pg.rank(), pg.world_size(), DistEnv::from_env()?);
    let device = plan.device_kind.resolve(env.local_rank)?;

    // 2. The model, the same seed everywhere (DDP also broadcasts rank 0's weights).
    tch::manual_seed(args.seed as i64);
    let mnist = args.load_mnist()?;
    // ANCHOR_END: user_code
    args.check_batch_size(mnist.train.len(), world_size)?; // the binary's checks of its flags
    args.check_batch_memory(cfg.width, env.local_world_size, device)?; // fits in free memory
                                                                       // ANCHOR: user_code (continued)
    let (train, test) = (mnist.train.to_device(device), mnist.test.to_device(device));
    let vs = nn::VarStore::new(device);
    let net = BasicNet::new(&vs.root(), BasicNetConfig { width: cfg.width, ..Default::default() });

    // 3. Wrap it. DDP: broadcast from rank 0, gradient buckets. FSDP: FlatParameters, shards.
    let mut model = WrappedModel::new(vs, net, pg, &plan.wrap)?;

    // ANCHOR_END: user_code
    if cfg.explain && rank == 0 {
        println!("{}\n", model.explain());
    }
    // ANCHOR: user_code (continued)
    // 4. The optimizer over the wrapped model's parameters (for FSDP: this rank's shards only).
    let mut optimizer = model.optimizer_with_offload(AdamWConfig { lr: args.lr, ..AdamWConfig::default() }, &plan.offload)?;

    // 5. A DistributedSampler: each rank sees its own 1/W of every epoch.
    let sampler =
        DistributedSampler::new(train.len(), world_size, rank, DistributedSamplerOptions { seed: args.seed, ..Default::default() })?;
    let mut loader = DataLoader::new(&train, args.batch_size, Box::new(sampler))?;
    // ANCHOR_END: user_code
    ladder_core::recipe::check_batch_counts(pg, loader.len())?; // every rank runs as many steps
                                                                // ANCHOR: user_code (continued)

    // 6. The loop: zero_grad → forward → backward + gradient all-reduce → step; after every
    //    epoch, test() — exact evaluation: disjoint slices, counts all-reduced.
    let (mut steps, mut train_loss, mut history, mut eval) = (0usize, 0.0, Vec::new(), EvalSums::default());
    // ANCHOR_END: user_code
    let mut timer = StepTimer::start(device); // the harness's clock: step times by phase, communication apart
                                              // ANCHOR: user_code (continued)
    for epoch in 1..=args.epochs {
        loader.set_epoch(epoch as u64 - 1);
        let (mut loss_sum, mut n, mut stop) = (0.0, 0usize, false);
        let batches = loader.iter();
        // ANCHOR_END: user_code
        let batches = timer.timed(batches, model.comm()); // each batch one timed step
                                                          // ANCHOR: user_code (continued)
        for (batch_idx, (images, labels)) in batches.enumerate() {
            // Dropout masks: a function of (seed, rank, batch), different on every rank.
            seed_batch(args.seed, rank, steps as u64);
            optimizer.zero_grad();
            let loss = model.forward_t(&images, true)?.nll_loss(&labels);
            // ANCHOR_END: user_code
            timer.lap(Phase::Forward, model.comm());
            // ANCHOR: user_code (continued)
            model.backward(&loss)?;
            // ANCHOR_END: user_code
            timer.lap(Phase::Backward, model.comm());
            // ANCHOR: user_code (continued)
            let l = loss.double_value(&[]);
            if !args.allow_non_finite {
                model.check_finite(steps as u64 + 1, l)?; // a NaN/inf stops every rank
            }
            optimizer.step();
            (loss_sum, n, steps) = (loss_sum + l, n + 1, steps + 1);
            if rank == 0 && args.log_interval > 0 && batch_idx % args.log_interval == 0 {
                println!(
                    "Train Epoch: {epoch} [{}/{} ({:.0}%)]\tLoss: {l:.6}\t(rank 0 of {world_size})",
                    batch_idx * args.batch_size,
                    loader.num_samples(),
                    100.0 * batch_idx as f64 / loader.len() as f64
                );
            }
            if args.max_steps.is_some_and(|m| steps >= m) {
                stop = true;
                break;
            }
        }
        train_loss = loss_sum / n.max(1) as f64;
        // 7. test(): every image once at any world size (unless --no-eval).
        eval = if cfg.no_eval { EvalSums::default() } else { model.evaluate(&test, 1000)? };
        history.push(end_of_epoch(Some(pg), epoch, n, train_loss, &eval)?);
        if stop {
            break;
        }
    }

    // ANCHOR_END: user_code
    let report = finish(cfg, pg, (&model, &optimizer), &timer, Trained { steps, train_loss, eval, history }, start)?;
    // ANCHOR: user_code (continued)
    // 8. cleanup()
    cleanup(pg);
    // ANCHOR_END: user_code
    Ok(report)
}

/// What the tutorial's loop leaves for the report.
struct Trained {
    /// Optimizer steps this rank took.
    steps: usize,
    /// This rank's mean training loss over the last epoch.
    train_loss: f64,
    /// The last evaluation.
    eval: EvalSums,
    /// Every epoch's figures.
    history: Vec<EpochFigures>,
}

/// What the harness adds after the last evaluation, before `cleanup()`: `--check-sync`,
/// `--save-model`, and every rank's figures gathered into the report (with an offloaded
/// optimizer or FSDP's CPU offload, the per-step transfers, printed too), which rank 0 writes to `--metrics-json`.
/// Collective.
///
/// # Errors
/// Parameters out of sync, an unwritable `--save-model` or `--metrics-json` (named), collective
/// errors.
fn finish(
    cfg: &Config,
    pg: &dyn ProcessGroup,
    (model, optimizer): (&WrappedModel, &AdamW),
    timer: &StepTimer,
    trained: Trained,
    start: Instant,
) -> Result<Report> {
    if cfg.check_sync {
        model.check_parameters_in_sync()?;
        if pg.rank() == 0 {
            println!("check-sync: parameters are bit-identical on all {} ranks", pg.world_size());
        }
    }
    if let Some(path) = &cfg.train.save_model {
        if let Some(weights) = model.full_state_dict()? {
            ladder_core::recipe::save_weights(path, &weights)
                .map_err(|e| e.named_by(&[(ladder_core::recipe::WEIGHTS_FILE, "--save-model")]))?;
        }
    }
    // Every rank's own figures, gathered to all.
    let timing = timer.finish();
    let local = LocalFigures {
        samples: timing.samples,
        train_s: timer.loops_s(),
        train_loss: trained.train_loss,
        comm_s: model.comm_seconds(),
        model_state: optimizer.placed(model.memory()), // the moments' bytes on disk when offloaded
        timing,
    };
    let wall_s = start.elapsed().as_secs_f64();
    let mut report = gather_report(pg, &local, &trained.eval, trained.steps as u64, model.strategy().label(), wall_s)?;
    report.history = trained.history;
    if let Some((entry, line)) = model.cpu_offload_report() {
        report.extra.insert("cpu_offload".into(), entry);
        if pg.rank() == 0 {
            println!("{line}");
        }
    }
    if let (Some((_, total)), Some(dir)) = (optimizer.offload_stats(), &cfg.offload_optimizer_nvme_path) {
        let per_step = OffloadStats::per_step(&total);
        report.extra.insert("offload_optimizer".into(), serde_json::json!({ "device": "nvme", "nvme_path": dir, "per_step": per_step }));
        if pg.rank() == 0 {
            println!("{}", per_step.summary());
        }
    }
    if pg.rank() == 0 {
        cfg.train.write_metrics_json(&report)?;
    }
    pg.barrier()?;
    Ok(report)
}
