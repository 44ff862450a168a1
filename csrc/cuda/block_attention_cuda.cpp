// block_attention, CUDA binding: argument checks (block_attention_checks.h, shared with the CPU binding), device
// guard and stream, the shared params and the work plan, the workspace, dtype dispatch to the raw-pointer
// launchers of csrc/cuda/kernels/block_attention.h. No host synchronisation: the lengths stay on the device and
// the kernel validates them (block_attention_checks.h says how an invalid length is reported).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <tuple>
#include <utility>

#include "block_attention_checks.h"
#include "checks.h"
#include "cuda/binding_utils.h"
#include "cuda/kernels/block_attention.h"
#include "cuda/kernels/device_info.h"

namespace sbd_ext {
namespace {

// The invalid-lengths record of an earlier launch as the CPU binding's message, or "" if there is none.
std::string take_length_error() {
  sbd::BlockAttentionStatus st;
  if (!sbd_cuda::block_attention_take_status(&st)) return "";
  return block_attention_length_message(static_cast<sbd::LengthError>(st.code), st.b, st.cache_len, st.n_commit,
                                        st.n_valid, st.T, st.S) +
         " (found on the GPU by an earlier block_attention call, which wrote zeros for that sequence's output rows "
         "and appended nothing to its cache)";
}

void raise_length_error() {
  const std::string msg = take_length_error();
  TORCH_CHECK_VALUE(msg.empty(), msg);
}

}  // namespace

// For sbd_ext._C.take_cuda_error (csrc/ops.cpp), which sbd_ext.ops.check_cuda_errors calls after a synchronize.
std::string take_block_attention_cuda_error() { return take_length_error(); }

at::Tensor block_attention_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache,
                                at::Tensor v_cache, const at::Tensor& cache_lens, const at::Tensor& n_commit,
                                const at::Tensor& n_valid, double scale, double softcap, int64_t window_left) {
  constexpr const char* op = "block_attention";
  // An error an earlier call's kernel found is raised here, at the next call at the latest (like CUDA's own
  // asynchronous errors); sbd_ext.ops.check_cuda_errors() raises it at once.
  raise_length_error();
  check_block_attention(q, k, v, k_cache, v_cache, cache_lens, n_commit, n_valid, scale, softcap, window_left);
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t Hkv = k_cache.size(1), S = k_cache.size(2);
  TORCH_CHECK(q.is_cuda(), op, ": q must be a CUDA tensor here, got device ", q.device());
  TORCH_CHECK_VALUE(sbd_cuda::block_attention_supports_head_dim(D), op,
                    ": the CUDA kernels support head dims 32, 64 and 128, got D = q.size(3) = ", D,
                    " (the CPU kernel supports any D)");
  // Sizes the kernels index with 32-bit integers or use as grid dimensions.
  TORCH_CHECK_VALUE(B * Hkv <= 65535, op, ": on CUDA B * Hkv must be <= 65535, got ", B, " * ", Hkv);
  check_fits_int32(op, "the cache size k_cache.size(2)", S, "on CUDA ");
  TORCH_CHECK_VALUE(T <= INT32_MAX / Hq, op, ": on CUDA T * Hq must be at most 2^31 - 1, got ", T, " * ", Hq);
  TORCH_CHECK_VALUE(B * T * Hq <= int64_t{INT32_MAX} * 4, op, ": on CUDA B * T * Hq must be below 2^33, got ",
                    B * T * Hq);
  // The caches are written in place, so they cannot be copied into an aligned layout: require it.
  for (auto [name, t] : {std::pair<const char*, const at::Tensor&>{"k_cache", k_cache}, {"v_cache", v_cache}})
    TORCH_CHECK_VALUE(rows_aligned16(t), op, ": on CUDA ", name,
                      " must have 16-byte aligned rows (data pointer and strides, in bytes, multiples of 16), got "
                      "strides ",
                      t.strides());

  const c10::cuda::CUDAGuard device_guard(q.device());
  auto out = at::empty({B, T, Hq, D}, q.options());
  if (B == 0) return out;
  // q / k / v are only read: copy them if their rows are not 16-byte aligned (a slice at an odd offset).
  const at::Tensor qa = rows_aligned16(q) ? q : q.contiguous();
  const at::Tensor ka = rows_aligned16(k) ? k : k.contiguous();
  const at::Tensor va = rows_aligned16(v) ? v : v.contiguous();
  const at::Tensor lens = cache_lens.contiguous(), commit = n_commit.contiguous(), valid = n_valid.contiguous();

  sbd_cuda::BlockAttentionParams p{};
  fill_block_attention_params(p, qa, ka, va, k_cache, v_cache, out, scale, softcap, window_left);
  p.cache_lens = lens.const_data_ptr();
  p.n_commit = commit.const_data_ptr();
  p.n_valid = valid.const_data_ptr();
  p.cache_lens_i64 = lens.scalar_type() == at::kLong;
  p.n_commit_i64 = commit.scalar_type() == at::kLong;
  p.n_valid_i64 = valid.scalar_type() == at::kLong;
  p.status = sbd_cuda::block_attention_status();
  p.force_simt = env_flag("SBD_EXT_ATTN_SIMT");  // read per call, so tests can A/B the two kernels
  sbd_cuda::block_attention_plan(p, sbd_cuda::sm_count(), sbd_cuda::smem_per_sm());
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
  if (env_flag("SBD_EXT_CUDA_SYNC_CHECKS")) {  // debugging: this call's own length error, raised by this call
    C10_CUDA_CHECK(cudaStreamSynchronize(stream));
    raise_length_error();
  }
  return out;
}

TORCH_LIBRARY_IMPL(sbd_ext, CUDA, m) { m.impl("block_attention", &block_attention_cuda); }

}  // namespace sbd_ext
