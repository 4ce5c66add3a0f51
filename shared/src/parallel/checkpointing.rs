//! Activation checkpointing, as `torch.utils.checkpoint.checkpoint(segment, x,
//! use_reentrant=False)` around every segment of a [`Segmented`] model (Accelerate's
//! `fsdp_activation_checkpointing`, Transformers' `gradient_checkpointing`): forward runs each
//! segment without a graph and keeps only the segment's input; backward, when it reaches the
//! segment, runs its forward again with grad on (the recompute) and backpropagates through that
//! graph, so the intermediates of one segment at a time are alive instead of every segment's.
//!
//! Dropout in a recomputed segment draws the same mask as the first pass: before each
//! checkpointed forward the default generators' states are stashed (the CPU's, and the CUDA
//! device's when the segment runs there), the recompute runs from the stashed states, and the
//! states the recompute found are put back after it — PyTorch's `preserve_rng_state=True` with
//! `torch.random.fork_rng`. The core's CPU dropout draws one word from the CPU generator per
//! call and fills its mask from a counter-based generator keyed by it (see
//! [`crate::model::dropout`]), so the replayed draw gives the same bits.
//!
//! Used by DDP's segmented forward ([`DistributedDataParallel::forward_segmented`]) and by
//! FSDP's forward, which both keep a [`SavedSegment`] per segment for their segment-by-segment
//! backward.
//!
//! [`DistributedDataParallel::forward_segmented`]: super::DistributedDataParallel::forward_segmented

use crate::model::Segmented;
use crate::{Error, Result};
use std::sync::atomic::{AtomicU64, Ordering};
use tch::{Device, Tensor};

/// Segments recomputed in this process (see [`recomputed_segments`]).
static RECOMPUTED: AtomicU64 = AtomicU64::new(0);

/// How many segment forwards backward has run again in this process since it started (every
/// model, every thread): a checkpointed training step of a model with S segments adds S. For
/// tests and diagnostics (the cost of checkpointing is one more forward per step).
pub fn recomputed_segments() -> u64 {
    RECOMPUTED.load(Ordering::Relaxed)
}

/// The default generators' states before a checkpointed segment's forward.
struct RngStash {
    /// `torch.get_rng_state()`.
    cpu: Tensor,
    /// The CUDA device's generator state, when the segment's input lives there.
    device: Option<(Device, Tensor)>,
}

impl RngStash {
    /// The current states of the CPU generator and of `device`'s (when it is not the CPU).
    fn take(device: Device) -> Result<Self> {
        let cpu = crate::ffi::model::rng_get_state(Device::Cpu).map_err(rng_error)?;
        let device = match device {
            Device::Cpu => None,
            d => Some((d, crate::ffi::model::rng_get_state(d).map_err(rng_error)?)),
        };
        Ok(Self { cpu, device })
    }

    /// Sets the generators to these states.
    fn restore(&self) -> Result<()> {
        crate::ffi::model::rng_set_state(Device::Cpu, &self.cpu).map_err(rng_error)?;
        if let Some((d, state)) = &self.device {
            crate::ffi::model::rng_set_state(*d, state).map_err(rng_error)?;
        }
        Ok(())
    }
}

fn rng_error(msg: String) -> Error {
    tch::TchError::Torch(format!("activation checkpointing: generator state: {msg}")).into()
}

/// What a segment's forward keeps for backward: its input and either its output with the graph
/// (no checkpointing) or what it takes to recompute that graph (checkpointing).
pub(crate) struct SavedSegment {
    /// The segment's input: a detached leaf (requiring grad for segments after the first), whose
    /// `.grad` or gradient is what flows into the previous segment.
    pub(crate) x: Tensor,
    /// The output with its graph; `None` when checkpointed (until [`graph`](Self::graph)).
    y: Option<Tensor>,
    /// The generator states before a checkpointed forward.
    rng: Option<RngStash>,
}

impl SavedSegment {
    /// Runs segment `i` of `module` on `x` (in grad mode) and returns what to keep for
    /// backward and the output to feed the next segment. With `checkpoint`, the forward runs
    /// under `no_grad` after stashing the generators' states, and only `x` is kept.
    ///
    /// # Errors
    /// A generator state that cannot be read (a device without one).
    pub(crate) fn forward<M: Segmented>(module: &M, i: usize, x: Tensor, train: bool, checkpoint: bool) -> Result<(Self, Tensor)> {
        if !checkpoint {
            let y = module.segment_forward(i, &x, train);
            return Ok((Self { y: Some(y.shallow_clone()), x, rng: None }, y));
        }
        let rng = RngStash::take(x.device())?;
        let y = tch::no_grad(|| module.segment_forward(i, &x, train));
        Ok((Self { x, y: None, rng: Some(rng) }, y))
    }

    /// The segment's output with its graph: the one forward kept, or — checkpointed — the
    /// forward of segment `i` run again on the kept input with grad on, from the stashed
    /// generator states (the generators are put back as they were afterwards). The caller
    /// makes the segment's parameters present first (FSDP gathers its unit).
    ///
    /// # Errors
    /// A generator state that cannot be read or set.
    pub(crate) fn graph<M: Segmented>(&mut self, module: &M, i: usize, train: bool) -> Result<Tensor> {
        if let Some(y) = self.y.take() {
            return Ok(y);
        }
        let Some(stash) = &self.rng else { return Ok(Tensor::new()) };
        let now = RngStash::take(self.x.device())?;
        stash.restore()?;
        let y = tch::with_grad(|| module.segment_forward(i, &self.x, train));
        now.restore()?;
        RECOMPUTED.fetch_add(1, Ordering::Relaxed);
        Ok(y)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{BasicNet, BasicNetConfig};
    use tch::{nn, Kind};

    /// The next word of the CPU generator, as a tensor draw.
    fn draw() -> Tensor {
        Tensor::randint(i64::MAX, [4], (Kind::Int64, Device::Cpu))
    }

    #[test]
    fn a_checkpointed_segment_keeps_no_graph_and_recomputes_the_same_output_and_mask() {
        let vs = nn::VarStore::new(Device::Cpu);
        let net = BasicNet::new(&vs.root(), BasicNetConfig::default());
        // Segment 2 is dropout(0.25) + flatten: its recompute must draw the same mask.
        let x = Tensor::randn([3, 64, 12, 12], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        tch::manual_seed(11);
        let (mut plain, y_plain) = SavedSegment::forward(&net, 2, x.detach().set_requires_grad(true), true, false).unwrap();
        tch::manual_seed(11);
        let (mut ckpt, y_ckpt) = SavedSegment::forward(&net, 2, x.detach().set_requires_grad(true), true, true).unwrap();
        let after_forward = draw();
        assert!(y_plain.requires_grad() && !y_ckpt.requires_grad(), "checkpointed: no graph kept");
        assert!(ckpt.y.is_none() && ckpt.rng.is_some());
        assert!(y_plain.equal(&y_ckpt), "same mask in the first pass");
        assert!(y_plain.eq(0.0).any().to_kind(Kind::Int64).int64_value(&[]) == 1, "dropout did zero something");

        // Between forward and backward the generator moves on (here: reseeded); the recompute
        // still replays the first pass's mask and leaves the generator where it found it.
        tch::manual_seed(99);
        let expected_next = draw();
        tch::manual_seed(99);
        let y = ckpt.graph(&net, 2, true).unwrap();
        assert!(y.requires_grad(), "the recompute has a graph");
        assert!(y.equal(&y_ckpt), "the recompute draws the first pass's mask");
        assert!(draw().equal(&expected_next), "the generator is put back after the recompute");
        assert!(!after_forward.equal(&expected_next));

        // Same gradients through the recomputed graph as through the kept one.
        let g = Tensor::randn(y.size(), (Kind::Float, Device::Cpu));
        let gp = crate::autograd::grad(&plain.graph(&net, 2, true).unwrap(), &g, &[plain.x.shallow_clone()]).unwrap();
        let gc = crate::autograd::grad(&y, &g, &[ckpt.x.shallow_clone()]).unwrap();
        assert!(gp[0].equal(&gc[0]));
    }
}
