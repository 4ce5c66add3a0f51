//! ZeRO-1 over DDP, as `torch.distributed.optim.ZeroRedundancyOptimizer(params,
//! optimizer_class=AdamW)` around a `DistributedDataParallel` model (DeepSpeed's ZeRO stage 1):
//! parameters and gradients stay replicated (DDP's all-reduce is unchanged), but each rank keeps
//! and steps the AdamW state of its 1/W of the parameters only, and then the updated parameters
//! are sent from their owner to every rank (one broadcast per rank, in place).
//!
//! The partition: DeepSpeed's flat contiguous one, not PyTorch's greedy per-tensor assignment.
//! The parameters are laid out in definition order in one flat buffer, each starting at a
//! multiple of [`ALIGN`] elements, zero-padded to `padded_numel` (a multiple of `ALIGN · W`),
//! and rank r owns elements `[r·shard_numel, (r+1)·shard_numel)`; the model's parameters become
//! views of that buffer. The optimizer steps one leaf view per parameter piece inside the
//! shard (a parameter cut by a shard boundary gives two pieces), so AdamW updates the
//! parameters in place, and — the boundaries falling on multiples of [`ALIGN`] from every
//! parameter's start — libtorch's fused kernel treats every element as it does in DDP's
//! per-parameter step (the same vector lanes and scalar tail): the weights are bit-identical to
//! DDP's at one intra-op thread. Why not PyTorch's
//! assigns whole tensors to ranks (largest first, to the least-loaded rank), and BasicNet's
//! `fc1.weight` is 98% of its parameters (99.9% at width 4096), so one rank would keep almost
//! all of the state; the flat partition gives every rank exactly `padded_numel / W` elements
//! (closed form in [`ZeroPartition::memory`]).
//!
//! When the shards are sent: PyTorch's `step()` steps and then broadcasts. Here the optimizer is
//! the plain [`AdamW`] over the shard (every level's loop is unchanged), so the broadcast runs
//! at the first use of the parameters after a step — the next forward, state dict or sync check
//! ([`ZeroPartition::sync_parameters`]) — once per synchronised backward: the same collectives
//! in the same order on every rank.
//!
//! Gradients: one flat buffer laid out as the parameters' (`[padded_numel]`, allocated by the
//! first training forward), every parameter's `.grad` and every piece's `.grad` a view of it
//! ([`crate::autograd::set_grad`], PyTorch's `p.grad = view`): backward accumulates into it in
//! place, DDP's all-reduce writes the averaged gradients back into it, and the pieces the
//! optimizer steps see their slice of it with no copy — 4P bytes of gradients per rank in fp32
//! instead of 4Ψ + 4m when the pieces' gradients were copies (P: `padded_numel`, m: the rank's
//! share). After a synchronised backward the buffer outside this rank's shard is zeroed (the
//! optimizer, which sees only the pieces, zeroes the rest in its `zero_grad`), so the next
//! accumulation starts from zero as after `zero_grad`: gradient accumulation under `no_sync`
//! and clipping (`grads_are_sharded`: norms summed over ranks) behave as with FSDP's shards.

use crate::dist::ProcessGroup;
use crate::memory::ModelStateBytes;
use crate::optim::AdamW;
use crate::{Error, Result};
use std::cell::{Cell, RefCell};
use std::time::Duration;
use tch::{Kind, Tensor};

/// Alignment of every parameter's start and of the shard boundaries, in elements: a multiple
/// of every CPU vector width libtorch's kernels use (16 f32 lanes with AVX-512).
pub const ALIGN: i64 = 64;

/// A piece of one parameter inside this rank's shard: what the optimizer steps.
struct Piece {
    /// Index of the parameter (definition order).
    param: usize,
    /// Offset of the piece in the parameter (flattened), elements.
    in_param: i64,
    /// Offset of the piece in this rank's shard, elements.
    in_shard: i64,
    /// A leaf view of the flat buffer (`[len]`), with its own `.grad`.
    tensor: Tensor,
}

/// One rank's share of the flat parameter: where it lies, the buffer, the pieces.
pub struct ZeroPartition {
    /// Every parameter, flat, aligned and padded: `[padded_numel]`, the parameters' dtype.
    flat: Tensor,
    /// The gradients laid out as `flat` (undefined until [`attach_gradients`](Self::attach_gradients)):
    /// every parameter's and every piece's `.grad` is a view of it.
    flat_grad: RefCell<Tensor>,
    /// The pieces of parameters in this rank's shard, in order.
    pieces: Vec<Piece>,
    /// Each parameter's `(offset, numel)` in `flat`, definition order.
    layout: Vec<(i64, i64)>,
    /// Elements of all parameters.
    numel: i64,
    /// The flat buffer's length: the aligned layout rounded up to a multiple of `ALIGN · W`.
    padded_numel: i64,
    /// `padded_numel / world_size`.
    shard_numel: i64,
    rank: usize,
    world_size: usize,
    /// A synchronised backward set the pieces' gradients since the last broadcast: an
    /// optimizer step may have changed the shards.
    pending: Cell<bool>,
    /// Time and payload bytes of the parameter broadcasts.
    comm: Cell<(Duration, u64)>,
}

impl std::fmt::Debug for ZeroPartition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZeroPartition")
            .field("numel", &self.numel)
            .field("padded_numel", &self.padded_numel)
            .field("shard_numel", &self.shard_numel)
            .field("rank", &self.rank)
            .field("pieces", &self.pieces.len())
            .finish()
    }
}

fn round_up(n: i64, to: i64) -> i64 {
    (n + to - 1) / to * to
}

impl ZeroPartition {
    /// Lays `params` (definition order, one dtype and device, already equal on every rank)
    /// out in one flat buffer and points them at views of it; this rank's pieces are views too.
    ///
    /// # Errors
    /// [`Error::InvalidValue`] when the parameters do not share one dtype; libtorch errors.
    pub fn new(params: &[(String, Tensor)], pg: &dyn ProcessGroup) -> Result<Self> {
        let (rank, world_size) = (pg.rank(), pg.world_size());
        let kind = params.first().map_or(Kind::Float, |(_, t)| t.kind());
        if let Some((name, t)) = params.iter().find(|(_, t)| t.kind() != kind) {
            return Err(Error::invalid(
                "zero_redundancy_optimizer",
                format!("parameter {name} of dtype {:?}", t.kind()),
                format!("parameters of one dtype ({kind:?}) to lay out in one flat buffer"),
            ));
        }
        let device = params.first().map_or(pg.device(), |(_, t)| t.device());
        let mut layout = Vec::with_capacity(params.len());
        let (mut end, mut numel) = (0i64, 0i64);
        for (_, t) in params {
            let n = t.numel() as i64;
            layout.push((end, n));
            end = round_up(end + n, ALIGN);
            numel += n;
        }
        let padded_numel = round_up(end.max(1), ALIGN * world_size as i64);
        let shard_numel = padded_numel / world_size as i64;
        let flat = Tensor::zeros([padded_numel], (kind, device));
        tch::no_grad(|| -> Result<()> {
            for ((_, p), &(offset, n)) in params.iter().zip(&layout) {
                let view = flat.narrow(0, offset, n).view(p.size().as_slice());
                view.shallow_clone().f_copy_(p)?;
                // The parameter keeps its identity (the model and DDP hold it) but now lives in
                // the flat buffer.
                p.shallow_clone().f_set_data(&view)?;
            }
            Ok(())
        })?;
        let (lo, hi) = (rank as i64 * shard_numel, (rank as i64 + 1) * shard_numel);
        let mut pieces = Vec::new();
        for (param, &(offset, n)) in layout.iter().enumerate() {
            let (a, b) = (offset.max(lo), (offset + n).min(hi));
            if a < b {
                let tensor = flat.narrow(0, a, b - a).detach().set_requires_grad(true);
                pieces.push(Piece { param, in_param: a - offset, in_shard: a - lo, tensor });
            }
        }
        Ok(Self {
            flat,
            flat_grad: RefCell::new(Tensor::new()),
            pieces,
            layout,
            numel,
            padded_numel,
            shard_numel,
            rank,
            world_size,
            pending: Cell::new(false),
            comm: Cell::new((Duration::ZERO, 0)),
        })
    }

    /// What the optimizer steps: one `(name, leaf)` per parameter piece in this rank's shard,
    /// named `{parameter}._zero_shard` (a view of the parameters' flat buffer, so a step
    /// updates this rank's parameters in place).
    pub fn optimizer_params(&self, params: &[(String, Tensor)]) -> Vec<(String, Tensor)> {
        self.pieces.iter().map(|p| (format!("{}._zero_shard", params[p.param].0), p.tensor.shallow_clone())).collect()
    }

    /// `(numel, padded_numel, shard_numel)`: the parameters' elements, the flat buffer's, and
    /// each rank's share of it.
    pub fn sizes(&self) -> (i64, i64, i64) {
        (self.numel, self.padded_numel, self.shard_numel)
    }

    /// Seconds and payload bytes of the parameter broadcasts so far.
    pub fn comm(&self) -> (Duration, u64) {
        self.comm.get()
    }

    /// Points every parameter's `.grad` and every piece's at its view of the flat gradient
    /// buffer, allocating the buffer (zeros) the first time: the first training forward calls it
    /// (through the wrapper), so that backward accumulates straight into the buffer. A
    /// gradient that is not yet its view (one a backward made before, or one set to another
    /// tensor since) is copied into it first. Cheap when everything is in place (a pointer
    /// comparison per tensor).
    ///
    /// # Errors
    /// libtorch errors.
    pub fn attach_gradients(&self, params: &[(String, Tensor)]) -> Result<()> {
        let mut flat_grad = self.flat_grad.borrow_mut();
        if !flat_grad.defined() {
            *flat_grad = Tensor::zeros([self.padded_numel], (self.flat.kind(), self.flat.device()));
        }
        tch::no_grad(|| -> Result<()> {
            // Views made by `detach` (not differentiable views), as PyTorch's own gradients are
            // plain tensors: tch's `zero_grad` detaches a gradient in place, which libtorch
            // refuses on a view.
            for ((_, p), &(offset, n)) in params.iter().zip(&self.layout) {
                let view = flat_grad.narrow(0, offset, n).view(p.size().as_slice()).detach();
                attach(p, &view)?;
            }
            let lo = self.rank as i64 * self.shard_numel;
            for piece in &self.pieces {
                let len = piece.tensor.numel() as i64;
                // The buffer holds the truth (the parameters' gradients): a piece's gradient is
                // only ever re-pointed, never copied.
                let view = flat_grad.narrow(0, lo + piece.in_shard, len).detach();
                let g = piece.tensor.grad();
                if !g.defined() || g.data_ptr() != view.data_ptr() {
                    crate::autograd::set_grad(&piece.tensor, &view)?;
                }
            }
            Ok(())
        })
    }

    /// After a synchronised backward: the pieces' gradients are already this rank's slices of
    /// the averaged gradients (views of the flat buffer, see [`attach_gradients`](Self::attach_gradients),
    /// which re-points any gradient that is no longer its view); zeroes the buffer outside
    /// this rank's shard, so that the next accumulation starts from zero as after `zero_grad`
    /// (the optimizer, which sees only the pieces, zeroes the shard's part).
    ///
    /// # Errors
    /// libtorch errors.
    pub fn take_gradients(&self, params: &[(String, Tensor)]) -> Result<()> {
        self.attach_gradients(params)?;
        let flat_grad = self.flat_grad.borrow();
        let (lo, hi) = (self.rank as i64 * self.shard_numel, (self.rank as i64 + 1) * self.shard_numel);
        tch::no_grad(|| -> Result<()> {
            for (start, len) in [(0, lo), (hi, self.padded_numel - hi)] {
                if len > 0 {
                    let _ = flat_grad.narrow(0, start, len).f_zero_()?;
                }
            }
            Ok(())
        })?;
        self.pending.set(true);
        Ok(())
    }

    /// Sends each rank's block of the flat buffer to every rank (W broadcasts in place, in rank
    /// order) when a step may have changed them since the last time: PyTorch's
    /// `ZeroRedundancyOptimizer.step()` broadcast. Collective: every rank calls it at the same
    /// points and sees the same flag (set by the same synchronised backwards).
    ///
    /// # Errors
    /// Collective errors.
    pub fn sync_parameters(&self, pg: &dyn ProcessGroup) -> Result<()> {
        if !self.pending.replace(false) || self.world_size == 1 {
            return Ok(());
        }
        let t0 = std::time::Instant::now();
        tch::no_grad(|| -> Result<()> {
            for r in 0..self.world_size {
                let mut block = self.flat.narrow(0, r as i64 * self.shard_numel, self.shard_numel);
                pg.broadcast(&mut block, r)?;
            }
            Ok(())
        })?;
        let bytes = (self.padded_numel * self.flat.kind().elt_size_in_bytes() as i64) as u64;
        let (s, b) = self.comm.get();
        self.comm.set((s + t0.elapsed(), b + bytes));
        Ok(())
    }

    /// Elements of this rank's pieces (its share of the parameters, alignment gaps excluded).
    fn piece_numel(&self) -> i64 {
        self.pieces.iter().map(|p| p.tensor.numel() as i64).sum()
    }

    /// Model-state bytes this rank holds, from the tensors: `parameters` = the flat buffer
    /// (`padded_numel` elements, every parameter, as DDP's replicas plus alignment);
    /// `gradients` = the flat gradient buffer once allocated (`padded_numel` elements: the
    /// parameters' and the pieces' gradients are views of it), plus any parameter gradient
    /// that is not (yet) its view; `optimizer` = AdamW's two moments of the pieces (what it
    /// allocates at the first step): at most `2 · shard_numel` elements, `8 · padded_numel / W`
    /// bytes in fp32, against DDP's `8Ψ`. `gathered_peak` 0.
    pub fn memory(&self, params: &[(String, Tensor)]) -> ModelStateBytes {
        let bytes = |t: &Tensor| if t.defined() { (t.numel() * t.kind().elt_size_in_bytes()) as u64 } else { 0 };
        let elt = self.flat.kind().elt_size_in_bytes() as u64;
        let flat_grad = self.flat_grad.borrow();
        let inside = |t: &Tensor| {
            flat_grad.defined() && t.defined() && {
                let (start, end) = (flat_grad.data_ptr() as usize, flat_grad.data_ptr() as usize + bytes(&flat_grad) as usize);
                (start..end).contains(&(t.data_ptr() as usize))
            }
        };
        let stray: u64 = params.iter().map(|(_, p)| p.grad()).filter(|g| !inside(g)).map(|g| bytes(&g)).sum::<u64>()
            + self.pieces.iter().map(|p| p.tensor.grad()).filter(|g| !inside(g)).map(|g| bytes(&g)).sum::<u64>();
        ModelStateBytes {
            parameters: bytes(&self.flat),
            gradients: bytes(&flat_grad) + stray,
            optimizer: 2 * self.piece_numel() as u64 * elt,
            gathered_peak: 0,
            optimizer_on_disk: 0,
        }
    }

    /// This rank's moments laid out as its shard (`[shard_numel]` each, 0 in the gaps), and the
    /// step count; `None` before the first step.
    fn local_moments(&self, opt: &AdamW, params: &[(String, Tensor)]) -> Result<Option<(Tensor, Tensor, Tensor)>> {
        let names: Vec<String> = self.optimizer_params(params).into_iter().map(|(n, _)| n).collect();
        let local = opt.try_state_dict(&names)?;
        Ok(self.layout_moments(&names, &local))
    }

    /// [`local_moments`](Self::local_moments) from the optimizer's state dict `local`.
    fn layout_moments(&self, names: &[String], local: &[(String, Tensor)]) -> Option<(Tensor, Tensor, Tensor)> {
        let get = |k: String| local.iter().find(|(n, _)| *n == k).map(|(_, t)| t.shallow_clone());
        let step = get(format!("{}.step", names.first()?))?;
        let m = Tensor::zeros([self.shard_numel], (self.flat.kind(), self.flat.device()));
        let v = m.zeros_like();
        for (piece, name) in self.pieces.iter().zip(names) {
            let len = piece.tensor.numel() as i64;
            m.narrow(0, piece.in_shard, len).copy_(&get(format!("{name}.exp_avg"))?);
            v.narrow(0, piece.in_shard, len).copy_(&get(format!("{name}.exp_avg_sq"))?);
        }
        Some((m, v, step))
    }

    /// The optimizer's full state with the unwrapped model's keys on rank 0 (`None` elsewhere):
    /// `{name}.exp_avg`, `{name}.exp_avg_sq` (the parameter's shape) and `{name}.step`, as
    /// DDP's, so a checkpoint loads at any world size and strategy. Consolidated on rank 0 as
    /// PyTorch's `ZeroRedundancyOptimizer.consolidate_state_dict(to=0)`: per moment, each rank
    /// broadcasts its shard in turn and rank 0 alone keeps them (`[padded_numel]` per moment);
    /// another rank holds one shard-sized receive buffer, not the whole state an all-gather
    /// would leave on every rank. Collective (every rank has stepped as often, so all take the
    /// same path).
    ///
    /// # Errors
    /// Collective errors.
    pub fn optim_state_dict(
        &self,
        pg: &dyn ProcessGroup,
        opt: &AdamW,
        params: &[(String, Tensor)],
    ) -> Result<Option<Vec<(String, Tensor)>>> {
        let Some((m, v, step)) = tch::no_grad(|| self.local_moments(opt, params))? else {
            return Ok((self.rank == 0).then(Vec::new));
        };
        let mut full = Vec::with_capacity(2);
        for moment in [m, v] {
            if self.world_size == 1 {
                full.push(moment);
                continue;
            }
            // Rank 0 receives each shard into its slot of the whole; another rank into one
            // shard-sized buffer it drops; the sender broadcasts its own shard.
            let numel = if self.rank == 0 { self.padded_numel } else { self.shard_numel };
            let inbox = Tensor::empty([numel], (moment.kind(), moment.device()));
            for src in 0..self.world_size {
                let mut buffer = if src == self.rank {
                    moment.shallow_clone()
                } else if self.rank == 0 {
                    inbox.narrow(0, src as i64 * self.shard_numel, self.shard_numel)
                } else {
                    inbox.shallow_clone()
                };
                pg.broadcast(&mut buffer, src)?;
            }
            if self.rank == 0 {
                // Rank 0's own shard is the first.
                tch::no_grad(|| inbox.narrow(0, 0, self.shard_numel).f_copy_(&moment))?;
                full.push(inbox);
            }
        }
        if self.rank != 0 {
            return Ok(None);
        }
        // Views of the gathered moments: copies would hold them twice while a checkpoint is written.
        let mut out = Vec::with_capacity(3 * params.len());
        for ((name, p), &(offset, n)) in params.iter().zip(&self.layout) {
            out.push((format!("{name}.exp_avg"), full[0].narrow(0, offset, n).view(p.size().as_slice())));
            out.push((format!("{name}.exp_avg_sq"), full[1].narrow(0, offset, n).view(p.size().as_slice())));
            out.push((format!("{name}.step"), step.copy()));
        }
        Ok(Some(out))
    }

    /// Loads a full optimizer state (what [`optim_state_dict`](Self::optim_state_dict) or
    /// DDP's returned; every rank passes the same dict): this rank keeps its pieces of each
    /// moment. All parameters have state, or none. No communication.
    ///
    /// # Errors
    /// [`Error::StateDict`] naming missing or unexpected keys, shapes that differ, or step
    /// counts that differ between parameters.
    pub fn load_optim_state_dict(&self, opt: &mut AdamW, params: &[(String, Tensor)], state_dict: &[(String, Tensor)]) -> Result<()> {
        let names: Vec<String> = self.optimizer_params(params).into_iter().map(|(n, _)| n).collect();
        if state_dict.is_empty() {
            return opt.load_state_dict(&names, &[]);
        }
        let expected: Vec<(String, Vec<i64>)> = params
            .iter()
            .flat_map(|(n, p)| [(format!("{n}.exp_avg"), p.size()), (format!("{n}.exp_avg_sq"), p.size()), (format!("{n}.step"), vec![])])
            .collect();
        let map = super::data_parallel::check_named(state_dict, &expected, "optimizer")?;
        let steps: Vec<i64> = params.iter().map(|(n, _)| map[format!("{n}.step").as_str()].int64_value(&[])).collect();
        if steps.iter().any(|&s| s != steps[0]) {
            return Err(Error::StateDict(format!(
                "optimizer: ZeRO-1 steps every parameter together, but the parameters' step counts differ ({steps:?})"
            )));
        }
        let mut local = Vec::with_capacity(3 * self.pieces.len());
        for (piece, name) in self.pieces.iter().zip(&names) {
            let pname = &params[piece.param].0;
            let len = piece.tensor.numel() as i64;
            for what in ["exp_avg", "exp_avg_sq"] {
                let full = map[format!("{pname}.{what}").as_str()];
                local.push((format!("{name}.{what}"), full.reshape([-1]).narrow(0, piece.in_param, len).copy()));
            }
            local.push((format!("{name}.step"), Tensor::from(steps[0])));
        }
        opt.load_state_dict(&names, &local)
    }

    /// The partition as text, for `--explain`.
    pub fn explain(&self) -> String {
        let elt = self.flat.kind().elt_size_in_bytes() as i64;
        format!(
            "ZeRO-1 (ZeroRedundancyOptimizer over DDP): the {} parameter elements laid out flat ({ALIGN}-element aligned), \
             padded to {} (a multiple of {ALIGN} × {} ranks); rank r keeps and steps the AdamW state of elements \
             [r·{s}, (r+1)·{s}) (at most {} bytes of moments per rank instead of {}); after each step every rank's \
             block is broadcast from it",
            self.numel,
            self.padded_numel,
            self.world_size,
            2 * self.shard_numel * elt,
            2 * self.numel * elt,
            s = self.shard_numel
        )
    }
}

/// Makes `view` the `.grad` of parameter `p` unless it already is: a gradient `p` had is
/// copied into the view first, and without one the view is zeroed (no-grad mode).
fn attach(p: &Tensor, view: &Tensor) -> Result<()> {
    let g = p.grad();
    if g.defined() && g.data_ptr() == view.data_ptr() {
        return Ok(());
    }
    if g.defined() {
        view.shallow_clone().f_copy_(&g)?;
    } else {
        let _ = view.shallow_clone().f_zero_()?;
    }
    crate::autograd::set_grad(p, view)
}
