//! libnccl, loaded at run time (the build needs no CUDA): the entry points the `nccl` backend
//! calls, looked up once.
//!
//! It is opened by its soname, `libnccl.so.2`, first: the dynamic linker then hands back the
//! NCCL that libtorch_cuda already loaded (the torch wheel's `nvidia/nccl/lib/libnccl.so.2`,
//! found through the binary's rpath), so that one NCCL serves the process, as in PyTorch. Only
//! without one does it try `libnccl.so`. Two NCCLs in one process break it: cudarc's loader,
//! which this replaces, looked for `libnccl.so` only (never the wheel's file); on a machine with
//! another NCCL installed as `libnccl.so` (NCCL 2.28.3 beside the wheel's 2.28.9 on a lent
//! H200) every collective failed with `ncclInvalidArgument` ("corrupted comm object detected":
//! one NCCL's communicator checked by the other's code), and on a machine with the wheel alone
//! the backend was unavailable.
//!
//! The types and constants are NCCL's C ABI (`nccl.h`), stable since NCCL 2.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;

/// `ncclComm_t`: an opaque communicator.
pub(crate) type Comm = *mut c_void;
/// `cudaStream_t`.
pub(crate) type Stream = *mut c_void;

/// `ncclUniqueId`: 128 opaque bytes rank 0 creates and the others receive.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct UniqueId {
    /// The bytes.
    pub(crate) internal: [c_char; 128],
}

/// `ncclResult_t` values this backend tells apart.
pub(crate) const SUCCESS: c_int = 0;
/// `ncclInProgress`: a non-blocking call not finished yet (not an error).
pub(crate) const IN_PROGRESS: c_int = 7;

/// `ncclDataType_t`.
pub(crate) mod dtype {
    use std::ffi::c_int;
    pub(crate) const INT64: c_int = 4;
    pub(crate) const FLOAT16: c_int = 6;
    pub(crate) const FLOAT32: c_int = 7;
    pub(crate) const FLOAT64: c_int = 8;
    pub(crate) const BFLOAT16: c_int = 9;
}

/// `ncclRedOp_t`.
pub(crate) mod op {
    use std::ffi::c_int;
    pub(crate) const SUM: c_int = 0;
    pub(crate) const MAX: c_int = 2;
    pub(crate) const MIN: c_int = 3;
    pub(crate) const AVG: c_int = 4;
}

type Collective3 = unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, Comm, Stream) -> c_int;

/// The entry points, with the library that holds them.
pub(crate) struct Nccl {
    pub(crate) get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> c_int,
    pub(crate) comm_init_rank: unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int) -> c_int,
    pub(crate) comm_destroy: unsafe extern "C" fn(Comm) -> c_int,
    pub(crate) comm_abort: unsafe extern "C" fn(Comm) -> c_int,
    pub(crate) comm_get_async_error: unsafe extern "C" fn(Comm, *mut c_int) -> c_int,
    /// `ncclAllReduce(send, recv, count, datatype, op, comm, stream)`.
    pub(crate) all_reduce: Collective3,
    /// `ncclBroadcast(send, recv, count, datatype, root, comm, stream)`.
    pub(crate) broadcast: Collective3,
    /// `ncclReduceScatter(send, recv, recvcount, datatype, op, comm, stream)`.
    pub(crate) reduce_scatter: Collective3,
    /// `ncclAllGather(send, recv, sendcount, datatype, comm, stream)`.
    pub(crate) all_gather: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, Comm, Stream) -> c_int,
    get_error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    get_version: unsafe extern "C" fn(*mut c_int) -> c_int,
    /// Where it was loaded from (`libnccl.so.2` or `libnccl.so`).
    pub(crate) name: &'static str,
    _lib: libloading::Library,
}

/// The names tried, in order.
const NAMES: [&str; 2] = ["libnccl.so.2", "libnccl.so"];

/// The process's libnccl, loaded on first use; the error says what was tried.
pub(crate) fn nccl() -> Result<&'static Nccl, String> {
    static LIB: OnceLock<Result<Nccl, String>> = OnceLock::new();
    LIB.get_or_init(load).as_ref().map_err(Clone::clone)
}

fn load() -> Result<Nccl, String> {
    let mut tried = Vec::new();
    for name in NAMES {
        // SAFETY: loading NCCL runs its (side-effect free) initialisers only.
        match unsafe { libloading::Library::new(name) } {
            Ok(lib) => return bind(lib, name),
            Err(e) => tried.push(format!("{name}: {e}")),
        }
    }
    Err(format!("libnccl could not be loaded (it ships with the torch wheel under nvidia/nccl/lib): {}", tried.join("; ")))
}

fn bind(lib: libloading::Library, name: &'static str) -> Result<Nccl, String> {
    fn sym<T: Copy>(lib: &libloading::Library, name: &str) -> Result<T, String> {
        // SAFETY: each symbol is looked up with the C signature nccl.h gives it.
        unsafe { lib.get::<T>(name.as_bytes()) }.map(|s| *s).map_err(|e| format!("{name}: {e}"))
    }
    Ok(Nccl {
        get_unique_id: sym(&lib, "ncclGetUniqueId")?,
        comm_init_rank: sym(&lib, "ncclCommInitRank")?,
        comm_destroy: sym(&lib, "ncclCommDestroy")?,
        comm_abort: sym(&lib, "ncclCommAbort")?,
        comm_get_async_error: sym(&lib, "ncclCommGetAsyncError")?,
        all_reduce: sym(&lib, "ncclAllReduce")?,
        broadcast: sym(&lib, "ncclBroadcast")?,
        reduce_scatter: sym(&lib, "ncclReduceScatter")?,
        all_gather: sym(&lib, "ncclAllGather")?,
        get_error_string: sym(&lib, "ncclGetErrorString")?,
        get_version: sym(&lib, "ncclGetVersion")?,
        name,
        _lib: lib,
    })
}

impl Nccl {
    /// NCCL's text for a result code (`ncclGetErrorString`).
    pub(crate) fn error_string(&self, code: c_int) -> String {
        // SAFETY: NCCL returns a static NUL-terminated string for any code.
        let p = unsafe { (self.get_error_string)(code) };
        if p.is_null() {
            return format!("NCCL error {code}");
        }
        // SAFETY: non-null, NUL-terminated, static.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    /// NCCL's version as `major.minor.patch` (`ncclGetVersion`: major·10000 + minor·100 + patch
    /// since 2.9, major·1000 + minor·100 + patch before).
    pub(crate) fn version(&self) -> String {
        let mut v: c_int = 0;
        // SAFETY: a valid out-pointer.
        unsafe { (self.get_version)(&mut v) };
        if v < 10000 {
            format!("{}.{}.{}", v / 1000, v / 100 % 10, v % 100)
        } else {
            format!("{}.{}.{}", v / 10000, v / 100 % 100, v % 100)
        }
    }

    /// The file the library was loaded from (`dladdr` of one of its functions), else the name it
    /// was opened by.
    pub(crate) fn file(&self) -> String {
        // SAFETY: dladdr only reads the loader's tables; `info` is a valid out-pointer and its
        // file name, when set, a NUL-terminated string owned by the loader.
        unsafe {
            let mut info: libc::Dl_info = std::mem::zeroed();
            if libc::dladdr(self.get_version as *const c_void, &mut info) != 0 && !info.dli_fname.is_null() {
                return CStr::from_ptr(info.dli_fname).to_string_lossy().into_owned();
            }
        }
        self.name.to_owned()
    }
}
