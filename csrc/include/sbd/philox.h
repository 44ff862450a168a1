// Philox4x32-10 counter-based RNG (Salmon et al., SC'11), the generator behind the Gumbel-max sampling of
// entropy_sample. A draw is a pure function of (seed, offset, row, vocab index), so a (seed, offset) pair
// reproduces a sample on any device and under any work split. The pure-PyTorch twin lives in
// sbd_ext/reference.py (_philox4x32_10); both must stay bit-identical.
#pragma once

#include "sbd/common.h"

namespace sbd {

struct Philox4 {
  uint32_t x[4];
};

SBD_HD void philox_mulhilo(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
  const uint64_t p = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  *hi = static_cast<uint32_t>(p >> 32);
  *lo = static_cast<uint32_t>(p);
}

// counter = (c0, c1, c2, c3), key = (k0, k1). Ten rounds, the constants of Random123.
SBD_HD Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
#if defined(__CUDACC__)
#pragma unroll
#endif
  for (int r = 0; r < 10; ++r) {
    uint32_t hi0, lo0, hi1, lo1;
    philox_mulhilo(kM0, c0, &hi0, &lo0);
    philox_mulhilo(kM1, c2, &hi1, &lo1);
    const uint32_t n0 = hi1 ^ c1 ^ k0;
    const uint32_t n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += kW0;
    k1 += kW1;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// The 23 high bits of a word mapped to the open interval (0, 1): (w >> 9 + 1/2) / 2^23, in [2^-24, 1 - 2^-24].
// Every step is exact in fp32 (w >> 9 + 1/2 needs 24 bits), so u is never 0 or 1 and the Gumbel noise
// -log(-log(u)) is always finite, within [-2.81, 16.64]. (24 bits + 1/2 would need 25: the top draw rounded to
// u = 1, an infinite noise that made the entry win whatever its logit, once in 2^24 draws.)
SBD_HD float philox_uniform(uint32_t w) {
  return (static_cast<float>(w >> 9) + 0.5f) * (1.0f / 8388608.0f);
}

// The counter layout used by entropy_sample: vocab index j of row `row`, stream (seed, offset).
// One Philox call yields the uniforms of four consecutive vocab indices (j & ~3 .. j | 3).
SBD_HD Philox4 philox_for_vocab_quad(uint64_t seed, uint64_t offset, uint32_t row, uint32_t quad) {
  return philox4x32_10(quad, row, static_cast<uint32_t>(offset), static_cast<uint32_t>(offset >> 32),
                       static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

}  // namespace sbd
