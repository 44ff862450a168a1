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
  // fp32 weight packed in panels (sbd_ext.packing.pack_row_linear_weight): w is [N / kRowLinearPanel, K,
  // kRowLinearPanel], contiguous: weight row n, column k at w[(n / 16) * K * 16 + k * 16 + n % 16]. N % 16 == 0.
  bool packed = false;
  const float* xt = nullptr;  // packed: x transposed, [K, M] contiguous (the binding makes it)
  // quantize_x (int8 weight only): x quantised by row_linear_quantize_x, or nullptr (fp32 x). Row m's block b (32
  // values along K; the last one may be shorter) is xq[m * xq_stride + 32 b ...] * xd[m * x_blocks + b].
  const int8_t* xq = nullptr;  // [M, xq_stride], xq_stride = 32 * x_blocks, zero past K
  const float* xd = nullptr;   // [M, x_blocks]
  int64_t xq_stride = 0, x_blocks = 0;
  // int8 weight packed in panels for int8 x (sbd_ext.packing.pack_row_linear_int8, quantize_x only): wq_packed is uint8
  // [N / 16, x_blocks * 8, 16, 4], contiguous: weight row n's values k..k+3 (k = 4 j) at [n / 16, j, n % 16, 0..3],
  // each stored as q + 128 (zero past K: 128). x then comes as row_linear_quantize_x_packed writes it (transposed, so
  // a tile reads its rows from one pointer): xq4[j * M + m] = x row m's quantised values 4j..4j+3 (4 bytes),
  // xdt[b * M + m] = block b's scale, xct[b * M + m] = 128 * (sum of its quantised values).
  const uint8_t* wq_packed = nullptr;
  const int32_t* xq4 = nullptr;
  const float* xdt = nullptr;
  const int32_t* xct = nullptr;
  // bf16 weight [N, K] (its bits; w_stride its row stride) instead of w / wq, or nullptr: widened to fp32 in registers,
  // the fp32 path's sums. With `packed`, bf16 panels [N / kRowLinearPanel, K, kRowLinearPanel] laid out as w's (the
  // fp32 panel path's tiles and sums over the widened values).
  const uint16_t* wb = nullptr;
  // bf16 weight in tiles (sbd_ext.packing.pack_row_linear_weight(..., tiles=True); AMX-BF16's A operand) instead
  // of w / wq / wb: [N / 16, ceil(K / 32), 16, 32] bf16 bits, contiguous, zero past K: weight row n's values
  // 32 b .. 32 b + 31 at wt[((n / 16) * x_blocks + b) * 512 + (n % 16) * 32 ...]. x comes rounded to bf16 (to
  // nearest even) as xbt, in groups of xb_cols rows (the last group padded with zero rows): group g's block b holds
  // 16 pairs of values (32 b + 2 r, 32 b + 2 r + 1) of each of its rows at xbt[((g * x_blocks + b) * 16 + r) *
  // xb_cols * 2 ...] (the B operand), zero past K. tiles_mode (cpu/isa.h bf16_tiles_mode): HW the AMX-BF16 tiles,
  // EMULATE the tile loop over the emulated tiles (both in the AVX-512 variant), OFF the emulation's model on the
  // vector units (bf16_pair_add).
  const uint16_t* wt = nullptr;
  const uint16_t* xbt = nullptr;
  int64_t xb_cols = 0, xb_groups = 0;
  Amx tiles_mode = Amx::OFF;
};

// One pair of bf16 products added to an fp32 sum as the model of AMX-BF16 (tdpbf16ps) that the portable and emulated
// paths share: the pair's two products (exact in fp32) summed exactly, rounded to fp32 and added (round to nearest
// even). For one pair per instruction this is the tiles' result bit for bit (Intel Xeon, 2026-12-05, 20,000 random
// pairs); over the 16 pairs of a whole tile row the hardware rounds in an order of its own (~half the sums differ in
// the last bits), so the tiles are batch invariant among themselves and within ~1e-6 relative of this model.
inline float bf16_pair_add(float acc, uint16_t x0, uint16_t x1, uint16_t w0, uint16_t w1) {
  const auto widen = [](uint16_t b) {
    const uint32_t u = static_cast<uint32_t>(b) << 16;
    float f;
    __builtin_memcpy(&f, &u, sizeof(f));
    return static_cast<double>(f);
  };
  return acc + static_cast<float>(widen(x0) * widen(w0) + widen(x1) * widen(w1));
}

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

// x quantised as row_linear_quantize_x does (the same values), written in the packed int8 path's layout (see
// RowLinearParams::wq_packed): xdt and xct [x_blocks, M], for all M rows, and the values either as xq4 [x_blocks * 8,
// M] (4 bytes each; the VNNI panels) or, where xq_rows is not nullptr, row-major instead (the AMX path's A operand:
// [M, xq_stride], zero past K; xq4 is then not written and may be nullptr).
SBD_CPU_DECLARE_KERNEL(void, row_linear_quantize_x_packed, const RowLinearParams& p, int32_t* xq4, float* xdt,
                       int32_t* xct, int8_t* xq_rows)

// x rows [0, M) rounded to bf16 (to nearest even; NaN as 0x7FC0, as c10::BFloat16) into the tiles' B layout
// (RowLinearParams::xbt) of groups of `cols` rows, every slot written (zero past M and K).
SBD_CPU_DECLARE_KERNEL(void, row_linear_bf16_tiles_x, const float* x, int64_t x_stride, int64_t M, int64_t K,
                       int64_t nb, int64_t cols, int64_t groups, uint16_t* xb)

#if defined(CPU_CAPABILITY_AVX512)
namespace AVX512 {
// Packed int8 weight rows [n0, n1) times p.M quantised x rows on AMX-INT8 tiles (row_linear_amx_kernel.cpp): p as
// for the VNNI panels plus xq / xq_stride (row-major x); the same bits. emulate: the tile model instead of AMX.
void row_linear_amx_range(const RowLinearParams& p, int64_t n0, int64_t n1, bool emulate);
// bf16 weight rows [n0, n1) in tiles (p.wt) times p.M bf16 x rows (p.xbt) on AMX-BF16 tiles (emulate: the tile model).
void row_linear_bf16_tiles_range(const RowLinearParams& p, int64_t n0, int64_t n1, bool emulate);
}  // namespace AVX512
#endif

}  // namespace sbd_cpu
