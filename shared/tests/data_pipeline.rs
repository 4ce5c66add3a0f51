//! The real MNIST files (the workspace's data/mnist) through the whole pipeline: facts about the
//! data, the normalisation, the loader and the samplers.

use std::collections::HashSet;
use std::sync::{Mutex, MutexGuard, OnceLock};

use ladder_core::data::{
    eval_shard, mnist::workspace_data_dir, DataLoader, Dataset, DistributedSampler, DistributedSamplerOptions, Mnist, RandomSampler,
    Sampler, SequentialSampler,
};
use ladder_core::Error;
use tch::{Kind, Tensor};

/// MNIST loaded once per test binary (`Tensor` is `Send` but not `Sync`, hence the mutex).
fn mnist() -> MutexGuard<'static, Mnist> {
    static MNIST: OnceLock<Mutex<Mnist>> = OnceLock::new();
    MNIST
        .get_or_init(|| Mutex::new(Mnist::load(&workspace_data_dir()).expect("workspace MNIST loads")))
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

fn labels_vec(t: &Tensor) -> Vec<i64> {
    Vec::<i64>::try_from(t).unwrap()
}

#[test]
fn mnist_facts() {
    let m = mnist();
    assert_eq!((m.train.len(), m.test.len()), (60_000, 10_000));
    assert_eq!(m.train.images().size(), [60_000, 1, 28, 28]);
    assert_eq!(m.test.images().size(), [10_000, 1, 28, 28]);
    assert_eq!((m.train.images().kind(), m.train.labels.kind()), (Kind::Float, Kind::Int64));
    assert_eq!(labels_vec(&m.train.labels.narrow(0, 0, 10)), [5, 0, 4, 1, 9, 2, 1, 3, 1, 4]);
    assert_eq!(labels_vec(&m.test.labels.narrow(0, 0, 10)), [7, 2, 1, 0, 4, 1, 4, 9, 5, 9]);
    let counts = |d: &Dataset| labels_vec(&d.labels.bincount(None::<Tensor>, 10));
    assert_eq!(counts(&m.train), [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]);
    assert_eq!(counts(&m.test), [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]);
    let x = m.train.images().to_kind(Kind::Double);
    let (mean, std) = (x.mean(Kind::Double).double_value(&[]), x.std(true).double_value(&[]));
    assert!(mean.abs() < 1e-3, "normalised train mean {mean}");
    assert!((std - 1.0).abs() < 1e-3, "normalised train std {std}");
    // Background pixels map to exactly -0.1307/0.3081 (f32), the brightest to (1-0.1307)/0.3081.
    let (lo, hi) = (m.train.images().min().double_value(&[]), m.train.images().max().double_value(&[]));
    assert!((lo + 0.1307 / 0.3081).abs() < 1e-6 && (hi - 0.8693 / 0.3081).abs() < 1e-6, "{lo} {hi}");
}

#[test]
fn loads_raw_files_as_well_as_gz() {
    // The raw name is preferred over .gz; here only raw test files and gz train files exist.
    let dir = tempfile::tempdir().unwrap();
    for name in ["t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"] {
        let raw = ladder_core::data::idx::read_maybe_gz(&workspace_data_dir().join(format!("{name}.gz"))).unwrap();
        std::fs::write(dir.path().join(name), raw).unwrap();
    }
    for name in ["train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"] {
        std::fs::copy(workspace_data_dir().join(name), dir.path().join(name)).unwrap();
    }
    let loaded = Mnist::load(dir.path()).unwrap();
    let m = mnist();
    assert!(loaded.test.images().equal(&m.test.images()) && loaded.test.labels.equal(&m.test.labels));
    assert_eq!(loaded.train.len(), 60_000);
}

#[test]
fn loader_batches_cover_the_train_set_once() {
    let m = mnist();
    let loader = DataLoader::sequential(&m.train, 64).unwrap();
    assert_eq!((loader.len(), loader.num_samples()), (938, 60_000));
    let mut sizes = Vec::new();
    let mut first = None;
    for (x, y) in loader.iter() {
        assert_eq!(x.size()[1..], [1, 28, 28]);
        assert_eq!((x.kind(), y.kind()), (Kind::Float, Kind::Int64));
        assert_eq!(x.size()[0], y.size()[0]);
        first.get_or_insert(labels_vec(&y.narrow(0, 0, 10)));
        sizes.push(y.size()[0]);
    }
    assert_eq!(sizes.len(), 938);
    assert!(sizes[..937].iter().all(|&s| s == 64));
    assert_eq!(sizes[937], 32);
    assert_eq!(first.unwrap(), [5, 0, 4, 1, 9, 2, 1, 3, 1, 4]);

    let dropped = DataLoader::sequential(&m.train, 64).unwrap().drop_last(true);
    assert_eq!((dropped.len(), dropped.num_samples(), dropped.iter().count()), (937, 59_968, 937));
}

#[test]
fn shuffled_loader_visits_each_index_once_and_reshuffles_per_epoch() {
    // Labels 0..N make the batches' labels the visited indices.
    let n = 1000usize;
    let ds = Dataset::from_tensors(
        Tensor::zeros([n as i64, 1, 28, 28], (Kind::Float, tch::Device::Cpu)),
        Tensor::arange(n as i64, (Kind::Int64, tch::Device::Cpu)),
    )
    .unwrap();
    let epoch = |loader: &DataLoader| -> Vec<i64> { loader.iter().flat_map(|(_, y)| labels_vec(&y)).collect() };
    let mut a = DataLoader::shuffled(&ds, 64, 7).unwrap();
    let e0 = epoch(&a);
    let mut sorted = e0.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, (0..n as i64).collect::<Vec<_>>(), "every index exactly once");
    assert_ne!(e0, (0..n as i64).collect::<Vec<_>>(), "shuffled");
    assert_eq!(epoch(&a), e0, "same epoch, same order");
    a.set_epoch(1);
    let e1 = epoch(&a);
    assert_ne!(e1, e0, "a new order for epoch 1");
    let mut b = DataLoader::shuffled(&ds, 64, 7).unwrap();
    b.set_epoch(1);
    assert_eq!(epoch(&b), e1, "same seed and epoch, same order");
    assert_ne!(epoch(&DataLoader::shuffled(&ds, 64, 8).unwrap()), e0, "another seed, another order");
}

#[test]
fn loader_rejects_zero_batch_and_foreign_sampler() {
    let ds = Dataset::from_tensors(
        Tensor::zeros([10, 1, 28, 28], (Kind::Float, tch::Device::Cpu)),
        Tensor::zeros([10], (Kind::Int64, tch::Device::Cpu)),
    )
    .unwrap();
    assert!(matches!(DataLoader::sequential(&ds, 0), Err(Error::InvalidValue { .. })));
    let err = DataLoader::new(&ds, 4, Box::new(SequentialSampler::new(11))).unwrap_err();
    assert!(err.to_string().contains("index 10"), "{err}");
}

#[test]
fn distributed_loader_world3_on_train() {
    let m = mnist();
    let mut seen = HashSet::new();
    for rank in 0..3 {
        let s = DistributedSampler::new(60_000, 3, rank, DistributedSamplerOptions::default()).unwrap();
        assert_eq!((s.num_samples(), s.total_size()), (20_000, 60_000));
        seen.extend(s.indices());
        let loader = DataLoader::new(&m.train, 64, Box::new(s)).unwrap();
        assert_eq!(loader.len(), 313);
        let last = loader.iter().last().unwrap();
        assert_eq!(last.0.size(), [32, 1, 28, 28]);
    }
    assert_eq!(seen.len(), 60_000);
}

/// Every rank's indices for one epoch.
fn shares(n: usize, w: usize, shuffle: bool, seed: u64, drop_last: bool, epoch: u64) -> Vec<Vec<usize>> {
    (0..w)
        .map(|r| {
            let mut s = DistributedSampler::new(n, w, r, DistributedSamplerOptions { shuffle, seed, drop_last }).unwrap();
            s.set_epoch(epoch);
            let idx = s.indices();
            assert_eq!(idx.len(), s.len());
            assert_eq!(s.len(), s.num_samples());
            idx
        })
        .collect()
}

#[test]
fn distributed_sampler_disjoint_covering_and_padding() {
    for n in [10usize, 60_000] {
        for w in [2usize, 3] {
            for shuffle in [false, true] {
                let all: Vec<usize> = shares(n, w, shuffle, 0, false, 0).concat();
                let total = w * n.div_ceil(w);
                assert_eq!(all.len(), total);
                let distinct: HashSet<usize> = all.iter().copied().collect();
                assert_eq!(distinct, (0..n).collect(), "n={n} w={w}: covers 0..n");
                // Exactly total - n indices repeat (the padding), and nothing else does.
                assert_eq!(all.len() - distinct.len(), total - n, "n={n} w={w}");
                let padding =
                    DistributedSampler::new(n, w, 0, DistributedSamplerOptions { shuffle, ..Default::default() }).unwrap().padding();
                assert_eq!(padding, total - n);

                let dropped = shares(n, w, shuffle, 0, true, 0);
                let all: Vec<usize> = dropped.concat();
                assert!(dropped.iter().all(|s| s.len() == n / w), "drop_last: floor(n/w) each");
                assert_eq!(all.iter().copied().collect::<HashSet<_>>().len(), all.len(), "disjoint");
            }
        }
    }
    // N=10, W=3: 4 per rank, 2 padded (indices 0 and 1 again in torch's order).
    assert_eq!(shares(10, 3, false, 0, false, 0), [vec![0, 3, 6, 9], vec![1, 4, 7, 0], vec![2, 5, 8, 1]]);
    // N=10, W=4 drop_last: ceil((10-4)/4) = 2 per rank, total 8.
    let s = DistributedSampler::new(10, 4, 3, DistributedSamplerOptions { shuffle: false, drop_last: true, ..Default::default() }).unwrap();
    assert_eq!((s.num_samples(), s.total_size(), s.indices()), (2, 8, vec![3, 7]));
}

#[test]
fn distributed_sampler_epochs_and_seeds() {
    let e0 = shares(1000, 2, true, 5, false, 0);
    assert_eq!(shares(1000, 2, true, 5, false, 0), e0, "same seed, same order");
    assert_ne!(shares(1000, 2, true, 5, false, 1), e0, "set_epoch changes the order");
    assert_ne!(shares(1000, 2, true, 6, false, 0), e0, "another seed, another order");
    // Unshuffled: the epoch does not matter.
    assert_eq!(shares(1000, 2, false, 5, false, 3), shares(1000, 2, false, 9, false, 0));
    // seed + epoch decides, as torch: (seed 5, epoch 1) == (seed 6, epoch 0).
    assert_eq!(shares(1000, 2, true, 5, false, 1), shares(1000, 2, true, 6, false, 0));
}

#[test]
fn distributed_sampler_errors() {
    let err = DistributedSampler::new(10, 2, 2, DistributedSamplerOptions::default()).unwrap_err();
    assert!(matches!(err, Error::RankOutOfRange { rank: 2, world_size: 2, .. }));
    assert_eq!(err.to_string(), "DistributedSampler::new: rank 2 is outside 0..2");
    let err = DistributedSampler::new(10, 0, 0, DistributedSamplerOptions::default()).unwrap_err();
    assert!(matches!(err, Error::InvalidValue { .. }));
    assert_eq!(err.to_string(), "invalid value \"0\" for num_replicas: at least 1 (the world size)");
}

#[test]
fn single_process_samplers() {
    let s = SequentialSampler::new(5);
    assert_eq!((s.indices(), s.len()), (vec![0, 1, 2, 3, 4], 5));
    let mut r = RandomSampler::new(100, 1);
    let e0 = r.indices();
    assert_eq!(e0.iter().copied().collect::<HashSet<_>>().len(), 100);
    r.set_epoch(1);
    assert_ne!(r.indices(), e0);
}

#[test]
fn eval_shard_is_disjoint_covering_and_balanced() {
    for n in [0usize, 1, 10, 10_000, 60_000] {
        for w in 1..=8 {
            let shards: Vec<_> = (0..w).map(|r| eval_shard(n, r, w)).collect();
            assert_eq!(shards[0].start, 0);
            assert_eq!(shards[w - 1].end, n);
            assert!(shards.windows(2).all(|p| p[0].end == p[1].start), "contiguous, in order");
            let (min, max) = (shards.iter().map(|s| s.len()).min().unwrap(), shards.iter().map(|s| s.len()).max().unwrap());
            assert!(max - min <= 1, "n={n} w={w}");
        }
    }
    assert_eq!((0..3).map(|r| eval_shard(10_000, r, 3).len()).collect::<Vec<_>>(), [3334, 3333, 3333]);
    let m = mnist();
    let total: usize = (0..3).map(|r| m.test.slice(eval_shard(10_000, r, 3)).len()).sum();
    assert_eq!(total, 10_000);
    let last = m.test.slice(eval_shard(10_000, 2, 3));
    assert_eq!(labels_vec(&last.labels.narrow(0, 3332, 1)), labels_vec(&m.test.labels.narrow(0, 9999, 1)));
}

/// The bound: both splits (decode, verify, normalise) well under 2 s in a release build.
#[test]
#[cfg_attr(debug_assertions, ignore = "a release-build timing bound: cargo test --release")]
fn loading_is_fast_in_release() {
    let t = std::time::Instant::now();
    let m = Mnist::load(&workspace_data_dir()).unwrap();
    let secs = t.elapsed().as_secs_f64();
    assert_eq!(m.train.len(), 60_000);
    assert!(secs < 2.0, "Mnist::load took {secs:.2} s");
    eprintln!("Mnist::load (train + test): {secs:.3} s");
}
