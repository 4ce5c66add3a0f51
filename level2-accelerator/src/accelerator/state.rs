//! The one state of a run, shared by the Accelerator, its optimizer and its loaders: the
//! gradient/accumulation state (Accelerate's `GradientState`: the window the current
//! micro-batch belongs to — `sync_gradients` follows from it —, the loaders' positions, the
//! step counters), what guards an optimizer step, and the step clock. One `RefCell`, borrowed
//! for one operation at a time; the prepared model and optimizer sit beside it, set once.

use super::optimizer::StepGuard;
use crate::{Error, Result};
use ladder_core::checkpoint::TrainingState;
use ladder_core::data::{DistributedSampler, Sampler};
use ladder_core::dist::ProcessGroup;
use ladder_core::optim::AdamW;
use ladder_core::parallel::WrappedModel;
use ladder_core::timing::{Comm, Phase, StepTimer};
use std::cell::{OnceCell, RefCell};
use tch::Device;

/// Where the last batch a loader handed out sits in its epoch: what `accumulate` needs for
/// the window, and `gather_for_metrics` for the padding.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BatchPosition {
    /// Index of the batch in the epoch (0-based, counting skipped ones).
    pub index: usize,
    /// Batches in the epoch.
    pub num_batches: usize,
    /// Position of the batch's first sample in this rank's share of the epoch.
    pub local_start: usize,
    /// Samples in the batch (the same on every rank).
    pub len: usize,
    /// Samples in the dataset (without padding).
    pub dataset_len: usize,
}

/// The accumulation window of the current micro-batch: its length and the micro-batch's place
/// in it. The gradients sync — and the optimizer steps — on its last micro-batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Window {
    /// Micro-batches in the window (`gradient_accumulation_steps`, or fewer at an epoch's end).
    len: usize,
    /// The current micro-batch's index in the window.
    index: usize,
}

impl Window {
    /// No accumulation: every micro-batch is a window of its own.
    const SINGLE: Window = Window { len: 1, index: 0 };

    /// The window of batch `i` of an epoch of `n`, `k` per window: windows restart with every
    /// epoch, and the last one is as long as the batches left.
    fn of_batch(i: usize, n: usize, k: usize) -> Window {
        let start = i / k * k;
        Window { len: k.min(n - start), index: i - start }
    }

    /// The window of the `s`-th (0-based) micro-batch run outside any loader.
    fn of_free(s: u64, k: usize) -> Window {
        Window { len: k, index: (s % k as u64) as usize }
    }

    fn is_last(self) -> bool {
        self.index + 1 == self.len
    }
}

/// One loader's place in its epochs.
#[derive(Debug, Clone)]
pub(crate) struct LoaderPosition {
    /// A training (shuffled) loader: its position is saved and it seeds dropout.
    pub training: bool,
    /// Its sampler (any epoch, whole): what the samples consumed are counted with.
    sampler: DistributedSampler,
    /// Samples per batch on this process.
    batch_size: usize,
    /// The loader drops each epoch's last, incomplete batch.
    drop_last: bool,
    /// The epoch the next `iter()` runs.
    pub next_epoch: u64,
    /// Where the next `iter()`'s share of the epoch begins (the sampler's start: resume at
    /// another world size).
    pub start: usize,
    /// Batches the next `iter()` skips (resume at the same world size).
    pub skip: usize,
    /// The epoch in progress, its share's start and the batches of it handed out, while one is.
    pub in_progress: Option<(u64, usize, usize)>,
}

impl LoaderPosition {
    /// The sampler for `epoch` from `start`.
    pub fn sampler(&self, epoch: u64, start: usize) -> DistributedSampler {
        let mut s = self.sampler.clone();
        s.set_epoch(epoch);
        s.set_start(start);
        s
    }

    /// Batches of the share of an epoch from `start`, the same on every process.
    ///
    /// # Errors
    /// The rest of an epoch that cannot be split evenly (see `DistributedSampler::num_batches`).
    pub fn num_batches(&self, start: usize) -> ladder_core::Result<usize> {
        self.sampler(0, start).num_batches(self.batch_size, self.drop_last)
    }

    /// `(epoch, start, batches run)`: the epoch in progress or, between epochs, the next one
    /// with the position it will resume from.
    fn position(&self) -> (u64, usize, usize) {
        self.in_progress.unwrap_or((self.next_epoch, self.start, self.skip))
    }
}

/// Accelerate's `GradientState`, with the run's counters: the accumulation window,
/// the loaders' positions, the optimizer steps and batches so far, the seed.
#[derive(Debug)]
pub(crate) struct GradientState {
    /// Micro-batches per optimizer step.
    pub accumulation_steps: usize,
    window: Window,
    /// Micro-batches `accumulate` ran outside any loader.
    free_micro_batches: u64,
    /// The batch the last loader handed out.
    pub batch: Option<BatchPosition>,
    /// Every loader's position, by loader id.
    loaders: Vec<LoaderPosition>,
    /// Training micro-batches handed out over the run (the dropout seed of the next).
    pub batches_seen: u64,
    /// Optimizer steps taken (skipped fp16 steps included, as Accelerate counts them).
    pub global_step: u64,
    /// Seed of the shuffles and of dropout.
    pub seed: u64,
}

impl GradientState {
    fn new(accumulation_steps: usize, seed: u64) -> Self {
        GradientState {
            accumulation_steps,
            window: Window::SINGLE,
            free_micro_batches: 0,
            batch: None,
            loaders: Vec::new(),
            batches_seen: 0,
            global_step: 0,
            seed,
        }
    }

    /// True when the current micro-batch ends its window: the gradients sync, the optimizer
    /// steps.
    pub fn sync_gradients(&self) -> bool {
        self.window.is_last()
    }

    /// Micro-batches in the current window (what `backward` divides the loss by).
    pub fn window_len(&self) -> usize {
        self.window.len
    }

    /// A micro-batch starts (`accumulate`): its window is that of the batch the last loader
    /// handed out, or the next of a count kept outside loaders. Returns `sync_gradients`.
    pub fn enter_micro_batch(&mut self) -> bool {
        let k = self.accumulation_steps;
        self.window = if k == 1 {
            Window::SINGLE
        } else if let Some(pos) = self.batch {
            Window::of_batch(pos.index, pos.num_batches, k)
        } else {
            self.free_micro_batches += 1;
            Window::of_free(self.free_micro_batches - 1, k)
        };
        self.sync_gradients()
    }

    /// A new loader over `sampler` with `batch_size` samples per batch; returns its id.
    pub fn add_loader(&mut self, training: bool, sampler: DistributedSampler, batch_size: usize, drop_last: bool) -> usize {
        self.loaders.push(LoaderPosition { training, sampler, batch_size, drop_last, next_epoch: 0, start: 0, skip: 0, in_progress: None });
        self.loaders.len() - 1
    }

    /// Loader `id`'s position.
    pub fn loader(&self, id: usize) -> &LoaderPosition {
        &self.loaders[id]
    }

    /// Loader `id` starts an epoch: returns the epoch, its share's start and the batches to
    /// skip.
    pub fn start_epoch(&mut self, id: usize) -> (u64, usize, usize) {
        let l = &mut self.loaders[id];
        let (epoch, start, skip) = (l.next_epoch, std::mem::take(&mut l.start), std::mem::take(&mut l.skip));
        l.next_epoch += 1;
        if l.training {
            l.in_progress = Some((epoch, start, skip));
        }
        (epoch, start, skip)
    }

    /// Loader `id` hands out the batch at `pos` of `epoch`. A training loader's batch is the
    /// run's next micro-batch: returns its index over the run (the dropout seed's input).
    pub fn hand_out(&mut self, id: usize, epoch: u64, pos: BatchPosition) -> Option<u64> {
        self.batch = Some(pos);
        let l = &mut self.loaders[id];
        if !l.training {
            return None;
        }
        let start = l.in_progress.map_or(0, |(_, start, _)| start);
        l.in_progress = (pos.index + 1 < pos.num_batches).then_some((epoch, start, pos.index + 1));
        self.batches_seen += 1;
        Some(self.batches_seen - 1)
    }

    /// Sets the epoch loader `id`'s next `iter()` runs.
    pub fn set_epoch(&mut self, id: usize, epoch: u64) {
        self.loaders[id].next_epoch = epoch;
    }

    /// Makes loader `id`'s next epoch skip its first `num_batches` batches.
    pub fn skip_first_batches(&mut self, id: usize, num_batches: usize) {
        self.loaders[id].skip = num_batches;
    }

    /// Where training stands: steps, batches, the first training loader's epoch and position
    /// (batches run on each process, and samples consumed over all of them).
    pub fn training_state(&self, world_size: usize) -> TrainingState {
        let (epoch, start, batches, consumed) = match self.loaders.iter().find(|l| l.training) {
            Some(l) => {
                let (epoch, start, batches) = l.position();
                (epoch, start, batches, l.sampler(epoch, start).consumed_after(batches, l.batch_size))
            }
            None => (0, 0, 0, 0),
        };
        TrainingState {
            global_step: self.global_step,
            batches_seen: self.batches_seen,
            epoch,
            step_in_epoch: batches as u64,
            samples_consumed: consumed as u64,
            epoch_start: start as u64,
            seed: self.seed,
            world_size,
            extra: serde_json::Map::new(),
        }
    }

    /// Restores the counters and the training loaders' positions of a checkpoint: their next
    /// epoch resumes where it was taken — at the same world size skipping the batches already
    /// run, at another splitting the samples not yet consumed between the processes
    /// ([`TrainingState::resume_position`]).
    ///
    /// Call [`check_restore`](Self::check_restore) first.
    pub fn restore(&mut self, s: &TrainingState, world_size: usize) {
        let (start, skip) = s.resume_position(world_size);
        self.global_step = s.global_step;
        self.batches_seen = s.batches_seen;
        self.seed = s.seed;
        for l in self.loaders.iter_mut().filter(|l| l.training) {
            l.next_epoch = s.epoch;
            l.start = start as usize;
            l.skip = skip as usize;
            l.in_progress = None;
        }
    }

    /// Checks that [`restore`](Self::restore) can resume `s` at `world_size`.
    ///
    /// # Errors
    /// A rest of the epoch that `world_size` processes cannot split evenly.
    pub fn check_restore(&self, s: &TrainingState, world_size: usize) -> ladder_core::Result<()> {
        let (start, _) = s.resume_position(world_size);
        for l in self.loaders.iter().filter(|l| l.training) {
            l.num_batches(start as usize)?;
        }
        Ok(())
    }
}

/// Everything that changes while a run trains, in one place.
#[derive(Debug)]
pub(crate) struct State {
    /// The accumulation window, positions and counters.
    pub gradient: GradientState,
    /// fp16 loss scaling and the divergence check.
    pub guard: StepGuard,
    /// Step times and phases, started by the first training loader's first `iter()`.
    pub timer: Option<StepTimer>,
}

/// What the Accelerator, its prepared model and optimizer, and its loaders share.
pub(crate) struct Shared {
    /// The process group (leaked: it lives as long as the process).
    pub pg: &'static dyn ProcessGroup,
    /// The device this process trains on (the step timer synchronizes CUDA).
    pub device: Device,
    /// The prepared model, once `prepare_model` ran: held here only.
    model: OnceCell<RefCell<WrappedModel<'static>>>,
    /// The prepared optimizer, once `prepare_optimizer` ran: held here only.
    optimizer: OnceCell<RefCell<AdamW>>,
    /// The run's state.
    pub state: RefCell<State>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("rank", &self.pg.rank())
            .field("world_size", &self.pg.world_size())
            .field("device", &self.device)
            .field("model_prepared", &self.model.get().is_some())
            .field("state", &self.state.try_borrow().ok())
            .finish()
    }
}

impl Shared {
    pub fn new(pg: &'static dyn ProcessGroup, accumulation_steps: usize, seed: u64, guard: StepGuard) -> Self {
        Shared {
            pg,
            device: pg.device(),
            model: OnceCell::new(),
            optimizer: OnceCell::new(),
            state: RefCell::new(State { gradient: GradientState::new(accumulation_steps, seed), guard, timer: None }),
        }
    }

    /// The prepared model.
    ///
    /// # Errors
    /// [`Error::Usage`] naming `op` before `prepare_model`.
    pub fn model(&self, op: &'static str) -> Result<&RefCell<WrappedModel<'static>>> {
        self.model.get().ok_or(Error::Usage { op, problem: "no model prepared; call prepare_model first".into() })
    }

    /// Refuses a second model (before one is wrapped: wrapping is collective).
    ///
    /// # Errors
    /// [`Error::Usage`] when a model was prepared already.
    pub fn ensure_no_model(&self) -> Result<()> {
        match self.model.get() {
            Some(_) => Err(Error::Usage {
                op: "prepare_model",
                problem: "this Accelerator already prepared a model; ddp-ladder's Accelerator holds one model (and one optimizer)".into(),
            }),
            None => Ok(()),
        }
    }

    /// Holds `model` as the prepared one.
    ///
    /// # Errors
    /// [`Error::Usage`] when a model was prepared already.
    pub fn set_model(&self, model: WrappedModel<'static>) -> Result<()> {
        self.ensure_no_model()?;
        let _ = self.model.set(RefCell::new(model));
        Ok(())
    }

    /// The prepared optimizer.
    ///
    /// # Errors
    /// [`Error::Usage`] naming `op` before `prepare_optimizer`.
    pub fn optimizer(&self, op: &'static str) -> Result<&RefCell<AdamW>> {
        self.optimizer.get().ok_or(Error::Usage { op, problem: "no optimizer prepared".into() })
    }

    /// The optimizer, for an [`AcceleratedOptimizer`](super::AcceleratedOptimizer): one exists
    /// only once `prepare_optimizer` set it, and nothing unsets it.
    pub fn prepared_optimizer(&self) -> &RefCell<AdamW> {
        self.optimizer.get().expect("an AcceleratedOptimizer exists only after prepare_optimizer set the optimizer")
    }

    /// The model, for a [`PreparedModel`](super::PreparedModel) or an
    /// [`AcceleratedOptimizer`](super::AcceleratedOptimizer): one exists only once
    /// `prepare_model` set it, and nothing unsets it.
    pub fn prepared_model(&self) -> &RefCell<WrappedModel<'static>> {
        self.model.get().expect("a PreparedModel exists only after prepare_model set the model")
    }

    /// Refuses a second optimizer.
    ///
    /// # Errors
    /// [`Error::Usage`] when an optimizer was prepared already.
    pub fn ensure_no_optimizer(&self) -> Result<()> {
        match self.optimizer.get() {
            Some(_) => Err(Error::Usage {
                op: "prepare_optimizer",
                problem: "this Accelerator already prepared an optimizer; ddp-ladder's Accelerator holds one".into(),
            }),
            None => Ok(()),
        }
    }

    /// Holds `opt` as the prepared optimizer.
    ///
    /// # Errors
    /// [`Error::Usage`] when an optimizer was prepared already.
    pub fn set_optimizer(&self, opt: AdamW) -> Result<()> {
        self.ensure_no_optimizer()?;
        let _ = self.optimizer.set(RefCell::new(opt));
        Ok(())
    }

    /// The prepared model's cumulative communication (zero before `prepare_model`).
    pub fn comm(&self) -> Comm {
        self.model.get().and_then(|m| m.try_borrow().ok().map(|m| m.comm())).unwrap_or_default()
    }

    /// Ends `phase` of the step in progress, once timing has started.
    pub fn lap(&self, phase: Phase) {
        let mut state = self.state.borrow_mut();
        if let Some(t) = state.timer.as_mut() {
            t.lap(phase, self.comm());
        }
    }

    /// Ends the step in progress (the optimizer phase), once timing has started.
    pub fn end_step(&self) {
        let mut state = self.state.borrow_mut();
        if let Some(t) = state.timer.as_mut() {
            t.end_step(Phase::Optimizer, self.comm(), 0);
        }
    }

    /// A training loader hands out a batch of `samples`: the data phase ends.
    pub fn data_ready(&self, samples: u64) {
        let mut state = self.state.borrow_mut();
        if let Some(t) = state.timer.as_mut() {
            t.lap(Phase::Data, self.comm());
            t.add_samples(samples);
        }
    }

    /// Restarts the step clock (what passed since the last step belongs to no step), starting
    /// it the first time when `start` (a training loader starts an epoch).
    pub fn resume_clock(&self, start: bool) {
        let comm = self.comm();
        let mut state = self.state.borrow_mut();
        if state.timer.is_none() && start {
            state.timer = Some(StepTimer::start(self.device));
        }
        if let Some(t) = state.timer.as_mut() {
            t.resume(comm);
        }
    }
}
