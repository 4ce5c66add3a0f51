//! HSDP's 2-D mesh, as `init_device_mesh(device, (dp_replicate_size, dp_shard_size),
//! mesh_dim_names=("replicate", "shard"))`: the world's ranks in `dp_replicate_size` runs of
//! `dp_shard_size` consecutive ranks. A run is a *shard group* (FSDP shards within it); the
//! ranks with the same position in every run form a *replicate group* (gradients are
//! all-reduced across it). With `dp_shard_size` = 2 at 4 ranks: shard groups {0,1}, {2,3};
//! replicate groups {0,2}, {1,3}.
//!
//! The sub-groups ([`ProcessGroup::new_group`]) are made once per world group and shard size
//! and then live for the rest of the process, as torch's groups live until
//! `destroy_process_group` (a new FSDP wrapper on the same mesh reuses them; every rank builds
//! its wrappers in the same order, as any collective requires).

use crate::dist::{new_subgroups_by_enumeration, DistEnv, ProcessGroup};
use crate::{Error, Result};
use std::cell::RefCell;
use std::collections::HashMap;

/// The groups of one rank in the mesh.
#[derive(Debug, Clone, Copy)]
pub struct HybridMesh<'pg> {
    /// This rank's shard group (`dp_shard_size` ranks): parameters are sharded over it.
    pub shard: &'pg dyn ProcessGroup,
    /// This rank's replicate group (`dp_replicate_size` ranks), `None` when it has one rank:
    /// the shard-group-reduced gradients are all-reduced (Avg) over it.
    pub replicate: Option<&'pg dyn ProcessGroup>,
}

/// A world group (its address, backend, rank, size) and a shard size.
type Key = (usize, &'static str, usize, usize, usize);
/// The shard and replicate groups made for a [`Key`].
type Groups = (&'static dyn ProcessGroup, &'static dyn ProcessGroup);

thread_local! {
    static MESHES: RefCell<HashMap<Key, Groups>> = RefCell::new(HashMap::new());
}

/// `dp_shard_size` as given, else `LOCAL_WORLD_SIZE` (the ranks of one node).
///
/// # Errors
/// [`Error::Env`] for a contradictory launcher environment.
pub fn resolve_shard_size(dp_shard_size: Option<usize>) -> Result<usize> {
    match dp_shard_size {
        Some(s) => Ok(s),
        None => Ok(DistEnv::from_env()?.local_world_size),
    }
}

/// Checks that `dp_shard_size` divides `world_size` and returns `dp_replicate_size`.
///
/// # Errors
/// [`Error::InvalidValue`] naming `dp_shard_size`, its value and the world size.
pub fn replicate_size(dp_shard_size: usize, world_size: usize) -> Result<usize> {
    if dp_shard_size == 0 || world_size % dp_shard_size != 0 {
        return Err(Error::invalid(
            "dp_shard_size",
            dp_shard_size,
            format!(
                "a divisor of the world size {world_size} (HSDP's mesh is dp_replicate_size x dp_shard_size = world size; \
                 by default dp_shard_size is LOCAL_WORLD_SIZE, the ranks of one node)"
            ),
        ));
    }
    Ok(world_size / dp_shard_size)
}

impl<'pg> HybridMesh<'pg> {
    /// This rank's groups in the `world_size / dp_shard_size` x `dp_shard_size` mesh over `pg`.
    /// Collective on first use for a given `pg` and size (every rank calls it, in the same
    /// order); no communication when the shard group is the world or a single rank.
    ///
    /// # Errors
    /// As [`replicate_size`]; the backend's errors from [`ProcessGroup::new_group`].
    pub fn new(pg: &'pg dyn ProcessGroup, dp_shard_size: usize) -> Result<Self> {
        let w = pg.world_size();
        let r = replicate_size(dp_shard_size, w)?;
        if r == 1 {
            return Ok(Self { shard: pg, replicate: None });
        }
        let key: Key = (pg as *const dyn ProcessGroup as *const () as usize, pg.backend(), pg.rank(), w, dp_shard_size);
        if let Some((shard, replicate)) = MESHES.with(|m| m.borrow().get(&key).copied()) {
            return Ok(Self { shard, replicate: Some(replicate) });
        }
        let shards: Vec<Vec<usize>> = (0..r).map(|k| (k * dp_shard_size..(k + 1) * dp_shard_size).collect()).collect();
        let replicas: Vec<Vec<usize>> = (0..dp_shard_size).map(|j| (0..r).map(|k| k * dp_shard_size + j).collect()).collect();
        let shard: &'static dyn ProcessGroup = Box::leak(new_subgroups_by_enumeration(pg, &shards)?);
        let replicate: &'static dyn ProcessGroup = Box::leak(new_subgroups_by_enumeration(pg, &replicas)?);
        MESHES.with(|m| m.borrow_mut().insert(key, (shard, replicate)));
        Ok(Self { shard, replicate: Some(replicate) })
    }
}
