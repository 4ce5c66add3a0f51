//! `ladder-accelerate config`: writes the config file `launch` reads, as `accelerate config`
//! (prompts) and `accelerate config default` (`--default`).

use super::CmdResult;
use level2_accelerator::config::{
    default_config_file, default_fsdp_min_num_params, AcceleratorConfig, BackwardPrefetch, ConfigFormat, DistributedType, Origin,
    Precision, ShardingStrategy,
};
use level2_accelerator::{Error, Result};
use std::io::IsTerminal;
use std::path::PathBuf;

/// `ladder-accelerate config` flags.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Without flags, on a terminal, asks the questions `accelerate config` asks. With setting flags, writes exactly those settings (no questions); with --default, completes them with the defaults for this machine. The file is YAML, or TOML / JSON when --config-file ends in .toml / .json."
)]
pub struct ConfigArgs {
    /// Where to write the config [default: ~/.config/ddp-ladder/accelerate/default_config.yaml, or under $XDG_CONFIG_HOME].
    #[arg(long = "config-file", alias = "config_file", value_name = "FILE")]
    pub config_file: Option<PathBuf>,
    /// Do not ask: write the given flags completed with the defaults for this machine.
    #[arg(long)]
    pub default: bool,
    #[command(flatten)]
    pub settings: AcceleratorConfig,
}

/// Runs `config`: decides the settings (flags, defaults or prompts), writes the file, prints it.
pub fn run(args: &ConfigArgs) -> CmdResult {
    let path = match &args.config_file {
        Some(p) => p.clone(),
        None => default_config_file().ok_or_else(|| Error::Cli {
            command: "config",
            problem: "this system has no user config directory ($HOME and $XDG_CONFIG_HOME are unset); give --config-file FILE".into(),
        })?,
    };
    ConfigFormat::of(&path)?;
    let flags = args.settings.clone();
    flags.validate(&Origin::Flags)?;
    let cfg = if args.default {
        with_defaults(&flags, &Machine::detect())
    } else if flags != AcceleratorConfig::default() {
        flags
    } else if std::io::stdin().is_terminal() && std::io::stderr().is_terminal() {
        ask(&mut Dialoguer, &Machine::detect())?
    } else {
        return Err(Error::Cli {
            command: "config",
            problem: "stdin is not a terminal, so there is no one to ask: give the settings as flags \
                      (e.g. --num-processes 2 --mixed-precision bf16) or --default"
                .into(),
        });
    };
    cfg.validate(&Origin::Flags)?;
    cfg.save(&path)?;
    let text = cfg.to_string_as(ConfigFormat::of(&path)?).unwrap_or_default();
    println!("ladder-accelerate config: wrote {}\n{}", path.display(), text.trim_end());
    Ok(0)
}

/// What the defaults and the questions depend on: the GPUs libtorch sees, the CPU's bf16 units.
#[derive(Debug, Clone, Copy)]
pub struct Machine {
    /// CUDA devices usable by libtorch (0 when CUDA is not available).
    pub gpus: usize,
    /// The CPU is known to lack bf16 units (neither AVX512-BF16 nor AMX): bf16 runs emulated
    /// there, several times slower than fp32, and the mixed-precision question says so.
    pub cpu_lacks_bf16: bool,
}

impl Machine {
    /// Asks libtorch (loads the CUDA backend if there is one) and `/proc/cpuinfo`.
    pub fn detect() -> Machine {
        let gpus = if ladder_core::device::cuda_available() { tch::Cuda::device_count().max(0) as usize } else { 0 };
        let cpu_lacks_bf16 = ladder_core::device::cpu_bf16_units().is_some_and(|u| u.is_empty());
        Machine { gpus, cpu_lacks_bf16 }
    }
}

/// `--default`: the flags, completed as Accelerate's `write_basic_config` does for this machine:
/// one process per GPU (at least 1), CPU training when there is no GPU, `no` mixed precision,
/// one machine, and the distributed type that follows (FSDP when `--use-fsdp`, with its
/// strategy, threshold and prefetch settings: `FULL_SHARD`, 1e8, `NO_PREFETCH`, no forward
/// prefetch).
pub fn with_defaults(flags: &AcceleratorConfig, machine: &Machine) -> AcceleratorConfig {
    let cpu = flags.cpu.unwrap_or(machine.gpus == 0);
    let num_processes = flags.num_processes.unwrap_or(if cpu { 1 } else { machine.gpus.max(1) });
    let use_fsdp = flags.effective_use_fsdp().unwrap_or(false);
    let distributed_type = flags.distributed_type.unwrap_or(if use_fsdp {
        DistributedType::Fsdp
    } else if num_processes == 1 {
        DistributedType::No
    } else if cpu {
        DistributedType::MultiCpu
    } else {
        DistributedType::MultiGpu
    });
    let base = AcceleratorConfig {
        distributed_type: Some(distributed_type),
        num_processes: Some(num_processes),
        num_machines: Some(1),
        machine_rank: Some(0),
        mixed_precision: Some(Precision::No),
        gradient_accumulation_steps: Some(1),
        cpu: Some(cpu),
        use_fsdp: Some(use_fsdp),
        fsdp_sharding_strategy: use_fsdp.then_some(ShardingStrategy::FullShard),
        fsdp_min_num_params: use_fsdp.then(default_fsdp_min_num_params),
        fsdp_backward_prefetch: use_fsdp.then_some(BackwardPrefetch::NoPrefetch),
        fsdp_forward_prefetch: use_fsdp.then_some(false),
        ..AcceleratorConfig::default()
    };
    flags.merged_over(&base)
}

/// The questions' answerer: the terminal (dialoguer) or, in tests, a script.
pub trait Prompter {
    /// One of `items`; returns its index.
    fn select(&mut self, prompt: &str, items: &[&str], default: usize) -> Result<usize>;
    /// A line of text, re-asked until `check` accepts it.
    fn input(&mut self, prompt: &str, default: &str, check: &dyn Fn(&str) -> std::result::Result<(), String>) -> Result<String>;
    /// Yes or no.
    fn confirm(&mut self, prompt: &str, default: bool) -> Result<bool>;
}

/// Questions on the terminal (stderr), through dialoguer.
#[derive(Debug)]
struct Dialoguer;

fn prompt_error(e: dialoguer::Error) -> Error {
    Error::Cli { command: "config", problem: format!("cannot read the answer from the terminal: {e}") }
}

impl Prompter for Dialoguer {
    fn select(&mut self, prompt: &str, items: &[&str], default: usize) -> Result<usize> {
        dialoguer::Select::new().with_prompt(prompt).items(items).default(default).interact().map_err(prompt_error)
    }
    fn input(&mut self, prompt: &str, default: &str, check: &dyn Fn(&str) -> std::result::Result<(), String>) -> Result<String> {
        let mut input = dialoguer::Input::<String>::new().with_prompt(prompt);
        if !default.is_empty() {
            input = input.default(default.to_string());
        }
        input.validate_with(|s: &String| check(s)).interact_text().map_err(prompt_error)
    }
    fn confirm(&mut self, prompt: &str, default: bool) -> Result<bool> {
        dialoguer::Confirm::new().with_prompt(prompt).default(default).interact().map_err(prompt_error)
    }
}

fn check_count(min: usize) -> impl Fn(&str) -> std::result::Result<(), String> {
    move |s| match s.trim().parse::<usize>() {
        Ok(n) if n >= min => Ok(()),
        _ => Err(format!("expected a whole number of at least {min}")),
    }
}

/// The questions `accelerate config` asks, for what ddp-ladder runs: the kind of machine,
/// the machines (rank, main process address and port when several), FSDP and its settings
/// (sharding strategy, CPU offload, auto-wrap threshold, backward and forward prefetch,
/// activation checkpointing),
/// the number of processes, CPU-only training, mixed precision.
pub fn ask(p: &mut dyn Prompter, machine: &Machine) -> Result<AcceleratorConfig> {
    let kinds = ["No distributed training", "multi-CPU (mpi)", "multi-GPU (nccl)"];
    let kind = p.select("Which type of machine are you using?", &kinds, if machine.gpus > 1 { 2 } else { 0 })?;
    let mut cfg = AcceleratorConfig::default();
    let distributed = kind != 0;
    let mut machines = 1;
    if distributed {
        machines = ask_machines(p, &mut cfg)?;
    }
    let mut use_fsdp = false;
    if distributed {
        use_fsdp = p.confirm("Do you want to use FullyShardedDataParallel?", false)?;
        if use_fsdp {
            ask_fsdp(p, &mut cfg)?;
        }
        cfg.use_fsdp = Some(use_fsdp);
    }
    let cpu = match kind {
        1 => true,
        2 => false,
        _ => p.confirm("Do you wish to train on the CPU only (even if a GPU is available)?", machine.gpus == 0)?,
    };
    cfg.cpu = Some(cpu);
    if distributed {
        let default_n = if kind == 2 { machine.gpus.max(1) * machines } else { 2 * machines };
        let n =
            p.input("How many processes in total will you use? (all machines together)", &default_n.to_string(), &move |s: &str| match s
                .trim()
                .parse::<usize>()
            {
                Ok(n) if n >= 1 && n % machines == 0 => Ok(()),
                _ => Err(format!("expected a multiple of the {machines} machine(s), at least 1")),
            })?;
        cfg.num_processes = n.trim().parse().ok();
    } else {
        cfg.num_processes = Some(1);
    }
    cfg.distributed_type = Some(if use_fsdp {
        DistributedType::Fsdp
    } else {
        [DistributedType::No, DistributedType::MultiCpu, DistributedType::MultiGpu][kind]
    });
    let precisions: &[Precision] = if cpu { &[Precision::No, Precision::Bf16] } else { &[Precision::No, Precision::Fp16, Precision::Bf16] };
    // The bf16 warning goes on the bf16 item, not the question: a question wider than the
    // terminal is redrawn twice by the prompt library.
    let bf16_label =
        format!("bf16 ({} slower than fp32 on this CPU: no AVX512-BF16 or AMX units)", ladder_core::device::BF16_EMULATED_SLOWDOWN);
    let names: Vec<&str> = precisions
        .iter()
        .map(|m| match m {
            Precision::Bf16 if cpu && machine.cpu_lacks_bf16 => bf16_label.as_str(),
            m => ladder_core::parallel::Choice::name(*m),
        })
        .collect();
    let prompt = if cpu { "Do you wish to use mixed precision? (fp16 needs a GPU)" } else { "Do you wish to use mixed precision?" };
    let i = p.select(prompt, &names, 0)?;
    cfg.mixed_precision = Some(precisions[i]);
    Ok(cfg)
}

/// The machines: how many, and for several this one's rank and the main process's address
/// and port. Returns the number of machines.
fn ask_machines(p: &mut dyn Prompter, cfg: &mut AcceleratorConfig) -> Result<usize> {
    let n = p.input("How many machines will you use (more than 1 for multi-node training)?", "1", &check_count(1))?;
    let machines: usize = n.trim().parse().unwrap_or(1);
    cfg.num_machines = Some(machines);
    if machines == 1 {
        cfg.machine_rank = Some(0);
        return Ok(machines);
    }
    let rank = p.input("What is the rank of this machine?", "0", &move |s: &str| match s.trim().parse::<usize>() {
        Ok(r) if r < machines => Ok(()),
        _ => Err(format!("expected a machine index in 0..{machines}")),
    })?;
    cfg.machine_rank = rank.trim().parse().ok();
    let ip = p.input("What is the IP address of the machine that will host the main process?", "", &|s: &str| {
        if s.trim().is_empty() {
            Err("expected a host name or IP address".into())
        } else {
            Ok(())
        }
    })?;
    cfg.main_process_ip = Some(ip.trim().to_string());
    let port = p.input("What is the port you will use to communicate with the main process?", "29500", &|s: &str| match s
        .trim()
        .parse::<u16>()
    {
        Ok(p) if p >= 1 => Ok(()),
        _ => Err("expected a port in 1..=65535".into()),
    })?;
    cfg.main_process_port = port.trim().parse().ok();
    Ok(machines)
}

/// FSDP's settings, in Accelerate's order: sharding strategy, CPU offload of the parameters,
/// auto-wrap threshold, backward and forward prefetch, activation checkpointing.
fn ask_fsdp(p: &mut dyn Prompter, cfg: &mut AcceleratorConfig) -> Result<()> {
    let strategies = [ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp, ShardingStrategy::NoShard];
    let names: Vec<&str> = strategies.iter().map(|s| ladder_core::parallel::Choice::name(*s)).collect();
    let i = p.select("What should be your sharding strategy?", &names, 0)?;
    cfg.fsdp_sharding_strategy = Some(strategies[i]);
    cfg.fsdp_offload_params = Some(p.confirm("Do you want to offload parameters and gradients to CPU?", false)?);
    let n = p.input(
        "FSDP's auto-wrap policy: minimum number of parameters per unit?",
        &default_fsdp_min_num_params().to_string(),
        &check_count(0),
    )?;
    cfg.fsdp_min_num_params = n.trim().parse().ok();
    // Accelerate's order and preselection: `accelerate config` proposes the first item,
    // BACKWARD_PRE (PyTorch's own default). A file without the key, and --default, get the
    // plugin's default instead, NO_PREFETCH.
    let prefetches = [BackwardPrefetch::BackwardPre, BackwardPrefetch::BackwardPost, BackwardPrefetch::NoPrefetch];
    let names: Vec<&str> = prefetches.iter().map(|p| ladder_core::parallel::Choice::name(*p)).collect();
    let i = p.select("What should be your FSDP's backward prefetch policy?", &names, 0)?;
    cfg.fsdp_backward_prefetch = Some(prefetches[i]);
    cfg.fsdp_forward_prefetch = Some(p.confirm("Do you want to enable FSDP's forward prefetch policy?", false)?);
    cfg.fsdp_activation_checkpointing = Some(p.confirm("Do you want to enable FSDP activation checkpointing?", false)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;

    /// Answers from a script; records every question and rejects an answer `check` refuses.
    struct Script {
        answers: VecDeque<&'static str>,
        asked: Vec<String>,
        /// The items of each select, in order.
        offered: Vec<Vec<String>>,
        /// The widest line each question draws, columns (prompt with its default, or an item).
        widths: Vec<usize>,
    }

    impl Script {
        fn new(answers: &[&'static str]) -> Script {
            Script { answers: answers.iter().copied().collect(), asked: Vec::new(), offered: Vec::new(), widths: Vec::new() }
        }
        fn next(&mut self, prompt: &str) -> &'static str {
            self.asked.push(prompt.to_string());
            self.answers.pop_front().unwrap_or_else(|| panic!("no scripted answer for {prompt:?}"))
        }
    }

    impl Prompter for Script {
        fn select(&mut self, prompt: &str, items: &[&str], _default: usize) -> Result<usize> {
            let a = self.next(prompt);
            self.offered.push(items.iter().map(|i| i.to_string()).collect());
            self.widths.push(items.iter().map(|i| i.chars().count() + 2).chain([prompt.chars().count() + 2]).max().unwrap_or(0));
            // An answer names an item, or its first word when the item carries a note in brackets.
            let named = |i: &&str| *i == a || i.strip_prefix(a).is_some_and(|rest| rest.starts_with(" ("));
            Ok(items.iter().position(named).unwrap_or_else(|| panic!("{a:?} is not one of {items:?}")))
        }
        fn input(&mut self, prompt: &str, default: &str, check: &dyn Fn(&str) -> std::result::Result<(), String>) -> Result<String> {
            self.widths.push(format!("{prompt} [{default}]: ").chars().count());
            let a = self.next(prompt);
            let a = if a.is_empty() { default } else { a };
            check(a).map_err(|e| Error::Cli { command: "config", problem: format!("{prompt}: {a:?}: {e}") })?;
            Ok(a.to_string())
        }
        fn confirm(&mut self, prompt: &str, _default: bool) -> Result<bool> {
            self.widths.push(format!("{prompt} [y/N] ").chars().count());
            Ok(self.next(prompt) == "yes")
        }
    }

    #[test]
    fn single_process_on_the_cpu() {
        let mut s = Script::new(&["No distributed training", "yes", "bf16"]);
        let cfg = ask(&mut s, &Machine { gpus: 0, cpu_lacks_bf16: false }).unwrap();
        assert_eq!(s.asked.len(), 3);
        let want = AcceleratorConfig {
            distributed_type: Some(DistributedType::No),
            num_processes: Some(1),
            cpu: Some(true),
            mixed_precision: Some(Precision::Bf16),
            ..Default::default()
        };
        assert_eq!(cfg, want);
    }

    /// On a CPU without bf16 units the mixed-precision question's bf16 item says what bf16
    /// costs there (issue 27, bug 7); elsewhere it is plain `bf16`.
    #[test]
    fn the_precision_question_warns_where_bf16_is_emulated() {
        for (lacks, want) in [(true, "bf16 (5-10x slower than fp32 on this CPU: no AVX512-BF16 or AMX units)"), (false, "bf16")] {
            let mut s = Script::new(&["No distributed training", "yes", "bf16"]);
            let cfg = ask(&mut s, &Machine { gpus: 0, cpu_lacks_bf16: lacks }).unwrap();
            assert_eq!(cfg.mixed_precision, Some(Precision::Bf16));
            assert_eq!(s.offered.last().unwrap(), &["no".to_string(), want.to_string()]);
        }
    }

    /// Every line a question draws — the prompt with its default, each item — fits an
    /// 80-column terminal: dialoguer draws a wrapped prompt twice. Both paths through the
    /// questions: one machine without FSDP, several machines with FSDP on a CPU without bf16.
    #[test]
    fn every_question_fits_80_columns() {
        let paths: [&[&'static str]; 2] = [
            &["No distributed training", "yes", "bf16"],
            &[
                "multi-CPU (mpi)",
                "2",
                "0",
                "10.0.0.1",
                "29500",
                "yes",
                "SHARD_GRAD_OP",
                "no",
                "0",
                "BACKWARD_POST",
                "yes",
                "no",
                "4",
                "bf16",
            ],
        ];
        for answers in paths {
            let mut s = Script::new(answers);
            ask(&mut s, &Machine { gpus: 0, cpu_lacks_bf16: true }).unwrap();
            for (q, w) in s.asked.iter().zip(&s.widths) {
                assert!(*w <= 80, "{q:?} draws {w} columns");
            }
        }
    }

    #[test]
    fn multi_cpu_fsdp_two_processes() {
        let mut s = Script::new(&["multi-CPU (mpi)", "1", "yes", "SHARD_GRAD_OP", "yes", "0", "BACKWARD_POST", "yes", "yes", "2", "no"]);
        let cfg = ask(&mut s, &Machine { gpus: 0, cpu_lacks_bf16: false }).unwrap();
        assert_eq!(
            cfg,
            AcceleratorConfig {
                distributed_type: Some(DistributedType::Fsdp),
                num_processes: Some(2),
                num_machines: Some(1),
                machine_rank: Some(0),
                cpu: Some(true),
                use_fsdp: Some(true),
                fsdp_sharding_strategy: Some(ShardingStrategy::ShardGradOp),
                fsdp_min_num_params: Some(0),
                fsdp_backward_prefetch: Some(BackwardPrefetch::BackwardPost),
                fsdp_forward_prefetch: Some(true),
                fsdp_offload_params: Some(true),
                fsdp_activation_checkpointing: Some(true),
                mixed_precision: Some(Precision::No),
                ..Default::default()
            }
        );
        assert!(s.asked.contains(&"What should be your FSDP's backward prefetch policy?".to_string()), "{:?}", s.asked);
        // fp16 is not offered on the CPU.
        assert!(s.asked.last().unwrap().contains("fp16 needs a GPU"));
    }

    #[test]
    fn multi_node_gpu_asks_rank_address_and_port_and_checks_the_process_count() {
        let mut s = Script::new(&["multi-GPU (nccl)", "2", "1", "10.1.2.3", "", "no", "", "fp16"]);
        let cfg = ask(&mut s, &Machine { gpus: 4, cpu_lacks_bf16: false }).unwrap();
        assert_eq!(cfg.num_machines, Some(2));
        assert_eq!(cfg.machine_rank, Some(1));
        assert_eq!(cfg.main_process_ip.as_deref(), Some("10.1.2.3"));
        assert_eq!(cfg.main_process_port, Some(29500));
        assert_eq!(cfg.num_processes, Some(8)); // 4 GPUs × 2 machines, the default
        assert_eq!(cfg.distributed_type, Some(DistributedType::MultiGpu));
        assert_eq!((cfg.cpu, cfg.mixed_precision), (Some(false), Some(Precision::Fp16)));
        cfg.validate(&Origin::Flags).unwrap();
        // 3 processes on 2 machines is refused; rank 2 of 2 machines too.
        let mut s = Script::new(&["multi-GPU (nccl)", "2", "0", "h", "29500", "no", "3"]);
        assert!(ask(&mut s, &Machine { gpus: 4, cpu_lacks_bf16: false })
            .unwrap_err()
            .to_string()
            .contains("expected a multiple of the 2 machine(s)"));
        let mut s = Script::new(&["multi-GPU (nccl)", "2", "2"]);
        assert!(ask(&mut s, &Machine { gpus: 4, cpu_lacks_bf16: false })
            .unwrap_err()
            .to_string()
            .contains("expected a machine index in 0..2"));
    }

    #[test]
    fn defaults_follow_the_machine_and_keep_every_flag() {
        let none = AcceleratorConfig::default();
        let cpu = with_defaults(&none, &Machine { gpus: 0, cpu_lacks_bf16: false });
        assert_eq!((cpu.distributed_type, cpu.num_processes, cpu.cpu), (Some(DistributedType::No), Some(1), Some(true)));
        let gpu = with_defaults(&none, &Machine { gpus: 4, cpu_lacks_bf16: false });
        assert_eq!((gpu.distributed_type, gpu.num_processes, gpu.cpu), (Some(DistributedType::MultiGpu), Some(4), Some(false)));
        let flags = AcceleratorConfig { num_processes: Some(2), use_fsdp: Some(true), seed: Some(1), ..Default::default() };
        let f = with_defaults(&flags, &Machine { gpus: 0, cpu_lacks_bf16: false });
        assert_eq!(f.distributed_type, Some(DistributedType::Fsdp));
        assert_eq!((f.fsdp_sharding_strategy, f.fsdp_min_num_params), (Some(ShardingStrategy::FullShard), Some(100_000_000)));
        assert_eq!((f.fsdp_backward_prefetch, f.fsdp_forward_prefetch), (Some(BackwardPrefetch::NoPrefetch), Some(false)));
        // Without FSDP no FSDP setting is written; a given one is kept.
        assert_eq!((cpu.fsdp_backward_prefetch, cpu.fsdp_forward_prefetch), (None, None));
        let given =
            AcceleratorConfig { use_fsdp: Some(true), fsdp_backward_prefetch: Some(BackwardPrefetch::BackwardPre), ..Default::default() };
        assert_eq!(
            with_defaults(&given, &Machine { gpus: 0, cpu_lacks_bf16: false }).fsdp_backward_prefetch,
            Some(BackwardPrefetch::BackwardPre)
        );
        assert_eq!((f.num_processes, f.seed), (Some(2), Some(1)));
        let two_cpu =
            with_defaults(&AcceleratorConfig { num_processes: Some(2), ..Default::default() }, &Machine { gpus: 0, cpu_lacks_bf16: false });
        assert_eq!(two_cpu.distributed_type, Some(DistributedType::MultiCpu));
    }
}
