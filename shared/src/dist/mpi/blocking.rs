//! The blocking collectives: Open MPI's blocking calls — the fastest for small messages — each
//! preceded by the blocking agreement probe (a 4-integer `MPI_Allreduce`) unless prechecked,
//! and armed in the group's watchdog, which aborts the job when one waits past the timeout.

use super::{mpi_op, raw_type, MpiGroup};
use crate::dist::{agreement_probe, check_agreement, Agreement, Call, Collective, Input, ReduceOp};
use crate::ffi::mpi::in_place;
use crate::Result;
use mpi::ffi;
use std::ffi::{c_int, c_void};
use tch::{Kind, Tensor};

/// From this many bytes of input (the whole message, every rank's blocks) and 3 ranks, a
/// blocking reduce-scatter is one `MPI_Reduce` per block ([`MpiGroup::reduce_per_owner`])
/// instead of `MPI_Reduce_scatter_block`. Measured at 3 and 4 ranks: as fast or faster from
/// here (`examples/reduce_scatter_bench.rs`); from 8 ranks not measured.
pub(crate) const PER_OWNER_MIN_BYTES: usize = 1 << 20;

impl MpiGroup {
    /// [`ProcessGroup::run`](crate::dist::ProcessGroup::run): Open MPI's blocking calls (the
    /// fastest for small messages), each preceded by the blocking agreement probe unless
    /// prechecked, armed in the watchdog.
    ///
    /// A reduce-scatter of a handed-over input at 2 ranks is the all-reduce in
    /// place, then this rank's block. Open MPI 4.1's all-reduce is tuned better than its
    /// `MPI_Reduce_scatter_block` there, though a reduce-scatter moves half the bytes (2 ranks,
    /// 2-core AMD EPYC: 151 MB 74–79 ms against 101–103 ms, 4.7 MB 0.60 against 0.75–0.82 ms;
    /// FULL_SHARD at width 4096 spent 127–138 ms per step in collectives against 143–157, with
    /// 40–50 MiB less peak RSS per rank). At 3 and more ranks a message of at least
    /// [`PER_OWNER_MIN_BYTES`] is reduced block by block, one `MPI_Reduce` to each block's owner
    /// (see [`reduce_per_owner`](Self::reduce_per_owner)); a smaller one is one
    /// `MPI_Reduce_scatter_block`. At one rank a reduce-scatter is a copy of its input (any reduction
    /// of one value is that value): Open MPI 4.1's `MPI_Reduce_scatter_block` (basic linear)
    /// reduces into a temporary as large as the input first, then copies — FULL_SHARD's flat
    /// gradient of fc1 at width 4096 held 144 MiB more at its peak (counted with an
    /// `LD_PRELOAD` count of live `malloc`'d bytes, AMD EPYC Zen 5) for the same result.
    pub(super) fn run_blocking(&self, collective: Collective<'_>) -> Result<()> {
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
            Call::ReduceScatter { output, input, .. } if self.world_size == 1 => {
                // Flat, as the checks compare element counts and Open MPI reads raw buffers.
                self.blocking("reduce_scatter", || Ok(output.f_view([-1])?.f_copy_(&input.f_view([-1])?)?))
            }
            Call::ReduceScatter { mut output, input: Input::Owned(input), op } if self.world_size == 2 => {
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
        let rc = unsafe { ffi::MPI_Allreduce(in_place(), v.as_mut_ptr() as *mut c_void, 4, ffi::RSMPI_INT64_T, ffi::RSMPI_MAX, self.comm) };
        self.check("MPI_Allreduce", rc)?;
        check_agreement(op, self.rank, numel, kind, &v)
    }

    /// In-place MPI_Allreduce on a contiguous f32/f64/i64 tensor.
    fn all_reduce_raw(&self, t: &mut Tensor, op: ReduceOp) -> Result<()> {
        let n = self.count("all_reduce", t)?;
        // SAFETY: `t` is contiguous on the CPU with `n` elements of the datatype's size (checked by
        // the caller), and nothing else touches it during the call.
        let rc = unsafe { ffi::MPI_Allreduce(in_place(), t.data_ptr(), n, raw_type(t.kind()), mpi_op(op, t.kind()), self.comm) };
        self.check("MPI_Allreduce", rc)
    }

    fn reduce_scatter_raw(&self, output: &mut Tensor, input: &Tensor, op: ReduceOp) -> Result<()> {
        let n = self.count("reduce_scatter", output)?;
        if self.world_size >= 3 && input.numel() * input.kind().elt_size_in_bytes() >= PER_OWNER_MIN_BYTES {
            return self.reduce_per_owner(output, input, op, n);
        }
        // SAFETY: input holds world_size·n and output n contiguous CPU elements of one datatype
        // (checked by the caller); they do not overlap.
        let rc = unsafe {
            ffi::MPI_Reduce_scatter_block(
                input.data_ptr(),
                output.data_ptr(),
                n,
                raw_type(input.kind()),
                mpi_op(op, input.kind()),
                self.comm,
            )
        };
        self.check("MPI_Reduce_scatter_block", rc)
    }

    /// The reduce-scatter as `world_size` calls of `MPI_Reduce`, block `r` (`n` elements) of
    /// every rank's input reduced into rank `r`'s output (Open MPI 4.1's basic linear
    /// algorithm reduces block by block too above `INT_MAX` elements, each block to rank 0,
    /// then sent on). Its `MPI_Reduce_scatter_block` (commutative ops, `tuned` component's
    /// fixed rules) picks the basic linear algorithm for a block per rank of at least 128 KiB
    /// at 3 ranks, 1 MiB at 4 to 7, and some sizes from 8: the whole
    /// message reduced into a temporary on rank 0, then scattered; the reduce under it adds a
    /// second one at 4 ranks (linear: rank 0 receives each peer's message whole) and one on
    /// rank 1 at 3 (a pipelined chain's accumulator). Measured, 64 MiB of f32 (AMD EPYC Zen 5):
    /// 1.0 of the message on ranks 0 and 1 at W = 3, 2.0 on rank 0 at W = 4; FSDP's flat
    /// gradient of fc1 at width 4096 put 130–145 MiB more on rank 0 than on the others at
    /// W = 4. One reduce per owner needs at most a block's temporaries, on whichever rank
    /// the reduce picks, and no rank receives more than its own block's share.
    fn reduce_per_owner(&self, output: &mut Tensor, input: &Tensor, op: ReduceOp, n: c_int) -> Result<()> {
        let (ty, mop) = (raw_type(input.kind()), mpi_op(op, input.kind()));
        let block_bytes = n as usize * input.kind().elt_size_in_bytes();
        for root in 0..self.world_size {
            // SAFETY: input holds world_size·n contiguous CPU elements (checked by the caller), so
            // block `root` starts `root · block_bytes` in and holds n; the output (n elements, not
            // overlapping the input) is written on the root alone and ignored elsewhere.
            let rc = unsafe {
                let block = (input.data_ptr() as *mut u8).add(root * block_bytes) as *mut c_void;
                let recv = if root == self.rank { output.data_ptr() } else { std::ptr::null_mut() };
                ffi::MPI_Reduce(block, recv, n, ty, mop, root as c_int, self.comm)
            };
            self.check("MPI_Reduce", rc)?;
        }
        Ok(())
    }

    /// The all-reduce itself (Avg divides after).
    fn all_reduce_unchecked(&self, tensor: &mut Tensor, op: ReduceOp) -> Result<()> {
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
        self.reduce_scatter_raw(output, input, op)?;
        if op == ReduceOp::Avg {
            let _ = output.g_div_scalar_(self.world_size as f64);
        }
        Ok(())
    }

    /// The reduce-scatter of a handed-over input at 2 ranks (see [`run_blocking`](Self::run_blocking)): the
    /// all-reduce in place (`Avg`: a sum, then only this rank's block divided — the rest is
    /// thrown away), then this rank's block. Arguments checked by the caller.
    fn reduce_scatter_in_place(&self, output: &mut Tensor, mut input: Tensor, op: ReduceOp, agreement: Agreement) -> Result<()> {
        let sum = if op == ReduceOp::Avg { ReduceOp::Sum } else { op };
        self.run_blocking(Collective::all_reduce(&mut input, sum).with_agreement(agreement))?;
        let n = output.numel() as i64;
        output.f_view([-1])?.f_copy_(&input.f_view([-1])?.f_narrow(0, self.rank as i64 * n, n)?)?;
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
