// The CPU ops' output tensors from a small cache of freed blocks (pooled_empty), instead of a fresh allocation each.
//
// Why: a compiled SmolLM2 decoding forward calls row_linear ~210 times and block_attention 30 times, each returning a
// new tensor. c10's CPU allocator takes each from posix_memalign, which glibc (2.36, Debian 12) serves without its
// per-thread cache: every output went down malloc's full path (its bins and their consolidation), over free lists
// that the forward's weight stream had just pushed out of every cache. On an AMD EPYC Zen 4 (1 thread) malloc's code
// was ~8 % of a w8a8 NTP forward's samples (docs/notes/benchmarks-log.md, 2026-12-06).
//
// How: blocks of a power-of-two size from 64 bytes to kMaxPooled, 64-byte aligned; a freed output's block goes back
// to its class's list (at most kPerClass per class and kKeepBytes in all kept; the rest, and anything larger, freed
// at once: a decoding forward's outputs are a few hundred KB at a time). The lists
// are shared by all threads under one mutex (a deleter runs on whichever thread drops the last reference). A tensor
// from here is an ordinary CPU tensor: its storage resizes (through this allocator), shares, and frees as any other.
#pragma once

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <array>
#include <cstdlib>
#include <mutex>
#include <vector>

#include "cpu/aligned_buffer.h"

namespace sbd_ext {

class OutputPool final : public c10::Allocator {
 public:
  static constexpr size_t kMinPooled = 64, kMaxPooled = size_t{1} << 20;  // bytes
  static constexpr size_t kPerClass = 64, kKeepBytes = size_t{32} << 20;
  static constexpr int kClasses = 15;  // 64 B .. 1 MB
  static_assert((kMinPooled << (kClasses - 1)) == kMaxPooled, "one class per power of two up to kMaxPooled");

  c10::DataPtr allocate(size_t n) override {
    const int c = size_class(n);
    if (c < 0) return c10::GetCPUAllocator()->allocate(n);
    char* base = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto& list = free_[c];
      if (!list.empty()) {
        base = list.back();
        list.pop_back();
        kept_ -= class_bytes(c);
      }
    }
    if (base == nullptr) {
      // a header cache line holds the class; the data starts after it (64-byte aligned, as at::empty's)
      base = sbd_cpu::alloc_aligned<char>(static_cast<int64_t>(kHeader + class_bytes(c))).release();
      *reinterpret_cast<int*>(base) = c;
    }
    return {base + kHeader, base, &release, c10::Device(c10::DeviceType::CPU)};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  static OutputPool& get() {
    static OutputPool* pool = new OutputPool();  // never destroyed: a tensor may outlive static destruction
    return *pool;
  }

 private:
  static constexpr size_t kHeader = 64;

  static size_t class_bytes(int c) { return kMinPooled << c; }
  static int size_class(size_t n) {
    if (n > kMaxPooled) return -1;
    int c = 0;
    while (class_bytes(c) < n) ++c;
    return c;
  }

  static void release(void* ctx) {
    char* base = static_cast<char*>(ctx);
    OutputPool& pool = get();
    {
      std::lock_guard<std::mutex> lock(pool.mu_);
      const int c = *reinterpret_cast<int*>(base);
      auto& list = pool.free_[c];
      if (list.size() < kPerClass && pool.kept_ + class_bytes(c) <= kKeepBytes) {
        list.push_back(base);
        pool.kept_ += class_bytes(c);
        return;
      }
    }
    std::free(base);
  }

  std::mutex mu_;
  std::array<std::vector<char*>, kClasses> free_;
  size_t kept_ = 0;  // bytes in the lists
};

// at::empty(sizes, options) for a CPU op's output (contiguous), its memory from OutputPool.
inline at::Tensor pooled_empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  return at::detail::empty_generic(sizes, &OutputPool::get(), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                   c10::typeMetaToScalarType(options.dtype()), c10::MemoryFormat::Contiguous);
}

}  // namespace sbd_ext
