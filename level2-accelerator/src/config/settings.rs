//! The table of settings: each declared once, with its file key and flag (the name), type,
//! parser, description (the doc comment; its first paragraph is the flag's help) and — for
//! the settings a program resolves — its launcher variable (Accelerate's name) and default.
//! Everything else is derived by [`settings!`](super::table).
//!
//! Booleans are read as Accelerate's `str_to_bool` reads them (`true`/`false`, `1`/`0`,
//! `yes`/`no`, `on`/`off`, any case: its launcher writes `True`); the choices take every
//! spelling of the references (`FSDP_SHARDING_STRATEGY` also PyTorch's numbers `1`..`5`,
//! `FSDP_BACKWARD_PREFETCH` PyTorch's `1`, `2`, names in any case). An empty variable is an
//! error.

use super::table::parse;
use super::{DistributedType, LogWith};
use ladder_core::parallel::{BackwardPrefetch, OffloadDevice, Precision, ShardingStrategy};
use std::path::PathBuf;

settings! {
    // Read by `ladder-accelerate launch` only: how many processes, where.
    launch {
        /// How the job is distributed: no, multi-cpu (mpi), multi-gpu (nccl), fsdp.
        ///
        /// Accelerate's `NO`, `MULTI_CPU`, `MULTI_GPU`, `FSDP` (see [`DistributedType`]).
        #[arg(value_name = "TYPE")]
        distributed_type: DistributedType, parse parse::choice;

        /// Total number of processes over all machines [default: 1].
        ///
        /// Accelerate's meaning: a multiple of `num_machines`.
        #[arg(value_name = "N")]
        num_processes: usize, parse parse::positive;

        /// Number of machines [default: 1].
        #[arg(value_name = "M")]
        num_machines: usize, parse parse::positive;

        /// This machine's index, 0..num_machines [default: 0].
        #[arg(value_name = "R")]
        machine_rank: usize, parse parse::count;

        /// Address of machine 0 (MASTER_ADDR) [default: 127.0.0.1].
        #[arg(value_name = "ADDR")]
        main_process_ip: String, parse parse::address;

        /// Rendezvous port on machine 0 (MASTER_PORT) [default: a free port on one machine, 29500 on several].
        #[arg(value_name = "PORT")]
        main_process_port: u16, parse parse::port;
    }
    // Resolved by every program: builder > variable > config file > default.
    resolved {
        /// Mixed precision: no, bf16, fp16 (fp16 needs CUDA) [default: no].
        #[arg(value_name = "MODE")]
        mixed_precision: Precision => Precision = Precision::No,
            env "ACCELERATE_MIXED_PRECISION", parse parse::choice;

        /// Micro-batches per optimizer step [default: 1].
        #[arg(value_name = "K")]
        gradient_accumulation_steps: usize => usize = 1,
            env "ACCELERATE_GRADIENT_ACCUMULATION_STEPS", parse parse::positive;

        /// Train on the CPU even when a GPU is available [default: false].
        ///
        /// Accelerate's `cpu`; its config files also say `use_cpu`.
        #[arg(value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true", alias = "use_cpu")]
        #[serde(alias = "use_cpu")]
        cpu: bool => bool = false,
            env "ACCELERATE_USE_CPU", parse parse::bool;

        /// Wrap the model in FSDP instead of DDP [default: false].
        ///
        /// `distributed_type: FSDP` implies it.
        #[arg(value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
        use_fsdp: bool => bool = false,
            env "ACCELERATE_USE_FSDP", parse parse::bool;

        /// FSDP sharding strategy: full-shard, shard-grad-op, no-shard, hybrid-shard, hybrid-shard-zero2 [default: full-shard].
        #[arg(value_name = "STRATEGY")]
        fsdp_sharding_strategy: ShardingStrategy => ShardingStrategy = ShardingStrategy::FullShard,
            env "FSDP_SHARDING_STRATEGY", parse parse::choice;

        /// FSDP auto-wrap threshold: layers with at least this many parameters get their own unit [default: 100000000].
        ///
        /// PyTorch's `size_based_auto_wrap_policy` default: one unit for BasicNet.
        #[arg(value_name = "N")]
        fsdp_min_num_params: usize => usize = super::default_fsdp_min_num_params(),
            env "FSDP_MIN_NUM_PARAMS", parse parse::count;

        /// FSDP backward prefetch: backward-pre, backward-post, no-prefetch [default: no-prefetch].
        ///
        /// Accelerate's default (`FullyShardedDataParallelPlugin(backward_prefetch=None)`);
        /// PyTorch's own is `BACKWARD_PRE`.
        #[arg(value_name = "POLICY")]
        fsdp_backward_prefetch: BackwardPrefetch => BackwardPrefetch = BackwardPrefetch::NoPrefetch,
            env "FSDP_BACKWARD_PREFETCH", parse parse::choice;

        /// FSDP forward prefetch: start the next unit's all-gather before the current unit's forward [default: false].
        ///
        /// Sharded strategies only; Accelerate's and PyTorch's default.
        #[arg(value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
        fsdp_forward_prefetch: bool => bool = false,
            env "FSDP_FORWARD_PREFETCH", parse parse::bool;

        /// FSDP CPU offload: parameter shards, gradients and optimizer state in host memory, each unit copied to the device for its all-gather [default: false].
        ///
        /// Accelerate's `fsdp_offload_params` (PyTorch's `CPUOffload(offload_params=True)`):
        /// the host memory is pinned under CUDA, the optimizer steps on the host, the reduced
        /// gradient shard is copied back after each reduce-scatter. FSDP only (use_fsdp, or
        /// zero_stage 2 or 3): refused by name with DDP.
        #[arg(value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
        fsdp_offload_params: bool => bool = false,
            env "FSDP_OFFLOAD_PARAMS", parse parse::bool;

        /// HSDP's shard-group size: hybrid-shard(-zero2) shard over runs of N consecutive ranks [default: LOCAL_WORLD_SIZE].
        ///
        /// Accelerate's `parallelism_config.parallelism_config_dp_shard_size` (read there or as
        /// a top-level key; `dp_replicate_size` is the world size over it, which it must divide). Used by
        /// the hybrid sharding strategies only.
        #[arg(value_name = "N")]
        parallelism_config_dp_shard_size: usize => Option<usize> = None,
            env "PARALLELISM_CONFIG_DP_SHARD_SIZE", parse parse::positive;

        /// Activation checkpointing: keep each layer's input, recompute the rest in backward [default: false].
        ///
        /// Accelerate's FSDP plugin `activation_checkpointing`; here usable under DDP as well.
        /// Dropout replays its masks: the same weights as without, bit for bit on CPU.
        #[arg(value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
        fsdp_activation_checkpointing: bool => bool = false,
            env "FSDP_ACTIVATION_CHECKPOINTING", parse parse::bool;

        /// DeepSpeed ZeRO stage: 1 shards the optimizer state over DDP, 2 is FSDP shard-grad-op, 3 full-shard [default: none].
        ///
        /// Accelerate's `deepspeed_config.zero_stage` (read there or as a top-level key), run on the core's
        /// strategies: 1 → DDP with ZeroRedundancyOptimizer (ZeRO-1), 2 → FSDP SHARD_GRAD_OP
        /// (ZeRO-2), 3 → FSDP FULL_SHARD (ZeRO-3); 0 is plain DDP. With the two offload_optimizer
        /// settings, the only DeepSpeed settings honoured (the other keys of deepspeed_config
        /// are refused by name); it excludes use_fsdp.
        #[arg(value_name = "STAGE")]
        zero_stage: usize => Option<usize> = None,
            env "ACCELERATE_DEEPSPEED_ZERO_STAGE", parse parse::zero_stage;

        /// DeepSpeed optimizer offload: none, or nvme (AdamW's moments in a file per process under offload_optimizer_nvme_path) [default: none].
        ///
        /// Accelerate's `deepspeed_config.offload_optimizer_device` (read there or as a top-level key),
        /// DeepSpeed's `offload_optimizer.device`; `cpu` is refused by name (see
        /// [`OffloadDevice`]). Works with every strategy; the weights are bit-identical to the
        /// run without.
        #[arg(value_name = "DEVICE")]
        offload_optimizer_device: OffloadDevice => OffloadDevice = OffloadDevice::None,
            env "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", parse parse::choice;

        /// Directory of the offloaded optimizer's moment files, with offload_optimizer_device nvme [default: none].
        ///
        /// Accelerate's `deepspeed_config.offload_optimizer_nvme_path` (read there or as a top-level key),
        /// DeepSpeed's `offload_optimizer.nvme_path`: an existing, writable directory, checked
        /// before training; each process creates its file there and removes it at the end.
        #[arg(value_name = "DIR")]
        offload_optimizer_nvme_path: PathBuf => Option<PathBuf> = None,
            env "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH", parse parse::path;

        /// The loader's batch size is global, split between the processes [default: false].
        ///
        /// The batch size must then be a multiple of the number of processes.
        #[arg(value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
        split_batches: bool => bool = false,
            env "ACCELERATE_SPLIT_BATCHES", parse parse::bool;

        /// Pad the last batches so every process gets as many [default: true].
        ///
        /// Accelerate's default; false is refused for training (the shorter ranks' collectives
        /// would hang).
        #[arg(value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
        even_batches: bool => bool = true,
            env "ACCELERATE_EVEN_BATCHES", parse parse::bool;

        /// Seed for set_seed [default: not set].
        ///
        /// torch and the samplers here (Python, NumPy and torch in Accelerate);
        /// `ACCELERATE_SEED` is ddp-ladder's own variable.
        #[arg(value_name = "SEED")]
        seed: u64 => Option<u64> = None,
            env "ACCELERATE_SEED", parse parse::seed;

        /// Experiment tracker: tensorboard, event files in project_dir/<project name> [default: none].
        ///
        /// Accelerate's `Accelerator(log_with=...)`: [`Accelerator::init_trackers`](crate::Accelerator::init_trackers)
        /// starts it and [`Accelerator::log`](crate::Accelerator::log) writes to it, on the main
        /// process only. `ACCELERATE_LOG_WITH` is ddp-ladder's own variable.
        #[arg(value_name = "TRACKER")]
        log_with: LogWith => Option<LogWith> = None,
            env "ACCELERATE_LOG_WITH", parse parse::choice;

        /// Directory the trackers write into; needed by log_with tensorboard [default: none].
        ///
        /// Accelerate's `Accelerator(project_dir=...)` (its `logging_dir` defaults to it): the
        /// TensorBoard tracker writes `project_dir/<project name>/events.out.tfevents.*`.
        /// `ACCELERATE_PROJECT_DIR` is ddp-ladder's own variable.
        #[arg(value_name = "DIR")]
        project_dir: PathBuf => Option<PathBuf> = None,
            env "ACCELERATE_PROJECT_DIR", parse parse::path;
    }
}
