//! Open MPI hostfiles: read and checked against the job before mpirun sees them.

use crate::{Error, Result};
use std::path::Path;

/// One node of an Open MPI hostfile: `host [slots=N] [max_slots=N]`, `#` comments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostfileEntry {
    /// The host name or address, as written.
    pub host: String,
    /// `slots=N`, when given (Open MPI then defaults to the host's core count).
    pub slots: Option<usize>,
    /// The line it is on (1-based).
    pub line: usize,
}

/// Reads an Open MPI hostfile and checks it against the job, as mpirun would place it
/// (`--map-by ppr:NPROC:node`: `nproc_per_node` ranks on each of the first `nnodes` hosts).
///
/// # Errors
/// [`Error::InvalidValue`] for `--hostfile`, naming the file, line and host: unreadable, a
/// line that is not `host [slots=N] [max_slots=N]`, fewer hosts than `--nnodes`, a host
/// listed twice, a host with fewer slots than `--nproc-per-node`, or a host name that does
/// not resolve to an address.
pub fn check_hostfile(path: &Path, nnodes: usize, nproc_per_node: usize) -> Result<Vec<HostfileEntry>> {
    let shown = path.display().to_string();
    let bad = |what: String| Error::invalid("--hostfile", &shown, what);
    let text = std::fs::read_to_string(path).map_err(|e| bad(format!("a readable Open MPI hostfile ({e})")))?;
    let mut hosts: Vec<HostfileEntry> = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.split('#').next().unwrap_or("").trim();
        let mut words = line.split_whitespace();
        let Some(host) = words.next() else { continue };
        let mut slots = None;
        for w in words {
            let count = |v: &str| v.parse::<usize>().ok().filter(|n| *n >= 1);
            match w.split_once('=') {
                Some(("slots", v)) => {
                    slots = Some(count(v).ok_or_else(|| bad(format!("line {}: `{w}`: slots must be a whole number of at least 1", i + 1)))?)
                }
                Some(("max_slots" | "max-slots", v)) if count(v).is_some() => {}
                _ => return Err(bad(format!("line {}: `{line}`: expected `host [slots=N] [max_slots=N]`", i + 1))),
            }
        }
        if let Some(prev) = hosts.iter().find(|h| h.host == host) {
            return Err(bad(format!("line {}: host {host} is listed twice (also line {}); expected one line per node", i + 1, prev.line)));
        }
        hosts.push(HostfileEntry { host: host.to_string(), slots, line: i + 1 });
    }
    if hosts.len() < nnodes {
        return Err(bad(format!(
            "{nnodes} hosts (--nnodes {nnodes}), one per line as `host slots=N`; it lists {}{}",
            hosts.len(),
            if hosts.is_empty() {
                String::new()
            } else {
                format!(": {}", hosts.iter().map(|h| h.host.as_str()).collect::<Vec<_>>().join(", "))
            }
        )));
    }
    hosts.truncate(nnodes);
    for h in &hosts {
        if let Some(slots) = h.slots.filter(|s| *s < nproc_per_node) {
            return Err(bad(format!(
                "at least {nproc_per_node} slots on every host (--nproc-per-node {nproc_per_node}); line {}: host {} has slots={slots}: raise slots= or lower --nproc-per-node",
                h.line, h.host
            )));
        }
        if std::net::ToSocketAddrs::to_socket_addrs(&(h.host.as_str(), 0)).map(|mut a| a.next().is_none()).unwrap_or(true) {
            return Err(bad(format!(
                "host names that resolve to an address; line {}: host {} does not resolve (check /etc/hosts or DNS on this node)",
                h.line, h.host
            )));
        }
    }
    Ok(hosts)
}
