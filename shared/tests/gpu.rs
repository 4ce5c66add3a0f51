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
