// entropy_sample on the CPU: one vocabulary chunk per call, compiled once per ISA (setup.py).
//
// The chunk is walked in tiles of kTile logits that stay in L1. Per tile: convert to fp32 (bf16/fp16, into the
// tile's place in a chunk buffer that sampling reads again), take the tile max, then accumulate r = sum e^(x -
// tile_max) over the entries but one max and u = sum e^(x - tile_max) (tile_max - x) with at::vec's exp
// (sbd/entropy_state.h: the form that keeps near-zero entropies accurate), and fold the tile state into the chunk
// state with sbd::EntropyState::merge, the merge the CUDA kernel uses. Memory is read once; the second sweep over a
// tile hits L1.
//
// The chosen token: greedy keeps the first index of the maximum. Sampling is Gumbel-max with the exact fast path
// of sbd/gumbel.h, in a second pass over the chunk (still in L2) that visits its tiles by decreasing max: a tile
// whose max cannot reach the best score so far ends the pass (no later tile can); otherwise the best is first
// raised to the exact score of the tile's max entry, then groups of 64 entries (16 Philox quads) are tested against
// the best with the noise bound kGumbelNoiseMax (no Philox at all when none passes), then with the per-draw bound
// gumbel_noise_bound (Philox, no logarithm), and only the entries that pass get their exact score
// sbd::gumbel_score, the function the CUDA kernel calls. The best starts from the floor the caller passes (the best
// of the row's chunks done before on this thread), so on LLM-like rows a chunk without the row's top tokens is
// mostly skipped. Exact scores are compared as (score, lowest index first), so the token is the argmax of the
// exact scores whatever the visiting order and the floor, identical to the CUDA kernel's.
// With AVX2 (and AVX-512 machines, which run the same 256-bit code here) Philox runs on 8 quads per instruction,
// its first two rounds folded where they do not depend on the vocabulary index; the DEFAULT build runs the same
// tests one entry at a time.
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <vector>

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

// 1024 fp32 = 4 KB: a tile stays in L1 (32-64 KB) for its second sweep (statistics) and for the sampling pass's
// group loop. A multiple of 64, so every tile starts a Philox group of 16 quads.
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
// e^(x - m) below e^-87 (about the smallest normal fp32) counts as 0, and -inf logits drop out. The last partial
// vector is padded with -inf, which adds exact zeros.
inline sbd::EntropyState tile_state(const float* x, int64_t n, float m) {
  const Vec vm(m), floor(-87.f), zero(0.f), one(1.f);
  Vec vr(0.f), vu(0.f), vties(0.f);
  const auto add = [&](const Vec& xv) {
    const Vec d = xv - vm;  // <= 0
    const Vec below = (d < zero) & (d > floor);
    const Vec e = d.exp_u20() & below;
    vr = vr + e;
    vu = vu - ((e * d) & below);  // masked after the product: 0 * -inf is NaN
    vties = vties + ((d == zero) & one);
  };
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) add(Vec::loadu(x + i));
  if (i < n) {
    alignas(32) float tail[Vec::size()];
    std::fill(tail, tail + Vec::size(), -INFINITY);
    std::copy(x + i, x + n, tail);
    add(Vec::loadu(tail));
  }
  const auto sum = [](Vec& a, Vec& b) { return a + b; };
  const float r = at::vec::vec_reduce_all<float>(sum, vr);
  const float u = at::vec::vec_reduce_all<float>(sum, vu);
  const float ties = at::vec::vec_reduce_all<float>(sum, vties);
  return sbd::EntropyState{m, r + (ties - 1.f), u, false};
}

// Vectorised: sampling looks up the max of nearly every tile, and a scalar scan cost ~1 cycle per logit.
inline int64_t first_index_of(const float* x, int64_t n, float v) {
  int64_t i = 0;
  const Vec vv(v);
  for (; i + Vec::size() <= n; i += Vec::size()) {
    // zero_mask has a bit per lane that compares equal to 0.0: every lane but the (all-ones) matches
    if ((Vec::loadu(x + i) == vv).zero_mask() != (1 << Vec::size()) - 1) break;
  }
  for (; i < n; ++i)
    if (x[i] == v) return i;
  return -1;
}

#if defined(SBD_ENTROPY_SAMPLE_AVX2)
// The parts of sbd::philox_for_vocab_quad that a row shares. Only counter word 0 (the quad) varies along a row, so
// the first two rounds are mostly constant: in round 0 the product c2 * M1 is, in round 1 the product c0 * M0 is
// (c0 after round 0 does not depend on the quad), and round 2 xors a constant c3. Folding those constants leaves 3
// of round 0's 8 operations, 4 of round 1's and 7 of round 2's; rounds 3 to 9 are whole (philox_round4).
struct PhiloxRow8 {
  __m256i k0[10], k1[10];
  __m256i b;  // round 0: c2 = hi(q M0) ^ b
  __m256i f;  // round 1: c0 = hi(c2 M1) ^ f
  __m256i g;  // round 1: c2 = lo(q M0) ^ g
  __m256i h;  // round 2: c2 = hi(c0 M0) ^ h

  PhiloxRow8(uint64_t seed, uint64_t offset, uint32_t row) {
    constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
    uint32_t k0s[10], k1s[10];
    uint32_t a = static_cast<uint32_t>(seed), bb = static_cast<uint32_t>(seed >> 32);
    for (int r = 0; r < 10; ++r, a += 0x9E3779B9u, bb += 0xBB67AE85u) {
      k0s[r] = a;
      k1s[r] = bb;
      k0[r] = _mm256_set1_epi32(static_cast<int>(a));
      k1[r] = _mm256_set1_epi32(static_cast<int>(bb));
    }
    const uint32_t c1 = row, c2 = static_cast<uint32_t>(offset), c3 = static_cast<uint32_t>(offset >> 32);
    const uint64_t p1 = static_cast<uint64_t>(c2) * kM1;                               // round 0, constant
    const uint32_t c0_r1 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0s[0];             // c0 after round 0
    const uint32_t c1_r1 = static_cast<uint32_t>(p1);                                 // c1 after round 0
    const uint64_t p0_r1 = static_cast<uint64_t>(c0_r1) * kM0;                        // round 1, constant
    const uint32_t c3_r2 = static_cast<uint32_t>(p0_r1);                              // c3 after round 1
    b = _mm256_set1_epi32(static_cast<int>(c3 ^ k1s[0]));
    f = _mm256_set1_epi32(static_cast<int>(c1_r1 ^ k0s[1]));
    g = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(p0_r1 >> 32) ^ k1s[1]));
    h = _mm256_set1_epi32(static_cast<int>(c3_r2 ^ k1s[2]));
  }
};

// One Philox round on 4 quads held one per 64-bit lane (the low 32 bits; the high halves carry don't-care bits,
// which _mm256_mul_epu32 never reads): the 64-bit products are the (hi, lo) pairs directly, so a round is 2
// multiplies, 2 shifts and 4 xors, with no blends to repack 32-bit lanes.
inline void philox_round4(__m256i& c0, __m256i& c1, __m256i& c2, __m256i& c3, __m256i m0, __m256i m1, __m256i k0,
                          __m256i k1) {
  const __m256i p0 = _mm256_mul_epu32(c0, m0), p1 = _mm256_mul_epu32(c2, m1);
  c0 = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(p1, 32), c1), k0);
  c2 = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(p0, 32), c3), k1);
  c1 = p1;
  c3 = p0;
}

// sbd::philox_for_vocab_quad for the 8 quads in the 32-bit lanes of q (in any order), as two sets of 4 in lockstep:
// set 0 holds the even lanes, set 1 the odd ones, so that packing the two sets' low halves puts the quad of lane l
// back in 32-bit lane l. out[k] lane 4 h + l is word l of the quad in lane 2 k + h of q.
inline void philox_words8(const PhiloxRow8& pr, __m256i q, __m256i out[4]) {
  const __m256i m0 = _mm256_set1_epi32(static_cast<int>(0xD2511F53u));
  const __m256i m1 = _mm256_set1_epi32(static_cast<int>(0xCD9E8D57u));
  __m256i c0[2], c1[2], c2[2], c3[2];
  for (int s = 0; s < 2; ++s) {
    const __m256i qs = s ? _mm256_srli_epi64(q, 32) : q;
    // Round 0 (c0 and c1 become constants, not stored) and round 1.
    const __m256i p0 = _mm256_mul_epu32(qs, m0);
    const __m256i c2r1 = _mm256_xor_si256(_mm256_srli_epi64(p0, 32), pr.b);
    const __m256i p1 = _mm256_mul_epu32(c2r1, m1);
    c0[s] = _mm256_xor_si256(_mm256_srli_epi64(p1, 32), pr.f);
    c2[s] = _mm256_xor_si256(p0, pr.g);
    c1[s] = p1;
  }
  for (int s = 0; s < 2; ++s) {  // round 2: c3 is a constant
    const __m256i p0 = _mm256_mul_epu32(c0[s], m0), p1 = _mm256_mul_epu32(c2[s], m1);
    c0[s] = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(p1, 32), c1[s]), pr.k0[2]);
    c2[s] = _mm256_xor_si256(_mm256_srli_epi64(p0, 32), pr.h);
    c1[s] = p1;
    c3[s] = p0;
  }
  for (int r = 3; r < 10; ++r)
    for (int s = 0; s < 2; ++s) philox_round4(c0[s], c1[s], c2[s], c3[s], m0, m1, pr.k0[r], pr.k1[r]);
  // Word l of the quad in lane x into 32-bit lane x, then a 4 x 4 transpose in each 128-bit half and the halves
  // regrouped.
  const auto pack = [](__m256i even, __m256i odd) {
    return _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
  };
  const __m256i w0 = pack(c0[0], c0[1]), w1 = pack(c1[0], c1[1]), w2 = pack(c2[0], c2[1]), w3 = pack(c3[0], c3[1]);
  const __m256i t0 = _mm256_unpacklo_epi32(w0, w1), t1 = _mm256_unpacklo_epi32(w2, w3);
  const __m256i t2 = _mm256_unpackhi_epi32(w0, w1), t3 = _mm256_unpackhi_epi32(w2, w3);
  const __m256i q04 = _mm256_unpacklo_epi64(t0, t1), q15 = _mm256_unpackhi_epi64(t0, t1);
  const __m256i q26 = _mm256_unpacklo_epi64(t2, t3), q37 = _mm256_unpackhi_epi64(t2, t3);
  out[0] = _mm256_permute2x128_si256(q04, q15, 0x20);
  out[1] = _mm256_permute2x128_si256(q26, q37, 0x20);
  out[2] = _mm256_permute2x128_si256(q04, q15, 0x31);
  out[3] = _mm256_permute2x128_si256(q26, q37, 0x31);
}

// sbd::reach_base on 8 lanes.
inline __m256 reach_base8(__m256 xs) {
  const __m256 ax = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), xs);
  return _mm256_fmadd_ps(ax, _mm256_set1_ps(sbd::kBoundRelSlack), xs);
}

// Lanes where reach_base(xs) + gumbel_noise_bound(w) >= best, as a bit mask: the bound's last fma takes the reach
// base as its addend and the bound's constant moves to the right side (best - c0), which the slack also covers.
inline int may_reach_bound8(__m256 base, __m256i w, __m256 best_minus_c0) {
  const __m256i k = _mm256_srli_epi32(_mm256_xor_si256(w, _mm256_set1_epi32(-1)), 9);
  const __m256 kb = _mm256_cvtepi32_ps(_mm256_castps_si256(_mm256_cvtepi32_ps(k)));
  const __m256 v = _mm256_fmadd_ps(kb, _mm256_set1_ps(sbd::kNoiseBoundSlope), base);
  return _mm256_movemask_ps(_mm256_cmp_ps(v, best_minus_c0, _CMP_GE_OQ));
}

#endif

// Gumbel-max sampling of one row, entry by entry in any order: the best exact score and its index, ties to the
// lowest index. `am` may start from a score of another chunk of the row (a floor): it only lets more entries be
// skipped, every one of them strictly below a score that is in the row.
struct RowSampler {
  const EntropySampleParams& p;
  uint32_t row;
  float inv_t;  // 1 / T, for the bounds only (the 2^-20 relative slack of may_reach covers its rounding)
  sbd::ArgmaxState am;
#if defined(SBD_ENTROPY_SAMPLE_AVX2)
  PhiloxRow8 pr;
#endif

  RowSampler(const EntropySampleParams& params, uint32_t r, sbd::ArgmaxState floor)
      : p(params),
        row(r),
        inv_t(1.f / params.temperature),
        am(floor)
#if defined(SBD_ENTROPY_SAMPLE_AVX2)
        ,
        pr(params.seed, params.offset, r)
#endif
  {
  }

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
// Entries [0, n) of a tile starting at vocab index j0 (a multiple of 64), in groups of 64 = 16 Philox quads: the
// noise bound kGumbelNoiseMax first (no Philox for a group where no entry passes), then the per-draw bound.
inline void RowSampler::scan(int64_t j0, const float* x, int64_t n) {
  constexpr int kGroup = 64;
  const __m256 vinv = _mm256_set1_ps(inv_t);
  const __m256i lanes8 = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  alignas(32) float pad[kGroup];
  alignas(32) uint32_t words[kGroup];
  for (int64_t g = 0; g < n; g += kGroup) {
    const float* xg = x + g;
    if (n - g < kGroup) {  // the last, partial group: -inf lanes never pass a bound
      std::fill(pad, pad + kGroup, -INFINITY);
      std::copy(xg, x + n, pad);
      xg = pad;
    }
    __m256 base[8];
    __m256 any = _mm256_setzero_ps();
    const __m256 best_minus_gmax = _mm256_set1_ps(am.best - sbd::kGumbelNoiseMax);
    for (int k = 0; k < 8; ++k) {
      base[k] = reach_base8(_mm256_mul_ps(_mm256_loadu_ps(xg + 8 * k), vinv));
      any = _mm256_or_ps(any, _mm256_cmp_ps(base[k], best_minus_gmax, _CMP_GE_OQ));
    }
    if (_mm256_testz_ps(any, any)) continue;  // no noise lifts any of the 64 entries to the best: no Philox
    const uint32_t q0 = static_cast<uint32_t>((j0 + g) >> 2);
    const __m256i q = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(q0)), lanes8);
    __m256i w[8];  // w[k] lane i: the word of entry g + 8 k + i
    philox_words8(pr, q, w);
    philox_words8(pr, _mm256_add_epi32(q, _mm256_set1_epi32(8)), w + 4);
    const __m256 best_minus_c0 = _mm256_set1_ps(am.best - sbd::kNoiseBoundC0);
    uint64_t pass = 0;
    for (int k = 0; k < 8; ++k)
      pass |= static_cast<uint64_t>(may_reach_bound8(base[k], w[k], best_minus_c0)) << (8 * k);
    if (!pass) continue;
    for (int k = 0; k < 8; ++k) _mm256_store_si256(reinterpret_cast<__m256i*>(words + 8 * k), w[k]);
    for (; pass; pass &= pass - 1) {
      const int i = __builtin_ctzll(pass);
      offer(j0 + g + i, xg[i], words[i]);
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
void run_chunk(const EntropySampleParams& p, int64_t row, int64_t j0, int64_t j1, sbd::ArgmaxState floor,
               sbd::EntropyState* state, sbd::ArgmaxState* best) {
  constexpr int kMaxTiles = static_cast<int>((kVocabChunk + kTile - 1) / kTile);
  const T* src = static_cast<const T*>(p.logits) + row * p.row_stride;
  const bool sample = p.temperature > 0.f;
  // bf16 / fp16: pass 1 converts each tile to fp32 once, into its place in a chunk buffer (64 KB, one per thread,
  // off the stack: worker threads may have small stacks) that pass 2 reads again when sampling; fp32 tiles are read
  // in place.
  constexpr bool kConvert = !std::is_same_v<T, float>;
  float* converted = nullptr;
  if constexpr (kConvert) {
    thread_local std::vector<float> buffer(static_cast<size_t>(kVocabChunk));
    converted = buffer.data();
  }
  const auto tile_ptr = [&](int64_t j, int64_t n, bool fresh) -> const float* {
    if constexpr (kConvert) {
      float* dst = converted + (j - j0);
      if (fresh) load_tile(src + j, n, dst);
      return dst;
    } else {
      return src + j;
    }
  };
  // Pass 1, statistics (and the greedy argmax): every tile once, its max kept for pass 2.
  sbd::EntropyState st = sbd::EntropyState::empty();
  sbd::ArgmaxState am = sbd::ArgmaxState::empty();
  float tile_m[kMaxTiles];
  int tiles = 0;
  for (int64_t j = j0; j < j1; j += kTile, ++tiles) {
    const int64_t n = std::min(kTile, j1 - j);
    const float* x = tile_ptr(j, n, true);
    const float m = tile_max(x, n);
    tile_m[tiles] = m;
    if (m != m || m == INFINITY) {  // NaN or +inf: the row is invalid, nothing else matters
      st.invalid = true;
      break;
    }
    if (m == -INFINITY) continue;  // every entry banned
    st.merge(tile_state(x, n, m));
    if (!sample && m > am.best) am = sbd::ArgmaxState{m, j + first_index_of(x, n, m)};
  }
  *state = st;
  if (!sample || st.invalid) {
    *best = am;
    return;
  }
  // Pass 2, sampling: tiles by decreasing max, so the best score starts from the chunk's max entry and, once the
  // next tile's max cannot reach it, neither can any later one (on LLM-like logits most tiles are never read
  // again). The chunk (64 KB of fp32) is still in L2. The visiting order does not change the token: RowSampler
  // compares (score, lowest index first).
  int order[kMaxTiles];
  for (int t = 0; t < tiles; ++t) order[t] = t;
  std::stable_sort(order, order + tiles, [&](int a, int b) { return tile_m[a] > tile_m[b]; });
  RowSampler sampler(p, static_cast<uint32_t>(row), floor);
  for (int i = 0; i < tiles; ++i) {
    const int t = order[i];
    const float m = tile_m[t];
    if (m == -INFINITY || !sbd::may_reach(m * sampler.inv_t, sbd::kGumbelNoiseMax, sampler.am.best)) break;
    const int64_t j = j0 + static_cast<int64_t>(t) * kTile;
    const int64_t n = std::min(kTile, j1 - j);
    sampler.tile(j, tile_ptr(j, n, false), n, m);
  }
  *best = sampler.am;
}

}  // namespace

void entropy_sample_chunk(const EntropySampleParams& p, int64_t row, int64_t j0, int64_t j1, sbd::ArgmaxState floor,
                          sbd::EntropyState* state, sbd::ArgmaxState* best) {
  switch (p.dtype) {
    case LogitsDtype::kFloat32:
      return run_chunk<float>(p, row, j0, j1, floor, state, best);
    case LogitsDtype::kBFloat16:
      return run_chunk<c10::BFloat16>(p, row, j0, j1, floor, state, best);
    case LogitsDtype::kFloat16:
      return run_chunk<c10::Half>(p, row, j0, j1, floor, state, best);
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace sbd_cpu
