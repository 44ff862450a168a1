// sm_count() of csrc/cuda/kernels/device_info.h (no torch headers).
#include <cuda_runtime.h>

#include <atomic>

#include "cuda/kernels/device_info.h"

namespace sbd_cuda {

int sm_count() {
  // cudaDeviceGetAttribute costs ~1 us and the ops launch per layer per forward, so cache per device.
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices];  // zero-initialised (static storage)
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 1;
  if (dev >= 0 && dev < kMaxDevices) {
    const int c = cache[dev].load(std::memory_order_relaxed);
    if (c > 0) return c;
  }
  int n = 0;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0) n = 1;
  if (dev >= 0 && dev < kMaxDevices) cache[dev].store(n, std::memory_order_relaxed);
  return n;
}

}  // namespace sbd_cuda
