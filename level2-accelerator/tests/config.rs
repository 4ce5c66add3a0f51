//! Level 2's configuration: the precedence builder > launcher env > config file > default
//! (with "given as the default" kept apart from "not given"), config file round-trips, the
//! written files, the banner, and every error message (insta snapshots, reviewed).

use ladder_core::parallel::{Dtype, FsdpOptions, Strategy, WrapConfig};
use level2_accelerator::config::{
    AcceleratorConfig, BackwardPrefetch, ConfigFormat, DistributedType, Precision, ResolvedConfig, ShardingStrategy, Source, SETTINGS,
};
use level2_accelerator::DistributedDataParallelKwargs;
use std::collections::HashMap;
use std::path::Path;

/// An environment lookup over `vars`.
fn env_of(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let map: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    move |k| map.get(k).cloned()
}

/// Writes `text` to `dir/name` and returns the path.
fn write(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p.display().to_string()
}

/// Resolves with the builder, the variables, and (when given) a YAML config file holding `file`.
fn resolve_with(builder: &AcceleratorConfig, vars: &[(&str, &str)], file: Option<&str>) -> ResolvedConfig {
    let dir = tempfile::tempdir().unwrap();
    let mut all: Vec<(&str, &str)> = vars.to_vec();
    let path;
    if let Some(text) = file {
        path = write(dir.path(), "c.yaml", text);
        all.push(("ACCELERATE_CONFIG_FILE", &path));
    }
    ResolvedConfig::resolve(builder, env_of(&all)).unwrap()
}

/// HSDP from Accelerate's variables: `FSDP_SHARDING_STRATEGY` HYBRID_SHARD (or PyTorch's 5 for
/// _HYBRID_SHARD_ZERO2) and `PARALLELISM_CONFIG_DP_SHARD_SIZE`; the config file's key too.
#[test]
fn hybrid_sharding_and_its_shard_size_resolve() {
    let vars = [("ACCELERATE_USE_FSDP", "true"), ("FSDP_SHARDING_STRATEGY", "HYBRID_SHARD"), ("PARALLELISM_CONFIG_DP_SHARD_SIZE", "2")];
    let r = resolve_with(&AcceleratorConfig::default(), &vars, None);
    let Strategy::Fsdp(o) = r.strategy() else { panic!("{:?}", r.strategy()) };
    assert_eq!((o.sharding_strategy, o.dp_shard_size), (ShardingStrategy::HybridShard, Some(2)));
    let file = "use_fsdp: true\nfsdp_sharding_strategy: 5\nparallelism_config_dp_shard_size: 4\n";
    let r = resolve_with(&AcceleratorConfig::default(), &[], Some(file));
    let Strategy::Fsdp(o) = r.strategy() else { panic!("{:?}", r.strategy()) };
    assert_eq!((o.sharding_strategy, o.dp_shard_size), (ShardingStrategy::HybridShardZero2, Some(4)));
    assert_eq!(resolve_with(&AcceleratorConfig::default(), &[], None).parallelism_config_dp_shard_size, None, "default: LOCAL_WORLD_SIZE");
}

#[test]
fn nothing_given_gives_accelerates_defaults() {
    let r = ResolvedConfig::resolve(&AcceleratorConfig::default(), env_of(&[])).unwrap();
    assert_eq!(r.mixed_precision, Precision::No);
    assert_eq!(r.gradient_accumulation_steps, 1);
    assert!(!r.cpu);
    assert!(!r.use_fsdp);
    assert_eq!(r.fsdp_sharding_strategy, ShardingStrategy::FullShard);
    assert_eq!(r.fsdp_min_num_params, 100_000_000);
    // Accelerate's FullyShardedDataParallelPlugin: backward_prefetch=None, forward_prefetch=False.
    assert_eq!(r.fsdp_backward_prefetch, BackwardPrefetch::NoPrefetch);
    assert!(!r.fsdp_forward_prefetch);
    assert!(!r.split_batches);
    assert!(r.even_batches);
    assert_eq!(r.seed, None);
    assert_eq!(r.config_file, None);
    assert_eq!(r.sources.len(), SETTINGS.len());
    assert!(r.sources.values().all(|s| *s == Source::Default));
}

/// The precedence table for mixed_precision, one row per combination of sources.
/// "no" in a higher source is "given as the default" and must still win.
#[test]
fn precedence_table_mixed_precision() {
    let b = |mp| AcceleratorConfig { mixed_precision: mp, ..Default::default() };
    let env = |v: &'static str| vec![("ACCELERATE_MIXED_PRECISION", v)];
    type Row = (AcceleratorConfig, Vec<(&'static str, &'static str)>, Option<&'static str>, Precision, Source);
    #[rustfmt::skip]
    let rows: Vec<Row> = vec![
        // builder                           env           file                        -> value                 source
        (b(None),                           vec![],        None,                          Precision::No,   Source::Default),
        (b(None),                           vec![],        Some("mixed_precision: bf16"), Precision::Bf16, Source::ConfigFile),
        (b(None),                           vec![],        Some("mixed_precision: 'no'"), Precision::No,   Source::ConfigFile),
        (b(None),                           env("bf16"),   Some("mixed_precision: fp16"), Precision::Bf16, Source::Env),
        (b(None),                           env("no"),     Some("mixed_precision: bf16"), Precision::No,   Source::Env),
        (b(None),                           env("BF16"),   None,                          Precision::Bf16, Source::Env),
        (b(Some(Precision::Fp16)),     env("bf16"),   Some("mixed_precision: bf16"), Precision::Fp16, Source::Builder),
        (b(Some(Precision::No)),       env("bf16"),   Some("mixed_precision: bf16"), Precision::No,   Source::Builder),
        (b(Some(Precision::No)),       vec![],        Some("mixed_precision: fp16"), Precision::No,   Source::Builder),
        (b(Some(Precision::Bf16)),     vec![],        None,                          Precision::Bf16, Source::Builder),
        // A file that does not mention the setting leaves it to the default.
        (b(None),                           vec![],        Some("seed: 3"),               Precision::No,   Source::Default),
    ];
    for (i, (builder, vars, file, want, src)) in rows.into_iter().enumerate() {
        let r = resolve_with(&builder, &vars, file);
        assert_eq!((r.mixed_precision, r.source("mixed_precision")), (want, src), "row {i}: {builder:?} {vars:?} {file:?}");
    }
}

/// Every setting: each source wins over the ones below it, and a value equal to the default
/// given by a higher source still beats a different value from a lower one.
#[test]
fn precedence_table_every_setting() {
    // (setting, builder value, env text, file line, value of each as the banner prints it)
    struct Row {
        setting: &'static str,
        builder: AcceleratorConfig,
        builder_v: &'static str,
        env: &'static str,
        env_v: &'static str,
        file: &'static str,
        file_v: &'static str,
        default_v: &'static str,
        /// The default, given explicitly by the builder, and a lower source's different value.
        builder_default: AcceleratorConfig,
        env_default: &'static str,
    }
    let d = AcceleratorConfig::default;
    let rows = vec![
        Row {
            setting: "gradient_accumulation_steps",
            builder: AcceleratorConfig { gradient_accumulation_steps: Some(2), ..d() },
            builder_v: "2",
            env: "3",
            env_v: "3",
            file: "gradient_accumulation_steps: 4",
            file_v: "4",
            default_v: "1",
            builder_default: AcceleratorConfig { gradient_accumulation_steps: Some(1), ..d() },
            env_default: "1",
        },
        Row {
            setting: "cpu",
            builder: AcceleratorConfig { cpu: Some(true), ..d() },
            builder_v: "true",
            env: "True", // what Accelerate's launcher writes: str(True)
            env_v: "true",
            file: "use_cpu: true",
            file_v: "true",
            default_v: "false",
            builder_default: AcceleratorConfig { cpu: Some(false), ..d() },
            env_default: "False",
        },
        Row {
            setting: "use_fsdp",
            builder: AcceleratorConfig { use_fsdp: Some(true), ..d() },
            builder_v: "true",
            env: "1",
            env_v: "true",
            file: "distributed_type: FSDP",
            file_v: "true",
            default_v: "false",
            builder_default: AcceleratorConfig { use_fsdp: Some(false), ..d() },
            env_default: "false",
        },
        Row {
            setting: "fsdp_sharding_strategy",
            builder: AcceleratorConfig { fsdp_sharding_strategy: Some(ShardingStrategy::NoShard), ..d() },
            builder_v: "NO_SHARD",
            env: "2",
            env_v: "SHARD_GRAD_OP",
            file: "fsdp_sharding_strategy: NO_SHARD",
            file_v: "NO_SHARD",
            default_v: "FULL_SHARD",
            builder_default: AcceleratorConfig { fsdp_sharding_strategy: Some(ShardingStrategy::FullShard), ..d() },
            env_default: "FULL_SHARD",
        },
        Row {
            setting: "fsdp_min_num_params",
            builder: AcceleratorConfig { fsdp_min_num_params: Some(0), ..d() },
            builder_v: "0",
            env: "1000",
            env_v: "1000",
            file: "fsdp_min_num_params: 20000",
            file_v: "20000",
            default_v: "100000000",
            builder_default: AcceleratorConfig { fsdp_min_num_params: Some(100_000_000), ..d() },
            env_default: "100000000",
        },
        Row {
            setting: "fsdp_backward_prefetch",
            builder: AcceleratorConfig { fsdp_backward_prefetch: Some(BackwardPrefetch::BackwardPost), ..d() },
            builder_v: "BACKWARD_POST",
            env: "backward_pre", // Accelerate upper-cases the variable
            env_v: "BACKWARD_PRE",
            file: "fsdp_backward_prefetch: BACKWARD_POST",
            file_v: "BACKWARD_POST",
            default_v: "NO_PREFETCH",
            builder_default: AcceleratorConfig { fsdp_backward_prefetch: Some(BackwardPrefetch::NoPrefetch), ..d() },
            env_default: "NO_PREFETCH",
        },
        Row {
            setting: "fsdp_forward_prefetch",
            builder: AcceleratorConfig { fsdp_forward_prefetch: Some(true), ..d() },
            builder_v: "true",
            env: "True",
            env_v: "true",
            file: "fsdp_forward_prefetch: true",
            file_v: "true",
            default_v: "false",
            builder_default: AcceleratorConfig { fsdp_forward_prefetch: Some(false), ..d() },
            env_default: "false", // what Accelerate's launcher writes: str(False).lower()
        },
        Row {
            setting: "split_batches",
            builder: AcceleratorConfig { split_batches: Some(true), ..d() },
            builder_v: "true",
            env: "yes",
            env_v: "true",
            file: "split_batches: true",
            file_v: "true",
            default_v: "false",
            builder_default: AcceleratorConfig { split_batches: Some(false), ..d() },
            env_default: "no",
        },
        Row {
            setting: "even_batches",
            builder: AcceleratorConfig { even_batches: Some(false), ..d() },
            builder_v: "false",
            env: "off",
            env_v: "false",
            file: "even_batches: false",
            file_v: "false",
            default_v: "true",
            builder_default: AcceleratorConfig { even_batches: Some(true), ..d() },
            env_default: "true",
        },
        Row {
            setting: "seed",
            builder: AcceleratorConfig { seed: Some(7), ..d() },
            builder_v: "7",
            env: "8",
            env_v: "8",
            file: "seed: 9",
            file_v: "9",
            default_v: "not set",
            // A seed has no default value to repeat; "given" still beats the lower sources.
            builder_default: AcceleratorConfig { seed: Some(0), ..d() },
            env_default: "0",
        },
    ];
    for row in rows {
        let var = level2_accelerator::config::env_var(row.setting).unwrap();
        let check = |builder: &AcceleratorConfig, vars: &[(&str, &str)], file: Option<&str>, want: &str, src: Source| {
            let r = resolve_with(builder, vars, file);
            assert_eq!(
                (r.value_of(row.setting).as_str(), r.source(row.setting)),
                (want, src),
                "{}: builder {builder:?}, env {vars:?}, file {file:?}",
                row.setting
            );
        };
        let none = d();
        check(&none, &[], None, row.default_v, Source::Default);
        check(&none, &[], Some(row.file), row.file_v, Source::ConfigFile);
        check(&none, &[(var, row.env)], Some(row.file), row.env_v, Source::Env);
        check(&row.builder, &[(var, row.env)], Some(row.file), row.builder_v, Source::Builder);
        // "Given as the default" beats a lower source's other value.
        let default_shown = if row.setting == "seed" { "0" } else { row.default_v };
        check(&row.builder_default, &[(var, row.env)], Some(row.file), default_shown, Source::Builder);
        check(&none, &[(var, row.env_default)], Some(row.file), default_shown, Source::Env);
    }
}

#[test]
fn distributed_type_fsdp_in_the_file_turns_fsdp_on_but_an_explicit_env_false_wins() {
    let r = resolve_with(&AcceleratorConfig::default(), &[("ACCELERATE_USE_FSDP", "false")], Some("distributed_type: FSDP"));
    assert!(!r.use_fsdp);
    assert_eq!(r.source("use_fsdp"), Source::Env);
    let r = resolve_with(&AcceleratorConfig::default(), &[], Some("distributed_type: MULTI_CPU"));
    assert!(!r.use_fsdp);
    assert_eq!(r.source("use_fsdp"), Source::Default);
}

fn full_config() -> AcceleratorConfig {
    AcceleratorConfig {
        distributed_type: Some(DistributedType::Fsdp),
        num_processes: Some(4),
        num_machines: Some(2),
        machine_rank: Some(1),
        main_process_ip: Some("10.0.0.1".into()),
        main_process_port: Some(29501),
        mixed_precision: Some(Precision::Bf16),
        gradient_accumulation_steps: Some(4),
        cpu: Some(true),
        use_fsdp: Some(true),
        fsdp_sharding_strategy: Some(ShardingStrategy::ShardGradOp),
        fsdp_min_num_params: Some(0),
        fsdp_backward_prefetch: Some(BackwardPrefetch::BackwardPost),
        fsdp_forward_prefetch: Some(true),
        fsdp_offload_params: Some(true),
        fsdp_activation_checkpointing: Some(true),
        parallelism_config_dp_shard_size: Some(2),
        zero_stage: Some(0),
        offload_optimizer_device: Some(ladder_core::parallel::OffloadDevice::Nvme),
        offload_optimizer_nvme_path: Some("/local_nvme".into()),
        split_batches: Some(false),
        even_batches: Some(true),
        seed: Some(42),
        log_with: Some(level2_accelerator::tracking::LogWith::Tensorboard),
        project_dir: Some("runs".into()),
    }
}

#[test]
fn config_files_round_trip_in_every_format() {
    let dir = tempfile::tempdir().unwrap();
    let partial = AcceleratorConfig { num_processes: Some(2), mixed_precision: Some(Precision::No), ..Default::default() };
    for name in ["c.yaml", "c.yml", "c.toml", "c.json", "sub/dir/c.YAML"] {
        for cfg in [full_config(), partial.clone(), AcceleratorConfig::default()] {
            let path = dir.path().join(name);
            cfg.save(&path).unwrap();
            assert_eq!(AcceleratorConfig::load(&path).unwrap(), cfg, "{name}");
            // Written 0644, nothing left behind but the file.
            use std::os::unix::fs::PermissionsExt;
            assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o644);
            assert_eq!(std::fs::read_dir(path.parent().unwrap()).unwrap().filter(|e| e.as_ref().unwrap().path().is_file()).count(), 1);
            std::fs::remove_file(&path).unwrap();
        }
    }
}

#[test]
fn written_files_hold_exactly_the_given_settings() {
    insta::assert_snapshot!("full_yaml", full_config().to_string_as(ConfigFormat::Yaml).unwrap());
    insta::assert_snapshot!("full_toml", full_config().to_string_as(ConfigFormat::Toml).unwrap());
    // Given as the default is written; not given is not.
    let partial = AcceleratorConfig { mixed_precision: Some(Precision::No), even_batches: Some(true), ..Default::default() };
    assert_eq!(partial.to_string_as(ConfigFormat::Yaml).unwrap(), "mixed_precision: no\neven_batches: true\n");
    assert_eq!(AcceleratorConfig::default().to_string_as(ConfigFormat::Yaml).unwrap(), "{}\n");
}

#[test]
fn accelerates_own_spellings_are_read() {
    let dir = tempfile::tempdir().unwrap();
    let p = write(
        dir.path(),
        "a.yaml",
        "distributed_type: MULTI_CPU\nnum_processes: 2\nmixed_precision: bf16\nuse_cpu: true\nfsdp_sharding_strategy: shard-grad-op\n",
    );
    let c = AcceleratorConfig::load(&p).unwrap();
    assert_eq!(c.distributed_type, Some(DistributedType::MultiCpu));
    assert_eq!(c.cpu, Some(true));
    assert_eq!(c.fsdp_sharding_strategy, Some(ShardingStrategy::ShardGradOp));
    // An empty file is the empty config.
    assert_eq!(AcceleratorConfig::load(write(dir.path(), "e.toml", "\n")).unwrap(), AcceleratorConfig::default());
    for (text, want) in [
        ("FULL_SHARD", ShardingStrategy::FullShard),
        ("full-shard", ShardingStrategy::FullShard),
        ("1", ShardingStrategy::FullShard),
        ("shard_grad_op", ShardingStrategy::ShardGradOp),
        ("3", ShardingStrategy::NoShard),
    ] {
        assert_eq!(text.parse::<ShardingStrategy>(), Ok(want), "{text}");
    }
    // Backward prefetch: Accelerate's names in any case (it upper-cases them), PyTorch's
    // BackwardPrefetch numbers 1 and 2, and our kebab-case; in files the names.
    for (text, want) in [
        ("BACKWARD_PRE", BackwardPrefetch::BackwardPre),
        ("backward_pre", BackwardPrefetch::BackwardPre),
        ("1", BackwardPrefetch::BackwardPre),
        ("BACKWARD_POST", BackwardPrefetch::BackwardPost),
        ("backward-post", BackwardPrefetch::BackwardPost),
        ("2", BackwardPrefetch::BackwardPost),
        ("NO_PREFETCH", BackwardPrefetch::NoPrefetch),
        ("No_Prefetch", BackwardPrefetch::NoPrefetch),
    ] {
        assert_eq!(text.parse::<BackwardPrefetch>(), Ok(want), "{text}");
    }
    for bad in ["3", "0", "BACKWARD", "PRE", "none", ""] {
        assert!(bad.parse::<BackwardPrefetch>().is_err(), "{bad:?} must be refused");
    }
    let p = write(dir.path(), "p.yaml", "fsdp_backward_prefetch: backward_pre\nfsdp_forward_prefetch: true\n");
    let c = AcceleratorConfig::load(&p).unwrap();
    assert_eq!((c.fsdp_backward_prefetch, c.fsdp_forward_prefetch), (Some(BackwardPrefetch::BackwardPre), Some(true)));
    let p = write(dir.path(), "p.toml", "fsdp_backward_prefetch = \"NO_PREFETCH\"\n");
    assert_eq!(AcceleratorConfig::load(&p).unwrap().fsdp_backward_prefetch, Some(BackwardPrefetch::NoPrefetch));
}

/// The resolved settings reach the core's WrapConfig (what `prepare_model` wraps with), from
/// every source; `NO_PREFETCH` is the core's `None`.
#[test]
fn resolved_prefetch_settings_reach_the_wrap_config() {
    let fsdp = |extra: AcceleratorConfig| AcceleratorConfig {
        use_fsdp: Some(true),
        fsdp_sharding_strategy: Some(ShardingStrategy::FullShard),
        fsdp_min_num_params: Some(0),
        ..extra
    };
    let fsdp_options = |w: WrapConfig| match w.strategy {
        Strategy::Fsdp(o) => o,
        other => panic!("expected FSDP, got {other:?}"),
    };
    let ddp = |bucket_cap_mb| DistributedDataParallelKwargs { bucket_cap_mb, ..Default::default() };
    // Nothing given: Accelerate's defaults, not the core's (PyTorch's BACKWARD_PRE).
    let o = fsdp_options(resolve_with(&fsdp(AcceleratorConfig::default()), &[], None).wrap_config(ddp(25.0)));
    assert_eq!((o.sharding_strategy, o.min_num_params), (ShardingStrategy::FullShard, 0));
    assert_eq!((o.backward_prefetch, o.forward_prefetch), (BackwardPrefetch::NoPrefetch, false));
    assert_ne!(o.backward_prefetch, FsdpOptions::default().backward_prefetch);
    // From the builder.
    let b = fsdp(AcceleratorConfig {
        fsdp_backward_prefetch: Some(BackwardPrefetch::BackwardPre),
        fsdp_forward_prefetch: Some(true),
        ..Default::default()
    });
    let o = fsdp_options(resolve_with(&b, &[("FSDP_BACKWARD_PREFETCH", "BACKWARD_POST")], None).wrap_config(ddp(25.0)));
    assert_eq!((o.backward_prefetch, o.forward_prefetch), (BackwardPrefetch::BackwardPre, true));
    // From the launcher's variables, over the file.
    let w = resolve_with(
        &fsdp(AcceleratorConfig::default()),
        &[("FSDP_BACKWARD_PREFETCH", "BACKWARD_POST"), ("FSDP_FORWARD_PREFETCH", "true")],
        Some("fsdp_backward_prefetch: BACKWARD_PRE\nfsdp_forward_prefetch: false\n"),
    )
    .wrap_config(ddp(25.0));
    let o = fsdp_options(w);
    assert_eq!((o.backward_prefetch, o.forward_prefetch), (BackwardPrefetch::BackwardPost, true));
    // From the file.
    let w = resolve_with(&fsdp(AcceleratorConfig::default()), &[], Some("fsdp_backward_prefetch: BACKWARD_PRE\n")).wrap_config(ddp(25.0));
    assert_eq!(fsdp_options(w).backward_prefetch, BackwardPrefetch::BackwardPre);
    // The rest of the wrap config: DDP with its bucket cap, bf16 compute with fp32 reduction.
    let w =
        resolve_with(&AcceleratorConfig { mixed_precision: Some(Precision::Bf16), ..Default::default() }, &[], None).wrap_config(ddp(10.0));
    assert_eq!(w.strategy, Strategy::Ddp(ddp(10.0)));
    let mp = w.mixed_precision.policy().expect("bf16 policy");
    assert_eq!((mp.param_dtype, mp.reduce_dtype), (Dtype::Bf16, Dtype::F32));
}

/// DeepSpeed's zero_stage runs on the core's strategies (1: DDP with ZeRO-1, 2: SHARD_GRAD_OP,
/// 3: FULL_SHARD, keeping the FSDP settings' other values), and fsdp_activation_checkpointing
/// reaches the wrap config under DDP and FSDP alike, from the file and the launcher's variables.
#[test]
fn zero_stage_and_activation_checkpointing_reach_the_wrap_config() {
    let kw = DistributedDataParallelKwargs::default();
    let wrap = |env: &[(&str, &str)], file: Option<&str>| resolve_with(&AcceleratorConfig::default(), env, file).wrap_config(kw);
    let w = wrap(&[("ACCELERATE_DEEPSPEED_ZERO_STAGE", "1")], None);
    assert_eq!(w.strategy, Strategy::Ddp(DistributedDataParallelKwargs { zero_redundancy_optimizer: true, ..kw }));
    assert!(!w.activation_checkpointing);
    let w = wrap(&[], Some("zero_stage: 2\nfsdp_min_num_params: 0\nfsdp_activation_checkpointing: true\n"));
    match w.strategy {
        Strategy::Fsdp(o) => assert_eq!((o.sharding_strategy, o.min_num_params), (ShardingStrategy::ShardGradOp, 0)),
        other => panic!("zero_stage 2: expected FSDP, got {other:?}"),
    }
    assert!(w.activation_checkpointing);
    assert_eq!(wrap(&[], Some("zero_stage: 3\n")).strategy.sharding(), Some(ShardingStrategy::FullShard));
    assert_eq!(wrap(&[("ACCELERATE_DEEPSPEED_ZERO_STAGE", "0")], None).strategy, Strategy::Ddp(kw));
    let w = wrap(&[("FSDP_ACTIVATION_CHECKPOINTING", "true")], None);
    assert_eq!((w.strategy, w.activation_checkpointing), (Strategy::Ddp(kw), true));
}

/// Accelerate's config files nest the DeepSpeed settings under `deepspeed_config:`: the
/// honoured ones are read from there as from the top level, in YAML, JSON and TOML.
#[test]
fn deepspeed_config_section_is_read_as_accelerate_writes_it() {
    let dir = tempfile::tempdir().unwrap();
    let nvme = dir.path().display().to_string();
    let yaml = format!(
        "deepspeed_config:\n  zero_stage: 1\n  offload_optimizer_device: nvme\n  offload_optimizer_nvme_path: {nvme}\nnum_processes: 2\n"
    );
    let json = format!(
        "{{\"num_processes\": 2, \"deepspeed_config\": {{\"zero_stage\": 1, \"offload_optimizer_device\": \"nvme\", \"offload_optimizer_nvme_path\": \"{nvme}\"}}}}"
    );
    let toml = format!("num_processes = 2\n[deepspeed_config]\nzero_stage = 1\noffload_optimizer_device = \"nvme\"\noffload_optimizer_nvme_path = \"{nvme}\"\n");
    let top = AcceleratorConfig {
        num_processes: Some(2),
        zero_stage: Some(1),
        offload_optimizer_device: Some(ladder_core::parallel::OffloadDevice::Nvme),
        offload_optimizer_nvme_path: Some(dir.path().to_path_buf()),
        ..Default::default()
    };
    for (name, text) in [("c.yaml", &yaml), ("c.json", &json), ("c.toml", &toml)] {
        let cfg = AcceleratorConfig::load(write(dir.path(), name, text)).unwrap();
        assert_eq!(cfg, top, "{name}");
    }
    // And through the resolution, to the strategy: ZeRO-1.
    let kw = DistributedDataParallelKwargs::default();
    let w = resolve_with(&AcceleratorConfig::default(), &[], Some("deepspeed_config:\n  zero_stage: 1\n")).wrap_config(kw);
    assert_eq!(w.strategy, Strategy::Ddp(DistributedDataParallelKwargs { zero_redundancy_optimizer: true, ..kw }));
}

#[test]
fn banner_names_every_source() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(dir.path(), "c.yaml", "gradient_accumulation_steps: 4\nseed: 3\n");
    let builder = AcceleratorConfig { even_batches: Some(true), ..Default::default() };
    let r = ResolvedConfig::resolve(
        &builder,
        env_of(&[("ACCELERATE_MIXED_PRECISION", "bf16"), ("ACCELERATE_CONFIG_FILE", &file), ("ACCELERATE_SEED", "5")]),
    )
    .unwrap();
    insta::assert_snapshot!(r.banner().replace(&dir.path().display().to_string(), "[DIR]"));
}

/// The error of resolving with `vars` (and `file` as `c.<ext>` when given), the temp dir masked.
fn resolve_err(builder: &AcceleratorConfig, vars: &[(&str, &str)], file: Option<(&str, &str)>) -> String {
    let dir = tempfile::tempdir().unwrap();
    let mut all: Vec<(&str, &str)> = vars.to_vec();
    let path;
    if let Some((name, text)) = file {
        path = write(dir.path(), name, text);
        all.push(("ACCELERATE_CONFIG_FILE", &path));
    }
    let err = ResolvedConfig::resolve(builder, env_of(&all)).expect_err("must fail").to_string();
    err.replace(&dir.path().display().to_string(), "[DIR]")
}

#[test]
fn error_messages() {
    let none = AcceleratorConfig::default();
    let mut out = Vec::new();
    let mut case = |title: &str, msg: String| out.push(format!("{title}:\n  {msg}"));
    case("fp8 in the env", resolve_err(&none, &[("ACCELERATE_MIXED_PRECISION", "fp8")], None));
    case("unknown precision in the env", resolve_err(&none, &[("ACCELERATE_MIXED_PRECISION", "half")], None));
    case("zero accumulation steps in the env", resolve_err(&none, &[("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "0")], None));
    case("empty variable", resolve_err(&none, &[("ACCELERATE_USE_CPU", "")], None));
    case("bad bool", resolve_err(&none, &[("ACCELERATE_EVEN_BATCHES", "maybe")], None));
    case("unknown sharding strategy", resolve_err(&none, &[("FSDP_SHARDING_STRATEGY", "HYBRID")], None));
    case("zero dp_shard_size in the env", resolve_err(&none, &[("PARALLELISM_CONFIG_DP_SHARD_SIZE", "0")], None));
    case("negative min_num_params", resolve_err(&none, &[("FSDP_MIN_NUM_PARAMS", "-1")], None));
    case("unknown backward prefetch in the env", resolve_err(&none, &[("FSDP_BACKWARD_PREFETCH", "BACKWARD")], None));
    case("PyTorch number 3 for backward prefetch", resolve_err(&none, &[("FSDP_BACKWARD_PREFETCH", "3")], None));
    case("bad forward prefetch in the env", resolve_err(&none, &[("FSDP_FORWARD_PREFETCH", "sometimes")], None));
    case("bad backward prefetch in yaml", resolve_err(&none, &[], Some(("c.yaml", "fsdp_backward_prefetch: PREFETCH\n"))));
    case("forward prefetch not a bool in toml", resolve_err(&none, &[], Some(("c.toml", "fsdp_forward_prefetch = \"yes\"\n"))));
    case("bad seed", resolve_err(&none, &[("ACCELERATE_SEED", "abc")], None));
    case(
        "fp16 from the builder with cpu from the env",
        resolve_err(&AcceleratorConfig { mixed_precision: Some(Precision::Fp16), ..none.clone() }, &[("ACCELERATE_USE_CPU", "true")], None),
    );
    case("fp16 and cpu in one file", resolve_err(&none, &[], Some(("c.yaml", "mixed_precision: fp16\ncpu: true\n"))));
    case(
        "zero accumulation steps in the builder",
        resolve_err(&AcceleratorConfig { gradient_accumulation_steps: Some(0), ..none.clone() }, &[], None),
    );
    case("zero accumulation steps in a file", resolve_err(&none, &[], Some(("c.toml", "gradient_accumulation_steps = 0\n"))));
    case("unknown key in yaml", resolve_err(&none, &[], Some(("c.yaml", "mixed_precison: bf16\n"))));
    case("wrong type in yaml", resolve_err(&none, &[], Some(("c.yaml", "num_processes: two\n"))));
    case("bad precision in yaml", resolve_err(&none, &[], Some(("c.yaml", "mixed_precision: fp8\n"))));
    case("malformed yaml", resolve_err(&none, &[], Some(("c.yaml", "seed: 1\nmixed_precision: bf16: x\n"))));
    case("yaml that is not a mapping", resolve_err(&none, &[], Some(("c.yaml", "- bf16\n"))));
    case("malformed toml", resolve_err(&none, &[], Some(("c.toml", "num_processes = \n"))));
    case("wrong type in toml", resolve_err(&none, &[], Some(("c.toml", "seed = \"x\"\n"))));
    case("malformed json", resolve_err(&none, &[], Some(("c.json", "{\"seed\": }"))));
    case("unsupported extension", resolve_err(&none, &[], Some(("c.ini", "seed=1"))));
    case("machine_rank out of range", resolve_err(&none, &[], Some(("c.yaml", "num_machines: 2\nmachine_rank: 2\n"))));
    case("processes not a multiple of machines", resolve_err(&none, &[], Some(("c.yaml", "num_machines: 2\nnum_processes: 3\n"))));
    case("port 0", resolve_err(&none, &[], Some(("c.yaml", "main_process_port: 0\n"))));
    case("port too large", resolve_err(&none, &[], Some(("c.yaml", "main_process_port: 70000\n"))));
    case("FSDP type with use_fsdp false", resolve_err(&none, &[], Some(("c.yaml", "distributed_type: FSDP\nuse_fsdp: false\n"))));
    case("ZeRO stage 4 in the env", resolve_err(&none, &[("ACCELERATE_DEEPSPEED_ZERO_STAGE", "4")], None));
    case(
        "ZeRO stage 2 with use_fsdp",
        resolve_err(&none, &[("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")], Some(("c.yaml", "use_fsdp: true\n"))),
    );
    case("ZeRO stage 1 with bf16", resolve_err(&none, &[], Some(("c.yaml", "zero_stage: 1\nmixed_precision: bf16\n"))));
    case(
        "DeepSpeed key not honoured under deepspeed_config",
        resolve_err(&none, &[], Some(("c.yaml", "deepspeed_config:\n  zero_stage: 2\n  offload_param_device: none\n"))),
    );
    case(
        "zero_stage at the top level and under deepspeed_config",
        resolve_err(&none, &[], Some(("c.json", "{\"zero_stage\": 1, \"deepspeed_config\": {\"zero_stage\": 2}}"))),
    );
    case("deepspeed_config not a mapping", resolve_err(&none, &[], Some(("c.yaml", "deepspeed_config: 2\n"))));
    case("ZeRO stage 4 under deepspeed_config", resolve_err(&none, &[], Some(("c.yaml", "deepspeed_config:\n  zero_stage: 4\n"))));
    case("activation checkpointing not a bool", resolve_err(&none, &[("FSDP_ACTIVATION_CHECKPOINTING", "sometimes")], None));
    case("missing file", resolve_err(&none, &[("ACCELERATE_CONFIG_FILE", "/nonexistent/ddp-ladder/c.yaml")], None));
    case("empty ACCELERATE_CONFIG_FILE", resolve_err(&none, &[("ACCELERATE_CONFIG_FILE", "")], None));
    insta::assert_snapshot!(out.join("\n"));
}

#[test]
fn unreadable_and_unwritable_files_name_the_file() {
    let dir = tempfile::tempdir().unwrap();
    // A directory is not a readable config file.
    let d = dir.path().join("d.yaml");
    std::fs::create_dir(&d).unwrap();
    let err = AcceleratorConfig::load(&d).unwrap_err().to_string();
    assert!(err.starts_with(&format!("config file {}: cannot read it: ", d.display())), "{err}");
    // A parent that is a file cannot hold the config.
    let f = dir.path().join("f");
    std::fs::write(&f, "x").unwrap();
    let target = f.join("c.yaml");
    let err = full_config().save(&target).unwrap_err().to_string();
    assert!(err.starts_with(&format!("config file {}: cannot write it: ", target.display())), "{err}");
    let err = full_config().save(dir.path().join("c.txt")).unwrap_err().to_string();
    assert!(err.ends_with("unsupported extension \"txt\"; expected .yaml, .yml, .toml or .json"), "{err}");
}

#[test]
fn env_vars_for_launch_read_back_to_the_same_values() {
    let cfg = full_config();
    let vars = cfg.to_env_vars();
    let names: Vec<&str> = vars.iter().map(|(k, _)| *k).collect();
    assert_eq!(names, SETTINGS.iter().map(|(_, v)| *v).collect::<Vec<_>>());
    let pairs: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (*k, v.as_str())).collect();
    // fp16 is not in full_config (it has cpu); everything comes back from Env.
    let r = ResolvedConfig::resolve(&AcceleratorConfig::default(), env_of(&pairs)).unwrap();
    assert!(r.sources.values().all(|s| *s == Source::Env));
    assert_eq!(
        (r.mixed_precision, r.gradient_accumulation_steps, r.cpu, r.use_fsdp, r.fsdp_sharding_strategy, r.fsdp_min_num_params),
        (Precision::Bf16, 4, true, true, ShardingStrategy::ShardGradOp, 0)
    );
    assert_eq!((r.fsdp_backward_prefetch, r.fsdp_forward_prefetch), (BackwardPrefetch::BackwardPost, true));
    assert_eq!((r.split_batches, r.even_batches, r.seed), (false, true, Some(42)));
    // Nothing given, nothing exported.
    assert!(AcceleratorConfig::default().to_env_vars().is_empty());
}

/// An FSDP config file as Accelerate 1.16's `accelerate config` writes it (FSDP1, CPU).
const ACCELERATE_FSDP_YAML: &str = "compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
enable_cpu_affinity: false
fsdp_config:
  fsdp_activation_checkpointing: false
  fsdp_auto_wrap_policy: SIZE_BASED_WRAP
  fsdp_backward_prefetch: BACKWARD_PRE
  fsdp_cpu_ram_efficient_loading: true
  fsdp_forward_prefetch: false
  fsdp_min_num_params: 100000
  fsdp_offload_params: true
  fsdp_reshard_after_forward: FULL_SHARD
  fsdp_state_dict_type: FULL_STATE_DICT
  fsdp_sync_module_states: true
  fsdp_use_orig_params: true
  fsdp_version: 1
machine_rank: 0
main_training_function: main
mixed_precision: 'no'
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: true
";

/// The files `accelerate config` writes are read as written: the settings nested under
/// `fsdp_config:` as the flat keys of the same name (`fsdp_reshard_after_forward` as the
/// sharding strategy), the informational keys accepted at the value implemented here, and
/// refused by name, with the reason, at another.
#[test]
fn accelerates_own_files_are_read_as_written() {
    let dir = tempfile::tempdir().unwrap();
    let load = |name: &str, text: &str| AcceleratorConfig::load(write(dir.path(), name, text));
    // `accelerate config default --config_file c.json` (Accelerate 1.16), verbatim.
    let default = r#"{
  "compute_environment": "LOCAL_MACHINE",
  "debug": false,
  "distributed_type": "NO",
  "downcast_bf16": false,
  "enable_cpu_affinity": false,
  "machine_rank": 0,
  "main_training_function": "main",
  "mixed_precision": "no",
  "num_machines": 1,
  "num_processes": 1,
  "rdzv_backend": "static",
  "same_network": false,
  "tpu_use_cluster": false,
  "tpu_use_sudo": false,
  "use_cpu": true
}"#;
    let flat =
        r#"{"distributed_type": "NO", "machine_rank": 0, "mixed_precision": "no", "num_machines": 1, "num_processes": 1, "use_cpu": true}"#;
    assert_eq!(load("default.json", default).unwrap(), load("flat.json", flat).unwrap());
    let flat_fsdp = "distributed_type: FSDP\nfsdp_activation_checkpointing: false\nfsdp_backward_prefetch: BACKWARD_PRE\n\
                     fsdp_forward_prefetch: false\nfsdp_min_num_params: 100000\nfsdp_offload_params: true\n\
                     fsdp_sharding_strategy: FULL_SHARD\nmachine_rank: 0\nmixed_precision: 'no'\nnum_machines: 1\n\
                     num_processes: 2\nuse_cpu: true\n";
    let fsdp = load("fsdp.yaml", ACCELERATE_FSDP_YAML).unwrap();
    assert_eq!(fsdp, load("flat.yaml", flat_fsdp).unwrap());
    assert_eq!(fsdp.fsdp_offload_params, Some(true));
    // FSDP2's boolean spelling: reshard after forward or not (ZeRO-3 or ZeRO-2).
    for (b, strategy) in [("true", "FULL_SHARD"), ("false", "SHARD_GRAD_OP")] {
        let nested = load("b.toml", &format!("[fsdp_config]\nfsdp_reshard_after_forward = {b}\n")).unwrap();
        assert_eq!(nested, load("s.toml", &format!("fsdp_sharding_strategy = \"{strategy}\"\n")).unwrap());
    }
    // parallelism_config's one key.
    let p = load("p.yaml", "parallelism_config:\n  parallelism_config_dp_shard_size: 2\n").unwrap();
    assert_eq!(p, load("q.yaml", "parallelism_config_dp_shard_size: 2\n").unwrap());
    let refused: Vec<String> = [
        ("compute_environment: LOCAL_MACHINE", "compute_environment: AMAZON_SAGEMAKER"),
        ("fsdp_state_dict_type: FULL_STATE_DICT", "fsdp_state_dict_type: SHARDED_STATE_DICT"),
        ("fsdp_version: 1", "fsdp_version: 2"),
        ("fsdp_auto_wrap_policy: SIZE_BASED_WRAP", "fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP"),
        ("fsdp_sync_module_states: true", "fsdp_sync_module_states: false"),
        ("fsdp_use_orig_params: true", "fsdp_transformer_layer_cls_to_wrap: BertLayer"),
        ("enable_cpu_affinity: false", "enable_cpu_affinity: true"),
        ("tpu_env: []", "tpu_env: [A=1]"),
        ("num_machines: 1", "num_machines: 1\nfsdp_offload_params: false"),
        ("fsdp_config:\n", "fsdp_config: 3\nx:\n"),
    ]
    .iter()
    .map(|(from, to)| {
        assert!(ACCELERATE_FSDP_YAML.contains(from), "{from}");
        let err = load("c.yaml", &ACCELERATE_FSDP_YAML.replacen(from, to, 1)).unwrap_err().to_string();
        format!("{to:?}\n  {}", err.replace(&dir.path().display().to_string(), "[DIR]"))
    })
    .collect();
    insta::assert_snapshot!(refused.join("\n"));
}
