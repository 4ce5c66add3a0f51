//! Downloading as torchvision's `MNIST(download=True)`, against a loopback HTTP server started by
//! each test (std `TcpListener` on 127.0.0.1:0) and `file://` mirrors.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use ladder_core::data::download::{download_file, parse_mirrors};
use ladder_core::data::mnist::workspace_data_dir;
use ladder_core::data::{default_mirrors, download_missing, Mnist};
use ladder_core::Error;

const NAME: &str = "t10k-labels-idx1-ubyte";

/// What the server answers for a path.
#[derive(Clone)]
enum Reply {
    /// 200 with the body.
    Ok(Vec<u8>),
    /// The status code, with a short HTML body.
    Status(u16),
    /// 200 announcing `Content-Length` of the full body, but only the first half is sent.
    CutShort(Vec<u8>),
}

/// A loopback HTTP/1.1 server answering each path from `routes` (404 otherwise); returns its base
/// URL and the log of requested paths. The thread serves until the test process exits.
fn serve(routes: Vec<(&'static str, Reply)>) -> (String, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let log = Arc::new(Mutex::new(Vec::new()));
    let log2 = Arc::clone(&log);
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let _ = answer(stream, &routes, &log2);
        }
    });
    (base, log)
}

fn answer(mut stream: TcpStream, routes: &[(&str, Reply)], log: &Mutex<Vec<String>>) -> std::io::Result<()> {
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut request_line = String::new();
    reader.read_line(&mut request_line)?;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 || line == "\r\n" {
            break;
        }
    }
    let path = request_line.split_whitespace().nth(1).unwrap_or("").to_string();
    log.lock().unwrap().push(path.clone());
    let reply = routes.iter().find(|(p, _)| *p == path).map(|(_, r)| r.clone()).unwrap_or(Reply::Status(404));
    let (status, body, sent) = match &reply {
        Reply::Ok(b) => (200, b.clone(), b.len()),
        Reply::Status(code) => {
            let b = format!("<html><body><h1>{code}</h1></body></html>").into_bytes();
            let n = b.len();
            (*code, b, n)
        }
        Reply::CutShort(b) => (200, b.clone(), b.len() / 2),
    };
    write!(stream, "HTTP/1.1 {status} X\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len())?;
    stream.write_all(&body[..sent])?;
    stream.flush()
}

fn real_gz(name: &str) -> Vec<u8> {
    std::fs::read(workspace_data_dir().join(format!("{name}.gz"))).unwrap()
}

/// A port nothing listens on (bound, then released).
fn dead_mirror() -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/dead/", l.local_addr().unwrap());
    drop(l);
    url
}

fn snap(name: &str, err: &Error, dir: &Path) {
    let msg = err.to_string().replace(&dir.display().to_string(), "[TMP]");
    insta::with_settings!({ filters => vec![(r"127\.0\.0\.1:\d+", "127.0.0.1:[PORT]")] }, {
        insta::assert_snapshot!(name, msg);
    });
}

#[test]
fn good_file_is_fetched_and_written_atomically() {
    let gz = real_gz(NAME);
    let (base, log) = serve(vec![("/m/t10k-labels-idx1-ubyte.gz", Reply::Ok(gz.clone()))]);
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("sub"); // created on demand
    let path = download_file(&target, NAME, &[format!("{base}/m")]).unwrap();
    assert_eq!(path, target.join("t10k-labels-idx1-ubyte.gz"));
    assert_eq!(std::fs::read(&path).unwrap(), gz);
    // Nothing but the file is left behind (the temporary file was renamed).
    let names: Vec<_> = std::fs::read_dir(&target).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, ["t10k-labels-idx1-ubyte.gz"]);
    assert_eq!(*log.lock().unwrap(), ["/m/t10k-labels-idx1-ubyte.gz"]);
}

#[test]
fn falls_back_after_404() {
    let (bad, bad_log) = serve(vec![]);
    let (good, good_log) = serve(vec![("/t10k-labels-idx1-ubyte.gz", Reply::Ok(real_gz(NAME)))]);
    let dir = tempfile::tempdir().unwrap();
    let path = download_file(dir.path(), NAME, &[format!("{bad}/"), format!("{good}/")]).unwrap();
    assert!(path.is_file());
    assert_eq!(bad_log.lock().unwrap().len(), 1);
    assert_eq!(good_log.lock().unwrap().len(), 1);
}

#[test]
fn html_page_with_200_is_rejected_by_checksum() {
    let html = b"<!DOCTYPE html><html><body>Please log in</body></html>".to_vec();
    let (bad, _) = serve(vec![("/t10k-labels-idx1-ubyte.gz", Reply::Ok(html))]);
    let (good, _) = serve(vec![("/t10k-labels-idx1-ubyte.gz", Reply::Ok(real_gz(NAME)))]);
    let dir = tempfile::tempdir().unwrap();
    let path = download_file(dir.path(), NAME, &[bad, good]).unwrap();
    assert_eq!(std::fs::read(path).unwrap(), real_gz(NAME));
}

#[test]
fn truncated_body_is_rejected() {
    let (bad, _) = serve(vec![("/t10k-labels-idx1-ubyte.gz", Reply::CutShort(real_gz(NAME)))]);
    let (good, _) = serve(vec![("/t10k-labels-idx1-ubyte.gz", Reply::Ok(real_gz(NAME)))]);
    let dir = tempfile::tempdir().unwrap();
    let path = download_file(dir.path(), NAME, &[bad, good]).unwrap();
    assert_eq!(std::fs::read(path).unwrap(), real_gz(NAME));
}

#[test]
fn all_mirrors_failing_lists_each_and_why() {
    let gz = real_gz(NAME);
    let wrong = real_gz("train-labels-idx1-ubyte"); // a valid gzip file, but the wrong one
    let (base, _) = serve(vec![
        ("/html/t10k-labels-idx1-ubyte.gz", Reply::Ok(b"<html>maintenance</html>".to_vec())),
        ("/short/t10k-labels-idx1-ubyte.gz", Reply::CutShort(gz)),
        ("/wrong/t10k-labels-idx1-ubyte.gz", Reply::Ok(wrong)),
        ("/forbidden/t10k-labels-idx1-ubyte.gz", Reply::Status(403)),
    ]);
    let dir = tempfile::tempdir().unwrap();
    let mirrors = vec![
        format!("{base}/missing/"),
        format!("{base}/forbidden"),
        format!("{base}/html/"),
        format!("{base}/short/"),
        format!("{base}/wrong/"),
        dead_mirror(),
        format!("file://{}/nowhere/", dir.path().display()),
        "ftp://example.invalid/mnist/".to_string(),
    ];
    let err = download_file(dir.path(), NAME, &mirrors).unwrap_err();
    let Error::DownloadFailed { file, attempts } = &err else { panic!("{err:?}") };
    assert_eq!(file, "t10k-labels-idx1-ubyte.gz");
    assert_eq!(attempts.lines().count(), mirrors.len());
    assert!(!dir.path().join("t10k-labels-idx1-ubyte.gz").exists());
    snap("all_mirrors_fail", &err, dir.path());
}

#[test]
fn download_missing_fetches_only_what_is_missing_then_loads() {
    // Three files present; the fourth comes from the loopback mirror.
    let dir = tempfile::tempdir().unwrap();
    for name in ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte"] {
        std::fs::copy(workspace_data_dir().join(format!("{name}.gz")), dir.path().join(format!("{name}.gz"))).unwrap();
    }
    let (base, log) = serve(vec![("/t10k-labels-idx1-ubyte.gz", Reply::Ok(real_gz(NAME)))]);
    let mnist = Mnist::load_or_download(dir.path(), &[base]).unwrap();
    assert_eq!(*log.lock().unwrap(), ["/t10k-labels-idx1-ubyte.gz"]);
    assert_eq!((mnist.train.len(), mnist.test.len()), (60_000, 10_000));
    // Nothing missing now: no request at all (the mirror list may even be empty).
    assert!(download_missing(dir.path(), &[]).unwrap().is_empty());
}

#[test]
fn file_mirror_fills_an_empty_dir() {
    let dir = tempfile::tempdir().unwrap();
    let mirror = format!("file://{}", workspace_data_dir().display());
    let written: Vec<PathBuf> = download_missing(&dir.path().join("mnist"), &[mirror]).unwrap();
    assert_eq!(written.len(), 4);
    assert!(written.iter().all(|p| p.extension().is_some_and(|e| e == "gz") && p.is_file()));
}

#[test]
fn mirror_lists() {
    assert_eq!(default_mirrors(), ["https://ossci-datasets.s3.amazonaws.com/mnist/", "http://yann.lecun.com/exdb/mnist/"]);
    assert_eq!(parse_mirrors("http://a/m/, file:///srv/mnist"), ["http://a/m/", "file:///srv/mnist"]);
}

/// A loopback server that accepts every connection and never answers (keeps it open).
fn silent_mirror() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let base = format!("http://{}/silent/", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        let mut open = Vec::new();
        for stream in listener.incoming().flatten() {
            open.push(stream); // held, never written to
        }
    });
    base
}

#[test]
fn a_silent_mirror_is_abandoned_after_the_stall_timeout_for_the_next() {
    use ladder_core::data::download::download_file_with;
    let (good, good_log) = serve(vec![("/t10k-labels-idx1-ubyte.gz", Reply::Ok(real_gz(NAME)))]);
    let dir = tempfile::tempdir().unwrap();
    let stall = std::time::Duration::from_millis(500);
    let path = download_file_with(dir.path(), NAME, &[silent_mirror(), format!("{good}/")], stall).unwrap();
    assert_eq!(std::fs::read(path).unwrap(), real_gz(NAME));
    assert_eq!(good_log.lock().unwrap().len(), 1);
    // Alone, the silent mirror gives an error that says what happened and after how long.
    let err = download_file_with(dir.path(), NAME, &[silent_mirror()], stall).unwrap_err();
    snap("silent_mirror", &err, dir.path());
    assert_eq!(ladder_core::data::download::STALL_TIMEOUT, std::time::Duration::from_secs(10));
}

#[test]
fn a_present_but_corrupt_file_is_fetched_again_with_download() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte"] {
        std::fs::copy(workspace_data_dir().join(format!("{name}.gz")), dir.path().join(format!("{name}.gz"))).unwrap();
    }
    // A .gz cut short: load alone fails and says what to do.
    let mut cut = real_gz(NAME);
    cut.truncate(cut.len() / 2);
    std::fs::write(dir.path().join("t10k-labels-idx1-ubyte.gz"), &cut).unwrap();
    let err = Mnist::load(dir.path()).unwrap_err().to_string();
    assert!(err.ends_with("(delete the file, or pass --download to fetch it again)"), "{err}");
    // With download: fetched again from the mirror, then loads.
    let (base, log) = serve(vec![("/t10k-labels-idx1-ubyte.gz", Reply::Ok(real_gz(NAME)))]);
    let mnist = Mnist::load_or_download(dir.path(), std::slice::from_ref(&base)).unwrap();
    assert_eq!(*log.lock().unwrap(), ["/t10k-labels-idx1-ubyte.gz"]);
    assert_eq!(mnist.test.len(), 10_000);
    assert_eq!(std::fs::read(dir.path().join("t10k-labels-idx1-ubyte.gz")).unwrap(), real_gz(NAME));

    // A raw file with the wrong bytes: replaced by the .gz, and deleted (it would be read first).
    let raw = dir.path().join(NAME);
    let mut bytes = ladder_core::data::idx::gunzip(&real_gz(NAME)).unwrap();
    bytes[100] = (bytes[100] + 1) % 10; // another digit: well-formed, but not MNIST's
    std::fs::write(&raw, bytes).unwrap();
    let err = Mnist::load(dir.path()).unwrap_err().to_string();
    assert!(err.ends_with("; delete the file, or pass --download to fetch it again"), "{err}");
    let written = download_missing(dir.path(), &[base]).unwrap();
    assert_eq!(written, [dir.path().join("t10k-labels-idx1-ubyte.gz")]);
    assert!(!raw.exists());
    assert_eq!(log.lock().unwrap().len(), 2);
    // Everything valid now: nothing is fetched.
    assert!(download_missing(dir.path(), &[]).unwrap().is_empty());
}
