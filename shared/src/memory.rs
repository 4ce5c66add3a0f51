//! Memory accounting: the process peak resident set size (`VmHWM`) and per-rank model-state
//! bytes (parameters, gradients, optimizer state, transient gathered parameters).

use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicU64, Ordering};

/// The highest `VmHWM` seen before a [`reset_peak_rss`], bytes.
static PEAK_BEFORE_RESET: AtomicU64 = AtomicU64::new(0);

/// Peak resident set size of this process in bytes since start-up (`VmHWM` of
/// `/proc/self/status`, or the high-water mark [`reset_peak_rss`] saw before resetting it, if
/// higher); `None` where `/proc` is not available.
pub fn peak_rss_bytes() -> Option<u64> {
    proc_status_kib("VmHWM:").map(|kib| (kib * 1024).max(PEAK_BEFORE_RESET.load(Ordering::Relaxed)))
}

/// Resets the kernel's peak RSS (`VmHWM`) to the current RSS by writing `5` to
/// `/proc/self/clear_refs`, so that a later `VmHWM` is the peak of what came after (a training
/// phase); [`peak_rss_bytes`] still reports the whole process's peak. Returns `true` when the
/// reset took effect (right after it, `VmHWM` is within 1 MiB of `VmRSS`).
pub fn reset_peak_rss() -> bool {
    let Some(before) = proc_status_kib("VmHWM:") else { return false };
    PEAK_BEFORE_RESET.fetch_max(before * 1024, Ordering::Relaxed);
    if std::fs::write("/proc/self/clear_refs", "5").is_err() {
        return false;
    }
    match (proc_status_kib("VmHWM:"), proc_status_kib("VmRSS:")) {
        (Some(hwm), Some(rss)) => hwm <= rss + 1024,
        _ => false,
    }
}

/// The kernel's `VmHWM` as it stands (since the last [`reset_peak_rss`]), bytes.
pub fn peak_rss_since_reset_bytes() -> Option<u64> {
    proc_status_kib("VmHWM:").map(|kib| kib * 1024)
}

/// Current resident set size of this process in bytes (`VmRSS`).
pub fn current_rss_bytes() -> Option<u64> {
    proc_status_kib("VmRSS:").map(|kib| kib * 1024)
}

/// Bytes to MiB (2^20 bytes).
pub fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn proc_status_kib(key: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(key))?;
    line[key.len()..].trim().trim_end_matches("kB").trim().parse().ok()
}

/// Bytes of model state that one rank keeps, by kind. Figures are exact byte counts of the
/// tensors the rank holds (numel × element size), not estimates.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelStateBytes {
    /// Persistent parameters (for FSDP: the local shards of every FlatParameter).
    pub parameters: u64,
    /// Persistent gradients (same layout as `parameters`).
    pub gradients: u64,
    /// Optimizer state (AdamW: `exp_avg` and `exp_avg_sq`, 2 × parameters).
    pub optimizer: u64,
    /// Peak transient bytes of parameters gathered for forward/backward (FSDP only; 0 for DDP).
    pub gathered_peak: u64,
}

impl ModelStateBytes {
    /// Parameters + gradients + optimizer state: the persistent per-rank footprint.
    pub fn persistent(&self) -> u64 {
        self.parameters + self.gradients + self.optimizer
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peak_rss_is_at_least_current_and_grows_with_a_touched_buffer() {
        let before = peak_rss_bytes().expect("VmHWM on Linux");
        let buf = vec![1u8; 64 << 20];
        std::hint::black_box(&buf);
        let after = peak_rss_bytes().unwrap();
        assert!(after >= before + (60 << 20), "before {before} after {after}");
        assert!(after >= current_rss_bytes().unwrap());
    }
}
