// block_attention in bf16 on AMX-BF16 tiles (BlockAttentionParams::tiles: the "tiles" path). A fragment of
// block_attention_kernel.cpp, included there inside its anonymous namespace in the AVX-512 variant only: it runs that
// file's work units, key blocks (for_each_key_block), online softmax (softmax_tile) and unit results (finish_unit).
//
// Why: the GEMM path hands each key block to oneDNN's matmul with plain row-major operands, which repacks them and
// sets up per call; on an Intel Xeon with AMX (1 thread, Llama-3.1-8B shapes, 2026-12-05) it ran at 0.69-0.80x
// PyTorch's SDPA, whose flash attention packs K and V once and calls oneDNN's brgemm on the packed blocks.
//
// Per unit (the GEMM path's lanes: GQA heads x valid rows) and block of up to kTilesBlock keys:
//   S^T [keys][mp lanes] = K_blk . Q^T   A = 16 keys x 32 d of K, read in place with the cache's row stride (a ragged
//                                        last group: its rows copied beside zero rows); B = Q^T in pairs ([16 d
//                                        pairs][16 lanes][2], packed once per unit, unscaled); C = 16 keys x 16 lanes
//                                        in fp32, over D / 32 products, stored into S^T's rows
//   S^T *= scale; mask; online softmax   softmax_tile, the other paths' own code, on whole lane vectors (its
//                                        probabilities by exp_u20: they are rounded to bf16 next)
//   O [mp][D] = O * alpha + P . V_blk    A = P [16 lanes][32 keys] in bf16 (two key rows of S^T rounded to bf16 and
//                                        paired into dwords, then a 16 x 16 dword transpose); B = V in pairs ([16 key
//                                        pairs][16 d][2], packed once per block for every lane tile); C = 16 lanes x
//                                        16 d of O in fp32, loaded and stored in place
// Keys past a ragged block's end are zero rows of K and V and zero probabilities. Every tile product sums each output
// element from its own A row and B column, so a lane's result does not depend on the lanes beside it (batch
// invariance); every bf16 call takes this path where it is on, whatever its row count.
//
// Tiles (palette 1, all 16 rows x 64 bytes), S^T: 0 / 3 / 5 / 6 C (the block's 4 key groups), 1 / 4 / 7 K's A, 2
// Q^T's B; P . V: 0 / 3 C (two 16-column groups of O), 4 / 5 P's A (the block's two chunks of 32 keys), 6 / 1 and
// 7 / 2 V's B. Independent accumulators, so that the products overlap.

constexpr int64_t kTilesBlock = 64;  // keys per block: 4 groups of 16 (S^T), 2 chunks of 32 (P . V)
constexpr int64_t kTileElems = 512;  // bf16 values in one 16 x 64-byte tile

TileConfig attention_tile_config() {
  TileConfig c;
  for (int i = 0; i < 8; ++i) {
    c.rows[i] = 16;
    c.colsb[i] = 64;
  }
  return c;
}

// Per-thread scratch, kept between calls and grown when a call needs more.
struct TilesWorkspace {
  AlignedBuffer<float> st, o, run_m, run_l, alpha, lo, hi;
  AlignedBuffer<uint16_t> qv, vv, pa, kpad, gk, gv;
  std::unique_ptr<int64_t[]> first, last;
  int64_t D, lanes;  // lanes: a multiple of 16
  TilesWorkspace(int64_t D_, int64_t lanes_)
      : st(alloc_aligned<float>(kTilesBlock * lanes_)),
        o(alloc_aligned<float>(lanes_ * D_)),
        run_m(alloc_aligned<float>(lanes_)),
        run_l(alloc_aligned<float>(lanes_)),
        alpha(alloc_aligned<float>(lanes_)),
        lo(alloc_aligned<float>(lanes_)),
        hi(alloc_aligned<float>(lanes_)),
        qv(alloc_aligned<uint16_t>(D_ / 32 * (lanes_ / 16) * kTileElems)),
        vv(alloc_aligned<uint16_t>(2 * (D_ / 16) * kTileElems)),
        pa(alloc_aligned<uint16_t>(2 * kTileElems)),
        kpad(alloc_aligned<uint16_t>(16 * D_)),
        gk(alloc_aligned<uint16_t>(kTilesBlock * D_)),
        gv(alloc_aligned<uint16_t>(kTilesBlock * D_)),
        first(new int64_t[static_cast<size_t>(lanes_)]),
        last(new int64_t[static_cast<size_t>(lanes_)]),
        D(D_),
        lanes(lanes_) {}

  static TilesWorkspace& of_thread(const BlockAttentionParams& p) {
    static thread_local std::unique_ptr<TilesWorkspace> ws;
    const int64_t lanes = (p.panel_lanes + 15) / 16 * 16;
    if (!ws || p.D > ws->D || lanes > ws->lanes)
      ws = std::make_unique<TilesWorkspace>(std::max(p.D, ws ? ws->D : 0), std::max(lanes, ws ? ws->lanes : 0));
    return *ws;
  }
};

// r[i][c] -> r[c][i] for 16 rows of 16 dwords: per bit of the index, the rows that differ in it swap their
// off-diagonal halves (element (i, c) moves to (i ^ s, c ^ s) where bit s of i and c differ), 64 permutes.
struct TransposeIndex {
  alignas(64) int32_t lo[4][16];
  alignas(64) int32_t hi[4][16];
  constexpr TransposeIndex() : lo{}, hi{} {
    for (int k = 0; k < 4; ++k)
      for (int s = 8 >> k, c = 0; c < 16; ++c) {
        lo[k][c] = (c & s) ? 16 + c - s : c;
        hi[k][c] = (c & s) ? 16 + c : c + s;
      }
  }
};
inline constexpr TransposeIndex kTransposeIndex{};

// Two rows of 32 bf16 (a, b) -> 16 pairs (a[l], b[l]): lo for l < 16, hi for l = 16..31 (_mm512_permutex2var_epi16).
struct PairIndex {
  alignas(64) int16_t lo[32];
  alignas(64) int16_t hi[32];
  constexpr PairIndex() : lo{}, hi{} {
    for (int l = 0; l < 16; ++l) {
      lo[2 * l] = static_cast<int16_t>(l);
      lo[2 * l + 1] = static_cast<int16_t>(32 + l);
      hi[2 * l] = static_cast<int16_t>(16 + l);
      hi[2 * l + 1] = static_cast<int16_t>(48 + l);
    }
  }
};
inline constexpr PairIndex kPairIndex{};

inline void transpose_16x16(__m512i* r) {
  for (int k = 0; k < 4; ++k) {
    const int s = 8 >> k;
    const __m512i il = _mm512_load_si512(kTransposeIndex.lo[k]), ih = _mm512_load_si512(kTransposeIndex.hi[k]);
    for (int i = 0; i < 16; ++i) {
      if (i & s) continue;
      const __m512i a = r[i], b = r[i + s];
      r[i] = _mm512_permutex2var_epi32(a, il, b);
      r[i + s] = _mm512_permutex2var_epi32(a, ih, b);
    }
  }
}

template <class Tiles>
class TilesUnitRunner {
 public:
  using T = c10::BFloat16;
  TilesUnitRunner(const BlockAttentionParams& p, TilesWorkspace& ws) : p_(p), ws_(ws) {}

  __attribute__((target("amx-tile,amx-int8,amx-bf16"))) void run(int64_t unit) {
    const Unit u = begin_unit<T>(p_, unit);
    if (u.lanes == 0) return;
    Tiles::configure(attention_tile_config());
    pack_queries(u);
    first_ = true;
    const auto visit = [&](const T* kp, int64_t ks, const T* vp, int64_t vs, int64_t nb, int64_t pos0) {
      block(u, reinterpret_cast<const uint16_t*>(kp), ks, reinterpret_cast<const uint16_t*>(vp), vs, nb, pos0);
    };
    for_each_key_block<T>(p_, u, kTilesBlock, lane_first_key(p_, p_.cache_len(u.b), 0), last_key_,
                          reinterpret_cast<T*>(ws_.gk.get()), reinterpret_cast<T*>(ws_.gv.get()), visit);
    Tiles::release();
    const float* o = ws_.o.get();
    const int64_t D = p_.D;
    if (p_.n_splits > 1 && !first_) return write_partial(u, unit);
    finish_unit<T>(p_, u, unit, first_, ws_.run_m.get(), ws_.run_l.get(),
                   [&](int64_t d, int64_t m) { return o[m * D + d]; });
  }

 private:
  // Q^T in pairs (zero beyond the unit's lanes): per lane tile and chunk of 32 d, the 16 lanes' 16 dwords (pairs of
  // d) transposed into [16 pairs][16 lanes]; each lane's first / last key, the running state (O is written from zero
  // by the first block).
  void pack_queries(const Unit& u) {
    const int64_t D = p_.D, mp = u.mp, ntiles = mp / 16, c = p_.commit(u.b), len = p_.cache_len(u.b);
    uint16_t* qv = ws_.qv.get();
    const T* rows[16];
    for (int64_t t = 0; t < ntiles; ++t) {
      for (int64_t l = 0; l < 16; ++l) {
        const int64_t m = 16 * t + l, lane = u.lane0 + m;
        rows[l] = m < u.lanes ? static_cast<const T*>(p_.q) + u.b * p_.q_sb + (u.kvh * u.g + lane / u.nv) * p_.q_sh +
                                    (lane % u.nv) * p_.q_st
                              : nullptr;
      }
      for (int64_t ch = 0; ch < D / 32; ++ch) {
        __m512i r[16];
        for (int64_t l = 0; l < 16; ++l)
          r[l] = rows[l] != nullptr ? _mm512_loadu_si512(rows[l] + 32 * ch) : _mm512_setzero_si512();
        transpose_16x16(r);
        uint16_t* out = qv + (ch * ntiles + t) * kTileElems;
        for (int64_t i = 0; i < 16; ++i) _mm512_store_si512(out + 32 * i, r[i]);
      }
    }
    last_key_ = -1;
    for (int64_t m = 0; m < mp; ++m) {
      const int64_t t = (u.lane0 + m) % u.nv;
      ws_.last[m] = m < u.lanes ? lane_last_key(len, t, c, u.nv) : -1;
      ws_.first[m] = m < u.lanes ? lane_first_key(p_, len, t) : 0;
      ws_.run_m[m] = -INFINITY;
      ws_.run_l[m] = 0.f;
      last_key_ = std::max(last_key_, ws_.last[m]);
    }
  }

  // finish_unit's partial state (acc^T [D][panel_lanes], m, l) from O [mp][D] by 16 x 16 transposes.
  void write_partial(const Unit& u, int64_t unit) const {
    const int64_t D = p_.D, pl = p_.panel_lanes;
    const float* o = ws_.o.get();
    float* part = p_.partials + unit * p_.partial_floats();
    for (int64_t m0 = 0; m0 < u.mp; m0 += 16)
      for (int64_t d0 = 0; d0 < D; d0 += 16) {
        __m512i r[16];
        for (int64_t i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(o + (m0 + i) * D + d0);
        transpose_16x16(r);
        for (int64_t j = 0; j < 16; ++j) _mm512_storeu_si512(part + (d0 + j) * pl + m0, r[j]);
      }
    for (int64_t m = 0; m < u.lanes; ++m) {
      part[D * pl + m] = ws_.run_m[m];
      part[(D + 1) * pl + m] = ws_.run_l[m];
    }
  }

  // V's rows [0, nb) in pairs of keys: vv[chunk][d group] = [16 key pairs][16 d][2]; rows from nb on are zeros.
  void pack_values(const uint16_t* vp, int64_t vs, int64_t nb, int64_t chunks) {
    const int64_t D = p_.D, groups = D / 16;
    const __m512i il = _mm512_load_si512(kPairIndex.lo), ih = _mm512_load_si512(kPairIndex.hi);
    uint16_t* vv = ws_.vv.get();
    for (int64_t j = 0; j < chunks; ++j)
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t k0 = 32 * j + 2 * i, k1 = k0 + 1;
        for (int64_t d = 0; d < D; d += 32) {
          const __m512i a = k0 < nb ? _mm512_loadu_si512(vp + k0 * vs + d) : _mm512_setzero_si512();
          const __m512i b = k1 < nb ? _mm512_loadu_si512(vp + k1 * vs + d) : _mm512_setzero_si512();
          uint16_t* out = vv + (j * groups + d / 16) * kTileElems + i * 32;
          _mm512_store_si512(out, _mm512_permutex2var_epi16(a, il, b));
          _mm512_store_si512(out + kTileElems, _mm512_permutex2var_epi16(a, ih, b));
        }
      }
  }

  // P's A tile for lane tile t and keys [32 j, 32 j + 32) of the block: row l = lane 16 t + l's 32 probabilities.
  void pack_probs(int64_t t, int64_t j, int64_t nb, int64_t mp, uint16_t* out) const {
    const float* st = ws_.st.get();
    __m512i r[16];
    for (int64_t i = 0; i < 16; ++i) {
      const int64_t k0 = 32 * j + 2 * i, k1 = k0 + 1;
      const __m512i a = k0 < nb ? bf16_rne_bits(_mm512_loadu_ps(st + k0 * mp + 16 * t)) : _mm512_setzero_si512();
      const __m512i b = k1 < nb ? bf16_rne_bits(_mm512_loadu_ps(st + k1 * mp + 16 * t)) : _mm512_setzero_si512();
      r[i] = _mm512_or_si512(a, _mm512_slli_epi32(b, 16));  // dword l: keys k0, k1 of lane l
    }
    transpose_16x16(r);
    for (int l = 0; l < 16; ++l) _mm512_store_si512(out + l * 32, r[l]);
  }

  __attribute__((target("amx-tile,amx-int8,amx-bf16"))) void block(const Unit& u, const uint16_t* kp, int64_t ks,
                                                                    const uint16_t* vp, int64_t vs, int64_t nb,
                                                                    int64_t pos0) {
    const int64_t D = p_.D, mp = u.mp, ntiles = mp / 16, groups = (nb + 15) / 16, chunks = (nb + 31) / 32;
    float* st = ws_.st.get();
    const uint16_t* qv = ws_.qv.get();
    // each group's 16 K rows in place, a ragged last group's beside zero rows
    const uint16_t* kg[4];
    int64_t kstride[4];
    for (int64_t g = 0; g < groups; ++g) {
      kg[g] = kp + 16 * g * ks;
      kstride[g] = ks * 2;
      if (16 * (g + 1) > nb) {
        uint16_t* pad = ws_.kpad.get();
        std::fill(pad, pad + 16 * D, uint16_t{0});
        for (int64_t n = 16 * g; n < nb; ++n) std::memcpy(pad + (n - 16 * g) * D, kp + n * ks, D * 2);
        kg[g] = pad;
        kstride[g] = D * 2;
      }
    }
    // S^T: the block's (up to) 4 key groups at once on C tiles 0 / 3 / 5 / 6, Q^T's chunk loaded once for them
    for (int64_t t = 0; t < ntiles; ++t) {
      Tiles::template tzero<0>();
      Tiles::template tzero<3>();
      Tiles::template tzero<5>();
      Tiles::template tzero<6>();
      for (int64_t c = 0; c < D / 32; ++c) {
        Tiles::template tload<2>(qv + (c * ntiles + t) * kTileElems, 64);
        Tiles::template tload<1>(kg[0] + 32 * c, kstride[0]);
        Tiles::template tdpbf16<0, 1, 2>();
        if (groups > 1) {
          Tiles::template tload<4>(kg[1] + 32 * c, kstride[1]);
          Tiles::template tdpbf16<3, 4, 2>();
        }
        if (groups > 2) {
          Tiles::template tload<7>(kg[2] + 32 * c, kstride[2]);
          Tiles::template tdpbf16<5, 7, 2>();
        }
        if (groups > 3) {
          Tiles::template tload<1>(kg[3] + 32 * c, kstride[3]);
          Tiles::template tdpbf16<6, 1, 2>();
        }
      }
      float* sc = st + 16 * t;
      Tiles::template tstore<0>(sc, mp * 4);
      if (groups > 1) Tiles::template tstore<3>(sc + 16 * mp, mp * 4);
      if (groups > 2) Tiles::template tstore<5>(sc + 32 * mp, mp * 4);
      if (groups > 3) Tiles::template tstore<6>(sc + 48 * mp, mp * 4);
    }
    const Vec scale(p_.scale);
    for (int64_t i = 0; i < nb * mp; i += W) (Vec::loadu(st + i) * scale).store(st + i);
    const bool masked = block_bounds(ws_.first.get(), ws_.last.get(), mp, nb, pos0, ws_.lo.get(), ws_.hi.get());
    softmax_tile<true>(st, mp, nb, mp / W, p_.softcap, masked ? ws_.lo.get() : nullptr, masked ? ws_.hi.get() : nullptr,
                 ws_.run_m.get(), ws_.run_l.get(), ws_.alpha.get());
    float* o = ws_.o.get();
    if (!first_)
      for (int64_t m = 0; m < mp; ++m) {
        if (ws_.alpha[m] == 1.f) continue;  // the running max did not move (most blocks): O as it is, exactly
        const Vec a(ws_.alpha[m]);
        for (int64_t d = 0; d < D; d += W) (Vec::loadu(o + m * D + d) * a).store(o + m * D + d);
      }
    pack_values(vp, vs, nb, chunks);
    const uint16_t* vv = ws_.vv.get();
    uint16_t* pa = ws_.pa.get();
    for (int64_t t = 0; t < ntiles; ++t) {
      pack_probs(t, 0, nb, mp, pa);
      Tiles::template tload<4>(pa, 64);
      if (chunks == 2) {
        pack_probs(t, 1, nb, mp, pa + kTileElems);
        Tiles::template tload<5>(pa + kTileElems, 64);
      }
      // two 16-column groups of O at a time (C tiles 0 and 3), each over the block's one or two chunks of keys
      for (int64_t e = 0; e < D / 16; e += 2) {
        float* oc = o + 16 * t * D + 16 * e;
        if (first_) {  // O starts here (never read before its first block: no zero fill)
          Tiles::template tzero<0>();
          Tiles::template tzero<3>();
        } else {
          Tiles::template tload<0>(oc, D * 4);
          Tiles::template tload<3>(oc + 16, D * 4);
        }
        Tiles::template tload<6>(vv + e * kTileElems, 64);
        Tiles::template tdpbf16<0, 4, 6>();
        Tiles::template tload<1>(vv + (e + 1) * kTileElems, 64);
        Tiles::template tdpbf16<3, 4, 1>();
        if (chunks == 2) {
          Tiles::template tload<7>(vv + (D / 16 + e) * kTileElems, 64);
          Tiles::template tdpbf16<0, 5, 7>();
          Tiles::template tload<2>(vv + (D / 16 + e + 1) * kTileElems, 64);
          Tiles::template tdpbf16<3, 5, 2>();
        }
        Tiles::template tstore<0>(oc, D * 4);
        Tiles::template tstore<3>(oc + 16, D * 4);
      }
    }
    first_ = false;
  }

  const BlockAttentionParams& p_;
  TilesWorkspace& ws_;
  bool first_ = true;
  int64_t last_key_ = -1;
};
