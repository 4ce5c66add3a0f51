//! The checks clap and serde cannot make, as Transformers' `TrainingArguments.__post_init__`:
//! each error names the field at fault and what it accepts.

use super::{IntervalStrategy, TrainingArguments};
use crate::error::{Error, Result};

impl TrainingArguments {
    /// Checks that metric_for_best_model (if any) names one of `available` (without the
    /// `eval_` prefix, e.g. `["loss", "accuracy"]`).
    ///
    /// # Errors
    /// [`Error::UnknownMetric`] listing the available names.
    pub fn validate_metric(&self, available: &[&str]) -> Result<()> {
        if let Some(key) = self.best_metric_key() {
            let bare = key.strip_prefix("eval_").unwrap_or(&key);
            if !available.contains(&bare) {
                return Err(Error::UnknownMetric {
                    metric: self.metric_for_best_model.clone().unwrap_or_else(|| "loss".into()),
                    available: available.iter().map(|m| format!("{m} (or eval_{m})")).collect::<Vec<_>>().join(", "),
                });
            }
        }
        Ok(())
    }

    /// Checks the values clap and serde cannot, as Transformers' `__post_init__` does: the
    /// run's length, the optimizer, the intervals, best-model tracking, output_dir — in that
    /// order, the first fault reported.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the first field at fault and what it accepts.
    pub fn validate(&self) -> Result<()> {
        self.validate_run_length()?;
        self.validate_optimizer()?;
        self.validate_intervals()?;
        self.validate_best_model()?;
        if let (Some(ds), Some(fsdp)) = (self.deepspeed.as_ref().filter(|d| d.zero_stage > 0), self.fsdp) {
            return Err(Error::invalid(
                "deepspeed",
                format!("zero_optimization.stage {} together with fsdp {fsdp}", ds.zero_stage),
                "either deepspeed or fsdp (DeepSpeed's stage 2 is fsdp shard_grad_op, stage 3 full_shard)",
            ));
        }
        if self.deepspeed.as_ref().is_some_and(|d| d.zero_stage == 1) && self.bf16 {
            return Err(Error::invalid(
                "deepspeed",
                "zero_optimization.stage 1 together with bf16",
                "fp32 for ZeRO-1 (it runs on DDP, which computes in bf16 on FSDP's NO_SHARD path); stage 2 shards the optimizer state in bf16",
            ));
        }
        if let Some(mb) = self.ddp_bucket_cap_mb {
            if !(mb.is_finite() && mb > 0.0) {
                return Err(Error::invalid("ddp_bucket_cap_mb", mb, "a positive number of MiB (PyTorch's default: 25)"));
            }
            if let Some(fsdp) = self.fsdp {
                return Err(Error::invalid(
                    "ddp_bucket_cap_mb",
                    format!("{mb} together with fsdp {fsdp}"),
                    "DDP (FSDP has no gradient buckets)",
                ));
            }
            if self.deepspeed.as_ref().is_some_and(|d| d.zero_stage > 1) {
                return Err(Error::invalid(
                    "ddp_bucket_cap_mb",
                    format!("{mb} together with deepspeed"),
                    "DDP or ZeRO-1 (stages 2 and 3 run on FSDP)",
                ));
            }
        }
        if let Some(ds) = &self.deepspeed {
            ds.offload_optimizer.validate().map_err(|e| match e {
                ladder_core::Error::InvalidValue { value, expected, .. } => {
                    Error::invalid("deepspeed", format!("zero_optimization.offload_optimizer.nvme_path {value}"), expected)
                }
                other => other.into(),
            })?;
        }
        if self.dp_shard_size == Some(0) {
            return Err(Error::invalid("dp_shard_size", 0, "at least 1 rank per shard group (a divisor of the world size)"));
        }
        if self.output_dir.as_os_str().is_empty() {
            return Err(Error::invalid("output_dir", "\"\"", "a directory path"));
        }
        Ok(())
    }

    /// ddp_timeout, the batch sizes, gradient_accumulation_steps, max_steps, num_train_epochs.
    fn validate_run_length(&self) -> Result<()> {
        if self.ddp_timeout == 0 {
            return Err(Error::invalid("ddp_timeout", 0, "a positive number of seconds (default 600)"));
        }
        positive("per_device_train_batch_size", self.per_device_train_batch_size)?;
        positive("per_device_eval_batch_size", self.per_device_eval_batch_size)?;
        positive("gradient_accumulation_steps", self.gradient_accumulation_steps)?;
        if self.max_steps == 0 || self.max_steps < -1 {
            return Err(Error::invalid(
                "max_steps",
                self.max_steps,
                "a positive number of optimization steps, or -1 to use num_train_epochs",
            ));
        }
        if self.max_steps < 0 && !(self.num_train_epochs.is_finite() && self.num_train_epochs > 0.0) {
            return Err(Error::invalid(
                "num_train_epochs",
                self.num_train_epochs,
                "a positive, finite number of epochs (or set max_steps)",
            ));
        }
        Ok(())
    }

    /// AdamW's hyper-parameters, max_grad_norm, warmup_ratio.
    fn validate_optimizer(&self) -> Result<()> {
        if !(self.learning_rate.is_finite() && self.learning_rate >= 0.0) {
            return Err(Error::invalid("learning_rate", self.learning_rate, "a finite learning rate ≥ 0"));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return Err(Error::invalid("weight_decay", self.weight_decay, "a finite weight decay ≥ 0"));
        }
        for (field, beta) in [("adam_beta1", self.adam_beta1), ("adam_beta2", self.adam_beta2)] {
            if !(0.0..1.0).contains(&beta) {
                return Err(Error::invalid(field, beta, "a value in [0, 1)"));
            }
        }
        if !(self.adam_epsilon.is_finite() && self.adam_epsilon > 0.0) {
            return Err(Error::invalid("adam_epsilon", self.adam_epsilon, "a positive, finite epsilon"));
        }
        if !(self.max_grad_norm.is_finite() && self.max_grad_norm >= 0.0) {
            return Err(Error::invalid("max_grad_norm", self.max_grad_norm, "a finite norm ≥ 0 (0: no clipping)"));
        }
        if !(0.0..=1.0).contains(&self.warmup_ratio) {
            return Err(Error::invalid("warmup_ratio", self.warmup_ratio, "a fraction of the total steps in [0, 1]"));
        }
        Ok(())
    }

    /// logging_steps, eval_steps, save_steps with the steps strategies; save_total_limit.
    fn validate_intervals(&self) -> Result<()> {
        if self.logging_strategy == IntervalStrategy::Steps {
            positive("logging_steps", self.logging_steps)?;
        }
        if self.eval_strategy == IntervalStrategy::Steps && self.eval_steps() == 0 {
            return Err(Error::invalid("eval_steps", self.eval_steps(), "at least 1 with eval_strategy=steps"));
        }
        if self.save_strategy == IntervalStrategy::Steps {
            positive("save_steps", self.save_steps)?;
        }
        if self.save_total_limit == Some(0) {
            return Err(Error::invalid("save_total_limit", 0, "at least 1 checkpoint kept (or leave it unset to keep all)"));
        }
        Ok(())
    }

    /// load_best_model_at_end's needs (an evaluation, saves at the evaluations) and
    /// metric_for_best_model's spelling.
    fn validate_best_model(&self) -> Result<()> {
        if self.load_best_model_at_end {
            if self.eval_strategy == IntervalStrategy::No {
                return Err(Error::invalid(
                    "load_best_model_at_end",
                    true,
                    "an eval_strategy other than `no` (the best model is chosen by evaluation)",
                ));
            }
            if self.eval_strategy != self.save_strategy {
                return Err(Error::invalid(
                    "load_best_model_at_end",
                    true,
                    format!("save_strategy equal to eval_strategy (they are {:?} and {:?})", self.save_strategy, self.eval_strategy),
                ));
            }
            if self.eval_strategy == IntervalStrategy::Steps && self.save_steps % self.eval_steps() != 0 {
                return Err(Error::invalid(
                    "save_steps",
                    self.save_steps,
                    format!("a round multiple of eval_steps ({}) with load_best_model_at_end", self.eval_steps()),
                ));
            }
        }
        if let Some(m) = &self.metric_for_best_model {
            if m.is_empty() || m == "eval_" {
                return Err(Error::invalid("metric_for_best_model", format!("{m:?}"), "a metric name such as `loss` or `eval_accuracy`"));
            }
        }
        Ok(())
    }
}

/// `field` = `v` must be at least 1.
fn positive(field: &'static str, v: usize) -> Result<()> {
    if v == 0 {
        Err(Error::invalid(field, v, "at least 1"))
    } else {
        Ok(())
    }
}
