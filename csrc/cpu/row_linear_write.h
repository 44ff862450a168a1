// row_linear's CPU kernel over a caller's output buffer (row_linear_cpu.cpp), for the CPU ops built on it.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace sbd_ext {

// row_linear of fp32 rows x [M, K] (M, N >= 1; checked by the caller) into out (row stride ld, N outputs per row), for
// every weight layout but a plain fp32 one over more than kRowLinearRows rows (at::mm_out's, in row_linear_cpu). Each
// output's sum runs over its weight row alone, in one order: it does not depend on the rows, the other weight rows
// or the thread count.
void row_linear_write(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& scale,
                      bool quantize_x, float* out, int64_t N, int64_t ld);

}  // namespace sbd_ext
