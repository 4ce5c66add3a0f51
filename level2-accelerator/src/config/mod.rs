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
//! Every setting is declared once, in one table (`settings.rs`: name, type, parser,
//! description, and for the settings a program resolves its variable and default); the
//! struct, its file keys, its flags, the resolution, the banner and the launcher's variables
//! are derived from it. The variables are Accelerate's (`accelerate launch` exports them in
//! `prepare_simple_launcher_cmd_env` / `prepare_multi_gpu_env`; the `Accelerator` and
//! `FullyShardedDataParallelPlugin` read them): see [`SETTINGS`].
//!
//! A program reads the config file named by `ACCELERATE_CONFIG_FILE` and no other: the user's
//! default config is read by `ladder-accelerate launch`, which turns it into the variables.

#[macro_use]
mod table;
mod file;
mod resolve;
mod settings;

pub use file::ConfigFormat;
pub use ladder_core::parallel::{BackwardPrefetch, Precision, ShardingStrategy};
pub use settings::{AcceleratorConfig, ResolvedConfig, SETTINGS};
pub use table::parse::bool as str_to_bool;
pub use table::{parse, Show};

use ladder_core::parallel::{Choice, FsdpOptions};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// The variable naming the config file a program reads (see [`ResolvedConfig::resolve`]).
pub const CONFIG_FILE_VAR: &str = "ACCELERATE_CONFIG_FILE";

/// Accelerate's `distributed_type`, as `accelerate config` asks for it. It picks how
/// `ladder-accelerate launch` starts the ranks (`MULTI_GPU`: the nccl backend; `MULTI_CPU`,
/// `NO`: mpi; `FSDP`: nccl when CUDA is usable and `cpu` is not set, else mpi) and `FSDP`
/// turns `use_fsdp` on. Written as Accelerate writes it (`MULTI_CPU`); read in any case, `-`
/// and `_` alike (`multi-cpu` is the flag's spelling).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum, Default)]
pub enum DistributedType {
    /// One process (or ranks started by hand).
    #[default]
    No,
    /// Several CPU processes, the mpi backend.
    MultiCpu,
    /// One process per GPU, the nccl backend.
    MultiGpu,
    /// Fully sharded data parallel (sets `use_fsdp`).
    Fsdp,
}

impl Choice for DistributedType {
    const WHAT: &'static str = "distributed type";

    fn name(self) -> &'static str {
        match self {
            DistributedType::No => "NO",
            DistributedType::MultiCpu => "MULTI_CPU",
            DistributedType::MultiGpu => "MULTI_GPU",
            DistributedType::Fsdp => "FSDP",
        }
    }
}
ladder_core::impl_choice!(DistributedType);

/// The experiment tracker the Accelerator logs to (Accelerate's `log_with`; see
/// [`crate::tracking`]). Accelerate's other trackers (wandb, mlflow, …) are refused by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum LogWith {
    /// TensorBoard event files under `project_dir/<project name>/` (Accelerate's
    /// `TensorBoardTracker`); `all` (every tracker available) means it too.
    #[value(name = "tensorboard", alias = "all")]
    Tensorboard,
}

impl Choice for LogWith {
    const WHAT: &'static str = "tracker";

    fn name(self) -> &'static str {
        match self {
            LogWith::Tensorboard => "tensorboard",
        }
    }

    fn unsupported(text: &str) -> Option<&'static str> {
        const OTHERS: &[&str] = &["wandb", "mlflow", "comet_ml", "aim", "clearml", "dvclive", "swanlab", "trackio"];
        OTHERS
            .contains(&text.to_ascii_lowercase().replace('-', "_").as_str())
            .then_some("Accelerate's other trackers are not implemented here")
    }
}
ladder_core::impl_choice!(LogWith);

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
        flags: Box<AcceleratorConfig>,
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

/// The environment variable of a setting in [`SETTINGS`].
pub fn env_var(setting: &str) -> Option<&'static str> {
    SETTINGS.iter().find(|(s, _)| *s == setting).map(|(_, v)| *v)
}

/// Default of [`ResolvedConfig::fsdp_min_num_params`]: PyTorch's, from the core's `FsdpOptions`.
pub fn default_fsdp_min_num_params() -> usize {
    FsdpOptions::default().min_num_params
}

/// The user's default config file: `dirs::config_dir()/ddp-ladder/accelerate/default_config.yaml`
/// (`~/.config/ddp-ladder/accelerate/default_config.yaml` on Linux), as Accelerate's
/// `~/.cache/huggingface/accelerate/default_config.yaml`. `None` when the platform has no
/// config directory (no `$HOME`, no `$XDG_CONFIG_HOME`).
pub fn default_config_file() -> Option<PathBuf> {
    dirs::config_dir().map(|d| d.join("ddp-ladder").join("accelerate").join("default_config.yaml"))
}

/// fp16 needs CUDA: the error naming where `mixed_precision` and `cpu` were given.
fn fp16_cpu_conflict(mp_origin: &str, cpu_origin: &str) -> crate::Error {
    crate::Error::Conflict {
        first: format!("mixed_precision fp16 ({mp_origin})"),
        second: format!("cpu true ({cpu_origin})"),
        why: "fp16 needs CUDA; use mixed_precision bf16 on the CPU".into(),
    }
}
