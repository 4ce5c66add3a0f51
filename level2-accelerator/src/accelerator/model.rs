//! The prepared model: the user's handle on the model the Accelerator holds.

use super::state::Shared;
use crate::Result;
use ladder_core::memory::ModelStateBytes;
use ladder_core::parallel::WrappedModel;
use std::cell::RefCell;
use std::rc::Rc;
use tch::Tensor;

/// The prepared model: `forward_t` as the plain model's; backward goes through
/// [`Accelerator::backward`](super::Accelerator::backward).
#[derive(Debug, Clone)]
pub struct PreparedModel {
    pub(crate) shared: Rc<Shared>,
}

impl PreparedModel {
    pub(crate) fn inner(&self) -> &RefCell<WrappedModel<'static>> {
        self.shared.prepared_model()
    }

    /// Forward pass: images `[b, 1, 28, 28]` f32 → log-probabilities `[b, 10]` f32 (fp32 also
    /// under mixed precision, as Accelerate's autocast returns).
    ///
    /// # Errors
    /// FSDP gather errors.
    pub fn forward_t(&self, xs: &Tensor, train: bool) -> Result<Tensor> {
        Ok(self.inner().borrow_mut().forward_t(xs, train)?)
    }

    /// Copies of the gradients of what the optimizer updates (`p.grad` of each parameter for
    /// DDP, of each FlatParameter shard for FSDP); undefined tensors where none exists yet.
    pub fn gradients(&self) -> Vec<Tensor> {
        self.inner().borrow().gradients()
    }

    /// Bytes of model state on this process.
    pub fn memory(&self) -> ModelStateBytes {
        self.inner().borrow().memory()
    }

    /// Seconds this process spent in collectives.
    pub fn comm_seconds(&self) -> f64 {
        self.inner().borrow().comm_seconds()
    }

    /// The bucket / FlatParameter layout.
    pub fn explain(&self) -> String {
        self.inner().borrow().explain()
    }

    /// Checks the processes hold the same parameters (DDP) or shard layout (FSDP).
    ///
    /// # Errors
    /// What differs, named.
    pub fn check_parameters_in_sync(&self) -> Result<()> {
        Ok(self.inner().borrow().check_parameters_in_sync()?)
    }
}
