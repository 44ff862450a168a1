// entropy_sample on the CPU: one pass over a vocabulary chunk, compiled once per ISA (setup.py).
//
// The chunk is walked in tiles of kTile logits that stay in L1. Per tile: convert to fp32 (bf16/fp16), take the
// tile max, then accumulate r = sum e^(x - tile_max) over the entries but one max and u = sum e^(x - tile_max)
// (tile_max - x) with at::vec's exp (sbd/entropy_state.h: the form that keeps near-zero entropies accurate), and
// fold the tile state into the chunk state with sbd::EntropyState::merge, the merge the CUDA kernel uses. Memory is
// read once; the second sweep over a tile hits L1.
//
// The chosen token: greedy keeps the first index of the maximum. Sampling is Gumbel-max with the exact fast path
// of sbd/gumbel.h: a tile whose max cannot reach the best score so far is skipped whole; otherwise the best is first
// raised to the exact score of the tile's max entry, then groups of 32 entries (8 Philox quads) are tested against
// the best with the noise bound kGumbelNoiseMax (no Philox at all when none passes), then with the per-draw bound
// gumbel_noise_bound (Philox, no logarithm), and only the entries that pass get their exact score
// sbd::gumbel_score, the function the CUDA kernel calls. Exact scores are compared as (score, lowest index first),
// so the token is the argmax of the exact scores whatever the visiting order, identical to the CUDA kernel's.
// With AVX2 (and AVX-512 machines, which run the same 256-bit code here) Philox runs on 8 quads per instruction;
// the DEFAULT build runs the same tests one entry at a time.
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#define SBD_ENTROPY_SAMPLE_AVX2 1
#endif

#include "cpu/entropy_sample_kernel.h"
#include "sbd/gumbel.h"
#include "sbd/philox.h"

namespace sbd_cpu {
namespace CPU_CAPABILITY {

using Vec = at::vec::Vectorized<float>;

namespace {

// 1024 fp32 = 4 KB: a tile stays in L1 (32-64 KB) for its second and third sweeps (statistics, sampling). A
// multiple of 32, so every tile starts a Philox group of 8 quads.
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

// State of a tile whose max is m (finite), in the form of sbd::EntropyState: the entries equal to m are counted
// apart (the first is the max, the others add 1 each to r), so r holds no rounded 1 and stays relatively accurate.
// e^(x - m) below e^-87 (about the smallest normal fp32) counts as 0, and -inf logits drop out.
inline sbd::EntropyState tile_state(const float* x, int64_t n, float m) {
  const Vec vm(m), floor(-87.f), zero(0.f), one(1.f);
  Vec vr(0.f), vu(0.f), vties(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    const Vec d = Vec::loadu(x + i) - vm;  // <= 0
    const Vec below = (d < zero) & (d > floor);
    const Vec e = d.exp_u20() & below;
    vr = vr + e;
    vu = vu - ((e * d) & below);  // masked after the product: 0 * -inf is NaN
    vties = vties + ((d == zero) & one);
  }
  const auto sum = [](Vec& a, Vec& b) { return a + b; };
  float r = at::vec::vec_reduce_all<float>(sum, vr);
  float u = at::vec::vec_reduce_all<float>(sum, vu);
  float ties = at::vec::vec_reduce_all<float>(sum, vties);
  for (; i < n; ++i) {
    const float d = x[i] - m;
    if (d == 0.f) {
      ties += 1.f;
    } else if (d > -87.f) {
      const float e = std::exp(d);
      r += e;
      u -= e * d;
    }
  }
  return sbd::EntropyState{m, r + (ties - 1.f), u, false};
}

inline int64_t first_index_of(const float* x, int64_t n, float v) {
  for (int64_t i = 0; i < n; ++i)
    if (x[i] == v) return i;
  return -1;
}

// Gumbel-max sampling of one row, entry by entry in any order: the best exact score and its index, ties to the
// lowest index.
struct RowSampler {
  const EntropySampleParams& p;
  uint32_t row;
  float inv_t;  // 1 / T, for the bounds only (the 2^-20 relative slack of may_reach covers its rounding)
  sbd::ArgmaxState am = sbd::ArgmaxState::empty();

  uint32_t word(int64_t j) const {
    return sbd::philox_for_vocab_quad(p.seed, p.offset, row, static_cast<uint32_t>(j >> 2)).x[j & 3];
  }
  void offer(int64_t j, float x, uint32_t w) {
    const float s = sbd::gumbel_score(x, p.temperature, w);
    if (s > am.best || (s == am.best && j < am.index)) am = sbd::ArgmaxState{s, j};
  }
  void tile(int64_t j0, const float* x, int64_t n, float m);
  void scan(int64_t j0, const float* x, int64_t n);
};

#if defined(SBD_ENTROPY_SAMPLE_AVX2)
// (hi, lo) 32-bit halves of a * m per lane, m the same 32-bit constant in every lane.
inline __m256i mulhilo8(__m256i a, __m256i m, __m256i* lo) {
  const __m256i even = _mm256_mul_epu32(a, m);                         // lanes 0, 2, 4, 6 as 64-bit products
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);  // lanes 1, 3, 5, 7
  *lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
  return _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}

// sbd::philox_for_vocab_quad for the 8 quads q0 .. q0 + 7 of `row` at once; out[k] lane i is the word of vocab
// index 4 q0 + 8 k + i (element order).
inline void philox_words8(uint64_t seed, uint64_t offset, uint32_t row, uint32_t q0, __m256i out[4]) {
  __m256i c0 = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(q0)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  __m256i c1 = _mm256_set1_epi32(static_cast<int>(row));
  __m256i c2 = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(offset)));
  __m256i c3 = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(offset >> 32)));
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  const __m256i m0 = _mm256_set1_epi32(static_cast<int>(0xD2511F53u));
  const __m256i m1 = _mm256_set1_epi32(static_cast<int>(0xCD9E8D57u));
  for (int r = 0; r < 10; ++r) {
    __m256i lo0, lo1;
    const __m256i hi0 = mulhilo8(c0, m0, &lo0);
    const __m256i hi1 = mulhilo8(c2, m1, &lo1);
    c0 = _mm256_xor_si256(_mm256_xor_si256(hi1, c1), _mm256_set1_epi32(static_cast<int>(k0)));
    c2 = _mm256_xor_si256(_mm256_xor_si256(hi0, c3), _mm256_set1_epi32(static_cast<int>(k1)));
    c1 = lo1;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  // c_l lane q = word l of quad q: a 4 x 4 transpose in each 128-bit half, then the halves regrouped.
  const __m256i t0 = _mm256_unpacklo_epi32(c0, c1), t1 = _mm256_unpacklo_epi32(c2, c3);
  const __m256i t2 = _mm256_unpackhi_epi32(c0, c1), t3 = _mm256_unpackhi_epi32(c2, c3);
  const __m256i q04 = _mm256_unpacklo_epi64(t0, t1), q15 = _mm256_unpackhi_epi64(t0, t1);
  const __m256i q26 = _mm256_unpacklo_epi64(t2, t3), q37 = _mm256_unpackhi_epi64(t2, t3);
  out[0] = _mm256_permute2x128_si256(q04, q15, 0x20);
  out[1] = _mm256_permute2x128_si256(q26, q37, 0x20);
  out[2] = _mm256_permute2x128_si256(q04, q15, 0x31);
  out[3] = _mm256_permute2x128_si256(q26, q37, 0x31);
}

// sbd::gumbel_noise_bound on 8 lanes (the same operations).
inline __m256 noise_bound8(__m256i w) {
  const __m256i k = _mm256_srli_epi32(_mm256_xor_si256(w, _mm256_set1_epi32(-1)), 9);
  const __m256 kb = _mm256_cvtepi32_ps(_mm256_castps_si256(_mm256_cvtepi32_ps(k)));
  return _mm256_fmadd_ps(kb, _mm256_set1_ps(-sbd::kLn2 / 8388608.0f), _mm256_set1_ps(150.0f * sbd::kLn2 + sbd::kBoundSlack));
}

// sbd::may_reach on 8 lanes, as a mask of the lanes that may reach best (NaN lanes never do).
inline int may_reach8(__m256 xs, __m256 bound, float best) {
  const __m256 ax = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), xs);
  const __m256 v = _mm256_fmadd_ps(ax, _mm256_set1_ps(sbd::kBoundRelSlack), _mm256_add_ps(xs, bound));
  return _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(best), _CMP_GE_OQ));
}

// Entries [0, n) of a tile starting at vocab index j0 (a multiple of 32), in groups of 32 = 8 Philox quads.
inline void RowSampler::scan(int64_t j0, const float* x, int64_t n) {
  constexpr int kGroup = 32;
  const __m256 vinv = _mm256_set1_ps(inv_t), gmax = _mm256_set1_ps(sbd::kGumbelNoiseMax);
  alignas(32) float pad[kGroup];
  alignas(32) uint32_t words[8];
  for (int64_t g = 0; g < n; g += kGroup) {
    const float* xg = x + g;
    if (n - g < kGroup) {  // the last, partial group: -inf lanes never pass a bound
      std::fill(pad, pad + kGroup, -INFINITY);
      std::copy(xg, x + n, pad);
      xg = pad;
    }
    __m256 xs[4];
    int any = 0;
    for (int k = 0; k < 4; ++k) {
      xs[k] = _mm256_mul_ps(_mm256_loadu_ps(xg + 8 * k), vinv);
      any |= may_reach8(xs[k], gmax, am.best);
    }
    if (!any) continue;  // no noise lifts any of the 32 entries to the best: no Philox
    __m256i w[4];
    philox_words8(p.seed, p.offset, row, static_cast<uint32_t>((j0 + g) >> 2), w);
    for (int k = 0; k < 4; ++k) {
      int lanes = may_reach8(xs[k], noise_bound8(w[k]), am.best);
      if (!lanes) continue;
      _mm256_store_si256(reinterpret_cast<__m256i*>(words), w[k]);
      for (; lanes; lanes &= lanes - 1) {
        const int i = __builtin_ctz(static_cast<unsigned>(lanes));
        offer(j0 + g + 8 * k + i, xg[8 * k + i], words[i]);
      }
    }
  }
}
#else
// Entries [0, n) of a tile starting at vocab index j0, one at a time, Philox once per quad that needs it.
inline void RowSampler::scan(int64_t j0, const float* x, int64_t n) {
  sbd::Philox4 r{};
  int64_t quad = -1;
  for (int64_t i = 0; i < n; ++i) {
    const float xs = x[i] * inv_t;
    if (!sbd::may_reach(xs, sbd::kGumbelNoiseMax, am.best)) continue;
    const int64_t j = j0 + i;
    if ((j >> 2) != quad) {
      quad = j >> 2;
      r = sbd::philox_for_vocab_quad(p.seed, p.offset, row, static_cast<uint32_t>(quad));
    }
    const uint32_t w = r.x[j & 3];
    if (sbd::may_reach(xs, sbd::gumbel_noise_bound(w), am.best)) offer(j, x[i], w);
  }
}
#endif

// A tile starting at vocab index j0 whose max is m (finite). Every entry's exact score is at most that of an entry
// equal to m with the largest noise, so if that cannot reach the best, nothing in the tile can.
inline void RowSampler::tile(int64_t j0, const float* x, int64_t n, float m) {
  if (!sbd::may_reach(m * inv_t, sbd::kGumbelNoiseMax, am.best)) return;
  const int64_t im = first_index_of(x, n, m);
  offer(j0 + im, m, word(j0 + im));
  scan(j0, x, n);
}

template <typename T>
void run_chunk(const EntropySampleParams& p, int64_t row, int64_t j0, int64_t j1, sbd::EntropyState* state,
               sbd::ArgmaxState* best) {
  const T* src = static_cast<const T*>(p.logits) + row * p.row_stride;
  alignas(64) float buf[kTile];
  const bool sample = p.temperature > 0.f;
  sbd::EntropyState st = sbd::EntropyState::empty();
  sbd::ArgmaxState am = sbd::ArgmaxState::empty();
  RowSampler sampler{p, static_cast<uint32_t>(row), sample ? 1.f / p.temperature : 0.f};
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
    if (sample) {
      sampler.tile(j, x, n, m);
    } else if (m > am.best) {
      am = sbd::ArgmaxState{m, j + first_index_of(x, n, m)};
    }
  }
  *state = st;
  *best = sample ? sampler.am : am;
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
