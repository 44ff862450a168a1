// Shared definitions for code that runs on both the CPU and the GPU.
//
// Everything under csrc/include/sbd/ is header-only, free of torch headers and usable from host C++ and
// from CUDA device code, so that the CPU kernels (which the CI machine runs) exercise exactly the math the
// CUDA kernels run.
#pragma once

#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define SBD_HD __host__ __device__ __forceinline__
#else
#define SBD_HD inline
#endif

namespace sbd {

// Acceptance rules of the in-place mask replacement (the paper's samplers; sbd_ext/reference.py mask_replace).
enum class AcceptRule : int32_t {
  kEntropyBound = 0,         // EB sampler, paper Eq. 8: largest entropy-sorted prefix with sum_{j<s} H_(j) <= gamma
  kEntropyThreshold = 1,     // reveal every H_i < gamma; at least the lowest-entropy position
  kConfidenceThreshold = 2,  // reveal every p_max,i > tau; at least the most confident position
};

}  // namespace sbd
