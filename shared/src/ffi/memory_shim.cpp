// The CUDA caching allocator's statistics (torch.cuda.max_memory_allocated and
// torch.cuda.reset_peak_memory_stats), through c10's device-generic allocator interface
// (c10::getDeviceAllocator, as torch.accelerator.memory_stats): no CUDA header is needed, and a
// process that never loaded libtorch_cuda gets an error, not a crash.
#include <c10/core/CachingDeviceAllocator.h>

#include <cstdint>

#include "shim.h"

namespace {
c10::DeviceAllocator *cuda_allocator() { return c10::getDeviceAllocator(c10::DeviceType::CUDA); }
}  // namespace

extern "C" {

// Writes the aggregate pool's allocated bytes (current, peak) and reserved bytes (current, peak)
// of CUDA device `device` into out[0..4].
int ladder_cuda_memory_stats(int device, int64_t *out, char *err, size_t errlen) {
  return ladder::guarded(err, errlen, [&] {
    auto stats = cuda_allocator()->getDeviceStats(static_cast<c10::DeviceIndex>(device));
    constexpr auto all = static_cast<size_t>(c10::CachingDeviceAllocator::StatType::AGGREGATE);
    out[0] = stats.allocated_bytes[all].current;
    out[1] = stats.allocated_bytes[all].peak;
    out[2] = stats.reserved_bytes[all].current;
    out[3] = stats.reserved_bytes[all].peak;
  });
}

// Resets the peaks of CUDA device `device` to the current values.
int ladder_cuda_reset_peak_memory_stats(int device, char *err, size_t errlen) {
  return ladder::guarded(err, errlen, [&] { cuda_allocator()->resetPeakStats(static_cast<c10::DeviceIndex>(device)); });
}

}  // extern "C"
