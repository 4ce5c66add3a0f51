//! The Trainer resumed from `checkpoint-<step>` at another world size than the one that wrote
//! it (2 → 3, 3 → 2, 2 → 1, 1 → 2; DDP and each FSDP strategy): the rest of the interrupted
//! epoch trains each unseen sample exactly once (counted in `compute_loss` through the index
//! each synthetic sample carries), and the run ends after the rest of the epoch. (The state's
//! bit-exact load is the Accelerator's `load_state`, tested in level 2's `resume.rs`.)

#[path = "../../shared/tests/common/mod.rs"]
mod common;

use ladder_core::data::Dataset;
use ladder_core::model::{BasicNet, BasicNetConfig};
use ladder_core::parallel::ShardingStrategy;
use level3_trainer::state::TrainerState;
use level3_trainer::{set_seed, Batch, ResumeFrom, Trainer, TrainerHooks, TrainingArguments};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use tch::{nn, Device, Tensor};

/// Samples of the synthetic dataset, per-device batch, steps before the checkpoint.
const SAMPLES: i64 = 52;
const BATCH: usize = 4;
const SAVED_AT: u64 = 3;

/// `nll_loss`, recording the index (first pixel) of every training sample it sees.
struct Counting(Arc<Mutex<Vec<i64>>>);
impl TrainerHooks for Counting {
    fn compute_loss(&self, model: &mut level3_trainer::TrainerModel<'_>, inputs: &Batch) -> level3_trainer::Result<(Tensor, Tensor)> {
        let first = inputs.x.select(1, 0).select(1, 0).select(1, 0);
        self.0.lock().unwrap().extend(Vec::<f32>::try_from(first).unwrap().into_iter().map(|v| v as i64));
        let out = model.forward(&inputs.x)?;
        Ok((out.nll_loss(&inputs.labels), out))
    }
}

/// The rank body: `L3R_PHASE` save (3 steps, checkpoint-3) or load (the rest of the epoch from
/// checkpoint-3) into `L3R_OUT` with FSDP's `L3R_FSDP` (or DDP); writes the indices it trained on.
#[test]
#[ignore = "rank body: run under mpirun by the resume tests"]
fn resume_body() {
    let out = PathBuf::from(std::env::var("L3R_OUT").unwrap());
    let phase = std::env::var("L3R_PHASE").unwrap();
    let fsdp = std::env::var("L3R_FSDP").ok().map(|s| s.parse::<ShardingStrategy>().unwrap());
    let args = TrainingArguments {
        per_device_train_batch_size: BATCH,
        num_train_epochs: 1.0,
        max_steps: if phase == "save" { SAVED_AT as i64 } else { -1 },
        save_steps: SAVED_AT as usize,
        logging_steps: 1,
        seed: 3,
        disable_tqdm: true,
        use_cpu: true,
        fsdp: fsdp.map(Into::into),
        fsdp_min_num_params: fsdp.map(|_| 0),
        ..TrainingArguments::new(&out)
    };
    set_seed(args.seed);
    let vs = nn::VarStore::new(Device::Cpu);
    let net = BasicNet::new(&vs.root(), BasicNetConfig::default());
    let seen = Arc::new(Mutex::new(Vec::new()));
    let mut trainer =
        Trainer::new(vs, net, args, Some(Dataset::indexed(SAMPLES)), None, level3_trainer::DefaultDataCollator, Counting(seen.clone()))
            .unwrap();
    let resume = (phase == "load").then(|| ResumeFrom::Dir(out.join(format!("checkpoint-{SAVED_AT}"))));
    trainer.train(resume).unwrap();
    let (rank, w) = (std::env::var("OMPI_COMM_WORLD_RANK").unwrap(), std::env::var("OMPI_COMM_WORLD_SIZE").unwrap());
    let seen = seen.lock().unwrap().clone();
    std::fs::write(out.join(format!("seen-{phase}-{w}-{rank}.json")), serde_json::to_vec(&seen).unwrap()).unwrap();
}

fn seen(dir: &Path, phase: &str, w: usize) -> Vec<i64> {
    (0..w)
        .flat_map(|r| serde_json::from_slice::<Vec<i64>>(&std::fs::read(dir.join(format!("seen-{phase}-{w}-{r}.json"))).unwrap()).unwrap())
        .collect()
}

fn save_then_resume(w: usize, w2: usize, strategies: &[Option<&str>]) {
    for fsdp in strategies {
        let root = tempfile::tempdir().unwrap();
        let out = root.path().to_str().unwrap();
        let mut envs = vec![("L3R_OUT", out), ("L3R_PHASE", "save")];
        if let Some(s) = fsdp {
            envs.push(("L3R_FSDP", s));
        }
        common::mpirun(w, "resume_body", &envs);
        envs[1].1 = "load";
        let text = common::mpirun(w2, "resume_body", &envs);
        assert!(text.contains(&format!("at {w2} processes instead of {w}")), "{text}");
        let before = seen(root.path(), "save", w);
        assert_eq!(before.len(), SAVED_AT as usize * BATCH * w, "{fsdp:?} {w}->{w2}: trained before the checkpoint");
        let mut all: Vec<i64> = before.into_iter().chain(seen(root.path(), "load", w2)).collect();
        all.sort_unstable();
        assert_eq!(all, (0..SAMPLES).collect::<Vec<_>>(), "{fsdp:?} {w}->{w2}: every sample of the epoch exactly once");
        // The run ended with the epoch: its steps are the checkpoint's and the rest's.
        let rest = (SAMPLES as usize - SAVED_AT as usize * BATCH * w).div_ceil(w2).div_ceil(BATCH) as u64;
        let state = TrainerState::load(&root.path().join("trainer_state.json")).unwrap();
        assert_eq!(state.global_step, SAVED_AT + rest, "{fsdp:?} {w}->{w2}");
    }
}

#[test]
fn resume_2_to_3_every_strategy() {
    save_then_resume(2, 3, &[None, Some("full_shard"), Some("shard_grad_op"), Some("no_shard")]);
}

#[test]
fn resume_3_to_2() {
    save_then_resume(3, 2, &[None, Some("full_shard")]);
}

#[test]
fn resume_2_to_1() {
    save_then_resume(2, 1, &[None, Some("shard_grad_op")]);
}

#[test]
fn resume_1_to_2() {
    save_then_resume(1, 2, &[None, Some("no_shard")]);
}

/// Transformers' ddp_bucket_cap_mb reaches DDP. Buckets fill in reverse order and close once
/// over their cap, the first at 1 MiB (PyTorch's rule): fc2 and fc1 make the first; under the
/// default 25 MiB the convolutions' 74 KiB share the second, under a 0.05 MiB cap conv2's
/// weight (72 KiB) closes it and conv1 takes a third.
#[test]
fn ddp_bucket_cap_mb_reaches_the_buckets() {
    let dir = tempfile::tempdir().unwrap();
    let buckets = |cap: Option<f64>| {
        let args = TrainingArguments { use_cpu: true, disable_tqdm: true, ddp_bucket_cap_mb: cap, ..TrainingArguments::new(dir.path()) };
        let vs = nn::VarStore::new(Device::Cpu);
        let net = BasicNet::new(&vs.root(), BasicNetConfig::default());
        let trainer =
            Trainer::new(vs, net, args, Some(Dataset::indexed(8)), None, level3_trainer::DefaultDataCollator, Counting(Default::default()))
                .unwrap();
        let explained = trainer.model().explain();
        let count = explained.split_once("DDP gradient buckets: ").and_then(|(_, rest)| rest.split_once(' ')).map(|(n, _)| n.to_string());
        count.and_then(|n| n.parse::<usize>().ok()).unwrap_or_else(|| panic!("no DDP bucket layout in:\n{explained}"))
    };
    let (small, default) = (buckets(Some(0.05)), buckets(None));
    assert_eq!((small, default), (3, 2), "buckets with 0.05 MiB and with 25 MiB");
}
