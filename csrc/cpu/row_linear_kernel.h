// CPU kernel of row_linear on raw pointers (no torch headers); see row_linear_kernel.cpp.
#pragma once

#include <cstdint>

#include "cpu/isa.h"

namespace sbd_cpu {

struct RowLinearParams {
  const float* x;  // [M, K], unit stride along K
  int64_t x_stride;
  const float* w;  // [N, K] fp32, unit stride along K (nullptr with an int8 weight)
  int64_t w_stride;
  const int8_t* wq;       // [N, K] int8, unit stride along K, or nullptr (fp32 weight)
  const float* w_scale;   // [N] fp32, unit stride: out[:, n] = (x @ wq[n]) * w_scale[n] (int8 weight only)
  float* out;  // [M, N], unit stride along N
  int64_t out_stride;
  int64_t M, N, K;
};

// Weight rows of one work item: 64 rows (at K = 576, 144 KB of fp32) keep the split independent of the thread
// count and give a 576-row projection 9 items.
constexpr int64_t kRowLinearChunk = 64;

// out[:, n0:n1] = x @ w[n0:n1]^T (int8: (x @ wq[n0:n1]^T) * w_scale[n0:n1]).
SBD_CPU_DECLARE_KERNEL(void, row_linear_range, const RowLinearParams& p, int64_t n0, int64_t n1)

}  // namespace sbd_cpu
