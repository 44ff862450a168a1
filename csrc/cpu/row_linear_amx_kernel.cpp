// row_linear's packed int8 weights times several quantised x rows on AMX-INT8 tiles (Intel Sapphire Rapids and
// later), and its bf16 weights in tiles times bf16 x rows on AMX-BF16 (the "bf16" section below), in the AVX-512
// variant only (the other variants compile nothing here). See cpu/isa.h for when each runs.
//
// Why: at one x row a packed int8 linear is a pass over the weight and the VNNI tile (row_linear_kernel.cpp,
// q8_panel_tile) keeps up with memory; at 4-32 rows (a verify or SBD forward) it does 8 vpdpbusd and 8 broadcasts per
// row, block of 32 values and panel of 16 outputs, and the multiply-adds, not the stream, set the time. One
// tdpbsud does a block for 16 rows x 16 outputs: the target is a 16-row forward at <= 1.3x a one-row one.
//
// The sums are the VNNI path's, bit for bit, so the choice of path by row count (cpu/isa.h, kAmxMinRows) keeps
// row_linear batch invariant. Per x row m, panel output n and block b of 32 values: the block's integer dot product
// sum_k x[m, 32 b + k] * (q[n, 32 b + k] + 128) -- exact in int32 on both paths (vpdpbusd / tdpbsud, no
// saturation) -- minus 128 x (the block's x sum), converted to fp32 and added with one FMA times the block's x scale,
// the blocks in ascending order from zero; the weight row's scale multiplies the finished sum.
//
// Tiles (palette 1): the packed panel's block of 32 values is 8 rows of 64 bytes ([K / 4][16 outputs][4 values],
// sbd_ext.packing.pack_row_linear_int8), which is the B operand's layout (row k: 4 consecutive values of each of 16
// columns); A is the quantised x, row-major ([M, 32 * blocks], signed), 32 bytes of one block per row. Per block:
// tileloadd A and B, tileloadd C from the rows' -128 x sums of the block (so the tile's exact int32 sum is the VNNI
// path's difference; it was a tilezero and a subtraction per row in the epilogue), tdpbsud, tilestored C to a 1 KB
// buffer in L1, then per row one load, a conversion and an FMA into the row's fp32 accumulator. Consecutive blocks
// alternate between two sets of tiles, so
// a block's dot product overlaps the store and epilogue of the one before. Rows come in groups of up to 16 (A's and
// C's row count), each group a pass over the range's panels (the second pass reads them from L2).
//
// Tile numbers are literals (the intrinsics paste them into the instruction), so each operation is its own small
// function, once for the hardware (HwTiles) and once for a C++ model of the same instructions (EmuTiles, on
// cpu/amx_tiles.h's model from the Intel SDM's pseudo-code: zeroing, row/column limits, the configuration's shape
// rules), which the tests run on any AVX512-VNNI CPU so that the layouts and the loop are checked where no AMX exists.
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "cpu/row_linear_kernel.h"

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>

#include "cpu/aligned_buffer.h"
#include "cpu/amx_tiles.h"

namespace sbd_cpu {
namespace CPU_CAPABILITY {
namespace {

constexpr int64_t kB = kRowLinearXBlock;                       // values per block
constexpr int64_t kPanelBlockBytes = kRowLinearPanel * kB;     // one block of one panel: 8 tile rows of 64 bytes
constexpr int kGroupRows = 16;                                 // A's and C's rows
// The weight stream's prefetch, two levels: into L2 kAheadL2 bytes ahead (the L2's queue holds more lines in flight
// than L1's fill buffers) and from there into L1 kAheadL1 ahead. One level, 4 KB into L1 (as the VNNI tile's), left
// the 16-row loop's tile loads waiting: SmolLM2's w8a8 linears x 16 rows, streamed, ~47 ns per panel block against
// ~37 with the two levels (Intel Xeon, AMX, 1 thread; 8/1, 16/1 and 16/2 KB alike, 4 KB into L2 ~10 % slower).
constexpr int64_t kAheadL2 = 8192, kAheadL1 = 1024;

// The kernel's tiles, two sets that alternate by block (so that a block's dot product need not wait for the tile
// store of the one before): 0 / 1 = C (int32 [rows][16]), 2 / 3 = A (int8 [rows][32]), 4 / 5 = B (uint8 [8][64]).
TileConfig config_for(int rows) {
  TileConfig c;
  for (int s = 0; s < 2; ++s) {
    c.rows[0 + s] = c.rows[2 + s] = static_cast<uint8_t>(rows);
    c.colsb[0 + s] = 64;
    c.colsb[2 + s] = static_cast<uint16_t>(kB);
    c.rows[4 + s] = static_cast<uint8_t>(kB / 4);
    c.colsb[4 + s] = 64;
  }
  return c;
}

#define SBD_AMX __attribute__((target("amx-tile,amx-int8,amx-bf16"))) inline
struct HwTiles : HwTileOps {  // configure / release: cpu/amx_tiles.h's
  // one block on tile set S: C = c0 + A . B (c0: [rows][16] int32, 64-byte rows, the rows' -128 x sums), stored to c
  template <int S>
  SBD_AMX static void block(const int8_t* a, int64_t a_stride, const uint8_t* b, const int32_t* c0, int32_t* c) {
    if constexpr (S == 0) {
      _tile_loadd(2, a, a_stride);
      _tile_loadd(4, b, 64);
      _tile_loadd(0, c0, 64);
      _tile_dpbsud(0, 2, 4);
      _tile_stored(0, c, 64);
    } else {
      _tile_loadd(3, a, a_stride);
      _tile_loadd(5, b, 64);
      _tile_loadd(1, c0, 64);
      _tile_dpbsud(1, 3, 5);
      _tile_stored(1, c, 64);
    }
  }
  // bf16 (row_linear_bf16_tiles_range): C tiles 0 / 1 (fp32 [16 weight rows][cols]), A tiles 2 / 3 (16 weight rows of
  // 32 bf16), B tile 4 (16 pairs x cols x rows of bf16 x)
  template <int S>
  SBD_AMX static void bf16_zero() {
    if constexpr (S == 0) {
      _tile_zero(0);
    } else {
      _tile_zero(1);
    }
  }
  SBD_AMX static void bf16_x(const uint16_t* b, int64_t stride) { _tile_loadd(4, b, stride); }
  template <int S>
  SBD_AMX static void bf16_dot(const uint16_t* a) {
    if constexpr (S == 0) {
      _tile_loadd(2, a, 64);
      _tile_dpbf16ps(0, 2, 4);
    } else {
      _tile_loadd(3, a, 64);
      _tile_dpbf16ps(1, 3, 4);
    }
  }
  template <int S>
  SBD_AMX static void bf16_store(float* c) {
    if constexpr (S == 0) {
      _tile_stored(0, c, 64);
    } else {
      _tile_stored(1, c, 64);
    }
  }
};
#undef SBD_AMX

// The same operations on the emulated tiles (cpu/amx_tiles.h), for the tests on any AVX512-VNNI CPU.
struct EmuTiles : EmuTileOps {
  template <int S>
  static void bf16_zero() {
    zero(S);
  }
  static void bf16_x(const uint16_t* b, int64_t stride) { load(4, b, stride); }
  template <int S>
  static void bf16_dot(const uint16_t* a) {
    load(2 + S, a, 64);
    dpbf16ps(S, 2 + S, 4);
  }
  template <int S>
  static void bf16_store(float* c) {
    store(S, c, 64);
  }
  template <int S>
  static void block(const int8_t* a, int64_t a_stride, const uint8_t* b, const int32_t* c0, int32_t* c) {
    load(2 + S, a, a_stride);
    load(4 + S, b, 64);
    load(S, c0, 64);
    dpbsud(S, 2 + S, 4 + S);
    store(S, c, 64);
  }
};

// One block's int32 sums of a row group (c: [rows][16], the -128 x sum already in: the tile started from it) into its
// fp32 accumulators, as q8_panel_tile does.
template <int MR>
inline void add_block(const int32_t* c, const float* xd, __m512* acc) {
  for (int i = 0; i < MR; ++i)
    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * i)), _mm512_set1_ps(xd[i]), acc[i]);
}

template <int MR>
inline void store_rows(const RowLinearParams& p, int64_t m0, int64_t panel, const __m512* acc) {
  const __m512 scale = _mm512_loadu_ps(p.w_scale + panel * kRowLinearPanel);
  for (int i = 0; i < MR; ++i)
    _mm512_storeu_ps(p.out + (m0 + i) * p.out_stride + panel * kRowLinearPanel, _mm512_mul_ps(acc[i], scale));
}

inline void prefetch_block(const uint8_t* wb, const char* end) {
  for (int64_t line = 0; line < kPanelBlockBytes; line += 64) {
    const char* far = reinterpret_cast<const char*>(wb) + kAheadL2 + line;
    const char* near = reinterpret_cast<const char*>(wb) + kAheadL1 + line;
    if (far < end) __builtin_prefetch(far, 0, 2);
    if (near < end) __builtin_prefetch(near, 0, 3);
  }
}

// Rows [m0, m0 + MR) times panels [p0, p1), the blocks of a panel on alternating tile sets. The tiles are configured
// for MR rows by the caller. Compiled for the tile instructions (which only the intrinsics emit), so that HwTiles'
// operations inline: as calls they cost the 16-row loop ~10 % (a SmolLM2 gate projection, 16 rows, streamed).
template <class T, int MR>
__attribute__((target("amx-tile,amx-int8,amx-bf16"))) void group_panels(const RowLinearParams& p, int64_t m0,
                                                                          int64_t p0, int64_t p1, bool prefetch) {
  const int64_t M = p.M, nb = p.x_blocks, panel_bytes = nb * kPanelBlockBytes;
  const char* end = reinterpret_cast<const char*>(p.wq_packed + (p.N / kRowLinearPanel) * panel_bytes);
  const int8_t* xa = p.xq + m0 * p.xq_stride;
  alignas(64) int32_t c[2][kGroupRows * 16];
  // Each block's C starts from its rows' -xct (the correction of the weight's +128): the tile's integer sum is then
  // the VNNI path's (c - xct) exactly, and the epilogue is a conversion and an FMA per row.
  static thread_local AlignedBuffer<int32_t> c0_buf;
  static thread_local int64_t c0_blocks = 0;
  if (c0_blocks < nb) {
    c0_buf = alloc_aligned<int32_t>(nb * kGroupRows * 16);
    c0_blocks = nb;
  }
  int32_t* c0 = c0_buf.get();
  for (int64_t b = 0; b < nb; ++b)
    for (int i = 0; i < MR; ++i)
      _mm512_store_si512(c0 + (b * kGroupRows + i) * 16, _mm512_set1_epi32(-p.xct[b * M + m0 + i]));
  for (int64_t panel = p0; panel < p1; ++panel) {
    const uint8_t* w = p.wq_packed + panel * panel_bytes;
    __m512 acc[MR];
    for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* wb = w + b * kPanelBlockBytes;
      if (prefetch) prefetch_block(wb, end);
      const int32_t* cb = c0 + b * kGroupRows * 16;
      if (b % 2 == 0) {
        T::template block<0>(xa + b * kB, p.xq_stride, wb, cb, c[0]);
      } else {
        T::template block<1>(xa + b * kB, p.xq_stride, wb, cb, c[1]);
      }
      add_block<MR>(c[b % 2], p.xdt + b * M + m0, acc);
    }
    store_rows<MR>(p, m0, panel, acc);
  }
}

template <class T, int R>
void group_rows(const RowLinearParams& p, int64_t m0, int64_t rows, int64_t p0, int64_t p1, bool prefetch) {
  if constexpr (R > 0) {
    if (rows == R) return group_panels<T, R>(p, m0, p0, p1, prefetch);
    group_rows<T, R - 1>(p, m0, rows, p0, p1, prefetch);
  }
}

template <class T>
void amx_range(const RowLinearParams& p, int64_t n0, int64_t n1) {
  const int64_t groups = (p.M + kGroupRows - 1) / kGroupRows, base = p.M / groups, extra = p.M % groups;
  int64_t m = 0;
  for (int64_t g = 0; g < groups; ++g) {  // as equal groups as 16 rows allow (20 rows: 10 + 10)
    const int64_t rows = base + (g < extra ? 1 : 0);
    T::configure(config_for(static_cast<int>(rows)));
    group_rows<T, kGroupRows>(p, m, rows, n0 / kRowLinearPanel, n1 / kRowLinearPanel, g == 0);
    m += rows;
  }
  T::release();
}

// ---- bf16 -------------------------------------------------------------------------------------------------------
// row_linear_bf16_tiles_range: Why: a bf16 panel (row_linear_kernel.cpp) widens every weight to fp32 and does one FMA
// per weight and x row, so 16 rows cost 16 times the multiply-adds of one; one tdpbf16ps does 32 values x 16 weight
// rows x up to 16 x rows. A standalone probe (Intel Xeon, AMX, 1 thread, 270 MB of bf16 weights in this layout on
// huge pages, 2026-12-05): the tiles streamed at 13.7-14.0 GB/s at 1, 4 and 16 x rows, a plain read 14.6-14.9 and
// the one-row bf16 panel loop 10.6; no software prefetch distance (2 KB into L1, 8 / 16 KB into L2) beat none.
//
// Roles: the weight is A (its tile layout puts 16 rows x 32 values -- 1 KB -- in one contiguous run, so the stream
// is linear), x is B (16 pairs x up to 16 x rows), C is [16 weight rows][x rows] in fp32, kept across all blocks of
// K and read back once per panel, transposed into out's rows. Two panels at a time (C tiles 0 and 1, A tiles 2 and
// 3) share each loaded x block.

TileConfig bf16_config(int cols) {
  TileConfig c;
  for (int s = 0; s < 2; ++s) {
    c.rows[s] = 16;
    c.colsb[s] = static_cast<uint16_t>(4 * cols);
    c.rows[2 + s] = 16;
    c.colsb[2 + s] = 64;
  }
  c.rows[4] = 16;
  c.colsb[4] = static_cast<uint16_t>(4 * cols);
  return c;
}

// C ([16 weight rows][16], 64-byte rows, from bf16_store) to out: x row m0 + j gets the panel's 16 outputs c[i][j].
inline void store_bf16_panel(const RowLinearParams& p, const float* c, int64_t m0, int64_t rows, int64_t panel) {
  const __m512i down = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
  for (int64_t j = 0; j < rows; ++j)
    _mm512_storeu_ps(p.out + (m0 + j) * p.out_stride + panel * kRowLinearPanel,
                     _mm512_i32gather_ps(_mm512_add_epi32(down, _mm512_set1_epi32(static_cast<int>(j))), c, 4));
}

template <class T>
__attribute__((target("amx-tile,amx-int8,amx-bf16"))) void bf16_tiles(const RowLinearParams& p, int64_t n0,
                                                                      int64_t n1) {
  const int64_t nb = p.x_blocks, cols = p.xb_cols, panel_elems = nb * 512, x_block = 16 * cols * 2;
  const int64_t last = n1 / kRowLinearPanel;
  alignas(64) float c[2][16 * 16];
  T::configure(bf16_config(static_cast<int>(cols)));
  for (int64_t panel = n0 / kRowLinearPanel; panel < last; panel += 2) {
    const bool two = panel + 1 < last;
    const uint16_t* w0 = p.wt + panel * panel_elems;
    const uint16_t* w1 = w0 + panel_elems;
    for (int64_t g = 0; g < p.xb_groups; ++g) {
      const uint16_t* xb = p.xbt + g * nb * x_block;
      T::template bf16_zero<0>();
      T::template bf16_zero<1>();
      for (int64_t b = 0; b < nb; ++b) {
        T::bf16_x(xb + b * x_block, 4 * cols);
        T::template bf16_dot<0>(w0 + b * 512);
        if (two) T::template bf16_dot<1>(w1 + b * 512);
      }
      const int64_t m0 = g * cols, rows = std::min(cols, p.M - m0);
      T::template bf16_store<0>(c[0]);
      store_bf16_panel(p, c[0], m0, rows, panel);
      if (two) {
        T::template bf16_store<1>(c[1]);
        store_bf16_panel(p, c[1], m0, rows, panel + 1);
      }
    }
  }
  T::release();
}

}  // namespace

void row_linear_bf16_tiles_range(const RowLinearParams& p, int64_t n0, int64_t n1, bool emulate) {
  count_amx_range();
  if (emulate) return bf16_tiles<EmuTiles>(p, n0, n1);
  bf16_tiles<HwTiles>(p, n0, n1);
}

void row_linear_amx_range(const RowLinearParams& p, int64_t n0, int64_t n1, bool emulate) {
  count_amx_range();
  if (emulate) return amx_range<EmuTiles>(p, n0, n1);
  amx_range<HwTiles>(p, n0, n1);
}

}  // namespace CPU_CAPABILITY
}  // namespace sbd_cpu
#endif
