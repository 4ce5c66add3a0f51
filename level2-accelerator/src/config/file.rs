//! Config files: YAML (Accelerate's format), TOML or JSON by extension, read with the key and
//! the line of a bad value named, written atomically with exactly the given settings.

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
                ConfigFormat::Yaml => serde_norway::from_str(&text).map_err(|e| parse_err(e.to_string()))?,
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
            ConfigFormat::Yaml => serde_norway::to_string(self).map_err(|e| e.to_string()),
            ConfigFormat::Toml => toml::to_string(self).map_err(|e| e.to_string()),
            ConfigFormat::Json => serde_json::to_string_pretty(self).map(|s| s + "\n").map_err(|e| e.to_string()),
        }
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
