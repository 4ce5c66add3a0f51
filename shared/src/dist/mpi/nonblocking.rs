//! The non-blocking collectives: the agreement probe (a 4-integer `MPI_Iallreduce`, unless
//! prechecked), then the collective's own non-blocking call, both advanced by the [`Work`] with
//! `MPI_Test`. Each keeps its tensors — borrowed or handed over — in the closure that finishes
//! it, so they live until the request completed.

use super::{mpi_op, null_request, raw_type, MpiGroup};
use crate::dist::work::{Pending, Work};
use crate::dist::{agreement_probe, check_agreement, Agreement, Buffer, Call, Collective, Input, ReduceOp};
use crate::ffi::mpi::in_place;
use crate::Result;
use mpi::ffi;
use std::ffi::{c_int, c_void};
use tch::Kind;

impl MpiGroup {
    /// [`ProcessGroup::start`](crate::dist::ProcessGroup::start): Open MPI's non-blocking
    /// calls, each preceded by the non-blocking agreement probe unless prechecked; the [`Work`]
    /// advances them with `MPI_Test`.
    pub(super) fn start_nonblocking<'a>(&'a self, collective: Collective<'a>) -> Result<Work<'a>> {
        let Collective { call, agreement } = collective;
        self.check_call(&call)?;
        match call {
            Call::AllReduce { tensor, op } => self.start_all_reduce(tensor, op, agreement),
            Call::Broadcast { tensor, src } => self.start_broadcast(tensor, src, agreement),
            Call::AllGather { output, input } => self.start_all_gather(output, input, agreement),
            // One rank: a copy, done when started (run_blocking says why not Open MPI's call).
            Call::ReduceScatter { output, input, .. } if self.world_size == 1 => {
                output.f_view([-1])?.f_copy_(&input.f_view([-1])?)?;
                Ok(Work::completed("reduce_scatter"))
            }
            Call::ReduceScatter { output, input, op } => self.start_reduce_scatter(output, input, op, agreement),
            Call::Barrier => self.start_barrier(),
        }
    }

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
            ffi::MPI_Iallreduce(in_place(), probe.as_mut_ptr() as *mut c_void, 4, ffi::RSMPI_INT64_T, ffi::RSMPI_MAX, self.comm, &mut req)
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

    /// `MPI_Iallreduce` in place on `n` elements of `kind` at `p`.
    fn iallreduce(&self, p: *mut c_void, n: c_int, kind: Kind, op: ReduceOp) -> Result<ffi::MPI_Request> {
        let mut req = null_request();
        // SAFETY: the caller's buffer holds `n` elements of `kind` and is kept alive by the Work
        // until the request completed.
        let rc = unsafe { ffi::MPI_Iallreduce(in_place(), p, n, raw_type(kind), mpi_op(op, kind), self.comm, &mut req) };
        self.check("MPI_Iallreduce", rc)?;
        Ok(req)
    }

    /// `MPI_Ireduce_scatter_block` from `input` (world_size·n elements) to `output` (n).
    fn ireduce_scatter(&self, input: *mut c_void, output: *mut c_void, n: c_int, kind: Kind, op: ReduceOp) -> Result<ffi::MPI_Request> {
        let mut req = null_request();
        // SAFETY: as `iallreduce`; input and output do not overlap.
        let rc = unsafe { ffi::MPI_Ireduce_scatter_block(input, output, n, raw_type(kind), mpi_op(op, kind), self.comm, &mut req) };
        self.check("MPI_Ireduce_scatter_block", rc)?;
        Ok(req)
    }

    /// All-reduce: in place; `Avg` divides once completed.
    fn start_all_reduce<'a>(&'a self, mut tensor: Buffer<'a>, op: ReduceOp, agreement: Agreement) -> Result<Work<'a>> {
        let (n, kind, numel, ws) = (self.count("all_reduce", &tensor)?, tensor.kind(), tensor.numel() as i64, self.world_size as f64);
        let p = tensor.data_ptr();
        let main = Box::new(move || self.iallreduce(p, n, kind, op));
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

    /// Reduce-scatter: `MPI_Ireduce_scatter_block`; `Avg` divides once completed.
    fn start_reduce_scatter<'a>(
        &'a self,
        mut output: Buffer<'a>,
        input: Input<'a>,
        op: ReduceOp,
        agreement: Agreement,
    ) -> Result<Work<'a>> {
        let (n, kind, numel, ws) = (self.count("reduce_scatter", &output)?, input.kind(), input.numel() as i64, self.world_size as f64);
        let (i, o) = (input.data_ptr(), output.data_ptr());
        let main = Box::new(move || self.ireduce_scatter(i, o, n, kind, op));
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
