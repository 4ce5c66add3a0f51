//! The few POSIX/Linux calls the launcher needs (process groups, parent-death signals, kill,
//! signal handlers), each wrapped in a safe function. This is the only module of the launcher
//! with `unsafe`.

use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::atomic::{AtomicI32, Ordering};

pub(crate) use libc::{SIGHUP, SIGINT, SIGKILL, SIGTERM};

/// Arranges for the child that `cmd` spawns to (a) lead a new process group when `new_group`
/// (so the whole tree it starts can be signalled with [`kill_group`]) and (b) receive
/// `death_signal` when this process dies (Linux `PR_SET_PDEATHSIG`), so no rank outlives its
/// launcher.
pub(crate) fn prepare_child(cmd: &mut Command, death_signal: i32, new_group: bool) {
    let parent = std::process::id() as libc::pid_t;
    let hook = move || -> std::io::Result<()> {
        // SAFETY: setpgid, prctl, getppid and raise are async-signal-safe system calls with
        // plain integer arguments; nothing is allocated between fork and exec.
        unsafe {
            if new_group && libc::setpgid(0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::prctl(libc::PR_SET_PDEATHSIG, death_signal as libc::c_ulong, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The parent may have died between fork and prctl: then no signal would come.
            if libc::getppid() != parent {
                libc::raise(death_signal);
            }
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
    // SAFETY: prctl(PR_SET_PDEATHSIG) and getppid take and return plain integers.
    unsafe {
        let parent = libc::getppid();
        libc::prctl(libc::PR_SET_PDEATHSIG, signal as libc::c_ulong, 0, 0, 0);
        libc::getppid() == parent
    }
}

/// Makes this process the leader of its own process group (no-op when it already is, as
/// mpirun's ranks are), so that [`kill_own_group`] reaches its whole tree and nothing else.
pub(crate) fn become_group_leader() {
    // SAFETY: getpgrp/getpid/setpgid take and return plain integers.
    unsafe {
        if libc::getpgrp() != libc::getpid() {
            libc::setpgid(0, 0);
        }
    }
}

/// Sends `signal` to every process of the process group `pgid`. Returns false when no such
/// group exists any more.
pub(crate) fn kill_group(pgid: u32, signal: i32) -> bool {
    if pgid <= 1 {
        return false; // never signal "every process" or init's group
    }
    // SAFETY: kill with a negative pid signals a process group; plain integers.
    unsafe { libc::kill(-(pgid as libc::pid_t), signal) == 0 }
}

/// Sends `signal` to every process of this process's own group (this process included).
pub(crate) fn kill_own_group(signal: i32) {
    // SAFETY: kill(0, sig) signals the caller's process group; plain integers.
    unsafe {
        libc::kill(0, signal);
    }
}

/// Whether this process runs as root (mpirun then needs `OMPI_ALLOW_RUN_AS_ROOT`).
pub(crate) fn is_root() -> bool {
    // SAFETY: geteuid cannot fail and takes no arguments.
    unsafe { libc::geteuid() == 0 }
}

/// The last termination signal received since [`install_termination_handlers`] (0: none).
static RECEIVED: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(signal: libc::c_int) {
    // Only an atomic store: async-signal-safe.
    RECEIVED.store(signal, Ordering::SeqCst);
}

/// The handlers that were in place before [`install_termination_handlers`].
pub(crate) struct SavedHandlers(Vec<(i32, libc::sigaction)>);

impl std::fmt::Debug for SavedHandlers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SavedHandlers").field("signals", &self.0.iter().map(|s| s.0).collect::<Vec<_>>()).finish()
    }
}

/// Catches SIGINT, SIGTERM and SIGHUP: instead of dying, the process records the signal for
/// [`received_signal`] so that it can stop its children first. Returns the previous handlers
/// for [`restore_handlers`].
pub(crate) fn install_termination_handlers() -> SavedHandlers {
    RECEIVED.store(0, Ordering::SeqCst);
    let mut saved = Vec::new();
    for signal in [SIGINT, SIGTERM, SIGHUP] {
        // SAFETY: a zeroed sigaction is a valid starting value; the handler only stores to an
        // atomic, which is async-signal-safe; sigemptyset/sigaction get valid pointers.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(signal, &action, &mut old) == 0 {
                saved.push((signal, old));
            }
        }
    }
    SavedHandlers(saved)
}

/// Puts back the handlers [`install_termination_handlers`] replaced.
pub(crate) fn restore_handlers(saved: SavedHandlers) {
    for (signal, old) in saved.0 {
        // SAFETY: `old` is the sigaction the kernel returned for this signal.
        unsafe {
            libc::sigaction(signal, &old, std::ptr::null_mut());
        }
    }
}

/// The termination signal received, if any (see [`install_termination_handlers`]).
pub(crate) fn received_signal() -> Option<i32> {
    match RECEIVED.load(Ordering::SeqCst) {
        0 => None,
        s => Some(s),
    }
}

/// The conventional name of a signal number (`"SIGKILL"`), or `"signal N"`.
pub(crate) fn signal_name(signal: i32) -> String {
    let name = match signal {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        libc::SIGXCPU => "SIGXCPU",
        _ => return format!("signal {signal}"),
    };
    name.to_string()
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
    ptr: *mut std::sync::atomic::AtomicU64,
    len: usize,
}

impl std::fmt::Debug for SharedWords {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedWords").field("len", &self.len).finish()
    }
}

impl SharedWords {
    /// Maps the first `len` words of `file` (which must be at least `len * 8` bytes long).
    pub(crate) fn map(file: &std::fs::File, len: usize) -> std::io::Result<Self> {
        use std::os::fd::AsRawFd;
        // SAFETY: a fresh shared read-write mapping of an open file's first len*8 bytes; the
        // kernel chooses the address. The mapping outlives the file descriptor (POSIX).
        let p =
            unsafe { libc::mmap(std::ptr::null_mut(), len * 8, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, file.as_raw_fd(), 0) };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self { ptr: p.cast(), len })
    }

    /// Stores `value` in word `i` (ignored when out of range).
    pub(crate) fn store(&self, i: usize, value: u64) {
        if i < self.len {
            // SAFETY: in range of a live, page-aligned mapping; AtomicU64 has u64's layout.
            unsafe { (*self.ptr.add(i)).store(value, Ordering::Release) };
        }
    }
}

impl Drop for SharedWords {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `map`, once.
        unsafe { libc::munmap(self.ptr.cast(), self.len * 8) };
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

/// Takes an exclusive `flock` on `file`, waiting for it (released when the file is closed):
/// what serialises the ranks of one node that build the same data cache.
///
/// # Errors
/// The OS error, e.g. on a file system without locks (callers then proceed unlocked).
pub(crate) fn lock_exclusive(file: &std::fs::File) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    loop {
        // SAFETY: flock on a file descriptor this `File` owns; plain integers.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } == 0 {
            return Ok(());
        }
        let err = std::io::Error::last_os_error();
        if err.kind() != std::io::ErrorKind::Interrupted {
            return Err(err);
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

extern "C" fn remove_record_then_die(signal: libc::c_int) {
    if let Some((file, dir)) = ON_SIGNAL_PATHS.get() {
        // SAFETY: unlink, rmdir, signal and raise are async-signal-safe; the paths are
        // NUL-terminated and live for the whole process (a static).
        unsafe {
            libc::unlink(file.as_ptr());
            libc::rmdir(dir.as_ptr()); // only when empty
        }
    }
    // SAFETY: restoring the default action and re-raising: the process ends by this signal,
    // as it would have without the handler (same exit status for the launcher).
    unsafe {
        libc::signal(signal, libc::SIG_DFL);
        libc::raise(signal);
    }
}

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
    for signal in [libc::SIGTERM, libc::SIGINT] {
        // SAFETY: sigaction with a zeroed struct queries the current action; the handler is a
        // plain extern "C" fn that only makes async-signal-safe calls.
        unsafe {
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(signal, std::ptr::null(), &mut old) != 0 || old.sa_sigaction != libc::SIG_DFL {
                continue;
            }
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = remove_record_then_die as extern "C" fn(libc::c_int) as libc::sighandler_t;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(signal, &action, std::ptr::null_mut());
        }
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
