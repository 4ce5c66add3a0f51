//! The `nccl` backend: NCCL loaded at run time (`ffi::nccl`: the libnccl.so.2 libtorch loaded,
//! so builds need no CUDA and one NCCL serves the process), in place on CUDA tensors, on the
//! stream libtorch uses by default (the legacy default stream), so the collectives are ordered
//! after the kernels that produced their inputs.
//!
//! Rank 0 creates NCCL's unique id and hands it to the others through the TCP rendezvous at
//! `MASTER_ADDR:MASTER_PORT` ([`super::rendezvous::TcpStore`]), as torch's `TCPStore` does.
//! A missing GPU or libnccl is an [`Error::BackendUnavailable`].
//!
//! The collective timeout: each collective starts with the agreement probe, whose result the
//! host reads; that wait polls the stream (`cuStreamQuery`) and NCCL's asynchronous error
//! against the group's deadline, and on timeout calls `ncclCommAbort` (as PyTorch's NCCL
//! watchdog does) and returns [`Error::CollectiveTimeout`]. The stream is ordered, so a
//! collective that never completes is caught by the next one's probe.

use super::rendezvous::TcpStore;
use super::work::Watch;
use super::{agreement_probe, check_agreement, check_call, Call, Collective, DistEnv, ProcessGroup, ReduceOp};
use crate::ffi::nccl::{self as lib, Comm, Stream, UniqueId};
use crate::{Error, Result};
use std::ffi::{c_int, c_void};
use std::time::Duration;
use tch::{Device, Kind, Tensor};

/// How long ranks wait for each other at the rendezvous.
pub const RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(300);

/// A process group over one NCCL communicator; rank r uses GPU `local_rank`.
pub struct NcclGroup {
    comm: Comm,
    // The process's libnccl, which created `comm`.
    nccl: &'static lib::Nccl,
    // The rendezvous store, kept for the unique ids of sub-groups (`new_group`).
    store: std::rc::Rc<TcpStore>,
    // This group's name in store keys (`world`, `world/g1`, …) and how many `new_group`
    // calls it has seen (the next sub-group's number).
    key: String,
    groups_made: std::cell::Cell<u64>,
    rank: usize,
    local_rank: usize,
    world_size: usize,
    device: Device,
    // Keeps the CUDA primary context alive and current for this thread.
    _ctx: std::sync::Arc<cudarc::driver::CudaContext>,
    // Set once the communicator is destroyed (by `shutdown` or drop).
    destroyed: std::cell::Cell<bool>,
    watch: Watch,
}

impl std::fmt::Debug for NcclGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclGroup").field("rank", &self.rank).field("world_size", &self.world_size).finish()
    }
}

fn unavailable(why: impl Into<String>) -> Error {
    Error::BackendUnavailable { backend: "nccl".into(), why: why.into() }
}

impl NcclGroup {
    /// Probes CUDA and libnccl, exchanges the unique id, and calls `ncclCommInitRank`.
    ///
    /// # Errors
    /// [`Error::BackendUnavailable`] without a GPU or libnccl; rendezvous and NCCL errors.
    pub fn init(env: &DistEnv) -> Result<Self> {
        Self::init_with_timeout(env, super::timeout_from_env()?)
    }

    /// [`NcclGroup::init`] with a collective timeout.
    ///
    /// # Errors
    /// As [`NcclGroup::init`].
    pub fn init_with_timeout(env: &DistEnv, timeout: Duration) -> Result<Self> {
        let device = crate::device::DeviceKind::Cuda.resolve(env.local_rank)?;
        let Device::Cuda(ordinal) = device else { unreachable!("resolve(Cuda) gives a CUDA device") };
        let nccl = lib::nccl().map_err(unavailable)?;
        let ctx = std::panic::catch_unwind(|| cudarc::driver::CudaContext::new(ordinal))
            .map_err(|_| unavailable("the CUDA driver library could not be loaded"))?
            .map_err(|e| unavailable(format!("CUDA device {ordinal}: {e:?}")))?;
        let store = TcpStore::connect(env, RENDEZVOUS_TIMEOUT)?;
        let comm = init_comm(nccl, &store, "nccl_unique_id", env.rank, env.world_size)?;
        let watch = Watch::new(env.rank, env.world_size, timeout);
        Ok(Self {
            comm,
            nccl,
            store: std::rc::Rc::new(store),
            key: "world".into(),
            groups_made: std::cell::Cell::new(0),
            rank: env.rank,
            local_rank: env.local_rank,
            world_size: env.world_size,
            device,
            _ctx: ctx,
            destroyed: std::cell::Cell::new(false),
            watch,
        })
    }

    /// `new_group(ranks)`: every rank counts the call (so sub-group `n` of this group has the
    /// same store key `nccl_unique_id/<key>/g<n>` on every rank); the members build a
    /// communicator of their own, the lowest member creating its unique id.
    fn split(&self, sorted: &[usize]) -> Result<Option<Box<dyn ProcessGroup>>> {
        let n = self.groups_made.get() + 1;
        self.groups_made.set(n);
        let Some(rank) = sorted.iter().position(|&r| r == self.rank) else { return Ok(None) };
        let key = format!("{}/g{n}", self.key);
        let comm = init_comm(self.nccl, &self.store, &format!("nccl_unique_id/{key}"), rank, sorted.len())?;
        let watch = Watch::unrecorded(rank, sorted.len(), self.watch.timeout());
        Ok(Some(Box::new(Self {
            comm,
            nccl: self.nccl,
            store: self.store.clone(),
            key,
            groups_made: std::cell::Cell::new(0),
            rank,
            local_rank: self.local_rank,
            world_size: sorted.len(),
            device: self.device,
            _ctx: self._ctx.clone(),
            destroyed: std::cell::Cell::new(false),
            watch,
        })))
    }

    fn stream() -> Stream {
        std::ptr::null_mut()
    }

    fn agree(&self, op: &'static str, numel: i64, kind: Kind) -> Result<()> {
        let seq = self.watch.begin(op)?;
        let v = Tensor::from_slice(&agreement_probe(numel, kind)).to_device(self.device);
        self.call("ncclAllReduce", |n, comm, s| {
            // SAFETY: 4 contiguous i64 on this group's GPU, used in place.
            unsafe { (n.all_reduce)(v.data_ptr(), v.data_ptr(), 4, lib::dtype::INT64, lib::op::MAX, comm, s) }
        })?;
        self.wait_stream(op, seq)?;
        self.watch.end(seq);
        let v = Vec::<i64>::try_from(v.to_device(Device::Cpu))?;
        let v: [i64; 4] =
            v.try_into().map_err(|_| Error::BadTensor { op, rank: self.rank, problem: "agreement probe lost its shape".into() })?;
        check_agreement(op, self.rank, numel, kind, &v)
    }

    /// Waits until the stream completed what was enqueued, at most the group's timeout; on
    /// timeout (or an asynchronous NCCL error) aborts the communicator.
    fn wait_stream(&self, op: &'static str, seq: u64) -> Result<()> {
        let start = std::time::Instant::now();
        let step = super::progress::step();
        loop {
            // SAFETY: the legacy default stream (null) of the current context.
            let rc = unsafe { cudarc::driver::sys::cuStreamQuery(std::ptr::null_mut()) };
            if rc == cudarc::driver::sys::CUresult::CUDA_SUCCESS {
                return Ok(());
            }
            if rc != cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_READY {
                return Err(Error::Backend {
                    backend: "nccl",
                    call: "cuStreamQuery",
                    rank: self.rank,
                    code: rc as i64,
                    message: format!("{rc:?}"),
                });
            }
            let mut async_err = lib::SUCCESS;
            // SAFETY: a live communicator and a valid out-pointer.
            unsafe { (self.nccl.comm_get_async_error)(self.comm, &mut async_err) };
            if async_err != lib::SUCCESS && async_err != lib::IN_PROGRESS {
                self.abort();
                let message = self.nccl.error_string(async_err);
                self.watch.fail(format!("NCCL reported {message} in {op} #{seq}"));
                return Err(Error::Backend {
                    backend: "nccl",
                    call: "ncclCommGetAsyncError",
                    rank: self.rank,
                    code: async_err as i64,
                    message,
                });
            }
            let waited = start.elapsed();
            if waited >= self.watch.timeout() {
                self.abort();
                return Err(self.watch.timed_out(op, seq, step, waited));
            }
            super::work::backoff(waited);
        }
    }

    /// `ncclCommAbort`: ends the communicator's outstanding work at once (once).
    fn abort(&self) {
        if self.destroyed.replace(true) {
            return;
        }
        // SAFETY: a communicator created by ncclCommInitRank, aborted once (the flag above).
        unsafe { (self.nccl.comm_abort)(self.comm) };
    }

    /// Calls NCCL entry point `name` through `f` (given the library, the communicator and the
    /// stream); a result other than success is [`Error::Backend`] with NCCL's text.
    fn call(&self, name: &'static str, f: impl FnOnce(&lib::Nccl, Comm, Stream) -> c_int) -> Result<()> {
        check(self.nccl, f(self.nccl, self.comm, Self::stream()), self.rank, name)
    }

    /// `ReduceOp::Avg` needs a floating-point tensor (NCCL has no integer average).
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
                problem: "ReduceOp::Avg needs a floating-point tensor, found Int64".into(),
            });
        }
        Ok(())
    }
}

/// A communicator of `size` ranks, this one `rank`: rank 0 of it creates NCCL's unique id and
/// sets it in the store under `key`; the others get it from there.
fn init_comm(nccl: &lib::Nccl, store: &TcpStore, key: &str, rank: usize, size: usize) -> Result<Comm> {
    let id = if rank == 0 {
        let mut id = UniqueId { internal: [0; 128] };
        // SAFETY: a valid out-pointer to 128 bytes.
        check(nccl, unsafe { (nccl.get_unique_id)(&mut id) }, store.rank(), "ncclGetUniqueId")?;
        let bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
        store.set(key, &bytes)?;
        id
    } else {
        let bytes = store.get(key)?;
        if bytes.len() != 128 {
            return Err(Error::Rendezvous {
                addr: format!("the rendezvous store, key {key:?}"),
                problem: format!("NCCL unique id of {} bytes, expected 128", bytes.len()),
            });
        }
        let mut id = UniqueId { internal: [0; 128] };
        for (dst, src) in id.internal.iter_mut().zip(bytes) {
            *dst = src as std::ffi::c_char;
        }
        id
    };
    let mut comm = std::ptr::null_mut();
    // SAFETY: `comm` is a valid out-pointer; the id is the one rank 0 of the communicator created.
    check(nccl, unsafe { (nccl.comm_init_rank)(&mut comm, size as c_int, id, rank as c_int) }, store.rank(), "ncclCommInitRank")?;
    Ok(comm)
}

/// `code` from NCCL entry point `call` on `rank`: success, or [`Error::Backend`] with NCCL's
/// text and the library's version (two NCCLs in one process show here).
fn check(nccl: &lib::Nccl, code: c_int, rank: usize, call: &'static str) -> Result<()> {
    if code == lib::SUCCESS || code == lib::IN_PROGRESS {
        return Ok(());
    }
    let message = format!("{} (NCCL {} from {}; NCCL_DEBUG=WARN says more)", nccl.error_string(code), nccl.version(), nccl.file());
    Err(Error::Backend { backend: "nccl", call, rank, code: code as i64, message })
}

fn dtype(kind: Kind) -> c_int {
    match kind {
        Kind::Float => lib::dtype::FLOAT32,
        Kind::Double => lib::dtype::FLOAT64,
        Kind::Half => lib::dtype::FLOAT16,
        Kind::BFloat16 => lib::dtype::BFLOAT16,
        _ => lib::dtype::INT64,
    }
}

fn red_op(op: ReduceOp) -> c_int {
    match op {
        ReduceOp::Sum => lib::op::SUM,
        ReduceOp::Avg => lib::op::AVG,
        ReduceOp::Max => lib::op::MAX,
        ReduceOp::Min => lib::op::MIN,
    }
}

impl ProcessGroup for NcclGroup {
    fn shutdown(&self) {
        self.destroy();
    }

    /// A communicator of its own (see [`NcclGroup::split`]).
    fn new_group(&self, ranks: &[usize]) -> Result<Option<Box<dyn ProcessGroup>>> {
        let sorted = super::check_group_ranks(ranks, self.world_size)?;
        self.split(&sorted)
    }

    fn backend(&self) -> &'static str {
        "nccl"
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
        self.device
    }
    fn timeout(&self) -> Duration {
        self.watch.timeout()
    }

    /// Enqueues the collective on the stream after the agreement probe, whose result the host
    /// reads (within the timeout): the probe runs for [`Prechecked`](super::Agreement::Prechecked) calls too, as
    /// it is where this backend observes the collective timeout. The collective completes in
    /// stream order, so the default [`start`](ProcessGroup::start) returns a completed `Work`.
    fn run(&self, collective: Collective<'_>) -> Result<()> {
        let call = collective.call;
        check_call(&call, self.rank, self.world_size, self.device)?;
        self.check_avg(&call)?;
        match call {
            Call::AllReduce { tensor, op } => {
                self.agree("all_reduce", tensor.numel() as i64, tensor.kind())?;
                let (n, ty, p) = (tensor.numel(), dtype(tensor.kind()), tensor.data_ptr());
                // SAFETY: contiguous tensor of n elements on this group's GPU, reduced in place.
                self.call("ncclAllReduce", |l, c, s| unsafe { (l.all_reduce)(p as *const c_void, p, n, ty, red_op(op), c, s) })
            }
            Call::Broadcast { tensor, src } => {
                self.agree("broadcast", tensor.numel() as i64, tensor.kind())?;
                let (n, ty, p) = (tensor.numel(), dtype(tensor.kind()), tensor.data_ptr());
                // SAFETY: contiguous tensor of n elements on this group's GPU, in place.
                self.call("ncclBroadcast", |l, c, s| unsafe { (l.broadcast)(p as *const c_void, p, n, ty, src as c_int, c, s) })
            }
            Call::AllGather { output, input } => {
                self.agree("all_gather", input.numel() as i64, input.kind())?;
                let (n, ty) = (input.numel(), dtype(input.kind()));
                let (i, o) = (input.data_ptr(), output.data_ptr());
                // SAFETY: input n and output world_size·n elements on this group's GPU.
                self.call("ncclAllGather", |l, c, s| unsafe { (l.all_gather)(i as *const c_void, o, n, ty, c, s) })
            }
            Call::ReduceScatter { output, input, op } => {
                self.agree("reduce_scatter", input.numel() as i64, input.kind())?;
                let (n, ty) = (output.numel(), dtype(input.kind()));
                let (i, o) = (input.data_ptr(), output.data_ptr());
                // SAFETY: input world_size·n and output n elements on this group's GPU.
                self.call("ncclReduceScatter", |l, c, s| unsafe { (l.reduce_scatter)(i as *const c_void, o, n, ty, red_op(op), c, s) })
            }
            Call::Barrier => {
                let mut t = Tensor::zeros([1], (Kind::Float, self.device));
                self.all_reduce(&mut t, ReduceOp::Sum)?;
                tch::Cuda::synchronize(match self.device {
                    Device::Cuda(i) => i as i64,
                    _ => 0,
                });
                Ok(())
            }
        }
    }
}

impl NcclGroup {
    fn destroy(&self) {
        if self.destroyed.replace(true) {
            return;
        }
        // SAFETY: the communicator was created by ncclCommInitRank and is destroyed once (the
        // flag above).
        unsafe { (self.nccl.comm_destroy)(self.comm) };
    }
}

impl Drop for NcclGroup {
    fn drop(&mut self) {
        self.destroy();
    }
}
