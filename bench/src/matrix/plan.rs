//! `bench run`'s options and the cells they select.

use super::case::{Case, Peer, Replication, BATCH_SIZE};
use crate::error::{Error, Result};
use ladder_core::parallel::{OffloadDevice, Precision, ShardingStrategy, Strategy};
use std::path::PathBuf;

/// `bench run`'s options. Every list flag takes comma-separated values.
#[derive(Debug, Clone, clap::Args)]
pub struct RunArgs {
    /// Levels (1, 2, 3).
    #[arg(long, value_delimiter = ',', default_values_t = [1u8, 2, 3])]
    pub levels: Vec<u8>,
    /// Strategies (`single` is ladder-baseline: one process, whatever --world-sizes says). FSDP
    /// cells wrap every layer in its own unit (`--fsdp-min-num-params 0`); the levels' default
    /// threshold (10⁸ parameters) leaves BasicNet one unit below fc1 width 10,850. Estimate
    /// the bench's cells with `estimate-memory --fsdp-min-num-params 0`.
    #[arg(long, value_parser = ladder_core::cli::spelling::<Replication>(), value_delimiter = ',', default_values_t = DEFAULT_STRATEGIES)]
    pub strategies: Vec<Replication>,
    /// World sizes of the distributed strategies (ranks; more ranks than cores are
    /// oversubscribed).
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 2, 4])]
    pub world_sizes: Vec<usize>,
    /// fc1 widths (128 is the tutorial's BasicNet; 4096 gives ~38M parameters).
    #[arg(long, value_delimiter = ',', default_values_t = [128i64, 4096])]
    pub widths: Vec<i64>,
    /// Precisions, as every level's `--mixed-precision` (`no`, also read as `fp32`; `bf16`);
    /// reports name them fp32 and bf16. The baseline is fp32 only.
    #[arg(long, value_parser = ladder_core::cli::spelling_among(&[Precision::No, Precision::Bf16]), value_delimiter = ',', default_values_t = [Precision::No, Precision::Bf16])]
    pub precisions: Vec<Precision>,
    /// Samples per rank per step (every level's `--batch-size`; the Trainer's
    /// `--per-device-train-batch-size`). Batch sizes other than 64 run `--wide-steps` steps and
    /// no PyTorch peer (memory measurements).
    #[arg(long, value_delimiter = ',', default_values_t = [BATCH_SIZE])]
    pub batch_sizes: Vec<usize>,
    /// Activation checkpointing off, on, or both (`false,true`): level 1
    /// `--activation-checkpointing`, level 2 `--fsdp-activation-checkpointing`, level 3
    /// `--gradient-checkpointing`. Checkpointed cells run no PyTorch peer.
    #[arg(long, value_delimiter = ',', default_values_t = [false], action = clap::ArgAction::Set)]
    pub activation_checkpointing: Vec<bool>,
    /// FSDP's CPU offload of the parameters off, on, or both (`false,true`): level 1
    /// `--cpu-offload`, level 2 `--fsdp-offload-params`, level 3 `--fsdp "FULL_SHARD offload"`.
    /// FSDP strategies only (the others run without, and say so); offloaded cells run no
    /// PyTorch peer. On a CPU the host is the device: it measures what the copies cost, not a
    /// saving.
    #[arg(long, value_delimiter = ',', default_values_t = [false], action = clap::ArgAction::Set)]
    pub cpu_offload: Vec<bool>,
    /// Where AdamW's moments live, one or both (`none,nvme`): `nvme` is DeepSpeed's optimizer
    /// offload to disk (level 1 `--offload-optimizer-nvme-path`, level 2
    /// `--offload-optimizer-device nvme`, level 3 `--deepspeed` with
    /// `zero_optimization.offload_optimizer`), the moments' files in a directory under
    /// --out-dir, removed after each run; the notes give each such cell's streaming per step.
    /// Every strategy but `single`; offloaded cells run no PyTorch peer.
    #[arg(long, value_delimiter = ',', default_values_t = [OffloadDevice::None])]
    pub offload_optimizer: Vec<OffloadDevice>,
    /// Optimizer steps per rank for width-128 runs at batch size 64 (938 is one epoch at one
    /// process).
    #[arg(long, default_value_t = 300)]
    pub steps: usize,
    /// Optimizer steps per rank for runs at another width or batch size (memory measurements:
    /// the heap grows over a run's first tens of steps, so a much shorter run measures less than
    /// a longer one, and than the memory estimate, fitted to runs of 20 steps and more).
    #[arg(long, default_value_t = 20)]
    pub wide_steps: usize,
    /// Repeats of every run, interleaved with the PyTorch peers (median, min, max reported).
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Repeats of runs at another width (memory measurements vary little; at most --repeats).
    #[arg(long, default_value_t = 1)]
    pub wide_repeats: usize,
    /// Leave the PyTorch peers out (no ratios).
    #[arg(long)]
    pub no_peers: bool,
    /// Install 🤗 accelerate and transformers into the peers' venv (pip, from PyPI; nothing
    /// happens when both import already) so that levels 2 and 3 get their Accelerate and
    /// Trainer peers. Without it those peers run only if the venv has them.
    #[arg(long)]
    pub install_peers: bool,
    /// What the tuned PyTorch peer (`bench/reference/tuned.py --tune`) may try at start-up and
    /// keep when a short timed trial measures it faster: some of `channels_last`, `compile`
    /// (torch.compile, the slowest to try), comma-separated, or `none`. The peer runs in the
    /// row's precision: fp32 rows against an fp32 peer, bf16 rows against one under bf16
    /// autocast.
    #[arg(long, default_value = "channels_last,compile")]
    pub tuned_trial: String,
    /// Leave the all-reduce bandwidth and DDP bucket measurements out.
    #[arg(long)]
    pub no_allreduce: bool,
    /// Print every column of every table on the terminal (about 300 characters wide); by
    /// default the terminal gets narrow tables and bench.md holds every column.
    #[arg(long)]
    pub all_columns: bool,
    /// Timed rounds per bucket_cap_mb in the DDP bucket measurement.
    #[arg(long, default_value_t = 30)]
    pub bucket_iters: usize,
    /// Ranks of the all-reduce and DDP bucket measurements.
    #[arg(long, default_value_t = 2)]
    pub allreduce_ranks: usize,
    /// Output directory. Default: `<root>/bench/results`.
    #[arg(long)]
    pub out_dir: Option<PathBuf>,
    /// The workspace, its binaries, the time limit.
    #[command(flatten)]
    pub launch: crate::LaunchArgs,
    /// Python of the PyTorch peers. Default: `<root>/.venv/bin/python`.
    #[arg(long)]
    pub python: Option<PathBuf>,
}

/// `--strategies`' default: the baseline, DDP, FULL_SHARD and SHARD_GRAD_OP.
const DEFAULT_STRATEGIES: [Replication; 4] = [
    Replication::Single,
    Replication::Parallel(Strategy::Ddp(ladder_core::parallel::DdpOptions::DEFAULT)),
    Replication::Parallel(Strategy::Fsdp(ladder_core::parallel::FsdpOptions::with_sharding(ShardingStrategy::FullShard))),
    Replication::Parallel(Strategy::Fsdp(ladder_core::parallel::FsdpOptions::with_sharding(ShardingStrategy::ShardGradOp))),
];

/// The cells `args` select, in run order, and a line for every combination left out and why.
///
/// # Errors
/// [`Error::InvalidValue`] for an unknown level, an empty list, world size 0, width < 1,
/// 0 steps, 0 repeats or an unknown `--tuned-trial` candidate.
pub fn plan(args: &RunArgs) -> Result<(Vec<Case>, Vec<String>)> {
    let levels = crate::select_levels(&args.levels)?;
    check(args)?;
    let (mut cases, mut skipped) = (Vec::new(), Vec::new());
    let steps_for = |width: i64, batch_size: usize| if width == 128 && batch_size == BATCH_SIZE { args.steps } else { args.wide_steps };
    for &strategy in &args.strategies {
        if strategy == Replication::Single {
            // One process whatever --world-sizes says (they are the process groups' sizes):
            // the figure every other is read against.
            if args.batch_sizes != [BATCH_SIZE]
                || args.activation_checkpointing != [false]
                || args.cpu_offload != [false]
                || args.offload_optimizer != [OffloadDevice::None]
            {
                skipped.push(format!(
                    "single at other batch sizes, with activation checkpointing or with CPU or optimizer offload: ladder-baseline is the tutorial's loop (batch {BATCH_SIZE}, no checkpointing, no offload) only"
                ));
            }
            for &width in &args.widths {
                for &precision in &args.precisions {
                    if width != 128 || precision != Precision::No {
                        skipped.push(format!(
                            "single at width {width} {}: ladder-baseline is the tutorial's BasicNet in fp32 only",
                            precision.label()
                        ));
                        continue;
                    }
                    if !args.batch_sizes.contains(&BATCH_SIZE)
                        || !args.activation_checkpointing.contains(&false)
                        || !args.cpu_offload.contains(&false)
                        || !args.offload_optimizer.contains(&OffloadDevice::None)
                    {
                        continue;
                    }
                    cases.push(Case {
                        id: "baseline-w1-128-fp32".into(),
                        level: None,
                        strategy,
                        world_size: 1,
                        width,
                        precision,
                        steps: steps_for(width, BATCH_SIZE),
                        batch_size: BATCH_SIZE,
                        activation_checkpointing: false,
                        cpu_offload: false,
                        offload_optimizer: OffloadDevice::None,
                        peer: (!args.no_peers).then_some(Peer::Tutorial),
                        tuned_peer: (!args.no_peers).then_some(Peer::Tuned { world_size: 1, bf16: false }),
                    });
                }
            }
            continue;
        }
        // CPU offload is FSDP's: the other strategies run only without it.
        let offloads: Vec<bool> = if strategy.sharding().is_some() {
            args.cpu_offload.clone()
        } else {
            if args.cpu_offload.contains(&true) {
                skipped.push(format!("{} with CPU offload: FSDP's option (PyTorch's CPUOffload), FSDP strategies only", strategy.name()));
            }
            args.cpu_offload.iter().copied().filter(|&o| !o).collect()
        };
        for level in &levels {
            for &world_size in &args.world_sizes {
                for &width in &args.widths {
                    for &precision in &args.precisions {
                        if strategy.is_zero1() && precision != Precision::No {
                            let why = "ZeRO-1 runs in fp32 only";
                            skipped.push(format!("L{} zero1 ×{world_size} fc1 {width} {}: {why}", level.number, precision.label()));
                            continue;
                        }
                        for &batch_size in &args.batch_sizes {
                            for &activation_checkpointing in &args.activation_checkpointing {
                                for &cpu_offload in &offloads {
                                    for &offload_optimizer in &args.offload_optimizer {
                                        let cell = Cell {
                                            level: level.number,
                                            strategy,
                                            world_size,
                                            width,
                                            precision,
                                            batch_size,
                                            activation_checkpointing,
                                            cpu_offload,
                                            offload_optimizer,
                                        };
                                        cases.push(cell.case(args, steps_for(width, batch_size)));
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    Ok((cases, skipped))
}

/// A level's cell before its id, steps and peers are decided.
struct Cell {
    level: u8,
    strategy: Replication,
    world_size: usize,
    width: i64,
    precision: Precision,
    batch_size: usize,
    activation_checkpointing: bool,
    cpu_offload: bool,
    offload_optimizer: OffloadDevice,
}

impl Cell {
    /// The case: id `l1-ddp-w2-128-fp32` (`-b512` for another batch size, `-ckpt` with
    /// checkpointing, `-offload` with CPU offload, `-nvme` with the moments on disk); each
    /// level's twin (PyTorch DDP, 🤗 Accelerate, 🤗 Trainer) and the tuned peer for DDP at width
    /// 128, fp32, batch 64, without checkpointing or optimizer offload.
    fn case(self, args: &RunArgs, steps: usize) -> Case {
        let Cell { level, strategy, world_size, width, precision, batch_size, activation_checkpointing, cpu_offload, offload_optimizer } =
            self;
        let twin = match level {
            1 => Peer::DdpGloo { world_size },
            2 => Peer::Accelerate { world_size },
            _ => Peer::Trainer { world_size },
        };
        // The PyTorch peers run DDP at the tutorial's width, batch and no checkpointing; the
        // tutorial's programs in fp32 only, the tuned one in the row's precision.
        let with_peers = !args.no_peers
            && strategy.is_ddp()
            && width == 128
            && batch_size == BATCH_SIZE
            && !activation_checkpointing
            && offload_optimizer == OffloadDevice::None;
        let peer = (with_peers && precision == Precision::No).then_some(twin);
        let mut id = format!("l{level}-{}-w{world_size}-{width}-{}", strategy.name(), precision.label());
        if batch_size != BATCH_SIZE {
            id.push_str(&format!("-b{batch_size}"));
        }
        if activation_checkpointing {
            id.push_str("-ckpt");
        }
        if cpu_offload {
            id.push_str("-offload");
        }
        if offload_optimizer == OffloadDevice::Nvme {
            id.push_str("-nvme");
        }
        Case {
            id,
            level: Some(level),
            strategy,
            world_size,
            width,
            precision,
            steps,
            batch_size,
            activation_checkpointing,
            cpu_offload,
            offload_optimizer,
            peer,
            // The strongest PyTorch loop at the same world size and precision, for every level.
            tuned_peer: with_peers.then_some(Peer::Tuned { world_size, bf16: precision == Precision::Bf16 }),
        }
    }
}

/// The list and count flags' values.
///
/// # Errors
/// [`Error::InvalidValue`] naming the first flag out of range.
fn check(args: &RunArgs) -> Result<()> {
    let invalid = |flag: &'static str, value: String, expected: &str| Err(Error::InvalidValue { flag, value, expected: expected.into() });
    if args.strategies.is_empty() {
        return invalid("--strategies", String::new(), "at least one strategy");
    }
    if args.precisions.is_empty() {
        return invalid("--precisions", String::new(), "fp32, bf16 or both");
    }
    if args.world_sizes.is_empty() || args.world_sizes.contains(&0) {
        return invalid("--world-sizes", format!("{:?}", args.world_sizes), "one or more world sizes of at least 1");
    }
    if args.batch_sizes.is_empty() || args.batch_sizes.contains(&0) {
        return invalid("--batch-sizes", format!("{:?}", args.batch_sizes), "one or more batch sizes of at least 1");
    }
    if args.activation_checkpointing.is_empty() {
        return invalid("--activation-checkpointing", String::new(), "false, true or both");
    }
    if args.cpu_offload.is_empty() {
        return invalid("--cpu-offload", String::new(), "false, true or both");
    }
    if args.offload_optimizer.is_empty() {
        return invalid("--offload-optimizer", String::new(), "none, nvme or both");
    }
    if args.widths.is_empty() || args.widths.iter().any(|&w| w < 1) {
        return invalid("--widths", format!("{:?}", args.widths), "one or more fc1 widths of at least 1");
    }
    if args.steps == 0 || args.wide_steps == 0 {
        return invalid("--steps", format!("{} / --wide-steps {}", args.steps, args.wide_steps), "at least 1 step");
    }
    if args.tuned_trial.split(',').any(|t| !["channels_last", "compile", "none"].contains(&t)) {
        return invalid(
            "--tuned-trial",
            args.tuned_trial.clone(),
            "some of channels_last, compile (comma-separated), or none (bf16 is not a trial: a row's precision is the peer's, bf16 rows get a peer under bf16 autocast)",
        );
    }
    if args.repeats == 0 || args.wide_repeats == 0 {
        return invalid("--repeats", format!("{} / --wide-repeats {}", args.repeats, args.wide_repeats), "at least 1 repeat");
    }
    Ok(())
}

/// `bench run`'s options from `flags` (tests).
#[cfg(test)]
pub(crate) fn args(flags: &[&str]) -> RunArgs {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        run: RunArgs,
    }
    Cli::parse_from(std::iter::once("bench").chain(flags.iter().copied())).run
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_matrix_and_what_it_leaves_out() {
        let (cases, skipped) = plan(&args(&[])).unwrap();
        // baseline 1 + levels 1, 2 and 3: 3 strategies × 3 world sizes × 2 widths × 2 precisions.
        assert_eq!(cases.len(), 1 + 3 * 36);
        assert_eq!(cases[0].id, "baseline-w1-128-fp32");
        assert_eq!((cases[0].peer, cases[0].tuned_peer), (Some(Peer::Tutorial), Some(Peer::Tuned { world_size: 1, bf16: false })));
        // Peers: ddp at width 128 in fp32, per level and world size.
        let with_peer: Vec<&str> = cases.iter().filter(|c| c.level.is_some() && c.peer.is_some()).map(|c| c.id.as_str()).collect();
        assert_eq!(with_peer.len(), 9);
        assert!(with_peer.contains(&"l3-ddp-w4-128-fp32"));
        // Every DDP row at width 128 has the tuned peer at its world size and in its precision
        // (the tutorial peers are fp32 only): the 9 fp32 rows with a peer and their 9 bf16 twins.
        for c in cases.iter().filter(|c| c.level.is_some()) {
            let bf16 = c.precision == Precision::Bf16;
            let expected = (c.strategy.is_ddp() && c.width == 128).then_some(Peer::Tuned { world_size: c.world_size, bf16 });
            assert_eq!(c.tuned_peer, expected, "{}", c.id);
            assert_eq!(c.peer.is_some(), expected.is_some() && !bf16, "{}", c.id);
        }
        assert_eq!(cases.iter().filter(|c| matches!(c.tuned_peer, Some(Peer::Tuned { bf16: true, .. }))).count(), 9);
        assert_eq!(Peer::Tuned { world_size: 2, bf16: true }.id(), "pytorch-tuned-w2-bf16");
        assert!(cases.iter().all(|c| c.steps == if c.width == 128 { 300 } else { 20 }));
        assert_eq!(cases.iter().filter(|c| c.level == Some(1) && c.precision == Precision::Bf16).count(), 18);
        assert_eq!(
            skipped,
            [
                "single at width 128 bf16: ladder-baseline is the tutorial's BasicNet in fp32 only",
                "single at width 4096 fp32: ladder-baseline is the tutorial's BasicNet in fp32 only",
                "single at width 4096 bf16: ladder-baseline is the tutorial's BasicNet in fp32 only",
            ]
        );
        let (cases, _) =
            plan(&args(&["--levels", "2", "--strategies", "ddp", "--world-sizes", "2", "--widths", "128", "--no-peers"])).unwrap();
        assert_eq!(cases.iter().map(|c| c.id.as_str()).collect::<Vec<_>>(), ["l2-ddp-w2-128-fp32", "l2-ddp-w2-128-bf16"]);
        assert!(cases.iter().all(|c| c.peer.is_none() && c.tuned_peer.is_none()));
        // `single` is one process whatever --world-sizes says (the book's matrix runs at 2 ranks
        // and keeps its one-process row).
        let (cases, skipped) =
            plan(&args(&["--levels", "1", "--strategies", "single,ddp", "--world-sizes", "2", "--widths", "128", "--precisions", "fp32"]))
                .unwrap();
        assert_eq!(cases.iter().map(|c| c.id.as_str()).collect::<Vec<_>>(), ["baseline-w1-128-fp32", "l1-ddp-w2-128-fp32"]);
        assert!(skipped.is_empty(), "{skipped:?}");
        let err = plan(&args(&["--tuned-trial", "channels_last,jit"])).unwrap_err().to_string();
        assert!(err.contains("--tuned-trial") && err.contains("channels_last,jit"), "{err}");
    }

    #[test]
    fn batch_sizes_checkpointing_and_zero1_are_dimensions_of_their_own() {
        let flags = ["--levels", "1,3", "--strategies", "single,zero1,fsdp-full-shard", "--world-sizes", "1,2", "--widths", "128"];
        let flags: Vec<&str> = flags.into_iter().chain(["--batch-sizes", "64,512", "--activation-checkpointing", "false,true"]).collect();
        let (cases, skipped) = plan(&args(&flags)).unwrap();
        // single: one cell; levels 1 and 3 × 2 world sizes × (zero1: fp32 only; FULL_SHARD: fp32
        // and bf16) × 2 batch sizes × 2 checkpointing.
        assert_eq!(cases.len(), 1 + 2 * 2 * (1 + 2) * 4);
        let ids: Vec<&str> = cases.iter().map(|c| c.id.as_str()).collect();
        assert_eq!(
            &ids[1..5],
            ["l1-zero1-w1-128-fp32", "l1-zero1-w1-128-fp32-ckpt", "l1-zero1-w1-128-fp32-b512", "l1-zero1-w1-128-fp32-b512-ckpt"]
        );
        // Only batch 64 at width 128 runs --steps; no peer for ZeRO-1, checkpointing or batch 512.
        assert!(cases.iter().all(|c| c.steps == if c.batch_size == 64 { 300 } else { 20 }));
        assert!(cases.iter().skip(1).all(|c| c.peer.is_none() && c.tuned_peer.is_none()));
        assert!(skipped.contains(&"L1 zero1 ×2 fc1 128 bf16: ZeRO-1 runs in fp32 only".to_string()), "{skipped:?}");
        assert!(skipped[0].starts_with("single at other batch sizes, with activation checkpointing"), "{skipped:?}");
        // DDP at batch 64 without checkpointing keeps its peers.
        let flags = "--levels 2 --strategies ddp --world-sizes 2 --widths 128 --precisions fp32 --batch-sizes 64,128";
        let (cases, _) = plan(&args(&flags.split(' ').collect::<Vec<_>>())).unwrap();
        let peers: Vec<(&str, bool)> = cases.iter().map(|c| (c.id.as_str(), c.peer.is_some())).collect();
        assert_eq!(peers, [("l2-ddp-w2-128-fp32", true), ("l2-ddp-w2-128-fp32-b128", false)]);
        let err = plan(&args(&["--batch-sizes", "64,0"])).unwrap_err().to_string();
        assert!(err.contains("--batch-sizes") && err.contains("[64, 0]"), "{err}");
    }

    #[test]
    fn cpu_offload_is_a_dimension_of_the_fsdp_cells_only() {
        let flags = "--levels 1,2,3 --strategies ddp,zero1,fsdp-full-shard --world-sizes 2 --widths 4096 --precisions fp32 --cpu-offload false,true";
        let (cases, skipped) = plan(&args(&flags.split(' ').collect::<Vec<_>>())).unwrap();
        // 3 levels × (ddp, zero1: without only; FULL_SHARD: without and with).
        assert_eq!(cases.len(), 3 * 4);
        let offloaded: Vec<&str> = cases.iter().filter(|c| c.cpu_offload).map(|c| c.id.as_str()).collect();
        assert_eq!(
            offloaded,
            [
                "l1-fsdp-full-shard-w2-4096-fp32-offload",
                "l2-fsdp-full-shard-w2-4096-fp32-offload",
                "l3-fsdp-full-shard-w2-4096-fp32-offload"
            ]
        );
        assert_eq!(
            skipped,
            [
                "ddp with CPU offload: FSDP's option (PyTorch's CPUOffload), FSDP strategies only",
                "zero1 with CPU offload: FSDP's option (PyTorch's CPUOffload), FSDP strategies only"
            ]
        );
        // An offloaded cell runs no peer, and compares with its twin without.
        let flags = "--levels 1 --strategies ddp --world-sizes 2 --widths 128 --precisions fp32 --cpu-offload true";
        let (cases, skipped) = plan(&args(&flags.split(' ').collect::<Vec<_>>())).unwrap();
        assert!(cases.is_empty() && skipped.len() == 1, "{cases:?} {skipped:?}");
        let on = Case {
            cpu_offload: true,
            ..plan(&args(&["--levels", "1", "--strategies", "fsdp-full-shard", "--world-sizes", "2"])).unwrap().0[0].clone()
        };
        assert!(
            super::super::case::same_setting(&on, &on)
                && !super::super::case::same_setting(&on, &Case { cpu_offload: false, ..on.clone() })
        );
    }

    #[test]
    fn optimizer_offload_is_a_dimension_of_every_strategy() {
        let flags = "--levels 1,3 --strategies single,ddp,zero1,fsdp-full-shard --world-sizes 2 --widths 4096 --precisions fp32 --offload-optimizer none,nvme";
        let (cases, skipped) = plan(&args(&flags.split(' ').collect::<Vec<_>>())).unwrap();
        // single: its one cell at width 128 is not asked for (width 4096 only); 2 levels × 3
        // strategies × (none, nvme).
        assert_eq!(cases.len(), 2 * 3 * 2);
        let on_disk: Vec<&str> = cases.iter().filter(|c| c.offload_optimizer == OffloadDevice::Nvme).map(|c| c.id.as_str()).collect();
        assert_eq!(
            on_disk,
            [
                "l1-ddp-w2-4096-fp32-nvme",
                "l3-ddp-w2-4096-fp32-nvme",
                "l1-zero1-w2-4096-fp32-nvme",
                "l3-zero1-w2-4096-fp32-nvme",
                "l1-fsdp-full-shard-w2-4096-fp32-nvme",
                "l3-fsdp-full-shard-w2-4096-fp32-nvme"
            ]
        );
        assert!(skipped[0].contains("with CPU or optimizer offload"), "{skipped:?}");
        // DDP at the tutorial's width keeps its peers without the option, none with it.
        let flags = "--levels 1 --strategies ddp --world-sizes 2 --widths 128 --precisions fp32 --offload-optimizer none,nvme";
        let (cases, _) = plan(&args(&flags.split(' ').collect::<Vec<_>>())).unwrap();
        let peers: Vec<(&str, bool, bool)> = cases.iter().map(|c| (c.id.as_str(), c.peer.is_some(), c.tuned_peer.is_some())).collect();
        assert_eq!(peers, [("l1-ddp-w2-128-fp32", true, true), ("l1-ddp-w2-128-fp32-nvme", false, false)]);
    }
}
