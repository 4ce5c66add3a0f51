//! A real Slurm for tests: `scripts/slurm.sh` brings up namespace hosts (scripts/cluster.sh) with
//! munged, slurmctld and one slurmd per host; the guard takes everything down on drop, also when
//! the test panics. Included by the levels' Slurm tests with `#[path]`.
#![allow(dead_code)]

use std::path::Path;
use std::process::{Command, Output};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// `scripts/slurm.sh`.
pub const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/slurm.sh");

static SERIAL: Mutex<()> = Mutex::new(());

/// One Slurm test at a time (2-core machine; each brings up its own cluster).
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// Why Slurm cannot run on this machine, if it cannot: not root, no namespaces, no Slurm.
pub fn unavailable() -> Option<String> {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let uid = status.lines().find_map(|l| l.strip_prefix("Uid:")).and_then(|l| l.split_whitespace().nth(1)).unwrap_or("?");
    if uid != "0" {
        return Some(format!("not root (effective uid {uid}); the namespace hosts and Slurm's daemons need root, as in CI"));
    }
    match Command::new("unshare").args(["--net", "--uts", "true"]).output() {
        Ok(o) if !o.status.success() => {
            return Some(format!("this machine refuses new namespaces: {}", String::from_utf8_lossy(&o.stderr).trim()))
        }
        Err(e) => return Some(format!("unshare (util-linux) cannot run: {e}")),
        Ok(_) => {}
    }
    for bin in ["munged", "slurmctld", "slurmd", "srun", "sbatch"] {
        if Command::new("sh").args(["-c", &format!("command -v {bin}")]).output().map_or(true, |o| !o.status.success()) {
            return Some(format!("{bin} is not installed (scripts/bootstrap.sh, run by `make setup`, installs slurm-wlm and munge)"));
        }
    }
    None
}

/// Slurm on `nodes` namespace hosts, taken down on drop.
pub struct Slurm {
    /// The cluster's name (hosts `NAME-node0`…).
    pub name: String,
    pub nodes: usize,
}

impl Slurm {
    /// `slurm.sh --name <unique> up nodes`.
    pub fn up(tag: &str, nodes: usize) -> Slurm {
        static N: AtomicUsize = AtomicUsize::new(0);
        let name = format!("s{}-{}{}", std::process::id() % 100_000, tag, N.fetch_add(1, Ordering::SeqCst));
        let slurm = Slurm { name, nodes };
        let out = slurm.script(&["up", &nodes.to_string()]).output().expect("run scripts/slurm.sh");
        assert!(out.status.success(), "slurm.sh up {nodes} failed:\n{}", text(&out));
        slurm
    }

    /// `slurm.sh --name NAME ARGS...`.
    pub fn script(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new("bash");
        cmd.arg(SCRIPT).args(["--name", &self.name]).args(args);
        cmd
    }

    /// `CMD ARGS...` on host 0 with `SLURM_CONF` set (srun, sbatch, scancel, squeue).
    pub fn on_host0(&self, cmd: &str, args: &[&str]) -> Command {
        let mut c = self.script(&["exec", "0", cmd]);
        c.args(args).env("OMPI_ALLOW_RUN_AS_ROOT", "1").env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
        c
    }

    /// Host `node`'s name.
    pub fn host(&self, node: usize) -> String {
        format!("{}-node{node}", self.name)
    }

    /// The Open MPI hostfile of the namespace hosts (for the same run under mpirun).
    pub fn hostfile(&self) -> String {
        format!("/run/ddp-ladder-cluster/{}/hostfile", self.name)
    }

    /// A job's state from `scontrol show job ID` (`JobState=...`), or "" once it is forgotten.
    pub fn job_state(&self, id: &str) -> String {
        let out = self.on_host0("scontrol", &["show", "job", id]).output().unwrap();
        let s = String::from_utf8_lossy(&out.stdout).into_owned();
        s.split_whitespace().find_map(|w| w.strip_prefix("JobState=")).unwrap_or_default().to_string()
    }
}

impl Drop for Slurm {
    fn drop(&mut self) {
        let out = self.script(&["down"]).output();
        let ok = out.as_ref().is_ok_and(|o| o.status.success());
        let gone = !Path::new(&format!("/run/ddp-ladder-cluster/{}", self.name)).exists();
        if !(std::thread::panicking() || ok && gone) {
            panic!("slurm.sh down left cluster {} behind: {out:?}", self.name);
        }
    }
}

/// stdout then stderr of a finished command.
pub fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}
