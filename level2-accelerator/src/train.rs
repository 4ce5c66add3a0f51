//! The tutorial's `train_ddp_accelerate`: level 1's job with the distributed lines gone. No
//! rank, no device, no setup/cleanup, no sampler, no wrapper in this code: the
//! [`Accelerator`] reads them from the launcher and the config.

use crate::config::{AcceleratorConfig, LogWith, ResolvedConfig, CONFIG_FILE_VAR, SETTINGS};
use crate::{
    AcceleratedDataLoader, Accelerator, DataLoaderOptions, DistributedDataParallelKwargs, InitProcessGroupKwargs, PreparedModel, Result,
};
use clap::Parser;
use ladder_core::device::DeviceKind;
use ladder_core::dist::ReduceOp;
use ladder_core::eval::EvalSums;
use ladder_core::metrics::{EpochFigures, LocalFigures, Report};
use ladder_core::model::{BasicNet, BasicNetConfig};
use ladder_core::optim::AdamWConfig;
use ladder_core::parallel::{BackwardPrefetch, OffloadDevice, Precision, Strategy, StrategyOptions};
use ladder_core::recipe::TrainArgs;
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Instant;
use tch::{nn, Kind};

/// Level 2's command line: level 1's training flags; the distributed settings are optional
/// here, since `ladder-accelerate launch` and the config file can give them too (a flag given
/// beats them; a flag not given leaves them alone).
#[derive(Debug, Clone, Parser, Serialize, Deserialize)]
#[command(
    name = "level2-accelerator",
    version,
    about = "Level 2: BasicNet on MNIST with an Accelerator — one single-device-looking loop on 1..N processes",
    after_help = after_help(),
    allow_negative_numbers = true
)]
pub struct Config {
    /// Level 1's training flags (epochs, batch size, learning rate, data, device, …).
    #[command(flatten)]
    pub train: TrainArgs,
    /// How the model is replicated (sets use_fsdp and fsdp_sharding_strategy). Default: the
    /// launcher's or config file's setting, else ddp.
    #[arg(long, value_parser = ladder_core::cli::spelling::<Strategy>())]
    pub strategy: Option<Strategy>,
    /// Mixed precision (fp16 needs CUDA). Default: the launcher's or config file's setting,
    /// else no.
    #[arg(long, value_parser = ladder_core::cli::spelling::<Precision>())]
    pub mixed_precision: Option<Precision>,
    /// Micro-batches per optimizer step. Default: the launcher's or config file's, else 1.
    #[arg(long, value_name = "K")]
    pub gradient_accumulation_steps: Option<usize>,
    /// FSDP auto-wrap threshold in parameters. Default: the launcher's or config file's, else 1e8.
    #[arg(long, value_name = "N")]
    pub fsdp_min_num_params: Option<usize>,
    /// FSDP backward prefetch: when FULL_SHARD's backward starts all-gathering the next unit
    /// (Accelerate's fsdp_backward_prefetch; FSDP strategies only). Default: the launcher's or
    /// config file's, else no-prefetch (Accelerate's, where level 1 follows PyTorch's
    /// backward-pre).
    #[arg(long, value_parser = ladder_core::cli::spelling::<BackwardPrefetch>(), value_name = "POLICY")]
    pub fsdp_backward_prefetch: Option<BackwardPrefetch>,
    /// FSDP forward prefetch: start the next unit's all-gather before the current unit's
    /// forward (Accelerate's fsdp_forward_prefetch; FSDP strategies only); alone it means true.
    /// Default: the launcher's or config file's, else false.
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = crate::config::str_to_bool)]
    pub fsdp_forward_prefetch: Option<bool>,
    /// FSDP CPU offload (Accelerate's fsdp_offload_params, PyTorch's
    /// CPUOffload(offload_params=True)): parameter shards, gradients and AdamW's moments in host
    /// memory, each unit's shard copied to the device before its all-gather (FSDP strategies
    /// only); alone it means true. Default: the launcher's or config file's, else false.
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = crate::config::str_to_bool)]
    pub fsdp_offload_params: Option<bool>,
    /// Activation checkpointing: keep each layer's input, recompute the rest in backward
    /// (Accelerate's fsdp_activation_checkpointing; DDP too); alone it means true. Default: the
    /// launcher's or config file's, else false.
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true", value_parser = crate::config::str_to_bool)]
    pub fsdp_activation_checkpointing: Option<bool>,
    /// DeepSpeed ZeRO stage (Accelerate's deepspeed_config.zero_stage): 1 = DDP with the
    /// optimizer state sharded (ZeroRedundancyOptimizer), 2 = fsdp-shard-grad-op, 3 =
    /// fsdp-full-shard, 0 = off. Default: the launcher's or config file's, else none.
    #[arg(long, value_name = "STAGE", value_parser = clap::value_parser!(u8).range(0..=3))]
    pub zero_stage: Option<u8>,
    /// Optimizer offload (Accelerate's deepspeed_config.offload_optimizer_device): nvme keeps
    /// AdamW's moments in a file per process under --offload-optimizer-nvme-path, streamed
    /// through a bounded buffer at each step (the same weights, bit for bit); cpu is refused.
    /// Default: the launcher's or config file's, else none.
    #[arg(long, value_parser = ladder_core::cli::spelling::<OffloadDevice>(), value_name = "DEVICE")]
    pub offload_optimizer_device: Option<OffloadDevice>,
    /// Directory of the moments' files (Accelerate's
    /// deepspeed_config.offload_optimizer_nvme_path), checked writable before training.
    /// Default: the launcher's or config file's, else none.
    #[arg(long, value_name = "DIR")]
    pub offload_optimizer_nvme_path: Option<PathBuf>,
    /// Experiment tracker (Accelerate's log_with): tensorboard writes event files into
    /// --project-dir/level2-accelerator/ on the main process — train_loss and lr every
    /// --log-interval batches, eval_loss and accuracy after each evaluation,
    /// train_samples_per_second at the end, each at the optimizer step reached. Default: the
    /// launcher's or config file's, else none.
    #[arg(long, value_parser = ladder_core::cli::spelling::<LogWith>(), value_name = "TRACKER")]
    pub log_with: Option<LogWith>,
    /// Directory the tracker writes into (Accelerate's project_dir), checked writable before
    /// training. Default: the launcher's or config file's, else none.
    #[arg(long, value_name = "DIR")]
    pub project_dir: Option<PathBuf>,
    /// DDP gradient bucket cap in MiB (PyTorch's bucket_cap_mb) [default: 25; DDP only].
    #[arg(long, value_name = "MIB")]
    pub bucket_cap_mb: Option<f64>,
    /// Output features of BasicNet's fc1 (128; 4096 for memory comparisons).
    #[arg(long, default_value_t = 128)]
    pub width: i64,
    /// Resume from a directory written by --save-state (model, optimizer, data position), at
    /// any number of processes (at another, the rest of the interrupted epoch is split between
    /// them). A run restarted by its launcher (TORCHELASTIC_RESTART_COUNT > 0, ladder-run
    /// --max-restarts) resumes from --save-state's directory by itself when it holds one.
    #[arg(long, value_name = "DIR")]
    pub resume_from: Option<PathBuf>,
    /// Save the state (accelerator.save_state) into this directory after every epoch and at
    /// --max-steps; and on SIGTERM (a preemption): every process finishes its step, the state
    /// is saved, and the program exits 143.
    #[arg(long, value_name = "DIR")]
    pub save_state: Option<PathBuf>,
    /// Save the state every N optimizer steps too (with --save-state).
    #[arg(long, value_name = "N")]
    pub save_every: Option<u64>,
    /// After training, check that every process holds bit-identical parameters.
    #[arg(long)]
    pub check_sync: bool,
    /// Skip the evaluation after each epoch, for quick checks (Transformers' `eval_strategy
    /// no`): the test figures are then reported over 0 images.
    #[arg(long)]
    #[serde(default)]
    pub no_eval: bool,
    /// The flags given on the command line (clap ids), as [`Config::parse_command_line`]
    /// records them, so that a flag with a default (`--seed`) not typed leaves the launcher's
    /// or config file's setting alone; `None` (a `Config` built otherwise) counts `--seed` as
    /// given when it differs from its default.
    #[arg(skip)]
    #[serde(skip)]
    pub given: Option<BTreeSet<String>>,
}

/// How to launch, and the environment: the rank variables (torchrun's, mpirun's), and every
/// variable of the Accelerator's settings table ([`SETTINGS`]).
fn after_help() -> String {
    // The variables, comma-separated, in lines of at most 100 columns (clap's help width).
    let mut lines: Vec<String> = vec![String::new()];
    for (i, (_, var)) in SETTINGS.iter().enumerate() {
        let item = if i + 1 < SETTINGS.len() { format!("{var},") } else { var.to_string() };
        match lines.last_mut() {
            Some(line) if line.is_empty() || 2 + line.len() + 1 + item.len() <= 100 => {
                if !line.is_empty() {
                    line.push(' ');
                }
                line.push_str(&item);
            }
            _ => lines.push(item),
        }
    }
    let vars: Vec<String> = lines.iter().map(|l| format!("  {l}")).collect();
    let vars = vars.join("\n");
    format!(
        "Launch: `target/release/level2-accelerator` (1 process), `target/release/ladder-accelerate launch --num-processes 2 \
         target/release/level2-accelerator`, `target/release/ladder-run --nproc-per-node 2 target/release/level2-accelerator`, or \
         `mpirun -n 2 target/release/level2-accelerator`.\n\n{}\n{vars}\n      the Accelerator's settings as `ladder-accelerate launch` exports them (below \
         the\n      flags, above the config file)\n  {}\n      a config file to read, below the variables [default: none; as Accelerate's, a program reads\n      no default config: `ladder-accelerate launch` reads it and exports its settings]",
        ladder_core::cli::ENVIRONMENT_HELP,
        CONFIG_FILE_VAR
    )
}

/// Level 2's flag for each option [`Strategy::with_options`] names.
const FLAG_NAMES: &[(&str, &str)] = &[
    ("bucket_cap_mb", "--bucket-cap-mb"),
    ("min_num_params", "--fsdp-min-num-params"),
    ("backward_prefetch", "--fsdp-backward-prefetch"),
    ("forward_prefetch", "--fsdp-forward-prefetch"),
];

impl Config {
    /// Parses the process's command line, remembering which flags were given
    /// ([`try_parse_command_line_from`](Self::try_parse_command_line_from)). Exits on bad
    /// flags or `--help`, as clap does.
    pub fn parse_command_line() -> Self {
        Self::try_parse_command_line_from(std::env::args_os()).unwrap_or_else(|e| e.exit())
    }

    /// Parses `args` (the program name first), remembering which flags were given: `--seed`
    /// then reaches the Accelerator only when typed, so that the launcher's or the config
    /// file's `seed` is not overridden by the flag's default.
    ///
    /// # Errors
    /// clap's error for bad flags, `--help` and `--version`.
    pub fn try_parse_command_line_from<I, T>(args: I) -> std::result::Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        use clap::{CommandFactory, FromArgMatches};
        let matches = Self::command().try_get_matches_from(args)?;
        let mut cfg = Self::from_arg_matches(&matches)?;
        let given = matches
            .ids()
            .filter(|id| matches!(matches.value_source(id.as_str()), Some(clap::parser::ValueSource::CommandLine)))
            .map(|id| id.as_str().to_string())
            .collect();
        cfg.given = Some(given);
        Ok(cfg)
    }

    /// Whether `--seed` was given (see [`given`](Self::given)).
    fn seed_given(&self) -> bool {
        match &self.given {
            Some(given) => given.contains("seed"),
            None => self.train.seed != TrainArgs::default().seed,
        }
    }

    /// The checkpoint to resume from: --resume-from, or in a run restarted by its launcher
    /// (`TORCHELASTIC_RESTART_COUNT` > 0) --save-state's directory when it holds a complete
    /// checkpoint.
    pub fn resume_dir(&self) -> Option<PathBuf> {
        self.resume_from.clone().or_else(|| {
            let dir = self.save_state.as_ref()?;
            (ladder_core::launch::restart_count() > 0 && ladder_core::checkpoint::is_complete(dir)).then(|| dir.clone())
        })
    }

    /// The settings this command line gives the Accelerator explicitly (flags not given stay
    /// `None`, so the launcher's environment and the config file still apply).
    pub fn accelerator_config(&self) -> AcceleratorConfig {
        // --strategy is Accelerate's use_fsdp and fsdp_sharding_strategy at once.
        let (use_fsdp, sharding) = match self.strategy {
            None => (None, None),
            Some(s) => (Some(s.sharding().is_some()), s.sharding()),
        };
        AcceleratorConfig {
            mixed_precision: self.mixed_precision,
            gradient_accumulation_steps: self.gradient_accumulation_steps,
            cpu: self.train.device.map(|d| d == DeviceKind::Cpu),
            use_fsdp,
            fsdp_sharding_strategy: sharding,
            fsdp_min_num_params: self.fsdp_min_num_params,
            fsdp_backward_prefetch: self.fsdp_backward_prefetch,
            fsdp_forward_prefetch: self.fsdp_forward_prefetch,
            fsdp_offload_params: self.fsdp_offload_params,
            fsdp_activation_checkpointing: self.fsdp_activation_checkpointing,
            zero_stage: self.zero_stage.map(usize::from),
            offload_optimizer_device: self.offload_optimizer_device,
            offload_optimizer_nvme_path: self.offload_optimizer_nvme_path.clone(),
            seed: self.seed_given().then_some(self.train.seed),
            log_with: self.log_with,
            project_dir: self.project_dir.clone(),
            ..AcceleratorConfig::default()
        }
    }

    /// Resolves the Accelerator's settings — these flags over the launcher's environment and
    /// the config file — once, and checks the strategy flags against the strategy they resolve
    /// to (the strategy may come from the launcher or the config file). Returns the settings
    /// and DDP's keyword arguments.
    ///
    /// # Errors
    /// Invalid settings (named with their source); a flag of the other strategy, named.
    pub fn resolve(&self) -> Result<(ResolvedConfig, DistributedDataParallelKwargs)> {
        let resolved = ResolvedConfig::resolve(&self.accelerator_config(), |k| std::env::var(k).ok())?;
        let flags = StrategyOptions {
            bucket_cap_mb: self.bucket_cap_mb,
            min_num_params: self.fsdp_min_num_params,
            backward_prefetch: self.fsdp_backward_prefetch,
            forward_prefetch: self.fsdp_forward_prefetch,
            ..StrategyOptions::default()
        };
        let strategy = resolved.strategy().with_options(&flags).map_err(|e| match e.named_by(FLAG_NAMES) {
            ladder_core::Error::OptionNotForStrategy { option, belongs_to, .. } => ladder_core::Error::OptionNotForStrategy {
                option,
                strategy: {
                    let setting = resolved.strategy_setting();
                    format!(
                        "the resolved strategy {} ({setting} {}, {})",
                        resolved.strategy().label(),
                        resolved.value_of(setting),
                        resolved.describe_source(setting)
                    )
                },
                belongs_to,
            },
            other => other,
        })?;
        let kwargs = match strategy {
            Strategy::Ddp(o) => o,
            Strategy::Fsdp(_) => DistributedDataParallelKwargs::default(),
        };
        Ok((resolved, kwargs))
    }
}

/// Trains and evaluates as configured; every process returns the same report.
///
/// # Errors
/// Bad flags or settings (named), data errors, collective errors.
pub fn run(cfg: &Config) -> Result<Report> {
    run_named(cfg).map_err(name_flags)
}

/// The flag of this command line that gives an Accelerator setting.
fn flag_of(setting: &str) -> String {
    match setting {
        "cpu" => "--device cpu".into(),
        "use_fsdp" | "fsdp_sharding_strategy" => "--strategy".into(),
        s => format!("--{}", s.replace('_', "-")),
    }
}

/// Errors about the settings this command line gives name its flags, where the library says
/// "set by the program" or "builder setting" (the program's builder is these flags).
fn name_flags(e: crate::Error) -> crate::Error {
    let by_flag = |s: String| {
        let Some((head, origin)) = s.rfind('(').map(|i| s.split_at(i)) else { return s.clone() };
        let setting = match origin.strip_prefix("(builder setting ").and_then(|r| r.strip_suffix(')')) {
            Some(setting) => setting,
            None if origin == "(set by the program)" => head.split([' ', '=']).next().unwrap_or(""),
            None => return s.clone(),
        };
        format!("{head}(flag {})", flag_of(setting))
    };
    match e {
        crate::Error::Conflict { first, second, why } => crate::Error::Conflict { first: by_flag(first), second: by_flag(second), why },
        crate::Error::InvalidSetting { setting, value, origin, expected } => {
            let origin = if origin.starts_with("builder setting ") || origin == "set by the program" {
                format!("flag {}", flag_of(&setting))
            } else if let Some(head) = origin.strip_suffix(", set by the program") {
                // "needed by offload_optimizer_device nvme, set by the program": that setting's flag.
                let other = head.split(' ').find(|w| w.contains('_')).unwrap_or(&setting);
                format!("{head}, flag {}", flag_of(other))
            } else {
                origin
            };
            crate::Error::InvalidSetting { setting, value, origin, expected }
        }
        other => other,
    }
}

/// [`run`], with the library's words for the program's settings.
fn run_named(cfg: &Config) -> Result<Report> {
    let start = Instant::now();
    cfg.train.validate()?;
    if cfg.width < 1 {
        return Err(ladder_core::Error::invalid("--width", cfg.width, "at least 1 output feature for fc1").into());
    }
    if let Some(dir) = &cfg.save_state {
        ladder_core::recipe::check_writable("--save-state", dir, ladder_core::recipe::OutputKind::Checkpoint)?;
    }
    cfg.train.check_device()?;
    if cfg.save_state.is_some() {
        // A checkpoint on SIGTERM, before the process group exists (see ladder_core::preempt).
        ladder_core::preempt::watch()?;
    }
    let (settings, kwargs) = cfg.resolve()?;
    let trained = train(cfg, settings, kwargs)?;
    finish(cfg, trained, start)
}

/// What the tutorial's loop leaves for the report.
struct Trained {
    accelerator: Accelerator,
    model: PreparedModel,
    history: Vec<EpochFigures>,
    eval: EvalSums,
    samples: usize,
    train_s: f64,
}

// ANCHOR: user_code
/// Evaluation: every process takes a share; gather_for_metrics drops the padding. The figures
/// go to the tracker (with --log-with) at the optimizer step reached.
fn evaluate(accelerator: &Accelerator, model: &PreparedModel, test_loader: &AcceleratedDataLoader) -> Result<EvalSums> {
    let mut eval = EvalSums::default();
    for (images, labels) in test_loader.iter() {
        let output = tch::no_grad(|| model.forward_t(&images, false))?;
        let losses = output.nll_loss_nd::<tch::Tensor>(&labels, None, tch::Reduction::None, -100);
        let correct = output.argmax(-1, false).eq_tensor(&labels);
        let (losses, correct) = (accelerator.gather_for_metrics(&losses)?, accelerator.gather_for_metrics(&correct)?);
        eval.loss_sum += losses.to_kind(Kind::Double).sum(Kind::Double).double_value(&[]);
        eval.correct += correct.sum(Kind::Int64).int64_value(&[]);
        eval.count += losses.size()[0];
    }
    accelerator.log([("eval_loss", eval.mean_loss()), ("accuracy", eval.accuracy())], Some(accelerator.global_step()))?;
    Ok(eval)
}
// ANCHOR_END: user_code

/// The tutorial's loop: what a level-2 user writes is between the `user_code` anchors (with
/// [`evaluate`] before it and `end_training()` in [`finish`]); what the harness adds is cut out,
/// as at every level: the flag checks and the throughput counters (`t0`, `train_s`, `samples`).
fn train(cfg: &Config, settings: ResolvedConfig, kwargs: DistributedDataParallelKwargs) -> Result<Trained> {
    let args = &cfg.train;
    let (mut samples, mut train_s) = (0usize, 0.0f64); // the harness's throughput counters
                                                       // ANCHOR: user_code
    let init = InitProcessGroupKwargs { timeout: Some(args.collective_timeout()) };
    let accelerator = Accelerator::with_resolved(settings, kwargs, init)?;
    // --seed, else the launcher's or the config file's seed, else the recipe's (1).
    accelerator.set_seed(accelerator.config().seed.unwrap_or(args.seed));
    accelerator.set_check_finite(!args.allow_non_finite);
    accelerator.init_trackers("level2-accelerator", cfg)?; // with --log-with tensorboard
    let mnist = accelerator.main_process_first(|| args.load_mnist())??;
    // ANCHOR_END: user_code
    args.check_batch_size(mnist.train.len(), accelerator.num_processes())?; // the binary's checks of its flags
    args.check_batch_memory(cfg.width, accelerator.local_num_processes(), accelerator.device())?;
    // ANCHOR: user_code (continued)

    let vs = nn::VarStore::new(accelerator.device());
    let net = BasicNet::new(&vs.root(), BasicNetConfig { width: cfg.width, ..Default::default() });
    let model = accelerator.prepare_model(vs, net)?;
    let mut optimizer = accelerator.prepare_optimizer(&model, AdamWConfig { lr: args.lr, ..Default::default() })?;
    let train_loader = accelerator
        .prepare_data_loader(&mnist.train, DataLoaderOptions { batch_size: args.batch_size, shuffle: true, ..Default::default() })?;
    let test_loader = accelerator.prepare_data_loader(&mnist.test, DataLoaderOptions { batch_size: 1000, ..Default::default() })?;
    let (mut first_epoch, mut skipped, mut so_far) = (1, 0, (0.0, 0));
    if let Some(dir) = cfg.resume_dir() {
        (first_epoch, skipped, so_far) = resume(&accelerator, &dir)?;
    }
    let (mut history, mut eval) = (Vec::new(), EvalSums::default());
    for epoch in first_epoch..=args.epochs {
        // ANCHOR_END: user_code
        let t0 = Instant::now();
        // ANCHOR: user_code (continued)
        // The epoch's micro-batches so far: a resumed epoch counts those before the checkpoint.
        let ((mut loss_sum, mut n), mut stop) = (std::mem::take(&mut so_far), false);
        for (batch_idx, (images, labels)) in train_loader.iter().enumerate() {
            let loss = accelerator.accumulate(&model, || -> Result<_> {
                let loss = model.forward_t(&images, true)?.nll_loss(&labels);
                accelerator.backward(&loss)?;
                optimizer.step()?;
                optimizer.zero_grad();
                Ok(loss.double_value(&[]))
            })?;
            (loss_sum, n) = (loss_sum + loss, n + 1);
            // ANCHOR_END: user_code
            samples += images.size()[0] as usize;
            // ANCHOR: user_code (continued)
            let step = accelerator.global_step();
            if args.log_interval > 0 && batch_idx % args.log_interval == 0 {
                accelerator.print(format!(
                    "Train Epoch: {epoch} [{}/{} ({:.0}%)]\tLoss: {loss:.6}",
                    (skipped + batch_idx) * args.batch_size,
                    train_loader.num_samples(),
                    100.0 * (skipped + batch_idx) as f64 / train_loader.len() as f64
                ));
                accelerator.log([("train_loss", loss), ("lr", optimizer.lr())], Some(step))?;
            }
            save_state_if_due(&accelerator, cfg, step, (loss_sum, n))?;
            if args.max_steps.is_some_and(|m| step >= m as u64) {
                stop = true;
                break;
            }
        }
        // ANCHOR_END: user_code
        train_s += t0.elapsed().as_secs_f64();
        // ANCHOR: user_code (continued)
        skipped = 0;
        if let Some(dir) = &cfg.save_state {
            accelerator.save_state_with(dir, epoch_loss_extra(&accelerator, loss_sum, n)?, &[])?;
        }
        if !cfg.no_eval {
            eval = evaluate(&accelerator, &model, &test_loader)?;
        }
        let train_loss = accelerator.reduce(&tch::Tensor::from(loss_sum / n.max(1) as f64), ReduceOp::Avg)?.double_value(&[]);
        let figures = EpochFigures {
            epoch,
            steps: n.div_ceil(accelerator.gradient_accumulation_steps()), // optimizer steps, not micro-batches
            train_loss,
            test_loss: eval.mean_loss(),
            accuracy: eval.accuracy(),
            eval_samples: eval.count as u64,
        };
        accelerator.print(format!("{}\n{}", figures.train_line(), figures.test_line()));
        history.push(figures);
        if stop {
            break;
        }
    }
    // ANCHOR_END: user_code
    Ok(Trained { accelerator, model, history, eval, samples, train_s })
}

/// With `--save-state`, after each micro-batch: the state every `--save-every` optimizer steps,
/// and on SIGTERM (a preemption: every process ends this step, one state is saved) the state
/// and [`crate::Error::Preempted`]. `epoch_loss` is the epoch's (loss sum, micro-batches) so far.
/// Collective: [`Accelerator::preemption_requested`] agrees across processes.
fn save_state_if_due(accelerator: &Accelerator, cfg: &Config, step: u64, epoch_loss: (f64, usize)) -> Result<()> {
    let Some(dir) = &cfg.save_state else { return Ok(()) };
    if let Some(every) = cfg.save_every {
        if accelerator.sync_gradients() && step % every == 0 {
            accelerator.save_state_with(dir, epoch_loss_extra(accelerator, epoch_loss.0, epoch_loss.1)?, &[])?;
            accelerator.restart_step_clock(); // a save between steps is no step's time or memory
        }
    }
    if accelerator.sync_gradients() && accelerator.preemption_requested()? {
        accelerator.save_state(dir)?;
        ladder_core::preempt::mark_saved();
        return Err(crate::Error::Preempted { dir: dir.clone(), step });
    }
    Ok(())
}

/// The epoch's training loss so far, for a mid-epoch checkpoint's extra fields: the sum of
/// the micro-batches' losses (averaged over the processes, so one value serves every process
/// on resume) and their number. Collective.
fn epoch_loss_extra(accelerator: &Accelerator, loss_sum: f64, n: usize) -> Result<serde_json::Map<String, serde_json::Value>> {
    let sum = accelerator.reduce(&tch::Tensor::from(loss_sum), ReduceOp::Avg)?.double_value(&[]);
    let mut extra = serde_json::Map::new();
    extra.insert("epoch_loss_sum".into(), sum.into());
    extra.insert("epoch_micro_batches".into(), n.into());
    Ok(extra)
}

/// `accelerator.load_state(dir)`, said on the main process; returns the epoch to resume (from
/// 1), the micro-batches of it already trained, and its loss so far
/// ([`epoch_loss_extra`]: nothing for a checkpoint taken at an epoch's end).
fn resume(accelerator: &Accelerator, dir: &std::path::Path) -> Result<(usize, usize, (f64, usize))> {
    let state = accelerator.load_state(dir)?;
    accelerator.print(format!(
        "Resuming from {} at step {} (epoch {}, after micro-batch {} of the epoch)",
        dir.display(),
        state.global_step,
        state.epoch + 1,
        state.step_in_epoch
    ));
    let get = |k: &str| state.extra.get(k).and_then(serde_json::Value::as_f64);
    let so_far = match (state.step_in_epoch, get("epoch_loss_sum"), get("epoch_micro_batches")) {
        (1.., Some(sum), Some(n)) => (sum, n as usize),
        _ => (0.0, 0),
    };
    Ok((state.epoch as usize + 1, state.step_in_epoch as usize, so_far))
}

/// After the loop: the saved weights, the sync check, the report (gathered from every
/// process, written by the main one), the end of training.
fn finish(cfg: &Config, trained: Trained, start: Instant) -> Result<Report> {
    let Trained { accelerator, model, history, eval, samples, train_s } = trained;
    let args = &cfg.train;
    if let Some(path) = &args.save_model {
        if let Some(weights) = accelerator.get_state_dict()? {
            ladder_core::recipe::save_weights(path, &weights)
                .map_err(|e| e.named_by(&[(ladder_core::recipe::WEIGHTS_FILE, "--save-model")]))?;
        }
    }
    if cfg.check_sync {
        model.check_parameters_in_sync()?;
        accelerator.print(format!("check-sync: parameters are bit-identical on all {} processes", accelerator.num_processes()));
    }
    let train_loss = history.last().map_or(0.0, |h: &EpochFigures| h.train_loss);
    let local = LocalFigures {
        samples: samples as u64,
        train_s,
        train_loss,
        comm_s: model.comm_seconds(),
        model_state: model.memory(),
        timing: Default::default(),
    };
    let mut report = accelerator.gather_report(&local, &eval, start.elapsed().as_secs_f64())?;
    report.history = history;
    accelerator.log([("train_samples_per_second", report.samples_per_s)], Some(accelerator.global_step()))?;
    if accelerator.is_main_process() {
        args.write_metrics_json(&report)?;
    }
    accelerator.wait_for_everyone()?;
    // ANCHOR: user_code
    accelerator.end_training();
    // ANCHOR_END: user_code
    Ok(report)
}
