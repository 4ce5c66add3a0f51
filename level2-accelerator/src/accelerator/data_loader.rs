//! Prepared data loaders: each process's shard of every epoch (a `DistributedSampler`), on the
//! device, with the epoch advanced by itself and its position in the run's state.

use super::state::{BatchPosition, Shared};
use super::Accelerator;
use crate::{Error, Result};
use ladder_core::data::{Dataset, DistributedSampler, DistributedSamplerOptions, Sampler};
use ladder_core::recipe::seed_batch;
use serde::{Deserialize, Serialize};
use std::rc::Rc;
use tch::Tensor;

/// The loader to prepare, with the arguments of `torch.utils.data.DataLoader(dataset,
/// batch_size=1, shuffle=False, drop_last=False)` and their defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataLoaderOptions {
    /// Samples per batch: per process, or global and split between the processes with
    /// `split_batches`. Default 1.
    pub batch_size: usize,
    /// Reshuffle the samples every epoch (seeded by the seed and the epoch). A shuffled loader
    /// is a training loader: its position is saved by `save_state`, and each of its batches
    /// seeds dropout from (seed, rank, batch index). Default false.
    pub shuffle: bool,
    /// Drop each epoch's last, incomplete batch; every process drops alike, so they still run
    /// the same number of batches. Default false.
    pub drop_last: bool,
}

impl Default for DataLoaderOptions {
    fn default() -> Self {
        DataLoaderOptions { batch_size: 1, shuffle: false, drop_last: false }
    }
}

impl Accelerator {
    /// A loader over `dataset` sharded across processes with a `DistributedSampler` (padded so
    /// every process gets the same number of batches, as `even_batches=True`), on this device,
    /// as `accelerator.prepare(DataLoader(dataset, batch_size=…, shuffle=…))`. Its epoch
    /// advances on every `iter()` (no `set_epoch` to forget).
    ///
    /// # Errors
    /// A zero batch size; with `split_batches`, a batch size the process count does not divide;
    /// for a training loader, processes that would run different numbers of batches.
    pub fn prepare_data_loader<'d>(&self, dataset: &'d Dataset, options: DataLoaderOptions) -> Result<AcceleratedDataLoader<'d>> {
        let DataLoaderOptions { batch_size, shuffle, drop_last } = options;
        let shared = &self.shared;
        let (rank, w) = (shared.pg.rank(), shared.pg.world_size());
        if batch_size == 0 {
            return Err(ladder_core::Error::invalid("batch_size", 0, "a positive number of samples per batch").into());
        }
        let per_process = if self.config.split_batches {
            if batch_size % w != 0 {
                return Err(Error::Conflict {
                    first: format!("split_batches=true ({})", self.config.describe_source("split_batches")),
                    second: format!("batch_size {batch_size}"),
                    why: format!("the global batch of {batch_size} cannot be split evenly between {w} processes; use a multiple of {w}"),
                });
            }
            batch_size / w
        } else {
            batch_size
        };
        let seed = shared.state.borrow().gradient.seed;
        let sampler = DistributedSampler::new(dataset.len(), w, rank, DistributedSamplerOptions { shuffle, seed, drop_last: false })?;
        let id = shared.state.borrow_mut().gradient.add_loader(shuffle, sampler.clone(), per_process, drop_last);
        let data = if dataset.device() == shared.device { dataset.shallow_clone() } else { dataset.to_device(shared.device) };
        if shuffle {
            // Every process must run as many training batches (one tiny collective).
            ladder_core::recipe::check_batch_counts(shared.pg, sampler.num_samples().div_ceil(per_process))?;
        }
        Ok(AcceleratedDataLoader {
            data,
            batch_size: per_process,
            sampler,
            training: shuffle,
            id,
            shared: shared.clone(),
            _d: std::marker::PhantomData,
        })
    }

    /// A loader like `loader` whose next epoch skips its first `num_batches` batches (to resume
    /// mid-epoch, as Accelerate's `skip_first_batches`). The epoch count is shared with
    /// `loader`.
    pub fn skip_first_batches<'d>(&self, loader: &AcceleratedDataLoader<'d>, num_batches: usize) -> AcceleratedDataLoader<'d> {
        self.shared.state.borrow_mut().gradient.skip_first_batches(loader.id, num_batches);
        AcceleratedDataLoader {
            data: loader.data.shallow_clone(),
            sampler: loader.sampler.clone(),
            shared: loader.shared.clone(),
            ..*loader
        }
    }
}

/// A loader prepared by [`Accelerator::prepare_data_loader`]: this process's shard of every
/// epoch, in batches of `[b, 1, 28, 28]` f32 images and `[b]` i64 labels on the device.
#[derive(Debug)]
pub struct AcceleratedDataLoader<'d> {
    data: Dataset,
    batch_size: usize,
    sampler: DistributedSampler,
    training: bool,
    /// Its position's slot in the run's state.
    id: usize,
    shared: Rc<Shared>,
    _d: std::marker::PhantomData<&'d Dataset>,
}

impl AcceleratedDataLoader<'_> {
    /// Batches per epoch on each process: of the epoch in progress, or else of the next one
    /// (the rest of an epoch resumed at another world size has fewer; see `load_state`).
    pub fn len(&self) -> usize {
        // load_state refused a start that cannot be split evenly; 0 batches on every process
        // otherwise (the same count everywhere: no process waits for another).
        self.shared.state.borrow().gradient.loader(self.id).num_batches(self.epoch_start()).unwrap_or(0)
    }

    /// Samples of this process in the epoch in progress, or else the next one (padding
    /// included): [`num_samples`](Self::num_samples), but for the rest of an epoch resumed at
    /// another world size, where the processes' shares differ by one sample at most.
    pub fn epoch_num_samples(&self) -> usize {
        let mut sampler = self.sampler.clone();
        sampler.set_start(self.epoch_start());
        sampler.len()
    }

    /// Where the share of the epoch in progress (or else the next) begins.
    fn epoch_start(&self) -> usize {
        let state = self.shared.state.borrow();
        let l = state.gradient.loader(self.id);
        l.in_progress.map_or(l.start, |(_, start, _)| start)
    }

    /// True when an epoch has no batch.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Samples per epoch on each process (padding included).
    pub fn num_samples(&self) -> usize {
        self.sampler.len()
    }

    /// Samples per batch on each process.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// Samples in the dataset.
    pub fn dataset_len(&self) -> usize {
        self.data.len()
    }

    /// Sets the epoch the next `iter()` runs (as `DistributedSampler.set_epoch`; the loader
    /// advances it by itself otherwise).
    pub fn set_epoch(&self, epoch: u64) {
        self.shared.state.borrow_mut().gradient.set_epoch(self.id, epoch);
    }

    /// One epoch: the shuffle of the epoch (seeded by (seed, epoch)), this process's share,
    /// in batches. The next call runs the next epoch. After `load_state`, the first epoch is
    /// the rest of the interrupted one (`DistributedSampler`'s rule at another world size).
    pub fn iter(&self) -> impl Iterator<Item = (Tensor, Tensor)> + '_ {
        let (epoch, start, skip) = self.shared.state.borrow_mut().gradient.start_epoch(self.id);
        let n_batches = self.shared.state.borrow().gradient.loader(self.id).num_batches(start).unwrap_or(0);
        let mut sampler = self.sampler.clone();
        sampler.set_epoch(epoch);
        sampler.set_start(start);
        let indices = self.data.epoch_order(sampler.indices().into_iter().map(|i| i as i64).collect());
        let bs = self.batch_size;
        if self.training {
            self.shared.resume_clock(true);
        }
        let rank = self.shared.pg.rank();
        (skip..n_batches).map(move |b| {
            let end = ((b + 1) * bs).min(indices.len());
            let pos =
                BatchPosition { index: b, num_batches: n_batches, local_start: b * bs, len: end - b * bs, dataset_len: self.data.len() };
            let seen = {
                let mut state = self.shared.state.borrow_mut();
                state.gradient.hand_out(self.id, epoch, pos).map(|seen| (state.gradient.seed, seen))
            };
            if let Some((seed, seen)) = seen {
                seed_batch(seed, rank, seen);
                ladder_core::dist::progress::set_step(seen + 1);
            }
            let batch = self.data.batch_in(&indices, b * bs..end);
            if self.training {
                self.shared.data_ready((end - b * bs) as u64);
            }
            batch
        })
    }
}
