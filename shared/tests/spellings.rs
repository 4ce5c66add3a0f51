//! The vocabulary's spellings: every value of every choice parses from each spelling its users
//! know — PyTorch's, Accelerate's (YAML keys and environment variables), Transformers', our
//! flags' — and a wrong one is refused with the list (snapshots). One table per choice.

use clap::Parser;
use ladder_core::parallel::{
    choice, BackwardPrefetch, Choice, DdpOptions, FsdpOptions, Precision, ShardingStrategy, Strategy, StrategyOptions, WrapConfig,
};

/// Asserts every `(spelling, value)` of the table parses to its value, in the spelling's own
/// case, upper-cased and lower-cased; and that each value is written as `name`.
fn table<T: Choice + std::fmt::Debug + std::str::FromStr>(rows: &[(&str, T)], names: &[(T, &str)])
where
    <T as std::str::FromStr>::Err: std::fmt::Debug,
{
    for (text, want) in rows {
        for t in [text.to_string(), text.to_ascii_uppercase(), text.to_ascii_lowercase(), format!("  {text} ")] {
            assert_eq!(choice::parse::<T>(&t).as_ref(), Ok(want), "{t:?}");
            assert_eq!(t.parse::<T>().unwrap(), *want, "FromStr {t:?}");
        }
    }
    for (value, name) in names {
        assert_eq!(value.name(), *name);
        assert_eq!(choice::parse::<T>(name).unwrap(), *value, "a value's own name parses back");
    }
}

#[test]
fn sharding_strategy_spellings() {
    use ShardingStrategy::*;
    table(
        &[
            // ours (flags)
            ("full-shard", FullShard),
            ("shard-grad-op", ShardGradOp),
            ("no-shard", NoShard),
            // PyTorch: the enum member and its qualified name; Accelerate's YAML writes the member
            ("FULL_SHARD", FullShard),
            ("SHARD_GRAD_OP", ShardGradOp),
            ("NO_SHARD", NoShard),
            ("ShardingStrategy.FULL_SHARD", FullShard),
            ("ShardingStrategy.SHARD_GRAD_OP", ShardGradOp),
            ("ShardingStrategy.NO_SHARD", NoShard),
            // Accelerate: FSDP_SHARDING_STRATEGY also takes PyTorch's numbers
            ("1", FullShard),
            ("2", ShardGradOp),
            ("3", NoShard),
            // Transformers: fsdp="full_shard"
            ("full_shard", FullShard),
            ("shard_grad_op", ShardGradOp),
            ("no_shard", NoShard),
            // HSDP: PyTorch's HYBRID_SHARD and private _HYBRID_SHARD_ZERO2, Accelerate's 4 and 5,
            // Transformers' hybrid_shard / hybrid_shard_zero2, our flags
            ("hybrid-shard", HybridShard),
            ("hybrid-shard-zero2", HybridShardZero2),
            ("HYBRID_SHARD", HybridShard),
            ("_HYBRID_SHARD_ZERO2", HybridShardZero2),
            ("HYBRID_SHARD_ZERO2", HybridShardZero2),
            ("ShardingStrategy.HYBRID_SHARD", HybridShard),
            ("ShardingStrategy._HYBRID_SHARD_ZERO2", HybridShardZero2),
            ("4", HybridShard),
            ("5", HybridShardZero2),
            ("hybrid_shard", HybridShard),
            ("hybrid_shard_zero2", HybridShardZero2),
        ],
        &[
            (FullShard, "FULL_SHARD"),
            (ShardGradOp, "SHARD_GRAD_OP"),
            (NoShard, "NO_SHARD"),
            (HybridShard, "HYBRID_SHARD"),
            (HybridShardZero2, "_HYBRID_SHARD_ZERO2"),
        ],
    );
}

#[test]
fn backward_prefetch_spellings() {
    use BackwardPrefetch::*;
    table(
        &[
            ("backward-pre", BackwardPre),
            ("backward-post", BackwardPost),
            ("no-prefetch", NoPrefetch),
            ("BACKWARD_PRE", BackwardPre),
            ("BACKWARD_POST", BackwardPost),
            ("NO_PREFETCH", NoPrefetch),
            ("BackwardPrefetch.BACKWARD_PRE", BackwardPre),
            ("BackwardPrefetch.BACKWARD_POST", BackwardPost),
            ("1", BackwardPre),
            ("2", BackwardPost),
            ("backward_pre", BackwardPre),
            ("backward_post", BackwardPost),
            ("no_prefetch", NoPrefetch),
        ],
        &[(BackwardPre, "BACKWARD_PRE"), (BackwardPost, "BACKWARD_POST"), (NoPrefetch, "NO_PREFETCH")],
    );
    assert_eq!(BackwardPrefetch::default(), BackwardPre, "PyTorch's default");
}

#[test]
fn precision_spellings() {
    use Precision::*;
    table(
        &[
            // Accelerate's mixed_precision and ACCELERATE_MIXED_PRECISION, our flags
            ("no", No),
            ("bf16", Bf16),
            ("fp16", Fp16),
            // the dtype's names (PyTorch's torch.bfloat16, the bench's fp32)
            ("fp32", No),
            ("float32", No),
            ("torch.float32", No),
            ("bfloat16", Bf16),
            ("torch.bfloat16", Bf16),
            ("float16", Fp16),
            ("torch.float16", Fp16),
        ],
        &[(No, "no"), (Bf16, "bf16"), (Fp16, "fp16")],
    );
    assert_eq!((No.label(), Bf16.label(), Fp16.label()), ("fp32", "bf16", "fp16"));
    assert!(No.policy().is_none());
}

#[test]
fn strategy_spellings_carry_default_options() {
    let fsdp = Strategy::fsdp;
    table(
        &[
            ("ddp", Strategy::Ddp(DdpOptions::default())),
            ("fsdp-full-shard", fsdp(ShardingStrategy::FullShard)),
            ("fsdp-shard-grad-op", fsdp(ShardingStrategy::ShardGradOp)),
            ("fsdp-no-shard", fsdp(ShardingStrategy::NoShard)),
            ("fsdp_full_shard", fsdp(ShardingStrategy::FullShard)),
            // a sharding strategy alone is FSDP (Transformers' fsdp="full_shard")
            ("full_shard", fsdp(ShardingStrategy::FullShard)),
            ("FULL_SHARD", fsdp(ShardingStrategy::FullShard)),
            ("shard-grad-op", fsdp(ShardingStrategy::ShardGradOp)),
            ("NO_SHARD", fsdp(ShardingStrategy::NoShard)),
            ("fsdp-hybrid-shard", fsdp(ShardingStrategy::HybridShard)),
            ("fsdp-hybrid-shard-zero2", fsdp(ShardingStrategy::HybridShardZero2)),
            ("hybrid_shard", fsdp(ShardingStrategy::HybridShard)),
            ("_HYBRID_SHARD_ZERO2", fsdp(ShardingStrategy::HybridShardZero2)),
        ],
        &[
            (Strategy::default(), "ddp"),
            (fsdp(ShardingStrategy::FullShard), "fsdp-full-shard"),
            (fsdp(ShardingStrategy::ShardGradOp), "fsdp-shard-grad-op"),
            (fsdp(ShardingStrategy::NoShard), "fsdp-no-shard"),
            (fsdp(ShardingStrategy::HybridShard), "fsdp-hybrid-shard"),
            (fsdp(ShardingStrategy::HybridShardZero2), "fsdp-hybrid-shard-zero2"),
        ],
    );
    // The defaults are PyTorch's.
    assert_eq!(DdpOptions::default().bucket_cap_mb, 25.0);
    let o = FsdpOptions::default();
    assert_eq!(
        (o.sharding_strategy, o.min_num_params, o.backward_prefetch, o.forward_prefetch),
        (ShardingStrategy::FullShard, 100_000_000, BackwardPrefetch::BackwardPre, false)
    );
}

#[test]
fn wrong_spellings_are_refused_with_the_list() {
    let errors = [
        choice::parse::<ShardingStrategy>("full").unwrap_err().to_string(),
        choice::parse::<ShardingStrategy>("HYBRID").unwrap_err().to_string(),
        choice::parse::<ShardingStrategy>("6").unwrap_err().to_string(),
        choice::parse::<ShardingStrategy>("").unwrap_err().to_string(),
        choice::parse::<BackwardPrefetch>("BACKWARD").unwrap_err().to_string(),
        choice::parse::<Precision>("fp8").unwrap_err().to_string(),
        choice::parse::<Precision>("int8").unwrap_err().to_string(),
        choice::parse::<Strategy>("fsdp").unwrap_err().to_string(),
        choice::parse::<Strategy>("fsdp-hybrid").unwrap_err().to_string(),
        choice::parse::<Strategy>("zero3").unwrap_err().to_string(),
    ];
    insta::assert_snapshot!(errors.join("\n"));
}

/// The vocabulary in files: written as the reference's name, read from any spelling; a wrong
/// one names the choice.
#[test]
fn serde_writes_the_name_and_reads_every_spelling() {
    assert_eq!(serde_json::to_string(&ShardingStrategy::ShardGradOp).unwrap(), "\"SHARD_GRAD_OP\"");
    assert_eq!(serde_json::to_string(&BackwardPrefetch::NoPrefetch).unwrap(), "\"NO_PREFETCH\"");
    assert_eq!(serde_json::to_string(&Precision::Bf16).unwrap(), "\"bf16\"");
    assert_eq!(serde_json::from_str::<ShardingStrategy>("\"shard_grad_op\"").unwrap(), ShardingStrategy::ShardGradOp);
    assert_eq!(serde_json::from_str::<Precision>("\"bfloat16\"").unwrap(), Precision::Bf16);
    let err = serde_json::from_str::<BackwardPrefetch>("\"sometimes\"").unwrap_err().to_string();
    assert!(err.starts_with("invalid backward prefetch \"sometimes\": expected backward-pre, backward-post or no-prefetch"), "{err}");
    // A strategy keeps its options through a file.
    let s = Strategy::Fsdp(FsdpOptions { min_num_params: 0, backward_prefetch: BackwardPrefetch::BackwardPost, ..FsdpOptions::default() });
    assert_eq!(serde_json::from_str::<Strategy>(&serde_json::to_string(&s).unwrap()).unwrap(), s);
}

/// On the command line: the flag spellings are listed, every spelling is read, and a wrong one
/// is clap's usual error with the list and no "similar value" tip.
#[test]
fn flags_take_every_spelling_and_list_the_flag_ones() {
    #[derive(Debug, Parser)]
    struct Cli {
        #[arg(long, value_parser = ladder_core::cli::spelling::<Strategy>(), default_value_t = Strategy::default())]
        strategy: Strategy,
        #[arg(long, value_parser = ladder_core::cli::spelling_among(&[Precision::No, Precision::Bf16]))]
        mixed_precision: Option<Precision>,
    }
    let cli = Cli::try_parse_from(["t", "--strategy", "FULL_SHARD", "--mixed-precision", "BF16"]).unwrap();
    assert_eq!((cli.strategy, cli.mixed_precision), (Strategy::fsdp(ShardingStrategy::FullShard), Some(Precision::Bf16)));
    assert_eq!(Cli::try_parse_from(["t"]).unwrap().strategy, Strategy::default());
    let errors = [
        Cli::try_parse_from(["t", "--strategy", "fsdp"]).unwrap_err().render().to_string(),
        Cli::try_parse_from(["t", "--mixed-precision", "fp16"]).unwrap_err().render().to_string(),
    ];
    insta::assert_snapshot!(errors.join("\n"));
}

/// Options given apart from the strategy's name go to the strategy they belong to; the others
/// are named.
#[test]
fn options_apply_to_their_own_strategy_only() {
    let ddp = Strategy::default();
    let full = Strategy::fsdp(ShardingStrategy::FullShard);
    let cap = StrategyOptions { bucket_cap_mb: Some(5.0), ..Default::default() };
    assert_eq!(ddp.with_options(&cap).unwrap(), Strategy::Ddp(DdpOptions { bucket_cap_mb: 5.0, ..DdpOptions::default() }));
    let wrap = StrategyOptions { min_num_params: Some(0), forward_prefetch: Some(true), ..Default::default() };
    assert_eq!(
        full.with_options(&wrap).unwrap(),
        Strategy::Fsdp(FsdpOptions { min_num_params: 0, forward_prefetch: true, ..FsdpOptions::default() })
    );
    let errors = [
        full.with_options(&cap).unwrap_err().to_string(),
        ddp.with_options(&wrap).unwrap_err().to_string(),
        ddp.with_options(&StrategyOptions { bucket_cap_mb: Some(-1.0), ..Default::default() }).unwrap_err().to_string(),
        ddp.with_options(&StrategyOptions { backward_prefetch: Some(BackwardPrefetch::BackwardPost), ..Default::default() })
            .unwrap_err()
            .named_by(&[("backward_prefetch", "--fsdp-backward-prefetch")])
            .to_string(),
    ];
    insta::assert_snapshot!(errors.join("\n"));
}

/// ZeRO-1 is DDP's: set on DDP, refused by name on FSDP and with mixed precision.
#[test]
fn zero_redundancy_optimizer_is_ddps_and_fp32s() {
    let zero = StrategyOptions { zero_redundancy_optimizer: Some(true), ..Default::default() };
    let ddp = Strategy::default().with_options(&zero).unwrap();
    assert_eq!(ddp, Strategy::Ddp(DdpOptions { zero_redundancy_optimizer: true, ..DdpOptions::default() }));
    let off = StrategyOptions { zero_redundancy_optimizer: Some(false), ..Default::default() };
    assert!(Strategy::fsdp(ShardingStrategy::ShardGradOp).with_options(&off).is_ok(), "false is not given");
    let bf16 = WrapConfig { strategy: ddp, mixed_precision: Precision::Bf16, activation_checkpointing: false };
    let errors = [
        Strategy::fsdp(ShardingStrategy::FullShard).with_options(&zero).unwrap_err().to_string(),
        bf16.validate().unwrap_err().to_string(),
    ];
    assert!(WrapConfig { mixed_precision: Precision::No, ..bf16 }.validate().is_ok());
    insta::assert_snapshot!(errors.join("\n"));
}

/// HSDP's mesh option, ParallelismConfig's `dp_shard_size`: set on FSDP, refused on DDP and when
/// 0; the shard-group size it gives the hybrid strategies (the world for the others).
#[test]
fn dp_shard_size_is_fsdps() {
    let two = StrategyOptions { dp_shard_size: Some(2), ..Default::default() };
    let hybrid = Strategy::fsdp(ShardingStrategy::HybridShard).with_options(&two).unwrap();
    let Strategy::Fsdp(o) = hybrid else { panic!("{hybrid:?}") };
    assert_eq!((o.dp_shard_size, o.shard_group_size(8)), (Some(2), 2));
    let full = FsdpOptions { dp_shard_size: Some(2), ..FsdpOptions::default() };
    assert_eq!(full.shard_group_size(8), 8, "FULL_SHARD shards over the world");
    assert_eq!(FsdpOptions::with_sharding(ShardingStrategy::HybridShardZero2).shard_group_size(8), 8, "not given: one node");
    let errors = [
        Strategy::default().with_options(&two).unwrap_err().to_string(),
        hybrid.with_options(&StrategyOptions { dp_shard_size: Some(0), ..Default::default() }).unwrap_err().to_string(),
        ladder_core::parallel::fsdp::mesh::replicate_size(3, 4).unwrap_err().to_string(),
    ];
    assert_eq!(ladder_core::parallel::fsdp::mesh::replicate_size(2, 4).unwrap(), 2);
    insta::assert_snapshot!(errors.join("\n"));
}
