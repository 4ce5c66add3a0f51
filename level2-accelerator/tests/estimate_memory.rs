//! `ladder-accelerate estimate-memory` as a process: its `--help`, its tables (insta snapshots,
//! reviewed; the book includes one), `--json` carrying the library's figures, `--budget`
//! naming the cheapest strategy that fits, and every bad input refused with the flag named.

use ladder_core::memory::estimate::{self, EstimateInput};
use ladder_core::parallel::{FsdpOptions, Precision, ShardingStrategy, Strategy, WrapConfig};
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_ladder-accelerate");

fn run(args: &[&str]) -> Output {
    Command::new(BIN).arg("estimate-memory").args(args).output().unwrap()
}

fn stdout(args: &[&str]) -> String {
    let out = run(args);
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn help_and_tables() {
    insta::assert_snapshot!("help_estimate_memory", stdout(&["--help"]));
    insta::assert_snapshot!("estimate_default", stdout(&[]));
    insta::assert_snapshot!("estimate_width_4096_budget", stdout(&["--width", "4096", "--num-processes", "2", "--budget", "800MiB"]));
    insta::assert_snapshot!(
        "estimate_bf16_checkpointing_w3",
        stdout(&[
            "--num-processes",
            "3",
            "--batch-size",
            "512",
            "--mixed-precision",
            "bf16",
            "--cpu-bf16",
            "amx",
            "--activation-checkpointing",
            "--budget",
            "100MB"
        ])
    );
    // On a GPU: the CUDA allocator's peak, the host's part apart under CPU offload, the budget
    // held against the device's part.
    insta::assert_snapshot!(
        "estimate_cuda_offload_budget",
        stdout(&[
            "--device",
            "cuda",
            "--num-processes",
            "1",
            "--width",
            "4096",
            "--batch-size",
            "512",
            "--strategy",
            "fsdp-shard-grad-op,fsdp-full-shard",
            "--offload-params",
            "--budget",
            "800MiB"
        ])
    );
}

#[test]
fn device_cuda_json_carries_the_librarys_cuda_figures() {
    let text = stdout(&["--device", "cuda", "--width", "4096", "--num-processes", "2", "--batch-size", "512", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["device"], "cuda");
    for (s, strategy) in v["strategies"].as_array().unwrap().iter().zip(estimate::default_strategies()) {
        let wrap = WrapConfig { strategy, mixed_precision: Precision::No, activation_checkpointing: false };
        let input = EstimateInput {
            wrap,
            world_size: 2,
            width: 4096,
            batch_size: 512,
            offload_optimizer: Default::default(),
            save_checkpoint: false,
            cpu_bf16: None,
            huge_pages: None,
        };
        let expected = estimate::estimate_on(&input, ladder_core::device::DeviceKind::Cuda).unwrap();
        assert_eq!(s["ranks"], serde_json::to_value(&expected).unwrap(), "{}", s["strategy"]);
        assert_ne!(expected, estimate::estimate(&input).unwrap(), "the CPU's figures differ (heap factor, runtime)");
    }
}

/// In bf16 on a CPU the heap factor follows the CPU's bf16 unit (`--cpu-bf16`, by default this
/// machine's, said in the title): AVX512-BF16's 1.9 against AMX's 2.3, the same live bytes
/// beneath; in fp32 the unit is neither used nor printed.
#[test]
fn the_bf16_estimate_follows_the_cpus_bf16_unit() {
    let json = |unit: &str| -> serde_json::Value {
        let args = ["--mixed-precision", "bf16", "--batch-size", "512", "--strategy", "ddp", "--cpu-bf16", unit, "--json"];
        serde_json::from_str(&stdout(&args)).unwrap()
    };
    let activations = |v: &serde_json::Value| v["strategies"][0]["ranks"][0]["activations"].as_f64().unwrap();
    let (amx, avx512, none) = (json("amx"), json("avx512-bf16"), json("none"));
    assert_eq!((amx["cpu_bf16"].as_str(), avx512["cpu_bf16"].as_str()), (Some("amx"), Some("avx512-bf16")));
    let ratio = activations(&avx512) / activations(&amx);
    let expected = estimate::RESIDENT_PER_LIVE_16BIT_AVX512 / estimate::RESIDENT_PER_LIVE_16BIT;
    assert!((ratio - expected).abs() < 1e-6, "{ratio} against {expected}");
    assert_eq!(activations(&none), activations(&amx), "emulated bf16 takes the larger factor");
    // `--help` quotes the factors the estimate takes (its text is written by hand; `{:?}` keeps
    // a round factor's ".0").
    let help = stdout(&["--help"]).split_whitespace().collect::<Vec<_>>().join(" ");
    for quoted in [
        format!("{:?} resident bytes per live byte with AMX", estimate::RESIDENT_PER_LIVE_16BIT),
        format!("{:?} with AVX512-BF16", estimate::RESIDENT_PER_LIVE_16BIT_AVX512),
    ] {
        assert!(help.contains(&quoted), "--help should say {quoted:?}: {help}");
    }
    let wrap = WrapConfig { strategy: Strategy::default(), mixed_precision: Precision::Bf16, activation_checkpointing: false };
    let input = EstimateInput {
        wrap,
        world_size: 2,
        width: 128,
        batch_size: 512,
        offload_optimizer: Default::default(),
        save_checkpoint: false,
        cpu_bf16: Some(ladder_core::device::CpuBf16Unit::Avx512Bf16),
        huge_pages: None,
    };
    assert_eq!(avx512["strategies"][0]["ranks"], serde_json::to_value(estimate::estimate(&input).unwrap()).unwrap());
    let title = stdout(&["--mixed-precision", "bf16", "--cpu-bf16", "avx512-bf16"]);
    assert!(title.lines().next().unwrap().ends_with(", bf16 (CPU bf16 unit: avx512-bf16)"), "{title}");
    let fp32 = stdout(&["--cpu-bf16", "avx512-bf16", "--json"]);
    assert!(!fp32.contains("cpu_bf16"), "{fp32}");
    let fp32_table = stdout(&["--cpu-bf16", "none"]);
    assert!(fp32_table.lines().next().unwrap().ends_with(", fp32"));
    // Given where it changes nothing, the unit is said to be unused (not silently dropped).
    let unused = "--cpu-bf16 changes nothing here";
    assert!(fp32_table.lines().last().unwrap().starts_with(unused), "{fp32_table}");
    assert!(!stdout(&["--mixed-precision", "bf16", "--cpu-bf16", "none"]).contains(unused));
    // Without the flag, this machine's unit, named (or said unknown); /proc/cpuinfo's spelling
    // is taken too; a unit that does not exist is refused with the flag and the values named.
    let here = ladder_core::device::CpuBf16Unit::of_this_machine().map_or("unknown, AMX's factor taken", |u| u.label());
    assert_eq!(json_of(&["--mixed-precision", "bf16", "--json"])["cpu_bf16"], here);
    assert_eq!(json("avx512_bf16")["cpu_bf16"], "avx512-bf16");
    let bad = run(&["--mixed-precision", "bf16", "--cpu-bf16", "avx2"]);
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(!bad.status.success() && err.contains("--cpu-bf16") && err.contains("avx512-bf16"), "{err}");
    // fp16 is estimated on CUDA only (every level refuses it on a CPU, the unit given or not).
    let fp16 = run(&["--mixed-precision", "fp16", "--cpu-bf16", "amx"]);
    let err = String::from_utf8_lossy(&fp16.stderr);
    assert!(!fp16.status.success() && err.contains("--mixed-precision fp16 conflicts with --device cpu"), "{err}");
}

fn json_of(args: &[&str]) -> serde_json::Value {
    serde_json::from_str(&stdout(args)).unwrap()
}

/// Huge pages as a run would have them: the levels' default (on from 32 MiB of parameters) or
/// the user's `THP_MEM_ALLOC_ENABLE`, read from the environment as the levels read it.
#[test]
fn the_huge_page_term_follows_thp_mem_alloc_enable() {
    let runtime = |width: &str, thp: Option<&str>| {
        let mut cmd = Command::new(BIN);
        cmd.args(["estimate-memory", "--width", width, "--strategy", "ddp", "--json"]).env_remove("THP_MEM_ALLOC_ENABLE");
        if let Some(v) = thp {
            cmd.env("THP_MEM_ALLOC_ENABLE", v);
        }
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["strategies"][0]["ranks"][0]["runtime"].as_u64().unwrap()
    };
    let (base, huge) = (estimate::RUNTIME_BYTES, estimate::RUNTIME_BYTES + estimate::HUGE_PAGES_BYTES);
    assert_eq!((runtime("4096", None), runtime("4096", Some("0"))), (huge, base));
    assert_eq!((runtime("128", None), runtime("128", Some("1"))), (base, huge));
}

#[test]
fn json_carries_the_librarys_figures_and_the_budget_names_the_cheapest_fit() {
    let text = stdout(&["--width", "4096", "--num-processes", "3", "--batch-size", "256", "--json", "--budget", "750MiB"]);
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let names: Vec<&str> = v["strategies"].as_array().unwrap().iter().map(|s| s["strategy"].as_str().unwrap()).collect();
    assert_eq!(names, ["ddp", "zero1", "fsdp-shard-grad-op", "fsdp-full-shard", "fsdp-no-shard"]);
    let mut first_fit = None;
    for (s, strategy) in v["strategies"].as_array().unwrap().iter().zip(estimate::default_strategies()) {
        let wrap = WrapConfig { strategy, mixed_precision: Precision::No, activation_checkpointing: false };
        let expected = estimate::estimate(&EstimateInput {
            wrap,
            world_size: 3,
            width: 4096,
            batch_size: 256,
            offload_optimizer: Default::default(),
            save_checkpoint: false,
            cpu_bf16: None,
            huge_pages: None,
        })
        .unwrap();
        assert_eq!(s["ranks"], serde_json::to_value(&expected).unwrap(), "{}", s["strategy"]);
        let fits = expected.iter().all(|r| r.total <= 750 << 20);
        assert_eq!(s["fits"], fits);
        if fits && first_fit.is_none() {
            first_fit = Some(s["strategy"].as_str().unwrap().to_string());
        }
    }
    // DDP's 16Ψ does not fit; ZeRO-1's sharded moments do.
    assert_eq!(first_fit.as_deref(), Some("zero1"));
    assert_eq!(v["cheapest_fit"].as_str(), first_fit.as_deref());
}

/// `--save-checkpoint`: ZeRO-1 gathers both moments on every rank for the file (8 bytes per
/// parameter of the padded flat buffer, beside the 4 of the shard it sends): on both ranks the
/// save is the peak. DDP's state dicts are its own tensors, so its estimate does not change;
/// nor does FULL_SHARD's with the default wrapping (one unit), whose step holds the gathered
/// model, its flat gradient and a fresh gradient — as much as the two gathered moments the
/// save holds on rank 0, the weights written and dropped first.
#[test]
fn save_checkpoint_is_zero1s_peak_and_adds_nothing_to_ddp() {
    let args = ["--width", "4096", "--num-processes", "2", "--strategy", "ddp,zero1,fsdp-full-shard", "--json"];
    let without: serde_json::Value = serde_json::from_str(&stdout(&args)).unwrap();
    let with: serde_json::Value = serde_json::from_str(&stdout(&[&args[..], &["--save-checkpoint"]].concat())).unwrap();
    assert_eq!(with["save_checkpoint"], true);
    assert!(without.get("save_checkpoint").is_none());
    // The table's title says the save is counted (it may change nothing, as for DDP here).
    let title = |extra: &[&str]| stdout(&[&args[..args.len() - 1], extra].concat()).lines().next().unwrap_or_default().to_string();
    assert!(title(&["--save-checkpoint"]).ends_with(", a checkpoint save counted") && !title(&[]).contains("save"));
    assert_eq!(with["strategies"][0]["ranks"], without["strategies"][0]["ranks"], "DDP: nothing added");
    assert_eq!(with["strategies"][2]["ranks"], without["strategies"][2]["ranks"], "FULL_SHARD, one unit");
    let (_, padded, shard) = ladder_core::memory::layout::zero_partition(4096, 2);
    let get = |r: &serde_json::Value, k: &str| r["model_state"][k].as_u64().unwrap();
    // Consolidated on rank 0 (consolidate_state_dict(to=0)): both moments whole beside its last
    // shard; rank 1 holds its two shards and one receive buffer, less than its step's peak.
    let ranks = with["strategies"][1]["ranks"].as_array().unwrap();
    let r = &ranks[0];
    assert_eq!((r["peak_at"].as_str(), r["activations"].as_u64()), (Some("checkpoint save"), Some(0)));
    let save = r["transient"].as_u64().unwrap();
    assert_eq!(save, 4 * (2 * padded + shard) as u64);
    let growth = r["peak_growth"].as_u64().unwrap();
    assert_eq!(growth, get(r, "gradients") + get(r, "optimizer") + save + r["runtime"].as_u64().unwrap());
    assert!(growth > without["strategies"][1]["ranks"][0]["peak_growth"].as_u64().unwrap());
    let input = EstimateInput {
        wrap: WrapConfig { strategy: estimate::zero1(), mixed_precision: Precision::No, activation_checkpointing: false },
        world_size: 2,
        width: 4096,
        batch_size: 64,
        offload_optimizer: Default::default(),
        save_checkpoint: true,
        cpu_bf16: None,
        huge_pages: None,
    };
    assert_eq!(ladder_core::memory::checkpoint_save::save_bytes(&input, 1), 4 * 3 * shard as u64);
    assert_eq!(ranks[1], without["strategies"][1]["ranks"][1], "rank 1: the step's peak stays the larger");
}

#[test]
fn bad_input_is_refused_with_the_flag_named() {
    let cases: [(&str, &[&str]); 14] = [
        ("unknown strategy", &["--strategy", "zero3"]),
        ("unknown sharding strategy", &["--strategy", "ddp,fsdp-hybrid"]),
        ("zero1 with bf16", &["--strategy", "zero1", "--mixed-precision", "bf16"]),
        ("budget without a number", &["--budget", "GiB"]),
        ("budget with an unknown unit", &["--budget", "8 gigs"]),
        ("budget of zero", &["--budget", "0"]),
        ("negative budget", &["--budget", "-1"]),
        ("width 0", &["--width", "0"]),
        ("batch size 0", &["--batch-size", "0"]),
        ("no processes", &["--num-processes", "0"]),
        ("fp8", &["--mixed-precision", "fp8"]),
        ("fp16 on a CPU", &["--mixed-precision", "fp16"]),
        ("offload to cpu", &["--offload-optimizer", "cpu"]),
        ("a wrap policy for ddp", &["--strategy", "ddp", "--fsdp-min-num-params", "0"]),
    ];
    let mut report = Vec::new();
    for (title, args) in cases {
        let out = run(args);
        assert!(!out.status.success(), "{title}: {args:?} must fail");
        assert!(out.stdout.is_empty(), "{title}: nothing on stdout");
        let code = out.status.code().unwrap();
        report.push(format!("## {title} (exit {code})\n{}", String::from_utf8_lossy(&out.stderr).trim_end()));
    }
    insta::assert_snapshot!(report.join("\n\n"));
}

/// `--fsdp-min-num-params 0` (one unit per layer, as the bench runs FSDP) gives the library's
/// estimate with that policy, and differs from the default (one unit for BasicNet): FULL_SHARD
/// gathers one layer at a time instead of the whole model.
#[test]
fn fsdp_min_num_params_sets_the_wrap_policy() {
    let json = |extra: &[&str]| -> serde_json::Value {
        let args = [&["--width", "4096", "--num-processes", "2", "--strategy", "fsdp-full-shard", "--json"][..], extra].concat();
        serde_json::from_str(&stdout(&args)).unwrap()
    };
    let (per_layer, default) = (json(&["--fsdp-min-num-params", "0"]), json(&[]));
    let wrap = |min_num_params| WrapConfig {
        strategy: Strategy::Fsdp(FsdpOptions { min_num_params, ..FsdpOptions::with_sharding(ShardingStrategy::FullShard) }),
        mixed_precision: Precision::No,
        activation_checkpointing: false,
    };
    let input = |min_num_params| EstimateInput {
        wrap: wrap(min_num_params),
        world_size: 2,
        width: 4096,
        batch_size: 64,
        offload_optimizer: Default::default(),
        save_checkpoint: false,
        cpu_bf16: None,
        huge_pages: None,
    };
    let expected = estimate::estimate(&input(0)).unwrap();
    assert_eq!(per_layer["strategies"][0]["ranks"], serde_json::to_value(&expected).unwrap());
    assert_eq!(
        default["strategies"][0]["ranks"],
        serde_json::to_value(estimate::estimate(&input(FsdpOptions::default().min_num_params)).unwrap()).unwrap()
    );
    assert_ne!(per_layer["strategies"][0]["ranks"], default["strategies"][0]["ranks"]);
    let gathered = |v: &serde_json::Value| v["strategies"][0]["ranks"][0]["model_state"]["gathered_peak"].as_u64().unwrap();
    assert!(gathered(&per_layer) < gathered(&default), "one layer at a time gathers less than the whole model");
    // The policy is said where it was set: in the JSON and the table's title.
    assert_eq!((per_layer["fsdp_min_num_params"].as_u64(), default.get("fsdp_min_num_params")), (Some(0), None));
    let title = |extra: &[&str]| stdout(&[&["--strategy", "fsdp-full-shard"][..], extra].concat()).lines().next().unwrap().to_string();
    assert!(title(&["--fsdp-min-num-params", "0"]).ends_with(", fp32, fsdp_min_num_params 0"));
    assert!(title(&[]).ends_with(", fp32"));
}

/// `--offload-params` (FSDP's CPU offload): the FSDP strategies' figures are those without it
/// plus the copies to the device (on a CPU host and device are one memory), each rank's `host`
/// is its parameters, gradients and optimizer state, said in one placement line per strategy;
/// ddp and zero1 are left out, and refused when asked for by name.
#[test]
fn offload_params_places_the_model_state_on_the_host() {
    insta::assert_snapshot!("estimate_offload_params_w4096", stdout(&["--width", "4096", "--offload-params"]));
    let json = |extra: &[&str]| -> serde_json::Value {
        let mut args = vec!["--width", "4096", "--json", "--strategy", "fsdp-full-shard,fsdp-no-shard"];
        args.extend(extra);
        serde_json::from_str(&stdout(&args)).unwrap()
    };
    let (with, without) = (json(&["--offload-params"]), json(&[]));
    assert_eq!(with["offload_params"], true);
    for (s, plain) in with["strategies"].as_array().unwrap().iter().zip(without["strategies"].as_array().unwrap()) {
        for (r, p) in s["ranks"].as_array().unwrap().iter().zip(plain["ranks"].as_array().unwrap()) {
            let m = &r["model_state"];
            let state = ["parameters", "gradients", "optimizer"].iter().map(|k| m[k].as_u64().unwrap()).sum::<u64>();
            assert_eq!(r["host"].as_u64(), Some(state), "{}", s["strategy"]);
            // The copies to the device are real allocations, also where host and device are one
            // memory: NO_SHARD keeps the whole parameters' copy while they are gathered (it is
            // at the peak), and its flat gradient on the device (without offload, `.grad`
            // itself, all-reduced in place); a sharded unit's shard copy lives only while it
            // is all-gathered (not at this peak).
            let no_shard = s["strategy"] == "fsdp-no-shard";
            let copy = if no_shard { m["parameters"].as_u64().unwrap() + m["gradients"].as_u64().unwrap() } else { 0 };
            let (total, growth) = (p["total"].as_u64().unwrap() + copy, p["peak_growth"].as_u64().unwrap() + copy);
            assert_eq!((r["total"].as_u64(), r["peak_growth"].as_u64()), (Some(total), Some(growth)), "{}", s["strategy"]);
            assert!(p.get("host").is_none(), "no host bytes without offload");
        }
    }
    let out = run(&["--strategy", "ddp", "--offload-params"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--strategy ddp") && err.contains("--offload-params"), "{err}");
}

/// When nothing fits, the verdict suggests activation checkpointing only where it can lower the
/// estimate: on CUDA, not on a CPU (whose heap keeps the peak of the run without, the library's
/// `fitted::checkpointing_keeps_the_heap`) — and on a CPU the checkpointed estimate is indeed
/// no lower.
#[test]
fn checkpointing_is_suggested_only_where_it_lowers_the_estimate() {
    let verdict = |device: &str, width: &str| {
        stdout(&["--device", device, "--width", width, "--batch-size", "512", "--budget", "100MiB"])
            .lines()
            .last()
            .unwrap_or_default()
            .to_string()
    };
    // Width 4096, batch 512 on CUDA: fewer activations alive at fc1's backward.
    assert!(verdict("cuda", "4096").ends_with("a smaller batch or --activation-checkpointing."), "{}", verdict("cuda", "4096"));
    // Width 128 on CUDA: the segment-by-segment backward holds more at conv2's, so no.
    assert!(verdict("cuda", "128").ends_with("a smaller batch."), "{}", verdict("cuda", "128"));
    assert!(verdict("cpu", "4096").ends_with("a smaller batch."), "{}", verdict("cpu", "4096"));
    let peak = |extra: &[&str]| {
        let j = json_of(&[&["--json", "--width", "4096", "--batch-size", "512", "--strategy", "ddp"][..], extra].concat());
        j["strategies"][0]["ranks"][0]["peak_growth"].as_u64().unwrap()
    };
    assert_eq!(peak(&["--activation-checkpointing"]), peak(&[]));
}
