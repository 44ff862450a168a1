// The compiled block_attention kernels and launchers for fp32 / bf16 / fp16 (no torch headers; built by setup.py
// with a CUDA torch and by csrc/cuda/compile_check.sh everywhere), and the status record of invalid lengths.
#include <cstring>
#include <mutex>

#include "cuda/kernels/block_attention.cuh"

namespace sbd_cuda {

template cudaError_t launch_block_attention<float>(const BlockAttentionParams&, cudaStream_t);
template cudaError_t launch_block_attention<__nv_bfloat16>(const BlockAttentionParams&, cudaStream_t);
template cudaError_t launch_block_attention<__half>(const BlockAttentionParams&, cudaStream_t);

// Mapped pinned memory rather than a device buffer: the host reads the record with a plain load (no copy, no
// synchronisation inside the op, so the op stays capturable in a CUDA graph), and with unified addressing the same
// pointer is valid in kernels on every device. Never freed: kernels may write it until the process exits.
sbd::BlockAttentionStatus* block_attention_status() {
  static sbd::BlockAttentionStatus* status = [] {
    void* p = nullptr;
    if (cudaHostAlloc(&p, sizeof(sbd::BlockAttentionStatus), cudaHostAllocMapped | cudaHostAllocPortable) !=
        cudaSuccess) {
      (void)cudaGetLastError();  // the op then runs without recording (it still never leaves its tensors)
      return static_cast<sbd::BlockAttentionStatus*>(nullptr);
    }
    std::memset(p, 0, sizeof(sbd::BlockAttentionStatus));
    return static_cast<sbd::BlockAttentionStatus*>(p);
  }();
  return status;
}

bool block_attention_take_status(sbd::BlockAttentionStatus* out) {
  static std::mutex mu;  // two host threads must not both report (or half-clear) one record
  sbd::BlockAttentionStatus* st = block_attention_status();
  if (st == nullptr) return false;
  const std::lock_guard<std::mutex> lock(mu);
  volatile sbd::BlockAttentionStatus* vst = st;
  if (vst->ready == 0) return false;
  std::memcpy(out, st, sizeof(*out));
  vst->ready = 0;
  vst->code = 0;  // after `ready`: a kernel that claims the record now writes all of it again
  return true;
}

}  // namespace sbd_cuda
