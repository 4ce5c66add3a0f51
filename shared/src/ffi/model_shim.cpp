// CPU kernels of BasicNet where libtorch's are serial scalar loops (see src/model.rs; declared
// in src/ffi/model.rs): dropout's noise (1.), a 2×2 max-pool for NCHW and channels-last inputs
// (2., further down), and a channels-last clone. Each kernel splits its work over libtorch's
// intra-op threads with `at::parallel_for`, which takes effect only because build.rs compiles
// this file with OpenMP, as libtorch is built (without it the header runs the whole range on
// the calling thread).
//
// 1. Dropout's noise tensor on CPU in one parallel pass, instead of libtorch's CPU `bernoulli_`:
// that kernel draws one mt19937 number per element in a serial loop (perf: ~10% of a bf16
// BasicNet step, for the 9,216 × batch mask after the convolutions). See src/model.rs `dropout`.
//
// The random bits come from a counter-based generator: word i of a call is
// splitmix64(key + (i + 1) · 0x9E3779B97F4A7C15) — the i-th output of Steele, Lea & Flood's
// SplitMix64 stream started at `key` — and `key` is one `random64()` drawn from libtorch's
// default CPU generator. So the mask is a function of the generator's state alone (what
// `torch.manual_seed` sets), the same at any number of threads, and the generator advances by
// one draw per call, not one per element.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/custom_function.h>
#include <ATen/OpMathType.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>

#include "shim.h"
#include <limits>
#include <mutex>
#include <type_traits>
#include <vector>

namespace {

inline uint64_t splitmix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// Each kernel's loop over its share [begin, end) of the work is a function of its own
// (`*_range`, not inlined) that `at::parallel_for`'s lambda calls with plain arguments: inside
// OpenMP's outlined parallel region the compiler reaches a lambda's captures through a pointer
// and no longer vectorises the loops (the channels-last max-pool's forward ran 3.6× slower
// when this file was first compiled with -fopenmp).

// Word i of the stream keyed `key` (see 1. above).
inline uint64_t word(uint64_t key, int64_t i) { return splitmix64(key + static_cast<uint64_t>(i + 1) * 0x9E3779B97F4A7C15ULL); }

// Pairs [begin, end) of `fill` below (see the note on `*_range` functions above).
template <typename T>
[[gnu::noinline]] void fill_range(T *out, int64_t begin, int64_t end, uint64_t key, uint64_t threshold, T kept) {
  const T value[2] = {T(0), kept};
  for (int64_t i = begin; i < end; ++i) {
    const uint64_t w = word(key, i);
    out[2 * i] = value[(w & 0xFFFFFFFFULL) < threshold];
    out[2 * i + 1] = value[(w >> 32) < threshold];
  }
}

// Element 2i takes the low 32 bits of word i, element 2i+1 the high 32: it is kept (set to
// `kept`) when those bits, read as an integer u in [0, 2^32), are below `threshold`. The value
// is looked up in a two-entry table, not selected by a branch (which mispredicts).
template <typename T>
void fill(T *out, int64_t n, uint64_t key, uint64_t threshold, T kept) {
  const int64_t pairs = n / 2;
  at::parallel_for(0, pairs, 16384, [&](int64_t begin, int64_t end) { fill_range<T>(out, begin, end, key, threshold, kept); });
  if (n % 2 == 1) {
    const T value[2] = {T(0), kept};
    out[n - 1] = value[(word(key, pairs) & 0xFFFFFFFFULL) < threshold];
  }
}

// 2. Window (i, j) of each h × w plane: rows 2i, 2i+1 and columns 2j, 2j+1, scanned row by row.
// The first maximum wins and a NaN wins over any number (a later NaN over an earlier one),
// exactly as libtorch's `cpu_max_pool` compares (`val > maxval || isnan(val)` in opmath, from
// maxval = −∞: starting from the window's first element instead is the same).
//
// Per plane, the four elements of every window are first copied into four arrays (a: top-left,
// b: top-right, c: bottom-left, d: bottom-right), so that the selection is one loop without
// control flow that the compiler vectorises (compares and blends): on real data the
// comparisons are coin flips, and a branch on each mispredicts half the time. Writes each
// window's maximum to `out` and its position to `code` (0 = a, 1 = b, 2 = c, 3 = d).
// One window's selection, shared by both layouts' kernels: its maximum, written to `*o`, and
// its position (0 = a, 1 = b, 2 = c, 3 = d) to `*k`; without branches, so that the loops
// calling it vectorise.
template <typename T, typename opmath_t>
inline void select_window(opmath_t a, opmath_t b, opmath_t c, opmath_t d, T *o, uint8_t *k) {
  opmath_t m = a;
  uint8_t q = 0;
  const bool tb = (b > m) | (b != b);
  m = tb ? b : m;
  q = tb ? 1 : q;
  const bool tc = (c > m) | (c != c);
  m = tc ? c : m;
  q = tc ? 2 : q;
  const bool td = (d > m) | (d != d);
  m = td ? d : m;
  q = td ? 3 : q;
  *o = static_cast<T>(m);  // an element of x, converted there and back: exact (a bf16 or f16
                           // NaN comes back canonical, as from libtorch's kernel)
  *k = q;
}

template <typename T>
[[gnu::noinline]] void max_pool_2x2_forward_range(const T *x, T *out, uint8_t *code, int64_t begin, int64_t end, int64_t h, int64_t w) {
  using opmath_t = at::opmath_type<T>;
  const int64_t oh = h / 2, ow = w / 2, n = oh * ow;
  std::vector<opmath_t> buf(4 * n);
  opmath_t *a = buf.data(), *b = a + n, *c = b + n, *d = c + n;
  for (int64_t p = begin; p < end; ++p) {
    const T *in = x + p * h * w;
    for (int64_t i = 0; i < oh; ++i) {
      const T *r0 = in + 2 * i * w;
      const T *r1 = r0 + w;
      for (int64_t j = 0; j < ow; ++j) {
        a[i * ow + j] = static_cast<opmath_t>(r0[2 * j]);
        b[i * ow + j] = static_cast<opmath_t>(r0[2 * j + 1]);
        c[i * ow + j] = static_cast<opmath_t>(r1[2 * j]);
        d[i * ow + j] = static_cast<opmath_t>(r1[2 * j + 1]);
      }
    }
    T *o = out + p * n;
    uint8_t *k = code + p * n;
    for (int64_t e = 0; e < n; ++e) {
      select_window<T, opmath_t>(a[e], b[e], c[e], d[e], o + e, k + e);
    }
  }
}

template <typename T>
void max_pool_2x2_forward(const T *x, T *out, uint8_t *code, int64_t planes, int64_t h, int64_t w) {
  at::parallel_for(0, planes, 8, [&](int64_t begin, int64_t end) { max_pool_2x2_forward_range<T>(x, out, code, begin, end, h, w); });
}

// The bits of `v + 0` computed in opmath, as libtorch's max-pool backward stores a gradient (it
// adds it to a zero-filled tensor): −0 becomes +0, a bf16 or f16 NaN comes back canonical.
template <typename T, typename bits_t>
inline bits_t plus_zero_bits(T v) {
  using opmath_t = at::opmath_type<T>;
  bits_t vb;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    // The same without converting to f32 and back: −0 → +0, and a NaN becomes c10's
    // canonical bf16 NaN (0x7FC0), as the conversion from f32 makes it.
    std::memcpy(&vb, &v, sizeof vb);
    vb = static_cast<bits_t>(vb & static_cast<bits_t>(-static_cast<bits_t>((vb & 0x7FFF) != 0)));
    vb = (vb & 0x7FFF) > 0x7F80 ? bits_t(0x7FC0) : vb;
  } else {
    const T s = static_cast<T>(static_cast<opmath_t>(v) + opmath_t(0));
    std::memcpy(&vb, &s, sizeof vb);
  }
  return vb;
}

// The input gradient: each window's output gradient goes to the element its `code` names, the
// other three get +0 — what libtorch's max-pool backward computes (windows do not overlap, so
// an element receives at most one gradient; libtorch adds it to a zero-filled tensor, so −0
// arrives as +0, and so it does here: the `+ 0` in opmath). One pass, no zero-fill, no
// scatter; the selection is by bit masks, not branches (they would mispredict).
template <typename T>
[[gnu::noinline]] void max_pool_2x2_backward_range(const T *g, const uint8_t *code, T *gx, int64_t begin, int64_t end, int64_t h, int64_t w) {
  using bits_t = std::conditional_t<sizeof(T) == 2, uint16_t, std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>>;
  static_assert(sizeof(T) == sizeof(bits_t), "a 2-, 4- or 8-byte floating type");
  const int64_t oh = h / 2, ow = w / 2, n = oh * ow;
  for (int64_t p = begin; p < end; ++p) {
    const T *gp = g + p * n;
    const uint8_t *k = code + p * n;
    bits_t *out = reinterpret_cast<bits_t *>(gx + p * h * w);
    for (int64_t i = 0; i < oh; ++i) {
      bits_t *r0 = out + 2 * i * w;
      bits_t *r1 = r0 + w;
      for (int64_t j = 0; j < ow; ++j) {
        const bits_t vb = plus_zero_bits<T, bits_t>(gp[i * ow + j]);
        const uint8_t q = k[i * ow + j];
        r0[2 * j] = vb & static_cast<bits_t>(-static_cast<bits_t>(q == 0));
        r0[2 * j + 1] = vb & static_cast<bits_t>(-static_cast<bits_t>(q == 1));
        r1[2 * j] = vb & static_cast<bits_t>(-static_cast<bits_t>(q == 2));
        r1[2 * j + 1] = vb & static_cast<bits_t>(-static_cast<bits_t>(q == 3));
      }
    }
  }
}

template <typename T>
void max_pool_2x2_backward(const T *g, const uint8_t *code, T *gx, int64_t planes, int64_t h, int64_t w) {
  at::parallel_for(0, planes, 8, [&](int64_t begin, int64_t end) { max_pool_2x2_backward_range<T>(g, code, gx, begin, end, h, w); });
}

// The same two kernels for a channels-last input (memory order [b, h, w, c], what a
// channels-last convolution writes): each window's four rows of `c` channels are contiguous,
// so the selection runs along the channels, vectorised, with the same comparisons in the same
// order (a, b, c, d as above) as the NCHW kernel. The output and its code are first written
// image by image into a small window-major tile ([oh·ow, c]), then transposed into `out`'s
// NCHW order, so everything after the pool is as for an NCHW input. `code` stays window-major:
// [b, oh·ow, c], read by the backward below.
template <typename T>
[[gnu::noinline]] void max_pool_2x2_forward_nhwc_range(const T *x, T *out, uint8_t *code, int64_t begin, int64_t end, int64_t channels, int64_t h,
                                                       int64_t w) {
  using opmath_t = at::opmath_type<T>;
  const int64_t oh = h / 2, ow = w / 2, n = oh * ow, c = channels;
  std::vector<T> tile(n * c);
  for (int64_t img = begin; img < end; ++img) {
    const T *in = x + img * h * w * c;
    uint8_t *k = code + img * n * c;
    for (int64_t i = 0; i < oh; ++i) {
      for (int64_t j = 0; j < ow; ++j) {
        const T *pa = in + (2 * i * w + 2 * j) * c;
        const T *pb = pa + c;
        const T *pc = pa + w * c;
        const T *pd = pc + c;
        T *o = tile.data() + (i * ow + j) * c;
        uint8_t *q = k + (i * ow + j) * c;
        for (int64_t ch = 0; ch < c; ++ch) {
          select_window<T, opmath_t>(static_cast<opmath_t>(pa[ch]), static_cast<opmath_t>(pb[ch]), static_cast<opmath_t>(pc[ch]),
                                     static_cast<opmath_t>(pd[ch]), o + ch, q + ch);
        }
      }
    }
    T *dst = out + img * c * n;
    for (int64_t ch = 0; ch < c; ++ch)
      for (int64_t e = 0; e < n; ++e) dst[ch * n + e] = tile[e * c + ch];
  }
}

template <typename T>
void max_pool_2x2_forward_nhwc(const T *x, T *out, uint8_t *code, int64_t images, int64_t channels, int64_t h, int64_t w) {
  at::parallel_for(0, images, 1,
                   [&](int64_t begin, int64_t end) { max_pool_2x2_forward_nhwc_range<T>(x, out, code, begin, end, channels, h, w); });
}

// The input gradient of the channels-last forward above, written channels-last ([b, h, w, c]
// in memory): the output gradient `g` (NCHW) is first transposed, image by image, into a
// window-major tile, then each window's four rows are written along the channels, each
// element the gradient (+0 added, as above) or +0, by the same bit masks.
template <typename T>
[[gnu::noinline]] void max_pool_2x2_backward_nhwc_range(const T *g, const uint8_t *code, T *gx, int64_t begin, int64_t end, int64_t channels,
                                                        int64_t h, int64_t w) {
  using bits_t = std::conditional_t<sizeof(T) == 2, uint16_t, std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>>;
  static_assert(sizeof(T) == sizeof(bits_t), "a 2-, 4- or 8-byte floating type");
  const int64_t oh = h / 2, ow = w / 2, n = oh * ow, c = channels;
  std::vector<bits_t> tile(n * c);
  for (int64_t img = begin; img < end; ++img) {
    const T *gi = g + img * c * n;
    for (int64_t ch = 0; ch < c; ++ch)
      for (int64_t e = 0; e < n; ++e) tile[e * c + ch] = plus_zero_bits<T, bits_t>(gi[ch * n + e]);
    const uint8_t *k = code + img * n * c;
    bits_t *base = reinterpret_cast<bits_t *>(gx + img * h * w * c);
    for (int64_t i = 0; i < oh; ++i) {
      for (int64_t j = 0; j < ow; ++j) {
        bits_t *ra = base + (2 * i * w + 2 * j) * c;
        bits_t *rb = ra + c;
        bits_t *rc = ra + w * c;
        bits_t *rd = rc + c;
        const bits_t *v = tile.data() + (i * ow + j) * c;
        const uint8_t *q = k + (i * ow + j) * c;
        for (int64_t ch = 0; ch < c; ++ch) {
          ra[ch] = v[ch] & static_cast<bits_t>(-static_cast<bits_t>(q[ch] == 0));
          rb[ch] = v[ch] & static_cast<bits_t>(-static_cast<bits_t>(q[ch] == 1));
          rc[ch] = v[ch] & static_cast<bits_t>(-static_cast<bits_t>(q[ch] == 2));
          rd[ch] = v[ch] & static_cast<bits_t>(-static_cast<bits_t>(q[ch] == 3));
        }
      }
    }
  }
}

template <typename T>
void max_pool_2x2_backward_nhwc(const T *g, const uint8_t *code, T *gx, int64_t images, int64_t channels, int64_t h, int64_t w) {
  at::parallel_for(0, images, 1,
                   [&](int64_t begin, int64_t end) { max_pool_2x2_backward_nhwc_range<T>(g, code, gx, begin, end, channels, h, w); });
}

// max_pool2d(x, 2) as an autograd function: forward saves the uint8 window codes (1 byte per
// output element, where libtorch saves int64 indices), backward spreads the gradient by them.
// A channels-last input (BasicNet's conv2 output on CPU, src/model.rs) runs the channels-last
// kernels and gets its input gradient channels-last, as the convolution's backward wants it;
// any other layout is made contiguous NCHW. The output is contiguous NCHW either way.
struct MaxPool2x2 : public torch::autograd::Function<MaxPool2x2> {
  static at::Tensor forward(torch::autograd::AutogradContext *ctx, const at::Tensor &x) {
    const bool nhwc = x.suggest_memory_format() == at::MemoryFormat::ChannelsLast;
    const at::Tensor in = x.contiguous(nhwc ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous);
    const int64_t b = in.size(0), c = in.size(1), h = in.size(2), w = in.size(3);
    at::Tensor out = at::empty({b, c, h / 2, w / 2}, in.options());
    at::Tensor code = at::empty({b, c, h / 2, w / 2}, in.options().dtype(at::kByte));
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, in.scalar_type(), "ladder_max_pool_2x2", [&] {
      if (nhwc)
        max_pool_2x2_forward_nhwc<scalar_t>(in.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), code.data_ptr<uint8_t>(), b, c, h, w);
      else
        max_pool_2x2_forward<scalar_t>(in.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), code.data_ptr<uint8_t>(), b * c, h, w);
    });
    ctx->save_for_backward({code});
    ctx->saved_data["h"] = h;
    ctx->saved_data["w"] = w;
    ctx->saved_data["nhwc"] = nhwc;
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext *ctx, torch::autograd::variable_list grads) {
    TORCH_CHECK(!(at::GradMode::is_enabled() && grads[0].requires_grad()),
                "max_pool2d_2x2 has no double backward (create_graph=True): use max_pool2d");
    const at::Tensor code = ctx->get_saved_variables()[0];
    const at::Tensor g = grads[0].contiguous();
    const int64_t h = ctx->saved_data["h"].toInt(), w = ctx->saved_data["w"].toInt();
    const bool nhwc = ctx->saved_data["nhwc"].toBool();
    const int64_t b = g.size(0), c = g.size(1);
    at::Tensor gx = at::empty({b, c, h, w}, g.options().memory_format(nhwc ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous));
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, g.scalar_type(), "ladder_max_pool_2x2_backward", [&] {
      if (nhwc)
        max_pool_2x2_backward_nhwc<scalar_t>(g.data_ptr<scalar_t>(), code.data_ptr<uint8_t>(), gx.data_ptr<scalar_t>(), b, c, h, w);
      else
        max_pool_2x2_backward<scalar_t>(g.data_ptr<scalar_t>(), code.data_ptr<uint8_t>(), gx.data_ptr<scalar_t>(), b * c, h, w);
    });
    return {gx};
  }
};

}  // namespace

// `max_pool2d(x, 2)` of `x` (a CPU tensor `[b, c, h, w]` of a floating dtype, even h and w,
// NCHW or channels-last), differentiable: stores the result `[b, c, h/2, w/2]` into the tensor handle `out` (tch's
// `at::Tensor *`, replaced by assignment). Returns 0, or 1 with a message in `err`.
extern "C" int ladder_max_pool_2x2(const at::Tensor *x, at::Tensor *out, char *err, size_t errlen) {
  return ladder::guarded(err, errlen, [&] {
    const at::Tensor &in = *x;
    TORCH_CHECK(in.dim() == 4 && in.device().is_cpu(), "x must be a 4-d CPU tensor [b, c, h, w]");
    TORCH_CHECK(in.size(2) % 2 == 0 && in.size(3) % 2 == 0, "x's height and width must be even, got ", in.size(2), " × ",
                in.size(3));
    *out = MaxPool2x2::apply(in);
  });
}

// Fills `noise` (tch's tensor handle: a contiguous CPU tensor of a floating dtype) with
// dropout's noise for drop probability `p` in (0, 1): each element independently 1/(1 − p)
// (computed as libtorch's `noise.div_(1 - p)` does: in f64 for f64 tensors, f32 otherwise,
// then rounded to the dtype) with probability 1 − p, quantised to 2^-32 (exact for p = 0.25,
// 0.5), and 0 otherwise. Returns 0, or 1 with a message in `err`.
extern "C" int ladder_dropout_noise(at::Tensor *noise, double p, char *err, size_t errlen) {
  return ladder::guarded(err, errlen, [&] {
    const at::Tensor &t = *noise;
    TORCH_CHECK(p > 0.0 && p < 1.0, "dropout probability must be in (0, 1), got ", p);
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "the noise tensor must be a contiguous CPU tensor");
    uint64_t key;
    {
      auto *gen = at::get_generator_or_default<at::CPUGeneratorImpl>(std::nullopt, at::detail::getDefaultCPUGenerator());
      std::lock_guard<std::mutex> lock(gen->mutex_);
      key = gen->random64();
    }
    const double keep = 1.0 - p;
    const uint64_t threshold = static_cast<uint64_t>(keep * 4294967296.0 + 0.5);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, t.scalar_type(), "ladder_dropout_noise", [&] {
      using opmath_t = at::opmath_type<scalar_t>;
      const scalar_t kept = static_cast<scalar_t>(opmath_t(1) / static_cast<opmath_t>(keep));
      fill<scalar_t>(t.mutable_data_ptr<scalar_t>(), t.numel(), key, threshold, kept);
    });
  });
}

// The state of the default generator of a device (`device_type` 0: the CPU; 1: CUDA device
// `device_index`), as `torch.get_rng_state()` / `torch.cuda.get_rng_state(i)`: a uint8 CPU tensor
// stored into the tensor handle `out`. Activation checkpointing stashes it before a segment's
// forward so that the recompute draws the same dropout bits (torch.utils.checkpoint's
// `preserve_rng_state`). Returns 0, or 1 with a message in `err`.
extern "C" int ladder_rng_get_state(int device_type, int device_index, at::Tensor *out, char *err, size_t errlen) {
  return ladder::guarded(err, errlen, [&] {
    TORCH_CHECK(device_type == 0 || device_type == 1, "device type must be 0 (cpu) or 1 (cuda), got ", device_type);
    const at::Device device = device_type == 0 ? at::Device(at::kCPU) : at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device_index));
    at::Generator gen = at::globalContext().defaultGenerator(device);
    std::lock_guard<std::mutex> lock(gen.mutex());
    *out = gen.get_state();
  });
}

// Sets the default generator of a device (as `ladder_rng_get_state`) to `state`, a tensor that
// function returned (`torch.set_rng_state(state)`). Returns 0, or 1 with a message in `err`.
extern "C" int ladder_rng_set_state(int device_type, int device_index, const at::Tensor *state, char *err, size_t errlen) {
  return ladder::guarded(err, errlen, [&] {
    TORCH_CHECK(device_type == 0 || device_type == 1, "device type must be 0 (cpu) or 1 (cuda), got ", device_type);
    const at::Device device = device_type == 0 ? at::Device(at::kCPU) : at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device_index));
    at::Generator gen = at::globalContext().defaultGenerator(device);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(*state);
  });
}

// `x` (a CPU or CUDA tensor `[b, c, h, w]`) in channels-last memory order ([b, h, w, c]),
// differentiable, assigned to the tensor handle `out`: `x` itself when it already is (its
// suggested memory format), else `x.clone(memory_format=torch.channels_last)` — a clone, not
// `contiguous`, because a one-channel NCHW tensor already counts as channels-last contiguous
// and `contiguous` would return it unchanged, still suggesting NCHW to the convolution.
// Returns 0, or 1 with a message in `err`.
extern "C" int ladder_channels_last(const at::Tensor *x, at::Tensor *out, char *err, size_t errlen) {
  return ladder::guarded(err, errlen, [&] {
    const at::Tensor &in = *x;
    TORCH_CHECK(in.dim() == 4, "channels-last needs a 4-d tensor [b, c, h, w], got ", in.dim(), " dimensions");
    *out = in.suggest_memory_format() == at::MemoryFormat::ChannelsLast ? in : in.clone(at::MemoryFormat::ChannelsLast);
  });
}
