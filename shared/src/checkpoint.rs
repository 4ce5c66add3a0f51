//! Directory checkpoints that survive a kill mid-write, for the Accelerator's
//! `save_state`/`load_state` and the Trainer's `checkpoint-<step>/`.
//!
//! A checkpoint is a directory:
//!
//! | file | content |
//! |---|---|
//! | `model.safetensors` | the unwrapped model's weights (`conv1.weight`, …: no wrapper prefix; FSDP gathers them) |
//! | `optimizer.safetensors` | AdamW's state with the same keys (`conv1.weight.exp_avg`, `.exp_avg_sq`, `.step`) |
//! | `training_state.json` | [`TrainingState`]: global step, epoch, position in the epoch (batches per rank and samples over all ranks), seed, world size |
//! | anything else | files the caller adds (the Trainer's `trainer_state.json`, a scheduler's state) |
//!
//! One rank (rank 0) writes it, first into a hidden temporary directory next to the target, each
//! file synced, then renames it into place; an existing checkpoint of the same name is moved
//! aside first and removed last. A SIGKILL at any point leaves either the previous checkpoint or
//! the new one loadable: [`load`] falls back to the moved-aside copy when the kill came between
//! the two renames.
//!
//! Dropout and shuffling resume bit-identically without saving any generator state: the
//! shuffle is a function of (seed, epoch) and every batch's dropout masks of (seed, rank, batch
//! index) (see [`crate::recipe::seed_batch`]), so the position in [`TrainingState`] is enough.
//!
//! Model and optimizer state are full and keyed by the plain model's names whatever the
//! strategy (DDP, every FSDP sharding), so a checkpoint loads at any world size; the data
//! order of the interrupted epoch then follows [`crate::data::DistributedSampler`]'s rule.

use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use tch::Tensor;

/// File name of the model weights inside a checkpoint.
pub const MODEL_FILE: &str = "model.safetensors";
/// File name of the optimizer state inside a checkpoint.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
/// File name of the training state inside a checkpoint.
pub const STATE_FILE: &str = "training_state.json";

/// Where training stood when the checkpoint was written. Integers stay integers in the JSON.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TrainingState {
    /// Optimizer updates taken so far.
    pub global_step: u64,
    /// Micro-batches consumed so far over all epochs (equals `global_step` without gradient
    /// accumulation); the dropout seed of the next batch derives from it.
    pub batches_seen: u64,
    /// The epoch in progress (0-based): the next batch comes from this epoch.
    pub epoch: u64,
    /// Batches of `epoch` already consumed on each rank, counted from `epoch_start`: resuming
    /// at the same world size skips them.
    pub step_in_epoch: u64,
    /// Samples of `epoch`'s list consumed so far, over all ranks (a prefix of it, padding not
    /// counted; see [`crate::data::DistributedSampler`]): where a resume at another world size
    /// picks up. 0 in checkpoints from before it was recorded.
    #[serde(default)]
    pub samples_consumed: u64,
    /// Where the share of `epoch` being run began ([`crate::data::DistributedSampler::set_start`]):
    /// 0 unless this epoch was itself resumed at another world size.
    #[serde(default)]
    pub epoch_start: u64,
    /// The run's seed (weights, shuffle, dropout).
    pub seed: u64,
    /// Number of ranks that trained. Resuming at another world size continues `epoch` from
    /// `samples_consumed` (see [`TrainingState::resume_position`]).
    pub world_size: usize,
    /// Anything else the caller keeps (numbers stay numbers: f64 stays f64).
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl TrainingState {
    /// Where a run of `world_size` ranks resumes [`epoch`](Self::epoch): the sampler's start
    /// ([`crate::data::DistributedSampler::set_start`]) and the batches of that share to skip.
    /// At the world size that wrote the state: the share it was running and the batches it ran,
    /// so the order (padding included) is the uninterrupted run's, bit for bit. At another:
    /// the samples consumed, nothing to skip — the rest of the epoch is split between the new
    /// ranks, each unseen sample once.
    pub fn resume_position(&self, world_size: usize) -> (u64, u64) {
        if world_size == self.world_size {
            (self.epoch_start, self.step_in_epoch)
        } else {
            (self.samples_consumed, 0)
        }
    }
}

/// The contents of a checkpoint.
#[derive(Debug)]
pub struct Checkpoint {
    /// The unwrapped model's weights, by name.
    pub model: Vec<(String, Tensor)>,
    /// The optimizer's state, by name (empty before the first step).
    pub optimizer: Vec<(String, Tensor)>,
    /// Where training stood.
    pub state: TrainingState,
}

fn aside(dir: &Path) -> PathBuf {
    let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    dir.with_file_name(format!(".{name}.previous"))
}

fn sync_dir(dir: &Path) -> Result<()> {
    std::fs::File::open(dir).and_then(|f| f.sync_all()).map_err(|e| Error::io(dir, e))
}

/// Writes `ckpt` (and `extra_files`, name → bytes) to the directory `dir`, atomically: see the
/// module docs. Call it on one rank. [`Writer`] does the same a file at a time, so that each
/// state dict can be dropped before the next is gathered.
///
/// # Errors
/// [`Error::Io`] naming the directory or file that could not be written (the previous
/// checkpoint, if any, is left in place); [`Error::Torch`] if a tensor cannot be serialised.
// ANCHOR: checkpoint_save
pub fn save(dir: &Path, ckpt: &Checkpoint, extra_files: &[(&str, Vec<u8>)]) -> Result<()> {
    let writer = Writer::begin(dir)?;
    writer.tensors(MODEL_FILE, &ckpt.model)?;
    writer.tensors(OPTIMIZER_FILE, &ckpt.optimizer)?;
    writer.finish(&ckpt.state, extra_files)
}

/// A checkpoint being written: a hidden temporary directory next to the target, which
/// [`finish`](Self::finish) renames into place (dropped unfinished, it is removed and the
/// previous checkpoint stays).
#[derive(Debug)]
pub struct Writer {
    dir: PathBuf,
    parent: PathBuf,
    tmp: tempfile::TempDir,
}

impl Writer {
    /// Starts a checkpoint of the directory `dir` (created on [`finish`](Self::finish)).
    ///
    /// # Errors
    /// [`Error::Io`] naming the parent directory; [`Error::Checkpoint`] when `dir` exists and
    /// is not a directory.
    pub fn begin(dir: &Path) -> Result<Self> {
        let parent = match dir.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        std::fs::create_dir_all(&parent).map_err(|e| Error::io(&parent, e))?;
        if dir.exists() && !dir.is_dir() {
            return Err(Error::Checkpoint { dir: dir.into(), problem: "exists and is not a directory".into() });
        }
        // Mode 0777 less the umask, as any directory a program creates (tempfile's own is 0700).
        let tmp = tempfile::Builder::new()
            .prefix(".ladder-ckpt-")
            .permissions(std::os::unix::fs::PermissionsExt::from_mode(0o777))
            .tempdir_in(&parent)
            .map_err(|e| Error::io(&parent, e))?;
        Ok(Self { dir: dir.to_path_buf(), parent, tmp })
    }

    /// Writes `tensors` as the safetensors file `name` (e.g. [`MODEL_FILE`]), synced.
    ///
    /// # Errors
    /// [`Error::Io`] naming the file; [`Error::Torch`] if a tensor cannot be serialised.
    pub fn tensors(&self, name: &str, tensors: &[(String, Tensor)]) -> Result<()> {
        let path = self.tmp.path().join(name);
        crate::safetensors_file::write(&path, tensors)?;
        std::fs::File::open(&path).and_then(|f| f.sync_all()).map_err(|e| Error::io(&path, e))
    }

    /// Writes the training state and `extra_files`, then renames the checkpoint into place.
    ///
    /// # Errors
    /// [`Error::Io`] naming the file or directory that could not be written or renamed.
    pub fn finish(self, state: &TrainingState, extra_files: &[(&str, Vec<u8>)]) -> Result<()> {
        let Self { dir, parent, tmp } = self;
        let dir = dir.as_path();
        let json = serde_json::to_vec_pretty(state).expect("TrainingState serialises");
        crate::atomic::write_atomic(&tmp.path().join(STATE_FILE), &json)?;
        for (name, bytes) in extra_files {
            crate::atomic::write_atomic(&tmp.path().join(name), bytes)?;
        }
        std::fs::set_permissions(tmp.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).map_err(|e| Error::io(tmp.path(), e))?;
        let tmp_path = tmp.keep();
        let old = aside(dir);
        if old.exists() {
            // A previous kill between the renames: the target is already in place or absent.
            if dir.exists() {
                std::fs::remove_dir_all(&old).map_err(|e| Error::io(&old, e))?;
            } else {
                std::fs::rename(&old, dir).map_err(|e| Error::io(&old, e))?;
            }
        }
        let had_previous = dir.exists();
        if had_previous {
            std::fs::rename(dir, &old).map_err(|e| Error::io(dir, e))?;
        }
        std::fs::rename(&tmp_path, dir).map_err(|e| Error::io(dir, e))?;
        sync_dir(&parent)?;
        if had_previous {
            std::fs::remove_dir_all(&old).map_err(|e| Error::io(&old, e))?;
        }
        Ok(())
    }
}
// ANCHOR_END: checkpoint_save

/// Whether `dir` holds a complete checkpoint (or the previous one, moved aside by a save that
/// a kill interrupted): what [`load`] can read. A directory a kill left half-written never
/// counts: [`save`] renames only complete ones into place.
pub fn is_complete(dir: &Path) -> bool {
    [dir.to_path_buf(), aside(dir)].iter().any(|d| [MODEL_FILE, OPTIMIZER_FILE, STATE_FILE].iter().all(|f| d.join(f).is_file()))
}

/// Reads the checkpoint in `dir` (or, if a kill interrupted a save between its two renames,
/// the previous one moved aside next to it).
///
/// # Errors
/// [`Error::Checkpoint`] naming the directory and the missing or unreadable file;
/// [`Error::Torch`] for a corrupt safetensors file.
pub fn load(dir: &Path) -> Result<Checkpoint> {
    let dir = if dir.is_dir() {
        dir.to_path_buf()
    } else if aside(dir).is_dir() {
        aside(dir)
    } else {
        return Err(Error::Checkpoint {
            dir: dir.into(),
            problem: "no such checkpoint directory (expected one written by save_state / a checkpoint-<step> directory)".into(),
        });
    };
    let need = |name: &str| -> Result<PathBuf> {
        let p = dir.join(name);
        if p.is_file() {
            Ok(p)
        } else {
            Err(Error::Checkpoint { dir: dir.clone(), problem: format!("missing {name}") })
        }
    };
    let model = Tensor::read_safetensors(need(MODEL_FILE)?)?;
    let optimizer = Tensor::read_safetensors(need(OPTIMIZER_FILE)?)?;
    let state_path = need(STATE_FILE)?;
    let bytes = std::fs::read(&state_path).map_err(|e| Error::io(&state_path, e))?;
    let state: TrainingState =
        serde_json::from_slice(&bytes).map_err(|e| Error::Checkpoint { dir: dir.clone(), problem: format!("{STATE_FILE}: {e}") })?;
    Ok(Checkpoint { model, optimizer, state })
}

/// Checks that a checkpoint read from `dir` can resume training: past step 0 its optimizer
/// state must hold AdamW's moments (a checkpoint without them would restart AdamW from
/// zero moments: not the run that was saved).
///
/// # Errors
/// [`Error::Checkpoint`] naming the directory, the step and the missing state.
pub fn check_resumable(dir: &Path, ckpt: &Checkpoint) -> Result<()> {
    let has_moments = ckpt.optimizer.iter().any(|(k, _)| k.ends_with(".exp_avg"));
    if ckpt.state.global_step > 0 && !has_moments {
        return Err(Error::Checkpoint {
            dir: dir.into(),
            problem: format!(
                "{OPTIMIZER_FILE} holds no AdamW state, but the checkpoint is at step {}: resuming needs the optimizer's moments \
                 (save with save_state, which writes them)",
                ckpt.state.global_step
            ),
        });
    }
    Ok(())
}

/// Reads one extra file of a checkpoint (see [`save`]).
///
/// # Errors
/// [`Error::Checkpoint`] when it is missing.
pub fn read_extra(dir: &Path, name: &str) -> Result<Vec<u8>> {
    let dir = if dir.is_dir() { dir.to_path_buf() } else { aside(dir) };
    std::fs::read(dir.join(name)).map_err(|e| Error::Checkpoint { dir, problem: format!("cannot read {name}: {e}") })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(step: u64) -> Checkpoint {
        Checkpoint {
            model: vec![("fc.weight".into(), Tensor::from_slice(&[1.0f32, 2.0, 3.0]).view([3, 1]))],
            optimizer: vec![("fc.weight.step".into(), Tensor::from(step as i64))],
            state: TrainingState {
                global_step: step,
                batches_seen: step,
                epoch: 1,
                step_in_epoch: 7,
                samples_consumed: 7 * 64 * 2,
                seed: 3,
                world_size: 2,
                ..Default::default()
            },
        }
    }

    #[test]
    fn round_trip_replace_and_interrupted_rename() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("ckpt");
        save(&dir, &sample(5), &[("extra.json", b"{\"a\": 1.5}".to_vec())]).unwrap();
        let c = load(&dir).unwrap();
        assert_eq!(c.state.global_step, 5);
        assert_eq!(c.state.step_in_epoch, 7);
        assert_eq!(c.model[0].0, "fc.weight");
        assert_eq!(c.model[0].1.size(), vec![3, 1]);
        assert_eq!(Vec::<f32>::try_from(c.model[0].1.reshape([-1])).unwrap(), vec![1.0, 2.0, 3.0]);
        assert_eq!(read_extra(&dir, "extra.json").unwrap(), b"{\"a\": 1.5}");
        let json = std::fs::read_to_string(dir.join(STATE_FILE)).unwrap();
        assert!(json.contains("\"global_step\": 5,"), "{json}");
        // Overwrite: the new one wins, nothing is left beside it.
        save(&dir, &sample(9), &[]).unwrap();
        assert_eq!(load(&dir).unwrap().state.global_step, 9);
        let names: Vec<String> = std::fs::read_dir(root.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into()).collect();
        assert_eq!(names, vec!["ckpt".to_string()]);
        // A kill between the two renames: only the moved-aside previous checkpoint exists.
        std::fs::rename(&dir, aside(&dir)).unwrap();
        assert_eq!(load(&dir).unwrap().state.global_step, 9);
        assert!(is_complete(&dir));
        // The next save repairs it.
        save(&dir, &sample(11), &[]).unwrap();
        assert_eq!(load(&dir).unwrap().state.global_step, 11);
        assert!(!aside(&dir).exists());
        // Issue 27: the directory and its files get the modes of any other (0777 / 0666 less
        // the umask), not tempfile's 0700.
        use std::os::unix::fs::PermissionsExt;
        let (plain_dir, plain_file) = (root.path().join("plain"), root.path().join("plain.txt"));
        std::fs::create_dir(&plain_dir).unwrap();
        std::fs::File::create(&plain_file).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dir), mode(&plain_dir));
        assert_eq!(mode(&dir.join(STATE_FILE)), mode(&plain_file));
    }

    #[test]
    fn resume_position_keeps_the_order_at_the_same_world_size() {
        let s = TrainingState { step_in_epoch: 7, samples_consumed: 896, epoch_start: 0, world_size: 2, ..Default::default() };
        assert_eq!(s.resume_position(2), (0, 7));
        assert_eq!(s.resume_position(3), (896, 0));
        // Old checkpoints (no samples_consumed) still load.
        let old: TrainingState =
            serde_json::from_str(r#"{"global_step": 1, "batches_seen": 1, "epoch": 0, "step_in_epoch": 1, "seed": 1, "world_size": 1}"#)
                .unwrap();
        assert_eq!((old.samples_consumed, old.epoch_start), (0, 0));
    }

    #[test]
    fn errors_name_the_directory_and_file() {
        let root = tempfile::tempdir().unwrap();
        let err = load(&root.path().join("nope")).unwrap_err().to_string();
        assert!(err.contains("nope") && err.contains("no such checkpoint directory"), "{err}");
        let dir = root.path().join("c");
        save(&dir, &sample(1), &[]).unwrap();
        std::fs::remove_file(dir.join(OPTIMIZER_FILE)).unwrap();
        let err = load(&dir).unwrap_err().to_string();
        assert!(err.ends_with("missing optimizer.safetensors"), "{err}");
        let mut empty = sample(3);
        empty.optimizer.clear();
        let err = check_resumable(&dir, &empty).unwrap_err().to_string();
        assert!(err.contains("holds no AdamW state, but the checkpoint is at step 3"), "{err}");
        empty.state.global_step = 0;
        check_resumable(&dir, &empty).unwrap();
        std::fs::write(dir.join("file"), b"x").unwrap();
        let err = save(&dir.join("file"), &sample(1), &[]).unwrap_err().to_string();
        assert!(err.contains("exists and is not a directory"), "{err}");
    }
}
