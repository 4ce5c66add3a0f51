//! Where each rank was last seen: its training step and its collective (operation and sequence
//! number), kept in a per-job directory that peers and the launcher can read — so that a rank
//! that times out, and `ladder-run`'s failure summary, can name the rank that stopped making
//! progress ("rank 1 last seen at step 37, before all_reduce #112").
//!
//! Each rank owns one file `rank{R}` of [`WORDS`] little-endian `u64` words, mapped shared
//! into memory: updating it is a few plain stores, no system call. The directory is
//! `$LADDER_PROGRESS_DIR` (set by `ladder-run`, which removes it at the end); under a bare
//! `mpirun`, `/dev/shm/ladder-progress-<Open MPI job id>` (else under `$TMPDIR`). Without
//! either, nothing is recorded and errors say that progress is unknown.
//!
//! Under a bare `mpirun` nobody else cleans up, so every exit path a rank controls removes its
//! own record (and the directory once empty): a clean shutdown; an error returned from `main`
//! and a panic (both end through `exit`, whose `atexit` handler removes it); the SIGTERM or
//! SIGINT with which `mpirun` stops the other ranks of a failed job (a signal handler that
//! unlinks and re-raises); a job aborted after a timeout (the whole directory, before
//! `MPI_Abort`). What no process can handle — SIGKILL, the OOM killer, a power cut — is swept
//! by the next job: when a rank opens its record under a bare `mpirun`, it removes every
//! `ladder-progress-*` directory whose job is gone ([`sweep_stale`]: no record names a live
//! process, and nothing changed in it for a minute).

use crate::sys;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// The environment variable naming the per-job progress directory.
pub const PROGRESS_DIR_VAR: &str = "LADDER_PROGRESS_DIR";

/// Words of a record: magic, pid, sequence number, step, operation code, phase.
pub const WORDS: usize = 6;
const MAGIC: u64 = 0x4c41_4444_5052_4731; // "LADDPRG1"

static STEP: AtomicU64 = AtomicU64::new(0);

/// Sets this process's current training step (1-based; 0 is set-up). The levels call it
/// before each batch (beside [`crate::recipe::seed_batch`]); collectives record it.
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
            sys::remove_on_termination_signal(&path);
            if let Some(base) = dir.parent() {
                sweep_stale(base, STALE_AFTER);
            }
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

/// How long a progress directory must have stayed unchanged before [`sweep_stale`] may
/// remove it: a job's ranks create their records within this time of each other.
pub const STALE_AFTER: std::time::Duration = std::time::Duration::from_secs(60);

/// Removes the `ladder-progress-*` directories under `base` whose job is gone — left by ranks
/// killed with SIGKILL (or the OOM killer), which no handler can clean up. A directory is
/// stale when no record in it names a live process, no launcher named by it is alive
/// (`ladder-progress-run-<pid>`, `ladder-run`'s), and it has not changed for `unchanged_for`
/// (a job that is still starting up). A reused pid only keeps a stale directory until a later
/// sweep. Returns the directories removed.
pub fn sweep_stale(base: &Path, unchanged_for: std::time::Duration) -> Vec<PathBuf> {
    let alive = |pid: u32| pid > 0 && sys::process_state(pid).is_some_and(|s| s != 'Z' && s != 'X');
    let mut removed = Vec::new();
    let Ok(entries) = std::fs::read_dir(base) else { return removed };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(job) = name.strip_prefix("ladder-progress-") else { continue };
        let dir = entry.path();
        let recent = std::fs::symlink_metadata(&dir)
            .ok()
            .filter(|m| m.is_dir())
            .map(|m| m.modified().ok().and_then(|t| t.elapsed().ok()).is_none_or(|age| age < unchanged_for));
        if recent != Some(false) {
            continue; // not a directory, or changed recently
        }
        if job.strip_prefix("run-").and_then(|p| p.parse::<u32>().ok()).is_some_and(alive) {
            continue; // its ladder-run is alive and removes it itself
        }
        let live_record = std::fs::read_dir(&dir).into_iter().flatten().flatten().any(|f| {
            let rank = f.file_name().to_string_lossy().strip_prefix("rank").and_then(|r| r.parse::<usize>().ok());
            rank.and_then(|r| read(&dir, r)).is_some_and(|s| alive(s.pid))
        });
        if !live_record && std::fs::remove_dir_all(&dir).is_ok() {
            removed.push(dir);
        }
    }
    removed
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
            Some(s) if s.seq + 1 == front.seq && !s.waiting => lines.push(format!("rank {r} {}", before(s, front.seq, front.op))),
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
        lines.push(format!("rank(s) {} waited for it in {} #{} (step {})", waiting.join(", "), front.op, front.seq, front.step));
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

    /// Ages a directory's modification time by `secs`.
    fn age(dir: &Path, secs: u64) {
        let then = std::time::SystemTime::now() - std::time::Duration::from_secs(secs);
        std::fs::File::open(dir).unwrap().set_modified(then).unwrap();
    }

    #[test]
    fn stale_directories_of_dead_jobs_are_swept_and_live_or_young_ones_kept() {
        let base = tempfile::tempdir().unwrap();
        let dead_pid = {
            let mut child = std::process::Command::new("true").spawn().unwrap();
            let pid = child.id();
            child.wait().unwrap();
            pid
        };
        let write_record = |dir: &Path, rank: usize, pid: u32| {
            std::fs::create_dir_all(dir).unwrap();
            let mut bytes = Vec::new();
            for w in [MAGIC, u64::from(pid), 3, 2, 1, 1] {
                bytes.extend_from_slice(&w.to_le_bytes());
            }
            std::fs::write(record_path(dir, rank), bytes).unwrap();
        };
        let dead = base.path().join("ladder-progress-111");
        write_record(&dead, 0, dead_pid);
        write_record(&dead, 1, dead_pid);
        let live = base.path().join("ladder-progress-222");
        write_record(&live, 0, dead_pid);
        write_record(&live, 1, std::process::id());
        let young = base.path().join("ladder-progress-333");
        write_record(&young, 0, dead_pid);
        let empty = base.path().join("ladder-progress-444");
        std::fs::create_dir_all(&empty).unwrap();
        let launcher = base.path().join(format!("ladder-progress-run-{}", std::process::id()));
        std::fs::create_dir_all(&launcher).unwrap();
        let other = base.path().join("not-ours");
        std::fs::create_dir_all(&other).unwrap();
        for d in [&dead, &live, &empty, &launcher, &other] {
            age(d, 120);
        }
        let mut removed = sweep_stale(base.path(), STALE_AFTER);
        removed.sort();
        assert_eq!(removed, vec![dead.clone(), empty.clone()]);
        for kept in [&live, &young, &launcher, &other] {
            assert!(kept.is_dir(), "{} was removed", kept.display());
        }
    }
}
