//! The lean data path: uint8 pixels normalised as batches are drawn (bit for bit the values the
//! whole-split f32 tensor had), one decompressed cache file per node mapped by every rank (shared
//! pages), and a corrupt, cut short or unwritable cache handled without an error.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};

use ladder_core::data::mnist::{workspace_data_dir, TEST_IMAGES, TRAIN_IMAGES};
use ladder_core::data::{DataLoader, Dataset, Mnist, RandomSampler, Sampler};
use tch::{Kind, Tensor};

const CHILD_ENV: &str = "LADDER_DATA_CACHE_CHILD";

/// What the whole split went through before this change (`Dataset::from_bytes` then):
/// uint8 → f32, `/ 255`, `- 0.1307`, `/ 0.3081`, in place, over all images at once.
fn precomputed(pixels: &[u8]) -> Tensor {
    let n = (pixels.len() / 784) as i64;
    let mut images = Tensor::from_slice(pixels).view([n, 1, 28, 28]).to_kind(Kind::Float);
    let _ = images.f_div_scalar_(255.0).unwrap();
    let _ = images.f_sub_scalar_(0.1307).unwrap();
    let _ = images.f_div_scalar_(0.3081).unwrap();
    images
}

fn bits(t: &Tensor) -> Vec<i32> {
    Vec::<i32>::try_from(&t.contiguous().view_dtype(Kind::Int).flatten(0, -1)).unwrap()
}

/// A temp dir holding copies of the four bundled `.gz` files.
fn copy_of_mnist() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(workspace_data_dir()).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "gz") {
            std::fs::copy(&path, dir.path().join(path.file_name().unwrap())).unwrap();
        }
    }
    dir
}

fn cache_of(d: &Dataset) -> PathBuf {
    d.pixels().unwrap().1.expect("the pixels map a cache file").to_path_buf()
}

fn inode(path: &Path) -> (u64, u64) {
    let m = std::fs::metadata(path).unwrap();
    (m.dev(), m.ino())
}

#[test]
fn per_batch_normalisation_equals_the_precomputed_tensor_bit_for_bit() {
    let m = Mnist::load(&workspace_data_dir()).unwrap();
    for (name, d) in [("train", &m.train), ("test", &m.test)] {
        let reference = precomputed(d.pixels().unwrap().0);
        // The whole split, and batches drawn in a shuffled order through the loader.
        assert_eq!(bits(&d.images()), bits(&reference), "{name}: images() differ from the precomputed tensor");
        let order: Vec<i64> = RandomSampler::new(d.len(), 3).indices().into_iter().map(|i| i as i64).collect();
        let loader = DataLoader::new(d, 1000, Box::new(RandomSampler::new(d.len(), 3))).unwrap();
        let mut seen = 0;
        for (x, y) in loader.iter() {
            let b = x.size()[0] as usize;
            let idx = Tensor::from_slice(&order[seen..seen + b]);
            assert_eq!(bits(&x), bits(&reference.index_select(0, &idx)), "{name}: a shuffled batch differs");
            assert!(y.equal(&d.labels.index_select(0, &idx)));
            seen += b;
        }
        assert_eq!(seen, d.len());
    }
}

#[test]
fn cache_is_built_once_then_mapped_and_a_corrupt_or_cut_short_one_is_rebuilt() {
    let dir = copy_of_mnist();
    let first = Mnist::load(dir.path()).unwrap();
    let train_cache = dir.path().join(format!("{TRAIN_IMAGES}.cache"));
    assert_eq!(cache_of(&first.train), train_cache);
    assert_eq!(cache_of(&first.test), dir.path().join(format!("{TEST_IMAGES}.cache")));
    // The cache is the decompressed IDX file itself (16-byte header + 60,000 · 784 pixels).
    assert_eq!(std::fs::metadata(&train_cache).unwrap().len(), 47_040_016);
    let reference = bits(&first.train.images());
    let built = inode(&train_cache);
    drop(first);

    // Valid: mapped as it is, not rebuilt.
    let again = Mnist::load(dir.path()).unwrap();
    assert_eq!(inode(&train_cache), built, "a valid cache was rebuilt");
    drop(again);

    // One byte changed in the middle, cut to half, emptied: each is detected and rebuilt.
    type Damage = (&'static str, fn(&Path));
    let damage: [Damage; 3] = [
        ("a flipped byte", |p| {
            let mut b = std::fs::read(p).unwrap();
            b[20_000_000] ^= 0x5a;
            std::fs::write(p, b).unwrap();
        }),
        ("cut short", |p| {
            let f = std::fs::OpenOptions::new().write(true).open(p).unwrap();
            f.set_len(23_520_008).unwrap();
        }),
        ("empty", |p| std::fs::write(p, b"").unwrap()),
    ];
    for (what, damage) in damage {
        damage(&train_cache);
        let damaged = inode(&train_cache);
        let m = Mnist::load(dir.path()).unwrap();
        assert_ne!(inode(&train_cache), damaged, "{what}: not rebuilt");
        assert_eq!(std::fs::metadata(&train_cache).unwrap().len(), 47_040_016, "{what}");
        assert_eq!(bits(&m.train.images()), reference, "{what}: the rebuilt data differ");
    }
    // Nothing else is left behind (the temporary files were renamed).
    let mut names: Vec<String> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    names.sort();
    assert_eq!(
        names,
        [
            "t10k-images-idx3-ubyte.cache",
            "t10k-images-idx3-ubyte.gz",
            "t10k-labels-idx1-ubyte.gz",
            "train-images-idx3-ubyte.cache",
            "train-images-idx3-ubyte.gz",
            "train-labels-idx1-ubyte.gz"
        ]
    );
}

/// Starts this test binary as a child that loads MNIST from `dir` and reports its mapping.
#[allow(clippy::zombie_processes)] // `Running::finish` waits for it; a failed read ends the test (and the child with it)
fn spawn_child(dir: &Path, xdg: &Path) -> (Running, String) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_loads_and_reports_its_mapping", "--ignored", "--nocapture", "--test-threads", "1"])
        .env(CHILD_ENV, dir)
        .env("XDG_CACHE_HOME", xdg)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    // libtest prints the test's name first, on the same line.
    let mut line = String::new();
    loop {
        line.clear();
        assert!(out.read_line(&mut line).unwrap() > 0, "the child ended without reporting");
        if let Some(at) = line.find("MAPPED") {
            return (Running { child, out }, line[at..].trim().to_string());
        }
    }
}

/// A child that reported and waits for its stdin to close.
struct Running {
    child: Child,
    out: BufReader<ChildStdout>,
}

impl Running {
    /// Closes its stdin, reads the rest of its output, and checks that it passed.
    fn finish(mut self) {
        drop(self.child.stdin.take());
        let mut rest = String::new();
        self.out.read_to_string(&mut rest).unwrap();
        assert!(self.child.wait().unwrap().success(), "the child failed: {rest}");
    }
}

/// `Shared_Clean` and `Rss` (KiB) of the mapping of `file` in process `pid`.
fn smaps_kib(pid: u32, file: &Path) -> (u64, u64) {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap();
    let name = file.display().to_string();
    let (mut in_map, mut shared, mut rss) = (false, 0, 0);
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if first.contains('-') && first.chars().all(|c| c.is_ascii_hexdigit() || c == '-') {
            in_map = line.ends_with(&name);
        } else if in_map {
            let kib = || line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap();
            match first {
                "Shared_Clean:" => shared += kib(),
                "Rss:" => rss += kib(),
                _ => {}
            }
        }
    }
    (shared, rss)
}

#[test]
fn two_processes_map_the_same_cache_and_share_its_pages() {
    let dir = copy_of_mnist();
    let xdg = tempfile::tempdir().unwrap();
    let (a, line_a) = spawn_child(dir.path(), xdg.path());
    let (b, line_b) = spawn_child(dir.path(), xdg.path());
    // Same file: same device and inode, the node-local cache next to the data.
    assert_eq!(line_a, line_b);
    let cache = dir.path().join(format!("{TRAIN_IMAGES}.cache"));
    let (dev, ino) = inode(&cache);
    assert_eq!(line_a, format!("MAPPED {} {dev} {ino}", cache.display()));
    // Both processes touched every page (MD5 check, images()); the pages are shared: each
    // process's resident pages of the mapping are counted as shared, not private.
    let full_kib = 47_040_016 / 1024;
    for pid in [a.child.id(), b.child.id()] {
        let (shared, rss) = smaps_kib(pid, &cache);
        assert!(rss >= full_kib - 64, "pid {pid}: only {rss} KiB of the mapping resident");
        assert!(shared >= rss - 64, "pid {pid}: {shared} KiB shared of {rss} KiB resident");
    }
    a.finish();
    b.finish();
    // The fallback cache directory was not needed.
    assert_eq!(std::fs::read_dir(xdg.path()).unwrap().count(), 0);
}

#[test]
fn an_unwritable_data_dir_falls_back_to_the_user_cache_then_to_memory() {
    let dir = copy_of_mnist();
    // Root ignores permissions, so make the cache's name unusable instead: a directory there
    // cannot be replaced by the cache file (as a read-only data directory cannot receive it).
    for name in [TRAIN_IMAGES, TEST_IMAGES] {
        std::fs::create_dir(dir.path().join(format!("{name}.cache"))).unwrap();
    }
    let xdg = tempfile::tempdir().unwrap();
    let (child, line) = spawn_child(dir.path(), xdg.path());
    let fallback = xdg.path().join("ddp-ladder/mnist/6bbc9ace898e44ae57da46a324031adb-train-images-idx3-ubyte");
    assert!(line.starts_with(&format!("MAPPED {} ", fallback.display())), "{line}");
    child.finish();

    // No usable cache location at all: decoded in memory, no error.
    let blocked = xdg.path().join("a-file");
    std::fs::write(&blocked, b"not a directory").unwrap();
    let (child, line) = spawn_child(dir.path(), &blocked);
    assert_eq!(line, "MAPPED none");
    child.finish();
}

/// The child of the tests above: loads MNIST from `$LADDER_DATA_CACHE_CHILD`, normalises every
/// image once (touching every page), prints `MAPPED <cache> <dev> <ino>` (or `MAPPED none`), and
/// waits for its stdin to close.
#[test]
#[ignore = "run as a child process by the tests of this file"]
fn child_loads_and_reports_its_mapping() {
    let dir = PathBuf::from(std::env::var_os(CHILD_ENV).expect("run by the tests of this file"));
    let m = Mnist::load(&dir).unwrap();
    assert_eq!(m.train.images().size(), [60_000, 1, 28, 28]);
    match m.train.pixels().unwrap().1 {
        Some(path) => {
            let (dev, ino) = inode(path);
            println!("MAPPED {} {dev} {ino}", path.display());
        }
        None => println!("MAPPED none"),
    }
    std::io::stdout().flush().unwrap();
    let mut rest = String::new();
    let _ = std::io::stdin().read_line(&mut rest);
}
