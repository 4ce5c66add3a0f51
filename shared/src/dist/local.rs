//! The one-rank group: what a plain, unlaunched process gets. Every collective is the identity
//! (the reduction of one rank's value is that value), after the same checks the real backends
//! make, so code that runs here runs unchanged under a launcher.

use super::{check_blocks, check_rank, check_tensor, ProcessGroup, ReduceOp};
use crate::Result;
use tch::{Device, Tensor};

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
    fn world_size(&self) -> usize {
        1
    }
    fn device(&self) -> Device {
        self.device
    }
    fn all_reduce(&self, tensor: &mut Tensor, _op: ReduceOp) -> Result<()> {
        check_tensor("all_reduce", 0, self.device, tensor)
    }
    fn broadcast(&self, tensor: &mut Tensor, src: usize) -> Result<()> {
        check_tensor("broadcast", 0, self.device, tensor)?;
        check_rank("broadcast", src, 1)
    }
    fn all_gather(&self, output: &mut Tensor, input: &Tensor) -> Result<()> {
        check_tensor("all_gather", 0, self.device, input)?;
        check_tensor("all_gather", 0, self.device, output)?;
        check_blocks("all_gather", 0, 1, output, input)?;
        output.view([-1]).copy_(&input.view([-1]));
        Ok(())
    }
    fn reduce_scatter(&self, output: &mut Tensor, input: &Tensor, _op: ReduceOp) -> Result<()> {
        check_tensor("reduce_scatter", 0, self.device, input)?;
        check_tensor("reduce_scatter", 0, self.device, output)?;
        check_blocks("reduce_scatter", 0, 1, input, output)?;
        output.view([-1]).copy_(&input.view([-1]));
        Ok(())
    }
    fn barrier(&self) -> Result<()> {
        Ok(())
    }
}
