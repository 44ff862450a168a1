// Gumbel-max sampling for entropy_sample: the score of a vocabulary entry, bit-identical on every device, and the
// bounds behind the exact fast path that skips most of the work.
//
// Sampling at temperature T draws argmax_j (x_j / T + G_j) with G_j = -log(-log(u_j)) Gumbel noise and u_j from
// Philox (sbd/philox.h). The token is the same on the CPU and CUDA only if every score rounds the same, so the score
// uses only correctly rounded IEEE operations (division, add, multiply, fma): x / T (an IEEE division on both, the
// CUDA kernels are not built with fast math) and log_f32 below, a polynomial logarithm written with explicit fmaf
// so no compiler can contract or reassociate it differently (libm's logf and CUDA's logf are different functions
// that disagree in the last bit now and then). sbd_ext.reference computes the same scores with torch.log, which
// may round a score 1 ulp apart: against the reference the token may differ at such a near-tie only.
//
// Fast path (exact). Most entries cannot win: u <= 1 - 2^-24, so G <= 24 ln 2 = 16.64 < kGumbelNoiseMax, and an
// entry with x / T + kGumbelNoiseMax below the best score so far needs neither its Philox draw nor its logarithms.
// For the others, gumbel_noise_bound(w) bounds G from the integer bits of the draw (no logarithm), and only the
// entries whose bound reaches the best score get their exact score. may_reach() makes both tests with a slack that
// covers every rounding (below), so a skipped entry's exact score is strictly below the best: the token is the
// argmax of the exact scores, as if every score had been computed.
#pragma once

#include <cstdint>
#include <cstring>

#include "sbd/common.h"
#include "sbd/philox.h"

namespace sbd {

SBD_HD uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return static_cast<uint32_t>(__float_as_int(x));
#else
  uint32_t i;
  std::memcpy(&i, &x, sizeof(i));
  return i;
#endif
}

SBD_HD float bits_float(uint32_t i) {
#if defined(__CUDA_ARCH__)
  return __int_as_float(static_cast<int>(i));
#else
  float x;
  std::memcpy(&x, &i, sizeof(x));
  return x;
#endif
}

SBD_HD float fma_f32(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);  // correctly rounded with or without an FMA unit (libm falls back to software)
#endif
}

// Natural logarithm of a positive normal float, about 1 ulp (Cephes' logf polynomial, evaluated in fma form):
// x = 2^e (1 + f) with 1 + f in [sqrt(1/2), sqrt(2)), log x = e ln 2 + f - f^2 / 2 + f^3 P(f), ln 2 split in two
// parts so that e ln 2 adds no rounding. Every multiply-add is an explicit fma and no product feeds a plain add,
// so the result is the same bits under any compiler, ISA and device.
SBD_HD float log_f32(float x) {
  const uint32_t i = float_bits(x);
  // Exponent of x relative to sqrt(1/2) (0x3f3504f3): the mantissa lands in [sqrt(1/2), sqrt(2)).
  const int32_t e = static_cast<int32_t>(i - 0x3f3504f3u) >> 23;
  const float m = bits_float(i - (static_cast<uint32_t>(e) << 23));
  const float f = m - 1.0f;  // exact (Sterbenz: m in [1/2, 2])
  const float z = f * f;
  float p = 7.0376836292e-2f;
  p = fma_f32(p, f, -1.1514610310e-1f);
  p = fma_f32(p, f, 1.1676998740e-1f);
  p = fma_f32(p, f, -1.2420140846e-1f);
  p = fma_f32(p, f, 1.4249322787e-1f);
  p = fma_f32(p, f, -1.6668057665e-1f);
  p = fma_f32(p, f, 2.0000714765e-1f);
  p = fma_f32(p, f, -2.4999993993e-1f);
  p = fma_f32(p, f, 3.3333331174e-1f);
  const float fe = static_cast<float>(e);
  float y = fma_f32(p * f, z, fe * -2.12194440e-4f);  // f^3 P(f) + e * (ln 2 - 0.693359375)
  y = fma_f32(z, -0.5f, y);
  return fma_f32(fe, 0.693359375f, f + y);
}

// The Gumbel noise of a Philox word: -log(-log(u)), u = philox_uniform(w) in [2^-24, 1 - 2^-24].
SBD_HD float gumbel_noise(uint32_t w) { return -log_f32(-log_f32(philox_uniform(w))); }

// The sampling score of logit x at temperature T (> 0) with Philox word w.
SBD_HD float gumbel_score(float x, float temperature, uint32_t w) { return x / temperature + gumbel_noise(w); }

// Upper bound of the noise, tested against the largest gumbel_noise over all 2^24 draws (tools/cuda_emu).
constexpr float kGumbelNoiseMax = 16.75f;

// ln 2 and the slack of the bounds: 1e-3 absolute (every rounding of a score below |x / T| ~ 1000 is far smaller)
// plus 2^-20 relative (rounding of larger scores is at most 2^-24 relative per operation).
constexpr float kLn2 = 0.693147180559945f;
constexpr float kBoundSlack = 1e-3f;
constexpr float kBoundRelSlack = 1.0f / 1048576.0f;
// gumbel_noise_bound(w) = kb * kNoiseBoundSlope + kNoiseBoundC0, kb = bits(float(k)) as a float (below).
constexpr float kNoiseBoundSlope = -kLn2 / 8388608.0f;
constexpr float kNoiseBoundC0 = 150.0f * kLn2 + kBoundSlack;

// An upper bound of gumbel_noise(w) from integer operations: with u = philox_uniform(w) and k = 2^23 - 1 - (w >> 9)
// (so 1 - u = (k + 1/2) 2^-23), -log u >= 1 - u gives G <= 23 ln 2 - ln(k + 1/2) <= ln 2 (23 - log2 k), and
// log2 k >= bits(float(k)) / 2^23 - 127 (the exponent plus the mantissa fraction, log2(1 + t) >= t on [0, 1]).
// So G <= ln 2 (150 - bits(float(k)) / 2^23), which k = 0 (bits 0) turns into the loose 150 ln 2. The bound is
// tight where it matters, for the draws near 1 that give large noise; the vector CPU kernel evaluates the same
// expression on 8 lanes.
SBD_HD float gumbel_noise_bound(uint32_t w) {
  const uint32_t k = (~w) >> 9;
  const float kb = static_cast<float>(static_cast<int32_t>(float_bits(static_cast<float>(k))));
  return fma_f32(kb, kNoiseBoundSlope, kNoiseBoundC0);
}

// x / T plus its relative slack, the left side of every reach test (NaN for -inf and NaN).
SBD_HD float reach_base(float xs) { return fma_f32(xs < 0.f ? -xs : xs, kBoundRelSlack, xs); }

// Whether a score x / T + G with G <= bound may reach `best` (a score already seen). When this is false the exact
// score is strictly below best: the slacks absorb the rounding of x / T + G, of this test (best - bound included:
// where it rounds by more than 1e-3, |best| > 2^13, and a score that could reach best has |x / T| as large, whose
// 2^-20 relative slack exceeds the 2^-24 relative rounding), and of the bound. -inf and NaN xs never reach (NaN makes
// the row invalid anyway).
SBD_HD bool may_reach(float xs, float bound, float best) { return reach_base(xs) >= best - bound; }

}  // namespace sbd
