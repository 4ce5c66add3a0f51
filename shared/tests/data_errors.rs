//! Every bad MNIST input gives its typed error, with a message naming the file and what was
//! expected (insta snapshots, the temp dir replaced by [TMP]); no byte sequence panics.

use std::io::Write;
use std::path::Path;

use ladder_core::data::idx::{self, IMAGES_MAGIC, LABELS_MAGIC};
use ladder_core::data::mnist::load_split;
use ladder_core::data::Mnist;
use ladder_core::Error;
use rand::{Rng, SeedableRng};

const TI: &str = "train-images-idx3-ubyte";
const TL: &str = "train-labels-idx1-ubyte";

fn images(n: u32, rows: u32, cols: u32, pixels: usize) -> Vec<u8> {
    let mut v = Vec::new();
    for x in [IMAGES_MAGIC, n, rows, cols] {
        v.extend_from_slice(&x.to_be_bytes());
    }
    v.extend((0..pixels).map(|i| (i % 251) as u8));
    v
}

fn labels(values: &[u8]) -> Vec<u8> {
    let mut v = LABELS_MAGIC.to_be_bytes().to_vec();
    v.extend_from_slice(&(values.len() as u32).to_be_bytes());
    v.extend_from_slice(values);
    v
}

fn gz(bytes: &[u8]) -> Vec<u8> {
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    enc.write_all(bytes).unwrap();
    enc.finish().unwrap()
}

/// A temp dir holding `files`; `Mnist::load` on it must fail.
fn load_err(files: &[(&str, Vec<u8>)]) -> (tempfile::TempDir, Error) {
    let dir = tempfile::tempdir().unwrap();
    for (name, bytes) in files {
        std::fs::write(dir.path().join(name), bytes).unwrap();
    }
    let err = Mnist::load(dir.path()).expect_err("bad input must fail");
    (dir, err)
}

/// Snapshots `err`'s message with `dir` replaced by `[TMP]`.
fn snap(name: &str, dir: &Path, err: &Error) {
    let escaped: String =
        dir.display().to_string().chars().flat_map(|c| if r"\.+*?()|[]{}^$#&-~".contains(c) { vec!['\\', c] } else { vec![c] }).collect();
    let ws = ladder_core::data::mnist::workspace_data_dir().display().to_string();
    let ws = ws.replace('.', r"\.").replace('-', r"\-");
    insta::with_settings!({ filters => vec![(escaped.as_str(), "[TMP]"), (ws.as_str(), "[BUNDLED]")] }, {
        insta::assert_snapshot!(name, err.to_string());
    });
}

#[test]
fn missing_file_says_how_to_get_it() {
    let (dir, err) = load_err(&[]);
    assert!(matches!(&err, Error::MissingFile { file, .. } if file.ends_with("train-images-idx3-ubyte.gz")));
    snap("missing_file", dir.path(), &err);
}

#[test]
fn still_gzipped_file_under_raw_name() {
    let (dir, err) = load_err(&[(TI, gz(&images(1, 28, 28, 784))), (TL, labels(&[1]))]);
    assert!(matches!(err, Error::BadMagic { expected: IMAGES_MAGIC, .. }));
    snap("still_gzipped", dir.path(), &err);
}

#[test]
fn labels_file_given_as_images() {
    let (dir, err) = load_err(&[(TI, labels(&[1, 2])), (TL, labels(&[1, 2]))]);
    assert!(matches!(err, Error::BadMagic { found: LABELS_MAGIC, .. }));
    snap("labels_as_images", dir.path(), &err);
}

#[test]
fn html_page_under_raw_name() {
    let (dir, err) = load_err(&[(TI, b"<html><body>404 Not Found</body></html>".to_vec()), (TL, labels(&[1]))]);
    assert!(matches!(err, Error::BadMagic { found: 0x3c68_746d, .. }));
    snap("html_as_raw", dir.path(), &err);
}

#[test]
fn truncated_pixels() {
    let (dir, err) = load_err(&[(TI, images(2, 28, 28, 784 + 100)), (TL, labels(&[1, 2]))]);
    assert!(matches!(err, Error::Truncated { expected: 1584, found: 900, .. }));
    snap("truncated_pixels", dir.path(), &err);
}

#[test]
fn truncated_header() {
    let (dir, err) = load_err(&[(TI, images(2, 28, 28, 0)[..10].to_vec()), (TL, labels(&[1, 2]))]);
    assert!(matches!(err, Error::Truncated { expected: 16, found: 10, .. }));
    snap("truncated_header", dir.path(), &err);
}

#[test]
fn empty_labels_file() {
    let (dir, err) = load_err(&[(TI, images(1, 28, 28, 784)), (TL, Vec::new())]);
    assert!(matches!(err, Error::Truncated { expected: 8, found: 0, .. }));
    snap("empty_labels", dir.path(), &err);
}

#[test]
fn wrong_dimensions() {
    let (dir, err) = load_err(&[(TI, images(1, 28, 27, 756)), (TL, labels(&[1]))]);
    assert!(matches!(err, Error::BadDims { .. }));
    snap("bad_dims", dir.path(), &err);
}

#[test]
fn trailing_data() {
    let (dir, err) = load_err(&[(TI, images(1, 28, 28, 800)), (TL, labels(&[1]))]);
    assert!(matches!(err, Error::TrailingData { expected: 800, found: 816, .. }));
    snap("trailing_data", dir.path(), &err);
}

#[test]
fn image_and_label_counts_differ() {
    let (dir, err) = load_err(&[(TI, images(3, 28, 28, 3 * 784)), (TL, labels(&[1, 2]))]);
    assert!(matches!(err, Error::CountMismatch { n_images: 3, n_labels: 2, .. }));
    snap("count_mismatch", dir.path(), &err);
}

#[test]
fn label_out_of_range() {
    let (dir, err) = load_err(&[(TI, images(3, 28, 28, 3 * 784)), (TL, labels(&[1, 12, 3]))]);
    assert!(matches!(err, Error::BadLabel { index: 1, label: 12, .. }));
    snap("bad_label", dir.path(), &err);
}

#[test]
fn well_formed_but_not_mnist_fails_the_checksum() {
    let img = images(2, 28, 28, 2 * 784);
    let (dir, err) = load_err(&[(TI, img.clone()), (TL, labels(&[1, 2]))]);
    assert!(matches!(&err, Error::ChecksumMismatch { expected, .. } if expected == "6bbc9ace898e44ae57da46a324031adb"));
    snap("checksum_mismatch", dir.path(), &err);
    // Under another name the same files load: the MD5 is only checked for the four MNIST names.
    std::fs::write(dir.path().join("tiny-images"), &img).unwrap();
    std::fs::write(dir.path().join("tiny-labels"), labels(&[1, 2])).unwrap();
    let ds = load_split(&dir.path().join("tiny-images"), &dir.path().join("tiny-labels")).unwrap();
    assert_eq!(ds.len(), 2);
}

#[test]
fn one_flipped_byte_in_a_real_file_fails_the_checksum() {
    let src = ladder_core::data::mnist::workspace_data_dir();
    let mut raw = idx::read_maybe_gz(&src.join("t10k-labels-idx1-ubyte.gz")).unwrap();
    raw[100] = (raw[100] + 1) % 10;
    let dir = tempfile::tempdir().unwrap();
    let labels_path = dir.path().join("t10k-labels-idx1-ubyte.gz");
    std::fs::write(&labels_path, gz(&raw)).unwrap();
    let err = load_split(&src.join("t10k-images-idx3-ubyte.gz"), &labels_path).unwrap_err();
    assert!(matches!(&err, Error::ChecksumMismatch { file, .. } if file == &labels_path));
}

#[test]
fn gz_file_that_is_not_gzip() {
    let (dir, err) = load_err(&[(&format!("{TI}.gz"), b"<!DOCTYPE html>\n<title>Error</title>".to_vec()), (TL, labels(&[1]))]);
    assert!(matches!(err, Error::BadGzip { .. }));
    snap("gz_is_html", dir.path(), &err);
    let (dir, err) = load_err(&[(&format!("{TI}.gz"), images(1, 28, 28, 784)), (TL, labels(&[1]))]);
    assert!(matches!(err, Error::BadGzip { .. }));
    snap("gz_is_raw_idx", dir.path(), &err);
}

#[test]
fn gz_file_cut_short() {
    let full = gz(&images(50, 28, 28, 50 * 784));
    let (dir, err) = load_err(&[(&format!("{TI}.gz"), full[..full.len() / 2].to_vec()), (TL, labels(&[1]))]);
    assert!(matches!(err, Error::BadGzip { .. }));
    snap("gz_cut_short", dir.path(), &err);
}

#[test]
fn raw_file_is_preferred_over_gz() {
    // A bad raw file shadows a good .gz: the raw name is looked for first.
    let src = ladder_core::data::mnist::workspace_data_dir();
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(src.join("t10k-labels-idx1-ubyte.gz"), dir.path().join("t10k-labels-idx1-ubyte.gz")).unwrap();
    std::fs::write(dir.path().join("t10k-labels-idx1-ubyte"), b"junk").unwrap();
    let found = ladder_core::data::mnist::locate(dir.path(), "t10k-labels-idx1-ubyte").unwrap();
    assert_eq!(found, dir.path().join("t10k-labels-idx1-ubyte"));
    std::fs::remove_file(&found).unwrap();
    let found = ladder_core::data::mnist::locate(dir.path(), "t10k-labels-idx1-ubyte").unwrap();
    assert_eq!(found, dir.path().join("t10k-labels-idx1-ubyte.gz"));
}

/// Random and mutated byte strings through every parser and the file reader: errors, never panics.
#[test]
fn no_byte_sequence_panics() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(42);
    let f = Path::new("fuzz");
    let valid_images = images(2, 28, 28, 2 * 784);
    let valid_labels = labels(&[3, 4]);
    let valid_gz = gz(&valid_images);
    let dir = tempfile::tempdir().unwrap();
    let (ip, lp) = (dir.path().join("fuzz-images.gz"), dir.path().join("fuzz-labels"));
    for round in 0..3000 {
        let mut bytes: Vec<u8> = match round % 4 {
            // Pure noise, mostly short.
            0 => (0..rng.gen_range(0..40)).map(|_| rng.gen()).collect(),
            // Truncations of valid files.
            1 => valid_images[..rng.gen_range(0..valid_images.len())].to_vec(),
            // Valid headers with random counts/dims and random lengths.
            2 => {
                let mut v = if rng.gen() { valid_images[..16].to_vec() } else { valid_labels[..8].to_vec() };
                let at = rng.gen_range(4..v.len());
                v[at] = rng.gen();
                v.extend((0..rng.gen_range(0..2000)).map(|_| rng.gen::<u8>()));
                v
            }
            // Mutated gzip streams.
            _ => {
                let mut v = valid_gz.clone();
                for _ in 0..rng.gen_range(1..4) {
                    let at = rng.gen_range(0..v.len());
                    v[at] = rng.gen();
                }
                v.truncate(rng.gen_range(0..=v.len()));
                v
            }
        };
        let _ = idx::parse_images(&bytes, f);
        let _ = idx::parse_labels(&bytes, f);
        let _ = idx::gunzip(&bytes);
        if round % 10 == 0 {
            std::fs::write(&ip, &bytes).unwrap();
            bytes.truncate(bytes.len() / 2);
            std::fs::write(&lp, &bytes).unwrap();
            let _ = load_split(&ip, &lp);
        }
    }
}

#[test]
fn an_empty_local_data_dir_names_every_place_and_the_bundled_copy() {
    // `./data/mnist` exists in the working directory but is empty: it is used (it comes before
    // the bundled copy), and the error says so and how to use the bundled copy.
    let cwd = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(cwd.path().join("data/mnist")).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ladder-baseline"))
        .args(["--device", "cpu", "--max-steps", "1"])
        .current_dir(cwd.path())
        .env_remove("MNIST_DIR")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    let local = cwd.path().join("data/mnist");
    let bundled = ladder_core::data::mnist::workspace_data_dir();
    for part in [
        format!("looked for data/mnist/{TI} and data/mnist/{TI}.gz"),
        "the data directory is --data-dir, else $MNIST_DIR, else ./data/mnist when that directory exists, else the bundled copy"
            .to_string(),
        format!("({} exists in the working directory, so it was used instead of the bundled copy)", local.display()),
        format!("the bundled copy is {b}: use it with --data-dir {b} (or MNIST_DIR={b})", b = bundled.display()),
    ] {
        assert!(stderr.contains(&part), "missing {part:?} in:\n{stderr}");
    }
}
