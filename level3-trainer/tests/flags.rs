//! The `level3-trainer` command line (issue #27, bugs 2, 4 and 6): every TrainingArguments field
//! is a Transformers-style flag, a JSON key and a TOML key, and `--help` lists it; snake_case
//! flags and Transformers' older names are read; level 1's names stay, and one setting given
//! under two names is an error naming both; the launcher's settings are honoured where the
//! arguments leave them, and a contradiction is refused by name; `--device cuda` without CUDA
//! is refused.

use level3_trainer::{Config, Trainer, TrainingArguments};
use std::path::Path;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_level3-trainer");

/// A field, its flag's value (`None`: a bare flag), the same value in an args file (JSON), and
/// the other fields (with JSON values) it needs to be valid.
type Row = (&'static str, Option<&'static str>, &'static str, &'static [(&'static str, &'static str)]);

/// Every TrainingArguments field must be here.
const TABLE: &[Row] = &[
    ("output_dir", Some("o1"), r#""o1""#, &[]),
    ("overwrite_output_dir", None, "true", &[]),
    ("per_device_train_batch_size", Some("16"), "16", &[]),
    ("per_device_eval_batch_size", Some("32"), "32", &[]),
    ("num_train_epochs", Some("2.5"), "2.5", &[]),
    ("max_steps", Some("7"), "7", &[]),
    ("learning_rate", Some("0.0002"), "0.0002", &[]),
    ("weight_decay", Some("0.1"), "0.1", &[]),
    ("adam_beta1", Some("0.8"), "0.8", &[]),
    ("adam_beta2", Some("0.99"), "0.99", &[]),
    ("adam_epsilon", Some("1e-6"), "1e-6", &[]),
    ("max_grad_norm", Some("0.5"), "0.5", &[]),
    ("lr_scheduler_type", Some("cosine"), r#""cosine""#, &[]),
    ("warmup_steps", Some("3"), "3", &[]),
    ("warmup_ratio", Some("0.1"), "0.1", &[]),
    ("gradient_accumulation_steps", Some("4"), "4", &[]),
    ("eval_strategy", Some("steps"), r#""steps""#, &[]),
    ("eval_steps", Some("50"), "50", &[]),
    ("logging_dir", Some("tb"), r#""tb""#, &[]),
    ("logging_strategy", Some("epoch"), r#""epoch""#, &[]),
    ("logging_steps", Some("25"), "25", &[]),
    ("logging_first_step", None, "true", &[]),
    ("save_strategy", Some("no"), r#""no""#, &[]),
    ("save_steps", Some("200"), "200", &[]),
    ("save_total_limit", Some("2"), "2", &[]),
    ("load_best_model_at_end", None, "true", &[("save_strategy", r#""epoch""#)]),
    ("metric_for_best_model", Some("accuracy"), r#""accuracy""#, &[]),
    ("greater_is_better", Some("true"), "true", &[]),
    ("seed", Some("7"), "7", &[]),
    ("data_seed", Some("7"), "7", &[]),
    ("bf16", None, "true", &[]),
    ("gradient_checkpointing", None, "true", &[]),
    ("dataloader_drop_last", None, "true", &[]),
    ("disable_tqdm", None, "true", &[]),
    ("report_to", Some("jsonl"), r#""jsonl""#, &[]),
    ("fsdp", Some("full_shard"), r#""full_shard""#, &[]),
    ("fsdp_min_num_params", Some("0"), "0", &[]),
    ("fsdp_config", Some(r#"{"forward_prefetch": true}"#), r#"{"forward_prefetch": true}"#, &[]),
    ("dp_shard_size", Some("2"), "2", &[]),
    ("deepspeed", Some(r#"{"zero_optimization": {"stage": 1}}"#), r#"{"zero_optimization": {"stage": 1}}"#, &[]),
    ("use_cpu", None, "true", &[]),
    ("ddp_timeout", Some("30"), "30", &[]),
    ("ddp_bucket_cap_mb", Some("5"), "5.0", &[]),
    ("allow_non_finite", None, "true", &[]),
];

fn flag(field: &str) -> String {
    format!("--{}", field.replace('_', "-"))
}

/// The binary's TrainingArguments for `words` (after the program name), as JSON.
fn resolve(words: &[String]) -> serde_json::Value {
    let cfg = Config::try_parse_command_line(std::iter::once("level3-trainer".to_string()).chain(words.iter().cloned()))
        .unwrap_or_else(|e| panic!("{words:?}: {e}"));
    serde_json::to_value(cfg.training_arguments().unwrap_or_else(|e| panic!("{words:?}: {e}"))).unwrap()
}

/// Flags for `field` = `value` (a bare flag for a bool) and for the row's companions.
fn flags_for(field: &str, value: Option<&str>, needs: &[(&str, &str)], spell: impl Fn(&str) -> String) -> Vec<String> {
    let mut words = vec![spell(field)];
    words.extend(value.map(str::to_string));
    for (f, v) in needs {
        words.push(spell(f));
        words.push(serde_json::from_str::<serde_json::Value>(v).unwrap().as_str().unwrap().to_string());
    }
    words
}

#[test]
fn every_field_is_a_flag_a_json_key_a_toml_key_and_listed_by_help() {
    let fields: Vec<String> = serde_json::to_value(TrainingArguments::default()).unwrap().as_object().unwrap().keys().cloned().collect();
    let mut listed: Vec<&str> = TABLE.iter().map(|r| r.0).collect();
    listed.sort_unstable();
    let mut all: Vec<&str> = fields.iter().map(String::as_str).collect();
    all.sort_unstable();
    assert_eq!(listed, all, "a TrainingArguments field is missing from this table (or the table names one that is gone)");

    let dir = tempfile::tempdir().unwrap();
    let default = resolve(&[]);
    let help = Config::command_line().render_long_help().to_string();
    for (field, value, json, needs) in TABLE {
        assert!(
            help.contains(&format!("{} ", flag(field))) || help.contains(&format!("{}\n", flag(field))),
            "--help does not list {}",
            flag(field)
        );
        let by_flag = resolve(&flags_for(field, *value, needs, flag));
        assert_ne!(by_flag[field], default[field], "{field}: the flag changed nothing");
        // HfArgumentParser's spelling.
        let by_snake = resolve(&flags_for(field, *value, needs, |f| format!("--{f}")));
        assert_eq!(by_snake[field], by_flag[field], "{field}: --{field}");
        // The args file, JSON and TOML.
        let mut table: serde_json::Map<String, serde_json::Value> = serde_json::Map::new();
        table.insert(field.to_string(), serde_json::from_str(json).unwrap());
        for (f, v) in *needs {
            table.insert(f.to_string(), serde_json::from_str(v).unwrap());
        }
        let json_file = dir.path().join(format!("{field}.json"));
        std::fs::write(&json_file, serde_json::to_string(&table).unwrap()).unwrap();
        let toml_file = dir.path().join(format!("{field}.toml"));
        std::fs::write(&toml_file, toml::to_string(&table).unwrap()).unwrap();
        for file in [&json_file, &toml_file] {
            let by_file = resolve(&["--args-file".to_string(), file.display().to_string()]);
            assert_eq!(by_file[field], by_flag[field], "{field} from {}", file.display());
        }
    }
}

#[test]
fn older_names_and_list_forms_are_read() {
    let dir = tempfile::tempdir().unwrap();
    let words = |w: &[&str]| w.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    for spelling in ["--evaluation-strategy", "--evaluation_strategy"] {
        assert_eq!(resolve(&words(&[spelling, "steps"]))["eval_strategy"], "steps", "{spelling}");
    }
    assert_eq!(resolve(&words(&["--evaluation_strategy=no"]))["eval_strategy"], "no");
    assert_eq!(resolve(&words(&["--per_gpu_train_batch_size", "16"]))["per_device_train_batch_size"], 16);
    assert_eq!(resolve(&words(&["--no_cuda"]))["use_cpu"], true);
    let file = dir.path().join("a.json");
    std::fs::write(&file, r#"{"evaluation_strategy": "steps", "report_to": ["none"], "no_cuda": true}"#).unwrap();
    let a = resolve(&words(&["--args-file", file.to_str().unwrap()]));
    assert_eq!((&a["eval_strategy"], &a["report_to"], &a["use_cpu"]), (&"steps".into(), &"none".into(), &true.into()));
    std::fs::write(&file, r#"{"report_to": ["jsonl"]}"#).unwrap();
    assert_eq!(resolve(&words(&["--args-file", file.to_str().unwrap()]))["report_to"], "jsonl");
    std::fs::write(&file, r#"{"report_to": ["tensorboard"]}"#).unwrap();
    assert_eq!(resolve(&words(&["--args-file", file.to_str().unwrap()]))["report_to"], "tensorboard");
    std::fs::write(&file, r#"{"report_to": []}"#).unwrap();
    assert_eq!(resolve(&words(&["--args-file", file.to_str().unwrap()]))["report_to"], "none");

    // Both names of one field in a file: which one?
    std::fs::write(&file, r#"{"evaluation_strategy": "steps", "eval_strategy": "no"}"#).unwrap();
    let cfg = Config::try_parse_command_line(["level3-trainer", "--args-file", file.to_str().unwrap()]).unwrap();
    let err = cfg.training_arguments().unwrap_err().to_string().replace(file.to_str().unwrap(), "a.json");
    insta::assert_snapshot!(err, @r#"a.json: cannot read training arguments: both `evaluation_strategy` and `eval_strategy` are given; `evaluation_strategy` is the older name of `eval_strategy`: keep one"#);
    std::fs::write(&file, r#"{"report_to": ["jsonl", "csv"]}"#).unwrap();
    let cfg = Config::try_parse_command_line(["level3-trainer", "--args-file", file.to_str().unwrap()]).unwrap();
    let err = cfg.training_arguments().unwrap_err().to_string().replace(file.to_str().unwrap(), "a.json");
    insta::assert_snapshot!(err, @r#"a.json: cannot read training arguments: invalid report_to ["jsonl","csv"]: expected one of "none", "jsonl", "csv", "tensorboard", or a list of at most one of them (Transformers' list form)"#);
}

#[test]
fn level_1_names_stay_and_two_names_of_one_setting_are_refused() {
    let words = |w: &[&str]| w.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let a = resolve(&words(&["--batch-size", "32", "--lr", "0.01", "--epochs", "2", "--log-interval", "0", "--timeout", "30"]));
    assert_eq!((&a["per_device_train_batch_size"], &a["learning_rate"], &a["num_train_epochs"]), (&32.into(), &0.01.into(), &2.0.into()));
    assert_eq!((&a["logging_strategy"], &a["ddp_timeout"]), (&"epoch".into(), &30.into()));
    let a = resolve(&words(&["--strategy", "fsdp-no-shard", "--mixed-precision", "bf16"]));
    assert_eq!((&a["fsdp"], &a["bf16"]), (&serde_json::to_value(ladder_core::parallel::ShardingStrategy::NoShard).unwrap(), &true.into()));

    for (one, other) in [
        (["--batch-size", "32"], ["--per-device-train-batch-size", "64"]),
        (["--lr", "0.01"], ["--learning-rate", "0.02"]),
        (["--strategy", "ddp"], ["--fsdp", "full_shard"]),
        (["--mixed-precision", "no"], ["--bf16", "--"]),
    ] {
        let w: Vec<&str> = std::iter::once("level3-trainer").chain(one).chain(other.into_iter().filter(|w| *w != "--")).collect();
        let err = Config::try_parse_command_line(w.clone()).unwrap_err().to_string();
        assert!(err.contains(one[0]) && err.contains(other[0]), "{w:?}: {err}");
    }
    let err = Config::try_parse_command_line(["level3-trainer", "--batch-size", "32", "--per_device_train_batch_size", "64"]).unwrap_err();
    insta::assert_snapshot!(err.to_string(), @"
error: the argument '--batch-size <N>' cannot be used with '--per-device-train-batch-size <PER_DEVICE_TRAIN_BATCH_SIZE>'

Usage: level3-trainer --batch-size <N>

For more information, try '--help'.
    ");

    // The --batch-size 70000 error names the flag typed, not per_device_train_batch_size.
    let (ok, text) = run(Command::new(BIN).args(["--device", "cpu", "--batch-size", "70000", "--output-dir", "/nonexistent/never"]));
    assert!(!ok);
    assert!(text.contains("for --batch-size:") && !text.contains("per_device_train_batch_size"), "{text}");
    let (ok, text) =
        run(Command::new(BIN).args(["--device", "cpu", "--per-device-train-batch-size", "70000", "--output-dir", "/nonexistent/never"]));
    assert!(!ok);
    assert!(text.contains("for --per-device-train-batch-size:"), "{text}");
}

fn run(cmd: &mut Command) -> (bool, String) {
    let out = cmd.output().expect("spawn");
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

#[test]
fn device_cuda_without_cuda_is_refused_before_anything_is_written() {
    if ladder_core::device::cuda_available() {
        return; // the refusal is for machines without CUDA
    }
    let dir = tempfile::tempdir().unwrap();
    let (ok, text) = run(Command::new(BIN).current_dir(dir.path()).args(["--device", "cuda", "--max-steps", "1"]));
    assert!(!ok, "--device cuda trained without CUDA:\n{text}");
    assert!(text.contains("--device cuda requested but CUDA is not available"), "{text}");
    assert!(!dir.path().join("basic-trainer").exists(), "wrote an output_dir");
}

/// The launcher's variables as `ladder-accelerate launch --use-fsdp --gradient-accumulation-steps
/// 2 --mixed-precision bf16` exports them.
fn launcher(k: &str) -> Option<String> {
    [
        ("ACCELERATE_USE_FSDP", "true"),
        ("FSDP_SHARDING_STRATEGY", "FULL_SHARD"),
        ("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "2"),
        ("ACCELERATE_MIXED_PRECISION", "bf16"),
    ]
    .iter()
    .find(|(n, _)| *n == k)
    .map(|(_, v)| v.to_string())
}

#[test]
fn launcher_settings_are_honoured_where_the_arguments_leave_them_and_contradictions_refused() {
    use level2_accelerator::ResolvedConfig;
    // Left at their defaults: the launcher's values win.
    let args = TrainingArguments::default();
    Trainer::check_launcher_settings(&args, |_| None, launcher).unwrap();
    let r = ResolvedConfig::resolve(&Trainer::accelerator_config(&args), launcher).unwrap();
    assert_eq!(r.strategy().to_string(), "fsdp-full-shard");
    assert_eq!((r.gradient_accumulation_steps, r.mixed_precision.to_string()), (2, "bf16".to_string()));
    // Set explicitly to something else: refused, naming both.
    let err = Trainer::check_launcher_settings(&args, |f| (f == "fsdp").then(|| "--strategy".to_string()), launcher).unwrap_err();
    insta::assert_snapshot!(err.to_string(), @r#"TrainingArguments.fsdp = ddp (--strategy) contradicts the launcher's fsdp-full-shard (from ACCELERATE_USE_FSDP); give the setting in one place (drop it from the launcher's flags or config, or from the arguments)"#);
    let four = TrainingArguments { gradient_accumulation_steps: 4, ..TrainingArguments::default() };
    let err = Trainer::check_launcher_settings(&four, |f| (f == "gradient_accumulation_steps").then(|| "a.json".to_string()), launcher)
        .unwrap_err();
    insta::assert_snapshot!(err.to_string(), @r#"TrainingArguments.gradient_accumulation_steps = 4 (a.json) contradicts the launcher's 2 (from ACCELERATE_GRADIENT_ACCUMULATION_STEPS); give the setting in one place (drop it from the launcher's flags or config, or from the arguments)"#);
    // Set explicitly to the same value: fine.
    let same = TrainingArguments {
        gradient_accumulation_steps: 2,
        bf16: true,
        fsdp: Some(ladder_core::parallel::ShardingStrategy::FullShard.into()),
        ..TrainingArguments::default()
    };
    Trainer::check_launcher_settings(&same, |_| Some("--flag".into()), launcher).unwrap();
}

/// The binary under the launcher's variables (world size 1): FSDP and accumulation 2 are
/// what runs, the banner says they came from the launcher; `--strategy ddp` is refused.
#[test]
fn the_binary_runs_the_launchers_settings_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let env = [("ACCELERATE_USE_FSDP", "true"), ("FSDP_SHARDING_STRATEGY", "FULL_SHARD"), ("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "2")];
    let flags = ["--device", "cpu", "--max-steps", "2", "--save-strategy", "no", "--eval-strategy", "no", "--output-dir"];
    let (ok, text) = run(Command::new(BIN).envs(env).args(flags).arg(&out));
    assert!(ok, "{text}");
    for line in [
        "  Gradient Accumulation steps = 2",
        "  Distributed strategy = fsdp-full-shard (the launcher: ACCELERATE_USE_FSDP)",
        "  Gradient Accumulation steps from = the launcher: ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
    ] {
        assert!(text.contains(line), "missing {line:?}:\n{text}");
    }
    // A DeepSpeed config of stage 0 (ZeRO off) leaves the strategy, and its source, to the launcher.
    let stage0 = dir.path().join("stage0");
    let (ok, text0) =
        run(Command::new(BIN).envs(env).args(flags).arg(&stage0).args(["--deepspeed", r#"{"zero_optimization": {"stage": 0}}"#]));
    assert!(ok && text0.contains("  Distributed strategy = fsdp-full-shard (the launcher: ACCELERATE_USE_FSDP)"), "{text0}");
    let written: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("training_args.json")).unwrap()).unwrap();
    assert_eq!(written["gradient_accumulation_steps"], 2);
    assert!(!written["fsdp"].is_null());
    let (ok, text) = run(Command::new(BIN).envs(env).args(["--strategy", "ddp"]).args(flags).arg(dir.path().join("other")));
    assert!(!ok, "{text}");
    assert!(text.contains("--strategy") && text.contains("ACCELERATE_USE_FSDP"), "{text}");
    assert!(!Path::new(&dir.path().join("other")).exists());
}

/// A DeepSpeed config's ZeRO stage 1 is what the banner, the summary line and the metrics JSON
/// name (`zero1`, from TrainingArguments' `deepspeed`), not plain DDP by default.
#[test]
fn deepspeed_stage_1_is_named_zero1_in_the_banner_and_the_report() {
    let dir = tempfile::tempdir().unwrap();
    let (out, json) = (dir.path().join("out"), dir.path().join("m.json"));
    let flags = ["--device", "cpu", "--max-steps", "2", "--save-strategy", "no", "--eval-strategy", "no"];
    let (ok, text) = run(Command::new(BIN)
        .args(flags)
        .args(["--deepspeed", r#"{"zero_optimization": {"stage": 1}}"#, "--output-dir"])
        .arg(&out)
        .arg("--metrics-json")
        .arg(&json));
    assert!(ok, "{text}");
    assert!(text.contains("  Distributed strategy = zero1 (TrainingArguments)"), "{text}");
    assert!(text.contains("| world size 1 | zero1"), "{text}");
    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(report["strategy"], "zero1");
}
