// block_attention on the CPU: checks, the work decomposition, and the calls into the per-ISA kernel.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "block_attention_checks.h"
#include "cpu/block_attention_kernel.h"

namespace sbd_ext {
namespace {

// Query lanes (g heads x valid new rows) per panel: 256 lanes x D = 128 keep QT and O^T at 128 KB each, inside
// a 1-2 MB L2 next to the streamed K/V blocks. Llama's g = 4 with a 2k = 32-row forward is 128 lanes: one panel.
constexpr int64_t kMaxPanelLanes = 256;
// Shortest cache split: each split adds a partial-state write (D + 2 floats per lane) and its merge, small next
// to attending 256 cache rows.
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

}  // namespace

at::Tensor block_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                               at::Tensor v_cache, const at::Tensor& cache_lens, const at::Tensor& n_commit,
                               const at::Tensor& n_valid, double scale) {
  check_block_attention(q, k, v, k_cache, v_cache, cache_lens, n_commit, n_valid, scale);
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), S = k_cache.size(2);
  const std::vector<int64_t> lens = host_lengths(cache_lens), commit = host_lengths(n_commit),
                             valid = host_lengths(n_valid);
  check_block_attention_lengths(lens, commit, valid, T, S);
  at::Tensor out = at::empty({B, T, Hq, D}, q.options());
  if (B == 0 || T == 0) return out;

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
  // Cache splits (flash decoding) when the items alone would leave threads idle: fewer items than threads (batch 1
  // with few kv heads), or a few items that do not divide evenly (3 kv heads on 2 threads: 2 + 1 items is 67%
  // busy, 2 splits make 3 + 3 units). The split count depends on the thread count, so the rounding of the
  // result does too (within fp32 noise).
  const int64_t threads = at::get_num_threads(), items = p.n_items();
  const int64_t max_splits =
      std::clamp<int64_t>(*std::max_element(lens.begin(), lens.end()) / kMinSplitRows, 1, kMaxSplits);
  p.n_splits = 1;
  while (p.n_splits < max_splits && (items * p.n_splits) % threads != 0 && items * p.n_splits < 4 * threads)
    ++p.n_splits;
  at::Tensor partials;
  p.partials = nullptr;
  if (p.n_splits > 1) {
    partials = at::empty({p.n_units() * p.partial_floats()}, q.options().dtype(at::kFloat));
    p.partials = partials.data_ptr<float>();
  }

  // One worker per thread, each taking units from a shared counter until none is left: a thread that the OS
  // delays (a busy machine) or that drew the longer units does not hold the others up, as a static split would.
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, p.n_units()), 1, [&](int64_t w0, int64_t w1) {
    for (int64_t w = w0; w < w1; ++w) SBD_CPU_DISPATCH(block_attention_units, p, next);
  });
  if (p.n_splits > 1)
    at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) { SBD_CPU_DISPATCH(block_attention_merge, p, i0, i1); });
  return out;
}

TORCH_LIBRARY_IMPL(sbd_ext, CPU, m) { m.impl("block_attention", &block_attention_cpu); }

}  // namespace sbd_ext
