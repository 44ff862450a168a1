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
  // fp32 weight packed in panels (sbd_ext.pack / ops.pack_row_linear_weight): w is [N / kRowLinearPanel, K,
  // kRowLinearPanel], contiguous: weight row n, column k at w[(n / 16) * K * 16 + k * 16 + n % 16]. N % 16 == 0.
  bool packed = false;
  const float* xt = nullptr;  // packed: x transposed, [K, M] contiguous (the binding makes it)
  // quantize_x (int8 weight only): x quantised by row_linear_quantize_x, or nullptr (fp32 x). Row m's block b (32
  // values along K; the last one may be shorter) is xq[m * xq_stride + 32 b ...] * xd[m * x_blocks + b].
  const int8_t* xq = nullptr;  // [M, xq_stride], xq_stride = 32 * x_blocks, zero past K
  const float* xd = nullptr;   // [M, x_blocks]
  int64_t xq_stride = 0, x_blocks = 0;
};

// Values of x per quantisation block (llama.cpp's Q8_0 block).
constexpr int64_t kRowLinearXBlock = 32;

// Weight rows per panel of a packed fp32 weight (one AVX-512 vector, two AVX2 vectors of outputs).
constexpr int64_t kRowLinearPanel = 16;

// x rows of one kernel pass (row_linear_cpu.cpp): more rows are a prefill (fp32: at::mm; int8: slices of this many).
// Python reads it as sbd_ext.linear.ROW_LIMIT (build_info()["cpu_row_linear_rows"]).
constexpr int64_t kRowLinearRows = 32;

// Weight rows of one work item: 64 rows (at K = 576, 144 KB of fp32) keep the split independent of the thread
// count and give a 576-row projection 9 items.
constexpr int64_t kRowLinearChunk = 64;

// out[:, n0:n1] = x @ w[n0:n1]^T (int8: (x @ wq[n0:n1]^T) * w_scale[n0:n1]).
SBD_CPU_DECLARE_KERNEL(void, row_linear_range, const RowLinearParams& p, int64_t n0, int64_t n1)

// x rows [m0, m1) quantised into p.xq / p.xd (which it writes; p's pointers are const for the ranges that read
// them): per block of kRowLinearXBlock values, d = max|x| / 127, q = round-half-even(x * (127 / max|x|)), |q| <= 127;
// an all-zero block has d = 0 and q = 0; a block with a NaN or infinite value gets d = NaN (and q = 0), so the
// rows it reaches are NaN, as in the fp32 product.
SBD_CPU_DECLARE_KERNEL(void, row_linear_quantize_x, const RowLinearParams& p, int8_t* xq, float* xd, int64_t m0,
                       int64_t m1)

}  // namespace sbd_cpu
