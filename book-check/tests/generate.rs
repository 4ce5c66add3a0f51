//! `book-check generate` and the freshness half of `book-check check` on a fixture workspace:
//! three levels, a baseline, a snapshot the book includes, and one reference run
//! (tests/fixtures/run: provenance.md, a bench.md cut to 40 rows, demo.md) — and on the real
//! workspace, that the README's `make demo` block and the book's tables come from one run.

use book_check::generate::{check_fresh, outputs, write};
use book_check::{diff, provenance};
use std::path::{Path, PathBuf};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

const README: &str = "# x\n\n<!-- generated:demo:begin (scripts/book-data.sh) -->\nold\n<!-- generated:demo:end -->\n\nmore\n";

fn workspace() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let put = |rel: &str, text: &str| {
        let p = dir.path().join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    };
    let span = |body: &str| format!("fn f() {{\n    // ANCHOR: user_code\n{body}    // ANCHOR_END: user_code\n}}\n");
    put(diff::LEVELS[0].file, &span("    let pg = setup()?;\n    train(&pg);\n    cleanup(pg);\n"));
    put(diff::LEVELS[1].file, &span("    let acc = Accelerator::new()?;\n    train(&acc);\n"));
    put(diff::LEVELS[2].file, &span("    trainer.train()?;\n"));
    put(diff::BASELINE.file, "fn b() {\n    // ANCHOR: user_code\n    train(&net);\n    // ANCHOR_END: user_code\n}\n");
    put(
        "shared/tests/snapshots/data_errors__checksum.snap",
        "---\nsource: shared/tests/data_errors.rs\nexpression: e\n---\nchecksum mismatch\n",
    );
    put("book/src/baseline.md", "# B\n\n```text\n{{#include generated/snapshots/shared/data_errors__checksum.txt}}\n```\n");
    for f in ["provenance.md", "bench.md", "demo.md"] {
        put(&format!("book/src/generated/{f}"), &std::fs::read_to_string(fixtures().join("run").join(f)).unwrap());
    }
    put("README.md", README);
    dir
}

#[test]
fn generate_writes_everything_and_check_then_finds_it_fresh() {
    let ws = workspace();
    let root = ws.path();
    assert!(check_fresh(root).is_err(), "nothing generated yet");
    let outs = outputs(root).unwrap();
    let written = write(root, &outs).unwrap();
    assert_eq!(written.len(), outs.len());
    assert_eq!(check_fresh(root).unwrap(), outs.len());
    // A second generate rewrites nothing.
    assert!(write(root, &outputs(root).unwrap()).unwrap().is_empty());
    let names: Vec<String> = outs.iter().map(|o| o.path.display().to_string()).collect();
    for expected in [
        "book/src/generated/baseline-to-level2.md",
        "book/src/generated/level1-to-level2.md",
        "book/src/generated/memory-arithmetic.md",
        "book/src/generated/snapshots/shared/data_errors__checksum.txt",
        "book/src/generated/q-sharding.md",
        "book/src/generated/measurements-full.md",
        "book/src/generated/plot-throughput.svg",
        "README.md",
    ] {
        assert!(names.iter().any(|n| n == expected), "{expected} not in {names:?}");
    }
    // The run's one-process baseline (level `baseline`, 1 rank, fp32 only) has no bf16 line and
    // does not set the model-state table's world size; the peers' table and the plot show it.
    let generated = |name: &str| std::fs::read_to_string(root.join("book/src/generated").join(name)).unwrap();
    assert!(!generated("q-bf16.md").contains("baseline"), "{}", generated("q-bf16.md"));
    assert!(generated("q-model-state.md").contains("Rank 0 at 2 ranks, fp32:"), "{}", generated("q-model-state.md"));
    assert!(
        generated("q-peers.md").contains("| baseline | single · 1 rank · fc1 128 · fp32 | 2900 | PyTorch tutorial |"),
        "{}",
        generated("q-peers.md")
    );
    assert!(generated("plot-throughput.svg").contains("baseline · single · 1 rank\n"));
    // The snapshot without insta's header; the README block is the run's line and demo table.
    let snap = std::fs::read_to_string(root.join("book/src/generated/snapshots/shared/data_errors__checksum.txt")).unwrap();
    assert_eq!(snap, "checksum mismatch\n");
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let block = provenance::block(&readme, "demo").unwrap();
    assert!(block.starts_with("Measured by `make book-data` on 2026-12-01T19:40:22Z, AMD EPYC, 2 cores (commit `7573123`)"), "{block}");
    assert!(block.contains("| 1 · raw DDP"), "{block}");
    // The fixture's code counts 3, 2, 1 user-code lines; the run measured 99, 71, 38: said under the table.
    assert!(block.ends_with("its spans count 3, 2, 1 lines now (levels 1, 2, 3; `book-check generate` counts them), against 99, 71, 38 in the table. The next `make book-data` measures the code as it is.*"), "{block}");
    assert!(readme.ends_with("<!-- generated:demo:end -->\n\nmore\n"), "{readme}");
}

#[test]
fn a_changed_source_makes_its_generated_file_stale() {
    let ws = workspace();
    let root = ws.path();
    write(root, &outputs(root).unwrap()).unwrap();
    std::fs::write(root.join("shared/tests/snapshots/data_errors__checksum.snap"), "---\nsource: x\n---\nanother message\n").unwrap();
    std::fs::write(root.join(diff::LEVELS[1].file), "// ANCHOR: user_code\nlet acc = Accelerator::new()?;\n// ANCHOR_END: user_code\n")
        .unwrap();
    let err = check_fresh(root).unwrap_err().to_string();
    // The four listings and diffs of level 2, the snapshot's copy, and the demo table and the
    // README's block, whose notes give the user-code line counts of the code.
    assert!(err.starts_with("7 generated file(s) out of date"), "{err}");
    assert!(err.contains("book/src/generated/demo-table.md: differs"), "{err}");
    assert!(err.contains("README.md: the `make demo` block is not generated/demo.md of the reference run with the note on the user-code lines the code counts now"), "{err}");
    assert!(err.contains("book/src/generated/snapshots/shared/data_errors__checksum.txt: differs from what `book-check generate` writes now (from the test's snapshot)"), "{err}");
    assert!(
        err.contains(
            "book/src/generated/level1-to-level2.md: differs from what `book-check generate` writes now (from the `user_code` anchors)"
        ),
        "{err}"
    );
}

#[test]
fn a_readme_block_from_another_run_is_named_with_both_runs() {
    let ws = workspace();
    let root = ws.path();
    write(root, &outputs(root).unwrap()).unwrap();
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    std::fs::write(root.join("README.md"), readme.replace("2026-12-01T19:40:22Z", "2026-11-30T08:00:00Z")).unwrap();
    let err = check_fresh(root).unwrap_err().to_string();
    assert_eq!(
        err,
        "1 generated file(s) out of date (run `make book`, or `book-check generate`):\n\
         README.md: the `make demo` block comes from another run than the book's tables:\n  \
         README:            Measured by `make book-data` on 2026-11-30T08:00:00Z, AMD EPYC, 2 cores (commit `7573123`); figures vary by machine: compare rows of one run only.\n  \
         book (provenance): Measured by `make book-data` on 2026-12-01T19:40:22Z, AMD EPYC, 2 cores (commit `7573123`); figures vary by machine: compare rows of one run only."
    );
}

#[test]
fn a_bench_table_without_a_column_the_book_reads_is_named() {
    let ws = workspace();
    let root = ws.path();
    let bench = root.join("book/src/generated/bench.md");
    let text = std::fs::read_to_string(&bench).unwrap().replace("| vs ddp |", "| versus ddp |");
    std::fs::write(&bench, text).unwrap();
    let err = outputs(root).unwrap_err().to_string();
    assert!(err.ends_with("bench.md: the Throughput table has no `vs ddp` column"), "{err}");
}

/// The real workspace: the README's `make demo` block and every table of the book that comes
/// from the reference run carry the provenance line of `book/src/generated/provenance.md`; the
/// fit sweep's table, that of `fit-provenance.md`.
#[test]
fn the_readme_and_the_book_show_one_run() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let gen = root.join("book/src/generated");
    let Ok(prov) = std::fs::read_to_string(gen.join("provenance.md")) else {
        panic!("book/src/generated/provenance.md is missing: run `make book-data`");
    };
    let line = provenance::line(&prov, &gen.join("provenance.md")).unwrap();
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let block = provenance::block(&readme, "demo").expect("README.md has a generated:demo block");
    assert_eq!(block.lines().next(), Some(line.as_str()), "README.md's `make demo` block comes from another run");
    let demo = std::fs::read_to_string(gen.join("demo.md")).unwrap();
    let counts = book_check::generate::user_code_counts(&root).unwrap();
    assert_eq!(
        block,
        book_check::generate::readme_demo_block(&line, &demo, &counts).trim(),
        "README.md's `make demo` block is not generated/demo.md (with the note on the user-code lines the code counts now)"
    );
    // The "Will it fit?" sweep is a run of its own, with its own provenance.
    let fit_prov = gen.join("fit-provenance.md");
    let fit_line = std::fs::read_to_string(&fit_prov).ok().map(|p| provenance::line(&p, &fit_prov).unwrap());
    let mut tables = 0;
    for entry in std::fs::read_dir(&gen).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if name.starts_with("q-") || name == "measurements-full.md" {
            let text = std::fs::read_to_string(&path).unwrap();
            let expected = match name.as_str() {
                "q-fit.md" => fit_line.clone().expect("q-fit.md without generated/fit-provenance.md"),
                _ => line.clone(),
            };
            assert!(text.starts_with(&format!("<!-- {expected} -->")), "{name} comes from another run");
            tables += 1;
        }
    }
    assert!(tables > 0, "no table of the reference run in book/src/generated/");
}
