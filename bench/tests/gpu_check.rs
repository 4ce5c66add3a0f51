//! `scripts/gpu-check.sh` refuses at once, with one clear line and exit status 2, on a machine
//! without an NVIDIA GPU — before it bootstraps, builds or writes anything.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().join("scripts/gpu-check.sh")
}

/// Runs the script with `NVIDIA_SMI` set to `smi` (None: left unset, the machine's own), its
/// output directory in a temp dir; the output, how long it took, and whether the directory exists.
fn gpu_check(smi: Option<&Path>) -> (Output, Duration, bool) {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("gpu-check");
    let mut cmd = Command::new("bash");
    cmd.arg(script()).env("GPU_CHECK_OUT", &out_dir).env_remove("NVIDIA_SMI");
    if let Some(smi) = smi {
        cmd.env("NVIDIA_SMI", smi);
    }
    let t = Instant::now();
    let out = cmd.output().unwrap();
    (out, t.elapsed(), out_dir.exists())
}

fn assert_refused(out: &Output, took: Duration, wrote: bool, why: &str) {
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(2), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert_eq!(
        stderr.trim(),
        format!(
            "gpu-check: refused: {}. This check needs a machine with an NVIDIA GPU; nothing was built or run.",
            why.trim_end_matches('.')
        ),
    );
    assert!(stdout.is_empty(), "nothing else is printed: {stdout}");
    assert!(!wrote, "no output directory is created");
    assert!(took < Duration::from_secs(10), "refused at once, not after a build: {took:?}");
}

/// A fake `nvidia-smi` in `dir` that prints `text` and exits with `code`.
fn fake_smi(dir: &Path, text: &str, code: i32) -> PathBuf {
    let path = dir.join("nvidia-smi");
    write_executable(&path, &format!("#!/bin/sh\ncat <<'MSG'\n{text}\nMSG\nexit {code}\n"));
    path
}

/// Writes an executable script through a child `sh`: a file this process held open for writing
/// can be inherited by another test thread's fork, and running it then fails with ETXTBSY
/// ("Text file busy") — a flaky refusal message, seen under load.
fn write_executable(path: &Path, body: &str) {
    let st = Command::new("sh").args(["-c", "printf '%s' \"$1\" > \"$2\" && chmod 755 \"$2\"", "sh", body]).arg(path).status().unwrap();
    assert!(st.success(), "writing {}", path.display());
}

#[test]
fn refuses_without_nvidia_smi() {
    let missing = Path::new("/nonexistent/nvidia-smi");
    let (out, took, wrote) = gpu_check(Some(missing));
    assert_refused(&out, took, wrote, "no NVIDIA GPU on this machine (/nonexistent/nvidia-smi not found)");
}

#[test]
fn refuses_when_nvidia_smi_fails_or_lists_no_gpu() {
    let dir = tempfile::tempdir().unwrap();
    let msg = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.";
    let smi = fake_smi(dir.path(), msg, 9);
    let (out, took, wrote) = gpu_check(Some(&smi));
    assert_refused(&out, took, wrote, &format!("{} failed: {msg}", smi.display()));
    let dir = tempfile::tempdir().unwrap();
    let smi = fake_smi(dir.path(), "No devices were found", 0);
    let (out, took, wrote) = gpu_check(Some(&smi));
    assert_refused(&out, took, wrote, &format!("{} lists no GPU", smi.display()));
}

#[test]
fn refuses_on_this_machine_when_it_has_no_gpu() {
    // The script as a user runs it here: the machine's own nvidia-smi, if any. This project's
    // CPU machines have none; on a GPU machine this case is the GPU check itself, not a test.
    let has_smi = Command::new("sh").args(["-c", "command -v nvidia-smi"]).output().unwrap().status.success();
    if has_smi {
        eprintln!("nvidia-smi is on PATH: this machine may have a GPU; the refusal is covered by the other tests");
        return;
    }
    let (out, took, wrote) = gpu_check(None);
    assert_refused(&out, took, wrote, "no NVIDIA GPU on this machine (nvidia-smi not found)");
}

/// `GPU_CHECK_PREBUILT` naming a directory without the binaries: one line naming the missing
/// binary and the script that makes them, exit status 1, nothing run (a fake GPU lets it past
/// the refusal).
#[test]
fn prebuilt_directory_without_the_binaries_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let smi = fake_smi(dir.path(), "GPU 0: NVIDIA Fake (UUID: GPU-0)", 0);
    let prebuilt = dir.path().join("prebuilt");
    std::fs::create_dir(&prebuilt).unwrap();
    let out = Command::new("bash")
        .arg(script())
        .env("NVIDIA_SMI", &smi)
        .env("GPU_CHECK_OUT", dir.path().join("out"))
        .env("GPU_CHECK_PREBUILT", &prebuilt)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        stderr.trim(),
        format!("gpu-check: GPU_CHECK_PREBUILT={} has no executable level1-raw-ddp (scripts/gpu-prebuild.sh makes it)", prebuilt.display())
    );
}

/// `scripts/gpu-prebuild.sh` refuses a directory that is not a torch package before building
/// anything, naming it (exit status 2), and a wrong number of arguments with its usage.
#[test]
fn gpu_prebuild_refuses_what_is_not_a_torch_directory() {
    let prebuild = script().with_file_name("gpu-prebuild.sh");
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new("bash").arg(&prebuild).arg(dir.path()).arg(dir.path().join("out")).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let torch = dir.path().canonicalize().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).trim(),
        format!(
            "gpu-prebuild: {} is not a torch package directory (no include/torch/csrc/api/include/torch/torch.h or lib/)",
            torch.display()
        )
    );
    assert!(!dir.path().join("out").exists(), "nothing is written");
    let missing = dir.path().join("no-torch-here");
    let out = Command::new("bash").arg(&prebuild).arg(&missing).arg(dir.path().join("out")).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).trim(),
        format!("gpu-prebuild: {}: no such directory (expected a torch package directory)", missing.display())
    );
    let out = Command::new("bash").arg(&prebuild).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(String::from_utf8_lossy(&out.stderr).trim(), "usage: bash scripts/gpu-prebuild.sh TORCH_DIR OUT_DIR");
}
