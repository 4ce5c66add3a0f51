//! Resolving the settings once — builder > launcher environment > config file > default —
//! with the source of each, and the checks of values given together.

use super::{fp16_cpu_conflict, AcceleratorConfig, DistributedType, Origin, ResolvedConfig, Source, CONFIG_FILE_VAR, SETTINGS};
use crate::{Error, Result};
use ladder_core::parallel::{DdpOptions, FsdpOptions, OptimizerOffload, Precision, ShardingStrategy, Strategy, WrapConfig};
use std::path::PathBuf;

impl AcceleratorConfig {
    /// `use_fsdp` as given, else true when `distributed_type` is `FSDP` (Accelerate's way of
    /// saying it), else not given.
    pub fn effective_use_fsdp(&self) -> Option<bool> {
        self.use_fsdp.or(match self.distributed_type {
            Some(DistributedType::Fsdp) => Some(true),
            _ => None,
        })
    }

    /// This config with what it implies made explicit: `use_fsdp` from `distributed_type:
    /// FSDP` ([`effective_use_fsdp`](Self::effective_use_fsdp)). What resolution and the
    /// launcher's variables read.
    pub fn with_implied(&self) -> AcceleratorConfig {
        AcceleratorConfig { use_fsdp: self.effective_use_fsdp(), ..self.clone() }
    }

    /// Checks every given value (each with its setting's parser, the rule a variable or a flag
    /// obeys) and the combinations of given values; `origin` says where they come from and is
    /// named in the error.
    ///
    /// # Errors
    /// [`Error::InvalidSetting`] for a value its setting's parser refuses (`num_processes`,
    /// `num_machines` or `gradient_accumulation_steps` 0, `main_process_port` 0, an empty
    /// `main_process_ip`) and for `machine_rank` outside `0..num_machines`;
    /// [`Error::Conflict`] for `num_processes` not a multiple of `num_machines`, `fp16` with
    /// `cpu`, `use_fsdp: false` with `distributed_type: FSDP`.
    pub fn validate(&self, origin: &Origin) -> Result<()> {
        self.validate_each(origin)?;
        let machines = self.num_machines.unwrap_or(1);
        if let Some(r) = self.machine_rank.filter(|r| *r >= machines) {
            return Err(Error::InvalidSetting {
                setting: "machine_rank".into(),
                value: r.to_string(),
                origin: origin.describe("machine_rank"),
                expected: format!("a machine index in 0..{machines} (num_machines {machines})"),
            });
        }
        if let Some(n) = self.num_processes.filter(|n| n % machines != 0) {
            return Err(Error::Conflict {
                first: format!("num_processes {n} ({})", origin.describe("num_processes")),
                second: format!("num_machines {machines} ({})", origin.describe("num_machines")),
                why: "num_processes counts the processes of all machines and must be a multiple of num_machines".into(),
            });
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
        let resolved = ResolvedConfig::pick_all(builder, &file, &env, config_file)?;
        if resolved.mixed_precision == Precision::Fp16 && resolved.cpu {
            return Err(fp16_cpu_conflict(&resolved.describe_source("mixed_precision"), &resolved.describe_source("cpu")));
        }
        if let Some(stage) = resolved.zero_stage.filter(|&s| s > 0 && resolved.use_fsdp) {
            return Err(Error::Conflict {
                first: format!("zero_stage {stage} ({})", resolved.describe_source("zero_stage")),
                second: format!("use_fsdp true ({})", resolved.describe_source("use_fsdp")),
                why: "DeepSpeed's ZeRO stages and FSDP exclude each other (stage 2 is FSDP's SHARD_GRAD_OP, 3 its FULL_SHARD); \
                      remove one of them"
                    .into(),
            });
        }
        if resolved.fsdp_offload_params && resolved.strategy().sharding().is_none() {
            let second = match resolved.zero_stage {
                Some(stage) if stage > 0 => format!("zero_stage {stage} ({})", resolved.describe_source("zero_stage")),
                _ => format!("use_fsdp false ({})", resolved.describe_source("use_fsdp")),
            };
            return Err(Error::Conflict {
                first: format!("fsdp_offload_params true ({})", resolved.describe_source("fsdp_offload_params")),
                second,
                why: "CPU offload of the parameters is FSDP's (PyTorch's CPUOffload(offload_params=True)): the strategy ddp keeps a \
                      full replica on the device; use use_fsdp true (or zero_stage 2 or 3), or drop fsdp_offload_params"
                    .into(),
            });
        }
        if resolved.zero_stage == Some(1) && resolved.mixed_precision != Precision::No {
            return Err(Error::Conflict {
                first: format!("zero_stage 1 ({})", resolved.describe_source("zero_stage")),
                second: format!("mixed_precision {} ({})", resolved.mixed_precision, resolved.describe_source("mixed_precision")),
                why: "ZeRO-1 runs on fp32 DDP (mixed precision runs DDP on FSDP's NO_SHARD path); use zero_stage 2 for sharded \
                      optimizer state in bf16"
                    .into(),
            });
        }
        Ok(resolved)
    }

    /// The setting that decides [`strategy`](Self::strategy): `zero_stage` when above 0, else
    /// `use_fsdp` (for banners and errors naming it with its source).
    pub fn strategy_setting(&self) -> &'static str {
        if self.zero_stage.is_some_and(|z| z > 0) {
            "zero_stage"
        } else {
            "use_fsdp"
        }
    }

    /// How the model is wrapped: DDP (PyTorch's options), or FSDP with
    /// `fsdp_sharding_strategy`, `fsdp_min_num_params`, `fsdp_backward_prefetch`,
    /// `fsdp_forward_prefetch` and `fsdp_offload_params` when `use_fsdp`; DeepSpeed's `zero_stage` 1 is DDP with ZeRO-1,
    /// 2 and 3 FSDP `SHARD_GRAD_OP` and `FULL_SHARD` with the FSDP settings' other values.
    pub fn strategy(&self) -> Strategy {
        let sharding_strategy = match self.zero_stage {
            Some(1) => return Strategy::Ddp(DdpOptions { zero_redundancy_optimizer: true, ..DdpOptions::default() }),
            Some(2) => ShardingStrategy::ShardGradOp,
            Some(3) => ShardingStrategy::FullShard,
            _ if !self.use_fsdp => return Strategy::default(),
            _ => self.fsdp_sharding_strategy,
        };
        Strategy::Fsdp(FsdpOptions {
            sharding_strategy,
            min_num_params: self.fsdp_min_num_params,
            backward_prefetch: self.fsdp_backward_prefetch,
            forward_prefetch: self.fsdp_forward_prefetch,
            dp_shard_size: self.parallelism_config_dp_shard_size,
            offload_params: self.fsdp_offload_params,
            ..FsdpOptions::default()
        })
    }

    /// The core's wrapping settings these values stand for, with DDP's options (from
    /// [`DistributedDataParallelKwargs`](crate::DistributedDataParallelKwargs)) when the
    /// [`strategy`](Self::strategy) is DDP, and the mixed precision. What
    /// [`Accelerator::prepare_model`](crate::Accelerator::prepare_model) wraps the model with.
    pub fn wrap_config(&self, ddp: DdpOptions) -> WrapConfig {
        let strategy = match self.strategy() {
            Strategy::Ddp(o) => {
                Strategy::Ddp(DdpOptions { zero_redundancy_optimizer: ddp.zero_redundancy_optimizer || o.zero_redundancy_optimizer, ..ddp })
            }
            fsdp => fsdp,
        };
        WrapConfig { strategy, mixed_precision: self.mixed_precision, activation_checkpointing: self.fsdp_activation_checkpointing }
    }

    /// Where the prepared optimizer keeps AdamW's moments: `offload_optimizer_device` with
    /// `offload_optimizer_nvme_path` (DeepSpeed's `offload_optimizer: {"device", "nvme_path"}`),
    /// the directory checked as [`OptimizerOffload::validate`] does (it exists, is a directory,
    /// a file can be created in it). What
    /// [`Accelerator::prepare_optimizer`](crate::Accelerator::prepare_optimizer) uses.
    ///
    /// # Errors
    /// [`Error::InvalidSetting`] naming `offload_optimizer_nvme_path` and where it (or, when it
    /// is missing, the device nvme) was given.
    pub fn optimizer_offload(&self) -> Result<OptimizerOffload> {
        const PATH: &str = "offload_optimizer_nvme_path";
        let offload = OptimizerOffload::new(self.offload_optimizer_device, self.offload_optimizer_nvme_path.clone());
        let origin = |given: bool| match given {
            true => self.describe_source(PATH),
            false => format!("needed by offload_optimizer_device nvme, {}", self.describe_source("offload_optimizer_device")),
        };
        offload.and_then(|o| o.validate().map(|()| o)).map_err(|e| match e {
            ladder_core::Error::InvalidValue { value, expected, .. } => Error::InvalidSetting {
                setting: PATH.into(),
                value: if self.offload_optimizer_nvme_path.is_some() { value } else { "not set".into() },
                origin: origin(self.offload_optimizer_nvme_path.is_some()),
                expected,
            },
            other => other.into(),
        })
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
            Source::Env => format!("from {}", super::env_var(setting).unwrap_or("the environment")),
            Source::ConfigFile => match &self.config_file {
                Some(f) => format!("from config file {}", f.display()),
                None => "from the config file".into(),
            },
            Source::Default => "default".into(),
        }
    }

    /// One line per setting with its value and where it came from, e.g.
    /// `mixed_precision: bf16 (from ACCELERATE_MIXED_PRECISION)`; lines end with `\n`.
    pub fn banner(&self) -> String {
        SETTINGS.iter().map(|(setting, _)| format!("{setting}: {} ({})\n", self.value_of(setting), self.describe_source(setting))).collect()
    }
}
