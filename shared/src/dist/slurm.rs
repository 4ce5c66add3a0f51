//! Slurm's environment: which task of a job step this process is, as `srun` tells each task.
//!
//! Read only inside a job step (`SLURM_STEP_ID` or `SLURM_STEPID` set: `srun` sets it, a batch
//! script has none, so a program run directly in an `sbatch` script is a plain process):
//!
//! | variable | meaning |
//! | --- | --- |
//! | `SLURM_PROCID` | the task's rank, `0..SLURM_NTASKS` |
//! | `SLURM_STEP_NUM_TASKS`, else `SLURM_NTASKS` | the step's task count (the world size) |
//! | `SLURM_LOCALID` | the task's rank on its node |
//! | `SLURM_NODEID` | the node's index in the step |
//! | `SLURM_STEP_TASKS_PER_NODE`, else `SLURM_TASKS_PER_NODE` | tasks on each node, compressed: `2(x3),1` |
//! | `SLURM_STEP_NODELIST`, else `SLURM_JOB_NODELIST`, `SLURM_NODELIST` | the hosts; the first is `MASTER_ADDR` |
//! | `SLURM_JOB_ID` | the job; its last four digits + 15000 are `MASTER_PORT` |
//! | `PMIX_RANK` | set by `srun --mpi=pmix`: Open MPI's `MPI_Init` can then join the step's ranks |
//!
//! `MASTER_ADDR` and `MASTER_PORT`, when set, win. The port rule is PyTorch Lightning's
//! (`SLURMEnvironment.main_port`): every task of a job derives the same port without talking to
//! the others, and two jobs sharing a node rarely collide; without `SLURM_JOB_ID` it is 12910.
//! Accelerate and torchrun read no Slurm variable (their users export `MASTER_ADDR` from
//! `scontrol show hostnames` in the batch script and pass a port).

use super::env::{DistEnv, Launcher};
use crate::{Error, Result};

/// Every Slurm variable [`step_env`] reads (besides `MASTER_ADDR` and `MASTER_PORT`).
pub const SLURM_VARS: [&str; 13] = [
    "SLURM_STEP_ID",
    "SLURM_STEPID",
    "SLURM_PROCID",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_STEP_TASKS_PER_NODE",
    "SLURM_TASKS_PER_NODE",
    "SLURM_STEP_NODELIST",
    "SLURM_JOB_NODELIST",
    "SLURM_NODELIST",
    "SLURM_JOB_ID",
];

/// `MASTER_PORT` under Slurm without `SLURM_JOB_ID` (Lightning's default).
pub const DEFAULT_SLURM_PORT: u16 = 12910;

/// Most hosts one hostlist may expand to (a typo such as `n[0-99999999]` is refused, not
/// allocated).
const MAX_HOSTS: usize = 1 << 20;

/// The world of a Slurm job step, or `None` outside a step.
///
/// `master_addr` and `master_port` are `MASTER_ADDR` and `MASTER_PORT` when set (they win over
/// what Slurm's variables say).
///
/// # Errors
/// [`Error::Env`] naming the variable, its value and what was expected when, inside a step: a
/// required variable (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, `SLURM_NODEID`, the tasks
/// per node, a node list without `MASTER_ADDR`) is missing or malformed; `SLURM_PROCID` is not
/// below the task count; `SLURM_NODEID` has no entry in the tasks per node; `SLURM_LOCALID` is
/// not below its node's task count; the tasks per node do not add up to the task count; or
/// `PMIX_RANK` disagrees with `SLURM_PROCID`.
pub fn step_env(get: &dyn Fn(&str) -> Option<String>, master_addr: Option<String>, master_port: Option<u16>) -> Result<Option<DistEnv>> {
    if get("SLURM_STEP_ID").is_none() && get("SLURM_STEPID").is_none() {
        return Ok(None);
    }
    let need = |name: &'static str| get(name).ok_or_else(|| missing(&[name]));
    let num = |name: &str, v: String| -> Result<usize> {
        v.trim().parse::<usize>().map_err(|_| Error::Env(format!("{name}={v:?} is not a non-negative integer (as srun sets it)")))
    };
    let first = |names: &[&'static str]| -> Result<(&'static str, String)> {
        names.iter().find_map(|n| get(n).map(|v| (*n, v))).ok_or_else(|| missing(names))
    };
    let rank = num("SLURM_PROCID", need("SLURM_PROCID")?)?;
    let (world_name, world) = first(&["SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"])?;
    let world_size = num(world_name, world)?;
    let local_rank = num("SLURM_LOCALID", need("SLURM_LOCALID")?)?;
    let node = num("SLURM_NODEID", need("SLURM_NODEID")?)?;
    let (tpn_name, tpn) = first(&["SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"])?;
    let per_node = expand_tasks_per_node(&tpn).map_err(|why| Error::Env(format!("{tpn_name}={tpn:?}: {why}")))?;

    if world_size == 0 || rank >= world_size {
        return Err(Error::Env(format!(
            "SLURM_PROCID={rank} is not below {world_name}={world_size}; expected a task rank in 0..{world_size}"
        )));
    }
    let Some(&local_world_size) = per_node.get(node) else {
        return Err(Error::Env(format!(
            "SLURM_NODEID={node} has no entry in {tpn_name}={tpn:?} ({} nodes); expected a node index in 0..{}",
            per_node.len(),
            per_node.len()
        )));
    };
    let total: usize = per_node.iter().sum();
    if total != world_size {
        return Err(Error::Env(format!(
            "{tpn_name}={tpn:?} adds up to {total} tasks but {world_name}={world_size}; expected the same count"
        )));
    }
    if local_rank >= local_world_size {
        return Err(Error::Env(format!(
            "SLURM_LOCALID={local_rank} is not below node {node}'s task count {local_world_size} ({tpn_name}={tpn:?}); expected a local rank in 0..{local_world_size}"
        )));
    }
    let pmix = match get("PMIX_RANK") {
        None => false,
        Some(p) if num("PMIX_RANK", p.clone())? == rank => true,
        Some(p) => {
            return Err(Error::Env(format!(
                "PMIX_RANK={p} disagrees with SLURM_PROCID={rank}; expected the same rank (srun --mpi=pmix sets both)"
            )))
        }
    };
    let master_addr = match master_addr {
        Some(a) => a,
        None => {
            let (list_name, list) = first(&["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"])?;
            let hosts = expand_hostlist(&list).map_err(|why| Error::Env(format!("{list_name}={list:?}: {why}")))?;
            hosts.into_iter().next().unwrap_or_default()
        }
    };
    let master_port = Some(master_port.unwrap_or_else(|| port_for_job(get("SLURM_JOB_ID").as_deref())));
    Ok(Some(DistEnv { rank, local_rank, world_size, local_world_size, master_addr, master_port, launcher: Launcher::Srun { pmix } }))
}

fn missing(names: &[&str]) -> Error {
    let what = match names {
        [one] => format!("{one} is not set"),
        more => format!("none of {} is set", more.join(", ")),
    };
    Error::Env(format!(
        "{what}, but SLURM_STEP_ID is (this process is a task of an srun step); expected srun to set it \
         (or set RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT as torchrun does)"
    ))
}

/// `MASTER_PORT` for a Slurm job, PyTorch Lightning's rule: the job id's last four digits plus
/// 15000 (so in 15000..=24999), or [`DEFAULT_SLURM_PORT`] without a job id (or a non-numeric
/// one).
pub fn port_for_job(job_id: Option<&str>) -> u16 {
    let Some(id) = job_id.map(str::trim) else { return DEFAULT_SLURM_PORT };
    let tail = &id[id.len().saturating_sub(4)..];
    tail.parse::<u16>().map(|t| t + 15000).unwrap_or(DEFAULT_SLURM_PORT)
}

/// Expands Slurm's compressed tasks-per-node list: `"2(x3),1"` is `[2, 2, 2, 1]` (one count per
/// node, in node order), as `SLURM_TASKS_PER_NODE` and `SLURM_STEP_TASKS_PER_NODE` write it.
///
/// # Errors
/// A message saying which element is malformed and the form expected.
pub fn expand_tasks_per_node(list: &str) -> std::result::Result<Vec<usize>, String> {
    let mut out = Vec::new();
    for item in list.split(',') {
        let item = item.trim();
        let (count, repeat) = match item.split_once("(x") {
            Some((c, r)) => (c, r.strip_suffix(')').ok_or_else(|| format!("element {item:?} lacks its closing ')'"))?),
            None => (item, "1"),
        };
        let bad = || format!("element {item:?} is not COUNT or COUNT(xREPEAT) with whole numbers (e.g. 2(x3),1)");
        let count: usize = count.parse().map_err(|_| bad())?;
        let repeat: usize = repeat.parse().map_err(|_| bad())?;
        if repeat == 0 || out.len() + repeat > MAX_HOSTS {
            return Err(bad());
        }
        out.extend(std::iter::repeat_n(count, repeat));
    }
    Ok(out)
}

/// Expands a Slurm hostlist, as `scontrol show hostnames` does: `"node[0-3,7],gpu01"` is
/// `node0 node1 node2 node3 node7 gpu01`; a range keeps the width of its zero-padded start
/// (`n[08-10]` is `n08 n09 n10`); several brackets in one name multiply (`r[1-2]n[1-2]` is
/// `r1n1 r1n2 r2n1 r2n2`). Order is kept; duplicates are kept, as Slurm keeps them.
///
/// # Errors
/// A message naming the malformed part (empty name, unbalanced bracket, a range whose end is
/// below its start, a non-numeric bound) or a list of more than 2^20 hosts.
pub fn expand_hostlist(list: &str) -> std::result::Result<Vec<String>, String> {
    let mut hosts = Vec::new();
    for name in split_top_level(list)? {
        let mut names = vec![String::new()];
        let mut rest = name;
        while let Some(open) = rest.find('[') {
            let close = rest[open..].find(']').map(|c| open + c).ok_or_else(|| format!("{name:?} has a '[' without ']'"))?;
            let choices = expand_brackets(&rest[open + 1..close]).map_err(|why| format!("{name:?}: {why}"))?;
            let prefix = &rest[..open];
            if names.len().saturating_mul(choices.len()) + hosts.len() > MAX_HOSTS {
                return Err(format!("it expands to more than {MAX_HOSTS} hosts"));
            }
            names = names.iter().flat_map(|n| choices.iter().map(move |c| format!("{n}{prefix}{c}"))).collect();
            rest = &rest[close + 1..];
        }
        if rest.contains(']') {
            return Err(format!("{name:?} has a ']' without '['"));
        }
        hosts.extend(names.into_iter().map(|n| n + rest));
    }
    Ok(hosts)
}

/// Splits at the commas outside brackets; refuses empty names and nested brackets.
fn split_top_level(list: &str) -> std::result::Result<Vec<&str>, String> {
    let (mut parts, mut depth, mut start) = (Vec::new(), 0usize, 0usize);
    for (i, ch) in list.char_indices() {
        match ch {
            '[' if depth > 0 => return Err(format!("nested '[' at byte {i}")),
            '[' => depth = 1,
            ']' => depth = 0,
            ',' if depth == 0 => {
                parts.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&list[start..]);
    match parts.iter().find(|p| p.trim().is_empty()) {
        Some(_) => Err("a host name is empty (expected names separated by single commas, e.g. node[0-3],gpu01)".into()),
        None => Ok(parts.into_iter().map(str::trim).collect()),
    }
}

/// `0-3,7` to `["0", "1", "2", "3", "7"]`, keeping a zero-padded start's width.
fn expand_brackets(spec: &str) -> std::result::Result<Vec<String>, String> {
    let mut out = Vec::new();
    for item in spec.split(',') {
        let bad = || format!("[{spec}] has {item:?}; expected numbers and ranges such as 0-3,7 or 08-10");
        let (lo, hi) = item.split_once('-').unwrap_or((item, item));
        if lo.is_empty() || !lo.bytes().all(|b| b.is_ascii_digit()) || !hi.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        let (a, b): (u64, u64) = (lo.parse().map_err(|_| bad())?, hi.parse().map_err(|_| bad())?);
        if b < a {
            return Err(format!("[{spec}] has the range {item:?} whose end is below its start"));
        }
        if (b - a) as usize >= MAX_HOSTS {
            return Err(format!("[{spec}] expands to more than {MAX_HOSTS} hosts"));
        }
        let width = lo.len();
        out.extend((a..=b).map(|n| format!("{n:0width$}")));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostlists_expand_as_scontrol_does() {
        let e = |s: &str| expand_hostlist(s).unwrap();
        assert_eq!(e("node[0-3,7],gpu01"), ["node0", "node1", "node2", "node3", "node7", "gpu01"]);
        assert_eq!(e("n[08-10]"), ["n08", "n09", "n10"]);
        assert_eq!(e("r[1-2]n[1-2].ib"), ["r1n1.ib", "r1n2.ib", "r2n1.ib", "r2n2.ib"]);
        assert_eq!(e("ladder-node[0-1]"), ["ladder-node0", "ladder-node1"]);
        assert_eq!(e("solo"), ["solo"]);
        assert_eq!(e("a,b[9-10]"), ["a", "b9", "b10"]);
    }

    #[test]
    fn bad_hostlists_name_the_part() {
        let e = |s: &str| expand_hostlist(s).unwrap_err();
        assert_eq!(e("node[0-3"), "\"node[0-3\" has a '[' without ']'");
        assert_eq!(e("node[3-1]"), "\"node[3-1]\": [3-1] has the range \"3-1\" whose end is below its start");
        assert_eq!(e("node[a]"), "\"node[a]\": [a] has \"a\"; expected numbers and ranges such as 0-3,7 or 08-10");
        assert_eq!(e("a,,b"), "a host name is empty (expected names separated by single commas, e.g. node[0-3],gpu01)");
        assert_eq!(e("n0]"), "\"n0]\" has a ']' without '['");
        assert_eq!(e("n[0-99999999]"), "\"n[0-99999999]\": [0-99999999] expands to more than 1048576 hosts");
    }

    #[test]
    fn tasks_per_node_expand() {
        assert_eq!(expand_tasks_per_node("2(x3),1").unwrap(), [2, 2, 2, 1]);
        assert_eq!(expand_tasks_per_node("1(x2)").unwrap(), [1, 1]);
        assert_eq!(expand_tasks_per_node("4").unwrap(), [4]);
        assert_eq!(expand_tasks_per_node("2(x3").unwrap_err(), "element \"2(x3\" lacks its closing ')'");
        assert_eq!(
            expand_tasks_per_node("2(x0)").unwrap_err(),
            "element \"2(x0)\" is not COUNT or COUNT(xREPEAT) with whole numbers (e.g. 2(x3),1)"
        );
    }

    #[test]
    fn port_follows_lightning() {
        assert_eq!(port_for_job(Some("123456")), 18456);
        assert_eq!(port_for_job(Some("7")), 15007);
        assert_eq!(port_for_job(Some("9999")), 24999);
        assert_eq!(port_for_job(None), DEFAULT_SLURM_PORT);
        assert_eq!(port_for_job(Some("x")), DEFAULT_SLURM_PORT);
    }
}
