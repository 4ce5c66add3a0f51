//! The rank worker: runs PROGRAM as one rank with the torchrun variables, prefixes its output,
//! keeps its last stderr lines and reports its failure to the top launcher.

use super::*;

/// How a rank worker ended: its own exit code, and PROGRAM's (torchrun's convention: the code,
/// or minus the signal) when PROGRAM ran.
#[derive(Debug, Clone, Copy)]
pub(super) struct Ended {
    pub(super) code: i32,
    pub(super) program: Option<i32>,
}

impl Ended {
    fn without_program(code: i32) -> Self {
        Self { code, program: None }
    }
}

/// Runs PROGRAM as this process's rank and returns how the worker ended: PROGRAM's code
/// (`128 + signal` when it was killed, 127 when it could not start); 0 when it was stopped on
/// request — a signal to this worker, or its stand-in under mpirun ([`CARRIERS`]), is forwarded
/// to PROGRAM's process group, which gets `shutdown_timeout` to exit before SIGKILL — since
/// stopping is then not this rank's failure (its code goes to the launcher in the exit marker).
pub(super) fn worker(program: &OsStr, args: &[OsString], extra_env: &[(&str, String)], prefix: bool, shutdown_timeout: Duration) -> Ended {
    if !sys::set_own_death_signal(sys::SIGTERM) {
        return Ended::without_program(1); // the launcher is already gone
    }
    sys::become_group_leader();
    let _handlers = sys::install_termination_handlers();
    for (signal, carrier) in CARRIERS {
        sys::record_carrier(carrier, signal);
    }
    let host = host_name();
    let label = program_label(&program.to_string_lossy());
    let failed = |rank: usize, local_rank: usize, code: i32, error: Option<String>, pid: u32, last_stderr: Vec<String>| {
        let rec = FailureRecord { rank, local_rank, host: host.clone(), pid, exitcode: code, error, program: label.clone(), last_stderr };
        if let Ok(json) = serde_json::to_string(&rec) {
            let _ = std::io::stderr().lock().write_all(format!("{FAILURE_MARKER}{json}\n").as_bytes());
        }
    };
    let env = match DistEnv::from_env() {
        Ok(env) => env,
        Err(e) => {
            let rank = ["OMPI_COMM_WORLD_RANK", "RANK"].iter().find_map(|v| std::env::var(v).ok()?.parse().ok()).unwrap_or(0);
            failed(rank, 0, 1, Some(e.to_string()), std::process::id(), Vec::new());
            return Ended::without_program(1);
        }
    };
    let tag = if prefix { format!("[rank{}]: ", env.rank) } else { String::new() };
    let mut cmd = Command::new(program);
    cmd.args(args).envs(env.to_vars()).envs(extra_env.iter().map(|(k, v)| (*k, v.as_str())));
    // torchrun's GROUP_RANK, the node's index (ranks are placed node by node).
    cmd.env("GROUP_RANK", (env.rank / env.local_world_size).to_string());
    match terminal::columns_after_tag(std::env::var(TTY_COLUMNS_VAR).ok().as_deref(), &tag) {
        Some(columns) => cmd.env(TTY_COLUMNS_VAR, columns.to_string()),
        None => cmd.env_remove(TTY_COLUMNS_VAR),
    };
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    // PROGRAM leads its own process group: mpirun's signals to this worker's group (its
    // stand-ins) stay here, and this worker's SIGKILL to PROGRAM's group spares the worker.
    sys::prepare_child(&mut cmd, sys::SIGKILL, true);
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            let (code, why) = match e.kind() {
                std::io::ErrorKind::NotFound => (127, format!("program {program:?} not found on {host} (not a file, and not in PATH)")),
                std::io::ErrorKind::PermissionDenied => (126, format!("program {program:?} is not executable on {host}")),
                _ => (127, format!("cannot start {program:?} on {host}: {e}")),
            };
            failed(env.rank, env.local_rank, code, Some(why), std::process::id(), Vec::new());
            return Ended::without_program(code);
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
    let status = wait_forwarding_signals(&mut child, shutdown_timeout);
    join_all(relays, Duration::from_secs(1));
    let Some(status) = status else { return Ended::without_program(1) };
    let code = exitcode(status);
    if sys::received_signal().is_some() {
        return Ended { code: 0, program: Some(code) }; // stopped on request: not a failure of this rank
    }
    if status.success() {
        return Ended { code: 0, program: Some(0) };
    }
    let last_stderr = last.lock().map(|l| l.iter().cloned().collect()).unwrap_or_default();
    failed(env.rank, env.local_rank, code, None, child.id(), last_stderr);
    // Whatever PROGRAM left behind in its group goes too.
    sys::kill_group(child.id(), sys::SIGTERM);
    Ended { code: if code < 0 { 128 - code } else { code }, program: Some(code) }
}

/// Waits for PROGRAM; once this worker receives a termination signal (or a stand-in for one),
/// sends that signal to PROGRAM's process group, and SIGKILL `shutdown_timeout` later.
/// Returns PROGRAM's status (`None` if it cannot be read).
fn wait_forwarding_signals(child: &mut Child, shutdown_timeout: Duration) -> Option<ExitStatus> {
    let mut forwarded: Option<Instant> = None;
    let mut killed = false;
    loop {
        match child.try_wait() {
            Ok(Some(st)) => return Some(st),
            Ok(None) => {}
            Err(_) => return None,
        }
        if let Some(signal) = sys::received_signal() {
            match forwarded {
                None => {
                    sys::kill_group(child.id(), signal);
                    forwarded = Some(Instant::now());
                }
                Some(t) if !killed && t.elapsed() >= shutdown_timeout => {
                    sys::kill_group(child.id(), sys::SIGKILL);
                    killed = true;
                }
                Some(_) => {}
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Copies `stream` to stdout/stderr with `tag` before every line (see [`terminal::Prefixer`]:
/// carriage-return redraws pass through as they come); keeps the last lines in `keep` when
/// given.
pub(super) fn prefix_lines(
    stream: impl Read + Send + 'static,
    tag: String,
    to_stderr: bool,
    keep: Option<Arc<Mutex<VecDeque<String>>>>,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut keep_line = |line: &[u8]| {
            if let Some(keep) = &keep {
                let text = String::from_utf8_lossy(line);
                let text = shorten(text.trim_end_matches(['\n', '\r']));
                if let Ok(mut k) = keep.lock() {
                    if k.len() == KEEP_LINES {
                        k.pop_front();
                    }
                    k.push_back(text);
                }
            }
            true
        };
        let mut write = |bytes: &[u8]| {
            if to_stderr {
                let _ = std::io::stderr().lock().write_all(bytes);
            } else {
                let mut o = std::io::stdout().lock();
                let _ = o.write_all(bytes).and_then(|_| o.flush());
            }
        };
        terminal::pump(stream, &mut terminal::Prefixer::new(&tag), &mut keep_line, &mut write);
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

/// Writes the rank worker's exit marker (see [`EXIT_MARKER`]), with PROGRAM's exit code when it
/// ran; the rank comes from mpirun's or torchrun's variables (nothing is written without them).
pub(super) fn report_exit(program: Option<i32>) {
    if let Some(rank) = ["OMPI_COMM_WORLD_RANK", "RANK"].iter().find_map(|v| std::env::var(v).ok()?.parse::<usize>().ok()) {
        let code = program.map(|c| format!(" {c}")).unwrap_or_default();
        let _ = std::io::stderr().lock().write_all(format!("{EXIT_MARKER}{rank}{code}\n").as_bytes());
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
