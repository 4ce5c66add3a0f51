//! The matrix's cells: what a cell runs (a level or the baseline, how the model is replicated,
//! ranks, width, precision) and the PyTorch peer it is measured next to.

use clap::builder::PossibleValue;
use clap::ValueEnum;
use ladder_core::memory::estimate::zero1;
use ladder_core::parallel::{Choice, OffloadDevice, Precision, ShardingStrategy, Strategy};
use serde::{Deserialize, Serialize};
use std::sync::OnceLock;

/// How a cell replicates the model: one process without a process group (`single`, the
/// bench's own notion: `ladder-baseline`), or one of the core's strategies across ranks.
/// Written as the flag value and report name: `single`, `ddp`, `fsdp-full-shard`, …; read as
/// any spelling of [`Strategy`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Replication {
    /// One process, no process group: `ladder-baseline` (level-independent).
    Single,
    /// A level binary under `ladder-run`, with this strategy (its default options; DDP with
    /// `zero_redundancy_optimizer` is ZeRO-1, named `zero1`).
    Parallel(Strategy),
}

impl Replication {
    /// The flag value / report name: `single`, or the strategy's ([`Strategy::name`]).
    pub fn name(self) -> &'static str {
        Choice::name(self)
    }

    /// FSDP's sharding strategy; `None` for `single` and DDP.
    pub fn sharding(self) -> Option<ShardingStrategy> {
        match self {
            Replication::Single => None,
            Replication::Parallel(s) => s.sharding(),
        }
    }

    /// True for DDP without ZeRO-1.
    pub fn is_ddp(self) -> bool {
        matches!(self, Replication::Parallel(Strategy::Ddp(o)) if !o.zero_redundancy_optimizer)
    }

    /// True for DDP with ZeRO-1 (`ZeroRedundancyOptimizer`; DeepSpeed's stage 1).
    pub fn is_zero1(self) -> bool {
        matches!(self, Replication::Parallel(Strategy::Ddp(o)) if o.zero_redundancy_optimizer)
    }

    /// The core's strategy (`None` for `single`); ZeRO-1 is DDP with its option set.
    pub fn strategy(self) -> Option<Strategy> {
        match self {
            Replication::Single => None,
            Replication::Parallel(s) => Some(s),
        }
    }
}

impl From<Strategy> for Replication {
    fn from(strategy: Strategy) -> Self {
        Replication::Parallel(strategy)
    }
}

impl ValueEnum for Replication {
    /// `single`, DDP, ZeRO-1 (`zero1`), then the core's other strategies in their `--help` order.
    fn value_variants<'a>() -> &'a [Self] {
        static ALL: OnceLock<Vec<Replication>> = OnceLock::new();
        ALL.get_or_init(|| {
            let strategies = Strategy::value_variants().iter().flat_map(|&s| match s {
                Strategy::Ddp(_) => vec![s, zero1()],
                s => vec![s],
            });
            std::iter::once(Replication::Single).chain(strategies.map(Replication::from)).collect()
        })
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        match self {
            Replication::Single => {
                Some(PossibleValue::new("single").help("One process, no process group: `ladder-baseline` (level-independent)"))
            }
            r if r.is_zero1() => Some(PossibleValue::new("zero1").aliases(["zero-1", "ddp-zero1"]).help(
                "DDP with ZeRO-1 (PyTorch's ZeroRedundancyOptimizer, DeepSpeed's stage 1): each rank keeps and steps \
                 the AdamW state of its 1/W of the parameters (fp32 only)",
            )),
            Replication::Parallel(s) => s.to_possible_value(),
        }
    }
}

impl Choice for Replication {
    const WHAT: &'static str = "strategy";
    fn name(self) -> &'static str {
        match self {
            Replication::Single => "single",
            Replication::Parallel(s) => s.label(),
        }
    }
    fn unsupported(text: &str) -> Option<&'static str> {
        <Strategy as Choice>::unsupported(text)
    }
}
ladder_core::impl_choice!(Replication);

/// serde for a cell's precision: written as [`Precision::label`] (`fp32`, `bf16`: the name in
/// ids, tables and `bench.json`), read as any spelling of [`Precision`].
mod precision_label {
    use ladder_core::parallel::Precision;

    pub fn serialize<S: serde::Serializer>(p: &Precision, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(p.label())
    }

    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Precision, D::Error> {
        serde::Deserialize::deserialize(d)
    }
}

/// A PyTorch peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(tag = "peer", rename_all = "kebab-case")]
pub enum Peer {
    /// `bench/reference/tutorial.py`: the MNIST example loop, one process.
    Tutorial,
    /// `bench/reference/ddp_gloo.py` under `torchrun --standalone --nproc-per-node W`.
    DdpGloo {
        /// Ranks.
        world_size: usize,
    },
    /// `bench/reference/accelerate_loop.py` under `accelerate launch --num_processes W`
    /// (W processes over gloo on CPU): level 2's twin.
    Accelerate {
        /// Processes.
        world_size: usize,
    },
    /// `bench/reference/trainer.py` (🤗 `Trainer`, `TrainingArguments`) under `torchrun
    /// --standalone --nproc-per-node W`: level 3's twin.
    Trainer {
        /// Processes.
        world_size: usize,
    },
    /// `bench/reference/tuned.py`: the loop a speed-minded PyTorch user writes (tensors
    /// preloaded, index batching, fused AdamW, set-to-none gradients, and whichever of
    /// channels_last / torch.compile a start-up trial measures faster); one process at W = 1,
    /// DDP over gloo under `torchrun --standalone --nproc-per-node W` above. In the row's
    /// precision (`--precision fp32` or `bf16`, bf16 autocast): a peer that switched an fp32
    /// row to bf16 would compare another computation, and the fastest.
    Tuned {
        /// Processes.
        world_size: usize,
        /// bf16 autocast (a bf16 row's peer); fp32 otherwise.
        #[serde(default)]
        bf16: bool,
    },
}

impl Peer {
    /// `pytorch-tutorial`, `pytorch-ddp-gloo-w2`, `pytorch-tuned-w2-bf16`.
    pub fn id(self) -> String {
        match self {
            Peer::Tutorial => "pytorch-tutorial".into(),
            Peer::DdpGloo { world_size } => format!("pytorch-ddp-gloo-w{world_size}"),
            Peer::Accelerate { world_size } => format!("hf-accelerate-w{world_size}"),
            Peer::Trainer { world_size } => format!("hf-trainer-w{world_size}"),
            Peer::Tuned { world_size, bf16: false } => format!("pytorch-tuned-w{world_size}"),
            Peer::Tuned { world_size, bf16: true } => format!("pytorch-tuned-w{world_size}-bf16"),
        }
    }

    /// Whether the peer needs 🤗 accelerate and transformers in the venv.
    pub fn needs_hf(self) -> bool {
        matches!(self, Peer::Accelerate { .. } | Peer::Trainer { .. })
    }

    /// What the peer is, for tables: `PyTorch DDP (gloo)`, `🤗 Accelerate`, …
    pub fn title(self) -> &'static str {
        match self {
            Peer::Tutorial => "PyTorch tutorial",
            Peer::DdpGloo { .. } => "PyTorch DDP (gloo)",
            Peer::Accelerate { .. } => "🤗 Accelerate",
            Peer::Trainer { .. } => "🤗 Trainer",
            Peer::Tuned { .. } => "PyTorch tuned",
        }
    }
}

/// One cell of the matrix.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Case {
    /// File-name-safe id: `baseline-w1-128-fp32`, `l2-fsdp-full-shard-w4-4096-bf16`.
    pub id: String,
    /// Level, `None` for the single-process baseline.
    pub level: Option<u8>,
    /// How the model is replicated (`single`, `ddp`, `fsdp-full-shard`, …).
    pub strategy: Replication,
    /// Ranks.
    pub world_size: usize,
    /// fc1 width.
    pub width: i64,
    /// Precision (`no` or `bf16`; written `fp32`, `bf16`).
    #[serde(with = "precision_label")]
    pub precision: Precision,
    /// Optimizer steps per rank.
    pub steps: usize,
    /// Samples per rank per step (every level's `--batch-size`; Transformers'
    /// `per_device_train_batch_size`). Reports written before it ran [`BATCH_SIZE`].
    #[serde(default = "default_batch_size")]
    pub batch_size: usize,
    /// Activation checkpointing (level 1 `--activation-checkpointing`, level 2
    /// `--fsdp-activation-checkpointing`, level 3 `--gradient-checkpointing`).
    #[serde(default)]
    pub activation_checkpointing: bool,
    /// FSDP's CPU offload of the parameters (level 1 `--cpu-offload`, level 2
    /// `--fsdp-offload-params`, level 3 `--fsdp "<STRATEGY> offload"`).
    #[serde(default)]
    pub cpu_offload: bool,
    /// Where AdamW's moments live: `none` (in memory) or `nvme`, a file per rank on disk —
    /// DeepSpeed's `offload_optimizer.device` (level 1 `--offload-optimizer-nvme-path`, level 2
    /// `--offload-optimizer-device nvme`, level 3 `--deepspeed` with
    /// `zero_optimization.offload_optimizer`).
    #[serde(default)]
    pub offload_optimizer: OffloadDevice,
    /// The PyTorch twin, if any.
    pub peer: Option<Peer>,
    /// The tuned PyTorch peer (`bench/reference/tuned.py`) at the same world size, if any.
    #[serde(default)]
    pub tuned_peer: Option<Peer>,
}

impl Case {
    /// Whether the cell sets no option apart from its strategy: the levels' batch size
    /// ([`BATCH_SIZE`]), no activation checkpointing, no CPU offload, the optimizer's moments in
    /// memory ([`precision_and_options`] then names the precision alone).
    pub fn without_options(&self) -> bool {
        self.batch_size == BATCH_SIZE
            && !self.activation_checkpointing
            && !self.cpu_offload
            && self.offload_optimizer == OffloadDevice::None
    }
}

/// Whether two cells run the same world size, width, precision, batch size, activation
/// checkpointing, CPU offload and optimizer offload (their level and strategy may differ): the
/// twins a ratio compares.
pub fn same_setting(a: &Case, b: &Case) -> bool {
    a.world_size == b.world_size
        && a.width == b.width
        && a.precision == b.precision
        && a.batch_size == b.batch_size
        && a.activation_checkpointing == b.activation_checkpointing
        && a.cpu_offload == b.cpu_offload
        && a.offload_optimizer == b.offload_optimizer
}

/// Samples per rank per step unless a cell says otherwise: the levels' default `--batch-size`.
pub const BATCH_SIZE: usize = 64;

fn default_batch_size() -> usize {
    BATCH_SIZE
}

/// `L2 fsdp-full-shard ×4 fc1 4096 bf16` / `baseline single ×1 fc1 128 fp32`; a batch size
/// other than [`BATCH_SIZE`], activation checkpointing, CPU offload and optimizer offload are
/// appended: `L1 ddp ×2 fc1 128 fp32 batch 512 ckpt`, `L1 fsdp-full-shard ×2 fc1 4096 fp32
/// offload`, `L1 zero1 ×2 fc1 4096 fp32 nvme`.
pub fn label(case: &Case) -> String {
    let who = case.level.map_or("baseline".to_string(), |l| format!("L{l}"));
    format!("{who} {} ×{} fc1 {} {}", case.strategy.name(), case.world_size, case.width, precision_and_options(case))
}

/// The precision, then the options a cell sets apart from its strategy: `fp32`,
/// `fp32 batch 512 ckpt`, `fp32 offload`, `fp32 nvme` (tables put it in their precision column).
pub fn precision_and_options(case: &Case) -> String {
    let mut out = case.precision.label().to_string();
    if case.batch_size != BATCH_SIZE {
        out.push_str(&format!(" batch {}", case.batch_size));
    }
    if case.activation_checkpointing {
        out.push_str(" ckpt");
    }
    if case.cpu_offload {
        out.push_str(" offload");
    }
    if case.offload_optimizer == OffloadDevice::Nvme {
        out.push_str(" nvme");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cells_are_written_with_the_report_names_and_read_in_any_spelling() {
        let case = Case {
            id: "l1-fsdp-full-shard-w2-128-bf16".into(),
            level: Some(1),
            strategy: Strategy::fsdp(ShardingStrategy::FullShard).into(),
            world_size: 2,
            width: 128,
            precision: Precision::Bf16,
            steps: 3,
            batch_size: BATCH_SIZE,
            activation_checkpointing: false,
            cpu_offload: false,
            offload_optimizer: OffloadDevice::None,
            peer: None,
            tuned_peer: None,
        };
        let json = serde_json::to_value(&case).unwrap();
        assert_eq!((&json["strategy"], &json["precision"]), (&"fsdp-full-shard".into(), &"bf16".into()));
        let single = serde_json::json!({"id": "b", "level": null, "strategy": "single", "world_size": 1, "width": 128,
            "precision": "fp32", "steps": 3, "peer": null});
        let single: Case = serde_json::from_value(single).unwrap();
        assert_eq!((single.strategy, single.precision), (Replication::Single, Precision::No));
        assert_eq!(serde_json::to_value(&single).unwrap()["precision"], "fp32");
        assert_eq!(label(&single), "baseline single ×1 fc1 128 fp32");
        let read: Replication = "FULL_SHARD".parse().unwrap();
        assert_eq!((read, read.sharding(), read.is_ddp()), (case.strategy, Some(ShardingStrategy::FullShard), false));
        let names: Vec<&str> = Replication::value_variants().iter().map(|r| r.name()).collect();
        assert_eq!(
            names,
            [
                "single",
                "ddp",
                "zero1",
                "fsdp-full-shard",
                "fsdp-shard-grad-op",
                "fsdp-no-shard",
                "fsdp-hybrid-shard",
                "fsdp-hybrid-shard-zero2"
            ]
        );
        let zero: Replication = "ZeRO-1".parse().unwrap();
        assert_eq!((zero.name(), zero.is_zero1(), zero.is_ddp(), zero.strategy().map(|s| s.name())), ("zero1", true, false, Some("ddp")));
        let wide = Case { batch_size: 512, activation_checkpointing: true, strategy: zero, ..case.clone() };
        assert_eq!(label(&wide), "L1 zero1 ×2 fc1 128 bf16 batch 512 ckpt");
        let offloaded = Case { cpu_offload: true, ..case.clone() };
        let on_disk = Case { offload_optimizer: OffloadDevice::Nvme, ..case.clone() };
        assert_eq!(label(&offloaded), "L1 fsdp-full-shard ×2 fc1 128 bf16 offload");
        assert_eq!(label(&on_disk), "L1 fsdp-full-shard ×2 fc1 128 bf16 nvme");
        assert!(!same_setting(&case, &on_disk), "the moments on disk are another setting");
        let json = serde_json::to_value(&on_disk).unwrap();
        assert_eq!(json["offload_optimizer"], "nvme");
        assert_eq!(serde_json::from_value::<Case>(json).unwrap(), on_disk);
        let err = "zero3".parse::<Replication>().unwrap_err().to_string();
        assert!(err.starts_with("invalid strategy \"zero3\": expected single, ddp, zero1, fsdp-full-shard"), "{err}");
    }
}
