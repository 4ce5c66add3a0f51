//! Level 2's configuration, as 🤗 Accelerate's: what a user can set ([`AcceleratorConfig`]),
//! the config file `ladder-accelerate config` writes, and one precedence that turns them into
//! concrete values ([`ResolvedConfig`]):
//!
//! ```text
//! an explicit builder setting  >  a variable the launcher exported  >  the config file  >  the default
//! ```
//!
//! A setting nobody gave never overrides one somebody gave: every field of
//! [`AcceleratorConfig`] is an `Option`, and `Some(default value)` ("given as the default")
//! still beats every lower source.
//!
//! The environment variables are Accelerate's (`accelerate launch` exports them in
//! `prepare_simple_launcher_cmd_env` / `prepare_multi_gpu_env`; the `Accelerator` and
//! `FullyShardedDataParallelPlugin` read them):
//!
//! | setting | variable | default |
//! |---|---|---|
//! | `mixed_precision` | `ACCELERATE_MIXED_PRECISION` | `no` |
//! | `gradient_accumulation_steps` | `ACCELERATE_GRADIENT_ACCUMULATION_STEPS` | 1 |
//! | `cpu` | `ACCELERATE_USE_CPU` | false |
//! | `use_fsdp` | `ACCELERATE_USE_FSDP` | false |
//! | `fsdp_sharding_strategy` | `FSDP_SHARDING_STRATEGY` | `FULL_SHARD` |
//! | `fsdp_min_num_params` | `FSDP_MIN_NUM_PARAMS` | 100,000,000 (PyTorch's; one FSDP unit for BasicNet) |
//! | `fsdp_backward_prefetch` | `FSDP_BACKWARD_PREFETCH` | `NO_PREFETCH` (Accelerate's `backward_prefetch=None`; PyTorch's own default is `BACKWARD_PRE`) |
//! | `fsdp_forward_prefetch` | `FSDP_FORWARD_PREFETCH` | false |
//! | `split_batches` | `ACCELERATE_SPLIT_BATCHES` | false |
//! | `even_batches` | `ACCELERATE_EVEN_BATCHES` | true |
//! | `seed` | `ACCELERATE_SEED` (ddp-ladder's own: Accelerate has no seed variable) | not set |
//!
//! Booleans are read as Accelerate's `str_to_bool` reads them (`true`/`false`, `1`/`0`,
//! `yes`/`no`, `on`/`off`, any case: its launcher writes `True`); `FSDP_SHARDING_STRATEGY`
//! also takes PyTorch's numbers `1`..`3`, and `FSDP_BACKWARD_PREFETCH` PyTorch's `1`, `2`, as
//! Accelerate does (names in any case, as Accelerate upper-cases them). An empty variable is an
//! error.
//!
//! A program reads the config file named by `ACCELERATE_CONFIG_FILE` and no other: the user's
//! default config is read by `ladder-accelerate launch`, which turns it into the variables above.

use crate::{Error, Result};
pub use ladder_core::parallel::{BackwardPrefetch, Precision, ShardingStrategy};
use ladder_core::parallel::{Choice, ChoiceError, DdpOptions, FsdpOptions, Strategy};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

/// The variable naming the config file a program reads (see [`ResolvedConfig::resolve`]).
pub const CONFIG_FILE_VAR: &str = "ACCELERATE_CONFIG_FILE";

/// Accelerate's `distributed_type`, as `accelerate config` asks for it. It picks how
/// `ladder-accelerate launch` starts the ranks (`MULTI_GPU`: the nccl backend; `MULTI_CPU`,
/// `NO`: mpi; `FSDP`: nccl when CUDA is usable and `cpu` is not set, else mpi) and `FSDP`
/// turns `use_fsdp` on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum, Default)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum DistributedType {
    /// One process (or ranks started by hand).
    #[default]
    #[value(name = "no", alias = "NO")]
    No,
    /// Several CPU processes, the mpi backend.
    #[serde(alias = "multi-cpu")]
    #[value(name = "multi-cpu", alias = "MULTI_CPU", alias = "multi_cpu")]
    MultiCpu,
    /// One process per GPU, the nccl backend.
    #[serde(alias = "multi-gpu")]
    #[value(name = "multi-gpu", alias = "MULTI_GPU", alias = "multi_gpu")]
    MultiGpu,
    /// Fully sharded data parallel (sets `use_fsdp`).
    #[serde(alias = "fsdp")]
    #[value(name = "fsdp", alias = "FSDP")]
    Fsdp,
}

impl DistributedType {
    /// Accelerate's spelling: `NO`, `MULTI_CPU`, `MULTI_GPU`, `FSDP`.
    pub fn as_str(self) -> &'static str {
        match self {
            DistributedType::No => "NO",
            DistributedType::MultiCpu => "MULTI_CPU",
            DistributedType::MultiGpu => "MULTI_GPU",
            DistributedType::Fsdp => "FSDP",
        }
    }
}

impl fmt::Display for DistributedType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Everything a user can set; every field `Option`: `None` = "not given" (never confused with
/// "given as the default"). The config file holds exactly the fields that are `Some`, under
/// these names (Accelerate's; `use_cpu` is read as `cpu`); any other key is an error.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AcceleratorConfig {
    /// How the job is distributed (`NO`, `MULTI_CPU`, `MULTI_GPU`, `FSDP`); read by
    /// `ladder-accelerate launch` (see [`DistributedType`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub distributed_type: Option<DistributedType>,
    /// Total number of processes over all machines (Accelerate's meaning); at least 1 and a
    /// multiple of `num_machines`. Default 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_processes: Option<usize>,
    /// Number of machines (nodes). Default 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_machines: Option<usize>,
    /// This machine's index, `0..num_machines`. Default 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub machine_rank: Option<usize>,
    /// Address of machine 0 (`MASTER_ADDR`). Default 127.0.0.1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub main_process_ip: Option<String>,
    /// Port of the rendezvous on machine 0 (`MASTER_PORT`), 1..=65535. Default: a free port on
    /// one machine, 29500 on several.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub main_process_port: Option<u16>,
    /// `no` | `bf16` | `fp16` (fp16 needs CUDA). Default `no`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mixed_precision: Option<Precision>,
    /// Micro-batches per optimizer step, at least 1. Default 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gradient_accumulation_steps: Option<usize>,
    /// Train on the CPU even when a GPU is available (Accelerate's `cpu` / `use_cpu`). Default false.
    #[serde(default, alias = "use_cpu", skip_serializing_if = "Option::is_none")]
    pub cpu: Option<bool>,
    /// Wrap the model in FSDP instead of DDP. Default false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub use_fsdp: Option<bool>,
    /// FSDP sharding strategy. Default `FULL_SHARD`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fsdp_sharding_strategy: Option<ShardingStrategy>,
    /// FSDP `size_based_auto_wrap_policy` threshold: a layer with at least this many parameters
    /// becomes its own unit. Default 100,000,000 (PyTorch's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fsdp_min_num_params: Option<usize>,
    /// FSDP backward prefetch (`BACKWARD_PRE`, `BACKWARD_POST`, `NO_PREFETCH`; see
    /// [`BackwardPrefetch`]). Default `NO_PREFETCH`, Accelerate's (its
    /// `FullyShardedDataParallelPlugin(backward_prefetch=None)`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fsdp_backward_prefetch: Option<BackwardPrefetch>,
    /// FSDP forward prefetch: start the next unit's all-gather before the current unit's
    /// forward computation (sharded strategies). Default false, Accelerate's and PyTorch's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fsdp_forward_prefetch: Option<bool>,
    /// The loader's batch size is the global one, split between the processes (it must be a
    /// multiple of their number). Default false: each process draws a full batch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub split_batches: Option<bool>,
    /// Pad the last batches so every process gets as many as the others (Accelerate's
    /// default true); false lets processes see different numbers of batches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub even_batches: Option<bool>,
    /// Seed for `set_seed` (Python, NumPy and torch in Accelerate; torch and the samplers here).
    /// Default: not set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
}

/// The file format of a config file, from its extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfigFormat {
    /// `.yaml` / `.yml` (Accelerate's own format).
    Yaml,
    /// `.toml`.
    Toml,
    /// `.json`.
    Json,
}

impl ConfigFormat {
    /// The format a path's extension names (case-insensitive).
    ///
    /// # Errors
    /// [`Error::ConfigFormat`] naming the file when the extension is none of `.yaml`, `.yml`,
    /// `.toml`, `.json`.
    pub fn of(path: &Path) -> Result<ConfigFormat> {
        let ext = path.extension().map(|e| e.to_string_lossy().to_ascii_lowercase()).unwrap_or_default();
        match ext.as_str() {
            "yaml" | "yml" => Ok(ConfigFormat::Yaml),
            "toml" => Ok(ConfigFormat::Toml),
            "json" => Ok(ConfigFormat::Json),
            _ => Err(Error::ConfigFormat { file: path.to_path_buf(), extension: ext }),
        }
    }

    fn name(self) -> &'static str {
        match self {
            ConfigFormat::Yaml => "YAML",
            ConfigFormat::Toml => "TOML",
            ConfigFormat::Json => "JSON",
        }
    }
}

impl AcceleratorConfig {
    /// Reads a config file: YAML (`.yaml`, `.yml`), TOML (`.toml`) or JSON (`.json`) by
    /// extension. An empty file is the empty config. The values are checked as
    /// [`AcceleratorConfig::validate`] does.
    ///
    /// # Errors
    /// [`Error::ConfigFormat`] for another extension; [`Error::ConfigRead`] when the file
    /// cannot be read; [`Error::ConfigParse`] naming the file and the key for malformed
    /// contents, an unknown key or a value of the wrong type; [`Error::InvalidSetting`] /
    /// [`Error::Conflict`] naming the file and the key for a value out of range.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let format = ConfigFormat::of(path)?;
        let text = std::fs::read_to_string(path).map_err(|source| Error::ConfigRead { file: path.to_path_buf(), source })?;
        let parse_err = |problem: String| Error::ConfigParse { file: path.to_path_buf(), format: format.name(), problem };
        let cfg: AcceleratorConfig = if text.trim().is_empty() {
            AcceleratorConfig::default()
        } else {
            match format {
                ConfigFormat::Yaml => serde_yaml::from_str(&text).map_err(|e| parse_err(e.to_string()))?,
                ConfigFormat::Toml => toml::from_str(&text)
                    .map_err(|e| parse_err(e.message().trim().replace('\n', "; ") + &toml_location(&text, e.span())))?,
                ConfigFormat::Json => serde_json::from_str(&text).map_err(|e| parse_err(e.to_string()))?,
            }
        };
        cfg.validate(&Origin::File(path.to_path_buf()))?;
        Ok(cfg)
    }

    /// Writes the config (only the fields that are `Some`) to `path`, as YAML, TOML or JSON by
    /// extension, atomically (a temp file in the same directory renamed into place, mode 0644;
    /// missing directories are created).
    ///
    /// # Errors
    /// [`Error::ConfigFormat`] for an unsupported extension; [`Error::ConfigWrite`] naming
    /// the file when it cannot be written.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let text =
            self.to_string_as(ConfigFormat::of(path)?).map_err(|problem| Error::ConfigWrite { file: path.to_path_buf(), problem })?;
        ladder_core::atomic::write_atomic(path, text.as_bytes())
            .map_err(|e| Error::ConfigWrite { file: path.to_path_buf(), problem: e.to_string() })
    }

    /// The text [`AcceleratorConfig::save`] writes in `format`.
    ///
    /// # Errors
    /// The serializer's message (not expected for this struct).
    pub fn to_string_as(&self, format: ConfigFormat) -> std::result::Result<String, String> {
        match format {
            ConfigFormat::Yaml => serde_yaml::to_string(self).map_err(|e| e.to_string()),
            ConfigFormat::Toml => toml::to_string(self).map_err(|e| e.to_string()),
            ConfigFormat::Json => serde_json::to_string_pretty(self).map(|s| s + "\n").map_err(|e| e.to_string()),
        }
    }

    /// `self`'s given values, and `base`'s where `self` gives none (e.g. launch flags over the
    /// config file).
    pub fn merged_over(&self, base: &AcceleratorConfig) -> AcceleratorConfig {
        AcceleratorConfig {
            distributed_type: self.distributed_type.or(base.distributed_type),
            num_processes: self.num_processes.or(base.num_processes),
            num_machines: self.num_machines.or(base.num_machines),
            machine_rank: self.machine_rank.or(base.machine_rank),
            main_process_ip: self.main_process_ip.clone().or_else(|| base.main_process_ip.clone()),
            main_process_port: self.main_process_port.or(base.main_process_port),
            mixed_precision: self.mixed_precision.or(base.mixed_precision),
            gradient_accumulation_steps: self.gradient_accumulation_steps.or(base.gradient_accumulation_steps),
            cpu: self.cpu.or(base.cpu),
            use_fsdp: self.use_fsdp.or(base.use_fsdp),
            fsdp_sharding_strategy: self.fsdp_sharding_strategy.or(base.fsdp_sharding_strategy),
            fsdp_min_num_params: self.fsdp_min_num_params.or(base.fsdp_min_num_params),
            fsdp_backward_prefetch: self.fsdp_backward_prefetch.or(base.fsdp_backward_prefetch),
            fsdp_forward_prefetch: self.fsdp_forward_prefetch.or(base.fsdp_forward_prefetch),
            split_batches: self.split_batches.or(base.split_batches),
            even_batches: self.even_batches.or(base.even_batches),
            seed: self.seed.or(base.seed),
        }
    }

    /// Whether the field named `setting` (a field name of this struct) is `Some`.
    pub fn is_given(&self, setting: &str) -> bool {
        match setting {
            "distributed_type" => self.distributed_type.is_some(),
            "num_processes" => self.num_processes.is_some(),
            "num_machines" => self.num_machines.is_some(),
            "machine_rank" => self.machine_rank.is_some(),
            "main_process_ip" => self.main_process_ip.is_some(),
            "main_process_port" => self.main_process_port.is_some(),
            "mixed_precision" => self.mixed_precision.is_some(),
            "gradient_accumulation_steps" => self.gradient_accumulation_steps.is_some(),
            "cpu" => self.cpu.is_some(),
            "use_fsdp" => self.use_fsdp.is_some(),
            "fsdp_sharding_strategy" => self.fsdp_sharding_strategy.is_some(),
            "fsdp_min_num_params" => self.fsdp_min_num_params.is_some(),
            "fsdp_backward_prefetch" => self.fsdp_backward_prefetch.is_some(),
            "fsdp_forward_prefetch" => self.fsdp_forward_prefetch.is_some(),
            "split_batches" => self.split_batches.is_some(),
            "even_batches" => self.even_batches.is_some(),
            "seed" => self.seed.is_some(),
            _ => false,
        }
    }

    /// `use_fsdp` as given, else true when `distributed_type` is `FSDP` (Accelerate's way of
    /// saying it), else not given.
    pub fn effective_use_fsdp(&self) -> Option<bool> {
        self.use_fsdp.or(match self.distributed_type {
            Some(DistributedType::Fsdp) => Some(true),
            _ => None,
        })
    }

    /// Checks every given value and the combinations of given values; `origin` says where they
    /// come from and is named in the error.
    ///
    /// # Errors
    /// [`Error::InvalidSetting`] for `num_processes`, `num_machines` or
    /// `gradient_accumulation_steps` 0, `main_process_port` 0, `machine_rank` outside
    /// `0..num_machines`, an empty `main_process_ip`; [`Error::Conflict`] for `num_processes`
    /// not a multiple of `num_machines`, `fp16` with `cpu`, `use_fsdp: false` with
    /// `distributed_type: FSDP`.
    pub fn validate(&self, origin: &Origin) -> Result<()> {
        let invalid = |setting: &str, value: String, expected: &str| Error::InvalidSetting {
            setting: setting.to_string(),
            value,
            origin: origin.describe(setting),
            expected: expected.to_string(),
        };
        if self.num_processes == Some(0) {
            return Err(invalid("num_processes", "0".into(), "a whole number of at least 1"));
        }
        if self.num_machines == Some(0) {
            return Err(invalid("num_machines", "0".into(), "a whole number of at least 1"));
        }
        if self.gradient_accumulation_steps == Some(0) {
            return Err(invalid("gradient_accumulation_steps", "0".into(), "a whole number of at least 1"));
        }
        if self.main_process_port == Some(0) {
            return Err(invalid("main_process_port", "0".into(), "a port in 1..=65535 (leave it out to pick a free port)"));
        }
        if let Some(ip) = &self.main_process_ip {
            if ip.trim().is_empty() {
                return Err(invalid("main_process_ip", ip.clone(), "the address of machine 0 (a host name or IP address)"));
            }
        }
        let machines = self.num_machines.unwrap_or(1);
        if let Some(r) = self.machine_rank {
            if r >= machines {
                return Err(invalid("machine_rank", r.to_string(), &format!("a machine index in 0..{machines} (num_machines {machines})")));
            }
        }
        if let Some(n) = self.num_processes {
            if n % machines != 0 {
                return Err(Error::Conflict {
                    first: format!("num_processes {n} ({})", origin.describe("num_processes")),
                    second: format!("num_machines {machines} ({})", origin.describe("num_machines")),
                    why: "num_processes counts the processes of all machines and must be a multiple of num_machines".into(),
                });
            }
        }
        if self.mixed_precision == Some(Precision::Fp16) && self.cpu == Some(true) {
            return Err(fp16_cpu_conflict(&origin.describe("mixed_precision"), &origin.describe("cpu")));
        }
        if self.distributed_type == Some(DistributedType::Fsdp) && self.use_fsdp == Some(false) {
            return Err(Error::Conflict {
                first: format!("distributed_type FSDP ({})", origin.describe("distributed_type")),
                second: format!("use_fsdp false ({})", origin.describe("use_fsdp")),
                why: "distributed_type FSDP means use_fsdp true; remove one of them".into(),
            });
        }
        Ok(())
    }
}

fn fp16_cpu_conflict(mp_origin: &str, cpu_origin: &str) -> Error {
    Error::Conflict {
        first: format!("mixed_precision fp16 ({mp_origin})"),
        second: format!("cpu true ({cpu_origin})"),
        why: "fp16 needs CUDA; use mixed_precision bf16 on the CPU".into(),
    }
}

/// ` at line L, column C` for a TOML error span.
fn toml_location(text: &str, span: Option<std::ops::Range<usize>>) -> String {
    let Some(span) = span else { return String::new() };
    let before = &text[..span.start.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before.rsplit('\n').next().map(|l| l.chars().count()).unwrap_or(0) + 1;
    format!(" at line {line}, column {col}")
}

/// Where a set of values was given, for error messages.
#[derive(Debug, Clone, PartialEq)]
pub enum Origin {
    /// Set by the program on the builder.
    Builder,
    /// A config file.
    File(PathBuf),
    /// `ladder-accelerate` flags.
    Flags,
    /// `ladder-accelerate launch`: its flags over a config file (each setting is described by
    /// whichever gave it).
    Launch {
        /// The settings given as flags.
        flags: AcceleratorConfig,
        /// The config file read, if any.
        file: Option<PathBuf>,
    },
}

impl Origin {
    /// "key `name` of config file F", "builder setting `name`", or "flag --name".
    pub fn describe(&self, setting: &str) -> String {
        match self {
            Origin::Builder => format!("builder setting {setting}"),
            Origin::File(f) => format!("key {setting} of config file {}", f.display()),
            Origin::Flags => format!("flag --{}", setting.replace('_', "-")),
            Origin::Launch { flags, file } => match file {
                Some(f) if !flags.is_given(setting) => Origin::File(f.clone()).describe(setting),
                _ => Origin::Flags.describe(setting),
            },
        }
    }
}

/// Where a resolved value came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Source {
    /// Set explicitly by the program (`AcceleratorConfig` passed to the builder).
    Builder,
    /// An environment variable (exported by `ladder-accelerate launch`, or by the user).
    Env,
    /// The config file named by `ACCELERATE_CONFIG_FILE`.
    ConfigFile,
    /// Nobody gave it: the default.
    Default,
}

/// The settings [`ResolvedConfig`] resolves, each with its environment variable (Accelerate's
/// name), in banner order.
pub const SETTINGS: [(&str, &str); 11] = [
    ("mixed_precision", "ACCELERATE_MIXED_PRECISION"),
    ("gradient_accumulation_steps", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"),
    ("cpu", "ACCELERATE_USE_CPU"),
    ("use_fsdp", "ACCELERATE_USE_FSDP"),
    ("fsdp_sharding_strategy", "FSDP_SHARDING_STRATEGY"),
    ("fsdp_min_num_params", "FSDP_MIN_NUM_PARAMS"),
    ("fsdp_backward_prefetch", "FSDP_BACKWARD_PREFETCH"),
    ("fsdp_forward_prefetch", "FSDP_FORWARD_PREFETCH"),
    ("split_batches", "ACCELERATE_SPLIT_BATCHES"),
    ("even_batches", "ACCELERATE_EVEN_BATCHES"),
    ("seed", "ACCELERATE_SEED"),
];

/// The environment variable of a setting in [`SETTINGS`].
pub fn env_var(setting: &str) -> Option<&'static str> {
    SETTINGS.iter().find(|(s, _)| *s == setting).map(|(_, v)| *v)
}

/// Default of [`ResolvedConfig::fsdp_min_num_params`]: PyTorch's, from the core's `FsdpConfig`.
pub fn default_fsdp_min_num_params() -> usize {
    FsdpOptions::default().min_num_params
}

/// Concrete values + the source of each, after precedence builder > launcher env > config
/// file > default.
#[derive(Debug, Clone, PartialEq)]
pub struct ResolvedConfig {
    /// `no` | `bf16` | `fp16`.
    pub mixed_precision: Precision,
    /// Micro-batches per optimizer step (≥ 1).
    pub gradient_accumulation_steps: usize,
    /// Train on the CPU even when a GPU is available.
    pub cpu: bool,
    /// FSDP instead of DDP.
    pub use_fsdp: bool,
    /// FSDP sharding strategy (meaningful when `use_fsdp`).
    pub fsdp_sharding_strategy: ShardingStrategy,
    /// FSDP auto-wrap threshold in parameters (meaningful when `use_fsdp`).
    pub fsdp_min_num_params: usize,
    /// FSDP backward prefetch (meaningful when `use_fsdp` with `FULL_SHARD`).
    pub fsdp_backward_prefetch: BackwardPrefetch,
    /// FSDP forward prefetch (meaningful when `use_fsdp` with a sharded strategy).
    pub fsdp_forward_prefetch: bool,
    /// The loader's batch size is global, split between the processes.
    pub split_batches: bool,
    /// Pad so every process gets the same number of batches.
    pub even_batches: bool,
    /// The seed for `set_seed`, when one was given.
    pub seed: Option<u64>,
    /// The config file that was read (named by `ACCELERATE_CONFIG_FILE`), if any.
    pub config_file: Option<PathBuf>,
    /// Where each setting of [`SETTINGS`] came from, by setting name.
    pub sources: BTreeMap<&'static str, Source>,
}

/// Accelerate's `str_to_bool`: `y yes t true on 1` / `n no f false off 0`, any case; how every
/// boolean variable is read (and level 2's boolean flags).
///
/// # Errors
/// What was expected, for any other text.
pub fn str_to_bool(s: &str) -> std::result::Result<bool, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "y" | "yes" | "t" | "true" | "on" | "1" => Ok(true),
        "n" | "no" | "f" | "false" | "off" | "0" => Ok(false),
        _ => Err("a boolean: true or false (also 1/0, yes/no, on/off)".into()),
    }
}

/// A choice of the core's vocabulary from its text, the error being what was expected in
/// Accelerate's spelling (`FULL_SHARD, SHARD_GRAD_OP or NO_SHARD`).
fn choice<T: Choice>(s: &str) -> std::result::Result<T, String> {
    ladder_core::parallel::choice::parse(s).map_err(|e: ChoiceError| e.names)
}

fn parse_count(s: &str, min: usize) -> std::result::Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if n >= min => Ok(n),
        _ if min == 0 => Err("a whole number ≥ 0".into()),
        _ => Err(format!("a whole number of at least {min}")),
    }
}

fn parse_seed(s: &str) -> std::result::Result<u64, String> {
    s.trim().parse::<u64>().map_err(|_| "a whole number in 0..=18446744073709551615".into())
}

impl ResolvedConfig {
    /// Resolves every setting by the precedence builder > launcher env > config file > default.
    ///
    /// `builder` is what the program set explicitly; `env` a lookup (`|k| std::env::var(k).ok()`
    /// in production, a map in tests). The config file is the one named by
    /// `ACCELERATE_CONFIG_FILE`, else none: a program never reads the user's default config by
    /// itself (`ladder-accelerate launch` reads it and exports the variables).
    ///
    /// # Errors
    /// [`Error::InvalidSetting`] naming the variable (e.g. `ACCELERATE_MIXED_PRECISION=fp8`,
    /// `ACCELERATE_GRADIENT_ACCUMULATION_STEPS=0`, an empty value), the builder field or the file
    /// key and what was expected; the errors of [`AcceleratorConfig::load`] for the file;
    /// [`Error::Conflict`] for `fp16` together with `cpu`, naming where each came from.
    pub fn resolve(builder: &AcceleratorConfig, env: impl Fn(&str) -> Option<String>) -> Result<ResolvedConfig> {
        builder.validate(&Origin::Builder)?;
        let config_file = match env(CONFIG_FILE_VAR) {
            Some(p) if p.trim().is_empty() => {
                return Err(Error::InvalidSetting {
                    setting: "config file".into(),
                    value: p,
                    origin: format!("environment variable {CONFIG_FILE_VAR}"),
                    expected: "the path of a .yaml, .yml, .toml or .json config file (or leave the variable unset)".into(),
                })
            }
            Some(p) => Some(PathBuf::from(p)),
            None => None,
        };
        let file = match &config_file {
            Some(p) => AcceleratorConfig::load(p)?,
            None => AcceleratorConfig::default(),
        };
        let mut sources = BTreeMap::new();

        // One setting: builder, else its variable (parsed), else the file, else the default.
        fn pick<T: Copy>(
            sources: &mut BTreeMap<&'static str, Source>,
            env: &dyn Fn(&str) -> Option<String>,
            setting: &'static str,
            builder: Option<T>,
            file: Option<T>,
            default: T,
            parse: impl Fn(&str) -> std::result::Result<T, String>,
        ) -> Result<T> {
            let var = env_var(setting).expect("every resolved setting has a variable");
            let (v, src) = if let Some(v) = builder {
                (v, Source::Builder)
            } else if let Some(raw) = env(var) {
                let v = parse(&raw).map_err(|expected| Error::InvalidSetting {
                    setting: setting.into(),
                    value: raw.clone(),
                    origin: format!("environment variable {var}"),
                    expected: if raw.trim().is_empty() { format!("{expected} (or leave the variable unset)") } else { expected },
                })?;
                (v, Source::Env)
            } else if let Some(v) = file {
                (v, Source::ConfigFile)
            } else {
                (default, Source::Default)
            };
            sources.insert(setting, src);
            Ok(v)
        }

        let env: &dyn Fn(&str) -> Option<String> = &env;
        let s = &mut sources;
        let mixed_precision = pick(s, env, "mixed_precision", builder.mixed_precision, file.mixed_precision, Precision::No, choice)?;
        let gradient_accumulation_steps =
            pick(s, env, "gradient_accumulation_steps", builder.gradient_accumulation_steps, file.gradient_accumulation_steps, 1, |v| {
                parse_count(v, 1)
            })?;
        let cpu = pick(s, env, "cpu", builder.cpu, file.cpu, false, str_to_bool)?;
        let use_fsdp = pick(s, env, "use_fsdp", builder.effective_use_fsdp(), file.effective_use_fsdp(), false, str_to_bool)?;
        let fsdp_sharding_strategy = pick(
            s,
            env,
            "fsdp_sharding_strategy",
            builder.fsdp_sharding_strategy,
            file.fsdp_sharding_strategy,
            ShardingStrategy::FullShard,
            choice,
        )?;
        let fsdp_min_num_params = pick(
            s,
            env,
            "fsdp_min_num_params",
            builder.fsdp_min_num_params,
            file.fsdp_min_num_params,
            default_fsdp_min_num_params(),
            |v| parse_count(v, 0),
        )?;
        let fsdp_backward_prefetch = pick(
            s,
            env,
            "fsdp_backward_prefetch",
            builder.fsdp_backward_prefetch,
            file.fsdp_backward_prefetch,
            BackwardPrefetch::NoPrefetch,
            choice,
        )?;
        let fsdp_forward_prefetch =
            pick(s, env, "fsdp_forward_prefetch", builder.fsdp_forward_prefetch, file.fsdp_forward_prefetch, false, str_to_bool)?;
        let split_batches = pick(s, env, "split_batches", builder.split_batches, file.split_batches, false, str_to_bool)?;
        let even_batches = pick(s, env, "even_batches", builder.even_batches, file.even_batches, true, str_to_bool)?;
        let seed = pick(s, env, "seed", builder.seed.map(Some), file.seed.map(Some), None, |v| parse_seed(v).map(Some))?;

        let resolved = ResolvedConfig {
            mixed_precision,
            gradient_accumulation_steps,
            cpu,
            use_fsdp,
            fsdp_sharding_strategy,
            fsdp_min_num_params,
            fsdp_backward_prefetch,
            fsdp_forward_prefetch,
            split_batches,
            even_batches,
            seed,
            config_file,
            sources,
        };
        if resolved.mixed_precision == Precision::Fp16 && resolved.cpu {
            return Err(fp16_cpu_conflict(&resolved.describe_source("mixed_precision"), &resolved.describe_source("cpu")));
        }
        Ok(resolved)
    }

    /// How the model is wrapped: DDP (PyTorch's options), or FSDP with
    /// `fsdp_sharding_strategy`, `fsdp_min_num_params`, `fsdp_backward_prefetch` and
    /// `fsdp_forward_prefetch` when `use_fsdp`.
    pub fn strategy(&self) -> Strategy {
        if !self.use_fsdp {
            return Strategy::default();
        }
        Strategy::Fsdp(FsdpOptions {
            sharding_strategy: self.fsdp_sharding_strategy,
            min_num_params: self.fsdp_min_num_params,
            backward_prefetch: self.fsdp_backward_prefetch,
            forward_prefetch: self.fsdp_forward_prefetch,
            ..FsdpOptions::default()
        })
    }

    /// The core's wrapping settings these values stand for, with DDP's options (from
    /// [`DistributedDataParallelKwargs`](crate::DistributedDataParallelKwargs)) when the
    /// [`strategy`](Self::strategy) is DDP, and the mixed precision. What
    /// [`Accelerator::prepare_model`](crate::Accelerator::prepare_model) wraps the model with.
    pub fn wrap_config(&self, ddp: DdpOptions) -> ladder_core::parallel::WrapConfig {
        let strategy = match self.strategy() {
            Strategy::Ddp(_) => Strategy::Ddp(ddp),
            fsdp => fsdp,
        };
        ladder_core::parallel::WrapConfig { strategy, mixed_precision: self.mixed_precision }
    }

    /// Where `setting` came from (`Source::Default` for a name that is not a setting).
    pub fn source(&self, setting: &str) -> Source {
        self.sources.get(setting).copied().unwrap_or(Source::Default)
    }

    /// Where `setting` came from, in words: `set by the program`, `from ACCELERATE_…`,
    /// `from config file F`, `default`.
    pub fn describe_source(&self, setting: &str) -> String {
        match self.source(setting) {
            Source::Builder => "set by the program".into(),
            Source::Env => format!("from {}", env_var(setting).unwrap_or("the environment")),
            Source::ConfigFile => match &self.config_file {
                Some(f) => format!("from config file {}", f.display()),
                None => "from the config file".into(),
            },
            Source::Default => "default".into(),
        }
    }

    /// The value of `setting` as text (`bf16`, `4`, `true`, `FULL_SHARD`, `NO_PREFETCH`, `not set`).
    pub fn value_of(&self, setting: &str) -> String {
        match setting {
            "mixed_precision" => self.mixed_precision.to_string(),
            "gradient_accumulation_steps" => self.gradient_accumulation_steps.to_string(),
            "cpu" => self.cpu.to_string(),
            "use_fsdp" => self.use_fsdp.to_string(),
            "fsdp_sharding_strategy" => self.fsdp_sharding_strategy.to_string(),
            "fsdp_min_num_params" => self.fsdp_min_num_params.to_string(),
            "fsdp_backward_prefetch" => self.fsdp_backward_prefetch.to_string(),
            "fsdp_forward_prefetch" => self.fsdp_forward_prefetch.to_string(),
            "split_batches" => self.split_batches.to_string(),
            "even_batches" => self.even_batches.to_string(),
            "seed" => self.seed.map(|s| s.to_string()).unwrap_or_else(|| "not set".into()),
            _ => String::new(),
        }
    }

    /// One line per setting with its value and where it came from, e.g.
    /// `mixed_precision: bf16 (from ACCELERATE_MIXED_PRECISION)`; lines end with `\n`.
    pub fn banner(&self) -> String {
        let mut out = String::new();
        for (setting, _) in SETTINGS {
            out.push_str(&format!("{setting}: {} ({})\n", self.value_of(setting), self.describe_source(setting)));
        }
        out
    }
}

impl AcceleratorConfig {
    /// The variables `ladder-accelerate launch` exports for the given settings of [`SETTINGS`]
    /// (only those that are `Some`; `use_fsdp` also from `distributed_type: FSDP`), in the
    /// spelling [`ResolvedConfig::resolve`] reads back: `bf16`, `4`, `true`, `FULL_SHARD`.
    pub fn to_env_vars(&self) -> Vec<(&'static str, String)> {
        let mut vars = Vec::new();
        let mut put = |setting: &str, v: Option<String>| {
            if let (Some(v), Some(var)) = (v, env_var(setting)) {
                vars.push((var, v));
            }
        };
        put("mixed_precision", self.mixed_precision.map(|v| v.to_string()));
        put("gradient_accumulation_steps", self.gradient_accumulation_steps.map(|v| v.to_string()));
        put("cpu", self.cpu.map(|v| v.to_string()));
        put("use_fsdp", self.effective_use_fsdp().map(|v| v.to_string()));
        put("fsdp_sharding_strategy", self.fsdp_sharding_strategy.map(|v| v.to_string()));
        put("fsdp_min_num_params", self.fsdp_min_num_params.map(|v| v.to_string()));
        put("fsdp_backward_prefetch", self.fsdp_backward_prefetch.map(|v| v.to_string()));
        put("fsdp_forward_prefetch", self.fsdp_forward_prefetch.map(|v| v.to_string()));
        put("split_batches", self.split_batches.map(|v| v.to_string()));
        put("even_batches", self.even_batches.map(|v| v.to_string()));
        put("seed", self.seed.map(|v| v.to_string()));
        vars
    }
}

/// The user's default config file: `dirs::config_dir()/ddp-ladder/accelerate/default_config.yaml`
/// (`~/.config/ddp-ladder/accelerate/default_config.yaml` on Linux), as Accelerate's
/// `~/.cache/huggingface/accelerate/default_config.yaml`. `None` when the platform has no
/// config directory (no `$HOME`, no `$XDG_CONFIG_HOME`).
pub fn default_config_file() -> Option<PathBuf> {
    dirs::config_dir().map(|d| d.join("ddp-ladder").join("accelerate").join("default_config.yaml"))
}
