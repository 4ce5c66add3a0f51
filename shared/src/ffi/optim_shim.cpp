// AdamW's step through libtorch's fused kernel, `at::_fused_adamw_` — what
// `torch.optim.AdamW(fused=True)` calls (CPU and CUDA): one pass over each parameter, its
// gradient and its two moments, instead of a dozen element-wise ops with their temporaries.
// tch has no binding for it (its generator skips in-place ops over tensor lists). See src/optim.rs (declared in
// src/ffi/optim.rs).
#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/_fused_adamw.h>

#include <cstring>
#include <exception>

#include "shim.h"
#include <vector>

// Each `*const at::Tensor` array has `n` entries (tch's tensor handles). `steps` are 0-d f32
// tensors holding each parameter's step count *after* this step (the kernel reads them; the
// caller increments them, as `torch.optim.AdamW` does before its `_fused_adamw_` call).
// Returns 0, or 1 with libtorch's message in `err`.
extern "C" int ladder_fused_adamw(const at::Tensor *const *params, const at::Tensor *const *grads,
                                  const at::Tensor *const *exp_avgs, const at::Tensor *const *exp_avg_sqs,
                                  const at::Tensor *const *steps, size_t n, double lr, double beta1, double beta2,
                                  double weight_decay, double eps, char *err, size_t errlen) {
  return ladder::guarded(err, errlen, [&] {
    // The optimizer runs under torch.no_grad(): the parameters are leaves that require grad.
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> p, g, m, v, s;
    p.reserve(n), g.reserve(n), m.reserve(n), v.reserve(n), s.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      p.push_back(*params[i]);
      g.push_back(*grads[i]);
      m.push_back(*exp_avgs[i]);
      v.push_back(*exp_avg_sqs[i]);
      s.push_back(*steps[i]);
    }
    at::_fused_adamw_(p, g, m, v, /*max_exp_avg_sqs=*/{}, s, lr, beta1, beta2, weight_decay, eps,
                      /*amsgrad=*/false, /*maximize=*/false);
  });
}
