// block_attention on the CPU, compiled once per ISA (setup.py): flash attention over the cache and the new rows.
//
// Work unit = (b, kv head, panel of query lanes, cache split). The g = Hq / Hkv query heads of the kv head times
// the n_valid[b] valid new rows are packed into one tile of "lanes" (GQA packing: every K/V row loaded is used by
// all g heads), stored transposed and pre-scaled, QT [D][lanes]. The keys are walked in blocks of kBlock rows:
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
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <utility>

#include "cpu/block_attention_kernel.h"
#include "sbd/softmax_state.h"

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
// Keys per block: the scores tile kBlock x kTileLanes (AVX-512: 96 x 64 fp32 = 24 KB) stays in L1 between the
// two products; a multiple of kRI so the QK product has no ragged edge except at the end of a range.
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

// One block of nb keys for the lanes [0, nvec * W) of a tile. The scores st [nb][ld] become e^(s - offset) in
// place; the lanes' running (m, l) absorb the block and alpha receives the factor their earlier accumulators
// must be scaled by. The vector form of sbd::SoftmaxState::push_block. lim (null outside the new-rows block)
// carries the causal mask: key j0 + n is hidden from a lane when j0 + n > lim[lane].
void softmax_tile(float* st, int64_t ld, int64_t nb, int64_t nvec, const float* lim, int64_t j0, float* run_m,
                  float* run_l, float* alpha) {
  const Vec ninf(-INFINITY), zero(0.f);
  for (int64_t j = 0; j < nvec; ++j) {
    float* col = st + j * W;
    Vec bmax(-INFINITY);
    if (lim != nullptr) {
      const Vec vlim = Vec::loadu(lim + j * W);
      for (int64_t n = 0; n < nb; ++n) {
        const Vec s = Vec::blendv(Vec::loadu(col + n * ld), ninf, Vec(static_cast<float>(j0 + n)) > vlim);
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
      const Vec e = (Vec::loadu(col + n * ld) - off).exp();
      e.store(col + n * ld);
      sum = sum + e;
    }
    const Vec a = (m_old - off).exp();
    (Vec::loadu(run_l + j * W) * a + sum).store(run_l + j * W);
    m_new.store(run_m + j * W);
    a.store(alpha + j * W);
  }
}

template <typename T>
inline void to_float_row(const T* src, float* dst, int64_t n) {
  int64_t d = 0;
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  } else {
    for (; d + W <= n; d += W) {
      Vec x;
      at::vec::load_to_float<T>(src + d, x);
      x.store(dst + d);
    }
    for (; d < n; ++d) dst[d] = static_cast<float>(src[d]);
  }
}

struct AlignedFree {
  void operator()(float* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<float[], AlignedFree>;

Buffer alloc_floats(int64_t n) {
  const size_t bytes = (static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(float) + 63) / 64 * 64;
  void* ptr = std::aligned_alloc(64, bytes);
  if (ptr == nullptr) throw std::bad_alloc();
  return Buffer(static_cast<float*>(ptr));
}

// Per-thread working set, sized for the largest panel.
struct Workspace {
  Buffer qt, ot, st, kf, vf, lim, run_m, run_l, alpha;
  explicit Workspace(const BlockAttentionParams& p)
      : qt(alloc_floats(p.D * p.panel_lanes)),
        ot(alloc_floats(p.D * p.panel_lanes)),
        st(alloc_floats(kBlock * kTileLanes)),
        kf(alloc_floats(p.dtype == AttnDtype::kFloat32 ? 0 : kBlock * p.D)),
        vf(alloc_floats(p.dtype == AttnDtype::kFloat32 ? 0 : kBlock * p.D)),
        lim(alloc_floats(p.panel_lanes)),
        run_m(alloc_floats(p.panel_lanes)),
        run_l(alloc_floats(p.panel_lanes)),
        alpha(alloc_floats(kTileLanes)) {}
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
  u.nv = p.n_valid[u.b];
  u.lane0 = panel * p.panel_lanes;
  u.lanes = std::clamp<int64_t>(u.g * u.nv - u.lane0, 0, p.panel_lanes);
  u.mp = (u.lanes + W - 1) / W * W;
  u.split = 0;
  return u;
}

template <typename T>
class UnitRunner {
 public:
  UnitRunner(const BlockAttentionParams& p, Workspace& ws) : p_(p), ws_(ws) {}

  void run(int64_t unit) {
    const int64_t item = unit / p_.n_splits;
    Unit u = describe(p_, item);
    u.split = unit % p_.n_splits;
    if (u.lane0 == 0 && u.split == 0) append_and_pad(u);
    if (u.lanes == 0) return;
    // Cache rows of this split: equal shares rounded to whole blocks; the new rows go with the last split.
    const int64_t len = p_.cache_lens[u.b];
    const int64_t share = ((len + p_.n_splits - 1) / p_.n_splits + kBlock - 1) / kBlock * kBlock;
    const int64_t c0 = std::min(len, u.split * share), c1 = std::min(len, c0 + share);
    const bool with_new = u.split == p_.n_splits - 1;

    pack_queries(u);
    first_ = true;
    const T* kc = static_cast<const T*>(p_.k_cache) + u.b * p_.kc_sb + u.kvh * p_.kc_sh;
    const T* vc = static_cast<const T*>(p_.v_cache) + u.b * p_.vc_sb + u.kvh * p_.vc_sh;
    for (int64_t j = c0; j < c1; j += kBlock)
      block(u, kc + j * p_.kc_st, p_.kc_st, vc + j * p_.vc_st, p_.vc_st, std::min(kBlock, c1 - j), -1);
    if (with_new) {
      const T* kn = static_cast<const T*>(p_.k) + u.b * p_.k_sb + u.kvh * p_.k_sh;
      const T* vn = static_cast<const T*>(p_.v) + u.b * p_.v_sb + u.kvh * p_.v_sh;
      for (int64_t j = 0; j < u.nv; j += kBlock)
        block(u, kn + j * p_.k_st, p_.k_st, vn + j * p_.v_st, p_.v_st, std::min(kBlock, u.nv - j), j);
    }
    if (p_.n_splits == 1) {
      write_output(u);
    } else {
      write_partial(u, unit);
    }
  }

 private:
  // Committed rows' K/V into the cache at cache_lens[b]; zero output rows for the padding rows t >= n_valid.
  void append_and_pad(const Unit& u) {
    const int64_t len = p_.cache_lens[u.b], c = p_.n_commit[u.b], D = p_.D;
    for (int64_t t = 0; t < c; ++t) {
      std::memcpy(static_cast<T*>(p_.k_cache) + u.b * p_.kc_sb + u.kvh * p_.kc_sh + (len + t) * p_.kc_st,
                  static_cast<const T*>(p_.k) + u.b * p_.k_sb + u.kvh * p_.k_sh + t * p_.k_st, D * sizeof(T));
      std::memcpy(static_cast<T*>(p_.v_cache) + u.b * p_.vc_sb + u.kvh * p_.vc_sh + (len + t) * p_.vc_st,
                  static_cast<const T*>(p_.v) + u.b * p_.v_sb + u.kvh * p_.v_sh + t * p_.v_st, D * sizeof(T));
    }
    for (int64_t t = u.nv; t < p_.T; ++t)
      std::memset(out_row(u, t, 0), 0, u.g * D * sizeof(T));  // the g heads of this kv head are adjacent
  }

  T* out_row(const Unit& u, int64_t t, int64_t h) const {
    return static_cast<T*>(p_.out) + ((u.b * p_.T + t) * p_.Hq + u.kvh * u.g + h) * p_.D;
  }

  // QT [D][mp] = scale * q of the unit's lanes (zero beyond them); lim = causal limit per lane; state reset.
  void pack_queries(const Unit& u) {
    const int64_t D = p_.D, mp = u.mp, c = p_.n_commit[u.b];
    float* qt = ws_.qt.get();
    for (int64_t m = 0; m < mp; ++m) {
      const int64_t lane = u.lane0 + m;
      if (m < u.lanes) {
        const int64_t h = lane / u.nv, t = lane % u.nv;
        const T* q = static_cast<const T*>(p_.q) + u.b * p_.q_sb + (u.kvh * u.g + h) * p_.q_sh + t * p_.q_st;
        for (int64_t d = 0; d < D; ++d) qt[d * mp + m] = static_cast<float>(q[d]) * p_.scale;
        // A committed row sees new rows 0..t, a set-block row every valid new row.
        ws_.lim[m] = t < c ? static_cast<float>(t) : INFINITY;
      } else {
        for (int64_t d = 0; d < D; ++d) qt[d * mp + m] = 0.f;
        ws_.lim[m] = INFINITY;
      }
      ws_.run_m[m] = -INFINITY;
      ws_.run_l[m] = 0.f;
    }
  }

  // Keys j0 .. j0 + nb of the new rows (j0 >= 0, masked) or nb cache rows (j0 < 0, all visible).
  void block(const Unit& u, const T* kp, int64_t ks, const T* vp, int64_t vs, int64_t nb, int64_t j0) {
    const int64_t D = p_.D, mp = u.mp;
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
    float* st = ws_.st.get();
    for (int64_t m0 = 0; m0 < mp; m0 += kTileLanes) {
      const int64_t rm = std::min<int64_t>(kRM, (mp - m0) / W);
      for (int64_t n = 0; n < nb; n += kRI) {
        const int64_t ri = std::min<int64_t>(kRI, nb - n);
        micro_kernel_for(ri, rm)(kf + n * kfs, kfs, 1, ws_.qt.get() + m0, mp, st + n * kTileLanes, kTileLanes, D,
                                 nullptr);
      }
      softmax_tile(st, kTileLanes, nb, rm, j0 >= 0 ? ws_.lim.get() + m0 : nullptr, j0, ws_.run_m.get() + m0,
                   ws_.run_l.get() + m0, ws_.alpha.get());
      for (int64_t d = 0; d < D; d += kRI) {
        const int64_t ri = std::min<int64_t>(kRI, D - d);
        micro_kernel_for(ri, rm)(vf + d, 1, vfs, st, kTileLanes, ws_.ot.get() + d * mp + m0, mp, nb,
                                 first_ ? nullptr : ws_.alpha.get());
      }
    }
    first_ = false;
  }

  void write_output(const Unit& u) {
    const int64_t D = p_.D, mp = u.mp;
    for (int64_t m = 0; m < u.lanes; ++m) {
      const int64_t lane = u.lane0 + m;
      const sbd::SoftmaxState s{ws_.run_m[m], ws_.run_l[m]};
      const float inv = first_ ? 0.f : s.inv_sum();
      T* o = out_row(u, lane % u.nv, lane / u.nv);
      const float* ot = ws_.ot.get() + m;
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(first_ ? 0.f : ot[d * mp] * inv);
    }
  }

  void write_partial(const Unit& u, int64_t unit) {
    const int64_t D = p_.D, pl = p_.panel_lanes, mp = u.mp;
    float* part = p_.partials + unit * p_.partial_floats();
    if (!first_)
      for (int64_t d = 0; d < D; ++d) std::memcpy(part + d * pl, ws_.ot.get() + d * mp, u.lanes * sizeof(float));
    for (int64_t m = 0; m < u.lanes; ++m) {
      part[D * pl + m] = first_ ? -INFINITY : ws_.run_m[m];
      part[(D + 1) * pl + m] = first_ ? 0.f : ws_.run_l[m];  // l = 0 marks an empty split: its acc is not read
    }
  }

  const BlockAttentionParams& p_;
  Workspace& ws_;
  bool first_ = true;  // no key block processed yet: O^T holds no data
};

template <typename T>
void merge_item(const BlockAttentionParams& p, int64_t item) {
  const Unit u = describe(p, item);
  const int64_t D = p.D, pl = p.panel_lanes, ns = p.n_splits;
  const float* parts = p.partials + item * ns * p.partial_floats();
  float scale[64];  // n_splits <= 64 (the binding caps it)
  for (int64_t m = 0; m < u.lanes; ++m) {
    sbd::SoftmaxState s = sbd::SoftmaxState::empty();
    for (int64_t i = 0; i < ns; ++i) {
      const float* part = parts + i * p.partial_floats();
      const sbd::SoftmaxState o{part[D * pl + m], part[(D + 1) * pl + m]};
      float self_scale, other_scale;
      s.merge(o, self_scale, other_scale);
      for (int64_t j = 0; j < i; ++j) scale[j] *= self_scale;
      scale[i] = other_scale;
    }
    const float inv = s.inv_sum();
    const int64_t lane = u.lane0 + m;
    T* o = static_cast<T*>(p.out) + ((u.b * p.T + lane % u.nv) * p.Hq + u.kvh * u.g + lane / u.nv) * D;
    for (int64_t d = 0; d < D; ++d) {
      float acc = 0.f;
      for (int64_t i = 0; i < ns; ++i)
        if (scale[i] != 0.f) acc += parts[i * p.partial_floats() + d * pl + m] * scale[i];
      o[d] = static_cast<T>(acc * inv);
    }
  }
}

template <typename T>
void run_units(const BlockAttentionParams& p, int64_t u0, int64_t u1) {
  Workspace ws(p);
  UnitRunner<T> runner(p, ws);
  for (int64_t unit = u0; unit < u1; ++unit) runner.run(unit);
}

}  // namespace

void block_attention_units(const BlockAttentionParams& p, int64_t u0, int64_t u1) {
  switch (p.dtype) {
    case AttnDtype::kFloat32:
      return run_units<float>(p, u0, u1);
    case AttnDtype::kBFloat16:
      return run_units<c10::BFloat16>(p, u0, u1);
    case AttnDtype::kFloat16:
      return run_units<c10::Half>(p, u0, u1);
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
