//! What the processes do together outside the training step: gathering results (exactly, for
//! metrics), reducing, padding, splitting work, ordering and waiting.

use super::Accelerator;
use crate::Result;
use ladder_core::dist::ReduceOp;
use tch::Tensor;

impl Accelerator {
    /// Gathers `tensor` from every process along dim 0 (`[b, …]` on each → `[W·b, …]`, rank
    /// order), on the tensor's device (a tensor elsewhere than the process group's device,
    /// e.g. a CPU tensor under NCCL, travels through the group's device). Every process must
    /// pass the same shape and dtype.
    ///
    /// # Errors
    /// Collective errors (a shape or dtype mismatch across ranks is named).
    pub fn gather(&self, tensor: &Tensor) -> Result<Tensor> {
        // Collectives move numbers; booleans travel as i64 and come back as booleans.
        if tensor.kind() == tch::Kind::Bool {
            return Ok(self.gather(&tensor.to_kind(tch::Kind::Int64))?.to_kind(tch::Kind::Bool));
        }
        let device = self.shared.pg.device();
        let t = if tensor.dim() == 0 { tensor.reshape([1]) } else { tensor.contiguous() }.to_device(device);
        let mut size = t.size();
        size[0] *= self.num_processes() as i64;
        let mut out = Tensor::empty(size.as_slice(), (t.kind(), device));
        self.shared.pg.all_gather(&mut out, &t)?;
        Ok(out.to_device(tensor.device()))
    }

    /// [`gather`](Self::gather) for evaluation: the per-sample results of the batch the last
    /// loader handed out, from every process, in the sampler's order, with exactly the samples
    /// the sampler's padding duplicated removed — so an epoch of an evaluation loader yields
    /// every sample exactly once at any world size and batch size (`[b, …]` → `[≤ W·b, …]`).
    /// Outside a loader it is [`gather`](Self::gather).
    ///
    /// # Errors
    /// Collective errors; a tensor whose first dimension is not the batch's length.
    pub fn gather_for_metrics(&self, tensor: &Tensor) -> Result<Tensor> {
        let all = self.gather(tensor)?;
        let Some(pos) = self.shared.state.borrow().gradient.batch else { return Ok(all) };
        if tensor.dim() == 0 || tensor.size()[0] != pos.len as i64 {
            return Err(ladder_core::Error::invalid(
                "gather_for_metrics",
                format!("a tensor of shape {:?}", tensor.size()),
                format!("per-sample results of the current batch: first dimension {}", pos.len),
            )
            .into());
        }
        // Rank r's j-th sample of the batch sits at global position (local_start + j)·W + r;
        // positions past the dataset's end are padding.
        let w = self.num_processes();
        let mut keep = Vec::with_capacity(w * pos.len);
        for j in 0..pos.len {
            for r in 0..w {
                if (pos.local_start + j) * w + r < pos.dataset_len {
                    keep.push((r * pos.len + j) as i64);
                }
            }
        }
        let index = Tensor::from_slice(&keep).to_device(all.device());
        Ok(all.index_select(0, &index))
    }

    /// Reduces `tensor` over processes (a copy on the tensor's device; the input is unchanged),
    /// as Accelerate's `reduce(tensor, reduction)`: its `"sum"` is [`ReduceOp::Sum`], its
    /// `"mean"` [`ReduceOp::Avg`]; `Max` and `Min` work too. A tensor elsewhere than the process
    /// group's device (a CPU scalar under NCCL, say) is reduced there and brought back.
    ///
    /// # Errors
    /// Collective errors.
    pub fn reduce(&self, tensor: &Tensor, reduction: ReduceOp) -> Result<Tensor> {
        let device = self.shared.pg.device();
        let mut t = if tensor.device() == device { tensor.copy() } else { tensor.to_device(device) };
        self.shared.pg.all_reduce(&mut t, reduction)?;
        Ok(t.to_device(tensor.device()))
    }

    /// Pads `tensor` along `dim` with `pad_index` to the largest size any process has there,
    /// so that it can be gathered.
    ///
    /// # Errors
    /// `dim` out of range; collective errors.
    pub fn pad_across_processes(&self, tensor: &Tensor, dim: usize, pad_index: f64) -> Result<Tensor> {
        if dim >= tensor.dim() {
            return Err(ladder_core::Error::invalid("dim", dim, format!("a dimension of the tensor (it has {})", tensor.dim())).into());
        }
        let pg = self.shared.pg;
        let mut size = Tensor::from_slice(&[tensor.size()[dim]]).to_device(pg.device());
        pg.all_reduce(&mut size, ReduceOp::Max)?;
        let max = size.int64_value(&[0]);
        let have = tensor.size()[dim];
        if have == max {
            return Ok(tensor.shallow_clone());
        }
        let mut shape = tensor.size();
        shape[dim] = max - have;
        let pad = Tensor::full(shape.as_slice(), pad_index, (tensor.kind(), tensor.device()));
        Ok(Tensor::cat(&[tensor.shallow_clone(), pad], dim as i64))
    }

    /// This process's contiguous share of `items` (`split_between_processes`): shares differ in
    /// length by at most one and cover every item once, in order.
    pub fn split_between_processes<T: Clone>(&self, items: &[T]) -> Vec<T> {
        items[ladder_core::data::eval_shard(items.len(), self.process_index(), self.num_processes())].to_vec()
    }

    /// Runs `f` on the main process first, then on the others (e.g. one process downloads
    /// MNIST while the others wait, then they read the files it wrote).
    ///
    /// # Errors
    /// Collective errors of the barrier; `f`'s own result is returned as it is.
    pub fn main_process_first<R>(&self, f: impl FnOnce() -> R) -> Result<R> {
        if !self.is_main_process() {
            self.shared.pg.barrier()?;
        }
        let r = f();
        if self.is_main_process() {
            self.shared.pg.barrier()?;
        }
        Ok(r)
    }

    /// Prints on the main process only.
    pub fn print(&self, msg: impl std::fmt::Display) {
        if self.is_main_process() {
            println!("{msg}");
        }
    }

    /// Waits until every process gets here (a barrier).
    ///
    /// # Errors
    /// Collective errors.
    pub fn wait_for_everyone(&self) -> Result<()> {
        Ok(self.shared.pg.barrier()?)
    }

    /// Whether any process received SIGTERM (once `ladder_core::preempt::watch` was called in
    /// every process): all get the same answer at the same call, so call it at the same point
    /// of every step — then save the state and stop. One all-reduce of one number; `false`
    /// and no collective without `watch`.
    ///
    /// # Errors
    /// Collective errors.
    pub fn preemption_requested(&self) -> Result<bool> {
        Ok(ladder_core::preempt::agree(self.shared.pg)?)
    }
}
