//! torchrun's error summary of a failed job.

use super::*;

/// torchrun's `ChildFailedError` summary.
pub(super) fn summary(label: &str, failures: &[FailureRecord]) -> String {
    let first = &failures[0];
    let rule = "=".repeat(60);
    let thin = "-".repeat(60);
    let mut s = format!(
        "rank {} (local_rank {}, host {}) failed with exitcode {}\n{rule}\n{label} FAILED\n{thin}\nFailures:\n",
        first.rank,
        first.local_rank,
        first.host,
        describe_exitcode(first.exitcode)
    );
    if failures.len() == 1 {
        s.push_str("  <NO_OTHER_FAILURES>\n");
    } else {
        for (i, f) in failures.iter().enumerate().skip(1) {
            s.push_str(&entry(i, f));
        }
    }
    s.push_str(&format!("{thin}\nRoot Cause (first observed failure):\n"));
    s.push_str(&entry(0, first));
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

pub(super) fn entry(i: usize, f: &FailureRecord) -> String {
    let mut s = format!(
        "[{i}]:\n  host      : {}\n  rank      : {} (local_rank: {})\n  exitcode  : {} (pid: {})\n",
        f.host,
        f.rank,
        f.local_rank,
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
