// row_linear, CUDA binding: the CPU binding's checks, then cuBLAS through at::mm. On a GPU a few-row product is
// bandwidth-bound and cuBLAS's GEMV/GEMM kernels read the weight at the memory's rate; the op exists for the CPU
// (row_linear_kernel.cpp), and on CUDA it keeps one op and one contract on every device.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "row_linear_checks.h"

namespace sbd_ext {

at::Tensor row_linear_cuda(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& scale) {
  check_row_linear(x, weight, scale);
  TORCH_CHECK(x.is_cuda(), "row_linear: x must be a CUDA tensor here, got device ", x.device());
  const c10::cuda::CUDAGuard device_guard(x.device());
  if (weight.scalar_type() == at::kChar) {
    // int8 weight: (x @ wq^T) * scale. The weight is widened to fp32 for cuBLAS (a correct path, not a fast one:
    // weight-only int8 exists for the CPU's bandwidth-bound rows; a GPU int8 GEMV is not written).
    return at::mm(x, weight.to(at::kFloat).t()).mul_(*scale);
  }
  return at::mm(x, weight.t());
}

TORCH_LIBRARY_IMPL(sbd_ext, CUDA, m) { m.impl("row_linear", &row_linear_cuda); }

}  // namespace sbd_ext
