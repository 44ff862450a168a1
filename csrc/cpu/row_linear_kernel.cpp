// row_linear on the CPU: out = x @ w^T for a few rows x (a decoding forward's T rows) and a weight w [N, K] stored
// as nn.Linear stores it, compiled once per ISA (setup.py).
//
// Why: for a handful of rows the BLAS GEMM the framework calls packs the weight again at every call and, with a
// 49k-row output head, runs at a fraction of the core's FMA rate (this 2-core AVX2 machine: 11-18 GFLOP/s for 16
// rows x 49152 x 576). With few rows the product is a set of dot products over K: each weight row is read from
// memory once and multiplied with every x row while it sits in L1, so the cost is one pass over the weight (the
// one-row case's bandwidth floor) plus the FMAs.
//
// Register tile: kNr weight rows x kMr x rows, one accumulator vector each (3 x 4 = 12 of the 16 AVX2 registers,
// plus the loads). Per K step of one vector: 3 weight loads (L1 after the first x tile), 4 x loads (L2), 12 FMAs
// (4 x 3 measured faster than 3 x 4 here, and 16 rows split into whole tiles). The weight tile (3 rows, 7 KB at K = 576) is the outer loop so it stays in L1 while every x tile passes over it;
// x (M x K, 36 KB for 16 rows) stays in L2. The lanes of an accumulator are summed once at the end of K; the K
// tail (K mod the vector width) and the edge tiles (M mod 4, N mod 3) run the same code with smaller tiles.
// The sum order is fixed (vector lanes, then lanes in order, then the tail), independent of the thread count.
//
// int8 weights (weight-only quantisation, sbd_ext.quantize): the same tiles over an int8 weight [N, K] with one fp32
// scale per weight row. A K step loads a vector's worth of int8 (8 bytes on AVX2, 16 on AVX-512), widens them to
// int32 and converts to fp32 in registers (vpmovsxbd + vcvtdq2ps), then the FMAs are those of the fp32 path; the
// row's scale multiplies its finished sum. The weight stream is a quarter of fp32's, so the one-row case (a
// bandwidth-bound pass over the weight) can run up to 4x faster; with more rows the widening is shared by the x tile.
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <type_traits>

#include "cpu/row_linear_kernel.h"

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace sbd_cpu {
namespace CPU_CAPABILITY {

using Vec = at::vec::Vectorized<float>;

namespace {

constexpr int kNr = 3;  // weight rows per tile
constexpr int kMr = 4;  // x rows per tile

inline float lane_sum(const Vec& v) {
  alignas(64) float lanes[Vec::size()];
  v.store(lanes);
  float s = 0.f;
  for (int i = 0; i < Vec::size(); ++i) s += lanes[i];
  return s;
}

inline Vec load_w(const float* p) { return Vec::loadu(p); }

// Vec::size() int8 weights as fp32.
inline Vec load_w(const int8_t* p) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(CPU_CAPABILITY_AVX2)
  return Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  alignas(64) float lanes[Vec::size()];
  for (int i = 0; i < Vec::size(); ++i) lanes[i] = static_cast<float>(p[i]);
  return Vec::loadu(lanes);
#endif
}

inline const float* weight_of(const RowLinearParams& p, float) { return p.w; }
inline const int8_t* weight_of(const RowLinearParams& p, int8_t) { return p.wq; }

// PREFETCH: the first x tile of a weight tile also prefetches the next weight tile (the same K offsets), so the
// stream from memory overlaps the FMAs; the later x tiles find the current weight tile in L1. (Spreading the
// prefetches over all x tiles measured slower here.)
template <typename W, int MR, int NR, bool PREFETCH>
inline void tile(const RowLinearParams& p, int64_t m0, int64_t n0) {
  const int64_t K = p.K, Kv = K - K % Vec::size();
  const float* xr[MR];
  const W* wr[NR];
  for (int i = 0; i < MR; ++i) xr[i] = p.x + (m0 + i) * p.x_stride;
  for (int j = 0; j < NR; ++j) wr[j] = weight_of(p, W{}) + (n0 + j) * p.w_stride;
  Vec acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = Vec(0.f);
  for (int64_t k = 0; k < Kv; k += Vec::size()) {
    Vec wv[NR];
    for (int j = 0; j < NR; ++j) {
      if constexpr (PREFETCH) __builtin_prefetch(wr[j] + NR * p.w_stride + k, 0, 3);
      wv[j] = load_w(wr[j] + k);
    }
    for (int i = 0; i < MR; ++i) {
      const Vec xv = Vec::loadu(xr[i] + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = at::vec::fmadd(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    float* o = p.out + (m0 + i) * p.out_stride + n0;
    for (int j = 0; j < NR; ++j) {
      float s = lane_sum(acc[i][j]);
      for (int64_t k = Kv; k < K; ++k) s += xr[i][k] * static_cast<float>(wr[j][k]);
      if constexpr (std::is_same_v<W, int8_t>) s *= p.w_scale[n0 + j];
      o[j] = s;
    }
  }
}

template <typename W, int MR, int NR>
inline void tile_pf(const RowLinearParams& p, int64_t m0, int64_t n0, bool prefetch) {
  if (prefetch) {
    tile<W, MR, NR, true>(p, m0, n0);
  } else {
    tile<W, MR, NR, false>(p, m0, n0);
  }
}

template <typename W, int NR>
inline void column(const RowLinearParams& p, int64_t n0) {
  // Only a full tile prefetches, and only when a full next tile exists (no request past the weight's end).
  const bool next = NR == kNr && n0 + 2 * NR <= p.N;
  int64_t m = 0;
  for (; m + kMr <= p.M; m += kMr) tile_pf<W, kMr, NR>(p, m, n0, next && m == 0);
  switch (p.M - m) {
    case 3:
      tile_pf<W, 3, NR>(p, m, n0, next && m == 0);
      break;
    case 2:
      tile_pf<W, 2, NR>(p, m, n0, next && m == 0);
      break;
    case 1:
      tile_pf<W, 1, NR>(p, m, n0, next && m == 0);
      break;
    default:
      break;
  }
}

template <typename W>
void range(const RowLinearParams& p, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + kNr <= n1; n += kNr) column<W, kNr>(p, n);
  switch (n1 - n) {
    case 2:
      column<W, 2>(p, n);
      break;
    case 1:
      column<W, 1>(p, n);
      break;
    default:
      break;
  }
}

}  // namespace

void row_linear_range(const RowLinearParams& p, int64_t n0, int64_t n1) {
  if (p.wq != nullptr) {
    range<int8_t>(p, n0, n1);
  } else {
    range<float>(p, n0, n1);
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace sbd_cpu
