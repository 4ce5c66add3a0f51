//! The estimate's heap terms on a CPU ([`ladder_core::memory::estimate::fitted`]): what moves
//! them and what must not. The CPU's bf16 unit changes bf16 on a CPU only (not fp32, not fp16,
//! not CUDA); transparent huge pages add their term exactly where the levels turn them on (from
//! 32 MiB of fp32 parameters, or as `THP_MEM_ALLOC_ENABLE` says), under every engine and
//! precision, never on CUDA.

use ladder_core::device::{huge_pages_by_default, CpuBf16Unit, DeviceKind};
use ladder_core::memory::estimate::{
    estimate_on, fitted::FSDP_SHARDED_HUGE_PAGES_BYTES, resident_per_live, EstimateInput, RankEstimate, FSDP_RUNTIME_BYTES,
    HUGE_PAGES_BYTES, RESIDENT_PER_LIVE_16BIT, RESIDENT_PER_LIVE_16BIT_AVX512, RESIDENT_PER_LIVE_FP32, RUNTIME_BYTES,
};
use ladder_core::model::BasicNet;
use ladder_core::parallel::{FsdpOptions, Precision, ShardingStrategy, Strategy, WrapConfig};

fn input(strategy: Strategy, precision: Precision, width: i64) -> EstimateInput {
    EstimateInput {
        wrap: WrapConfig { strategy, mixed_precision: precision, activation_checkpointing: false },
        world_size: 2,
        width,
        batch_size: 512,
        offload_optimizer: Default::default(),
        save_checkpoint: false,
        cpu_bf16: None,
        huge_pages: None,
    }
}

fn full_shard() -> Strategy {
    Strategy::Fsdp(FsdpOptions { sharding_strategy: ShardingStrategy::FullShard, min_num_params: 0, ..Default::default() })
}

fn on(i: &EstimateInput, device: DeviceKind) -> Vec<RankEstimate> {
    estimate_on(i, device).unwrap()
}

#[test]
fn the_bf16_unit_moves_bf16_on_a_cpu_and_nothing_else() {
    let avx512 = |i: &EstimateInput| EstimateInput { cpu_bf16: Some(CpuBf16Unit::Avx512Bf16), ..*i };
    for strategy in [Strategy::default(), full_shard()] {
        // fp32 anywhere, fp16 on a CPU (the unit's factor is bf16's), bf16 on CUDA: unchanged.
        for (precision, device) in
            [(Precision::No, DeviceKind::Cpu), (Precision::Fp16, DeviceKind::Cpu), (Precision::Bf16, DeviceKind::Cuda)]
        {
            let i = input(strategy, precision, 128);
            assert_eq!(on(&avx512(&i), device), on(&i, device), "{precision:?} on {device:?}");
        }
        let i = input(strategy, Precision::Bf16, 128);
        let (amx, avx) = (on(&EstimateInput { cpu_bf16: Some(CpuBf16Unit::Amx), ..i }, DeviceKind::Cpu), on(&avx512(&i), DeviceKind::Cpu));
        let none = on(&EstimateInput { cpu_bf16: Some(CpuBf16Unit::Emulated), ..i }, DeviceKind::Cpu);
        assert_eq!((&amx, &none), (&on(&i, DeviceKind::Cpu), &amx), "AMX's factor for an unknown or absent unit");
        let ratio = avx[0].activations as f64 / amx[0].activations as f64;
        assert!((ratio - RESIDENT_PER_LIVE_16BIT_AVX512 / RESIDENT_PER_LIVE_16BIT).abs() < 1e-6, "{ratio}");
        assert_eq!(avx[0].model_state, amx[0].model_state);
    }
    assert_eq!(resident_per_live(4, Some(CpuBf16Unit::Avx512Bf16)), RESIDENT_PER_LIVE_FP32);
    assert_eq!(resident_per_live(2, Some(CpuBf16Unit::Avx512Bf16)), RESIDENT_PER_LIVE_16BIT_AVX512);
    assert_eq!(resident_per_live(2, None), RESIDENT_PER_LIVE_16BIT);
}

#[test]
fn huge_pages_add_their_term_where_the_levels_turn_them_on() {
    // The first width whose fp32 parameters reach 32 MiB, as the levels' start-up computes it.
    let first = (1..8192).find(|&w| huge_pages_by_default(BasicNet::param_bytes(w))).unwrap();
    assert_eq!(first, 908);
    let no_shard = Strategy::Fsdp(FsdpOptions { sharding_strategy: ShardingStrategy::NoShard, ..Default::default() });
    for strategy in [Strategy::default(), full_shard(), no_shard] {
        for precision in [Precision::No, Precision::Bf16] {
            // FSDP's engine in fp32 has its own runtime term; DDP, and every engine in 16 bits
            // (DDP in bf16 runs on FSDP's NO_SHARD path), the common one.
            let fsdp_fp32 = !matches!(strategy, Strategy::Ddp(_)) && precision == Precision::No;
            let runtime = if fsdp_fp32 { FSDP_RUNTIME_BYTES } else { RUNTIME_BYTES };
            // FULL_SHARD in fp32 has its own, smaller term; DDP, NO_SHARD and bf16 keep the
            // common one.
            let sharded_fp32 = strategy == full_shard() && precision == Precision::No;
            let huge = if sharded_fp32 { FSDP_SHARDED_HUGE_PAGES_BYTES } else { HUGE_PAGES_BYTES };
            let at = |width, huge_pages| on(&EstimateInput { huge_pages, ..input(strategy, precision, width) }, DeviceKind::Cpu)[0].runtime;
            let what = format!("{strategy:?} {precision:?}");
            assert_eq!((at(first - 1, None), at(first, None)), (runtime, runtime + huge), "{what}");
            // THP_MEM_ALLOC_ENABLE set by the user: 0 at width 4096, 1 at the tutorial's.
            assert_eq!((at(4096, Some(false)), at(128, Some(true))), (runtime, runtime + huge), "{what}");
            let cuda = |huge_pages| on(&EstimateInput { huge_pages, ..input(strategy, precision, 4096) }, DeviceKind::Cuda);
            assert_eq!(cuda(Some(true)), cuda(Some(false)), "{what}: none on CUDA");
        }
    }
}
