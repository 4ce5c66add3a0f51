//! MNIST as `torchvision.datasets.MNIST` with
//! `transforms.Compose([ToTensor(), Normalize((0.1307,), (0.3081,))])`, computed once for the
//! whole split.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use md5::{Digest, Md5};
use tch::{Device, Kind, Tensor};

use super::idx;
use crate::{Error, Result};

/// Mean of the MNIST training pixels after `ToTensor` (/255), as the PyTorch MNIST example.
pub const MNIST_MEAN: f64 = 0.1307;
/// Standard deviation of the MNIST training pixels after `ToTensor`, as the PyTorch MNIST example.
pub const MNIST_STD: f64 = 0.3081;

/// Training images file name (without `.gz`).
pub const TRAIN_IMAGES: &str = "train-images-idx3-ubyte";
/// Training labels file name (without `.gz`).
pub const TRAIN_LABELS: &str = "train-labels-idx1-ubyte";
/// Test images file name (without `.gz`).
pub const TEST_IMAGES: &str = "t10k-images-idx3-ubyte";
/// Test labels file name (without `.gz`).
pub const TEST_LABELS: &str = "t10k-labels-idx1-ubyte";

/// The four MNIST files and the MD5 of their decompressed bytes (as `data/mnist/MD5SUMS`).
pub const FILES: [(&str, &str); 4] = [
    (TRAIN_IMAGES, "6bbc9ace898e44ae57da46a324031adb"),
    (TRAIN_LABELS, "a25bea736e30d166cdddb491f175f624"),
    (TEST_IMAGES, "2646ac647ad5339dbf082846283269ea"),
    (TEST_LABELS, "27ae3e4e09519cfbb04c329615203637"),
];

/// The canonical MD5 (of the decompressed bytes) of a known MNIST file, by name with or without
/// `.gz`; `None` for any other name.
pub fn known_md5(file_name: &str) -> Option<&'static str> {
    let stem = file_name.strip_suffix(".gz").unwrap_or(file_name);
    FILES.iter().find(|(n, _)| *n == stem).map(|(_, md5)| *md5)
}

/// Hex MD5 of `bytes`.
pub fn md5_hex(bytes: &[u8]) -> String {
    Md5::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// What to do when an MNIST file is missing.
pub(crate) const MISSING_HINT: &str =
    "get the MNIST files with --download (mirrors from --mirror or \
MNIST_MIRRORS, comma-separated), or point --data-dir (or MNIST_DIR) at a directory holding them";

/// One split of MNIST, normalised, in memory.
#[derive(Debug)]
pub struct Dataset {
    /// `[N, 1, 28, 28]` f32: `(x / 255 - 0.1307) / 0.3081` for pixel bytes `x`.
    pub images: Tensor,
    /// `[N]` i64 digit classes in `0..=9`.
    pub labels: Tensor,
}

impl Dataset {
    /// Builds a dataset from `n` images' raw pixel bytes (`n * 28 * 28`, row-major) and `n` label
    /// bytes, applying `ToTensor` and `Normalize(MNIST_MEAN, MNIST_STD)` once, in f32, on the CPU.
    ///
    /// # Errors
    /// [`Error::InvalidValue`] when the lengths disagree; [`Error::Torch`] from libtorch.
    pub fn from_bytes(pixels: &[u8], labels: &[u8]) -> Result<Dataset> {
        let side = idx::SIDE;
        if pixels.len() != labels.len() * side * side {
            return Err(Error::invalid(
                "pixels",
                format!("{} bytes", pixels.len()),
                format!(
                    "{} bytes: 28 * 28 per each of the {} labels",
                    labels.len() * side * side,
                    labels.len()
                ),
            ));
        }
        let n = labels.len() as i64;
        let mut images = Tensor::from_slice(pixels)
            .f_view([n, 1, side as i64, side as i64])?
            .f_to_kind(Kind::Float)?;
        let _ = images.f_div_scalar_(255.0)?;
        let _ = images.f_sub_scalar_(MNIST_MEAN)?;
        let _ = images.f_div_scalar_(MNIST_STD)?;
        let labels = Tensor::from_slice(labels).f_to_kind(Kind::Int64)?;
        Ok(Dataset { images, labels })
    }

    /// Number of samples `N`.
    pub fn len(&self) -> usize {
        self.labels.size().first().map_or(0, |&n| n.max(0) as usize)
    }

    /// Whether the dataset holds no samples.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The samples at `indices`, in that order: `(images [b, 1, 28, 28] f32, labels [b] i64)` with
    /// `b = indices.len()`, on the dataset's device (`index_select`, a copy).
    ///
    /// # Panics
    /// When an index is outside `0..len()`, like slice indexing (a programming error: the
    /// samplers only yield valid indices, and [`super::DataLoader::new`] checks its sampler).
    pub fn batch(&self, indices: &[i64]) -> (Tensor, Tensor) {
        let idx = Tensor::from_slice(indices).to_device(self.labels.device());
        (
            self.images.index_select(0, &idx),
            self.labels.index_select(0, &idx),
        )
    }

    /// The samples `range` as a dataset that shares storage with this one (`narrow`, no copy).
    ///
    /// # Panics
    /// When `range` is not within `0..len()`, like slice indexing.
    pub fn slice(&self, range: std::ops::Range<usize>) -> Dataset {
        assert!(
            range.start <= range.end && range.end <= self.len(),
            "Dataset::slice: range {range:?} is not within 0..{}",
            self.len()
        );
        let (start, len) = (range.start as i64, (range.end - range.start) as i64);
        Dataset {
            images: self.images.narrow(0, start, len),
            labels: self.labels.narrow(0, start, len),
        }
    }

    /// A copy on `device` (or the same storage when it is already there).
    pub fn to_device(&self, device: Device) -> Dataset {
        Dataset {
            images: self.images.to_device(device),
            labels: self.labels.to_device(device),
        }
    }

    /// Another handle on the same storage (`Tensor::shallow_clone`).
    pub fn shallow_clone(&self) -> Dataset {
        Dataset {
            images: self.images.shallow_clone(),
            labels: self.labels.shallow_clone(),
        }
    }
}

/// MNIST's two splits: 60,000 training and 10,000 test samples.
#[derive(Debug)]
pub struct Mnist {
    /// The 60,000 training samples (`train-*` files).
    pub train: Dataset,
    /// The 10,000 test samples (`t10k-*` files).
    pub test: Dataset,
}

impl Mnist {
    /// Reads the four MNIST files from `dir`, verifies them and normalises the images, as
    /// `torchvision.datasets.MNIST(dir, train=..., download=False)` with the example's transform.
    ///
    /// For each file `<name>` (e.g. `train-images-idx3-ubyte`) the raw `dir/<name>` is used when it
    /// exists, else `dir/<name>.gz` (decompressed in memory). Each split is checked in this order:
    /// IDX structure (magic, 28×28, length), equal image and label counts, labels in `0..=9`, and
    /// the MD5 of the decompressed bytes of each file. The two splits are read in parallel.
    ///
    /// # Errors
    /// [`Error::MissingFile`] (with how to get the files), [`Error::Io`], [`Error::BadGzip`],
    /// [`Error::BadMagic`], [`Error::Truncated`], [`Error::TrailingData`], [`Error::BadDims`],
    /// [`Error::CountMismatch`], [`Error::BadLabel`], [`Error::ChecksumMismatch`], naming the file.
    pub fn load(dir: &Path) -> Result<Mnist> {
        let (train, test) = std::thread::scope(|s| {
            let test =
                s.spawn(|| load_split(&locate(dir, TEST_IMAGES)?, &locate(dir, TEST_LABELS)?));
            let train = load_split(&locate(dir, TRAIN_IMAGES)?, &locate(dir, TRAIN_LABELS)?);
            let test = test.join().unwrap_or_else(|p| std::panic::resume_unwind(p));
            Ok::<_, Error>((train?, test?))
        })?;
        Ok(Mnist { train, test })
    }

    /// As `torchvision.datasets.MNIST(dir, download=True)`: downloads the files missing from
    /// `dir` (see [`super::download_missing`]; `mirrors` as [`super::mirrors_from_env`]), then
    /// [`Mnist::load`]s. Files already present are not fetched again, even if they are bad: their
    /// error says which one to delete.
    ///
    /// # Errors
    /// Those of [`super::download_missing`] and [`Mnist::load`].
    pub fn load_or_download(dir: &Path, mirrors: &[String]) -> Result<Mnist> {
        super::download_missing(dir, mirrors)?;
        Mnist::load(dir)
    }
}

/// `dir/<name>` when it exists, else `dir/<name>.gz` when it exists, else [`Error::MissingFile`].
pub fn locate(dir: &Path, name: &str) -> Result<PathBuf> {
    let raw = dir.join(name);
    if raw.is_file() {
        return Ok(raw);
    }
    let gz = dir.join(format!("{name}.gz"));
    if gz.is_file() {
        return Ok(gz);
    }
    Err(Error::MissingFile {
        file: gz,
        hint: format!(
            "neither {name} nor {name}.gz is in {}; {MISSING_HINT}",
            dir.display()
        ),
    })
}

/// Reads one split from an images and a labels IDX file (raw, or gzip when the name ends in `.gz`).
///
/// Checks as [`Mnist::load`]; the MD5 is checked only for files named as one of the four MNIST
/// files (with or without `.gz`), so other IDX files (e.g. Fashion-MNIST) load too.
///
/// # Errors
/// As [`Mnist::load`].
pub fn load_split(images_path: &Path, labels_path: &Path) -> Result<Dataset> {
    let image_bytes = idx::read_maybe_gz(images_path)?;
    let (n_images, pixels) = idx::parse_images(&image_bytes, images_path)?;
    let label_bytes = idx::read_maybe_gz(labels_path)?;
    let labels = idx::parse_labels(&label_bytes, labels_path)?;
    if n_images != labels.len() {
        return Err(Error::CountMismatch {
            images: images_path.to_path_buf(),
            n_images,
            labels: labels_path.to_path_buf(),
            n_labels: labels.len(),
        });
    }
    idx::check_labels(labels, labels_path)?;
    verify_md5(images_path, &image_bytes)?;
    verify_md5(labels_path, &label_bytes)?;
    Dataset::from_bytes(pixels, labels)
}

/// Checks the MD5 of `bytes` (decompressed) when `path` names one of the four MNIST files.
fn verify_md5(path: &Path, bytes: &[u8]) -> Result<()> {
    let Some(expected) = path.file_name().and_then(OsStr::to_str).and_then(known_md5) else {
        return Ok(());
    };
    let actual = md5_hex(bytes);
    if actual == expected {
        Ok(())
    } else {
        Err(Error::ChecksumMismatch {
            file: path.to_path_buf(),
            expected: expected.into(),
            actual,
        })
    }
}

/// The MNIST directory: the `--data-dir` flag, else `$MNIST_DIR` (when set and not empty), else
/// `./data/mnist` when that directory exists, else the workspace's `data/mnist` (which holds the
/// four `.gz` files).
pub fn resolve_data_dir(flag: Option<&Path>) -> PathBuf {
    let env = std::env::var_os("MNIST_DIR");
    let local = Path::new("data").join("mnist");
    resolve_data_dir_with(flag, env.as_deref(), local.is_dir())
}

/// The precedence of [`resolve_data_dir`] with its inputs injected: `flag`, the value of
/// `MNIST_DIR` (`None` or empty: unset), and whether `./data/mnist` exists.
pub fn resolve_data_dir_with(
    flag: Option<&Path>,
    mnist_dir: Option<&OsStr>,
    local_exists: bool,
) -> PathBuf {
    if let Some(flag) = flag {
        return flag.to_path_buf();
    }
    if let Some(env) = mnist_dir.filter(|v| !v.is_empty()) {
        return PathBuf::from(env);
    }
    if local_exists {
        return Path::new("data").join("mnist");
    }
    workspace_data_dir()
}

/// The workspace's `data/mnist` (set at build time), without `..` where it can be resolved.
pub fn workspace_data_dir() -> PathBuf {
    let dir = PathBuf::from(env!("LADDER_WORKSPACE_MNIST"));
    dir.canonicalize().unwrap_or(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_dir_precedence_flag_env_local_workspace() {
        let flag = Path::new("/flag");
        let env = OsStr::new("/env");
        assert_eq!(resolve_data_dir_with(Some(flag), Some(env), true), flag);
        assert_eq!(
            resolve_data_dir_with(None, Some(env), true),
            Path::new("/env")
        );
        assert_eq!(
            resolve_data_dir_with(None, Some(OsStr::new("")), true),
            Path::new("data/mnist")
        );
        assert_eq!(
            resolve_data_dir_with(None, None, true),
            Path::new("data/mnist")
        );
        let ws = resolve_data_dir_with(None, None, false);
        assert_eq!(ws, workspace_data_dir());
        assert!(ws.ends_with("data/mnist"), "{}", ws.display());
        assert!(ws.join("train-images-idx3-ubyte.gz").is_file());
    }

    #[test]
    fn known_md5_accepts_gz_and_raw_names_only() {
        assert_eq!(
            known_md5("t10k-labels-idx1-ubyte.gz"),
            Some("27ae3e4e09519cfbb04c329615203637")
        );
        assert_eq!(
            known_md5("t10k-labels-idx1-ubyte"),
            Some("27ae3e4e09519cfbb04c329615203637")
        );
        assert_eq!(known_md5("other"), None);
        assert_eq!(md5_hex(b""), "d41d8cd98f00b204e9800998ecf8427e");
    }

    #[test]
    fn from_bytes_normalises_as_torchvision() {
        let pixels = [0u8; 784]
            .iter()
            .chain([255u8; 784].iter())
            .copied()
            .collect::<Vec<_>>();
        let d = Dataset::from_bytes(&pixels, &[3, 7]).unwrap();
        assert_eq!(d.images.size(), [2, 1, 28, 28]);
        assert_eq!(d.images.kind(), Kind::Float);
        assert_eq!(d.labels.kind(), Kind::Int64);
        let lo = d.images.double_value(&[0, 0, 0, 0]);
        let hi = d.images.double_value(&[1, 0, 27, 27]);
        assert!((lo - (-0.1307 / 0.3081)).abs() < 1e-6, "{lo}");
        assert!((hi - ((1.0 - 0.1307) / 0.3081)).abs() < 1e-6, "{hi}");
        assert!(Dataset::from_bytes(&pixels, &[3]).is_err());
        let s = d.slice(1..2);
        assert_eq!((s.len(), s.labels.int64_value(&[0])), (1, 7));
        let (x, y) = d.batch(&[1, 0, 1]);
        assert_eq!(x.size(), [3, 1, 28, 28]);
        assert_eq!(Vec::<i64>::try_from(&y).unwrap(), [7, 3, 7]);
    }
}
