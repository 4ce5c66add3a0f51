//! What a run saves and restores: the output directory at the start of training (a previous
//! run's files refused, or replaced with overwrite_output_dir; training_args.json), `checkpoint-<step>/` through the
//! Accelerator's `save_state` with the Trainer's own files, and resuming from one.

use super::loss_sums::LossSums;
use super::{ResumeFrom, Trainer, SCHEDULER_FILE, TRAINER_STATE_FILE, TRAINING_ARGS_FILE};
use crate::checkpoints;
use crate::error::{Error, Result};
use crate::schedule::TrainingPlan;
use crate::state::TrainerState;
use std::path::{Path, PathBuf};

/// Where a resumed run picks up: the loader's position, the global step and the loss sums.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Resumed {
    /// The epoch the checkpoint was written in.
    pub(super) epoch: usize,
    /// Micro-batches of that epoch to skip: those already trained at the same world size; 0
    /// at another (the rest of the epoch is split between the new ranks).
    pub(super) step_in_epoch: usize,
    /// The checkpoint was written at another world size.
    pub(super) world_size_changed: bool,
    /// Optimization steps done.
    pub(super) global_step: u64,
    /// The loss sums at the checkpoint (rank 0 carries the sums over ranks).
    pub(super) sums: LossSums,
}

impl Trainer {
    /// The checkpoint directory `resume_from_checkpoint` names, if any. Without one, a run
    /// restarted by its launcher (`TORCHELASTIC_RESTART_COUNT` > 0: `ladder-run
    /// --max-restarts`) resumes from the newest checkpoint in output_dir, if there is one.
    ///
    /// # Errors
    /// [`Error::NoCheckpoint`] for [`ResumeFrom::Last`] in an output_dir without one.
    pub(super) fn resume_dir(&self, resume_from_checkpoint: Option<&ResumeFrom>) -> Result<Option<PathBuf>> {
        let out_dir = &self.args.output_dir;
        Ok(match resume_from_checkpoint {
            None if ladder_core::launch::restart_count() > 0 => checkpoints::last_checkpoint(out_dir)?,
            None => None,
            Some(ResumeFrom::Dir(d)) => Some(d.clone()),
            Some(ResumeFrom::Last) => {
                Some(checkpoints::last_checkpoint(out_dir)?.ok_or_else(|| Error::NoCheckpoint { dir: out_dir.clone() })?)
            }
        })
    }

    /// The output-directory policy, checked before anything is written (as Transformers'
    /// "Output directory already exists and is not empty" check): a fresh run refuses an
    /// output_dir holding a previous run's files (`checkpoint-<step>/`, model.safetensors,
    /// trainer_state.json, …: [`checkpoints::run_files`]) unless overwrite_output_dir is set;
    /// a resume keeps them. Writes nothing.
    ///
    /// # Errors
    /// [`Error::OutputDirNotEmpty`] naming the directory, what it holds and the two ways on.
    pub(super) fn check_output_dir(&self, resuming: bool) -> Result<()> {
        if resuming || self.args.overwrite_output_dir {
            return Ok(());
        }
        let out_dir = &self.args.output_dir;
        let existing = checkpoints::run_files(out_dir)?;
        if existing.is_empty() {
            return Ok(());
        }
        let names: Vec<String> = existing.iter().filter_map(|p| p.file_name()).map(|n| n.to_string_lossy().into_owned()).collect();
        let found = match names.len() {
            0..=8 => names.join(", "),
            n => format!("{}, … ({n} in all)", names[..8].join(", ")),
        };
        Err(Error::OutputDirNotEmpty { dir: out_dir.clone(), found })
    }

    /// Makes output_dir ready once the run is known to start (arguments, output-directory
    /// policy and resume checked): with overwrite_output_dir and no resume, rank 0 removes the
    /// previous run's files ([`checkpoints::run_files`]; nothing else in the directory), so
    /// that no stale checkpoint, log or model is left beside the new run's; then rank 0 writes
    /// training_args.json. Collective.
    ///
    /// # Errors
    /// [`Error::Io`] naming a file or directory that could not be removed or written.
    pub(super) fn start_output_dir(&self, resuming: bool) -> Result<()> {
        self.accelerator.wait_for_everyone()?;
        if self.accelerator.is_main_process() {
            if !resuming && self.args.overwrite_output_dir {
                for path in checkpoints::run_files(&self.args.output_dir)? {
                    let removed = if path.is_dir() { std::fs::remove_dir_all(&path) } else { std::fs::remove_file(&path) };
                    removed.map_err(|e| Error::io(&path, e))?;
                }
            }
            self.args.write_json()?;
        }
        self.accelerator.wait_for_everyone()?;
        Ok(())
    }

    /// Restores a checkpoint: weights, optimizer, loader position and counters (the
    /// Accelerator's `load_state`), then the Trainer's own state and loss sums.
    ///
    /// # Errors
    /// Unreadable checkpoint files; a trainer_state.json whose global_step disagrees with the
    /// Accelerator's training_state.json.
    pub(super) fn resume(&mut self, dir: &Path, plan: &TrainingPlan) -> Result<Resumed> {
        let rank = self.accelerator.process_index();
        let position = self.accelerator.load_state(dir)?;
        let state_file = dir.join(TRAINER_STATE_FILE);
        self.state = TrainerState::load(&state_file)?;
        self.state.is_world_process_zero = rank == 0;
        self.state.max_steps = plan.max_steps as u64;
        if position.global_step != self.state.global_step {
            return Err(Error::BadCheckpoint {
                file: state_file,
                problem: format!("global_step {} but training_state.json says {}", self.state.global_step, position.global_step),
            });
        }
        let world_size = self.accelerator.num_processes();
        let (_, skip) = position.resume_position(world_size);
        if position.world_size == world_size {
            self.say(&format!(
                "Resuming from {} at step {} (epoch {}, batch {} of the epoch)",
                dir.display(),
                position.global_step,
                position.epoch,
                position.step_in_epoch
            ));
        } else {
            self.say(&format!(
                "Resuming from {} at step {} (epoch {}, {} samples of the epoch trained) at {world_size} processes instead of {}: \
                 the rest of the epoch is split between them",
                dir.display(),
                position.global_step,
                position.epoch,
                position.samples_consumed,
                position.world_size
            ));
        }
        Ok(Resumed {
            epoch: position.epoch as usize,
            step_in_epoch: skip as usize,
            world_size_changed: position.world_size != world_size,
            global_step: position.global_step,
            sums: LossSums::from_extra(&position.extra, rank),
        })
    }

    /// Writes output_dir/checkpoint-<step>/ through `accelerator.save_state` (the main
    /// process, atomically) with trainer_state.json, scheduler.json and training_args.json,
    /// then rotates. Collective.
    pub(super) fn save_checkpoint(&mut self, sums: &LossSums, new_best: bool) -> Result<()> {
        let dir = checkpoints::checkpoint_dir(&self.args.output_dir, self.state.global_step);
        let extra = sums.checkpoint_extra(&self.accelerator)?;
        if new_best || self.state.best_global_step == Some(self.state.global_step) {
            self.state.best_model_checkpoint = Some(dir.clone());
        }
        let scheduler = serde_json::json!({ "last_epoch": self.state.global_step, "lr_scheduler_type": self.args.lr_scheduler_type });
        let files = [
            (TRAINER_STATE_FILE, serde_json::to_vec_pretty(&self.state).expect("TrainerState serialises")),
            (SCHEDULER_FILE, serde_json::to_vec_pretty(&scheduler).expect("json")),
            (TRAINING_ARGS_FILE, serde_json::to_vec_pretty(&self.args).expect("TrainingArguments serialise")),
        ];
        self.accelerator.save_state_with(&dir, extra, &files)?;
        if self.accelerator.is_main_process() {
            checkpoints::rotate_checkpoints(
                &self.args.output_dir,
                self.args.save_total_limit,
                self.state.best_model_checkpoint.as_deref(),
            )?;
        }
        self.accelerator.wait_for_everyone()?;
        Ok(())
    }
}
