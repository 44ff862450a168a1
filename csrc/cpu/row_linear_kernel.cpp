// row_linear on the CPU: out = x @ w^T for a few rows x (a decoding forward's T rows) and a weight w [N, K] stored
// as nn.Linear stores it, compiled once per ISA (setup.py).
//
// Why: for a handful of rows the BLAS GEMM the framework calls packs the weight again at every call and, with a
// 49k-row output head, runs at a fraction of the core's FMA rate (this 2-core AVX2 machine: 11-18 GFLOP/s for 16
// rows x 49152 x 576). With few rows the product is a set of dot products over K: each weight row is read from
// memory once and multiplied with every x row while it sits in L1, so the cost is one pass over the weight (the
// one-row case's bandwidth floor) plus the FMAs.
//
// Register tile (2 or more x rows): kNr weight rows x kMr x rows, one accumulator vector each (AVX-512: 6 x 4 = 24
// of its 32 registers; AVX2: 3 x 4 = 12 of 16), plus the loads. Per K step of one vector: kNr weight loads (L1 after
// the first x tile), 4 x loads (L2), kNr x 4 FMAs. The weight tile (AVX-512: 6 rows, 14 KB at K = 576) is the outer
// loop so it stays in L1 while every x tile passes over it; x (M x K, 36 KB for 16 rows) stays in L2. The lanes of an
// accumulator are summed once at the end of K (a tree); the K tail (K mod the vector width) and the edge tiles
// (M mod 4, N mod kNr) run the same code with smaller tiles.
//
// One x row (NTP decode) is a pass over the weight and nothing else, so it is laid out for the memory stream
// (range_one_row): weight rows in order, each summed by 4 accumulators, the stream prefetched 4 KB ahead into L2.
// On an AMD EPYC Zen 4 (1 thread) that moved SmolLM2's linears at one row from 13.8 to ~23 GB/s (the 3-row tile's
// three interleaved streams kept the hardware prefetcher short of it), against ~29 GB/s for a plain read.
// The sum order is fixed per output (vector lanes, lanes by a fixed tree, then the tail), independent of the thread
// count.
//
// int8 weights (weight-only quantisation, sbd_ext.quantize): the same tiles over an int8 weight [N, K] with one fp32
// scale per weight row. A K step loads a vector's worth of int8 (8 bytes on AVX2, 16 on AVX-512), widens them to
// int32 and converts to fp32 in registers (vpmovsxbd + vcvtdq2ps), then the FMAs are those of the fp32 path; the
// row's scale multiplies its finished sum. The weight stream is a quarter of fp32's, so the one-row case (a
// bandwidth-bound pass over the weight) can run up to 4x faster; with more rows the widening is shared by the x tile.
//
// int8 x int8 (quantize_x, sbd_ext.quantize(model, "w8a8")): as llama.cpp's Q8_0 does, x is quantised at run time
// per block of 32 values along K (row_linear_quantize_x: one fp32 scale per block), and a K step multiplies 32 int8
// of x with 32 int8 of a weight row in integer arithmetic: vpmaddubsw (unsigned x signed bytes, pairs summed to
// int16) on |w| and sign(x, w) (x is within +-127, so the sign flip cannot overflow; a weight of -128 is exact too),
// vpmaddwd with ones (int32), then one conversion and one FMA with the block's scale. On this Zen 3 core, on
// SmolLM2's linears alone, that is 1.1-1.7x the widening path at one row and 0.9-1.2x at 9-16 rows (the int8
// multiplies share the FMA pipes' throughput: AVX2 has no VNNI). Tile: 4 weight rows x 2 x rows; a block's 4 rows
// share one conversion and one FMA (tile_q8), and the tile two on is prefetched: SmolLM2's one-row linears in 12.1 ms
// instead of 15.6 (3 rows, a conversion and an FMA each, the next tile prefetched; AVX2 EPYC, 1 thread, from memory).
// The AVX-512 build runs vpdpbusd on 512 bits where the CPU has AVX512-VNNI (tile_q8_vnni, below) and the same
// 256-bit code otherwise; the DEFAULT build is scalar.
//
// Packed weights (sbd_ext/packing.py; panel_range, below): the same products over a weight
// stored in panels of 16 rows, where one vector holds a K step (fp32) or 4 K steps (int8, for vpdpbusd) of 16 weight
// rows, so x is broadcast and no lane sums are left: ~1.6x the tiles above at 16 rows in fp32, ~2.3x in w8a8.
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "cpu/bf16_rne.h"
#include "cpu/row_linear_kernel.h"

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif
#if defined(CPU_CAPABILITY_AVX512)
#include "cpu/amx_tiles.h"  // bf16_rne_bits
#endif

namespace sbd_cpu {
namespace CPU_CAPABILITY {

using Vec = at::vec::Vectorized<float>;

namespace {

// Register tile: kNr weight rows x kMr x rows of accumulators. AVX-512 (32 registers): 6 x 4 = 24 accumulators +
// 6 weight vectors + 1 x vector; on an AMD EPYC Zen 4 it ran SmolLM2's 16-row linears at 57 GFLOP/s where 3 x 4 ran
// at 46 (8 rows: 52 vs 64 ms a forward; 4 x 6, 5 x 5, 8 x 3 and 7 x 3 measured in between). AVX2 / the 8-wide
// default (16 registers): 3 x 4 = 12.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kNr = 6;  // weight rows per tile
#else
constexpr int kNr = 3;
#endif
constexpr int kMr = 4;  // x rows per tile

inline float lane_sum(const Vec& v) {
  alignas(64) float lanes[Vec::size()];
  v.store(lanes);
  float s = 0.f;
  for (int i = 0; i < Vec::size(); ++i) s += lanes[i];
  return s;
}

inline float tree_sum(const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_reduce_add_ps(v);
#elif defined(CPU_CAPABILITY_AVX2)
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
#else
  return lane_sum(v);
#endif
}

// ---- The sum order of one output (batch invariance) --------------------------------------------------------------
// Every path below sums one output x[m] . w[n] in the same order, whatever the row count, the tile a row falls in or
// the thread count, so a row's result is bit for bit the one it gets alone (verify decoding equals next-token
// decoding by construction, sbd_ext's central promise). The order: K's whole vectors (dot-product paths) or steps
// (panel paths) cut into kSegs = 4 fixed segments (segment s < 3: [s q, (s + 1) q), q = the count / 4; segment 3 the
// rest), each one FMA chain from zero in ascending k; the four combined as (s0 + s1) + (s2 + s3); then (dot-product
// paths) the lanes by the ISA's fixed tree and the K tail in ascending k by fused multiply-adds. A path only chooses
// how many segments it runs at once (one x row: all four, four independent chains along one weight row; a tile of
// many rows: one at a time, the partial sums parked in L1 between segments) -- never the order.
constexpr int kSegs = 4;

// Segment s of n items (vectors or steps): [seg_begin(n, s), seg_begin(n, s + 1)).
inline int64_t seg_begin(int64_t n, int s) { return s == kSegs ? n : (n / kSegs) * s; }

// The K tail of a dot-product output, in ascending k, each step one fused multiply-add (std::fma: no contraction
// choice left to the compiler, so every path rounds it alike).
template <typename W>
inline float tail_dot(float s, const float* x, const W* w, int64_t k0, int64_t K) {
  for (int64_t k = k0; k < K; ++k) s = std::fma(x[k], static_cast<float>(w[k]), s);
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

// Vec::size() bf16 weights as fp32: the 16 bits are the fp32 value's upper half (exact).
inline Vec load_w(const c10::BFloat16* p) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return Vec(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return Vec(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
#else
  alignas(64) float lanes[Vec::size()];
  for (int i = 0; i < Vec::size(); ++i) lanes[i] = static_cast<float>(p[i]);
  return Vec::loadu(lanes);
#endif
}

inline const float* weight_of(const RowLinearParams& p, float) { return p.w; }
inline const c10::BFloat16* weight_of(const RowLinearParams& p, c10::BFloat16) {
  return reinterpret_cast<const c10::BFloat16*>(p.wb);
}
inline const int8_t* weight_of(const RowLinearParams& p, int8_t) { return p.wq; }

// PREFETCH: the first x tile of a weight tile also prefetches the next weight tile (the same K offsets), so the
// stream from memory overlaps the FMAs; the later x tiles find the current weight tile in L1. (Spreading the
// prefetches over all x tiles measured slower here.)
template <typename W, int MR, int NR, bool PREFETCH>
inline void tile(const RowLinearParams& p, int64_t m0, int64_t n0) {
  const int64_t K = p.K, C = K / Vec::size(), Kv = C * Vec::size();
  const float* xr[MR];
  const W* wr[NR];
  for (int i = 0; i < MR; ++i) xr[i] = p.x + (m0 + i) * p.x_stride;
  for (int j = 0; j < NR; ++j) wr[j] = weight_of(p, W{}) + (n0 + j) * p.w_stride;
  Vec lo[MR][NR], hi[MR][NR];  // s0 + s1 and s2 + s3 (the segments one at a time: the canonical order above)
  for (int seg = 0; seg < kSegs; ++seg) {
    Vec acc[MR][NR];
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) acc[i][j] = Vec(0.f);
    const int64_t k1 = seg_begin(C, seg + 1) * Vec::size();
    for (int64_t k = seg_begin(C, seg) * Vec::size(); k < k1; k += Vec::size()) {
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
    Vec(&half)[MR][NR] = seg < 2 ? lo : hi;
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) half[i][j] = seg % 2 == 0 ? acc[i][j] : half[i][j] + acc[i][j];
  }
  for (int i = 0; i < MR; ++i) {
    float* o = p.out + (m0 + i) * p.out_stride + n0;
    for (int j = 0; j < NR; ++j) {
      float s = tail_dot(tree_sum(lo[i][j] + hi[i][j]), xr[i], wr[j], Kv, K);
      if constexpr (std::is_same_v<W, int8_t>) s *= p.w_scale[n0 + j];
      o[j] = s;
    }
  }
}

// The walk over a weight range [n0, n1) that every tile family T shares: T::kW weight rows x T::kX x rows per tile,
// run by T::template run<MR, NR, PREFETCH>(p, m0, n0); whole tiles, then the edge tiles with fewer rows. The weight
// tile is the outer loop (it stays in L1 while every x tile passes over it). Only a full tile prefetches (the next
// weight tile, in its first x tile), and only when a full next tile exists (no request past the weight's end).
template <class T, int MR, int NR>
inline void run_tile(const RowLinearParams& p, int64_t m0, int64_t n0, bool prefetch) {
  if (prefetch) {
    T::template run<MR, NR, true>(p, m0, n0);
  } else {
    T::template run<MR, NR, false>(p, m0, n0);
  }
}

// The x rows left after the whole tiles: R = p.M - m rows, R < T::kX, dispatched to a tile of R rows.
template <class T, int NR, int R>
inline void column_rest(const RowLinearParams& p, int64_t m, int64_t n0, bool prefetch) {
  if constexpr (R > 0) {
    if (p.M - m == R) return run_tile<T, R, NR>(p, m, n0, prefetch);
    column_rest<T, NR, R - 1>(p, m, n0, prefetch);
  }
}

template <class T, int NR>
inline void column(const RowLinearParams& p, int64_t n0) {
  const bool next = NR == T::kW && n0 + 2 * NR <= p.N;
  int64_t m = 0;
  for (; m + T::kX <= p.M; m += T::kX) run_tile<T, T::kX, NR>(p, m, n0, next && m == 0);
  column_rest<T, NR, T::kX - 1>(p, m, n0, next && m == 0);
}

// The weight rows left after the whole tiles: R = n1 - n rows, R < T::kW.
template <class T, int R>
inline void range_rest(const RowLinearParams& p, int64_t n, int64_t n1) {
  if constexpr (R > 0) {
    if (n1 - n == R) return column<T, R>(p, n);
    range_rest<T, R - 1>(p, n, n1);
  }
}

template <class T>
void tiled_range(const RowLinearParams& p, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + T::kW <= n1; n += T::kW) column<T, T::kW>(p, n);
  range_rest<T, T::kW - 1>(p, n, n1);
}

// fp32 x times an fp32 or int8 (widened) weight.
template <typename W>
struct WidenTiles {
  static constexpr int kW = kNr, kX = kMr;
  template <int MR, int NR, bool PREFETCH>
  static void run(const RowLinearParams& p, int64_t m0, int64_t n0) {
    tile<W, MR, NR, PREFETCH>(p, m0, n0);
  }
};

// One x row (NTP decode, the bandwidth-bound case): each weight row is read once, its kSegs segments summed at once
// by independent accumulators (the FMA latency hidden), their lanes reduced by a tree; the stream is prefetched
// kStreamAhead bytes ahead into L2 (4 KB measured faster than 1, 2 or 8 KB, and than no software prefetch). Rows in
// order, so the hardware and software prefetchers see one linear pass.
constexpr int64_t kStreamAhead = 4096;
// An fp32 stream on AVX2 goes without the software prefetch: on an AMD EPYC Zen 3 (AVX2 only, 2026-11-27; a
// standalone copy of this loop, 1 thread, SmolLM2's shapes from memory, best of 6 interleaved passes) the hardware
// prefetcher alone read 13.7-16.5 GB/s against 10.9-11.9 with 4 KB ahead (1, 2, 8 KB: 11.4-14.3). The 4 KB above
// was measured on AVX-512 (Zen 4) and stays there, and for int8 weights.
#if defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
constexpr bool kStreamPrefetchF32 = false;
#else
constexpr bool kStreamPrefetchF32 = true;
#endif

template <typename W>
void range_one_row(const RowLinearParams& p, int64_t n0, int64_t n1) {
  constexpr int64_t L = Vec::size();
  const int64_t K = p.K, C = K / L, Kv = C * L, q = seg_begin(C, 1) * L;  // q: the length of segments 0-2
  // a software prefetch once per cache line of each segment's stream
  constexpr int64_t kLineSteps = std::max<int64_t>(1, 64 / (L * static_cast<int64_t>(sizeof(W))));
  const float* x = p.x;
  const W* w0 = weight_of(p, W{});
  const char* end = reinterpret_cast<const char*>(w0 + (p.N - 1) * p.w_stride + K);
  for (int64_t n = n0; n < n1; ++n) {
    const W* w = w0 + n * p.w_stride;
    Vec acc[kSegs];
    for (int a = 0; a < kSegs; ++a) acc[a] = Vec(0.f);
    for (int64_t k = 0; k < q; k += L) {
      if constexpr (kStreamPrefetchF32 || !std::is_same_v<W, float>) {
        if ((k / L) % kLineSteps == 0)
          for (int a = 0; a < kSegs; ++a) {
            const char* ahead = reinterpret_cast<const char*>(w + a * q + k) + kStreamAhead;
            if (ahead < end) __builtin_prefetch(ahead, 0, 1);  // to L2
          }
      }
      for (int a = 0; a < kSegs; ++a)
        acc[a] = at::vec::fmadd(Vec::loadu(x + a * q + k), load_w(w + a * q + k), acc[a]);
    }
    for (int64_t k = kSegs * q; k < Kv; k += L) acc[3] = at::vec::fmadd(Vec::loadu(x + k), load_w(w + k), acc[3]);
    float s = tail_dot(tree_sum((acc[0] + acc[1]) + (acc[2] + acc[3])), x, w, Kv, K);
    if constexpr (std::is_same_v<W, int8_t>) s *= p.w_scale[n];
    p.out[n] = s;
  }
}

template <typename W>
void range(const RowLinearParams& p, int64_t n0, int64_t n1) {
  if (p.M == 1) return range_one_row<W>(p, n0, n1);
  tiled_range<WidenTiles<W>>(p, n0, n1);
}

// ---- fp32 weight packed in panels (sbd_ext.pack) -------------------------------------------------------------
// The weight as [N / 16, K, 16]: for each K step, the 16 weight rows of a panel are one vector (AVX-512; two on AVX2)
// that lies next to the previous step's, so a panel is one sequential stream of 64 bytes per K step. A tile of MR x
// rows keeps MR accumulator vectors per panel vector: out[m, 16 rows] += x[m, k] (broadcast) * panel[k]. Per K step:
// one weight load, MR broadcasts, MR FMAs, and no lane sums at the end (each accumulator lane is one output), so the
// loop runs at the FMA rate where the dot-product tiles above pay for their loads of x and their final lane sums.
// AVX-512 takes up to 16 x rows per tile (16 accumulators + the weight vector + a broadcast; 24-row tiles measured
// slower: 17-24 rows are two tiles), so a verify forward's 9-16 rows read every panel once; fewer rows run KS of the
// kSegs K segments at once so that about 8 FMA chains are in flight (one x row: all 4, a
// bandwidth-bound stream; three rows: 2, since 4 sets of 3 -- 12 chains -- ran a third slower than four rows'
// 8: 99 vs 70 us for SmolLM2's 1536 x 576 in cache, 85 us with 2 sets; verify's forwards after a correction have
// 3 rows). The first x tile of a panel
// prefetches kF32PanelAhead bytes ahead in the stream (per ISA, below; the later tiles, with more than 16 rows, find it
// in L2).
// On an AMD EPYC Zen 4 (1 thread) SmolLM2's linears at 16 rows ran at ~86 GFLOP/s this way (the 6 x 4 dot-product
// tile: 58), its 49152-row head at ~100.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kPMr = 16;  // x rows per tile
#else
constexpr int kPMr = 6;  // 2 vectors per panel: 12 accumulators of 16 registers
#endif
// The panel kernel's vector, as the ISA's own register type: GCC keeps an array of at::vec::Vectorized in memory
// at these tile sizes (every FMA a load and a store), an array of __m512 / __m256 in registers.
#if defined(CPU_CAPABILITY_AVX512)
using PVec = __m512;
inline PVec pv_zero() { return _mm512_setzero_ps(); }
inline PVec pv_load(const float* p) { return _mm512_loadu_ps(p); }
inline PVec pv_set1(float v) { return _mm512_set1_ps(v); }
inline PVec pv_fmadd(PVec a, PVec b, PVec c) { return _mm512_fmadd_ps(a, b, c); }
inline PVec pv_add(PVec a, PVec b) { return _mm512_add_ps(a, b); }
inline void pv_store(float* p, PVec v) { _mm512_storeu_ps(p, v); }
constexpr int kPL = 16;
#elif defined(CPU_CAPABILITY_AVX2)
using PVec = __m256;
inline PVec pv_zero() { return _mm256_setzero_ps(); }
inline PVec pv_load(const float* p) { return _mm256_loadu_ps(p); }
inline PVec pv_set1(float v) { return _mm256_set1_ps(v); }
inline PVec pv_fmadd(PVec a, PVec b, PVec c) { return _mm256_fmadd_ps(a, b, c); }
inline PVec pv_add(PVec a, PVec b) { return _mm256_add_ps(a, b); }
inline void pv_store(float* p, PVec v) { _mm256_storeu_ps(p, v); }
constexpr int kPL = 8;
#else
using PVec = Vec;
inline PVec pv_zero() { return Vec(0.f); }
inline PVec pv_load(const float* p) { return Vec::loadu(p); }
inline PVec pv_set1(float v) { return Vec(v); }
inline PVec pv_fmadd(PVec a, PVec b, PVec c) { return at::vec::fmadd(a, b, c); }
inline PVec pv_add(PVec a, PVec b) { return a + b; }
inline void pv_store(float* p, PVec v) { v.store(p); }
constexpr int kPL = Vec::size();
#endif
constexpr int kPV = static_cast<int>(kRowLinearPanel) / kPL;  // vectors per panel step

// One panel step (16 weight rows at one k) as kPV fp32 vectors: an fp32 panel's, loaded; a bf16 panel's
// (sbd_ext.quantize(model, "bf16"): the 16 bits are the fp32 value's upper half, widened exactly), half the bytes of
// an fp32 one with the same products and sums, so the one-row stream (bandwidth-bound) reads half as much.
// AVX2: one 32-byte load holds the step's 16 values; a shift by 16 gives the even rows' values (0, 2, .., 14) and a
// mask the odd rows' (1, 3, .., 15), so the accumulators hold the outputs in that order and store_panel interleaves
// them once per tile. (vpmovzxwd + a shift per 8 values, the AVX-512 way below, crosses 128-bit lanes: on an AMD EPYC
// Zen 3, 1 thread, SmolLM2's linears at one row, streamed from memory, took 32.3 ms that way against 23.5 ms this
// way and 33.7 ms in fp32 panels; no software prefetch distance (0.5-8 KB, one panel ahead) beat none.)
inline void load_panel(const float* p, PVec* wv) {
  for (int v = 0; v < kPV; ++v) wv[v] = pv_load(p + v * kPL);
}
inline void load_panel(const uint16_t* p, PVec* wv) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  wv[0] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  wv[0] = _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
  wv[1] = _mm256_castsi256_ps(_mm256_and_si256(h, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
#else
  for (int v = 0; v < kPV; ++v) {
    alignas(64) float lanes[kPL];
    for (int i = 0; i < kPL; ++i) {
      const uint32_t bits = static_cast<uint32_t>(p[v * kPL + i]) << 16;
      std::memcpy(&lanes[i], &bits, sizeof(float));
    }
    wv[v] = pv_load(lanes);
  }
#endif
}
// The kPV output vectors of one x row's panel (16 outputs) into o, in row order.
template <typename W>
inline void store_panel(float* o, const PVec* s) {
#if defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<W, uint16_t>) {  // s[0]: rows 0, 2, .., 14; s[1]: rows 1, 3, .., 15
    const __m256 lo = _mm256_unpacklo_ps(s[0], s[1]), hi = _mm256_unpackhi_ps(s[0], s[1]);
    _mm256_storeu_ps(o, _mm256_permute2f128_ps(lo, hi, 0x20));
    _mm256_storeu_ps(o + kPL, _mm256_permute2f128_ps(lo, hi, 0x31));
    return;
  }
#endif
  for (int v = 0; v < kPV; ++v) pv_store(o + v * kPL, s[v]);
}
inline const float* panel_weight(const RowLinearParams& p, float) { return p.w; }
inline const uint16_t* panel_weight(const RowLinearParams& p, uint16_t) { return p.wb; }
constexpr int64_t kPanelAhead = 4096;
// The fp32 panel stream's software prefetch, per ISA, each measured on one machine (1 thread, SmolLM2's shapes
// streamed from memory, a standalone copy of panel_tile, best of 6 interleaved passes over ~400 MB). AVX-512 (AMD
// EPYC Zen 4): kPanelAhead ahead for every tile. AVX2 (AMD EPYC Zen 3, 2026-11-27): none for 1-2 x rows (the
// hardware prefetcher alone: one row 16.4-17.4 GB/s against 14.6-15.2 with 4 KB ahead; two rows 14.5-15.2 against
// 11.0-12.6), and 1 KB ahead from 3 rows (15.2-16.4 GB/s against 13.7-15.0 at 3 rows, about the same at 4-6 rows);
// a plain sum over the same weights reads 17-18 GB/s there.
#if defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kF32PanelAhead = 1024;
constexpr int kF32PrefetchMinRows = 3;
#else
constexpr int64_t kF32PanelAhead = kPanelAhead;
constexpr int kF32PrefetchMinRows = 1;
#endif
// One x row on AVX-512: 1 KB ahead. On the AMD EPYC Zen 4 (1 thread, 2026-12-01, SmolLM2's linears + head in the
// weight arena on huge pages, direct op calls, best of 7, processes of each build alternated): fp32 panels 4 KB
// ahead 18.3-22.0 ms (0.78-0.87x a plain read of the same pages), 1 KB 17.0-18.3 (0.88-0.95x), 2 KB 18.1-19.1, none
// 17.1-19.3, 8-16 KB 23.5-25.3; bf16 panels 4 KB 11.8-12.1 ms, 1 KB 9.5-10.3, 512 B or none the same as 1 KB.
// (4 KB had been chosen on 4 KB pages, before the weight arena put the weights on huge pages.)
// On an AMD EPYC Zen 5 (cpu_core() == ZEN5; 1 thread, 2026-12-03, a standalone copy of the panel loop over
// SmolLM2's linears + head on huge pages, best and median of 9-21 interleaved passes) those distances left the
// stream short. One row, fp32 panels: 1 KB 33.4 GB/s (best; median 18.2 ms), 4 KB 36.8, 8 KB 37.0 (15.8 ms), 12-32 KB
// 35.6-36.9, a plain read 38.8; bf16 panels 1 KB 26-30 GB/s, 8 KB 31-35. 2 / 3 / 4 / 8 / 16 rows, fp32, 4 KB into L1
// against 8 KB into L2: 35.1 / 31.5 / 33.1 / 28.1 / 19.2 against 36.6 / 35.8 / 35.8 / 32.2 / 20.8 GB/s. There every
// fp32 tile and the one-row bf16 tile prefetch 8 KB ahead into L2 (bf16 at 16 rows ran ~10 % slower that way in a
// whole forward: 50 -> 55 ms); every other core keeps the distances above (the Zen 4's 8-16 KB were its slowest at
// one row). In the library SmolLM2's fp32 head at one row went from 27 to 37 GB/s.
// More x rows on an AMD EPYC Zen 4 (cpu_core() == ZEN4; 1 thread, 2026-12-04, SmolLM2's linears + head in the weight
// arena, direct op calls, the settings alternated within one process, median of 9-11): fp32 panels of 5 to 16 rows
// 8 KB ahead into L2 (6 / 8 / 11 / 16 rows 30.4 / 32.4 / 37.1 / 47.1 ms with 4 KB into L1 -> 24.7 / 26.0 / 31.6 /
// 42.6; one row 21.5), 2-4 rows no software prefetch (3-9 % faster than 4 KB into L1; 8 KB into L2 was 12-20 %
// slower there); bf16 panels of 3 to 16 rows 8 KB into L2 (3 / 4 / 6 / 8 rows 5-12 % faster, 16 the same). A
// verify + branch forward (mostly 6 rows, packed fp32, compiled, chat) went from 41.5 to 33.1 ms.
// One fp32 row on an Intel Xeon with AVX-512 (cpu_core() == INTEL; AMX, CPUID family 6 model 207, 1 thread,
// 2026-12-05, a standalone copy of the one-row panel loop over 540 MB of panels on huge pages, best / median of 7
// interleaved passes): 1 KB into L2 39.0 / 40.2 ms, 8 KB into L2 35.9 / 36.9, 4-16 KB alike, none 35.7 / 38.2, a plain
// read 35.7 / 37.8; 512 B-4 KB into L1 38.5-40.6 best. There the one-row fp32 panels prefetch 8 KB into L2.
// More fp32 x rows on that Xeon (2026-12-06, SmolLM2's packed linears + head, direct op calls, a process per setting,
// three alternated rounds, median of 7; time against one row in the same process): 4 KB into L1 (the default) 2 / 3 /
// 4 / 6 / 16 rows 1.17 / 1.21-1.24 / 1.17-1.20 / 1.21-1.23 / 1.41-1.47x; 16 KB into L2 1.05-1.09 / 1.10-1.15 /
// 1.05-1.14 / 1.11-1.19 / 1.39-1.44x; 8, 12, 24 and 32 KB into L2 in between or alike; none 1.29-1.49x at 2 rows,
// 2.3-2.5x at 16. There fp32 panels of 2+ rows prefetch 16 KB into L2. (At 16 rows the tile runs at this core's
// FMA rate from L2 already: 4.3 ns per 16-row step against 3.9 ns for 16 register-only zmm FMAs.)
// One x row on the AMD Zen 4 again (2026-12-07, 1 thread, SmolLM2's shapes in the weight arena on huge pages, direct
// op calls, the settings switched within one process, paired medians): with the hardware prefetcher alone fp32 panels
// ran 0.96-0.97x the time of 1 KB into L2 (one call of 3.4 MB: 27.1-27.9 against 26.1-26.9 GB/s, a plain read 31),
// bf16 panels 0.95x, and a compiled next-token decoding (packed fp32, 4 held-out chat prompts x 48) 0.93-0.99x the
// time per forward in three runs. Against 1 KB into L2 (the linears in forward order) 2 KB into L2 ran the same and
// 1 KB into L1 1.10x; in the decoding 512 B into L2 took 1.06x the time of none. There one-row fp32 and bf16 panels
// prefetch nothing.
struct PanelPrefetch {
  int64_t ahead;  // bytes ahead in the panel stream (0: no software prefetch)
  bool l2;        // into L2 (else L1)
};
// One cache line at p into L2 or L1 (the locality hint must be a constant).
inline void prefetch_line(const char* p, bool l2) {
  if (l2) {
    __builtin_prefetch(p, 0, 1);
  } else {
    __builtin_prefetch(p, 0, 3);
  }
}
template <typename W, int MR>
inline PanelPrefetch f32_panel_prefetch() {
#if defined(CPU_CAPABILITY_AVX512)
  static const bool zen5 = cpu_core() == Core::ZEN5;
  if (zen5 && (std::is_same_v<W, float> || MR == 1)) return {8192, true};
  static const bool intel = cpu_core() == Core::INTEL;
  if (intel && std::is_same_v<W, float>) return MR == 1 ? PanelPrefetch{8192, true} : PanelPrefetch{16384, true};
  static const bool zen4 = cpu_core() == Core::ZEN4;
  if constexpr (MR == 1) return zen4 ? PanelPrefetch{0, false} : PanelPrefetch{1024, true};
  if (zen4) {
    if constexpr (std::is_same_v<W, float>) return MR >= 5 ? PanelPrefetch{8192, true} : PanelPrefetch{0, false};
    if (MR >= 3) return {8192, true};
  }
#endif
  return {kF32PanelAhead, MR == 1};
}

// Segments of K run at once by a tile of MR rows (the order is kSegs segments whatever this is, see above). AVX2 and
// the default build: about 8 FMA chains in flight (one x row: all 4 segments, a bandwidth-bound stream; three rows:
// 2, since 4 x 3 -- 12 chains -- ran a third slower than four rows' 8).
// On AVX-512 every tile runs one segment at a time: a panel is then read as one linear stream, which is what the
// weight's pass from memory needs. On an AMD EPYC Zen 4 (1 thread, 2026-11-29, SmolLM2's linears + head streamed
// from memory, kernel calls only, best of 9) one x row took 20-21 ms this way against 26.6-27.6 with the 4 segments at
// once (four streams 9 KB apart: 0.70x the read rate against ~1.0x), 3 rows 21.2 against 34.2, 6 rows 25.9 against
// 35.0; bf16 panels one row 13.1 against 16.0-18.7. One FMA chain per 64-byte step (4-cycle latency) still outruns
// the memory. The AVX2 choice above was measured on an AVX2 core and stays.
template <int MR>
constexpr int k_sets() {
#if defined(CPU_CAPABILITY_AVX512)
  return 1;
#else
  constexpr int chains = MR * kPV;
  return chains >= 8 ? 1 : chains >= 3 ? 2 : 4;
#endif
}

// KS segments starting at segment s0, at once, over the q = K / kSegs steps of each (plus, for the group holding the
// last segment, its steps past kSegs q alone), into acc[KS][MR * kPV] from zero.
template <typename W, int MR, int KS, bool PREFETCH>
inline void panel_segments(const RowLinearParams& p, const W* w, const float* xt, int s0, PVec* acc) {
  constexpr int64_t P = kRowLinearPanel;
  const int64_t K = p.K, q = seg_begin(K, 1), ld = p.M;
  const char* end = reinterpret_cast<const char*>(panel_weight(p, W{}) + p.N * K);
  const PanelPrefetch pf = f32_panel_prefetch<W, MR>();
  for (int a = 0; a < KS * MR * kPV; ++a) acc[a] = pv_zero();
  for (int64_t k = 0; k < q; ++k) {
    for (int s = 0; s < KS; ++s) {
      const int64_t ks = (s0 + s) * q + k;
      const W* wk = w + ks * P;
      const float* xk = xt + ks * ld;
      if (PREFETCH && MR >= kF32PrefetchMinRows && (MR > 2 || s == 0) && pf.ahead > 0) {
        const char* ahead = reinterpret_cast<const char*>(wk) + pf.ahead;
        if (ahead < end) prefetch_line(ahead, pf.l2);
      }
      PVec wv[kPV];
      load_panel(wk, wv);
      for (int i = 0; i < MR; ++i) {
        const PVec b = pv_set1(xk[i]);
        for (int v = 0; v < kPV; ++v) acc[(s * MR + i) * kPV + v] = pv_fmadd(b, wv[v], acc[(s * MR + i) * kPV + v]);
      }
    }
  }
  if (s0 + KS == kSegs) {  // the last segment's steps past kSegs q
    PVec* a3 = acc + (KS - 1) * MR * kPV;
    for (int64_t k = kSegs * q; k < K; ++k) {
      PVec wv[kPV];
      load_panel(w + k * P, wv);
      for (int i = 0; i < MR; ++i) {
        const PVec b = pv_set1(xt[k * ld + i]);
        for (int v = 0; v < kPV; ++v) a3[i * kPV + v] = pv_fmadd(b, wv[v], a3[i * kPV + v]);
      }
    }
  }
}

template <typename W, int MR, bool PREFETCH>
inline void panel_tile(const RowLinearParams& p, int64_t m0, int64_t panel) {
  constexpr int KS = k_sets<MR>();
  constexpr int64_t P = kRowLinearPanel;
  constexpr int NA = MR * kPV;
  const W* w = panel_weight(p, W{}) + panel * p.K * P;
  const float* xt = p.xt + m0;  // x^T [K, M]: row m's value at step k is xt[k * M + m]
  PVec acc[KS * NA];
  PVec half[2][NA];  // s0 + s1, s2 + s3
  for (int s0 = 0; s0 < kSegs; s0 += KS) {
    panel_segments<W, MR, KS, PREFETCH>(p, w, xt, s0, acc);
    for (int s = 0; s < KS; ++s) {
      const int seg = s0 + s;
      PVec* h = half[seg / 2];
      for (int a = 0; a < NA; ++a) h[a] = seg % 2 == 0 ? acc[s * NA + a] : pv_add(h[a], acc[s * NA + a]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    float* o = p.out + (m0 + i) * p.out_stride + panel * P;
    PVec sum[kPV];
    for (int v = 0; v < kPV; ++v) sum[v] = pv_add(half[0][i * kPV + v], half[1][i * kPV + v]);
    store_panel<W>(o, sum);
  }
}

// The walk over the panels of weight rows [n0, n1) (multiples of 16) that both packed layouts share: the panels in
// order, each with every x tile, the M rows in tiles of as equal a size as T::kRows allows (16 rows on AVX2 are
// 6 + 5 + 5, not 6 + 6 + 4); a tile of R rows runs T::template run<R, PREFETCH>(p, m0, panel), the first tile of a
// panel prefetching its stream.
template <class T, int R>
inline void panel_rows(const RowLinearParams& p, int64_t m0, int64_t rows, int64_t panel, bool prefetch) {
  if constexpr (R > 0) {
    if (rows == R) {
      if (prefetch) return T::template run<R, true>(p, m0, panel);
      return T::template run<R, false>(p, m0, panel);
    }
    panel_rows<T, R - 1>(p, m0, rows, panel, prefetch);
  }
}

template <class T>
void panel_range(const RowLinearParams& p, int64_t n0, int64_t n1) {
  const int64_t tiles = (p.M + T::kRows - 1) / T::kRows, base = p.M / tiles, extra = p.M % tiles;
  for (int64_t panel = n0 / kRowLinearPanel; panel < n1 / kRowLinearPanel; ++panel) {
    int64_t m = 0;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t rows = base + (t < extra ? 1 : 0);
      panel_rows<T, T::kRows>(p, m, rows, panel, t == 0);
      m += rows;
    }
  }
}

// fp32 x times an fp32 (W = float) or bf16 (W = uint16_t, its bits) packed weight: the same tiles and sums.
template <typename W>
struct WidePanels {
  static constexpr int kRows = kPMr;
  template <int MR, bool PREFETCH>
  static void run(const RowLinearParams& p, int64_t m0, int64_t panel) {
    panel_tile<W, MR, PREFETCH>(p, m0, panel);
  }
};

// ---- int8 x int8 ----------------------------------------------------------------------------------------------
constexpr int kQNr = 4;  // weight rows per tile (tile_q8 sums 4 rows' blocks by vphaddd)
constexpr int kQMr = 2;  // x rows per tile
constexpr int64_t kB = kRowLinearXBlock;

#if defined(CPU_CAPABILITY_AVX2)
inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}
#endif

// One block of 32 x values (len <= 32): q (32 bytes, zero past len) and its scale; returns the sum of q. A NaN or
// infinite value gives d = NaN and q = 0 (row_linear_quantize_x's contract).
inline int32_t quantize_block(const float* x, int64_t len, int8_t* q, float* d) {
  float amax = 0.f;
  bool finite = true;
#if defined(CPU_CAPABILITY_AVX512)
  if (len == kB) {  // the AVX2 branch's values in two zmm registers, the sum taken before narrowing
    const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
    const __m512 a0 = _mm512_abs_ps(v0), a1 = _mm512_abs_ps(v1), big = _mm512_set1_ps(FLT_MAX);
    if ((_mm512_cmp_ps_mask(a0, big, _CMP_NLE_UQ) | _mm512_cmp_ps_mask(a1, big, _CMP_NLE_UQ)) == 0) {
      amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
      *d = amax / 127.f;
      const __m512 id = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, id)), i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, id));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(i0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(i1));
      return _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
    }
    finite = false;
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if (len == kB) {
    const __m256 sign = _mm256_set1_ps(-0.f), big = _mm256_set1_ps(FLT_MAX);
    __m256 v[4], m = _mm256_setzero_ps();
    int bad = 0;
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + 8 * i);
      const __m256 a = _mm256_andnot_ps(sign, v[i]);
      bad |= _mm256_movemask_ps(_mm256_cmp_ps(a, big, _CMP_NLE_UQ));  // NaN or infinite
      m = _mm256_max_ps(m, a);
    }
    if (bad == 0) {
      amax = hmax(m);
      *d = amax / 127.f;
      const __m256 id = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      __m256i i32[4];
      for (int i = 0; i < 4; ++i) i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id));  // round half to even
      // packs work within 128-bit lanes: [0..3 4..7 | ...] -> restore the order with one permute.
      const __m256i i16a = _mm256_packs_epi32(i32[0], i32[1]), i16b = _mm256_packs_epi32(i32[2], i32[3]);
      const __m256i i8 = _mm256_packs_epi16(i16a, i16b);
      const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(i8, order));
      const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3]));
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
      return _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1)));
    }
    finite = false;
  }
#endif
  for (int64_t k = 0; finite && k < len; ++k) {
    const float a = std::fabs(x[k]);
    if (!(a <= FLT_MAX)) finite = false;
    amax = std::max(amax, a);
  }
  std::memset(q, 0, kB);
  if (!finite) {
    *d = std::numeric_limits<float>::quiet_NaN();
    return 0;
  }
  *d = amax / 127.f;
  const float id = amax > 0.f ? 127.f / amax : 0.f;
  int32_t sum = 0;
  for (int64_t k = 0; k < len; ++k) {
    q[k] = static_cast<int8_t>(std::nearbyint(x[k] * id));  // half to even
    sum += q[k];
  }
  return sum;
}

// One output of an int8 x int8 tile: s, the sum over the whole blocks, plus the last, shorter block (scalar; x's
// quantised row xq, its block scales xd, weight row wq), times weight row n's scale.
inline float q8_output(const RowLinearParams& p, float s, const int8_t* xq, const int8_t* wq, const float* xd,
                       int64_t n) {
  const int64_t full = p.K / kB;
  if (full * kB < p.K) {
    int32_t t = 0;
    for (int64_t k = full * kB; k < p.K; ++k) t += int32_t{xq[k]} * int32_t{wq[k]};
    s += static_cast<float>(t) * xd[full];
  }
  return s * p.w_scale[n];
}

template <int MR, int NR, bool PREFETCH>
inline void tile_q8(const RowLinearParams& p, int64_t m0, int64_t n0) {
  static_assert(NR <= kQNr, "an int8 x int8 tile has at most kQNr weight rows");
  const int64_t K = p.K, full = K / kB;
  const int8_t* xr[MR];
  const float* dr[MR];
  const int8_t* wr[NR];
  for (int i = 0; i < MR; ++i) {
    xr[i] = p.xq + (m0 + i) * p.xq_stride;
    dr[i] = p.xd + (m0 + i) * p.x_blocks;
  }
  for (int j = 0; j < NR; ++j) wr[j] = p.wq + (n0 + j) * p.w_stride;
  float sums[MR][NR];
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  // Per x row one accumulator for the tile's 4 weight rows: a block's 4 int32 vectors (one per weight row) are
  // summed pairwise by two levels of vphaddd (exact, in integers) into lanes j (the row's lanes 0-3) and j + 4 (lanes
  // 4-7), so one conversion and one FMA per block serve 4 rows; the two lanes are added at the end. A tile of fewer
  // rows adds zero vectors in the missing rows' places: every output sums in the same order whatever the tile.
  const __m256i ones = _mm256_set1_epi16(1), zero = _mm256_setzero_si256();
  __m256 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
  // PREFETCH: the weight tile two tiles on (one near the end), read linearly, NR * 32 bytes per block: ~20 % less
  // time for SmolLM2's one-row linears on the AVX2 machine than the next tile's rows at the same K.
  const int8_t* ahead = nullptr;
  if constexpr (PREFETCH) ahead = wr[0] + (n0 + 3 * NR <= p.N ? 2 : 1) * NR * p.w_stride;
  for (int64_t b = 0; b < full; ++b) {
    const int64_t k = b * kB;
    if constexpr (PREFETCH) {
      for (int64_t o = 0; o < NR * kB; o += 64) __builtin_prefetch(ahead + NR * k + o, 0, 3);
    }
    __m256i wv[NR], wa[NR];
    for (int j = 0; j < NR; ++j) {
      wv[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr[j] + k));
      wa[j] = _mm256_abs_epi8(wv[j]);  // -128 -> 0x80, read as the unsigned 128 by vpmaddubsw
    }
    for (int i = 0; i < MR; ++i) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr[i] + k));
      __m256i t[kQNr];
      for (int j = 0; j < kQNr; ++j) {
        if (j < NR) {
          t[j] = _mm256_maddubs_epi16(wa[j], _mm256_sign_epi8(xv, wv[j]));  // |w| * sign(w) x, pairs: int16
          t[j] = _mm256_madd_epi16(t[j], ones);                              // int32
        } else {
          t[j] = zero;
        }
      }
      const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(t[0], t[1]), _mm256_hadd_epi32(t[2], t[3]));
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h), _mm256_set1_ps(dr[i][b]), acc[i]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc[i]);
    for (int j = 0; j < NR; ++j) sums[i][j] = lanes[j] + lanes[j + 4];
  }
#else
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float s = 0.f;
      for (int64_t b = 0; b < full; ++b) {
        int32_t t = 0;
        for (int64_t k = b * kB; k < (b + 1) * kB; ++k) t += int32_t{xr[i][k]} * int32_t{wr[j][k]};
        s += static_cast<float>(t) * dr[i][b];
      }
      sums[i][j] = s;
    }
#endif
  for (int i = 0; i < MR; ++i) {
    float* o = p.out + (m0 + i) * p.out_stride + n0;
    for (int j = 0; j < NR; ++j) {
      o[j] = q8_output(p, sums[i][j], xr[i], wr[j], dr[i], n0 + j);
    }
  }
}

struct Q8Tiles {
  static constexpr int kW = kQNr, kX = kQMr;
  template <int MR, int NR, bool PREFETCH>
  static void run(const RowLinearParams& p, int64_t m0, int64_t n0) {
    tile_q8<MR, NR, PREFETCH>(p, m0, n0);
  }
};

#if defined(CPU_CAPABILITY_AVX512)
// ---- int8 x int8 with AVX512-VNNI (the AVX-512 build, on CPUs that have it: AMD Zen 4, Intel Ice Lake and later) ----
// Two blocks of 32 per 512-bit step: vpdpbusd multiplies 64 unsigned bytes (|w|) by 64 signed bytes (x, negated
// where w < 0: a masked subtract from zero, the mask being w's sign bits) and sums each group of 4 into an int32
// lane, so lanes 0-7 hold block b's partial sums and lanes 8-15 block b+1's; one conversion and one FMA with a
// vector of the two blocks' scales (8 lanes each) finish the step. Per weight row x x row and 64 values: 4
// instructions, where the AVX2 code needs 5 per 32. An odd last whole block runs the same on 256 bits; a shorter last
// block is scalar, as above. |x| <= 127 and |w| <= 128, so a group of 4 is within int32 by far (no saturation).
// Tile: 4 weight rows x 4 x rows (16 accumulators). On an AMD EPYC Zen 4, SmolLM2's 16-row linears (1 thread): 43.7
// ms, against 44.7 for 3 x 2, 47 for 3 x 4 and 5 x 3, 50 for 6 x 2; the AVX2 code there takes 56.8 ms and the
// weight-only int8 path 49.2 ms. At ~98 int8 GOP/s the loop is at the instruction-throughput bound (4 per weight
// row x x row x 64 values, plus the loads and scales).
constexpr int kVNr = 4;  // weight rows per tile
constexpr int kVMr = 4;  // x rows per tile

template <int MR, int NR, bool PREFETCH>
__attribute__((target("avx512vnni"))) void tile_q8_vnni(const RowLinearParams& p, int64_t m0, int64_t n0) {
  const int64_t K = p.K, full = K / kB, pairs = full / 2;
  const int8_t* xr[MR];
  const float* dr[MR];
  const int8_t* wr[NR];
  for (int i = 0; i < MR; ++i) {
    xr[i] = p.xq + (m0 + i) * p.xq_stride;
    dr[i] = p.xd + (m0 + i) * p.x_blocks;
  }
  for (int j = 0; j < NR; ++j) wr[j] = p.wq + (n0 + j) * p.w_stride;
  const __m512i zero = _mm512_setzero_si512();
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t b2 = 0; b2 < pairs; ++b2) {
    const int64_t k = b2 * 2 * kB;
    __m512i wa[NR];
    __mmask64 neg[NR];
    for (int j = 0; j < NR; ++j) {
      if constexpr (PREFETCH) __builtin_prefetch(wr[j] + NR * p.w_stride + k, 0, 3);
      const __m512i w = _mm512_loadu_si512(wr[j] + k);
      neg[j] = _mm512_movepi8_mask(w);
      wa[j] = _mm512_abs_epi8(w);  // -128 -> 0x80, read as the unsigned 128 by vpdpbusd
    }
    for (int i = 0; i < MR; ++i) {
      const __m512i xv = _mm512_loadu_si512(xr[i] + k);
      const __m512 d = _mm512_insertf32x8(_mm512_set1_ps(dr[i][2 * b2]), _mm256_set1_ps(dr[i][2 * b2 + 1]), 1);
      for (int j = 0; j < NR; ++j) {
        const __m512i sx = _mm512_mask_sub_epi8(xv, neg[j], zero, xv);  // sign(x, w)
        const __m512i t = _mm512_dpbusd_epi32(zero, wa[j], sx);
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), d, acc[i][j]);
      }
    }
  }
  if (full % 2 == 1) {  // the last whole block, alone: 256 bits
    const int64_t k = (full - 1) * kB;
    const __m256i zero8 = _mm256_setzero_si256();
    for (int j = 0; j < NR; ++j) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr[j] + k));
      const __mmask32 ng = _mm256_movepi8_mask(w);
      const __m256i wa = _mm256_abs_epi8(w);
      for (int i = 0; i < MR; ++i) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr[i] + k));
        const __m256i t = _mm256_dpbusd_epi32(zero8, wa, _mm256_mask_sub_epi8(xv, ng, zero8, xv));
        const __m512 tf = _mm512_zextps256_ps512(_mm256_cvtepi32_ps(t));  // upper lanes 0
        acc[i][j] = _mm512_fmadd_ps(tf, _mm512_set1_ps(dr[i][full - 1]), acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    float* o = p.out + (m0 + i) * p.out_stride + n0;
    for (int j = 0; j < NR; ++j) {
      o[j] = q8_output(p, _mm512_reduce_add_ps(acc[i][j]), xr[i], wr[j], dr[i], n0 + j);
    }
  }
}

struct Q8VnniTiles {
  static constexpr int kW = kVNr, kX = kVMr;
  template <int MR, int NR, bool PREFETCH>
  static void run(const RowLinearParams& p, int64_t m0, int64_t n0) {
    tile_q8_vnni<MR, NR, PREFETCH>(p, m0, n0);
  }
};

#endif

bool cpu_has_vnni() {
#if defined(__x86_64__) || defined(_M_X64)
  static const bool has = __builtin_cpu_supports("avx512vnni");
  return has;
#else
  return false;
#endif
}

// ---- int8 x int8, the weight packed in panels (sbd_ext.packing.pack_row_linear_int8) -------------------------------
// The weight as uint8 q + 128 in [N / 16, K / 4, 16, 4]: one 64-byte vector holds 4 consecutive values of 16 weight
// rows, so with AVX512-VNNI one vpdpbusd multiplies them (unsigned) by 4 values of one x row (signed, broadcast)
// and adds each row's 4 products into its int32 lane: 64 multiply-adds per instruction, no sign fix-ups, no lane
// sums. Per block of 32 values and x row: 8 vpdpbusd into a zeroed int32 vector, minus 128 x (the block's sum of x)
// -- what the +128 added, exactly, in int32 -- then one conversion and one FMA with the block's scale; the weight
// rows' scales multiply the finished sums. A tile is up to kQPMr x rows (int32 and fp32 accumulators: 2 registers
// per row); the first prefetches the panel's stream ahead. On an AMD EPYC Zen 4 (1 thread) SmolLM2's 16-row linears
// ran in ~14 ms this way where the 4 x 4 VNNI dot-product tile above takes 44; one row ~5 ms (the weight stream).
// Without AVX512-VNNI the same sums run in scalar code (correct, slow: sbd_ext.quantize packs int8 weights only
// where the CPU has VNNI).
constexpr int kQPMr = 12;  // x rows per tile
constexpr int64_t kQPanelBytes = kRowLinearPanel * kB;  // one block of 32 values of a panel: 512 bytes

// out[m0 .. m0 + MR, 16 panel rows], the scalar definition (any ISA)
inline void q8_panel_scalar(const RowLinearParams& p, int64_t m0, int64_t rows, int64_t panel) {
  const int64_t M = p.M, nb = p.x_blocks;
  const uint8_t* w = p.wq_packed + panel * nb * kQPanelBytes;
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t m = m0 + i;
    for (int64_t j = 0; j < kRowLinearPanel; ++j) {
      float s = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t t = 0;
        for (int64_t q = 0; q < 8; ++q) {  // 4 values per step
          const int32_t xv = p.xq4[(b * 8 + q) * M + m];
          const uint8_t* wv = w + b * kQPanelBytes + q * 64 + j * 4;
          for (int c = 0; c < 4; ++c) {
            const int32_t xc = static_cast<int8_t>(static_cast<uint32_t>(xv) >> (8 * c));
            t += (static_cast<int32_t>(wv[c]) - 128) * xc;
          }
        }
        s += static_cast<float>(t) * p.xdt[b * M + m];
      }
      p.out[m * p.out_stride + panel * kRowLinearPanel + j] = s * p.w_scale[panel * kRowLinearPanel + j];
    }
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// The int8 panel stream's software prefetch: kPanelAhead ahead, into L2 for one x row, else into L1. On an AMD EPYC
// Zen 4 (cpu_core() == ZEN4) 10 or more x rows prefetch 8 KB ahead into L2 (1 thread, 2026-12-04, SmolLM2's w8a8
// linears + head in the weight arena, direct op calls, the settings alternated within one process, median of 9:
// 10 / 12 / 14 / 16 rows 14.4 / 17.4 / 24.4 / 27.1 ms -> 12.0 / 13.9 / 18.0 / 19.0; 2-8 rows as fast or faster as
// they were, 8 rows mixed between runs).
// Re-measured on the Zen 4 on huge pages (2026-12-06, 1 thread, a standalone copy of this tile over SmolLM2's w8a8
// linears + head, 135 MB, best / median of 15 interleaved passes, three processes): 2 / 3 / 4 / 5 x rows with the
// hardware prefetcher alone 4.5 / 4.5 / 4.9 / 5.2 ms against 5.2 / 5.3 / 6.1 / 5.9 4 KB ahead into L1, so there
// they prefetch nothing: the compiled w8a8 verify step (4 held-out chat prompts x 64, median call, order-swapped
// process pairs) 9.5-9.6 -> 8.3-8.5 ms. Kept as they were, the rest: one row (none was as fast in the standalone,
// 4.1-4.3 ms, a plain read's time, while 4 KB into L2 ran at ~20 GB/s in two processes of three -- Zen 4 drops some
// PREFETCHT1s -- but the compiled NTP step was the same either way, 6.4-6.7 ms) and 6-9 rows (8 KB into L2 was
// faster in the standalone, 6 / 8 rows 5.6 / 6.4 ms against 6.3 / 7.3, but not in the verify + branch step).
// One row again (2026-12-07, the same Zen 4, the settings switched within one process, paired medians): with the
// hardware prefetcher alone one call over SmolLM2's shapes streamed at 0.94-1.0x a plain read once the call's own
// overhead (a tiny call: 4.7 us) is taken out, against 0.80-0.89x with 4 KB into L2 (one 27 MB call: 0.947x
// against 0.875x a plain read; the linears in forward order 0.92x the time); a compiled w8a8 next-token decoding
// (4 held-out chat prompts x 48, 8 and 16 paired rounds) 0.978x the time per forward twice. 1 KB or 2 KB into L2 lay
// between, 8 KB was slower (1.34x). There one row prefetches nothing too.
inline PanelPrefetch q8_panel_prefetch(int64_t M) {
  static const bool zen4 = cpu_core() == Core::ZEN4;
  if (zen4 && M >= 10) return {8192, true};
  if (zen4 && M <= 5) return {0, false};
  return {kPanelAhead, M == 1};
}

template <int MR, bool PREFETCH>
__attribute__((target("avx512vnni"))) void q8_panel_tile(const RowLinearParams& p, int64_t m0, int64_t panel) {
  const int64_t M = p.M, nb = p.x_blocks;
  const PanelPrefetch pf = q8_panel_prefetch(M);
  const uint8_t* w = p.wq_packed + panel * nb * kQPanelBytes;
  const char* end = reinterpret_cast<const char*>(p.wq_packed + (p.N / kRowLinearPanel) * nb * kQPanelBytes);
  const int32_t* xq = p.xq4 + m0;
  const float* xd = p.xdt + m0;
  const int32_t* xc = p.xct + m0;
  __m512 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = w + b * kQPanelBytes;
    const int32_t* xb = xq + b * 8 * M;
    if (PREFETCH && pf.ahead > 0) {
      for (int64_t line = 0; line < kQPanelBytes; line += 64) {
        const char* ahead = reinterpret_cast<const char*>(wb) + pf.ahead + line;
        // one x row: into L2 (the stream is the whole cost), more rows: into L1 (a Zen 4: see q8_panel_prefetch)
        if (ahead < end) prefetch_line(ahead, pf.l2);
      }
    }
    __m512i dot[MR];
    for (int i = 0; i < MR; ++i) dot[i] = _mm512_setzero_si512();
    for (int q = 0; q < 8; ++q) {
      const __m512i wv = _mm512_loadu_si512(wb + q * 64);
      for (int i = 0; i < MR; ++i) dot[i] = _mm512_dpbusd_epi32(dot[i], wv, _mm512_set1_epi32(xb[q * M + i]));
    }
    for (int i = 0; i < MR; ++i) {
      const __m512i t = _mm512_sub_epi32(dot[i], _mm512_set1_epi32(xc[b * M + i]));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_set1_ps(xd[b * M + i]), acc[i]);
    }
  }
  const __m512 scale = _mm512_loadu_ps(p.w_scale + panel * kRowLinearPanel);
  for (int i = 0; i < MR; ++i) {
    _mm512_storeu_ps(p.out + (m0 + i) * p.out_stride + panel * kRowLinearPanel, _mm512_mul_ps(acc[i], scale));
  }
}

struct Q8PanelsVnni {
  static constexpr int kRows = kQPMr;
  template <int MR, bool PREFETCH>
  static void run(const RowLinearParams& p, int64_t m0, int64_t panel) {
    q8_panel_tile<MR, PREFETCH>(p, m0, panel);
  }
};
#endif

struct Q8PanelsScalar {
  static constexpr int kRows = kQPMr;
  template <int MR, bool PREFETCH>
  static void run(const RowLinearParams& p, int64_t m0, int64_t panel) {
    q8_panel_scalar(p, m0, MR, panel);
  }
};

}  // namespace

void row_linear_quantize_x(const RowLinearParams& p, int8_t* xq, float* xd, int64_t m0, int64_t m1) {
  for (int64_t m = m0; m < m1; ++m) {
    const float* x = p.x + m * p.x_stride;
    for (int64_t b = 0; b < p.x_blocks; ++b) {
      const int64_t k = b * kB;
      quantize_block(x + k, std::min(kB, p.K - k), xq + m * p.xq_stride + k, xd + m * p.x_blocks + b);
    }
  }
}

#if defined(CPU_CAPABILITY_AVX512)
namespace {
// Lane l of the result: op over the 16 values of r[kRowOf[l]]; kRowOf is a 4 x 4 transpose (its own inverse), so
// the caller that puts row i in r[kRowOf[i]] gets row i's reduction in lane i. Four levels of shuffles and ops
// (15 pairs) for 16 rows, where a reduction per row is 4 levels each (64).
constexpr int kRowOf[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};
template <class Op>
inline __m512 reduce16(const __m512* r, Op op) {
  __m512 c[8], d[4], e[2];
  for (int j = 0; j < 8; ++j)
    c[j] = op(_mm512_shuffle_f32x4(r[2 * j], r[2 * j + 1], 0x44), _mm512_shuffle_f32x4(r[2 * j], r[2 * j + 1], 0xEE));
  for (int j = 0; j < 4; ++j)
    d[j] = op(_mm512_shuffle_f32x4(c[2 * j], c[2 * j + 1], 0x88), _mm512_shuffle_f32x4(c[2 * j], c[2 * j + 1], 0xDD));
  for (int j = 0; j < 2; ++j)
    e[j] = op(_mm512_shuffle_ps(d[2 * j], d[2 * j + 1], 0x44), _mm512_shuffle_ps(d[2 * j], d[2 * j + 1], 0xEE));
  return op(_mm512_shuffle_ps(e[0], e[1], 0x88), _mm512_shuffle_ps(e[0], e[1], 0xDD));
}

// One whole block (32 values at x + i * x_stride) of rows i < rows <= 16 at once: what quantize_block gives each row
// (the same max, division, rounding and sum: max and integer sums do not depend on their order), q row i at
// q + i * q_stride, the scales at d[i] and 128 x the sums at xct[i]. False, with nothing written, if a value is NaN or
// infinite (the caller quantises those rows one by one). Why: a row's block alone is two horizontal reductions and a
// scalar division, ~14 ns per row and block (Intel Xeon, AMX, 1 thread), 16 rows at once ~9: SmolLM2's w8a8
// linears + head at 16 rows ~1 ms less (1.57x -> 1.45x one row, on huge pages; 2-4 rows within noise).
inline bool quantize_block_rows(const float* x, int64_t x_stride, int rows, int8_t* q, int64_t q_stride, float* d,
                                int32_t* xct) {
  __m512 v0[16], v1[16], a[16];
  const __m512 big = _mm512_set1_ps(FLT_MAX);
  __mmask16 bad = 0;
  for (int i = 0; i < 16; ++i) {
    if (i < rows) {
      v0[i] = _mm512_loadu_ps(x + i * x_stride);
      v1[i] = _mm512_loadu_ps(x + i * x_stride + 16);
      const __m512 a0 = _mm512_abs_ps(v0[i]), a1 = _mm512_abs_ps(v1[i]);
      bad |= _mm512_cmp_ps_mask(a0, big, _CMP_NLE_UQ) | _mm512_cmp_ps_mask(a1, big, _CMP_NLE_UQ);
      a[kRowOf[i]] = _mm512_max_ps(a0, a1);
    } else {
      a[kRowOf[i]] = _mm512_setzero_ps();
    }
  }
  if (bad != 0) return false;
  const __mmask16 live = static_cast<__mmask16>((1u << rows) - 1u);
  const __m512 amax = reduce16(a, [](__m512 u, __m512 w) { return _mm512_max_ps(u, w); });
  _mm512_mask_storeu_ps(d, live, _mm512_div_ps(amax, _mm512_set1_ps(127.f)));
  alignas(64) float id[16];
  _mm512_store_ps(id, _mm512_maskz_div_ps(_mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_GT_OQ),
                                          _mm512_set1_ps(127.f), amax));
  __m512 sums[16];
  for (int i = 0; i < 16; ++i) {
    if (i < rows) {
      const __m512 s = _mm512_set1_ps(id[i]);
      const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0[i], s)), i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1[i], s));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i * q_stride), _mm512_cvtsepi32_epi8(i0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i * q_stride + 16), _mm512_cvtsepi32_epi8(i1));
      sums[kRowOf[i]] = _mm512_castsi512_ps(_mm512_add_epi32(i0, i1));
    } else {
      sums[kRowOf[i]] = _mm512_setzero_ps();
    }
  }
  const __m512 total = reduce16(sums, [](__m512 u, __m512 w) {
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(u), _mm512_castps_si512(w)));
  });
  _mm512_mask_storeu_epi32(xct, live, _mm512_slli_epi32(_mm512_castps_si512(total), 7));
  return true;
}
}  // namespace
#endif

void row_linear_quantize_x_packed(const RowLinearParams& p, int32_t* xq4, float* xdt, int32_t* xct,
                                  int8_t* xq_rows) {
  const int64_t M = p.M;
  alignas(64) int8_t qb[16 * kB];
  for (int64_t m0 = 0; m0 < M; m0 += 16) {
    const int rows = static_cast<int>(std::min<int64_t>(16, M - m0));
    for (int64_t b = 0; b < p.x_blocks; ++b) {
      const int64_t k = b * kB;
      // the AMX path reads the rows (and not xq4): quantised in place there
      int8_t* q = xq_rows != nullptr ? xq_rows + m0 * p.xq_stride + k : qb;
      const int64_t q_stride = xq_rows != nullptr ? p.xq_stride : kB;
      bool done = false;
#if defined(CPU_CAPABILITY_AVX512)
      if (rows > 1 && k + kB <= p.K)
        done = quantize_block_rows(p.x + m0 * p.x_stride + k, p.x_stride, rows, q, q_stride, xdt + b * M + m0,
                                   xct + b * M + m0);
#endif
      for (int i = 0; i < rows && !done; ++i) {
        const int64_t m = m0 + i;
        xct[b * M + m] = 128 * quantize_block(p.x + m * p.x_stride + k, std::min(kB, p.K - k), q + i * q_stride,
                                              xdt + b * M + m);
      }
      if (xq_rows == nullptr)
        for (int i = 0; i < rows; ++i)
          for (int64_t j = 0; j < kB / 4; ++j) std::memcpy(xq4 + (b * 8 + j) * M + m0 + i, qb + i * kB + 4 * j, 4);
    }
  }
}

void row_linear_bf16_tiles_x(const float* x, int64_t x_stride, int64_t M, int64_t K, int64_t nb, int64_t cols,
                             int64_t groups, uint16_t* xb) {
  std::fill(xb, xb + groups * nb * 16 * cols * 2, uint16_t{0});
#if defined(CPU_CAPABILITY_AVX512)
  // one block of 32 values: rounded in the integer unit (the same bits as bf16_rne), the 16 pairs scattered to
  // their tile rows (~10x the scalar loop: SmolLM2's x rows at 16 rows were ~6 ms of a forward that way)
  const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32(static_cast<int>(cols)));
#endif
  for (int64_t m = 0; m < M; ++m) {
    const int64_t g = m / cols, j = m % cols;
    const float* xr = x + m * x_stride;
    uint16_t* dst = xb + g * nb * 16 * cols * 2 + j * 2;  // block b, pair r at dst[(b * 16 + r) * cols * 2]
    int64_t b = 0;
#if defined(CPU_CAPABILITY_AVX512)
    for (; b * 32 + 32 <= K; ++b) {
      const __m512i lo = bf16_rne_bits(_mm512_loadu_ps(xr + b * 32));
      const __m512i hi = bf16_rne_bits(_mm512_loadu_ps(xr + b * 32 + 16));
      // pair r = values 2r, 2r + 1: lo holds values 0..15, hi 16..31 (16 bits each in 32-bit lanes)
      const __m512i words = _mm512_packus_epi32(lo, hi);  // per 128-bit lane: lo[4i..4i+3], hi[4i..4i+3] as 16 bits
      const __m512i pairs = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7), words);
      // pairs' 64-bit words: lo 0-3, lo 4-7, lo 8-11, lo 12-15, hi 0-3, ...: dword r = values 2r, 2r + 1
      _mm512_i32scatter_epi32(reinterpret_cast<int*>(dst + b * 16 * cols * 2), idx, pairs, 4);
    }
#endif
    for (; b < nb; ++b)
      for (int64_t k = b * 32; k < std::min(K, b * 32 + 32); ++k)
        dst[(b * 16 + (k % 32) / 2) * cols * 2 + k % 2] = bf16_rne(xr[k]);
  }
}

// bf16 weight in tiles without the tiles (p.tiles_mode OFF): bf16_pair_add per pair in k order, as the emulated tiles
// do, from the same x layout. Scalar: the path of a tiles weight on a CPU without AMX-BF16 (or with it turned off
// after quantize), for its results, not its speed.
void bf16_tiles_model(const RowLinearParams& p, int64_t n0, int64_t n1) {
  const int64_t nb = p.x_blocks, cols = p.xb_cols;
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* w = p.wt + (n / kRowLinearPanel) * nb * 512 + (n % kRowLinearPanel) * 32;
    for (int64_t m = 0; m < p.M; ++m) {
      const int64_t g = m / cols, j = m % cols;
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint16_t* xb = p.xbt + (g * nb + b) * 16 * cols * 2 + j * 2;
        for (int64_t r = 0; r < 16; ++r)
          acc = bf16_pair_add(acc, xb[r * cols * 2], xb[r * cols * 2 + 1], w[b * 512 + 2 * r], w[b * 512 + 2 * r + 1]);
      }
      p.out[m * p.out_stride + n] = acc;
    }
  }
}

void row_linear_range(const RowLinearParams& p, int64_t n0, int64_t n1) {
  if (p.wt != nullptr) {
#if defined(CPU_CAPABILITY_AVX512)
    if (p.tiles_mode != Amx::OFF) return row_linear_bf16_tiles_range(p, n0, n1, p.tiles_mode == Amx::EMULATE);
#endif
    return bf16_tiles_model(p, n0, n1);
  }
  if (p.wq_packed != nullptr) {
#if defined(CPU_CAPABILITY_AVX512)
    // the binding fills the row-major x (p.xq) exactly when cpu/isa.h's amx_rows(M) held
    if (p.xq != nullptr) return row_linear_amx_range(p, n0, n1, amx_mode() == Amx::EMULATE);
    if (cpu_has_vnni()) return panel_range<Q8PanelsVnni>(p, n0, n1);
#endif
    panel_range<Q8PanelsScalar>(p, n0, n1);
  } else if (p.xq != nullptr) {
#if defined(CPU_CAPABILITY_AVX512)
    if (cpu_has_vnni()) return tiled_range<Q8VnniTiles>(p, n0, n1);
#endif
    tiled_range<Q8Tiles>(p, n0, n1);
  } else if (p.wq != nullptr) {
    range<int8_t>(p, n0, n1);
  } else if (p.packed && p.wb != nullptr) {
    panel_range<WidePanels<uint16_t>>(p, n0, n1);
  } else if (p.wb != nullptr) {
    range<c10::BFloat16>(p, n0, n1);
  } else if (p.packed) {
    panel_range<WidePanels<float>>(p, n0, n1);
  } else {
    range<float>(p, n0, n1);
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace sbd_cpu
