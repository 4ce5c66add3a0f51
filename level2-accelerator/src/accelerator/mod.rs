//! The [`Accelerator`]: 🤗 Accelerate's small user-facing surface over the core's process
//! groups, DDP/FSDP wrapper, sampler and checkpoints.
//!
//! The user writes the loop of one device; the Accelerator makes it run on 1..N processes:
//!
//! ```text
//! let accelerator = Accelerator::new(AcceleratorConfig::default())?;  // reads the launcher's env
//! let model = accelerator.prepare_model(vs, net)?;                    // moved, wrapped (DDP/FSDP)
//! let mut optimizer = accelerator.prepare_optimizer(&model, AdamWConfig::default())?;
//! let options = DataLoaderOptions { batch_size: 64, shuffle: true, ..Default::default() };
//! let train = accelerator.prepare_data_loader(&dataset, options)?;  // sharded, set_epoch for you
//! for (x, y) in train.iter() {
//!     accelerator.accumulate(&model, || -> Result<()> {
//!         let loss = model.forward_t(&x, true)?.nll_loss(&y);
//!         accelerator.backward(&loss)?;      // scaled for accumulation, synced at the boundary
//!         optimizer.step()?;                  // only at the boundary
//!         optimizer.zero_grad();
//!         Ok(())
//!     })?;
//! }
//! ```
//!
//! Differences from Accelerate, by design:
//! * no global state: everything hangs off the `Accelerator` value, and dropping it (or
//!   [`end_training`](Accelerator::end_training)) destroys the process group;
//! * one model, one optimizer and any number of loaders per Accelerator (what `save_state`
//!   saves is then unambiguous);
//! * a short last accumulation window of an epoch is scaled by its own length (Accelerate
//!   divides by `gradient_accumulation_steps` always, under-weighting it);
//! * `gather_for_metrics` is exact for any batch size, world size and `drop_last`: it removes
//!   exactly the samples the sampler's padding duplicated, wherever they fall.
//!
//! One room per concept: the Accelerator (this file: construction, the process, preparing,
//! accumulation and backward), the run's shared state (`state.rs`: the gradient/accumulation
//! state and the step clock), the optimizer and what guards its step (`optimizer.rs`), the
//! prepared model (`model.rs`), the data loaders (`data_loader.rs`), collectives
//! (`collectives.rs`), checkpoints (`checkpoint.rs`) and trackers (`trackers.rs`:
//! `init_trackers`, `log`).

mod checkpoint;
mod collectives;
mod data_loader;
mod model;
mod optimizer;
mod state;
mod trackers;

pub use data_loader::{AcceleratedDataLoader, DataLoaderOptions};
pub use model::PreparedModel;
pub use optimizer::AcceleratedOptimizer;

use crate::config::{AcceleratorConfig, ResolvedConfig};
use crate::scaler::GradScaler;
use crate::{Error, Result};
use ladder_core::dist::{self, Backend, DistEnv, ProcessGroup};
use ladder_core::eval::EvalSums;
use ladder_core::metrics::{gather_report, LocalFigures, Report};
use ladder_core::model::BasicNet;
use ladder_core::optim::AdamWConfig;
use ladder_core::optim::OffloadStats;
use ladder_core::parallel::{OptimizerOffload, Precision, Strategy, WrapConfig, WrappedModel};
use ladder_core::timing::{Phase, StepTimer, StepTiming};
use optimizer::StepGuard;
use serde::{Deserialize, Serialize};
use state::Shared;
use std::cell::Cell;
use std::rc::Rc;
use tch::{nn, Device, Tensor};

/// DDP's keyword arguments, as Accelerate's `DistributedDataParallelKwargs`: the core's
/// [`DdpOptions`](ladder_core::parallel::DdpOptions) (`bucket_cap_mb`, 25 MiB) under
/// Accelerate's name.
pub use ladder_core::parallel::DdpOptions as DistributedDataParallelKwargs;

/// Process-group keyword arguments, as Accelerate's `InitProcessGroupKwargs`.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct InitProcessGroupKwargs {
    /// How long a collective may wait for the other processes before every waiting process
    /// fails with an error naming the ones that did not arrive, and the job ends
    /// (`init_process_group(timeout=...)`). `None`: `LADDER_COLLECTIVE_TIMEOUT_S`, else 600 s.
    pub timeout: Option<std::time::Duration>,
}

/// 🤗 Accelerate's `Accelerator`: owns the process group, wraps the model, shards the data,
/// and turns a single-device loop into a distributed one.
pub struct Accelerator {
    /// The process group, the prepared model and optimizer, and the run's state, shared with
    /// the prepared model, optimizer and loaders.
    shared: Rc<Shared>,
    config: ResolvedConfig,
    wrap: WrapConfig,
    /// Where the prepared optimizer keeps its moments (`offload_optimizer_device`).
    offload: OptimizerOffload,
    local_rank: usize,
    local_world_size: usize,
    /// The group was created here (and is destroyed with the Accelerator).
    owns_group: bool,
    /// `end_training` was called: dropping finalises the group.
    ended: Cell<bool>,
    /// The trackers `init_trackers` started (main process; see `trackers.rs`).
    trackers: std::cell::RefCell<Vec<crate::tracking::TensorBoardTracker>>,
}

impl std::fmt::Debug for Accelerator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Accelerator")
            .field("process_index", &self.process_index())
            .field("num_processes", &self.num_processes())
            .field("device", &self.device())
            .field("config", &self.config)
            .finish()
    }
}

impl Accelerator {
    /// Builds the Accelerator from `builder` (what the program sets explicitly), the launcher's
    /// environment (`ACCELERATE_*` from `ladder-accelerate launch`, the torchrun/mpirun rank
    /// variables) and the config file named by `ACCELERATE_CONFIG_FILE`, in that precedence;
    /// initialises the process group (MPI on CPU, NCCL on CUDA; one process needs no launcher)
    /// and picks the device: CPU when `cpu` is set or no GPU exists, else `cuda:LOCAL_RANK`.
    ///
    /// # Errors
    /// Invalid settings (named with their source: an `offload_optimizer_nvme_path` that is not
    /// a writable directory among them); `fp16` without a GPU; process-group errors.
    pub fn new(builder: AcceleratorConfig) -> Result<Self> {
        Self::with_kwargs(builder, DistributedDataParallelKwargs::default())
    }

    /// [`new`](Self::new) with DDP keyword arguments.
    ///
    /// # Errors
    /// As [`new`](Self::new); a non-positive `bucket_cap_mb`.
    pub fn with_kwargs(builder: AcceleratorConfig, ddp: DistributedDataParallelKwargs) -> Result<Self> {
        Self::with_kwargs_handlers(builder, ddp, InitProcessGroupKwargs::default())
    }

    /// [`new`](Self::new) with DDP and process-group keyword arguments (Accelerate's
    /// `kwargs_handlers=[DistributedDataParallelKwargs(...), InitProcessGroupKwargs(timeout=...)]`).
    ///
    /// # Errors
    /// As [`with_kwargs`](Self::with_kwargs).
    pub fn with_kwargs_handlers(
        builder: AcceleratorConfig,
        ddp: DistributedDataParallelKwargs,
        init: InitProcessGroupKwargs,
    ) -> Result<Self> {
        Self::with_resolved(resolve_from_env(&builder)?, ddp, init)
    }

    /// [`with_kwargs_handlers`](Self::with_kwargs_handlers) with settings resolved already
    /// ([`ResolvedConfig::resolve`]), for a program that looks at them first — level 2's
    /// binary checks its flags against the resolved strategy — without resolving twice.
    ///
    /// # Errors
    /// As [`with_kwargs`](Self::with_kwargs).
    pub fn with_resolved(config: ResolvedConfig, ddp: DistributedDataParallelKwargs, init: InitProcessGroupKwargs) -> Result<Self> {
        Self::build(config, ddp, init, None)
    }

    /// An Accelerator over a process group the program already set up (it is not destroyed
    /// when the Accelerator is dropped): several Accelerators in one process, one after the
    /// other, as tests need. The group's device must match the settings (CPU for `cpu`).
    ///
    /// # Errors
    /// As [`new`](Self::new).
    pub fn with_group(builder: AcceleratorConfig, ddp: DistributedDataParallelKwargs, pg: &'static dyn ProcessGroup) -> Result<Self> {
        Self::build(resolve_from_env(&builder)?, ddp, InitProcessGroupKwargs::default(), Some(pg))
    }

    fn build(
        config: ResolvedConfig,
        ddp: DistributedDataParallelKwargs,
        init: InitProcessGroupKwargs,
        group: Option<&'static dyn ProcessGroup>,
    ) -> Result<Self> {
        if !(ddp.bucket_cap_mb.is_finite() && ddp.bucket_cap_mb > 0.0) {
            return Err(ladder_core::Error::invalid("bucket_cap_mb", ddp.bucket_cap_mb, "a positive number of MiB").into());
        }
        let use_cuda = match group {
            Some(pg) => pg.device().is_cuda(),
            None => !config.cpu && ladder_core::device::cuda_available(),
        };
        check_training_settings(&config, use_cuda)?;
        crate::tracking::check_settings(&config)?;
        let offload = config.optimizer_offload()?;
        let env = DistEnv::from_env()?;
        let owns_group = group.is_none();
        let pg = match group {
            Some(pg) => pg,
            None => {
                let timeout = match init.timeout {
                    Some(t) => t,
                    None => dist::timeout_from_env()?,
                };
                let backend = if use_cuda { Backend::Nccl } else { Backend::Mpi };
                dist::leak(dist::init_process_group_with_timeout(backend, timeout)?)
            }
        };
        let scaler = (config.mixed_precision == Precision::Fp16).then(GradScaler::default);
        let shared = Rc::new(Shared::new(pg, config.gradient_accumulation_steps, config.seed.unwrap_or(0), StepGuard::new(scaler)));
        let acc = Self {
            shared,
            wrap: config.wrap_config(ddp),
            offload,
            config,
            local_rank: env.local_rank,
            local_world_size: env.local_world_size,
            owns_group,
            ended: Cell::new(false),
            trackers: Default::default(),
        };
        if let Some(seed) = acc.config.seed {
            acc.set_seed(seed);
        }
        Ok(acc)
    }

    /// The resolved settings and where each came from.
    pub fn config(&self) -> &ResolvedConfig {
        &self.config
    }

    /// How the model is wrapped (DDP, or an FSDP sharding strategy).
    pub fn strategy(&self) -> Strategy {
        self.wrap.strategy
    }

    /// Everything [`prepare_model`](Self::prepare_model) wraps the model with: the strategy,
    /// DDP's bucket cap, FSDP's auto-wrap threshold and prefetch settings, mixed precision
    /// (see [`ResolvedConfig::wrap_config`]).
    pub fn wrap_config(&self) -> &WrapConfig {
        &self.wrap
    }

    /// The device this process trains on (`cpu` or `cuda:LOCAL_RANK`).
    pub fn device(&self) -> Device {
        self.shared.device
    }

    /// Number of processes (the world size).
    pub fn num_processes(&self) -> usize {
        self.shared.pg.world_size()
    }

    /// This process's global rank.
    pub fn process_index(&self) -> usize {
        self.shared.pg.rank()
    }

    /// This process's rank on its node.
    pub fn local_process_index(&self) -> usize {
        self.local_rank
    }

    /// Processes on this node.
    pub fn local_num_processes(&self) -> usize {
        self.local_world_size
    }

    /// True on global rank 0.
    pub fn is_main_process(&self) -> bool {
        self.process_index() == 0
    }

    /// True on local rank 0 (one process per node).
    pub fn is_local_main_process(&self) -> bool {
        self.local_rank == 0
    }

    /// The micro-batches per optimizer step.
    pub fn gradient_accumulation_steps(&self) -> usize {
        self.config.gradient_accumulation_steps
    }

    /// The mixed-precision mode.
    pub fn mixed_precision(&self) -> Precision {
        self.config.mixed_precision
    }

    /// Accelerate's `set_seed(seed)`: seeds libtorch (weights initialised after this are the
    /// same on every process), the loaders' shuffle, and the per-batch dropout seeds.
    pub fn set_seed(&self, seed: u64) {
        self.shared.state.borrow_mut().gradient.seed = seed;
        tch::manual_seed(seed as i64);
    }

    /// `set_seed(seed, device_specific=True)`: libtorch is seeded with `seed + process_index`
    /// (the global rank, never the local one, so two nodes never share a stream); the loaders'
    /// shuffle keeps `seed`, which must be the same on every rank.
    pub fn set_seed_device_specific(&self, seed: u64) {
        self.shared.state.borrow_mut().gradient.seed = seed;
        tch::manual_seed(seed.wrapping_add(self.process_index() as u64) as i64);
    }

    /// The seed in use (0 until [`set_seed`](Self::set_seed), as `DistributedSampler`'s default).
    pub fn seed(&self) -> u64 {
        self.shared.state.borrow().gradient.seed
    }

    /// Moves the model (built in `vs`) to this process's device and wraps it as configured:
    /// DDP (rank 0's weights broadcast, gradient buckets) or FSDP (FlatParameters sharded).
    /// Collective.
    ///
    /// # Errors
    /// A second model (one per Accelerator); wrapping errors.
    pub fn prepare_model(&self, mut vs: nn::VarStore, net: BasicNet) -> Result<PreparedModel> {
        self.shared.ensure_no_model()?;
        if vs.device() != self.device() {
            vs.set_device(self.device());
        }
        self.shared.set_model(WrappedModel::new(vs, net, self.shared.pg, &self.wrap)?)?;
        Ok(PreparedModel { shared: self.shared.clone() })
    }

    /// AdamW over what this rank owns of `model` (all parameters for DDP, its shards for FSDP),
    /// stepping only at accumulation boundaries. With `offload_optimizer_device` nvme its
    /// moments live in this process's file under `offload_optimizer_nvme_path` (DeepSpeed's
    /// ZeRO-Infinity optimizer offload; see [`ladder_core::parallel::offload`]), removed when
    /// the Accelerator is dropped.
    ///
    /// # Errors
    /// A second optimizer; an out-of-range hyper-parameter; the moments' file cannot be created.
    pub fn prepare_optimizer(&self, model: &PreparedModel, config: AdamWConfig) -> Result<AcceleratedOptimizer> {
        self.shared.ensure_no_optimizer()?;
        let opt = model.inner().borrow().optimizer_with_offload(config, &self.offload)?;
        self.shared.set_optimizer(opt)?;
        Ok(AcceleratedOptimizer { shared: self.shared.clone() })
    }

    /// Runs `f` as one micro-batch of an accumulation window (`with accelerator.accumulate(model)`):
    /// the gradient sync happens only on the window's last micro-batch — every
    /// `gradient_accumulation_steps`-th batch of the loader, or its last batch — and the
    /// optimizer steps only then. Windows restart with every epoch.
    pub fn accumulate<R>(&self, model: &PreparedModel, f: impl FnOnce() -> R) -> R {
        let sync = self.shared.state.borrow_mut().gradient.enter_micro_batch();
        model.inner().borrow_mut().set_require_backward_grad_sync(sync);
        f()
    }

    /// True when the current micro-batch ends an accumulation window (the optimizer steps).
    pub fn sync_gradients(&self) -> bool {
        self.shared.state.borrow().gradient.sync_gradients()
    }

    /// `accelerator.backward(loss)`: divides the loss by the window's length (so k micro-batches
    /// of B give the gradient of one batch of k·B; a short last window by its own length),
    /// multiplies it by the loss scale under fp16, runs backward and — at a window's end —
    /// the gradient sync (DDP all-reduce or FSDP reduce-scatter).
    ///
    /// # Errors
    /// No prepared model; collective errors.
    pub fn backward(&self, loss: &Tensor) -> Result<()> {
        let model = self.shared.model("backward")?;
        let to_backward = {
            let mut state = self.shared.state.borrow_mut();
            let window = state.gradient.window_len();
            state.guard.loss_to_backward(loss, window)
        };
        self.shared.lap(Phase::Forward);
        model.borrow_mut().backward(&to_backward)?;
        self.shared.lap(Phase::Backward);
        Ok(())
    }

    /// Turns the divergence check on or off (default on; `--allow-non-finite` turns it off):
    /// at each optimizer step, a NaN/inf loss of the window or a NaN/inf gradient stops every
    /// process with an error naming the step and the process where it appeared
    /// ([`WrappedModel::check_finite`]). With fp16 loss scaling the gradients are the
    /// scaler's: an overflow still skips the step.
    pub fn set_check_finite(&self, on: bool) {
        self.shared.state.borrow_mut().guard.check_finite = on;
    }

    /// Clips the gradients by their global L2 norm (`clip_grad_norm_`), after unscaling them
    /// under fp16. Returns the total norm before clipping — or `None` inside an accumulation
    /// window, where gradients are not complete yet (call it when
    /// [`sync_gradients`](Self::sync_gradients) is true, as Accelerate's examples do).
    ///
    /// # Errors
    /// A `max_norm` that is not positive and finite; collective errors (FSDP).
    pub fn clip_grad_norm_(&self, max_norm: f64) -> Result<Option<f64>> {
        if !self.sync_gradients() {
            return Ok(None);
        }
        let model = self.shared.model("clip_grad_norm_")?;
        self.shared.state.borrow_mut().guard.unscale(&model.borrow())?;
        let norm = model.borrow().clip_grad_norm(max_norm)?;
        Ok(Some(norm))
    }

    /// Runs `f` under autocast: on CUDA with mixed precision, libtorch's autocast; on CPU the
    /// prepared model already computes in the mixed-precision dtype, so `f` runs as it is.
    pub fn autocast<R>(&self, f: impl FnOnce() -> R) -> R {
        if self.device().is_cuda() && self.config.mixed_precision != Precision::No {
            tch::autocast(true, f)
        } else {
            f()
        }
    }

    /// The loss scaler in use (fp16), if any.
    pub fn grad_scaler(&self) -> Option<GradScaler> {
        self.shared.state.borrow().guard.scaler
    }

    /// Installs (or removes) a loss scaler. fp16 installs one by itself; with fp32 or bf16 it is
    /// legal but rarely useful (as `GradScaler` in PyTorch) — tests use it to inject an overflow
    /// on the CPU.
    pub fn set_grad_scaler(&self, scaler: Option<GradScaler>) {
        self.shared.state.borrow_mut().guard.scaler = scaler;
    }

    /// Optimizer steps taken so far.
    pub fn global_step(&self) -> u64 {
        self.shared.state.borrow().gradient.global_step
    }

    /// True when the last `optimizer.step()` was skipped because fp16 gradients overflowed.
    pub fn optimizer_step_was_skipped(&self) -> bool {
        self.shared.state.borrow().guard.step_was_skipped
    }

    /// The step figures timed inside the Accelerator (see [`ladder_core::timing`]): the
    /// training loader marks the data phase, [`backward`](Self::backward) forward and
    /// backward (communication apart), the prepared optimizer's step the optimizer phase and
    /// the step's end. `None` before a training loader ran.
    pub fn step_timing(&self) -> Option<StepTiming> {
        self.shared.state.borrow().timer.as_ref().map(StepTimer::finish)
    }

    /// Restarts the step clock: what passed since the last step ended (evaluation, a
    /// checkpoint inside the loop) belongs to no step. The Trainer calls it after its
    /// evaluations and saves.
    pub fn restart_step_clock(&self) {
        self.shared.resume_clock(false);
    }

    /// Gathers every process's figures into the run's report (the same JSON as level 1's,
    /// plus `mixed_precision`, `gradient_accumulation_steps` and `num_processes`); the step
    /// figures are the Accelerator's own ([`step_timing`](Self::step_timing)) unless `local`
    /// brings some. `local.model_state` is the prepared model's
    /// [`memory`](PreparedModel::memory): the prepared optimizer places it (the moments'
    /// bytes on disk when offloaded), and adds, as level 1 does, `offload_optimizer`
    /// (`device`, `nvme_path`, this process's mean `per_step` bytes read and written and
    /// seconds) and, with `fsdp_offload_params`, `cpu_offload` (see
    /// [`WrappedModel::cpu_offload_report`](ladder_core::parallel::WrappedModel::cpu_offload_report)),
    /// each printed by the main process. Collective.
    ///
    /// # Errors
    /// Collective errors.
    pub fn gather_report(&self, local: &LocalFigures, eval: &EvalSums, wall_s: f64) -> Result<Report> {
        let mut local = *local;
        if local.timing.steps == 0 {
            local.timing = self.step_timing().unwrap_or_default();
        }
        let stats = self.shared.optimizer("gather_report").ok().map(|opt| {
            let opt = opt.borrow();
            local.model_state = opt.placed(local.model_state);
            opt.offload_stats()
        });
        let mut report = gather_report(self.shared.pg, &local, eval, self.global_step(), self.wrap.strategy.label(), wall_s)?;
        report.extra.insert("mixed_precision".into(), self.config.mixed_precision.to_string().into());
        report.extra.insert("gradient_accumulation_steps".into(), self.gradient_accumulation_steps().into());
        report.extra.insert("num_processes".into(), self.num_processes().into());
        if let Some((entry, line)) = self.shared.model("gather_report").ok().and_then(|m| m.borrow().cpu_offload_report()) {
            report.extra.insert("cpu_offload".into(), entry);
            self.print(line);
        }
        if let (Some(Some((_, total))), OptimizerOffload::Nvme(o)) = (stats, &self.offload) {
            let per_step = OffloadStats::per_step(&total);
            let entry = serde_json::json!({ "device": "nvme", "nvme_path": o.nvme_path, "per_step": per_step });
            report.extra.insert("offload_optimizer".into(), entry);
            self.print(per_step.summary());
        }
        Ok(report)
    }

    /// Marks the run as complete, as Accelerate's `end_training()`: closes the trackers
    /// ([`init_trackers`](Self::init_trackers)); dropping the Accelerator then destroys the
    /// process group, waiting for the other processes (at most `LADDER_SHUTDOWN_TIMEOUT_S`).
    /// An Accelerator dropped without it — an error leaving the training function early —
    /// leaves the group unfinalised, so the process reports its error at once and exits, and
    /// the launcher stops the processes still waiting for it.
    pub fn end_training(&self) {
        self.trackers.borrow_mut().clear();
        self.ended.set(true);
    }
}

impl Drop for Accelerator {
    fn drop(&mut self) {
        // A panicking process aborts the job at once (shutdown does so while unwinding).
        if self.owns_group && (self.ended.get() || std::thread::panicking()) {
            self.shared.pg.shutdown();
        }
    }
}

/// The settings of `builder` over the launcher's variables and the config file they name.
fn resolve_from_env(builder: &AcceleratorConfig) -> Result<ResolvedConfig> {
    ResolvedConfig::resolve(builder, |k| std::env::var(k).ok())
}

/// Settings that cannot train: uneven batches (the shorter ranks' collectives would hang), fp16
/// without CUDA.
fn check_training_settings(config: &ResolvedConfig, use_cuda: bool) -> Result<()> {
    if !config.even_batches {
        return Err(Error::Conflict {
            first: format!("even_batches=false ({})", config.describe_source("even_batches")),
            second: "DDP/FSDP training".into(),
            why: "every rank must run the same number of batches, or the collectives of the shorter ranks hang; \
                  keep even_batches=true (gather_for_metrics already drops the padding it adds)"
                .into(),
        });
    }
    if config.mixed_precision == Precision::Fp16 && !use_cuda {
        return Err(Error::Conflict {
            first: format!("mixed_precision=fp16 ({})", config.describe_source("mixed_precision")),
            second: if config.cpu {
                format!("cpu=true ({})", config.describe_source("cpu"))
            } else {
                "a machine without a CUDA GPU".into()
            },
            why: "fp16 compute with loss scaling needs CUDA; use mixed_precision=bf16 on CPU".into(),
        });
    }
    Ok(())
}
