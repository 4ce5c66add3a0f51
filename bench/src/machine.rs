//! The machine a measurement was taken on; every output carries it.

use crate::compute::{cpu_peak, gpu_peak, CpuFacts, Peak};
use serde::{Deserialize, Serialize};
use std::process::Command;

/// Where and when a run happened.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Machine {
    /// `model name` from /proc/cpuinfo.
    pub cpu: String,
    /// Logical cores available to this process.
    pub cores: usize,
    /// Whether the CPU advertises bf16 instructions (`avx512_bf16` or `amx_bf16`).
    pub cpu_bf16: bool,
    /// `nvidia-smi -L`'s lines, or `none`.
    pub gpu: String,
    /// UTC date and time, ISO 8601.
    pub date: String,
    /// Kernel release.
    pub os: String,
    /// The bench crate's version.
    pub bench_version: String,
    /// The PyTorch version of the peers' venv, when they ran.
    pub torch_version: Option<String>,
    /// The CPU's peak FLOP/s and how it was derived ([`crate::compute::cpu_peak`]); `None` in
    /// reports from before it was recorded.
    pub cpu_peak: Option<Peak>,
    /// The first GPU's peak from its model name ([`crate::compute::gpu_peak`]); `None` without a
    /// GPU or for a model the table does not know.
    pub gpu_peak: Option<Peak>,
}

impl Machine {
    /// Describes this machine now. Never fails: what cannot be read is left as `unknown`.
    pub fn describe() -> Self {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("model name").and_then(|r| r.split_once(':')).map(|(_, v)| v.trim().to_string()))
            .unwrap_or_else(|| "unknown".into());
        let cpu_bf16 = ladder_core::device::bf16_units_in(&cpuinfo).is_some_and(|units| !units.is_empty());
        let gpu = Command::new("nvidia-smi")
            .arg("-L")
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().replace('\n', "; "))
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| "none".into());
        let gpu_peak = gpu_peak(gpu.split("; ").next().unwrap_or(""));
        Machine {
            cpu_peak: Some(cpu_peak(&CpuFacts::of_this_machine())),
            gpu_peak: if gpu == "none" { None } else { gpu_peak },
            cpu,
            cores: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            cpu_bf16,
            gpu,
            date: utc_now(),
            os: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .map(|s| format!("Linux {}", s.trim()))
                .unwrap_or_else(|_| "unknown".into()),
            bench_version: env!("CARGO_PKG_VERSION").into(),
            torch_version: None,
        }
    }

    /// A warning when the load average `load` (one minute), less the `own` processes the
    /// bench itself kept running during that minute (its ranks: 0 at the start, the most ranks
    /// it runs at once at the end), exceeds the `cores` at the `when` of a run: other processes
    /// then take the cores the ranks and the peers were timed on, so samples/s and the ratios
    /// between them say as much about that load as about the code (ours / peer read 1.08× at
    /// load 8 on 2 cores). `None` below it or where unknown.
    pub fn load_warning(load: Option<f64>, cores: usize, own: usize, when: &str) -> Option<String> {
        let load = load.filter(|l| *l - own as f64 > cores as f64)?;
        Some(format!(
            "warning: load average {load:.1} on {cores} cores {when}: other processes compete for the cores, so samples/s \
             and the ratios (ours / peer, bf16 / fp32, …) are not meaningful; rerun on an idle machine"
        ))
    }

    /// The one-minute load average (`/proc/loadavg`); `None` where it cannot be read.
    pub fn load_average() -> Option<f64> {
        std::fs::read_to_string("/proc/loadavg").ok()?.split_whitespace().next()?.parse().ok()
    }

    /// One line for the top of a table.
    pub fn line(&self) -> String {
        let mut s = format!(
            "{} · {} cores · bf16 {} · GPU {} · {} · {}",
            self.cpu,
            self.cores,
            if self.cpu_bf16 { "yes" } else { "no" },
            self.gpu,
            self.os,
            self.date
        );
        if let Some(t) = &self.torch_version {
            s.push_str(&format!(" · PyTorch {t}"));
        }
        s
    }
}

/// The current UTC time as `YYYY-MM-DDTHH:MM:SSZ`.
pub fn utc_now() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

#[cfg(test)]
mod tests {
    use super::Machine;

    /// Issue 27: `bench run` warns when the load exceeds the cores (ratios read 1.08× at load 8
    /// on 2 cores), and not otherwise.
    #[test]
    fn a_load_above_the_cores_is_warned_about() {
        let w = Machine::load_warning(Some(8.0), 2, 0, "at the start of the run").unwrap();
        assert!(w.starts_with("warning: load average 8.0 on 2 cores at the start of the run: "), "{w}");
        assert_eq!(Machine::load_warning(Some(1.5), 2, 0, "at the start of the run"), None);
        assert_eq!(Machine::load_warning(None, 2, 0, "at the end of the run"), None);
        // At the end the bench's own ranks are in the average: 2 ranks on an idle 2-core
        // machine read about 2.1 (seen on an idle Intel Xeon), which is not another's load.
        assert_eq!(Machine::load_warning(Some(2.07), 2, 2, "at the end of the run"), None);
        assert!(Machine::load_warning(Some(9.0), 2, 2, "at the end of the run").is_some());
    }
}
