// entropy_sample on CUDA: entropy, max probability and chosen token of each row of logits in ONE pass over the
// vocabulary.
//
// Each thread streams its share of a row with 16-byte loads (kUnroll = 4 loads in flight per thread) and keeps
// the shared online state of sbd/entropy_state.h (running max m, r = sum e^(x-m) but the max's 1, u = sum
// e^(x-m)(m-x)) and a running argmax of the score: the logit (temperature 0) or sbd::gumbel_score, logit / T +
// Gumbel noise from Philox (sbd/gumbel.h, sbd/philox.h: the counter layout and the exactly rounded score the CPU
// kernel uses, so a (seed, offset) gives the same token on every device and under every work split). Sampling
// takes the exact fast path of sbd/gumbel.h per element: no Philox for an entry whose logit / T plus the largest
// noise cannot reach the thread's best score so far, no logarithm for one whose per-draw noise bound cannot. The
// best is per thread (~30 entries each for 16 x 128256 on an H100), so Philox is skipped only after the thread has
// met a high entry, and the logarithms where the per-draw bound falls short. Sharing a block-wide best (seeded
// with the row max) would skip most of Philox on LLM-like logits, ~20 instructions per element that may outlast
// the row's DRAM time on an H100: to measure on a GPU first. Per-thread states are merged with EntropyState::merge /
// ArgmaxState::merge over warp shuffles, then across the warps of the block.
//
// Work split: a 16 x 128256 bf16 block of logits is 4.1 MB, 1.2 us of H100 DRAM time (3.35 TB/s), so the
// 10 us target is lost to latency, not bandwidth, unless every SM pulls its share at once: with few rows each
// row is cut into `splits` chunks so that N * splits >= 2 x SM count (16 rows on an H100: 17 chunks of 7552
// elements, 272 blocks, ~4 loads per thread). The chunk states go to a small workspace and a second kernel
// (one warp per row) merges them in split order; with N >= 2 x SMs each block owns whole rows and writes the
// result directly. Two launches rather than a last-block-done merge: that needs a zeroed counter array, i.e.
// another launch (memset) or a persistent buffer shared by streams, and the merge order would be fixed anyway.
// Merges are in a fixed order, so results are deterministic run to run.
//
// Element order: ArgmaxState::push keeps the first of equal scores, so each thread visits its indices in
// increasing order (head, then its vectors in order, then tail); across threads ArgmaxState::merge breaks ties
// by index. Ties therefore go to the lowest index, as torch.argmax does.
//
// Build: not with --use_fast_math. The Gumbel score is an IEEE division plus sbd::log_f32 (explicit fmas), the
// CPU kernel's exact operations; fast math would approximate the division and sampled tokens would differ from
// the CPU's (the softmax statistics use __expf either way: see sbd/entropy_state.h for its error).
//
// Included by exactly one translation unit, csrc/cuda/entropy_sample_launch.cu.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "cuda/kernels/common.cuh"
#include "cuda/kernels/entropy_sample.h"
#include "sbd/entropy_state.h"
#include "sbd/gumbel.h"
#include "sbd/philox.h"

namespace sbd_cuda {
namespace es {

constexpr int kThreads = 256;  // 8 warps: enough loads in flight per SM at 2+ blocks/SM, cheap block reduce
constexpr int kUnroll = 4;     // 16-byte loads issued back to back per thread before any is consumed
constexpr int64_t kMinChunk = 2048;  // >= one 16 B load per thread of a block, so a split is never mostly idle
constexpr int64_t kMaxSplits = 256;
constexpr int kMergeRowsPerBlock = 8;  // merge kernel: one warp per row

// Partial state of one (row, split), 32 bytes.
struct alignas(16) Partial {
  float m, r, u;
  int32_t invalid;
  float best;
  int32_t pad;
  int64_t index;
};

struct RowState {
  sbd::EntropyState e;
  sbd::ArgmaxState a;

  __device__ __forceinline__ static RowState empty() { return RowState{sbd::EntropyState::empty(), sbd::ArgmaxState::empty()}; }
  __device__ __forceinline__ void merge(const RowState& o) {
    e.merge(o.e);
    a.merge(o.a);
  }
};

__device__ __forceinline__ RowState shfl_xor(const RowState& x, int mask) {
  constexpr unsigned kAll = 0xffffffffu;
  RowState y;
  y.e.m = __shfl_xor_sync(kAll, x.e.m, mask);
  y.e.r = __shfl_xor_sync(kAll, x.e.r, mask);
  y.e.u = __shfl_xor_sync(kAll, x.e.u, mask);
  y.e.invalid = __shfl_xor_sync(kAll, static_cast<int>(x.e.invalid), mask) != 0;
  y.a.best = __shfl_xor_sync(kAll, x.a.best, mask);
  y.a.index = __shfl_xor_sync(kAll, static_cast<long long>(x.a.index), mask);
  return y;
}

// Butterfly over the warp; lane 0's result is the one used, and it is a fixed function of the lane states.
__device__ __forceinline__ RowState warp_reduce(RowState x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x.merge(shfl_xor(x, o));
  return x;
}

// Valid in thread 0 only. Every thread of the block must call it.
__device__ __forceinline__ RowState block_reduce(RowState x) {
  constexpr int kWarps = kThreads / 32;
  __shared__ RowState warp_states[kWarps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  x = warp_reduce(x);
  if (lane == 0) warp_states[warp] = x;
  __syncthreads();
  if (warp == 0) {
    x = lane < kWarps ? warp_states[lane] : RowState::empty();
    x = warp_reduce(x);
  }
  return x;
}

// Score of one vocab entry: the logit, or sbd::gumbel_score with the draw for (seed, offset, row, j), computed only
// where sbd::may_reach says it could beat the thread's best (the exact fast path of sbd/gumbel.h).
template <bool kSample>
struct Scorer {
  float temperature;
  float inv_temperature;  // for the bounds only: a multiply, not an IEEE division per element (the slack covers it)
  uint64_t seed, offset;
  uint32_t row;
  uint32_t quad = 0xffffffffu;  // the vocab quad whose Philox output `r` holds
  sbd::Philox4 r{};

  __device__ __forceinline__ void push(RowState& st, float x, int64_t j) {
    st.e.push(x);
    if constexpr (kSample) {
      const float xs = x * inv_temperature;
      if (!sbd::may_reach(xs, sbd::kGumbelNoiseMax, st.a.best)) return;
      const uint32_t q = static_cast<uint32_t>(j >> 2);
      if (q != quad) {  // one Philox call per 4 consecutive vocab entries
        quad = q;
        r = sbd::philox_for_vocab_quad(seed, offset, row, q);
      }
      const int k = static_cast<int>(j & 3);  // selects, not a dynamically indexed (local-memory) array
      const uint32_t w = k == 0 ? r.x[0] : k == 1 ? r.x[1] : k == 2 ? r.x[2] : r.x[3];
      if (!sbd::may_reach(xs, sbd::gumbel_noise_bound(w), st.a.best)) return;
      st.a.push(sbd::gumbel_score(x, temperature, w), j);
    } else {
      st.a.push(x, j);
    }
  }
};

// Folds elements [lo, hi) of row `x` into this thread's state: an unaligned head (one element per thread),
// 16-byte vectors, a tail shorter than a vector. Each thread's indices increase (see the file comment).
template <typename T, bool kSample>
__device__ __forceinline__ void scan_range(const T* __restrict__ x, int64_t lo, int64_t hi, RowState& st,
                                           Scorer<kSample>& sc) {
  constexpr int kVec = ElemTraits<T>::kVec;
  const int tid = threadIdx.x;
  // Rows need not start 16-byte aligned (odd V, sliced logits): elements up to the next 16-byte boundary.
  int64_t head = static_cast<int64_t>((16u - (reinterpret_cast<uintptr_t>(x + lo) & 15u)) & 15u) / sizeof(T);
  if (head > hi - lo) head = hi - lo;
  if (tid < head) sc.push(st, to_float(x[lo + tid]), lo + tid);
  const int64_t vlo = lo + head;
  const int64_t nvec = (hi - vlo) / kVec;
  const T* xv = x + vlo;  // 16-byte aligned
  for (int64_t v0 = tid; v0 < nvec; v0 += static_cast<int64_t>(kThreads) * kUnroll) {
    Vec16<T> buf[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t v = v0 + static_cast<int64_t>(u) * kThreads;
      if (v < nvec) buf[u] = load16(xv + v * kVec);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t v = v0 + static_cast<int64_t>(u) * kThreads;
      if (v < nvec) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) sc.push(st, to_float(buf[u].e[e]), vlo + v * kVec + e);
      }
    }
  }
  const int64_t t0 = vlo + nvec * kVec;
  if (tid < hi - t0) sc.push(st, to_float(x[t0 + tid]), t0 + tid);
}

__device__ __forceinline__ void write_row(const EntropySampleParams& p, int64_t row, const RowState& st) {
  const bool ok = st.e.ok();
  p.entropy[row] = st.e.entropy();
  p.max_prob[row] = st.e.max_prob();
  // A valid row whose scores are all -inf (sampling at a temperature so small that every x / T is -inf) has no
  // argmax by strict comparison; torch.argmax returns the first index then, and so does this.
  p.token[row] = !ok ? -1 : (st.a.index < 0 ? 0 : st.a.index);
}

// Grid: N * splits blocks; block (row, split) scans elements [split * chunk, (split + 1) * chunk) of its row.
// kFinal (splits == 1): write the outputs; else write the partial state to the workspace.
template <typename T, bool kSample, bool kFinal>
__global__ void __launch_bounds__(kThreads) entropy_sample_kernel(EntropySampleParams p) {
  const int64_t row = blockIdx.x / p.splits;
  const int64_t split = blockIdx.x % p.splits;
  const T* x = static_cast<const T*>(p.logits) + row * p.row_stride;
  const int64_t lo = split * p.chunk;
  const int64_t hi = lo + p.chunk < p.V ? lo + p.chunk : p.V;
  Scorer<kSample> sc{p.temperature, kSample ? 1.f / p.temperature : 0.f, p.seed, p.offset,
                     static_cast<uint32_t>(row)};
  RowState st = RowState::empty();
  if (lo < hi) scan_range<T, kSample>(x, lo, hi, st, sc);
  st = block_reduce(st);
  if (threadIdx.x != 0) return;
  if constexpr (kFinal) {
    write_row(p, row, st);
  } else {
    Partial out;
    out.m = st.e.m;
    out.r = st.e.r;
    out.u = st.e.u;
    out.invalid = st.e.invalid ? 1 : 0;
    out.best = st.a.best;
    out.pad = 0;
    out.index = st.a.index;
    static_cast<Partial*>(p.workspace)[row * p.splits + split] = out;
  }
}

// One warp per row: merges the row's `splits` partial states in split order (lane l folds l, l + 32, ...),
// then across lanes.
__global__ void __launch_bounds__(kMergeRowsPerBlock * 32) entropy_sample_merge_kernel(EntropySampleParams p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kMergeRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= p.N) return;  // whole warps leave together: the shuffles below see full warps
  const Partial* parts = static_cast<const Partial*>(p.workspace) + row * p.splits;
  RowState st = RowState::empty();
  for (int s = lane; s < p.splits; s += 32) {
    const Partial q = parts[s];
    RowState o;
    o.e = sbd::EntropyState{q.m, q.r, q.u, q.invalid != 0};
    o.a = sbd::ArgmaxState{q.best, q.index};
    st.merge(o);
  }
  st = warp_reduce(st);
  if (lane == 0) write_row(p, row, st);
}

}  // namespace es

void entropy_sample_plan(EntropySampleParams& p, int num_sms) {
  const int64_t target_blocks = 2 * static_cast<int64_t>(num_sms > 0 ? num_sms : 1);
  int64_t splits = p.N >= target_blocks ? 1 : ceil_div<int64_t>(target_blocks, p.N > 0 ? p.N : 1);
  const int64_t by_len = p.V / es::kMinChunk > 1 ? p.V / es::kMinChunk : 1;
  if (splits > by_len) splits = by_len;
  if (splits > es::kMaxSplits) splits = es::kMaxSplits;
  // Chunks of whole 64-element groups (128 B of bf16) so that most chunk starts stay 16-byte aligned.
  const int64_t chunk = ceil_div<int64_t>(ceil_div<int64_t>(p.V > 0 ? p.V : 1, splits), 64) * 64;
  splits = ceil_div<int64_t>(p.V, chunk);  // drop trailing empty chunks
  p.splits = static_cast<int>(splits > 0 ? splits : 1);
  p.chunk = chunk;
}

size_t entropy_sample_workspace_bytes(const EntropySampleParams& p) {
  return p.splits > 1 ? static_cast<size_t>(p.N) * static_cast<size_t>(p.splits) * sizeof(es::Partial) : 0;
}

template <typename T>
cudaError_t launch_entropy_sample(const EntropySampleParams& p, cudaStream_t stream) {
  if (p.N == 0) return cudaSuccess;
  if (p.N < 0 || p.V < 0 || p.splits < 1 || p.chunk < 1 || p.N * p.splits > INT_MAX) return cudaErrorInvalidValue;
  if (p.splits > 1 && p.workspace == nullptr) return cudaErrorInvalidValue;
  const unsigned blocks = static_cast<unsigned>(p.N * p.splits);
  const bool sample = p.temperature > 0.f;
  if (p.splits == 1) {
    if (sample)
      es::entropy_sample_kernel<T, true, true><<<blocks, es::kThreads, 0, stream>>>(p);
    else
      es::entropy_sample_kernel<T, false, true><<<blocks, es::kThreads, 0, stream>>>(p);
    return cudaGetLastError();
  }
  if (sample)
    es::entropy_sample_kernel<T, true, false><<<blocks, es::kThreads, 0, stream>>>(p);
  else
    es::entropy_sample_kernel<T, false, false><<<blocks, es::kThreads, 0, stream>>>(p);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const unsigned merge_blocks = static_cast<unsigned>(ceil_div<int64_t>(p.N, es::kMergeRowsPerBlock));
  es::entropy_sample_merge_kernel<<<merge_blocks, es::kMergeRowsPerBlock * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace sbd_cuda
