//! `ladder-accelerate estimate-memory` as a process: its `--help`, its tables (insta snapshots,
//! reviewed; the book includes one), `--json` carrying the library's figures, `--budget`
//! naming the cheapest strategy that fits, and every bad input refused with the flag named.

use ladder_core::memory::estimate::{self, EstimateInput};
use ladder_core::parallel::{Precision, WrapConfig};
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
            "--activation-checkpointing",
            "--budget",
            "100MB"
        ])
    );
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

/// `--save-checkpoint`: under FULL_SHARD rank 0's peak is the save, which holds the gathered
/// model and both moments (3 × 4 bytes per parameter, padded); the other ranks' is still the
/// step's; DDP's state dicts are its own tensors, so its estimate does not change.
#[test]
fn save_checkpoint_makes_the_gathered_state_rank_0s_peak_under_full_shard() {
    // bf16: FSDP's default wrapping is one unit, whose step holds the gathered model and the
    // fresh gradients in bf16 and the flat gradient in fp32 (8 bytes per parameter); the save
    // holds 12. (In fp32 the step's 12 and its activations come first.)
    let args = ["--width", "4096", "--num-processes", "2", "--mixed-precision", "bf16", "--strategy", "ddp,fsdp-full-shard", "--json"];
    let without: serde_json::Value = serde_json::from_str(&stdout(&args)).unwrap();
    let with: serde_json::Value = serde_json::from_str(&stdout(&[&args[..], &["--save-checkpoint"]].concat())).unwrap();
    assert_eq!(with["save_checkpoint"], true);
    assert!(without.get("save_checkpoint").is_none());
    assert_eq!(with["strategies"][0]["ranks"], without["strategies"][0]["ranks"], "DDP: nothing added");
    let (fs, before) = (&with["strategies"][1]["ranks"], &without["strategies"][1]["ranks"]);
    assert_eq!(fs[0]["peak_at"], "checkpoint save");
    // The save's bytes: 3 × 4 per parameter, the unit padded by at most 1 element.
    let psi = ladder_core::memory::layout::num_parameters(4096) as u64;
    let save = fs[0]["transient"].as_u64().unwrap();
    assert!((12 * psi..=12 * (psi + 4)).contains(&save), "{save} vs 12 × {psi}");
    let get = |r: &serde_json::Value, k: &str| r["model_state"][k].as_u64().unwrap();
    let growth = |r: &serde_json::Value| r["peak_growth"].as_u64().unwrap();
    assert_eq!(fs[0]["activations"], 0);
    assert_eq!(growth(&fs[0]), get(&fs[0], "gradients") + get(&fs[0], "optimizer") + save + fs[0]["runtime"].as_u64().unwrap());
    assert!(growth(&fs[0]) > growth(&before[0]) && fs[1] == before[1], "rank 1 holds one unit at a time: its step's peak is higher");
}

#[test]
fn bad_input_is_refused_with_the_flag_named() {
    let cases: [(&str, &[&str]); 10] = [
        ("unknown strategy", &["--strategy", "zero3"]),
        ("unknown sharding strategy", &["--strategy", "ddp,fsdp-hybrid"]),
        ("zero1 with bf16", &["--strategy", "zero1", "--mixed-precision", "bf16"]),
        ("budget without a number", &["--budget", "GiB"]),
        ("budget with an unknown unit", &["--budget", "8 gigs"]),
        ("width 0", &["--width", "0"]),
        ("batch size 0", &["--batch-size", "0"]),
        ("no processes", &["--num-processes", "0"]),
        ("fp8", &["--mixed-precision", "fp8"]),
        ("offload to cpu", &["--offload-optimizer", "cpu"]),
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
