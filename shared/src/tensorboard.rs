//! TensorBoard event files: the one writer levels 2 and 3 log through (level 2's
//! `log_with="tensorboard"` tracker, as Accelerate's `TensorBoardTracker`; level 3's
//! `report_to="tensorboard"`, as Transformers' `TensorBoardCallback`).
//!
//! As PyTorch's `torch.utils.tensorboard.SummaryWriter(log_dir)` writes them: one file
//! `events.out.tfevents.<unix seconds>.<host>.<pid>.<n>` per writer in its log directory
//! (created with its missing parents), starting with the `brain.Event:2` version record, then
//! one record per scalar — its tag, its value as a 32-bit float (`simple_value`, as
//! `add_scalar` writes it), the step and the wall time — flushed as it is written, so
//! TensorBoard shows a run while it trains and a killed run keeps what it logged. The records
//! (TFRecord framing with masked CRC-32C, the `Event` protobuf) are written by the
//! `syntaxdot-summary` crate.

use crate::{Error, Result};
use std::fs::File;
use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Writers opened by this process, for the file name's last part (PyTorch's `global_uid`): two
/// writers opened in the same second in one directory get two files.
static OPENED: AtomicU64 = AtomicU64::new(0);

/// An open event file (PyTorch's `SummaryWriter`, scalars only).
pub struct SummaryWriter {
    writer: syntaxdot_summary::SummaryWriter<BufWriter<File>>,
    path: PathBuf,
}

impl std::fmt::Debug for SummaryWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SummaryWriter").field("path", &self.path).finish()
    }
}

impl SummaryWriter {
    /// Creates `log_dir` (and its missing parents) and a new event file in it, named as
    /// PyTorch names it: `events.out.tfevents.<unix seconds>.<host>.<pid>.<n>`.
    ///
    /// # Errors
    /// [`Error::Io`] naming the directory or the file that could not be created.
    pub fn new(log_dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(log_dir).map_err(|e| Error::io(log_dir, e))?;
        let seconds = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let n = OPENED.fetch_add(1, Ordering::Relaxed);
        let name = format!("events.out.tfevents.{seconds}.{}.{}.{n}", hostname(), std::process::id());
        let path = log_dir.join(name);
        let file = File::create(&path).map_err(|e| Error::io(&path, e))?;
        let writer = syntaxdot_summary::SummaryWriter::new(BufWriter::new(file)).map_err(|e| Error::io(&path, e))?;
        Ok(Self { writer, path })
    }

    /// Writes one scalar (`add_scalar(tag, value, global_step=step)`): `value` is stored as an
    /// `f32`, as TensorBoard's scalars are; the record is flushed to the file.
    ///
    /// # Errors
    /// [`Error::Io`] naming the event file.
    pub fn add_scalar(&mut self, tag: &str, value: f64, step: u64) -> Result<()> {
        let step = i64::try_from(step).unwrap_or(i64::MAX);
        self.writer.write_scalar(tag, step, value as f32).map_err(|e| Error::io(&self.path, e))
    }

    /// The event file written.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// This machine's host name, as Python's `socket.gethostname()` (`localhost` when the system
/// gives none): the event file's name and Transformers' default `logging_dir` use it.
pub fn hostname() -> String {
    hostname::get().ok().and_then(|h| h.into_string().ok()).filter(|h| !h.is_empty()).unwrap_or_else(|| "localhost".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_files_are_named_as_pytorch_names_them_and_hold_framed_records() {
        let dir = tempfile::tempdir().unwrap();
        let log_dir = dir.path().join("a/b");
        let mut w = SummaryWriter::new(&log_dir).unwrap();
        let mut w2 = SummaryWriter::new(&log_dir).unwrap();
        assert_ne!(w.path(), w2.path(), "two writers, two files");
        let name = w.path().file_name().unwrap().to_str().unwrap().to_string();
        let parts: Vec<&str> = name.split('.').collect();
        assert_eq!(&parts[..3], ["events", "out", "tfevents"], "{name}");
        assert!(parts[3].parse::<u64>().is_ok(), "{name}");
        // The host may hold dots: the pid and the writer's number are the last two parts.
        assert_eq!(parts[parts.len() - 2], std::process::id().to_string(), "{name}");
        assert!(name.contains(&format!(".{}.", hostname())), "{name}");
        let before = std::fs::metadata(w.path()).unwrap().len();
        w.add_scalar("train/loss", 0.5, 3).unwrap();
        w2.add_scalar("x", 1.0, 0).unwrap();
        // Flushed at once: one more record (8-byte length, 4-byte CRC, data, 4-byte CRC).
        let bytes = std::fs::read(w.path()).unwrap();
        assert!(bytes.len() as u64 > before);
        let len = u64::from_le_bytes(bytes[before as usize..before as usize + 8].try_into().unwrap());
        assert_eq!(bytes.len() as u64, before + 8 + 4 + len + 4);
        assert!(bytes.windows(10).any(|w| w == b"train/loss"));
    }

    #[test]
    fn an_unwritable_log_dir_is_named() {
        let err = SummaryWriter::new(Path::new("/dev/null/runs")).unwrap_err();
        assert!(err.to_string().contains("/dev/null/runs"), "{err}");
    }
}
