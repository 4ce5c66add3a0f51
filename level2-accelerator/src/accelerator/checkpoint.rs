//! Checkpoints, as Accelerate's `save_state` / `load_state`, and the trained weights
//! (`get_state_dict`, `unwrap_model`).

use super::Accelerator;
use crate::scaler::GradScaler;
use crate::{Error, Result};
use ladder_core::checkpoint::{self, TrainingState};
use ladder_core::dist::ReduceOp;
use ladder_core::model::{BasicNet, BasicNetConfig};
use std::path::Path;
use tch::{nn, Device, Tensor};

impl Accelerator {
    /// Where training stands: steps, batches, the training loader's epoch and position, and
    /// the loss scale (fp16) in `extra["grad_scaler"]`.
    pub fn training_state(&self) -> TrainingState {
        let state = self.shared.state.borrow();
        let mut s = state.gradient.training_state(self.num_processes());
        if let Some(scaler) = state.guard.scaler {
            s.extra.insert("grad_scaler".into(), serde_json::to_value(scaler).expect("GradScaler serialises"));
        }
        s
    }

    /// `save_state(dir)`: the model (unwrapped keys), the optimizer (unwrapped keys), and the
    /// training state, written by the main process into `dir` atomically (a kill mid-write
    /// leaves the previous checkpoint loadable). Collective.
    ///
    /// # Errors
    /// No prepared model or optimizer; I/O errors naming the file; collective errors.
    pub fn save_state(&self, dir: &Path) -> Result<()> {
        self.save_state_with(dir, serde_json::Map::new(), &[])
    }

    /// [`save_state`](Self::save_state) with extra training-state fields and extra files (the
    /// Trainer's `trainer_state.json`, a scheduler's state).
    ///
    /// # Errors
    /// As [`save_state`](Self::save_state).
    pub fn save_state_with(&self, dir: &Path, extra: serde_json::Map<String, serde_json::Value>, files: &[(&str, Vec<u8>)]) -> Result<()> {
        let model = self.shared.model("save_state")?;
        let opt = self.shared.optimizer("save_state")?;
        let mut state = self.training_state();
        state.extra.extend(extra);
        // One state dict at a time, as Accelerate's save_state (the model's file, then the
        // optimizer's): FSDP's main process holds the gathered weights or the gathered moments,
        // not both. Every rank takes part in both gathers, whatever the main process's writes.
        let weights = model.borrow().full_state_dict()?;
        let written = weights.map(|w| {
            let writer = checkpoint::Writer::begin(dir)?;
            writer.tensors(checkpoint::MODEL_FILE, &w)?;
            Ok::<_, ladder_core::Error>(writer)
        });
        let moments = model.borrow().optimizer_state_dict(&opt.borrow())?;
        let result = match (written, moments) {
            (Some(writer), Some(optimizer)) => writer
                .and_then(|w| {
                    w.tensors(checkpoint::OPTIMIZER_FILE, &optimizer)?;
                    w.finish(&state, files)
                })
                .map_err(Error::from),
            _ => Ok(()),
        };
        // Every rank learns whether the main process succeeded before anyone goes on.
        let pg = self.shared.pg;
        let mut ok = Tensor::from_slice(&[f64::from(u8::from(result.is_ok()))]).to_device(pg.device());
        pg.all_reduce(&mut ok, ReduceOp::Min)?;
        if ok.double_value(&[0]) == 0.0 && result.is_ok() {
            return Err(Error::Usage { op: "save_state", problem: format!("the main process could not write {}", dir.display()) });
        }
        result
    }

    /// `load_state(dir)`: restores the model, the optimizer, the loss scale, the step counters,
    /// and the training loaders' position (their next epoch resumes where the checkpoint was
    /// taken). Every process reads the directory (a shared filesystem across nodes). Returns
    /// the training state.
    ///
    /// Any world size: the model and optimizer state are full (DDP or any FSDP strategy wrote
    /// them, any strategy loads them, bit for bit). At the world size that wrote the
    /// checkpoint the loaders skip the batches already run, so the run continues exactly as if
    /// it had not stopped; at another, the samples of the interrupted epoch not yet consumed
    /// (counted over all processes) are split between the new processes, each trained on once
    /// (`DistributedSampler`'s rule); later epochs are ordinary epochs at the new size.
    ///
    /// # Errors
    /// A missing or corrupt checkpoint (named); weights or optimizer state that do not fit the
    /// model (another width: the keys and shapes named); a checkpoint past step 0 without
    /// optimizer state; a rest of the epoch the new world size cannot split evenly.
    pub fn load_state(&self, dir: &Path) -> Result<TrainingState> {
        let model = self.shared.model("load_state")?;
        let opt = self.shared.optimizer("load_state")?;
        let ckpt = checkpoint::load(dir)?;
        checkpoint::check_resumable(dir, &ckpt)?;
        let world_size = self.num_processes();
        let in_dir = |e: ladder_core::Error| match e {
            ladder_core::Error::StateDict(problem) => {
                ladder_core::Error::Checkpoint { dir: dir.into(), problem: format!("does not fit this model: {problem}") }
            }
            ladder_core::Error::UnevenResume { .. } => ladder_core::Error::Checkpoint {
                dir: dir.into(),
                problem: format!("written by {} processes, resumed by {world_size}: {e}", ckpt.state.world_size),
            },
            other => other,
        };
        if ckpt.state.world_size != world_size && ckpt.state.step_in_epoch > 0 && ckpt.state.samples_consumed == 0 {
            return Err(ladder_core::Error::Checkpoint {
                dir: dir.into(),
                problem: format!(
                    "written by {} processes before samples_consumed was recorded: it resumes at {} processes only",
                    ckpt.state.world_size, ckpt.state.world_size
                ),
            }
            .into());
        }
        // Nothing changes before every check passed.
        self.shared.state.borrow().gradient.check_restore(&ckpt.state, world_size).map_err(in_dir)?;
        model.borrow_mut().load_full_state_dict(&ckpt.model).map_err(in_dir)?;
        model.borrow().load_optimizer_state_dict(&mut opt.borrow_mut(), &ckpt.optimizer).map_err(in_dir)?;
        let scaler = match ckpt.state.extra.get("grad_scaler") {
            Some(v) => Some(
                serde_json::from_value::<GradScaler>(v.clone())
                    .map_err(|e| ladder_core::Error::Checkpoint { dir: dir.into(), problem: format!("grad_scaler: {e}") })?,
            ),
            None => None,
        };
        self.set_seed(ckpt.state.seed);
        let mut state = self.shared.state.borrow_mut();
        state.gradient.restore(&ckpt.state, world_size);
        if scaler.is_some() {
            state.guard.scaler = scaler;
        }
        drop(state);
        Ok(ckpt.state)
    }

    /// The prepared model's weights with the unwrapped model's keys (`conv1.weight`, …,
    /// definition order; FSDP gathers them), on the main process; `None` on the others
    /// (Accelerate's `get_state_dict`). Collective. Under DDP and NO_SHARD the tensors are the
    /// parameters themselves (torch's `state_dict()`): copy them to keep a snapshot across steps.
    ///
    /// # Errors
    /// No prepared model; collective errors.
    pub fn get_state_dict(&self) -> Result<Option<Vec<(String, Tensor)>>> {
        let sd = self.shared.model("get_state_dict")?.borrow().full_state_dict()?;
        Ok(sd)
    }

    /// The unwrapped model with the trained weights, on the main process (`None` on the
    /// others): a plain BasicNet on the CPU, FSDP's shards gathered. Collective.
    ///
    /// # Errors
    /// No prepared model; collective errors.
    pub fn unwrap_model(&self, config: BasicNetConfig) -> Result<Option<(nn::VarStore, BasicNet)>> {
        let sd = self.shared.model("unwrap_model")?.borrow().full_state_dict()?;
        let Some(sd) = sd else { return Ok(None) };
        let mut vs = nn::VarStore::new(Device::Cpu);
        let net = BasicNet::new(&vs.root(), config);
        tch::no_grad(|| -> Result<()> {
            let vars = vs.variables();
            for (name, t) in &sd {
                let v = vars.get(name).ok_or_else(|| ladder_core::Error::StateDict(format!("model: unexpected key {name}")))?;
                v.shallow_clone().f_copy_(t).map_err(ladder_core::Error::from)?;
            }
            Ok(())
        })?;
        vs.freeze();
        Ok(Some((vs, net)))
    }
}
