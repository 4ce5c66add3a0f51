//! Every collective of the `mpi` backend against its closed form, for every dtype, at world
//! sizes 1, 2 and 3 (real processes under mpirun), plus each typed error.

mod common;

use ladder_core::dist::{init_process_group, Backend, Collective, ReduceOp};
use ladder_core::Error;
use tch::{Device, Kind, Tensor};

const KINDS: [Kind; 5] = [Kind::Float, Kind::Double, Kind::BFloat16, Kind::Half, Kind::Int64];

fn full(n: i64, v: f64, kind: Kind) -> Tensor {
    Tensor::full([n], v, (kind, Device::Cpu))
}

fn values(t: &Tensor) -> Vec<f64> {
    Vec::<f64>::try_from(t.to_kind(Kind::Double)).unwrap()
}

#[test]
fn collectives_at_world_size_2() {
    common::mpirun(2, "rank_collectives", &[]);
}

/// One rank under mpirun is an MPI group (not the identity group): its collectives are
/// still their closed forms, the reduce-scatter's one-rank shortcut (a copy) included.
#[test]
fn collectives_at_world_size_1_under_mpirun() {
    common::mpirun(1, "rank_collectives", &[]);
}

#[test]
fn collectives_at_world_size_3() {
    common::mpirun(3, "rank_collectives", &[]);
}

#[test]
fn collective_errors_at_world_size_2() {
    common::mpirun(2, "rank_errors", &[]);
}

#[test]
fn one_rank_without_launcher_is_the_identity_group() {
    if common::is_rank() {
        return;
    }
    let pg = init_process_group(Backend::Mpi).unwrap();
    assert_eq!((pg.rank(), pg.world_size()), (0, 1));
    let mut t = Tensor::from_slice(&[1.0f32, 2.0, 3.0]);
    pg.all_reduce(&mut t, ReduceOp::Sum).unwrap();
    assert_eq!(values(&t), [1.0, 2.0, 3.0]);
    let mut out = Tensor::zeros([3], (Kind::Float, Device::Cpu));
    pg.all_gather(&mut out, &t).unwrap();
    assert_eq!(values(&out), [1.0, 2.0, 3.0]);
    assert!(matches!(pg.broadcast(&mut t, 1), Err(Error::RankOutOfRange { rank: 1, world_size: 1, .. })));
}

#[test]
#[ignore = "rank body: run under mpirun by collectives_at_world_size_{1_under_mpirun,2,3}"]
fn rank_collectives() {
    let pg = init_process_group(Backend::Mpi).unwrap();
    let (r, w) = (pg.rank() as f64, pg.world_size() as f64);
    assert_eq!(pg.world_size(), std::env::var("OMPI_COMM_WORLD_SIZE").unwrap().parse::<usize>().unwrap());
    for kind in KINDS {
        let ctx = format!("rank {r} {kind:?}");
        // all_reduce: rank+1 everywhere; Sum = n(n+1)/2, Max = n, Min = 1, Avg = (n+1)/2.
        for (op, want) in [(ReduceOp::Sum, w * (w + 1.0) / 2.0), (ReduceOp::Max, w), (ReduceOp::Min, 1.0)] {
            let mut t = full(5, r + 1.0, kind);
            pg.all_reduce(&mut t, op).unwrap();
            assert_eq!(values(&t), vec![want; 5], "{ctx} {op:?}");
            assert_eq!(t.kind(), kind);
        }
        if kind != Kind::Int64 {
            let mut t = full(4, r + 1.0, kind);
            pg.all_reduce(&mut t, ReduceOp::Avg).unwrap();
            assert_eq!(values(&t), vec![(w + 1.0) / 2.0; 4], "{ctx} Avg");
        }
        // broadcast from the last rank (non-zero): everyone ends with its value.
        let src = pg.world_size() - 1;
        let mut t = full(3, r * 10.0, kind);
        pg.broadcast(&mut t, src).unwrap();
        assert_eq!(values(&t), vec![src as f64 * 10.0; 3], "{ctx} broadcast");
        // all_gather: rank r contributes [10r, 10r+1, 10r+2]; blocks arrive in rank order.
        let input = Tensor::from_slice(&[10.0 * r, 10.0 * r + 1.0, 10.0 * r + 2.0]).to_kind(kind);
        let mut out = Tensor::zeros([pg.world_size() as i64 * 3], (kind, Device::Cpu));
        pg.all_gather(&mut out, &input).unwrap();
        let want: Vec<f64> = (0..pg.world_size()).flat_map(|q| (0..3).map(move |i| 10.0 * q as f64 + i as f64)).collect();
        assert_eq!(values(&out), want, "{ctx} all_gather");
        // reduce_scatter: input[j] = r + j; block r of the sum is n(n-1)/2 + n·j for j in block r.
        let input = (Tensor::arange(pg.world_size() as i64 * 2, (Kind::Double, Device::Cpu)) + r).to_kind(kind);
        let mut out = Tensor::zeros([2], (kind, Device::Cpu));
        pg.reduce_scatter(&mut out, &input, ReduceOp::Sum).unwrap();
        let j0 = r * 2.0;
        let base = w * (w - 1.0) / 2.0;
        assert_eq!(values(&out), [base + w * j0, base + w * (j0 + 1.0)], "{ctx} reduce_scatter");
        if kind != Kind::Int64 {
            pg.reduce_scatter(&mut out, &input, ReduceOp::Avg).unwrap();
            assert_eq!(values(&out), [(base + w * j0) / w, (base + w * (j0 + 1.0)) / w], "{ctx} reduce_scatter Avg");
        }
        // reduce_scatter of a handed-over input (an all-reduce in place at 2 ranks): the same blocks.
        for op in [ReduceOp::Sum, ReduceOp::Avg].into_iter().filter(|&op| kind != Kind::Int64 || op == ReduceOp::Sum) {
            let mut consumed = Tensor::zeros([2], (kind, Device::Cpu));
            pg.run(Collective::reduce_scatter(&mut consumed, input.copy(), op)).unwrap();
            let d = if op == ReduceOp::Avg { w } else { 1.0 };
            assert_eq!(
                values(&consumed),
                [(base + w * j0) / d, (base + w * (j0 + 1.0)) / d],
                "{ctx} reduce_scatter of a handed-over input {op:?}"
            );
        }
        // Shapes do not matter, element counts do: a [W, 2] input into a [2, 1] output, blocking
        // (handed over and borrowed) and not.
        let square = input.view([pg.world_size() as i64, 2]);
        let mut column = Tensor::zeros([2, 1], (kind, Device::Cpu));
        pg.run(Collective::reduce_scatter(&mut column, square.copy(), ReduceOp::Sum)).unwrap();
        assert_eq!(values(&column.reshape([-1])), [base + w * j0, base + w * (j0 + 1.0)], "{ctx} reduce_scatter [W, 2] -> [2, 1]");
        let mut column = Tensor::zeros([2, 1], (kind, Device::Cpu));
        pg.reduce_scatter(&mut column, &square, ReduceOp::Sum).unwrap();
        assert_eq!(values(&column.reshape([-1])), [base + w * j0, base + w * (j0 + 1.0)], "{ctx} reduce_scatter of a borrowed [W, 2]");
        let mut column = Tensor::zeros([2, 1], (kind, Device::Cpu));
        pg.start(Collective::reduce_scatter(&mut column, square.copy(), ReduceOp::Sum)).unwrap().wait().unwrap();
        assert_eq!(values(&column.reshape([-1])), [base + w * j0, base + w * (j0 + 1.0)], "{ctx} reduce_scatter started, [W, 2]");
        // Its checks are the reduce-scatter's: a wrong block size is an error before any message.
        let mut wrong = Tensor::zeros([3], (kind, Device::Cpu));
        assert!(pg.run(Collective::reduce_scatter(&mut wrong, input.copy(), ReduceOp::Sum)).is_err(), "{ctx}: block size");
        // coalesced: two tensors of different shapes in one call.
        let mut ts = [Tensor::full([2, 3], r, (kind, Device::Cpu)), Tensor::full([4], 1.0, (kind, Device::Cpu))];
        pg.all_reduce_coalesced(&mut ts, ReduceOp::Sum).unwrap();
        assert_eq!(values(&ts[0].reshape([-1])), vec![w * (w - 1.0) / 2.0; 6], "{ctx} coalesced[0]");
        assert_eq!(ts[0].size(), vec![2, 3]);
        assert_eq!(values(&ts[1]), vec![w; 4], "{ctx} coalesced[1]");
        let mut ts = [full(2, r, kind), full(3, r + 5.0, kind)];
        pg.broadcast_coalesced(&mut ts, 0).unwrap();
        assert_eq!((values(&ts[0]), values(&ts[1])), (vec![0.0; 2], vec![5.0; 3]), "{ctx} broadcast_coalesced");
    }
    // A large reduce-scatter (≥ 1 MiB in every dtype: from 3 ranks one `MPI_Reduce` per block's
    // owner) for every op: rank q's element in block b is q + b, so rank r's block of the sum
    // is W(W−1)/2 + W·r, of the max W−1 + r, of the min r, of the mean (W−1)/2 + r.
    let block = 300_000i64;
    for kind in KINDS {
        let input = ((Tensor::arange(block * w as i64, (Kind::Double, Device::Cpu)) / block as f64).floor() + r).to_kind(kind);
        let ops = [
            (ReduceOp::Sum, w * (w - 1.0) / 2.0 + w * r),
            (ReduceOp::Max, w - 1.0 + r),
            (ReduceOp::Min, r),
            (ReduceOp::Avg, (w - 1.0) / 2.0 + r),
        ];
        for (op, want) in ops.into_iter().filter(|&(op, _)| kind != Kind::Int64 || op != ReduceOp::Avg) {
            let mut out = Tensor::full([block], -1.0, (kind, Device::Cpu));
            pg.reduce_scatter(&mut out, &input, op).unwrap();
            let (lo, hi) = (out.min().to_kind(Kind::Double).double_value(&[]), out.max().to_kind(Kind::Double).double_value(&[]));
            assert_eq!((lo, hi), (want, want), "rank {r} {kind:?} {op:?}: a large reduce-scatter's block");
        }
    }
    // A large buffer (over the 1 MiB first bucket of DDP): 2^20 f32.
    let mut t = Tensor::full([1 << 20], r + 1.0, (Kind::Float, Device::Cpu));
    pg.all_reduce(&mut t, ReduceOp::Sum).unwrap();
    assert_eq!(t.min().double_value(&[]), w * (w + 1.0) / 2.0);
    assert_eq!(t.max().double_value(&[]), w * (w + 1.0) / 2.0);
    pg.barrier().unwrap();
}

#[test]
#[ignore = "rank body: run under mpirun by collective_errors_at_world_size_2"]
fn rank_errors() {
    let pg = init_process_group(Backend::Mpi).unwrap();
    let rank = pg.rank();
    // Non-contiguous input: a transposed matrix.
    let mut t = Tensor::zeros([3, 2], (Kind::Float, Device::Cpu)).transpose(0, 1);
    match pg.all_reduce(&mut t, ReduceOp::Sum) {
        Err(Error::BadTensor { op: "all_reduce", problem, .. }) => assert!(problem.contains("not contiguous"), "{problem}"),
        other => panic!("expected BadTensor, got {other:?}"),
    }
    // Unsupported dtype.
    let mut t = Tensor::zeros([3], (Kind::Int, Device::Cpu));
    assert!(matches!(pg.all_reduce(&mut t, ReduceOp::Sum), Err(Error::BadTensor { .. })));
    // Avg of integers.
    let mut t = Tensor::zeros([3], (Kind::Int64, Device::Cpu));
    assert!(matches!(pg.all_reduce(&mut t, ReduceOp::Avg), Err(Error::BadTensor { .. })));
    // src out of range.
    let mut t = Tensor::zeros([3], (Kind::Float, Device::Cpu));
    match pg.broadcast(&mut t, 2) {
        Err(e @ Error::RankOutOfRange { rank: 2, world_size: 2, .. }) => {
            assert_eq!(e.to_string(), "broadcast: rank 2 is outside 0..2")
        }
        other => panic!("expected RankOutOfRange, got {other:?}"),
    }
    // Shape mismatch across ranks: every rank gets the error, none hangs or corrupts memory.
    let mut t = Tensor::zeros([4 + rank as i64], (Kind::Float, Device::Cpu));
    match pg.all_reduce(&mut t, ReduceOp::Sum) {
        Err(Error::CollectiveMismatch { op: "all_reduce", detail }) => assert!(detail.contains("numel ranges 4..=5"), "{detail}"),
        other => panic!("expected CollectiveMismatch, got {other:?}"),
    }
    // Dtype mismatch across ranks.
    let kind = if rank == 0 { Kind::Float } else { Kind::Double };
    let mut t = Tensor::zeros([4], (kind, Device::Cpu));
    assert!(matches!(pg.broadcast(&mut t, 0), Err(Error::CollectiveMismatch { op: "broadcast", .. })));
    // all_gather output of the wrong size.
    let input = Tensor::zeros([3], (Kind::Float, Device::Cpu));
    let mut out = Tensor::zeros([5], (Kind::Float, Device::Cpu));
    assert!(matches!(pg.all_gather(&mut out, &input), Err(Error::BadTensor { op: "all_gather", .. })));
    // Coalesced tensors of mixed dtypes.
    let mut ts = [Tensor::zeros([2], (Kind::Float, Device::Cpu)), Tensor::zeros([2], (Kind::Double, Device::Cpu))];
    assert!(matches!(pg.all_reduce_coalesced(&mut ts, ReduceOp::Sum), Err(Error::BadTensor { .. })));
    // After all those errors the group still works.
    let mut t = Tensor::ones([2], (Kind::Float, Device::Cpu));
    pg.all_reduce(&mut t, ReduceOp::Sum).unwrap();
    assert_eq!(values(&t), [2.0, 2.0]);
}

#[test]
fn a_panicking_rank_ends_the_job_instead_of_hanging_it() {
    let (text, took) = common::mpirun_failing(2, "rank_panics_while_other_waits", &[]);
    assert!(text.contains("rank 1 fails on purpose"), "{text}");
    assert!(text.contains("rank 1: panicked; aborting the MPI job"), "{text}");
    assert!(took.as_secs() < 20, "took {took:?}");
}

#[test]
fn a_rank_that_returns_early_ends_the_job_within_the_shutdown_timeout() {
    let (text, took) = common::mpirun_failing(2, "rank_leaves_while_other_waits", &[("LADDER_SHUTDOWN_TIMEOUT_S", "2")]);
    assert!(text.contains("rank 1: the other ranks did not reach shutdown within 2s"), "{text}");
    assert!(took.as_secs() < 20, "took {took:?}");
}

#[test]
#[ignore = "rank body: run under mpirun by a_panicking_rank_ends_the_job_instead_of_hanging_it"]
fn rank_panics_while_other_waits() {
    let pg = init_process_group(Backend::Mpi).unwrap();
    if pg.rank() == 1 {
        panic!("rank 1 fails on purpose");
    }
    let mut t = Tensor::ones([4], (Kind::Float, Device::Cpu));
    let _ = pg.all_reduce(&mut t, ReduceOp::Sum); // rank 1 never joins
}

#[test]
#[ignore = "rank body: run under mpirun by a_rank_that_returns_early_ends_the_job_within_the_shutdown_timeout"]
fn rank_leaves_while_other_waits() {
    let pg = init_process_group(Backend::Mpi).unwrap();
    if pg.rank() == 1 {
        return; // e.g. an error returned on this rank only: dropping the group must not hang
    }
    let mut t = Tensor::ones([4], (Kind::Float, Device::Cpu));
    let _ = pg.all_reduce(&mut t, ReduceOp::Sum);
}

#[test]
fn subgroups_at_world_size_4() {
    common::mpirun(4, "rank_subgroups", &[]);
}

#[test]
#[ignore = "rank body: run under mpirun by subgroups_at_world_size_4"]
fn rank_subgroups() {
    use ladder_core::dist::new_subgroups_by_enumeration;
    let pg = init_process_group(Backend::Mpi).unwrap();
    let r = pg.rank();
    // Non-members get no group; a bad rank list is a typed error before any message.
    assert!(matches!(pg.new_group(&[0, 4]), Err(Error::RankOutOfRange { rank: 4, world_size: 4, .. })));
    assert!(matches!(pg.new_group(&[1, 1]), Err(Error::InvalidValue { .. })));
    // HSDP's mesh (replicate 2 x shard 2): shard groups {0,1},{2,3}; replicate groups {0,2},{1,3}.
    let shard = new_subgroups_by_enumeration(&*pg, &[vec![0, 1], vec![2, 3]]).unwrap();
    let replicate = new_subgroups_by_enumeration(&*pg, &[vec![2, 0], vec![1, 3]]).unwrap();
    assert_eq!((shard.rank(), shard.world_size()), (r % 2, 2));
    assert_eq!((replicate.rank(), replicate.world_size()), (r / 2, 2));
    let only_0_and_3 = pg.new_group(&[3, 0]).unwrap();
    assert_eq!(only_0_and_3.as_ref().map(|g| g.rank()), [Some(0), None, None, Some(1)][r]);
    for kind in [Kind::Float, Kind::Double, Kind::BFloat16] {
        let v = (r + 1) as f64;
        // all_reduce Sum: {0,1} → 1+2 = 3, {2,3} → 3+4 = 7; {0,2} → 1+3 = 4, {1,3} → 2+4 = 6.
        let mut t = full(3, v, kind);
        shard.all_reduce(&mut t, ReduceOp::Sum).unwrap();
        assert_eq!(values(&t), vec![[3.0, 7.0][r / 2]; 3], "rank {r} {kind:?}");
        let mut t = full(3, v, kind);
        replicate.all_reduce(&mut t, ReduceOp::Avg).unwrap();
        assert_eq!(values(&t), vec![[2.0, 3.0][r % 2]; 3], "rank {r} {kind:?}");
        // all_gather: the members' values in sub-group rank order.
        let mut out = full(4, 0.0, kind);
        shard.all_gather(&mut out, &full(2, v, kind)).unwrap();
        let (a, b) = ([1.0, 3.0][r / 2], [2.0, 4.0][r / 2]);
        assert_eq!(values(&out), [a, a, b, b], "rank {r} {kind:?}");
        let mut out = full(2, 0.0, kind);
        replicate.all_gather(&mut out, &full(1, v, kind)).unwrap();
        assert_eq!(values(&out), [[1.0, 2.0][r % 2], [3.0, 4.0][r % 2]], "rank {r} {kind:?}");
        // reduce_scatter: input [rank+1, 10·(rank+1)] → block i of the sum over the members.
        let input = Tensor::from_slice(&[v, 10.0 * v]).to_kind(kind);
        let mut out = full(1, 0.0, kind);
        replicate.reduce_scatter(&mut out, &input, ReduceOp::Sum).unwrap();
        let sum = [4.0, 6.0][r % 2];
        assert_eq!(values(&out), [[sum, 10.0 * sum][r / 2]], "rank {r} {kind:?}");
        let mut out = full(1, 0.0, kind);
        shard.run(Collective::reduce_scatter(&mut out, input.copy(), ReduceOp::Avg)).unwrap();
        let avg = [1.5, 3.5][r / 2];
        assert_eq!(values(&out), [[avg, 10.0 * avg][r % 2]], "rank {r} {kind:?}");
    }
    // A large reduce-scatter over three members (from 3 ranks and 1 MiB one `MPI_Reduce` per
    // block, rooted at the sub-group's ranks): member s's element in block b is s + b, so
    // member s's block of the sum is 3 + 3s.
    if let Some(g) = pg.new_group(&[3, 1, 2]).unwrap() {
        let (s, block) = (g.rank() as f64, 200_000i64);
        assert_eq!((g.rank(), g.world_size()), (r - 1, 3));
        let input = (Tensor::arange(3 * block, (Kind::Double, Device::Cpu)) / block as f64).floor() + s;
        let mut out = Tensor::zeros([block], (Kind::Float, Device::Cpu));
        g.reduce_scatter(&mut out, &input.to_kind(Kind::Float), ReduceOp::Sum).unwrap();
        let (lo, hi) = (out.min().double_value(&[]), out.max().double_value(&[]));
        assert_eq!((lo, hi), (3.0 + 3.0 * s, 3.0 + 3.0 * s), "rank {r}: a large reduce-scatter over three members");
    }
    // The non-blocking form, and a broadcast from the sub-group's rank 1 (world rank 3).
    if let Some(g) = &only_0_and_3 {
        let mut t = full(2, r as f64, Kind::Float);
        g.start(Collective::broadcast(&mut t, 1)).unwrap().wait().unwrap();
        assert_eq!(values(&t), [3.0, 3.0]);
        assert!(matches!(g.broadcast(&mut t, 2), Err(Error::RankOutOfRange { rank: 2, world_size: 2, .. })));
    }
    let mut t = full(2, 1.0, Kind::Float);
    pg.all_reduce(&mut t, ReduceOp::Sum).unwrap();
    assert_eq!(values(&t), [4.0, 4.0]);
    println!("rank {r}: sub-group collectives ok");
}
