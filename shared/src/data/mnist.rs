//! MNIST as `torchvision.datasets.MNIST` with
//! `transforms.Compose([ToTensor(), Normalize((0.1307,), (0.3081,))])`, applied to each batch as it
//! is drawn (the pixels stay uint8, shared between the ranks of a node: see [`super::cache`]).

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use md5::{Digest, Md5};
use tch::{Device, Kind, Tensor};

use super::cache::{self, SharedBytes};
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
    Md5::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// What to do when an MNIST file is missing.
pub(crate) const MISSING_HINT: &str = "get the MNIST files with --download (mirrors from --mirror or \
MNIST_MIRRORS, comma-separated), or point --data-dir (or MNIST_DIR) at a directory holding them";

/// One split of MNIST: the raw pixel bytes (uint8, 47 MB for the training split, usually a
/// read-only mapping shared by every rank of the node, see [`super::cache`]) and the labels;
/// each batch is normalised as it is drawn.
///
/// Why not normalise once up front, as before: the normalised f32 images take four times the
/// bytes (188 MB + 31 MB) in every rank, while normalising a batch of 64 takes tens of
/// microseconds next to a step of tens of milliseconds. A pixel byte has only 256 values, so
/// normalising is one lookup in a 256-entry table computed with the very tensor operations the
/// whole split used to go through ([`normalize_table`]): the values are the same, bit for bit.
#[derive(Debug)]
pub struct Dataset {
    images: Images,
    /// `[N]` i64 digit classes in `0..=9`, on the dataset's device.
    pub labels: Tensor,
    device: Device,
}

#[derive(Debug)]
enum Images {
    /// Raw pixel bytes: sample `i` is `bytes[offset + i * 784..][..784]`.
    Pixels { bytes: SharedBytes, offset: usize },
    /// The raw pixel bytes as a `[N, 784]` u8 tensor on the dataset's device and
    /// [`normalize_table`] there (`[256]` f32): a batch is two `index_select`s on the device.
    PixelTensor { pixels: Tensor, table: Tensor },
    /// Ready-made f32 images `[N, 1, 28, 28]` (see [`Dataset::from_tensors`]).
    Tensor(Tensor),
}

/// Bytes per image (28 × 28).
const PIXELS: usize = idx::SIDE * idx::SIDE;

/// The 256 values `Normalize(MNIST_MEAN, MNIST_STD)(ToTensor()(x))` for pixel bytes `x = 0..=255`,
/// computed once with libtorch's f32 operations in `ToTensor` / `Normalize`'s order (`x as f32
/// / 255`, `- 0.1307`, `/ 0.3081`): looking a byte up here gives exactly what those operations
/// give over a whole tensor.
pub fn normalize_table() -> &'static [f32; 256] {
    static TABLE: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        // Infallible in practice: 256 values on the CPU (a failure here is libtorch's bug).
        let t = normalize_reference(&Tensor::arange(256, (Kind::Uint8, Device::Cpu))).expect("libtorch normalises 256 bytes");
        let v = Vec::<f32>::try_from(&t).expect("256 f32 values");
        let mut table = [0f32; 256];
        table.copy_from_slice(&v);
        table
    })
}

/// `ToTensor` + `Normalize(MNIST_MEAN, MNIST_STD)` of a uint8 tensor as libtorch operations, in
/// f32 (any shape; the result has the same shape). The reference [`normalize_table`] is built
/// from, and what the whole split went through before batches were normalised as drawn.
///
/// # Errors
/// [`Error::Torch`] from libtorch.
pub fn normalize_reference(pixels: &Tensor) -> Result<Tensor> {
    let mut x = pixels.f_to_kind(Kind::Float)?;
    let _ = x.f_div_scalar_(255.0)?;
    let _ = x.f_sub_scalar_(MNIST_MEAN)?;
    let _ = x.f_div_scalar_(MNIST_STD)?;
    Ok(x)
}

impl Dataset {
    /// Builds a dataset from `n` images' raw pixel bytes (`n * 28 * 28`, row-major) and `n` label
    /// bytes (copied); images are normalised as batches are drawn, on the CPU.
    ///
    /// # Errors
    /// [`Error::InvalidValue`] when the lengths disagree; [`Error::Torch`] from libtorch.
    pub fn from_bytes(pixels: &[u8], labels: &[u8]) -> Result<Dataset> {
        Self::from_shared(SharedBytes::from_vec(pixels.to_vec()), 0, labels)
    }

    /// A dataset over `pixels[offset..]` (`n * 28 * 28` bytes) and `n` label bytes.
    ///
    /// # Errors
    /// As [`Dataset::from_bytes`].
    pub fn from_shared(pixels: SharedBytes, offset: usize, labels: &[u8]) -> Result<Dataset> {
        let have = pixels.as_slice().len().saturating_sub(offset);
        if have != labels.len() * PIXELS {
            return Err(Error::invalid(
                "pixels",
                format!("{have} bytes"),
                format!("{} bytes: 28 * 28 per each of the {} labels", labels.len() * PIXELS, labels.len()),
            ));
        }
        let labels = Tensor::from_slice(labels).f_to_kind(Kind::Int64)?;
        Ok(Dataset { images: Images::Pixels { bytes: pixels, offset }, labels, device: Device::Cpu })
    }

    /// A dataset of ready-made images `[N, 1, 28, 28]` f32 and labels `[N]` i64 on one device
    /// (e.g. synthetic data in tests); batches are `index_select`s of them.
    ///
    /// # Errors
    /// [`Error::InvalidValue`] when the shapes, kinds or devices disagree.
    pub fn from_tensors(images: Tensor, labels: Tensor) -> Result<Dataset> {
        let (is, ls) = (images.size(), labels.size());
        if is.len() != 4 || is[1..] != [1, 28, 28] || images.kind() != Kind::Float {
            return Err(Error::invalid("images", format!("{:?} {:?}", images.kind(), is), "[N, 1, 28, 28] f32"));
        }
        if ls != [is[0]] || labels.kind() != Kind::Int64 || labels.device() != images.device() {
            return Err(Error::invalid(
                "labels",
                format!("{:?} {ls:?} on {:?}", labels.kind(), labels.device()),
                format!("[{}] i64 on {:?}, one per image", is[0], images.device()),
            ));
        }
        let device = images.device();
        Ok(Dataset { images: Images::Tensor(images), labels, device })
    }

    /// `n` synthetic samples that say where they went: image `i` (`[1, 28, 28]` f32, standard
    /// normal, seeded with 99 so every rank builds the same set) carries `i` in its first pixel,
    /// labels are uniform in 0..10 (i64). For tests that trace which sample each rank trained
    /// on (the sampler's order, a resume's remainder) at any level. `n` ≥ 0.
    pub fn indexed(n: i64) -> Dataset {
        tch::manual_seed(99);
        let images = Tensor::randn([n, 1, 28, 28], (Kind::Float, Device::Cpu));
        images.select(1, 0).select(1, 0).select(1, 0).copy_(&Tensor::arange(n, (Kind::Float, Device::Cpu)));
        let labels = Tensor::randint(10, [n], (Kind::Int64, Device::Cpu));
        Dataset::from_tensors(images, labels).expect("[n, 1, 28, 28] f32 images and [n] i64 labels on the CPU")
    }

    /// Number of samples `N`.
    pub fn len(&self) -> usize {
        self.labels.size().first().map_or(0, |&n| n.max(0) as usize)
    }

    /// Whether the dataset holds no samples.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The device batches are returned on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The raw pixel bytes of the samples, `len() * 784` bytes (row-major, 0 = background), and
    /// the cache file they map when shared; `None` for a dataset built [`Dataset::from_tensors`],
    /// and moved to a GPU ([`Dataset::to_device`]).
    pub fn pixels(&self) -> Option<(&[u8], Option<&Path>)> {
        match &self.images {
            Images::Pixels { bytes, offset } => Some((&bytes.as_slice()[*offset..*offset + self.len() * PIXELS], bytes.mapped_path())),
            Images::PixelTensor { .. } | Images::Tensor(_) => None,
        }
    }

    /// The samples at `indices`, in that order: `(images [b, 1, 28, 28] f32, labels [b] i64)` with
    /// `b = indices.len()`, on the dataset's device; images normalised as
    /// `Normalize((0.1307,), (0.3081,))(ToTensor()(x))`.
    ///
    /// # Panics
    /// When an index is outside `0..len()`, like slice indexing (a programming error: the
    /// samplers only yield valid indices, and [`super::DataLoader::new`] checks its sampler).
    pub fn batch(&self, indices: &[i64]) -> (Tensor, Tensor) {
        // Checked on the host for every kind of dataset: on a GPU an index out of range is a
        // device-side assert that breaks the CUDA context, not an error.
        self.check_indices(indices, "Dataset::batch");
        let idx = Tensor::from_slice(indices).to_device(self.device);
        let Images::Pixels { bytes, offset } = &self.images else { return self.batch_at(&idx) };
        let (pixels, table) = (bytes.as_slice(), normalize_table());
        let mut out = Vec::with_capacity(indices.len() * PIXELS);
        for &i in indices {
            let at = offset + i as usize * PIXELS;
            out.extend(pixels[at..at + PIXELS].iter().map(|&p| table[p as usize]));
        }
        let images = Tensor::from_slice(&out).view([indices.len() as i64, 1, idx::SIDE as i64, idx::SIDE as i64]);
        (images, self.labels.index_select(0, &idx))
    }

    /// One epoch's sample order (`indices`, each in `0..len()`), placed where this dataset draws
    /// batches: for a dataset held as tensors (on a GPU, or built from tensors) it is copied to
    /// the dataset's device once, so that drawing a batch ([`Dataset::batch_in`]) copies
    /// nothing from the host.
    ///
    /// # Panics
    /// When an index is outside `0..len()`, as [`Dataset::batch`] (checked here, on the host).
    pub fn epoch_order(&self, indices: Vec<i64>) -> EpochOrder {
        let on_device = matches!(self.images, Images::PixelTensor { .. } | Images::Tensor(_)).then(|| {
            self.check_indices(&indices, "Dataset::epoch_order");
            Tensor::from_slice(&indices).to_device(self.device)
        });
        EpochOrder { indices, on_device }
    }

    /// Panics, naming `what`, when an index is outside `0..len()`.
    fn check_indices(&self, indices: &[i64], what: &str) {
        let n = self.len();
        if let Some(bad) = indices.iter().find(|&&i| usize::try_from(i).map_or(true, |i| i >= n)) {
            panic!("{what}: index {bad} outside 0..{n}");
        }
    }

    /// The samples at `order`'s positions `range`, as [`Dataset::batch`] of those indices.
    ///
    /// # Panics
    /// As [`Dataset::batch`], and when `range` is not within the order, like slice indexing.
    pub fn batch_in(&self, order: &EpochOrder, range: std::ops::Range<usize>) -> (Tensor, Tensor) {
        match &order.on_device {
            Some(all) => {
                assert!(range.start <= range.end && range.end <= order.indices.len(), "Dataset::batch_in: {range:?} outside the order");
                self.batch_at(&all.narrow(0, range.start as i64, (range.end - range.start) as i64))
            }
            None => self.batch(&order.indices[range]),
        }
    }

    /// A batch drawn on the dataset's device, `idx` `[b]` i64 there, checked: the tensor
    /// variants' path (pixel bytes on the host go through [`Dataset::batch`]'s own loop).
    fn batch_at(&self, idx: &Tensor) -> (Tensor, Tensor) {
        let images = match &self.images {
            Images::PixelTensor { pixels, table } => {
                let codes = pixels.index_select(0, idx).to_kind(Kind::Int).view([-1]);
                table.index_select(0, &codes).view([idx.size()[0], 1, idx::SIDE as i64, idx::SIDE as i64])
            }
            Images::Tensor(t) => t.index_select(0, idx),
            Images::Pixels { .. } => unreachable!("pixel bytes on the host are batched by Dataset::batch"),
        };
        (images, self.labels.index_select(0, idx))
    }

    /// Every sample's image, normalised: `[N, 1, 28, 28]` f32 on the dataset's device (a new
    /// tensor for pixel datasets: take a [`Dataset::slice`] first for part of the set).
    pub fn images(&self) -> Tensor {
        match &self.images {
            Images::Pixels { .. } | Images::PixelTensor { .. } => self.batch(&(0..self.len() as i64).collect::<Vec<_>>()).0,
            Images::Tensor(t) => t.shallow_clone(),
        }
    }

    /// The samples `range` as a dataset that shares storage with this one (no copy).
    ///
    /// # Panics
    /// When `range` is not within `0..len()`, like slice indexing.
    pub fn slice(&self, range: std::ops::Range<usize>) -> Dataset {
        assert!(range.start <= range.end && range.end <= self.len(), "Dataset::slice: range {range:?} is not within 0..{}", self.len());
        let (start, len) = (range.start as i64, (range.end - range.start) as i64);
        let images = match &self.images {
            Images::Pixels { bytes, offset } => Images::Pixels { bytes: bytes.clone(), offset: offset + range.start * PIXELS },
            Images::PixelTensor { pixels, table } => {
                Images::PixelTensor { pixels: pixels.narrow(0, start, len), table: table.shallow_clone() }
            }
            Images::Tensor(t) => Images::Tensor(t.narrow(0, start, len)),
        };
        Dataset { images, labels: self.labels.narrow(0, start, len), device: self.device }
    }

    /// The dataset with its batches on `device`: labels and images are copied there. On a GPU
    /// the pixels go as their raw bytes (`[N, 784]` u8: 47 MB for the training split, a quarter
    /// of the normalised f32 images a speed-minded PyTorch loop moves there) with the 256-entry
    /// normalisation table, and a batch is normalised on the device — the same values, bit for
    /// bit, with no host work or host-to-device copy per batch. On the CPU the pixel bytes stay
    /// shared between the ranks ([`super::cache`]).
    pub fn to_device(&self, device: Device) -> Dataset {
        let images = match &self.images {
            Images::Pixels { bytes, offset } if device == Device::Cpu => Images::Pixels { bytes: bytes.clone(), offset: *offset },
            Images::Pixels { .. } => return self.with_pixel_tensor().to_device(device),
            Images::PixelTensor { pixels, table } => {
                Images::PixelTensor { pixels: pixels.to_device(device), table: table.to_device(device) }
            }
            Images::Tensor(t) => Images::Tensor(t.to_device(device)),
        };
        Dataset { images, labels: self.labels.to_device(device), device }
    }

    /// The same samples with the pixel bytes held as a `[N, 784]` u8 tensor beside the
    /// normalisation table on the dataset's device, batches normalised by `index_select`s: what
    /// [`Dataset::to_device`] gives on a GPU, here where the dataset is (a copy of the bytes; a
    /// shallow clone for a dataset built from tensors or converted already).
    pub fn with_pixel_tensor(&self) -> Dataset {
        let Images::Pixels { bytes, offset } = &self.images else { return self.shallow_clone() };
        let n = self.len();
        let pixels = Tensor::from_slice(&bytes.as_slice()[*offset..*offset + n * PIXELS]).view([n as i64, PIXELS as i64]);
        let table = Tensor::from_slice(normalize_table().as_slice());
        let (pixels, table) = (pixels.to_device(self.device), table.to_device(self.device));
        Dataset { images: Images::PixelTensor { pixels, table }, labels: self.labels.shallow_clone(), device: self.device }
    }

    /// Another handle on the same storage.
    pub fn shallow_clone(&self) -> Dataset {
        let images = match &self.images {
            Images::Pixels { bytes, offset } => Images::Pixels { bytes: bytes.clone(), offset: *offset },
            Images::PixelTensor { pixels, table } => Images::PixelTensor { pixels: pixels.shallow_clone(), table: table.shallow_clone() },
            Images::Tensor(t) => Images::Tensor(t.shallow_clone()),
        };
        Dataset { images, labels: self.labels.shallow_clone(), device: self.device }
    }
}

/// One epoch's sample order, placed for [`Dataset::batch_in`] by [`Dataset::epoch_order`]: the
/// indices, and on a GPU one `[n]` i64 copy of them on the device.
#[derive(Debug)]
pub struct EpochOrder {
    indices: Vec<i64>,
    on_device: Option<Tensor>,
}

impl EpochOrder {
    /// The number of samples in the order.
    pub fn len(&self) -> usize {
        self.indices.len()
    }

    /// Whether the order is empty.
    pub fn is_empty(&self) -> bool {
        self.indices.is_empty()
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
            let test = s.spawn(|| load_split(&locate(dir, TEST_IMAGES)?, &locate(dir, TEST_LABELS)?));
            let train = load_split(&locate(dir, TRAIN_IMAGES)?, &locate(dir, TRAIN_LABELS)?);
            let test = test.join().unwrap_or_else(|p| std::panic::resume_unwind(p));
            Ok::<_, Error>((train?, test?))
        })?;
        Ok(Mnist { train, test })
    }

    /// As `torchvision.datasets.MNIST(dir, download=True)`: downloads the files missing from
    /// `dir` or failing their integrity check (see [`super::download_missing`]; `mirrors` as
    /// [`super::mirrors_from_env`]), then [`Mnist::load`]s.
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
        hint: format!("looked for {} and {}; {}{MISSING_HINT}", raw.display(), gz.display(), bundled_hint(dir, name)),
        file: gz,
    })
}

/// Where the data directory came from, and how to use the bundled copy when `dir` is not it:
/// the part of a missing-file error that lists every place searched.
fn bundled_hint(dir: &Path, name: &str) -> String {
    let ws = workspace_data_dir();
    let order = "the data directory is --data-dir, else $MNIST_DIR, else ./data/mnist when that \
                 directory exists, else the bundled copy";
    let same = dir.canonicalize().ok().is_some_and(|d| d == ws);
    if same || !ws.join(format!("{name}.gz")).is_file() {
        return format!("{order}; ");
    }
    let shadow = if dir == Path::new("data").join("mnist") {
        let cwd = std::env::current_dir().map(|d| d.join(dir).display().to_string()).unwrap_or_else(|_| dir.display().to_string());
        format!(" ({cwd} exists in the working directory, so it was used instead of the bundled copy)")
    } else {
        String::new()
    };
    format!("{order}{shadow}; the bundled copy is {ws}: use it with --data-dir {ws} (or MNIST_DIR={ws}); or ", ws = ws.display())
}

/// Reads one split from an images and a labels IDX file (raw, or gzip when the name ends in `.gz`).
///
/// Checks as [`Mnist::load`]; the MD5 is checked only for files named as one of the four MNIST
/// files (with or without `.gz`), so other IDX files (e.g. Fashion-MNIST) load too.
///
/// # Errors
/// As [`Mnist::load`].
pub fn load_split(images_path: &Path, labels_path: &Path) -> Result<Dataset> {
    // The images: a verified, shared mapping of the decompressed cache when it can be had.
    let image_bytes = cache::decompressed(images_path)?;
    let (n_images, _) = idx::parse_images(image_bytes.as_slice(), images_path)?;
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
    if !image_bytes.verified() {
        verify_md5(images_path, image_bytes.as_slice())?;
    }
    verify_md5(labels_path, &label_bytes)?;
    // The labels' decoded bytes are freed on return (the dataset holds them as an i64 tensor).
    Dataset::from_shared(image_bytes, idx::IMAGES_HEADER, labels)
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
        Err(Error::ChecksumMismatch { file: path.to_path_buf(), expected: expected.into(), actual })
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
fn resolve_data_dir_with(flag: Option<&Path>, mnist_dir: Option<&OsStr>, local_exists: bool) -> PathBuf {
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
        assert_eq!(resolve_data_dir_with(None, Some(env), true), Path::new("/env"));
        assert_eq!(resolve_data_dir_with(None, Some(OsStr::new("")), true), Path::new("data/mnist"));
        assert_eq!(resolve_data_dir_with(None, None, true), Path::new("data/mnist"));
        let ws = resolve_data_dir_with(None, None, false);
        assert_eq!(ws, workspace_data_dir());
        assert!(ws.ends_with("data/mnist"), "{}", ws.display());
        assert!(ws.join("train-images-idx3-ubyte.gz").is_file());
    }

    #[test]
    fn known_md5_accepts_gz_and_raw_names_only() {
        assert_eq!(known_md5("t10k-labels-idx1-ubyte.gz"), Some("27ae3e4e09519cfbb04c329615203637"));
        assert_eq!(known_md5("t10k-labels-idx1-ubyte"), Some("27ae3e4e09519cfbb04c329615203637"));
        assert_eq!(known_md5("other"), None);
        assert_eq!(md5_hex(b""), "d41d8cd98f00b204e9800998ecf8427e");
    }

    #[test]
    fn from_bytes_normalises_as_torchvision() {
        let pixels = [0u8; 784].iter().chain([255u8; 784].iter()).copied().collect::<Vec<_>>();
        let d = Dataset::from_bytes(&pixels, &[3, 7]).unwrap();
        let images = d.images();
        assert_eq!(images.size(), [2, 1, 28, 28]);
        assert_eq!(images.kind(), Kind::Float);
        assert_eq!(d.labels.kind(), Kind::Int64);
        let lo = images.double_value(&[0, 0, 0, 0]);
        let hi = images.double_value(&[1, 0, 27, 27]);
        assert!((lo - (-0.1307 / 0.3081)).abs() < 1e-6, "{lo}");
        assert!((hi - ((1.0 - 0.1307) / 0.3081)).abs() < 1e-6, "{hi}");
        assert!(Dataset::from_bytes(&pixels, &[3]).is_err());
        let s = d.slice(1..2);
        assert_eq!((s.len(), s.labels.int64_value(&[0])), (1, 7));
        let (x, y) = d.batch(&[1, 0, 1]);
        assert_eq!(x.size(), [3, 1, 28, 28]);
        assert_eq!(Vec::<i64>::try_from(&y).unwrap(), [7, 3, 7]);
    }

    #[test]
    fn a_pixel_tensor_draws_the_same_batches_bit_for_bit() {
        // Every byte value, in a pattern that differs per image, and a slice of the set.
        let pixels: Vec<u8> = (0..5 * 784).map(|i| ((i * 7 + i / 784 * 13) % 256) as u8).collect();
        let d = Dataset::from_bytes(&pixels, &[1, 2, 3, 4, 5]).unwrap();
        let t = d.with_pixel_tensor();
        assert!(t.pixels().is_none(), "the bytes are a tensor now");
        for (a, b) in [(&d, &t), (&d.slice(1..4), &t.slice(1..4))] {
            let order = [2i64, 0, 2, 1];
            let (xa, ya) = a.batch(&order);
            let placed = b.epoch_order(order.to_vec());
            assert_eq!(placed.len(), 4);
            let (xb, yb) = b.batch_in(&placed, 1..4);
            assert_eq!(xb.size(), [3, 1, 28, 28]);
            let bits = |x: &Tensor| Vec::<f32>::try_from(x.reshape([-1])).unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&xb), bits(&xa.narrow(0, 1, 3)));
            assert_eq!(Vec::<i64>::try_from(&yb).unwrap(), Vec::<i64>::try_from(&ya.narrow(0, 1, 3)).unwrap());
            assert_eq!(bits(&b.images()), bits(&a.images()));
            let (la, lb) = (super::super::DataLoader::shuffled(a, 2, 3).unwrap(), super::super::DataLoader::shuffled(b, 2, 3).unwrap());
            let drawn = la.iter().zip(lb.iter()).map(|((xa, ya), (xb, yb))| {
                assert_eq!(bits(&xa), bits(&xb));
                assert!(ya.equal(&yb));
            });
            assert_eq!(drawn.count(), a.len().div_ceil(2));
        }
        assert!(d.to_device(Device::Cpu).pixels().is_some(), "on the CPU the raw bytes stay shared");
        let bad = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| t.epoch_order(vec![0, 5])));
        assert!(bad.is_err(), "index 5 of 5 samples is refused on the host");
    }
}
