//! `ladder-accelerate env`: what a bug report needs, as `accelerate env`: versions (this crate,
//! tch, libtorch, Open MPI, NCCL), the platform, the CPU (model, cores, bf16 instructions),
//! the GPUs, the active config file and the settings a program would resolve here.

use super::{implicit_config_file, CmdResult};
use level2_accelerator::config::{AcceleratorConfig, ConfigFormat, ResolvedConfig, CONFIG_FILE_VAR, SETTINGS};
use std::path::{Path, PathBuf};
use std::process::Command;

/// `ladder-accelerate env` flags.
#[derive(Debug, clap::Args)]
pub struct EnvArgs {
    /// The config file to show [default: $ACCELERATE_CONFIG_FILE, else the default config].
    #[arg(long = "config-file", alias = "config_file", value_name = "FILE")]
    pub config_file: Option<PathBuf>,
}

/// tch's version, from the workspace lock file at build time.
fn tch_version() -> String {
    let lock = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../Cargo.lock"));
    let mut lines = lock.lines();
    while let Some(l) = lines.next() {
        if l == "name = \"tch\"" {
            if let Some(v) = lines.next().and_then(|v| v.strip_prefix("version = \"")) {
                return v.trim_end_matches('"').to_string();
            }
        }
    }
    "unknown".into()
}

/// The libtorch directory: `$LIBTORCH`, else the one this binary was built against, else the
/// directory of the `libtorch_cpu.so` mapped into this process.
fn libtorch_dir() -> Option<PathBuf> {
    let candidates = [std::env::var("LIBTORCH").ok(), option_env!("LIBTORCH").map(String::from)];
    for c in candidates.into_iter().flatten() {
        let p = PathBuf::from(c);
        if p.join("lib").is_dir() {
            return Some(p.canonicalize().unwrap_or(p));
        }
    }
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| p.ends_with("/libtorch_cpu.so"))
        .and_then(|p| Path::new(p).parent()?.parent().map(Path::to_path_buf))
}

/// libtorch's version (`torch/version.py`'s `__version__`, e.g. `2.13.0+cpu`) and directory.
fn libtorch_version() -> String {
    let Some(dir) = libtorch_dir() else { return "not found (LIBTORCH unset)".into() };
    let version = std::fs::read_to_string(dir.join("version.py"))
        .ok()
        .and_then(|t| {
            t.lines().find_map(|l| l.strip_prefix("__version__ = ").map(|v| v.trim_matches(|c| c == '\'' || c == '"').to_string()))
        })
        .or_else(|| std::fs::read_to_string(dir.join("build-version")).ok().map(|v| v.trim().to_string()))
        .unwrap_or_else(|| "unknown version".into());
    format!("{version} ({})", dir.display())
}

/// `mpirun --version`'s first line's version, e.g. `4.1.4`.
fn openmpi_version() -> String {
    match Command::new("mpirun").arg("--version").output() {
        Ok(out) => {
            let text = String::from_utf8_lossy(&out.stdout);
            let first = text.lines().next().unwrap_or("").trim().to_string();
            match first.rsplit(' ').next() {
                Some(v) if first.contains("Open MPI") => v.to_string(),
                _ if first.is_empty() => "unknown (mpirun --version printed nothing)".into(),
                _ => format!("not Open MPI: {first}"),
            }
        }
        Err(_) => "not found (no mpirun in PATH)".into(),
    }
}

/// NCCL's version from the pip package next to libtorch (`nvidia_nccl_cu*-X.dist-info`),
/// else `libnccl.so.X.Y.Z` in the usual directories.
fn nccl_version() -> String {
    if let Some(site) = libtorch_dir().and_then(|d| d.parent().map(Path::to_path_buf)) {
        if let Ok(entries) = std::fs::read_dir(&site) {
            let mut found: Vec<String> = entries
                .flatten()
                .filter_map(|e| {
                    let name = e.file_name().to_string_lossy().into_owned();
                    let rest = name.strip_prefix("nvidia_nccl")?.strip_suffix(".dist-info")?;
                    Some(rest.rsplit('-').next()?.to_string())
                })
                .collect();
            found.sort();
            if let Some(v) = found.pop() {
                return format!("{v} (pip package next to libtorch)");
            }
        }
    }
    for dir in ["/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/local/cuda/lib64", "/usr/lib"] {
        if let Ok(entries) = std::fs::read_dir(dir) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if let Some(v) = name.strip_prefix("libnccl.so.") {
                    if v.matches('.').count() == 2 {
                        return format!("{v} ({dir})");
                    }
                }
            }
        }
    }
    "not found".into()
}

/// The value of `key` in /proc/cpuinfo's first processor.
fn cpuinfo(key: &str) -> Option<String> {
    let text = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        (k.trim() == key).then(|| v.trim().to_string())
    })
}

/// Whether the CPU has bf16 instructions (`avx512_bf16`, `amx_bf16`), as a line.
fn bf16_support() -> String {
    match ladder_core::device::cpu_bf16_units() {
        Some(have) if have.is_empty() => format!(
            "no (neither avx512_bf16 nor amx_bf16; bf16 runs emulated, {} slower than fp32)",
            ladder_core::device::BF16_EMULATED_SLOWDOWN
        ),
        Some(have) => format!("yes ({})", have.join(", ")),
        None => "unknown (no x86 flags in /proc/cpuinfo)".into(),
    }
}

/// The GPUs libtorch sees, with names and memory from nvidia-smi when it is there.
fn gpus() -> String {
    if let Err(why) = ladder_core::device::load_cuda() {
        let why = why.lines().next().unwrap_or("").to_string();
        return format!("none (libtorch's CUDA backend is not loadable: {why})");
    }
    let n = if tch::Cuda::is_available() { tch::Cuda::device_count() } else { 0 };
    if n <= 0 {
        return "none (CUDA is not available to libtorch)".into();
    }
    let names = Command::new("nvidia-smi")
        .args(["--query-gpu=name,memory.total", "--format=csv,noheader"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).lines().map(|l| l.trim().to_string()).collect::<Vec<_>>().join("; "))
        .unwrap_or_default();
    if names.is_empty() {
        format!("{n}")
    } else {
        format!("{n} ({names})")
    }
}

fn platform() -> String {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").map(|r| r.trim().to_string()).unwrap_or_default();
    format!("{} {} (kernel {release})", std::env::consts::OS, std::env::consts::ARCH)
}

/// Runs `env`: prints the report on stdout.
pub fn run(args: &EnvArgs) -> CmdResult {
    let mut out = String::new();
    out.push_str("Copy-and-paste the text below in your GitHub issue\n\n");
    let mut line = |k: &str, v: String| out.push_str(&format!("- {k}: {v}\n"));
    line("`ladder-accelerate` version", env!("CARGO_PKG_VERSION").to_string());
    line("tch version", tch_version());
    line("libtorch version", libtorch_version());
    line("Open MPI version", openmpi_version());
    line("NCCL version", nccl_version());
    line("Platform", platform());
    line("CPU", cpuinfo("model name").unwrap_or_else(|| "unknown".into()));
    line("Cores", ladder_core::device::cores().to_string());
    line("CPU bf16 support", bf16_support());
    line("GPUs", gpus());
    let path = args.config_file.clone().or_else(implicit_config_file);
    let (file_line, contents) = match &path {
        None => (
            format!(
                "none (no --config-file, no {CONFIG_FILE_VAR}, and no {})",
                level2_accelerator::config::default_config_file()
                    .map(|p| p.display().to_string())
                    .unwrap_or_else(|| "default config".into())
            ),
            None,
        ),
        Some(p) => match AcceleratorConfig::load(p) {
            Ok(cfg) => (p.display().to_string(), Some(cfg)),
            Err(e) => (format!("{} (unusable: {e})", p.display()), None),
        },
    };
    line("Config file", file_line);
    if let Some(cfg) = contents {
        let yaml = cfg.to_string_as(ConfigFormat::Yaml).unwrap_or_default();
        out.push_str("- Config:\n");
        for l in yaml.lines() {
            out.push_str(&format!("\t- {l}\n"));
        }
    }
    let mut set: Vec<String> = SETTINGS
        .iter()
        .map(|(_, v)| *v)
        .chain([CONFIG_FILE_VAR])
        .filter_map(|v| std::env::var(v).ok().map(|val| format!("{v}={val}")))
        .collect();
    set.sort();
    out.push_str(&format!("- Variables set: {}\n", if set.is_empty() { "none".into() } else { set.join(" ") }));
    // What a program started here with no builder settings would use (the config file only
    // through ACCELERATE_CONFIG_FILE, as a program reads it).
    let file_str = path.as_ref().map(|p| p.display().to_string());
    let lookup = |k: &str| if k == CONFIG_FILE_VAR { file_str.clone() } else { std::env::var(k).ok() };
    match ResolvedConfig::resolve(&AcceleratorConfig::default(), lookup) {
        Ok(r) => {
            out.push_str("- Resolved settings (config file and variables above, no builder settings):\n");
            for l in r.banner().lines() {
                out.push_str(&format!("\t- {l}\n"));
            }
        }
        Err(e) => out.push_str(&format!("- Resolved settings: error: {e}\n")),
    }
    print!("{out}");
    Ok(0)
}
