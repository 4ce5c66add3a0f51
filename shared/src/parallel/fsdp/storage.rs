//! Freeing a storage's memory and refilling the same storage — the mechanism behind FSDP's
//! "free the gathered parameters after forward, all-gather them again before backward"
//! without a second forward (FFI to `storage_shim.cpp`, declared in `crate::ffi::storage`).
//!
//! Why a storage and not a tensor: forward's autograd graph saves tensors that *view* the
//! gathered flat parameter (`linear` saves `weight.t()`, a view libtorch creates and we never
//! see; `conv2d` saves the parameter itself). Repointing the parameters with `set_data` does
//! not reach those saved views, and dropping our handle does not free the memory they keep
//! alive. What all of them share is one `StorageImpl`; PyTorch's FSDP frees its memory with
//! `flat_param._full_param_padded.untyped_storage().resize_(0)` and re-allocates it with
//! `resize_(n)` before the all-gather of backward, so the saved views read the refilled
//! parameters. tch exposes neither: `Tensor::resize_` only ever *grows* a storage (libtorch's
//! `resize_` keeps a larger storage as it is) and `Tensor::set_` gives one tensor another
//! storage. So these two calls go to a 30-line C++ shim against libtorch's own headers.

//!
//! # Safety
//!
//! While a [`FlatStorage`] is released its storage holds no memory (a null data pointer), yet
//! views of it still exist: those autograd saved, and any the caller made. Reading one of them
//! then would read freed memory. [`FullyShardedDataParallel`](super::FullyShardedDataParallel)
//! keeps the rule that makes this sound: on release it repoints the model's parameters at
//! empty tensors, so the only remaining views are inside the forward graph it keeps privately
//! (`saved`), and it runs that graph's backward only after [`FlatStorage::refill`]; a graph that
//! is dropped instead is never read. The views are never handed to user code while released.

use crate::{Error, Result};
use tch::{Device, Kind, Tensor};

/// A flat buffer (`[numel]`, one dtype, one device) whose memory can be released and allocated
/// again *in the same storage*, so that views of it made while it was filled — the model's
/// parameters, and the tensors autograd saved from them — read the refilled contents.
/// FSDP's gathered `FlatParameter` (PyTorch's `_full_param_padded`).
pub(super) struct FlatStorage {
    flat: Tensor,
    nbytes: usize,
    filled: bool,
}

impl FlatStorage {
    /// A filled buffer of `numel` elements of `kind` on `device` (contents uninitialised).
    pub(super) fn new(numel: i64, kind: Kind, device: Device) -> Self {
        let flat = Tensor::empty([numel], (kind, device));
        Self { nbytes: numel as usize * kind.elt_size_in_bytes(), flat, filled: true }
    }

    /// The buffer, `[numel]`: the all-gather writes into it and the parameters view it. `None`
    /// while released.
    pub(super) fn tensor(&self) -> Option<&Tensor> {
        self.filled.then_some(&self.flat)
    }

    /// Bytes the buffer holds when filled.
    pub(super) fn nbytes(&self) -> u64 {
        self.nbytes as u64
    }

    /// True while the memory is allocated.
    pub(super) fn is_filled(&self) -> bool {
        self.filled
    }

    /// Frees the memory (`untyped_storage().resize_(0)`); every view keeps its shape and now
    /// points at nothing until [`refill`](Self::refill). No-op when already released.
    ///
    /// # Errors
    /// [`Error::Fsdp`] (with libtorch's message) if the storage cannot be resized.
    pub(super) fn release(&mut self, rank: usize) -> Result<()> {
        if self.filled {
            self.resize(0, rank)?;
            self.filled = false;
        }
        Ok(())
    }

    /// Allocates the memory again (`untyped_storage().resize_(nbytes)`), contents undefined:
    /// the caller all-gathers into [`tensor`](Self::tensor) before any view is read. Returns
    /// the buffer. No-op when filled.
    ///
    /// # Errors
    /// [`Error::Fsdp`] if libtorch cannot allocate it.
    pub(super) fn refill(&mut self, rank: usize) -> Result<&Tensor> {
        if !self.filled {
            self.resize(self.nbytes, rank)?;
            self.filled = true;
        }
        Ok(&self.flat)
    }

    fn resize(&self, nbytes: usize, rank: usize) -> Result<()> {
        // SAFETY: resizing is what makes views unreadable until refilled: see the module's
        // `# Safety` (`flat` is alive for the call).
        unsafe { crate::ffi::storage::resize_bytes(&self.flat, nbytes) }.map_err(|msg| Error::Fsdp {
            rank,
            problem: format!("resizing a gathered FlatParameter's storage to {nbytes} bytes failed: {msg}"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn released_storage_holds_no_memory_and_views_read_the_refill() {
        let mut s = FlatStorage::new(6, Kind::Float, Device::Cpu);
        let flat = s.tensor().expect("filled").shallow_clone();
        flat.detach().copy_(&Tensor::from_slice(&[1f32, 2., 3., 4., 5., 6.]));
        let view = flat.narrow(0, 2, 3);
        assert_eq!(s.nbytes(), 24);
        s.release(0).unwrap();
        assert!(s.tensor().is_none() && !s.is_filled());
        // The views keep their shapes; their storage holds nothing (a null data pointer, which
        // the view at element offset 2 sees as address 8).
        assert_eq!(view.size(), [3]);
        assert!(flat.data_ptr().is_null(), "released: no memory behind the flat buffer");
        assert_eq!(view.data_ptr() as usize, 8, "nor behind the view");
        s.refill(0).unwrap().detach().copy_(&Tensor::from_slice(&[6f32, 5., 4., 3., 2., 1.]));
        assert!(!view.data_ptr().is_null());
        assert_eq!(Vec::<f32>::try_from(&view).unwrap(), [4., 3., 2.], "the old view reads the refilled storage");
    }

    #[test]
    fn a_graph_saved_before_release_backpropagates_after_refill() {
        // As FSDP does with a layer: the parameter views a flat buffer, forward's graph saves
        // (views of) it, the memory is released, then refilled with the same values.
        let x = Tensor::from_slice(&[1f32, -2., 0.5, 3., 1., -1.]).view([2, 3]);
        let reference = |w: &Tensor| {
            let w = w.detach().set_requires_grad(true);
            x.linear(&w, None::<Tensor>).square().sum(Kind::Float).backward();
            w.grad()
        };
        let values = Tensor::from_slice(&[0.1f32, -0.2, 0.3, 0.4, 0.5, -0.6]);
        let mut s = FlatStorage::new(6, Kind::Float, Device::Cpu);
        s.tensor().unwrap().detach().copy_(&values);
        let mut w = Tensor::empty([0], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        w.set_data(&s.tensor().unwrap().view([2, 3]));
        let loss = x.linear(&w, None::<Tensor>).square().sum(Kind::Float);
        s.release(0).unwrap();
        w.set_data(&Tensor::empty([0], (Kind::Float, Device::Cpu)));
        s.refill(0).unwrap().detach().copy_(&values);
        w.set_data(&s.tensor().unwrap().view([2, 3]));
        loss.backward();
        assert!(w.grad().equal(&reference(&values.view([2, 3]))), "same gradient as without the release");
    }
}
