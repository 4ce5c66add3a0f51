//! TrainingArguments: Transformers' defaults, file + command line merging (flags win), the
//! resolved arguments written to output_dir, and validation errors that name the field.

use level3_trainer::args::{IntervalStrategy, ReportTo, SchedulerType, TrainingArguments};
use level3_trainer::Error;

fn parse(flags: &[&str]) -> Result<TrainingArguments, Error> {
    TrainingArguments::parse_from_cli(std::iter::once("training-args").chain(flags.iter().copied()))
}

#[test]
fn defaults_are_transformers_and_clap_agrees_with_default() {
    let d = TrainingArguments::default();
    assert_eq!(parse(&[]).unwrap(), d);
    assert_eq!((d.per_device_train_batch_size, d.per_device_eval_batch_size), (8, 8));
    assert_eq!((d.num_train_epochs, d.max_steps, d.learning_rate, d.weight_decay), (3.0, -1, 5e-5, 0.0));
    assert_eq!((d.adam_beta1, d.adam_beta2, d.adam_epsilon, d.max_grad_norm), (0.9, 0.999, 1e-8, 1.0));
    assert_eq!(d.lr_scheduler_type, SchedulerType::Linear);
    assert_eq!((d.warmup_steps, d.warmup_ratio, d.gradient_accumulation_steps), (0, 0.0, 1));
    assert_eq!(
        (d.eval_strategy, d.logging_strategy, d.save_strategy),
        (IntervalStrategy::No, IntervalStrategy::Steps, IntervalStrategy::Steps)
    );
    assert_eq!((d.logging_steps, d.save_steps, d.eval_steps(), d.save_total_limit), (500, 500, 500, None));
    assert_eq!((d.seed, d.data_seed(), d.report_to), (42, 42, ReportTo::None));
    assert_eq!(d.best_metric_key(), None);
}

#[test]
fn metric_prefix_is_normalised_and_direction_follows_the_name() {
    let mut a = TrainingArguments { load_best_model_at_end: true, ..Default::default() };
    assert_eq!(a.best_metric_key().as_deref(), Some("eval_loss"));
    assert!(!a.greater_is_better());
    for name in ["accuracy", "eval_accuracy"] {
        a.metric_for_best_model = Some(name.into());
        assert_eq!(a.best_metric_key().as_deref(), Some("eval_accuracy"));
        assert!(a.greater_is_better());
        a.validate_metric(&["loss", "accuracy"]).unwrap();
    }
    a.greater_is_better = Some(false);
    assert!(!a.greater_is_better());
    a.metric_for_best_model = Some("f1".into());
    insta::assert_snapshot!(a.validate_metric(&["loss", "accuracy"]).unwrap_err().to_string(), @"TrainingArguments.metric_for_best_model = \"f1\": unknown metric; available: loss (or eval_loss), accuracy (or eval_accuracy)");
}

#[test]
fn file_then_flags_json_and_toml() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("args.json");
    std::fs::write(&json, r#"{"learning_rate": 0.001, "per_device_train_batch_size": 64, "lr_scheduler_type": "constant_with_warmup", "eval_strategy": "epoch", "seed": 7}"#).unwrap();
    let a = parse(&["--args-file", json.to_str().unwrap(), "--seed", "9", "--learning-rate", "5e-5"]).unwrap();
    assert_eq!(a.per_device_train_batch_size, 64); // from the file
    assert_eq!(a.lr_scheduler_type, SchedulerType::ConstantWithWarmup);
    assert_eq!(a.eval_strategy, IntervalStrategy::Epoch);
    assert_eq!((a.seed, a.learning_rate), (9, 5e-5)); // flags win, even when equal to a default
    assert_eq!(a.num_train_epochs, 3.0); // neither: the default

    let toml = dir.path().join("args.toml");
    std::fs::write(&toml, "gradient_accumulation_steps = 4\nfsdp = \"full_shard\"\nreport_to = \"jsonl\"\n").unwrap();
    let a = parse(&["--args-file", toml.to_str().unwrap(), "--per-device-train-batch-size", "16"]).unwrap();
    assert_eq!((a.gradient_accumulation_steps, a.per_device_train_batch_size), (4, 16));
    assert_eq!(a.report_to, ReportTo::Jsonl);

    // Written to output_dir/training_args.json, and read back to the same arguments.
    let out = dir.path().join("out");
    let a = TrainingArguments { output_dir: out.clone(), ..a };
    let written = a.write_json().unwrap();
    assert_eq!(written, out.join("training_args.json"));
    let back = TrainingArguments::from_file(&written).unwrap();
    assert_eq!(TrainingArguments { args_file: a.args_file.clone(), ..back }, a);
}

#[test]
fn file_errors_name_the_file_and_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, r#"{"learning_rte": 0.1}"#).unwrap();
    let msg = parse(&["--args-file", bad.to_str().unwrap()]).unwrap_err().to_string();
    assert!(msg.starts_with(&format!("{}: cannot read training arguments: unknown field `learning_rte`", bad.display())), "{msg}");
    let missing = dir.path().join("missing.toml");
    let msg = parse(&["--args-file", missing.to_str().unwrap()]).unwrap_err().to_string();
    assert!(msg.contains("missing.toml: cannot read training arguments"), "{msg}");
}

#[test]
fn validation_errors_name_the_field() {
    let err = |flags: &[&str]| parse(flags).unwrap_err().to_string();
    insta::assert_snapshot!(err(&["--warmup-ratio", "1.5"]), @"TrainingArguments.warmup_ratio = 1.5: expected a fraction of the total steps in [0, 1]");
    insta::assert_snapshot!(err(&["--per-device-train-batch-size", "0"]), @"TrainingArguments.per_device_train_batch_size = 0: expected at least 1");
    insta::assert_snapshot!(err(&["--max-steps", "0"]), @"TrainingArguments.max_steps = 0: expected a positive number of optimization steps, or -1 to use num_train_epochs");
    insta::assert_snapshot!(err(&["--load-best-model-at-end"]), @"TrainingArguments.load_best_model_at_end = true: expected an eval_strategy other than `no` (the best model is chosen by evaluation)");
    insta::assert_snapshot!(err(&["--load-best-model-at-end", "--eval-strategy", "epoch"]), @"TrainingArguments.load_best_model_at_end = true: expected save_strategy equal to eval_strategy (they are Steps and Epoch)");
    insta::assert_snapshot!(err(&["--load-best-model-at-end", "--eval-strategy", "steps", "--eval-steps", "300"]), @"TrainingArguments.save_steps = 500: expected a round multiple of eval_steps (300) with load_best_model_at_end");
    insta::assert_snapshot!(err(&["--save-total-limit", "0"]), @"TrainingArguments.save_total_limit = 0: expected at least 1 checkpoint kept (or leave it unset to keep all)");
    insta::assert_snapshot!(err(&["--adam-beta2", "1"]), @"TrainingArguments.adam_beta2 = 1: expected a value in [0, 1)");
    insta::assert_snapshot!(err(&["--ddp-bucket-cap-mb", "0"]), @"TrainingArguments.ddp_bucket_cap_mb = 0: expected a positive number of MiB (PyTorch's default: 25)");
    insta::assert_snapshot!(err(&["--ddp-bucket-cap-mb", "5", "--fsdp", "full_shard"]), @"TrainingArguments.ddp_bucket_cap_mb = 5 together with fsdp FULL_SHARD: expected DDP (FSDP has no gradient buckets)");
    parse(&["--load-best-model-at-end", "--eval-strategy", "steps", "--eval-steps", "250"]).unwrap();
    let msg = err(&["--lr-scheduler-type", "polynomial"]);
    assert!(msg.starts_with("error: invalid value 'polynomial' for '--lr-scheduler-type <LR_SCHEDULER_TYPE>'"), "{msg}");
    assert!(msg.contains("[possible values: linear, cosine, constant, constant_with_warmup]"), "{msg}");
}

/// Transformers' fsdp_config keys backward_prefetch / forward_prefetch: absent = no prefetch
/// and false; given as a JSON object or file on the command line, or as a table in the args
/// file; what the Accelerator then wraps the model with; bad values named.
#[test]
fn fsdp_config_prefetch_keys() {
    use ladder_core::parallel::{BackwardPrefetch, FsdpOptions, ShardingStrategy, Strategy};
    use level2_accelerator::config::ResolvedConfig;
    use level3_trainer::args::FsdpConfig;
    use level3_trainer::Trainer;

    let d = TrainingArguments::default();
    assert_eq!(d.fsdp_config, FsdpConfig { backward_prefetch: BackwardPrefetch::NoPrefetch, forward_prefetch: false });

    let a =
        parse(&["--fsdp", "full_shard", "--fsdp-config", r#"{"backward_prefetch": "backward_post", "forward_prefetch": true}"#]).unwrap();
    assert_eq!(a.fsdp_config, FsdpConfig { backward_prefetch: BackwardPrefetch::BackwardPost, forward_prefetch: true });
    // Transformers upper-cases the value and strips an `fsdp_` prefix from the keys;
    // no_prefetch (Accelerate's name) and null are no prefetch.
    for (json, want) in [
        (r#"{"backward_prefetch": "BACKWARD_PRE"}"#, BackwardPrefetch::BackwardPre),
        (r#"{"fsdp_backward_prefetch": "backward_pre"}"#, BackwardPrefetch::BackwardPre),
        (r#"{"backward_prefetch": "no_prefetch"}"#, BackwardPrefetch::NoPrefetch),
        (r#"{"backward_prefetch": null}"#, BackwardPrefetch::NoPrefetch),
        ("{}", BackwardPrefetch::NoPrefetch),
    ] {
        assert_eq!(parse(&["--fsdp-config", json]).unwrap().fsdp_config.backward_prefetch, want, "{json}");
    }

    let dir = tempfile::tempdir().unwrap();
    // A path to a JSON file, as Transformers' fsdp_config="fsdp_config.json".
    let fsdp_json = dir.path().join("fsdp_config.json");
    std::fs::write(&fsdp_json, r#"{"fsdp_forward_prefetch": true}"#).unwrap();
    let a = parse(&["--fsdp-config", fsdp_json.to_str().unwrap()]).unwrap();
    assert_eq!(a.fsdp_config, FsdpConfig { backward_prefetch: BackwardPrefetch::NoPrefetch, forward_prefetch: true });
    // In the args file as a table; the flag replaces the whole table, as in Transformers.
    let toml = dir.path().join("args.toml");
    std::fs::write(&toml, "fsdp = \"full_shard\"\n[fsdp_config]\nbackward_prefetch = \"backward_pre\"\nforward_prefetch = true\n").unwrap();
    let a = parse(&["--args-file", toml.to_str().unwrap()]).unwrap();
    assert_eq!(a.fsdp_config, FsdpConfig { backward_prefetch: BackwardPrefetch::BackwardPre, forward_prefetch: true });
    let a = parse(&["--args-file", toml.to_str().unwrap(), "--fsdp-config", r#"{"backward_prefetch": "backward_post"}"#]).unwrap();
    assert_eq!(a.fsdp_config, FsdpConfig { backward_prefetch: BackwardPrefetch::BackwardPost, forward_prefetch: false });
    // Written to training_args.json and read back.
    let a = TrainingArguments { output_dir: dir.path().join("out"), ..a };
    let back = TrainingArguments::from_file(&a.write_json().unwrap()).unwrap();
    assert_eq!(back.fsdp_config, a.fsdp_config);

    // Into the Accelerator's settings (explicitly: a launcher's FSDP_BACKWARD_PREFETCH does
    // not override them), and from there into the core's WrapConfig.
    let wrap_of = |a: &TrainingArguments, env: &[(&str, &str)]| {
        let env: Vec<(String, String)> = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let cfg = Trainer::accelerator_config(a);
        let r = ResolvedConfig::resolve(&cfg, |k| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())).unwrap();
        (cfg, r.wrap_config(Default::default()))
    };
    let (cfg, w) = wrap_of(&a, &[("FSDP_BACKWARD_PREFETCH", "BACKWARD_PRE"), ("FSDP_FORWARD_PREFETCH", "true")]);
    assert_eq!((cfg.fsdp_backward_prefetch, cfg.fsdp_forward_prefetch), (Some(BackwardPrefetch::BackwardPost), Some(false)));
    let fsdp_options = |s: Strategy| match s {
        Strategy::Fsdp(o) => o,
        other => panic!("expected FSDP, got {other:?}"),
    };
    let o: FsdpOptions = fsdp_options(w.strategy);
    assert_eq!(
        (o.sharding_strategy, o.backward_prefetch, o.forward_prefetch),
        (ShardingStrategy::FullShard, BackwardPrefetch::BackwardPost, false)
    );
    let full_shard = TrainingArguments { fsdp: Some(ShardingStrategy::FullShard.into()), ..TrainingArguments::default() };
    let (cfg, w) = wrap_of(&full_shard, &[("FSDP_BACKWARD_PREFETCH", "BACKWARD_PRE")]);
    assert_eq!(cfg.fsdp_backward_prefetch, Some(BackwardPrefetch::NoPrefetch));
    let o = fsdp_options(w.strategy);
    assert_eq!((o.backward_prefetch, o.forward_prefetch), (BackwardPrefetch::NoPrefetch, false));

    // Bad values, named.
    let err = |flags: &[&str]| parse(flags).unwrap_err().to_string();
    let msg = err(&["--fsdp-config", r#"{"backward_prefetch": "backward"}"#]);
    assert!(msg.starts_with(r#"error: invalid value '{"backward_prefetch": "backward"}' for '--fsdp-config <JSON|FILE>': fsdp_config: invalid value "backward" for fsdp_config.backward_prefetch: expected backward_pre, backward_post or no_prefetch (no key: no prefetch)"#), "{msg}");
    let msg = err(&["--fsdp-config", r#"{"forward_prefetch": "yes"}"#]);
    assert!(msg.contains("fsdp_config: invalid type: string \"yes\", expected a boolean"), "{msg}");
    let msg = err(&["--fsdp-config", r#"{"limit_all_gathers": true}"#]);
    assert!(msg.contains("fsdp_config: unknown field `limit_all_gathers`, expected one of `backward_prefetch`"), "{msg}");
    let missing = dir.path().join("none.json");
    let msg = err(&["--fsdp-config", missing.to_str().unwrap()]);
    assert!(msg.contains(&format!("cannot read {}", missing.display())), "{msg}");
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, r#"{"fsdp_config": {"backward_prefetch": "BACKWARD_PREFETCH"}}"#).unwrap();
    let msg = err(&["--args-file", bad.to_str().unwrap()]);
    assert!(
        msg.starts_with(&format!("{}: cannot read training arguments: invalid value \"BACKWARD_PREFETCH\" for fsdp_config.backward_prefetch: expected backward_pre, backward_post or no_prefetch", bad.display())),
        "{msg}"
    );
}

/// logging_dir: as given, else Transformers' default output_dir/runs/<Mon DD_HH-MM-SS>_<host>
/// (here for 2024-12-02 13:25:02 UTC).
#[test]
fn logging_dir_defaults_to_transformers_runs_directory() {
    let at = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_733_145_902);
    let a = TrainingArguments::new("out");
    let host = ladder_core::tensorboard::hostname();
    assert_eq!(a.logging_dir_at(at), std::path::Path::new("out/runs").join(format!("Dec02_13-25-02_{host}")));
    let given = TrainingArguments { logging_dir: Some("tb".into()), ..a };
    assert_eq!(given.logging_dir_at(at), std::path::Path::new("tb"));
}
