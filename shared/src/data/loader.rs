//! Mini-batches over a [`Dataset`], as `torch.utils.data.DataLoader(dataset, batch_size,
//! sampler=..., drop_last=...)` with `num_workers=0`: the samples are already decoded and
//! normalised in memory, so a batch is one `index_select`.

use tch::Tensor;

use super::mnist::Dataset;
use super::sampler::{RandomSampler, Sampler, SequentialSampler};
use crate::{Error, Result};

/// Batches of `(images [b, 1, 28, 28] f32, labels [b] i64)` in the order a [`Sampler`] gives.
pub struct DataLoader<'a> {
    dataset: &'a Dataset,
    batch_size: usize,
    sampler: Box<dyn Sampler + 'a>,
    drop_last: bool,
}

impl std::fmt::Debug for DataLoader<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataLoader")
            .field("dataset_len", &self.dataset.len())
            .field("batch_size", &self.batch_size)
            .field("sampler_len", &self.sampler.len())
            .field("drop_last", &self.drop_last)
            .finish()
    }
}

impl<'a> DataLoader<'a> {
    /// Batches of `batch_size` samples of `dataset` in `sampler`'s order; the last, partial batch
    /// is kept (see [`DataLoader::drop_last`]).
    ///
    /// # Errors
    /// [`Error::InvalidValue`] when `batch_size` is 0, or when the sampler yields an index outside
    /// `0..dataset.len()` (e.g. a sampler built for another dataset).
    pub fn new(dataset: &'a Dataset, batch_size: usize, sampler: Box<dyn Sampler + 'a>) -> Result<Self> {
        if batch_size == 0 {
            return Err(Error::invalid("batch_size", 0, "a positive number of samples per batch"));
        }
        let n = dataset.len();
        if let Some(&bad) = sampler.indices().iter().find(|&&i| i >= n) {
            return Err(Error::invalid(
                "sampler",
                format!("index {bad}"),
                format!("indices in 0..{n}, the dataset's length (was the sampler built for another dataset?)"),
            ));
        }
        Ok(DataLoader { dataset, batch_size, sampler, drop_last: false })
    }

    /// A loader that reshuffles every epoch ([`RandomSampler`] seeded by `seed + epoch`), as
    /// `DataLoader(dataset, batch_size, shuffle=True)`.
    ///
    /// # Errors
    /// [`Error::InvalidValue`] when `batch_size` is 0.
    pub fn shuffled(dataset: &'a Dataset, batch_size: usize, seed: u64) -> Result<Self> {
        Self::new(dataset, batch_size, Box::new(RandomSampler::new(dataset.len(), seed)))
    }

    /// A loader in index order ([`SequentialSampler`]), as `DataLoader(dataset, batch_size)`.
    ///
    /// # Errors
    /// [`Error::InvalidValue`] when `batch_size` is 0.
    pub fn sequential(dataset: &'a Dataset, batch_size: usize) -> Result<Self> {
        Self::new(dataset, batch_size, Box::new(SequentialSampler::new(dataset.len())))
    }

    /// Whether to drop the last batch when it holds fewer than `batch_size` samples (default
    /// `false`, as PyTorch).
    pub fn drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// Selects the epoch (forwarded to the sampler): call it before each epoch's [`iter`] so that
    /// shuffling samplers draw a new order, as `DistributedSampler.set_epoch`.
    ///
    /// [`iter`]: DataLoader::iter
    pub fn set_epoch(&mut self, epoch: u64) {
        self.sampler.set_epoch(epoch);
    }

    /// Samples per batch.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }

    /// Batches per epoch: `ceil(num_indices / batch_size)`, or `floor(...)` with `drop_last`.
    pub fn len(&self) -> usize {
        let n = self.sampler.len();
        if self.drop_last {
            n / self.batch_size
        } else {
            n.div_ceil(self.batch_size)
        }
    }

    /// Whether an epoch yields no batch.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Samples one epoch yields, over all its batches: the sampler's length, less the dropped
    /// partial batch with `drop_last`.
    pub fn num_samples(&self) -> usize {
        let n = self.sampler.len();
        if self.drop_last {
            n - n % self.batch_size
        } else {
            n
        }
    }

    /// One epoch's batches: `(images [b, 1, 28, 28] f32, labels [b] i64)` on the dataset's device,
    /// `b = batch_size` except perhaps for the last batch. The order is drawn once when `iter` is
    /// called.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (Tensor, Tensor)> + '_ {
        let order = self.dataset.epoch_order(self.sampler.indices().into_iter().map(|i| i as i64).collect());
        let batches = self.len();
        let bs = self.batch_size;
        (0..batches).map(move |b| {
            let end = ((b + 1) * bs).min(order.len());
            self.dataset.batch_in(&order, b * bs..end)
        })
    }
}
