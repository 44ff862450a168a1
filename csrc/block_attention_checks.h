// Argument checks of block_attention, shared by its CPU and CUDA bindings, and the one place that fills the
// params both devices' kernels share (sbd/block_attention_params.h).
//
// check_block_attention validates everything that does not need the lengths' values: dtypes, shapes, devices,
// strides, the scale, and memory overlap (k_cache / v_cache are written in place: neither may overlap itself, the
// other, or any input). The lengths' values (no negative length, n_commit <= n_valid <= T, no cache overflow) are
// defined once, by sbd::block_attention_length_error, and checked where the lengths live:
// - CPU: the binding reads them (host_lengths) and check_block_attention_lengths raises before the kernel runs.
// - CUDA: they stay on the device. Reading them on the host would synchronise with the GPU once per layer and
//   could not be captured in a CUDA graph, so the kernel checks each sequence itself with the same function. An
//   invalid sequence is treated as empty: its output rows are zeros and nothing is appended to its cache, so no
//   lengths whatsoever make the kernel read or write outside its tensors. The first invalid sequence is recorded in
//   a status word in mapped host memory (sbd::BlockAttentionStatus); the binding raises it, with the message the
//   CPU gives (block_attention_length_message), at the next CUDA block_attention call, and
//   sbd_ext.ops.check_cuda_errors() synchronises and raises it at once. SBD_EXT_CUDA_SYNC_CHECKS=1 makes every
//   CUDA call synchronise and raise its own error (debugging).
#pragma once

#include <cmath>
#include <limits>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "checks.h"
#include "sbd/block_attention_params.h"

namespace sbd_ext {

inline void check_block_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cache_lens,
                                  const at::Tensor& n_commit, const at::Tensor& n_valid, double scale,
                                  double softcap, int64_t window_left) {
  constexpr const char* op = "block_attention";
  check_dtype(op, "q", q, {at::kFloat, at::kBFloat16, at::kHalf});
  check_dim(op, "q", q, 4, "[B, Hq, T, D]");
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3);
  TORCH_CHECK_VALUE(D > 0, op, ": q must have a non-empty head dimension D, got shape ", q.sizes());
  for (auto [name, t] : {std::pair<const char*, const at::Tensor&>{"k", k}, {"v", v}}) {
    check_same_dtype(op, name, t, q, "q");
    check_dim(op, name, t, 4, "[B, Hkv, T, D]");
    check_size(op, name, t, 0, B, "q.size(0) (B)");
    check_size(op, name, t, 2, T, "q.size(2) (T)");
    check_size(op, name, t, 3, D, "q.size(3) (D)");
  }
  const int64_t Hkv = k.size(1);
  check_size(op, "v", v, 1, Hkv, "k.size(1) (Hkv)");
  TORCH_CHECK_VALUE(Hkv > 0 && Hq % Hkv == 0, op, ": the number of query heads q.size(1) = ", Hq,
                    " must be a multiple of the number of kv heads k.size(1) = ", Hkv, " (GQA)");
  for (auto [name, t] : {std::pair<const char*, const at::Tensor&>{"k_cache", k_cache}, {"v_cache", v_cache}}) {
    check_same_dtype(op, name, t, q, "q");
    check_dim(op, name, t, 4, "[B, Hkv, S, D]");
    check_size(op, name, t, 0, B, "q.size(0) (B)");
    check_size(op, name, t, 1, Hkv, "k.size(1) (Hkv)");
    check_size(op, name, t, 3, D, "q.size(3) (D)");
  }
  check_size(op, "v_cache", v_cache, 2, k_cache.size(2), "k_cache.size(2) (S)");
  for (auto [name, t] : {std::pair<const char*, const at::Tensor&>{"q", q},
                         {"k", k},
                         {"v", v},
                         {"k_cache", k_cache},
                         {"v_cache", v_cache}}) {
    check_inner_contiguous(op, name, t);
    check_same_device(op, name, t, q, "q");
  }
  for (auto [name, t] : {std::pair<const char*, const at::Tensor&>{"cache_lens", cache_lens},
                         {"n_commit", n_commit},
                         {"n_valid", n_valid}}) {
    check_lengths(op, name, t, B);
    check_same_device(op, name, t, q, "q");
  }
  TORCH_CHECK_VALUE(std::isfinite(scale), op, ": scale must be a finite number, got ", scale);
  // The kernels compute in fp32: a cap that is not a finite fp32 number would make every logit NaN.
  TORCH_CHECK_VALUE(std::isfinite(softcap) && softcap >= 0.0 && softcap <= std::numeric_limits<float>::max(), op,
                    ": softcap must be a finite number >= 0 that fits in fp32 (0 = no soft-capping), got ", softcap);
  TORCH_CHECK_VALUE(window_left >= -1, op,
                    ": window_left must be >= 0 (a row at position p sees keys at positions >= p - window_left) or -1 "
                    "(no window), got ",
                    window_left);
  // The output [B, T, Hq, D] is allocated, so its element count must exist (q may be an expanded view).
  checked_mul(op, "the output size B * T * Hq * D", {B, T, Hq, D});

  // The caches are written while every input is read (by other threads / thread blocks): no sharing at all.
  check_no_internal_overlap(op, "k_cache", k_cache);
  check_no_internal_overlap(op, "v_cache", v_cache);
  check_no_overlap(op, "k_cache", k_cache, "v_cache", v_cache);
  for (auto [cname, cache] :
       {std::pair<const char*, const at::Tensor&>{"k_cache", k_cache}, {"v_cache", v_cache}})
    for (auto [name, t] : {std::pair<const char*, const at::Tensor&>{"q", q},
                           {"k", k},
                           {"v", v},
                           {"cache_lens", cache_lens},
                           {"n_commit", n_commit},
                           {"n_valid", n_valid}})
      check_no_overlap(op, cname, cache, name, t);
}

// The message of an invalid sequence, the same on both devices (the CUDA binding builds it from the kernel's
// status record).
inline std::string block_attention_length_message(sbd::LengthError e, int64_t b, int64_t len, int64_t commit,
                                                  int64_t valid, int64_t T, int64_t S) {
  std::ostringstream m;
  m << "block_attention: ";
  switch (e) {
    case sbd::LengthError::kNegativeCacheLen:
      m << "cache_lens[" << b << "] = " << len << " is negative";
      break;
    case sbd::LengthError::kNegativeCommit:
      m << "n_commit[" << b << "] = " << commit << " is negative";
      break;
    case sbd::LengthError::kNegativeValid:
      m << "n_valid[" << b << "] = " << valid << " is negative";
      break;
    case sbd::LengthError::kValidExceedsT:
      m << "n_valid[" << b << "] = " << valid << " exceeds the number of new rows T = " << T;
      break;
    case sbd::LengthError::kCommitExceedsValid:
      m << "n_commit[" << b << "] = " << commit << " exceeds n_valid[" << b << "] = " << valid
        << " (expected n_commit <= n_valid <= T)";
      break;
    case sbd::LengthError::kCacheOverflow:
      m << "cache overflow for sequence " << b << ": cache_lens[" << b << "] + n_commit[" << b << "] = " << len
        << " + " << commit << " exceeds the cache size k_cache.size(2) = " << S;
      break;
    default:
      m << "invalid lengths for sequence " << b << " (error code " << static_cast<int>(e) << ")";
  }
  return m.str();
}

// The lengths' values, read on the host (host_lengths in checks.h).
inline void check_block_attention_lengths(const std::vector<int64_t>& lens, const std::vector<int64_t>& commit,
                                          const std::vector<int64_t>& valid, int64_t T, int64_t S) {
  for (size_t b = 0; b < lens.size(); ++b) {
    const sbd::LengthError e = sbd::block_attention_length_error(lens[b], commit[b], valid[b], T, S);
    TORCH_CHECK_VALUE(e == sbd::LengthError::kNone,
                      block_attention_length_message(e, static_cast<int64_t>(b), lens[b], commit[b], valid[b], T, S));
  }
}

// Pointers, sizes, strides and scale of the shared params, from checked tensors (the lengths are set by each
// binding: host copies on the CPU, device tensors on CUDA). q / k / v are the tensors the kernel will read (the
// CUDA binding may pass aligned copies); out is [B, T, Hq, D] contiguous.
inline void fill_block_attention_params(sbd::BlockAttentionParams& p, const at::Tensor& q, const at::Tensor& k,
                                        const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                                        at::Tensor& out, double scale, double softcap, int64_t window_left) {
  p.q = q.const_data_ptr();
  p.k = k.const_data_ptr();
  p.v = v.const_data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.out = out.data_ptr();
  p.B = q.size(0);
  p.Hq = q.size(1);
  p.T = q.size(2);
  p.D = q.size(3);
  p.Hkv = k.size(1);
  p.S = k_cache.size(2);
  p.q_sb = q.stride(0), p.q_sh = q.stride(1), p.q_st = q.stride(2);
  p.k_sb = k.stride(0), p.k_sh = k.stride(1), p.k_st = k.stride(2);
  p.v_sb = v.stride(0), p.v_sh = v.stride(1), p.v_st = v.stride(2);
  p.kc_sb = k_cache.stride(0), p.kc_sh = k_cache.stride(1), p.kc_st = k_cache.stride(2);
  p.vc_sb = v_cache.stride(0), p.vc_sh = v_cache.stride(1), p.vc_st = v_cache.stride(2);
  p.scale = static_cast<float>(scale);
  p.softcap = static_cast<float>(softcap);
  p.window_left = window_left;
}

}  // namespace sbd_ext
