//! The `mpi` backend: OpenMPI through rsmpi's raw bindings (`mpi::ffi`), in place on CPU
//! tensors. Each collective is one MPI call on the tensor's own memory — no staging copy —
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
//! bf16 and f16 have no MPI datatype: reductions of them go through an f32 copy; broadcast and
//! all_gather move their bytes as 16-bit integers.
//!
//! The communicator's error handler is `MPI_ERRORS_RETURN`, and every return code is checked
//! and turned into [`Error::Backend`] with MPI's own error string. After a timeout the group is
//! failed: shutting it down calls `MPI_Abort`, so mpirun (and `ladder-run`) stop every rank.

use super::work::{Pending, Watch, Watchdog, Work};
use super::{agreement_probe, check_agreement, check_call, Agreement, Buffer, Call, Collective, DistEnv, Input, ProcessGroup, ReduceOp};
use crate::{Error, Result};
use mpi::ffi;
use mpi::traits::{AsRaw, Communicator};
use std::ffi::{c_int, c_void};
use tch::{Device, Kind, Tensor};

extern "C" {
    fn ladder_mpi_in_place() -> *mut c_void;
}

/// A process group over `MPI_COMM_WORLD`.
pub struct MpiGroup {
    // Dropping the universe calls MPI_Finalize; `shutdown` takes it (once).
    universe: std::cell::RefCell<Option<mpi::environment::Universe>>,
    comm: ffi::MPI_Comm,
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
        let group =
            Self { universe: std::cell::RefCell::new(Some(universe)), comm, rank, local_rank: env.local_rank, world_size, watch, dog };
        group.check("MPI_Comm_set_errhandler", code)?;
        Ok(group)
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

fn is_half(kind: Kind) -> bool {
    matches!(kind, Kind::BFloat16 | Kind::Half)
}

fn mpi_op(op: ReduceOp) -> ffi::MPI_Op {
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

    /// Open MPI's blocking calls (the fastest for small messages), each preceded by the
    /// blocking agreement probe unless prechecked, armed in the watchdog.
    ///
    /// A reduce-scatter of a handed-over f32/f64/i64 input at 2 ranks is the all-reduce in
    /// place, then this rank's block. Open MPI 4.1's all-reduce is tuned better than its
    /// `MPI_Reduce_scatter_block` there, though a reduce-scatter moves half the bytes (2 ranks,
    /// 2-core AMD EPYC: 151 MB 74–79 ms against 101–103 ms, 4.7 MB 0.60 against 0.75–0.82 ms;
    /// FULL_SHARD at width 4096 spent 127–138 ms per step in collectives against 143–157, with
    /// 40–50 MiB less peak RSS per rank). At 3 and more ranks `MPI_Reduce_scatter_block`, as
    /// fast or faster there.
    fn run(&self, collective: Collective<'_>) -> Result<()> {
        let Collective { call, agreement } = collective;
        self.check_call(&call)?;
        let checked = agreement == Agreement::Checked;
        match call {
            Call::AllReduce { mut tensor, op } => self.blocking("all_reduce", || {
                if checked {
                    self.agree("all_reduce", tensor.numel() as i64, tensor.kind())?;
                }
                self.all_reduce_unchecked(&mut tensor, op)
            }),
            Call::Broadcast { mut tensor, src } => self.blocking("broadcast", || {
                if checked {
                    self.agree("broadcast", tensor.numel() as i64, tensor.kind())?;
                }
                self.broadcast_unchecked(&mut tensor, src)
            }),
            Call::AllGather { mut output, input } => self.blocking("all_gather", || {
                if checked {
                    self.agree("all_gather", input.numel() as i64, input.kind())?;
                }
                self.all_gather_unchecked(&mut output, &input)
            }),
            Call::ReduceScatter { mut output, input: Input::Owned(input), op } if self.world_size == 2 && !is_half(input.kind()) => {
                self.reduce_scatter_in_place(&mut output, input, op, agreement)
            }
            Call::ReduceScatter { mut output, input, op } => self.blocking("reduce_scatter", || {
                if checked {
                    self.agree("reduce_scatter", input.numel() as i64, input.kind())?;
                }
                self.reduce_scatter_unchecked(&mut output, &input, op)
            }),
            Call::Barrier => self.blocking("barrier", || self.barrier_unchecked()),
        }
    }

    /// Open MPI's non-blocking calls, each preceded by the non-blocking agreement probe unless
    /// prechecked; the [`Work`] advances them with `MPI_Test`.
    fn start<'a>(&'a self, collective: Collective<'a>) -> Result<Work<'a>> {
        let Collective { call, agreement } = collective;
        self.check_call(&call)?;
        match call {
            Call::AllReduce { tensor, op } => self.start_all_reduce(tensor, op, agreement),
            Call::Broadcast { tensor, src } => self.start_broadcast(tensor, src, agreement),
            Call::AllGather { output, input } => self.start_all_gather(output, input, agreement),
            Call::ReduceScatter { output, input, op } => self.start_reduce_scatter(output, input, op, agreement),
            Call::Barrier => self.start_barrier(),
        }
    }
}

/// `MPI_Abort` on `MPI_COMM_WORLD`: ends every rank of the job (the watchdog's abort).
fn abort_world() {
    // SAFETY: MPI is initialised (the group exists); MPI_Abort terminates the job.
    unsafe { ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, 1) };
}

/// The non-blocking forms: the agreement probe (unless prechecked), then the collective's own
/// non-blocking call, advanced by the [`Work`] with `MPI_Test`. Each keeps its tensors —
/// borrowed or handed over — in the closure that finishes it, so they live until the request
/// completed.
impl MpiGroup {
    /// Starts collective `op`. Checked: the non-blocking agreement probe on `numel` and `kind`
    /// first, and once every rank agreed `main` issues the collective's own non-blocking call
    /// (before this returns). Prechecked: `main` at once. `finish` runs once it completed.
    fn issue<'a>(
        &'a self,
        op: &'static str,
        (numel, kind): (i64, Kind),
        agreement: Agreement,
        main: Box<dyn FnOnce() -> Result<ffi::MPI_Request> + 'a>,
        finish: Option<Box<dyn FnOnce() + 'a>>,
    ) -> Result<Work<'a>> {
        let seq = self.watch.begin(op)?;
        if agreement == Agreement::Prechecked {
            let req = main()?;
            let pending = MpiPending { group: self, op, req, stage: None, finish };
            return Ok(Work::pending(op, seq, &self.watch, Box::new(pending)));
        }
        let mut probe = Box::new(agreement_probe(numel, kind));
        let mut req = null_request();
        // SAFETY: `probe` is 4 heap-stable i64 reduced in place and kept alive (in the pending
        // state) until the request completed; the communicator is live.
        let rc = unsafe {
            ffi::MPI_Iallreduce(
                ladder_mpi_in_place(),
                probe.as_mut_ptr() as *mut c_void,
                4,
                ffi::RSMPI_INT64_T,
                ffi::RSMPI_MAX,
                self.comm,
                &mut req,
            )
        };
        self.check("MPI_Iallreduce", rc)?;
        let pending = MpiPending { group: self, op, req, stage: Some(Stage { probe, numel, kind, main }), finish };
        let mut work = Work::pending(op, seq, &self.watch, Box::new(pending));
        // Issue the collective itself before returning: were it issued later, from a `test`,
        // a collective started meanwhile could be issued before it on one rank and after it
        // on another. The probe is 4 integers; only its latency is waited for here.
        work.wait_issued()?;
        Ok(work)
    }

    /// `MPI_Iallreduce` in place on `n` elements of `ty` at `p`.
    fn iallreduce(&self, p: *mut c_void, n: c_int, ty: ffi::MPI_Datatype, op: ReduceOp) -> Result<ffi::MPI_Request> {
        let mut req = null_request();
        // SAFETY: the caller's buffer holds `n` elements of `ty` and is kept alive by the Work
        // until the request completed.
        let rc = unsafe { ffi::MPI_Iallreduce(ladder_mpi_in_place(), p, n, ty, mpi_op(op), self.comm, &mut req) };
        self.check("MPI_Iallreduce", rc)?;
        Ok(req)
    }

    /// `MPI_Ireduce_scatter_block` from `input` (world_size·n elements) to `output` (n).
    fn ireduce_scatter(
        &self,
        input: *mut c_void,
        output: *mut c_void,
        n: c_int,
        ty: ffi::MPI_Datatype,
        op: ReduceOp,
    ) -> Result<ffi::MPI_Request> {
        let mut req = null_request();
        // SAFETY: as `iallreduce`; input and output do not overlap.
        let rc = unsafe { ffi::MPI_Ireduce_scatter_block(input, output, n, ty, mpi_op(op), self.comm, &mut req) };
        self.check("MPI_Ireduce_scatter_block", rc)?;
        Ok(req)
    }

    /// All-reduce: in place; 16-bit floats through an f32 copy; `Avg` divides once completed.
    fn start_all_reduce<'a>(&'a self, mut tensor: Buffer<'a>, op: ReduceOp, agreement: Agreement) -> Result<Work<'a>> {
        let (n, kind, numel, ws) = (self.count("all_reduce", &tensor)?, tensor.kind(), tensor.numel() as i64, self.world_size as f64);
        if is_half(kind) {
            let mut wide = tensor.to_kind(Kind::Float);
            let p = wide.data_ptr();
            let main = Box::new(move || self.iallreduce(p, n, raw_type(Kind::Float), op));
            let finish = Box::new(move || {
                if op == ReduceOp::Avg {
                    let _ = wide.g_div_scalar_(ws);
                }
                tensor.copy_(&wide);
            });
            return self.issue("all_reduce", (numel, kind), agreement, main, Some(finish));
        }
        let p = tensor.data_ptr();
        let main = Box::new(move || self.iallreduce(p, n, raw_type(kind), op));
        let finish = Box::new(move || {
            if op == ReduceOp::Avg {
                let _ = tensor.g_div_scalar_(ws);
            }
            drop(tensor);
        });
        self.issue("all_reduce", (numel, kind), agreement, main, Some(finish))
    }

    /// Broadcast: `MPI_Ibcast` in place.
    fn start_broadcast<'a>(&'a self, tensor: Buffer<'a>, src: usize, agreement: Agreement) -> Result<Work<'a>> {
        let (n, kind, numel, p) = (self.count("broadcast", &tensor)?, tensor.kind(), tensor.numel() as i64, tensor.data_ptr());
        let main = Box::new(move || {
            let mut req = null_request();
            // SAFETY: contiguous CPU tensor of `n` elements of the datatype's size, kept alive
            // by the Work until the request completed.
            let rc = unsafe { ffi::MPI_Ibcast(p, n, raw_type(kind), src as c_int, self.comm, &mut req) };
            self.check("MPI_Ibcast", rc).map(|_| req)
        });
        self.issue("broadcast", (numel, kind), agreement, main, Some(Box::new(move || drop(tensor))))
    }

    /// All-gather: `MPI_Iallgather`, moving 16-bit floats as 16-bit integers.
    fn start_all_gather<'a>(&'a self, output: Buffer<'a>, input: Input<'a>, agreement: Agreement) -> Result<Work<'a>> {
        let (n, kind, numel) = (self.count("all_gather", &input)?, input.kind(), input.numel() as i64);
        let (i, o) = (input.data_ptr(), output.data_ptr());
        let main = Box::new(move || {
            let ty = raw_type(kind);
            let mut req = null_request();
            // SAFETY: input holds n and output world_size·n contiguous CPU elements of one
            // datatype, both kept alive by the Work until the request completed.
            let rc = unsafe { ffi::MPI_Iallgather(i, n, ty, o, n, ty, self.comm, &mut req) };
            self.check("MPI_Iallgather", rc).map(|_| req)
        });
        self.issue("all_gather", (numel, kind), agreement, main, Some(Box::new(move || drop((output, input)))))
    }

    /// Reduce-scatter: `MPI_Ireduce_scatter_block`; 16-bit floats through f32 copies; `Avg`
    /// divides once completed.
    fn start_reduce_scatter<'a>(
        &'a self,
        mut output: Buffer<'a>,
        input: Input<'a>,
        op: ReduceOp,
        agreement: Agreement,
    ) -> Result<Work<'a>> {
        let (n, kind, numel, ws) = (self.count("reduce_scatter", &output)?, input.kind(), input.numel() as i64, self.world_size as f64);
        if is_half(kind) {
            let wide_in = input.to_kind(Kind::Float);
            let mut wide_out = output.to_kind(Kind::Float);
            let (i, o) = (wide_in.data_ptr(), wide_out.data_ptr());
            let main = Box::new(move || self.ireduce_scatter(i, o, n, raw_type(Kind::Float), op));
            let finish = Box::new(move || {
                if op == ReduceOp::Avg {
                    let _ = wide_out.g_div_scalar_(ws);
                }
                output.copy_(&wide_out);
                drop((wide_in, input));
            });
            return self.issue("reduce_scatter", (numel, kind), agreement, main, Some(finish));
        }
        let (i, o) = (input.data_ptr(), output.data_ptr());
        let main = Box::new(move || self.ireduce_scatter(i, o, n, raw_type(kind), op));
        let finish = Box::new(move || {
            if op == ReduceOp::Avg {
                let _ = output.g_div_scalar_(ws);
            }
            drop((output, input));
        });
        self.issue("reduce_scatter", (numel, kind), agreement, main, Some(finish))
    }

    /// Barrier: `MPI_Ibarrier` (nothing to agree on).
    fn start_barrier(&self) -> Result<Work<'_>> {
        let seq = self.watch.begin("barrier")?;
        let mut req = null_request();
        // SAFETY: the communicator is live; `req` is a valid out-pointer.
        let rc = unsafe { ffi::MPI_Ibarrier(self.comm, &mut req) };
        self.check("MPI_Ibarrier", rc)?;
        let pending = MpiPending { group: self, op: "barrier", req, stage: None, finish: None };
        Ok(Work::pending("barrier", seq, &self.watch, Box::new(pending)))
    }
}

fn null_request() -> ffi::MPI_Request {
    // SAFETY: reading rsmpi's predefined null request handle.
    unsafe { ffi::RSMPI_REQUEST_NULL }
}

/// The agreement probe in flight and the collective to issue once it completed.
struct Stage<'a> {
    probe: Box<[i64; 4]>,
    numel: i64,
    kind: Kind,
    main: Box<dyn FnOnce() -> Result<ffi::MPI_Request> + 'a>,
}

/// A started MPI collective: probe → main call → finish.
struct MpiPending<'a> {
    group: &'a MpiGroup,
    op: &'static str,
    req: ffi::MPI_Request,
    stage: Option<Stage<'a>>,
    finish: Option<Box<dyn FnOnce() + 'a>>,
}

impl Pending for MpiPending<'_> {
    fn issued(&self) -> bool {
        self.stage.is_none()
    }

    fn test(&mut self) -> Result<bool> {
        loop {
            let mut done: c_int = 0;
            // SAFETY: `req` is the live request of the current stage; the status is ignored.
            let rc = unsafe { ffi::MPI_Test(&mut self.req, &mut done, ffi::RSMPI_STATUS_IGNORE) };
            self.group.check("MPI_Test", rc)?;
            if done == 0 {
                return Ok(false);
            }
            match self.stage.take() {
                Some(Stage { probe, numel, kind, main }) => {
                    check_agreement(self.op, self.group.rank, numel, kind, &probe)?;
                    self.req = main()?;
                }
                None => {
                    if let Some(f) = self.finish.take() {
                        f();
                    }
                    return Ok(true);
                }
            }
        }
    }
}

/// The blocking forms: Open MPI's blocking calls, preceded by the blocking agreement probe
/// unless prechecked, under the watchdog's deadline.
impl MpiGroup {
    /// Runs blocking collective `op` with its sequence number and progress record, armed in
    /// the watchdog.
    fn blocking(&self, op: &'static str, f: impl FnOnce() -> Result<()>) -> Result<()> {
        let seq = self.watch.begin(op)?;
        let armed = self.dog.arm(op, seq);
        let r = f();
        drop(armed);
        self.watch.end(seq);
        r
    }

    /// One small all-reduce that makes every rank agree that each passed `numel` elements of
    /// `kind`; the error names the smallest and largest value seen.
    fn agree(&self, op: &'static str, numel: i64, kind: Kind) -> Result<()> {
        let mut v = agreement_probe(numel, kind);
        // SAFETY: `v` is 4 contiguous i64 used in place; the communicator is live.
        let rc = unsafe {
            ffi::MPI_Allreduce(ladder_mpi_in_place(), v.as_mut_ptr() as *mut c_void, 4, ffi::RSMPI_INT64_T, ffi::RSMPI_MAX, self.comm)
        };
        self.check("MPI_Allreduce", rc)?;
        check_agreement(op, self.rank, numel, kind, &v)
    }

    /// In-place MPI_Allreduce on a contiguous f32/f64/i64 tensor.
    fn all_reduce_raw(&self, t: &mut Tensor, op: ReduceOp) -> Result<()> {
        let n = self.count("all_reduce", t)?;
        // SAFETY: `t` is contiguous on the CPU with `n` elements of the datatype's size (checked by
        // the caller), and nothing else touches it during the call.
        let rc = unsafe { ffi::MPI_Allreduce(ladder_mpi_in_place(), t.data_ptr(), n, raw_type(t.kind()), mpi_op(op), self.comm) };
        self.check("MPI_Allreduce", rc)
    }

    fn reduce_scatter_raw(&self, output: &mut Tensor, input: &Tensor, op: ReduceOp) -> Result<()> {
        let n = self.count("reduce_scatter", output)?;
        // SAFETY: input holds world_size·n and output n contiguous CPU elements of one datatype
        // (checked by the caller); they do not overlap.
        let rc =
            unsafe { ffi::MPI_Reduce_scatter_block(input.data_ptr(), output.data_ptr(), n, raw_type(input.kind()), mpi_op(op), self.comm) };
        self.check("MPI_Reduce_scatter_block", rc)
    }

    /// The all-reduce itself (f32 through a copy for 16-bit floats; Avg divides after).
    fn all_reduce_unchecked(&self, tensor: &mut Tensor, op: ReduceOp) -> Result<()> {
        if is_half(tensor.kind()) {
            let mut wide = tensor.to_kind(Kind::Float);
            self.all_reduce_raw(&mut wide, op)?;
            if op == ReduceOp::Avg {
                let _ = wide.g_div_scalar_(self.world_size as f64);
            }
            tensor.copy_(&wide);
            return Ok(());
        }
        self.all_reduce_raw(tensor, op)?;
        if op == ReduceOp::Avg {
            let _ = tensor.g_div_scalar_(self.world_size as f64);
        }
        Ok(())
    }

    fn broadcast_unchecked(&self, tensor: &mut Tensor, src: usize) -> Result<()> {
        let n = self.count("broadcast", tensor)?;
        // SAFETY: contiguous CPU tensor of `n` elements of the datatype's size.
        let rc = unsafe { ffi::MPI_Bcast(tensor.data_ptr(), n, raw_type(tensor.kind()), src as c_int, self.comm) };
        self.check("MPI_Bcast", rc)
    }

    fn all_gather_unchecked(&self, output: &mut Tensor, input: &Tensor) -> Result<()> {
        let n = self.count("all_gather", input)?;
        let ty = raw_type(input.kind());
        // SAFETY: input holds n and output world_size·n contiguous CPU elements of one datatype.
        let rc = unsafe { ffi::MPI_Allgather(input.data_ptr(), n, ty, output.data_ptr(), n, ty, self.comm) };
        self.check("MPI_Allgather", rc)
    }

    fn reduce_scatter_unchecked(&self, output: &mut Tensor, input: &Tensor, op: ReduceOp) -> Result<()> {
        if is_half(input.kind()) {
            let wide_in = input.to_kind(Kind::Float);
            let mut wide_out = output.to_kind(Kind::Float);
            self.reduce_scatter_raw(&mut wide_out, &wide_in, op)?;
            if op == ReduceOp::Avg {
                let _ = wide_out.g_div_scalar_(self.world_size as f64);
            }
            output.copy_(&wide_out);
            return Ok(());
        }
        self.reduce_scatter_raw(output, input, op)?;
        if op == ReduceOp::Avg {
            let _ = output.g_div_scalar_(self.world_size as f64);
        }
        Ok(())
    }

    /// The reduce-scatter of a handed-over input at 2 ranks (see [`ProcessGroup::run`]): the
    /// all-reduce in place (`Avg`: a sum, then only this rank's block divided — the rest is
    /// thrown away), then this rank's block. Arguments checked by the caller.
    fn reduce_scatter_in_place(&self, output: &mut Tensor, mut input: Tensor, op: ReduceOp, agreement: Agreement) -> Result<()> {
        let sum = if op == ReduceOp::Avg { ReduceOp::Sum } else { op };
        self.run(Collective::all_reduce(&mut input, sum).with_agreement(agreement))?;
        let n = output.numel() as i64;
        output.f_copy_(&input.narrow(0, self.rank as i64 * n, n))?;
        if op == ReduceOp::Avg {
            let _ = output.f_div_scalar_(self.world_size as f64)?;
        }
        Ok(())
    }

    fn barrier_unchecked(&self) -> Result<()> {
        // SAFETY: the communicator is live.
        let rc = unsafe { ffi::MPI_Barrier(self.comm) };
        self.check("MPI_Barrier", rc)
    }
}
