// entropy_sample on CUDA: the parameters, the work split, and the launcher, which is all the torch binding sees.
// Kernels: csrc/cuda/kernels/entropy_sample.cuh; compiled for fp32/bf16/fp16 in csrc/cuda/entropy_sample_launch.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace sbd_cuda {

struct EntropySampleParams {
  const void* logits;  // [N, V] of T, unit stride along V, row stride `row_stride` elements
  float* entropy;      // [N] contiguous
  float* max_prob;     // [N] contiguous
  int64_t* token;      // [N] contiguous
  int64_t N, V, row_stride;
  float temperature;  // 0: argmax; > 0: Gumbel-max sample
  uint64_t seed, offset;
  // Work split (entropy_sample_plan): each row is cut into `splits` chunks of `chunk` elements, one thread
  // block each; with splits > 1 the blocks write partial states to `workspace` and a second kernel merges them.
  int splits;
  int64_t chunk;
  void* workspace;  // entropy_sample_workspace_bytes(...) bytes, 16-byte aligned; unused when splits == 1
};

// Chooses splits / chunk for N rows of V on a GPU with `num_sms` SMs (fills p.splits and p.chunk).
void entropy_sample_plan(EntropySampleParams& p, int num_sms);
size_t entropy_sample_workspace_bytes(const EntropySampleParams& p);

// Launches on `stream` (N == 0 launches nothing). T = float, __nv_bfloat16 or __half.
template <typename T>
cudaError_t launch_entropy_sample(const EntropySampleParams& p, cudaStream_t stream);

}  // namespace sbd_cuda
