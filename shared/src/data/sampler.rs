//! Index samplers, as `torch.utils.data.{SequentialSampler, RandomSampler, DistributedSampler}`,
//! and [`eval_shard`] for exact distributed evaluation.
//!
//! Shuffles use ChaCha8 seeded with `seed + epoch` (wrapping): reproducible on every platform, but
//! not the same permutation as torch's `randperm`.

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::{Error, Result};

/// The order in which a [`super::DataLoader`] visits a dataset's indices, epoch by epoch.
pub trait Sampler: Send {
    /// This epoch's indices, in order (for this rank, where distributed).
    fn indices(&self) -> Vec<usize>;
    /// The number of indices per epoch; always `indices().len()`.
    fn len(&self) -> usize;
    /// Whether an epoch yields no indices.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Selects the epoch; samplers that shuffle draw a new order for each epoch.
    fn set_epoch(&mut self, epoch: u64);
}

/// A permutation of `0..n` drawn from ChaCha8 seeded with `seed + epoch` (wrapping).
fn permutation(n: usize, seed: u64, epoch: u64) -> Vec<usize> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed.wrapping_add(epoch));
    let mut v: Vec<usize> = (0..n).collect();
    v.shuffle(&mut rng);
    v
}

/// `0..len` in order, every epoch (as `torch.utils.data.SequentialSampler`).
#[derive(Debug, Clone)]
pub struct SequentialSampler {
    len: usize,
}

impl SequentialSampler {
    /// A sampler over `0..len`.
    pub fn new(len: usize) -> Self {
        SequentialSampler { len }
    }
}

impl Sampler for SequentialSampler {
    fn indices(&self) -> Vec<usize> {
        (0..self.len).collect()
    }
    fn len(&self) -> usize {
        self.len
    }
    fn set_epoch(&mut self, _epoch: u64) {}
}

/// A permutation of `0..len` without replacement, a different one each epoch, determined by
/// `seed + epoch` (as `torch.utils.data.RandomSampler` with a seeded generator).
#[derive(Debug, Clone)]
pub struct RandomSampler {
    len: usize,
    seed: u64,
    epoch: u64,
}

impl RandomSampler {
    /// A sampler over `0..len`, at epoch 0.
    pub fn new(len: usize, seed: u64) -> Self {
        RandomSampler { len, seed, epoch: 0 }
    }
}

impl Sampler for RandomSampler {
    fn indices(&self) -> Vec<usize> {
        permutation(self.len, self.seed, self.epoch)
    }
    fn len(&self) -> usize {
        self.len
    }
    fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }
}

/// The keyword arguments of `torch.utils.data.DistributedSampler` beside the dataset and the
/// ranks, with PyTorch's defaults (`shuffle=True, seed=0, drop_last=False`):
/// `DistributedSamplerOptions { seed: 1, ..Default::default() }`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DistributedSamplerOptions {
    /// Shuffle the indices every epoch (by `seed + epoch`); else `0..N` in order.
    pub shuffle: bool,
    /// The shuffle's seed; every rank must use the same.
    pub seed: u64,
    /// Cut the indices to a multiple of the world size instead of padding them by repetition.
    pub drop_last: bool,
}

impl Default for DistributedSamplerOptions {
    fn default() -> Self {
        Self { shuffle: true, seed: 0, drop_last: false }
    }
}

/// Each rank's share of a dataset, as `torch.utils.data.DistributedSampler`.
///
/// Per epoch: the indices `0..N` (shuffled by `seed + epoch` when `shuffle`); without `drop_last`
/// they are padded by repeating from the start (the whole list as often as needed) up to
/// `total_size = W * ceil(N / W)`; with `drop_last` they are cut to `total_size = W * floor(N / W)`.
/// Rank `r` takes `indices[r..total_size]` with step `W`, so every rank gets `num_samples =
/// total_size / W` indices and the ranks' shares are disjoint (but for the padding). All ranks
/// must use the same `seed` and call [`Sampler::set_epoch`] with the same epoch.
#[derive(Debug, Clone)]
pub struct DistributedSampler {
    dataset_len: usize,
    num_replicas: usize,
    rank: usize,
    shuffle: bool,
    seed: u64,
    drop_last: bool,
    epoch: u64,
    num_samples: usize,
}

impl DistributedSampler {
    /// A sampler for `rank` of `num_replicas` over a dataset of `dataset_len` samples, at epoch 0
    /// (`DistributedSampler(dataset, num_replicas, rank, shuffle, seed, drop_last)`; the options'
    /// defaults are PyTorch's).
    ///
    /// # Errors
    /// [`Error::InvalidValue`] when `num_replicas` is 0; [`Error::RankOutOfRange`] when
    /// `rank >= num_replicas`.
    pub fn new(dataset_len: usize, num_replicas: usize, rank: usize, options: DistributedSamplerOptions) -> Result<Self> {
        let DistributedSamplerOptions { shuffle, seed, drop_last } = options;
        if num_replicas == 0 {
            return Err(Error::invalid("num_replicas", 0, "at least 1 (the world size)"));
        }
        if rank >= num_replicas {
            return Err(Error::RankOutOfRange { op: "DistributedSampler::new", rank, world_size: num_replicas });
        }
        let num_samples = if drop_last {
            // torch: ceil((N - W) / W) when N % W != 0, else N / W; both are floor(N / W).
            dataset_len / num_replicas
        } else {
            dataset_len.div_ceil(num_replicas)
        };
        Ok(DistributedSampler { dataset_len, num_replicas, rank, shuffle, seed, drop_last, epoch: 0, num_samples })
    }

    /// Indices per rank and epoch.
    pub fn num_samples(&self) -> usize {
        self.num_samples
    }

    /// Indices over all ranks per epoch, padding included: `num_samples * num_replicas`.
    pub fn total_size(&self) -> usize {
        self.num_samples * self.num_replicas
    }

    /// How many indices are repeated to pad the epoch (0 with `drop_last`).
    pub fn padding(&self) -> usize {
        self.total_size().saturating_sub(self.dataset_len)
    }

    /// Whether `drop_last` was asked for.
    pub fn drop_last(&self) -> bool {
        self.drop_last
    }
}

impl Sampler for DistributedSampler {
    fn indices(&self) -> Vec<usize> {
        let n = self.dataset_len;
        if n == 0 {
            return Vec::new();
        }
        let base: Vec<usize> = if self.shuffle { permutation(n, self.seed, self.epoch) } else { (0..n).collect() };
        // Position i of the padded (or cut) list is base[i % n]: padding repeats from the start.
        (self.rank..self.total_size()).step_by(self.num_replicas).map(|i| base[i % n]).collect()
    }
    fn len(&self) -> usize {
        self.num_samples
    }
    fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }
}

/// The contiguous, unpadded slice of `0..n` that `rank` evaluates when `world_size` ranks split
/// `n` samples: the slices of ranks `0..world_size` are disjoint, in order, cover `0..n` exactly,
/// and their sizes differ by at most one (the first `n % world_size` ranks get one more). Use it
/// with [`super::Dataset::slice`] so that evaluation counts every sample exactly once (10,000, not
/// 10,002), unlike a padded [`DistributedSampler`].
///
/// Gives the empty range `n..n` when `world_size == 0` or `rank >= world_size`.
pub fn eval_shard(n: usize, rank: usize, world_size: usize) -> std::ops::Range<usize> {
    if world_size == 0 || rank >= world_size {
        return n..n;
    }
    let (base, rem) = (n / world_size, n % world_size);
    let start = rank * base + rank.min(rem);
    start..start + base + usize::from(rank < rem)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torch_example_n10_w3() {
        // torch: DistributedSampler(range(10), 3, r, shuffle=False) -> [0,3,6,9] [1,4,7,0] [2,5,8,1]
        let got: Vec<Vec<usize>> = (0..3)
            .map(|r| {
                DistributedSampler::new(10, 3, r, DistributedSamplerOptions { shuffle: false, ..Default::default() }).unwrap().indices()
            })
            .collect();
        assert_eq!(got, [vec![0, 3, 6, 9], vec![1, 4, 7, 0], vec![2, 5, 8, 1]]);
        // drop_last: [0,3,6] [1,4,7] [2,5,8]
        let got: Vec<Vec<usize>> = (0..3)
            .map(|r| {
                DistributedSampler::new(10, 3, r, DistributedSamplerOptions { shuffle: false, drop_last: true, ..Default::default() })
                    .unwrap()
                    .indices()
            })
            .collect();
        assert_eq!(got, [vec![0, 3, 6], vec![1, 4, 7], vec![2, 5, 8]]);
    }

    #[test]
    fn padding_repeats_the_whole_list_when_world_exceeds_n() {
        // N=2, W=5: total 5, list [0,1,0,1,0].
        let got: Vec<usize> = (0..5)
            .flat_map(|r| {
                DistributedSampler::new(2, 5, r, DistributedSamplerOptions { shuffle: false, ..Default::default() }).unwrap().indices()
            })
            .collect();
        assert_eq!(got, [0, 1, 0, 1, 0]);
        let s =
            DistributedSampler::new(2, 5, 4, DistributedSamplerOptions { shuffle: false, drop_last: true, ..Default::default() }).unwrap();
        assert_eq!((s.num_samples(), s.total_size(), s.indices()), (0, 0, vec![]));
        assert!(DistributedSampler::new(0, 2, 1, DistributedSamplerOptions::default()).unwrap().indices().is_empty());
    }

    #[test]
    fn eval_shard_examples() {
        assert_eq!((0..3).map(|r| eval_shard(10, r, 3)).collect::<Vec<_>>(), [0..4, 4..7, 7..10]);
        assert_eq!(eval_shard(10, 3, 3), 10..10);
        assert_eq!(eval_shard(10, 0, 0), 10..10);
        assert_eq!(eval_shard(2, 2, 3), 2..2);
    }
}
