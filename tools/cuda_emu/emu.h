// A CPU emulator of CUDA thread blocks, enough to run the sbd_ext kernels (csrc/cuda/kernels/*.cuh) on a machine
// without a GPU. It checks what a GPU-less CI cannot: index math, masks, work splits, merges, barriers and the
// register-fragment layouts of ldmatrix / mma.sync, by running the kernel sources themselves (textually adapted
// by tools/cuda_emu/transform.py: kernel launches, shared-memory declarations, runtime calls).
//
// Model: blocks run one after another; the threads of a block are fibers (ucontext) scheduled round-robin;
// __syncthreads and every warp-collective (shuffles, ldmatrix, mma) are barriers among the live threads of the
// block / warp; with a skew seed, the scheduler lets a random warp run ahead of the others for many collectives
// (up to the next __syncthreads), which opens the windows in which a missing barrier shows. ldmatrix and mma.sync follow the fragment layouts of the PTX ISA (m8n8.x4 b16; m16n8k16 with
// f32 accumulation). cp.async is either performed at issue ("early") or, in "late" mode, performed only when a
// cp.async.wait_group makes it complete, with its destination poisoned (NaN bytes) from issue until then: that
// exposes both reading a stage before its copy has landed and refilling a stage other warps still read.
// Out-of-bounds checks: every cp.async / ldmatrix / __ldg address is checked against the registered global
// buffers and the block's shared memory, and deadlocks (mismatched barriers) abort with a message.
//
// Not modelled: timing, memory-ordering between blocks (blocks are sequential), warp divergence inside a
// collective (collectives require all 32 lanes live, and abort otherwise), bank conflicts.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <functional>
#include <memory>
#include <vector>

#undef __global__
#define __global__
#undef __device__
#define __device__
#undef __host__
#define __host__
#undef __forceinline__
#define __forceinline__ inline
#undef __launch_bounds__
#define __launch_bounds__(...)

inline uint3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

namespace sbd_emu {

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "cuda_emu: %s (block %u,%u,%u thread %u)\n", what, blockIdx.x, blockIdx.y, blockIdx.z,
               threadIdx.x);
  std::fflush(stderr);
  std::abort();
}

struct PendingCopy {
  int group;
  void* dst;
  const void* src;
  bool valid;
};

struct Fiber {
  ucontext_t ctx;
  bool done = false;
  std::vector<PendingCopy> pending;
  int committed = 0;  // cp.async groups committed by this thread
};

struct Warp {
  int count = 0, gen = 0, alive = 0;
  uint64_t slots[32][12];
};

struct Range {
  const char* lo;
  size_t n;
};

struct State {
  std::vector<Fiber> fibers;
  std::vector<std::unique_ptr<char[]>> stacks;  // one per thread slot, reused by every block (not zeroed)
  ucontext_t sched;
  int cur = 0;
  int alive = 0;
  int bar_count = 0, bar_gen = 0, bar_acc = 0, bar_result = 0;
  std::vector<Warp> warps;
  uint64_t progress = 0;
  std::vector<unsigned char> smem;
  std::vector<Range> ranges;
  bool late_async = false;
  uint64_t skew_seed = 0;  // 0: warps advance in lockstep; else skewed scheduling from this seed
  uint64_t rng = 0;
  std::function<void()> body;
  int launches = 0;
};

inline State& st() {
  static State s;
  return s;
}

inline uint64_t next_random() {  // splitmix64
  uint64_t z = (st().rng += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// ---- memory checks -------------------------------------------------------------------------------------
inline void register_range(const void* p, size_t n) { st().ranges.push_back({static_cast<const char*>(p), n}); }
inline void clear_ranges() { st().ranges.clear(); }
inline bool in_smem(const void* p, size_t n) {
  auto& s = st();
  const auto* c = static_cast<const unsigned char*>(p);
  return !s.smem.empty() && c >= s.smem.data() && c + n <= s.smem.data() + s.smem.size();
}
inline void check_global(const void* p, size_t n, const char* what) {
  const char* c = static_cast<const char*>(p);
  for (const Range& r : st().ranges)
    if (c >= r.lo && c + n <= r.lo + r.n) return;
  std::fprintf(stderr, "cuda_emu: %s reads %zu bytes at %p outside every registered buffer\n", what, n, p);
  fail("out-of-bounds global read");
}
inline void check_smem(const void* p, size_t n, const char* what) {
  if (!in_smem(p, n)) {
    std::fprintf(stderr, "cuda_emu: %s: %zu bytes at %p outside the %zu bytes of dynamic shared memory\n", what, n,
                 p, st().smem.size());
    fail("out-of-bounds shared access");
  }
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0) fail("misaligned 16-byte shared access");
}

template <typename T>
T* dyn_smem() {
  return reinterpret_cast<T*>(st().smem.data());
}

// ---- scheduling and barriers ---------------------------------------------------------------------------
inline void yield() {
  auto& s = st();
  swapcontext(&s.fibers[s.cur].ctx, &s.sched);
}
inline int lane() { return static_cast<int>(threadIdx.x % 32); }
inline Warp& my_warp() { return st().warps[threadIdx.x / 32]; }

inline void release_block() {
  auto& s = st();
  s.bar_result = s.bar_acc;
  s.bar_acc = 0;
  s.bar_count = 0;
  ++s.bar_gen;
  ++s.progress;
}
inline int block_barrier(int pred) {
  auto& s = st();
  const int gen = s.bar_gen;
  s.bar_acc += pred != 0;
  ++s.bar_count;
  ++s.progress;
  if (s.bar_count == s.alive)
    release_block();
  else
    while (s.bar_gen == gen) yield();
  return s.bar_result;
}
inline void release_warp(Warp& w) {
  w.count = 0;
  ++w.gen;
  ++st().progress;
}
inline void warp_barrier() {
  Warp& w = my_warp();
  if (w.alive != 32) fail("warp collective with fewer than 32 live lanes");
  const int gen = w.gen;
  ++w.count;
  ++st().progress;
  if (w.count == w.alive)
    release_warp(w);
  else
    while (w.gen == gen) yield();
}

inline void fiber_entry() {
  auto& s = st();
  s.body();
  Fiber& f = s.fibers[s.cur];
  if (!f.pending.empty()) fail("thread exited with cp.async copies never waited for");
  f.done = true;
  --s.alive;
  Warp& w = s.warps[threadIdx.x / 32];
  --w.alive;
  ++s.progress;
  if (s.bar_count > 0 && s.bar_count == s.alive) release_block();
  if (w.count > 0 && w.count == w.alive) release_warp(w);
  // returning resumes uc_link (the scheduler)
}

inline int& last_error_slot() {
  static int e = 0;
  return e;
}
inline cudaError_t last_error() {
  const int e = last_error_slot();
  last_error_slot() = 0;
  return static_cast<cudaError_t>(e);
}
template <typename F>
cudaError_t func_set_attribute(F*, cudaFuncAttribute, int value) {
  // Both A100 (163 KiB) and H100 (227 KiB) allow opting in to this much; more would fail on the GPU too.
  return value <= 163 * 1024 ? cudaSuccess : cudaErrorInvalidValue;
}

// Runs kernel<<<grid, block, smem_bytes>>>(args...) to completion, block after block.
template <typename K, typename... Args>
void launch(K* kernel, dim3 grid, dim3 block, size_t smem_bytes, cudaStream_t, Args... args) {
  auto& s = st();
  ++s.launches;
  const int nthreads = static_cast<int>(block.x * block.y * block.z);
  if (block.y != 1 || block.z != 1) fail("the emulator supports 1-D thread blocks only");
  if (nthreads <= 0 || nthreads > 1024 || grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 ||
      grid.z > 65535 || smem_bytes > 227 * 1024) {
    last_error_slot() = cudaErrorInvalidConfiguration;
    return;
  }
  gridDim = grid;
  blockDim = block;
  s.body = [&]() { kernel(args...); };
  constexpr size_t kStack = 128 * 1024;
  while (s.stacks.size() < static_cast<size_t>(nthreads)) s.stacks.emplace_back(new char[kStack]);
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        blockIdx = make_uint3(bx, by, bz);
        s.smem.assign(smem_bytes, 0xFF);  // NaN bytes: reading shared memory never written shows up
        s.fibers.clear();
        s.fibers.resize(nthreads);
        s.warps.assign((nthreads + 31) / 32, Warp{});
        for (int t = 0; t < nthreads; ++t) s.warps[t / 32].alive++;
        s.alive = nthreads;
        s.bar_count = s.bar_acc = 0;
        for (int t = 0; t < nthreads; ++t) {
          Fiber& f = s.fibers[t];
          getcontext(&f.ctx);
          f.ctx.uc_stack.ss_sp = s.stacks[t].get();
          f.ctx.uc_stack.ss_size = kStack;
          f.ctx.uc_link = &s.sched;
          makecontext(&f.ctx, fiber_entry, 0);
        }
        const int nwarps = static_cast<int>(s.warps.size());
        std::vector<int> order(nwarps);
        for (int w = 0; w < nwarps; ++w) order[w] = w;
        while (s.alive > 0) {
          const uint64_t before = s.progress;
          if (s.skew_seed) {  // warps in random order, each running ahead for a random number of rounds
            for (int w = nwarps - 1; w > 0; --w) std::swap(order[w], order[next_random() % (w + 1)]);
          }
          for (int w : order) {
            for (int round = 0; round < 256; ++round) {
              const uint64_t p0 = s.progress;
              for (int t = 32 * w; t < std::min(32 * (w + 1), nthreads); ++t) {
                if (s.fibers[t].done) continue;
                s.cur = t;
                threadIdx = make_uint3(t, 0, 0);
                swapcontext(&s.sched, &s.fibers[t].ctx);
              }
              if (!s.skew_seed || s.progress == p0 || next_random() % 16 == 0) break;
            }
          }
          if (s.alive > 0 && s.progress == before) fail("deadlock: every live thread waits at a barrier");
        }
      }
  s.smem.clear();
  s.fibers.clear();
}

// ---- cp.async ------------------------------------------------------------------------------------------
inline void do_copy(const PendingCopy& c) {
  if (c.valid)
    std::memcpy(c.dst, c.src, 16);
  else
    std::memset(c.dst, 0, 16);
}
inline void cp_async(void* dst, const void* src, bool valid) {
  check_smem(dst, 16, "cp.async destination");
  if (valid) {
    check_global(src, 16, "cp.async source");
    if (reinterpret_cast<uintptr_t>(src) % 16 != 0) fail("misaligned cp.async source");
  }
  auto& s = st();
  Fiber& f = s.fibers[s.cur];
  const PendingCopy c{f.committed, dst, src, valid};
  if (!s.late_async) {
    do_copy(c);
    return;
  }
  std::memset(dst, 0xFF, 16);  // undefined until the copy is known complete
  f.pending.push_back(c);
}
inline void cp_async_commit() {
  auto& s = st();
  ++s.fibers[s.cur].committed;
}
inline void cp_async_wait(int n) {
  auto& s = st();
  Fiber& f = s.fibers[s.cur];
  // Complete every copy of the groups older than the n most recent committed ones (and uncommitted copies
  // count as the newest group, as on the GPU).
  std::vector<PendingCopy> keep;
  for (const PendingCopy& c : f.pending) {
    if (c.group < f.committed - n)
      do_copy(c);
    else
      keep.push_back(c);
  }
  f.pending.swap(keep);
}

// ---- warp collectives ----------------------------------------------------------------------------------
template <typename T>
T shfl_from(T v, int src) {
  static_assert(sizeof(T) <= 8, "shuffle of at most 8 bytes");
  Warp& w = my_warp();
  std::memcpy(&w.slots[lane()][0], &v, sizeof(T));
  warp_barrier();
  T r;
  std::memcpy(&r, &w.slots[src & 31][0], sizeof(T));
  warp_barrier();
  return r;
}

inline uint16_t ld16(const void* row, int col) {
  uint16_t v;
  std::memcpy(&v, static_cast<const char*>(row) + 2 * col, 2);
  return v;
}

// ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16: lanes 8i..8i+7 give the 16-byte row addresses of matrix i.
inline void ldmatrix(uint32_t (&r)[4], const void* addr, bool trans) {
  check_smem(addr, 16, "ldmatrix row");
  Warp& w = my_warp();
  const int l = lane();
  std::memcpy(&w.slots[l][0], &addr, sizeof(addr));
  warp_barrier();
  auto row_of = [&](int src_lane) {
    const void* p;
    std::memcpy(&p, &w.slots[src_lane][0], sizeof(p));
    return p;
  };
  for (int i = 0; i < 4; ++i) {
    uint16_t lo, hi;
    if (!trans) {  // (row l/4, cols 2(l%4), 2(l%4)+1)
      const void* row = row_of(8 * i + l / 4);
      lo = ld16(row, 2 * (l % 4));
      hi = ld16(row, 2 * (l % 4) + 1);
    } else {  // transposed: (rows 2(l%4), 2(l%4)+1; col l/4)
      lo = ld16(row_of(8 * i + 2 * (l % 4)), l / 4);
      hi = ld16(row_of(8 * i + 2 * (l % 4) + 1), l / 4);
    }
    r[i] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
  }
  warp_barrier();
}

template <typename T>
float b16_to_float(uint16_t bits) {
  T v;
  std::memcpy(&v, &bits, 2);
  if constexpr (std::is_same<T, __nv_bfloat16>::value)
    return __bfloat162float(v);
  else
    return __half2float(v);
}

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}: gathers the fragments of the warp, then each lane computes
// its four accumulators, summing k in order in fp32.
template <typename T>
void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  Warp& w = my_warp();
  const int l = lane();
  for (int i = 0; i < 4; ++i) w.slots[l][i] = a[i];
  w.slots[l][4] = b0;
  w.slots[l][5] = b1;
  warp_barrier();
  auto half_of = [](uint64_t reg, int k) { return static_cast<uint16_t>(reg >> (16 * (k & 1))); };
  auto A = [&](int row, int k) {
    const int owner = (row % 8) * 4 + (k % 8) / 2;
    const int reg = (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
    return b16_to_float<T>(half_of(w.slots[owner][reg], k));
  };
  auto B = [&](int k, int n) {
    const int owner = n * 4 + (k % 8) / 2;
    return b16_to_float<T>(half_of(w.slots[owner][k >= 8 ? 5 : 4], k));
  };
  const int g = l / 4, t = l % 4;
  const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
  float out[4];
  for (int e = 0; e < 4; ++e) {
    float acc = d[e];
    for (int k = 0; k < 16; ++k) acc += A(rows[e], k) * B(k, cols[e]);
    out[e] = acc;
  }
  warp_barrier();
  for (int e = 0; e < 4; ++e) d[e] = out[e];
}

}  // namespace sbd_emu

// ---- CUDA builtins used by the kernels -----------------------------------------------------------------
inline void __syncthreads() { sbd_emu::block_barrier(0); }
inline int __syncthreads_count(int pred) { return sbd_emu::block_barrier(pred); }
template <typename T>
T __shfl_xor_sync(unsigned, T v, int mask, int = 32) {
  return sbd_emu::shfl_from(v, sbd_emu::lane() ^ mask);
}
template <typename T>
T __shfl_sync(unsigned, T v, int src, int = 32) {
  return sbd_emu::shfl_from(v, src);
}
// Blocks run one at a time and the threads of a block are fibers switched only at collectives, so an atomic is a
// plain read-modify-write and a fence has nothing to order.
inline int atomicCAS(int* p, int compare, int val) {
  const int old = *p;
  if (old == compare) *p = val;
  return old;
}
inline int atomicExch(int* p, int val) {
  const int old = *p;
  *p = val;
  return old;
}
inline void __threadfence_system() {}
namespace sbd_emu {
template <typename V>
V ldg(const V* p) {  // a checked, aligned load of 8 or 16 bytes
  check_global(p, sizeof(V), "__ldg");
  if (reinterpret_cast<uintptr_t>(p) % sizeof(V) != 0) fail("misaligned vector load");
  return *p;
}
}  // namespace sbd_emu
inline uint4 __ldg(const uint4* p) { return sbd_emu::ldg(p); }
inline float4 __ldg(const float4* p) { return sbd_emu::ldg(p); }
inline float2 __ldg(const float2* p) { return sbd_emu::ldg(p); }
inline float __ldg(const float* p) { return sbd_emu::ldg(p); }
