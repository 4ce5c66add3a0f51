//! Fetching the MNIST files, as `torchvision.datasets.MNIST(download=True)`: each missing file is
//! tried on each mirror in turn until one serves bytes with the canonical MD5.
//!
//! A mirror is a base URL; the file's URL is the mirror, a `/` when it lacks one, and
//! `<name>.gz`. Schemes: `https://`, `http://`, and `file://` (a local directory, e.g.
//! `file:///srv/mnist/`). The next mirror is tried on an HTTP error status, a connection error or
//! timeout, or a body that is not the expected file (an HTML error page served with 200, a cut
//! short body: the MD5 of the decompressed bytes decides). The file is written atomically: a
//! temporary file in the target directory, renamed into place.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::idx;
use super::mnist::{known_md5, md5_hex, FILES};
use crate::{Error, Result};

/// torchvision's MNIST mirrors, in its order.
pub fn default_mirrors() -> Vec<String> {
    vec![
        "https://ossci-datasets.s3.amazonaws.com/mnist/".into(),
        "http://yann.lecun.com/exdb/mnist/".into(),
    ]
}

/// The mirrors in `$MNIST_MIRRORS` (comma-separated) when it is set and names at least one,
/// else [`default_mirrors`].
pub fn mirrors_from_env() -> Vec<String> {
    let parsed = std::env::var("MNIST_MIRRORS")
        .map(|v| parse_mirrors(&v))
        .unwrap_or_default();
    if parsed.is_empty() {
        default_mirrors()
    } else {
        parsed
    }
}

/// Splits a comma-separated mirror list (as `MNIST_MIRRORS` or `--mirror a,b`), trimming blanks
/// and dropping empty entries.
pub fn parse_mirrors(list: &str) -> Vec<String> {
    list.split(',')
        .map(str::trim)
        .filter(|m| !m.is_empty())
        .map(String::from)
        .collect()
}

/// The most bytes one download may hold (64 MiB; the largest MNIST `.gz` is 9.9 MB).
const MAX_BODY: u64 = 64 << 20;

/// Downloads every MNIST file of which neither `dir/<name>` nor `dir/<name>.gz` exists, creating
/// `dir` if needed; returns the paths written, in the order train images, train labels, test
/// images, test labels. Present files are left alone (not verified here; [`super::Mnist::load`]
/// verifies them).
///
/// # Errors
/// [`Error::Io`] when `dir` cannot be created or written; [`Error::DownloadFailed`] (listing each
/// mirror and why it failed) for the first file that no mirror could provide.
pub fn download_missing(dir: &Path, mirrors: &[String]) -> Result<Vec<PathBuf>> {
    let mut written = Vec::new();
    for (name, _) in FILES {
        if dir.join(name).is_file() || dir.join(format!("{name}.gz")).is_file() {
            continue;
        }
        written.push(download_file(dir, name, mirrors)?);
    }
    Ok(written)
}

/// Downloads the MNIST file `name` (one of the four, without `.gz`) into `dir` from the first
/// mirror that serves it with the canonical MD5, and returns the path written: `dir/<name>.gz`,
/// or `dir/<name>` when the mirror served the file already decompressed.
///
/// # Errors
/// [`Error::InvalidValue`] when `name` is not an MNIST file name; [`Error::Io`] when `dir` cannot
/// be created or written; [`Error::DownloadFailed`] when every mirror failed (or none was given).
pub fn download_file(dir: &Path, name: &str, mirrors: &[String]) -> Result<PathBuf> {
    let stem = name.strip_suffix(".gz").unwrap_or(name);
    let Some(md5) = known_md5(stem) else {
        let names: Vec<&str> = FILES.iter().map(|(n, _)| *n).collect();
        return Err(Error::invalid(
            "MNIST file name",
            name,
            format!("one of {}", names.join(", ")),
        ));
    };
    let file_name = format!("{stem}.gz");
    let mut attempts = Vec::new();
    if mirrors.is_empty() {
        attempts.push("  - (no mirrors given: set --mirror or MNIST_MIRRORS)".to_string());
    }
    for mirror in mirrors {
        let url = join_url(mirror, &file_name);
        match fetch(&url).and_then(|body| check_body(body, md5)) {
            Ok((bytes, compressed)) => {
                std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
                let target = dir.join(if compressed { file_name.as_str() } else { stem });
                crate::atomic::write_atomic(&target, &bytes)?;
                return Ok(target);
            }
            Err(why) => attempts.push(format!("  - {url}: {why}")),
        }
    }
    Err(Error::DownloadFailed {
        file: file_name,
        attempts: attempts.join("\n"),
    })
}

/// `mirror` + `/` (if missing) + `file`.
fn join_url(mirror: &str, file: &str) -> String {
    if mirror.ends_with('/') {
        format!("{mirror}{file}")
    } else {
        format!("{mirror}/{file}")
    }
}

/// The body at `url`, or why it could not be had.
fn fetch(url: &str) -> std::result::Result<Vec<u8>, String> {
    if let Some(path) = url.strip_prefix("file://") {
        let file = std::fs::File::open(path).map_err(|e| format!("cannot open {path}: {e}"))?;
        let mut bytes = Vec::new();
        file.take(MAX_BODY + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| format!("cannot read {path}: {e}"))?;
        return if bytes.len() as u64 > MAX_BODY {
            Err(format!("larger than {MAX_BODY} bytes"))
        } else {
            Ok(bytes)
        };
    }
    if !(url.starts_with("http://") || url.starts_with("https://")) {
        return Err("unsupported URL scheme (expected https://, http:// or file://)".into());
    }
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_connect(Some(Duration::from_secs(15)))
        .timeout_per_read(Some(Duration::from_secs(30)))
        .timeout_global(Some(Duration::from_secs(300)))
        .build()
        .into();
    let mut response = agent.get(url).call().map_err(|e| match e {
        ureq::Error::StatusCode(code) => format!("HTTP status {code}"),
        e => format!("request failed: {e}"),
    })?;
    response
        .body_mut()
        .with_config()
        .limit(MAX_BODY)
        .read_to_vec()
        .map_err(|e| format!("reading the body failed: {e}"))
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
            Err(format!(
                "checksum mismatch: MD5 of the decompressed bytes is {actual}, expected {md5}"
            ))
        }
    } else {
        let actual = md5_hex(&body);
        if actual == md5 {
            return Ok((body, false));
        }
        let head: String = body
            .iter()
            .take(40)
            .map(|&b| {
                if b.is_ascii_graphic() || b == b' ' {
                    b as char
                } else {
                    '.'
                }
            })
            .collect();
        Err(format!(
            "checksum mismatch: the {len}-byte body is not gzip (starts with {head:?}) and its MD5 is {actual}, expected {md5}"
        ))
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
        assert!(matches!(
            download_file(dir.path(), "foo", &[]),
            Err(Error::InvalidValue { .. })
        ));
        let err = download_file(dir.path(), "t10k-labels-idx1-ubyte", &[]).unwrap_err();
        assert!(err.to_string().contains("no mirrors given"), "{err}");
        assert!(matches!(fetch("ftp://x/y"), Err(e) if e.contains("unsupported")));
    }
}
