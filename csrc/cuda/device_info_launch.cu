// sm_count() of csrc/cuda/kernels/device_info.h (no torch headers).
#include <cuda_runtime.h>

#include <atomic>

#include "cuda/kernels/device_info.h"

namespace sbd_cuda {

namespace {
// cudaDeviceGetAttribute costs ~1 us and the ops launch per layer per forward, so cache per device.
constexpr int kMaxDevices = 64;

int cached_attribute(std::atomic<int> (&cache)[kMaxDevices], cudaDeviceAttr attr, int fallback) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return fallback;
  if (dev >= 0 && dev < kMaxDevices) {
    const int c = cache[dev].load(std::memory_order_relaxed);
    if (c > 0) return c;
  }
  int n = 0;
  if (cudaDeviceGetAttribute(&n, attr, dev) != cudaSuccess || n <= 0) return fallback;
  if (dev >= 0 && dev < kMaxDevices) cache[dev].store(n, std::memory_order_relaxed);
  return n;
}
}  // namespace

int sm_count() {
  static std::atomic<int> cache[kMaxDevices];  // zero-initialised (static storage)
  return cached_attribute(cache, cudaDevAttrMultiProcessorCount, 1);
}

int smem_per_sm() {
  static std::atomic<int> cache[kMaxDevices];
  return cached_attribute(cache, cudaDevAttrMaxSharedMemoryPerMultiprocessor, 0);
}

}  // namespace sbd_cuda
