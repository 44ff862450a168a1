// block_attention on CUDA: flash-decoding over a KV cache for a block of T new query rows, with the committed
// rows' K/V appended to the cache in the same launch.
//
// Shape of the problem (SBD decoding): T = 1..64 new rows (16 or 32 for Llama-3.1-8B with block size 16),
// caches of thousands of rows. The work is reading the cache once: K and V of one KV head of a 4k cache are
// 2 MiB in bf16 at D = 128, so a Llama-3.1-8B layer (8 KV heads) is 16 MiB, 5 us at the H100's 3.35 TB/s.
//
// Decomposition (FlashDecoding, with GQA packing):
// - The g = Hq / Hkv query heads that share a KV head and the T rows are packed into M = g * T query rows
//   (packed row r = i * g + head-in-group), so the cache of a KV head is read once for all of them. M is cut
//   into tiles of kBM = 64 rows.
// - The cache of each sequence is cut into `splits` ranges (sized on the device from its own length, so a short
//   sequence in a long-capacity cache still spreads over all splits); one more split holds the T new rows with
//   the SBD mask (committed rows causal, set-block rows bidirectional over the valid rows, padding rows empty).
// - One thread block per (m-tile, split, sequence x KV head) runs the online softmax over its keys and writes a
//   partial (row max m, row sum l, unnormalised output) in fp32; a merge kernel combines the splits + 1 partials
//   of each output row and writes [B, T, Hq, D] in q's dtype. Softmax runs in base 2 with the scale folded in
//   (exp2(s * scale * log2 e - m)), in both kernels and the merge: the update of sbd/softmax_state.h with Exp2
//   (softmax_advance<Exp2>), the CPU's rule in another base (that header says why the result is the same).
// - The new-rows block of m-tile 0 also copies the committed rows' K/V into the cache at cache_lens[b]. No
//   block of this launch reads cache rows >= cache_lens[b] (the new rows are read from k / v, which the binding
//   guarantees do not share memory with the caches), so the copy races with nothing and needs no ordering.
// - Lengths are read on the device and validated per sequence with sbd::block_attention_length_error, the
//   function the CPU binding runs on the host (block_work). An invalid sequence is given no keys and no append, so
//   its output rows are zeros and no length whatsoever leads outside a tensor; the new-rows block of its first
//   kv head and m-tile records it in p.status for the binding to raise, if no earlier sequence is invalid (so the
//   record names the first invalid sequence, as the CPU's error does). A call with T == 0 runs check_lengths_kernel
//   alone: nothing to compute or append, the same record.
// - Model features (sbd/block_attention_params.h): soft-capping maps each scaled score before the mask (logit());
//   a sliding window starts the cache splits at the first row the sequence's first new row sees and hides, per
//   key, what lies before each row's window (visible()).
//
// Two attention kernels with one partial format:
// - attn_mma_kernel (bf16 / fp16): tensor cores via mma.sync.m16n8k16 (fp32 accumulation), ldmatrix from an
//   XOR-swizzled shared-memory layout (conflict-free for ldmatrix and cp.async), K/V tiles of 64 keys
//   double-buffered with 16-byte cp.async, the P tile kept in registers between the two MMAs (the C fragment
//   of S = Q K^T is the A fragment of O = P V). Why tensor cores: with M = 64 packed rows a 4k-cache Llama
//   layer is ~1.1 GFLOP; CUDA cores (~60 fp32 TFLOP/s on an H100) need ~18 us, far above the 5 us of reading
//   the cache, while mma.sync needs ~1-2 us.
// - attn_simt_kernel (fp32, and bf16 / fp16 when forced): CUDA cores, one key per lane, 32-key tiles converted
//   to fp32 in shared memory. fp32 does not go to tensor cores because TF32 rounds Q and K to 10-bit mantissas
//   (~1e-3 relative error), far outside the fp32 tolerance (1e-5); fp32 is the accuracy path, not the fast one.
//
// Included by exactly one translation unit, csrc/cuda/block_attention_launch.cu.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <type_traits>

#include "cuda/kernels/block_attention.h"
#include "cuda/kernels/common.cuh"
#include "sbd/block_attention_params.h"
#include "sbd/softmax_state.h"

namespace sbd_cuda {
namespace ba {

constexpr int kBM = 64;            // packed query rows per block (16 per warp)
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kMmaBN = 64;         // keys per K/V tile on the tensor-core path
constexpr int kSimtBN = 32;        // keys per tile on the CUDA-core path: one per lane
constexpr int kMinSplitKeys = 256; // a cache split reads >= 256 keys: its partial (64 x D x 4 B) is <= 1/4 of
                                   // the K/V bytes it reads (256 x D x 2 x 2 B in bf16)
constexpr int kMaxSplits = 64;
constexpr int kMergeRowsPerBlock = 4;  // merge kernel: one warp per output row
constexpr float kLog2e = 1.4426950408889634f;

// The first invalid sequence of any launch since the host last took the record (block_attention_take_status).
__device__ __forceinline__ void record_length_error(const BlockAttentionParams& p, sbd::LengthError err, int b,
                                                    int64_t L, int64_t c, int64_t nv) {
  sbd::BlockAttentionStatus* st = p.status;
  if (st == nullptr || atomicCAS(&st->code, 0, static_cast<int32_t>(err)) != 0) return;
  st->b = b;
  st->cache_len = L;
  st->n_commit = c;
  st->n_valid = nv;
  st->T = p.T;
  st->S = p.S;
  __threadfence_system();  // the fields reach host memory before `ready` does
  atomicExch(&st->ready, 1);
}

// Whether a sequence before b has invalid lengths. Called only for an invalid sequence b (never on the valid path),
// so that the record names the first invalid sequence whatever order the blocks run in (the CPU's message).
__device__ __forceinline__ bool earlier_sequence_invalid(const BlockAttentionParams& p, int b) {
  for (int e = 0; e < b; ++e)
    if (sbd::block_attention_length_error(p.cache_len(e), p.commit(e), p.valid(e), p.T, p.S) !=
        sbd::LengthError::kNone)
      return true;
  return false;
}

// A call with no new rows (T == 0) computes and appends nothing, but its lengths are still checked, as on the CPU:
// one thread per sequence; the first invalid one is recorded.
__global__ void __launch_bounds__(128) check_lengths_kernel(const BlockAttentionParams p) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= p.B) return;
  const int64_t L = p.cache_len(b), c = p.commit(b), nv = p.valid(b);
  const sbd::LengthError err = sbd::block_attention_length_error(L, c, nv, p.T, p.S);
  if (err != sbd::LengthError::kNone && !earlier_sequence_invalid(p, static_cast<int>(b)))
    record_length_error(p, err, static_cast<int>(b), L, c, nv);
}

// What one thread block works on.
struct Work {
  int b, h, mt, split;
  int cnt;         // m-tiles of this block: mt .. mt + cnt - 1 (the tensor-core kernel may take two)
  int L, c, nv;    // cache length, committed rows and valid rows: validated, or all 0 for an invalid sequence
  bool is_new;     // the split of the T new rows (split == splits)
  int n;           // keys in this block's range: cache rows [key0, key0 + n) or new rows [0, n)
  int key0;
  int64_t part;    // index of this block's partial state
};

__device__ __forceinline__ Work block_work(const BlockAttentionParams& p, int tiles = 1) {
  Work w;
  w.mt = static_cast<int>(blockIdx.x) * tiles;
  w.cnt = min(tiles, p.m_tiles - w.mt);
  w.split = blockIdx.y;
  w.b = static_cast<int>(blockIdx.z) / p.Hkv;
  w.h = static_cast<int>(blockIdx.z) % p.Hkv;
  w.is_new = w.split == p.splits;
  {
    const int64_t L = p.cache_len(w.b), c = p.commit(w.b), nv = p.valid(w.b);
    const sbd::LengthError err = sbd::block_attention_length_error(L, c, nv, p.T, p.S);
    if (err == sbd::LengthError::kNone) {  // then 0 <= c <= nv <= T and 0 <= L <= S - c: all fit in int
      w.L = static_cast<int>(L);
      w.c = static_cast<int>(c);
      w.nv = static_cast<int>(nv);
    } else {
      w.L = w.c = w.nv = 0;  // no keys, no append: zero output rows (the merge's empty-row convention)
      if (w.is_new && w.mt == 0 && w.h == 0 && threadIdx.x == 0 && !earlier_sequence_invalid(p, w.b))
        record_length_error(p, err, w.b, L, c, nv);
    }
  }
  w.part = ((static_cast<int64_t>(w.b) * p.Hkv + w.h) * p.m_tiles + w.mt) * (p.splits + 1) + w.split;
  const int M = p.group * p.T;
  const int r_lo = w.mt * kBM;
  const int r_hi = min(M, r_lo + w.cnt * kBM);  // exclusive; > r_lo since mt < m_tiles
  const int i_lo = r_lo / p.group, i_hi = (r_hi - 1) / p.group;  // new-row indices of this tile's rows
  if (i_lo >= w.nv) {  // every row of the tile is padding: the merge writes zeros for them
    w.n = 0;
    w.key0 = 0;
  } else if (!w.is_new) {
    // The rows from the first one a sliding window shows (0 without one; < L, so it fits in int) to L.
    const int start = static_cast<int>(p.first_cache_row(w.L));
    const int per = ceil_div(ceil_div(w.L - start, p.splits), 64) * 64;  // whole 64-key tiles per split
    w.key0 = start + min(w.split * per, w.L - start);
    w.n = min(w.L - w.key0, per);
  } else {
    w.key0 = 0;
    w.n = w.nv;
    // Committed rows see only new rows j <= i: if all rows of the tile are committed, keys past the last
    // row are invisible to all of them.
    if (i_hi < w.c) w.n = min(w.n, i_hi + 1);
  }
  return w;
}

// Can packed row `i` (a new-row index) see key `key` (local index in the block's range)? The causal / set-block
// rule, and the sliding window: the key's position (cache row key0 + key, or new row L + key) is at least the
// window start of the row's position L + i.
__device__ __forceinline__ bool visible(const BlockAttentionParams& p, const Work& w, int i, int key) {
  if (key >= w.n) return false;
  if (p.window_left >= 0) {
    const int64_t pos = w.is_new ? static_cast<int64_t>(w.L) + key : static_cast<int64_t>(w.key0) + key;
    if (pos < sbd::window_first_key(static_cast<int64_t>(w.L) + i, p.window_left)) return false;
  }
  if (!w.is_new) return true;
  return i < w.nv && (i >= w.c || key <= i);
}

// A visible raw score q.k as the kernels' base-2 logit: scaled, soft-capped when p.softcap > 0 (sbd::soft_cap, on
// the scaled score as on the CPU), times log2(e).
__device__ __forceinline__ float logit(const BlockAttentionParams& p, float dot, float scale_log2) {
  return p.softcap > 0.f ? sbd::soft_cap(dot * p.scale, p.softcap) * kLog2e : dot * scale_log2;
}

// The committed rows' K/V into the cache at L: rows j < c (L + c <= S: block_work validated the lengths).
template <typename T, int D>
__device__ __forceinline__ void append_committed(const BlockAttentionParams& p, const Work& w) {
  constexpr int kVec = ElemTraits<T>::kVec;
  constexpr int kChunks = D / kVec;  // 16-byte chunks per row
  const int rows = w.c;
  const T* kb = static_cast<const T*>(p.k) + w.b * p.k_sb + w.h * p.k_sh;
  const T* vb = static_cast<const T*>(p.v) + w.b * p.v_sb + w.h * p.v_sh;
  T* kcb = static_cast<T*>(p.k_cache) + w.b * p.kc_sb + w.h * p.kc_sh + static_cast<int64_t>(w.L) * p.kc_st;
  T* vcb = static_cast<T*>(p.v_cache) + w.b * p.vc_sb + w.h * p.vc_sh + static_cast<int64_t>(w.L) * p.vc_st;
  for (int idx = threadIdx.x; idx < rows * kChunks; idx += blockDim.x) {
    const int64_t j = idx / kChunks;
    const int e = (idx % kChunks) * kVec;
    *reinterpret_cast<uint4*>(kcb + j * p.kc_st + e) = *reinterpret_cast<const uint4*>(kb + j * p.k_st + e);
    *reinterpret_cast<uint4*>(vcb + j * p.vc_st + e) = *reinterpret_cast<const uint4*>(vb + j * p.v_st + e);
  }
}

__device__ __forceinline__ float* part_o(const BlockAttentionParams& p) { return static_cast<float*>(p.workspace); }
__device__ __forceinline__ float2* part_ml(const BlockAttentionParams& p) {
  const int64_t parts = static_cast<int64_t>(p.B) * p.Hkv * p.m_tiles * (p.splits + 1);
  return reinterpret_cast<float2*>(part_o(p) + parts * kBM * p.D);
}

// A block with no keys (empty range, or only padding rows): m = -inf, l = 0 for all rows of its `cnt` m-tiles
// (partials part, part + splits + 1, ...); the merge skips them without reading their output rows.
__device__ __forceinline__ void write_empty_partial(const BlockAttentionParams& p, int64_t part, int cnt = 1) {
  for (int r = threadIdx.x; r < cnt * kBM; r += blockDim.x)
    part_ml(p)[(part + static_cast<int64_t>(r / kBM) * (p.splits + 1)) * kBM + r % kBM] = make_float2(-INFINITY, 0.f);
}

// Online-softmax step of one row, the shared rule in base 2 (sbd/softmax_state.h): new running max from the
// tile's max; returns the factor for the old state and sets `base`, the value subtracted from this tile's scores
// (0 while the row has seen no key, so that exp2(-inf - base) = 0 rather than NaN).
__device__ __forceinline__ float softmax_rescale(float& m, float tile_max, float& base) {
  return sbd::softmax_advance<sbd::Exp2>(m, tile_max, base);
}

// ---- tensor-core kernel (bf16 / fp16) ------------------------------------------------------------------
// Element offset of 16-byte chunk `ch` of row `r` in a [rows][D] tile: chunk ch ^ (r % 8). Eight consecutive
// rows at the same logical chunk land in eight different 16-byte bank groups, so ldmatrix (8 rows per matrix)
// and the row-wise cp.async stores are bank-conflict free. D = 32 has 4 chunks (64-byte rows, two rows per
// 128-byte line): chunk ch ^ ((r / 2) % 4) keeps the permutation inside the row and still puts eight consecutive
// rows in eight bank groups ((r % 2) * 4 + chunk).
template <int D>
__device__ __forceinline__ int swz(int r, int ch) {
  static_assert(D == 32 || D % 64 == 0, "the swizzle needs 4 or a multiple of 8 chunks per row");
  if constexpr (D == 32)
    return r * D + ((ch ^ ((r >> 1) & 3)) << 3);
  else
    return r * D + ((ch ^ (r & 7)) << 3);
}

// MT m-tiles per block (MT x 4 warps, one 16-row slice of the MT x 64 packed rows each: the K/V tiles are read
// once for all of them), ST stages of K/V tiles in flight (cp.async).
template <typename T, int D, int MT, int ST>
struct MmaSmem {
  static constexpr int kTile = kMmaBN * D;                                  // elements of one K or V tile
  static constexpr size_t kBytes = (MT * kBM * D + ST * 2 * kTile) * sizeof(T);  // Q + ST stages x (K, V)
};

template <typename T, int D, int MT, int ST>
__global__ void __launch_bounds__(kThreads * MT) attn_mma_kernel(BlockAttentionParams p) {
  static_assert(sizeof(T) == 2, "tensor-core path is bf16 / fp16");
  static_assert(D % 16 == 0, "head dim must be a multiple of 16");
  static_assert(MT >= 1 && ST >= 2, "at least one m-tile and two stages");
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  constexpr int kTile = MmaSmem<T, D, MT, ST>::kTile;
  constexpr int kBlockThreads = kThreads * MT;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);  // [MT x 64][D]
  T* sK = sQ + MT * kBM * D;               // [ST][64][D]
  T* sV = sK + ST * kTile;                 // [ST][64][D]

  const Work w = block_work(p, MT);
  if (w.is_new && w.mt == 0) append_committed<T, D>(p, w);
  if (w.n <= 0) {
    write_empty_partial(p, w.part, w.cnt);
    return;
  }
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = p.group, M = g * p.T;

  // Q tiles: packed rows mt * 64 .. + MT * 64 - 1; rows >= M are zero-filled.
  {
    const T* qb = static_cast<const T*>(p.q) + w.b * p.q_sb;
    for (int idx = tid; idx < MT * kBM * kChunks; idx += kBlockThreads) {
      const int r = idx / kChunks, ch = idx % kChunks;
      const int pr = w.mt * kBM + r;
      const bool ok = pr < M;
      const int i = ok ? pr / g : 0, hq = w.h * g + (ok ? pr % g : 0);
      const T* src = qb + hq * p.q_sh + static_cast<int64_t>(i) * p.q_st + ch * 8;
      cp_async16(sQ + swz<D>(r, ch), ok ? src : qb, ok);
    }
  }
  // K/V tile `t` of the block's range into stage `st`; keys >= n are zero-filled (never read from memory).
  const T* kbase;
  const T* vbase;
  int64_t kstride, vstride;
  if (w.is_new) {
    kbase = static_cast<const T*>(p.k) + w.b * p.k_sb + w.h * p.k_sh;
    vbase = static_cast<const T*>(p.v) + w.b * p.v_sb + w.h * p.v_sh;
    kstride = p.k_st;
    vstride = p.v_st;
  } else {
    kbase = static_cast<const T*>(p.k_cache) + w.b * p.kc_sb + w.h * p.kc_sh + static_cast<int64_t>(w.key0) * p.kc_st;
    vbase = static_cast<const T*>(p.v_cache) + w.b * p.vc_sb + w.h * p.vc_sh + static_cast<int64_t>(w.key0) * p.vc_st;
    kstride = p.kc_st;
    vstride = p.vc_st;
  }
  auto load_kv = [&](int t, int st) {
    for (int idx = tid; idx < kMmaBN * kChunks; idx += kBlockThreads) {
      const int r = idx / kChunks, ch = idx % kChunks;
      const int key = t * kMmaBN + r;
      const bool ok = key < w.n;
      const int64_t kk = ok ? key : 0;
      cp_async16(sK + st * kTile + swz<D>(r, ch), kbase + kk * kstride + ch * 8, ok);
      cp_async16(sV + st * kTile + swz<D>(r, ch), vbase + kk * vstride + ch * 8, ok);
    }
  };

  // This thread's rows of the C fragments: block rows r0 = 16 warp + lane / 4 and r0 + 8 (m-tile mt + warp / 4),
  // their new-row index.
  const int r0 = warp * 16 + lane / 4;
  const int i_row[2] = {(w.mt * kBM + r0) / g, (w.mt * kBM + r0 + 8) / g};  // >= T for rows past M
  const int tq = lane % 4;
  // ldmatrix addressing: lane gives a row address of matrix lane / 8.
  const int lm_mat = lane / 8, lm_row = lane % 8;
  const float scale_log2 = p.scale * kLog2e;

  uint32_t qf[D / 16][4];
  float o[D / 8][4];
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};

  const int ntiles = ceil_div(w.n, kMmaBN);
#pragma unroll
  for (int s = 0; s < ST - 1; ++s) {  // groups 0 .. ST - 2: Q and tile 0, then tiles 1 .. ST - 2 (possibly empty)
    if (s < ntiles) load_kv(s, s);
    cp_async_commit();
  }
  for (int t = 0; t < ntiles; ++t) {
    const int st = t % ST;
    // Tile t + ST - 1 into the stage of tile t - 1, released by the barrier that ended iteration t - 1.
    if (t + ST - 1 < ntiles) load_kv(t + ST - 1, (t + ST - 1) % ST);
    cp_async_commit();       // (possibly empty) group t + ST - 1
    cp_async_wait<ST - 1>();  // groups <= t complete: tile t (and Q) landed
    __syncthreads();
    if (t == 0) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk)  // A fragments of rows 16 warp .. + 15, dims 16 kk .. + 15
        ldmatrix_x4(qf[kk], sQ + swz<D>(warp * 16 + lm_row + (lm_mat & 1) * 8, 2 * kk + (lm_mat >> 1)));
    }
    const T* sKt = sK + st * kTile;
    const T* sVt = sV + st * kTile;

    // S = Q K^T: 16 rows x 64 keys per warp, as 8 n-tiles of 8 keys.
    float s[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int np = 0; np < 4; ++np) {  // keys 16 np .. + 15: matrices (keys +0, dims +0), (+0, +8), (+8, +0), (+8, +8)
        uint32_t kb[4];
        ldmatrix_x4(kb, sKt + swz<D>(np * 16 + lm_row + (lm_mat >> 1) * 8, 2 * kk + (lm_mat & 1)));
        mma_16816<T>(s[2 * np], qf[kk], kb[0], kb[1]);
        mma_16816<T>(s[2 * np + 1], qf[kk], kb[2], kb[3]);
      }
    }

    // Scale, mask, online softmax. Element e of n-tile nt: row r0 + 8 (e / 2), key 8 nt + 2 tq + e % 2.
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float mx = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key = t * kMmaBN + nt * 8 + 2 * tq + e;
          float& x = s[nt][2 * hr + e];
          x = visible(p, w, i_row[hr], key) ? logit(p, x, scale_log2) : -INFINITY;
          mx = fmaxf(mx, x);
        }
      }
      // The four lanes of a quad hold the 64 keys of a row.
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      float base;
      const float alpha = softmax_rescale(m_run[hr], mx, base);
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[nt][2 * hr + e];
          x = exp2f(x - base);
          sum += x;
        }
      }
      l_run[hr] = l_run[hr] * alpha + sum;  // this lane's share; the quad is summed at the end
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        o[dt][2 * hr] *= alpha;
        o[dt][2 * hr + 1] *= alpha;
      }
    }

    // O += P V. P's C fragments of n-tiles 2 kk, 2 kk + 1 are the A fragment of keys 16 kk .. + 15.
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      uint32_t pa[4];
      pa[0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
      pa[1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
      pa[2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      pa[3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {  // dims 16 dp .. + 15: matrices (keys +0, dims +0), (+8, +0), (+0, +8), (+8, +8)
        uint32_t vb[4];
        ldmatrix_x4_trans(vb, sVt + swz<D>(kk * 16 + lm_row + (lm_mat & 1) * 8, 2 * dp + (lm_mat >> 1)));
        mma_16816<T>(o[2 * dp], pa, vb[0], vb[1]);
        mma_16816<T>(o[2 * dp + 1], pa, vb[2], vb[3]);
      }
    }
    __syncthreads();  // all warps are done with stage st before iteration t + 1 refills it with tile t + ST
  }

  // Partial state of rows r0, r0 + 8: unnormalised O (fp32), m and l.
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    l_run[hr] += __shfl_xor_sync(0xffffffffu, l_run[hr], 1);
    l_run[hr] += __shfl_xor_sync(0xffffffffu, l_run[hr], 2);
  }
  const int sub = warp / kWarps;  // this warp's m-tile in the block; the last block may hold fewer than MT
  if (sub >= w.cnt) return;
  const int64_t part = w.part + static_cast<int64_t>(sub) * (p.splits + 1);
  const int rt = r0 - sub * kBM;  // the row in its m-tile
  float* po = part_o(p) + (part * kBM + rt) * D;
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) {
    const int col = dt * 8 + 2 * tq;
    *reinterpret_cast<float2*>(po + col) = make_float2(o[dt][0], o[dt][1]);
    *reinterpret_cast<float2*>(po + 8 * D + col) = make_float2(o[dt][2], o[dt][3]);
  }
  if (tq == 0) {
    float2* ml = part_ml(p) + part * kBM + rt;
    ml[0] = make_float2(m_run[0], l_run[0]);
    ml[8] = make_float2(m_run[1], l_run[1]);
  }
}

// ---- CUDA-core kernel (fp32; bf16 / fp16 when forced) --------------------------------------------------
template <int D>
struct SimtSmem {
  static constexpr int kKStride = D + 4;  // floats; +4 so that lane j's float4 reads of row j hit distinct banks
  static constexpr size_t kBytes = (kBM * D + kSimtBN * kKStride + kSimtBN * D) * sizeof(float);
};

template <typename T>
__device__ __forceinline__ void store_vec_as_float(float* dst, const Vec16<T>& v) {
#pragma unroll
  for (int e = 0; e < ElemTraits<T>::kVec; ++e) dst[e] = to_float(v.e[e]);
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 1) attn_simt_kernel(BlockAttentionParams p) {
  static_assert(D % 32 == 0, "head dim must be a multiple of 32");
  constexpr int kVec = ElemTraits<T>::kVec;
  constexpr int kChunks = D / kVec;  // 16-byte chunks per row
  constexpr int kKStride = SimtSmem<D>::kKStride;
  constexpr int kRows = kBM / kWarps;  // 16 rows per warp
  constexpr int kPer = D / 32;         // output dims per lane: lane + 32 k
  extern __shared__ __align__(16) float smem_f[];
  float* sQ = smem_f;                  // [64][D]
  float* sK = sQ + kBM * D;            // [32][D + 4]
  float* sV = sK + kSimtBN * kKStride; // [32][D]

  const Work w = block_work(p);
  if (w.is_new && w.mt == 0) append_committed<T, D>(p, w);
  if (w.n <= 0) {
    write_empty_partial(p, w.part);
    return;
  }
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = p.group, M = g * p.T;
  {
    const T* qb = static_cast<const T*>(p.q) + w.b * p.q_sb;
    for (int idx = tid; idx < kBM * kChunks; idx += kThreads) {
      const int r = idx / kChunks, ch = idx % kChunks;
      const int pr = w.mt * kBM + r;
      Vec16<T> v;
      v.u = make_uint4(0, 0, 0, 0);
      if (pr < M) v = load16(qb + (w.h * g + pr % g) * p.q_sh + static_cast<int64_t>(pr / g) * p.q_st + ch * kVec);
      store_vec_as_float(sQ + r * D + ch * kVec, v);
    }
  }
  const T* kbase;
  const T* vbase;
  int64_t kstride, vstride;
  if (w.is_new) {
    kbase = static_cast<const T*>(p.k) + w.b * p.k_sb + w.h * p.k_sh;
    vbase = static_cast<const T*>(p.v) + w.b * p.v_sb + w.h * p.v_sh;
    kstride = p.k_st;
    vstride = p.v_st;
  } else {
    kbase = static_cast<const T*>(p.k_cache) + w.b * p.kc_sb + w.h * p.kc_sh + static_cast<int64_t>(w.key0) * p.kc_st;
    vbase = static_cast<const T*>(p.v_cache) + w.b * p.vc_sb + w.h * p.vc_sh + static_cast<int64_t>(w.key0) * p.vc_st;
    kstride = p.kc_st;
    vstride = p.vc_st;
  }

  // Rows go to warps round-robin (tile row warp + kWarps * rr), and a warp stops at the tile's last packed row: a
  // decode step has M = group * T packed rows (3 for SmolLM2's NTP step, 15 for a verify step at k = 4), so the
  // rows spread over all four warps, and none of the 64 - M padding rows costs its serial dot / softmax / P V chain
  // (it did: every warp ran 16 rows, real or not, ~40 us per layer at a 100-key cache on an H200).
  const int rows_here = min(kBM, M - w.mt * kBM);
  const int row0 = w.mt * kBM + warp;  // packed row of this warp's first row; its rr-th is row0 + kWarps * rr
  float acc[kRows][kPer];
  float m_run[kRows], l_run[kRows];
#pragma unroll
  for (int rr = 0; rr < kRows; ++rr) {
    m_run[rr] = -INFINITY;
    l_run[rr] = 0.f;
#pragma unroll
    for (int k = 0; k < kPer; ++k) acc[rr][k] = 0.f;
  }
  const float scale_log2 = p.scale * kLog2e;
  const int ntiles = ceil_div(w.n, kSimtBN);
  for (int t = 0; t < ntiles; ++t) {
    __syncthreads();  // the previous tile has been consumed by every warp
    for (int idx = tid; idx < kSimtBN * kChunks; idx += kThreads) {
      const int r = idx / kChunks, ch = idx % kChunks;
      const int key = t * kSimtBN + r;
      Vec16<T> kv, vv;
      kv.u = vv.u = make_uint4(0, 0, 0, 0);
      if (key < w.n) {
        kv = load16(kbase + static_cast<int64_t>(key) * kstride + ch * kVec);
        vv = load16(vbase + static_cast<int64_t>(key) * vstride + ch * kVec);
      }
      store_vec_as_float(sK + r * kKStride + ch * kVec, kv);
      store_vec_as_float(sV + r * D + ch * kVec, vv);
    }
    __syncthreads();  // tile (and, at t == 0, Q) visible to all warps
    const int key = t * kSimtBN + lane;
    const float4* krow = reinterpret_cast<const float4*>(sK + lane * kKStride);
#pragma unroll
    for (int rr = 0; rr < kRows; ++rr) {
      if (warp + kWarps * rr >= rows_here) break;  // warp-uniform: the rest of this warp's rows are padding
      const float4* qrow = reinterpret_cast<const float4*>(sQ + (warp + kWarps * rr) * D);
      float dot = 0.f;
#pragma unroll
      for (int d4 = 0; d4 < D / 4; ++d4) {
        const float4 a = qrow[d4], b = krow[d4];
        dot = fmaf(a.x, b.x, dot);
        dot = fmaf(a.y, b.y, dot);
        dot = fmaf(a.z, b.z, dot);
        dot = fmaf(a.w, b.w, dot);
      }
      const float sc = visible(p, w, (row0 + kWarps * rr) / g, key) ? logit(p, dot, scale_log2) : -INFINITY;
      float mx = sc;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      float base;
      const float alpha = softmax_rescale(m_run[rr], mx, base);
      const float pj = exp2f(sc - base);
      float sum = pj;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      l_run[rr] = l_run[rr] * alpha + sum;
#pragma unroll
      for (int k = 0; k < kPer; ++k) acc[rr][k] *= alpha;
#pragma unroll 8
      for (int j = 0; j < kSimtBN; ++j) {
        const float pb = __shfl_sync(0xffffffffu, pj, j);
#pragma unroll
        for (int k = 0; k < kPer; ++k) acc[rr][k] = fmaf(pb, sV[j * D + lane + 32 * k], acc[rr][k]);
      }
    }
  }
#pragma unroll
  for (int rr = 0; rr < kRows; ++rr) {
    const int r = warp + kWarps * rr;  // padding rows write their empty state (the merge never reads them)
    float* po = part_o(p) + (w.part * kBM + r) * D;
#pragma unroll
    for (int k = 0; k < kPer; ++k) po[lane + 32 * k] = acc[rr][k];
    if (lane == 0) part_ml(p)[w.part * kBM + r] = make_float2(m_run[rr], l_run[rr]);
  }
}

// ---- merge ---------------------------------------------------------------------------------------------
// One warp per output row (b, i, query head), in output order. out = sum_p 2^(m_p - M) O_p / sum_p 2^(m_p - M) l_p
// over the splits + 1 partials of the row, M = max_p m_p. Padding rows (i >= n_valid) and rows with no visible
// key are written as zeros.
//
// Parallel over the partials: a Llama-3.1-8B layer at a 4k+ cache has 33 cache splits + 1 (8 KV heads, one m-tile
// each, two blocks per SM on 132 SMs), and a loop over them that loads (m, l), branches, then loads the O row
// costs ~2 dependent L2 round trips per split, an estimated 4-11 us of a 10-60 us attention. Here lane j
// reads (m, l) of partials j, j + 32, ... at once, the warp reduces the max and the sum with shuffles, and each
// partial's weight 2^(m_p - M) (exactly 0 for a partial with no visible key, m_p = -inf, whose O rows were never
// written) is broadcast while its O row is read as one float2 / float4 per lane, kUnroll partials' loads in
// flight before the first use. A zero weight skips the load (the weight is warp-uniform: no divergence).
// The sum order is fixed by the split count alone, so the result is deterministic.
template <int N>
struct F32x;  // N fp32 values as one 4-, 8- or 16-byte load
template <>
struct F32x<1> {
  using V = float;
  static __device__ __forceinline__ V zero() { return 0.f; }
  static __device__ __forceinline__ void fma(float w, const V& v, float (&acc)[1]) { acc[0] = fmaf(w, v, acc[0]); }
};
template <>
struct F32x<2> {
  using V = float2;
  static __device__ __forceinline__ V zero() { return make_float2(0.f, 0.f); }
  static __device__ __forceinline__ void fma(float w, const V& v, float (&acc)[2]) {
    acc[0] = fmaf(w, v.x, acc[0]);
    acc[1] = fmaf(w, v.y, acc[1]);
  }
};
template <>
struct F32x<4> {
  using V = float4;
  static __device__ __forceinline__ V zero() { return make_float4(0.f, 0.f, 0.f, 0.f); }
  static __device__ __forceinline__ void fma(float w, const V& v, float (&acc)[4]) {
    acc[0] = fmaf(w, v.x, acc[0]);
    acc[1] = fmaf(w, v.y, acc[1]);
    acc[2] = fmaf(w, v.z, acc[2]);
    acc[3] = fmaf(w, v.w, acc[3]);
  }
};

// A lane's N output values rounded to T and written as 4-byte words (16-bit values packed in pairs, as pack2
// does for mma.sync); the warp's words are contiguous, so each row is written in whole 32-byte sectors.
template <typename T, int N>
__device__ __forceinline__ void store_out(T* dst, const float (&a)[N]) {
  if constexpr (std::is_same<T, float>::value) {
#pragma unroll
    for (int k = 0; k < N; ++k) dst[k] = a[k];
  } else if constexpr (N == 1) {  // D = 32: one value per lane, the warp's 64 bytes still contiguous
    dst[0] = from_float<T>(a[0]);
  } else {
    static_assert(N % 2 == 0, "16-bit values are written in pairs");
#pragma unroll
    for (int k = 0; k < N; k += 2) reinterpret_cast<uint32_t*>(dst)[k / 2] = pack2<T>(a[k], a[k + 1]);
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(kMergeRowsPerBlock * 32) attn_merge_kernel(BlockAttentionParams p) {
  constexpr int kPer = D / 32;  // dims per lane: lane l owns l * kPer .. + kPer - 1
  constexpr int kUnroll = 4;    // partials whose O rows are in flight at once per lane
  using Vec = typename F32x<kPer>::V;
  const int64_t orow = static_cast<int64_t>(blockIdx.x) * kMergeRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t n_rows = static_cast<int64_t>(p.B) * p.T * p.Hq;
  if (orow >= n_rows) return;  // whole warps leave: orow is warp-uniform
  const int qh = static_cast<int>(orow % p.Hq);
  const int i = static_cast<int>((orow / p.Hq) % p.T);
  const int b = static_cast<int>(orow / (static_cast<int64_t>(p.Hq) * p.T));
  const int h = qh / p.group;
  const int pr = i * p.group + qh % p.group;
  const int mt = pr / kBM, rl = pr % kBM;
  const int nv = load_len(p.n_valid, p.n_valid_i64, b, p.T);
  float acc[kPer];
#pragma unroll
  for (int k = 0; k < kPer; ++k) acc[k] = 0.f;
  if (i < nv) {
    const int n_parts = p.splits + 1;
    const int64_t part0 = ((static_cast<int64_t>(b) * p.Hkv + h) * p.m_tiles + mt) * (p.splits + 1);
    const float2* ml = part_ml(p) + part0 * kBM + rl;  // partial sp's (m, l) at ml[sp * kBM]
    const float* po = part_o(p) + (part0 * kBM + rl) * D + lane * kPer;  // partial sp's O at po[sp * kBM * D]
    float m_max = -INFINITY;
    for (int sp = lane; sp < n_parts; sp += 32) m_max = fmaxf(m_max, __ldg(ml + sp * kBM).x);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m_max = fmaxf(m_max, __shfl_xor_sync(0xffffffffu, m_max, off));
    if (m_max > -INFINITY) {  // warp-uniform; else no partial saw a key and the row stays zero
      float l_sum = 0.f;      // this lane's share of sum_p w_p l_p
      for (int c0 = 0; c0 < n_parts; c0 += 32) {  // 32 partials at a time, partial c0 + j on lane j
        float wgt = 0.f;
        if (c0 + lane < n_parts) {
          const float2 st = __ldg(ml + (c0 + lane) * kBM);  // an L1 hit: read by the max above
          if (st.x > -INFINITY) wgt = exp2f(st.x - m_max);  // no -inf - (-inf) = NaN for empty partials
          l_sum = fmaf(wgt, st.y, l_sum);
        }
        const int cnt = min(32, n_parts - c0);
        // Lanes j >= cnt hold wgt = 0, and j0 + u < 32 since cnt <= 32: every shuffle reads a real lane.
        for (int j0 = 0; j0 < cnt; j0 += kUnroll) {
          float wj[kUnroll];
          Vec v[kUnroll];
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) wj[u] = __shfl_sync(0xffffffffu, wgt, j0 + u);
#pragma unroll
          for (int u = 0; u < kUnroll; ++u)
            v[u] = wj[u] != 0.f ? __ldg(reinterpret_cast<const Vec*>(po + static_cast<int64_t>(c0 + j0 + u) * kBM * D))
                                : F32x<kPer>::zero();
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) F32x<kPer>::fma(wj[u], v[u], acc);  // split order: deterministic
        }
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) l_sum += __shfl_xor_sync(0xffffffffu, l_sum, off);
      const float inv = l_sum > 0.f ? 1.f / l_sum : 0.f;
#pragma unroll
      for (int k = 0; k < kPer; ++k) acc[k] *= inv;
    }
  }
  store_out<T, kPer>(static_cast<T*>(p.out) + orow * D + lane * kPer, acc);
}

// The tensor-core kernel with MT m-tiles per block and ST stages (block_attention_plan chose them).
template <typename T, int D, int MT, int ST>
cudaError_t run_mma(const BlockAttentionParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(ceil_div(p.m_tiles, MT)), static_cast<unsigned>(p.splits + 1),
                  static_cast<unsigned>(p.B * p.Hkv));
  // 80-128 KiB (D = 128) of shared memory: above the 48 KiB default, so opt in (every launch: the setting is per
  // device, and the call is cheap next to a launch).
  constexpr size_t smem = MmaSmem<T, D, MT, ST>::kBytes;
  const cudaError_t err = cudaFuncSetAttribute(attn_mma_kernel<T, D, MT, ST>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  attn_mma_kernel<T, D, MT, ST><<<grid, kThreads * MT, smem, stream>>>(p);
  return cudaSuccess;
}

// Stage counts instantiated per head dim: three stages where two blocks per SM fit them on every supported GPU (D
// <= 64: 56 KiB at most), and at D = 128 two or three, as the device's shared memory allows (block_attention_plan).
template <typename T, int D, int MT>
cudaError_t run_mma_stages(const BlockAttentionParams& p, cudaStream_t stream) {
  if constexpr (D == 128) {
    if (p.stages == 2) return run_mma<T, D, MT, 2>(p, stream);
  }
  return run_mma<T, D, MT, 3>(p, stream);
}

template <typename T, int D>
cudaError_t run(const BlockAttentionParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.m_tiles), static_cast<unsigned>(p.splits + 1),
                  static_cast<unsigned>(p.B * p.Hkv));
  cudaError_t err;
  bool done = false;
  if constexpr (sizeof(T) == 2) {
    if (!p.force_simt) {
      err = p.tiles_per_block == 2 ? run_mma_stages<T, D, 2>(p, stream) : run_mma_stages<T, D, 1>(p, stream);
      if (err != cudaSuccess) return err;
      done = true;
    }
  }
  if (!done) {
    constexpr size_t smem = SimtSmem<D>::kBytes;
    err = cudaFuncSetAttribute(attn_simt_kernel<T, D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(smem));
    if (err != cudaSuccess) return err;
    attn_simt_kernel<T, D><<<grid, kThreads, smem, stream>>>(p);
  }
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const int64_t n_rows = static_cast<int64_t>(p.B) * p.T * p.Hq;
  const unsigned merge_blocks = static_cast<unsigned>(ceil_div<int64_t>(n_rows, kMergeRowsPerBlock));
  attn_merge_kernel<T, D><<<merge_blocks, kMergeRowsPerBlock * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace ba

bool block_attention_supports_head_dim(int64_t D) { return sbd::cuda_block_attention_supports_head_dim(D); }

void block_attention_plan(BlockAttentionParams& p, int num_sms, int smem_per_sm) {
  p.group = p.Hkv > 0 ? p.Hq / p.Hkv : 1;
  const int64_t M = static_cast<int64_t>(p.group) * p.T;
  p.m_tiles = static_cast<int>(M > 0 ? ceil_div<int64_t>(M, ba::kBM) : 1);
  // The tensor-core kernel: two m-tiles per block where there are two or more (8 warps share each K/V tile, so
  // the cache is read half as often: T = 32 rows of a Llama-3.1-8B step are two m-tiles), else one (4 warps). At
  // ~235 registers per thread an SM holds two 4-warp blocks or one 8-warp block. Three stages of K/V tiles in
  // flight where the SM's shared memory holds that many blocks with them (D = 128: 112 KiB a block with one m-tile;
  // an A100's 164 KiB per SM holds one, so two stages there), else two.
  p.tiles_per_block = p.m_tiles >= 2 ? 2 : 1;
  const int per_sm = p.tiles_per_block == 2 ? 1 : 2;
  const int64_t q_bytes = static_cast<int64_t>(p.tiles_per_block) * ba::kBM * p.D * 2;
  const int64_t kv3 = int64_t{3} * 2 * ba::kMmaBN * p.D * 2;
  p.stages = (p.D < 128 || static_cast<int64_t>(smem_per_sm) >= per_sm * (q_bytes + kv3 + 1024)) ? 3 : 2;
  // Aim for one full wave of blocks, the new-rows split included (34 blocks per unit on 272 slots made a second
  // wave of 8); the lengths are on the device, so the split count comes from the cache capacity S and each block
  // sizes its range from its own sequence's length.
  const int64_t units = static_cast<int64_t>(p.B) * p.Hkv * ceil_div<int64_t>(p.m_tiles, p.tiles_per_block);
  const int64_t target = per_sm * static_cast<int64_t>(num_sms > 0 ? num_sms : 1);
  int64_t splits = 2 * units >= target ? 1 : target / (units > 0 ? units : 1) - 1;
  const int64_t by_len = p.S / ba::kMinSplitKeys > 1 ? p.S / ba::kMinSplitKeys : 1;
  if (splits > by_len) splits = by_len;
  if (splits > ba::kMaxSplits) splits = ba::kMaxSplits;
  p.splits = static_cast<int>(splits);
}

size_t block_attention_workspace_bytes(const BlockAttentionParams& p) {
  const size_t parts = static_cast<size_t>(p.B) * p.Hkv * p.m_tiles * (p.splits + 1);
  return parts * ba::kBM * (static_cast<size_t>(p.D) * sizeof(float) + sizeof(float2));
}

template <typename T>
cudaError_t launch_block_attention(const BlockAttentionParams& p, cudaStream_t stream) {
  if (p.B == 0) return cudaSuccess;
  if (p.T == 0) {  // nothing to compute or append; the lengths are still checked
    if (p.B < 0 || p.B > INT_MAX || p.S < 0) return cudaErrorInvalidValue;
    ba::check_lengths_kernel<<<static_cast<unsigned>(ceil_div<int64_t>(p.B, 128)), 128, 0, stream>>>(p);
    return cudaGetLastError();
  }
  if (p.B < 0 || p.T < 0 || p.Hkv <= 0 || p.Hq <= 0 || p.Hq % p.Hkv != 0 || p.group != p.Hq / p.Hkv ||
      p.S < 0 || p.S > INT_MAX || p.T > INT_MAX / p.Hq || p.splits < 1 || p.m_tiles < 1 || p.workspace == nullptr ||
      static_cast<int64_t>(p.m_tiles) * ba::kBM < static_cast<int64_t>(p.group) * p.T ||
      static_cast<int64_t>(p.B) * p.Hkv > 65535 || p.splits + 1 > 65535 ||
      static_cast<int64_t>(p.B) * p.T * p.Hq > static_cast<int64_t>(INT_MAX) * ba::kMergeRowsPerBlock)
    return cudaErrorInvalidValue;
  static_assert(sizeof(sbd::kCudaBlockAttentionHeadDims) == 3 * sizeof(int64_t) &&
                    sbd::kCudaBlockAttentionHeadDims[0] == 32 && sbd::kCudaBlockAttentionHeadDims[1] == 64 &&
                    sbd::kCudaBlockAttentionHeadDims[2] == 128,
                "the cases below instantiate exactly sbd::kCudaBlockAttentionHeadDims");
  switch (p.D) {
    case 32:
      return ba::run<T, 32>(p, stream);
    case 64:
      return ba::run<T, 64>(p, stream);
    case 128:
      return ba::run<T, 128>(p, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace sbd_cuda
