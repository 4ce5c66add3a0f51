//! Process groups: the collectives every level stands on, over real engines — OpenMPI (through
//! rsmpi, cargo feature `mpi`) on CPU and across nodes, NCCL (loaded at run time, the
//! libnccl.so.2 libtorch loaded; cargo feature `nccl`) on GPUs — plus the torchrun environment
//! ([`env`]) and the TCP rendezvous ([`rendezvous`]) that hands out NCCL's unique id.
//!
//! The API follows `torch.distributed`: [`init_process_group`] reads the environment the
//! launcher set (`RANK`, `WORLD_SIZE`, … or mpirun's `OMPI_COMM_WORLD_*`) and returns a
//! [`ProcessGroup`]; dropping it (or [`destroy_process_group`]) finalises the backend.
//! With nothing set the world has one rank and every collective is the identity.

pub mod collective;
pub mod env;
pub mod local;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod progress;
pub mod rendezvous;
pub mod slurm;
pub mod work;

use crate::{Error, Result};
use std::time::Duration;
use tch::{Device, Kind, Tensor};

pub use collective::{Agreement, Buffer, Call, Collective, Input};
pub use env::DistEnv;
pub use work::{parse_timeout, timeout_from_env, Work, DEFAULT_TIMEOUT, TIMEOUT_VAR};

/// Reduction applied by [`ProcessGroup::all_reduce`] and [`ProcessGroup::reduce_scatter`],
/// as `torch.distributed.ReduceOp`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise mean over ranks (sum / world_size; NCCL's `ncclAvg`).
    Avg,
    /// Element-wise maximum.
    Max,
    /// Element-wise minimum.
    Min,
}

/// A communication backend, as `torch.distributed`'s `backend=` argument.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// OpenMPI through rsmpi: CPU tensors, one node or many (launch with mpirun or ladder-run).
    Mpi,
    /// NCCL (libnccl.so.2, the torch wheel's): CUDA tensors (launch with ladder-run).
    Nccl,
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Backend::Mpi => "mpi",
            Backend::Nccl => "nccl",
        })
    }
}

/// A group of ranks and the collectives between them, as a `torch.distributed` process group.
///
/// A backend implements [`run`](Self::run) (and, if it has host-side asynchrony,
/// [`start`](Self::start)) for every [`Collective`]; the torch-named calls
/// ([`all_reduce`](Self::all_reduce), [`broadcast`](Self::broadcast), …) are that collective
/// run with the defaults: blocking, checked, on borrowed tensors.
///
/// Every collective works in place on tch tensors that are contiguous, of one of the dtypes
/// f32, f64, bf16, f16, i64, and on the backend's device (CPU for MPI, CUDA for NCCL). A tensor
/// that is not is a typed [`Error::BadTensor`]; ranks that disagree on numel or dtype get
/// [`Error::CollectiveMismatch`] on every rank instead of undefined behaviour (unless the call
/// is [`Agreement::Prechecked`]).
pub trait ProcessGroup: std::fmt::Debug {
    /// The engine behind this group.
    fn backend(&self) -> &'static str;
    /// This process's rank, `0..world_size`.
    fn rank(&self) -> usize;
    /// This process's rank among the ranks on its node (`LOCAL_RANK`, `0..LOCAL_WORLD_SIZE`;
    /// the GPU it uses under NCCL).
    fn local_rank(&self) -> usize;
    /// Number of ranks in the group.
    fn world_size(&self) -> usize;
    /// The device this group's tensors live on (CPU for MPI; `cuda:local_rank` for NCCL).
    fn device(&self) -> Device;

    /// Ends the group now, as `destroy_process_group()` — for a group that is never dropped
    /// (see [`leak`]). Idempotent; dropping the group afterwards does nothing more. No
    /// collective may follow it. Default: nothing to release.
    fn shutdown(&self) {}

    /// How long a collective may wait for the other ranks before it fails with
    /// [`Error::CollectiveTimeout`] (as `init_process_group(timeout=...)`; default
    /// [`DEFAULT_TIMEOUT`], 600 s).
    fn timeout(&self) -> Duration {
        DEFAULT_TIMEOUT
    }

    /// Creates the sub-group of `ranks` (ranks of this group), as `dist.new_group(ranks)`:
    /// collective — every rank of this group calls it with the same `ranks`, and all ranks make
    /// their `new_group` calls in the same order (as torch requires). A member gets the group,
    /// whose ranks are the members in ascending order of their rank here (torch sorts `ranks`
    /// too), on the same device with the same timeout; every other rank gets `None` (torch's
    /// `GroupMember.NON_GROUP_MEMBER`). A sub-group's collectives run only among its members
    /// and are independent of this group's. MPI: `MPI_Comm_split`; NCCL: a communicator of
    /// its own, its unique id exchanged through the rendezvous store under a key of its own.
    ///
    /// # Errors
    /// [`Error::RankOutOfRange`] for a rank `>= world_size`; [`Error::InvalidValue`] (name
    /// `ranks`) for an empty list or one with a rank twice; the backend's errors.
    fn new_group(&self, ranks: &[usize]) -> Result<Option<Box<dyn ProcessGroup>>>;

    /// Runs `collective` and returns once it completed, as `torch.distributed`'s calls with
    /// `async_op=False`.
    ///
    /// # Errors
    /// [`Error::BadTensor`] for a tensor the backend cannot take or blocks of the wrong size,
    /// [`Error::RankOutOfRange`] for a broadcast's `src >= world_size`,
    /// [`Error::CollectiveMismatch`] when the ranks disagree on numel or dtype (checked calls),
    /// [`Error::CollectiveTimeout`] / [`Error::GroupAborted`], and the backend's own errors.
    fn run(&self, collective: Collective<'_>) -> Result<()>;

    /// Starts `collective` and returns at once, as `async_op=True`: the result is in place once
    /// the returned [`Work`] completed ([`Work::wait`], [`Work::test`]); the `Work` keeps the
    /// tensors (borrowed or handed over) until then. A checked collective is issued before this
    /// returns (past its agreement probe), so several started ones are issued in call order on
    /// every rank. Default, for backends without host-side asynchrony: [`run`](Self::run), then
    /// a completed `Work`.
    ///
    /// # Errors
    /// As [`run`](Self::run); a failure after the start comes from the `Work`.
    fn start<'a>(&'a self, collective: Collective<'a>) -> Result<Work<'a>> {
        let name = collective.name();
        self.run(collective)?;
        Ok(Work::completed(name))
    }

    /// Reduces `tensor` element-wise over all ranks with `op`; every rank receives the result.
    /// As `dist.all_reduce(tensor, op)`: [`Collective::all_reduce`], run.
    ///
    /// # Errors
    /// As [`run`](Self::run).
    fn all_reduce(&self, tensor: &mut Tensor, op: ReduceOp) -> Result<()> {
        self.run(Collective::all_reduce(tensor, op))
    }

    /// Copies `tensor` of rank `src` into `tensor` on every rank. As `dist.broadcast`.
    ///
    /// # Errors
    /// [`Error::RankOutOfRange`] when `src >= world_size`; as [`run`](Self::run).
    fn broadcast(&self, tensor: &mut Tensor, src: usize) -> Result<()> {
        self.run(Collective::broadcast(tensor, src))
    }

    /// Gathers every rank's `input` (numel n) into `output` (numel world_size · n), rank r's
    /// block at `[r·n, (r+1)·n)`. As `dist.all_gather_into_tensor(output, input)`.
    ///
    /// # Errors
    /// As [`run`](Self::run).
    fn all_gather(&self, output: &mut Tensor, input: &Tensor) -> Result<()> {
        self.run(Collective::all_gather(output, input))
    }

    /// Reduces `input` (numel world_size · n) over ranks with `op` and leaves block `rank`
    /// (numel n) of the result in `output`. As `dist.reduce_scatter_tensor(output, input, op)`.
    ///
    /// # Errors
    /// As [`run`](Self::run).
    fn reduce_scatter(&self, output: &mut Tensor, input: &Tensor, op: ReduceOp) -> Result<()> {
        self.run(Collective::reduce_scatter(output, input, op))
    }

    /// Returns once every rank has called it. As `dist.barrier()`.
    ///
    /// # Errors
    /// As [`run`](Self::run).
    fn barrier(&self) -> Result<()> {
        self.run(Collective::barrier())
    }

    /// All-reduces many tensors with one call: they are packed into one flat buffer (one copy
    /// in, one out), reduced, and unpacked. All must share dtype and device.
    ///
    /// # Errors
    /// [`Error::BadTensor`] for tensors of mixed dtype or device; as [`run`](Self::run).
    fn all_reduce_coalesced(&self, tensors: &mut [Tensor], op: ReduceOp) -> Result<()> {
        coalesced(tensors, "all_reduce_coalesced", self.rank(), |flat| self.all_reduce(flat, op))
    }

    /// Broadcasts many tensors from `src` with one call (packed into one flat buffer).
    ///
    /// # Errors
    /// As [`all_reduce_coalesced`](Self::all_reduce_coalesced).
    fn broadcast_coalesced(&self, tensors: &mut [Tensor], src: usize) -> Result<()> {
        coalesced(tensors, "broadcast_coalesced", self.rank(), |flat| self.broadcast(flat, src))
    }
}

/// Checks the `ranks` of a [`ProcessGroup::new_group`] call against `world_size` and returns
/// them sorted: this rank's position among them is its rank in the sub-group.
///
/// # Errors
/// As [`ProcessGroup::new_group`].
pub(crate) fn check_group_ranks(ranks: &[usize], world_size: usize) -> Result<Vec<usize>> {
    let mut sorted = ranks.to_vec();
    sorted.sort_unstable();
    if let Some(&r) = sorted.iter().find(|&&r| r >= world_size) {
        return Err(Error::RankOutOfRange { op: "new_group", rank: r, world_size });
    }
    if sorted.is_empty() || sorted.windows(2).any(|w| w[0] == w[1]) {
        return Err(Error::invalid("ranks", format!("{ranks:?}"), format!("distinct ranks of the group (0..{world_size}), at least one")));
    }
    Ok(sorted)
}

/// Creates one sub-group per list in `groups` (a partition of the ranks of `pg`) and returns
/// the one this rank belongs to, as `dist.new_subgroups_by_enumeration(groups)`: every rank
/// calls [`ProcessGroup::new_group`] for every list, in order.
///
/// # Errors
/// [`Error::InvalidValue`] (name `groups`) when this rank is in none of the lists or in
/// several; as [`ProcessGroup::new_group`].
pub fn new_subgroups_by_enumeration(pg: &dyn ProcessGroup, groups: &[Vec<usize>]) -> Result<Box<dyn ProcessGroup>> {
    let mut mine = None;
    for ranks in groups {
        if let Some(g) = pg.new_group(ranks)? {
            if mine.replace(g).is_some() {
                return Err(Error::invalid("groups", format!("{groups:?}"), format!("lists that hold rank {} once", pg.rank())));
            }
        }
    }
    mine.ok_or_else(|| Error::invalid("groups", format!("{groups:?}"), format!("lists that hold every rank, rank {} too", pg.rank())))
}

/// Packs `tensors` into one flat buffer, runs `f` on it, and copies the result back.
fn coalesced(tensors: &mut [Tensor], op: &'static str, rank: usize, f: impl FnOnce(&mut Tensor) -> Result<()>) -> Result<()> {
    let Some(first) = tensors.first() else { return Ok(()) };
    let (kind, device) = (first.kind(), first.device());
    for (i, t) in tensors.iter().enumerate() {
        if t.kind() != kind || t.device() != device {
            return Err(Error::BadTensor {
                op,
                rank,
                problem: format!(
                    "tensor {i} is {:?} on {:?}, but tensor 0 is {kind:?} on {device:?}; coalesced tensors must share dtype and device",
                    t.kind(),
                    t.device()
                ),
            });
        }
    }
    let flats: Vec<Tensor> = tensors.iter().map(|t| t.reshape([-1])).collect();
    let mut flat = Tensor::cat(&flats, 0);
    f(&mut flat)?;
    let mut offset = 0i64;
    for t in tensors.iter_mut() {
        let n = t.numel() as i64;
        let mut view = t.view([-1]);
        view.copy_(&flat.narrow(0, offset, n));
        offset += n;
    }
    Ok(())
}

/// Element size in bytes of the dtypes collectives accept, or `None` for any other dtype.
pub fn supported_kind_size(kind: Kind) -> Option<usize> {
    match kind {
        Kind::Float => Some(4),
        Kind::Double | Kind::Int64 => Some(8),
        Kind::BFloat16 | Kind::Half => Some(2),
        _ => None,
    }
}

/// What each rank contributes to the cross-rank agreement check that precedes every collective:
/// an element-wise Max all-reduce of `[n, -n, k, -k]` yields the largest and (negated) smallest
/// numel and dtype code over all ranks in one 4-integer call.
pub(crate) fn agreement_probe(numel: i64, kind: Kind) -> [i64; 4] {
    let code = kind_code(kind);
    [numel, -numel, code, -code]
}

/// Reads the Max-reduced [`agreement_probe`]: every rank passed the same numel and dtype, or
/// [`Error::CollectiveMismatch`] (on every rank alike) naming the ranges seen.
pub(crate) fn check_agreement(op: &'static str, rank: usize, numel: i64, kind: Kind, reduced: &[i64; 4]) -> Result<()> {
    let v = reduced;
    if v[0] != -v[1] || v[2] != -v[3] {
        return Err(Error::CollectiveMismatch {
            op,
            detail: format!(
                "rank {rank} passed {numel} elements of {kind:?}; across ranks numel ranges {}..={} and dtype codes {}..={}",
                -v[1], v[0], -v[3], v[2]
            ),
        });
    }
    Ok(())
}

/// A stable code per supported dtype, exchanged to detect dtype mismatches across ranks.
fn kind_code(kind: Kind) -> i64 {
    match kind {
        Kind::Float => 1,
        Kind::Double => 2,
        Kind::Int64 => 3,
        Kind::BFloat16 => 4,
        Kind::Half => 5,
        _ => 0,
    }
}

/// Checks what every backend needs of a tensor: contiguous, a supported dtype, the group's
/// device.
pub(crate) fn check_tensor(op: &'static str, rank: usize, device: Device, t: &Tensor) -> Result<()> {
    let bad = |problem: String| Err(Error::BadTensor { op, rank, problem });
    if !t.is_contiguous() {
        return bad(format!("tensor of shape {:?} is not contiguous; call .contiguous() first", t.size()));
    }
    if supported_kind_size(t.kind()).is_none() {
        return bad(format!("dtype {:?} is not supported; expected one of f32, f64, bf16, f16, i64", t.kind()));
    }
    if t.device() != device {
        return bad(format!("tensor is on {:?}, but this process group works on {:?}", t.device(), device));
    }
    Ok(())
}

/// Checks a call's arguments as every backend needs them: each tensor contiguous, of a
/// supported dtype, on `device` ([`check_tensor`]; an input before an output); an all-gather's
/// output and a reduce-scatter's input `world_size` blocks the size and dtype of the other
/// tensor ([`check_blocks`]); a broadcast's `src` in range ([`check_rank`]).
pub(crate) fn check_call(call: &Call<'_>, rank: usize, world_size: usize, device: Device) -> Result<()> {
    match call {
        Call::AllReduce { tensor, .. } => check_tensor("all_reduce", rank, device, tensor),
        Call::Broadcast { tensor, src } => {
            check_tensor("broadcast", rank, device, tensor)?;
            check_rank("broadcast", *src, world_size)
        }
        Call::AllGather { output, input } => {
            check_tensor("all_gather", rank, device, input)?;
            check_tensor("all_gather", rank, device, output)?;
            check_blocks("all_gather", rank, world_size, output, input)
        }
        Call::ReduceScatter { output, input, .. } => {
            check_tensor("reduce_scatter", rank, device, input)?;
            check_tensor("reduce_scatter", rank, device, output)?;
            check_blocks("reduce_scatter", rank, world_size, input, output)
        }
        Call::Barrier => Ok(()),
    }
}

/// Checks `big` holds `world_size` blocks the size and dtype of `small`.
pub(crate) fn check_blocks(op: &'static str, rank: usize, world_size: usize, big: &Tensor, small: &Tensor) -> Result<()> {
    if big.numel() != world_size * small.numel() || big.kind() != small.kind() {
        return Err(Error::BadTensor {
            op,
            rank,
            problem: format!(
                "expected the large tensor to hold world_size ({world_size}) x {} {:?} elements, found {} {:?}",
                small.numel(),
                small.kind(),
                big.numel(),
                big.kind()
            ),
        });
    }
    Ok(())
}

/// Checks `src` against the world size.
pub(crate) fn check_rank(op: &'static str, src: usize, world_size: usize) -> Result<()> {
    if src >= world_size {
        return Err(Error::RankOutOfRange { op, rank: src, world_size });
    }
    Ok(())
}

/// Initialises the process group for this process, as `dist.init_process_group(backend)`.
///
/// Reads the launcher's environment ([`DistEnv::from_env`]); sets libtorch's intra-op threads
/// to `cores / LOCAL_WORLD_SIZE` and glibc's `malloc` for training
/// ([`tune_malloc_for_training`](crate::device::tune_malloc_for_training)). With world size 1 and no launcher, returns the one-rank
/// [`local::LocalGroup`] whatever the backend, so every binary also runs plainly.
///
/// # Errors
/// [`Error::Env`] for a contradictory environment, [`Error::BackendUnavailable`] when the
/// backend is not compiled in or cannot start (no GPU, no libnccl), and the backend's own
/// errors.
///
/// The collective timeout is `LADDER_COLLECTIVE_TIMEOUT_S`, else 600 s; see
/// [`init_process_group_with_timeout`].
pub fn init_process_group(backend: Backend) -> Result<Box<dyn ProcessGroup>> {
    init_process_group_with_timeout(backend, timeout_from_env()?)
}

/// [`init_process_group`] with a collective timeout, as `init_process_group(backend,
/// timeout=timedelta(seconds=...))`: a collective that waits longer for the other ranks fails
/// with [`Error::CollectiveTimeout`] (naming the operation, its sequence number, the step and
/// the ranks that did not arrive) and the job is aborted when the group shuts down.
///
/// # Errors
/// As [`init_process_group`].
pub fn init_process_group_with_timeout(backend: Backend, timeout: Duration) -> Result<Box<dyn ProcessGroup>> {
    let env = DistEnv::from_env()?;
    crate::device::set_threads_per_rank(env.local_world_size);
    crate::device::tune_malloc_for_training();
    init_with_env_timeout(backend, &env, timeout)
}

/// [`init_process_group`] with an explicit environment (tests, and launchers that already
/// parsed it); the timeout comes from `LADDER_COLLECTIVE_TIMEOUT_S`, else 600 s.
pub fn init_with_env(backend: Backend, env: &DistEnv) -> Result<Box<dyn ProcessGroup>> {
    init_with_env_timeout(backend, env, timeout_from_env()?)
}

/// [`init_with_env`] with an explicit collective timeout.
pub fn init_with_env_timeout(backend: Backend, env: &DistEnv, timeout: Duration) -> Result<Box<dyn ProcessGroup>> {
    if env.world_size == 1 && !env.under_mpirun() {
        let device = match backend {
            Backend::Mpi => Device::Cpu,
            Backend::Nccl => crate::device::DeviceKind::Cuda.resolve(env.local_rank)?,
        };
        return Ok(Box::new(local::LocalGroup::new(backend, device)));
    }
    match backend {
        Backend::Mpi if env.launcher == env::Launcher::Srun { pmix: false } => Err(Error::Env(format!(
            "srun without --mpi=pmix cannot start Open MPI ranks (this is task {} of {}, and PMIX_RANK is not set); \
             use `srun --mpi=pmix` (or MpiDefault=pmix in slurm.conf), or mpirun / ladder-run inside the allocation",
            env.rank, env.world_size
        ))),
        Backend::Mpi if !env.under_mpirun() => Err(Error::Env(format!(
            "the mpi backend needs its {} ranks started by mpirun (`mpirun -n {}` or `ladder-run --backend mpi`), \
             but this process has only the torchrun variables (RANK={}, WORLD_SIZE={}); \
             `ladder-run --backend nccl` starts ranks for the nccl backend (with --device cuda)",
            env.world_size, env.world_size, env.rank, env.world_size
        ))),
        Backend::Mpi => init_mpi(env, timeout),
        Backend::Nccl => init_nccl(env, timeout),
    }
}

#[cfg(feature = "mpi")]
fn init_mpi(env: &DistEnv, timeout: Duration) -> Result<Box<dyn ProcessGroup>> {
    Ok(Box::new(mpi::MpiGroup::init_with_timeout(env, timeout)?))
}

#[cfg(not(feature = "mpi"))]
fn init_mpi(_env: &DistEnv, _timeout: Duration) -> Result<Box<dyn ProcessGroup>> {
    Err(Error::BackendUnavailable {
        backend: "mpi".into(),
        why: "this build has no MPI support; rebuild with the cargo feature `mpi`".into(),
    })
}

#[cfg(feature = "nccl")]
fn init_nccl(env: &DistEnv, timeout: Duration) -> Result<Box<dyn ProcessGroup>> {
    Ok(Box::new(nccl::NcclGroup::init_with_timeout(env, timeout)?))
}

#[cfg(not(feature = "nccl"))]
fn init_nccl(_env: &DistEnv, _timeout: Duration) -> Result<Box<dyn ProcessGroup>> {
    Err(Error::BackendUnavailable {
        backend: "nccl".into(),
        why: "this build has no NCCL support; rebuild with `cargo build --release --workspace --bins --features ladder-core/nccl`".into(),
    })
}

/// Gives the group a `'static` lifetime, for owners that hand out references to it together
/// with objects borrowing it (the Accelerator and its prepared models). The group is never
/// dropped: call [`ProcessGroup::shutdown`] to finalise it (the Accelerator does so when it is
/// dropped, also while unwinding from a panic, which aborts the job as dropping would).
pub fn leak(group: Box<dyn ProcessGroup>) -> &'static dyn ProcessGroup {
    Box::leak(group)
}

/// Finalises the group (as `dist.destroy_process_group()`); dropping it does the same.
pub fn destroy_process_group(group: Box<dyn ProcessGroup>) {
    drop(group);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mpi_backend_without_mpirun_is_a_clear_error() {
        // What `ladder-run --backend nccl PROGRAM --device cpu` hands a rank: torchrun variables only.
        let vars = [("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")];
        let env = DistEnv::from_lookup(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())).unwrap();
        let err = init_with_env(Backend::Mpi, &env).unwrap_err().to_string();
        assert!(err.contains("the mpi backend needs its 2 ranks started by mpirun"), "{err}");
        assert!(err.contains("RANK=1, WORLD_SIZE=2"), "{err}");
    }

    #[test]
    fn agreement_names_the_ranges_seen() {
        let a = agreement_probe(4, Kind::Float);
        let b = agreement_probe(5, Kind::Double);
        let max: [i64; 4] = std::array::from_fn(|i| a[i].max(b[i]));
        assert!(check_agreement("all_reduce", 0, 4, Kind::Float, &a).is_ok());
        let err = check_agreement("all_reduce", 0, 4, Kind::Float, &max).unwrap_err().to_string();
        assert_eq!(
            err,
            "all_reduce: ranks disagree on the tensor: rank 0 passed 4 elements of Float; across ranks numel ranges 4..=5 and dtype codes 1..=2"
        );
    }
}
