// screened_head on the CPU: a greedy decoder's output head at the bytes of a bf16 one, with the fp32 head's choice.
//
// A one-row decoding forward reads every weight once, and the output head is the largest single weight (SmolLM2-135M:
// 49152 x 576, 113 MB of a 538 MB fp32 forward). A greedy step needs only the row's largest logit. So the head runs
// over its bf16 copy (the screen: half the bytes) and the few columns whose exact value may be the largest run again
// over the fp32 panels:
//   a_j = row_linear(x, screen)_j, e_j a bound on |a_j - exact_j|, t = max_j (a_j - e_j) (exact_max >= t),
//   candidates: every j with a_j + e_j >= t (every other j has exact_j <= a_j + e_j < t), whose 16-row panels are
//   computed again by row_linear over the fp32 panels -- each output's sum runs over its own weight row in one order
//   (row_linear_write.h), so those values are the fp32 head's bit for bit.
// The bound: with u = 2^-24 and gamma = K u / (1 - K u), both fp32 sums are within gamma * sum_k |x_k w_jk| (times
// 1 + 2^-8 for the screen) of their real values, and the screen's weights within 2^-8 |w_jk| (bf16 to nearest even)
// of the fp32 ones, so |a_j - exact_j| <= (2^-8 + 3 gamma) sum_k |x_k w_jk| <= (2^-8 + 3 gamma) |x| |w_j| (Cauchy-
// Schwarz; screen_norm holds |w_j|, rounded up), widened for the fp32 arithmetic of the screen itself and for
// underflow (screened_head_kernel.cpp). Where the CPU has bf16 products (screened_head_pairs_usable) and a call
// has pairs_rows() rows or more, the screen runs on them with x rounded to bf16 as well: then x~_k w~_jk is within
// (2^-7 + 2^-16) |x_k w_jk| of x_k w_jk and the fp32 sum of the exact products within gamma (1 + 2^-8)^2 of their
// absolute sum, so the factor is 2^-7 + 2^-16 + 3 gamma; and for the operands and results the instruction flushes to
// zero (each below 2^-126), at most 2^-126 (sum_k |w~_jk| + sum_k |x~_k| + 3 K) <= 2^-126 (1.01 sqrt(K) (|w_j| +
// |x|) + 3 K) more. A row with a non-finite x norm, screen value or bound, or a call whose candidates fill more than
// an eighth of the panels, runs the fp32 head whole: the result is then row_linear's.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu/op_clock.h"
#include "cpu/output_pool.h"
#include "cpu/row_linear_write.h"
#include "cpu/screened_head_kernel.h"
#include "screened_head_checks.h"

namespace sbd_ext {

namespace {

constexpr int64_t kPanel = sbd_cpu::kRowLinearPanel;  // the screen's panels are row_linear's

// Rows from which a call screens with bf16 products where the CPU has them. On an AMD EPYC Zen 4 (1 thread,
// 2026-12-07, SmolLM2's head in the weight arena, direct calls, the two paths alternated in one process, medians of
// 7 rounds): 2 / 3 / 4 / 6 rows 1.89 / 2.04 / 2.11 / 2.48 ms against 2.41 / 2.45 / 2.66 / 3.59 with the widened
// fp32 products; a compiled verify + branch decoding (chat, 4 held-out prompts x 64) 0.96-0.97x the time per
// forward, the same tokens. One row there too (a later session, the head's weights cold after the layers' calls,
// 41 alternated rounds in each of three processes): 0.911-0.925x the time of the widened one-row stream (~0.92-0.96x
// a plain read of the screen against 0.83-0.87x; 1-5 candidate panels against 1-3, a few us); a compiled next-token
// decoding cannot resolve the ~0.7 % of a forward that is. The widened stream's loop is one load, two integer
// operations and two FMAs per 64 bytes, the bf16 products' half that. Other cores keep one row on the widened
// stream until measured there.
int64_t pairs_rows() {
  static const int64_t rows = sbd_cpu::cpu_core() == sbd_cpu::Core::ZEN4 ? 1 : 2;
  return rows;
}

// calls, rows, candidate panels computed again, calls that ran the fp32 head whole, calls screened with bf16
// products (screened_head_stats)
std::atomic<int64_t> g_calls{0}, g_rows{0}, g_panels{0}, g_whole{0}, g_pairs{0};
std::atomic<bool> g_pairs_on{true};  // set_screen_pairs

// The bound's factor on |x| |w_j| for sums over K terms (x rounded to bf16 too: `pairs`), or a negative value where
// K is too long for it to hold.
double bound_factor(int64_t K, bool pairs) {
  const double ku = static_cast<double>(K) * std::ldexp(1.0, -24);
  if (ku >= 0.01) return -1.0;
  const double rounding = pairs ? std::ldexp(1.0, -7) + std::ldexp(1.0, -16) : std::ldexp(1.0, -8);
  return (rounding + 3.0 * ku / (1.0 - ku)) * (1.0 + std::ldexp(1.0, -40));
}

// fp32 rounded up from a non-negative double
float up(double v) { return std::nextafter(static_cast<float>(v * (1.0 + 0x1p-40)), INFINITY); }

}  // namespace

at::Tensor screened_head_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& screen,
                             const at::Tensor& screen_norm, int64_t exclude) {
  const OpClock clock(Clocked::kScreenedHead);
  check_screened_head(x, weight, screen, screen_norm, exclude);
  const int64_t M = x.size(0), K = x.size(1), P = weight.size(0), N = P * kPanel, V = screen_norm.size(0);
  at::Tensor out = pooled_empty({M, N}, x.options());
  if (M == 0) return out;
  float* o = out.data_ptr<float>();
  g_calls.fetch_add(1, std::memory_order_relaxed);
  g_rows.fetch_add(M, std::memory_order_relaxed);
  const bool pairs = M >= pairs_rows() && g_pairs_on.load(std::memory_order_relaxed) &&
                     SBD_CPU_DISPATCH(screened_head_pairs_usable);
  const double factor = bound_factor(K, pairs);
  const auto whole = [&] {
    g_whole.fetch_add(1, std::memory_order_relaxed);
    row_linear_write(x, weight, std::nullopt, false, o, N, N);
    return out;
  };
  if (K == 0 || factor < 0) return whole();
  const float* xp = x.data_ptr<float>();
  if (pairs) {
    g_pairs.fetch_add(1, std::memory_order_relaxed);
    std::vector<uint32_t> xpairs(static_cast<size_t>((K + 1) / 2 * M));
    SBD_CPU_DISPATCH(screened_head_x_pairs, xp, x.stride(0), M, K, xpairs.data());
    const auto* sp = static_cast<const uint16_t*>(screen.data_ptr());
    constexpr int64_t kChunk = sbd_cpu::kRowLinearChunk / kPanel;  // panels per task, as row_linear's chunks
    at::parallel_for(0, (P + kChunk - 1) / kChunk, 1, [&](int64_t c0, int64_t c1) {
      SBD_CPU_DISPATCH(screened_head_pairs_range, xpairs.data(), M, K, sp, c0 * kChunk,
                       std::min(P, c1 * kChunk), o, N);
    });
  } else {
    row_linear_write(x, screen, std::nullopt, false, o, N, N);
  }
  std::vector<uint8_t> mark(P, 0);
  const float* wn = screen_norm.data_ptr<float>();
  const double flushed = pairs ? std::ldexp(1.01, -126) * std::sqrt(static_cast<double>(K)) : 0.0;
  for (int64_t m = 0; m < M; ++m) {
    double ss = 0.0;
    for (int64_t k = 0; k < K; ++k) ss += static_cast<double>(xp[m * x.stride(0) + k]) * xp[m * x.stride(0) + k];
    // |x| |w_j| times the bound's factor (and, with bf16 products, sqrt(K) |w_j| 2^-126 1.01 of what the flushes
    // may lose) in fp32 rounded up (screened_head_mark's widening covers the product); the flushes' rest per row
    const double norm = std::sqrt(ss);
    const float scale = up(factor * norm + flushed);
    const float absolute = pairs ? up(0x1p-100 + flushed * norm + 3.0 * std::ldexp(static_cast<double>(K), -126))
                                 : 0x1p-100f;
    float* row = o + m * N;
    if (exclude >= 0) row[exclude] = -FLT_MAX;  // left out of t; its panel runs again below
    bool finite = false;
    SBD_CPU_DISPATCH(screened_head_mark, row, wn, V, exclude, scale, absolute, mark.data(), &finite);
    if (!finite) return whole();
  }
  std::vector<int64_t> panels;
  for (int64_t p = 0; p < P; ++p)
    if (mark[p]) panels.push_back(p);
  const int64_t C = static_cast<int64_t>(panels.size());
  if (C * 8 > P) return whole();
  g_panels.fetch_add(C, std::memory_order_relaxed);
  // the candidates' panels side by side, then row_linear over them: the fp32 head's values of those columns
  at::Tensor sub = at::empty({C, K, kPanel}, weight.options());
  const size_t panel_bytes = static_cast<size_t>(K * kPanel) * sizeof(float);
  const char* w = static_cast<const char*>(weight.data_ptr());
  for (int64_t c = 0; c < C; ++c)
    std::memcpy(static_cast<char*>(sub.data_ptr()) + c * panel_bytes, w + panels[c] * panel_bytes, panel_bytes);
  std::vector<float> exact(static_cast<size_t>(M * C * kPanel));
  row_linear_write(x, sub, std::nullopt, false, exact.data(), C * kPanel, C * kPanel);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < C; ++c)
      std::memcpy(o + m * N + panels[c] * kPanel, exact.data() + (m * C + c) * kPanel, kPanel * sizeof(float));
  return out;
}

bool set_screen_pairs(bool enabled) { return g_pairs_on.exchange(enabled); }

int64_t screened_head_pairs_rows() {
  return SBD_CPU_DISPATCH(screened_head_pairs_usable) ? pairs_rows() : 0;
}

std::vector<int64_t> screened_head_stats() {
  return {g_calls.load(), g_rows.load(), g_panels.load(), g_whole.load(), g_pairs.load()};
}

TORCH_LIBRARY_IMPL(sbd_ext, CPU, m) { m.impl("screened_head", &screened_head_cpu); }

}  // namespace sbd_ext
