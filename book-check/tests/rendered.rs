//! The rendered-page check on pages mdBook 0.5.4 rendered from fixture chapters
//! (tests/fixtures/rendered: `src/` the chapters, `book/` the `<main>` of each rendered page):
//! a good chapter passes, and each fault fails with its own message.

use book_check::rendered::check;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/rendered")
}

/// A copy of the fixture book whose SUMMARY lists only `chapters`; every page written a minute
/// after every source, as `mdbook build` leaves them.
fn book_with(chapters: &[&str]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let (src, out) = (dir.path().join("src"), dir.path().join("book"));
    std::fs::create_dir_all(&src).unwrap();
    std::fs::create_dir_all(&out).unwrap();
    let then = SystemTime::now() - Duration::from_secs(3600);
    for entry in std::fs::read_dir(fixture().join("src")).unwrap() {
        let path = entry.unwrap().path();
        let dest = src.join(path.file_name().unwrap());
        std::fs::copy(&path, &dest).unwrap();
        File::options().write(true).open(&dest).unwrap().set_modified(then).unwrap();
    }
    let mut summary = String::from("# Summary\n\n");
    for c in chapters {
        summary.push_str(&format!("- [{c}]({c}.md)\n"));
        let page = out.join(format!("{c}.html"));
        std::fs::copy(fixture().join("book").join(format!("{c}.html")), &page).unwrap();
        File::options().write(true).open(&page).unwrap().set_modified(then + Duration::from_secs(60)).unwrap();
    }
    std::fs::write(src.join("SUMMARY.md"), summary).unwrap();
    File::options().write(true).open(src.join("SUMMARY.md")).unwrap().set_modified(then).unwrap();
    dir
}

fn problems(chapters: &[&str]) -> Vec<String> {
    let dir = book_with(chapters);
    match check(dir.path()) {
        Ok(_) => Vec::new(),
        Err(e) => e.to_string().replace(&dir.path().display().to_string(), "<book>").lines().skip(1).map(str::to_string).collect(),
    }
}

#[test]
fn a_good_page_passes_with_its_escaped_include_and_list_fence() {
    let dir = book_with(&["good"]);
    let s = check(dir.path()).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((s.pages, s.headings), (1, 2));
}

#[test]
fn a_snapshot_in_a_list_fence_breaks_the_page_three_ways() {
    // The fault of the baseline chapter: the .snap's `---` ends the list and its fence, the
    // header becomes an h2, and the chapter's next fence shows as text.
    let p = problems(&["fence"]);
    assert_eq!(p.len(), 3, "{p:#?}");
    assert!(p[0].starts_with("<book>/book/fence.html: a stray code fence on the page (rendered text line 21: \"```rust\")"), "{}", p[0]);
    assert!(
        p[1].starts_with("<book>/book/fence.html: insta's snapshot header on the page (`source: shared/tests/data_errors.rs`)"),
        "{}",
        p[1]
    );
    assert!(
        p[2].starts_with("<book>/book/fence.html: heading h2 \"source: shared/tests/data_errors.rs expression: err.to_string()\""),
        "{}",
        p[2]
    );
}

#[test]
fn a_directive_mdbook_did_not_expand_is_named() {
    let p = problems(&["raw"]);
    assert_eq!(p, ["<book>/book/raw.html: 1 raw `{{#` on the page but 0 escaped in the chapter: a directive mdBook did not expand (a misspelt or missing include)"]);
}

#[test]
fn a_snapshot_header_in_a_listing_is_named() {
    let p = problems(&["header"]);
    assert_eq!(p.len(), 1, "{p:#?}");
    assert!(p[0].contains("insta's snapshot header on the page (`source: shared/tests/data_errors.rs`)"), "{}", p[0]);
}

#[test]
fn headings_of_an_included_file_are_named() {
    let p = problems(&["heading"]);
    assert_eq!(p.len(), 2, "{p:#?}");
    assert!(p[0].starts_with("<book>/book/heading.html: heading h1 \"A generated report\" on the page (and in the sidebar)"), "{}", p[0]);
    assert!(p[1].starts_with("<book>/book/heading.html: heading h2 \"Throughput\""), "{}", p[1]);
}

#[test]
fn a_page_older_than_its_chapter_or_an_included_file_is_stale() {
    let dir = book_with(&["good"]);
    let later = SystemTime::now();
    File::options().write(true).open(dir.path().join("src/table.md")).unwrap().set_modified(later).unwrap();
    let err = check(dir.path()).unwrap_err().to_string().replace(&dir.path().display().to_string(), "<book>");
    assert_eq!(
        err,
        "1 problem(s) in the rendered book:\n<book>/book/good.html: older than <book>/src/table.md (changed after the book was built): run `mdbook build <book>`"
    );
}

#[test]
fn a_chapter_never_rendered_is_named() {
    let dir = book_with(&["good"]);
    std::fs::remove_file(dir.path().join("book/good.html")).unwrap();
    let err = check(dir.path()).unwrap_err().to_string();
    assert!(err.contains("good.html: No such file or directory"), "{err}");
}
