//! Transformers' `fsdp_config`: the FSDP settings beside `fsdp`, from a JSON object or file.

use ladder_core::parallel::BackwardPrefetch;
use serde::{Deserialize, Serialize};

/// `backward_prefetch` as Transformers reads it (it upper-cases the text and hands it to
/// Accelerate: `backward_pre`, `backward_post`, `no_prefetch`, any spelling of the core's
/// [`BackwardPrefetch`]); `null` is no prefetch, as leaving the key out.
fn backward_prefetch_from_text<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<BackwardPrefetch, D::Error> {
    let text: Option<String> = Option::deserialize(d)?;
    let Some(text) = text else { return Ok(BackwardPrefetch::NoPrefetch) };
    ladder_core::parallel::choice::parse(&text).map_err(|e: ladder_core::parallel::ChoiceError| {
        serde::de::Error::custom(format!(
            "invalid value {text:?} for fsdp_config.backward_prefetch: expected {} (no key: no prefetch)",
            e.expected.replace('-', "_")
        ))
    })
}

fn is_no_prefetch(p: &BackwardPrefetch) -> bool {
    *p == BackwardPrefetch::NoPrefetch
}

/// Transformers' `TrainingArguments.fsdp_config`: FSDP settings beside `fsdp`, with
/// Transformers' key names (an `fsdp_` prefix is accepted too, as Transformers strips it).
/// The keys this Trainer implements; any other key is an error. Used when `fsdp` is set.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FsdpConfig {
    /// `backward_prefetch`: `backward_pre` or `backward_post`. Absent (or `no_prefetch`): no
    /// prefetch, Transformers' and Accelerate's default (PyTorch's own is `backward_pre`).
    #[serde(alias = "fsdp_backward_prefetch", deserialize_with = "backward_prefetch_from_text", skip_serializing_if = "is_no_prefetch")]
    pub backward_prefetch: BackwardPrefetch,
    /// `forward_prefetch`: start the next unit's all-gather before the current unit's forward
    /// computation. Default false, Transformers'.
    #[serde(alias = "fsdp_forward_prefetch")]
    pub forward_prefetch: bool,
}

impl Default for FsdpConfig {
    fn default() -> Self {
        Self { backward_prefetch: BackwardPrefetch::NoPrefetch, forward_prefetch: false }
    }
}

impl FsdpConfig {
    /// The `--fsdp-config` value, as Transformers reads `fsdp_config` given as text: a JSON
    /// object (`{"backward_prefetch": "backward_pre"}`), else the path of a JSON file holding
    /// one.
    ///
    /// # Errors
    /// An unreadable file; malformed JSON, an unknown key or a bad value, named.
    pub fn from_arg(text: &str) -> std::result::Result<Self, String> {
        let json = if text.trim_start().starts_with('{') {
            text.to_string()
        } else {
            std::fs::read_to_string(text).map_err(|e| {
                format!("cannot read {text}: {e} (expected a JSON object such as {{\"backward_prefetch\": \"backward_pre\"}}, or the path of a JSON file holding one)")
            })?
        };
        serde_json::from_str(&json).map_err(|e| format!("fsdp_config: {e}"))
    }
}
