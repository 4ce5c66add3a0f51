//! FSDP's backward: the graphs forward kept, run segment by segment in reverse with
//! `torch.autograd.grad`, each unit refilled before its last segment and its gradient reduced
//! (reduce-scatter, or all-reduce for `NoShard`) as soon as it is complete.

use super::FullyShardedDataParallel;
use crate::dist::{Collective, ReduceOp};
use crate::model::Segmented;
use crate::parallel::BackwardPrefetch;
use crate::{Error, Result};
use std::time::Instant;
use tch::Tensor;

impl<M: Segmented> FullyShardedDataParallel<'_, M> {
    /// Runs `loss.backward()` (which stops at the output of [`forward_t`](Self::forward_t)),
    /// then backpropagates the graphs forward kept, segment by segment in reverse — refilling a
    /// `FullShard` unit's gathered parameters (one all-gather into the storage its graph views)
    /// before its last segment — and, unless inside [`no_sync`](crate::parallel::GradSync::no_sync), reduces each
    /// unit's gradient as soon as it is complete: reduce-scatter(Avg) into the shard's `.grad`
    /// (accumulating, as PyTorch) — under HSDP within the shard group, then all-reduce(Avg) of
    /// the shard across the replicate group — or all-reduce(Avg) for `NoShard`. Call it where
    /// single-process code calls `loss.backward()`: `zero_grad` → `backward` →
    /// (`clip_grad_norm`) → `step`.
    ///
    /// # Errors
    /// [`Error::Fsdp`] when no grad-mode `forward_t` precedes it (or it is called twice for one
    /// forward); collective errors; [`Error::Torch`] from autograd.
    pub fn backward(&mut self, loss: &Tensor) -> Result<()> {
        let Some(out) = self.output.take() else {
            return Err(Error::Fsdp {
                rank: self.shard_pg.rank(),
                problem: "backward called without a preceding forward_t in grad mode (or twice for one forward); \
                          expected forward_t(x, train) → loss → backward(&loss)"
                    .into(),
            });
        };
        if let Some(o) = &mut self.offload {
            o.set_eval(false);
        }
        tch::with_grad(|| loss.f_backward())?;
        let mut g = out.grad();
        if !g.defined() {
            g = out.zeros_like();
        }
        let mut saved = std::mem::take(&mut self.saved);
        let sharded = self.config.sharding_strategy.is_sharded();
        for i in (0..saved.len()).rev() {
            let mut seg = saved.pop().expect("one saved segment per segment");
            let unit = self.seg_unit[i];
            if let Some(u) = unit {
                // FullShard: refill the storage forward's graph views (no-op when gathered).
                self.gather(u)?;
            }
            if self.config.backward_prefetch == BackwardPrefetch::BackwardPre {
                // BACKWARD_PRE: the next unit's all-gather starts before this segment's
                // gradient computation.
                if let Some(v) = self.next_unit_backward(i, unit) {
                    self.prefetch(v)?;
                }
            }
            // The segment's graph: kept by forward, or recomputed now that its unit is gathered.
            let y = seg.graph(&self.module, i, self.train)?;
            let x = seg.x;
            let want_x = i > 0 && x.requires_grad();
            let mut inputs: Vec<Tensor> = Vec::new();
            if want_x {
                inputs.push(x.shallow_clone());
            }
            inputs.extend(self.seg_params[i].iter().map(|&p| self.params[p].1.shallow_clone()));
            let grads: Vec<Tensor> = if inputs.is_empty() || !y.requires_grad() {
                Vec::new()
            } else {
                // torch.autograd.grad(y, inputs, grad_outputs=g): nothing accumulates in .grad,
                // and (retain_graph=False) the graph's saved tensors are released as it runs.
                crate::autograd::grad(&y, &g, &inputs)?
            };
            drop((y, inputs));
            let grad_of = |k: usize| grads.get(k).filter(|t| t.defined());
            let done = unit.filter(|&u| self.units[u].segments.first() == Some(&i));
            if let Some(u) = done.filter(|_| sharded) {
                // The unit's backward is over: free its gathered parameters before the gradient
                // is flattened and reduced (peak: per-parameter gradients + flat gradient, not
                // those and the gathered parameters too).
                self.free(u)?;
                if self.config.backward_prefetch == BackwardPrefetch::BackwardPost {
                    // BACKWARD_POST: with this unit's parameters freed, the next unit's
                    // all-gather starts before this unit's gradient is reduced.
                    if let Some(v) = self.next_unit_backward(i, Some(u)) {
                        self.prefetch(v)?;
                    }
                }
            }
            if let Some(u) = unit {
                if self.full_grads[u].is_none() {
                    self.full_grads[u] = Some(self.flat_grad(u));
                }
                let (unit_ref, fg) = (&self.units[u], self.full_grads[u].as_mut().expect("set above"));
                tch::no_grad(|| {
                    for (k, &p) in self.seg_params[i].iter().enumerate() {
                        if let Some(gp) = grad_of(usize::from(want_x) + k) {
                            let j = unit_ref.params.iter().position(|&q| q == p).expect("segment params are in the unit");
                            fg.accumulate(unit_ref, j, gp)?;
                        }
                    }
                    Ok::<(), tch::TchError>(())
                })?;
            }
            if want_x {
                g = match grad_of(0) {
                    Some(gx) => gx.shallow_clone(),
                    None => x.zeros_like(),
                };
            }
            drop(grads);
            if let Some(u) = done {
                self.reduce_unit(u)?;
            }
        }
        if self.require_backward_grad_sync {
            if let Some(o) = &mut self.offload {
                o.step_done();
            }
        }
        self.finish_prefetch()
    }

    /// Where unit `u`'s gradient accumulates during backward. `NoShard` with a gradient
    /// already there (every step after the first: zero_grad zeroes it in place), synced, not
    /// offloaded and reducing in the shard's dtype: the shard's `.grad` itself, all-reduced in
    /// place (PyTorch's `NO_SHARD`: autograd accumulates into `flat_param.grad`, which is
    /// all-reduced; DDP's `gradient_as_bucket_view`) — no second full-size buffer, no copy.
    /// Otherwise a fresh buffer in the reduce dtype (a bf16 gradient is widened as it is added:
    /// no bf16 flat gradient cast to fp32 afterwards).
    fn flat_grad(&self, u: usize) -> FlatGrad {
        let (unit, shard, rkind) = (&self.units[u], &self.shards[u], self.reduce_kind(u));
        let grad = shard.grad();
        let in_place = !self.config.sharding_strategy.is_sharded()
            && self.require_backward_grad_sync
            && self.offload.is_none()
            && grad.defined()
            && grad.kind() == rkind
            && grad.numel() as i64 == unit.padded_numel;
        if in_place {
            return FlatGrad::into_grad(unit, grad.detach());
        }
        // The compute device, also with CPU offload.
        FlatGrad::new(unit, rkind, self.shard_pg.device())
    }

    /// A unit's gradient is complete: reduce it into the shard's gradient, unless under
    /// `no_sync` (then it stays in `full_grads`, accumulating across backwards). With CPU
    /// offload the reduced shard, cast to the shard's dtype, is copied to the host first.
    fn reduce_unit(&mut self, u: usize) -> Result<()> {
        if !self.require_backward_grad_sync {
            return Ok(());
        }
        let Some(fg) = self.full_grads[u].take() else { return Ok(()) };
        let rkind = self.reduce_kind(u);
        let shard = self.shards[u].shallow_clone();
        let in_grad = fg.in_grad;
        let reduced = tch::no_grad(|| -> Result<Tensor> {
            let mut input = fg.finish(&self.units[u])?;
            let bytes = (input.numel() * input.kind().elt_size_in_bytes()) as u64;
            let t0 = Instant::now();
            let out = if self.config.sharding_strategy.is_sharded() {
                // Every element is written by the collective.
                let mut out = Tensor::empty([self.units[u].shard_numel], (rkind, input.device()));
                // The flat gradient is a temporary: the backend may reduce it in place.
                self.shard_pg.run(Collective::reduce_scatter(&mut out, input, ReduceOp::Avg))?;
                if let Some(replicate) = self.replicate {
                    // HSDP: the shard group's average, averaged over the replicas — the
                    // average over the world (every group has the same size).
                    replicate.all_reduce(&mut out, ReduceOp::Avg)?;
                    self.comm_bytes += (out.numel() * out.kind().elt_size_in_bytes()) as u64;
                }
                out
            } else {
                self.shard_pg.all_reduce(&mut input, ReduceOp::Avg)?;
                input
            };
            self.comm += t0.elapsed();
            self.comm_bytes += bytes;
            match &mut self.offload {
                Some(o) => o.copy_to_host(&out.to_kind(shard.kind())),
                None => Ok(out),
            }
        })?;
        if in_grad {
            // All-reduced where it lies: `.grad` is the average now (it held zeros or an
            // average already, the same on every rank, when backward added into it).
            return Ok(());
        }
        // Accumulate into shard.grad as PyTorch's FSDP does (`_accumulate_sharded_grad`): with
        // no gradient yet the reduced tensor, cast to the shard's dtype, becomes it (no copy
        // when the dtypes agree, as under the core's policies); otherwise it is added in place.
        let grad = shard.grad();
        if grad.defined() {
            tch::no_grad(|| add_in_pieces(&grad.detach(), &reduced))?;
        } else {
            crate::autograd::set_grad(&shard, &tch::no_grad(|| reduced.to_kind(shard.kind())))?;
        }
        Ok(())
    }
}

/// Elements per piece when a tensor of another dtype is added into a gradient: its cast is
/// then 1 Mi elements (4 MiB in fp32), below glibc's mmap threshold once that has adapted, so
/// the same heap memory serves every piece.
const MIXED_ADD_CHUNK: i64 = 1 << 20;

/// `dst += src` in place (same shape; `dst` contiguous). libtorch's CPU `add_` of another dtype
/// first casts all of `src` to `dst`'s (for fc1's bf16 gradient at width 4096, a fresh 151 MB
/// in fp32, mmapped and zeroed by the kernel every step): then the add runs in pieces of
/// [`MIXED_ADD_CHUNK`] elements, so each cast is small and reused. Same values either way.
fn add_in_pieces(dst: &Tensor, src: &Tensor) -> std::result::Result<(), tch::TchError> {
    if dst.kind() == src.kind() {
        return dst.shallow_clone().f_add_(src).map(drop);
    }
    let (dst, src) = (dst.f_view([-1])?, src.f_reshape([-1])?);
    let n = dst.size()[0];
    for start in (0..n).step_by(MIXED_ADD_CHUNK as usize) {
        let len = MIXED_ADD_CHUNK.min(n - start);
        let _ = dst.narrow(0, start, len).f_add_(&src.narrow(0, start, len))?;
    }
    Ok(())
}

/// A unit's unsharded flat gradient while backward fills it (PyTorch's `flat_param.grad`
/// before the reduce-scatter): `[padded_numel]` in the reduce dtype. In a fresh buffer a
/// parameter's first gradient is copied into its slot and later ones added, so it is neither
/// zero-filled first nor summed into (one pass over each slot, not three); the slots nothing
/// wrote and the padding are zeroed once, by [`finish`](Self::finish), before it is read.
pub(super) struct FlatGrad {
    flat: Tensor,
    /// Per parameter of the unit: its slot holds a gradient.
    written: Vec<bool>,
    /// `flat` is the shard's `.grad` itself (`NoShard`, see `flat_grad`): every slot is added
    /// into, and the reduction leaves the result there.
    pub(super) in_grad: bool,
}

impl FlatGrad {
    /// An uninitialised buffer for `unit`, nothing written.
    fn new(unit: &super::plan::FlatParamUnit, kind: tch::Kind, device: tch::Device) -> Self {
        Self { flat: Tensor::empty([unit.padded_numel], (kind, device)), written: vec![false; unit.params.len()], in_grad: false }
    }

    /// The shard's existing gradient `grad` (`[padded_numel]`, the reduce dtype) as the buffer:
    /// every slot counts as written, so gradients are added to what it holds.
    fn into_grad(unit: &super::plan::FlatParamUnit, grad: Tensor) -> Self {
        Self { flat: grad, written: vec![true; unit.params.len()], in_grad: true }
    }

    /// Adds `grad` (parameter `j`'s shape; cast to the buffer's dtype if it differs) into
    /// parameter `j`'s slot — a copy when the slot is unwritten.
    fn accumulate(&mut self, unit: &super::plan::FlatParamUnit, j: usize, grad: &Tensor) -> std::result::Result<(), tch::TchError> {
        let mut slot = unit.param_view(&self.flat, j);
        if self.written[j] {
            add_in_pieces(&slot, grad)?;
        } else {
            slot.f_copy_(grad)?;
            self.written[j] = true;
        }
        Ok(())
    }

    /// The buffer, with every unwritten slot and the padding zeroed.
    fn finish(self, unit: &super::plan::FlatParamUnit) -> std::result::Result<Tensor, tch::TchError> {
        for (j, &written) in self.written.iter().enumerate() {
            if !written {
                let _ = unit.param_view(&self.flat, j).f_zero_()?;
            }
        }
        if unit.padded_numel > unit.numel {
            let _ = self.flat.narrow(0, unit.numel, unit.padded_numel - unit.numel).f_zero_()?;
        }
        Ok(self.flat)
    }

    /// The buffer (for memory accounting).
    pub(super) fn tensor(&self) -> &Tensor {
        &self.flat
    }
}
