// mask_replace on CUDA: one thread block per sequence, one thread per block position.
//
// Each thread evaluates the shared acceptance predicate sbd::accept_reveal (sbd/accept.h, the code the CPU
// kernel runs) for its position over a copy of the sequence's row in shared memory, and only then writes its
// token, so the O(K^2) predicate never sees a token this launch has already replaced. The counts come from
// __syncthreads_count, and nothing is read back to the host.
//
// Cost: a block is K <= 1024 positions (16 at inference), so a launch is B blocks of <= 1024 threads doing
// K steps each over shared memory: launch-latency bound (~2-3 us on an H100), under the 5 us target.
//
// Included by exactly one translation unit, csrc/cuda/mask_replace_launch.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/kernels/common.cuh"
#include "cuda/kernels/mask_replace.h"
#include "sbd/accept.h"

namespace sbd_cuda {

// Shared memory per block: K x (token, proposal, entropy, confidence) = 24 B per position (24 KiB at K = 1024,
// under the 48 KiB that needs no opt-in).
inline size_t mask_replace_smem_bytes(int64_t K) {
  return static_cast<size_t>(K) * (2 * sizeof(int64_t) + 2 * sizeof(float));
}

__global__ void mask_replace_kernel(MaskReplaceParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int64_t K = p.K;
  int64_t* s_tok = reinterpret_cast<int64_t*>(smem_raw);
  int64_t* s_prop = s_tok + K;
  float* s_ent = reinterpret_cast<float*>(s_prop + K);
  float* s_conf = s_ent + K;

  const int64_t b = blockIdx.x;
  const int i = threadIdx.x;
  int64_t* tok_row = p.tokens + b * p.tok_sb;
  const bool active = i < K;
  if (active) {
    s_tok[i] = tok_row[i * p.tok_sk];
    s_prop[i] = p.proposals[b * p.prop_sb + i * p.prop_sk];
    s_ent[i] = p.entropy[b * p.ent_sb + i * p.ent_sk];
    s_conf[i] = p.confidence[b * p.conf_sb + i * p.conf_sk];
  }
  __syncthreads();  // the whole row is in shared memory before any thread ranks against it

  const sbd::AcceptView view{s_tok, s_prop, s_ent, s_conf, 1, 1, 1, 1, K, p.mask_id};
  const bool masked = active && s_tok[i] == p.mask_id;
  const bool reveal = active && sbd::accept_reveal(view, p.rule, p.threshold, i);
  // After the copy above only this thread touches global position i, and the predicate reads the shared copy,
  // so the write needs no barrier of its own.
  if (reveal) tok_row[i * p.tok_sk] = s_prop[i];
  const int n_masked = __syncthreads_count(masked);
  const int n_rev = __syncthreads_count(reveal);
  if (i == 0) {
    p.n_revealed[b] = n_rev;
    p.n_remaining[b] = n_masked - n_rev;
  }
}

cudaError_t launch_mask_replace(const MaskReplaceParams& p, cudaStream_t stream) {
  if (p.K < 0 || p.K > kMaskReplaceMaxK || p.B < 0 || p.B > 0x7fffffff) return cudaErrorInvalidValue;
  if (p.B == 0) return cudaSuccess;
  // Whole warps, at least one, so that an empty block (K == 0) still gets its counts (0, 0) written.
  const int threads = static_cast<int>(ceil_div<int64_t>(p.K > 0 ? p.K : 1, 32) * 32);
  mask_replace_kernel<<<static_cast<unsigned>(p.B), threads, mask_replace_smem_bytes(p.K), stream>>>(p);
  return cudaGetLastError();
}

}  // namespace sbd_cuda
