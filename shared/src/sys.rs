//! The few POSIX/Linux calls the launcher and the progress records need — process groups,
//! parent-death signals (`prctl`), kill, signal handlers, file locks, shared mappings — each
//! wrapped in a safe function, on [`nix`] (system calls), [`signal_hook`] (signal handlers) and
//! [`memmap2`] (mappings). What neither covers is called through `libc` here, with its
//! `# Safety`: `dlopen` of libtorch's CUDA backend and `atexit`.

use nix::sys::signal::{self, Signal};
use nix::unistd::{self, Pid};
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

pub(crate) use libc::{SIGALRM, SIGHUP, SIGINT, SIGKILL, SIGTERM, SIGUSR1, SIGUSR2};

/// Arranges for the child that `cmd` spawns to (a) lead a new process group when `new_group`
/// (so the whole tree it starts can be signalled with [`kill_group`]) and (b) receive
/// `death_signal` when this process dies (Linux `PR_SET_PDEATHSIG`), so no rank outlives its
/// launcher.
pub(crate) fn prepare_child(cmd: &mut Command, death_signal: i32, new_group: bool) {
    let Ok(death) = Signal::try_from(death_signal) else { return };
    let parent = unistd::getpid();
    let hook = move || -> std::io::Result<()> {
        // System calls only (setpgid, prctl, getppid, raise): async-signal-safe, nothing is
        // allocated between fork and exec.
        if new_group {
            unistd::setpgid(Pid::from_raw(0), Pid::from_raw(0))?;
        }
        nix::sys::prctl::set_pdeathsig(death)?;
        // The parent may have died between fork and prctl: then no signal would come.
        if unistd::getppid() != parent {
            let _ = signal::raise(death);
        }
        Ok(())
    };
    // SAFETY: the hook runs in the forked child before exec and only makes async-signal-safe
    // system calls (see above); it touches no locks or allocations of the parent.
    unsafe {
        cmd.pre_exec(hook);
    }
}

/// Asks the kernel to send `signal` to this process when its parent dies (`PR_SET_PDEATHSIG`).
/// Returns false when the parent died while this was being set up (this process was
/// re-parented), in which case the caller should stop.
pub(crate) fn set_own_death_signal(signal: i32) -> bool {
    let parent = unistd::getppid();
    if let Ok(s) = Signal::try_from(signal) {
        let _ = nix::sys::prctl::set_pdeathsig(s);
    }
    unistd::getppid() == parent
}

/// Makes this process the leader of its own process group (no-op when it already is, as
/// mpirun's ranks are), so that a signal to its group reaches it and nothing else.
pub(crate) fn become_group_leader() {
    if unistd::getpgrp() != unistd::getpid() {
        let _ = unistd::setpgid(Pid::from_raw(0), Pid::from_raw(0));
    }
}

/// Sends `signal` to every process of the process group `pgid`. Returns false when no such
/// group exists any more.
pub(crate) fn kill_group(pgid: u32, signal: i32) -> bool {
    if pgid <= 1 {
        return false; // never signal "every process" or init's group
    }
    let (Ok(pgid), Ok(s)) = (i32::try_from(pgid), Signal::try_from(signal)) else { return false };
    signal::killpg(Pid::from_raw(pgid), s).is_ok()
}

/// Whether this process runs as root (mpirun then needs `OMPI_ALLOW_RUN_AS_ROOT`).
pub(crate) fn is_root() -> bool {
    unistd::geteuid().is_root()
}

/// The signals [`install_termination_handlers`] catches.
const TERMINATION: [i32; 3] = [SIGINT, SIGTERM, SIGHUP];

/// The last termination signal received since [`install_termination_handlers`] (0: none).
static RECEIVED: AtomicUsize = AtomicUsize::new(0);

/// Per signal of [`TERMINATION`]: whether its default action runs when it arrives. signal-hook
/// keeps its handler installed once registered, so "the default action is back" is an action of
/// its own that runs the default (terminate) while armed — registered once per process, first,
/// so that it runs before any other action of ours.
static DEFAULT_ARMED: [AtomicBool; 3] = [const { AtomicBool::new(false) }; 3];

/// The handlers that were in place before [`install_termination_handlers`]: its own
/// registrations, and per signal whether the default action was in force.
#[derive(Debug)]
pub(crate) struct SavedHandlers(Vec<(usize, signal_hook::SigId, bool)>);

/// Catches SIGINT, SIGTERM and SIGHUP: instead of dying, the process records the signal for
/// [`received_signal`] so that it can stop its children first. Returns what
/// [`restore_handlers`] needs to put the previous dispositions back.
pub(crate) fn install_termination_handlers() -> SavedHandlers {
    static DEFAULT_ACTIONS: std::sync::Once = std::sync::Once::new();
    RECEIVED.store(0, Ordering::SeqCst);
    let before = Dispositions::of_this_process();
    let registry_installed = DEFAULT_ACTIONS.is_completed();
    DEFAULT_ACTIONS.call_once(|| {
        for (i, &s) in TERMINATION.iter().enumerate() {
            let _ = signal_hook::flag::register_conditional_default(s, &DEFAULT_ARMED[i]);
        }
    });
    let mut saved = Vec::new();
    for (i, &s) in TERMINATION.iter().enumerate() {
        // Once signal-hook's handler is in place, the kernel sees a handler: the default is in
        // force exactly when our default action is armed.
        let was_default = if registry_installed { DEFAULT_ARMED[i].load(Ordering::SeqCst) } else { before.is_default(s) };
        DEFAULT_ARMED[i].store(false, Ordering::SeqCst);
        if let Ok(id) = signal_hook::flag::register_usize(s, &RECEIVED, s as usize) {
            saved.push((i, id, was_default));
        }
    }
    SavedHandlers(saved)
}

/// Puts back the dispositions [`install_termination_handlers`] replaced: the signals stop being
/// recorded, and those whose default action was in force terminate the process again (an
/// ignored one stays ignored; a handler installed before ours, which signal-hook chains to, is
/// left as it was).
pub(crate) fn restore_handlers(saved: SavedHandlers) {
    for (i, id, was_default) in saved.0 {
        signal_hook::low_level::unregister(id);
        DEFAULT_ARMED[i].store(was_default, Ordering::SeqCst);
    }
}

/// From now on, `carrier` arriving is recorded as `stands_for` (see [`received_signal`]): how
/// a rank worker under mpirun learns which signal its launcher received, mpirun forwarding
/// SIGUSR1, SIGUSR2 and SIGALRM as they are but answering SIGTERM, SIGINT and SIGHUP itself.
/// Call it after [`install_termination_handlers`], which forgets what was recorded.
pub(crate) fn record_carrier(carrier: i32, stands_for: i32) {
    if let Ok(value) = usize::try_from(stands_for) {
        let _ = signal_hook::flag::register_usize(carrier, &RECEIVED, value);
    }
}

/// The termination signal received, if any (see [`install_termination_handlers`]).
pub(crate) fn received_signal() -> Option<i32> {
    match RECEIVED.load(Ordering::SeqCst) {
        0 => None,
        s => Some(s as i32),
    }
}

/// The conventional name of a signal number (`"SIGKILL"`), or `"signal N"`.
pub(crate) fn signal_name(signal: i32) -> String {
    Signal::try_from(signal).map_or_else(|_| format!("signal {signal}"), |s| s.as_str().to_string())
}

/// This process's signal dispositions as the kernel reports them (`SigIgn`, `SigCgt` of
/// `/proc/self/status`): which signals are ignored, which have a handler.
struct Dispositions {
    ignored: u64,
    caught: u64,
}

impl Dispositions {
    /// Read from `/proc/self/status`; all default when it cannot be read.
    fn of_this_process() -> Self {
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let mask =
            |key: &str| status.lines().find_map(|l| l.strip_prefix(key)).and_then(|v| u64::from_str_radix(v.trim(), 16).ok()).unwrap_or(0);
        Self { ignored: mask("SigIgn:"), caught: mask("SigCgt:") }
    }

    /// Whether `signal` (1..=64) has its default action: neither ignored nor caught.
    fn is_default(&self, signal: i32) -> bool {
        let bit = 1u64.checked_shl(signal as u32 - 1).unwrap_or(0);
        (self.ignored | self.caught) & bit == 0
    }
}

/// Loads `libtorch_cuda.so` (found through the binary's rpath) with `RTLD_GLOBAL`, so that
/// libtorch registers its CUDA backend and `tch::Cuda::is_available()` can turn true. tch
/// references no symbol of it, so the linker would drop it; loading it at run time, only when
/// CUDA is asked about, keeps CPU-only binaries such as `ladder-run` from loading the CUDA
/// libraries at all. Returns `dlerror()`'s text on failure.
pub(crate) fn load_torch_cuda() -> Result<(), String> {
    let name = c"libtorch_cuda.so";
    // SAFETY: dlopen with a NUL-terminated name; the handle is deliberately never closed (the
    // library stays loaded for the life of the process, as a link-time dependency would).
    let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns a thread-local NUL-terminated string or null.
        let err = unsafe { libc::dlerror() };
        let text = if err.is_null() {
            "unknown dlopen error".to_string()
        } else {
            // SAFETY: non-null, NUL-terminated, valid until the next dl* call on this thread.
            unsafe { std::ffi::CStr::from_ptr(err) }.to_string_lossy().into_owned()
        };
        return Err(text);
    }
    Ok(())
}

/// A few `u64` words of a file mapped `MAP_SHARED` (a rank's progress record under /dev/shm):
/// stores are plain memory writes that any process reading the file sees — no system call per
/// update.
pub(crate) struct SharedWords {
    map: memmap2::MmapRaw,
    len: usize,
}

impl std::fmt::Debug for SharedWords {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedWords").field("len", &self.len).finish()
    }
}

impl SharedWords {
    /// Maps the first `len` words of `file` (which must be at least `len * 8` bytes long),
    /// shared and read-write.
    pub(crate) fn map(file: &std::fs::File, len: usize) -> std::io::Result<Self> {
        let map = memmap2::MmapOptions::new().len(len * 8).map_raw(file)?;
        Ok(Self { map, len })
    }

    /// Stores `value` in word `i` (ignored when out of range).
    pub(crate) fn store(&self, i: usize, value: u64) {
        if i < self.len {
            let word = self.map.as_mut_ptr().cast::<std::sync::atomic::AtomicU64>();
            // SAFETY: word `i` is in range of a live, page-aligned mapping of `len` words (so
            // aligned for u64) that lives as long as `self`; AtomicU64 has u64's layout, and
            // other processes only ever read or store whole words.
            unsafe { (*word.add(i)).store(value, Ordering::Release) };
        }
    }
}

/// The one-letter scheduler state of process `pid` (`R`, `S`, `T` for stopped, `Z`, …) from
/// `/proc/PID/stat`, or `None` when it is gone.
pub(crate) fn process_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may contain spaces: the state follows the last ')'.
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// Whether the NVIDIA driver's user-space library `libcuda.so.1` can be loaded (it then stays
/// loaded: it is small, and CUDA use would load it next). Loads nothing of libtorch.
pub(crate) fn libcuda_loads() -> bool {
    let name = c"libcuda.so.1";
    // SAFETY: dlopen with a NUL-terminated name; the handle is never closed (see above).
    let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL) };
    !handle.is_null()
}

/// An exclusive `flock` on a file, held until this is dropped.
#[derive(Debug)]
pub(crate) struct FileLock(#[allow(dead_code)] nix::fcntl::Flock<std::fs::File>);

/// Takes an exclusive `flock` on `file`, waiting for it; released when the returned lock is
/// dropped: what serialises the ranks of one node that build the same data cache.
///
/// # Errors
/// The OS error, e.g. on a file system without locks (callers then proceed unlocked).
pub(crate) fn lock_exclusive(file: &std::fs::File) -> std::io::Result<FileLock> {
    // A duplicate descriptor shares the open file description, and so the lock, with `file`.
    let mut f = file.try_clone()?;
    loop {
        match nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusive) {
            Ok(lock) => return Ok(FileLock(lock)),
            Err((back, nix::errno::Errno::EINTR)) => f = back,
            Err((_, errno)) => return Err(errno.into()),
        }
    }
}

/// Maps `file` read-only into memory (`mmap(PROT_READ, MAP_SHARED)` through memmap2): the pages
/// are the page cache's, shared with every process mapping the same file.
///
/// # Safety (why this safe wrapper is sound for its callers)
/// A mapping is only sound while nobody changes the file underneath it. The only callers map the
/// data cache files (`data::cache`), which this crate never writes in place: a cache is written
/// to a temporary file and renamed over the old name, which leaves every existing mapping on the
/// old, unchanged inode.
pub(crate) fn map_read_only(file: &std::fs::File) -> std::io::Result<memmap2::Mmap> {
    // SAFETY: see above: the mapped files are replaced by rename, never modified in place.
    unsafe { memmap2::Mmap::map(file) }
}

static AT_EXIT_FILES: std::sync::Mutex<Vec<std::path::PathBuf>> = std::sync::Mutex::new(Vec::new());

extern "C" fn remove_files_at_exit() {
    if let Ok(files) = AT_EXIT_FILES.lock() {
        for f in files.iter() {
            let _ = std::fs::remove_file(f);
            if let Some(d) = f.parent() {
                let _ = std::fs::remove_dir(d); // only when empty
            }
        }
    }
}

/// The record file and its directory that [`remove_on_termination_signal`]'s handler removes:
/// NUL-terminated paths, set once before the handler is installed (read in the handler
/// without allocating).
static ON_SIGNAL_PATHS: std::sync::OnceLock<(std::ffi::CString, std::ffi::CString)> = std::sync::OnceLock::new();

/// Removes `file` (and its directory, once empty) when this process is ended by SIGTERM or
/// SIGINT — how `mpirun` stops the ranks of a job one of whose ranks failed (SIGTERM, SIGKILL
/// 1 s later: Open MPI's `odls_base_sigkill_timeout`) — then ends by that signal as before.
/// Only where no handler is installed yet (the default action), and for one file per process.
pub(crate) fn remove_on_termination_signal(file: &std::path::Path) {
    use std::os::unix::ffi::OsStrExt;
    let (Some(dir), Ok(f)) = (file.parent(), std::ffi::CString::new(file.as_os_str().as_bytes())) else { return };
    let Ok(d) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else { return };
    if ON_SIGNAL_PATHS.set((f, d)).is_err() {
        return;
    }
    let before = Dispositions::of_this_process();
    for s in [SIGTERM, SIGINT] {
        if !before.is_default(s) {
            continue;
        }
        let action = move || {
            if let Some((file, dir)) = ON_SIGNAL_PATHS.get() {
                let _ = unistd::unlink(file.as_c_str());
                let _ = unistd::unlinkat(nix::fcntl::AT_FDCWD, dir.as_c_str(), unistd::UnlinkatFlags::RemoveDir);
                // only when empty
            }
            // The default action, as it would have been without this handler: the process ends
            // by this signal (same exit status for the launcher).
            let _ = signal_hook::low_level::emulate_default_handler(s);
        };
        // SAFETY: the action only makes async-signal-safe calls — unlink and unlinkat on
        // NUL-terminated paths that live for the whole process (a static, read without
        // allocating), then sigaction, sigprocmask and raise (emulate_default_handler).
        let _ = unsafe { signal_hook::low_level::register(s, action) };
    }
}

/// Removes `file` (and its directory, once empty) when the process exits normally — also
/// after an error returned from `main` — through `atexit`.
pub(crate) fn remove_at_exit(file: std::path::PathBuf) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    // SAFETY: registers a plain extern "C" function with no arguments, once.
    ONCE.call_once(|| unsafe {
        libc::atexit(remove_files_at_exit);
    });
    if let Ok(mut files) = AT_EXIT_FILES.lock() {
        files.push(file);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    /// While the handlers are installed a SIGTERM is recorded and the process lives on; once
    /// they are restored, SIGTERM's default action ends the process again. Run in a child
    /// process (this test binary again), which the second signal ends.
    #[test]
    fn termination_handlers_record_then_restore_the_default() {
        const NAME: &str = "sys::tests::termination_handlers_record_then_restore_the_default";
        if std::env::var_os("LADDER_SYS_CHILD").is_none() {
            let out = Command::new(std::env::current_exe().unwrap())
                .args(["--exact", NAME, "--nocapture", "--test-threads", "1"])
                .env("LADDER_SYS_CHILD", "1")
                .output()
                .unwrap();
            let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            assert!(text.contains("SIGTERM recorded"), "the child did not reach the restore: {text}");
            assert_eq!(out.status.signal(), Some(SIGTERM), "the child was not ended by SIGTERM ({}): {text}", out.status);
            return;
        }
        let saved = install_termination_handlers();
        signal::raise(Signal::SIGTERM).unwrap();
        assert_eq!(received_signal(), Some(SIGTERM));
        println!("SIGTERM recorded");
        restore_handlers(saved);
        let _ = signal::raise(Signal::SIGTERM);
        panic!("still alive after SIGTERM with the default action restored");
    }

    #[test]
    fn signals_are_named_as_the_kernel_does() {
        assert_eq!(signal_name(SIGKILL), "SIGKILL");
        assert_eq!(signal_name(libc::SIGABRT), "SIGABRT");
        assert_eq!(signal_name(0), "signal 0");
        assert_eq!(signal_name(64), "signal 64");
    }
}
