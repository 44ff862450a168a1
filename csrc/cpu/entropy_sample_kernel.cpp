// entropy_sample on the CPU: one pass over a vocabulary chunk, compiled once per ISA (setup.py).
//
// The chunk is walked in tiles of kTile logits that stay in L1. Per tile: convert to fp32 (bf16/fp16), take the
// tile max, then accumulate s = sum e^(x - tile_max) and t = sum e^(x - tile_max)(x - tile_max) with at::vec's
// Sleef exp, and fold the tile state into the chunk state with sbd::EntropyState::merge — the same merge the
// CUDA kernel uses, so both devices share the rescaling math. Memory is read once; the second sweep over a
// tile hits L1. The chosen token: greedy keeps the first index of the maximum; sampling scores each entry as
// x / T + Gumbel(u) with u from Philox(seed, offset, row, j) (sbd/philox.h) and keeps the first maximum.
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>

#include "cpu/entropy_sample_kernel.h"
#include "sbd/philox.h"

namespace sbd_cpu {
namespace CPU_CAPABILITY {

using Vec = at::vec::Vectorized<float>;

namespace {

// 1024 fp32 = 4 KB per buffer: the tile plus its Gumbel scores sit in L1 (32-48 KB) with room to spare.
constexpr int64_t kTile = 1024;

template <typename T>
inline void load_tile(const T* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline float tile_max(const float* x, int64_t n) {
  int64_t i = 0;
  float m = -INFINITY;
  if (n >= Vec::size()) {
    Vec vm(-INFINITY);
    for (; i + Vec::size() <= n; i += Vec::size()) vm = at::vec::maximum(vm, Vec::loadu(x + i));
    m = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, vm);
  }
  for (; i < n; ++i) {
    const float v = x[i];
    if (v != v || m != m) {
      m = NAN;
    } else if (v > m) {
      m = v;
    }
  }
  return m;
}

// State of a tile whose max is m (finite): s = sum e^(x-m), t = sum e^(x-m)(x-m); -inf entries contribute 0.
inline sbd::EntropyState tile_state(const float* x, int64_t n, float m) {
  const Vec vm(m), floor(-87.f);  // e^-87 ~ 1.6e-38, the smallest normal fp32: anything below counts as 0
  Vec vs(0.f), vt(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    const Vec d = Vec::loadu(x + i) - vm;
    const Vec keep = d > floor;  // all-ones lanes where the term is representable; -inf logits are dropped
    const Vec e = d.exp_u20() & keep;
    vs = vs + e;
    vt = vt + ((e * d) & keep);
  }
  float s = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, vs);
  float t = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, vt);
  for (; i < n; ++i) {
    const float d = x[i] - m;
    if (d > -87.f) {
      const float e = std::exp(d);
      s += e;
      t += e * d;
    }
  }
  return sbd::EntropyState{m, s, t, false};
}

inline int64_t first_index_of(const float* x, int64_t n, float v) {
  for (int64_t i = 0; i < n; ++i)
    if (x[i] == v) return i;
  return -1;
}

// Gumbel-perturbed scores x / T - log(-log(u)) of entries [j0, j0 + n) of `row`; j0 is a multiple of 4.
inline void gumbel_scores(const EntropySampleParams& p, int64_t row, int64_t j0, const float* x, int64_t n,
                          float* out) {
  alignas(64) float u[kTile];
  const int64_t quads = (n + 3) / 4;
  for (int64_t q = 0; q < quads; ++q) {
    const sbd::Philox4 r = sbd::philox_for_vocab_quad(p.seed, p.offset, static_cast<uint32_t>(row),
                                                      static_cast<uint32_t>((j0 >> 2) + q));
    for (int l = 0; l < 4; ++l) u[4 * q + l] = sbd::philox_uniform(r.x[l]);
  }
  // Tails use partial vector loads (not scalar logf) so every entry goes through the same vectorised log.
  const Vec temp(p.temperature);
  for (int64_t i = 0; i < n; i += Vec::size()) {
    const int count = static_cast<int>(std::min<int64_t>(Vec::size(), n - i));
    const Vec g = Vec::loadu(u + i, count).log().neg().log();  // log(-log(u)); u in (0, 1): both logs finite
    (Vec::loadu(x + i, count) / temp - g).store(out + i, count);
  }
}

template <typename T>
void run_chunk(const EntropySampleParams& p, int64_t row, int64_t j0, int64_t j1, sbd::EntropyState* state,
               sbd::ArgmaxState* best) {
  const T* src = static_cast<const T*>(p.logits) + row * p.row_stride;
  alignas(64) float buf[kTile];
  alignas(64) float score[kTile];
  sbd::EntropyState st = sbd::EntropyState::empty();
  sbd::ArgmaxState am = sbd::ArgmaxState::empty();
  for (int64_t j = j0; j < j1; j += kTile) {
    const int64_t n = std::min(kTile, j1 - j);
    const float* x;
    if constexpr (std::is_same_v<T, float>) {
      x = src + j;
    } else {
      load_tile(src + j, n, buf);
      x = buf;
    }
    const float m = tile_max(x, n);
    if (m != m || m == INFINITY) {  // NaN or +inf: the row is invalid, nothing else matters
      st.invalid = true;
      break;
    }
    if (m == -INFINITY) continue;  // every entry banned
    st.merge(tile_state(x, n, m));
    if (p.temperature == 0.f) {
      if (m > am.best) am = sbd::ArgmaxState{m, j + first_index_of(x, n, m)};
    } else {
      gumbel_scores(p, row, j, x, n, score);
      const float sm = tile_max(score, n);
      if (sm > am.best) am = sbd::ArgmaxState{sm, j + first_index_of(score, n, sm)};
    }
  }
  *state = st;
  *best = am;
}

}  // namespace

void entropy_sample_chunk(const EntropySampleParams& p, int64_t row, int64_t j0, int64_t j1, sbd::EntropyState* state,
                          sbd::ArgmaxState* best) {
  switch (p.dtype) {
    case LogitsDtype::kFloat32:
      return run_chunk<float>(p, row, j0, j1, state, best);
    case LogitsDtype::kBFloat16:
      return run_chunk<c10::BFloat16>(p, row, j0, j1, state, best);
    case LogitsDtype::kFloat16:
      return run_chunk<c10::Half>(p, row, j0, j1, state, best);
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace sbd_cpu
