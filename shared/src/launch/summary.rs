//! torchrun's error summary of a failed job: the root cause first as entry `[0]`, the other
//! failures as `[1]`, `[2]`, … (one numbering), an error that several ranks hit reported once
//! with the ranks that hit it, and where each rank was last seen when ranks were left waiting
//! (the progress records, see [`crate::dist::progress`]).

use super::*;

/// A failure and the ranks that failed the same way.
struct Group<'a> {
    first: &'a FailureRecord,
    ranks: Vec<usize>,
}

/// What makes two failures "the same": exit code, launch error, and the last stderr lines
/// without the rank-specific prefixes (`[rank1]: `, `error on rank 1 of 2: `).
fn key(f: &FailureRecord) -> (i32, Option<String>, Vec<String>) {
    let strip = |l: &str| -> String {
        let l = match l.strip_prefix("[rank").and_then(|r| r.split_once("]: ")) {
            Some((_, rest)) => rest,
            None => l,
        };
        match l.strip_prefix("error on rank ").and_then(|r| r.split_once(": ")) {
            Some((_, rest)) => rest.to_string(),
            None => l.to_string(),
        }
    };
    (f.exitcode, f.error.clone(), f.last_stderr.iter().rev().take(1).map(|l| strip(l)).collect())
}

fn group(failures: &[FailureRecord]) -> Vec<Group<'_>> {
    let mut groups: Vec<Group> = Vec::new();
    for f in failures {
        let same = |g: &Group| g.first.rank == f.rank || (!f.last_stderr.is_empty() && key(g.first) == key(f));
        match groups.iter_mut().find(|g| same(g)) {
            Some(g) if !g.ranks.contains(&f.rank) => g.ranks.push(f.rank),
            Some(_) => {}
            None => groups.push(Group { first: f, ranks: vec![f.rank] }),
        }
    }
    groups
}

/// torchrun's `ChildFailedError` summary; `stuck` lists where ranks were last seen (empty when
/// no rank was left waiting).
pub(super) fn summary(label: &str, failures: &[FailureRecord], stuck: &[String]) -> String {
    let first = &failures[0];
    let rule = "=".repeat(60);
    let thin = "-".repeat(60);
    let mut s = format!(
        "rank {} (local_rank {}, host {}) failed with exitcode {}\n{rule}\n{label} FAILED\n{thin}\nRoot Cause (first observed failure):\n",
        first.rank,
        first.local_rank,
        first.host,
        describe_exitcode(first.exitcode)
    );
    let groups = group(failures);
    s.push_str(&entry(0, &groups[0]));
    s.push_str(&format!("{thin}\nOther Failures:\n"));
    if groups.len() == 1 {
        s.push_str("  <NO_OTHER_FAILURES>\n");
    } else {
        for (i, g) in groups.iter().enumerate().skip(1) {
            s.push_str(&entry(i, g));
        }
    }
    if !stuck.is_empty() {
        s.push_str(&format!("{thin}\nWhere the ranks were (progress records):\n"));
        for l in stuck {
            s.push_str(&format!("  {l}\n"));
        }
    }
    s.push_str(&rule);
    s
}

pub(super) fn describe_exitcode(code: i32) -> String {
    if code < 0 {
        format!("{code} ({})", sys::signal_name(-code))
    } else {
        code.to_string()
    }
}

fn entry(i: usize, g: &Group) -> String {
    let f = g.first;
    let rank = if g.ranks.len() == 1 {
        format!("{} (local_rank: {})", f.rank, f.local_rank)
    } else {
        let r: Vec<String> = g.ranks.iter().map(|r| r.to_string()).collect();
        format!("{} (the same error on {} ranks)", r.join(", "), g.ranks.len())
    };
    let mut s = format!(
        "[{i}]:\n  host      : {}\n  rank      : {rank}\n  exitcode  : {} (pid: {})\n",
        f.host,
        describe_exitcode(f.exitcode),
        f.pid
    );
    if let Some(e) = &f.error {
        s.push_str(&format!("  error     : {e}\n"));
    }
    if f.last_stderr.is_empty() {
        s.push_str("  stderr    : <empty>\n");
    } else {
        s.push_str(&format!("  stderr    : last {} lines:\n", f.last_stderr.len()));
        for l in &f.last_stderr {
            s.push_str(&format!("    {l}\n"));
        }
    }
    s
}
