//! Gathering a unit's parameters: the blocking all-gather a segment waits for, the prefetch
//! that starts one ahead of need (at most one in flight, so every rank issues its collectives
//! in one order), and freeing or releasing the gathered memory again.

use super::storage::FlatStorage;
use super::FullyShardedDataParallel;
use crate::dist::{Collective, Work};
use crate::model::Segmented;
use crate::Result;
use std::time::Instant;
use tch::{Kind, Tensor};

/// An all-gather started ahead of need (forward or backward prefetch).
pub(super) struct Inflight<'pg> {
    /// The unit it gathers.
    pub(super) unit: usize,
    /// The collective; it owns shallow clones of the shard's cast and of the gathered storage.
    pub(super) work: Work<'pg>,
}

/// A unit's gathered parameters.
pub(super) enum Gathered {
    /// `NoShard`: the shard is the whole flat parameter; this is the shard itself (0 extra
    /// bytes) or its cast to the compute dtype (mixed precision; those bytes).
    Local(Tensor, u64),
    /// Sharded: the all-gathered flat parameter, `[padded_numel]` in the compute dtype. Under
    /// `FullShard` it is released between forward and backward and refilled in place.
    Flat(FlatStorage),
}

impl Gathered {
    /// The flat parameter while its memory is allocated.
    fn tensor(&self) -> Option<&Tensor> {
        match self {
            Gathered::Local(t, _) => Some(t),
            Gathered::Flat(s) => s.tensor(),
        }
    }

    /// Bytes it adds while allocated.
    fn bytes(&self) -> u64 {
        match self {
            Gathered::Local(_, b) => *b,
            Gathered::Flat(s) => s.nbytes(),
        }
    }
}

impl<M: Segmented> FullyShardedDataParallel<'_, M> {
    /// All-gathers unit `u` (in the compute dtype) and points the model's parameters at it. A
    /// unit released after forward (`FullShard`) is refilled *in its own storage*, which the
    /// views saved by forward's graph share; a unit already gathered is left as it is.
    pub(super) fn gather(&mut self, u: usize) -> Result<()> {
        if self.inflight.as_ref().is_some_and(|f| f.unit == u) {
            return self.finish_prefetch();
        }
        if self.is_gathered(u) {
            // Nothing to communicate: another unit's prefetch stays in flight.
            return Ok(());
        }
        // Another unit's prefetch: complete it first (collectives complete in issue order).
        self.finish_prefetch()?;
        let gathered = if !self.config.sharding_strategy.is_sharded() {
            // NoShard: the "shard" is the whole flat parameter; only a dtype cast copies — and
            // CPU offload's copy to the compute device.
            let (pkind, shard) = (self.param_kind(u), self.shards[u].detach());
            let (shard, copied) = match &mut self.offload {
                Some(o) => (tch::no_grad(|| o.copy_to_device(&shard))?, true),
                None => (shard, false),
            };
            let bytes = self.units[u].numel as u64 * pkind.elt_size_in_bytes() as u64;
            let retired = self.retired[u].take();
            tch::no_grad(|| {
                if pkind == shard.kind() {
                    Ok(Gathered::Local(shard, if copied { bytes } else { 0 }))
                } else if let Some(mut cast) = retired {
                    // The last step's cast, written over: no fresh allocation (at width 4096,
                    // fc1's 75 MB in bf16, which glibc mmaps and the kernel zeroes every step).
                    cast.f_copy_(&shard)?;
                    Ok(Gathered::Local(cast, bytes))
                } else {
                    Ok(Gathered::Local(shard.to_kind(pkind), bytes))
                }
            })
            .map_err(crate::Error::Torch)?
        } else {
            let (storage, mut full, input) = self.gather_buffers(u)?;
            let t0 = Instant::now();
            // The collective writes the storage's memory directly; `full` and the saved views
            // share it.
            tch::no_grad(|| self.shard_pg.all_gather(&mut full, &input))?;
            self.comm += t0.elapsed();
            self.comm_bytes += storage.nbytes();
            Gathered::Flat(storage)
        };
        self.keep_gathered(u, gathered);
        self.point_params(u)
    }

    /// What an all-gather of sharded unit `u` needs: the unit's flat storage, allocated (a
    /// storage released after forward is refilled in place, for forward's graph views it),
    /// the buffer to gather into (a view of that storage) and the shard cast to the compute
    /// dtype (with CPU offload, first copied to the compute device in its own dtype, as
    /// PyTorch's `_mp_shard.copy_(_local_shard.to(device))`).
    ///
    /// # Errors
    /// [`Error::Fsdp`] if the storage cannot be allocated or the shard copied.
    fn gather_buffers(&mut self, u: usize) -> Result<(FlatStorage, Tensor, Tensor)> {
        let (rank, pkind, device) = (self.shard_pg.rank(), self.param_kind(u), self.shard_pg.device());
        let shard = self.shards[u].detach();
        let shard = match &mut self.offload {
            Some(o) => tch::no_grad(|| o.copy_to_device(&shard))?,
            None => shard,
        };
        let mut storage = match self.gathered[u].take() {
            Some(Gathered::Flat(released)) => released,
            _ => FlatStorage::new(self.units[u].padded_numel, pkind, device),
        };
        let full = storage.refill(rank)?.shallow_clone();
        let input = tch::no_grad(|| shard.to_kind(pkind).contiguous());
        Ok((storage, full, input))
    }

    /// Keeps `gathered` as unit `u`'s gathered parameters, counting its bytes as live.
    fn keep_gathered(&mut self, u: usize, gathered: Gathered) {
        self.live_gathered += gathered.bytes();
        self.peak_gathered = self.peak_gathered.max(self.live_gathered);
        self.gathered[u] = Some(gathered);
    }

    /// True when unit `u`'s gathered parameters are allocated (and not still in flight).
    fn is_gathered(&self, u: usize) -> bool {
        self.gathered[u].as_ref().is_some_and(|g| g.tensor().is_some()) && self.inflight.as_ref().is_none_or(|f| f.unit != u)
    }

    /// Points the model's parameters of unit `u` at views of its gathered flat parameter.
    fn point_params(&mut self, u: usize) -> Result<()> {
        let full = match self.gathered[u].as_ref().and_then(Gathered::tensor) {
            Some(t) => t.shallow_clone(),
            None => return Ok(()),
        };
        let unit = &self.units[u];
        for (k, &p) in unit.params.iter().enumerate() {
            self.params[p].1.f_set_data(&unit.param_view(&full, k))?;
        }
        Ok(())
    }

    /// Starts all-gathering sharded unit `u` without waiting for it (PyTorch's prefetch);
    /// [`gather`](Self::gather) completes it when the unit is needed, and nothing reads the
    /// storage before. At most one prefetch is in flight: a previous one is completed first.
    /// No-op when `u` is already gathered or in flight, or nothing is sharded.
    pub(super) fn prefetch(&mut self, u: usize) -> Result<()> {
        if !self.config.sharding_strategy.is_sharded() || self.inflight.as_ref().is_some_and(|f| f.unit == u) || self.is_gathered(u) {
            return Ok(());
        }
        self.finish_prefetch()?;
        let (mut storage, full, input) = self.gather_buffers(u)?;
        let t0 = Instant::now();
        let started = self.shard_pg.start(Collective::all_gather(full, input));
        self.comm += t0.elapsed();
        let work = match started {
            Ok(work) => work,
            Err(e) => {
                // Nothing was issued: hand the memory back and keep the (released) storage.
                storage.release(self.shard_pg.rank())?;
                self.gathered[u] = Some(Gathered::Flat(storage));
                return Err(e);
            }
        };
        self.comm_bytes += storage.nbytes();
        self.keep_gathered(u, Gathered::Flat(storage));
        self.inflight = Some(Inflight { unit: u, work });
        self.prefetches += 1;
        Ok(())
    }

    /// Waits for the prefetched all-gather in flight, if any, and points its unit's
    /// parameters at the result. The wait counts as communication time; the time it ran
    /// behind computation does not.
    pub(super) fn finish_prefetch(&mut self) -> Result<()> {
        let Some(Inflight { unit, work }) = self.inflight.take() else { return Ok(()) };
        let t0 = Instant::now();
        let waited = work.wait();
        self.comm += t0.elapsed();
        if let Err(e) = waited {
            // The storage holds no parameters: release it, so that nothing takes it for gathered.
            if let Some(Gathered::Flat(storage)) = &mut self.gathered[unit] {
                if storage.is_filled() {
                    self.live_gathered -= storage.nbytes();
                    storage.release(self.shard_pg.rank())?;
                }
            }
            return Err(e);
        }
        self.point_params(unit)
    }

    /// The next unit forward needs after segment `i` that is neither `current` nor gathered.
    pub(super) fn next_unit_forward(&self, i: usize, current: Option<usize>) -> Option<usize> {
        self.seg_unit[i + 1..].iter().flatten().copied().find(|&v| Some(v) != current && !self.is_gathered(v))
    }

    /// The next unit backward needs after segment `i` (segments run in reverse) that is
    /// neither `current` nor gathered.
    pub(super) fn next_unit_backward(&self, i: usize, current: Option<usize>) -> Option<usize> {
        self.seg_unit[..i].iter().rev().flatten().copied().find(|&v| Some(v) != current && !self.is_gathered(v))
    }

    /// Points unit `u`'s parameters at 0-element tensors, so that nothing outside forward's
    /// graph views the gathered flat parameter.
    fn empty_params(&mut self, u: usize, kind: Kind) -> Result<()> {
        let device = self.shard_pg.device();
        for &p in &self.units[u].params {
            self.params[p].1.f_set_data(&Tensor::empty([0], (kind, device)))?;
        }
        Ok(())
    }

    /// Frees unit `u`'s gathered parameters (the model's tensors go back to 0 elements). The
    /// memory goes when the last view of it does: at once, unless a forward graph that was not
    /// backpropagated still holds views (it is dropped by the next forward).
    pub(super) fn free(&mut self, u: usize) -> Result<()> {
        if self.inflight.as_ref().is_some_and(|f| f.unit == u) {
            self.finish_prefetch()?;
        }
        if let Some(g) = self.gathered[u].take() {
            if let Some(t) = g.tensor() {
                self.live_gathered -= g.bytes();
                self.empty_params(u, t.kind())?;
            }
            if let Gathered::Local(cast, _) = g {
                // NoShard's cast to the compute dtype: nothing views it any more (the
                // parameters are emptied, forward's graph dropped); the next gather, at once
                // after (`free_all` starts a forward), writes over it.
                if cast.kind() != self.shards[u].kind() {
                    self.retired[u] = Some(cast);
                }
            }
        }
        Ok(())
    }

    /// `FullShard` after a unit's forward: frees the memory of its gathered flat parameter but
    /// keeps the storage object, which forward's graph views, for [`gather`](Self::gather) to
    /// refill before the unit's backward (PyTorch's reshard: `storage().resize_(0)`).
    pub(super) fn release(&mut self, u: usize) -> Result<()> {
        if self.inflight.as_ref().is_some_and(|f| f.unit == u) {
            self.finish_prefetch()?;
        }
        let rank = self.shard_pg.rank();
        let kind = self.param_kind(u);
        if let Some(Gathered::Flat(storage)) = &mut self.gathered[u] {
            if storage.is_filled() {
                self.live_gathered -= storage.nbytes();
                storage.release(rank)?;
                self.empty_params(u, kind)?;
            }
        }
        Ok(())
    }

    /// Frees every unit and drops what the last forward kept for backward (a graph whose
    /// parameters are freed, or about to change, can no longer be backpropagated).
    pub(super) fn free_all(&mut self) -> Result<()> {
        self.finish_prefetch()?;
        self.saved.clear();
        self.output = None;
        for u in 0..self.units.len() {
            self.free(u)?;
        }
        Ok(())
    }
}
