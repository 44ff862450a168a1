// block_attention on the CPU, compiled once per ISA (setup.py): flash attention over the cache and the new rows.
//
// Work unit = (b, kv head, panel of query lanes, cache split). The g = Hq / Hkv query heads of the kv head times
// the n_valid[b] valid new rows are packed into one tile of "lanes" (GQA packing: every K/V row loaded is used by
// all g heads), stored transposed and pre-scaled: QT [D][lanes]. The keys are walked in blocks of kBlock rows:
// the unit's cache range, then (last split only) the valid new rows, the only block that needs a mask. Per block
// and per tile of kTileLanes lanes:
//   S^T [keys][lanes] = K_blk . QT                     (micro-kernel: broadcast a K element, FMA a lane vector)
//   online softmax down the key axis                   (per-lane running max / sum are plain vectors: no
//                                                       horizontal reductions anywhere)
//   O^T [D][lanes] = O^T * alpha + V_blk^T . P^T       (the same micro-kernel, broadcasting V elements)
// Both products have the lanes as the vector axis, so K and V are read in place from the cache with their own
// strides (fp32) or after an fp32 conversion of the block (bf16 / fp16), and nothing is transposed per block.
// Accumulation is fp32; the rescale is fused into the load of the accumulators. Padding rows (>= n_valid) take
// no lanes and are written as zeros.
//
// Model features (sbd/block_attention_params.h): soft-capping maps the scaled scores before the mask (softmax_tile,
// row_block); a sliding window starts each unit's cache range at the first row its first lane sees (split_range)
// and masks, per block, the keys before each lane's window (block_bounds) with the same mask as the causal rule.
//
// A unit with fewer lanes than a vector (NTP decode: T = 1, g = 4 is 4 of 16 lanes) takes the rows path instead
// (row_block): vectors run along the keys and the head dimension, at the price of transposing each K block.
// At NTP decode shapes it is the faster of the two paths (bench/ops/bench_block_attention.py;
// bench/results/cpu_ops.csv).
//
// With p.gemm (bf16 / fp16 on CPUs with bf16 / fp16 matrix units, see block_attention_use_gemm) the two products
// go to ATen's cpublas GEMM on the input type instead (GemmUnitRunner): oneDNN's matmul on AMX tiles or
// vdpbf16ps, the call PyTorch's own CPU flash attention makes. The work units, the online softmax (softmax_tile)
// and the partial states are this file's.
//
// With p.tiles (bf16 where the AMX-BF16 tiles are on, AVX-512 variant) the products run on the tiles directly
// (block_attention_tiles.h, TilesUnitRunner), with the same units, softmax and partial states.
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <type_traits>
#include <utility>

#include "cpu/aligned_buffer.h"
#include "cpu/block_attention_kernel.h"
#include "sbd/softmax_state.h"

#if defined(CPU_CAPABILITY_AVX512)
#include "cpu/amx_tiles.h"
#endif

namespace sbd_cpu {
namespace CPU_CAPABILITY {

using Vec = at::vec::Vectorized<float>;

namespace {

constexpr int W = Vec::size();

// Register tile of the micro-kernel: kRI broadcast rows x kRM lane vectors of accumulators. AVX-512 has 32
// registers: 6 x 4 = 24 accumulators + 4 lane vectors + 1 broadcast. AVX2 / the 8-wide default have 16.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kRI = 6;
constexpr int kRM = 4;
#else
constexpr int kRI = 4;
constexpr int kRM = 2;
#endif
constexpr int64_t kTileLanes = int64_t{kRM} * W;
// Keys per block: the scores tile kBlock x kTileLanes (AVX-512: 96 x 64 fp32 = 24 KB) is reread from L1/L2 by the
// second product, and the rescale of O^T is paid once per block. 48, 96 and 192 time the same within noise at
// Llama shapes (bench/ops/bench_block_attention.py); a multiple of kRI so only a range's end is ragged.
constexpr int64_t kBlock = 16 * kRI;

// C[i][0 : RM*W) = (cscale ? C[i] * cscale : 0) + sum_k A[i * a_i + k * a_k] * Bt[k * ldb + (0 : RM*W)], i < RI.
template <int RI, int RM>
void micro_kernel(const float* __restrict A, int64_t a_i, int64_t a_k, const float* __restrict Bt, int64_t ldb,
                  float* __restrict C, int64_t ldc, int64_t K, const float* __restrict cscale) {
  Vec c[RI][RM];
  if (cscale != nullptr) {
    Vec s[RM];
#pragma GCC unroll 8
    for (int j = 0; j < RM; ++j) s[j] = Vec::loadu(cscale + j * W);
#pragma GCC unroll 8
    for (int i = 0; i < RI; ++i)
#pragma GCC unroll 8
      for (int j = 0; j < RM; ++j) c[i][j] = Vec::loadu(C + i * ldc + j * W) * s[j];
  } else {
#pragma GCC unroll 8
    for (int i = 0; i < RI; ++i)
#pragma GCC unroll 8
      for (int j = 0; j < RM; ++j) c[i][j] = Vec(0.f);
  }
  for (int64_t k = 0; k < K; ++k) {
    Vec b[RM];
#pragma GCC unroll 8
    for (int j = 0; j < RM; ++j) b[j] = Vec::loadu(Bt + k * ldb + j * W);
    const float* a = A + k * a_k;
#pragma GCC unroll 8
    for (int i = 0; i < RI; ++i) {
      const Vec ai(a[i * a_i]);
#pragma GCC unroll 8
      for (int j = 0; j < RM; ++j) c[i][j] = at::vec::fmadd(ai, b[j], c[i][j]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < RI; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < RM; ++j) c[i][j].store(C + i * ldc + j * W);
}

using MicroKernel = void (*)(const float*, int64_t, int64_t, const float*, int64_t, float*, int64_t, int64_t,
                             const float*);

template <std::size_t... I>
constexpr std::array<MicroKernel, sizeof...(I)> make_micro_kernels(std::index_sequence<I...>) {
  return {{&micro_kernel<static_cast<int>(I / kRM) + 1, static_cast<int>(I % kRM) + 1>...}};
}
// Every (ri, rm) edge shape, so ragged key / head-dim / lane counts need no padding.
constexpr auto kMicroKernels = make_micro_kernels(std::make_index_sequence<kRI * kRM>{});

inline MicroKernel micro_kernel_for(int64_t ri, int64_t rm) { return kMicroKernels[(ri - 1) * kRM + (rm - 1)]; }

// The running state of W lanes after a block: m_new = max(m_old, the block's max), off = softmax_offset(m_new), sum
// = the block's e^(s - off) summed in ascending key order. One function for both paths (the lanes path calls it on
// its lane vectors, the rows path on its lanes gathered), so a lane's state is rounded alike whichever path ran it:
// alpha = e^(m_old - off) by the vector exp, l = fma(l, alpha, sum).
inline void lane_state(const Vec& m_old, const Vec& m_new, const Vec& off, const Vec& sum, float* run_m, float* run_l,
                       float* alpha) {
  const Vec a = (m_old - off).exp();
  at::vec::fmadd(Vec::loadu(run_l), a, sum).store(run_l);
  m_new.store(run_m);
  a.store(alpha);
}

// One block of nb keys for the lanes [0, nvec * W) of a tile. The scores st [nb][ld] become e^(s - offset) in
// place; the lanes' running (m, l) absorb the block and alpha receives the factor their earlier accumulators
// must be scaled by. The vector form of sbd::SoftmaxState::push_block. The scores are soft-capped first when
// softcap > 0 (sbd::soft_cap). lo / hi (both null when no key of the block is hidden from any lane) carry the mask
// (block_bounds): key n is visible to a lane when lo[lane] <= n <= hi[lane].
// kFastExp: the probabilities by exp_u20 (the tiles path, which rounds them to bf16 next, as PyTorch's flash
// attention does); the running state's factor stays the full-precision exp.
template <bool kFastExp = false>
void softmax_tile(float* st, int64_t ld, int64_t nb, int64_t nvec, float softcap, const float* lo, const float* hi,
                  float* run_m, float* run_l, float* alpha) {
  const Vec ninf(-INFINITY), zero(0.f);
  for (int64_t j = 0; j < nvec; ++j) {
    float* col = st + j * W;
    if (softcap > 0.f) {
      const Vec cap(softcap);
      for (int64_t n = 0; n < nb; ++n) (cap * (Vec::loadu(col + n * ld) / cap).tanh()).store(col + n * ld);
    }
    Vec bmax(-INFINITY);
    if (hi != nullptr) {
      const Vec vlo = Vec::loadu(lo + j * W), vhi = Vec::loadu(hi + j * W);
      for (int64_t n = 0; n < nb; ++n) {
        const Vec vn(static_cast<float>(n));
        const Vec s = Vec::blendv(Vec::loadu(col + n * ld), ninf, (vn > vhi) | (vn < vlo));
        s.store(col + n * ld);
        bmax = at::vec::maximum(bmax, s);
      }
    } else {
      for (int64_t n = 0; n < nb; ++n) bmax = at::vec::maximum(bmax, Vec::loadu(col + n * ld));
    }
    const Vec m_old = Vec::loadu(run_m + j * W);
    const Vec m_new = at::vec::maximum(m_old, bmax);
    const Vec off = Vec::blendv(m_new, zero, m_new == ninf);  // sbd::softmax_offset
    Vec sum(0.f);
    for (int64_t n = 0; n < nb; ++n) {
      const Vec x = Vec::loadu(col + n * ld) - off;
      Vec e;
      if constexpr (kFastExp) {
        e = x.exp_u20();
      } else {
        e = x.exp();
      }
      e.store(col + n * ld);
      sum = sum + e;
    }
    lane_state(m_old, m_new, off, sum, run_m + j * W, run_l + j * W, alpha + j * W);
  }
}

// bf16 / fp16 row -> fp32.
template <typename T>
inline void to_float_row(const T* src, float* dst, int64_t n) {
  int64_t d = 0;
  for (; d + W <= n; d += W) {
    Vec x;
    at::vec::load_to_float<T>(src + d, x);
    x.store(dst + d);
  }
  for (; d < n; ++d) dst[d] = static_cast<float>(src[d]);
}

using Buffer = AlignedBuffer<float>;

Buffer alloc_floats(int64_t n) { return alloc_aligned<float>(n); }

// QT and O^T are stored tile by tile, [lanes / kTileLanes][D][kTileLanes], so that the part of QT one micro-kernel
// call streams (D x kTileLanes fp32, 32 KB on AVX-512) is contiguous rather than rows a power-of-two stride apart
// (which would map onto half of the L1 sets).
inline int64_t tiled_lanes(int64_t lanes) { return (lanes + kTileLanes - 1) / kTileLanes * kTileLanes; }
inline int64_t tiled_index(int64_t D, int64_t d, int64_t m) {
  return ((m / kTileLanes) * D + d) * kTileLanes + m % kTileLanes;
}

// Per-thread working set, sized for the largest panel: `D` values per row, `lanes` panel lanes, `widen` for the
// fp32 copies of a bf16 / fp16 block.
struct Workspace {
  Buffer qt, ot, st, kf, vf, gk, gv, kt, ones, run_m, run_l, alpha, lo, hi, sums;
  // per lane: the first key position its window shows (0 without a window) and the last key it sees (-1: none)
  std::unique_ptr<int64_t[]> first, last, tile_last;
  int64_t D, lanes;
  bool widen;
  Workspace(int64_t D_, int64_t lanes_, bool widen_)
      : qt(alloc_floats(D_ * tiled_lanes(lanes_))),
        ot(alloc_floats(D_ * tiled_lanes(lanes_))),
        st(alloc_floats(kBlock * kTileLanes)),
        kf(alloc_floats(widen_ ? kBlock * D_ : 0)),
        vf(alloc_floats(widen_ ? kBlock * D_ : 0)),
        gk(alloc_floats(kBlock * D_)),  // a block with set-block rows gathered (element type <= 4 bytes)
        gv(alloc_floats(kBlock * D_)),
        kt(alloc_floats(D_ * kBlock)),
        ones(alloc_floats(kTileLanes)),
        run_m(alloc_floats(lanes_)),
        run_l(alloc_floats(lanes_)),
        alpha(alloc_floats(kTileLanes)),
        lo(alloc_floats(kTileLanes)),
        hi(alloc_floats(kTileLanes)),
        sums(alloc_floats(4 * W)),
        first(new int64_t[static_cast<size_t>(tiled_lanes(lanes_))]),
        last(new int64_t[static_cast<size_t>(tiled_lanes(lanes_))]),
        tile_last(new int64_t[static_cast<size_t>(tiled_lanes(lanes_) / kTileLanes)]),
        D(D_),
        lanes(lanes_),
        widen(widen_) {
    std::fill(ones.get(), ones.get() + kTileLanes, 1.f);
  }

  bool fits(const BlockAttentionParams& p) const {
    return p.D <= D && p.panel_lanes <= lanes && (widen || p.dtype == AttnDtype::kFloat32);
  }

  // This thread's workspace for a call of `p`: kept between calls (a decoding forward calls the op once per layer,
  // ~18 allocations each time otherwise), rebuilt larger when a call needs more (panels are at most kMaxPanelLanes).
  static Workspace& of_thread(const BlockAttentionParams& p) {
    static thread_local std::unique_ptr<Workspace> ws;
    if (!ws || !ws->fits(p)) {
      const bool widen = p.dtype != AttnDtype::kFloat32 || (ws && ws->widen);
      ws = std::make_unique<Workspace>(std::max(p.D, ws ? ws->D : 0), std::max(p.panel_lanes, ws ? ws->lanes : 0),
                                       widen);
    }
    std::fill(ws->kt.get(), ws->kt.get() + p.D * kBlock, 0.f);  // its ragged columns are computed on, then masked
    return *ws;
  }
};

// The lanes of one unit and where its keys come from.
struct Unit {
  int64_t b, kvh, g, nv, lane0, lanes, mp;  // mp: lanes rounded up to W
  int64_t split;
};

Unit describe(const BlockAttentionParams& p, int64_t item) {
  Unit u;
  u.b = item / (p.Hkv * p.n_panels);
  u.kvh = (item / p.n_panels) % p.Hkv;
  const int64_t panel = item % p.n_panels;
  u.g = p.Hq / p.Hkv;
  u.nv = p.valid(u.b);
  u.lane0 = panel * p.panel_lanes;
  u.lanes = std::clamp<int64_t>(u.g * u.nv - u.lane0, 0, p.panel_lanes);
  u.mp = (u.lanes + W - 1) / W * W;
  u.split = 0;
  return u;
}

template <typename T>
T* out_row(const BlockAttentionParams& p, const Unit& u, int64_t t, int64_t h) {
  return static_cast<T*>(p.out) + ((u.b * p.T + t) * p.Hq + u.kvh * u.g + h) * p.D;
}

// Zero output rows for the padding rows t >= n_valid. Done by split 0 of panel 0 of each (b, kv head). (The
// committed rows' K/V are in the cache before any unit runs: append_committed in block_attention_cpu.cpp.)
template <typename T>
void pad_rows(const BlockAttentionParams& p, const Unit& u) {
  if (u.g > 0)
    for (int64_t t = u.nv; t < p.T; ++t)
      std::memset(out_row<T>(p, u, t, 0), 0, u.g * p.D * sizeof(T));  // the g heads of this kv head are adjacent
}

// Keys by absolute position: cache row j is position j, new row t is position cache_len + t. Split s of a unit
// covers the positions [s * split_keys, (s + 1) * split_keys) (the last split: to the end), and a split's keys are
// walked in blocks aligned to absolute multiples of the block size. So the blocks (and splits) a key falls in, and
// with them every sum a lane makes, depend only on the key's position -- not on how many rows share the forward or
// where the cache ends and the new rows begin: a row's output is the one it gets alone (batch invariance).
inline std::pair<int64_t, int64_t> split_range(const BlockAttentionParams& p, const Unit& u) {
  const int64_t k0 = u.split * p.split_keys;
  return {k0, u.split == p.n_splits - 1 ? std::numeric_limits<int64_t>::max() : k0 + p.split_keys};
}

// Unit `unit` described, after its share of the padding (split 0 of panel 0 of its (b, kv head)).
template <typename T>
Unit begin_unit(const BlockAttentionParams& p, int64_t unit) {
  Unit u = describe(p, unit / p.n_splits);
  u.split = unit % p.n_splits;
  if (u.lane0 == 0 && u.split == 0) pad_rows<T>(p, u);
  return u;
}

// The unit's keys from position first_key to last_key (its lanes' union), within its split, in blocks of at most
// `rows` that end at absolute multiples of `rows`, as fn(k rows, k row stride, v rows, v row stride, n rows, pos0),
// pos0 the position of the block's first key. The committed rows are in the cache already (the binding appends them
// before any unit runs), so a block of cache rows and committed rows -- the cache's end included -- is read in place
// from the cache; one that holds set-block rows is gathered into gk / gv (rows x D each). The V of a set-block row
// (never stored: the drafter's rows) is read with its non-finite values as 0, so that a row that does not see it gets an exact zero from it (a
// hidden key's probability is 0, and 0 * NaN would be NaN): a drafter's NaN costs its drafts, never the committed
// rows (sbd_ext.reference.block_attention has the same rule).
template <typename T, typename Fn>
void for_each_key_block(const BlockAttentionParams& p, const Unit& u, int64_t rows, int64_t first_key,
                        int64_t last_key, T* gk, T* gv, Fn&& fn) {
  const auto [s0, s1] = split_range(p, u);
  // From first_key itself (no row before the earliest window is read), then the aligned blocks: a lane whose
  // window starts later sees the keys before its start as hidden keys of the same block (exact zeros).
  const int64_t k0 = std::max(s0, first_key), k1 = std::min(s1, last_key + 1);
  const int64_t len = p.cache_len(u.b), D = p.D, block0 = len + p.commit(u.b);
  const T* kc = static_cast<const T*>(p.k_cache) + u.b * p.kc_sb + u.kvh * p.kc_sh;
  const T* vc = static_cast<const T*>(p.v_cache) + u.b * p.vc_sb + u.kvh * p.vc_sh;
  const T* kn = static_cast<const T*>(p.k) + u.b * p.k_sb + u.kvh * p.k_sh;
  const T* vn = static_cast<const T*>(p.v) + u.b * p.v_sb + u.kvh * p.v_sh;
  for (int64_t j = k0; j < k1;) {
    const int64_t j1 = std::min(k1, (j / rows + 1) * rows), nb = j1 - j;
    if (j1 <= block0) {
      fn(kc + j * p.kc_st, p.kc_st, vc + j * p.vc_st, p.vc_st, nb, j);
    } else {
      for (int64_t n = 0; n < nb; ++n) {
        const int64_t pos = j + n;
        const T* ks = pos < block0 ? kc + pos * p.kc_st : kn + (pos - len) * p.k_st;
        const T* vs = pos < block0 ? vc + pos * p.vc_st : vn + (pos - len) * p.v_st;
        std::memcpy(gk + n * D, ks, D * sizeof(T));
        std::memcpy(gv + n * D, vs, D * sizeof(T));
        if (pos >= block0)
          for (int64_t d = 0; d < D; ++d)
            if (!std::isfinite(static_cast<float>(gv[n * D + d]))) gv[n * D + d] = T(0.f);
      }
      fn(gk, D, gv, D, nb, j);
    }
    j = j1;
  }
}

// The last key position lane (row t) sees: a committed row (t < n_commit) its own position, a set-block row the
// last valid new row's.
inline int64_t lane_last_key(int64_t len, int64_t t, int64_t n_commit, int64_t n_valid) {
  return t < n_commit ? len + t : len + n_valid - 1;
}

// The first key position lane (row t) sees: the start of its sliding window, at the row's position cache_len + t.
inline int64_t lane_first_key(const BlockAttentionParams& p, int64_t cache_len, int64_t t) {
  return sbd::window_first_key(cache_len + t, p.window_left);
}

// The mask of one block of nb keys, the first at position pos0, for n lanes that see the positions [first[m],
// last[m]] (last -1: a padding lane, sees nothing): key i of the block is visible to lane m when lo[m] <= i <=
// hi[m]. Returns false, leaving lo / hi unspecified, when every key is visible to every lane.
inline bool block_bounds(const int64_t* first, const int64_t* last, int64_t n, int64_t nb, int64_t pos0, float* lo,
                         float* hi) {
  bool masked = false;
  for (int64_t m = 0; m < n; ++m) {
    const int64_t f = first[m] - pos0, l = last[m] - pos0;  // both clamped to [-1, nb]: exact in fp32
    lo[m] = static_cast<float>(std::clamp<int64_t>(f, 0, nb));
    hi[m] = static_cast<float>(std::clamp<int64_t>(l, -1, nb));
    masked = masked || f > 0 || l < nb - 1;
  }
  return masked;
}

// A unit's result from its running softmax state (run_m, run_l per lane) and unnormalised accumulator acc(d, m):
// with one split the output rows (zeros when no key block was seen: first), else its partial state for
// block_attention_merge (acc^T [D][panel_lanes], m, l; l = 0 marks an empty split, whose acc is not read).
template <typename T, typename Acc>
void finish_unit(const BlockAttentionParams& p, const Unit& u, int64_t unit, bool first, const float* run_m,
                 const float* run_l, Acc&& acc) {
  const int64_t D = p.D;
  if (p.n_splits == 1) {
    for (int64_t m = 0; m < u.lanes; ++m) {
      const int64_t lane = u.lane0 + m;
      const float inv = first ? 0.f : sbd::SoftmaxState{run_m[m], run_l[m]}.inv_sum();
      T* o = out_row<T>(p, u, lane % u.nv, lane / u.nv);
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(first ? 0.f : acc(d, m) * inv);
    }
    return;
  }
  const int64_t pl = p.panel_lanes;
  float* part = p.partials + unit * p.partial_floats();
  if (!first)
    for (int64_t d = 0; d < D; ++d)
      for (int64_t m = 0; m < u.lanes; ++m) part[d * pl + m] = acc(d, m);
  for (int64_t m = 0; m < u.lanes; ++m) {
    part[D * pl + m] = first ? -INFINITY : run_m[m];
    part[(D + 1) * pl + m] = first ? 0.f : run_l[m];
  }
}

template <typename T>
class UnitRunner {
 public:
  UnitRunner(const BlockAttentionParams& p, Workspace& ws) : p_(p), ws_(ws) {}

  void run(int64_t unit) {
    const Unit u = begin_unit<T>(p_, unit);
    if (u.lanes == 0) return;
    // Fewer lanes than a vector (decode: T = 1) would fill a fraction of each lane vector: vectorise over keys and
    // the head dimension instead (rows path, see row_block); it needs whole vectors along D. Both paths round every
    // lane alike (the same sums in the same order), so which one runs does not change a lane's result.
    rows_ = u.lanes < W && p_.D % W == 0;
    pack_queries(u);
    first_ = true;
    const auto visit = [&](const T* kp, int64_t ks, const T* vp, int64_t vs, int64_t nb, int64_t pos0) {
      block(u, kp, ks, vp, vs, nb, pos0);
    };
    for_each_key_block<T>(p_, u, kBlock, first_key_, last_key_, reinterpret_cast<T*>(ws_.gk.get()),
                          reinterpret_cast<T*>(ws_.gv.get()), visit);
    finish_unit<T>(p_, u, unit, first_, ws_.run_m.get(), ws_.run_l.get(),
                   [&](int64_t d, int64_t m) { return ws_.ot[q_index(d, m)]; });
  }

 private:
  // QT (tiled) = scale * q of the unit's lanes (zero beyond them); each lane's first / last key (last -1 for the
  // padding lanes up to mp), the last per tile and the unit's key range; O^T zero; state reset.
  void pack_queries(const Unit& u) {
    const int64_t D = p_.D, mp = u.mp, c = p_.commit(u.b), len = p_.cache_len(u.b);
    float* qt = ws_.qt.get();
    last_key_ = -1;
    first_key_ = lane_first_key(p_, len, 0);  // the earliest row's window start: no lane sees a key before it
    for (int64_t m = 0; m < mp; ++m) {
      const int64_t lane = u.lane0 + m;
      if (m < u.lanes) {
        const int64_t h = lane / u.nv, t = lane % u.nv;
        const T* q = static_cast<const T*>(p_.q) + u.b * p_.q_sb + (u.kvh * u.g + h) * p_.q_sh + t * p_.q_st;
        for (int64_t d = 0; d < D; ++d) qt[q_index(d, m)] = static_cast<float>(q[d]) * p_.scale;
        ws_.last[m] = lane_last_key(len, t, c, u.nv);
        ws_.first[m] = lane_first_key(p_, len, t);
      } else {
        for (int64_t d = 0; d < D; ++d) qt[q_index(d, m)] = 0.f;
        ws_.last[m] = -1;
        ws_.first[m] = 0;
      }
      ws_.run_m[m] = -INFINITY;
      ws_.run_l[m] = 0.f;
      int64_t& tl = ws_.tile_last[m / kTileLanes];
      tl = m % kTileLanes == 0 ? ws_.last[m] : std::max(tl, ws_.last[m]);
      last_key_ = std::max(last_key_, ws_.last[m]);
    }
    // O^T from zero: every block scales it by its alpha (0 until a lane sees a key), so a tile that skips a block
    // (none of its lanes sees it) and a lane whose first keys are hidden accumulate exactly as from the start.
    std::fill(ws_.ot.get(), ws_.ot.get() + (rows_ ? u.lanes : tiled_lanes(mp)) * D, 0.f);
  }

  // The nb keys from position pos0.
  void block(const Unit& u, const T* kp, int64_t ks, const T* vp, int64_t vs, int64_t nb, int64_t pos0) {
    const int64_t D = p_.D;
    const float* kf;
    const float* vf;
    int64_t kfs = ks, vfs = vs;
    if constexpr (std::is_same_v<T, float>) {
      kf = kp;
      vf = vp;
    } else {
      for (int64_t n = 0; n < nb; ++n) {
        to_float_row(kp + n * ks, ws_.kf.get() + n * D, D);
        to_float_row(vp + n * vs, ws_.vf.get() + n * D, D);
      }
      kf = ws_.kf.get();
      vf = ws_.vf.get();
      kfs = vfs = D;
    }
    if (rows_) {
      row_block(u, kf, kfs, vf, vfs, nb, pos0);
    } else {
      lane_block(u, kf, kfs, vf, vfs, nb, pos0);
    }
    first_ = false;
  }

  // Lanes path: the lanes are the vector axis of both products (see the file comment).
  void lane_block(const Unit& u, const float* kf, int64_t kfs, const float* vf, int64_t vfs, int64_t nb,
                  int64_t pos0) {
    const int64_t D = p_.D, mp = u.mp;
    float* st = ws_.st.get();
    for (int64_t m0 = 0; m0 < mp; m0 += kTileLanes) {
      if (pos0 > ws_.tile_last[m0 / kTileLanes]) continue;  // no lane of the tile sees these keys
      const int64_t rm = std::min<int64_t>(kRM, (mp - m0) / W);
      for (int64_t n = 0; n < nb; n += kRI) {
        const int64_t ri = std::min<int64_t>(kRI, nb - n);
        micro_kernel_for(ri, rm)(kf + n * kfs, kfs, 1, ws_.qt.get() + m0 * D, kTileLanes, st + n * kTileLanes,
                                 kTileLanes, D, nullptr);
      }
      const bool masked = block_bounds(ws_.first.get() + m0, ws_.last.get() + m0, rm * W, nb, pos0, ws_.lo.get(),
                                       ws_.hi.get());
      softmax_tile(st, kTileLanes, nb, rm, p_.softcap, masked ? ws_.lo.get() : nullptr,
                   masked ? ws_.hi.get() : nullptr, ws_.run_m.get() + m0, ws_.run_l.get() + m0, ws_.alpha.get());
      for (int64_t d = 0; d < D; d += kRI) {
        const int64_t ri = std::min<int64_t>(kRI, D - d);
        micro_kernel_for(ri, rm)(vf + d, 1, vfs, st, kTileLanes, ws_.ot.get() + m0 * D + d * kTileLanes, kTileLanes,
                                 nb, ws_.alpha.get());
      }
    }
  }

  // Rows path, for lanes < W: Q [lanes][D] and O [lanes][D] row-major, K^T [D][kBlock] transposed per block.
  //   S [lanes][keys] = Q . K^T        (broadcast a q element, FMA a vector of keys)
  //   softmax along each row           (each lane's max, e^(s - off), and its sum in ascending key order; the
  //                                     lanes' state by lane_state, as the lanes path does)
  //   O = O * alpha + P . V            (broadcast a probability, FMA a vector of V's head dimension)
  // Every vector is full however few lanes there are; the price is the transpose of each K block. The sums are the
  // lanes path's, term for term: a score is an FMA chain over d from zero, P . V one over the keys from O * alpha.
  void row_block(const Unit& u, const float* kf, int64_t kfs, const float* vf, int64_t vfs, int64_t nb,
                 int64_t pos0) {
    const int64_t D = p_.D, lanes = u.lanes, nbw = (nb + W - 1) / W * W;  // kBlock is a multiple of W
    float* kt = ws_.kt.get();
    float* st = ws_.st.get();  // [lanes][kBlock]
    at::vec::transpose_mxn<float>(kf, kfs, kt, kBlock, static_cast<int>(nb), static_cast<int>(D));
    for (int64_t m0 = 0; m0 < lanes; m0 += kRI) {
      const int64_t ri = std::min<int64_t>(kRI, lanes - m0);
      for (int64_t n0 = 0; n0 < nbw; n0 += kTileLanes) {
        const int64_t rm = std::min<int64_t>(kRM, (nbw - n0) / W);
        micro_kernel_for(ri, rm)(ws_.qt.get() + m0 * D, D, 1, kt + n0, kBlock, st + m0 * kBlock + n0, kBlock, D,
                                 nullptr);
      }
    }
    // per lane (< W of them): m_old, m_new, off, sum, gathered for lane_state
    float* g_old = ws_.sums.get();
    float* g_new = g_old + W;
    float* g_off = g_new + W;
    float* g_sum = g_off + W;
    for (int64_t m = 0; m < W; ++m) {
      g_old[m] = g_new[m] = -INFINITY;
      g_off[m] = g_sum[m] = 0.f;
    }
    const Vec ninf(-INFINITY);
    for (int64_t m = 0; m < lanes; ++m) {
      float* row = st + m * kBlock;
      if (p_.softcap > 0.f) {
        const Vec cap(p_.softcap);
        for (int64_t n = 0; n < nbw; n += W) (cap * (Vec::loadu(row + n) / cap).tanh()).store(row + n);
      }
      for (int64_t n = nb; n < nbw; ++n) row[n] = -INFINITY;  // the transposed block's ragged edge
      float lo, hi;  // the causal / set-block rule and the window (block_bounds): keys outside [lo, hi] are hidden
      if (block_bounds(ws_.first.get() + m, ws_.last.get() + m, 1, nb, pos0, &lo, &hi))
        for (int64_t n = 0; n < nb; ++n)
          if (static_cast<float>(n) < lo || static_cast<float>(n) > hi) row[n] = -INFINITY;
      Vec vmax = ninf;
      for (int64_t n = 0; n < nbw; n += W) vmax = at::vec::maximum(vmax, Vec::loadu(row + n));
      const float bmax = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, vmax);
      const float m_old = ws_.run_m[m], m_new = m_old > bmax ? m_old : bmax;
      const float off = sbd::softmax_offset(m_new);
      const Vec voff(off);
      for (int64_t n = 0; n < nbw; n += W) (Vec::loadu(row + n) - voff).exp().store(row + n);
      g_old[m] = m_old;
      g_new[m] = m_new;
      g_off[m] = off;
    }
    // Each lane's sum in ascending key order, as the lanes path's vector sum per lane, four lanes' chains at a
    // time in registers so that they overlap (a chain costs one add's latency per key). Lane by lane, a one-row
    // SmolLM2 call (g = 3 lanes, 64 / 128 / 192 cached keys, L2-resident) took 6.75 / 10.3 / 13.9 us; this way
    // 6.5 / 10.0 / 13.55 (AMD EPYC Zen 4, 1 thread, 2026-12-08).
    for (int64_t m0 = 0; m0 < lanes; m0 += 4) {
      const int64_t c = std::min<int64_t>(4, lanes - m0);
      const float* r0 = st + m0 * kBlock;
      const float* r1 = c > 1 ? r0 + kBlock : r0;  // a lane past the last sums lane m0 again, unused
      const float* r2 = c > 2 ? r0 + 2 * kBlock : r0;
      const float* r3 = c > 3 ? r0 + 3 * kBlock : r0;
      float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
      for (int64_t n = 0; n < nb; ++n) {
        s0 += r0[n];
        s1 += r1[n];
        s2 += r2[n];
        s3 += r3[n];
      }
      const float got[4] = {s0, s1, s2, s3};
      for (int64_t j = 0; j < c; ++j) g_sum[m0 + j] = got[j];
    }
    float* alpha = ws_.alpha.get();
    float lane_m[W], lane_l[W];
    for (int64_t m = 0; m < W; ++m) {
      lane_m[m] = m < lanes ? ws_.run_m[m] : -INFINITY;
      lane_l[m] = m < lanes ? ws_.run_l[m] : 0.f;
    }
    lane_state(Vec::loadu(g_old), Vec::loadu(g_new), Vec::loadu(g_off), Vec::loadu(g_sum), lane_m, lane_l, alpha);
    for (int64_t m = 0; m < lanes; ++m) {
      ws_.run_m[m] = lane_m[m];
      ws_.run_l[m] = lane_l[m];
      float* o = ws_.ot.get() + m * D;
      for (int64_t d = 0; d < D; d += W) (Vec::loadu(o + d) * Vec(alpha[m])).store(o + d);
    }
    for (int64_t m0 = 0; m0 < lanes; m0 += kRI) {
      const int64_t ri = std::min<int64_t>(kRI, lanes - m0);
      for (int64_t d0 = 0; d0 < D; d0 += kTileLanes) {
        const int64_t rm = std::min<int64_t>(kRM, (D - d0) / W);
        micro_kernel_for(ri, rm)(st + m0 * kBlock, kBlock, 1, vf + d0, vfs, ws_.ot.get() + m0 * D + d0, D, nb,
                                 ws_.ones.get());
      }
    }
  }

  // Where lane m's element d lives in QT / O^T (lanes path, tiled) or Q / O (rows path, row-major).
  int64_t q_index(int64_t d, int64_t m) const { return rows_ ? m * p_.D + d : tiled_index(p_.D, d, m); }

  const BlockAttentionParams& p_;
  Workspace& ws_;
  bool first_ = true;  // no key block processed yet (an empty split: its partial state is empty)
  bool rows_ = false;  // this unit takes the rows path
  int64_t first_key_ = 0, last_key_ = -1;
};

// ---- the GEMM path ---------------------------------------------------------------------------------------------
// Per block of nb <= kGemmBlock keys, for the unit's lanes (rows of the products: M; QT and S^T keep mp >= lanes
// columns, the lanes rounded up to a vector, so the softmax runs on whole vectors):
//   S^T [nb][mp] = K_blk [nb][D] . QT [D][mp]        K read in place with its row stride; QT unscaled, input type
//   S^T *= scale; online softmax down the key axis   softmax_tile, the lanes path's own code
//   P [lanes][nb] = S^T transposed, input type       (the rounding PyTorch's flash attention makes too)
//   O [lanes][D] = O * alpha + P . V_blk [nb][D]     V read in place; O fp32
// Both products are at::native::cpublas::brgemm with plain row-major operands (is_vnni = false), whose bf16 /
// fp16 / fp32 form is cpublas::gemm: oneDNN's matmul (AMX tiles, vdpbf16ps) where the CPU has the units.
constexpr int64_t kGemmBlock = 2 * kBlock;

struct GemmWorkspace {
  Buffer st, o, run_m, run_l, alpha, lo, hi;
  std::unique_ptr<int64_t[]> first, last;  // per lane: its first and last key (UnitRunner's)
  std::unique_ptr<char[]> qt, pm, gk, gv;  // input-type QT [D][mp], P [lanes][kGemmBlock], a gathered K / V block
  GemmWorkspace(const BlockAttentionParams& p, size_t elem)
      : st(alloc_floats(kGemmBlock * tiled_lanes(p.panel_lanes))),
        o(alloc_floats(p.panel_lanes * p.D)),
        run_m(alloc_floats(tiled_lanes(p.panel_lanes))),
        run_l(alloc_floats(tiled_lanes(p.panel_lanes))),
        alpha(alloc_floats(tiled_lanes(p.panel_lanes))),
        lo(alloc_floats(tiled_lanes(p.panel_lanes))),
        hi(alloc_floats(tiled_lanes(p.panel_lanes))),
        first(new int64_t[static_cast<size_t>(tiled_lanes(p.panel_lanes))]),
        last(new int64_t[static_cast<size_t>(tiled_lanes(p.panel_lanes))]),
        qt(new char[static_cast<size_t>(p.D * tiled_lanes(p.panel_lanes)) * elem]),
        pm(new char[static_cast<size_t>(p.panel_lanes * kGemmBlock) * elem]),
        gk(new char[static_cast<size_t>(kGemmBlock * p.D) * elem]),
        gv(new char[static_cast<size_t>(kGemmBlock * p.D) * elem]) {}
};

template <typename T>
class GemmUnitRunner {
 public:
  GemmUnitRunner(const BlockAttentionParams& p, GemmWorkspace& ws)
      : p_(p), ws_(ws), qt_(reinterpret_cast<T*>(ws.qt.get())), pm_(reinterpret_cast<T*>(ws.pm.get())) {}

  void run(int64_t unit) {
    const Unit u = begin_unit<T>(p_, unit);
    if (u.lanes == 0) return;
    pack_queries(u);
    first_ = true;
    const auto visit = [&](const T* kp, int64_t ks, const T* vp, int64_t vs, int64_t nb, int64_t pos0) {
      block(u, kp, ks, vp, vs, nb, pos0);
    };
    for_each_key_block<T>(p_, u, kGemmBlock, lane_first_key(p_, p_.cache_len(u.b), 0), last_key_,
                          reinterpret_cast<T*>(ws_.gk.get()), reinterpret_cast<T*>(ws_.gv.get()), visit);
    finish_unit<T>(p_, u, unit, first_, ws_.run_m.get(), ws_.run_l.get(),
                   [&](int64_t d, int64_t m) { return ws_.o[m * p_.D + d]; });
  }

 private:
  // QT [D][mp] (input type, unscaled; zero beyond the unit's lanes), each lane's first / last key (last -1 for the
  // padding lanes), state.
  void pack_queries(const Unit& u) {
    const int64_t D = p_.D, mp = u.mp, c = p_.commit(u.b), len = p_.cache_len(u.b);
    last_key_ = -1;
    for (int64_t m = 0; m < mp; ++m) {
      if (m < u.lanes) {
        const int64_t lane = u.lane0 + m, h = lane / u.nv, t = lane % u.nv;
        const T* q = static_cast<const T*>(p_.q) + u.b * p_.q_sb + (u.kvh * u.g + h) * p_.q_sh + t * p_.q_st;
        for (int64_t d = 0; d < D; ++d) qt_[d * mp + m] = q[d];
        ws_.last[m] = lane_last_key(len, t, c, u.nv);
        ws_.first[m] = lane_first_key(p_, len, t);
      } else {
        for (int64_t d = 0; d < D; ++d) qt_[d * mp + m] = T(0.f);
        ws_.last[m] = -1;
        ws_.first[m] = 0;
      }
      ws_.run_m[m] = -INFINITY;
      ws_.run_l[m] = 0.f;
      last_key_ = std::max(last_key_, ws_.last[m]);
    }
  }

  void block(const Unit& u, const T* kp, int64_t ks, const T* vp, int64_t vs, int64_t nb, int64_t pos0) {
    namespace blas = at::native::cpublas;
    const int64_t D = p_.D, mp = u.mp, lanes = u.lanes;
    float* st = ws_.st.get();
    blas::brgemm(nb, mp, D, ks, mp, mp, /*add_C=*/false, kp, qt_, st, /*is_vnni=*/false);
    const Vec scale(p_.scale);
    for (int64_t i = 0; i < nb * mp; i += W) (Vec::loadu(st + i) * scale).store(st + i);
    const bool masked = block_bounds(ws_.first.get(), ws_.last.get(), mp, nb, pos0, ws_.lo.get(), ws_.hi.get());
    softmax_tile(st, mp, nb, mp / W, p_.softcap, masked ? ws_.lo.get() : nullptr, masked ? ws_.hi.get() : nullptr,
                 ws_.run_m.get(), ws_.run_l.get(), ws_.alpha.get());
    // P = (S^T)^T in the input type, 8 x 8 tiles so that neither side is walked a long stride apart.
    for (int64_t m0 = 0; m0 < lanes; m0 += 8)
      for (int64_t n0 = 0; n0 < nb; n0 += 8)
        for (int64_t m = m0; m < std::min(m0 + 8, lanes); ++m)
          for (int64_t n = n0; n < std::min(n0 + 8, nb); ++n) pm_[m * kGemmBlock + n] = static_cast<T>(st[n * mp + m]);
    float* o = ws_.o.get();
    if (!first_)
      for (int64_t m = 0; m < lanes; ++m) {
        const Vec a(ws_.alpha[m]);
        float* om = o + m * D;
        int64_t d = 0;
        for (; d + W <= D; d += W) (Vec::loadu(om + d) * a).store(om + d);
        for (; d < D; ++d) om[d] *= ws_.alpha[m];
      }
    blas::brgemm(lanes, D, nb, kGemmBlock, vs, D, /*add_C=*/!first_, pm_, vp, o, /*is_vnni=*/false);
    first_ = false;
  }

  const BlockAttentionParams& p_;
  GemmWorkspace& ws_;
  T* qt_;
  T* pm_;
  bool first_ = true;
  int64_t last_key_ = -1;
};

#if defined(CPU_CAPABILITY_AVX512)
#include "cpu/block_attention_tiles.h"
#endif

// Lanes in groups of W: each lane's split scales and inverse sum as sbd::SoftmaxState merges them, then the sums
// over the splits with the lanes as the vector axis (the partials are [D][panel_lanes]: contiguous along the lanes),
// each lane's own arithmetic whatever lanes share its group.
template <typename T>
void merge_item(const BlockAttentionParams& p, int64_t item) {
  const Unit u = describe(p, item);
  const int64_t D = p.D, pl = p.panel_lanes, ns = p.n_splits, pf = p.partial_floats();
  const float* parts = p.partials + item * ns * pf;
  alignas(64) float scale[kMaxSplits][W];  // n_splits <= kMaxSplits (block_attention_plan caps it)
  alignas(64) float inv[W];
  static thread_local Buffer sums;
  static thread_local int64_t sums_d = 0;
  if (sums_d < D) {
    sums = alloc_floats(D * W);
    sums_d = D;
  }
  float* acc_d = sums.get();
  for (int64_t m0 = 0; m0 < u.lanes; m0 += W) {
    const int64_t n = std::min<int64_t>(W, u.lanes - m0);
    for (int64_t j = 0; j < W; ++j) {
      inv[j] = 0.f;
      for (int64_t i = 0; i < ns; ++i) scale[i][j] = 0.f;
      if (j >= n) continue;
      sbd::SoftmaxState s = sbd::SoftmaxState::empty();
      for (int64_t i = 0; i < ns; ++i) {
        const float* part = parts + i * pf;
        const sbd::SoftmaxState o{part[D * pl + m0 + j], part[(D + 1) * pl + m0 + j]};
        float self_scale, other_scale;
        s.merge(o, self_scale, other_scale);
        for (int64_t k = 0; k < i; ++k) scale[k][j] *= self_scale;
        scale[i][j] = other_scale;
      }
      inv[j] = s.inv_sum();
    }
    const Vec vinv = Vec::loadu(inv), zero(0.f);
    for (int64_t d = 0; d < D; ++d) {
      Vec acc(0.f);
      for (int64_t i = 0; i < ns; ++i) {
        const Vec sc = Vec::loadu(scale[i]);  // a split with scale 0 (empty, or no weight) adds nothing, read or not
        acc = Vec::blendv(acc + Vec::loadu(parts + i * pf + d * pl + m0) * sc, acc, sc == zero);
      }
      (acc * vinv).store(acc_d + d * W);
    }
    for (int64_t j = 0; j < n; ++j) {
      const int64_t lane = u.lane0 + m0 + j;
      T* o = static_cast<T*>(p.out) + ((u.b * p.T + lane % u.nv) * p.Hq + u.kvh * u.g + lane / u.nv) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc_d[d * W + j]);
    }
  }
}

template <typename Runner>
void take_units(const BlockAttentionParams& p, Runner& runner, std::atomic<int64_t>& next) {
  const int64_t n = p.n_units();
  for (int64_t unit = next.fetch_add(1, std::memory_order_relaxed); unit < n;
       unit = next.fetch_add(1, std::memory_order_relaxed))
    runner.run(unit);
}

template <typename T>
void run_units(const BlockAttentionParams& p, std::atomic<int64_t>& next) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (p.tiles != Amx::OFF) {  // the binding sets it for bf16 in this variant only
      TilesWorkspace& ws = TilesWorkspace::of_thread(p);
      if (p.tiles == Amx::HW) {
        TilesUnitRunner<HwTileOps> runner(p, ws);
        take_units(p, runner, next);
      } else {
        TilesUnitRunner<EmuTileOps> runner(p, ws);
        take_units(p, runner, next);
      }
      return;
    }
  }
#endif
  if (p.gemm) {
    GemmWorkspace ws(p, sizeof(T));
    GemmUnitRunner<T> runner(p, ws);
    take_units(p, runner, next);
  } else {
    Workspace& ws = Workspace::of_thread(p);
    UnitRunner<T> runner(p, ws);
    take_units(p, runner, next);
  }
}

}  // namespace

void block_attention_units(const BlockAttentionParams& p, std::atomic<int64_t>& next) {
  switch (p.dtype) {
    case AttnDtype::kFloat32:
      return run_units<float>(p, next);
    case AttnDtype::kBFloat16:
      return run_units<c10::BFloat16>(p, next);
    case AttnDtype::kFloat16:
      return run_units<c10::Half>(p, next);
  }
}

void block_attention_merge(const BlockAttentionParams& p, int64_t i0, int64_t i1) {
  for (int64_t item = i0; item < i1; ++item) {
    switch (p.dtype) {
      case AttnDtype::kFloat32:
        merge_item<float>(p, item);
        break;
      case AttnDtype::kBFloat16:
        merge_item<c10::BFloat16>(p, item);
        break;
      case AttnDtype::kFloat16:
        merge_item<c10::Half>(p, item);
        break;
    }
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace sbd_cpu
