//! The IDX file format of MNIST (<http://yann.lecun.com/exdb/mnist/>), raw or gzip-compressed.
//!
//! An IDX file is a big-endian header followed by `u8` data:
//!
//! | file   | magic                 | header                         | data                 |
//! |--------|-----------------------|--------------------------------|----------------------|
//! | images | `0x00000803` (2051)   | magic, `n`, rows (28), cols (28) | `n * 28 * 28` pixels |
//! | labels | `0x00000801` (2049)   | magic, `n`                      | `n` labels in 0..=9 |
//!
//! The parsers here take any byte sequence and either return the data or a typed error that names
//! the file and what was expected versus found; they never panic (as torchvision's
//! `read_image_file` / `read_label_file`, with the checks made explicit).

use std::io::Read;
use std::path::Path;

use crate::{Error, Result};

/// Magic number of an IDX3 `u8` images file.
pub const IMAGES_MAGIC: u32 = 0x0000_0803;
/// Magic number of an IDX1 `u8` labels file.
pub const LABELS_MAGIC: u32 = 0x0000_0801;
/// Image height and width, in pixels.
pub const SIDE: usize = 28;
/// Header length of an images file, in bytes.
pub const IMAGES_HEADER: usize = 16;
/// Header length of a labels file, in bytes.
pub const LABELS_HEADER: usize = 8;
/// The most bytes a `.gz` file may decompress to (64 MiB; the largest MNIST file holds
/// 47,040,016): a guard against gzip bombs.
pub const MAX_DECOMPRESSED: u64 = 64 << 20;

const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// Whether `bytes` start with the gzip magic `1f 8b`.
pub fn is_gzip(bytes: &[u8]) -> bool {
    bytes.starts_with(&GZIP_MAGIC)
}

/// Reads `path` into memory, decompressing it when its name ends in `.gz`.
///
/// A file whose name does not end in `.gz` is returned as it is (the IDX parsers then report a
/// still-compressed file as such).
///
/// # Errors
/// [`Error::MissingFile`] when the file does not exist, [`Error::Io`] when it cannot be read,
/// [`Error::BadGzip`] when a `.gz` file is not gzip, is corrupt or cut short, or decompresses to
/// more than [`MAX_DECOMPRESSED`] bytes.
pub fn read_maybe_gz(path: &Path) -> Result<Vec<u8>> {
    let bytes = std::fs::read(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => Error::MissingFile { file: path.to_path_buf(), hint: "expected an MNIST IDX file here".into() },
        _ => Error::io(path, e),
    })?;
    if path.extension().is_some_and(|e| e == "gz") {
        gunzip(&bytes).map_err(|problem| Error::BadGzip { file: path.to_path_buf(), problem })
    } else {
        Ok(bytes)
    }
}

/// Decompresses a whole gzip stream held in memory; the error is a human-readable problem.
///
/// Fails when `bytes` do not start with the gzip magic, when the stream is corrupt or cut short,
/// or when it decompresses to more than [`MAX_DECOMPRESSED`] bytes.
pub fn gunzip(bytes: &[u8]) -> std::result::Result<Vec<u8>, String> {
    if !is_gzip(bytes) {
        let what = if bytes.len() >= 4 && matches!(be_u32(bytes, 0), IMAGES_MAGIC | LABELS_MAGIC) {
            " (it looks like an uncompressed IDX file: drop the .gz from its name)".to_string()
        } else {
            describe_start(bytes)
        };
        return Err(format!("it does not start with the gzip magic 1f 8b{what}"));
    }
    // The gzip trailer's ISIZE (length mod 2^32) is a good capacity hint for MNIST-sized files.
    let hint = bytes.len().checked_sub(4).map(|i| be_u32_le(bytes, i) as u64).unwrap_or(0).min(MAX_DECOMPRESSED) as usize;
    let mut out = Vec::with_capacity(hint);
    let decoder = flate2::read::GzDecoder::new(bytes);
    decoder.take(MAX_DECOMPRESSED + 1).read_to_end(&mut out).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => {
            format!("the gzip stream is cut short after {} compressed bytes ({e})", bytes.len())
        }
        _ => format!("corrupt gzip stream ({e})"),
    })?;
    if out.len() as u64 > MAX_DECOMPRESSED {
        return Err(format!("it decompresses to more than {MAX_DECOMPRESSED} bytes, larger than any MNIST file"));
    }
    Ok(out)
}

/// Parses an IDX3 images file (already decompressed): returns the number of images `n` and the
/// `n * 28 * 28` pixel bytes (row-major, `u8`, 0 = background).
///
/// # Errors
/// [`Error::Truncated`] (header or pixels missing), [`Error::BadMagic`] (with a hint when the
/// bytes are still gzip-compressed, are a labels file, or look like text), [`Error::BadDims`]
/// (rows × cols other than 28×28), [`Error::TrailingData`] (more bytes than announced). `file` is
/// only used to name the file in the error.
pub fn parse_images<'b>(bytes: &'b [u8], file: &Path) -> Result<(usize, &'b [u8])> {
    check_magic(bytes, file, IMAGES_MAGIC, "IDX3 images, 2051")?;
    if bytes.len() < IMAGES_HEADER {
        return Err(truncated(file, IMAGES_HEADER as u64, bytes.len()));
    }
    let n = be_u32(bytes, 4) as u64;
    let (rows, cols) = (be_u32(bytes, 8), be_u32(bytes, 12));
    if rows as usize != SIDE || cols as usize != SIDE {
        return Err(Error::BadDims {
            file: file.to_path_buf(),
            expected: format!("{SIDE}x{SIDE} (rows x cols)"),
            found: format!("{rows}x{cols}"),
        });
    }
    let expected = IMAGES_HEADER as u64 + n * (SIDE * SIDE) as u64;
    let data = check_len(bytes, file, expected, IMAGES_HEADER)?;
    Ok((n as usize, data))
}

/// Parses an IDX1 labels file (already decompressed): returns the `n` label bytes.
///
/// Label values are not range-checked here (see [`check_labels`]).
///
/// # Errors
/// [`Error::Truncated`], [`Error::BadMagic`], [`Error::TrailingData`], as [`parse_images`].
pub fn parse_labels<'b>(bytes: &'b [u8], file: &Path) -> Result<&'b [u8]> {
    check_magic(bytes, file, LABELS_MAGIC, "IDX1 labels, 2049")?;
    if bytes.len() < LABELS_HEADER {
        return Err(truncated(file, LABELS_HEADER as u64, bytes.len()));
    }
    let n = be_u32(bytes, 4) as u64;
    check_len(bytes, file, LABELS_HEADER as u64 + n, LABELS_HEADER)
}

/// Checks that every label is a digit class in `0..=9`.
///
/// # Errors
/// [`Error::BadLabel`] naming the first offending index and value.
pub fn check_labels(labels: &[u8], file: &Path) -> Result<()> {
    match labels.iter().position(|&l| l > 9) {
        Some(index) => Err(Error::BadLabel { file: file.to_path_buf(), index, label: labels[index] }),
        None => Ok(()),
    }
}

fn check_magic(bytes: &[u8], file: &Path, expected: u32, what: &'static str) -> Result<()> {
    if is_gzip(bytes) {
        let found = if bytes.len() >= 4 { be_u32(bytes, 0) } else { 0x1f8b_0000 };
        let name = file.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        return Err(Error::BadMagic {
            file: file.to_path_buf(),
            expected,
            found,
            what,
            extra: format!("; the file is still gzip-compressed: rename it to {name}.gz or decompress it (gunzip)"),
        });
    }
    if bytes.len() < 4 {
        return Err(truncated(file, if expected == IMAGES_MAGIC { IMAGES_HEADER } else { LABELS_HEADER } as u64, bytes.len()));
    }
    let found = be_u32(bytes, 0);
    if found == expected {
        return Ok(());
    }
    let extra = match found {
        IMAGES_MAGIC => "; this is an images file, not a labels file".to_string(),
        LABELS_MAGIC => "; this is a labels file, not an images file".to_string(),
        _ => describe_start(bytes),
    };
    Err(Error::BadMagic { file: file.to_path_buf(), expected, found, what, extra })
}

/// The data after the header, when the file holds exactly `expected` bytes.
fn check_len<'b>(bytes: &'b [u8], file: &Path, expected: u64, header: usize) -> Result<&'b [u8]> {
    let found = bytes.len() as u64;
    if found < expected {
        Err(truncated(file, expected, bytes.len()))
    } else if found > expected {
        Err(Error::TrailingData { file: file.to_path_buf(), expected, found })
    } else {
        Ok(&bytes[header..])
    }
}

fn truncated(file: &Path, expected: u64, found: usize) -> Error {
    Error::Truncated { file: file.to_path_buf(), expected, found: found as u64 }
}

/// A hint for bytes that look like text (an HTML error page saved in place of the data).
fn describe_start(bytes: &[u8]) -> String {
    let head: String = bytes.iter().take(16).map(|&b| b as char).collect();
    let texty = !bytes.is_empty() && bytes.iter().take(64).all(|&b| b.is_ascii_graphic() || b.is_ascii_whitespace());
    if texty {
        format!("; the file starts with the text {head:?}: an HTML or text page, not MNIST data")
    } else {
        String::new()
    }
}

/// Big-endian `u32` at `at`; the caller guarantees `at + 4 <= bytes.len()`.
fn be_u32(bytes: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

/// Little-endian `u32` at `at` (the gzip trailer); the caller guarantees `at + 4 <= bytes.len()`.
fn be_u32_le(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn images(n: u32, rows: u32, cols: u32, pixels: usize) -> Vec<u8> {
        let mut v = Vec::new();
        for x in [IMAGES_MAGIC, n, rows, cols] {
            v.extend_from_slice(&x.to_be_bytes());
        }
        v.resize(v.len() + pixels, 7);
        v
    }

    #[test]
    fn parses_well_formed_images_and_labels() {
        let f = Path::new("x");
        let bytes = images(2, 28, 28, 2 * 784);
        let (n, data) = parse_images(&bytes, f).unwrap();
        assert_eq!((n, data.len()), (2, 1568));
        let mut l = LABELS_MAGIC.to_be_bytes().to_vec();
        l.extend_from_slice(&3u32.to_be_bytes());
        l.extend_from_slice(&[0, 9, 4]);
        assert_eq!(parse_labels(&l, f).unwrap(), &[0, 9, 4]);
        check_labels(&[0, 9, 4], f).unwrap();
        assert!(matches!(check_labels(&[0, 10], f), Err(Error::BadLabel { index: 1, label: 10, .. })));
    }

    #[test]
    fn length_errors_carry_exact_byte_counts() {
        let f = Path::new("x");
        let short = images(2, 28, 28, 784);
        assert!(matches!(parse_images(&short, f), Err(Error::Truncated { expected: 1584, found: 800, .. })));
        let long = images(1, 28, 28, 785);
        assert!(matches!(parse_images(&long, f), Err(Error::TrailingData { expected: 800, found: 801, .. })));
        assert!(matches!(parse_images(&images(1, 28, 27, 756), f), Err(Error::BadDims { .. })));
        assert!(matches!(parse_labels(&[0, 0, 8], f), Err(Error::Truncated { expected: 8, found: 3, .. })));
        assert!(matches!(parse_labels(&[], f), Err(Error::Truncated { expected: 8, found: 0, .. })));
    }

    #[test]
    fn gunzip_round_trip_and_bomb_guard_message() {
        use std::io::Write;
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        enc.write_all(b"hello idx").unwrap();
        let gz = enc.finish().unwrap();
        assert_eq!(gunzip(&gz).unwrap(), b"hello idx");
        assert!(gunzip(&gz[..gz.len() - 6]).unwrap_err().contains("cut short"));
        assert!(gunzip(b"<html>").unwrap_err().contains("HTML"));
    }
}
