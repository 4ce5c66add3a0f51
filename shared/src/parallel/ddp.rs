//! `DistributedDataParallel`: one replica of the model per rank, gradients averaged after every
//! backward, so every rank takes the same optimizer step — as `torch.nn.parallel.
//! DistributedDataParallel`.
//!
//! What it does, in PyTorch's order:
//! 1. At construction, broadcasts rank 0's parameters to every rank (so all replicas start equal).
//! 2. Groups parameters into gradient buckets, in *reverse* definition order (gradients become
//!    ready from the last layer backwards): the first bucket closes at 1 MiB
//!    (`dist._DEFAULT_FIRST_BUCKET_BYTES`), the others at `bucket_cap_mb` (default 25 MiB); a bucket
//!    closes once its size reaches the cap, so it may exceed it by one tensor.
//! 3. Each bucket's gradients are packed into one flat buffer, all-reduced with `ReduceOp::Avg`,
//!    and copied back — one collective per bucket. PyTorch starts a bucket's all-reduce from an
//!    autograd hook as soon as its last gradient is ready, so communication overlaps the rest
//!    of backward. tch exposes no autograd hooks; [`DistributedDataParallel::forward_segmented`]
//!    gets the same overlap from a [`Segmented`](crate::model::Segmented) model (`ddp/overlap.rs`):
//!    forward keeps one graph per segment, backward runs them in reverse, and after each
//!    segment it starts (non-blocking, [`ProcessGroup::start`]) the all-reduce of every bucket
//!    whose parameters all belong to the segments done, then polls the started ones
//!    ([`Work::test`](crate::dist::Work::test): Open MPI progresses a non-blocking collective
//!    only inside MPI calls), and waits for all of them before `backward` returns. The plain [`forward_t`](DistributedDataParallel::forward_t)
//!    reduces every bucket after the whole backward with the blocking all-reduce — every
//!    level's default, because on CPU it is the faster of the two: the overlapped backward's
//!    collectives run on the same cores as backward and Open MPI's non-blocking ones (libnbc)
//!    are slower (waited at once: 4–11 ms per step for BasicNet's 4.6 MiB at 2 ranks, against
//!    1.7–2.3 ms blocking), so level 1 at 2 ranks measured 2,295–2,357 samples/s overlapped against
//!    2,423–2,518 plain. Overlap pays where communication has its own engine (NCCL's stream on
//!    a GPU, a network card). Same collectives and, at 2 ranks, bit-identical gradients; at 3
//!    or more ranks the two all-reduce algorithms sum in different orders (gradients equal to
//!    float rounding).
//! 4. Inside [`no_sync`](GradSync::no_sync), step 3 is skipped (gradient accumulation).
//!
//! With ZeRO-1 ([`DdpOptions::zero_redundancy_optimizer`]) the optimizer state is sharded
//! over ranks after step 3 (see [`crate::parallel::zero`]).
//!
//! With activation checkpointing ([`DistributedDataParallel::with_activation_checkpointing`])
//! a train forward runs segment by segment keeping only each segment's input, and backward
//! recomputes each segment before its backward; the buckets are reduced as above (overlapped
//! or after backward), with the same collectives and gradients.
//!
//! Parameter order comes from [`Model::named_parameters`] (definition order), identical on every
//! rank; never from a `HashMap`.

mod overlap;

pub use overlap::CommOverlap;

use crate::dist::{Collective, ProcessGroup, ReduceOp};
use crate::model::{Model, Segmented};
use crate::parallel::zero::ZeroPartition;
use crate::parallel::{DdpOptions, GradSync};
use crate::{Error, Result};
use overlap::SegmentedPass;
use serde::{Deserialize, Serialize};
use std::cell::RefCell;
use std::time::{Duration, Instant};
use tch::{Kind, Tensor};

/// PyTorch's `dist._DEFAULT_FIRST_BUCKET_BYTES`: the first bucket is small so that the first
/// all-reduce can start early.
pub const FIRST_BUCKET_BYTES: u64 = 1024 * 1024;

/// One gradient bucket: parameter indices (into [`Model::named_parameters`]) in the order they
/// are packed, and the bucket's size.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bucket {
    /// Indices of the parameters in this bucket, in packing order (reverse definition order).
    pub params: Vec<usize>,
    /// Elements in the bucket.
    pub numel: i64,
    /// Bytes in the bucket (numel × element size).
    pub bytes: u64,
    /// The cap this bucket was filled against, bytes.
    pub cap_bytes: u64,
}

/// Assigns parameters of the given byte sizes (definition order) to buckets as PyTorch does:
/// reverse order, first cap 1 MiB, then `bucket_cap_mb`.
// ANCHOR: bucket_assignment
pub fn compute_bucket_assignment(sizes: &[(i64, u64)], bucket_cap_mb: f64) -> Vec<Bucket> {
    let cap = (bucket_cap_mb * 1024.0 * 1024.0) as u64;
    let mut buckets = Vec::new();
    let mut current = Bucket { params: Vec::new(), numel: 0, bytes: 0, cap_bytes: FIRST_BUCKET_BYTES.min(cap.max(1)) };
    for i in (0..sizes.len()).rev() {
        let (numel, bytes) = sizes[i];
        current.params.push(i);
        current.numel += numel;
        current.bytes += bytes;
        if current.bytes >= current.cap_bytes {
            buckets.push(std::mem::replace(&mut current, Bucket { params: Vec::new(), numel: 0, bytes: 0, cap_bytes: cap.max(1) }));
        }
    }
    if !current.params.is_empty() {
        buckets.push(current);
    }
    buckets
}
// ANCHOR_END: bucket_assignment

/// A model replicated on every rank with gradients averaged after backward.
///
/// Usage, as the tutorial (with the sync made visible):
/// ```ignore
/// let ddp = DistributedDataParallel::new(net, &*pg, DdpOptions::default())?;
/// let mut opt = adamw(&vs, lr)?;      // over the wrapped model's parameters
/// opt.zero_grad();
/// let loss = ddp.forward_t(&x, true).nll_loss(&y);
/// ddp.backward(&loss)?;                // backward, then the bucketed all-reduce(Avg)
/// opt.step();
/// ```
pub struct DistributedDataParallel<'pg, M: Model> {
    module: M,
    params: Vec<(String, Tensor)>,
    buckets: Vec<Bucket>,
    pg: &'pg dyn ProcessGroup,
    options: DdpOptions,
    require_backward_grad_sync: bool,
    comm: Duration,
    /// Payload bytes all-reduced since construction.
    comm_bytes: u64,
    /// What [`forward_segmented`](Self::forward_segmented) kept for an overlapped backward.
    pass: RefCell<Option<SegmentedPass>>,
    overlap: CommOverlap,
    /// Keep only each segment's input in a train forward and recompute in backward.
    activation_checkpointing: bool,
    /// ZeRO-1's partition of the optimizer state (with `zero_redundancy_optimizer`).
    zero: Option<ZeroPartition>,
}

/// DDP's all-reduce after backward: on by default; `no_sync` accumulates locally.
impl<M: Model> GradSync for DistributedDataParallel<'_, M> {
    fn require_backward_grad_sync(&self) -> bool {
        self.require_backward_grad_sync
    }
    fn set_require_backward_grad_sync(&mut self, sync: bool) {
        self.require_backward_grad_sync = sync;
    }
}

impl<M: Model> std::fmt::Debug for DistributedDataParallel<'_, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DistributedDataParallel")
            .field("rank", &self.pg.rank())
            .field("world_size", &self.pg.world_size())
            .field("buckets", &self.buckets.len())
            .finish()
    }
}

impl<'pg, M: Model> DistributedDataParallel<'pg, M> {
    /// Wraps `module`: broadcasts rank 0's parameters to every rank and lays out the buckets.
    ///
    /// # Errors
    /// [`Error::InvalidValue`] for a non-positive `bucket_cap_mb`; collective errors (e.g. ranks
    /// whose models differ in shape get [`Error::CollectiveMismatch`]).
    pub fn new(module: M, pg: &'pg dyn ProcessGroup, config: DdpOptions) -> Result<Self> {
        if !(config.bucket_cap_mb.is_finite() && config.bucket_cap_mb > 0.0) {
            return Err(Error::invalid("bucket_cap_mb", config.bucket_cap_mb, "a positive number of MiB"));
        }
        let params = module.named_parameters();
        // sync_module_states: every replica starts from rank 0's weights.
        let mut tensors: Vec<Tensor> = params.iter().map(|(_, t)| t.shallow_clone()).collect();
        tch::no_grad(|| pg.broadcast_coalesced(&mut tensors, 0))?;
        let sizes: Vec<(i64, u64)> =
            params.iter().map(|(_, t)| (t.numel() as i64, (t.numel() * t.kind().elt_size_in_bytes()) as u64)).collect();
        let buckets = compute_bucket_assignment(&sizes, config.bucket_cap_mb);
        // Check the bucket layout across ranks once (numel and dtype of every bucket), so that
        // each step's all-reduces can skip the per-call agreement check.
        // The dtype as its position in a fixed list (tch's Kind has no stable integer).
        let kind_code = |k: Kind| [Kind::Float, Kind::Double, Kind::BFloat16, Kind::Half].iter().position(|&x| x == k);
        let layout: Vec<f64> = std::iter::once(buckets.len() as f64)
            .chain(buckets.iter().map(|b| b.numel as f64))
            .chain(params.iter().map(|(_, t)| kind_code(t.kind()).map_or(-1.0, |c| c as f64)))
            .collect();
        let what = "DDP bucket layout (bucket count, numel per bucket, parameter dtypes)".to_string();
        check_in_sync(pg, &[(what, Tensor::from_slice(&layout).to_device(pg.device()))])?;
        let zero = if config.zero_redundancy_optimizer { Some(ZeroPartition::new(&params, pg)?) } else { None };
        Ok(Self {
            module,
            params,
            buckets,
            pg,
            options: config,
            require_backward_grad_sync: true,
            comm: Duration::ZERO,
            comm_bytes: 0,
            pass: RefCell::new(None),
            overlap: CommOverlap::default(),
            activation_checkpointing: false,
            zero,
        })
    }

    /// Turns activation checkpointing on or off (`torch.utils.checkpoint` around every segment,
    /// see [`crate::parallel::checkpointing`]): a train forward in grad mode then runs
    /// [`forward_segmented`](Self::forward_segmented), keeping each segment's input only, and
    /// [`backward`](Self::backward) recomputes each segment before its backward. Gradients and
    /// collectives are those of the plain path (bit-identical on CPU).
    pub fn with_activation_checkpointing(mut self, on: bool) -> Self {
        self.activation_checkpointing = on;
        self
    }

    /// Whether activation checkpointing is on.
    pub fn activation_checkpointing(&self) -> bool {
        self.activation_checkpointing
    }

    /// The wrapped model (PyTorch's `ddp.module`).
    pub fn module(&self) -> &M {
        &self.module
    }

    /// The options it was built with.
    pub fn options(&self) -> &DdpOptions {
        &self.options
    }

    /// The process group it averages gradients over.
    pub fn pg(&self) -> &'pg dyn ProcessGroup {
        self.pg
    }

    /// The bucket layout, in reduction order.
    pub fn buckets(&self) -> &[Bucket] {
        &self.buckets
    }

    /// The parameters, in definition order, with their names.
    pub fn named_parameters(&self) -> &[(String, Tensor)] {
        &self.params
    }

    /// Seconds this rank's training loop spent inside collectives since construction (gradient
    /// sync, and ZeRO-1's parameter broadcasts): for an overlapped backward, the time to start and poll the all-reduces during
    /// backward and to wait for them after it — not the time they ran alongside backward.
    pub fn comm_seconds(&self) -> f64 {
        (self.comm + self.zero.as_ref().map_or(Duration::ZERO, |z| z.comm().0)).as_secs_f64()
    }

    /// Payload bytes of the gradient all-reduces since construction (each bucket's flat buffer),
    /// and of ZeRO-1's parameter broadcasts.
    pub fn comm_bytes(&self) -> u64 {
        self.comm_bytes + self.zero.as_ref().map_or(0, |z| z.comm().1)
    }

    /// How much of the all-reduce time overlapped backward (see [`CommOverlap`]).
    pub fn comm_overlap(&self) -> CommOverlap {
        self.overlap
    }

    /// ZeRO-1's partition, when the optimizer state is sharded
    /// ([`DdpOptions::zero_redundancy_optimizer`]).
    pub fn zero(&self) -> Option<&ZeroPartition> {
        self.zero.as_ref()
    }

    /// ZeRO-1: sends every rank's updated block of the parameters to all ranks if an optimizer
    /// step may have changed them since the last time (see [`ZeroPartition::sync_parameters`]);
    /// nothing without ZeRO-1. Every use of the parameters through the wrapper (forward, state
    /// dicts, the sync check) calls it first. Collective.
    ///
    /// # Errors
    /// Collective errors.
    pub fn sync_parameters(&self) -> Result<()> {
        match &self.zero {
            Some(zero) => zero.sync_parameters(self.pg),
            None => Ok(()),
        }
    }

    /// All-reduces (Avg) every bucket's gradients: pack into one flat buffer, one collective,
    /// unpack.
    ///
    /// # Errors
    /// Collective errors.
    // ANCHOR: ddp_sync_gradients
    pub fn sync_gradients(&mut self) -> Result<()> {
        // libtorch's zero_grad sets gradients to none; a parameter this rank did not use in the
        // forward pass has none after backward. Give those a zero gradient (a backward of
        // 0·Σp), so that every rank packs the same buckets and the optimizer steps them alike.
        let unused: Vec<Tensor> = self.params.iter().filter(|(_, p)| !p.grad().defined()).map(|(_, p)| p.sum(Kind::Float) * 0.0).collect();
        if let Some(zero) = unused.into_iter().reduce(|a, b| a + b) {
            zero.backward();
        }
        tch::no_grad(|| {
            for bucket in &self.buckets {
                let grads: Vec<Tensor> = bucket.params.iter().map(|&i| self.params[i].1.grad().reshape([-1])).collect();
                let mut flat = Tensor::cat(&grads, 0);
                let t0 = Instant::now();
                // The blocking all-reduce (why not the overlapped path's non-blocking one: see
                // the module docs). Unchecked per call: the bucket layout was verified across
                // ranks in `new`.
                self.pg.run(Collective::all_reduce(&mut flat, ReduceOp::Avg).prechecked())?;
                self.comm += t0.elapsed();
                self.comm_bytes += (flat.numel() * flat.kind().elt_size_in_bytes()) as u64;
                let mut offset = 0;
                for &i in &bucket.params {
                    let p = &self.params[i].1;
                    let n = p.numel() as i64;
                    p.grad().copy_(&flat.narrow(0, offset, n).view(p.size().as_slice()));
                    offset += n;
                }
            }
            Ok(())
        })
    }
    // ANCHOR_END: ddp_sync_gradients

    /// Debug check that every rank holds bit-identical parameters: an element-wise Max and Min
    /// all-reduce of all parameters must agree.
    ///
    /// # Errors
    /// [`Error::CollectiveMismatch`] naming the first parameter that differs across ranks.
    pub fn check_parameters_in_sync(&self) -> Result<()> {
        self.sync_parameters()?;
        check_in_sync(self.pg, &self.params)
    }

    /// The bucket layout as a table, for `--explain` (and ZeRO-1's partition).
    pub fn explain(&self) -> String {
        let buckets = explain_buckets(&self.buckets, &self.params);
        match &self.zero {
            Some(zero) => format!("{buckets}\n{}", zero.explain()),
            None => buckets,
        }
    }
}

impl<M: Segmented> DistributedDataParallel<'_, M> {
    /// Runs `loss.backward()` and then, unless inside [`no_sync`](GradSync::no_sync), averages the
    /// gradients over ranks bucket by bucket. Call it where single-process code calls
    /// `loss.backward()`: `zero_grad` → `backward` (with sync) → `step`.
    ///
    /// After [`forward_segmented`](Self::forward_segmented) the buckets' all-reduces start
    /// during backward, as soon as each bucket's gradients are final, and `backward` returns
    /// once all completed; the gradients are bit-identical to the plain path's.
    ///
    /// # Errors
    /// Collective errors from the gradient all-reduce; [`Error::Torch`] from autograd.
    // ANCHOR: ddp_backward
    pub fn backward(&mut self, loss: &Tensor) -> Result<()> {
        if let Some(pass) = self.pass.get_mut().take() {
            self.backward_segmented(loss, pass)?;
        } else {
            loss.backward();
            if self.require_backward_grad_sync {
                self.sync_gradients()?;
            }
        }
        if let Some(zero) = self.zero.as_ref().filter(|_| self.require_backward_grad_sync) {
            zero.take_gradients(&self.params)?; // ZeRO-1: this rank's slice to its shard
        }
        Ok(())
    }
    // ANCHOR_END: ddp_backward
}

impl<M: Model> DistributedDataParallel<'_, M> {
    /// The wrapped model's forward pass (`ddp(x)`). Not `ModuleT`: a process group is tied to
    /// its thread, and `ModuleT` requires `Send`. [`backward`](Self::backward) then reduces the
    /// buckets after the whole backward pass.
    pub fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        self.pass.borrow_mut().take();
        self.module.forward_t(xs, train)
    }
}

/// Checks `params` are bit-identical on every rank (element-wise Max and Min all-reduce).
///
/// # Errors
/// [`Error::CollectiveMismatch`] naming the first parameter that differs.
pub fn check_in_sync(pg: &dyn ProcessGroup, params: &[(String, Tensor)]) -> Result<()> {
    tch::no_grad(|| {
        let flats: Vec<Tensor> = params.iter().map(|(_, t)| t.detach().to_kind(Kind::Double).reshape([-1])).collect();
        let flat = Tensor::cat(&flats, 0);
        let mut max = flat.copy();
        let mut min = flat.copy();
        pg.all_reduce(&mut max, ReduceOp::Max)?;
        pg.all_reduce(&mut min, ReduceOp::Min)?;
        let differs = max.ne_tensor(&min);
        let mut offset = 0;
        for (name, t) in params {
            let n = t.numel() as i64;
            let bad = differs.narrow(0, offset, n).sum(Kind::Int64).int64_value(&[]);
            if bad > 0 {
                return Err(Error::CollectiveMismatch {
                    op: "check_parameters_in_sync",
                    detail: format!("parameter {name} differs across ranks in {bad} of {n} elements"),
                });
            }
            offset += n;
        }
        Ok(())
    })
}

/// Renders a bucket layout: one row per bucket with its cap, size and parameters.
pub fn explain_buckets(buckets: &[Bucket], params: &[(String, Tensor)]) -> String {
    let mut table = comfy_table::Table::new();
    table.load_preset(comfy_table::presets::ASCII_MARKDOWN);
    table.set_header(["bucket", "cap", "elements", "bytes", "parameters (packing order)"]);
    for (b, bucket) in buckets.iter().enumerate() {
        let names: Vec<&str> = bucket.params.iter().map(|&i| params[i].0.as_str()).collect();
        table.add_row([
            b.to_string(),
            format!("{:.2} MiB", bucket.cap_bytes as f64 / (1024.0 * 1024.0)),
            bucket.numel.to_string(),
            bucket.bytes.to_string(),
            names.join(", "),
        ]);
    }
    format!("DDP gradient buckets: {} bucket(s), reduced in this order with all_reduce(Avg) after backward\n{table}", buckets.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn basicnet_buckets_follow_pytorch_reverse_order_and_first_bucket_cap() {
        // BasicNet in definition order: conv1.w, conv1.b, conv2.w, conv2.b, fc1.w, fc1.b, fc2.w, fc2.b.
        let numels = [288i64, 32, 18432, 64, 1179648, 128, 1280, 10];
        let sizes: Vec<(i64, u64)> = numels.iter().map(|&n| (n, 4 * n as u64)).collect();
        let b = compute_bucket_assignment(&sizes, 25.0);
        assert_eq!(b.len(), 2);
        // fc2.b, fc2.w, fc1.b, fc1.w reach the 1 MiB first cap; the rest fills the 25 MiB bucket.
        assert_eq!(b[0].params, vec![7, 6, 5, 4]);
        assert_eq!(b[0].cap_bytes, 1 << 20);
        assert_eq!(b[1].params, vec![3, 2, 1, 0]);
        assert_eq!(b[0].numel + b[1].numel, 1_199_882);
        // A tiny cap: every tensor closes its own bucket.
        let b = compute_bucket_assignment(&sizes, 1e-6);
        assert_eq!(b.len(), 8);
        assert!(b.iter().all(|b| b.params.len() == 1));
    }
}
