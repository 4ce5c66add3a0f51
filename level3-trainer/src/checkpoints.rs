//! Checkpoint directories in output_dir (`checkpoint-<global_step>/`) and save_total_limit
//! rotation, as Transformers' `_sorted_checkpoints` / `_rotate_checkpoints` /
//! `get_last_checkpoint`.
//!
//! Checkpoints are ordered by their step *number* (`checkpoint-1000` after `checkpoint-999`),
//! never by name. Rotation deletes the oldest first but never the best checkpoint (it is moved
//! just before the newest one) and never the newest one: with `save_total_limit = 1` and a best
//! checkpoint that is not the newest, two are kept. A limit of `n ≥ 1` never leaves zero.

use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

/// Prefix of checkpoint directory names.
pub const PREFIX: &str = "checkpoint-";

/// `output_dir/checkpoint-<step>`.
pub fn checkpoint_dir(output_dir: &Path, step: u64) -> PathBuf {
    output_dir.join(format!("{PREFIX}{step}"))
}

/// The step of a checkpoint directory name (`checkpoint-470` → 470); `None` for other names
/// (including temporary `checkpoint-470.tmp…` directories).
pub fn checkpoint_step(dir: &Path) -> Option<u64> {
    let name = dir.file_name()?.to_str()?;
    let digits = name.strip_prefix(PREFIX)?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The checkpoint directories in `output_dir`, sorted by step number; `best` (if among them)
/// moved to the second-to-last place so that rotation, which deletes from the front, keeps it.
/// A missing output_dir has none.
///
/// # Errors
/// [`Error::Io`] if output_dir exists but cannot be listed.
pub fn sorted_checkpoints(output_dir: &Path, best: Option<&Path>) -> Result<Vec<PathBuf>> {
    let entries = match std::fs::read_dir(output_dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io(output_dir, e)),
    };
    let mut found: Vec<(u64, PathBuf)> = Vec::new();
    for entry in entries {
        let path = entry.map_err(|e| Error::io(output_dir, e))?.path();
        if let Some(step) = checkpoint_step(&path) {
            if path.is_dir() {
                found.push((step, path));
            }
        }
    }
    found.sort_by_key(|(step, _)| *step);
    let mut sorted: Vec<PathBuf> = found.into_iter().map(|(_, p)| p).collect();
    if let Some(i) = best.and_then(|b| sorted.iter().position(|p| p.file_name() == b.file_name())) {
        let n = sorted.len();
        if n >= 2 && i < n - 2 {
            let best = sorted.remove(i);
            sorted.insert(n - 2, best);
        }
    }
    Ok(sorted)
}

/// The files a Trainer run writes at the top of output_dir (besides `checkpoint-<step>/`):
/// what [`run_files`] finds and what overwrite_output_dir replaces.
pub const RUN_FILES: &[&str] =
    &["training_args.json", "trainer_state.json", "model.safetensors", "loss.svg", "log_history.jsonl", "log_history.csv"];

/// What a previous Trainer run left in `output_dir`: its `checkpoint-<step>/` directories
/// (sorted by step) and the [`RUN_FILES`] present; other files are not the Trainer's and are
/// not listed. A missing output_dir holds none.
///
/// # Errors
/// [`Error::Io`] if output_dir exists but cannot be listed.
pub fn run_files(output_dir: &Path) -> Result<Vec<PathBuf>> {
    let mut found = sorted_checkpoints(output_dir, None)?;
    found.extend(RUN_FILES.iter().map(|f| output_dir.join(f)).filter(|p| p.exists()));
    Ok(found)
}

/// The newest checkpoint (highest step) in `output_dir`, as Transformers' `get_last_checkpoint`.
///
/// # Errors
/// [`Error::Io`] if output_dir cannot be listed.
pub fn last_checkpoint(output_dir: &Path) -> Result<Option<PathBuf>> {
    Ok(sorted_checkpoints(output_dir, None)?.pop())
}

/// Deletes the oldest checkpoints beyond `save_total_limit`, keeping `best` and the newest
/// one; returns the deleted directories. `None` keeps everything.
///
/// # Errors
/// [`Error::Io`] naming a directory that could not be listed or removed.
pub fn rotate_checkpoints(output_dir: &Path, save_total_limit: Option<usize>, best: Option<&Path>) -> Result<Vec<PathBuf>> {
    let Some(limit) = save_total_limit.filter(|&l| l > 0) else {
        return Ok(Vec::new());
    };
    let sorted = sorted_checkpoints(output_dir, best)?;
    if sorted.len() <= limit {
        return Ok(Vec::new());
    }
    let best_is_newest = match (best, sorted.last()) {
        (Some(b), Some(last)) => b.file_name() == last.file_name(),
        _ => true,
    };
    let limit = if limit == 1 && !best_is_newest { 2 } else { limit };
    let doomed: Vec<PathBuf> = sorted[..sorted.len().saturating_sub(limit)].to_vec();
    for dir in &doomed {
        std::fs::remove_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    }
    Ok(doomed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn make(dir: &Path, steps: &[u64]) {
        for s in steps {
            std::fs::create_dir_all(checkpoint_dir(dir, *s)).unwrap();
        }
    }

    fn left(dir: &Path) -> Vec<u64> {
        let mut v: Vec<u64> = sorted_checkpoints(dir, None).unwrap().iter().map(|p| checkpoint_step(p).unwrap()).collect();
        v.sort();
        v
    }

    #[test]
    fn sorted_by_step_number_not_by_name() {
        let d = tempfile::tempdir().unwrap();
        make(d.path(), &[1000, 999, 20, 3]);
        std::fs::create_dir_all(d.path().join("checkpoint-50.tmp123")).unwrap();
        std::fs::create_dir_all(d.path().join("runs")).unwrap();
        std::fs::write(d.path().join("checkpoint-7"), b"a file, not a checkpoint").unwrap();
        let steps: Vec<u64> = sorted_checkpoints(d.path(), None).unwrap().iter().map(|p| checkpoint_step(p).unwrap()).collect();
        assert_eq!(steps, [3, 20, 999, 1000]);
        assert_eq!(last_checkpoint(d.path()).unwrap().unwrap(), checkpoint_dir(d.path(), 1000));
        assert_eq!(last_checkpoint(&d.path().join("absent")).unwrap(), None);
    }

    #[test]
    fn limit_two_keeps_the_early_best_and_the_newest() {
        let d = tempfile::tempdir().unwrap();
        make(d.path(), &[100, 200, 300, 400, 1000]);
        let best = checkpoint_dir(d.path(), 100);
        let deleted = rotate_checkpoints(d.path(), Some(2), Some(&best)).unwrap();
        assert_eq!(deleted.len(), 3);
        assert_eq!(left(d.path()), [100, 1000]);
    }

    #[test]
    fn limit_one_keeps_best_and_newest_or_only_the_newest_best() {
        let d = tempfile::tempdir().unwrap();
        make(d.path(), &[5, 10, 15]);
        rotate_checkpoints(d.path(), Some(1), Some(&checkpoint_dir(d.path(), 5))).unwrap();
        assert_eq!(left(d.path()), [5, 15]);
        // The best is the newest: one is kept.
        make(d.path(), &[20]);
        rotate_checkpoints(d.path(), Some(1), Some(&checkpoint_dir(d.path(), 20))).unwrap();
        assert_eq!(left(d.path()), [20]);
        // No best tracked: the newest.
        make(d.path(), &[25, 30]);
        rotate_checkpoints(d.path(), Some(1), None).unwrap();
        assert_eq!(left(d.path()), [30]);
    }

    #[test]
    fn no_limit_or_under_the_limit_deletes_nothing() {
        let d = tempfile::tempdir().unwrap();
        make(d.path(), &[1, 2, 3]);
        assert!(rotate_checkpoints(d.path(), None, None).unwrap().is_empty());
        assert!(rotate_checkpoints(d.path(), Some(3), None).unwrap().is_empty());
        assert_eq!(left(d.path()), [1, 2, 3]);
        // Oldest first, by number: 9 goes before 10.
        make(d.path(), &[9, 10]);
        rotate_checkpoints(d.path(), Some(2), None).unwrap();
        assert_eq!(left(d.path()), [9, 10]);
    }
}
