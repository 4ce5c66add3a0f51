//! Running one measured process: its output goes to a log file and feeds a live progress line;
//! it is killed (with everything it started) when it outlives its time limit.

use crate::error::{Error, Result};
use indicatif::{ProgressBar, ProgressStyle};
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// What a finished process left.
#[derive(Debug, Clone)]
pub struct Finished {
    /// Seconds from spawn to exit (what the user waited).
    pub wall_s: f64,
    /// Every stdout line, in order.
    pub stdout: Vec<String>,
    /// The last lines of stdout and stderr together (for error messages).
    pub tail: String,
}

/// Runs `cmd` to completion under a live progress line labelled `what`, appending all its output
/// to `log`. The progress line (a spinner with the elapsed time and the last line printed) shows
/// on a terminal only; elsewhere nothing is drawn.
///
/// The process stays in the bench's process group, so that Ctrl-C reaches it and everything it
/// started. On timeout it gets SIGTERM (ladder-run, mpirun and torchrun pass that on to their
/// ranks and exit), then SIGKILL 10 s later if it is still there.
///
/// # Errors
/// [`Error::Spawn`] if it cannot start; [`Error::RunFailed`] naming `what` with its exit status
/// (or signal, or the timeout) and its last 12 lines; [`Error::Io`] naming `log`.
pub fn run_logged(what: &str, cmd: &mut Command, log: &Path, timeout: Duration) -> Result<Finished> {
    if let Some(dir) = log.parent() {
        std::fs::create_dir_all(dir).map_err(Error::io(dir))?;
    }
    let mut log_file = std::fs::File::create(log).map_err(Error::io(log))?;
    let _ = writeln!(log_file, "$ {}", describe(cmd));
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let start = Instant::now();
    let mut child = cmd.spawn().map_err(|source| Error::Spawn { program: cmd.get_program().to_string_lossy().into_owned(), source })?;
    let (tx, rx) = mpsc::channel::<(bool, String)>();
    let mut readers = Vec::new();
    if let Some(out) = child.stdout.take() {
        let tx = tx.clone();
        readers.push(std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(std::result::Result::ok) {
                let _ = tx.send((true, line));
            }
        }));
    }
    if let Some(err) = child.stderr.take() {
        let tx = tx.clone();
        readers.push(std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(std::result::Result::ok) {
                let _ = tx.send((false, line));
            }
        }));
    }
    drop(tx);

    let bar = ProgressBar::new_spinner();
    bar.set_style(
        ProgressStyle::with_template("  {spinner} {prefix} [{elapsed}] {wide_msg}").unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    bar.set_prefix(what.to_string());
    bar.enable_steady_tick(Duration::from_millis(200));

    let (mut stdout, mut tail) = (Vec::new(), std::collections::VecDeque::new());
    let mut timed_out = false;
    let status = loop {
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok((is_stdout, line)) => {
                let _ = writeln!(log_file, "{line}");
                if !line.trim().is_empty() {
                    bar.set_message(line.clone());
                }
                tail.push_back(line.clone());
                if tail.len() > 12 {
                    tail.pop_front();
                }
                if is_stdout {
                    stdout.push(line);
                }
                continue;
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                // Both pipes closed: wait for the exit, but still within the time limit.
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        if let Some(status) = child.try_wait().map_err(Error::io(log))? {
            break status;
        }
        if start.elapsed() > timeout {
            timed_out = true;
            let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).stderr(Stdio::null()).status();
            let grace = Instant::now();
            while grace.elapsed() < Duration::from_secs(10) && matches!(child.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = child.kill();
            break child.wait().map_err(Error::io(log))?;
        }
    };
    // Drain what the readers still hold (they end when the pipes close; after a timeout the
    // group is dead, but do not wait on a pipe some escaped process may still hold).
    if !timed_out {
        for r in readers {
            let _ = r.join();
        }
    }
    for (is_stdout, line) in rx.try_iter() {
        let _ = writeln!(log_file, "{line}");
        tail.push_back(line.clone());
        if is_stdout {
            stdout.push(line);
        }
    }
    while tail.len() > 12 {
        tail.pop_front();
    }
    bar.finish_and_clear();
    let wall_s = start.elapsed().as_secs_f64();
    let tail = tail.into_iter().collect::<Vec<_>>().join("\n");
    if timed_out {
        return Err(Error::RunFailed { what: what.into(), status: format!("killed after the {} s time limit", timeout.as_secs()), tail });
    }
    if !status.success() {
        let status = match (status.code(), std::os::unix::process::ExitStatusExt::signal(&status)) {
            (Some(c), _) => format!("exit code {c}"),
            (None, Some(s)) => format!("killed by signal {s}"),
            _ => status.to_string(),
        };
        return Err(Error::RunFailed { what: what.into(), status, tail });
    }
    Ok(Finished { wall_s, stdout, tail })
}

/// `program arg arg …` for logs.
pub fn describe(cmd: &Command) -> String {
    std::iter::once(cmd.get_program()).chain(cmd.get_args()).map(|a| a.to_string_lossy().into_owned()).collect::<Vec<_>>().join(" ")
}
