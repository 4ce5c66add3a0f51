//! Every file the book's tooling generates, from one place: `book-check generate` writes them
//! (`make book`), `book-check check` regenerates them in memory and fails on any that differs
//! from the file on disk (`make test`) — so a listing, diff, table or plot in the book is never
//! older than the source or run it comes from.
//!
//! What is generated, all under `book/src/generated/` but the README:
//!
//! * the level listings and the statement diffs ([`crate::diff`]), from the `user_code` anchors;
//! * `memory-arithmetic.md` ([`crate::memory`]), from BasicNet's layer shapes;
//! * `snapshots/<crate>/<name>.txt` ([`crate::snapshots`]), the tests' snapshots without
//!   insta's header;
//! * from the reference run of `make book-data` (`provenance.md`, `bench.md`, `demo.md`): the
//!   small tables, the full tables and the plots ([`crate::figures`]), and the README's
//!   `make demo` block ([`crate::provenance`]) — all carrying the run's one provenance line.

use crate::error::{Error, Result};
use crate::{diff, figures, memory, provenance, snapshots};
use std::path::{Path, PathBuf};

/// The fc1 widths and world sizes of the memory arithmetic.
pub const MEMORY_WIDTHS: [u64; 2] = [128, 4096];
/// See [`MEMORY_WIDTHS`].
pub const MEMORY_WORLD_SIZES: [u64; 2] = [2, 4];

/// One generated file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    /// Its path, relative to the workspace root.
    pub path: PathBuf,
    /// Its contents.
    pub text: String,
    /// What makes it, for messages.
    pub from: &'static str,
}

/// Every generated file, computed from the sources and the reference run under `root`.
///
/// # Errors
/// A source that cannot be read, an anchor missing, a generated input without what a table
/// needs.
pub fn outputs(root: &Path) -> Result<Vec<Output>> {
    let src = Path::new("book/src");
    let gen = src.join("generated");
    let mut out = Vec::new();
    for (name, text) in diff::generated(root)? {
        out.push(Output { path: gen.join(name), text, from: "the `user_code` anchors" });
    }
    out.push(Output {
        path: gen.join("memory-arithmetic.md"),
        text: memory::markdown(&MEMORY_WIDTHS, &MEMORY_WORLD_SIZES),
        from: "BasicNet's layer shapes",
    });
    for (path, text) in snapshots::generated(root, &root.join(src))? {
        out.push(Output { path, text, from: "the test's snapshot" });
    }
    if let Some(fit) = figures::load_fit(&root.join(&gen))? {
        out.push(Output { path: gen.join("q-fit.md"), text: figures::fit::fit_tables(&fit)?, from: "the fit sweep (generated/fit.md)" });
    }
    if let Some(run) = figures::load(&root.join(&gen))? {
        let counts = user_code_counts(root)?;
        let demo_md = std::fs::read_to_string(root.join(&gen).join("demo.md")).unwrap_or_default();
        for (name, mut text) in figures::generated(&run)? {
            if name == "demo-table.md" {
                text.push_str(&figures::line_count_note(&demo_md, &counts).unwrap_or_default());
            }
            out.push(Output { path: gen.join(name), text, from: "the reference run (generated/bench.md)" });
        }
        let demo_file = root.join(&gen).join("demo.md");
        if let Ok(demo) = std::fs::read_to_string(&demo_file) {
            let readme_file = root.join("README.md");
            let readme = std::fs::read_to_string(&readme_file).map_err(|e| Error::io(&readme_file, e))?;
            let text = provenance::replace_block(&readme, "demo", &readme_demo_block(&run.line, &demo, &counts), Path::new("README.md"))?;
            out.push(Output { path: "README.md".into(), text, from: "the reference run (generated/demo.md)" });
        }
    }
    Ok(out)
}

/// The user-code lines of levels 1, 2 and 3 as the code is now (what `bench demo` counts).
///
/// # Errors
/// An unreadable source, a missing or unclosed anchor.
pub fn user_code_counts(root: &Path) -> Result<Vec<usize>> {
    diff::LEVELS.iter().map(|l| diff::user_code(root, l).map(|c| diff::code_lines(&c))).collect()
}

/// The README's `make demo` block: the run's `line` and `demo.md` ([`provenance::demo_block`]),
/// then — when the code's user-code lines (`counts`, levels 1 to 3) are no longer those the run
/// measured — the note that says so ([`figures::line_count_note`]), until the next
/// `make book-data`.
pub fn readme_demo_block(line: &str, demo_md: &str, counts: &[usize]) -> String {
    let mut block = provenance::demo_block(line, demo_md);
    if let Some(note) = figures::line_count_note(demo_md, counts) {
        block.push('\n');
        block.push_str(&note);
    }
    block
}

/// Writes every output whose file differs; returns the paths written.
///
/// # Errors
/// A file or directory that cannot be written.
pub fn write(root: &Path, outputs: &[Output]) -> Result<Vec<PathBuf>> {
    let mut written = Vec::new();
    for o in outputs {
        let path = root.join(&o.path);
        if std::fs::read_to_string(&path).is_ok_and(|t| t == o.text) {
            continue;
        }
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        }
        std::fs::write(&path, &o.text).map_err(|e| Error::io(&path, e))?;
        written.push(o.path.clone());
    }
    Ok(written)
}

/// The outputs whose file is missing or differs, one message each; for the README, which
/// run each side comes from.
pub fn stale(root: &Path, outputs: &[Output]) -> Vec<String> {
    let mut problems = Vec::new();
    for o in outputs {
        let path = root.join(&o.path);
        match std::fs::read_to_string(&path) {
            Ok(t) if t == o.text => {}
            Ok(t) if o.path == Path::new("README.md") => {
                let first = |text: &str| provenance::block(text, "demo").and_then(|b| b.lines().next()).unwrap_or("(no block)").to_string();
                let (has, wants) = (first(&t), first(&o.text));
                if has == wants {
                    problems.push(format!("{}: the `make demo` block is not generated/demo.md of the reference run with the note on the user-code lines the code counts now", o.path.display()));
                } else {
                    problems.push(format!(
                        "{}: the `make demo` block comes from another run than the book's tables:\n  README:            {has}\n  book (provenance): {wants}",
                        o.path.display()
                    ));
                }
            }
            Ok(_) => problems.push(format!("{}: differs from what `book-check generate` writes now (from {})", o.path.display(), o.from)),
            Err(_) => problems.push(format!("{}: missing (generated from {})", o.path.display(), o.from)),
        }
    }
    problems
}

/// [`stale`] as a result.
///
/// # Errors
/// [`Error::Stale`] listing every stale file.
pub fn check_fresh(root: &Path) -> Result<usize> {
    let outputs = outputs(root)?;
    let problems = stale(root, &outputs);
    if problems.is_empty() {
        Ok(outputs.len())
    } else {
        Err(Error::Stale { problems })
    }
}
