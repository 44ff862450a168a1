// The compiled entropy_sample kernels and launchers for fp32 / bf16 / fp16 logits (no torch headers; built by
// setup.py with a CUDA torch and by csrc/cuda/compile_check.sh everywhere).
#include "cuda/kernels/entropy_sample.cuh"

namespace sbd_cuda {

template cudaError_t launch_entropy_sample<float>(const EntropySampleParams&, cudaStream_t);
template cudaError_t launch_entropy_sample<__nv_bfloat16>(const EntropySampleParams&, cudaStream_t);
template cudaError_t launch_entropy_sample<__half>(const EntropySampleParams&, cudaStream_t);

}  // namespace sbd_cuda
