//! One copy of the decompressed MNIST images per node: each `.gz` is decompressed once into a
//! cache file next to it, verified by the MD5 of the decompressed bytes (as `data/mnist/MD5SUMS`
//! gives it), and mapped read-only into every rank.
//!
//! Why: the page cache holds one copy of a mapped file however many processes map it, so the
//! ranks of one node share the 47 MB of training pixels instead of each decoding its own copy
//! (and before the lean data path, each also held a normalised f32 copy four times as large).
//! Decompression streams from the `.gz` into the cache file through a 64 KiB buffer, so no rank
//! ever holds a whole decoded file on its heap.
//!
//! Where the cache goes, first that works:
//! 1. `<data dir>/<name>.cache` (next to `<name>.gz`);
//! 2. `$XDG_CACHE_HOME/ddp-ladder/mnist/<md5>-<name>` (else `~/.cache/...`), when the data directory
//!    is read-only;
//! 3. nowhere: the file is decoded in memory, as before (no error).
//!
//! The cache is written to a temporary file in its directory, synced, and renamed into place, so
//! no reader ever sees half of it; ranks of one node take turns through an exclusive `flock` on
//! the `.gz`, so the first builds and the others map its file. A cache file whose MD5 is not the
//! expected one (corrupted, cut short, or any other content) is rebuilt.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use md5::{Digest, Md5};

use super::idx;
use super::mnist::known_md5;
use crate::Result;

/// Read-only bytes that clone cheaply: a read-only memory map of a cache file (its pages shared
/// with every process that maps the same file) or a heap buffer.
#[derive(Clone)]
pub struct SharedBytes {
    storage: Arc<Storage>,
    /// Whether the bytes were checked against the file's canonical MD5 already.
    verified: bool,
}

enum Storage {
    Mapped { map: memmap2::Mmap, path: PathBuf },
    Heap(Vec<u8>),
}

impl std::fmt::Debug for SharedBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("SharedBytes");
        d.field("len", &self.as_slice().len());
        if let Some(p) = self.mapped_path() {
            d.field("mapped", &p);
        }
        d.finish()
    }
}

impl SharedBytes {
    /// Bytes held on the heap (not verified).
    pub fn from_vec(bytes: Vec<u8>) -> Self {
        SharedBytes { storage: Arc::new(Storage::Heap(bytes)), verified: false }
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        match &*self.storage {
            Storage::Mapped { map, .. } => map,
            Storage::Heap(v) => v,
        }
    }

    /// The cache file these bytes map, or `None` for heap bytes.
    pub fn mapped_path(&self) -> Option<&Path> {
        match &*self.storage {
            Storage::Mapped { path, .. } => Some(path),
            Storage::Heap(_) => None,
        }
    }

    /// Whether the bytes were already checked against the file's canonical MD5.
    pub fn verified(&self) -> bool {
        self.verified
    }
}

/// The decompressed bytes of the IDX file at `path`: for a `.gz` named as one of the four MNIST
/// files, a verified, shared mapping of its cache file (built if missing or bad); otherwise (a
/// raw file, another name, or no writable cache location) the bytes on the heap, unverified, as
/// [`idx::read_maybe_gz`] gives them.
///
/// # Errors
/// Those of [`idx::read_maybe_gz`]: [`crate::Error::MissingFile`], [`crate::Error::Io`],
/// [`crate::Error::BadGzip`], naming `path`. A `.gz` whose decompressed bytes do not have the
/// canonical MD5 is returned unverified, so that the caller reports what is wrong with it.
pub fn decompressed(path: &Path) -> Result<SharedBytes> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    let md5 = match (name.strip_suffix(".gz"), known_md5(name)) {
        (Some(_), Some(md5)) => md5,
        _ => return Ok(SharedBytes::from_vec(idx::read_maybe_gz(path)?)),
    };
    for cache in cache_paths(path, md5) {
        match cached(path, &cache, md5) {
            Ok(Some(bytes)) => return Ok(bytes),
            // The .gz itself is bad: the heap path below reports it.
            Ok(None) => break,
            // This location cannot hold the cache (read-only, full, …): try the next.
            Err(_) => continue,
        }
    }
    Ok(SharedBytes::from_vec(idx::read_maybe_gz(path)?))
}

/// Where the cache of `gz` may live, in order of preference (see the module docs).
pub fn cache_paths(gz: &Path, md5: &str) -> Vec<PathBuf> {
    let stem = gz.file_name().and_then(|n| n.to_str()).unwrap_or("").trim_end_matches(".gz");
    let mut paths = vec![gz.with_file_name(format!("{stem}.cache"))];
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").filter(|v| !v.is_empty()).map(|h| PathBuf::from(h).join(".cache")));
    if let Some(base) = base {
        paths.push(base.join("ddp-ladder").join("mnist").join(format!("{md5}-{stem}")));
    }
    paths
}

/// The verified mapping of `cache`, (re)built from `gz` when missing or bad; `Ok(None)` when `gz`
/// cannot be opened or does not decompress to bytes with MD5 `md5`; `Err` when `cache` cannot be
/// written where it is.
fn cached(gz: &Path, cache: &Path, md5: &str) -> std::io::Result<Option<SharedBytes>> {
    let Ok(mut src) = File::open(gz) else { return Ok(None) };
    // Ranks of one node take turns: the first builds the cache, the next find it built. A file
    // system without locks only loses that courtesy (the rename keeps every reader safe). The
    // lock is held until this function returns.
    let _lock = crate::sys::lock_exclusive(&src);
    if let Some(bytes) = map_if_valid(cache, md5)? {
        return Ok(Some(bytes));
    }
    let dir = cache.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let mut tmp =
        tempfile::Builder::new().prefix(".ladder-").permissions(std::os::unix::fs::PermissionsExt::from_mode(0o644)).tempfile_in(dir)?;
    let Some(digest) = gunzip_into(&mut src, tmp.as_file_mut())? else { return Ok(None) };
    if digest != md5 {
        return Ok(None);
    }
    tmp.as_file().sync_all()?;
    // Map before the rename: the mapping follows the inode, whatever happens to the name.
    let map = crate::sys::map_read_only(tmp.as_file())?;
    tmp.persist(cache).map_err(|e| e.error)?;
    Ok(Some(SharedBytes { storage: Arc::new(Storage::Mapped { map, path: cache.to_path_buf() }), verified: true }))
}

/// The mapping of `cache` when it exists and its MD5 is `md5`; `Ok(None)` when it is missing or
/// bad (to be rebuilt).
fn map_if_valid(cache: &Path, md5: &str) -> std::io::Result<Option<SharedBytes>> {
    let file = match File::open(cache) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    if file.metadata()?.len() == 0 {
        return Ok(None); // a zero-length file cannot be mapped; it is not MNIST either
    }
    let map = crate::sys::map_read_only(&file)?;
    if super::mnist::md5_hex(&map) != md5 {
        return Ok(None);
    }
    Ok(Some(SharedBytes { storage: Arc::new(Storage::Mapped { map, path: cache.to_path_buf() }), verified: true }))
}

/// Streams the gzip file `src` decompressed into `dst` through a 64 KiB buffer and returns the
/// hex MD5 of the decompressed bytes; `Ok(None)` when `src` is not a whole gzip stream or
/// decompresses to more than [`idx::MAX_DECOMPRESSED`] bytes; `Err` when `dst` cannot be written.
fn gunzip_into(src: &mut File, dst: &mut impl Write) -> std::io::Result<Option<String>> {
    let mut decoder = flate2::read::GzDecoder::new(std::io::BufReader::with_capacity(64 << 10, src));
    let mut out = std::io::BufWriter::with_capacity(64 << 10, dst);
    let mut hasher = Md5::new();
    let mut buf = vec![0u8; 64 << 10];
    let mut total = 0u64;
    loop {
        let n = match decoder.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => return Ok(None),
        };
        total += n as u64;
        if total > idx::MAX_DECOMPRESSED {
            return Ok(None);
        }
        hasher.update(&buf[..n]);
        out.write_all(&buf[..n])?;
    }
    out.flush()?;
    Ok(Some(hasher.finalize().iter().map(|b| format!("{b:02x}")).collect()))
}

/// Hex MD5 of the decompressed bytes of the gzip file `src`, streamed (nothing kept); `Ok(None)`
/// when `src` is not a whole gzip stream (corrupt, cut short, or too large).
///
/// # Errors
/// Never from the sink; kept `io::Result` for [`gunzip_into`]'s signature.
pub(crate) fn md5_of_gunzipped(src: &mut File) -> std::io::Result<Option<String>> {
    gunzip_into(src, &mut std::io::sink())
}

/// Hex MD5 of everything `src` yields, streamed through a 64 KiB buffer.
///
/// # Errors
/// The read error.
pub(crate) fn md5_of_reader(src: &mut impl Read) -> std::io::Result<String> {
    let mut hasher = Md5::new();
    let mut buf = vec![0u8; 64 << 10];
    loop {
        match src.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => hasher.update(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(hasher.finalize().iter().map(|b| format!("{b:02x}")).collect())
}
