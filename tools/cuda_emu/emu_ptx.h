// The emulator's versions of the PTX wrappers of csrc/cuda/kernels/common.cuh (cp.async, ldmatrix, mma.sync);
// transform.py puts this include where that section was.
#pragma once

#include "emu.h"

namespace sbd_cuda {

inline void cp_async16(void* smem, const void* gmem, bool valid) { sbd_emu::cp_async(smem, gmem, valid); }
inline void cp_async_commit() { sbd_emu::cp_async_commit(); }
template <int N>
inline void cp_async_wait() {
  sbd_emu::cp_async_wait(N);
}
inline void ldmatrix_x4(uint32_t (&r)[4], const void* smem) { sbd_emu::ldmatrix(r, smem, false); }
inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) { sbd_emu::ldmatrix(r, smem, true); }
template <typename T>
inline void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  sbd_emu::mma16816<T>(d, a, b0, b1);
}

}  // namespace sbd_cuda
