// One fp32 value's bf16 bits (round to nearest even; NaN -> the quiet NaN 0x7FC0, as c10::BFloat16), for the CPU
// kernels compiled per ISA (a *_kernel.cpp: CPU_CAPABILITY defined): row_linear's bf16 x, screened_head's x pairs.
// amx_tiles.h's bf16_rne_bits is the same rounding on 16 values.
#pragma once

#include <cstdint>
#include <cstring>

namespace sbd_cpu {
namespace CPU_CAPABILITY {

inline uint16_t bf16_rne(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

}  // namespace CPU_CAPABILITY
}  // namespace sbd_cpu
