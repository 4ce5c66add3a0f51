//! The torchrun environment contract: which rank this process is, how many there are, and where
//! the rendezvous lives.
//!
//! Variables read, as `torchrun` sets them (`torch.distributed.run`): `RANK`, `LOCAL_RANK`,
//! `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`. Under Open MPI's `mpirun` the
//! ranks come from `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_RANK`
//! and `OMPI_COMM_WORLD_LOCAL_SIZE`; torchrun variables set alongside them must agree. In a
//! task of a Slurm job step (`srun`), with neither set, the ranks come from Slurm's variables
//! ([`super::slurm`]). Precedence: `OMPI_COMM_WORLD_*` (mpirun, also inside an allocation), then
//! the torchrun variables, then Slurm's.
//! With nothing set the world is one rank (every binary also runs plainly).

use crate::{Error, Result};

/// Who started this process (decides which variables were authoritative).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// Nothing: a plain single process (world size 1).
    None,
    /// `torchrun` or `ladder-run --backend nccl` (the torchrun variables).
    Torchrun,
    /// Open MPI's `mpirun` (or `ladder-run --backend mpi`): the `OMPI_COMM_WORLD_*` variables.
    Mpirun,
    /// Slurm's `srun`: the `SLURM_*` variables of a job step ([`super::slurm::step_env`]).
    Srun {
        /// Whether `srun --mpi=pmix` started the task (`PMIX_RANK` set): only then can Open MPI's
        /// `MPI_Init` join the other tasks without `mpirun`.
        pmix: bool,
    },
}

/// This process's place in the job, read from the launcher's environment.
///
/// Invariants (checked by [`DistEnv::from_lookup`]): `world_size >= 1`, `rank < world_size`,
/// `1 <= local_world_size <= world_size`, `local_rank < local_world_size`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistEnv {
    /// Global rank, `0..world_size` (`RANK` / `OMPI_COMM_WORLD_RANK`).
    pub rank: usize,
    /// Rank on this node, `0..local_world_size` (`LOCAL_RANK` / `OMPI_COMM_WORLD_LOCAL_RANK`);
    /// picks the GPU. Defaults to `rank` when not set (one node).
    pub local_rank: usize,
    /// Number of ranks in the job (`WORLD_SIZE` / `OMPI_COMM_WORLD_SIZE`).
    pub world_size: usize,
    /// Number of ranks on this node (`LOCAL_WORLD_SIZE` / `OMPI_COMM_WORLD_LOCAL_SIZE`); each rank
    /// uses `cores / local_world_size` threads. Defaults to `world_size` when not set (one node).
    pub local_world_size: usize,
    /// Host of the rendezvous store (`MASTER_ADDR`; under srun without it, the first host of
    /// the step's node list), default `"127.0.0.1"`.
    pub master_addr: String,
    /// Port of the rendezvous store (`MASTER_PORT`; under srun without it, derived from the job
    /// id: [`super::slurm::port_for_job`]), `None` when not set.
    pub master_port: Option<u16>,
    /// Who set the variables.
    pub launcher: Launcher,
}

/// The default `MASTER_ADDR`.
pub const DEFAULT_MASTER_ADDR: &str = "127.0.0.1";

/// Every variable [`DistEnv::from_lookup`] reads (the launcher clears these before setting its
/// own).
pub const VARS: [&str; 10] = [
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
];

impl DistEnv {
    /// Reads the process environment; see [`DistEnv::from_lookup`].
    pub fn from_env() -> Result<DistEnv> {
        Self::from_lookup(|k| std::env::var_os(k).map(|v| v.to_string_lossy().into_owned()))
    }

    /// The world of one: rank 0 of 1, no launcher, no port.
    pub fn single() -> DistEnv {
        DistEnv {
            rank: 0,
            local_rank: 0,
            world_size: 1,
            local_world_size: 1,
            master_addr: DEFAULT_MASTER_ADDR.to_string(),
            master_port: None,
            launcher: Launcher::None,
        }
    }

    /// Whether an MPI launcher started the ranks — `mpirun`, or `srun --mpi=pmix` — so that
    /// `MPI_Init` forms their world (MPI must then be initialised even at world size 1).
    pub fn under_mpirun(&self) -> bool {
        matches!(self.launcher, Launcher::Mpirun | Launcher::Srun { pmix: true })
    }

    /// Builds the environment from `get` (a variable name to its value), so tests need not touch
    /// the process environment.
    ///
    /// The `OMPI_COMM_WORLD_*` variables, when present, decide the ranks ([`Launcher::Mpirun`]);
    /// otherwise `RANK`/`WORLD_SIZE` do ([`Launcher::Torchrun`]); otherwise, in a Slurm job step,
    /// Slurm's variables ([`Launcher::Srun`], see [`super::slurm::step_env`] for its variables,
    /// `MASTER_ADDR` and `MASTER_PORT` rules and errors); with none, world size 1.
    ///
    /// # Errors
    /// [`Error::Env`] naming the variables and values when: a number does not parse (or is out
    /// of range), `RANK >= WORLD_SIZE`, `WORLD_SIZE` is 0, `RANK` (or `LOCAL_RANK`,
    /// `LOCAL_WORLD_SIZE`) is set without `WORLD_SIZE`, `WORLD_SIZE > 1` without `RANK`,
    /// `LOCAL_RANK >= LOCAL_WORLD_SIZE`, `LOCAL_WORLD_SIZE > WORLD_SIZE`, a torchrun variable
    /// disagrees with its `OMPI_COMM_WORLD_*` counterpart, only one of
    /// `OMPI_COMM_WORLD_RANK`/`OMPI_COMM_WORLD_SIZE` is set, `MASTER_ADDR` is empty, or
    /// `MASTER_PORT` is not in `1..=65535`.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<DistEnv> {
        let num = |name: &str| -> Result<Option<usize>> {
            match get(name) {
                None => Ok(None),
                Some(v) => v.parse::<usize>().map(Some).map_err(|_| Error::Env(format!("{name}={v:?} is not a non-negative integer"))),
            }
        };
        let rank = num("RANK")?;
        let world = num("WORLD_SIZE")?;
        let local_rank = num("LOCAL_RANK")?;
        let local_world = num("LOCAL_WORLD_SIZE")?;
        let o_rank = num("OMPI_COMM_WORLD_RANK")?;
        let o_world = num("OMPI_COMM_WORLD_SIZE")?;
        let o_local_rank = num("OMPI_COMM_WORLD_LOCAL_RANK")?;
        let o_local_world = num("OMPI_COMM_WORLD_LOCAL_SIZE")?;

        let master_addr = match get("MASTER_ADDR") {
            None => DEFAULT_MASTER_ADDR.to_string(),
            Some(a) if a.trim().is_empty() => {
                return Err(Error::Env(format!(
                    "MASTER_ADDR={a:?} is empty; expected a host name or IP address (or leave it unset for {DEFAULT_MASTER_ADDR})"
                )))
            }
            Some(a) => a,
        };
        let master_port = match get("MASTER_PORT") {
            None => None,
            Some(p) => match p.parse::<u16>() {
                Ok(port) if port > 0 => Some(port),
                _ => return Err(Error::Env(format!("MASTER_PORT={p:?} is not a port number in 1..=65535"))),
            },
        };

        let torchrun_set = [rank, world, local_rank, local_world].iter().any(Option::is_some);
        if o_rank.is_none() && o_world.is_none() && !torchrun_set {
            if let Some(env) = super::slurm::step_env(&get, get("MASTER_ADDR").map(|_| master_addr.clone()), master_port)? {
                return Ok(env);
            }
        }

        // Torchrun and OMPI values for the same quantity must agree.
        let agree = |torch: &str, tv: Option<usize>, ompi: &str, ov: Option<usize>| -> Result<()> {
            match (tv, ov) {
                (Some(t), Some(o)) if t != o => Err(Error::Env(format!(
                    "{torch}={t} disagrees with {ompi}={o} (set by mpirun); expected equal values or {torch} unset"
                ))),
                _ => Ok(()),
            }
        };

        let (launcher, rank, world_size) = match (o_rank, o_world) {
            (Some(r), Some(w)) => {
                agree("WORLD_SIZE", world, "OMPI_COMM_WORLD_SIZE", Some(w))?;
                agree("RANK", rank, "OMPI_COMM_WORLD_RANK", Some(r))?;
                agree("LOCAL_RANK", local_rank, "OMPI_COMM_WORLD_LOCAL_RANK", o_local_rank)?;
                agree("LOCAL_WORLD_SIZE", local_world, "OMPI_COMM_WORLD_LOCAL_SIZE", o_local_world)?;
                if w == 0 {
                    return Err(Error::Env("OMPI_COMM_WORLD_SIZE=0; expected at least 1".into()));
                }
                if r >= w {
                    return Err(Error::Env(format!(
                        "OMPI_COMM_WORLD_RANK={r} is not below OMPI_COMM_WORLD_SIZE={w}; expected a rank in 0..{w}"
                    )));
                }
                (Launcher::Mpirun, r, w)
            }
            (Some(r), None) => {
                return Err(Error::Env(format!(
                    "OMPI_COMM_WORLD_RANK={r} is set but OMPI_COMM_WORLD_SIZE is not; expected both (as mpirun sets them) or neither"
                )))
            }
            (None, Some(w)) => {
                return Err(Error::Env(format!(
                    "OMPI_COMM_WORLD_SIZE={w} is set but OMPI_COMM_WORLD_RANK is not; expected both (as mpirun sets them) or neither"
                )))
            }
            (None, None) => match (rank, world) {
                (None, None) => {
                    for (name, v) in [("LOCAL_RANK", local_rank), ("LOCAL_WORLD_SIZE", local_world)] {
                        if let Some(v) = v {
                            return Err(Error::Env(format!(
                                "{name}={v} is set but WORLD_SIZE and RANK are not; expected all of RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE (as torchrun sets them) or none"
                            )));
                        }
                    }
                    (Launcher::None, 0, 1)
                }
                (Some(r), None) => {
                    return Err(Error::Env(format!(
                        "RANK={r} is set but WORLD_SIZE is not; expected WORLD_SIZE too (as torchrun sets both)"
                    )))
                }
                (_, Some(0)) => {
                    return Err(Error::Env("WORLD_SIZE=0; expected at least 1".into()));
                }
                (None, Some(w)) if w > 1 => {
                    return Err(Error::Env(format!(
                        "WORLD_SIZE={w} is set but RANK is not; expected RANK in 0..{w} too (as torchrun sets both)"
                    )))
                }
                (r, Some(w)) => {
                    let r = r.unwrap_or(0);
                    if r >= w {
                        return Err(Error::Env(format!("RANK={r} is not below WORLD_SIZE={w}; expected a rank in 0..{w}")));
                    }
                    (Launcher::Torchrun, r, w)
                }
            },
        };

        let (lr_name, lw_name) = match launcher {
            Launcher::Mpirun if o_local_world.is_some() || o_local_rank.is_some() => {
                ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")
            }
            _ => ("LOCAL_RANK", "LOCAL_WORLD_SIZE"),
        };
        let local_world_size = o_local_world.or(local_world).unwrap_or(world_size);
        let local_rank = o_local_rank.or(local_rank).unwrap_or(rank);
        if local_world_size == 0 {
            return Err(Error::Env(format!("{lw_name}=0; expected at least 1")));
        }
        if local_world_size > world_size {
            return Err(Error::Env(format!(
                "{lw_name}={local_world_size} exceeds the world size {world_size}; expected at most {world_size} ranks per node"
            )));
        }
        if local_rank >= local_world_size {
            return Err(Error::Env(format!(
                "{lr_name}={local_rank} is not below {lw_name}={local_world_size}; expected a local rank in 0..{local_world_size}"
            )));
        }
        Ok(DistEnv { rank, local_rank, world_size, local_world_size, master_addr, master_port, launcher })
    }

    /// The torchrun variables describing this environment (what `ladder-run` hands a rank):
    /// `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR` and, when known,
    /// `MASTER_PORT`.
    pub fn to_vars(&self) -> Vec<(&'static str, String)> {
        let mut v = vec![
            ("RANK", self.rank.to_string()),
            ("LOCAL_RANK", self.local_rank.to_string()),
            ("WORLD_SIZE", self.world_size.to_string()),
            ("LOCAL_WORLD_SIZE", self.local_world_size.to_string()),
            ("MASTER_ADDR", self.master_addr.clone()),
        ];
        if let Some(p) = self.master_port {
            v.push(("MASTER_PORT", p.to_string()));
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn parse(vars: &[(&str, &str)]) -> Result<DistEnv> {
        let m: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        DistEnv::from_lookup(|k| m.get(k).cloned())
    }

    #[test]
    fn nothing_set_is_single() {
        assert_eq!(parse(&[]).unwrap(), DistEnv::single());
        assert!(!DistEnv::single().under_mpirun());
    }

    #[test]
    fn to_vars_round_trips() {
        let env = parse(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29500"),
        ])
        .unwrap();
        let vars: Vec<(&str, String)> = env.to_vars();
        let back = DistEnv::from_lookup(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone())).unwrap();
        assert_eq!(back, env);
    }
}
