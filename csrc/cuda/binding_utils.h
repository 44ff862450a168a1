// Helpers of the torch-facing CUDA bindings (csrc/cuda/*_cuda.cpp): dtype dispatch to the kernels' element types
// and the 16-byte alignment test of the vectorised kernels.
//
// Torch headers used by the bindings are the light c10/cuda ones (CUDAGuard.h, CUDAStream.h, CUDAException.h):
// c10::cuda::getCurrentCUDAStream is the function at::cuda::getCurrentCUDAStream forwards to, and avoiding
// ATen/cuda/CUDAContext.h keeps cuBLAS / cuSPARSE headers out of these files.
#pragma once

#include <ATen/ATen.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstdlib>

namespace sbd_ext {

// Calls f(T{}) with T the CUDA element type of `t` (float, __nv_bfloat16, __half), which have the layouts of
// at::kFloat, at::kBFloat16 and at::kHalf.
template <typename F>
void dispatch_float_types(const char* op, at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat:
      f(float{});
      return;
    case at::kBFloat16:
      f(__nv_bfloat16{});
      return;
    case at::kHalf:
      f(__half{});
      return;
    default:
      TORCH_CHECK_TYPE(false, op, ": unsupported dtype ", t, " (expected float32, bfloat16 or float16)");
  }
}

// The data pointer and every stride but the last (over dimensions of size > 1) are multiples of 16 bytes, so
// each row can be read with 16-byte vector loads.
inline bool rows_aligned16(const at::Tensor& t) {
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return false;
  const int64_t es = t.element_size();
  for (int64_t d = 0; d + 1 < t.dim(); ++d)
    if (t.size(d) > 1 && (t.stride(d) * es) % 16 != 0) return false;
  return t.dim() == 0 || t.size(-1) <= 1 || t.stride(-1) == 1;
}

inline bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] == '1';
}

}  // namespace sbd_ext
