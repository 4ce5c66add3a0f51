//! The [`Accelerator`]: 🤗 Accelerate's small user-facing surface over the core's process
//! groups, DDP/FSDP wrapper, sampler and checkpoints.
//!
//! The user writes the loop of one device; the Accelerator makes it run on 1..N processes:
//!
//! ```text
//! let accelerator = Accelerator::new(AcceleratorConfig::default())?;  // reads the launcher's env
//! let model = accelerator.prepare_model(vs, net)?;                    // moved, wrapped (DDP/FSDP)
//! let mut optimizer = accelerator.prepare_optimizer(&model, AdamWConfig::default())?;
//! let train = accelerator.prepare_data_loader(&dataset, 64, true)?;  // sharded, set_epoch for you
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

use crate::config::{AcceleratorConfig, ResolvedConfig};
use crate::scaler::GradScaler;
use crate::{Error, Result};
use ladder_core::checkpoint::{self, Checkpoint, TrainingState};
use ladder_core::data::{Dataset, DistributedSampler, DistributedSamplerOptions, Sampler};
use ladder_core::dist::{self, Backend, DistEnv, ProcessGroup, ReduceOp};
use ladder_core::eval::EvalSums;
use ladder_core::memory::ModelStateBytes;
use ladder_core::metrics::{gather_report, LocalFigures, Report};
use ladder_core::model::{BasicNet, BasicNetConfig};
use ladder_core::optim::{AdamW, AdamWConfig};
use ladder_core::parallel::{Precision, Strategy, WrapConfig, WrappedModel};
use ladder_core::recipe::seed_batch;
use ladder_core::timing::{Comm, Phase, StepTimer, StepTiming};
use serde::{Deserialize, Serialize};
use std::cell::{Cell, RefCell};
use std::path::Path;
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

/// Where the last batch a loader handed out sits in its epoch: what `accumulate` needs for
/// the window, and `gather_for_metrics` for the padding.
#[derive(Debug, Clone, Copy)]
struct BatchPosition {
    /// Index of the batch in the epoch (0-based, counting skipped ones).
    index: usize,
    /// Batches in the epoch.
    num_batches: usize,
    /// Position of the batch's first sample in this rank's share of the epoch.
    local_start: usize,
    /// Samples in the batch (the same on every rank).
    len: usize,
    /// Samples in the dataset (without padding).
    dataset_len: usize,
}

/// State shared by the Accelerator, its loaders and its optimizer (Accelerate's
/// `GradientState`, plus the run's counters).
#[derive(Debug)]
struct Shared {
    rank: usize,
    world_size: usize,
    accumulation_steps: usize,
    seed: Cell<u64>,
    sync_gradients: Cell<bool>,
    /// Micro-batches in the current accumulation window (k, or fewer at an epoch's end).
    window_len: Cell<usize>,
    /// Micro-batches `accumulate` has seen outside any loader (for the window count).
    free_steps: Cell<u64>,
    /// Training micro-batches handed out over the run (the dropout seed of the next).
    batches_seen: Cell<u64>,
    /// Optimizer steps taken (skipped fp16 steps included, as Accelerate counts them).
    global_step: Cell<u64>,
    current: RefCell<Option<BatchPosition>>,
    scaler: RefCell<Option<GradScaler>>,
    step_was_skipped: Cell<bool>,
    /// Gradients of this window were unscaled already (fp16).
    unscaled: Cell<bool>,
    /// Stop on a NaN/inf loss or gradient (`set_check_finite`; default on).
    check_finite: Cell<bool>,
    /// The window's loss for that check: the first non-finite one, else the last.
    window_loss: Cell<f64>,
    /// The device (the step timer synchronizes CUDA).
    device: Device,
    /// The prepared model, for its communication totals.
    model: RefCell<Option<Rc<RefCell<WrappedModel<'static>>>>>,
    /// Step times and phases, started by the first training loader's first `iter()`.
    timer: RefCell<Option<StepTimer>>,
}

impl Shared {
    /// The prepared model's cumulative communication (zero before `prepare_model`).
    fn comm(&self) -> Comm {
        self.model.borrow().as_ref().and_then(|m| m.try_borrow().ok().map(|m| m.comm())).unwrap_or_default()
    }

    /// Ends `phase` of the step in progress, once timing has started.
    fn lap(&self, phase: Phase) {
        if self.timer.borrow().is_some() {
            let comm = self.comm();
            if let Some(t) = self.timer.borrow_mut().as_mut() {
                t.lap(phase, comm);
            }
        }
    }

    /// A training loader starts an epoch: the training phase starts (first time) or the clock
    /// restarts, leaving what passed since the last step (evaluation) out of every step.
    fn start_or_resume_timer(&self) {
        let comm = self.comm();
        let mut timer = self.timer.borrow_mut();
        match timer.as_mut() {
            Some(t) => t.resume(comm),
            None => {
                let mut t = StepTimer::start(self.device);
                t.resume(comm);
                *timer = Some(t);
            }
        }
    }
}

/// Epoch bookkeeping of one loader.
#[derive(Debug, Default)]
struct LoaderState {
    /// The epoch the next `iter()` runs.
    next_epoch: Cell<u64>,
    /// Batches the next `iter()` skips (resume).
    skip: Cell<usize>,
    /// The epoch in progress and the batches of it handed out, while one is.
    in_progress: Cell<Option<(u64, usize)>>,
}

/// 🤗 Accelerate's `Accelerator`: owns the process group, wraps the model, shards the data,
/// and turns a single-device loop into a distributed one.
pub struct Accelerator {
    pg: &'static dyn ProcessGroup,
    config: ResolvedConfig,
    device: Device,
    local_rank: usize,
    local_world_size: usize,
    wrap: WrapConfig,
    shared: Rc<Shared>,
    model: RefCell<Option<Rc<RefCell<WrappedModel<'static>>>>>,
    optimizer: RefCell<Option<Rc<RefCell<AdamW>>>>,
    train_loaders: RefCell<Vec<Rc<LoaderState>>>,
    /// The group was created here (and is destroyed with the Accelerator).
    owns_group: bool,
    /// `end_training` was called: dropping finalises the group.
    ended: Cell<bool>,
}

impl std::fmt::Debug for Accelerator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Accelerator")
            .field("process_index", &self.shared.rank)
            .field("num_processes", &self.shared.world_size)
            .field("device", &self.device)
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
    /// Invalid settings (named with their source); `fp16` without a GPU; process-group errors.
    pub fn new(builder: AcceleratorConfig) -> Result<Self> {
        Self::with_kwargs(builder, DistributedDataParallelKwargs::default())
    }

    /// [`new`](Self::new) with DDP keyword arguments.
    ///
    /// # Errors
    /// As [`new`](Self::new); a non-positive `bucket_cap_mb`.
    pub fn with_kwargs(builder: AcceleratorConfig, ddp: DistributedDataParallelKwargs) -> Result<Self> {
        Self::build(builder, ddp, InitProcessGroupKwargs::default(), None)
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
        Self::build(builder, ddp, init, None)
    }

    /// An Accelerator over a process group the program already set up (it is not destroyed
    /// when the Accelerator is dropped): several Accelerators in one process, one after the
    /// other, as tests need. The group's device must match the settings (CPU for `cpu`).
    ///
    /// # Errors
    /// As [`new`](Self::new).
    pub fn with_group(builder: AcceleratorConfig, ddp: DistributedDataParallelKwargs, pg: &'static dyn ProcessGroup) -> Result<Self> {
        Self::build(builder, ddp, InitProcessGroupKwargs::default(), Some(pg))
    }

    fn build(
        builder: AcceleratorConfig,
        ddp: DistributedDataParallelKwargs,
        init: InitProcessGroupKwargs,
        group: Option<&'static dyn ProcessGroup>,
    ) -> Result<Self> {
        let config = ResolvedConfig::resolve(&builder, |k| std::env::var(k).ok())?;
        if !(ddp.bucket_cap_mb.is_finite() && ddp.bucket_cap_mb > 0.0) {
            return Err(ladder_core::Error::invalid("bucket_cap_mb", ddp.bucket_cap_mb, "a positive number of MiB").into());
        }
        if !config.even_batches {
            return Err(Error::Conflict {
                first: format!("even_batches=false ({})", config.describe_source("even_batches")),
                second: "DDP/FSDP training".into(),
                why: "every rank must run the same number of batches, or the collectives of the shorter ranks hang; \
                      keep even_batches=true (gather_for_metrics already drops the padding it adds)"
                    .into(),
            });
        }
        let env = DistEnv::from_env()?;
        let use_cuda = match group {
            Some(pg) => pg.device().is_cuda(),
            None => !config.cpu && ladder_core::device::cuda_available(),
        };
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
        let backend = if use_cuda { Backend::Nccl } else { Backend::Mpi };
        let owns_group = group.is_none();
        let pg = match group {
            Some(pg) => pg,
            None => {
                let timeout = match init.timeout {
                    Some(t) => t,
                    None => dist::timeout_from_env()?,
                };
                dist::leak(dist::init_process_group_with_timeout(backend, timeout)?)
            }
        };
        let device = pg.device();
        let wrap = config.wrap_config(ddp);
        let shared = Rc::new(Shared {
            rank: pg.rank(),
            world_size: pg.world_size(),
            accumulation_steps: config.gradient_accumulation_steps,
            seed: Cell::new(config.seed.unwrap_or(0)),
            sync_gradients: Cell::new(true),
            window_len: Cell::new(1),
            free_steps: Cell::new(0),
            batches_seen: Cell::new(0),
            global_step: Cell::new(0),
            current: RefCell::new(None),
            scaler: RefCell::new((config.mixed_precision == Precision::Fp16).then(GradScaler::default)),
            step_was_skipped: Cell::new(false),
            unscaled: Cell::new(false),
            check_finite: Cell::new(true),
            window_loss: Cell::new(0.0),
            device,
            model: RefCell::new(None),
            timer: RefCell::new(None),
        });
        let acc = Self {
            pg,
            config,
            device,
            local_rank: env.local_rank,
            local_world_size: env.local_world_size,
            wrap,
            shared,
            model: RefCell::new(None),
            optimizer: RefCell::new(None),
            train_loaders: RefCell::new(Vec::new()),
            owns_group,
            ended: Cell::new(false),
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
        self.device
    }

    /// Number of processes (the world size).
    pub fn num_processes(&self) -> usize {
        self.shared.world_size
    }

    /// This process's global rank.
    pub fn process_index(&self) -> usize {
        self.shared.rank
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
        self.shared.rank == 0
    }

    /// True on local rank 0 (one process per node).
    pub fn is_local_main_process(&self) -> bool {
        self.local_rank == 0
    }

    /// The micro-batches per optimizer step.
    pub fn gradient_accumulation_steps(&self) -> usize {
        self.shared.accumulation_steps
    }

    /// The mixed-precision mode.
    pub fn mixed_precision(&self) -> Precision {
        self.config.mixed_precision
    }

    /// Accelerate's `set_seed(seed)`: seeds libtorch (weights initialised after this are the
    /// same on every process), the loaders' shuffle, and the per-batch dropout seeds.
    pub fn set_seed(&self, seed: u64) {
        self.shared.seed.set(seed);
        tch::manual_seed(seed as i64);
    }

    /// `set_seed(seed, device_specific=True)`: libtorch is seeded with `seed + process_index`
    /// (the global rank, never the local one, so two nodes never share a stream); the loaders'
    /// shuffle keeps `seed`, which must be the same on every rank.
    pub fn set_seed_device_specific(&self, seed: u64) {
        self.shared.seed.set(seed);
        tch::manual_seed(seed.wrapping_add(self.shared.rank as u64) as i64);
    }

    /// The seed in use (0 until [`set_seed`](Self::set_seed), as `DistributedSampler`'s default).
    pub fn seed(&self) -> u64 {
        self.shared.seed.get()
    }

    /// Moves the model (built in `vs`) to this process's device and wraps it as configured:
    /// DDP (rank 0's weights broadcast, gradient buckets) or FSDP (FlatParameters sharded).
    /// Collective.
    ///
    /// # Errors
    /// A second model (one per Accelerator); wrapping errors.
    pub fn prepare_model(&self, mut vs: nn::VarStore, net: BasicNet) -> Result<PreparedModel> {
        if self.model.borrow().is_some() {
            return Err(Error::Usage {
                op: "prepare_model",
                problem: "this Accelerator already prepared a model; ddp-ladder's Accelerator holds one model (and one optimizer)".into(),
            });
        }
        if vs.device() != self.device {
            vs.set_device(self.device);
        }
        let wrapped = Rc::new(RefCell::new(WrappedModel::new(vs, net, self.pg, &self.wrap)?));
        *self.model.borrow_mut() = Some(wrapped.clone());
        *self.shared.model.borrow_mut() = Some(wrapped.clone());
        Ok(PreparedModel { inner: wrapped })
    }

    /// AdamW over what this rank owns of `model` (all parameters for DDP, its shards for FSDP),
    /// stepping only at accumulation boundaries.
    ///
    /// # Errors
    /// A second optimizer; an out-of-range hyper-parameter.
    pub fn prepare_optimizer(&self, model: &PreparedModel, config: AdamWConfig) -> Result<AcceleratedOptimizer> {
        if self.optimizer.borrow().is_some() {
            return Err(Error::Usage {
                op: "prepare_optimizer",
                problem: "this Accelerator already prepared an optimizer; ddp-ladder's Accelerator holds one".into(),
            });
        }
        let opt = Rc::new(RefCell::new(model.inner.borrow().optimizer(config)?));
        *self.optimizer.borrow_mut() = Some(opt.clone());
        Ok(AcceleratedOptimizer { opt, model: model.inner.clone(), shared: self.shared.clone(), pg: self.pg })
    }

    /// A loader over `dataset` sharded across processes with a `DistributedSampler` (padded so
    /// every process gets the same number of batches, as `even_batches=True`), on this device.
    /// `batch_size` is per process, or global and split between processes with
    /// `split_batches`. A shuffled loader is a training loader: its epoch advances on every
    /// `iter()` (no `set_epoch` to forget), its position is saved by `save_state`, and each of
    /// its batches seeds dropout from (seed, rank, batch index).
    ///
    /// # Errors
    /// A zero batch size; with `split_batches`, a batch size the process count does not divide.
    pub fn prepare_data_loader<'d>(&self, dataset: &'d Dataset, batch_size: usize, shuffle: bool) -> Result<AcceleratedDataLoader<'d>> {
        let w = self.shared.world_size;
        if batch_size == 0 {
            return Err(ladder_core::Error::invalid("batch_size", 0, "a positive number of samples per batch").into());
        }
        let per_process = if self.config.split_batches {
            if batch_size % w != 0 {
                return Err(Error::Conflict {
                    first: format!("split_batches=true ({})", self.config.describe_source("split_batches")),
                    second: format!("batch_size {batch_size}"),
                    why: format!("the global batch of {batch_size} cannot be split evenly between {w} processes; use a multiple of {w}"),
                });
            }
            batch_size / w
        } else {
            batch_size
        };
        let options = DistributedSamplerOptions { shuffle, seed: self.shared.seed.get(), drop_last: false };
        let sampler = DistributedSampler::new(dataset.len(), w, self.shared.rank, options)?;
        let state = Rc::new(LoaderState::default());
        if shuffle {
            self.train_loaders.borrow_mut().push(state.clone());
        }
        let data = if dataset.device() == self.device { dataset.shallow_clone() } else { dataset.to_device(self.device) };
        if shuffle {
            // Every process must run as many training batches (one tiny collective).
            ladder_core::recipe::check_batch_counts(self.pg, sampler.num_samples().div_ceil(per_process))?;
        }
        Ok(AcceleratedDataLoader {
            data,
            batch_size: per_process,
            sampler,
            training: shuffle,
            drop_last: false,
            state,
            shared: self.shared.clone(),
            _d: std::marker::PhantomData,
        })
    }

    /// Runs `f` as one micro-batch of an accumulation window (`with accelerator.accumulate(model)`):
    /// the gradient sync happens only on the window's last micro-batch — every
    /// `gradient_accumulation_steps`-th batch of the loader, or its last batch — and the
    /// optimizer steps only then. Windows restart with every epoch.
    pub fn accumulate<R>(&self, model: &PreparedModel, f: impl FnOnce() -> R) -> R {
        let k = self.shared.accumulation_steps;
        let (sync, window) = if k == 1 {
            (true, 1)
        } else if let Some(pos) = *self.shared.current.borrow() {
            let i = pos.index;
            let start = i / k * k;
            ((i + 1) % k == 0 || i + 1 == pos.num_batches, k.min(pos.num_batches - start))
        } else {
            let s = self.shared.free_steps.get() + 1;
            self.shared.free_steps.set(s);
            (s % k as u64 == 0, k)
        };
        self.shared.sync_gradients.set(sync);
        self.shared.window_len.set(window);
        model.inner.borrow_mut().set_require_backward_grad_sync(sync);
        f()
    }

    /// True when the current micro-batch ends an accumulation window (the optimizer steps).
    pub fn sync_gradients(&self) -> bool {
        self.shared.sync_gradients.get()
    }

    /// `accelerator.backward(loss)`: divides the loss by the window's length (so k micro-batches
    /// of B give the gradient of one batch of k·B; a short last window by its own length),
    /// multiplies it by the loss scale under fp16, runs backward and — at a window's end —
    /// the gradient sync (DDP all-reduce or FSDP reduce-scatter).
    ///
    /// # Errors
    /// No prepared model; collective errors.
    pub fn backward(&self, loss: &Tensor) -> Result<()> {
        let model = self.prepared_model("backward")?;
        let window = self.shared.window_len.get();
        let per_window = if window > 1 { loss / window as f64 } else { loss.shallow_clone() };
        // A new tensor (not `*=` on a shallow clone): the caller's loss keeps its value.
        let scaled = match *self.shared.scaler.borrow() {
            Some(s) => &per_window * s.scale,
            None => per_window,
        };
        self.shared.unscaled.set(false);
        if self.shared.check_finite.get() {
            let (l, prev) = (loss.double_value(&[]), self.shared.window_loss.get());
            self.shared.window_loss.set(if prev.is_finite() { l } else { prev });
        }
        self.shared.lap(Phase::Forward);
        model.borrow_mut().backward(&scaled)?;
        self.shared.lap(Phase::Backward);
        Ok(())
    }

    /// Turns the divergence check on or off (default on; `--allow-non-finite` turns it off):
    /// at each optimizer step, a NaN/inf loss of the window or a NaN/inf gradient stops every
    /// process with an error naming the step and the process where it appeared
    /// ([`WrappedModel::check_finite`]). With fp16 loss scaling the gradients are the
    /// scaler's: an overflow still skips the step.
    pub fn set_check_finite(&self, on: bool) {
        self.shared.check_finite.set(on);
    }

    fn prepared_model(&self, op: &'static str) -> Result<Rc<RefCell<WrappedModel<'static>>>> {
        self.model.borrow().clone().ok_or(Error::Usage { op, problem: "no model prepared; call prepare_model first".into() })
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
        let model = self.prepared_model("clip_grad_norm_")?;
        unscale(&self.shared, &model.borrow())?;
        let norm = model.borrow().clip_grad_norm(max_norm)?;
        Ok(Some(norm))
    }

    /// Gathers `tensor` from every process along dim 0 (`[b, …]` on each → `[W·b, …]`, rank
    /// order). Every process must pass the same shape and dtype.
    ///
    /// # Errors
    /// Collective errors (a shape or dtype mismatch across ranks is named).
    pub fn gather(&self, tensor: &Tensor) -> Result<Tensor> {
        // Collectives move numbers; booleans travel as i64 and come back as booleans.
        if tensor.kind() == tch::Kind::Bool {
            return Ok(self.gather(&tensor.to_kind(tch::Kind::Int64))?.to_kind(tch::Kind::Bool));
        }
        let t = if tensor.dim() == 0 { tensor.reshape([1]) } else { tensor.contiguous() };
        let mut size = t.size();
        size[0] *= self.shared.world_size as i64;
        let mut out = Tensor::empty(size.as_slice(), (t.kind(), t.device()));
        self.pg.all_gather(&mut out, &t)?;
        Ok(out)
    }

    /// [`gather`](Self::gather) for evaluation: the per-sample results of the batch the last
    /// loader handed out, from every process, in the sampler's order, with exactly the samples
    /// the sampler's padding duplicated removed — so an epoch of an evaluation loader yields
    /// every sample exactly once at any world size and batch size (`[b, …]` → `[≤ W·b, …]`).
    /// Outside a loader it is [`gather`](Self::gather).
    ///
    /// # Errors
    /// Collective errors; a tensor whose first dimension is not the batch's length.
    pub fn gather_for_metrics(&self, tensor: &Tensor) -> Result<Tensor> {
        let all = self.gather(tensor)?;
        let Some(pos) = *self.shared.current.borrow() else { return Ok(all) };
        if tensor.dim() == 0 || tensor.size()[0] != pos.len as i64 {
            return Err(ladder_core::Error::invalid(
                "gather_for_metrics",
                format!("a tensor of shape {:?}", tensor.size()),
                format!("per-sample results of the current batch: first dimension {}", pos.len),
            )
            .into());
        }
        // Rank r's j-th sample of the batch sits at global position (local_start + j)·W + r;
        // positions past the dataset's end are padding.
        let w = self.shared.world_size;
        let mut keep = Vec::with_capacity(w * pos.len);
        for j in 0..pos.len {
            for r in 0..w {
                if (pos.local_start + j) * w + r < pos.dataset_len {
                    keep.push((r * pos.len + j) as i64);
                }
            }
        }
        let index = Tensor::from_slice(&keep).to_device(all.device());
        Ok(all.index_select(0, &index))
    }

    /// Reduces `tensor` over processes: `"sum"` or `"mean"` (a copy; the input is unchanged).
    ///
    /// # Errors
    /// An unknown reduction; collective errors.
    pub fn reduce(&self, tensor: &Tensor, reduction: &str) -> Result<Tensor> {
        let op = match reduction {
            "sum" => ReduceOp::Sum,
            "mean" => ReduceOp::Avg,
            other => return Err(ladder_core::Error::invalid("reduction", other, "\"sum\" or \"mean\"").into()),
        };
        let mut t = tensor.copy();
        self.pg.all_reduce(&mut t, op)?;
        Ok(t)
    }

    /// Pads `tensor` along `dim` with `pad_index` to the largest size any process has there,
    /// so that it can be gathered.
    ///
    /// # Errors
    /// `dim` out of range; collective errors.
    pub fn pad_across_processes(&self, tensor: &Tensor, dim: usize, pad_index: f64) -> Result<Tensor> {
        if dim >= tensor.dim() {
            return Err(ladder_core::Error::invalid("dim", dim, format!("a dimension of the tensor (it has {})", tensor.dim())).into());
        }
        let mut size = Tensor::from_slice(&[tensor.size()[dim]]).to_device(self.pg.device());
        self.pg.all_reduce(&mut size, ReduceOp::Max)?;
        let max = size.int64_value(&[0]);
        let have = tensor.size()[dim];
        if have == max {
            return Ok(tensor.shallow_clone());
        }
        let mut shape = tensor.size();
        shape[dim] = max - have;
        let pad = Tensor::full(shape.as_slice(), pad_index, (tensor.kind(), tensor.device()));
        Ok(Tensor::cat(&[tensor.shallow_clone(), pad], dim as i64))
    }

    /// This process's contiguous share of `items` (`split_between_processes`): shares differ in
    /// length by at most one and cover every item once, in order.
    pub fn split_between_processes<T: Clone>(&self, items: &[T]) -> Vec<T> {
        items[ladder_core::data::eval_shard(items.len(), self.shared.rank, self.shared.world_size)].to_vec()
    }

    /// Runs `f` on the main process first, then on the others (e.g. one process downloads
    /// MNIST while the others wait, then they read the files it wrote).
    ///
    /// # Errors
    /// Collective errors of the barrier; `f`'s own result is returned as it is.
    pub fn main_process_first<R>(&self, f: impl FnOnce() -> R) -> Result<R> {
        if !self.is_main_process() {
            self.pg.barrier()?;
        }
        let r = f();
        if self.is_main_process() {
            self.pg.barrier()?;
        }
        Ok(r)
    }

    /// Prints on the main process only.
    pub fn print(&self, msg: impl std::fmt::Display) {
        if self.is_main_process() {
            println!("{msg}");
        }
    }

    /// Waits until every process gets here (a barrier).
    ///
    /// # Errors
    /// Collective errors.
    pub fn wait_for_everyone(&self) -> Result<()> {
        Ok(self.pg.barrier()?)
    }

    /// A loader like `loader` whose next epoch skips its first `num_batches` batches (to resume
    /// mid-epoch, as Accelerate's `skip_first_batches`). The epoch count is shared with
    /// `loader`.
    pub fn skip_first_batches<'d>(&self, loader: &AcceleratedDataLoader<'d>, num_batches: usize) -> AcceleratedDataLoader<'d> {
        loader.state.skip.set(num_batches);
        AcceleratedDataLoader {
            data: loader.data.shallow_clone(),
            batch_size: loader.batch_size,
            sampler: loader.sampler.clone(),
            training: loader.training,
            drop_last: loader.drop_last,
            state: loader.state.clone(),
            shared: loader.shared.clone(),
            _d: std::marker::PhantomData,
        }
    }

    /// The prepared model's weights with the unwrapped model's keys (`conv1.weight`, …,
    /// definition order; FSDP gathers them), on the main process; `None` on the others
    /// (Accelerate's `get_state_dict`). Collective.
    ///
    /// # Errors
    /// No prepared model; collective errors.
    pub fn get_state_dict(&self) -> Result<Option<Vec<(String, Tensor)>>> {
        let model = self.prepared_model("get_state_dict")?;
        let sd = model.borrow().full_state_dict()?;
        Ok(sd)
    }

    /// The unwrapped model with the trained weights, on the main process (`None` on the
    /// others): a plain BasicNet on the CPU, FSDP's shards gathered. Collective.
    ///
    /// # Errors
    /// No prepared model; collective errors.
    pub fn unwrap_model(&self, config: BasicNetConfig) -> Result<Option<(nn::VarStore, BasicNet)>> {
        let model = self.prepared_model("unwrap_model")?;
        let sd = model.borrow().full_state_dict()?;
        let Some(sd) = sd else { return Ok(None) };
        let mut vs = nn::VarStore::new(Device::Cpu);
        let net = BasicNet::new(&vs.root(), config);
        tch::no_grad(|| -> Result<()> {
            let vars = vs.variables();
            for (name, t) in &sd {
                let v = vars.get(name).ok_or_else(|| ladder_core::Error::StateDict(format!("model: unexpected key {name}")))?;
                v.shallow_clone().f_copy_(t).map_err(ladder_core::Error::from)?;
            }
            Ok(())
        })?;
        vs.freeze();
        Ok(Some((vs, net)))
    }

    /// Runs `f` under autocast: on CUDA with mixed precision, libtorch's autocast; on CPU the
    /// prepared model already computes in the mixed-precision dtype, so `f` runs as it is.
    pub fn autocast<R>(&self, f: impl FnOnce() -> R) -> R {
        if self.device.is_cuda() && self.config.mixed_precision != Precision::No {
            tch::autocast(true, f)
        } else {
            f()
        }
    }

    /// The loss scaler in use (fp16), if any.
    pub fn grad_scaler(&self) -> Option<GradScaler> {
        *self.shared.scaler.borrow()
    }

    /// Installs (or removes) a loss scaler. fp16 installs one by itself; with fp32 or bf16 it is
    /// legal but rarely useful (as `GradScaler` in PyTorch) — tests use it to inject an overflow
    /// on the CPU.
    pub fn set_grad_scaler(&self, scaler: Option<GradScaler>) {
        *self.shared.scaler.borrow_mut() = scaler;
    }

    /// Optimizer steps taken so far.
    pub fn global_step(&self) -> u64 {
        self.shared.global_step.get()
    }

    /// True when the last `optimizer.step()` was skipped because fp16 gradients overflowed.
    pub fn optimizer_step_was_skipped(&self) -> bool {
        self.shared.step_was_skipped.get()
    }

    /// Where training stands: steps, batches, the training loader's epoch and position.
    pub fn training_state(&self) -> TrainingState {
        let (epoch, step_in_epoch) = match self.train_loaders.borrow().first() {
            Some(l) => match l.in_progress.get() {
                Some((e, consumed)) => (e, consumed as u64),
                None => (l.next_epoch.get(), 0),
            },
            None => (0, 0),
        };
        let mut extra = serde_json::Map::new();
        if let Some(s) = *self.shared.scaler.borrow() {
            extra.insert("grad_scaler".into(), serde_json::to_value(s).expect("GradScaler serialises"));
        }
        TrainingState {
            global_step: self.shared.global_step.get(),
            batches_seen: self.shared.batches_seen.get(),
            epoch,
            step_in_epoch,
            seed: self.shared.seed.get(),
            world_size: self.shared.world_size,
            extra,
        }
    }

    /// `save_state(dir)`: the model (unwrapped keys), the optimizer (unwrapped keys), and the
    /// training state, written by the main process into `dir` atomically (a kill mid-write
    /// leaves the previous checkpoint loadable). Collective.
    ///
    /// # Errors
    /// No prepared model or optimizer; I/O errors naming the file; collective errors.
    pub fn save_state(&self, dir: &Path) -> Result<()> {
        self.save_state_with(dir, serde_json::Map::new(), &[])
    }

    /// [`save_state`](Self::save_state) with extra training-state fields and extra files (the
    /// Trainer's `trainer_state.json`, a scheduler's state).
    ///
    /// # Errors
    /// As [`save_state`](Self::save_state).
    pub fn save_state_with(&self, dir: &Path, extra: serde_json::Map<String, serde_json::Value>, files: &[(&str, Vec<u8>)]) -> Result<()> {
        let model = self.prepared_model("save_state")?;
        let opt = self.optimizer.borrow().clone().ok_or(Error::Usage { op: "save_state", problem: "no optimizer prepared".into() })?;
        let weights = model.borrow().full_state_dict()?;
        let moments = model.borrow().optimizer_state_dict(&opt.borrow())?;
        let mut state = self.training_state();
        state.extra.extend(extra);
        let result = match (weights, moments) {
            (Some(model), Some(optimizer)) => checkpoint::save(dir, &Checkpoint { model, optimizer, state }, files).map_err(Error::from),
            _ => Ok(()),
        };
        // Every rank learns whether the main process succeeded before anyone goes on.
        let mut ok = Tensor::from_slice(&[f64::from(u8::from(result.is_ok()))]).to_device(self.pg.device());
        self.pg.all_reduce(&mut ok, ReduceOp::Min)?;
        if ok.double_value(&[0]) == 0.0 && result.is_ok() {
            return Err(Error::Usage { op: "save_state", problem: format!("the main process could not write {}", dir.display()) });
        }
        result
    }

    /// `load_state(dir)`: restores the model, the optimizer, the loss scale, the step counters,
    /// and the training loaders' position (their next epoch resumes where the checkpoint was
    /// taken, skipping the batches already seen). Every process reads the directory (a shared
    /// filesystem across nodes). Returns the training state.
    ///
    /// # Errors
    /// A missing or corrupt checkpoint (named); missing or unexpected keys; a checkpoint
    /// written at another world size (the data order would differ).
    pub fn load_state(&self, dir: &Path) -> Result<TrainingState> {
        let model = self.prepared_model("load_state")?;
        let opt = self.optimizer.borrow().clone().ok_or(Error::Usage { op: "load_state", problem: "no optimizer prepared".into() })?;
        let ckpt = checkpoint::load(dir)?;
        if ckpt.state.world_size != self.shared.world_size {
            return Err(ladder_core::Error::Checkpoint {
                dir: dir.into(),
                problem: format!(
                    "written by {} processes, loaded by {}: resuming at another world size would change the data order",
                    ckpt.state.world_size, self.shared.world_size
                ),
            }
            .into());
        }
        model.borrow_mut().load_full_state_dict(&ckpt.model)?;
        model.borrow().load_optimizer_state_dict(&mut opt.borrow_mut(), &ckpt.optimizer)?;
        let s = &ckpt.state;
        self.shared.global_step.set(s.global_step);
        self.shared.batches_seen.set(s.batches_seen);
        self.set_seed(s.seed);
        if let Some(v) = s.extra.get("grad_scaler") {
            let scaler: GradScaler = serde_json::from_value(v.clone())
                .map_err(|e| ladder_core::Error::Checkpoint { dir: dir.into(), problem: format!("grad_scaler: {e}") })?;
            *self.shared.scaler.borrow_mut() = Some(scaler);
        }
        for l in self.train_loaders.borrow().iter() {
            l.next_epoch.set(s.epoch);
            l.skip.set(s.step_in_epoch as usize);
            l.in_progress.set(None);
        }
        Ok(ckpt.state)
    }

    /// The step figures timed inside the Accelerator (see [`ladder_core::timing`]): the
    /// training loader marks the data phase, [`backward`](Self::backward) forward and
    /// backward (communication apart), the prepared optimizer's step the optimizer phase and
    /// the step's end. `None` before a training loader ran.
    pub fn step_timing(&self) -> Option<StepTiming> {
        self.shared.timer.borrow().as_ref().map(StepTimer::finish)
    }

    /// Restarts the step clock: what passed since the last step ended (evaluation, a
    /// checkpoint inside the loop) belongs to no step. The Trainer calls it after its
    /// evaluations and saves.
    pub fn restart_step_clock(&self) {
        let comm = self.shared.comm();
        if let Some(t) = self.shared.timer.borrow_mut().as_mut() {
            t.resume(comm);
        }
    }

    /// Gathers every process's figures into the run's report (the same JSON as level 1's,
    /// plus `mixed_precision`, `gradient_accumulation_steps` and `num_processes`); the step
    /// figures are the Accelerator's own ([`step_timing`](Self::step_timing)) unless `local`
    /// brings some. Collective.
    ///
    /// # Errors
    /// Collective errors.
    pub fn gather_report(&self, local: &LocalFigures, eval: &EvalSums, wall_s: f64) -> Result<Report> {
        let mut local = *local;
        if local.timing.steps == 0 {
            local.timing = self.step_timing().unwrap_or_default();
        }
        let local = &local;
        let mut report = gather_report(self.pg, local, eval, self.global_step(), self.wrap.strategy.name(), wall_s)?;
        report.extra.insert("mixed_precision".into(), self.config.mixed_precision.to_string().into());
        report.extra.insert("gradient_accumulation_steps".into(), self.shared.accumulation_steps.into());
        report.extra.insert("num_processes".into(), self.shared.world_size.into());
        Ok(report)
    }

    /// Marks the run as complete, as Accelerate's `end_training()`: dropping the Accelerator
    /// then destroys the process group, waiting for the other processes (at most
    /// `LADDER_SHUTDOWN_TIMEOUT_S`). An Accelerator dropped without it — an error leaving the
    /// training function early — leaves the group unfinalised, so the process reports its
    /// error at once and exits, and the launcher stops the processes still waiting for it.
    pub fn end_training(&self) {
        self.ended.set(true);
    }
}

impl Drop for Accelerator {
    fn drop(&mut self) {
        // A panicking process aborts the job at once (shutdown does so while unwinding).
        if self.owns_group && (self.ended.get() || std::thread::panicking()) {
            self.pg.shutdown();
        }
    }
}

/// Unscales the gradients once per window under fp16 (`GradScaler.unscale_`).
fn unscale(shared: &Shared, model: &WrappedModel<'static>) -> Result<()> {
    if let Some(s) = *shared.scaler.borrow() {
        if !shared.unscaled.replace(true) {
            model.scale_grads(1.0 / s.scale)?;
        }
    }
    Ok(())
}

/// The prepared model: `forward_t` as the plain model's; backward goes through
/// [`Accelerator::backward`].
#[derive(Debug, Clone)]
pub struct PreparedModel {
    inner: Rc<RefCell<WrappedModel<'static>>>,
}

impl PreparedModel {
    /// Forward pass: images `[b, 1, 28, 28]` f32 → log-probabilities `[b, 10]` f32 (fp32 also
    /// under mixed precision, as Accelerate's autocast returns).
    ///
    /// # Errors
    /// FSDP gather errors.
    pub fn forward_t(&self, xs: &Tensor, train: bool) -> Result<Tensor> {
        Ok(self.inner.borrow_mut().forward_t(xs, train)?)
    }

    /// Copies of the gradients of what the optimizer updates (`p.grad` of each parameter for
    /// DDP, of each FlatParameter shard for FSDP); undefined tensors where none exists yet.
    pub fn gradients(&self) -> Vec<Tensor> {
        self.inner.borrow().gradients()
    }

    /// Bytes of model state on this process.
    pub fn memory(&self) -> ModelStateBytes {
        self.inner.borrow().memory()
    }

    /// Seconds this process spent in collectives.
    pub fn comm_seconds(&self) -> f64 {
        self.inner.borrow().comm_seconds()
    }

    /// The bucket / FlatParameter layout.
    pub fn explain(&self) -> String {
        self.inner.borrow().explain()
    }

    /// Checks the processes hold the same parameters (DDP) or shard layout (FSDP).
    ///
    /// # Errors
    /// What differs, named.
    pub fn check_parameters_in_sync(&self) -> Result<()> {
        Ok(self.inner.borrow().check_parameters_in_sync()?)
    }
}

/// The prepared optimizer: steps and zeroes gradients only at accumulation boundaries; under
/// fp16 it unscales, and skips a step whose gradients overflowed on any process.
#[derive(Debug)]
pub struct AcceleratedOptimizer {
    opt: Rc<RefCell<AdamW>>,
    model: Rc<RefCell<WrappedModel<'static>>>,
    shared: Rc<Shared>,
    pg: &'static dyn ProcessGroup,
}

impl AcceleratedOptimizer {
    /// One optimizer step, at an accumulation boundary only (elsewhere a no-op).
    ///
    /// # Errors
    /// Collective errors (the fp16 overflow check).
    pub fn step(&mut self) -> Result<()> {
        if !self.shared.sync_gradients.get() {
            return Ok(());
        }
        if self.shared.check_finite.get() {
            let loss = self.shared.window_loss.replace(0.0);
            let (model, step) = (self.model.borrow(), self.shared.global_step.get() + 1);
            // Under fp16 loss scaling an infinite gradient is the scaler's business.
            if self.shared.scaler.borrow().is_none() {
                model.check_finite(step, loss)?;
            } else {
                model.check_finite_loss(step, loss)?;
            }
        }
        let found_inf = if self.shared.scaler.borrow().is_some() {
            let model = self.model.borrow();
            unscale(&self.shared, &model)?;
            !model.grads_finite()?
        } else {
            false
        };
        if let Some(s) = self.shared.scaler.borrow_mut().as_mut() {
            s.update(found_inf);
        }
        self.shared.step_was_skipped.set(found_inf);
        if !found_inf {
            self.opt.borrow_mut().step();
        }
        self.shared.global_step.set(self.shared.global_step.get() + 1);
        let comm = self.shared.comm();
        if let Some(t) = self.shared.timer.borrow_mut().as_mut() {
            t.end_step(Phase::Optimizer, comm, 0);
        }
        Ok(())
    }

    /// Zeroes the gradients, at an accumulation boundary only.
    pub fn zero_grad(&mut self) {
        if self.shared.sync_gradients.get() {
            self.opt.borrow_mut().zero_grad();
        }
    }

    /// The learning rate.
    pub fn lr(&self) -> f64 {
        self.opt.borrow().lr()
    }

    /// Sets the learning rate of the next steps (a scheduler's job).
    pub fn set_lr(&mut self, lr: f64) {
        self.opt.borrow_mut().set_lr(lr);
    }
}

/// A loader prepared by [`Accelerator::prepare_data_loader`]: this process's shard of every
/// epoch, in batches of `[b, 1, 28, 28]` f32 images and `[b]` i64 labels on the device.
#[derive(Debug)]
pub struct AcceleratedDataLoader<'d> {
    data: Dataset,
    batch_size: usize,
    sampler: DistributedSampler,
    training: bool,
    drop_last: bool,
    state: Rc<LoaderState>,
    shared: Rc<Shared>,
    _d: std::marker::PhantomData<&'d Dataset>,
}

impl AcceleratedDataLoader<'_> {
    /// Drops each epoch's last, incomplete batch (`DataLoader(drop_last=True)`); every process
    /// drops alike, so they still run the same number of batches.
    pub fn drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// Batches per epoch on each process.
    pub fn len(&self) -> usize {
        if self.drop_last {
            self.sampler.len() / self.batch_size
        } else {
            self.sampler.len().div_ceil(self.batch_size)
        }
    }

    /// True when an epoch has no batch.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Samples per epoch on each process (padding included).
    pub fn num_samples(&self) -> usize {
        self.sampler.len()
    }

    /// Samples per batch on each process.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// Samples in the dataset.
    pub fn dataset_len(&self) -> usize {
        self.data.len()
    }

    /// Sets the epoch the next `iter()` runs (as `DistributedSampler.set_epoch`; the loader
    /// advances it by itself otherwise).
    pub fn set_epoch(&self, epoch: u64) {
        self.state.next_epoch.set(epoch);
    }

    /// One epoch: the shuffle of the epoch (seeded by (seed, epoch)), this process's share,
    /// in batches. The next call runs the next epoch.
    pub fn iter(&self) -> impl Iterator<Item = (Tensor, Tensor)> + '_ {
        let epoch = self.state.next_epoch.get();
        self.state.next_epoch.set(epoch + 1);
        let skip = self.state.skip.replace(0);
        let mut sampler = self.sampler.clone();
        sampler.set_epoch(epoch);
        let indices: Vec<i64> = sampler.indices().into_iter().map(|i| i as i64).collect();
        let (bs, n_batches) = (self.batch_size, self.len());
        if self.training {
            self.state.in_progress.set(Some((epoch, skip)));
            self.shared.start_or_resume_timer();
        }
        (skip..n_batches).map(move |b| {
            let end = ((b + 1) * bs).min(indices.len());
            let pos =
                BatchPosition { index: b, num_batches: n_batches, local_start: b * bs, len: end - b * bs, dataset_len: self.data.len() };
            *self.shared.current.borrow_mut() = Some(pos);
            if self.training {
                let seen = self.shared.batches_seen.get();
                ladder_core::dist::progress::set_step(seen + 1);
                seed_batch(self.shared.seed.get(), self.shared.rank, seen);
                self.shared.batches_seen.set(seen + 1);
                self.state.in_progress.set((b + 1 < n_batches).then_some((epoch, b + 1)));
            }
            let batch = self.data.batch(&indices[b * bs..end]);
            if self.training {
                self.shared.lap(Phase::Data);
                if let Some(t) = self.shared.timer.borrow_mut().as_mut() {
                    t.add_samples((end - b * bs) as u64);
                }
            }
            batch
        })
    }
}
