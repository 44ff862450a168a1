// Online softmax statistics of one row of logits, computed in a single pass (DESIGN.md section 3).
//
// State over the elements seen so far, relative to their running maximum m:
//   s = sum_j e^(x_j - m)          t = sum_j e^(x_j - m) * (x_j - m)
// Then logsumexp = m + ln s, entropy H = ln s - t / s (nats) and p_max = 1 / s.
// Keeping t relative to m (rather than sum e^(x-m) * x) avoids the cancellation of "lse - E[x]" when the
// logits are large and the entropy is small. When m grows to m' = m + delta (delta > 0):
//   s' = s e^-delta,   t' = e^-delta (t - delta * s).
// -inf logits are banned tokens and contribute nothing. A NaN or +inf logit makes the row invalid, as does a
// row whose logits are all -inf: its entropy and p_max are NaN and its chosen token is -1.
#pragma once

#include <cmath>

#include "sbd/common.h"

namespace sbd {

// __expf is device-only: choose by __CUDA_ARCH__ (the device pass), not __CUDACC__, which is also defined in
// nvcc's host pass. Host code, under any compiler, uses std::exp.
SBD_HD float fast_exp(float x) {
#if defined(__CUDA_ARCH__)
  return __expf(x);
#else
  return std::exp(x);
#endif
}

struct EntropyState {
  float m;       // running max (-inf while empty)
  float s;       // sum e^(x - m)
  float t;       // sum e^(x - m) (x - m)
  bool invalid;  // a NaN or +inf was seen

  SBD_HD static EntropyState empty() { return EntropyState{-INFINITY, 0.f, 0.f, false}; }

  SBD_HD void push(float x) {
    if (x != x || x == INFINITY) {
      invalid = true;
      return;
    }
    if (x == -INFINITY) return;
    if (x > m) {
      if (s > 0.f) {
        const float delta = x - m;
        const float r = fast_exp(-delta);
        t = r * (t - delta * s);
        s = r * s;
      }
      m = x;
      s += 1.f;  // e^0; its t term is 0
    } else {
      const float d = x - m;
      const float e = fast_exp(d);
      s += e;
      t += e * d;
    }
  }

  // Fold another state in. Associative and commutative up to rounding, so any split of a row works.
  SBD_HD void merge(const EntropyState& o) {
    invalid = invalid || o.invalid;
    if (o.s == 0.f) return;
    if (s == 0.f) {
      m = o.m;
      s = o.s;
      t = o.t;
      return;
    }
    if (o.m > m) {
      const float delta = o.m - m;
      const float r = fast_exp(-delta);
      t = r * (t - delta * s) + o.t;
      s = r * s + o.s;
      m = o.m;
    } else {
      const float delta = m - o.m;
      const float r = fast_exp(-delta);
      t += r * (o.t - delta * o.s);
      s += r * o.s;
    }
  }

  SBD_HD bool ok() const { return !invalid && s > 0.f; }
  // Entropy in nats, clamped at 0 (rounding can leave -1e-7 on a near-one-hot row).
  SBD_HD float entropy() const {
    if (!ok()) return NAN;
    const float h = logf(s) - t / s;
    return h > 0.f ? h : 0.f;
  }
  SBD_HD float max_prob() const { return ok() ? 1.f / s : NAN; }
};

// Running argmax of a score; ties go to the lowest index, as torch.argmax does.
struct ArgmaxState {
  float best;
  int64_t index;  // -1 while empty

  SBD_HD static ArgmaxState empty() { return ArgmaxState{-INFINITY, -1}; }

  SBD_HD void push(float score, int64_t j) {
    if (score > best) {  // strict: the first of equal scores stays; -inf is never chosen
      best = score;
      index = j;
    }
  }
  SBD_HD void merge(const ArgmaxState& o) {
    if (o.index < 0) return;
    if (index < 0 || o.best > best || (o.best == best && o.index < index)) {
      best = o.best;
      index = o.index;
    }
  }
};

// Score of vocab entry j for Gumbel-max sampling at temperature T > 0: x / T + Gumbel(u).
SBD_HD float gumbel_score(float x, float temperature, float u) { return x / temperature - logf(-logf(u)); }

}  // namespace sbd
