//! `ladder-accelerate estimate-memory`: Accelerate's `accelerate estimate-memory`, answered for
//! the ladder's model exactly — per rank, for each strategy, the parameters, gradients,
//! optimizer state, gathered parameters, activations and the expected training-phase peak
//! (`ladder_core::memory::estimate`), at a width, a batch per process, a number of processes,
//! a precision and with or without activation checkpointing. Accelerate's counts the weights
//! of a batch of one for each dtype ("Training using Adam": 4× the weights), whatever the
//! strategy; here the strategy, the world size and the batch's activations are in the figures.

use super::CmdResult;
use comfy_table::{presets::ASCII_MARKDOWN, Table};
use ladder_core::device::{CpuBf16Unit, DeviceKind};
use ladder_core::memory::estimate::{self, EstimateInput, RankEstimate};
use ladder_core::memory::size::{format_size, parse_size};
use ladder_core::parallel::{FsdpOptions, OffloadDevice, Precision, Strategy, WrapConfig};
use level2_accelerator::{Error, Result};
use serde::Serialize;

/// `ladder-accelerate estimate-memory` flags.
#[derive(Debug, Clone, clap::Args)]
#[command(after_help = "Figures are per rank (process): parameters (fp32 masters), gradients, AdamW's two moments, the \
most parameters gathered at once (FSDP), the activations and their gradients at the step's peak, the expected \
training-phase peak RSS growth (gradients + optimizer + activations + transients: what `bench run` measures) and \
the total (parameters + peak growth). The process's own memory (libtorch, the dataset, MPI: a few hundred MiB on \
CPU) is not included, nor, when a process runs more than one intra-op thread (the levels run cores / processes), \
the fp32 matrix-multiply buffers MKL keeps per thread between steps: 20 to 140 MiB per process measured at 2 to 4 \
threads. With --offload-optimizer nvme (DeepSpeed's offload_optimizer) the optimizer column is the buffer the moments stream through, the moments being on disk. With --offload-params (FSDP's CPU offload) a placement line per strategy says what is in host memory (parameters, gradients, optimizer state) and what the device holds; on a CPU both are one memory.\n\nExamples:\n  ladder-accelerate estimate-memory \
--width 4096 --num-processes 2\n  ladder-accelerate estimate-memory --width 8192 --batch-size 512 --budget 1GiB\n  \
ladder-accelerate estimate-memory --strategy fsdp-full-shard --mixed-precision bf16 --activation-checkpointing --json\n  \
ladder-accelerate estimate-memory --device cuda --num-processes 1 --width 4096 --batch-size 512 --offload-params --budget 1GiB")]
pub struct EstimateArgs {
    /// BasicNet's fc1 width (the tutorial's 128).
    #[arg(long, value_name = "N", default_value_t = 128, value_parser = clap::value_parser!(i64).range(1..=1 << 24))]
    pub width: i64,
    /// Samples per process per step (per_device_train_batch_size).
    #[arg(long = "batch-size", alias = "batch_size", value_name = "N", default_value_t = 64,
          value_parser = clap::value_parser!(u64).range(1..=1 << 24))]
    pub batch_size: u64,
    /// Processes (ranks) the model is spread over.
    #[arg(long = "num-processes", alias = "num_processes", value_name = "N", default_value_t = 2,
          value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub num_processes: u64,
    /// Strategies to compare, comma-separated: ddp, zero1 (DDP with ZeroRedundancyOptimizer),
    /// fsdp-shard-grad-op, fsdp-full-shard, fsdp-no-shard [default: all, fastest first];
    /// fsdp-hybrid-shard(-zero2) on one node (shard groups of all the processes).
    #[arg(long, value_name = "STRATEGY", value_delimiter = ',', value_parser = estimate::parse_strategy)]
    pub strategy: Vec<Strategy>,
    /// Mixed precision: no, bf16 or fp16 (compute in 16 bits; fp32 masters and AdamW state; fp16
    /// with --device cuda only, as the levels).
    #[arg(long = "mixed-precision", alias = "mixed_precision", value_name = "PRECISION", default_value = "no",
          value_parser = ladder_core::cli::choice::<Precision>(), hide_possible_values = true)]
    pub mixed_precision: Precision,
    /// On a CPU, its bf16 unit — amx, avx512-bf16 or none (emulated) — which decides how much
    /// heap a bf16 step leaves resident (2.3 resident bytes per live byte with AMX, fitted on an
    /// Intel Xeon, and taken for none; 1.9 with AVX512-BF16, fitted on an AMD EPYC Zen 5)
    /// [default: this machine's, from /proc/cpuinfo]. bf16 on a CPU only.
    #[arg(long = "cpu-bf16", value_name = "UNIT", value_parser = ladder_core::cli::choice::<CpuBf16Unit>(),
          hide_possible_values = true)]
    pub cpu_bf16: Option<CpuBf16Unit>,
    /// Activation checkpointing (keep each segment's input, recompute in backward).
    #[arg(long = "activation-checkpointing", alias = "activation_checkpointing", alias = "gradient-checkpointing")]
    pub activation_checkpointing: bool,
    /// Where AdamW's moments live: none (in memory), or nvme — on disk, as DeepSpeed's
    /// offload_optimizer (Accelerate's offload_optimizer_device): only an 8 MiB buffer resident.
    #[arg(long = "offload-optimizer", alias = "offload_optimizer_device", value_name = "DEVICE", default_value = "none",
          value_parser = ladder_core::cli::spelling::<OffloadDevice>(), hide_possible_values = true)]
    pub offload_optimizer: OffloadDevice,
    /// FSDP's auto-wrap policy (size_based_auto_wrap_policy, Accelerate's fsdp_min_num_params):
    /// a layer with at least N parameters becomes its own unit; 0 wraps every layer (as `bench
    /// run` does) [default: 100000000, PyTorch's: one unit for BasicNet]. FSDP strategies only.
    #[arg(long = "fsdp-min-num-params", alias = "fsdp_min_num_params", value_name = "N")]
    pub fsdp_min_num_params: Option<usize>,
    /// FSDP's CPU offload (PyTorch's CPUOffload(offload_params=True), Accelerate's
    /// fsdp_offload_params): parameters, gradients and optimizer state in host memory, said in
    /// a placement line per strategy; FSDP strategies only (ddp and zero1 are not estimated).
    #[arg(long = "offload-params", alias = "offload_params", alias = "fsdp_offload_params")]
    pub offload_params: bool,
    /// Count writing a full checkpoint (save_state; the Trainer's checkpoint-N, by default every
    /// 500 steps and at the last) as a moment: FSDP's sharded strategies gather the model, then
    /// both AdamW moments, in fp32 to rank 0 (at most 8 bytes per parameter), ZeRO-1 both moments
    /// to rank 0 as consolidate_state_dict(to=0) (8; another rank 12 / W); DDP and NO_SHARD add
    /// nothing (moments on disk are read back).
    #[arg(long = "save-checkpoint", alias = "save_checkpoint")]
    pub save_checkpoint: bool,
    /// Whose memory: cpu, the training phase's peak RSS growth (what `bench run` measures; host
    /// and device are one memory); cuda, the CUDA caching allocator's peak of allocated bytes
    /// (torch.cuda.max_memory_allocated over the steps: activations at their live bytes, plus
    /// cuBLAS's workspaces and cuDNN's per sample, fitted on an H200 at one process, and MNIST
    /// held on the device; NCCL's
    /// buffers, the CUDA context and the allocator's cache, which nvidia-smi shows too, not
    /// counted), with --offload-params the host's part apart and --budget held against the
    /// device's.
    #[arg(long, value_name = "DEVICE", default_value = "cpu", value_parser = ladder_core::cli::choice::<DeviceKind>(),
          hide_possible_values = true)]
    pub device: DeviceKind,
    /// Memory per process, e.g. 8GiB, 512MiB, 1.5GB: says which strategies fit (total ≤ SIZE;
    /// with --device cuda, the device's part) and names the cheapest that does. The total
    /// leaves out the process's own start-up memory (see below): keep room for it.
    #[arg(long, value_name = "SIZE", value_parser = parse_budget, allow_hyphen_values = true)]
    pub budget: Option<u64>,
    /// Print the estimate as JSON instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// `--budget`: a size ([`parse_size`]) of at least one byte (a budget of 0 fits nothing).
fn parse_budget(text: &str) -> std::result::Result<u64, String> {
    match parse_size(text)? {
        0 => Err(format!("invalid budget {text:?}: expected a size above 0, such as 8GiB or 512MiB")),
        b => Ok(b),
    }
}

/// One strategy's estimate, as `--json` writes it.
#[derive(Debug, Serialize)]
struct StrategyEstimate {
    strategy: &'static str,
    ranks: Vec<RankEstimate>,
    /// `total` ≤ budget on every rank (with `--budget`).
    #[serde(skip_serializing_if = "Option::is_none")]
    fits: Option<bool>,
}

/// The whole answer, as `--json` writes it.
#[derive(Debug, Serialize)]
struct Report {
    width: i64,
    batch_size: u64,
    num_processes: u64,
    mixed_precision: &'static str,
    /// The CPU's bf16 unit the bf16 estimate assumed (`--cpu-bf16`, or this machine's):
    /// `amx`, `avx512-bf16`, `none`, or `unknown` (AMX's factor taken); only in bf16 on a CPU.
    #[serde(skip_serializing_if = "Option::is_none")]
    cpu_bf16: Option<&'static str>,
    activation_checkpointing: bool,
    /// `--fsdp-min-num-params`: FSDP's auto-wrap policy, where set (else each strategy's default).
    #[serde(skip_serializing_if = "Option::is_none")]
    fsdp_min_num_params: Option<usize>,
    /// `cpu` (peak RSS growth) or `cuda` (the CUDA allocator's peak).
    device: DeviceKind,
    /// FSDP's CPU offload (`--offload-params`): each rank's `host` bytes.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    offload_params: bool,
    /// `--save-checkpoint`: the save is one of the moments.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    save_checkpoint: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    budget: Option<u64>,
    strategies: Vec<StrategyEstimate>,
    /// Strategies left out: they do not combine with the precision.
    skipped: Vec<String>,
    /// The first strategy that fits, in the order compared (fastest first by default).
    #[serde(skip_serializing_if = "Option::is_none")]
    cheapest_fit: Option<&'static str>,
    /// `--strategy` set the order compared (not the default, fastest first).
    #[serde(skip)]
    order_given: bool,
    /// `--cpu-bf16` was given where it changes nothing (not bf16 on a CPU).
    #[serde(skip)]
    cpu_bf16_unused: bool,
    /// Nothing fits, and activation checkpointing would lower the smallest strategy's figure.
    #[serde(skip)]
    checkpointing_lowers: bool,
}

/// Runs `estimate-memory`: the table (or JSON) on stdout.
pub fn run(args: &EstimateArgs) -> CmdResult {
    let report = build(args)?;
    let text = if args.json { serde_json::to_string_pretty(&report).map_err(|e| cli_error(e.to_string()))? } else { render(&report) };
    println!("{text}");
    Ok(0)
}

fn cli_error(problem: String) -> Error {
    Error::Cli { command: "estimate-memory", problem }
}

fn build(args: &EstimateArgs) -> Result<Report> {
    if args.mixed_precision == Precision::Fp16 && args.device == DeviceKind::Cpu {
        return Err(Error::Conflict {
            first: "--mixed-precision fp16".into(),
            second: "--device cpu".into(),
            why: "fp16 compute with loss scaling needs CUDA, and every level refuses it on a CPU; estimate bf16 there, or fp16 with --device cuda".into(),
        });
    }
    let explicit = !args.strategy.is_empty();
    // The CPU's bf16 unit where it matters (bf16 on a CPU): Some(None) when it is not known.
    let bf16_cpu = args.mixed_precision == Precision::Bf16 && args.device == DeviceKind::Cpu;
    let cpu_bf16 = bf16_cpu.then(|| args.cpu_bf16.or_else(CpuBf16Unit::of_this_machine));
    let strategies = if explicit { args.strategy.clone() } else { estimate::default_strategies() };
    let (mut out, mut skipped) = (Vec::new(), Vec::new());
    for strategy in strategies {
        let label = strategy.label();
        let strategy = match strategy {
            Strategy::Fsdp(o) => Strategy::Fsdp(FsdpOptions {
                offload_params: args.offload_params,
                min_num_params: args.fsdp_min_num_params.unwrap_or(o.min_num_params),
                ..o
            }),
            _ if explicit && args.fsdp_min_num_params.is_some() => {
                return Err(Error::Conflict {
                    first: format!("--strategy {label}"),
                    second: "--fsdp-min-num-params".into(),
                    why: "the auto-wrap policy decides FSDP's units; DDP and ZeRO-1 have none".into(),
                });
            }
            _ if args.offload_params => {
                if explicit {
                    return Err(Error::Conflict {
                        first: format!("--strategy {label}"),
                        second: "--offload-params".into(),
                        why: "CPU offload of the parameters is FSDP's (CPUOffload(offload_params=True)); DDP keeps a full replica on the device".into(),
                    });
                }
                skipped.push(format!("{label}: --offload-params is FSDP's"));
                continue;
            }
            ddp => ddp,
        };
        let wrap = WrapConfig { strategy, mixed_precision: args.mixed_precision, activation_checkpointing: args.activation_checkpointing };
        if wrap.validate().is_err() {
            if explicit {
                return Err(Error::Conflict {
                    first: format!("--strategy {label}"),
                    second: format!("--mixed-precision {}", args.mixed_precision),
                    why: "ZeRO-1 runs in fp32 (DDP with mixed precision runs on FSDP's NO_SHARD path); for sharded optimizer state in 16 bits use fsdp-shard-grad-op".into(),
                });
            }
            skipped.push(format!("{label}: fp32 only"));
            continue;
        }
        let input = EstimateInput {
            wrap,
            world_size: args.num_processes as usize,
            width: args.width,
            batch_size: args.batch_size as usize,
            offload_optimizer: args.offload_optimizer,
            save_checkpoint: args.save_checkpoint,
            cpu_bf16: cpu_bf16.flatten(),
            huge_pages: Some(ladder_core::device::huge_pages_for(ladder_core::model::BasicNet::param_bytes(args.width))),
        };
        let ranks = estimate::estimate_on(&input, args.device)?;
        let fits = args.budget.map(|b| ranks.iter().all(|r| held(r, args.device) <= b));
        out.push(StrategyEstimate { strategy: label, ranks, fits });
    }
    let cheapest_fit = out.iter().find(|s| s.fits == Some(true)).map(|s| s.strategy);
    // When nothing fits: would checkpointing lower the smallest figure? (On a CPU never: the
    // heap keeps the peak of the run without; on CUDA only where fewer activations are alive.)
    let smallest = |s: &[StrategyEstimate]| s.iter().filter_map(|s| most_held(s, args.device)).min();
    let checkpointing_lowers = cheapest_fit.is_none() && args.budget.is_some() && !args.activation_checkpointing && {
        let with = build(&EstimateArgs { activation_checkpointing: true, budget: None, ..args.clone() })?;
        smallest(&with.strategies) < smallest(&out)
    };
    Ok(Report {
        width: args.width,
        batch_size: args.batch_size,
        num_processes: args.num_processes,
        mixed_precision: args.mixed_precision.label(),
        cpu_bf16: cpu_bf16.map(|u| u.map_or("unknown, AMX's factor taken", CpuBf16Unit::label)),
        activation_checkpointing: args.activation_checkpointing,
        fsdp_min_num_params: args.fsdp_min_num_params,
        device: args.device,
        offload_params: args.offload_params,
        save_checkpoint: args.save_checkpoint,
        budget: args.budget,
        strategies: out,
        skipped,
        cheapest_fit,
        order_given: explicit,
        cpu_bf16_unused: args.cpu_bf16.is_some() && !bf16_cpu,
        checkpointing_lowers,
    })
}

/// What a budget is held against: the whole total on a CPU (host and device are one memory),
/// the device's part (total less the host's, under CPU offload) on CUDA.
fn held(r: &RankEstimate, device: DeviceKind) -> u64 {
    match device {
        DeviceKind::Cpu => r.total,
        DeviceKind::Cuda => r.total - r.host,
    }
}

/// The most any rank of `s` holds against a budget ([`held`]).
fn most_held(s: &StrategyEstimate, device: DeviceKind) -> Option<u64> {
    s.ranks.iter().map(|r| held(r, device)).max()
}

/// One table row: strategy, rank, the figures in MiB (and whether it fits).
fn cells(strategy: &str, rank: &str, r: &RankEstimate, budget: Option<u64>, device: DeviceKind) -> Vec<String> {
    let m = r.model_state;
    let mut row = vec![strategy.to_string(), rank.to_string()];
    // MiB (the title says so), two decimals, no unit in the cells (126 characters wide at
    // width 4096 with --budget, 137 with the unit in every cell).
    row.extend(
        [m.parameters, m.gradients, m.optimizer, m.gathered_peak, r.activations, r.peak_growth, r.total]
            .map(|b| format!("{:.2}", ladder_core::memory::mib(b))),
    );
    if let Some(b) = budget {
        row.push(if held(r, device) <= b { "yes" } else { "no" }.into());
    }
    row
}

/// The table: one row per strategy (one per rank where the ranks' figures differ), then the
/// budget's verdict.
fn render(report: &Report) -> String {
    let mut table = Table::new();
    table.load_preset(ASCII_MARKDOWN);
    let mut header =
        vec!["strategy", "rank", "parameters", "gradients", "optimizer", "gathered peak", "activations", "peak growth", "total"];
    if report.budget.is_some() {
        header.push("fits");
    }
    table.set_header(header);
    for s in &report.strategies {
        let mut rows: Vec<Vec<String>> =
            s.ranks.iter().map(|r| cells(s.strategy, &r.rank.to_string(), r, report.budget, report.device)).collect();
        // Ranks whose figures print alike take one row (ZeRO-1's ranks differ by a few bytes
        // of padding, mostly below the printed precision).
        if rows.windows(2).all(|p| p[0][2..] == p[1][2..]) {
            rows = vec![cells(s.strategy, "all", &s.ranks[0], report.budget, report.device)];
        }
        for row in rows {
            table.add_row(row);
        }
    }
    let text = format!(
        "Memory per rank, MiB{}: BasicNet fc1 {}, batch {} per process, {} processes, {}{}{}{}{}\n\n{table}",
        if report.device == DeviceKind::Cuda {
            " (the CUDA allocator's peak; peak growth: less the parameters and the dataset)"
        } else {
            ""
        },
        report.width,
        report.batch_size,
        report.num_processes,
        report.mixed_precision,
        report.cpu_bf16.map_or(String::new(), |u| format!(" (CPU bf16 unit: {u})")),
        if report.activation_checkpointing { ", activation checkpointing" } else { "" },
        report.fsdp_min_num_params.map_or(String::new(), |n| format!(", fsdp_min_num_params {n}")),
        if report.save_checkpoint { ", a checkpoint save counted" } else { "" },
    );
    // The lines after the table, as a paragraph of their own: a blank line first, so that the
    // output is Markdown whose table ends where it should (a renderer reads a line right after a
    // table as one more row).
    let mut notes: Vec<String> = Vec::new();
    if report.device == DeviceKind::Cpu {
        notes.push(
            "peak growth: what a run's training phase adds to each process's peak RSS; most cells measured came within 10%, \
             some 10–30% off (the book's \"Will it fit?\")"
                .into(),
        );
        if report.activation_checkpointing {
            notes.push(
                "activation checkpointing: on a CPU it lowers no estimate (the heap keeps the peak of the run without it; \
                 no checkpointed run measured grew more than 6% less)"
                    .into(),
            );
        }
    }
    for s in &report.skipped {
        notes.push(format!("not estimated: {s}"));
    }
    if report.cpu_bf16_unused {
        notes.push("--cpu-bf16 changes nothing here: it sets the heap factor of bf16 on a CPU only".into());
    }
    for s in report.strategies.iter().filter(|s| s.ranks.iter().any(|r| r.host > 0)) {
        let (host, device) =
            (s.ranks.iter().map(|r| r.host).max().unwrap_or(0), s.ranks.iter().map(|r| r.total - r.host).max().unwrap_or(0));
        notes.push(format!(
            "placement, {}: {} on the host (model state), {} on the device",
            s.strategy,
            format_size(host),
            format_size(device)
        ));
    }
    if let Some(d) = report.strategies.iter().flat_map(|s| s.ranks.iter()).map(|r| r.dataset).find(|&d| d > 0) {
        notes.push(format!("dataset: MNIST on the device, {} per process (in total)", format_size(d)));
    }
    if let Some(b) = report.budget {
        let order = if report.order_given { "in the order given" } else { "fastest first" };
        notes.push(match report.cheapest_fit {
            Some(name) => {
                // How much of the budget the cheapest fit leaves: a run may exceed its estimate.
                let most = report.strategies.iter().find(|s| s.strategy == name).and_then(|s| most_held(s, report.device));
                let spare = most.map_or(String::new(), |m| format!(", {}% of it to spare", 100 * (b - m.min(b)) / b));
                format!(
                    "Within {} per process: {name} is the cheapest strategy that fits{spare} ({order}: {}); the process's start-up memory comes on top.",
                    format_size(b),
                    report.strategies.iter().map(|s| s.strategy).collect::<Vec<_>>().join(", ")
                )
            }
            None => {
                let most = |s: &StrategyEstimate| most_held(s, report.device);
                let least = report.strategies.iter().min_by_key(|s| most(s));
                let least = least.map_or(String::new(), |s| {
                    format!(" (the smallest: {} at {})", s.strategy, format_size(most(s).unwrap_or(0)))
                });
                let ckpt = if report.checkpointing_lowers { " or --activation-checkpointing" } else { "" };
                format!(
                    "Within {} per process, the process's start-up memory aside: no strategy fits{least}; try more processes, a smaller batch{ckpt}.",
                    format_size(b)
                )
            }
        });
    }
    if notes.is_empty() {
        text
    } else {
        format!("{text}\n\n{}", notes.join("\n"))
    }
}
