//! The `mpi` backend: OpenMPI through rsmpi's raw bindings (`mpi::ffi`), in place on CPU
//! tensors. Each collective is one MPI call on the tensor's own memory — no staging copy
//! (except a blocking reduce-scatter: at one rank a copy, at two an in-place all-reduce, from
//! three ranks and 1 MiB one `MPI_Reduce` per block, `blocking.rs`) —
//! preceded, unless the call is [`Agreement::Prechecked`], by one 4-integer Max all-reduce that
//! checks every rank passed the same numel and dtype (a mismatch would otherwise be undefined
//! behaviour in MPI).
//!
//! [`ProcessGroup::run`] uses Open MPI's blocking calls, the fastest for small messages, each
//! armed in the group's [`Watchdog`]: when one waits longer than the timeout, the watchdog
//! prints its [`Error::CollectiveTimeout`] and calls `MPI_Abort`. [`ProcessGroup::start`] uses
//! the non-blocking calls (`MPI_Iallreduce`, …) and returns a [`Work`] that advances the
//! two-stage state machine (probe, then the collective) with `MPI_Test` and fails with
//! [`Error::CollectiveTimeout`] after the group's timeout instead of waiting forever.
//!
//! bf16 and f16 have no MPI datatype: they move as 16-bit integers, and reductions of them use
//! user-defined operations that add each pair in f32 and round back, as gloo and NCCL do
//! ([`half_ops`]).
//!
//! The communicator's error handler is `MPI_ERRORS_RETURN`, and every return code is checked
//! and turned into [`Error::Backend`] with MPI's own error string. After a timeout the group is
//! failed: shutting it down calls `MPI_Abort`, so mpirun (and `ladder-run`) stop every rank.
//!
//! Sub-groups ([`ProcessGroup::new_group`]) are communicators split from the world's
//! (`MPI_Comm_split`), with the same collectives, timeout and abort (of the whole job); their
//! communicator is freed when they are dropped, unless MPI is finalised by then.
//!
//! Here: the group, its set-up and shutdown; [`blocking`] and [`nonblocking`]: the two forms
//! of the collectives. `MPI_IN_PLACE` comes from [`crate::ffi::mpi`].
//!
//! # Safety
//!
//! The `unsafe` blocks call rsmpi's raw bindings (`mpi::ffi`), each with its `SAFETY` comment.
//! What makes them sound: `MPI_COMM_WORLD` is live from `MPI_Init` until the group is
//! finalised, and no collective runs after that ([`Watch::begin`] and the group's lifetime
//! order them); every tensor handed to MPI was checked first (contiguous, on the CPU, of a
//! dtype whose element size the datatype matches, with the block sizes the call needs) and its
//! element count fits a C `int` ([`MpiGroup::count`]); a non-blocking call's buffers, probe
//! included, are kept alive by its [`Work`] until `MPI_Test` reported the request complete,
//! and a `Work` that times out is forgotten rather than dropped, so its memory is never
//! released while MPI may still write it.

mod blocking;
mod half_ops;
mod nonblocking;

use super::work::{Watch, Watchdog, Work};
use super::{check_call, Call, Collective, DistEnv, ProcessGroup, ReduceOp};
use crate::{Error, Result};
use mpi::ffi;
use mpi::traits::{AsRaw, Communicator};
use std::ffi::c_int;
use tch::{Device, Kind, Tensor};

/// A process group over `MPI_COMM_WORLD`, or over a communicator split from it
/// ([`ProcessGroup::new_group`]).
pub struct MpiGroup {
    // Dropping the universe calls MPI_Finalize; `shutdown` takes it (once). `None` in sub-groups.
    universe: std::cell::RefCell<Option<mpi::environment::Universe>>,
    comm: ffi::MPI_Comm,
    // A sub-group's communicator, freed (`MPI_Comm_free`) on drop unless MPI is finalised.
    owns_comm: bool,
    rank: usize,
    local_rank: usize,
    world_size: usize,
    watch: Watch,
    dog: Watchdog,
}

impl std::fmt::Debug for MpiGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiGroup").field("rank", &self.rank).field("world_size", &self.world_size).finish()
    }
}

impl MpiGroup {
    /// `MPI_Init`, then checks that MPI's rank and size agree with the launcher's environment.
    ///
    /// # Errors
    /// [`Error::Env`] when MPI was initialised already or disagrees with `RANK`/`WORLD_SIZE`.
    pub fn init(env: &DistEnv) -> Result<Self> {
        Self::init_with_timeout(env, super::timeout_from_env()?)
    }

    /// [`MpiGroup::init`] with a collective timeout (see [`super::init_process_group_with_timeout`]).
    ///
    /// # Errors
    /// As [`MpiGroup::init`].
    pub fn init_with_timeout(env: &DistEnv, timeout: std::time::Duration) -> Result<Self> {
        let universe = mpi::initialize()
            .ok_or_else(|| Error::Env("MPI is already initialised in this process (one process group per process)".into()))?;
        let world = universe.world();
        let (rank, world_size) = (world.rank() as usize, world.size() as usize);
        if rank != env.rank || world_size != env.world_size {
            return Err(Error::Env(format!(
                "MPI says rank {rank} of {world_size}, but the environment says RANK={} WORLD_SIZE={}",
                env.rank, env.world_size
            )));
        }
        let comm = world.as_raw();
        // SAFETY: `comm` is MPI_COMM_WORLD of an initialised MPI; the handler is a predefined one.
        let code = unsafe { ffi::MPI_Comm_set_errhandler(comm, ffi::RSMPI_ERRORS_RETURN) };
        let watch = Watch::new(rank, world_size, timeout);
        let dog = Watchdog::new(&watch, Box::new(abort_world));
        let group = Self {
            universe: std::cell::RefCell::new(Some(universe)),
            comm,
            owns_comm: false,
            rank,
            local_rank: env.local_rank,
            world_size,
            watch,
            dog,
        };
        group.check("MPI_Comm_set_errhandler", code)?;
        half_ops::create(|call, rc| group.check(call, rc))?;
        Ok(group)
    }

    /// `new_group(ranks)` by `MPI_Comm_split`: members split with color 0 and their rank as
    /// key (so the sub-group's ranks follow theirs), the others with `MPI_UNDEFINED`. Every
    /// rank of this group must call it (arguments checked by the caller).
    fn split(&self, sorted: &[usize]) -> Result<Option<Box<dyn ProcessGroup>>> {
        let member = sorted.binary_search(&self.rank).is_ok();
        // SAFETY: reading rsmpi's predefined constants.
        let (undefined, null) = unsafe { (ffi::RSMPI_UNDEFINED, ffi::RSMPI_COMM_NULL) };
        let color = if member { 0 } else { undefined };
        let mut comm = null;
        let seq = self.watch.begin("barrier")?;
        let armed = self.dog.arm("barrier", seq);
        // SAFETY: the communicator is live; `comm` is a valid out-pointer.
        let rc = unsafe { ffi::MPI_Comm_split(self.comm, color, self.rank as c_int, &mut comm) };
        drop(armed);
        self.watch.end(seq);
        self.check("MPI_Comm_split", rc)?;
        if !member {
            return Ok(None);
        }
        let (mut rank, mut size): (c_int, c_int) = (0, 0);
        // SAFETY: `comm` is the live communicator MPI_Comm_split just returned to a member.
        let codes = unsafe {
            [
                ffi::MPI_Comm_set_errhandler(comm, ffi::RSMPI_ERRORS_RETURN),
                ffi::MPI_Comm_rank(comm, &mut rank),
                ffi::MPI_Comm_size(comm, &mut size),
            ]
        };
        let (rank, world_size) = (rank as usize, size as usize);
        let watch = Watch::unrecorded(rank, world_size, self.watch.timeout());
        let dog = Watchdog::new(&watch, Box::new(abort_world));
        let group = Self {
            universe: std::cell::RefCell::new(None),
            comm,
            owns_comm: true,
            rank,
            local_rank: self.local_rank,
            world_size,
            watch,
            dog,
        };
        for (call, code) in ["MPI_Comm_set_errhandler", "MPI_Comm_rank", "MPI_Comm_size"].into_iter().zip(codes) {
            group.check(call, code)?;
        }
        Ok(Some(Box::new(group)))
    }

    /// rsmpi's handle on the same communicator (`MPI_COMM_WORLD`), for code that wants to call
    /// rsmpi directly — e.g. the all-reduce benchmark's raw baseline.
    pub fn communicator(&self) -> mpi::topology::SimpleCommunicator {
        mpi::topology::SimpleCommunicator::world()
    }

    fn check(&self, call: &'static str, code: c_int) -> Result<()> {
        if code == ffi::MPI_SUCCESS as c_int {
            return Ok(());
        }
        let mut buf = vec![0u8; 512];
        let mut len: c_int = 0;
        // SAFETY: the buffer holds MPI_MAX_ERROR_STRING (256 in OpenMPI) bytes and more.
        unsafe { ffi::MPI_Error_string(code, buf.as_mut_ptr() as *mut _, &mut len) };
        buf.truncate(len.max(0) as usize);
        Err(Error::Backend {
            backend: "mpi",
            call,
            rank: self.rank,
            code: code as i64,
            message: String::from_utf8_lossy(&buf).into_owned(),
        })
    }

    fn count(&self, op: &'static str, t: &Tensor) -> Result<c_int> {
        c_int::try_from(t.numel()).map_err(|_| Error::BadTensor {
            op,
            rank: self.rank,
            problem: format!("{} elements exceed MPI's int count limit", t.numel()),
        })
    }
}

/// How long a rank waits at shutdown for the others before it aborts the job
/// (`LADDER_SHUTDOWN_TIMEOUT_S`, default 30 s).
fn shutdown_timeout() -> std::time::Duration {
    let secs = std::env::var("LADDER_SHUTDOWN_TIMEOUT_S").ok().and_then(|v| v.parse::<f64>().ok()).unwrap_or(30.0);
    std::time::Duration::from_secs_f64(secs.max(0.0))
}

impl Drop for MpiGroup {
    /// [`shutdown`](ProcessGroup::shutdown), unless it already ran.
    fn drop(&mut self) {
        self.finalize();
        if self.owns_comm {
            let mut finalized: c_int = 0;
            // SAFETY: MPI_Finalized may be called at any time; a sub-group's communicator is
            // freed once, and only while MPI is still initialised.
            unsafe {
                ffi::MPI_Finalized(&mut finalized);
                if finalized == 0 {
                    ffi::MPI_Comm_free(&mut self.comm);
                }
            }
        }
    }
}

impl MpiGroup {
    /// Finalises MPI once, without ever hanging: `MPI_Finalize` is collective, so a rank that
    /// leaves early (an error returned, a panic) while the others wait in a collective would
    /// block forever. A panicking rank aborts the job at once (`MPI_Abort`: mpirun stops every
    /// rank); otherwise the rank waits in a non-blocking barrier for at most
    /// `LADDER_SHUTDOWN_TIMEOUT_S` (30 s) and aborts the job if the others do not arrive.
    pub(crate) fn finalize(&self) {
        let Some(universe) = self.universe.borrow_mut().take() else { return };
        self.wait_for_shutdown();
        drop(universe);
    }

    fn wait_for_shutdown(&self) {
        if let Some(why) = self.watch.failure() {
            eprintln!("rank {}: {why}; aborting the MPI job so that no rank waits forever", self.rank);
            self.watch.remove_dir_on_abort();
            // SAFETY: MPI is initialised; MPI_Abort terminates every process of the job.
            unsafe { ffi::MPI_Abort(self.comm, 1) };
            return;
        }
        if std::thread::panicking() {
            eprintln!("rank {}: panicked; aborting the MPI job so that no rank waits forever", self.rank);
            self.watch.remove_dir_on_abort();
            // SAFETY: MPI is initialised; MPI_Abort terminates every process of the job.
            unsafe { ffi::MPI_Abort(self.comm, 1) };
            return;
        }
        // SAFETY: reading rsmpi's predefined null request handle.
        let mut request: ffi::MPI_Request = unsafe { ffi::RSMPI_REQUEST_NULL };
        // SAFETY: the communicator is live and `request` is a valid out-pointer.
        if unsafe { ffi::MPI_Ibarrier(self.comm, &mut request) } != ffi::MPI_SUCCESS as c_int {
            return;
        }
        let deadline = std::time::Instant::now() + shutdown_timeout();
        loop {
            let mut done: c_int = 0;
            // SAFETY: `request` came from MPI_Ibarrier; the status is ignored.
            let rc = unsafe { ffi::MPI_Test(&mut request, &mut done, ffi::RSMPI_STATUS_IGNORE) };
            if rc != ffi::MPI_SUCCESS as c_int || done != 0 {
                self.watch.remove_record();
                return;
            }
            if std::time::Instant::now() >= deadline {
                eprintln!(
                    "rank {}: the other ranks did not reach shutdown within {:?} (did one fail?); aborting the MPI job",
                    self.rank,
                    shutdown_timeout()
                );
                self.watch.remove_dir_on_abort();
                // SAFETY: as above.
                unsafe { ffi::MPI_Abort(self.comm, 1) };
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}

/// The MPI datatype that moves `kind` unchanged (16-bit floats as 16-bit integers).
fn raw_type(kind: Kind) -> ffi::MPI_Datatype {
    // SAFETY: reading rsmpi's predefined datatype handles.
    unsafe {
        match kind {
            Kind::Float => ffi::RSMPI_FLOAT,
            Kind::Double => ffi::RSMPI_DOUBLE,
            Kind::Int64 => ffi::RSMPI_INT64_T,
            _ => ffi::RSMPI_UINT16_T,
        }
    }
}

/// The operation reducing `kind` with `op` (`Avg` sums; the caller divides): MPI's own, or
/// for 16-bit floats ours ([`half_ops`]).
fn mpi_op(op: ReduceOp, kind: Kind) -> ffi::MPI_Op {
    if let Some(half) = half_ops::op_for(kind, op) {
        return half;
    }
    // SAFETY: reading rsmpi's predefined operation handles.
    unsafe {
        match op {
            ReduceOp::Sum | ReduceOp::Avg => ffi::RSMPI_SUM,
            ReduceOp::Max => ffi::RSMPI_MAX,
            ReduceOp::Min => ffi::RSMPI_MIN,
        }
    }
}

impl MpiGroup {
    /// `ReduceOp::Avg` needs a floating-point tensor (as NCCL, which has no integer average).
    fn check_avg(&self, call: &Call<'_>) -> Result<()> {
        let (op, kind) = match call {
            Call::AllReduce { tensor, op: ReduceOp::Avg } => ("all_reduce", tensor.kind()),
            Call::ReduceScatter { input, op: ReduceOp::Avg, .. } => ("reduce_scatter", input.kind()),
            _ => return Ok(()),
        };
        if kind == Kind::Int64 {
            return Err(Error::BadTensor {
                op,
                rank: self.rank,
                problem: "ReduceOp::Avg needs a floating-point tensor, found Int64 (as NCCL)".into(),
            });
        }
        Ok(())
    }

    /// Checks what every call needs before any message: [`check_call`], then
    /// [`check_avg`](Self::check_avg).
    fn check_call(&self, call: &Call<'_>) -> Result<()> {
        check_call(call, self.rank, self.world_size, Device::Cpu)?;
        self.check_avg(call)
    }
}

impl ProcessGroup for MpiGroup {
    fn shutdown(&self) {
        self.finalize();
    }

    /// `MPI_Comm_split` (see the module docs).
    fn new_group(&self, ranks: &[usize]) -> Result<Option<Box<dyn ProcessGroup>>> {
        let sorted = super::check_group_ranks(ranks, self.world_size)?;
        self.split(&sorted)
    }

    fn backend(&self) -> &'static str {
        "mpi"
    }
    fn rank(&self) -> usize {
        self.rank
    }
    fn local_rank(&self) -> usize {
        self.local_rank
    }
    fn world_size(&self) -> usize {
        self.world_size
    }
    fn device(&self) -> Device {
        Device::Cpu
    }
    fn timeout(&self) -> std::time::Duration {
        self.watch.timeout()
    }

    /// Open MPI's blocking calls, armed in the watchdog (see [`blocking`]).
    fn run(&self, collective: Collective<'_>) -> Result<()> {
        self.run_blocking(collective)
    }

    /// Open MPI's non-blocking calls, advanced by the [`Work`] with `MPI_Test` (see
    /// [`nonblocking`]).
    fn start<'a>(&'a self, collective: Collective<'a>) -> Result<Work<'a>> {
        self.start_nonblocking(collective)
    }
}

/// `MPI_Abort` on `MPI_COMM_WORLD`: ends every rank of the job (the watchdog's abort).
fn abort_world() {
    // SAFETY: MPI is initialised (the group exists); MPI_Abort terminates the job.
    unsafe { ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, 1) };
}

fn null_request() -> ffi::MPI_Request {
    // SAFETY: reading rsmpi's predefined null request handle.
    unsafe { ffi::RSMPI_REQUEST_NULL }
}
