//! Where a training step's time goes, layer by layer: the forward and backward time of each of
//! BasicNet's segments (batch 64, one process, all cores), ours (`ladder_core::model::BasicNet`,
//! timed through its `Segmented` view) and PyTorch's (`bench/reference/layer_times.py`, the same
//! segments in eager PyTorch), alternated in one run, as one markdown table.
//!
//!   cargo run --release -p bench --example layer_times -- [--rounds 3] [--reps 30] [--python .venv/bin/python]
//!
//! The segments are our model's (`[conv1, relu]`, `[conv2, max_pool2d 2, relu]` — conv2 and the
//! pool are one segment: ours pools before the ReLU, PyTorch's tutorial after —, `[dropout,
//! flatten]`, `[fc1, relu]`, `[dropout]`, `[fc2, log_softmax]`) and the loss (`nll_loss`). Each
//! segment's forward is timed on the input the real forward gives it; its backward is
//! `out.sum().backward()` (a gradient of ones; the sum's own backward is an expand), parameter gradients accumulating as in a step;
//! conv1's input needs no gradient, as in training. Medians over `--reps` repeats per round, then
//! the median over rounds; ours and the peer alternate rounds, so both see the same load.

use ladder_core::model::{BasicNet, BasicNetConfig, Segmented};
use std::process::Command;
use std::time::Instant;
use tch::{nn, Device, Kind, Tensor};

/// Segment names, the loss last.
const NAMES: [&str; 7] = ["conv1+relu", "conv2+pool+relu", "dropout+flatten", "fc1+relu", "dropout", "fc2+log_softmax", "nll_loss"];

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn time_ms(f: impl FnOnce()) -> f64 {
    let t = Instant::now();
    f();
    t.elapsed().as_secs_f64() * 1e3
}

/// Ours: (forward ms, backward ms) per segment and the loss, medians over `reps`.
fn ours(net: &BasicNet, x: &Tensor, y: &Tensor, reps: usize) -> Vec<(f64, f64)> {
    let mut inputs = vec![x.shallow_clone()];
    for i in 0..net.num_segments() {
        let out = tch::no_grad(|| net.segment_forward(i, &inputs[i], true));
        inputs.push(out);
    }
    let mut rows = Vec::new();
    for i in 0..=net.num_segments() {
        let input = if i == 0 { inputs[0].shallow_clone() } else { inputs[i].detach().set_requires_grad(true) };
        let run = |inp: &Tensor| if i < net.num_segments() { net.segment_forward(i, inp, true) } else { inp.nll_loss(y) };
        let (mut fwd, mut bwd) = (Vec::new(), Vec::new());
        for _ in 0..reps {
            let mut out = None;
            fwd.push(time_ms(|| out = Some(run(&input))));
            let out = out.expect("forward ran");
            let total = out.sum(out.kind());
            bwd.push(time_ms(|| total.backward()));
        }
        rows.push((median(fwd), median(bwd)));
    }
    rows
}

/// The peer's rows from `layer_times.py`'s JSON line (`{"rows": [[fwd, bwd], …]}`).
fn peer(python: &str, reps: usize) -> Vec<(f64, f64)> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("reference");
    let out = Command::new(python)
        .arg(root.join("layer_times.py"))
        .args(["--reps", &reps.to_string()])
        .output()
        .unwrap_or_else(|e| panic!("{python}: {e}"));
    assert!(out.status.success(), "layer_times.py failed:\n{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let json: serde_json::Value = serde_json::from_str(text.lines().last().unwrap_or("")).expect("layer_times.py's JSON line");
    json["rows"].as_array().expect("rows").iter().map(|r| (r[0].as_f64().unwrap_or(0.0), r[1].as_f64().unwrap_or(0.0))).collect()
}

fn flag(args: &[String], name: &str, default: &str) -> String {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned().unwrap_or_else(|| default.to_string())
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let rounds: usize = flag(&args, "--rounds", "3").parse().expect("--rounds: a count");
    let reps: usize = flag(&args, "--reps", "30").parse().expect("--reps: a count");
    let default_python = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python");
    let python = flag(&args, "--python", &default_python.display().to_string());
    tch::manual_seed(0);
    let vs = nn::VarStore::new(Device::Cpu);
    let net = BasicNet::new(&vs.root(), BasicNetConfig::default());
    let x = Tensor::randn([64, 1, 28, 28], (Kind::Float, Device::Cpu));
    let y = Tensor::randint(10, [64], (Kind::Int64, Device::Cpu));
    let (mut mine, mut theirs) = (vec![Vec::new(); NAMES.len()], vec![Vec::new(); NAMES.len()]);
    for round in 1..=rounds {
        eprintln!("round {round}/{rounds}: ours, then PyTorch");
        for (i, r) in ours(&net, &x, &y, reps).into_iter().enumerate() {
            mine[i].push(r);
        }
        for (i, r) in peer(&python, reps).into_iter().enumerate() {
            theirs[i].push(r);
        }
    }
    let med = |v: &Vec<(f64, f64)>, bwd: bool| median(v.iter().map(|r| if bwd { r.1 } else { r.0 }).collect());
    println!(
        "| segment | ours forward ms | PyTorch forward ms | ours / PyTorch | ours backward ms | PyTorch backward ms | ours / PyTorch |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|");
    let ratio = |a: f64, b: f64| if b > 0.0 { format!("{:.2}×", a / b) } else { "—".into() };
    let mut totals = [0.0; 4];
    for (i, name) in NAMES.iter().enumerate() {
        let v = [med(&mine[i], false), med(&theirs[i], false), med(&mine[i], true), med(&theirs[i], true)];
        for k in 0..4 {
            totals[k] += v[k];
        }
        println!("| {name} | {:.3} | {:.3} | {} | {:.3} | {:.3} | {} |", v[0], v[1], ratio(v[0], v[1]), v[2], v[3], ratio(v[2], v[3]));
    }
    let t = totals;
    println!("| total | {:.3} | {:.3} | {} | {:.3} | {:.3} | {} |", t[0], t[1], ratio(t[0], t[1]), t[2], t[3], ratio(t[2], t[3]));
}
