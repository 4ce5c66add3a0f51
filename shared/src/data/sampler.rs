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
///
/// # Resuming an epoch at any world size
/// After `k` batches of `B` on each of `W` ranks, the samples consumed are exactly the first
/// `min(k·B·W, len)` entries of the epoch's list (`len = min(N, total_size)`, its samples
/// without the padding): batch `b` of rank `r` holds positions `(b·B + j)·W + r`. So the
/// position of an epoch is one number, `consumed`, counted over all ranks and independent of
/// `W` (as torchdata's `StatefulDistributedSampler` counts `yielded`). [`set_start`](Self::set_start)
/// resumes an epoch there at any world size `W'`: rank `r` takes positions `start + r`,
/// `start + r + W'`, … below `len` — the unseen samples, each exactly once, none twice, and no
/// padding (the ranks' shares differ by at most one sample). At the world size that wrote the
/// position, resuming instead skips the batches already run (the same order and padding as an
/// uninterrupted epoch, bit for bit); the levels choose between the two.
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
    /// Samples of the epoch's list consumed before this share begins (0: the whole epoch).
    start: usize,
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
        Ok(DistributedSampler { dataset_len, num_replicas, rank, shuffle, seed, drop_last, epoch: 0, num_samples, start: 0 })
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

    /// The distinct samples of an epoch's list: `min(N, total_size)` (the list without its
    /// padding; `total_size` with `drop_last`).
    pub fn epoch_len(&self) -> usize {
        self.dataset_len.min(self.total_size())
    }

    /// Samples of the epoch's list consumed after `batches` batches of `batch_size` on every
    /// rank, counted over all ranks from [`start`](Self::start): `min(start + batches ·
    /// batch_size · W, epoch_len)` (see the type's docs). What a checkpoint records.
    pub fn consumed_after(&self, batches: usize, batch_size: usize) -> usize {
        self.start.saturating_add(batches.saturating_mul(batch_size).saturating_mul(self.num_replicas)).min(self.epoch_len())
    }

    /// Resumes the epoch after its first `start` samples (counted over all ranks, as
    /// [`consumed_after`](Self::consumed_after) gives them): [`Sampler::indices`] then yields
    /// this rank's share of the rest, unpadded (see the type's docs). `0`, the default, is the
    /// whole epoch, padded as PyTorch pads it. Kept across [`Sampler::set_epoch`]; the caller
    /// sets it back to 0 for the next epoch. A `start` beyond [`epoch_len`](Self::epoch_len)
    /// leaves nothing to yield.
    pub fn set_start(&mut self, start: usize) {
        self.start = start;
    }

    /// Where this share of the epoch begins (see [`set_start`](Self::set_start)).
    pub fn start(&self) -> usize {
        self.start
    }

    /// The batches of at most `batch_size` every rank runs from [`start`](Self::start) (a
    /// trailing incomplete batch dropped with `drop_last_batch`, as `DataLoader(drop_last=…)`):
    /// `ceil(num_samples / batch_size)` for a whole epoch. Resumed at another world size, the
    /// ranks' shares of the rest differ by one sample at most, so they run the same number of
    /// batches as long as the last global batch holds at least one sample per rank.
    ///
    /// # Errors
    /// [`Error::UnevenResume`] when the rest of the epoch cannot be split that way (the last
    /// global batch would leave some rank without a sample): resume at another world size.
    pub fn num_batches(&self, batch_size: usize, drop_last_batch: bool) -> Result<usize> {
        let b = batch_size.max(1);
        if self.start == 0 {
            return Ok(if drop_last_batch { self.num_samples / b } else { self.num_samples.div_ceil(b) });
        }
        let w = self.num_replicas;
        let remaining = self.epoch_len().saturating_sub(self.start);
        let (most, least) = (remaining.div_ceil(w), remaining / w);
        if drop_last_batch {
            return Ok(least / b);
        }
        let n = most.div_ceil(b);
        if least.div_ceil(b) != n {
            return Err(Error::UnevenResume { remaining, world_size: w, batch_size: b, last_batch: remaining - (n - 1) * b * w });
        }
        Ok(n)
    }
}

impl Sampler for DistributedSampler {
    fn indices(&self) -> Vec<usize> {
        let n = self.dataset_len;
        if n == 0 {
            return Vec::new();
        }
        let base: Vec<usize> = if self.shuffle { permutation(n, self.seed, self.epoch) } else { (0..n).collect() };
        if self.start > 0 {
            // The rest of the epoch, unpadded: positions start + r, start + r + W, … below len.
            return (self.start + self.rank..self.epoch_len()).step_by(self.num_replicas).map(|i| base[i]).collect();
        }
        // Position i of the padded (or cut) list is base[i % n]: padding repeats from the start.
        (self.rank..self.total_size()).step_by(self.num_replicas).map(|i| base[i % n]).collect()
    }
    fn len(&self) -> usize {
        if self.start == 0 {
            return self.num_samples;
        }
        let first = self.start + self.rank;
        self.epoch_len().saturating_sub(first).div_ceil(self.num_replicas)
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

    /// The rule: whatever the world sizes, the consumed prefix and the resumed shares cover the
    /// epoch's distinct samples exactly once, and every rank runs as many batches.
    #[test]
    fn resuming_at_another_world_size_trains_each_unseen_sample_once() {
        let options = DistributedSamplerOptions { seed: 7, ..Default::default() };
        for (n, b) in [(52usize, 4usize), (60, 5), (61, 3)] {
            let whole: Vec<usize> = permutation(n, 7, 2);
            for w in 1..=4 {
                for k in 0..3 {
                    let writer = DistributedSampler::new(n, w, 0, options).unwrap();
                    let consumed = writer.consumed_after(k, b);
                    // What the W ranks ran: batches 0..k of each share.
                    let mut seen: Vec<usize> = (0..w)
                        .flat_map(|r| {
                            let mut s = DistributedSampler::new(n, w, r, options).unwrap();
                            s.set_epoch(2);
                            s.indices().into_iter().take(k * b).collect::<Vec<_>>()
                        })
                        .collect();
                    seen.sort_unstable();
                    let mut prefix = whole[..consumed].to_vec();
                    prefix.sort_unstable();
                    assert_eq!(seen, prefix, "n {n} b {b} w {w} k {k}: the consumed samples are the list's prefix");
                    if consumed == 0 {
                        continue; // Nothing consumed: an ordinary (padded) epoch at any size.
                    }
                    for w2 in 1..=4 {
                        let shares: Vec<DistributedSampler> = (0..w2)
                            .map(|r| {
                                let mut s = DistributedSampler::new(n, w2, r, options).unwrap();
                                s.set_epoch(2);
                                s.set_start(consumed);
                                s
                            })
                            .collect();
                        let mut rest: Vec<usize> = shares.iter().flat_map(|s| s.indices()).collect();
                        assert!(shares.iter().all(|s| s.len() == s.indices().len()));
                        rest.extend(&prefix);
                        rest.sort_unstable();
                        assert_eq!(rest, (0..n).collect::<Vec<_>>(), "n {n} w {w}->{w2} k {k}: each sample exactly once");
                        match shares[0].num_batches(b, false) {
                            Ok(nb) => {
                                for s in &shares {
                                    assert_eq!(s.len().div_ceil(b), nb, "n {n} w {w}->{w2} k {k}: lockstep");
                                    assert!(nb == 0 || s.len() > (nb - 1) * b, "n {n} w {w}->{w2} k {k}: no empty last batch");
                                }
                            }
                            Err(e) => assert!(matches!(e, Error::UnevenResume { .. }) && k > 0),
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn an_uneven_rest_is_refused_by_name() {
        // 52 samples, 24 consumed at W=2 (3 batches of 4): 28 left. At W=3, batches of 4: the
        // last global batch holds 28 - 2·12 = 4 ≥ 3 samples; with 26 left (26 consumed) it
        // would hold 2.
        let mut s = DistributedSampler::new(52, 3, 2, DistributedSamplerOptions::default()).unwrap();
        s.set_start(24);
        assert_eq!((s.num_batches(4, false).unwrap(), s.len()), (3, 9));
        s.set_start(26);
        let err = s.num_batches(4, false).unwrap_err().to_string();
        assert!(err.contains("26 unseen samples") && err.contains("3 ranks"), "{err}");
        assert_eq!(s.num_batches(4, true).unwrap(), 2);
    }

    #[test]
    fn eval_shard_examples() {
        assert_eq!((0..3).map(|r| eval_shard(10, r, 3)).collect::<Vec<_>>(), [0..4, 4..7, 7..10]);
        assert_eq!(eval_shard(10, 3, 3), 10..10);
        assert_eq!(eval_shard(10, 0, 0), 10..10);
        assert_eq!(eval_shard(2, 2, 3), 2..2);
    }
}
