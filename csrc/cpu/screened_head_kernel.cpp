// screened_head's screen on the CPU (screened_head_cpu.cpp), compiled once per ISA (setup.py): one row's two sweeps
// over its screened logits, 16 lanes (a panel) at a time in fp32, which the ISA variants' compilers vectorize.
#include <cmath>
#include <cstdint>

#include "cpu/screened_head_kernel.h"

namespace sbd_cpu {
namespace CPU_CAPABILITY {

namespace {
constexpr int64_t kPanel = kRowLinearPanel;
}  // namespace

void screened_head_mark(const float* a, const float* wn, int64_t V, int64_t exclude, float scale, uint8_t* mark,
                        bool* finite) {
  constexpr float kRel = 0x1p-22f, kAbs = 0x1p-100f;
  const auto widened = [&](float aj, float wj) {
    const float e = scale * wj;
    return e + kRel * (std::fabs(aj) + e) + kAbs;
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

}  // namespace CPU_CAPABILITY
}  // namespace sbd_cpu
