// block_attention on CUDA: the parameters, the work split, and the launcher, which is all the torch binding sees.
// Kernels: csrc/cuda/kernels/block_attention.cuh; compiled for fp32/bf16/fp16 in
// csrc/cuda/block_attention_launch.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace sbd_cuda {

struct BlockAttentionParams {
  // Tensors of element type T (the launcher's template argument); every last dimension has stride 1, and every
  // pointer and every other stride (in bytes) is a multiple of 16 (the binding guarantees it).
  const void* q;  // [B, Hq, T, D]
  const void* k;  // [B, Hkv, T, D]
  const void* v;  // [B, Hkv, T, D]
  void* k_cache;  // [B, Hkv, S, D], rows [cache_lens[b], cache_lens[b] + n_commit[b]) written
  void* v_cache;  // [B, Hkv, S, D]
  void* out;      // [B, T, Hq, D], contiguous
  // [B] lengths in device memory, contiguous, int32 or int64 each (the *_i64 flags). Read on the device and
  // clamped (cache_lens to [0, S], n_commit and n_valid to [0, T]), so bad values cannot cause out-of-bounds
  // access; the binding does not read them on the host (that would synchronise).
  const void* cache_lens;
  const void* n_commit;
  const void* n_valid;
  bool cache_lens_i64, n_commit_i64, n_valid_i64;
  int64_t q_sb, q_sh, q_st;     // element strides of q over B, Hq, T
  int64_t k_sb, k_sh, k_st;     // of k over B, Hkv, T
  int64_t v_sb, v_sh, v_st;     // of v
  int64_t kc_sb, kc_sh, kc_ss;  // of k_cache over B, Hkv, S
  int64_t vc_sb, vc_sh, vc_ss;  // of v_cache
  int B, Hq, Hkv, T, S, D;
  float scale;  // softmax scale
  // Work split (block_attention_plan). The g = Hq / Hkv query heads of a KV head and the T rows are packed into
  // M = g * T rows (packed row r = i * g + head-in-group), cut into m_tiles tiles of 64; the cache of each
  // sequence is cut into `splits` ranges, and one more "split" holds the T new rows. One thread block per
  // (m-tile, split, b * Hkv + kv head) writes a partial softmax state to `workspace`; a merge kernel combines
  // the splits + 1 partials of each output row.
  int group;
  int m_tiles;
  int splits;
  void* workspace;  // block_attention_workspace_bytes(*this) bytes, 16-byte aligned
  // Use the CUDA-core kernel for bf16/fp16 too (fp32 always uses it). For debugging and A/B tests.
  bool force_simt;
};

bool block_attention_supports_head_dim(int D);  // 64 and 128
// Fills group, m_tiles, splits for a GPU with `num_sms` SMs.
void block_attention_plan(BlockAttentionParams& p, int num_sms);
size_t block_attention_workspace_bytes(const BlockAttentionParams& p);

// Launches on `stream`: the attention kernel (which also appends the committed rows to the caches) and the
// merge kernel. B == 0 or T == 0 launches nothing. T = float, __nv_bfloat16 or __half.
template <typename T>
cudaError_t launch_block_attention(const BlockAttentionParams& p, cudaStream_t stream);

}  // namespace sbd_cuda
