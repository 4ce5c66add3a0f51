//! What `bench.json` holds: the rows, the all-reduce and DDP bucket measurements, the targets.

use super::rows::Row;
use super::targets::Target;
use crate::error::{Error, Result};
use crate::machine::Machine;
use serde::{Deserialize, Serialize};

/// One row of the all-reduce measurement (`allreduce_bench --json`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct AllReduceRow {
    /// Message size, bytes.
    pub bytes: u64,
    /// Timed rounds.
    pub iters: u64,
    /// `ProcessGroup::all_reduce` median latency, µs.
    pub ours_latency_us: f64,
    /// Raw rsmpi `all_reduce_into` median latency, µs.
    pub raw_latency_us: f64,
    /// Ours, bus bandwidth GB/s (algbw × 2(n−1)/n).
    pub ours_busbw_gbps: f64,
    /// Raw rsmpi, bus bandwidth GB/s.
    pub raw_busbw_gbps: f64,
    /// ours / raw.
    pub ratio: f64,
    /// `Collective::all_reduce(..).prechecked()` run by `ProcessGroup::run` (no per-call
    /// agreement check: DDP's path, its bucket layout checked once) median latency, µs; 0 in
    /// reports from before it was measured.
    pub prechecked_latency_us: f64,
    /// Prechecked, bus bandwidth GB/s.
    pub prechecked_busbw_gbps: f64,
    /// prechecked / raw.
    pub prechecked_ratio: f64,
}

/// The all-reduce measurement.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct AllReduce {
    /// Ranks.
    pub world_size: usize,
    /// One row per message size.
    pub rows: Vec<AllReduceRow>,
}

/// One row of the DDP bucket measurement (`examples/ddp_buckets --json`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct BucketRow {
    /// `bucket_cap_mb` (MiB); `None` for the one flat all-reduce.
    pub bucket_cap_mb: Option<f64>,
    /// Buckets (all-reduce calls) per sync.
    pub buckets: usize,
    /// Gradient bytes per sync.
    pub bytes: u64,
    /// Timed rounds.
    pub iters: usize,
    /// Median seconds of one sync, in ms.
    pub median_ms: f64,
    /// 95th percentile, ms.
    pub p95_ms: f64,
    /// Bus bandwidth, GB/s (bytes / median × 2(n−1)/n).
    pub busbw_gbps: f64,
}

/// DDP's bucketed gradient all-reduce of BasicNet vs `bucket_cap_mb`, and one flat all-reduce.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Buckets {
    /// Ranks.
    pub world_size: usize,
    /// One row per cap (1, 5, 25, 100 MiB).
    pub rows: Vec<BucketRow>,
    /// Every gradient in one buffer, one all-reduce (no packing).
    pub flat: BucketRow,
}

/// What `bench.json` holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MatrixSummary {
    /// Where and when.
    pub machine: Machine,
    /// Repeats per cell.
    pub repeats: usize,
    /// The matrix, in run order.
    pub rows: Vec<Row>,
    /// Combinations left out and why.
    pub skipped: Vec<String>,
    /// The all-reduce bandwidth, when measured.
    pub allreduce: Option<AllReduce>,
    /// Why the all-reduce measurement failed, if it did.
    pub allreduce_error: Option<String>,
    /// The targets of issues #10 and #11 with their measured values ([`targets`] of `rows`).
    #[serde(default)]
    pub targets: Vec<Target>,
    /// DDP's bucketed all-reduce vs bucket_cap_mb, when measured.
    #[serde(default)]
    pub buckets: Option<Buckets>,
    /// Why the bucket measurement failed, if it did.
    #[serde(default)]
    pub buckets_error: Option<String>,
    /// The load-average warnings of the run (at its start and end; empty on an idle machine):
    /// its samples/s and speed ratios are not meaningful when there are any.
    #[serde(default)]
    pub load_warnings: Vec<String>,
}

impl MatrixSummary {
    /// The targets its rows meet or miss, the efficiency one against this machine's CPU peak
    /// ([`super::targets`]).
    pub fn targets(&self) -> Vec<super::targets::Target> {
        super::targets(&self.rows, self.machine.cpu_peak.as_ref())
    }

    /// `Ok` when every run succeeded.
    ///
    /// # Errors
    /// [`Error::RunsFailed`] naming the failed cells (and the all-reduce measurement).
    pub fn check(&self) -> Result<()> {
        let mut names: Vec<String> = self.rows.iter().filter(|r| !r.errors.is_empty()).map(|r| r.case.id.clone()).collect();
        if self.allreduce_error.is_some() {
            names.push("allreduce".into());
        }
        if self.buckets_error.is_some() {
            names.push("ddp-buckets".into());
        }
        if names.is_empty() {
            Ok(())
        } else {
            Err(Error::RunsFailed {
                failed: names.len(),
                total: self.rows.len()
                    + usize::from(self.allreduce.is_some() || self.allreduce_error.is_some())
                    + usize::from(self.buckets.is_some() || self.buckets_error.is_some()),
                names: names.join(", "),
            })
        }
    }
}
