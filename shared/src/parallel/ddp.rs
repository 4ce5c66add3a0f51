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
//!    gets the same overlap from a [`Segmented`] model: forward keeps one graph per segment,
//!    backward runs them in reverse, and after each segment it starts (non-blocking,
//!    [`ProcessGroup::start`]) the all-reduce of every bucket whose parameters all belong to
//!    the segments done, then polls the started ones ([`Work::test`]: Open MPI
//!    progresses a non-blocking collective only inside MPI calls), and waits for all of them
//!    before `backward` returns. The plain [`forward_t`](DistributedDataParallel::forward_t)
//!    reduces every bucket after the whole backward with the blocking all-reduce — every
//!    level's default, because on CPU it is the faster of the two: the overlapped backward's
//!    collectives run on the same cores as backward and Open MPI's non-blocking ones (libnbc)
//!    are slower (waited at once: 4–11 ms per step for BasicNet's 4.6 MiB at 2 ranks, against
//!    1.7–2.3 ms blocking), so level 1 at 2 ranks measured 2,295–2,357 samples/s overlapped against
//!    2,423–2,518 plain. Overlap pays where communication has its own engine (NCCL's stream on
//!    a GPU, a network card). Same collectives and, at 2 ranks, bit-identical gradients; at 3
//!    or more ranks the two all-reduce algorithms sum in different orders (gradients equal to
//!    float rounding).
//! 4. Inside [`DistributedDataParallel::no_sync`], step 3 is skipped (gradient accumulation).
//!
//! Parameter order comes from [`Model::named_parameters`] (definition order), identical on every
//! rank; never from a `HashMap`.

use crate::dist::{Collective, ProcessGroup, ReduceOp, Work};
use crate::model::{Model, Segmented};
use crate::parallel::DdpOptions;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::cell::RefCell;
use std::time::{Duration, Instant};
use tch::{Device, Kind, Tensor};

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
}

/// What a segmented forward keeps for backward.
struct SegmentedPass {
    /// Per segment: its input (a detached leaf that requires grad, except for segment 0) and its
    /// output with the segment's graph.
    saved: Vec<(Tensor, Tensor)>,
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
        })
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
    /// sync only): for an overlapped backward, the time to start and poll the all-reduces during
    /// backward and to wait for them after it — not the time they ran alongside backward.
    pub fn comm_seconds(&self) -> f64 {
        self.comm.as_secs_f64()
    }

    /// Payload bytes of the gradient all-reduces since construction (each bucket's flat buffer).
    pub fn comm_bytes(&self) -> u64 {
        self.comm_bytes
    }

    /// How much of the all-reduce time overlapped backward (see [`CommOverlap`]).
    pub fn comm_overlap(&self) -> CommOverlap {
        self.overlap
    }

    /// Runs `loss.backward()` and then, unless inside [`no_sync`](Self::no_sync), averages the
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
            return self.backward_overlapped(loss, pass);
        }
        loss.backward();
        if self.require_backward_grad_sync {
            self.sync_gradients()?;
        }
        Ok(())
    }
    // ANCHOR_END: ddp_backward

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
    /// reverse, overlapping each bucket's all-reduce with the segments still to run.
    fn backward_overlapped(&mut self, loss: &Tensor, pass: SegmentedPass) -> Result<()> {
        let SegmentedPass { mut saved, bucket_ready_after, output } = pass;
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
        let sync = self.require_backward_grad_sync;
        let mut flats: Vec<Tensor> = self.buckets.iter().map(|_| Tensor::new()).collect();
        let mut slots = flats.iter_mut();
        let mut works: Vec<(usize, Work<'_>, Instant, Option<Instant>)> = Vec::new();
        let mut issue = Duration::ZERO;
        let mut next = 0;
        let mut bytes = 0u64;
        let this = &*self;
        for i in (0..saved.len()).rev() {
            let (x, y) = saved.pop().expect("one saved pair per segment");
            if y.requires_grad() {
                // y.backward(g) hands y's grad_fn exactly g, as the whole-graph backward would,
                // and accumulates into every leaf it reaches: this segment's parameters' .grad
                // (as `loss.backward()` does) and the segment input `x`, whose .grad is the
                // gradient flowing into the previous segment.
                crate::autograd::backward_with_grad(&y, &g)?;
            }
            if i > 0 {
                g = x.grad();
                if !g.defined() {
                    g = x.zeros_like();
                }
            }
            drop((x, y));
            if !sync {
                continue;
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
        }
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

    /// Runs `f` with gradient synchronisation off, as `with ddp.no_sync():` — gradients
    /// accumulate locally; the next `backward` outside syncs the accumulated sum.
    pub fn no_sync<R>(&mut self, f: impl FnOnce(&mut Self) -> R) -> R {
        let before = self.require_backward_grad_sync;
        self.require_backward_grad_sync = false;
        let out = f(self);
        self.require_backward_grad_sync = before;
        out
    }

    /// Turns the gradient sync of the next backwards on or off (PyTorch's
    /// `require_backward_grad_sync`, what [`no_sync`](Self::no_sync) toggles for a closure).
    pub fn set_require_backward_grad_sync(&mut self, sync: bool) {
        self.require_backward_grad_sync = sync;
    }

    /// Debug check that every rank holds bit-identical parameters: an element-wise Max and Min
    /// all-reduce of all parameters must agree.
    ///
    /// # Errors
    /// [`Error::CollectiveMismatch`] naming the first parameter that differs across ranks.
    pub fn check_parameters_in_sync(&self) -> Result<()> {
        check_in_sync(self.pg, &self.params)
    }

    /// The bucket layout as a table, for `--explain`.
    pub fn explain(&self) -> String {
        explain_buckets(&self.buckets, &self.params)
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

impl<M: Model> DistributedDataParallel<'_, M> {
    /// The wrapped model's forward pass (`ddp(x)`). Not `ModuleT`: a process group is tied to
    /// its thread, and `ModuleT` requires `Send`. [`backward`](Self::backward) then reduces the
    /// buckets after the whole backward pass.
    pub fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        self.pass.borrow_mut().take();
        self.module.forward_t(xs, train)
    }
}

/// True when autograd records operations here (not inside `no_grad`).
fn grad_enabled() -> bool {
    let probe = Tensor::zeros([1], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    (&probe * 1.0).requires_grad()
}

impl<M: Segmented> DistributedDataParallel<'_, M> {
    /// The forward pass of [`forward_t`](Self::forward_t) (same output, bit for bit: the
    /// [`Segmented`] contract), run segment by segment so that [`backward`](Self::backward) can
    /// start each bucket's all-reduce as soon as its gradients are final, overlapping
    /// communication with the rest of backward (PyTorch's DDP does it from autograd hooks).
    ///
    /// In grad mode each segment's graph is kept and the returned output (BasicNet: `[batch,
    /// 10]` f32 log-probabilities) is a leaf that requires grad: the loss must go to
    /// [`backward`](Self::backward) (a bare `loss.backward()` stops at the output). Under
    /// `no_grad` it is plain `forward_t`.
    pub fn forward_segmented(&self, xs: &Tensor, train: bool) -> Tensor {
        self.pass.borrow_mut().take();
        if !grad_enabled() {
            return self.module.forward_t(xs, train);
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
            let y = self.module.segment_forward(i, &x_in, train);
            saved.push((x_in, y.shallow_clone()));
            x = y;
        }
        let output = x.detach().set_requires_grad(true);
        *self.pass.borrow_mut() = Some(SegmentedPass { saved, bucket_ready_after, output: output.shallow_clone() });
        output
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
