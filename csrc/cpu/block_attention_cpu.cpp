// block_attention on the CPU: checks, the work decomposition, and the calls into the per-ISA kernel.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "block_attention_checks.h"
#include "cpu/block_attention_kernel.h"

namespace sbd_ext {
namespace {

// Query lanes (g heads x valid new rows) per panel: 256 lanes x D = 128 keep QT and O^T at 128 KB each, inside
// a 1-2 MB L2 next to the streamed K/V blocks. Llama's g = 4 with a 2k = 32-row forward is 128 lanes: one panel.
constexpr int64_t kMaxPanelLanes = 256;
// A cache split shorter than this costs more in its partial-state write and merge than it gains in parallelism.
constexpr int64_t kMinSplitRows = 256;
constexpr int64_t kMaxSplits = 64;  // bound of the merge's scale array (block_attention_kernel.cpp)

sbd_cpu::AttnDtype attn_dtype(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16:
      return sbd_cpu::AttnDtype::kBFloat16;
    case at::kHalf:
      return sbd_cpu::AttnDtype::kFloat16;
    default:
      return sbd_cpu::AttnDtype::kFloat32;
  }
}

std::vector<int64_t> to_host(const at::Tensor& t) {
  const at::Tensor l = t.to(at::kLong).contiguous();
  return std::vector<int64_t>(l.data_ptr<int64_t>(), l.data_ptr<int64_t>() + l.numel());
}

}  // namespace

at::Tensor block_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                               at::Tensor v_cache, const at::Tensor& cache_lens, const at::Tensor& n_commit,
                               const at::Tensor& n_valid, double scale) {
  check_block_attention(q, k, v, k_cache, v_cache, cache_lens, n_commit, n_valid, scale);
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), S = k_cache.size(2);
  check_block_attention_lengths(cache_lens, n_commit, n_valid, T, S);
  at::Tensor out = at::empty({B, T, Hq, D}, q.options());
  if (B == 0 || T == 0) return out;

  const std::vector<int64_t> lens = to_host(cache_lens), commit = to_host(n_commit), valid = to_host(n_valid);
  sbd_cpu::BlockAttentionParams p;
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.out = out.data_ptr();
  p.dtype = attn_dtype(q.scalar_type());
  p.B = B;
  p.Hq = Hq;
  p.Hkv = Hkv;
  p.T = T;
  p.D = D;
  p.S = S;
  p.q_sb = q.stride(0), p.q_sh = q.stride(1), p.q_st = q.stride(2);
  p.k_sb = k.stride(0), p.k_sh = k.stride(1), p.k_st = k.stride(2);
  p.v_sb = v.stride(0), p.v_sh = v.stride(1), p.v_st = v.stride(2);
  p.kc_sb = k_cache.stride(0), p.kc_sh = k_cache.stride(1), p.kc_st = k_cache.stride(2);
  p.vc_sb = v_cache.stride(0), p.vc_sh = v_cache.stride(1), p.vc_st = v_cache.stride(2);
  p.cache_lens = lens.data();
  p.n_commit = commit.data();
  p.n_valid = valid.data();
  p.scale = static_cast<float>(scale);

  // Panels: the lanes of the longest sequence cut into near-equal panels of at most kMaxPanelLanes, each a
  // multiple of 16 lanes (the widest vector, AVX-512 fp32).
  const int64_t g = Hq / Hkv;
  const int64_t max_lanes = g * *std::max_element(valid.begin(), valid.end());
  p.n_panels = std::max<int64_t>(1, (max_lanes + kMaxPanelLanes - 1) / kMaxPanelLanes);
  p.panel_lanes = std::max<int64_t>(16, ((max_lanes + p.n_panels - 1) / p.n_panels + 15) / 16 * 16);
  // Cache splits (flash decoding) only when there are fewer items than threads, e.g. batch 1 with few kv heads.
  // The split count depends on the thread count, so the rounding of the result does too (within fp32 noise).
  const int64_t threads = at::get_num_threads(), items = p.n_items();
  p.n_splits = 1;
  if (items < threads) {
    const int64_t max_len = *std::max_element(lens.begin(), lens.end());
    p.n_splits = std::clamp<int64_t>(std::min((threads + items - 1) / items, max_len / kMinSplitRows), 1, kMaxSplits);
  }
  at::Tensor partials;
  p.partials = nullptr;
  if (p.n_splits > 1) {
    partials = at::empty({p.n_units() * p.partial_floats()}, q.options().dtype(at::kFloat));
    p.partials = partials.data_ptr<float>();
  }

  at::parallel_for(0, p.n_units(), 1, [&](int64_t u0, int64_t u1) { SBD_CPU_DISPATCH(block_attention_units, p, u0, u1); });
  if (p.n_splits > 1)
    at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) { SBD_CPU_DISPATCH(block_attention_merge, p, i0, i1); });
  return out;
}

TORCH_LIBRARY_IMPL(sbd_ext, CPU, m) { m.impl("block_attention", &block_attention_cpu); }

}  // namespace sbd_ext
