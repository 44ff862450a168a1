// mask_replace on CUDA: the parameters and the launcher, which is all the torch binding sees.
// Kernel: csrc/cuda/kernels/mask_replace.cuh; compiled in csrc/cuda/mask_replace_launch.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "sbd/common.h"

namespace sbd_cuda {

struct MaskReplaceParams {
  int64_t* tokens;           // [B, K], element strides tok_sb, tok_sk (mutated)
  const int64_t* proposals;  // [B, K]
  const float* entropy;      // [B, K]
  const float* confidence;   // [B, K] (max_prob)
  int64_t* n_revealed;       // [B], contiguous
  int64_t* n_remaining;      // [B], contiguous
  int64_t tok_sb, tok_sk, prop_sb, prop_sk, ent_sb, ent_sk, conf_sb, conf_sk;
  int64_t B, K;
  int64_t mask_id;
  sbd::AcceptRule rule;
  double threshold;
};

// One thread per block position: K is at most one thread block.
constexpr int64_t kMaskReplaceMaxK = 1024;

// Launches on `stream`; B == 0 launches nothing. Returns cudaErrorInvalidValue for K outside [0, 1024] or
// B >= 2^31 (the binding checks both first), else the launch status.
cudaError_t launch_mask_replace(const MaskReplaceParams& p, cudaStream_t stream);

}  // namespace sbd_cuda
