//! Backward from a tensor with a given gradient, which tch cannot express (its `run_backward`
//! takes no `grad_outputs`): `y.backward(g)` and `torch.autograd.grad(y, inputs, g)`, through
//! src/ffi/autograd_shim.cpp. DDP's overlapped backward and FSDP's backward run the model segment
//! by segment with them; before, each segment started from the root `(y * g).sum()`, whose gradient
//! with respect to `y` is `g` exactly but which costs two passes over `y` forward and two more
//! backward (~2 ms per BasicNet step at batch 64 on one core).

use crate::error::Result;
use tch::Tensor;

/// `torch.autograd.backward([y], [g])` (= `y.backward(g)`): accumulates d(y·g)/d(leaf) — the
/// vector-Jacobian product with `g`, which has `y`'s shape and dtype — into the `.grad` of every
/// leaf `y` depends on, then frees `y`'s graph. Runs in grad mode whatever the caller's mode.
///
/// # Errors
/// [`crate::Error::Torch`] with libtorch's message: `g` of another shape or dtype than `y`
/// (checked as Python's autograd checks it), a graph already freed, `y` not requiring grad.
pub fn backward_with_grad(y: &Tensor, g: &Tensor) -> Result<()> {
    crate::ffi::autograd::backward_with_grad(y, g).map_err(|msg| tch::TchError::Torch(msg).into())
}

/// `torch.autograd.grad([y], inputs, grad_outputs=[g], retain_graph=False, allow_unused=True)`:
/// the gradient of each of `inputs` (same shape and dtype as it; undefined — `!t.defined()` —
/// where `y` does not depend on it), without accumulating into any `.grad`; frees `y`'s graph.
///
/// # Errors
/// As [`backward_with_grad`].
pub fn grad(y: &Tensor, g: &Tensor, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
    let mut results: Vec<Tensor> = inputs.iter().map(|_| Tensor::new()).collect();
    crate::ffi::autograd::grad(y, g, inputs, &mut results).map_err(tch::TchError::Torch)?;
    Ok(results)
}

/// `t.grad = g` (PyTorch's `.grad` setter): `g` itself — not a copy — becomes `t`'s gradient,
/// so `g` may be a view of a larger buffer (ZeRO-1 points every parameter's and every shard
/// piece's gradient into one flat buffer, [`crate::parallel::zero`]). A later backward
/// accumulates into it in place (libtorch's `AccumulateGrad` adds into a defined gradient
/// outside grad mode), so the buffer receives it. Every handle of `t` sees the new gradient.
///
/// # Errors
/// [`crate::Error::Torch`] with the setter's message when `g`'s shape, dtype or device differs
/// from `t`'s.
pub fn set_grad(t: &Tensor, g: &Tensor) -> Result<()> {
    crate::ffi::autograd::set_grad(t, g).map_err(|msg| tch::TchError::Torch(msg).into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    /// The product root these functions replace: Σ(y·g), whose gradient w.r.t. y is g.
    fn through_root(y: &Tensor, g: &Tensor, inputs: &[Tensor]) -> Vec<Tensor> {
        Tensor::run_backward(&[(y * g).sum(y.kind())], inputs, false, false)
    }

    #[test]
    fn grad_equals_the_product_root_bit_for_bit_and_accumulates_nothing() {
        let w = Tensor::randn([16, 8], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let unused = Tensor::randn([3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let x = Tensor::randn([4, 16], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let g = Tensor::randn([4, 8], (Kind::Float, Device::Cpu));
        let y = || x.matmul(&w).relu();
        let ours = grad(&y(), &g, &[x.shallow_clone(), w.shallow_clone(), unused.shallow_clone()]).unwrap();
        let theirs = through_root(&y(), &g, &[x.shallow_clone(), w.shallow_clone()]);
        assert!(ours[0].equal(&theirs[0]) && ours[1].equal(&theirs[1]));
        assert!(!ours[2].defined(), "an input y does not depend on has no gradient");
        assert!(!w.grad().defined() && !x.grad().defined(), "grad() accumulates into no .grad");
    }

    #[test]
    fn backward_with_grad_accumulates_into_leaves_as_backward_does() {
        let w = Tensor::randn([16, 8], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let x = Tensor::randn([4, 16], (Kind::Float, Device::Cpu));
        let g = Tensor::randn([4, 8], (Kind::Float, Device::Cpu));
        backward_with_grad(&x.matmul(&w), &g).unwrap();
        backward_with_grad(&x.matmul(&w), &g).unwrap();
        let once = through_root(&x.matmul(&w), &g, &[w.shallow_clone()]).remove(0);
        assert!(w.grad().equal(&(&once + &once)), "two backwards accumulate two gradients");
        // On a leaf: its .grad grows by g.
        let leaf = Tensor::zeros([8], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let h = Tensor::randn([8], (Kind::Float, Device::Cpu));
        backward_with_grad(&leaf, &h).unwrap();
        assert!(leaf.grad().equal(&h));
    }

    #[test]
    fn set_grad_makes_a_view_the_gradient_and_backward_accumulates_into_it() {
        let flat = Tensor::zeros([20], (Kind::Float, Device::Cpu));
        let w = Tensor::randn([4, 4], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let view = flat.narrow(0, 2, 16).view([4, 4]);
        set_grad(&w, &view).unwrap();
        assert_eq!(w.grad().data_ptr(), view.data_ptr(), "the view itself, not a copy");
        let x = Tensor::randn([3, 4], (Kind::Float, Device::Cpu));
        x.matmul(&w).sum(Kind::Float).backward();
        x.matmul(&w).sum(Kind::Float).backward();
        let once = x.sum_dim_intlist([0i64].as_slice(), false, Kind::Float).unsqueeze(1).expand([4, 4], false);
        assert!(flat.narrow(0, 2, 16).view([4, 4]).allclose(&(&once * 2.0), 1e-6, 1e-6, false), "accumulated in the buffer");
        assert_eq!(w.grad().data_ptr(), view.data_ptr(), "still the view after two backwards");
        assert_eq!(f64::try_from(flat.narrow(0, 0, 2).abs().sum(Kind::Float)).unwrap(), 0.0, "nothing outside the view");
        // As Python's setter: another shape, dtype or device is refused, the gradient unchanged.
        for wrong in [Tensor::zeros([16], (Kind::Float, Device::Cpu)), Tensor::zeros([4, 4], (Kind::Double, Device::Cpu))] {
            let e = set_grad(&w, &wrong).unwrap_err().to_string();
            assert!(e.contains("assigned grad has data of a different"), "{e}");
        }
        assert_eq!(w.grad().data_ptr(), view.data_ptr());
    }

    #[test]
    fn a_mismatched_gradient_is_an_error_not_a_crash() {
        let w = Tensor::randn([16, 8], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let x = Tensor::randn([4, 16], (Kind::Float, Device::Cpu));
        // Another shape — also one y would broadcast to — or another dtype: named, not summed
        // down or cast silently.
        for wrong in [
            Tensor::randn([5, 8], (Kind::Float, Device::Cpu)),
            Tensor::randn([2, 4, 8], (Kind::Float, Device::Cpu)),
            Tensor::randn([4, 8], (Kind::Float, Device::Cpu)).to_kind(Kind::BFloat16),
        ] {
            let e = backward_with_grad(&x.matmul(&w), &wrong).unwrap_err().to_string();
            assert!(e.contains("Mismatch in"), "{e}");
            assert!(grad(&x.matmul(&w), &wrong, &[w.shallow_clone()]).is_err());
        }
        assert!(!w.grad().defined(), "nothing accumulated");
    }
}
