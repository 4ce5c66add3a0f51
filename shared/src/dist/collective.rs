//! What a collective call is, apart from how a backend runs it: the operation and its tensors
//! ([`Call`]), who owns those tensors ([`Buffer`], [`Input`]) and whether the ranks first check
//! that they agree on the layout ([`Agreement`]). Whether the caller waits is the group's
//! method: [`ProcessGroup::run`](super::ProcessGroup::run) returns once the collective
//! completed, [`ProcessGroup::start`](super::ProcessGroup::start) returns a [`Work`](super::Work)
//! at once (`torch.distributed`'s `async_op=True`).
//!
//! ```ignore
//! pg.all_reduce(&mut t, ReduceOp::Sum)?;                                   // torch's dist.all_reduce
//! pg.run(Collective::all_reduce(&mut flat, ReduceOp::Avg).prechecked())?;  // DDP: layout checked once
//! let work = pg.start(Collective::all_gather(full, shard))?;               // FSDP's prefetch: the Work owns both
//! pg.run(Collective::reduce_scatter(&mut out, flat_grad, ReduceOp::Avg))?; // a flat gradient handed over
//! ```

use super::ReduceOp;
use std::ops::{Deref, DerefMut};
use tch::Tensor;

/// A tensor a collective writes its result into, in place: borrowed for as long as the call
/// (and its [`Work`](super::Work)) lives, or handed over to it. A handed-over tensor lets the
/// `Work` outlive the caller's scope (FSDP keeps a prefetched all-gather across segments):
/// pass a shallow clone ([`Tensor::shallow_clone`]) and keep another to read the result once
/// the work completed — not before, and without resizing or freeing it meanwhile.
#[derive(Debug)]
pub enum Buffer<'a> {
    /// The caller's tensor, borrowed.
    Borrowed(&'a mut Tensor),
    /// A tensor the call owns until it completed.
    Owned(Tensor),
}

/// A tensor a collective reads: borrowed, or handed over. A reduce-scatter may reduce a
/// handed-over input in place (the MPI backend does at 2 ranks), so it then holds unspecified
/// values; hand over temporaries only (FSDP's flat gradient).
#[derive(Debug)]
pub enum Input<'a> {
    /// The caller's tensor, borrowed; never written.
    Borrowed(&'a Tensor),
    /// A tensor the call owns, and may overwrite, until it completed.
    Owned(Tensor),
}

impl Deref for Buffer<'_> {
    type Target = Tensor;
    fn deref(&self) -> &Tensor {
        match self {
            Buffer::Borrowed(t) => t,
            Buffer::Owned(t) => t,
        }
    }
}

impl DerefMut for Buffer<'_> {
    fn deref_mut(&mut self) -> &mut Tensor {
        match self {
            Buffer::Borrowed(t) => t,
            Buffer::Owned(t) => t,
        }
    }
}

impl Deref for Input<'_> {
    type Target = Tensor;
    fn deref(&self) -> &Tensor {
        match self {
            Input::Borrowed(t) => t,
            Input::Owned(t) => t,
        }
    }
}

impl<'a> From<&'a mut Tensor> for Buffer<'a> {
    fn from(t: &'a mut Tensor) -> Self {
        Buffer::Borrowed(t)
    }
}

impl From<Tensor> for Buffer<'_> {
    fn from(t: Tensor) -> Self {
        Buffer::Owned(t)
    }
}

impl<'a> From<&'a Tensor> for Input<'a> {
    fn from(t: &'a Tensor) -> Self {
        Input::Borrowed(t)
    }
}

impl From<Tensor> for Input<'_> {
    fn from(t: Tensor) -> Self {
        Input::Owned(t)
    }
}

/// The operation and its tensors, with `torch.distributed`'s semantics.
#[derive(Debug)]
pub enum Call<'a> {
    /// Reduces `tensor` element-wise over all ranks with `op`; every rank receives the result.
    /// As `dist.all_reduce(tensor, op)`.
    AllReduce {
        /// Input and result.
        tensor: Buffer<'a>,
        /// The reduction.
        op: ReduceOp,
    },
    /// Copies `tensor` of rank `src` into `tensor` on every rank. As `dist.broadcast`.
    Broadcast {
        /// Rank `src`'s value, then the result.
        tensor: Buffer<'a>,
        /// The rank whose tensor is sent, `0..world_size`.
        src: usize,
    },
    /// Gathers every rank's `input` (numel n) into `output` (numel world_size · n), rank r's
    /// block at `[r·n, (r+1)·n)`. As `dist.all_gather_into_tensor(output, input)`.
    AllGather {
        /// world_size · n elements.
        output: Buffer<'a>,
        /// n elements.
        input: Input<'a>,
    },
    /// Reduces `input` (numel world_size · n) over ranks with `op` and leaves block `rank`
    /// (numel n) of the result in `output`. As `dist.reduce_scatter_tensor(output, input, op)`.
    ReduceScatter {
        /// n elements.
        output: Buffer<'a>,
        /// world_size · n elements; a handed-over one may be reduced in place.
        input: Input<'a>,
        /// The reduction.
        op: ReduceOp,
    },
    /// Completes once every rank has called it. As `dist.barrier()`.
    Barrier,
}

/// Whether the ranks check, before a collective, that each passed the same numel and dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Agreement {
    /// A 4-integer Max all-reduce on numel and dtype precedes the collective: ranks that
    /// disagree get [`Error::CollectiveMismatch`](crate::Error::CollectiveMismatch) on every
    /// rank instead of undefined behaviour. It doubles the latency of small messages.
    #[default]
    Checked,
    /// No per-call check: the caller verified its layout across ranks once and issues the same
    /// tensors every time (DDP's buckets, checked when DDP is built). Ranks that pass different
    /// numels or dtypes get an MPI error or wrong results instead of the typed error (never
    /// memory unsafety: each rank's backend writes only its own buffer). The NCCL backend
    /// checks anyway: its probe is where the host observes the collective timeout.
    Prechecked,
}

/// One collective call: what runs ([`Call`]) and whether the ranks first agree on the layout
/// ([`Agreement`]). Build it with the constructor named as `torch.distributed`'s function, then
/// hand it to [`ProcessGroup::run`](super::ProcessGroup::run) or
/// [`ProcessGroup::start`](super::ProcessGroup::start).
///
/// Every tensor must be contiguous, of dtype f32, f64, bf16, f16 or i64, on the group's device;
/// otherwise the call is a typed [`Error::BadTensor`](crate::Error::BadTensor).
#[derive(Debug)]
#[must_use = "a collective does nothing until it is given to ProcessGroup::run or ::start"]
pub struct Collective<'a> {
    /// The operation and its tensors.
    pub call: Call<'a>,
    /// Whether the agreement check runs first (default: it does).
    pub agreement: Agreement,
}

impl<'a> Collective<'a> {
    fn new(call: Call<'a>) -> Self {
        Self { call, agreement: Agreement::Checked }
    }

    /// `dist.all_reduce(tensor, op)`: see [`Call::AllReduce`].
    pub fn all_reduce(tensor: impl Into<Buffer<'a>>, op: ReduceOp) -> Self {
        Self::new(Call::AllReduce { tensor: tensor.into(), op })
    }

    /// `dist.broadcast(tensor, src)`: see [`Call::Broadcast`].
    pub fn broadcast(tensor: impl Into<Buffer<'a>>, src: usize) -> Self {
        Self::new(Call::Broadcast { tensor: tensor.into(), src })
    }

    /// `dist.all_gather_into_tensor(output, input)`: see [`Call::AllGather`].
    pub fn all_gather(output: impl Into<Buffer<'a>>, input: impl Into<Input<'a>>) -> Self {
        Self::new(Call::AllGather { output: output.into(), input: input.into() })
    }

    /// `dist.reduce_scatter_tensor(output, input, op)`: see [`Call::ReduceScatter`]. An `input`
    /// handed over by value may be reduced in place (same result in `output`, to float
    /// rounding).
    pub fn reduce_scatter(output: impl Into<Buffer<'a>>, input: impl Into<Input<'a>>, op: ReduceOp) -> Self {
        Self::new(Call::ReduceScatter { output: output.into(), input: input.into(), op })
    }

    /// `dist.barrier()`.
    pub fn barrier() -> Self {
        Self::new(Call::Barrier)
    }

    /// Skips the per-call agreement check: see [`Agreement::Prechecked`].
    pub fn prechecked(self) -> Self {
        self.with_agreement(Agreement::Prechecked)
    }

    /// This call with `agreement`.
    pub fn with_agreement(self, agreement: Agreement) -> Self {
        Self { agreement, ..self }
    }

    /// The collective's name as errors and progress records give it: `all_reduce`,
    /// `broadcast`, `all_gather`, `reduce_scatter`, `barrier`.
    pub fn name(&self) -> &'static str {
        match self.call {
            Call::AllReduce { .. } => "all_reduce",
            Call::Broadcast { .. } => "broadcast",
            Call::AllGather { .. } => "all_gather",
            Call::ReduceScatter { .. } => "reduce_scatter",
            Call::Barrier => "barrier",
        }
    }
}
