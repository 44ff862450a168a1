// row_linear, CUDA binding: the CPU binding's checks, then cuBLAS through at::mm. On a GPU a few-row product is
// bandwidth-bound and cuBLAS's GEMV/GEMM kernels read the weight at the memory's rate; the op exists for the CPU
// (row_linear_kernel.cpp), and on CUDA it keeps one op and one contract on every device.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <limits>

#include "row_linear_checks.h"
#include "screened_head_checks.h"

namespace sbd_ext {

namespace {

// x as the CPU kernel quantises it (row_linear_kernel.h, row_linear_quantize_x), dequantised: per block of 32
// values d = max|x| / 127, q = round-half-even(x * (127 / max|x|)); a block with a NaN or infinite value is NaN.
at::Tensor quantized_x(const at::Tensor& x) {
  constexpr int64_t kB = 32;
  const int64_t M = x.size(0), K = x.size(1), nb = (K + kB - 1) / kB;
  const at::Tensor xp = at::constant_pad_nd(x, {0, nb * kB - K}).view({M, nb, kB});
  const at::Tensor amax = xp.abs().amax(-1, /*keepdim=*/true);
  const at::Tensor finite = at::isfinite(xp).all(-1, /*keepdim=*/true);
  const at::Tensor id = at::where(amax > 0, at::div(at::full_like(amax, 127.0), amax), at::zeros_like(amax));
  const at::Tensor q = at::where(finite, at::round(xp * id), at::zeros_like(xp));
  const at::Tensor d = at::where(finite, amax / 127.0, at::full_like(amax, std::numeric_limits<float>::quiet_NaN()));
  return (q * d).view({M, nb * kB}).narrow(1, 0, K);
}

}  // namespace

at::Tensor row_linear_cuda(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& scale,
                           bool quantize_x) {
  check_row_linear(x, weight, scale, quantize_x);
  TORCH_CHECK(x.is_cuda(), "row_linear: x must be a CUDA tensor here, got device ", x.device());
  const c10::cuda::CUDAGuard device_guard(x.device());
  if (row_linear_is_q8_packed(weight)) {  // uint8 q + 128 in [N / 16, K / 4, 16, 4]: back to int8 [N, K]
    const at::Tensor q = (weight.transpose(1, 2).reshape({row_linear_out_features(weight), -1}).to(at::kShort) - 128)
                             .narrow(1, 0, x.size(1))
                             .to(at::kChar);
    return at::mm(quantized_x(x), q.to(at::kFloat).t()).mul_(*scale);
  }
  if (weight.scalar_type() == at::kChar) {
    // int8 weight: (x @ wq^T) * scale. The weight is widened to fp32 for cuBLAS (a correct path, not a fast one:
    // int8 weights exist for the CPU's bandwidth-bound rows; a GPU int8 GEMV is not written). quantize_x: the
    // CPU kernel's int8 x, dequantised, so every device returns the same numbers to fp32 rounding.
    return at::mm(quantize_x ? quantized_x(x) : x, weight.to(at::kFloat).t()).mul_(*scale);
  }
  if (row_linear_is_bf16_tiles(weight)) {  // bf16 [N / 16, K / 32, 16, 32]: x rounded to bf16 as on the CPU
    const at::Tensor w =
        weight.permute({0, 2, 1, 3}).reshape({row_linear_out_features(weight), -1}).narrow(1, 0, x.size(1));
    return at::mm(x.to(at::kBFloat16).to(at::kFloat), w.to(at::kFloat).t()).to(x.scalar_type());
  }
  // packed in panels of 16 rows [N / 16, K, 16] (fp32 or bf16): back to [N, K] for cuBLAS (a correct path: the panel
  // layout is the CPU kernel's; on a GPU keep the weight unpacked)
  const at::Tensor w = row_linear_is_packed(weight)
                           ? weight.transpose(1, 2).reshape({row_linear_out_features(weight), x.size(1)})
                           : weight;
  if (w.scalar_type() == at::kBFloat16)  // exact products, fp32 sums; bf16 x: the result rounded to bf16 once
    return at::mm(x.to(at::kFloat), w.to(at::kFloat).t()).to(x.scalar_type());
  return at::mm(x, w.t());
}

// screened_head, CUDA binding: the CPU binding's checks, then the fp32 head whole (its values are the op's contract's
// exact ones; the screen exists for the CPU's bandwidth-bound one-row forward).
at::Tensor screened_head_cuda(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& screen,
                              const at::Tensor& screen_norm, int64_t exclude) {
  check_screened_head(x, weight, screen, screen_norm, exclude);
  return row_linear_cuda(x, weight, std::nullopt, false);
}

TORCH_LIBRARY_IMPL(sbd_ext, CUDA, m) {
  m.impl("row_linear", &row_linear_cuda);
  m.impl("screened_head", &screened_head_cuda);
}

}  // namespace sbd_ext
