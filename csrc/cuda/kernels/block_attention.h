// block_attention on CUDA: the parameters, the work split, and the launcher, which is all the torch binding sees.
// Kernels: csrc/cuda/kernels/block_attention.cuh; compiled for fp32/bf16/fp16 in
// csrc/cuda/block_attention_launch.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "sbd/block_attention_params.h"

namespace sbd_cuda {

// The shared problem description (sbd/block_attention_params.h, filled by the binding's shared code) plus the
// CUDA work plan. On CUDA every pointer and every non-unit stride (in bytes) is a multiple of 16 (the binding
// guarantees it); the lengths are device memory, validated per sequence by the kernel (block_work in
// block_attention.cuh): an invalid sequence gets zero output rows and no cache write, and is reported in `status`.
struct BlockAttentionParams : sbd::BlockAttentionParams {
  // Work split (block_attention_plan). The g = Hq / Hkv query heads of a KV head and the T rows are packed into
  // M = g * T rows (packed row r = i * g + head-in-group), cut into m_tiles tiles of 64; the cache of each
  // sequence is cut into `splits` ranges, and one more "split" holds the T new rows. One thread block per
  // (m-tile, split, b * Hkv + kv head) writes a partial softmax state to `workspace`; a merge kernel combines
  // the splits + 1 partials of each output row.
  int group;
  int m_tiles;
  int splits;
  // The tensor-core kernel's shape: m-tiles per block (1 or 2) and stages of K/V tiles in flight (2 or 3).
  int tiles_per_block;
  int stages;
  void* workspace;  // block_attention_workspace_bytes(*this) bytes, 16-byte aligned
  // Use the CUDA-core kernel for bf16/fp16 too (fp32 always uses it). For debugging and A/B tests.
  bool force_simt;
  // Where the kernel records the first invalid sequence it finds (null: not recorded). Must stay valid, and be
  // readable by the host, after the launch returns: block_attention_status() below.
  sbd::BlockAttentionStatus* status;
};

bool block_attention_supports_head_dim(int64_t D);  // sbd::kCudaBlockAttentionHeadDims: 32, 64 and 128
// Fills group, m_tiles, splits, tiles_per_block and stages for a GPU with `num_sms` SMs of `smem_per_sm` bytes
// of shared memory each (0: unknown, two stages at D = 128).
void block_attention_plan(BlockAttentionParams& p, int num_sms, int smem_per_sm = 0);
size_t block_attention_workspace_bytes(const BlockAttentionParams& p);

// The process's status record for invalid lengths: mapped, pinned host memory (written by kernels on any device,
// read by the host without a copy), allocated on first use; null if that allocation fails. Defined in
// block_attention_launch.cu.
sbd::BlockAttentionStatus* block_attention_status();
// If a launch has recorded an invalid sequence since the last call, copy the record to *out, clear it and return
// true. Without a synchronisation first, a running kernel's record may be seen by a later call.
bool block_attention_take_status(sbd::BlockAttentionStatus* out);

// Launches on `stream`: the attention kernel (which also appends the committed rows to the caches) and the
// merge kernel. B == 0 launches nothing; T == 0 only the check of the lengths (an invalid one is recorded).
// T = float, __nv_bfloat16 or __half.
template <typename T>
cudaError_t launch_block_attention(const BlockAttentionParams& p, cudaStream_t stream);

}  // namespace sbd_cuda
