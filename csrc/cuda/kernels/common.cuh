// Small CUDA helpers shared by the sbd_ext kernels: element types, 16-byte vector loads, device-side lengths,
// and the PTX wrappers (cp.async, ldmatrix, mma.sync) of the tensor-core attention path.
// No torch headers: the files under csrc/cuda/kernels compile with plain nvcc (csrc/cuda/compile_check.sh).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace sbd_cuda {

// ---- element types -------------------------------------------------------------------------------------
// The three element types of the ops: float, __nv_bfloat16, __half. kVec elements fill one 16-byte load.
template <typename T>
struct ElemTraits;
template <>
struct ElemTraits<float> {
  static constexpr int kVec = 4;
};
template <>
struct ElemTraits<__nv_bfloat16> {
  static constexpr int kVec = 8;
};
template <>
struct ElemTraits<__half> {
  static constexpr int kVec = 8;
};

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}

// Two floats rounded to a packed pair of 16-bit values (low half = a), the register format of mma.sync.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float a, float b);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float a, float b) {
  __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float a, float b) {
  __half2 v = __floats2half2_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}

// 16 bytes of T, loaded or stored as one uint4 (LDG.128 / STG.128).
template <typename T>
union Vec16 {
  uint4 u;
  T e[ElemTraits<T>::kVec];
};

template <typename T>
__device__ __forceinline__ Vec16<T> load16(const T* p) {  // p must be 16-byte aligned
  Vec16<T> v;
  v.u = __ldg(reinterpret_cast<const uint4*>(p));
  return v;
}

// ---- arithmetic ----------------------------------------------------------------------------------------
template <typename I>
__host__ __device__ __forceinline__ I ceil_div(I a, I b) {
  return (a + b - 1) / b;
}

// A length read from device memory, int32 or int64, and clamped to [0, hi]. The attention kernels validate the
// lengths (block_work in block_attention.cuh) and give an invalid sequence only empty partial states; a kernel
// that reads a length after them (the merge) needs no more than this clamp to stay in bounds.
__device__ __forceinline__ int load_len(const void* p, bool is64, int64_t i, int hi) {
  const int64_t v = is64 ? static_cast<const int64_t*>(p)[i] : static_cast<const int32_t*>(p)[i];
  return v < 0 ? 0 : (v > hi ? hi : static_cast<int>(v));
}

// ---- PTX wrappers (sm_80+) -----------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy that bypasses L1 (.cg); with valid == false nothing is read and the 16 bytes
// are zero-filled (src-size 0), so out-of-range tile rows become zeros instead of out-of-bounds reads.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i, register i receives matrix i with
// lane l holding (row l/4, cols 2(l%4), 2(l%4)+1). .trans delivers the transpose: (rows 2(l%4), +1; col l/4).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem)));
}

// D = A B + D, m16n8k16, A row-major 16x16, B "col" 16x8, fp32 accumulators. Fragments (g = lane/4,
// t = lane%4): a = {(g, 2t..2t+1), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..)}; b = {(k 2t..2t+1, n g),
// (k 2t+8.., n g)}; d = {(g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)}.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

}  // namespace sbd_cuda
