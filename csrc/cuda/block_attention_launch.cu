// The compiled block_attention kernels and launchers for fp32 / bf16 / fp16 (no torch headers; built by setup.py
// with a CUDA torch and by csrc/cuda/compile_check.sh everywhere).
#include "cuda/kernels/block_attention.cuh"

namespace sbd_cuda {

template cudaError_t launch_block_attention<float>(const BlockAttentionParams&, cudaStream_t);
template cudaError_t launch_block_attention<__nv_bfloat16>(const BlockAttentionParams&, cudaStream_t);
template cudaError_t launch_block_attention<__half>(const BlockAttentionParams&, cudaStream_t);

}  // namespace sbd_cuda
