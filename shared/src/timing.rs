//! Per-step timing of a training loop, one helper for every level: step times (p50/p95 over the
//! timed steps), time to first step, a per-phase breakdown (data, forward, backward without
//! communication, communication, optimizer), communication bytes per step, and the peak RSS of
//! the training steps alone.
//!
//! ```text
//! let mut timer = StepTimer::start(device);        // training phase: peak RSS reset, clock on
//! for (x, y) in loader.iter() {
//!     timer.lap(Phase::Data, model.comm());       // the batch is here
//!     let loss = model.forward_t(&x, true)?.nll_loss(&y);
//!     timer.lap(Phase::Forward, model.comm());
//!     model.backward(&loss)?;                      // includes the gradient all-reduce
//!     timer.lap(Phase::Backward, model.comm());    // communication moved to Phase::Comm
//!     optimizer.step();
//!     timer.end_step(Phase::Optimizer, model.comm(), 64);
//! }
//! let timing = timer.finish();                      // StepTiming, seconds and bytes
//! ```
//!
//! A loop that has no other place for the data and step-end laps lets [`StepTimer::timed`]
//! take them: the iterator it wraps the loader in resumes the clock, laps [`Phase::Data`] as it
//! hands out each batch and ends the step ([`Phase::Optimizer`]) when the next one is asked for
//! or the loop is left, so the loop body marks only where forward and backward end:
//!
//! ```text
//! for (x, y) in timer.timed(loader.iter(), model.comm()) {
//!     let loss = model.forward_t(&x, true)?.nll_loss(&y);
//!     timer.lap(Phase::Forward, model.comm());
//!     model.backward(&loss)?;
//!     timer.lap(Phase::Backward, model.comm());
//!     optimizer.step();
//! }
//! ```
//!
//! How the clock is read: every lap reads `Instant::now()` once (on CUDA after a device
//! synchronize, so that queued kernels count in the phase that queued them); a step's time runs
//! from the end of the previous step (or from [`StepTimer::start`] / [`StepTimer::resume`]) to
//! its own end, so the step times add up to the timed interval exactly. Time between a
//! [`StepTimer::resume`] and the previous step's end (evaluation between epochs, checkpoints) is
//! not any step's. The first [`WARMUP_STEPS`] steps are warm-up: reported as time to first step
//! and left out of throughput, percentiles and phases.
//!
//! The peak RSS follows the same rule: the kernel's `VmHWM` is reset at [`StepTimer::start`]
//! and at every [`StepTimer::resume`], and read as each step ends, so what runs between a
//! step's end and the next resume (the evaluation after an epoch, a checkpoint's save) and
//! after the last step is no step's memory either — as the PyTorch peers measure it
//! (`bench/reference/common.py` reads `VmHWM` when the training loop ends, before evaluating).
//!
//! Communication: the caller passes the wrapped model's cumulative collective seconds and
//! bytes ([`Comm`]); what grew since the previous lap is moved out of that lap's phase into
//! [`Phase::Comm`] (DDP's all-reduce out of backward, FSDP's all-gathers out of forward).

use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tch::Device;

/// Steps at the start of training that are warm-up (left out of throughput and step figures).
pub const WARMUP_STEPS: u64 = 2;

/// Cumulative communication of a wrapped model since it was built (`WrappedModel::comm`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Comm {
    /// Seconds inside collectives.
    pub seconds: f64,
    /// Payload bytes of those collectives (the buffer each collective moves, as nccl-tests'
    /// `size`: all-reduce in/out buffer, all-gather output, reduce-scatter input), bytes.
    pub bytes: u64,
}

/// A phase of a training step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Fetching the batch (and the loop's own bookkeeping since the previous step ended; under
    /// [`StepTimer::timed`], the batch alone).
    Data,
    /// zero_grad, forward pass and loss.
    Forward,
    /// Backward pass, communication excluded.
    Backward,
    /// Time inside collectives (gradient all-reduce / reduce-scatter, FSDP all-gathers).
    Comm,
    /// Optimizer step (with gradient clipping and scaling where the loop does them; under
    /// [`StepTimer::timed`], with what the loop body does after it).
    Optimizer,
}

/// Mean seconds per timed step spent in each phase; they add up to the mean step time.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PhaseTimes {
    /// [`Phase::Data`], seconds per step.
    pub data_s: f64,
    /// [`Phase::Forward`], seconds per step.
    pub forward_s: f64,
    /// [`Phase::Backward`] (communication excluded), seconds per step.
    pub backward_s: f64,
    /// [`Phase::Comm`], seconds per step.
    pub comm_s: f64,
    /// [`Phase::Optimizer`], seconds per step.
    pub optimizer_s: f64,
}

impl PhaseTimes {
    /// Sum of the phases, seconds per step.
    pub fn total(&self) -> f64 {
        self.data_s + self.forward_s + self.backward_s + self.comm_s + self.optimizer_s
    }

    fn slot(&mut self, phase: Phase) -> &mut f64 {
        match phase {
            Phase::Data => &mut self.data_s,
            Phase::Forward => &mut self.forward_s,
            Phase::Backward => &mut self.backward_s,
            Phase::Comm => &mut self.comm_s,
            Phase::Optimizer => &mut self.optimizer_s,
        }
    }

    fn plus(&self, o: &Self) -> Self {
        Self {
            data_s: self.data_s + o.data_s,
            forward_s: self.forward_s + o.forward_s,
            backward_s: self.backward_s + o.backward_s,
            comm_s: self.comm_s + o.comm_s,
            optimizer_s: self.optimizer_s + o.optimizer_s,
        }
    }

    fn scaled(&self, k: f64) -> Self {
        Self {
            data_s: self.data_s * k,
            forward_s: self.forward_s * k,
            backward_s: self.backward_s * k,
            comm_s: self.comm_s * k,
            optimizer_s: self.optimizer_s * k,
        }
    }
}

/// How the training-phase peak RSS was measured.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RssScope {
    /// Not measured (no `/proc`).
    #[default]
    None,
    /// `VmHWM`, reset at the phase start and at every resume (`echo 5 > /proc/self/clear_refs`)
    /// and read as each step ends.
    ClearRefs,
    /// `VmRSS` sampled every 5 ms on a background thread (clear_refs did not reset `VmHWM`).
    Sampled,
}

/// One rank's step figures (what [`StepTimer::finish`] returns). Seconds, bytes, MiB.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct StepTiming {
    /// Steps taken (warm-up included).
    pub steps: u64,
    /// Warm-up steps (the first [`WARMUP_STEPS`], or fewer in a shorter run).
    pub warmup_steps: u64,
    /// Steps after warm-up.
    pub timed_steps: u64,
    /// Samples this rank processed over all steps.
    pub samples: u64,
    /// Samples this rank processed in the timed steps.
    pub timed_samples: u64,
    /// Sum of every step's time (warm-up included), seconds: the training loop's time less
    /// what was excluded by `resume` (evaluation, checkpoints).
    pub steps_s: f64,
    /// Sum of the timed steps' times, seconds (the timed interval).
    pub timed_s: f64,
    /// From the training phase's start to the end of the first step, seconds.
    pub first_step_s: f64,
    /// Median timed step, seconds.
    pub step_p50_s: f64,
    /// 95th-percentile timed step (nearest rank), seconds.
    pub step_p95_s: f64,
    /// Mean seconds per timed step by phase.
    pub phases: PhaseTimes,
    /// Mean communication payload bytes per timed step.
    pub comm_bytes_per_step: f64,
    /// Peak RSS of the training steps, MiB: the most any step held, from [`StepTimer::start`]
    /// to the last step's end, evaluations and saves between a step's end and a
    /// [`StepTimer::resume`] left out (the module docs). With no step ended, the peak since the
    /// start or the last resume, read at `finish`.
    pub train_peak_rss_mib: f64,
    /// How `train_peak_rss_mib` was measured.
    pub rss_scope: RssScope,
    /// RSS when the training phase started ([`StepTimer::start`]: data loaded, model wrapped),
    /// MiB; `train_peak_rss_mib` less this is what training itself added. 0 where unknown.
    pub train_start_rss_mib: f64,
    /// On CUDA, the caching allocator's peak of allocated bytes over the training steps, MiB:
    /// `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats` at the start and at
    /// every [`StepTimer::resume`], read as each step ends (the same window as
    /// `train_peak_rss_mib`; [`crate::memory::cuda_allocator_bytes`]). 0 on CPU.
    pub train_cuda_peak_mib: f64,
    /// On CUDA, what the caching allocator had allocated when the training phase started
    /// (parameters, and whatever else the process put on the device before), MiB; 0 on CPU.
    pub train_cuda_start_mib: f64,
}

impl StepTiming {
    /// Samples per second of this rank over the timed steps (all steps when none was timed).
    pub fn samples_per_s(&self) -> f64 {
        if self.timed_steps > 0 {
            self.timed_samples as f64 / self.timed_s.max(1e-9)
        } else {
            self.samples as f64 / self.steps_s.max(1e-9)
        }
    }
}

/// Times the steps of a training loop (see the module docs).
#[derive(Debug)]
pub struct StepTimer {
    /// The clock, shared with the iterators of [`timed`](Self::timed).
    clock: Arc<Mutex<Clock>>,
    start_rss_mib: f64,
    /// On CUDA, the allocator's allocated bytes at the start.
    start_cuda: Option<u64>,
}

/// What the laps update: the step in progress and the totals.
#[derive(Debug)]
struct Clock {
    cuda: Option<i64>,
    phase_start: Instant,
    mark: Instant,
    comm_mark: Comm,
    /// The step in progress: phases and samples.
    current: PhaseTimes,
    current_bytes: u64,
    current_samples: u64,
    step_times: Vec<f64>,
    phases: PhaseTimes,
    comm_bytes: u64,
    samples: u64,
    timed_samples: u64,
    first_step_s: f64,
    /// Wall seconds of the loops over [`StepTimer::timed`] iterators (creation to drop).
    loops_s: f64,
    /// The peak RSS since the phase's start or the last resume.
    rss: RssProbe,
    /// The most any ended step held (the probe read as each step ends), bytes.
    steps_peak: Option<u64>,
    /// On CUDA, the most the caching allocator had allocated in any ended step, bytes.
    steps_cuda_peak: Option<u64>,
}

impl Clock {
    /// What passed since the last step's end is no step's: neither its time nor its memory.
    fn resume(&mut self, comm: Comm) {
        self.rss.reset(); // before the mark: the reset's /proc reads are no step's time either
        if let Some(i) = self.cuda {
            crate::memory::reset_cuda_peak_memory_stats(i as usize);
        }
        self.mark = Instant::now();
        self.comm_mark = comm;
    }

    /// Ends `phase`. `comm`: the model's cumulative totals, whose growth since the last lap that
    /// read them is moved to [`Phase::Comm`]; `None` where no collective can have run since (the
    /// next lap that reads them moves any that did).
    fn lap(&mut self, phase: Phase, comm: Option<Comm>) {
        if let Some(i) = self.cuda {
            tch::Cuda::synchronize(i);
        }
        let now = Instant::now();
        let dt = now.duration_since(self.mark).as_secs_f64();
        let comm = comm.unwrap_or(self.comm_mark);
        let dc = (comm.seconds - self.comm_mark.seconds).clamp(0.0, dt);
        *self.current.slot(phase) += dt - dc;
        self.current.comm_s += dc;
        self.current_bytes += comm.bytes.saturating_sub(self.comm_mark.bytes);
        (self.mark, self.comm_mark) = (now, comm);
    }

    fn end_step(&mut self, phase: Phase, comm: Option<Comm>, samples: u64) {
        self.lap(phase, comm);
        let step = std::mem::take(&mut self.current);
        let bytes = std::mem::take(&mut self.current_bytes);
        let samples = std::mem::take(&mut self.current_samples) + samples;
        let n = self.step_times.len() as u64;
        if n == 0 {
            self.first_step_s = self.mark.duration_since(self.phase_start).as_secs_f64();
        }
        self.step_times.push(step.total());
        if let Some(peak) = self.rss.peak_bytes() {
            self.steps_peak = Some(self.steps_peak.map_or(peak, |p| p.max(peak)));
        }
        // `lap` synchronized the device: the step's kernels have run.
        if let Some((_, peak)) = self.cuda.and_then(|i| crate::memory::cuda_allocator_bytes(i as usize)) {
            self.steps_cuda_peak = Some(self.steps_cuda_peak.map_or(peak, |p| p.max(peak)));
        }
        self.samples += samples;
        if n >= WARMUP_STEPS {
            self.phases = self.phases.plus(&step);
            self.comm_bytes += bytes;
            self.timed_samples += samples;
        }
    }
}

/// The clock, whoever held it last (a panic while holding it leaves figures, not a poison).
fn lock(clock: &Mutex<Clock>) -> std::sync::MutexGuard<'_, Clock> {
    clock.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl StepTimer {
    /// Starts the training phase: resets the peak RSS, starts the clock. `device` is where the
    /// model trains (CUDA laps synchronize it).
    pub fn start(device: Device) -> Self {
        let start_rss_mib = crate::memory::current_rss_bytes().map_or(0.0, crate::memory::mib);
        let start_cuda = match device {
            Device::Cuda(i) => {
                crate::memory::reset_cuda_peak_memory_stats(i);
                crate::memory::cuda_allocator_bytes(i).map(|(allocated, _)| allocated)
            }
            _ => None,
        };
        let rss = RssProbe::start();
        let now = Instant::now();
        let clock = Clock {
            cuda: match device {
                Device::Cuda(i) => Some(i as i64),
                _ => None,
            },
            phase_start: now,
            mark: now,
            comm_mark: Comm::default(),
            current: PhaseTimes::default(),
            current_bytes: 0,
            current_samples: 0,
            step_times: Vec::new(),
            phases: PhaseTimes::default(),
            comm_bytes: 0,
            samples: 0,
            timed_samples: 0,
            first_step_s: 0.0,
            loops_s: 0.0,
            rss,
            steps_peak: None,
            steps_cuda_peak: None,
        };
        Self { clock: Arc::new(Mutex::new(clock)), start_rss_mib, start_cuda }
    }

    /// Restarts the clock without ending a step: what passed since the last lap (evaluation
    /// between epochs, a checkpoint) belongs to no step, nor does the memory it held (the peak
    /// RSS is reset here). `comm` is the model's current total, so that collectives outside
    /// steps are not counted either. Call it between steps only: inside one it would drop what
    /// the step had held so far.
    pub fn resume(&mut self, comm: Comm) {
        lock(&self.clock).resume(comm);
    }

    /// Ends `phase`: the time since the previous lap goes to it, less the communication that
    /// `comm` (the model's cumulative totals) grew by, which goes to [`Phase::Comm`].
    pub fn lap(&mut self, phase: Phase, comm: Comm) {
        lock(&self.clock).lap(phase, Some(comm));
    }

    /// Adds samples to the step in progress (a loader handing out a micro-batch).
    pub fn add_samples(&mut self, samples: u64) {
        lock(&self.clock).current_samples += samples;
    }

    /// Ends `phase` (as [`lap`](Self::lap)) and the step, which processed `samples` more samples
    /// on this rank (besides those given to [`add_samples`](Self::add_samples)).
    pub fn end_step(&mut self, phase: Phase, comm: Comm, samples: u64) {
        lock(&self.clock).end_step(phase, Some(comm), samples);
    }

    /// Times one step per item of `batches` (an epoch of a loader): the clock resumes now with
    /// the model's totals `comm` (as [`resume`](Self::resume)); each batch handed out ends
    /// [`Phase::Data`]; asking for the next batch, or leaving the loop (dropping the iterator),
    /// ends the step with [`Phase::Optimizer`] and the batch's samples ([`Batch::samples`]).
    /// The loop body marks where forward and backward end with [`lap`](Self::lap). Each batch
    /// handed out also records the step it begins (1-based, over every loop of this timer) in
    /// [`crate::dist::progress`]: where this rank is, for a collective timeout's report and
    /// ladder-run's failure summary.
    ///
    /// Neither of the iterator's laps reads the model's communication totals (it does not hold
    /// the model): collectives of the data phase or after the backward lap (none in a loop
    /// whose only collectives are the model's forward and backward) would be moved out at the
    /// next step's forward lap. What the loop does after the optimizer step (logging) counts in
    /// [`Phase::Optimizer`].
    pub fn timed<I>(&mut self, batches: I, comm: Comm) -> Timed<I>
    where
        I: Iterator,
        I::Item: Batch,
    {
        self.resume(comm);
        let started = lock(&self.clock).mark;
        Timed { batches, clock: Arc::clone(&self.clock), open: None, started }
    }

    /// Wall seconds of the loops over [`timed`](Self::timed) batches so far, each from the
    /// iterator's creation to its drop: the training loop's time, read from its own clock, not
    /// summed from the steps (against which it checks them).
    pub fn loops_s(&self) -> f64 {
        lock(&self.clock).loops_s
    }

    /// Steps ended so far.
    pub fn steps(&self) -> u64 {
        lock(&self.clock).step_times.len() as u64
    }

    /// The figures so far (the training-phase peak RSS read now).
    pub fn finish(&self) -> StepTiming {
        let clock = lock(&self.clock);
        let n = clock.step_times.len() as u64;
        let warmup = n.min(WARMUP_STEPS);
        let mut timed: Vec<f64> = clock.step_times[warmup as usize..].to_vec();
        let timed_s: f64 = timed.iter().sum();
        timed.sort_by(f64::total_cmp);
        let k = timed.len();
        let pick = |q: f64| if k == 0 { 0.0 } else { timed[((q * k as f64).ceil() as usize).clamp(1, k) - 1] };
        let per = if k == 0 { 0.0 } else { 1.0 / k as f64 };
        let peak = clock.steps_peak.or_else(|| clock.rss.peak_bytes()).map_or(0.0, crate::memory::mib);
        let scope = clock.rss.scope();
        let cuda_peak =
            clock.steps_cuda_peak.or_else(|| clock.cuda.and_then(|i| crate::memory::cuda_allocator_bytes(i as usize)).map(|(_, p)| p));
        StepTiming {
            steps: n,
            warmup_steps: warmup,
            timed_steps: k as u64,
            samples: clock.samples,
            timed_samples: clock.timed_samples,
            steps_s: clock.step_times.iter().sum::<f64>() + 0.0,
            timed_s: timed_s + 0.0,
            first_step_s: clock.first_step_s,
            step_p50_s: pick(0.5),
            step_p95_s: pick(0.95),
            phases: clock.phases.scaled(per),
            comm_bytes_per_step: clock.comm_bytes as f64 * per,
            train_peak_rss_mib: peak,
            rss_scope: scope,
            train_start_rss_mib: self.start_rss_mib,
            train_cuda_peak_mib: cuda_peak.map_or(0.0, crate::memory::mib),
            train_cuda_start_mib: self.start_cuda.map_or(0.0, crate::memory::mib),
        }
    }
}

/// A batch a training step consumes: how many samples it holds.
pub trait Batch {
    /// Samples in the batch (its leading dimension).
    fn samples(&self) -> u64;
}

impl Batch for (tch::Tensor, tch::Tensor) {
    /// The inputs' leading dimension: `[batch, …]` images with their `[batch]` labels.
    fn samples(&self) -> u64 {
        self.0.size().first().map_or(0, |&n| n as u64)
    }
}

/// The batches of one epoch, each timed as a step: see [`StepTimer::timed`].
#[derive(Debug)]
pub struct Timed<I> {
    batches: I,
    clock: Arc<Mutex<Clock>>,
    /// The samples of the step handed out and not yet ended.
    open: Option<u64>,
    /// When the loop began.
    started: Instant,
}

impl<I> Timed<I> {
    /// Ends the step in progress, if any.
    fn end_open_step(&mut self) {
        if let Some(samples) = self.open.take() {
            lock(&self.clock).end_step(Phase::Optimizer, None, samples);
        }
    }
}

impl<I> Iterator for Timed<I>
where
    I: Iterator,
    I::Item: Batch,
{
    type Item = I::Item;

    fn next(&mut self) -> Option<I::Item> {
        self.end_open_step();
        let batch = self.batches.next()?;
        let mut clock = lock(&self.clock);
        clock.lap(Phase::Data, None);
        crate::dist::progress::set_step(clock.step_times.len() as u64 + 1);
        drop(clock);
        self.open = Some(batch.samples());
        Some(batch)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.batches.size_hint()
    }
}

impl<I> ExactSizeIterator for Timed<I>
where
    I: ExactSizeIterator,
    I::Item: Batch,
{
}

impl<I> Drop for Timed<I> {
    fn drop(&mut self) {
        self.end_open_step();
        lock(&self.clock).loops_s += self.started.elapsed().as_secs_f64();
    }
}

/// The training phase's peak RSS: `VmHWM` reset through `/proc/self/clear_refs`
/// ([`crate::memory::reset_peak_rss`], which keeps the whole-process peak for
/// [`crate::memory::peak_rss_bytes`]) where that works, else a sampling thread.
#[derive(Debug)]
enum RssProbe {
    Unavailable,
    ClearRefs,
    Sampled { peak: Arc<AtomicU64>, stop: Arc<AtomicBool> },
}

impl RssProbe {
    fn start() -> Self {
        use crate::memory::{current_rss_bytes, reset_peak_rss};
        let Some(rss) = current_rss_bytes() else { return Self::Unavailable };
        if reset_peak_rss() {
            return Self::ClearRefs;
        }
        Self::sampled(rss)
    }

    /// The fallback: a thread sampling `VmRSS` every 5 ms from `rss` (the RSS now), bytes.
    fn sampled(rss: u64) -> Self {
        use crate::memory::current_rss_bytes;
        let (peak, stop) = (Arc::new(AtomicU64::new(rss)), Arc::new(AtomicBool::new(false)));
        let (p, s) = (peak.clone(), stop.clone());
        let spawned = std::thread::Builder::new().name("rss-sampler".into()).spawn(move || {
            while !s.load(Ordering::Relaxed) {
                if let Some(now) = current_rss_bytes() {
                    p.fetch_max(now, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        if spawned.is_err() {
            return Self::Unavailable;
        }
        Self::Sampled { peak, stop }
    }

    fn scope(&self) -> RssScope {
        match self {
            Self::Unavailable => RssScope::None,
            Self::ClearRefs => RssScope::ClearRefs,
            Self::Sampled { .. } => RssScope::Sampled,
        }
    }

    /// The peak since the start or the last [`reset`](Self::reset), bytes.
    fn peak_bytes(&self) -> Option<u64> {
        use crate::memory::{current_rss_bytes, peak_rss_since_reset_bytes};
        match self {
            Self::Unavailable => None,
            Self::ClearRefs => peak_rss_since_reset_bytes(),
            Self::Sampled { peak, .. } => Some(peak.load(Ordering::Relaxed).max(current_rss_bytes().unwrap_or(0))),
        }
    }

    /// Starts a new peak from the current RSS.
    fn reset(&self) {
        match self {
            Self::Unavailable => {}
            Self::ClearRefs => {
                crate::memory::reset_peak_rss();
            }
            Self::Sampled { peak, .. } => peak.store(crate::memory::current_rss_bytes().unwrap_or(0), Ordering::Relaxed),
        }
    }
}

impl Drop for RssProbe {
    fn drop(&mut self) {
        if let Self::Sampled { stop, .. } = self {
            stop.store(true, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Allocates `mib` MiB, writes every page, frees it (glibc maps and unmaps a block that
    /// size: the RSS goes up by `mib` and back).
    fn touch(mib: usize) {
        let v = vec![1u8; mib << 20];
        std::hint::black_box(&v);
    }

    fn spin(ms: u64) {
        let t = Instant::now();
        while t.elapsed() < Duration::from_millis(ms) {
            std::hint::spin_loop();
        }
    }

    #[test]
    fn step_times_add_up_and_communication_moves_out_of_its_phase() {
        let _rss = crate::memory::tests_rss_lock();
        let mut t = StepTimer::start(Device::Cpu);
        let mut comm = Comm::default();
        for step in 0..5u64 {
            spin(1);
            t.lap(Phase::Data, comm);
            t.lap(Phase::Forward, comm);
            spin(2);
            // 0.5 ms of "all-reduce", 4 KiB, inside backward.
            comm = Comm { seconds: comm.seconds + 0.0005, bytes: comm.bytes + 4096 };
            t.lap(Phase::Backward, comm);
            t.end_step(Phase::Optimizer, comm, 64);
            if step == 2 {
                spin(5);
                t.resume(comm); // not a step's time
            }
        }
        let f = t.finish();
        assert_eq!((f.steps, f.warmup_steps, f.timed_steps), (5, 2, 3));
        assert_eq!((f.samples, f.timed_samples), (320, 192));
        assert_eq!(f.comm_bytes_per_step, 4096.0);
        assert!((f.phases.comm_s - 0.0005).abs() < 1e-12, "{:?}", f.phases);
        assert!((f.phases.total() * 3.0 - f.timed_s).abs() < 1e-9);
        assert!(f.steps_s >= f.timed_s + f.first_step_s - 1e-12);
        assert!(f.step_p50_s <= f.step_p95_s && f.step_p95_s <= f.timed_s);
        assert!(f.step_p50_s >= 0.003, "each step spun ≥ 3 ms: {}", f.step_p50_s);
        assert!(f.phases.backward_s >= 0.0015 && f.phases.data_s >= 0.001, "{:?}", f.phases);
        assert_ne!(f.rss_scope, RssScope::None);
        assert!(f.train_peak_rss_mib > 0.0);
        // The start is the RSS when the phase began: positive, and within what the phase held.
        assert!(f.train_start_rss_mib > 0.0 && f.train_start_rss_mib <= f.train_peak_rss_mib + 1.0, "{f:?}");
    }

    #[test]
    fn timed_batches_are_steps_ended_by_the_next_batch_or_by_leaving_the_loop() {
        let _rss = crate::memory::tests_rss_lock();
        let batch = |n: i64| (tch::Tensor::zeros([n, 1], tch::kind::FLOAT_CPU), tch::Tensor::zeros([n], tch::kind::INT64_CPU));
        let mut t = StepTimer::start(Device::Cpu);
        let mut comm = Comm::default();
        let begun = Instant::now();
        for epoch in 0..2 {
            spin(10); // evaluation between epochs: no step's time
            let batches = vec![batch(64), batch(64), batch(32)];
            for (i, b) in t.timed(batches.into_iter(), comm).enumerate() {
                assert!(b.samples() > 0);
                spin(1);
                t.lap(Phase::Forward, comm);
                spin(2);
                // 0.5 ms of "all-reduce", 4 KiB, inside backward.
                comm = Comm { seconds: comm.seconds + 0.0005, bytes: comm.bytes + 4096 };
                t.lap(Phase::Backward, comm);
                spin(1);
                if epoch == 1 && i == 1 {
                    break; // the step still ends, when the loop lets go of the batches
                }
            }
        }
        let f = t.finish();
        // Epoch 1: 64, 64, 32; epoch 2: 64, 64 and the break. Steps 3..5 are timed.
        assert_eq!((f.steps, f.warmup_steps, f.timed_steps), (5, 2, 3));
        assert_eq!((f.samples, f.timed_samples), (288, 160));
        assert_eq!(f.comm_bytes_per_step, 4096.0);
        assert!((f.phases.comm_s - 0.0005).abs() < 1e-12, "{:?}", f.phases);
        assert!((f.phases.total() * 3.0 - f.timed_s).abs() < 1e-9);
        assert!(f.phases.forward_s >= 0.001 && f.phases.backward_s >= 0.0015 && f.phases.optimizer_s >= 0.001, "{:?}", f.phases);
        // The 2 × 10 ms before each epoch belong to no step, nor to the loops; the loops' own
        // clock holds the steps.
        assert!(f.steps_s + 0.02 <= begun.elapsed().as_secs_f64(), "{f:?}");
        assert!(t.loops_s() + 1e-9 >= f.steps_s && t.loops_s() + 0.02 <= begun.elapsed().as_secs_f64(), "{} {f:?}", t.loops_s());
    }

    #[test]
    fn training_phase_peak_excludes_what_came_before() {
        let _rss = crate::memory::tests_rss_lock();
        touch(160);
        let t = StepTimer::start(Device::Cpu);
        let whole = crate::memory::peak_rss_bytes().map(crate::memory::mib).unwrap();
        let f = t.finish();
        assert!(f.train_peak_rss_mib + 48.0 < whole || f.rss_scope == RssScope::Sampled, "{f:?} whole {whole}");
    }

    #[test]
    fn steps_peak_leaves_out_what_runs_between_a_step_and_the_next_resume() {
        let _rss = crate::memory::tests_rss_lock();
        let comm = Comm::default();
        let mut t = StepTimer::start(Device::Cpu);
        t.end_step(Phase::Optimizer, comm, 64);
        touch(160); // an evaluation after the epoch
        t.resume(comm);
        t.end_step(Phase::Optimizer, comm, 64);
        touch(160); // a save after the last step
        let f = t.finish();
        let after = crate::memory::peak_rss_since_reset_bytes().map(crate::memory::mib).unwrap();
        assert!(
            f.train_peak_rss_mib + 100.0 < after || f.rss_scope == RssScope::Sampled,
            "the steps' peak {f:?}, the kernel's since the resume {after}"
        );

        // A step that holds the same 160 MiB counts it, whether or not a resume came before.
        for resumed in [false, true] {
            let mut t = StepTimer::start(Device::Cpu);
            let start = crate::memory::current_rss_bytes().map(crate::memory::mib).unwrap();
            if resumed {
                t.resume(comm);
            }
            touch(160);
            t.end_step(Phase::Optimizer, comm, 64);
            touch(8); // after the last step
            let f = t.finish();
            // A 5 ms sampler may miss a block freed at once: only VmHWM is held to it.
            assert!(
                f.train_peak_rss_mib >= start + 150.0 || f.rss_scope == RssScope::Sampled,
                "resumed {resumed}: {f:?}, RSS {start} MiB at the start"
            );
        }
    }

    #[test]
    fn the_sampling_fallback_sees_a_held_block_and_starts_again_at_a_reset() {
        let _rss = crate::memory::tests_rss_lock();
        let mib = |b: u64| crate::memory::mib(b);
        let start = crate::memory::current_rss_bytes().unwrap();
        let probe = RssProbe::sampled(start);
        assert_eq!(probe.scope(), RssScope::Sampled);
        let held = vec![1u8; 160 << 20];
        std::hint::black_box(&held);
        // The RSS while the block is held, read here: other tests of this process allocate and
        // free beside this one, so the RSS before it is no fixed base. Under load the sampler
        // may run late: wait (5 s at most) until it has seen the block.
        let during = crate::memory::current_rss_bytes().unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let mut peak = probe.peak_bytes().unwrap();
        while mib(peak) + 16.0 < mib(during) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
            peak = probe.peak_bytes().unwrap();
        }
        drop(held);
        assert!(
            mib(peak) + 16.0 >= mib(during),
            "sampled peak {} MiB, {} MiB while the 160 MiB block was held ({} MiB before it)",
            mib(peak),
            mib(during),
            mib(start)
        );
        probe.reset();
        let after = probe.peak_bytes().unwrap();
        assert!(mib(after) + 100.0 < mib(peak), "after the reset {} MiB, before {} MiB", mib(after), mib(peak));
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let _rss = crate::memory::tests_rss_lock();
        let t = StepTimer::start(Device::Cpu);
        lock(&t.clock).step_times = (1..=22).map(f64::from).collect(); // 2 warm-up + 20 timed: 3..=22
        let f = t.finish();
        assert_eq!((f.step_p50_s, f.step_p95_s, f.timed_steps), (12.0, 21.0, 20));
        assert_eq!(StepTimer::start(Device::Cpu).finish().timed_steps, 0);
    }
}
