// topk_logsumexp on the CPU, one row per call, compiled once per ISA (setup.py): what a sampler head's rescoring
// reads of a vocabulary row (its top candidates and the log of its softmax's denominator) in two sweeps of the row,
// where torch.topk's selection and logsumexp's passes took ~0.2 ms per 49k-entry row at one thread (this: ~45 us).
//
// Sweep 1: the row's max (NaN-propagating). Sweep 2: sum e^(x - max) with at::vec's exp_u20 (the sum's relative
// error ~1e-6; the u10 exp made the row ~60 % slower), and the top k: each vector of entries is compared with a bar
// (the k-th best kept so far), and only entries strictly above it are kept, in a buffer cut back to its best k
// (nth_element) when full -- on a vocabulary row a few hundred entries of ~50k. A row with a NaN takes a scalar path
// (NaN ranks above every number, lower index first).
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "cpu/topk_logsumexp_kernel.h"

namespace sbd_cpu {
namespace CPU_CAPABILITY {

using Vec = at::vec::Vectorized<float>;

namespace {

struct Entry {
  float v;
  int64_t i;
};

// a ranks above b: (value descending, index ascending), NaN above every number
inline bool above(const Entry& a, const Entry& b) {
  const bool an = std::isnan(a.v), bn = std::isnan(b.v);
  if (an != bn) return an;
  if (!an && a.v != b.v) return a.v > b.v;
  return a.i < b.i;
}

float row_max(const float* x, int64_t V) {
  int64_t i = 0;
  float m = -std::numeric_limits<float>::infinity();
  if (V >= Vec::size()) {
    Vec vm = Vec::loadu(x);
    for (i = Vec::size(); i + Vec::size() <= V; i += Vec::size()) vm = at::vec::maximum(vm, Vec::loadu(x + i));
    m = at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return at::vec::maximum(a, b); }, vm);
  }
  for (; i < V; ++i)
    m = std::isnan(x[i]) || std::isnan(m) ? std::numeric_limits<float>::quiet_NaN() : std::max(m, x[i]);
  return m;
}

float sum_exp(const float* x, int64_t V, float m) {
  const Vec vm(m);
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= V; i += Vec::size()) acc = acc + (Vec::loadu(x + i) - vm).exp_u20();
  float s = at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return a + b; }, acc);
  for (; i < V; ++i) s += std::exp(x[i] - m);
  return s;
}

}  // namespace

void topk_logsumexp_row(const float* x, int64_t V, int64_t k, float* values, int64_t* indices, float* lse) {
  const float m = row_max(x, V);
  if (std::isnan(m)) {  // the rare row with a NaN: a full ordering
    *lse = m;
    std::vector<int64_t> order(static_cast<size_t>(V));
    std::iota(order.begin(), order.end(), int64_t{0});
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&](int64_t a, int64_t b) { return above({x[a], a}, {x[b], b}); });
    for (int64_t j = 0; j < k; ++j) {
      values[j] = x[order[j]];
      indices[j] = order[j];
    }
    return;
  }
  *lse = std::isinf(m) ? m : m + std::log(sum_exp(x, V, m));
  if (k == 0) return;
  // No NaN from here: (value descending, index ascending). The candidates: the first k entries, then every entry
  // strictly above the k-th best kept so far (an equal value comes later: its index is higher, it loses); when the
  // buffer is full, it is cut back to its best k and the bar rises to the new k-th.
  const auto better = [](const Entry& a, const Entry& b) { return a.v > b.v || (a.v == b.v && a.i < b.i); };
  const int64_t cap = k + std::max<int64_t>(k, 256);
  std::vector<Entry> buf;
  buf.reserve(static_cast<size_t>(cap));
  for (int64_t i = 0; i < k; ++i) buf.push_back({x[i], i});
  float bar = buf[0].v;  // the k-th best of the first k: their least value
  for (const Entry& e : buf) bar = std::min(bar, e.v);
  const auto take = [&](int64_t i) {
    buf.push_back({x[i], i});
    if (static_cast<int64_t>(buf.size()) == cap) {
      std::nth_element(buf.begin(), buf.begin() + (k - 1), buf.end(), better);
      buf.resize(static_cast<size_t>(k));
      bar = buf[k - 1].v;
    }
  };
  constexpr int kAll = (1 << Vec::size()) - 1;  // zero_mask: bit j set where lane j compared false
  int64_t i = k;
  for (; i + Vec::size() <= V; i += Vec::size()) {
    int hits = ~(Vec::loadu(x + i) > Vec(bar)).zero_mask() & kAll;
    while (hits != 0) {
      const int j = __builtin_ctz(static_cast<unsigned>(hits));
      hits &= hits - 1;
      if (x[i + j] > bar) take(i + j);  // the bar may have risen within the vector
    }
  }
  for (; i < V; ++i)
    if (x[i] > bar) take(i);
  std::partial_sort(buf.begin(), buf.begin() + k, buf.end(), better);
  for (int64_t j = 0; j < k; ++j) {
    values[j] = buf[j].v;
    indices[j] = buf[j].i;
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace sbd_cpu
