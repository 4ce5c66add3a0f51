//! Config files: YAML (Accelerate's format), TOML or JSON by extension, read with the key and
//! the line of a bad value named, written atomically with exactly the given settings.
//!
//! Accelerate nests the DeepSpeed plugin's settings under `deepspeed_config:`; the ones
//! honoured here ([`DEEPSPEED_KEYS`]) are read from there as from the top level (a file with
//! that section has its errors named by key, without a line), the others are refused by name.

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
                ConfigFormat::Yaml => match serde_norway::from_str::<serde_norway::Value>(&text) {
                    // Accelerate's `deepspeed_config:` section: lifted to the top level first.
                    Ok(serde_norway::Value::Mapping(mut map)) if map.contains_key(DEEPSPEED_SECTION) => {
                        let section = map.remove(DEEPSPEED_SECTION).expect("checked");
                        let serde_norway::Value::Mapping(section) = section else { return Err(parse_err(not_a_mapping())) };
                        for (key, value) in section {
                            let key = key.as_str().map(str::to_string).unwrap_or_else(|| format!("{key:?}"));
                            check_deepspeed_key(&key, map.contains_key(key.as_str())).map_err(parse_err)?;
                            map.insert(serde_norway::Value::String(key), value);
                        }
                        serde_norway::from_value(serde_norway::Value::Mapping(map)).map_err(|e| parse_err(e.to_string()))?
                    }
                    _ => serde_norway::from_str(&text).map_err(|e| parse_err(e.to_string()))?,
                },
                ConfigFormat::Toml => match toml::from_str::<toml::Table>(&text) {
                    Ok(mut map) if map.contains_key(DEEPSPEED_SECTION) => {
                        let toml::Value::Table(section) = map.remove(DEEPSPEED_SECTION).expect("checked") else {
                            return Err(parse_err(not_a_mapping()));
                        };
                        for (key, value) in section {
                            check_deepspeed_key(&key, map.contains_key(&key)).map_err(parse_err)?;
                            map.insert(key, value);
                        }
                        toml::Value::Table(map)
                            .try_into()
                            .map_err(|e: toml::de::Error| parse_err(e.message().trim().replace('\n', "; ")))?
                    }
                    _ => toml::from_str(&text)
                        .map_err(|e| parse_err(e.message().trim().replace('\n', "; ") + &toml_location(&text, e.span())))?,
                },
                ConfigFormat::Json => match serde_json::from_str::<serde_json::Value>(&text) {
                    Ok(serde_json::Value::Object(mut map)) if map.contains_key(DEEPSPEED_SECTION) => {
                        let serde_json::Value::Object(section) = map.remove(DEEPSPEED_SECTION).expect("checked") else {
                            return Err(parse_err(not_a_mapping()));
                        };
                        for (key, value) in section {
                            check_deepspeed_key(&key, map.contains_key(&key)).map_err(parse_err)?;
                            map.insert(key, value);
                        }
                        serde_json::from_value(serde_json::Value::Object(map)).map_err(|e| parse_err(e.to_string()))?
                    }
                    _ => serde_json::from_str(&text).map_err(|e| parse_err(e.to_string()))?,
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

/// Whether `deepspeed_config.key` may be lifted to the top level: one of [`DEEPSPEED_KEYS`],
/// not also given at the top level (`at_top`).
fn check_deepspeed_key(key: &str, at_top: bool) -> std::result::Result<(), String> {
    if !DEEPSPEED_KEYS.contains(&key) {
        return Err(format!(
            "key {DEEPSPEED_SECTION}.{key} is not honoured: ddp-ladder runs DeepSpeed's ZeRO on its own strategies and \
             reads only {} under {DEEPSPEED_SECTION} (remove the others)",
            DEEPSPEED_KEYS.join(", ")
        ));
    }
    if at_top {
        return Err(format!("{key} is given twice, at the top level and under {DEEPSPEED_SECTION}; keep one"));
    }
    Ok(())
}

fn not_a_mapping() -> String {
    format!("{DEEPSPEED_SECTION} must be a mapping of DeepSpeed settings ({})", DEEPSPEED_KEYS.join(", "))
}

/// ` at line L, column C` for a TOML error span.
fn toml_location(text: &str, span: Option<std::ops::Range<usize>>) -> String {
    let Some(span) = span else { return String::new() };
    let before = &text[..span.start.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before.rsplit('\n').next().map(|l| l.chars().count()).unwrap_or(0) + 1;
    format!(" at line {line}, column {col}")
}
