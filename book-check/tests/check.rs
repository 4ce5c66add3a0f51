//! book-check on fixtures: a chapter whose includes are all fine, and one with every problem.

use book_check::includes::{check, CheckSummary};
use std::path::{Path, PathBuf};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// A copy of the fixture book in a temp dir holding only the chapters named.
fn book_with(chapters: &[&str]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("src")).unwrap();
    std::fs::copy(fixtures().join("code.rs"), dir.path().join("code.rs")).unwrap();
    std::fs::copy(fixtures().join("rendered/src/tool.snap"), dir.path().join("tool.snap")).unwrap();
    for c in chapters {
        std::fs::copy(fixtures().join("src").join(c), dir.path().join("src").join(c)).unwrap();
    }
    dir
}

#[test]
fn good_chapter_passes_and_escaped_includes_are_text() {
    let dir = book_with(&["good.md"]);
    let summary = check(&dir.path().join("src"), dir.path()).unwrap();
    assert_eq!(summary, CheckSummary { files: 1, includes: 3, anchors: 2, links: 1, tests: 1 });
}

#[test]
fn every_problem_is_named_with_file_line_path_and_anchor() {
    let dir = book_with(&["good.md", "bad.md"]);
    let err = check(&dir.path().join("src"), dir.path()).unwrap_err().to_string();
    let err = err.replace(&dir.path().display().to_string(), "<book>");
    insta::assert_snapshot!(err, @r"
    10 problem(s) in the book's includes, links and named tests:
    <book>/src/bad.md:3: {{#include ../code.rs:absent}}: anchor `absent` not found in <book>/src/../code.rs (expected `// ANCHOR: absent` … `// ANCHOR_END: absent`)
    <book>/src/bad.md:4: {{#include ../code.rs:empty}}: anchor `empty` at <book>/src/../code.rs:10 is empty
    <book>/src/bad.md:5: {{#include ../code.rs:twice}}: anchor `twice` opens 2 times in <book>/src/../code.rs (lines 13, 16); mdBook shows only the first span: give each span its own name
    <book>/src/bad.md:6: {{#include ../code.rs:open}}: anchor `open` opened at <book>/src/../code.rs:19 is never closed by `ANCHOR_END: open`
    <book>/src/bad.md:7: {{#include ../no_such_file.rs:good}}: <book>/src/../no_such_file.rs does not exist
    <book>/src/bad.md:8: {{#include generated/table.md}}: <book>/src/generated/table.md does not exist (run `make book-data`)
    <book>/src/bad.md:10: {{#include ../tool.snap}}: a .snap shows insta's header (`source:`, `expression:`, …) on the page: include `generated/snapshots/<crate>/tool.txt` (written without it by `book-check generate`)
    <book>/src/bad.md:9: link (generated/plot.svg): <book>/src/generated/plot.svg does not exist (run `make book-data`)
    <book>/src/bad.md:9: test `code.rs::no_such_test`: no `fn no_such_test` in <book>/code.rs
    <book>/src/bad.md:9: test `missing.rs::t`: <book>/missing.rs does not exist
    ");
}

#[test]
fn the_real_book_passes() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../book/src");
    if src.exists() {
        let summary = check(&src, &src.join("../..")).unwrap_or_else(|e| panic!("{e}"));
        assert!(summary.anchors > 0, "the book includes no anchored listing: {summary:?}");
    }
}
