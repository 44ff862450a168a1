// The AMX tile registers for the CPU kernels' AVX-512 variant (row_linear_amx_kernel.cpp, block_attention_kernel.cpp):
// the ldtilecfg operand, the tiles' operations as the hardware runs them (HwTileOps) and the same operations on a C++
// model of the registers (EmuTileOps), which the tests run on any AVX512-VNNI CPU so that a kernel's layouts and loops
// are checked where no AMX exists. Tile numbers are literals in the instructions, so the generic operations take them
// as template arguments (tzero<0>, tload<1>, tdpbf16<0, 1, 2>, ...). Include only under CPU_CAPABILITY_AVX512.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "cpu/row_linear_kernel.h"

namespace sbd_cpu {
namespace CPU_CAPABILITY {

// 16 fp32 values -> their bf16 bits (round to nearest even, NaN -> the quiet NaN 0x7FC0: bf16_rne's bits) in the
// low half of each dword: the tiles' bf16 operands (row_linear's x, block_attention's probabilities).
inline __m512i bf16_rne_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
}

// ldtilecfg's 64-byte operand (Intel SDM, "TILECFG"): palette 1, per tile its bytes per row and its rows.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64);

// The same operations on a model of the tile registers (this thread's), per the SDM: ldtilecfg zeroes every tile;
// a load or tilezero writes the configured rows x bytes and zeroes the rest of the tile; tdpbsud requires
// A.rows == C.rows, B.rows == A.colsb / 4 and B.colsb == C.colsb and adds, per C row m and dword n, the 4 products
// of A's signed bytes [m][4k .. 4k + 3] with B's unsigned bytes [k][4n .. 4n + 3] for k < A.colsb / 4. A violated
// rule throws (the hardware raises #UD).
struct EmuTileOps {
  struct State {
    TileConfig cfg;
    bool configured = false;
    uint8_t t[8][16][64];
  };
  static State& s() {
    static thread_local State st;
    return st;
  }
  static void need(bool ok, const char* what) {
    if (!ok) throw std::logic_error(std::string("sbd_ext AMX emulation: ") + what);
  }
  static void configure(const TileConfig& c) {
    need(c.palette == 1, "palette must be 1");
    for (int i = 0; i < 8; ++i) need(c.rows[i] <= 16 && c.colsb[i] <= 64, "a tile over 16 rows x 64 bytes");
    s().cfg = c;
    s().configured = true;
    std::memset(s().t, 0, sizeof(s().t));
  }
  static void release() { s().configured = false; }
  static void zero(int i) {
    need(s().configured, "tilezero before ldtilecfg");
    std::memset(s().t[i], 0, sizeof(s().t[i]));
  }
  static void load(int i, const void* p, int64_t stride) {
    need(s().configured && s().cfg.rows[i] > 0, "tileloadd of an unconfigured tile");
    std::memset(s().t[i], 0, sizeof(s().t[i]));
    for (int r = 0; r < s().cfg.rows[i]; ++r)
      std::memcpy(s().t[i][r], static_cast<const uint8_t*>(p) + r * stride, s().cfg.colsb[i]);
  }
  static void store(int i, void* p, int64_t stride) {
    need(s().configured && s().cfg.rows[i] > 0, "tilestored of an unconfigured tile");
    for (int r = 0; r < s().cfg.rows[i]; ++r)
      std::memcpy(static_cast<uint8_t*>(p) + r * stride, s().t[i][r], s().cfg.colsb[i]);
  }
  static void dpbsud(int c, int a, int b) {
    const TileConfig& g = s().cfg;
    need(s().configured, "tdpbsud before ldtilecfg");
    need(g.rows[a] == g.rows[c] && g.rows[b] * 4 == g.colsb[a] && g.colsb[b] == g.colsb[c] && g.colsb[c] % 4 == 0,
         "tdpbsud's tile shapes do not agree");
    for (int m = 0; m < g.rows[c]; ++m) {
      for (int n = 0; n < g.colsb[c] / 4; ++n) {
        int32_t acc;
        std::memcpy(&acc, s().t[c][m] + 4 * n, 4);
        for (int k = 0; k < g.colsb[a] / 4; ++k)
          for (int i = 0; i < 4; ++i)
            acc += static_cast<int32_t>(static_cast<int8_t>(s().t[a][m][4 * k + i])) *
                   static_cast<int32_t>(s().t[b][k][4 * n + i]);
        std::memcpy(s().t[c][m] + 4 * n, &acc, 4);
      }
    }
  }
  // tdpbf16ps: A.rows == C.rows, B.rows == A.colsb / 4, B.colsb == C.colsb; per C row m and fp32 n, per pair k in
  // order, bf16_pair_add of A's bf16 [m][2k], [m][2k + 1] and B's [k][2n], [k][2n + 1] (the model, not the SDM's
  // sequential products: see row_linear_kernel.h)
  static void dpbf16ps(int c, int a, int b) {
    const TileConfig& g = s().cfg;
    need(s().configured, "tdpbf16ps before ldtilecfg");
    need(g.rows[a] == g.rows[c] && g.rows[b] * 4 == g.colsb[a] && g.colsb[b] == g.colsb[c] && g.colsb[c] % 4 == 0,
         "tdpbf16ps's tile shapes do not agree");
    for (int m = 0; m < g.rows[c]; ++m) {
      for (int n = 0; n < g.colsb[c] / 4; ++n) {
        float acc;
        std::memcpy(&acc, s().t[c][m] + 4 * n, 4);
        for (int k = 0; k < g.colsb[a] / 4; ++k) {
          uint16_t av[2], bv[2];
          std::memcpy(av, s().t[a][m] + 4 * k, 4);
          std::memcpy(bv, s().t[b][k] + 4 * n, 4);
          acc = bf16_pair_add(acc, av[0], av[1], bv[0], bv[1]);
        }
        std::memcpy(s().t[c][m] + 4 * n, &acc, 4);
      }
    }
  }
  template <int I>
  static void tzero() {
    zero(I);
  }
  template <int I>
  static void tload(const void* p, int64_t stride) {
    load(I, p, stride);
  }
  template <int I>
  static void tstore(void* p, int64_t stride) {
    store(I, p, stride);
  }
  template <int C, int A, int B>
  static void tdpbf16() {
    dpbf16ps(C, A, B);
  }
};

#define SBD_TILE_CASES                                                                       \
  SBD_TILE_CASE(0) SBD_TILE_CASE(1) SBD_TILE_CASE(2) SBD_TILE_CASE(3) SBD_TILE_CASE(4) SBD_TILE_CASE(5) \
  SBD_TILE_CASE(6) SBD_TILE_CASE(7)
#define SBD_AMX_OPS __attribute__((target("amx-tile,amx-int8,amx-bf16"))) inline
struct HwTileOps {
  // the whole 64 bytes as the asm's operand (the intrinsic names only 8 of them, so the compiler could drop the
  // stores of the rest)
  SBD_AMX_OPS static void configure(const TileConfig& c) { __asm__ volatile("ldtilecfg %0" ::"m"(c)); }
  SBD_AMX_OPS static void release() { _tile_release(); }
  // (GCC's tile intrinsics paste the number's spelling into the instruction, so each tile number is its own literal)
  template <int I>
  SBD_AMX_OPS static void tzero() {
#define SBD_TILE_CASE(N) \
  if constexpr (I == N) _tile_zero(N);
    SBD_TILE_CASES
#undef SBD_TILE_CASE
  }
  template <int I>
  SBD_AMX_OPS static void tload(const void* p, int64_t stride) {
#define SBD_TILE_CASE(N) \
  if constexpr (I == N) _tile_loadd(N, p, stride);
    SBD_TILE_CASES
#undef SBD_TILE_CASE
  }
  template <int I>
  SBD_AMX_OPS static void tstore(void* p, int64_t stride) {
#define SBD_TILE_CASE(N) \
  if constexpr (I == N) _tile_stored(N, p, stride);
    SBD_TILE_CASES
#undef SBD_TILE_CASE
  }
  // the (C, A, B) triples the kernels use
#define SBD_TILE_TRIPLES                                                                                    \
  SBD_TILE_TRIPLE(0, 1, 2) SBD_TILE_TRIPLE(3, 4, 2) SBD_TILE_TRIPLE(5, 7, 2) SBD_TILE_TRIPLE(6, 1, 2)     \
  SBD_TILE_TRIPLE(0, 4, 6) SBD_TILE_TRIPLE(0, 5, 7) SBD_TILE_TRIPLE(3, 4, 1) SBD_TILE_TRIPLE(3, 5, 2)
  template <int C, int A, int B>
  SBD_AMX_OPS static void tdpbf16() {
    constexpr bool listed = false
#define SBD_TILE_TRIPLE(c, a, b) || (C == c && A == a && B == b)
        SBD_TILE_TRIPLES;
#undef SBD_TILE_TRIPLE
    static_assert(listed, "add the triple to SBD_TILE_TRIPLES");
#define SBD_TILE_TRIPLE(c, a, b) \
  if constexpr (C == c && A == a && B == b) _tile_dpbf16ps(c, a, b);
    SBD_TILE_TRIPLES
#undef SBD_TILE_TRIPLE
  }
};
#undef SBD_AMX_OPS
#undef SBD_TILE_CASES
#undef SBD_TILE_TRIPLES

}  // namespace CPU_CAPABILITY
}  // namespace sbd_cpu
