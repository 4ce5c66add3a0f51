//! Config files: YAML (Accelerate's format), TOML or JSON by extension, read with the key and
//! the line of a bad value named, written atomically with exactly the given settings.
//!
//! Accelerate's own files (what `accelerate config` writes) are read as they are: the settings
//! it nests under `deepspeed_config:`, `fsdp_config:` and `parallelism_config:` that are
//! honoured here ([`DEEPSPEED_KEYS`], [`FSDP_KEYS`]) are read as the top-level settings of the
//! same name, the others are refused by name; its informational keys (`compute_environment`,
//! `debug`, `main_training_function`, `fsdp_state_dict_type`, …) are accepted with the one value
//! this project implements and refused, with the reason, with another. A file with any of these
//! has its errors named by key, without a line.

use super::AcceleratorConfig;
use super::Origin;
use crate::{Error, Result};
use std::path::Path;

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
    /// contents, an unknown key or a value of the wrong type; [`Error::ConfigKey`] naming the
    /// key of Accelerate's that is refused, and why; [`Error::InvalidSetting`] /
    /// [`Error::Conflict`] naming the file and the key for a value out of range.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let format = ConfigFormat::of(path)?;
        let text = std::fs::read_to_string(path).map_err(|source| Error::ConfigRead { file: path.to_path_buf(), source })?;
        let parse_err = |problem: String| Error::ConfigParse { file: path.to_path_buf(), format: format.name(), problem };
        let cfg: AcceleratorConfig = if text.trim().is_empty() {
            AcceleratorConfig::default()
        } else {
            // Accelerate's nested sections and its informational keys are read into one generic
            // value first; a file without them is parsed directly, so errors keep their line.
            let generic: Option<serde_json::Value> = match format {
                ConfigFormat::Yaml => serde_norway::from_str(&text).ok(),
                ConfigFormat::Toml => toml::from_str(&text).ok(),
                ConfigFormat::Json => serde_json::from_str(&text).ok(),
            };
            match generic {
                Some(serde_json::Value::Object(map)) if needs_normalizing(&map) => serde_json::from_value(serde_json::Value::Object(
                    normalize(map).map_err(|problem| Error::ConfigKey { file: path.to_path_buf(), problem })?,
                ))
                .map_err(|e| parse_err(e.to_string()))?,
                _ => match format {
                    ConfigFormat::Yaml => serde_norway::from_str(&text).map_err(|e| parse_err(e.to_string()))?,
                    ConfigFormat::Toml => toml::from_str(&text)
                        .map_err(|e| parse_err(e.message().trim().replace('\n', "; ") + &toml_location(&text, e.span())))?,
                    ConfigFormat::Json => serde_json::from_str(&text).map_err(|e| parse_err(e.to_string()))?,
                },
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
            ConfigFormat::Yaml => serde_norway::to_string(self).map_err(|e| e.to_string()),
            ConfigFormat::Toml => toml::to_string(self).map_err(|e| e.to_string()),
            ConfigFormat::Json => serde_json::to_string_pretty(self).map(|s| s + "\n").map_err(|e| e.to_string()),
        }
    }
}

/// The section of Accelerate's config files that holds the DeepSpeed plugin's settings
/// (`accelerate config` writes `deepspeed_config: {zero_stage: 2, offload_optimizer_device:
/// none, …}`).
pub const DEEPSPEED_SECTION: &str = "deepspeed_config";

/// The keys of [`DEEPSPEED_SECTION`] honoured here: read as the top-level settings of the same
/// name. Accelerate's other DeepSpeed keys are refused by name.
pub const DEEPSPEED_KEYS: [&str; 3] = ["zero_stage", "offload_optimizer_device", "offload_optimizer_nvme_path"];

/// The section that holds the FSDP plugin's settings (`accelerate config` writes
/// `fsdp_config: {fsdp_version: 1, fsdp_reshard_after_forward: FULL_SHARD, …}`).
pub const FSDP_SECTION: &str = "fsdp_config";

/// The keys of [`FSDP_SECTION`] honoured here, read as the top-level settings of the same name
/// (and `fsdp_reshard_after_forward`, Accelerate 1.x's spelling of the sharding strategy, read
/// as `fsdp_sharding_strategy`: a strategy's name, or `true` = FULL_SHARD, `false` =
/// SHARD_GRAD_OP as FSDP2 reads it).
pub const FSDP_KEYS: [&str; 6] = [
    "fsdp_sharding_strategy",
    "fsdp_min_num_params",
    "fsdp_backward_prefetch",
    "fsdp_forward_prefetch",
    "fsdp_offload_params",
    "fsdp_activation_checkpointing",
];

/// The section Accelerate 1.x writes the parallelism sizes in (`parallelism_config:
/// {parallelism_config_dp_shard_size: 2, …}`); its one key honoured here.
pub const PARALLELISM_SECTION: &str = "parallelism_config";
const PARALLELISM_KEYS: [&str; 1] = ["parallelism_config_dp_shard_size"];

/// A key `accelerate config` writes that selects nothing this project could do otherwise: it is
/// accepted with the values listed (any value when none are) and refused, by name and with the
/// reason, with any other.
struct Fixed {
    key: &'static str,
    accepted: &'static [&'static str],
    why: &'static str,
}

/// Accelerate's keys (top level and under [`FSDP_SECTION`]) read and checked, not stored.
const FIXED: [Fixed; 17] = [
    Fixed {
        key: "compute_environment",
        accepted: &["LOCAL_MACHINE"],
        why: "runs start on this machine (mpirun, Slurm or ladder-accelerate launch), not on SageMaker",
    },
    Fixed { key: "debug", accepted: &[], why: "every collective checks the ranks' shapes and dtypes anyway (Accelerate's debug mode)" },
    Fixed { key: "downcast_bf16", accepted: &["no", "false"], why: "it is for TPUs" },
    Fixed { key: "enable_cpu_affinity", accepted: &["false"], why: "CPU affinity is left to mpirun (--bind-to)" },
    Fixed { key: "gpu_ids", accepted: &["all"], why: "choose GPUs with CUDA_VISIBLE_DEVICES" },
    Fixed { key: "main_training_function", accepted: &[], why: "it names the function notebook and TPU launches call" },
    Fixed { key: "rdzv_backend", accepted: &["static"], why: "ranks meet at main_process_ip:main_process_port (a static rendezvous)" },
    Fixed { key: "same_network", accepted: &[], why: "it only matters to Accelerate's multi-node questionnaire" },
    Fixed { key: "tpu_env", accepted: &["[]"], why: "there is no TPU support" },
    Fixed { key: "tpu_use_cluster", accepted: &["false"], why: "there is no TPU support" },
    Fixed { key: "tpu_use_sudo", accepted: &["false"], why: "there is no TPU support" },
    Fixed {
        key: "fsdp_version",
        accepted: &["1"],
        why: "the FSDP here is FSDP1's (FlatParameter shards); FSDP2's fully_shard is not implemented",
    },
    Fixed {
        key: "fsdp_auto_wrap_policy",
        accepted: &["SIZE_BASED_WRAP"],
        why: "units follow fsdp_min_num_params (PyTorch's size_based_auto_wrap_policy)",
    },
    Fixed {
        key: "fsdp_state_dict_type",
        accepted: &["FULL_STATE_DICT"],
        why: "checkpoints hold the full state dict, loadable at any world size",
    },
    Fixed { key: "fsdp_sync_module_states", accepted: &["true"], why: "rank 0's weights are always broadcast when the model is wrapped" },
    Fixed {
        key: "fsdp_cpu_ram_efficient_loading",
        accepted: &[],
        why: "every rank builds the same initial weights and rank 0's are broadcast",
    },
    Fixed { key: "fsdp_use_orig_params", accepted: &[], why: "the optimizer steps each rank's FlatParameter shard either way" },
];

/// Whether a file's top-level mapping holds one of Accelerate's sections or [`FIXED`] keys.
fn needs_normalizing(map: &serde_json::Map<String, serde_json::Value>) -> bool {
    map.keys().any(|k| [DEEPSPEED_SECTION, FSDP_SECTION, PARALLELISM_SECTION].contains(&k.as_str()) || fixed(k).is_some())
}

fn fixed(key: &str) -> Option<&'static Fixed> {
    FIXED.iter().find(|f| f.key == key)
}

/// A value as a config file spells it: `true`, `1`, `FULL_SHARD`, `[]`.
fn spelled(value: &serde_json::Value) -> String {
    match value {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Checks a [`FIXED`] key's value (`at` is where it was: `""` or `"fsdp_config."`).
fn check_fixed(f: &Fixed, at: &str, value: &serde_json::Value) -> std::result::Result<(), String> {
    let v = spelled(value);
    if f.accepted.is_empty() || f.accepted.iter().any(|a| a.eq_ignore_ascii_case(&v)) {
        return Ok(());
    }
    Err(format!("key {at}{} = {v} is not supported: {}; use {} or remove the key", f.key, f.why, f.accepted.join(" or ")))
}

/// Accelerate's layout read into this project's flat one: each section's honoured keys lifted
/// to the top level (a key given in both places is refused), [`FIXED`] keys checked and
/// dropped, any other key of a section refused by name.
fn normalize(
    mut map: serde_json::Map<String, serde_json::Value>,
) -> std::result::Result<serde_json::Map<String, serde_json::Value>, String> {
    for (key, value) in &map {
        if let Some(f) = fixed(key) {
            check_fixed(f, "", value)?;
        }
    }
    map.retain(|k, _| fixed(k).is_none());
    for (section, keys) in
        [(DEEPSPEED_SECTION, &DEEPSPEED_KEYS[..]), (FSDP_SECTION, &FSDP_KEYS[..]), (PARALLELISM_SECTION, &PARALLELISM_KEYS[..])]
    {
        let Some(value) = map.remove(section) else { continue };
        let serde_json::Value::Object(entries) = value else {
            let what = if section == DEEPSPEED_SECTION { "DeepSpeed settings" } else { "settings" };
            return Err(format!("{section} must be a mapping of {what} ({})", keys.join(", ")));
        };
        for (key, mut value) in entries {
            let mut key = key;
            if section == FSDP_SECTION && key == "fsdp_reshard_after_forward" {
                key = "fsdp_sharding_strategy".into();
                if let serde_json::Value::Bool(b) = value {
                    value = serde_json::Value::String(if b { "FULL_SHARD" } else { "SHARD_GRAD_OP" }.into());
                }
            }
            if let Some(f) = fixed(&key) {
                check_fixed(f, &format!("{section}."), &value)?;
                continue;
            }
            if !keys.contains(&key.as_str()) {
                let how = if section == DEEPSPEED_SECTION { "runs DeepSpeed's ZeRO on its own strategies and " } else { "" };
                return Err(format!(
                    "key {section}.{key} is not honoured: ddp-ladder {how}reads only {} under {section} (remove the others)",
                    keys.join(", ")
                ));
            }
            if map.contains_key(&key) {
                return Err(format!("{key} is given twice, at the top level and under {section}; keep one"));
            }
            map.insert(key, value);
        }
    }
    Ok(map)
}

/// ` at line L, column C` for a TOML error span.
fn toml_location(text: &str, span: Option<std::ops::Range<usize>>) -> String {
    let Some(span) = span else { return String::new() };
    let before = &text[..span.start.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before.rsplit('\n').next().map(|l| l.chars().count()).unwrap_or(0) + 1;
    format!(" at line {line}, column {col}")
}
