//! The Trainer and the launcher's settings (`ladder-accelerate launch --use-fsdp
//! --mixed-precision bf16 --gradient-accumulation-steps 2 …`, exported as `ACCELERATE_*` /
//! `FSDP_*` variables), as 🤗 Transformers' Trainer under `accelerate launch`: a setting the
//! arguments leave at its default is the launcher's (the Accelerator reads its variables); one
//! the arguments set and the launcher contradicts is an error naming both; the banner says which
//! source won. The arguments are then brought in line with what the Accelerator runs.

use super::Trainer;
use crate::args::TrainingArguments;
use crate::error::{Error, Result};
use ladder_core::parallel::{Precision, Strategy};
use level2_accelerator::config::Source;
use level2_accelerator::{AcceleratorConfig, ResolvedConfig};

/// The TrainingArguments fields the launcher can also set, each with the Accelerator setting
/// it stands for.
pub const LAUNCHER_SETTINGS: &[(&str, &str)] = &[
    ("fsdp", "use_fsdp"),
    ("bf16", "mixed_precision"),
    ("gradient_accumulation_steps", "gradient_accumulation_steps"),
    ("seed", "seed"),
    ("report_to", "log_with"),
];

impl Trainer {
    /// The Accelerator settings these arguments set (Transformers builds its `Accelerator` the
    /// same way). Set: use_cpu when true; bf16 when true; the accumulation steps when not 1;
    /// with fsdp, FSDP, its sharding strategy, CPU offload (`offload`), auto-wrap threshold and HSDP's dp_shard_size
    /// (when given) and fsdp_config's prefetch settings (as Transformers exports `fsdp_config` over the
    /// launcher's variables); activation checkpointing when gradient_checkpointing is true; the
    /// ZeRO stage and optimizer offload of a `deepspeed` config; the seed; output_dir as the Accelerator's
    /// project_dir (the Trainer writes its TensorBoard files itself, in logging_dir: see
    /// report_to). Left to the launcher's variables (and then the defaults): everything the
    /// arguments leave at its default.
    pub fn accelerator_config(args: &TrainingArguments) -> AcceleratorConfig {
        let fsdp = args.fsdp.is_some();
        AcceleratorConfig {
            cpu: args.use_cpu.then_some(true),
            mixed_precision: args.bf16.then_some(Precision::Bf16),
            gradient_accumulation_steps: (args.gradient_accumulation_steps != 1).then_some(args.gradient_accumulation_steps),
            use_fsdp: fsdp.then_some(true),
            fsdp_sharding_strategy: args.fsdp.map(|f| f.sharding_strategy),
            fsdp_offload_params: args.fsdp.map(|f| f.offload),
            fsdp_min_num_params: args.fsdp_min_num_params.filter(|_| fsdp),
            fsdp_backward_prefetch: fsdp.then_some(args.fsdp_config.backward_prefetch),
            fsdp_forward_prefetch: fsdp.then_some(args.fsdp_config.forward_prefetch),
            parallelism_config_dp_shard_size: args.dp_shard_size.filter(|_| fsdp),
            fsdp_activation_checkpointing: args.gradient_checkpointing.then_some(true),
            zero_stage: args.deepspeed.as_ref().map(|d| usize::from(d.zero_stage)),
            offload_optimizer_device: args.deepspeed.as_ref().map(|d| d.offload_optimizer.device()),
            offload_optimizer_nvme_path: args.deepspeed.as_ref().and_then(|d| match &d.offload_optimizer {
                ladder_core::parallel::OptimizerOffload::Nvme(o) => Some(o.nvme_path.clone()),
                ladder_core::parallel::OptimizerOffload::None => None,
            }),
            seed: Some(args.seed),
            project_dir: Some(args.output_dir.clone()),
            ..AcceleratorConfig::default()
        }
    }

    /// Refuses a launcher setting that contradicts an argument set explicitly: for each of
    /// fsdp, bf16, gradient_accumulation_steps and seed, `set_by(field)` says how the user set
    /// it (`--strategy ddp`, `a.json`; `None`: left at its default), and `env` looks up the
    /// launcher's variables. The seed cannot be taken from the launcher (the model is built
    /// before the Trainer): any difference is refused. The Trainer calls it with the fields
    /// whose value differs from the default; the level-3 binary with every field it was given.
    ///
    /// # Errors
    /// [`Error::LauncherConflict`] naming the argument, how it was set, the launcher's
    /// variable and both values; the Accelerator's errors for a malformed variable.
    pub fn check_launcher_settings(
        args: &TrainingArguments,
        set_by: impl Fn(&str) -> Option<String>,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<()> {
        let launcher = ResolvedConfig::resolve(&AcceleratorConfig::default(), &env)?;
        for (field, setting) in LAUNCHER_SETTINGS {
            if launcher.source(setting) == Source::Default {
                continue;
            }
            let (ours, theirs) = match *field {
                "fsdp" => (args.strategy().to_string(), launcher.strategy().to_string()),
                "bf16" => (precision(args.bf16).to_string(), launcher.mixed_precision.to_string()),
                "gradient_accumulation_steps" => {
                    (args.gradient_accumulation_steps.to_string(), launcher.gradient_accumulation_steps.to_string())
                }
                "report_to" => (report_to_name(args.report_to), launcher.value_of("log_with")),
                _ => (args.seed.to_string(), launcher.seed.map_or_else(String::new, |s| s.to_string())),
            };
            // FSDP's sharding strategy only counts when both sides say FSDP explicitly.
            let differs = if *field == "fsdp" {
                args.fsdp.is_some() != launcher.use_fsdp || (args.fsdp.is_some() && ours != theirs)
            } else {
                ours != theirs
            };
            let how = match set_by(field) {
                Some(how) => how,
                None if *field == "seed" => "its default".into(),
                None => continue,
            };
            if differs {
                return Err(Error::LauncherConflict {
                    argument: format!("TrainingArguments.{field} = {ours} ({how})"),
                    launcher: format!("{} ({})", theirs, launcher.describe_source(setting)),
                });
            }
        }
        Ok(())
    }

    /// The arguments as the Accelerator runs them: the launcher's strategy, mixed precision,
    /// accumulation and tracker (`log_with tensorboard` is report_to tensorboard) where the
    /// arguments left them to it, so that planning, the banner and training_args.json say what
    /// runs.
    pub(super) fn effective_arguments(mut args: TrainingArguments, resolved: &ResolvedConfig) -> TrainingArguments {
        if resolved.log_with == Some(level2_accelerator::tracking::LogWith::Tensorboard) {
            args.report_to = crate::args::ReportTo::Tensorboard;
        }
        args.gradient_accumulation_steps = resolved.gradient_accumulation_steps;
        args.bf16 = resolved.mixed_precision == Precision::Bf16;
        if let Strategy::Fsdp(o) = resolved.strategy() {
            let auto_wrap = args.fsdp.is_some_and(|f| f.auto_wrap);
            args.fsdp = Some(crate::args::FsdpArg { sharding_strategy: o.sharding_strategy, offload: o.offload_params, auto_wrap });
            args.fsdp_min_num_params = Some(o.min_num_params);
            args.fsdp_config.backward_prefetch = o.backward_prefetch;
            args.fsdp_config.forward_prefetch = o.forward_prefetch;
            args.dp_shard_size = o.dp_shard_size;
        }
        args
    }

    /// The banner's lines on the settings the launcher can also give: each value and the source
    /// that won (`TrainingArguments`, the launcher's variable, the config file, the default).
    pub(super) fn settings_banner(&self) -> String {
        let resolved = self.accelerator.config();
        let source = |setting: &str| match resolved.source(setting) {
            Source::Builder => "TrainingArguments".to_string(),
            Source::Env => format!("the launcher: {}", resolved.describe_source(setting).trim_start_matches("from ")),
            _ => resolved.describe_source(setting),
        };
        format!(
            "  Distributed strategy = {} ({})\n  Mixed precision = {} ({})\n  Gradient Accumulation steps from = {}",
            resolved.strategy().label(),
            source(resolved.strategy_setting()),
            resolved.mixed_precision,
            source("mixed_precision"),
            source("gradient_accumulation_steps"),
        )
    }
}

/// report_to as written in an args file (`tensorboard`).
fn report_to_name(r: crate::args::ReportTo) -> String {
    serde_json::to_value(r).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default()
}

/// bf16 as a mixed-precision name.
fn precision(bf16: bool) -> Precision {
    if bf16 {
        Precision::Bf16
    } else {
        Precision::No
    }
}
