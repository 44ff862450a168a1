// The compiled mask_replace kernel and launcher (no torch headers; built by setup.py with a CUDA torch and by
// csrc/cuda/compile_check.sh everywhere). Tokens are int64 by the op's contract, so there is one instantiation.
#include "cuda/kernels/mask_replace.cuh"
