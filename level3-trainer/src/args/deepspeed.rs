//! Transformers' `deepspeed` argument: a DeepSpeed JSON config, of which this Trainer honours
//! the ZeRO stage (run on the core's strategies) and refuses every key it would ignore, by name.

use ladder_core::parallel::{OffloadDevice, OptimizerOffload};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The DeepSpeed keys honoured, with what each means here (`--help` and errors list them).
pub const HONOURED_KEYS: &str = "zero_optimization.stage (0 off, 1 ZeRO-1: DDP with the optimizer state sharded, \
     2 fsdp shard_grad_op, 3 fsdp full_shard), zero_optimization.offload_optimizer.device (\"none\", or \"nvme\" \
     with offload_optimizer.nvme_path: AdamW's moments in a file per rank; its other keys at DeepSpeed's defaults only); \
     and, with the value \"auto\" (take the TrainingArguments'), train_batch_size, train_micro_batch_size_per_gpu, \
     gradient_accumulation_steps, gradient_clipping, bf16.enabled, fp16.enabled";

/// Keys accepted only with the value `"auto"`, as Transformers fills them from its arguments.
const AUTO_KEYS: &[&str] = &[
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "bf16.enabled",
    "fp16.enabled",
];

/// What a DeepSpeed config asks of this Trainer (`TrainingArguments.deepspeed`). In an
/// arguments file: the path of a DeepSpeed JSON file, or the DeepSpeed object itself (written
/// back as `{"zero_optimization": {"stage": N}}`, with `"offload_optimizer": {"device":
/// "nvme", "nvme_path": DIR}` when offloaded).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeepSpeedConfig {
    /// `zero_optimization.stage`: 0..=3 (absent: 0).
    pub zero_stage: u8,
    /// `zero_optimization.offload_optimizer`: `device` `"none"` (absent: none) or `"nvme"` with
    /// `nvme_path` (see [`ladder_core::parallel::offload`]); the directory is checked by
    /// [`TrainingArguments::validate`](super::TrainingArguments::validate).
    pub offload_optimizer: OptimizerOffload,
}

impl Serialize for DeepSpeedConfig {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let mut zero = serde_json::json!({ "stage": self.zero_stage });
        if let OptimizerOffload::Nvme(o) = &self.offload_optimizer {
            zero["offload_optimizer"] = serde_json::json!({ "device": "nvme", "nvme_path": o.nvme_path });
        }
        serde_json::json!({ "zero_optimization": zero }).serialize(s)
    }
}

impl<'de> Deserialize<'de> for DeepSpeedConfig {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        match Value::deserialize(d)? {
            Value::String(path) => Self::from_arg(&path),
            v => Self::from_json(&v).map_err(|e| format!("deepspeed: {e}")),
        }
        .map_err(serde::de::Error::custom)
    }
}

impl DeepSpeedConfig {
    /// The `--deepspeed` value, as Transformers reads it: the path of a JSON file, or a JSON
    /// object given inline.
    ///
    /// # Errors
    /// An unreadable file; malformed JSON; the keys this Trainer does not honour, all in one
    /// message (by dotted path, a block none of whose keys is honoured by its name); a value out
    /// of range (reported first).
    pub fn from_arg(text: &str) -> std::result::Result<Self, String> {
        let json = if text.trim_start().starts_with('{') {
            text.to_string()
        } else {
            std::fs::read_to_string(text)
                .map_err(|e| format!("cannot read DeepSpeed config {text}: {e} (expected the path of a JSON file, or a JSON object)"))?
        };
        let value: Value = serde_json::from_str(&json).map_err(|e| format!("DeepSpeed config {text}: {e}"))?;
        Self::from_json(&value).map_err(|e| format!("DeepSpeed config {text}: {e}"))
    }

    /// Reads a parsed DeepSpeed config.
    ///
    /// # Errors
    /// As [`from_arg`](Self::from_arg).
    pub fn from_json(value: &Value) -> std::result::Result<Self, String> {
        let mut leaves = Vec::new();
        flatten("", value, &mut leaves)?;
        let mut cfg = DeepSpeedConfig::default();
        let (mut device, mut nvme_path) = (OffloadDevice::None, None);
        let (mut unknown, mut known) = (Vec::new(), Vec::new());
        for (key, v) in leaves {
            match key.as_str() {
                "zero_optimization.stage" => {
                    cfg.zero_stage = match v.as_u64() {
                        Some(s @ 0..=3) => s as u8,
                        _ => return Err(format!("zero_optimization.stage is {v}, expected 0, 1, 2 or 3")),
                    }
                }
                "zero_optimization.offload_optimizer.device" => {
                    let refused = |why: &str| {
                        format!("zero_optimization.offload_optimizer.device {v} is not supported by this Trainer: expected {why}")
                    };
                    let text = v.as_str().ok_or_else(|| refused("\"none\" or \"nvme\""))?;
                    device = text.parse().map_err(|e: ladder_core::parallel::ChoiceError| refused(&e.names))?;
                }
                "zero_optimization.offload_optimizer.nvme_path" => match v.as_str() {
                    Some(p) if !p.trim().is_empty() => nvme_path = Some(std::path::PathBuf::from(p)),
                    _ => return Err(format!("zero_optimization.offload_optimizer.nvme_path is {v}, expected a directory path")),
                },
                k if k.starts_with("zero_optimization.offload_optimizer.") => {
                    let sub = &k["zero_optimization.offload_optimizer.".len()..];
                    OptimizerOffload::check_deepspeed_key(sub, &v.to_string()).map_err(|e| match e {
                        ladder_core::Error::InvalidValue { expected, .. } => format!("{k} is {v}: this Trainer takes only {expected}"),
                        other => format!("{k}: {other}"),
                    })?;
                }
                k if AUTO_KEYS.contains(&k) => {
                    if v.as_str() != Some("auto") {
                        return Err(format!("{k} is {v}: this Trainer takes it from its TrainingArguments; give \"auto\" or leave it out"));
                    }
                }
                k => {
                    unknown.push(k.to_string());
                    continue;
                }
            }
            known.push(key);
        }
        if !unknown.is_empty() {
            return Err(unknown_keys(&unknown, &known));
        }
        cfg.offload_optimizer = OptimizerOffload::new(device, nvme_path).map_err(|_| {
            "zero_optimization.offload_optimizer.device \"nvme\" needs offload_optimizer.nvme_path, the directory of the moments' files"
                .to_string()
        })?;
        Ok(cfg)
    }
}

/// Every key not honoured, in one message: a top-level block none of whose keys is honoured
/// (a Hugging Face config's `optimizer`, `scheduler`) by its name alone, other keys by their
/// dotted path.
fn unknown_keys(unknown: &[String], known: &[String]) -> String {
    let top = |k: &str| k.split('.').next().unwrap_or(k).to_string();
    let mut names: Vec<String> = Vec::new();
    for k in unknown {
        let block = top(k);
        let name = if known.iter().any(|h| top(h) == block) { k.clone() } else { block };
        if !names.contains(&name) {
            names.push(name);
        }
    }
    let (s, list) = (if names.len() == 1 { "" } else { "s" }, names.join(", "));
    format!("unknown DeepSpeed key{s} {list}: this Trainer honours only {HONOURED_KEYS}")
}

/// The leaves of a JSON object as `(dotted.key, value)`, in key order (serde_json's maps are
/// sorted).
fn flatten<'a>(prefix: &str, value: &'a Value, out: &mut Vec<(String, &'a Value)>) -> std::result::Result<(), String> {
    match value {
        Value::Object(map) => {
            for (k, v) in map {
                let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                flatten(&key, v, out)?;
            }
            Ok(())
        }
        _ if prefix.is_empty() => Err("expected a JSON object".into()),
        v => {
            out.push((prefix.to_string(), v));
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stage_and_auto_values_are_read_and_other_keys_refused_by_name() {
        let ok = DeepSpeedConfig::from_arg(
            r#"{"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "none"}}, "train_batch_size": "auto", "bf16": {"enabled": "auto"}}"#,
        )
        .unwrap();
        assert_eq!(ok.zero_stage, 1);
        let e = DeepSpeedConfig::from_arg(r#"{"zero_optimization": {"stage": 2, "overlap_comm": true}}"#).unwrap_err();
        assert!(e.contains("unknown DeepSpeed key zero_optimization.overlap_comm"), "{e}");
        // A Hugging Face-style config: every key not honoured in one message, whole blocks by name.
        let hf = r#"{"optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto"}}, "scheduler": {"type": "WarmupLR"},
            "zero_optimization": {"stage": 1, "overlap_comm": true, "contiguous_gradients": true}, "train_batch_size": "auto"}"#;
        let e = DeepSpeedConfig::from_arg(hf).unwrap_err();
        assert!(
            e.contains(
                "unknown DeepSpeed keys optimizer, scheduler, zero_optimization.contiguous_gradients, zero_optimization.overlap_comm: "
            ),
            "{e}"
        );
        let e = DeepSpeedConfig::from_arg(r#"{"zero_optimization": {"stage": 4}}"#).unwrap_err();
        assert!(e.contains("zero_optimization.stage is 4"), "{e}");
        let e = DeepSpeedConfig::from_arg(r#"{"train_batch_size": 64}"#).unwrap_err();
        assert!(e.contains("train_batch_size is 64"), "{e}");
        let nvme = r#"{"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "buffer_count": 4}}}"#;
        let ok = DeepSpeedConfig::from_arg(nvme).unwrap();
        assert_eq!(ok.offload_optimizer, OptimizerOffload::Nvme(ladder_core::parallel::NvmeOffload::new("/local_nvme")));
        let back = serde_json::to_value(&ok).unwrap();
        assert_eq!(
            back,
            serde_json::json!({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"}}})
        );
        assert_eq!(DeepSpeedConfig::from_json(&back).unwrap(), ok, "written back, read again");
        let e = DeepSpeedConfig::from_arg(r#"{"zero_optimization": {"offload_optimizer": {"ratio": 0.5}}}"#).unwrap_err();
        assert!(e.contains("zero_optimization.offload_optimizer.ratio is 0.5: this Trainer takes only 1"), "{e}");
        let e = DeepSpeedConfig::from_arg("/nonexistent/ds.json").unwrap_err();
        assert!(e.contains("cannot read DeepSpeed config /nonexistent/ds.json"), "{e}");
    }
}
