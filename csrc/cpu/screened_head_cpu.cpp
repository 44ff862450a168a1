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
// underflow (screened_head_kernel.cpp). A row with a non-finite x norm, screen value or bound, or a call whose
// candidates fill more than an eighth of the panels, runs the fp32 head whole: the result is then row_linear's.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu/output_pool.h"
#include "cpu/row_linear_write.h"
#include "cpu/screened_head_kernel.h"
#include "screened_head_checks.h"

namespace sbd_ext {

namespace {

constexpr int64_t kPanel = sbd_cpu::kRowLinearPanel;  // the screen's panels are row_linear's

// calls, rows, candidate panels computed again, calls that ran the fp32 head whole (screened_head_stats)
std::atomic<int64_t> g_calls{0}, g_rows{0}, g_panels{0}, g_whole{0};

// The bound's factor on |x| |w_j| for sums over K terms, or a negative value where K is too long for it to hold.
double bound_factor(int64_t K) {
  const double ku = static_cast<double>(K) * std::ldexp(1.0, -24);
  if (ku >= 0.01) return -1.0;
  return (std::ldexp(1.0, -8) + 3.0 * ku / (1.0 - ku)) * (1.0 + std::ldexp(1.0, -40));
}

}  // namespace

at::Tensor screened_head_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& screen,
                             const at::Tensor& screen_norm, int64_t exclude) {
  check_screened_head(x, weight, screen, screen_norm, exclude);
  const int64_t M = x.size(0), K = x.size(1), P = weight.size(0), N = P * kPanel, V = screen_norm.size(0);
  at::Tensor out = pooled_empty({M, N}, x.options());
  if (M == 0) return out;
  float* o = out.data_ptr<float>();
  g_calls.fetch_add(1, std::memory_order_relaxed);
  g_rows.fetch_add(M, std::memory_order_relaxed);
  const double factor = bound_factor(K);
  const auto whole = [&] {
    g_whole.fetch_add(1, std::memory_order_relaxed);
    row_linear_write(x, weight, std::nullopt, false, o, N, N);
    return out;
  };
  if (K == 0 || factor < 0) return whole();
  row_linear_write(x, screen, std::nullopt, false, o, N, N);
  std::vector<uint8_t> mark(P, 0);
  const float* wn = screen_norm.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    double ss = 0.0;
    for (int64_t k = 0; k < K; ++k) ss += static_cast<double>(xp[m * x.stride(0) + k]) * xp[m * x.stride(0) + k];
    // |x| |w_j| times the bound's factor, in fp32 rounded up (screened_head_mark's widening covers the product)
    const float scale = std::nextafter(static_cast<float>(factor * std::sqrt(ss) * (1.0 + 0x1p-40)), INFINITY);
    float* row = o + m * N;
    if (exclude >= 0) row[exclude] = -FLT_MAX;  // left out of t; its panel runs again below
    bool finite = false;
    SBD_CPU_DISPATCH(screened_head_mark, row, wn, V, exclude, scale, mark.data(), &finite);
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

std::vector<int64_t> screened_head_stats() {
  return {g_calls.load(), g_rows.load(), g_panels.load(), g_whole.load()};
}

TORCH_LIBRARY_IMPL(sbd_ext, CPU, m) { m.impl("screened_head", &screened_head_cpu); }

}  // namespace sbd_ext
