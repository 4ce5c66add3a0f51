//! Where each rank was last seen: its training step and its collective (operation and sequence
//! number), kept in a per-job directory that peers and the launcher can read — so that a rank
//! that times out, and `ladder-run`'s failure summary, can name the rank that stopped making
//! progress ("rank 1 last seen at step 37, before all_reduce #112").
//!
//! Each rank owns one file `rank{R}` of [`WORDS`] little-endian `u64` words, mapped shared
//! into memory: updating it is a few plain stores, no system call. The directory is
//! `$LADDER_PROGRESS_DIR` (set by `ladder-run`, which removes it at the end); under a bare
//! `mpirun`, `/dev/shm/ladder-progress-<Open MPI job id>` (else under `$TMPDIR`), from which
//! each rank removes its own file when its group shuts down cleanly. Without either, nothing is
//! recorded and errors say that progress is unknown.

use crate::sys;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// The environment variable naming the per-job progress directory.
pub const PROGRESS_DIR_VAR: &str = "LADDER_PROGRESS_DIR";

/// Words of a record: magic, pid, sequence number, step, operation code, phase.
pub const WORDS: usize = 6;
const MAGIC: u64 = 0x4c41_4444_5052_4731; // "LADDPRG1"

static STEP: AtomicU64 = AtomicU64::new(0);

/// Sets this process's current training step (1-based; 0 is set-up). Every level calls it
/// through [`crate::train::seed_batch`] before each batch; collectives record it.
pub fn set_step(step: u64) {
    STEP.store(step, Ordering::Relaxed);
}

/// The step last set with [`set_step`].
pub fn step() -> u64 {
    STEP.load(Ordering::Relaxed)
}

/// The collectives, by the code a record stores.
const OPS: [&str; 6] = ["(none)", "all_reduce", "broadcast", "all_gather", "reduce_scatter", "barrier"];

fn op_code(op: &str) -> u64 {
    // Coalesced forms are recorded as their base operation.
    let base = op.trim_end_matches("_coalesced");
    OPS.iter().position(|o| *o == base).unwrap_or(0) as u64
}

impl Seen {
    /// True when the kernel says the rank's process is stopped (SIGSTOP, a debugger): it is
    /// stuck wherever its record says it is, even inside the collective the others wait in.
    pub fn is_stopped(&self) -> bool {
        matches!(sys::process_state(self.pid), Some('T') | Some('t'))
    }
}

/// What a rank's record says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seen {
    /// The rank.
    pub rank: usize,
    /// Its process id.
    pub pid: u32,
    /// Sequence number of its latest collective (1-based; 0: none yet).
    pub seq: u64,
    /// Its training step when that collective started.
    pub step: u64,
    /// The collective's name (`all_reduce`, …).
    pub op: &'static str,
    /// True while it waits in that collective; false once it completed.
    pub waiting: bool,
}

impl Seen {
    /// `last seen at step S, waiting in all_reduce #N` (or `after …`), plus `(process … is
    /// stopped …)` when the kernel says it is stopped (SIGSTOP, a debugger).
    pub fn describe(&self) -> String {
        let at = if self.seq == 0 {
            format!("last seen at step {}, before its first collective", self.step)
        } else if self.waiting {
            format!("last seen at step {}, waiting in {} #{}", self.step, self.op, self.seq)
        } else {
            format!("last seen at step {}, after {} #{}", self.step, self.op, self.seq)
        };
        match sys::process_state(self.pid) {
            Some('T') | Some('t') => format!("{at} (process {} is stopped: SIGSTOP or a debugger)", self.pid),
            _ => at,
        }
    }
}

/// The progress directory of this job, if one can be named: `$LADDER_PROGRESS_DIR`, else one
/// derived from Open MPI's job id (`OMPI_MCA_ess_base_jobid`).
pub fn job_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os(PROGRESS_DIR_VAR).filter(|d| !d.is_empty()) {
        return Some(PathBuf::from(d));
    }
    let job = std::env::var("OMPI_MCA_ess_base_jobid").ok().filter(|j| j.chars().all(|c| c.is_ascii_alphanumeric()))?;
    Some(shm_base().join(format!("ladder-progress-{job}")))
}

/// `/dev/shm` when it exists (memory-backed), else the temporary directory.
pub fn shm_base() -> PathBuf {
    let shm = Path::new("/dev/shm");
    if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    }
}

fn record_path(dir: &Path, rank: usize) -> PathBuf {
    dir.join(format!("rank{rank}"))
}

/// This rank's record, mapped into memory.
#[derive(Debug)]
pub struct Recorder {
    words: sys::SharedWords,
    path: PathBuf,
}

impl Recorder {
    /// Creates (or truncates) `dir/rank{rank}` and maps it. `None` when the directory cannot be
    /// used (progress is then simply not recorded).
    pub fn open(dir: &Path, rank: usize) -> Option<Self> {
        std::fs::create_dir_all(dir).ok()?;
        let path = record_path(dir, rank);
        let file = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).ok()?;
        file.set_len((WORDS * 8) as u64).ok()?;
        let words = sys::SharedWords::map(&file, WORDS).ok()?;
        words.store(1, u64::from(std::process::id()));
        words.store(3, step());
        words.store(0, MAGIC);
        if std::env::var_os(PROGRESS_DIR_VAR).is_none() {
            // A directory derived under bare mpirun: nobody else removes this record.
            sys::remove_at_exit(path.clone());
        }
        Some(Self { words, path })
    }

    /// Records that collective `seq` (`op`) starts at the current step.
    pub fn enter(&self, seq: u64, op: &str) {
        self.words.store(5, 1);
        self.words.store(3, step());
        self.words.store(4, op_code(op));
        self.words.store(2, seq);
    }

    /// Records that collective `seq` completed.
    pub fn leave(&self, seq: u64) {
        let _ = seq;
        self.words.store(5, 0);
    }

    /// Removes the record (a clean shutdown), and the directory when it is then empty.
    pub fn remove(&self) {
        let _ = std::fs::remove_file(&self.path);
        if let Some(dir) = self.path.parent() {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// Reads rank `rank`'s record from `dir`; `None` when there is none (yet) or it is unreadable.
pub fn read(dir: &Path, rank: usize) -> Option<Seen> {
    let bytes = std::fs::read(record_path(dir, rank)).ok()?;
    if bytes.len() < WORDS * 8 {
        return None;
    }
    let w = |i: usize| u64::from_le_bytes(bytes[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
    if w(0) != MAGIC {
        return None;
    }
    Some(Seen {
        rank,
        pid: w(1) as u32,
        seq: w(2),
        step: w(3),
        op: OPS.get(w(4) as usize).copied().unwrap_or("(none)"),
        waiting: w(5) == 1,
    })
}

/// The ranks (of `0..world_size`, other than `me`) that have not reached collective `seq`, each
/// with a description of where it was last seen; a rank with no record is listed as unknown.
pub fn behind(dir: Option<&Path>, world_size: usize, me: usize, seq: u64, op: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for r in (0..world_size).filter(|&r| r != me) {
        match dir.and_then(|d| read(d, r)) {
            Some(s) if s.seq >= seq && !s.is_stopped() => {}
            Some(s) if s.seq + 1 == seq && !s.waiting => out.push((r, before(&s, seq, op))),
            Some(s) => out.push((r, s.describe())),
            None => out.push((r, "no progress record (where it is is unknown)".into())),
        }
    }
    out
}

/// `last seen at step S, before OP #SEQ` for a rank that completed the collective before `seq`.
fn before(s: &Seen, seq: u64, op: &str) -> String {
    let text = s.describe();
    let after = format!("after {} #{}", s.op, s.seq);
    text.replacen(&after, &format!("before {op} #{seq}"), 1)
}

/// Everyone's record, for the launcher's summary: the ranks that are behind the furthest rank
/// still waiting in a collective, each as `rank R last seen at …`. Empty when no rank waits or
/// nothing was recorded.
/// `stopped` lists ranks the launcher saw stopped (SIGSTOP) while the job ran: they are named
/// even when their record shows them inside the collective the others wait in.
pub fn stuck_summary(dir: &Path, world_size: usize, stopped: &[usize]) -> Vec<String> {
    let seen: Vec<Seen> = (0..world_size).filter_map(|r| read(dir, r)).collect();
    let Some(front) = seen.iter().filter(|s| s.waiting).max_by_key(|s| s.seq) else { return Vec::new() };
    let mut lines = Vec::new();
    for r in 0..world_size {
        let was_stopped = stopped.contains(&r);
        match seen.iter().find(|s| s.rank == r) {
            Some(s) if was_stopped && !s.is_stopped() => {
                lines.push(format!("rank {r} {} (it was stopped: SIGSTOP or a debugger)", s.describe()))
            }
            Some(s) if s.seq >= front.seq && !s.is_stopped() => {}
            Some(s) if s.seq + 1 == front.seq && !s.waiting => {
                lines.push(format!("rank {r} {}", before(s, front.seq, front.op)))
            }
            Some(s) => lines.push(format!("rank {r} {}", s.describe())),
            None => lines.push(format!("rank {r} never recorded progress")),
        }
    }
    if !lines.is_empty() {
        let waiting: Vec<String> = seen
            .iter()
            .filter(|s| s.waiting && s.seq == front.seq && !stopped.contains(&s.rank) && !s.is_stopped())
            .map(|s| s.rank.to_string())
            .collect();
        lines.push(format!(
            "rank(s) {} waited for it in {} #{} (step {})",
            waiting.join(", "),
            front.op,
            front.seq,
            front.step
        ));
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_are_read_back_and_the_rank_behind_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let a = Recorder::open(dir.path(), 0).unwrap();
        let b = Recorder::open(dir.path(), 1).unwrap();
        set_step(37);
        b.enter(111, "all_reduce");
        b.leave(111);
        a.enter(112, "all_reduce");
        let s = read(dir.path(), 0).unwrap();
        assert_eq!((s.seq, s.step, s.op, s.waiting), (112, 37, "all_reduce", true));
        let behind = behind(Some(dir.path()), 2, 0, 112, "all_reduce");
        assert_eq!(behind.len(), 1);
        assert_eq!(behind[0].0, 1);
        assert!(behind[0].1.starts_with("last seen at step 37, before all_reduce #112"), "{}", behind[0].1);
        let lines = stuck_summary(dir.path(), 2, &[]);
        assert!(lines[0].starts_with("rank 1 last seen at step 37, before all_reduce #112"), "{lines:?}");
        assert_eq!(lines[1], "rank(s) 0 waited for it in all_reduce #112 (step 37)");
        // Once rank 1 arrives, nobody is behind.
        b.enter(112, "all_reduce");
        assert!(super::behind(Some(dir.path()), 2, 0, 112, "all_reduce").is_empty());
        a.remove();
        assert!(read(dir.path(), 0).is_none());
    }
}
