// block_attention's problem description, shared by the CPU and the CUDA kernels, and the one definition of which
// per-sequence lengths are valid (checked on the host by the CPU binding, on the device by the CUDA kernel).
//
// The torch-facing code fills this struct once (fill_block_attention_params in csrc/block_attention_checks.h);
// each device derives its own params from it, adding only its work plan (sbd_cpu::BlockAttentionParams in
// csrc/cpu/block_attention_kernel.h, sbd_cuda::BlockAttentionParams in csrc/cuda/kernels/block_attention.h).
#pragma once

#include <cmath>
#include <cstdint>

#include "sbd/common.h"

namespace sbd {

// The head dims the CUDA kernels are instantiated for (csrc/cuda/kernels/block_attention.cuh dispatches on them; the
// CPU kernel takes any). The Python layer reads the list from build_info() (sbd_ext.hf.CUDA_HEAD_DIMS), so this is
// its one definition.
inline constexpr int64_t kCudaBlockAttentionHeadDims[] = {32, 64, 128};

constexpr bool cuda_block_attention_supports_head_dim(int64_t D) {  // host code
  for (int64_t d : kCudaBlockAttentionHeadDims) {
    if (d == D) return true;
  }
  return false;
}

// Why a sequence's lengths are invalid; kNone when they are valid. The order is the order of the checks.
enum class LengthError : int32_t {
  kNone = 0,
  kNegativeCacheLen = 1,
  kNegativeCommit = 2,
  kNegativeValid = 3,
  kValidExceedsT = 4,
  kCommitExceedsValid = 5,
  kCacheOverflow = 6,
};

// Sequence b of a call with T new rows and a cache of S rows is valid when
//   cache_len >= 0,  0 <= n_commit <= n_valid <= T,  cache_len + n_commit <= S.
// The last test is written as cache_len <= S - n_commit: once 0 <= n_commit <= T, S - n_commit cannot overflow,
// whereas cache_len + n_commit does for cache_len near 2^63 (which once let an append write before the cache).
SBD_HD LengthError block_attention_length_error(int64_t cache_len, int64_t n_commit, int64_t n_valid, int64_t T,
                                                int64_t S) {
  if (cache_len < 0) return LengthError::kNegativeCacheLen;
  if (n_commit < 0) return LengthError::kNegativeCommit;
  if (n_valid < 0) return LengthError::kNegativeValid;
  if (n_valid > T) return LengthError::kValidExceedsT;
  if (n_commit > n_valid) return LengthError::kCommitExceedsValid;
  if (cache_len > S - n_commit) return LengthError::kCacheOverflow;
  return LengthError::kNone;
}

// The attention features of a model (FlashInfer's logits_soft_cap and window_left), one definition for both devices.
//
// Logit soft-capping (Gemma-2): a scaled score s becomes cap * tanh(s / cap) before masking and softmax, as
// transformers' eager attention does; cap = 0 means off.
SBD_HD float soft_cap(float s, float cap) {
#if defined(__CUDA_ARCH__)
  return cap > 0.f ? cap * tanhf(s / cap) : s;
#else
  return cap > 0.f ? cap * std::tanh(s / cap) : s;
#endif
}

// Sliding window (Mistral, Qwen2, Gemma-2/3): the query row at absolute position p -- cache row j is at position j,
// new row i at cache_len + i, committed and set-block rows alike -- sees the keys at positions >= p - window_left
// (transformers' `kv > q - sliding_window`, so window_left = sliding_window - 1), on top of the causal / set-block
// rule; window_left = -1 means no window. The first visible key position of a row at position `pos`:
SBD_HD int64_t window_first_key(int64_t pos, int64_t window_left) {
  return window_left < 0 || pos <= window_left ? 0 : pos - window_left;
}

// One length of a [B] int32 / int64 array (host or device memory, contiguous).
SBD_HD int64_t load_length(const void* p, bool is64, int64_t b) {
  return is64 ? static_cast<const int64_t*>(p)[b] : static_cast<const int32_t*>(p)[b];
}

struct BlockAttentionParams {
  // q [B, Hq, T, D]; k, v [B, Hkv, T, D]; k_cache, v_cache [B, Hkv, S, D]; all of one element type, unit stride
  // along D, the other strides in elements (*_sb over B, *_sh over heads, *_st over rows).
  const void* q;
  const void* k;
  const void* v;
  void* k_cache;  // rows [cache_len(b), cache_len(b) + commit(b)) receive the committed rows' K/V
  void* v_cache;
  void* out;  // [B, T, Hq, D], contiguous, q's element type
  int64_t B, Hq, Hkv, T, D, S;
  int64_t q_sb, q_sh, q_st;
  int64_t k_sb, k_sh, k_st;
  int64_t v_sb, v_sh, v_st;
  int64_t kc_sb, kc_sh, kc_st;
  int64_t vc_sb, vc_sh, vc_st;
  float scale;  // softmax scale
  float softcap;        // > 0: logits soft-capped at softcap (soft_cap above); 0: off
  int64_t window_left;  // >= 0: sliding window (window_first_key above); -1: off
  // [B] lengths, contiguous, int32 or int64 each (the *_i64 flags): host memory on the CPU (validated by the
  // binding before the kernel runs), device memory on CUDA (validated by the kernel, see block_attention.cuh).
  const void* cache_lens;
  const void* n_commit;
  const void* n_valid;
  bool cache_lens_i64, n_commit_i64, n_valid_i64;

  SBD_HD int64_t cache_len(int64_t b) const { return load_length(cache_lens, cache_lens_i64, b); }
  SBD_HD int64_t commit(int64_t b) const { return load_length(n_commit, n_commit_i64, b); }
  SBD_HD int64_t valid(int64_t b) const { return load_length(n_valid, n_valid_i64, b); }
  // The first cache row any new row of a sequence with `len` cached rows sees (its first row's window start): no
  // key before it is read.
  SBD_HD int64_t first_cache_row(int64_t len) const { return window_first_key(len, window_left); }
};

// The first invalid sequence a CUDA launch found (block_attention_status in csrc/cuda/kernels/block_attention.h):
// enough to rebuild the CPU binding's message on the host. `ready` is written last, after a system fence.
struct BlockAttentionStatus {
  int32_t code;  // a LengthError; claimed with atomicCAS from 0, so the first error found wins
  int32_t ready;
  int64_t b, cache_len, n_commit, n_valid, T, S;
};

}  // namespace sbd
