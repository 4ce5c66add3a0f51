//! CUDA and NCCL checks for a GPU machine, run by `scripts/gpu-check.sh` (built with
//! `--features nccl`). On a machine without a GPU they are ignored by `make test`.

use ladder_core::device::{cuda_available, DeviceKind};
use tch::{Device, Kind, Tensor};

#[test]
#[ignore = "needs a GPU: run by scripts/gpu-check.sh"]
fn cuda_is_available_after_loading_the_backend() {
    assert!(cuda_available(), "tch::Cuda::is_available() must be true on a GPU machine");
    assert_eq!(DeviceKind::default_for_machine(), DeviceKind::Cuda);
    assert_eq!(DeviceKind::Cuda.resolve(0).unwrap(), Device::Cuda(0));
    let x = Tensor::ones([4], (Kind::Float, Device::Cuda(0)));
    assert_eq!((x.sum(Kind::Float)).double_value(&[]), 4.0);
}

#[cfg(feature = "nccl")]
#[test]
#[ignore = "needs a GPU: run by scripts/gpu-check.sh"]
fn nccl_collectives_at_world_size_1() {
    use ladder_core::dist::nccl::NcclGroup;
    use ladder_core::dist::{DistEnv, ProcessGroup, ReduceOp};
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let env = DistEnv { master_port: Some(port), ..DistEnv::single() };
    let pg = NcclGroup::init(&env).expect("NCCL communicator on GPU 0");
    let dev = pg.device();
    // Every dtype is tried and every failure reported together (which dtype, which call).
    let failed: Vec<String> = [Kind::Float, Kind::Double, Kind::BFloat16, Kind::Half, Kind::Int64]
        .into_iter()
        .filter_map(|kind| pg.all_reduce(&mut Tensor::full([5], 3.0, (kind, dev)), ReduceOp::Sum).err().map(|e| format!("{kind:?}: {e}")))
        .collect();
    assert!(failed.is_empty(), "all_reduce failed for {failed:#?}");
    for kind in [Kind::Float, Kind::Double, Kind::BFloat16, Kind::Half, Kind::Int64] {
        let mut t = Tensor::full([5], 3.0, (kind, dev));
        pg.all_reduce(&mut t, ReduceOp::Sum).unwrap();
        assert_eq!(t.to_kind(Kind::Double).sum(Kind::Double).double_value(&[]), 15.0, "{kind:?}");
        pg.broadcast(&mut t, 0).unwrap();
        let mut out = Tensor::zeros([5], (kind, dev));
        pg.all_gather(&mut out, &t).unwrap();
        assert!(out.equal(&t));
        pg.reduce_scatter(&mut out, &t, ReduceOp::Max).unwrap();
        assert!(out.equal(&t));
    }
    let mut cpu = Tensor::ones([2], (Kind::Float, Device::Cpu));
    assert!(pg.all_reduce(&mut cpu, ReduceOp::Sum).is_err(), "a CPU tensor on the nccl group is a typed error");
    pg.barrier().unwrap();
}

#[test]
#[ignore = "needs a GPU: run by scripts/gpu-check.sh"]
fn cuda_allocator_statistics_count_a_tensor_exactly() {
    use ladder_core::memory::{cuda_allocator_bytes, reset_cuda_peak_memory_stats};
    assert!(cuda_available(), "libtorch's CUDA backend loads (and registers its allocator)");
    let dev = Device::Cuda(0);
    let _warm = Tensor::ones([1], (Kind::Float, dev));
    let (before, _) = cuda_allocator_bytes(0).expect("the CUDA allocator's statistics on a GPU machine");
    // 1 MiB of f32: a multiple of the allocator's 512-byte rounding, counted exactly.
    let x = Tensor::zeros([262_144], (Kind::Float, dev));
    let (now, peak) = cuda_allocator_bytes(0).unwrap();
    assert_eq!(now - before, 1 << 20);
    assert!(peak >= now);
    drop(x);
    assert_eq!(cuda_allocator_bytes(0).unwrap().0, before);
    assert!(reset_cuda_peak_memory_stats(0));
    let (_, peak) = cuda_allocator_bytes(0).unwrap();
    assert_eq!(peak, before, "reset_peak_memory_stats brings the peak down to what is allocated");
    let y = Tensor::zeros([2 * 262_144], (Kind::Float, dev));
    drop(y);
    assert_eq!(cuda_allocator_bytes(0).unwrap().1, before + (2 << 20));
}

#[test]
#[ignore = "needs a GPU: run by scripts/gpu-check.sh"]
fn mnist_on_the_device_draws_the_hosts_batches_bit_for_bit() {
    use ladder_core::data::{resolve_data_dir, DataLoader, Mnist};
    let mnist = Mnist::load(&resolve_data_dir(None)).expect("MNIST in data/mnist");
    let host = mnist.test.slice(0..1000);
    let device = host.to_device(Device::Cuda(0));
    assert!(device.pixels().is_none(), "on a GPU the pixel bytes are a device tensor");
    let (a, b) = (DataLoader::shuffled(&host, 64, 7).unwrap(), DataLoader::shuffled(&device, 64, 7).unwrap());
    let mut batches = 0;
    for ((xa, ya), (xb, yb)) in a.iter().zip(b.iter()) {
        assert_eq!((xb.device(), yb.device()), (Device::Cuda(0), Device::Cuda(0)));
        let bits = |x: &Tensor| {
            Vec::<f32>::try_from(x.to_device(Device::Cpu).reshape([-1])).unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        };
        assert_eq!(bits(&xb), bits(&xa));
        assert_eq!(Vec::<i64>::try_from(yb.to_device(Device::Cpu)).unwrap(), Vec::<i64>::try_from(&ya).unwrap());
        batches += 1;
    }
    assert_eq!(batches, 16, "1000 samples in batches of 64");
}
