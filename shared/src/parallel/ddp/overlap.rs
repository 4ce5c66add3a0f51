//! DDP's overlapped backward: [`DistributedDataParallel::forward_segmented`] keeps one graph
//! per segment, and the next [`backward`](DistributedDataParallel::backward) runs them in
//! reverse, starting each bucket's all-reduce (non-blocking, prechecked) as soon as its
//! gradients are final and polling the started ones between segments — the overlap PyTorch's
//! DDP gets from autograd hooks, which tch does not expose.

use super::DistributedDataParallel;
use crate::dist::{Collective, ReduceOp, Work};
use crate::model::Segmented;
use crate::parallel::checkpointing::SavedSegment;
use crate::parallel::data_parallel::grad_enabled;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::time::{Duration, Instant};
use tch::{Kind, Tensor};

/// What a segmented forward keeps for backward.
pub(super) struct SegmentedPass {
    /// Per segment: its input (a detached leaf that requires grad, except for segment 0) and its
    /// output with the segment's graph, or what recomputes it (activation checkpointing).
    saved: Vec<SavedSegment>,
    /// Whether the forward ran in train mode (a checkpointed segment is recomputed in it).
    train: bool,
    /// Start the buckets' all-reduces during backward (else after it, blocking).
    overlap: bool,
    /// Per bucket: the lowest segment holding one of its parameters — once backward has run
    /// that segment (segments run in reverse), every gradient of the bucket is final.
    bucket_ready_after: Vec<usize>,
    /// The output handed to the caller: a leaf where the caller's `loss.backward()` stops.
    output: Tensor,
}

/// How much of the gradient all-reduce ran while backward was still computing, summed over
/// overlapped backwards since construction (seconds).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct CommOverlap {
    /// Backwards that overlapped their all-reduces.
    pub backwards: u64,
    /// Per bucket, the time from starting its all-reduce to the earlier of its completion
    /// (seen by a poll) and the end of backward: communication in flight while backward
    /// computed — hidden.
    pub hidden_s: f64,
    /// Time spent after backward waiting for the all-reduces to complete — exposed.
    pub waited_s: f64,
    /// Time spent inside the collective calls during backward (packing, starting, polling):
    /// on the critical path, included in [`comm_seconds`](DistributedDataParallel::comm_seconds).
    pub issue_s: f64,
}

impl CommOverlap {
    /// The share of all-reduce time hidden behind backward: `hidden / (hidden + waited)`, in
    /// [0, 1]; `None` before any overlapped backward.
    pub fn hidden_fraction(&self) -> Option<f64> {
        let total = self.hidden_s + self.waited_s;
        (self.backwards > 0 && total > 0.0).then(|| self.hidden_s / total)
    }
}

impl<M: Segmented> DistributedDataParallel<'_, M> {
    /// Gives parameters of bucket `b` that got no gradient (unused in this forward) a zero one,
    /// as [`sync_gradients`](Self::sync_gradients) does, and packs the bucket's gradients into
    /// one flat buffer (packing order, the gradients' dtype).
    fn pack_bucket(&self, b: usize) -> Tensor {
        let unused: Vec<Tensor> = self.buckets[b]
            .params
            .iter()
            .map(|&i| &self.params[i].1)
            .filter(|p| !p.grad().defined())
            .map(|p| p.sum(Kind::Float) * 0.0)
            .collect();
        if let Some(zero) = unused.into_iter().reduce(|a, b| a + b) {
            zero.backward();
        }
        tch::no_grad(|| {
            let grads: Vec<Tensor> = self.buckets[b].params.iter().map(|&i| self.params[i].1.grad().reshape([-1])).collect();
            Tensor::cat(&grads, 0)
        })
    }

    /// Copies a reduced flat buffer back into bucket `b`'s gradients.
    fn unpack_bucket(&self, b: usize, flat: &Tensor) {
        tch::no_grad(|| {
            let mut offset = 0;
            for &i in &self.buckets[b].params {
                let p = &self.params[i].1;
                let n = p.numel() as i64;
                p.grad().copy_(&flat.narrow(0, offset, n).view(p.size().as_slice()));
                offset += n;
            }
        });
    }

    /// Backward over the segments [`forward_segmented`](Self::forward_segmented) kept, in
    /// reverse: overlapped, each bucket's all-reduce starts as soon as its gradients are final
    /// and overlaps the segments still to run; not (a checkpointed forward without
    /// [`DdpOptions::overlap`](crate::parallel::DdpOptions::overlap)), the buckets are reduced
    /// after the whole backward with the blocking all-reduce, as
    /// [`backward`](Self::backward)'s plain path does.
    pub(super) fn backward_segmented(&mut self, loss: &Tensor, pass: SegmentedPass) -> Result<()> {
        if pass.overlap {
            return self.backward_overlapped(loss, pass);
        }
        self.backward_segments(loss, pass, |_| Ok(()))?;
        if self.require_backward_grad_sync {
            self.sync_gradients()?;
        }
        Ok(())
    }

    /// Runs `loss.backward()` to the kept output, then each segment's backward in reverse
    /// (recomputing a checkpointed segment first), calling `after(i)` once segment `i`'s
    /// gradients have accumulated into its parameters' `.grad`.
    fn backward_segments(&self, loss: &Tensor, pass: SegmentedPass, mut after: impl FnMut(usize) -> Result<()>) -> Result<()> {
        let SegmentedPass { mut saved, train, output, .. } = pass;
        // Stops at `output`, a leaf: its .grad is the gradient flowing into the last segment.
        tch::with_grad(|| loss.f_backward())?;
        let mut g = output.grad();
        if !g.defined() {
            return Err(Error::invalid(
                "loss",
                "a loss that does not depend on the last forward_segmented output",
                "the loss of the last forward: forward_segmented(x) → loss → backward(&loss)",
            ));
        }
        for i in (0..saved.len()).rev() {
            let mut seg = saved.pop().expect("one saved segment per segment");
            let y = seg.graph(&self.module, i, train)?;
            if y.requires_grad() {
                // y.backward(g) hands y's grad_fn exactly g, as the whole-graph backward would,
                // and accumulates into every leaf it reaches: this segment's parameters' .grad
                // (as `loss.backward()` does) and the segment input `x`, whose .grad is the
                // gradient flowing into the previous segment.
                crate::autograd::backward_with_grad(&y, &g)?;
            }
            if i > 0 {
                g = seg.x.grad();
                if !g.defined() {
                    g = seg.x.zeros_like();
                }
            }
            drop((seg, y));
            after(i)?;
        }
        Ok(())
    }

    /// [`backward_segments`](Self::backward_segments), starting each bucket's all-reduce
    /// (non-blocking) once its lowest segment is done and polling the started ones between
    /// segments; waits for all of them at the end.
    fn backward_overlapped(&mut self, loss: &Tensor, pass: SegmentedPass) -> Result<()> {
        let bucket_ready_after = pass.bucket_ready_after.clone();
        let sync = self.require_backward_grad_sync;
        let mut flats: Vec<Tensor> = self.buckets.iter().map(|_| Tensor::new()).collect();
        let mut slots = flats.iter_mut();
        let mut works: Vec<(usize, Work<'_>, Instant, Option<Instant>)> = Vec::new();
        let mut issue = Duration::ZERO;
        let mut next = 0;
        let mut bytes = 0u64;
        let this = &*self;
        this.backward_segments(loss, pass, |i| {
            if !sync {
                return Ok(());
            }
            let t0 = Instant::now();
            // Every bucket whose lowest segment has now run is final: start its all-reduce,
            // in bucket order (the same on every rank).
            while next < this.buckets.len() && bucket_ready_after[next] >= i {
                let slot = slots.next().expect("one slot per bucket");
                *slot = this.pack_bucket(next);
                bytes += (slot.numel() * slot.kind().elt_size_in_bytes()) as u64;
                let started = Instant::now();
                works.push((next, this.pg.start(Collective::all_reduce(slot, ReduceOp::Avg).prechecked())?, started, None));
                next += 1;
            }
            // Progress: Open MPI advances non-blocking collectives only inside MPI calls.
            for (_, work, _, done) in works.iter_mut().filter(|w| w.3.is_none()) {
                if work.test()? {
                    *done = Some(Instant::now());
                }
            }
            issue += t0.elapsed();
            Ok(())
        })?;
        if !sync {
            return Ok(());
        }
        let end_of_backward = Instant::now();
        let mut hidden = Duration::ZERO;
        let mut finished = Vec::with_capacity(works.len());
        for (b, work, started, done) in works {
            hidden += done.unwrap_or(end_of_backward).min(end_of_backward).saturating_duration_since(started);
            work.wait()?;
            finished.push(b);
        }
        let waited = end_of_backward.elapsed();
        for (b, flat) in finished.into_iter().zip(&flats) {
            this.unpack_bucket(b, flat);
        }
        self.comm += issue + waited;
        self.comm_bytes += bytes;
        self.overlap.backwards += 1;
        self.overlap.hidden_s += hidden.as_secs_f64();
        self.overlap.waited_s += waited.as_secs_f64();
        self.overlap.issue_s += issue.as_secs_f64();
        Ok(())
    }
}

impl<M: Segmented> DistributedDataParallel<'_, M> {
    /// When each bucket's all-reduce starts under [`forward_segmented`](Self::forward_segmented)
    /// (after which backward segment), and — once overlapped backwards ran — how much of the
    /// all-reduce time they hid, for `--explain`.
    pub fn explain_overlap(&self) -> String {
        let n = self.module.num_segments();
        let mut lines = vec![format!(
            "Overlap: backward runs the model's {n} segments in reverse; each bucket's all_reduce(Avg) starts \
             (non-blocking) once its lowest segment is done, and is polled between the segments after it:"
        )];
        for (b, bucket) in self.buckets.iter().enumerate() {
            let seg = (0..n).filter(|&i| self.module.segment_params(i).iter().any(|p| bucket.params.contains(p))).min().unwrap_or(0);
            let after = if seg == 0 {
                "the end of backward (nothing left to overlap)".to_string()
            } else {
                format!("segment {seg} (overlaps segments {}..=0)", seg - 1)
            };
            lines.push(format!("  bucket {b}: starts after {after}"));
        }
        let o = self.overlap;
        if let Some(f) = o.hidden_fraction() {
            lines.push(format!(
                "  over {} backward(s): {:.3} s of all-reduce ran during backward, {:.3} s waited after it ({:.0}% hidden); \
                 {:.3} s starting and polling",
                o.backwards,
                o.hidden_s,
                o.waited_s,
                100.0 * f,
                o.issue_s
            ));
        }
        lines.join("\n")
    }
}

impl<M: Segmented> DistributedDataParallel<'_, M> {
    /// The forward pass of [`forward_t`](Self::forward_t) (same output, bit for bit: the
    /// [`Segmented`] contract), run segment by segment so that [`backward`](Self::backward) can
    /// run the segments' backwards one by one: it starts each bucket's all-reduce as soon as its
    /// gradients are final (without activation checkpointing, or with it and
    /// [`DdpOptions::overlap`](crate::parallel::DdpOptions::overlap)), overlapping
    /// communication with the rest of backward (PyTorch's DDP does it from autograd hooks); with
    /// [activation checkpointing](Self::with_activation_checkpointing) each segment keeps only
    /// its input and is recomputed in backward (see [`crate::parallel::checkpointing`]).
    ///
    /// In grad mode each segment's graph (or input) is kept and the returned output (BasicNet:
    /// `[batch, 10]` f32 log-probabilities) is a leaf that requires grad: the loss must go to
    /// [`backward`](Self::backward) (a bare `loss.backward()` stops at the output). Under
    /// `no_grad` it is plain `forward_t`.
    ///
    /// # Errors
    /// A generator state that cannot be stashed (checkpointing on a device without one).
    pub fn forward_segmented(&self, xs: &Tensor, train: bool) -> Result<Tensor> {
        self.pass.borrow_mut().take();
        if !grad_enabled() {
            return Ok(self.module.forward_t(xs, train));
        }
        let n = self.module.num_segments();
        let mut seg_of = vec![0; self.params.len()];
        for i in 0..n {
            for p in self.module.segment_params(i) {
                seg_of[p] = i;
            }
        }
        let bucket_ready_after = self.buckets.iter().map(|b| b.params.iter().map(|&p| seg_of[p]).min().unwrap_or(0)).collect();
        let mut saved = Vec::with_capacity(n);
        let mut x = xs.shallow_clone();
        for i in 0..n {
            let x_in = if i > 0 { x.detach().set_requires_grad(true) } else { x };
            let (seg, y) = SavedSegment::forward(&self.module, i, x_in, train, self.activation_checkpointing)?;
            saved.push(seg);
            x = y;
        }
        let output = x.detach().set_requires_grad(true);
        // Without checkpointing a segmented forward exists to overlap; with it, as the options say.
        let overlap = self.options.overlap || !self.activation_checkpointing;
        *self.pass.borrow_mut() = Some(SegmentedPass { saved, train, overlap, bucket_ready_after, output: output.shallow_clone() });
        Ok(output)
    }
}
