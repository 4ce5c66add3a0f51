// Backward from a tensor with a given gradient — `torch.autograd.backward([y], [g])` and
// `torch.autograd.grad([y], inputs, [g])` — which tch cannot express: its `run_backward` takes
// no grad_outputs, so a segment's backward had to start from the root `(y * g).sum()`, two extra
// passes over the segment's output forward and two more backward. And `t.grad = g`, which tch
// cannot express either (ZeRO-1's gradients as views of one flat buffer). See src/autograd.rs
// (declared in src/ffi/autograd.rs).
#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>

#include <cstring>
#include <exception>

#include "shim.h"
#include <vector>

namespace {
// As Python's autograd: the gradient must have the output's shape and dtype (the C++ engine
// would broadcast-sum a smaller output's gradient or cast a dtype silently).
void check_grad(const at::Tensor &y, const at::Tensor &g) {
  TORCH_CHECK(g.sizes() == y.sizes(), "Mismatch in shape: grad_output has a shape of ", g.sizes(),
              " and output has a shape of ", y.sizes());
  TORCH_CHECK(g.scalar_type() == y.scalar_type(), "Mismatch in dtype: grad_output is ", g.scalar_type(),
              " and output is ", y.scalar_type());
}
}  // namespace

// `torch.autograd.backward([*y], [*g])`: accumulates into the `.grad` of the leaves `y` depends
// on, then frees the graph (retain_graph=False). Returns 0, or 1 with libtorch's message.
extern "C" int ladder_backward_with_grad(const at::Tensor *y, const at::Tensor *g, char *err, size_t errlen) {
  return ladder::guarded(err, errlen, [&] {
    at::AutoGradMode enable(true);
    check_grad(*y, *g);
    torch::autograd::backward({*y}, {*g}, /*retain_graph=*/false, /*create_graph=*/false);
  });
}

// `torch.autograd.grad([*y], inputs, [*g], retain_graph=False, create_graph=False,
// allow_unused=True)`: nothing accumulates in `.grad`. The gradient of `inputs[i]` is assigned
// to the tensor handle `results[i]` (undefined where `y` does not depend on it). Returns 0, or 1
// with libtorch's message.
extern "C" int ladder_autograd_grad(const at::Tensor *y, const at::Tensor *g, const at::Tensor *const *inputs,
                                    size_t n, at::Tensor *const *results, char *err, size_t errlen) {
  return ladder::guarded(err, errlen, [&] {
    at::AutoGradMode enable(true);
    check_grad(*y, *g);
    std::vector<at::Tensor> in;
    in.reserve(n);
    for (size_t i = 0; i < n; ++i) in.push_back(*inputs[i]);
    auto grads = torch::autograd::grad({*y}, in, {*g}, /*retain_graph=*/false, /*create_graph=*/false,
                                       /*allow_unused=*/true);
    for (size_t i = 0; i < n; ++i) *results[i] = grads[i];
  });
}

// `t.grad = g` (Python's setter): makes `g` the `.grad` of `t` itself, not a copy — so that a
// gradient can be a view of a larger buffer (ZeRO-1's flat gradient); later backwards
// accumulate into it in place. Checked as Python's setter checks it: the same shape, dtype and
// device as `t`. Returns 0, or 1 with the message.
extern "C" int ladder_set_grad(const at::Tensor *t, const at::Tensor *g, char *err, size_t errlen) {
  return ladder::guarded(err, errlen, [&] {
    TORCH_CHECK(g->sizes() == t->sizes(), "assigned grad has data of a different size: ", g->sizes(), " for a tensor of size ",
                t->sizes());
    TORCH_CHECK(g->scalar_type() == t->scalar_type(), "assigned grad has data of a different type: ", g->scalar_type(),
                " for a tensor of type ", t->scalar_type());
    TORCH_CHECK(g->device() == t->device(), "assigned grad has data located on a different device: ", g->device(),
                " for a tensor on ", t->device());
    // `mutable_grad` is the grad slot of `t`'s TensorImpl, shared by every handle of it.
    t->mutable_grad() = *g;
  });
}
