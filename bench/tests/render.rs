//! The demo's and the matrix's tables rendered from fixed JSON (tests/fixtures/): every cell's
//! format, failed rows, notes. Reviewed snapshots, numbers included.

use bench::demo::{render_markdown as demo_markdown, render_table, DemoSummary};
use bench::matrix::{render_markdown as bench_markdown, render_terminal, MatrixSummary};

fn fixture(name: &str) -> String {
    std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)).unwrap()
}

/// The peak of the 2-core AMD EPYC (Zen 4) the fixtures were measured on, from its cpuinfo.
fn zen4_peak() -> Option<bench::compute::Peak> {
    let facts = bench::compute::CpuFacts::parse(&fixture("cpuinfo/avx512-amd-zen4.txt"), 2, None);
    Some(bench::compute::cpu_peak(&facts))
}

#[test]
fn demo_table_from_fixed_json() {
    let mut summary: DemoSummary = serde_json::from_str(&fixture("demo.json")).unwrap();
    assert_eq!(summary.failed().len(), 1);
    summary.machine.cpu_peak = zen4_peak();
    insta::assert_snapshot!("demo_efficiency", bench::demo::render_efficiency(&summary, false));
    insta::assert_snapshot!("demo_terminal", render_table(&summary, false));
    insta::assert_snapshot!("demo_markdown", demo_markdown(&summary));
}

/// Issue 27: a demo capped by --max-steps says so under its table.
#[test]
fn a_capped_demo_says_so() {
    let mut summary: DemoSummary = serde_json::from_str(&fixture("demo.json")).unwrap();
    assert!(!bench::demo::render_notes(&summary).contains("Capped"));
    summary.max_steps = Some(10);
    let notes = bench::demo::render_notes(&summary);
    assert!(notes.contains("\nCapped: every level stopped after --max-steps 10 optimizer steps (a full epoch is 60000 / (2 × 64) steps), so accuracy and loss are a short run's"), "{notes}");
}

#[test]
fn matrix_tables_from_fixed_json() {
    let mut summary: MatrixSummary = serde_json::from_str(&fixture("bench.json")).unwrap();
    // Reports from before the peak and the tuned peer was recorded read as none.
    assert!(summary.machine.cpu_peak.is_none() && summary.rows.iter().all(|r| r.tuned_samples_per_s.is_none()));
    summary.machine.cpu_peak = zen4_peak();
    // The tuned peer beside the first row with a peer: 3 repeats, ours / tuned per repeat.
    let row = summary.rows.iter_mut().find(|r| r.case.peer.is_some()).unwrap();
    row.case.tuned_peer = Some(bench::matrix::Peer::Tuned { world_size: row.case.world_size, bf16: false });
    row.tuned_samples_per_s = Some(bench::stats::Spread { median: 1176.0, min: 1136.0, max: 1240.0, n: 3 });
    row.tuned_ratio = Some(bench::stats::Spread { median: 1.16, min: 1.1, max: 1.2, n: 3 });
    row.tuned_accuracy = Some(0.9712);
    row.tuned_choice = Some("preloaded tensors, fused AdamW, channels_last".into());
    let e = summary.check().unwrap_err().to_string();
    assert_eq!(e, "1 of 9 runs failed: l3-fsdp-full-shard-w2-4096-bf16");
    insta::assert_snapshot!("bench_terminal_all_columns", render_terminal(&summary, true));
    // By default the terminal's tables are narrow: every line within 100 columns (the full ones
    // are about 300 wide), each table still one line per case.
    let narrow = render_terminal(&summary, false);
    let widest = narrow.lines().filter(|l| l.starts_with(['│', '┌', '╞', '└'])).map(|l| l.chars().count()).max().unwrap();
    assert!(widest <= 100, "a table line of {widest} columns:\n{narrow}");
    insta::assert_snapshot!("bench_terminal", narrow);
    insta::assert_snapshot!("bench_markdown", bench_markdown(&summary));
    insta::assert_snapshot!("bench_csv", bench::matrix::render_csv(&summary));
    insta::assert_snapshot!("targets_csv", bench::matrix::render_targets_csv(&summary));
    // Every target the rows allow, with its measured value: ours / peer for the 4 rows with a
    // peer, RSS for the same 4, FSDP / DDP, bf16 / fp32, level 2 / level 1 (for the ddp row).
    // And the share of the fp32 peak for the two one-process rows at width 128 in fp32 (the
    // baseline and level 1 at one rank), only with a peak.
    assert!(bench::matrix::targets(&summary.rows, None).iter().all(|g| !g.what.contains("FLOP/s")));
    let t = bench::matrix::targets(&summary.rows, summary.machine.cpu_peak.as_ref());
    let count = |issue: u32, what: &str| t.iter().filter(|g| g.issue == issue && g.what.starts_with(what)).count();
    assert_eq!(
        (count(11, "ours / "), count(11, "training-phase"), count(11, "FSDP"), count(11, "bf16"), count(10, "level 2")),
        (4, 4, 1, 1, 1)
    );
    let shares: Vec<(String, f64)> = t.iter().filter(|g| g.what.starts_with("fp32 FLOP/s")).map(|g| (g.cell.clone(), g.measured)).collect();
    let peak = summary.machine.cpu_peak.as_ref().unwrap().fp32_flops;
    assert_eq!(shares.iter().map(|s| s.0.as_str()).collect::<Vec<_>>(), ["baseline single ×1 fc1 128 fp32", "L1 ddp ×1 fc1 128 fp32"]);
    // 1,364.2 samples/s × 71,565,312 FLOP per sample (the hand count of bench::compute's tests).
    assert!((shares[0].1 - 1364.2 * 71_565_312.0 / peak).abs() < 1e-12, "{shares:?}");
    // The estimator's target (#23) is named `|measured − estimated| / …`: in Markdown its pipes
    // are escaped, so every line of the targets table has its 6 cells.
    let mut with_growth = summary.clone();
    with_growth.rows[0].train_rss_growth_median = Some(120.0);
    let md = bench::matrix::render_targets(&with_growth, true);
    assert!(md.contains("\\|measured − estimated\\|"), "{md}");
    for line in md.lines() {
        assert_eq!(line.replace("\\|", "").matches('|').count(), 7, "{line}");
    }
    let fsdp = t.iter().find(|g| g.what.starts_with("FSDP")).unwrap();
    assert_eq!((fsdp.measured, fsdp.met), (0.85, false));
    let rss = t.iter().find(|g| g.what.starts_with("training-phase") && g.cell.starts_with("L2")).unwrap();
    assert!((rss.measured - 655.0 / 842.9).abs() < 1e-12 && !rss.met && rss.what.contains("Accelerate"), "{rss:?}");
}

#[test]
fn plots_from_fixed_json() {
    let summary: MatrixSummary = serde_json::from_str(&fixture("bench.json")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let written = bench::matrix::write_plots(&summary, dir.path()).unwrap();
    assert_eq!(written, [dir.path().join("throughput.svg"), dir.path().join("memory.svg")]);
    let t = std::fs::read_to_string(&written[0]).unwrap();
    assert!(t.starts_with("<svg") && t.contains("level 1 ddp") && t.contains("level 2 ddp") && t.contains("PyTorch DDP (gloo)"), "{t}");
    assert!(t.contains("world size (ranks)"));
    let m = std::fs::read_to_string(&written[1]).unwrap();
    // One bar per run with model-state figures (the failed level-3 run has none).
    assert!(m.contains("L1 ddp ×2 fc1 128 fp32") && !m.contains("L3 "), "{m}");
    for part in ["parameters", "gradients", "optimizer", "gathered peak", "rest of peak RSS"] {
        assert!(m.contains(part), "{part}");
    }
}

/// A run on a loaded machine says so at the top of bench.md, where the book's tables come from.
#[test]
fn a_loaded_run_says_so_in_its_markdown() {
    let mut summary: MatrixSummary = serde_json::from_str(&fixture("bench.json")).unwrap();
    assert!(!bench_markdown(&summary).contains("> warning: load average"));
    summary.load_warnings = vec!["warning: load average 7.5 on 2 cores at the start of the run: …".into()];
    let md = bench_markdown(&summary);
    let throughput = md.find("## Throughput").unwrap();
    assert!(md[..throughput].contains("\n> warning: load average 7.5 on 2 cores at the start of the run: …\n"), "{md}");
}
