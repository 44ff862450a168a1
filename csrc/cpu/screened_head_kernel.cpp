// screened_head's screen on the CPU (screened_head_cpu.cpp), compiled once per ISA (setup.py): one row's two sweeps
// over its screened logits, 16 lanes (a panel) at a time in fp32, which the ISA variants' compilers vectorize; and,
// in the AVX-512 variant on a CPU with AVX512-BF16, the screen itself with bf16 products.
//
// Why bf16 products: one x row's screen streams the bf16 head at the memory's rate, but a verify forward screens 3-6
// rows, and widening each bf16 weight to fp32 for an fp32 FMA per row leaves six rows at the FMA rate (AMD EPYC
// Zen 4, 1 thread, SmolLM2's 49152 x 576 head: 2.0 ms at one row, 3.2 at six). vdpbf16ps does two products per lane
// per instruction on the weights as they are stored, once x is rounded to bf16 too.
#include <cmath>
#include <cstdint>

#include "cpu/bf16_rne.h"
#include "cpu/screened_head_kernel.h"

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace sbd_cpu {
namespace CPU_CAPABILITY {

namespace {
constexpr int64_t kPanel = kRowLinearPanel;
}  // namespace

void screened_head_mark(const float* a, const float* wn, int64_t V, int64_t exclude, float scale, float absolute,
                        uint8_t* mark, bool* finite) {
  constexpr float kRel = 0x1p-22f;
  const auto widened = [&](float aj, float wj) {
    const float e = scale * wj;
    return e + kRel * (std::fabs(aj) + e) + absolute;
  };
  float tl[kPanel], nan[kPanel];
  for (int64_t i = 0; i < kPanel; ++i) tl[i] = -INFINITY, nan[i] = 0.f;
  const int64_t full = V / kPanel * kPanel;
  for (int64_t j = 0; j < full; j += kPanel)
    for (int64_t i = 0; i < kPanel; ++i) {
      const float lo = a[j + i] - widened(a[j + i], wn[j + i]);
      tl[i] = lo > tl[i] ? lo : tl[i];
      nan[i] += a[j + i] * 0.f;  // inf * 0: NaN
    }
  float t = -INFINITY, bad = 0.f;
  for (int64_t i = 0; i < kPanel; ++i) t = tl[i] > t ? tl[i] : t, bad += nan[i];
  for (int64_t j = full; j < V; ++j) {
    const float lo = a[j] - widened(a[j], wn[j]);
    t = lo > t ? lo : t;
    bad += a[j] * 0.f;
  }
  *finite = !std::isnan(bad) && std::isfinite(t) && std::isfinite(scale);
  if (!*finite) return;
  for (int64_t j = 0; j < full; j += kPanel) {
    int hit = 0;
    for (int64_t i = 0; i < kPanel; ++i) hit |= a[j + i] + widened(a[j + i], wn[j + i]) >= t;
    if (hit) mark[j / kPanel] = 1;
  }
  for (int64_t j = full; j < V; ++j)
    if (a[j] + widened(a[j], wn[j]) >= t) mark[j / kPanel] = 1;
  if (exclude >= 0) mark[exclude / kPanel] = 1;
}

void screened_head_x_pairs(const float* x, int64_t x_stride, int64_t M, int64_t K, uint32_t* xp) {
  const int64_t J = (K + 1) / 2;
  for (int64_t m = 0; m < M; ++m) {
    const float* r = x + m * x_stride;
    for (int64_t j = 0; j < J; ++j) {
      const uint32_t hi = 2 * j + 1 < K ? bf16_rne(r[2 * j + 1]) : 0u;
      xp[j * M + m] = bf16_rne(r[2 * j]) | hi << 16;
    }
  }
}

#if defined(CPU_CAPABILITY_AVX512)
bool screened_head_pairs_usable() {
  static const bool usable = __builtin_cpu_supports("avx512bf16");
  return usable;
}

namespace {
// The panel stream's software prefetch (bytes ahead, into L2; 0: the hardware prefetcher alone). On the AMD EPYC
// Zen 4 (1 thread, 2026-12-07, SmolLM2's head [3072 panels, 576, 16] on huge pages, a standalone copy of
// pairs_range, best of 15, three alternated rounds; this VM's memory rate moved up to 2x between rounds): 6 rows
// none 2.07-2.92 ms, 2 KB 2.28-4.48, 4 KB 2.40-4.42, 8 KB 2.51-4.62; 4 rows none 1.73, 1 KB 1.79, 8 KB 3.35 (best);
// 2 rows none / 4 KB 1.53 / 1.57, 8 KB 2.38. There: none. Elsewhere (not measured with this kernel) 8 KB into L2,
// which the Zen 5's panels and the Xeon's fp32 panels of several rows measured best or alike (row_linear_kernel.cpp).
int64_t pairs_ahead() {
  static const int64_t ahead = cpu_core() == Core::ZEN4 ? 0 : 8192;
  return ahead;
}

// acc[i] += the 16 pairs of wv times row i's pair (x[i]) for MR rows
template <int MR>
__attribute__((target("avx512bf16"))) inline void pairs_step(__m512* acc, const uint32_t* x, __m512i wv) {
  for (int i = 0; i < MR; ++i)
    acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32(static_cast<int>(x[i])), (__m512bh)wv);
}

// One panel (w: [K, 16] bf16) times MR rows of xp (row m0's pairs at xp[j * M]), into out (row stride ld). A load of
// 64 bytes holds steps k and k + 1 of the 16 weight rows; vpermw interleaves them into the 16 pairs vdpbf16ps takes.
// Two sets of accumulators (even and odd pairs) keep two independent chains per output.
template <int MR>
__attribute__((target("avx512bf16"))) void pairs_panel(const uint32_t* xp, int64_t M, int64_t K, const uint16_t* w,
                                                       const char* end, float* out, int64_t ld) {
  alignas(64) static constexpr uint16_t kIdx[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                    8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i idx = _mm512_load_si512(kIdx);
  __m512 acc[2][MR];
  for (int s = 0; s < 2; ++s)
    for (int i = 0; i < MR; ++i) acc[s][i] = _mm512_setzero_ps();
  const int64_t J = K / 2;  // whole pairs
  const int64_t pf = pairs_ahead();
  int64_t j = 0;
  for (; j + 2 <= J; j += 2) {
    const char* ahead = reinterpret_cast<const char*>(w + j * 32) + pf;
    if (pf > 0 && ahead < end) __builtin_prefetch(ahead, 0, 1);
    pairs_step<MR>(acc[0], xp + j * M, _mm512_permutexvar_epi16(idx, _mm512_loadu_si512(w + j * 32)));
    pairs_step<MR>(acc[1], xp + (j + 1) * M, _mm512_permutexvar_epi16(idx, _mm512_loadu_si512(w + (j + 1) * 32)));
  }
  if (j < J) pairs_step<MR>(acc[0], xp + j * M, _mm512_permutexvar_epi16(idx, _mm512_loadu_si512(w + j * 32))), ++j;
  if (K % 2)  // the last step alone: each weight paired with a zero (and x's pair holds a zero above it)
    pairs_step<MR>(acc[1], xp + j * M,
                   _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (K - 1) * 16))));
  for (int i = 0; i < MR; ++i) _mm512_storeu_ps(out + i * ld, _mm512_add_ps(acc[0][i], acc[1][i]));
}
}  // namespace

void screened_head_pairs_range(const uint32_t* xp, int64_t M, int64_t K, const uint16_t* screen, int64_t p0,
                               int64_t p1, float* out, int64_t ld) {
  constexpr int64_t kMr = 6;  // 12 accumulators, the index and a weight vector in registers
  const char* end = reinterpret_cast<const char*>(screen + p1 * K * kPanel);
  for (int64_t p = p0; p < p1; ++p) {
    const uint16_t* w = screen + p * K * kPanel;
    for (int64_t m0 = 0; m0 < M; m0 += kMr) {
      const uint32_t* x = xp + m0;
      float* o = out + m0 * ld + p * kPanel;
      switch (M - m0 < kMr ? M - m0 : kMr) {
        case 1: pairs_panel<1>(x, M, K, w, end, o, ld); break;
        case 2: pairs_panel<2>(x, M, K, w, end, o, ld); break;
        case 3: pairs_panel<3>(x, M, K, w, end, o, ld); break;
        case 4: pairs_panel<4>(x, M, K, w, end, o, ld); break;
        case 5: pairs_panel<5>(x, M, K, w, end, o, ld); break;
        default: pairs_panel<6>(x, M, K, w, end, o, ld); break;
      }
    }
  }
}
#else
bool screened_head_pairs_usable() { return false; }
void screened_head_pairs_range(const uint32_t*, int64_t, int64_t, const uint16_t*, int64_t, int64_t, float*,
                               int64_t) {}
#endif

}  // namespace CPU_CAPABILITY
}  // namespace sbd_cpu
