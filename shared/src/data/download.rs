//! Fetching the MNIST files, as `torchvision.datasets.MNIST(download=True)`: each missing file is
//! tried on each mirror in turn until one serves bytes with the canonical MD5.
//!
//! A mirror is a base URL; the file's URL is the mirror, a `/` when it lacks one, and
//! `<name>.gz`. Schemes: `https://`, `http://`, and `file://` (a local directory, e.g.
//! `file:///srv/mnist/`). The next mirror is tried on an HTTP error status, a connection error or
//! timeout, or a body that is not the expected file (an HTML error page served with 200, a cut
//! short body: the MD5 of the decompressed bytes decides), or a mirror that stays silent for
//! [`STALL_TIMEOUT`]. The file is written atomically: a temporary file in the target directory,
//! renamed into place. A file present but corrupt is fetched again, as torchvision does.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::idx;
use super::mnist::{known_md5, md5_hex, FILES};
use crate::{Error, Result};

/// torchvision's MNIST mirrors, in its order.
pub fn default_mirrors() -> Vec<String> {
    vec!["https://ossci-datasets.s3.amazonaws.com/mnist/".into(), "http://yann.lecun.com/exdb/mnist/".into()]
}

/// The mirrors in `$MNIST_MIRRORS` (comma-separated) when it is set and names at least one,
/// else [`default_mirrors`].
pub fn mirrors_from_env() -> Vec<String> {
    let parsed = std::env::var("MNIST_MIRRORS").map(|v| parse_mirrors(&v)).unwrap_or_default();
    if parsed.is_empty() {
        default_mirrors()
    } else {
        parsed
    }
}

/// Splits a comma-separated mirror list (as `MNIST_MIRRORS` or `--mirror a,b`), trimming blanks
/// and dropping empty entries.
pub fn parse_mirrors(list: &str) -> Vec<String> {
    list.split(',').map(str::trim).filter(|m| !m.is_empty()).map(String::from).collect()
}

/// The most bytes one download may hold (64 MiB; the largest MNIST `.gz` is 9.9 MB).
const MAX_BODY: u64 = 64 << 20;

/// How long a mirror may stay silent (no response after connecting, or no byte while the body
/// comes) before it is abandoned for the next mirror: 10 s.
pub const STALL_TIMEOUT: Duration = Duration::from_secs(10);

/// Downloads every MNIST file of which neither `dir/<name>` nor `dir/<name>.gz` exists, and
/// every file that exists but fails its integrity check (the MD5 of its decompressed bytes), as
/// torchvision's `download=True` fetches a file again when its check fails; creates `dir` if
/// needed. Returns the paths written, in the order train images, train labels, test images, test
/// labels. Prints each file fetched and from where (and why a present file is fetched again) on
/// stdout.
///
/// A corrupt raw file (`dir/<name>`) that a `.gz` download replaces is deleted, since it would
/// otherwise be read before the new `.gz`.
///
/// # Errors
/// [`Error::Io`] when `dir` cannot be created or written, or a corrupt raw file cannot be
/// deleted; [`Error::DownloadFailed`] (listing each mirror and why it failed) for the first file
/// that no mirror could provide.
pub fn download_missing(dir: &Path, mirrors: &[String]) -> Result<Vec<PathBuf>> {
    let mut written = Vec::new();
    for (name, md5) in FILES {
        let raw = dir.join(name);
        let present = if raw.is_file() { Some(raw) } else { Some(dir.join(format!("{name}.gz"))).filter(|p| p.is_file()) };
        let corrupt = match &present {
            Some(path) => match check_present(path, md5) {
                Ok(()) => continue,
                Err(why) => {
                    println!("{}: {why}; downloading it again", path.display());
                    Some(path.clone())
                }
            },
            None => None,
        };
        let new = download_file(dir, name, mirrors)?;
        if let Some(old) = corrupt.filter(|old| *old != new) {
            std::fs::remove_file(&old).map_err(|e| Error::io(&old, e))?;
            println!("{}: deleted (corrupt; replaced by {})", old.display(), new.display());
        }
        written.push(new);
    }
    Ok(written)
}

/// Whether the MNIST file at `path` (raw, or `.gz` by its name) decompresses to bytes with MD5
/// `md5`, streamed (no copy of the file is held); else why not.
fn check_present(path: &Path, md5: &str) -> std::result::Result<(), String> {
    let mut file = std::fs::File::open(path).map_err(|e| format!("cannot be read ({e})"))?;
    let actual = if path.extension().is_some_and(|e| e == "gz") {
        super::cache::md5_of_gunzipped(&mut file)
            .map_err(|e| format!("cannot be read ({e})"))?
            .ok_or_else(|| "fails its integrity check: not a whole gzip stream (corrupt or cut short)".to_string())?
    } else {
        super::cache::md5_of_reader(&mut file).map_err(|e| format!("cannot be read ({e})"))?
    };
    if actual == md5 {
        Ok(())
    } else {
        Err(format!("fails its integrity check: MD5 of the decompressed bytes is {actual}, expected {md5}"))
    }
}

/// Downloads the MNIST file `name` (one of the four, without `.gz`) into `dir` from the first
/// mirror that serves it with the canonical MD5, and returns the path written: `dir/<name>.gz`,
/// or `dir/<name>` when the mirror served the file already decompressed. A mirror silent for
/// [`STALL_TIMEOUT`] is abandoned. Prints the file fetched and its URL on stdout, and each
/// mirror that failed on stderr.
///
/// # Errors
/// [`Error::InvalidValue`] when `name` is not an MNIST file name; [`Error::Io`] when `dir` cannot
/// be created or written; [`Error::DownloadFailed`] when every mirror failed (or none was given).
pub fn download_file(dir: &Path, name: &str, mirrors: &[String]) -> Result<PathBuf> {
    download_file_with(dir, name, mirrors, STALL_TIMEOUT)
}

/// [`download_file`] with another stall timeout than [`STALL_TIMEOUT`].
///
/// # Errors
/// As [`download_file`].
pub fn download_file_with(dir: &Path, name: &str, mirrors: &[String], stall: Duration) -> Result<PathBuf> {
    let stem = name.strip_suffix(".gz").unwrap_or(name);
    let Some(md5) = known_md5(stem) else {
        let names: Vec<&str> = FILES.iter().map(|(n, _)| *n).collect();
        return Err(Error::invalid("MNIST file name", name, format!("one of {}", names.join(", "))));
    };
    let file_name = format!("{stem}.gz");
    let mut attempts = Vec::new();
    if mirrors.is_empty() {
        attempts.push("  - (no mirrors given: set --mirror or MNIST_MIRRORS)".to_string());
    }
    for (i, mirror) in mirrors.iter().enumerate() {
        let url = join_url(mirror, &file_name);
        match fetch(&url, stall).and_then(|body| check_body(body, md5)) {
            Ok((bytes, compressed)) => {
                std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
                let target = dir.join(if compressed { file_name.as_str() } else { stem });
                crate::atomic::write_atomic(&target, &bytes)?;
                println!("Downloaded {url} to {} ({} bytes, MD5 verified)", target.display(), bytes.len());
                return Ok(target);
            }
            Err(why) => {
                if i + 1 < mirrors.len() {
                    eprintln!("Failed to download {url}: {why}; trying the next mirror");
                }
                attempts.push(format!("  - {url}: {why}"));
            }
        }
    }
    Err(Error::DownloadFailed { file: file_name, attempts: attempts.join("\n") })
}

/// `mirror` + `/` (if missing) + `file`.
fn join_url(mirror: &str, file: &str) -> String {
    if mirror.ends_with('/') {
        format!("{mirror}{file}")
    } else {
        format!("{mirror}/{file}")
    }
}

/// The body at `url`, or why it could not be had; abandoned after `stall` without a byte.
fn fetch(url: &str, stall: Duration) -> std::result::Result<Vec<u8>, String> {
    if let Some(path) = url.strip_prefix("file://") {
        let file = std::fs::File::open(path).map_err(|e| format!("cannot open {path}: {e}"))?;
        let _ = stall; // a local file does not stall
        let mut bytes = Vec::new();
        file.take(MAX_BODY + 1).read_to_end(&mut bytes).map_err(|e| format!("cannot read {path}: {e}"))?;
        return if bytes.len() as u64 > MAX_BODY { Err(format!("larger than {MAX_BODY} bytes")) } else { Ok(bytes) };
    }
    if !(url.starts_with("http://") || url.starts_with("https://")) {
        return Err("unsupported URL scheme (expected https://, http:// or file://)".into());
    }
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_connect(Some(Duration::from_secs(15)))
        .timeout_recv_response(Some(stall))
        .timeout_per_read(Some(stall))
        .timeout_global(Some(Duration::from_secs(300)))
        .build()
        .into();
    let silent = |what: &str| format!("abandoned: {what} for {} s", stall.as_secs_f64());
    let mut response = agent.get(url).call().map_err(|e| match e {
        ureq::Error::StatusCode(code) => format!("HTTP status {code}"),
        ureq::Error::Timeout(ureq::Timeout::RecvResponse | ureq::Timeout::PerRead) => {
            silent("the server accepted the connection but sent nothing")
        }
        e => format!("request failed: {e}"),
    })?;
    response.body_mut().with_config().limit(MAX_BODY).read_to_vec().map_err(|e| match e {
        ureq::Error::Timeout(ureq::Timeout::PerRead | ureq::Timeout::RecvBody) => silent("the body stopped coming"),
        e => format!("reading the body failed: {e}"),
    })
}

/// Accepts `body` when it is the gzip file whose decompressed bytes have MD5 `md5` (returns it
/// and `true`), or the decompressed file itself (returns it and `false`); else says why not.
fn check_body(body: Vec<u8>, md5: &str) -> std::result::Result<(Vec<u8>, bool), String> {
    let len = body.len();
    if idx::is_gzip(&body) {
        let raw = idx::gunzip(&body).map_err(|p| format!("{len}-byte body: {p}"))?;
        let actual = md5_hex(&raw);
        if actual == md5 {
            Ok((body, true))
        } else {
            Err(format!("checksum mismatch: MD5 of the decompressed bytes is {actual}, expected {md5}"))
        }
    } else {
        let actual = md5_hex(&body);
        if actual == md5 {
            return Ok((body, false));
        }
        let head: String = body.iter().take(40).map(|&b| if b.is_ascii_graphic() || b == b' ' { b as char } else { '.' }).collect();
        Err(format!("checksum mismatch: the {len}-byte body is not gzip (starts with {head:?}) and its MD5 is {actual}, expected {md5}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mirror_lists() {
        assert_eq!(parse_mirrors(" a/ ,, file:///x ,"), ["a/", "file:///x"]);
        assert!(parse_mirrors(" , ").is_empty());
        assert_eq!(default_mirrors().len(), 2);
        assert_eq!(join_url("http://h/m", "f.gz"), "http://h/m/f.gz");
        assert_eq!(join_url("http://h/m/", "f.gz"), "http://h/m/f.gz");
    }

    #[test]
    fn rejects_unknown_names_and_empty_mirror_lists() {
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(download_file(dir.path(), "foo", &[]), Err(Error::InvalidValue { .. })));
        let err = download_file(dir.path(), "t10k-labels-idx1-ubyte", &[]).unwrap_err();
        assert!(err.to_string().contains("no mirrors given"), "{err}");
        assert!(matches!(fetch("ftp://x/y", STALL_TIMEOUT), Err(e) if e.contains("unsupported")));
    }
}
