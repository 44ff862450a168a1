// block_attention, CUDA binding: argument checks, device guard and stream, the work split and its workspace, dtype
// dispatch to the raw-pointer launchers of csrc/cuda/kernels/block_attention.h. No host synchronisation: the
// lengths stay on the device (the kernels clamp them, so bad values cannot cause out-of-bounds access).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <tuple>
#include <utility>

#include "block_attention_checks.h"
#include "checks.h"
#include "cuda/binding_utils.h"
#include "cuda/kernels/block_attention.h"
#include "cuda/kernels/device_info.h"

namespace sbd_ext {

at::Tensor block_attention_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                                at::Tensor v_cache, const at::Tensor& cache_lens, const at::Tensor& n_commit,
                                const at::Tensor& n_valid, double scale) {
  constexpr const char* op = "block_attention";
  // Shapes, dtypes, devices, strides and scale (block_attention_checks.h, shared with the CPU binding). The
  // lengths' values are not read here: that would synchronise with the device; the kernels clamp every write to
  // the cache instead, and the decoding loop checks the lengths on its host-side copy.
  check_block_attention(q, k, v, k_cache, v_cache, cache_lens, n_commit, n_valid, scale);
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t Hkv = k_cache.size(1), S = k_cache.size(2);
  TORCH_CHECK(q.is_cuda(), op, ": q must be a CUDA tensor here, got device ", q.device());
  TORCH_CHECK_VALUE(sbd_cuda::block_attention_supports_head_dim(static_cast<int>(D)), op,
                    ": the CUDA kernels support head dims 64 and 128, got D = ", D);
  TORCH_CHECK_VALUE(B * Hkv <= 65535, op, ": on CUDA B * Hkv must be <= 65535, got ", B * Hkv);
  TORCH_CHECK_VALUE(S <= 0x7fffffff && T <= 0x7fffffff / std::max<int64_t>(Hq, 1), op, ": sizes too large");
  // The caches are written in place, so they cannot be copied into an aligned layout: require it.
  for (auto [name, t] : {std::pair<const char*, const at::Tensor&>{"k_cache", k_cache}, {"v_cache", v_cache}})
    TORCH_CHECK_VALUE(rows_aligned16(t), op, ": on CUDA ", name,
                      " must have 16-byte aligned rows (data pointer and strides, in bytes, multiples of 16), got "
                      "strides ",
                      t.strides());

  const c10::cuda::CUDAGuard device_guard(q.device());
  auto out = at::empty({B, T, Hq, D}, q.options());
  if (B == 0 || T == 0) return out;
  // q / k / v are only read: copy them if their rows are not 16-byte aligned (a slice at an odd offset).
  const at::Tensor qa = rows_aligned16(q) ? q : q.contiguous();
  const at::Tensor ka = rows_aligned16(k) ? k : k.contiguous();
  const at::Tensor va = rows_aligned16(v) ? v : v.contiguous();
  const at::Tensor lens = cache_lens.contiguous(), commit = n_commit.contiguous(), valid = n_valid.contiguous();

  sbd_cuda::BlockAttentionParams p{};
  p.q = qa.data_ptr();
  p.k = ka.data_ptr();
  p.v = va.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.out = out.data_ptr();
  p.cache_lens = lens.data_ptr();
  p.n_commit = commit.data_ptr();
  p.n_valid = valid.data_ptr();
  p.cache_lens_i64 = lens.scalar_type() == at::kLong;
  p.n_commit_i64 = commit.scalar_type() == at::kLong;
  p.n_valid_i64 = valid.scalar_type() == at::kLong;
  p.q_sb = qa.stride(0), p.q_sh = qa.stride(1), p.q_st = qa.stride(2);
  p.k_sb = ka.stride(0), p.k_sh = ka.stride(1), p.k_st = ka.stride(2);
  p.v_sb = va.stride(0), p.v_sh = va.stride(1), p.v_st = va.stride(2);
  p.kc_sb = k_cache.stride(0), p.kc_sh = k_cache.stride(1), p.kc_ss = k_cache.stride(2);
  p.vc_sb = v_cache.stride(0), p.vc_sh = v_cache.stride(1), p.vc_ss = v_cache.stride(2);
  p.B = static_cast<int>(B);
  p.Hq = static_cast<int>(Hq);
  p.Hkv = static_cast<int>(Hkv);
  p.T = static_cast<int>(T);
  p.S = static_cast<int>(S);
  p.D = static_cast<int>(D);
  p.scale = static_cast<float>(scale);
  p.force_simt = env_flag("SBD_EXT_ATTN_SIMT");  // read per call, so tests can A/B the two kernels
  sbd_cuda::block_attention_plan(p, sbd_cuda::sm_count());
  // Tuning hook (benchmarks): a fixed number of cache splits instead of the heuristic's.
  if (const char* e = std::getenv("SBD_EXT_ATTN_SPLITS")) {
    const int forced = std::atoi(e);
    if (forced >= 1) p.splits = std::min(forced, 256);
  }
  const auto ws = at::empty({static_cast<int64_t>(sbd_cuda::block_attention_workspace_bytes(p))},
                            q.options().dtype(at::kByte));
  p.workspace = ws.data_ptr();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float_types(op, q.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    C10_CUDA_CHECK(sbd_cuda::launch_block_attention<scalar_t>(p, stream));
  });
  return out;
}

TORCH_LIBRARY_IMPL(sbd_ext, CUDA, m) { m.impl("block_attention", &block_attention_cuda); }

}  // namespace sbd_ext
