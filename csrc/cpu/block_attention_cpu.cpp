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
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3), S = k_cache.size(2);
  const std::vector<int64_t> lens = host_lengths(cache_lens), commit = host_lengths(n_commit),
                             valid = host_lengths(n_valid);
  check_block_attention_lengths(lens, commit, valid, T, S);
  at::Tensor out = at::empty({B, T, Hq, D}, q.options());
  if (B == 0 || T == 0) return out;

  sbd_cpu::BlockAttentionParams p;
  fill_block_attention_params(p, q, k, v, k_cache, v_cache, out, scale);
  p.cache_lens = lens.data();
  p.n_commit = commit.data();
  p.n_valid = valid.data();
  p.cache_lens_i64 = p.n_commit_i64 = p.n_valid_i64 = true;
  p.dtype = attn_dtype(q.scalar_type());
  const int64_t threads = at::get_num_threads();
  sbd_cpu::block_attention_plan(p, threads);
  at::Tensor partials;
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
    at::parallel_for(0, p.n_items(), 1, [&](int64_t i0, int64_t i1) { SBD_CPU_DISPATCH(block_attention_merge, p, i0, i1); });
  return out;
}

TORCH_LIBRARY_IMPL(sbd_ext, CPU, m) { m.impl("block_attention", &block_attention_cpu); }

}  // namespace sbd_ext
