//! Memory accounting: the process peak resident set size (`VmHWM`) and per-rank model-state
//! bytes (parameters, gradients, optimizer state, transient gathered parameters); the
//! estimate of both before a run ([`estimate`], with the layouts' closed forms in [`layout`]).

pub mod checkpoint_save;
pub mod estimate;
pub mod layout;
pub mod size;

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

/// CUDA device `device`'s caching-allocator bytes, as `torch.cuda.memory_stats(device)`'s
/// aggregate pool: `(allocated, peak allocated)`, the peak since start-up or the last
/// [`reset_cuda_peak_memory_stats`] (`torch.cuda.max_memory_allocated`). Tensors' bytes, rounded
/// to the allocator's 512-byte blocks; the CUDA context and the allocator's cached, unallocated
/// segments are not in it (`nvidia-smi` shows those too). `None` where libtorch's CUDA
/// allocator is not loaded (a CPU run, a build without CUDA).
pub fn cuda_allocator_bytes(device: usize) -> Option<(u64, u64)> {
    let [allocated, peak, _, _] = crate::ffi::memory::cuda_memory_stats(device).ok()?;
    Some((allocated.max(0) as u64, peak.max(0) as u64))
}

/// Resets CUDA device `device`'s allocator peak to what is allocated now, as
/// `torch.cuda.reset_peak_memory_stats(device)`. Returns `false` where libtorch's CUDA
/// allocator is not loaded.
pub fn reset_cuda_peak_memory_stats(device: usize) -> bool {
    crate::ffi::memory::cuda_reset_peak_memory_stats(device).is_ok()
}

/// Bytes to MiB (2^20 bytes).
pub fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// Bytes one training step of [`BasicNet`](crate::model::BasicNet) needs per sample for its
/// activations and their gradients, with fc1 `width` (the tutorial's 128), all f32: an
/// upper-ish estimate derived from the layer shapes, so that a batch that cannot fit is refused
/// before it is allocated ([`crate::recipe::check_batch_memory`]).
///
/// Per sample, in f32 elements (4 bytes), every tensor the training forward creates — those
/// autograd keeps for backward and those freed at once alike, so it bounds what is alive when
/// the forward ends:
///
/// | tensor | elements |
/// |---|---|
/// | conv1 output, its ReLU | 32·26·26 = 21,632, twice |
/// | conv2 output (freed once max_pool2d has read it) | 64·24·24 = 36,864 |
/// | max_pool2d output, its ReLU | 64·12·12 = 9,216, twice |
/// | dropout(0.25): f32 mask (kept: CPU dropout multiplies by it), output | 9,216, twice |
/// | fc1 output, its ReLU, dropout(0.5) mask and output | `width`, four times |
/// | fc2 output, log_softmax | 10, twice |
///
/// that is `F = 117,012 + 4·width` elements; plus max_pool2d's window codes (9,216 × 1 byte,
/// [`crate::model::max_pool2d_2x2`]) and the input image with its channels-last copy (784
/// elements each, [`crate::model::channels_last`]). Backward then holds at most one gradient
/// per f32 activation (`F` more elements): gradients are freed as backward walks back, so this
/// too is an upper bound. In bytes:
///
/// `2·4·784 + 9,216 + 2·4·F = 951,584 + 32·width` (0.91 MiB per sample at width 128).
///
/// Parameters, their gradients and the optimizer state are not included (they do not grow with
/// the batch). Measured (peak RSS growth of one step, one thread, CPU, libtorch 2.13): ~80 % of
/// this figure at width 128 and ~55 % at width 4096 (`shared/tests/activation_memory.rs`): it
/// counts every tensor the step creates, also those freed before the peak.
pub fn activation_bytes_per_sample(width: i64) -> u64 {
    const INPUT: u64 = 784; // [1, 28, 28]
    const POOL_CODES_BYTES: u64 = 64 * 12 * 12; // uint8, one per window
    let w = width.max(0) as u64;
    let f32_activations = 2 * 32 * 26 * 26 + 64 * 24 * 24 + 4 * 64 * 12 * 12 + 4 * w + 2 * 10;
    2 * 4 * INPUT + POOL_CODES_BYTES + 2 * 4 * f32_activations
}

/// The memory the kernel says can be allocated without swapping (`MemAvailable` of
/// `/proc/meminfo`), bytes; `None` where `/proc/meminfo` is not available.
pub fn mem_available_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line["MemAvailable:".len()..].trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kib * 1024)
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
    /// Optimizer state in memory (AdamW: `exp_avg` and `exp_avg_sq`, 2 × parameters; with the
    /// optimizer offloaded to disk, the buffer the moments stream through).
    pub optimizer: u64,
    /// Peak transient bytes of parameters gathered for forward/backward (FSDP only; 0 for DDP).
    pub gathered_peak: u64,
    /// Optimizer state on disk: the moments in the offload file (DeepSpeed's
    /// `offload_optimizer` nvme; see [`crate::parallel::offload`]), 0 when they are in memory.
    #[serde(default)]
    pub optimizer_on_disk: u64,
}

impl ModelStateBytes {
    /// These bytes with the optimizer's moments offloaded to disk: `optimizer_on_disk` takes
    /// the moments, `optimizer` becomes the resident buffer they stream through,
    /// `buffer_bytes` ([`offload_buffer_bytes`] for fp32 masters).
    pub fn with_optimizer_offload(self, buffer_bytes: u64) -> Self {
        Self { optimizer: buffer_bytes, optimizer_on_disk: self.optimizer_on_disk + self.optimizer, ..self }
    }

    /// `self` with its optimizer state placed as `offload` says (unchanged in memory).
    pub fn placed(self, offload: crate::parallel::OffloadDevice) -> Self {
        match offload {
            crate::parallel::OffloadDevice::None => self,
            crate::parallel::OffloadDevice::Nvme => {
                self.with_optimizer_offload(offload_buffer_bytes(crate::parallel::NvmeOffload::DEFAULT_BUFFER_SIZE, layout::MASTER_BYTES))
            }
        }
    }

    /// Parameters + gradients + optimizer state: the persistent per-rank footprint.
    pub fn persistent(&self) -> u64 {
        self.parameters + self.gradients + self.optimizer
    }
}

/// Bytes of the offloaded optimizer's buffer: one chunk of each moment,
/// `2 · ⌈buffer_size / 64⌉ · 64` elements of `elt_bytes` (see [`crate::optim::AdamW::with_offload`]).
pub fn offload_buffer_bytes(buffer_size: usize, elt_bytes: u64) -> u64 {
    let align = crate::parallel::zero::ALIGN as u64;
    2 * (buffer_size.max(1) as u64).div_ceil(align) * align * elt_bytes
}

/// Serialises the unit tests that read the peak RSS or allocate large buffers: `VmHWM` and the
/// RSS are the process's, so another test's 100 MiB would show in a reading, and a timer
/// starting in another test resets the mark.
#[cfg(test)]
pub(crate) fn tests_rss_lock() -> std::sync::MutexGuard<'static, ()> {
    static RSS: std::sync::Mutex<()> = std::sync::Mutex::new(());
    RSS.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn activation_bytes_follow_the_layer_shapes() {
        assert_eq!(activation_bytes_per_sample(128), 951_584 + 32 * 128);
        assert_eq!(activation_bytes_per_sample(4096) - activation_bytes_per_sample(128), 32 * (4096 - 128));
        assert!(mem_available_bytes().is_some_and(|b| b > 0));
    }

    #[test]
    fn peak_rss_is_at_least_current_and_grows_with_a_touched_buffer() {
        let _rss = super::tests_rss_lock();
        let before = peak_rss_bytes().expect("VmHWM on Linux");
        let buf = vec![1u8; 64 << 20];
        std::hint::black_box(&buf);
        // The current RSS first: the high-water mark read after it includes it, whatever other
        // tests' threads allocate in between (read the other way round, one did, once).
        let current = current_rss_bytes().unwrap();
        let after = peak_rss_bytes().unwrap();
        assert!(after >= before + (60 << 20), "before {before} after {after}");
        assert!(after >= current, "peak {after} < current {current}");
    }
}
