//! Non-blocking collectives: a started collective is a [`Work`] handle, as the `Work` that
//! `dist.all_reduce(t, async_op=True)` returns — [`Work::test`] asks whether it completed
//! without waiting, [`Work::wait`] waits for it, at most the group's timeout (as
//! `init_process_group(timeout=...)`). The blocking collectives are start + wait.
//!
//! Every collective of a group gets a sequence number (1, 2, …, in call order, the same on
//! every rank) and records itself in this rank's [progress](super::progress) record, so that
//! a timeout can name the ranks that did not arrive and where they were last seen.
//!
//! When a wait times out the group is marked failed: the waiting rank gets
//! [`Error::CollectiveTimeout`], every later collective of the group fails at once with
//! [`Error::GroupAborted`], and shutting the group down aborts the job (`MPI_Abort`,
//! `ncclCommAbort`) instead of waiting for the missing ranks.

use super::progress::{self, Recorder};
use crate::{Error, Result};
use std::cell::{Cell, RefCell};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The default collective timeout: 600 s, as `torch.distributed`'s default for NCCL.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

/// The environment variable that sets the collective timeout in seconds.
pub const TIMEOUT_VAR: &str = "LADDER_COLLECTIVE_TIMEOUT_S";

/// Parses a timeout in seconds (as `--timeout` and [`TIMEOUT_VAR`] take it): a positive,
/// finite number.
///
/// # Errors
/// [`Error::InvalidValue`] naming `name`.
pub fn parse_timeout(name: &str, value: &str) -> Result<Duration> {
    match value.trim().parse::<f64>() {
        Ok(s) if s.is_finite() && s > 0.0 && s < 1e9 => Ok(Duration::from_secs_f64(s)),
        _ => Err(Error::invalid(name, value, "a positive number of seconds (e.g. 600)")),
    }
}

/// The timeout from [`TIMEOUT_VAR`], else [`DEFAULT_TIMEOUT`].
///
/// # Errors
/// [`Error::InvalidValue`] when the variable is set to something that is not a positive
/// number of seconds.
pub fn timeout_from_env() -> Result<Duration> {
    match std::env::var(TIMEOUT_VAR) {
        Ok(v) if !v.is_empty() => parse_timeout(TIMEOUT_VAR, &v),
        _ => Ok(DEFAULT_TIMEOUT),
    }
}

/// How a waiting rank spends the time between two polls of a collective that has waited
/// `waited` so far: a tight spin for the first 50 µs (small messages complete within it, so
/// their latency does not grow), then yielding the core, and after 1 s sleeping 1 ms.
pub(crate) fn backoff(waited: Duration) {
    if waited < Duration::from_micros(50) {
        std::hint::spin_loop();
    } else if waited < Duration::from_secs(1) {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// What a backend's pending operation must provide: a non-blocking completion test.
pub(crate) trait Pending {
    /// Advances the operation without blocking; `Ok(true)` once it (and any finishing step,
    /// such as the division of `ReduceOp::Avg`) completed.
    fn test(&mut self) -> Result<bool>;

    /// Whether the operation's main collective has been issued to the backend. A backend that
    /// first runs a cross-rank agreement probe issues the collective only once the probe
    /// completed; until then a later collective must not be issued, or ranks could issue the
    /// two in different orders (MPI requires one order on every rank). Default: issued at start.
    fn issued(&self) -> bool {
        true
    }
}

/// The bookkeeping every real group shares: rank, timeout, the sequence counter, the progress
/// record, and whether the group failed.
#[derive(Debug)]
pub struct Watch {
    rank: usize,
    world_size: usize,
    timeout: Duration,
    seq: Cell<u64>,
    dir: Option<PathBuf>,
    recorder: Option<Recorder>,
    failed: RefCell<Option<String>>,
}

impl Watch {
    /// The watch of rank `rank` of `world_size`, recording progress in [`progress::job_dir`].
    pub fn new(rank: usize, world_size: usize, timeout: Duration) -> Self {
        let dir = progress::job_dir();
        let recorder = dir.as_deref().and_then(|d| Recorder::open(d, rank));
        Self { rank, world_size, timeout, seq: Cell::new(0), dir, recorder, failed: RefCell::new(None) }
    }

    /// The watch of a sub-group ([`ProcessGroup::new_group`](super::ProcessGroup::new_group)):
    /// rank `rank` of the group's `world_size`, no progress record (the per-rank record
    /// belongs to the default group, whose sequence numbers it holds), so a sub-group's timeout
    /// names no missing ranks.
    pub fn unrecorded(rank: usize, world_size: usize, timeout: Duration) -> Self {
        Self { rank, world_size, timeout, seq: Cell::new(0), dir: None, recorder: None, failed: RefCell::new(None) }
    }

    /// The collective timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Why the group failed, once it has.
    pub fn failure(&self) -> Option<String> {
        self.failed.borrow().clone()
    }

    /// Marks the group failed (later collectives are refused).
    pub fn fail(&self, why: String) {
        self.failed.borrow_mut().get_or_insert(why);
    }

    /// Starts collective `op`: its sequence number, recorded in the progress record.
    ///
    /// # Errors
    /// [`Error::GroupAborted`] when the group already failed.
    pub fn begin(&self, op: &'static str) -> Result<u64> {
        if let Some(why) = self.failure() {
            return Err(Error::GroupAborted { op, rank: self.rank, why });
        }
        let seq = self.seq.get() + 1;
        self.seq.set(seq);
        if let Some(r) = &self.recorder {
            r.enter(seq, op);
        }
        Ok(seq)
    }

    /// Records that collective `seq` completed.
    pub fn end(&self, seq: u64) {
        if let (Some(r), true) = (&self.recorder, seq == self.seq.get()) {
            r.leave(seq);
        }
    }

    /// The timeout error of collective `seq`, naming the ranks that did not arrive; marks the
    /// group failed.
    pub(crate) fn timed_out(&self, op: &'static str, seq: u64, step: u64, waited: Duration) -> Error {
        self.fail(format!("{op} #{seq} timed out on rank {}", self.rank));
        timeout_error(self.rank, self.world_size, self.timeout, self.dir.as_deref(), op, seq, step, waited)
    }

    /// Before the job is aborted: removes the progress directory when this job derived it
    /// (bare mpirun); one that `ladder-run` made is left for its failure summary.
    pub fn remove_dir_on_abort(&self) {
        remove_dir_on_abort(self.dir.as_deref());
    }

    /// Removes this rank's progress record (a clean shutdown).
    pub fn remove_record(&self) {
        if let Some(r) = &self.recorder {
            r.remove();
        }
    }
}

/// A started collective, as the `Work` object of `torch.distributed`'s `async_op=True`.
///
/// It borrows the tensors it works on for `'a`: they must not be read or written until the
/// work completed. Dropping an incomplete `Work` waits for it (at most the timeout), so the
/// borrow never ends while the backend still uses the memory.
#[must_use = "a started collective must be waited for (Work::wait)"]
pub struct Work<'a> {
    pending: Option<Box<dyn Pending + 'a>>,
    watch: Option<&'a Watch>,
    op: &'static str,
    seq: u64,
    step: u64,
    started: Instant,
}

impl std::fmt::Debug for Work<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Work")
            .field("op", &self.op)
            .field("seq", &self.seq)
            .field("step", &self.step)
            .field("completed", &self.pending.is_none())
            .finish()
    }
}

impl<'a> Work<'a> {
    /// A work that completed when it was started (one-rank groups, backends whose work is
    /// ordered on a device stream).
    pub fn completed(op: &'static str) -> Self {
        Self { pending: None, watch: None, op, seq: 0, step: progress::step(), started: Instant::now() }
    }

    /// A work pending in a backend; `seq` comes from [`Watch::begin`].
    pub(crate) fn pending(op: &'static str, seq: u64, watch: &'a Watch, pending: Box<dyn Pending + 'a>) -> Self {
        Self { pending: Some(pending), watch: Some(watch), op, seq, step: progress::step(), started: Instant::now() }
    }

    /// The collective's name (`all_reduce`, …).
    pub fn op(&self) -> &'static str {
        self.op
    }

    /// The collective's sequence number in its group (0 for work completed at start).
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// True once the collective completed; never blocks (as `Work.is_completed()`, and it also
    /// makes progress, as `MPI_Test`).
    ///
    /// # Errors
    /// The backend's error; [`Error::CollectiveTimeout`] once the timeout has passed.
    pub fn test(&mut self) -> Result<bool> {
        let Some(p) = self.pending.as_mut() else { return Ok(true) };
        match p.test() {
            Ok(true) => {
                self.finish();
                Ok(true)
            }
            Ok(false) => {
                let waited = self.started.elapsed();
                match self.watch {
                    Some(w) if waited >= w.timeout => Err(self.time_out(waited)),
                    _ => Ok(false),
                }
            }
            Err(e) => {
                self.pending = None;
                Err(e)
            }
        }
    }

    /// Waits until the collective completed, at most the group's timeout, as `Work.wait()`.
    ///
    /// Polls: a tight spin for the first 50 µs (small messages complete within it, so their
    /// latency does not grow), then yielding the core between polls, and after 1 s sleeping
    /// 1 ms between polls. Time this process itself spent stopped (SIGSTOP, a debugger) does
    /// not count against the timeout.
    ///
    /// # Errors
    /// The backend's error; [`Error::CollectiveTimeout`] naming the operation, its sequence
    /// number, the step, the time waited and the ranks that did not arrive.
    pub fn wait(mut self) -> Result<()> {
        self.wait_mut()
    }

    fn wait_mut(&mut self) -> Result<()> {
        if self.poll_until(|_| false)? {
            self.finish();
        }
        Ok(())
    }

    /// Waits (within the timeout, as [`wait`](Self::wait)) until the backend has issued the
    /// collective itself — past any agreement probe — so that collectives started after this
    /// one are issued after it on every rank. Called by backends when a collective starts.
    pub(crate) fn wait_issued(&mut self) -> Result<()> {
        if self.poll_until(|p| p.issued())? {
            self.finish();
        }
        Ok(())
    }

    /// Polls until the operation completed (`Ok(true)`) or `enough` holds (`Ok(false)`),
    /// at most the timeout.
    fn poll_until(&mut self, enough: impl Fn(&(dyn Pending + 'a)) -> bool) -> Result<bool> {
        let Some(p) = self.pending.as_mut() else { return Ok(false) };
        let timeout = self.watch.map_or(Duration::MAX, |w| w.timeout);
        let mut last = self.started;
        let mut paused = Duration::ZERO;
        loop {
            match p.test() {
                Ok(true) => return Ok(true),
                Ok(false) if enough(&**p) => return Ok(false),
                Ok(false) => {}
                Err(e) => {
                    self.pending = None;
                    return Err(e);
                }
            }
            let now = Instant::now();
            let gap = now.duration_since(last);
            if gap > Duration::from_millis(500) {
                // This process did not run for a while (stopped, or starved): not waiting time.
                paused += gap;
            }
            last = now;
            let waited = now.duration_since(self.started).saturating_sub(paused);
            if waited >= timeout {
                return Err(self.time_out(waited));
            }
            backoff(waited);
        }
    }

    fn finish(&mut self) {
        self.pending = None;
        if let Some(w) = self.watch {
            w.end(self.seq);
        }
    }

    fn time_out(&mut self, waited: Duration) -> Error {
        // The backend may still own the memory: forget the pending operation without
        // touching it again. The group is failed, so no further progress is made on it.
        if let Some(p) = self.pending.take() {
            std::mem::forget(p);
        }
        match self.watch {
            Some(w) => w.timed_out(self.op, self.seq, self.step, waited),
            None => Error::GroupAborted { op: self.op, rank: 0, why: "timed out".into() },
        }
    }
}

impl Drop for Work<'_> {
    fn drop(&mut self) {
        if self.pending.is_some() {
            if let Err(e) = self.wait_mut() {
                eprintln!("a dropped {} #{} failed: {e}", self.op, self.seq);
            }
        }
    }
}

/// The deadline of the blocking collectives. A blocking MPI call is the fastest path for small
/// messages (Open MPI's non-blocking collectives cost several microseconds more per call), but
/// it cannot return before the peers arrive: so a blocking collective is *armed* here (a few
/// atomic stores), and one watchdog thread per group checks every 20 ms whether the armed
/// collective is older than the timeout. If it is, the watchdog prints the
/// [`Error::CollectiveTimeout`] this rank would have returned (prefixed with its rank) and
/// calls the backend's abort (`MPI_Abort`), which ends every rank of the job.
pub(crate) struct Watchdog {
    shared: std::sync::Arc<DogShared>,
    started: std::sync::Once,
    abort: std::sync::Mutex<Option<Box<dyn FnOnce() + Send>>>,
    rank: usize,
    world_size: usize,
    timeout: Duration,
    dir: Option<PathBuf>,
}

impl std::fmt::Debug for Watchdog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watchdog").field("timeout", &self.timeout).finish()
    }
}

#[derive(Default)]
struct DogShared {
    /// Sequence number of the armed collective; 0 when none is.
    seq: std::sync::atomic::AtomicU64,
    op: std::sync::atomic::AtomicU64,
    step: std::sync::atomic::AtomicU64,
}

const DOG_OPS: [&str; 6] = ["collective", "all_reduce", "broadcast", "all_gather", "reduce_scatter", "barrier"];

/// Disarms the watchdog when the blocking collective returns.
pub(crate) struct Armed<'a>(&'a Watchdog);

impl Drop for Armed<'_> {
    fn drop(&mut self) {
        self.0.shared.seq.store(0, std::sync::atomic::Ordering::Release);
    }
}

impl Watchdog {
    /// A watchdog for the group of `watch`; `abort` ends the job when a collective times out.
    pub(crate) fn new(watch: &Watch, abort: Box<dyn FnOnce() + Send>) -> Self {
        Self {
            shared: Default::default(),
            started: std::sync::Once::new(),
            abort: std::sync::Mutex::new(Some(abort)),
            rank: watch.rank,
            world_size: watch.world_size,
            timeout: watch.timeout,
            dir: watch.dir.clone(),
        }
    }

    /// Arms the deadline of blocking collective `seq` (`op`) until the guard is dropped.
    pub(crate) fn arm(&self, op: &'static str, seq: u64) -> Armed<'_> {
        use std::sync::atomic::Ordering::{Relaxed, Release};
        self.started.call_once(|| self.spawn());
        let code = DOG_OPS.iter().position(|o| *o == op).unwrap_or(0) as u64;
        self.shared.op.store(code, Relaxed);
        self.shared.step.store(progress::step(), Relaxed);
        self.shared.seq.store(seq, Release);
        Armed(self)
    }

    fn spawn(&self) {
        let shared = self.shared.clone();
        let abort = self.abort.lock().ok().and_then(|mut a| a.take());
        let (rank, world_size, timeout, dir) = (self.rank, self.world_size, self.timeout, self.dir.clone());
        let tick = Duration::from_millis(20).min(timeout / 4).max(Duration::from_millis(1));
        let spawned = std::thread::Builder::new().name("ladder-watchdog".into()).spawn(move || {
            use std::sync::atomic::Ordering::{Acquire, Relaxed};
            let (mut watching, mut since, mut paused, mut last) = (0u64, Instant::now(), Duration::ZERO, Instant::now());
            loop {
                std::thread::sleep(tick);
                let now = Instant::now();
                let gap = now.duration_since(last);
                last = now;
                let seq = shared.seq.load(Acquire);
                if seq == 0 {
                    watching = 0;
                    continue;
                }
                if seq != watching {
                    (watching, since, paused) = (seq, now - tick.min(gap), Duration::ZERO);
                    continue;
                }
                if gap > Duration::from_millis(500) {
                    paused += gap; // this process was stopped (SIGSTOP, a debugger): not waiting time
                }
                let waited = now.duration_since(since).saturating_sub(paused);
                if waited < timeout {
                    continue;
                }
                let op = DOG_OPS[(shared.op.load(Relaxed) as usize).min(DOG_OPS.len() - 1)];
                let step = shared.step.load(Relaxed);
                let err = timeout_error(rank, world_size, timeout, dir.as_deref(), op, seq, step, waited);
                eprintln!("error on rank {rank} of {world_size}: {err}");
                eprintln!("rank {rank}: aborting the job so that no rank waits forever");
                remove_dir_on_abort(dir.as_deref());
                if let Some(abort) = abort {
                    abort();
                }
                std::process::exit(1);
            }
        });
        if spawned.is_err() {
            eprintln!("rank {}: could not start the collective watchdog thread; collectives have no timeout", self.rank);
        }
    }
}

/// The [`Error::CollectiveTimeout`] of collective `seq`, naming the ranks that did not arrive
/// (from their progress records in `dir`).
#[allow(clippy::too_many_arguments)]
pub fn timeout_error(
    rank: usize,
    world_size: usize,
    timeout: Duration,
    dir: Option<&std::path::Path>,
    op: &'static str,
    seq: u64,
    step: u64,
    waited: Duration,
) -> Error {
    let behind = progress::behind(dir, world_size, rank, seq, op);
    let detail = if behind.is_empty() {
        "every rank's progress record shows it reached this collective (it may be stuck inside it)".to_string()
    } else {
        let names: Vec<String> = behind.iter().map(|(r, _)| r.to_string()).collect();
        let detail: Vec<String> = behind.iter().map(|(r, d)| format!("rank {r} {d}")).collect();
        format!("rank(s) {} did not arrive: {}", names.join(", "), detail.join("; "))
    };
    Error::CollectiveTimeout {
        op,
        seq,
        step,
        rank,
        waited_s: waited.as_secs_f64(),
        timeout_s: timeout.as_secs_f64(),
        not_arrived: behind.iter().map(|(r, _)| *r).collect(),
        detail,
    }
}

fn remove_dir_on_abort(dir: Option<&std::path::Path>) {
    if let (Some(d), None) = (dir, std::env::var_os(progress::PROGRESS_DIR_VAR)) {
        let _ = std::fs::remove_dir_all(d);
    }
}
