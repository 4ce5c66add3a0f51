//! The rank worker: runs PROGRAM as one rank with the torchrun variables, prefixes its output,
//! keeps its last stderr lines and reports its failure to the top launcher.

use super::*;

/// Runs PROGRAM as this process's rank and returns the worker's exit code (PROGRAM's code,
/// `128 + signal` when it was killed, 127 when it could not start).
pub(super) fn worker(program: &OsStr, args: &[OsString], extra_env: &[(&str, String)], prefix: bool) -> i32 {
    if !sys::set_own_death_signal(sys::SIGTERM) {
        return 1; // the launcher is already gone
    }
    sys::become_group_leader();
    let _handlers = sys::install_termination_handlers();
    let host = host_name();
    let label = program_label(&program.to_string_lossy());
    let report = |rec: &FailureRecord| {
        if let Ok(json) = serde_json::to_string(rec) {
            let _ = std::io::stderr().lock().write_all(format!("{FAILURE_MARKER}{json}\n").as_bytes());
        }
    };
    let env = match DistEnv::from_env() {
        Ok(env) => env,
        Err(e) => {
            let rank = ["OMPI_COMM_WORLD_RANK", "RANK"].iter().find_map(|v| std::env::var(v).ok()?.parse().ok()).unwrap_or(0);
            report(&FailureRecord {
                rank,
                local_rank: 0,
                host,
                pid: std::process::id(),
                exitcode: 1,
                error: Some(e.to_string()),
                program: label,
                last_stderr: Vec::new(),
            });
            return 1;
        }
    };
    let tag = if prefix { format!("[rank{}]: ", env.rank) } else { String::new() };
    let mut cmd = Command::new(program);
    cmd.args(args).envs(env.to_vars()).envs(extra_env.iter().map(|(k, v)| (*k, v.as_str())));
    // torchrun's GROUP_RANK, the node's index (ranks are placed node by node).
    cmd.env("GROUP_RANK", (env.rank / env.local_world_size).to_string());
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    sys::prepare_child(&mut cmd, sys::SIGKILL, false);
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            let (code, why) = match e.kind() {
                std::io::ErrorKind::NotFound => (127, format!("program {program:?} not found on {host} (not a file, and not in PATH)")),
                std::io::ErrorKind::PermissionDenied => (126, format!("program {program:?} is not executable on {host}")),
                _ => (127, format!("cannot start {program:?} on {host}: {e}")),
            };
            report(&FailureRecord {
                rank: env.rank,
                local_rank: env.local_rank,
                host,
                pid: std::process::id(),
                exitcode: code,
                error: Some(why),
                program: label,
                last_stderr: Vec::new(),
            });
            return code;
        }
    };
    let last = Arc::new(Mutex::new(VecDeque::<String>::new()));
    let mut relays = Vec::new();
    if let Some(out) = child.stdout.take() {
        relays.push(prefix_lines(out, tag.clone(), false, None));
    }
    if let Some(err) = child.stderr.take() {
        relays.push(prefix_lines(err, tag, true, Some(last.clone())));
    }
    let mut term_sent: Option<Instant> = None;
    let status = loop {
        match child.try_wait() {
            Ok(Some(st)) => break Some(st),
            Ok(None) => {}
            Err(_) => break None,
        }
        if sys::received_signal().is_some() {
            match term_sent {
                None => {
                    sys::kill_own_group(sys::SIGTERM);
                    term_sent = Some(Instant::now());
                }
                Some(t) if t.elapsed() >= TERM_GRACE => sys::kill_own_group(sys::SIGKILL),
                Some(_) => {}
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    join_all(relays, Duration::from_secs(1));
    let Some(status) = status else { return 1 };
    if let Some(sig) = sys::received_signal() {
        return 128 + sig; // stopped on request: not a failure of this rank
    }
    if status.success() {
        return 0;
    }
    let code = exitcode(status);
    let last_stderr = last.lock().map(|l| l.iter().cloned().collect()).unwrap_or_default();
    report(&FailureRecord {
        rank: env.rank,
        local_rank: env.local_rank,
        host,
        pid: child.id(),
        exitcode: code,
        error: None,
        program: label,
        last_stderr,
    });
    // Whatever PROGRAM left behind in this group goes too (this worker only notes the signal).
    sys::kill_own_group(sys::SIGTERM);
    if code < 0 {
        128 - code
    } else {
        code
    }
}

/// Copies `stream` to stdout/stderr with `tag` before every line; keeps the last lines in
/// `keep` when given.
pub(super) fn prefix_lines(
    stream: impl Read + Send + 'static,
    tag: String,
    to_stderr: bool,
    keep: Option<Arc<Mutex<VecDeque<String>>>>,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut r = BufReader::new(stream);
        let mut line = Vec::new();
        let mut out = Vec::new();
        loop {
            line.clear();
            match r.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
            if let Some(keep) = &keep {
                let text = String::from_utf8_lossy(&line);
                let text = text.trim_end_matches(['\n', '\r']);
                let text = shorten(text);
                if let Ok(mut k) = keep.lock() {
                    if k.len() == KEEP_LINES {
                        k.pop_front();
                    }
                    k.push_back(text);
                }
            }
            out.clear();
            out.extend_from_slice(tag.as_bytes());
            out.extend_from_slice(&line);
            if !out.ends_with(b"\n") {
                out.push(b'\n');
            }
            if to_stderr {
                let _ = std::io::stderr().lock().write_all(&out);
            } else {
                let mut o = std::io::stdout().lock();
                let _ = o.write_all(&out).and_then(|_| o.flush());
            }
        }
    })
}

/// A kept stderr line of at most [`KEEP_CHARS`] characters: a longer one keeps its first third
/// and its end — where an error says what to do — around a `…`.
fn shorten(text: &str) -> String {
    let n = text.chars().count();
    if n <= KEEP_CHARS {
        return text.to_string();
    }
    let head = KEEP_CHARS / 3;
    let tail = KEEP_CHARS - head - 1;
    text.chars().take(head).chain("…".chars()).chain(text.chars().skip(n - tail)).collect()
}

/// Writes the rank worker's exit marker (see [`EXIT_MARKER`]); the rank comes from mpirun's or
/// torchrun's variables (nothing is written without them).
pub(super) fn report_exit() {
    if let Some(rank) = ["OMPI_COMM_WORLD_RANK", "RANK"].iter().find_map(|v| std::env::var(v).ok()?.parse::<usize>().ok()) {
        let _ = std::io::stderr().lock().write_all(format!("{EXIT_MARKER}{rank}\n").as_bytes());
    }
}

#[cfg(test)]
mod tests {
    /// Issue 27: a long root-cause line keeps its end, where the fix is.
    #[test]
    fn long_stderr_lines_keep_their_start_and_their_end() {
        let line = format!("error: {}; run `ladder-run --backend nccl`", "x".repeat(1000));
        let kept = super::shorten(&line);
        assert_eq!(kept.chars().count(), super::KEEP_CHARS);
        assert!(kept.starts_with("error: xxx") && kept.ends_with("xxx; run `ladder-run --backend nccl`") && kept.contains('…'), "{kept}");
        assert_eq!(super::shorten("short"), "short");
    }
}
