//! The top launcher: starts the rank workers (through mpirun, or directly), relays their
//! output, watches for failures and signals, and stops everything when one rank fails.

use super::*;

/// One job to supervise: rank workers `worker_exe worker_args`, with `env` exported to them.
#[derive(Debug)]
pub(super) struct Job {
    /// PROGRAM's name, for the summary.
    pub(super) label: String,
    pub(super) worker_exe: PathBuf,
    pub(super) worker_args: Vec<OsString>,
    pub(super) env: Vec<(String, String)>,
    pub(super) nproc_per_node: usize,
    pub(super) nnodes: usize,
    pub(super) node_rank: usize,
    pub(super) hostfile: Option<PathBuf>,
    /// The hostfile's first `nnodes` hosts, in order (mpi over several nodes; else empty).
    pub(super) hosts: Vec<String>,
    /// The per-job progress directory (`LADDER_PROGRESS_DIR`), read to name a stuck rank.
    pub(super) progress_dir: Option<PathBuf>,
    /// How long the supervision loop sleeps between two looks (`--monitor-interval`).
    pub(super) monitor_interval: Duration,
    /// How long the ranks get to exit after a signal to the launcher (`--shutdown-timeout`).
    pub(super) shutdown_timeout: Duration,
}

/// What a rank worker's hidden stderr lines tell the top launcher.
#[derive(Debug)]
pub(super) enum Note {
    Failed(FailureRecord),
    /// A rank's exit marker: its rank, and PROGRAM's exit code (torchrun's convention) when
    /// PROGRAM ran.
    Exited(usize, Option<i32>),
}

/// A process the launcher waits for: mpirun, or one rank worker.
#[derive(Debug)]
pub(super) struct Member {
    pub(super) child: Child,
    /// The rank of a directly spawned worker (None for mpirun).
    pub(super) rank: Option<usize>,
    pub(super) local_rank: usize,
    pub(super) status: Option<ExitStatus>,
    /// When the exit was observed; failures seen before any stop request are root causes.
    pub(super) failed_on_its_own: bool,
}

#[derive(Debug)]
pub(super) struct Outcome {
    /// Hosts (with their ranks) from which no rank gave word that it ended.
    pub(super) silent_hosts: Vec<(String, Vec<usize>)>,
    /// How many hosts the job spans (0: one node without a hostfile).
    pub(super) hosts: usize,
    /// Failure records in the order they arrived.
    pub(super) failures: Vec<FailureRecord>,
    /// The signal that interrupted the launcher.
    pub(super) interrupted: Option<i32>,
    /// Each rank's exit marker, in the order they arrived (see [`Note::Exited`]).
    pub(super) exits: Vec<(usize, Option<i32>)>,
    /// The job's `--shutdown-timeout`, for the interruption message.
    pub(super) shutdown_timeout: Duration,
    /// mpirun's exit status (mpi mode).
    pub(super) mpirun_status: Option<ExitStatus>,
    pub(super) ranks: usize,
    /// Where the ranks were last seen, read when the first failure was observed.
    pub(super) stuck: Vec<String>,
}

impl Outcome {
    pub(super) fn into_code(self, label: &str) -> Result<i32> {
        let silent = self
            .silent_hosts
            .iter()
            .map(|(host, ranks)| {
                let ranks: Vec<String> = ranks.iter().map(usize::to_string).collect();
                format!("host {host} (rank{} {})", if ranks.len() == 1 { "" } else { "s" }, ranks.join(", "))
            })
            .collect::<Vec<_>>();
        if let (Some(sig), false) = (self.interrupted, self.failures.is_empty()) {
            // Interrupted after a failure: said, but never restarted (as torchrun).
            let _ = writeln!(std::io::stderr(), "{}", summary(label, &self.failures, &self.stuck));
            return Ok(self.interrupted_code(sig));
        }
        if let Some(first) = self.failures.first() {
            let mut summary = summary(label, &self.failures, &self.stuck);
            if !silent.is_empty() {
                summary.push_str(&format!(
                    "\nNo word from {}: unreachable, or its Open MPI daemon was lost; its ranks were not confirmed stopped",
                    silent.join(", ")
                ));
            }
            return Err(Error::RankFailed { rank: first.rank, exitcode: first.exitcode, summary });
        }
        if let Some(sig) = self.interrupted {
            return Ok(self.interrupted_code(sig));
        }
        if let Some(st) = self.mpirun_status {
            if !st.success() {
                if !silent.is_empty() {
                    let whom = if self.silent_hosts.len() == self.hosts {
                        format!("before any rank started on the {} hosts of the hostfile", self.hosts)
                    } else {
                        format!("and no rank reported back from {}", silent.join(", "))
                    };
                    return Err(Error::Launch(format!(
                        "mpirun {} {whom}: check that this node reaches every host (ssh HOST, or Open MPI's plm_rsh_agent) and that each has Open MPI and PROGRAM at the same path; mpirun's messages above say which host failed",
                        describe_status(st),
                    )));
                }
                return Err(Error::Launch(format!(
                    "mpirun {}, but no rank reported a failure; see mpirun's messages above",
                    describe_status(st)
                )));
            }
        }
        Ok(0)
    }
}

impl Outcome {
    /// The launcher's exit code after `signal` stopped the job, said on stderr: the code every
    /// rank exited with when they agree (143 when each wrote its checkpoint on SIGTERM and
    /// exited 143), else `128 + signal`; `128 + SIGPIPE` when its stdout was closed.
    fn interrupted_code(&self, signal: i32) -> i32 {
        let (code, text) = interrupted_code(signal, self.ranks, &self.exits, self.shutdown_timeout);
        let _ = writeln!(std::io::stderr(), "ladder-run: {text}");
        code
    }
}

/// See [`Outcome::interrupted_code`]: the code and what to say. `exits` holds each rank's
/// PROGRAM exit code (torchrun's convention: minus the signal), `None` when unknown.
pub(super) fn interrupted_code(signal: i32, ranks: usize, exits: &[(usize, Option<i32>)], shutdown_timeout: Duration) -> (i32, String) {
    let forwarded = if signal == libc::SIGPIPE { sys::SIGTERM } else { signal };
    let why = if signal == libc::SIGPIPE {
        format!("its standard output was closed (SIGPIPE); forwarded {}", sys::signal_name(forwarded))
    } else {
        format!("received {}; forwarded it", sys::signal_name(signal))
    };
    let code_of = |r: usize| exits.iter().find(|(rank, _)| *rank == r).and_then(|(_, c)| *c);
    let codes: Vec<Option<i32>> = (0..ranks).map(code_of).collect();
    let shell = |c: i32| if c < 0 { 128 - c } else { c };
    let agreed = codes.first().copied().flatten().filter(|c| codes.iter().all(|x| *x == Some(*c)));
    let code = match agreed {
        Some(c) if signal != libc::SIGPIPE => shell(c),
        _ => 128 + signal,
    };
    let how = |c: Option<i32>| match c {
        Some(c) if c == -sys::SIGKILL => format!("was killed by SIGKILL (after the {} s shutdown timeout)", shutdown_timeout.as_secs_f64()),
        Some(c) if c < 0 => format!("was ended by {}", sys::signal_name(-c)),
        Some(c) => format!("exited with {c}"),
        None => "reported no exit code".to_string(),
    };
    let ranks_word = if ranks == 1 { "the rank".to_string() } else { format!("all {ranks} ranks") };
    let what = match agreed {
        Some(c) if ranks > 1 => format!("{ranks_word}, which {}", how(Some(c)).replacen("was ", "were ", 1)),
        Some(c) => format!("{ranks_word}, which {}", how(Some(c))),
        None => {
            let each: Vec<String> = codes.iter().enumerate().map(|(r, c)| format!("rank {r} {}", how(*c))).collect();
            format!("{ranks_word}: {}", each.join(", "))
        }
    };
    let said = if agreed.is_some_and(|c| shell(c) == code) { String::new() } else { format!(" (128 + {})", sys::signal_name(signal)) };
    (code, format!("{why} to {what}; exiting with {code}{said}"))
}

pub(super) fn describe_status(st: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (st.code(), st.signal()) {
        (Some(c), _) => format!("exited with code {c}"),
        (None, Some(s)) => format!("was killed by {}", sys::signal_name(s)),
        _ => "ended".to_string(),
    }
}

/// torchrun's exit code convention: the code, or minus the signal.
pub(super) fn exitcode(st: ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    st.code().unwrap_or_else(|| -st.signal().unwrap_or(0))
}

impl Job {
    pub(super) fn ranks(&self) -> usize {
        self.nproc_per_node * self.nnodes
    }

    /// backend mpi: one mpirun starts every rank worker.
    pub(super) fn run_mpirun(&self) -> Result<Outcome> {
        let mut cmd = Command::new("mpirun");
        cmd.arg("-n").arg(self.ranks().to_string());
        match &self.hostfile {
            Some(h) => {
                cmd.arg("--hostfile").arg(h).arg("--map-by").arg(format!("ppr:{}:node", self.nproc_per_node));
            }
            None => {
                // Count slots as hardware threads, and allow more ranks than that.
                cmd.arg("--use-hwthread-cpus");
                if self.nproc_per_node > crate::device::cores() {
                    cmd.arg("--oversubscribe");
                }
            }
        }
        cmd.args(["--bind-to", "none", "--quiet"]);
        let mut exported: Vec<(String, String)> = self.env.clone();
        for name in ["PATH", "LD_LIBRARY_PATH"] {
            if let Ok(v) = std::env::var(name) {
                exported.push((name.to_string(), v));
            }
        }
        for (k, v) in &exported {
            cmd.env(k, v).arg("-x").arg(k);
        }
        if sys::is_root() {
            cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1").env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
        }
        for v in VARS.iter().filter(|v| !["MASTER_ADDR", "MASTER_PORT"].contains(v)) {
            cmd.env_remove(v);
        }
        cmd.arg(&self.worker_exe).args(&self.worker_args);
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        sys::prepare_child(&mut cmd, sys::SIGTERM, true);
        let child = cmd.spawn().map_err(|e| {
            Error::Launch(if e.kind() == std::io::ErrorKind::NotFound {
                "mpirun not found in PATH: install Open MPI (apt-get install openmpi-bin) or use --backend nccl".to_string()
            } else {
                format!("cannot start mpirun: {e}")
            })
        })?;
        self.supervise(vec![Member { child, rank: None, local_rank: 0, status: None, failed_on_its_own: false }], true)
    }

    /// backend nccl: this launcher spawns the node's rank workers with the torchrun variables.
    pub(super) fn run_direct(&self) -> Result<Outcome> {
        let mut members = Vec::new();
        for local_rank in 0..self.nproc_per_node {
            let rank = self.node_rank * self.nproc_per_node + local_rank;
            let mut cmd = Command::new(&self.worker_exe);
            cmd.args(&self.worker_args);
            for v in VARS {
                cmd.env_remove(v);
            }
            cmd.envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", local_rank.to_string())
                .env("WORLD_SIZE", self.ranks().to_string())
                .env("LOCAL_WORLD_SIZE", self.nproc_per_node.to_string());
            cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
            sys::prepare_child(&mut cmd, sys::SIGTERM, true);
            match cmd.spawn() {
                Ok(child) => members.push(Member { child, rank: Some(rank), local_rank, status: None, failed_on_its_own: false }),
                Err(e) => {
                    for m in &mut members {
                        sys::kill_group(m.child.id(), sys::SIGKILL);
                        let _ = m.child.wait();
                    }
                    return Err(Error::Launch(format!("cannot start rank {rank} ({}): {e}", self.worker_exe.display())));
                }
            }
        }
        self.supervise(members, false)
    }

    /// Relays output, watches for failures and signals, and stops everything when one rank
    /// fails.
    fn supervise(&self, mut members: Vec<Member>, mpirun: bool) -> Result<Outcome> {
        let saved = sys::install_termination_handlers();
        let (tx, rx) = channel::<Note>();
        let mut exited = Vec::new();
        let mut take_notes = |failures: &mut Vec<FailureRecord>| {
            for note in rx.try_iter() {
                match note {
                    Note::Failed(f) => failures.push(f),
                    Note::Exited(rank, code) => exited.push((rank, code)),
                }
            }
        };
        let stdout_closed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut stuck = Vec::new();
        // Ranks seen stopped (SIGSTOP, a debugger) while the job ran, checked twice a second.
        let mut stopped: Vec<usize> = Vec::new();
        let mut last_look = Instant::now();
        let mut relays = Vec::new();
        for m in &mut members {
            if let Some(out) = m.child.stdout.take() {
                relays.push(relay(out, false, tx.clone(), Some(stdout_closed.clone())));
            }
            if let Some(err) = m.child.stderr.take() {
                relays.push(relay(err, true, tx.clone(), None));
            }
        }
        drop(tx);
        let mut failures = Vec::new();
        let mut interrupted = None;
        let mut first_failure: Option<Instant> = None;
        let mut term_sent: Option<Instant> = None;
        let mut kill_sent = false;
        loop {
            take_notes(&mut failures);
            let stop_requested = term_sent.is_some();
            for m in members.iter_mut().filter(|m| m.status.is_none()) {
                if let Ok(Some(st)) = m.child.try_wait() {
                    m.status = Some(st);
                    m.failed_on_its_own = !st.success() && !stop_requested;
                }
            }
            if members.iter().all(|m| m.status.is_some()) {
                break;
            }
            let now = Instant::now();
            // `ladder-run … | head`: the reader is gone; end the job as SIGPIPE ends a program.
            let closed = stdout_closed.load(std::sync::atomic::Ordering::Relaxed).then_some(libc::SIGPIPE);
            if let (None, Some(sig)) = (interrupted, sys::received_signal().or(closed)) {
                interrupted = Some(sig);
                if term_sent.is_none() {
                    self.forward(&members, if sig == libc::SIGPIPE { sys::SIGTERM } else { sig }, mpirun);
                    term_sent = Some(now);
                }
            }
            if let (Some(d), true) = (&self.progress_dir, now.duration_since(last_look) >= Duration::from_millis(500)) {
                last_look = now;
                for r in 0..self.ranks() {
                    if !stopped.contains(&r) && crate::dist::progress::read(d, r).is_some_and(|s| s.is_stopped()) {
                        stopped.push(r);
                    }
                }
            }
            let failed = !failures.is_empty() || members.iter().any(|m| m.failed_on_its_own);
            if failed && first_failure.is_none() {
                first_failure = Some(now);
                // Before anything is stopped: where was every rank?
                if let Some(d) = &self.progress_dir {
                    stuck = crate::dist::progress::stuck_summary(d, self.ranks(), &stopped);
                }
            }
            if let (Some(t0), None) = (first_failure, term_sent) {
                // mpirun stops its own job; step in only if it lingers.
                if !mpirun || now.duration_since(t0) >= MPIRUN_GRACE {
                    stop(&members, sys::SIGTERM);
                    term_sent = Some(now);
                }
            }
            if let Some(t) = term_sent {
                // The ranks kill their PROGRAM themselves at the shutdown timeout; this is the
                // backstop.
                let grace = if interrupted.is_some() { self.shutdown_timeout + TERM_GRACE } else { TERM_GRACE };
                if !kill_sent && now.duration_since(t) >= grace {
                    stop(&members, sys::SIGKILL);
                    kill_sent = true;
                }
            }
            std::thread::sleep(self.monitor_interval);
        }
        // The relays end at EOF; a grandchild that kept a pipe open must not hold us up.
        join_all(relays, Duration::from_secs(2));
        take_notes(&mut failures);
        let failed = !failures.is_empty() || members.iter().any(|m| m.failed_on_its_own);
        if let (true, true, Some(d)) = (failed, stuck.is_empty(), &self.progress_dir) {
            // mpirun ended before the failure was seen: the records are still there.
            stuck = crate::dist::progress::stuck_summary(d, self.ranks(), &stopped);
        }
        sys::restore_handlers(saved);
        if !mpirun {
            // A worker that died without reporting (killed itself): describe it from its status.
            for m in members.iter().filter(|m| m.failed_on_its_own) {
                let rank = m.rank.unwrap_or(0);
                if !failures.iter().any(|f| f.rank == rank) {
                    let st = m.status.expect("every member has exited");
                    failures.push(FailureRecord {
                        rank,
                        local_rank: m.local_rank,
                        host: host_name(),
                        pid: m.child.id(),
                        exitcode: exitcode(st),
                        error: Some(format!("the rank worker itself {}", describe_status(st))),
                        program: self.label.clone(),
                        last_stderr: Vec::new(),
                    });
                }
            }
        }
        // Over several hosts: the hosts none of whose ranks gave word that it ended.
        let mut silent_hosts = Vec::new();
        if mpirun && !self.hosts.is_empty() {
            for (node, host) in self.hosts.iter().enumerate() {
                let ranks: Vec<usize> = (node * self.nproc_per_node..(node + 1) * self.nproc_per_node).collect();
                if ranks.iter().all(|r| !exited.iter().any(|(e, _)| e == r) && !failures.iter().any(|f| f.rank == *r)) {
                    silent_hosts.push((host.clone(), ranks));
                }
            }
        }
        Ok(Outcome {
            hosts: self.hosts.len(),
            silent_hosts,
            failures,
            interrupted,
            exits: exited,
            shutdown_timeout: self.shutdown_timeout,
            mpirun_status: if mpirun { members[0].status } else { None },
            ranks: self.ranks(),
            stuck,
        })
    }
}

impl Job {
    /// Forwards `signal` (SIGTERM, SIGINT or SIGHUP) to every rank: to each rank worker, which
    /// passes it to PROGRAM; under mpirun as its stand-in ([`CARRIERS`]), which mpirun forwards
    /// as it is.
    fn forward(&self, members: &[Member], signal: i32, mpirun: bool) {
        let sent = match CARRIERS.iter().find(|(s, _)| *s == signal) {
            Some((_, carrier)) if mpirun => *carrier,
            _ => signal,
        };
        stop(members, sent);
        let _ = writeln!(
            std::io::stderr(),
            "ladder-run: forwarding {} to the {} ranks; they get {} s to exit before SIGKILL (--shutdown-timeout, {SHUTDOWN_TIMEOUT_VAR})",
            sys::signal_name(signal),
            self.ranks(),
            self.shutdown_timeout.as_secs_f64()
        );
    }
}

/// Sends `signal` to the process group of every member still running.
pub(super) fn stop(members: &[Member], signal: i32) {
    for m in members.iter().filter(|m| m.status.is_none()) {
        sys::kill_group(m.child.id(), signal);
    }
}

/// Copies `stream` to this process's stdout or stderr — whole lines, and carriage-return
/// redraws as they come (see [`terminal::Prefixer`]) — passing the rank workers' failure
/// records and exit markers to `tx` instead. A write to stdout that fails (the reader closed
/// the pipe) sets `closed` and drops the rest.
pub(super) fn relay(
    stream: impl Read + Send + 'static,
    to_stderr: bool,
    tx: Sender<Note>,
    closed: Option<Arc<std::sync::atomic::AtomicBool>>,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut notes = |line: &[u8]| {
            if let Some(json) = line.strip_prefix(FAILURE_MARKER.as_bytes()) {
                if let Ok(rec) = serde_json::from_slice::<FailureRecord>(json) {
                    let _ = tx.send(Note::Failed(rec));
                    return false;
                }
            }
            if let Some(exit) = line.strip_prefix(EXIT_MARKER.as_bytes()) {
                let exit = String::from_utf8_lossy(exit);
                let mut words = exit.split_whitespace();
                if let Some(Ok(rank)) = words.next().map(str::parse) {
                    let _ = tx.send(Note::Exited(rank, words.next().and_then(|c| c.parse().ok())));
                    return false;
                }
            }
            true
        };
        let mut write = |bytes: &[u8]| {
            if to_stderr {
                let _ = std::io::stderr().lock().write_all(bytes);
            } else if closed.as_ref().is_none_or(|c| !c.load(std::sync::atomic::Ordering::Relaxed)) {
                let mut out = std::io::stdout().lock();
                if out.write_all(bytes).and_then(|_| out.flush()).is_err() {
                    if let Some(c) = &closed {
                        c.store(true, std::sync::atomic::Ordering::Relaxed);
                    }
                }
            }
        };
        terminal::pump(stream, &mut terminal::Prefixer::new(""), &mut notes, &mut write);
    })
}

/// Joins `handles`, giving up (leaving them detached) after `patience`.
pub(super) fn join_all(handles: Vec<JoinHandle<()>>, patience: Duration) {
    let deadline = Instant::now() + patience;
    for h in handles {
        while !h.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        if h.is_finished() {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The launcher's code after a signal: the ranks' when they agree, else 128 + the signal,
    /// each rank's end named; 141 whatever the ranks did when stdout was closed.
    #[test]
    fn an_interrupted_launcher_exits_with_the_ranks_code_when_they_agree() {
        let t = Duration::from_secs(30);
        let (code, text) = interrupted_code(sys::SIGTERM, 2, &[(1, Some(143)), (0, Some(143))], t);
        assert_eq!((code, text.as_str()), (143, "received SIGTERM; forwarded it to all 2 ranks, which exited with 143; exiting with 143"));
        let (code, text) = interrupted_code(sys::SIGTERM, 3, &[(0, Some(143)), (1, Some(-9))], t);
        assert_eq!(code, 143);
        assert_eq!(
            text,
            "received SIGTERM; forwarded it to all 3 ranks: rank 0 exited with 143, rank 1 was killed by SIGKILL (after the 30 s \
             shutdown timeout), rank 2 reported no exit code; exiting with 143 (128 + SIGTERM)"
        );
        let (code, text) = interrupted_code(sys::SIGINT, 1, &[(0, Some(-2))], t);
        assert_eq!((code, text.as_str()), (130, "received SIGINT; forwarded it to the rank, which was ended by SIGINT; exiting with 130"));
        let (code, text) = interrupted_code(libc::SIGPIPE, 2, &[(0, Some(-15)), (1, Some(-15))], t);
        assert_eq!(code, 141);
        assert!(text.ends_with("which were ended by SIGTERM; exiting with 141 (128 + SIGPIPE)"), "{text}");
    }
}
