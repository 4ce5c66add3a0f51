//! The one-rank group: what a plain, unlaunched process gets. Every collective is the identity
//! (the reduction of one rank's value is that value), after the same checks the real backends
//! make, so code that runs here runs unchanged under a launcher.

use super::{check_call, Call, Collective, ProcessGroup};
use crate::Result;
use tch::Device;

/// World size 1, rank 0.
#[derive(Debug)]
pub struct LocalGroup {
    backend: &'static str,
    device: Device,
}

impl LocalGroup {
    /// A one-rank group standing in for `backend`, on `device`.
    pub fn new(backend: super::Backend, device: Device) -> Self {
        let backend = match backend {
            super::Backend::Mpi => "mpi",
            super::Backend::Nccl => "nccl",
        };
        Self { backend, device }
    }
}

impl ProcessGroup for LocalGroup {
    fn backend(&self) -> &'static str {
        self.backend
    }
    fn rank(&self) -> usize {
        0
    }
    fn local_rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn device(&self) -> Device {
        self.device
    }
    /// Rank 0 alone: `new_group(&[0])` is another one-rank group.
    fn new_group(&self, ranks: &[usize]) -> Result<Option<Box<dyn ProcessGroup>>> {
        super::check_group_ranks(ranks, 1)?;
        Ok(Some(Box::new(Self { backend: self.backend, device: self.device })))
    }

    /// Checks the call, then copies where input and output are different tensors (all-gather,
    /// reduce-scatter); nothing else changes at one rank.
    fn run(&self, collective: Collective<'_>) -> Result<()> {
        check_call(&collective.call, 0, 1, self.device)?;
        match collective.call {
            Call::AllGather { output, input } | Call::ReduceScatter { output, input, .. } => {
                output.view([-1]).copy_(&input.view([-1]));
            }
            Call::AllReduce { .. } | Call::Broadcast { .. } | Call::Barrier => {}
        }
        Ok(())
    }
}
