// 64-byte aligned memory (a cache line, as at::empty's) for the CPU kernels' scratch: block_attention's per-thread
// workspace and row_linear's quantised x.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>

namespace sbd_cpu {

struct AlignedFree {
  void operator()(void* p) const { std::free(p); }
};
template <typename T>
using AlignedBuffer = std::unique_ptr<T[], AlignedFree>;

// n elements of T (at least one), rounded up to whole cache lines.
template <typename T>
AlignedBuffer<T> alloc_aligned(int64_t n) {
  const size_t bytes = (static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(T) + 63) / 64 * 64;
  void* ptr = std::aligned_alloc(64, bytes);
  if (ptr == nullptr) throw std::bad_alloc();
  return AlignedBuffer<T>(static_cast<T*>(ptr));
}

}  // namespace sbd_cpu
