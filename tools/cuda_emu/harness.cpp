// C entry points of the emulated kernels for tools/cuda_emu/run.py: they build the params the way the torch
// bindings (csrc/cuda/*_cuda.cpp) do, call the real launchers, and return the cudaError_t.
#include "emu.h"

#include "cuda/kernels/block_attention.cuh"
#include "cuda/kernels/entropy_sample.cuh"
#include "cuda/kernels/mask_replace.cuh"
#include "sbd/gumbel.h"

namespace {

// Workspaces get 256 guard bytes on each side; an out-of-bounds write there fails the call. With `poison`, the
// workspace itself starts as NaN bytes, so a kernel that reads a partial result nobody wrote gets NaN output.
struct Guarded {
  std::vector<unsigned char> buf;
  size_t n;
  explicit Guarded(size_t bytes, bool poison = false) : buf(bytes + 512, 0xA5), n(bytes) {
    if (poison) std::memset(buf.data() + 256, 0xFF, n);
  }
  void* data() { return buf.data() + 256; }
  bool intact() const {
    for (size_t i = 0; i < 256; ++i)
      if (buf[i] != 0xA5 || buf[256 + n + i] != 0xA5) return false;
    return true;
  }
};

template <typename F>
int dispatch(int dtype, F&& f) {  // 0 float, 1 bf16, 2 fp16
  switch (dtype) {
    case 0:
      return f(float{});
    case 1:
      return f(__nv_bfloat16{});
    case 2:
      return f(__half{});
  }
  return -1;
}

}  // namespace

extern "C" {

void emu_register_range(const void* p, size_t n) { sbd_emu::register_range(p, n); }
void emu_clear_ranges() { sbd_emu::clear_ranges(); }
void emu_set_late_async(int late) { sbd_emu::st().late_async = late != 0; }
void emu_set_skew(uint64_t seed) {
  sbd_emu::st().skew_seed = seed;
  sbd_emu::st().rng = seed;
}
int emu_launches() { return sbd_emu::st().launches; }

int emu_mask_replace(int64_t* tokens, const int64_t* proposals, const float* entropy, const float* confidence,
                     int64_t* n_rev, int64_t* n_rem, const int64_t* strides, int64_t B, int64_t K, int64_t mask_id,
                     int rule, double threshold) {
  sbd_cuda::MaskReplaceParams p{};
  p.tokens = tokens;
  p.proposals = proposals;
  p.entropy = entropy;
  p.confidence = confidence;
  p.n_revealed = n_rev;
  p.n_remaining = n_rem;
  p.tok_sb = strides[0], p.tok_sk = strides[1], p.prop_sb = strides[2], p.prop_sk = strides[3];
  p.ent_sb = strides[4], p.ent_sk = strides[5], p.conf_sb = strides[6], p.conf_sk = strides[7];
  p.B = B;
  p.K = K;
  p.mask_id = mask_id;
  p.rule = static_cast<sbd::AcceptRule>(rule);
  p.threshold = threshold;
  return sbd_cuda::launch_mask_replace(p, nullptr);
}

// Returns the error, or 1000 if a workspace guard was overwritten; *splits_out gets the split used.
int emu_entropy_sample(const void* logits, int dtype, int64_t N, int64_t V, int64_t row_stride, double temperature,
                       uint64_t seed, uint64_t offset, float* ent, float* mp, int64_t* tok, int num_sms,
                       int* splits_out) {
  sbd_cuda::EntropySampleParams p{};
  p.logits = logits;
  p.entropy = ent;
  p.max_prob = mp;
  p.token = tok;
  p.N = N;
  p.V = V;
  p.row_stride = row_stride;
  p.temperature = static_cast<float>(temperature);
  p.seed = seed;
  p.offset = offset;
  sbd_cuda::entropy_sample_plan(p, num_sms);
  *splits_out = p.splits;
  Guarded ws(sbd_cuda::entropy_sample_workspace_bytes(p));
  p.workspace = ws.n ? ws.data() : nullptr;
  sbd_emu::register_range(ws.data(), ws.n);
  const int err = dispatch(dtype, [&](auto tag) {
    return static_cast<int>(sbd_cuda::launch_entropy_sample<decltype(tag)>(p, nullptr));
  });
  return err ? err : (ws.intact() ? 0 : 1000);
}

// The Gumbel noise over all 2^23 draws (the bits philox_uniform keeps): out[0] = the largest sbd::gumbel_noise,
// out[1] = the smallest margin gumbel_noise_bound(w) - gumbel_noise(w), out[2] = the largest |gumbel_noise - the
// fp64 noise of the same u|, out[3] = the largest relative error of sbd::log_f32 over every 61st float in
// [2^-26, 64), out[4] = sbd::kGumbelNoiseMax.
void emu_gumbel_bounds(double* out) {
  double max_noise = -1e30, min_margin = 1e30, max_err = 0.0, max_log_rel = 0.0;
  for (uint32_t k = 0; k < (1u << 23); ++k) {
    const uint32_t w = (k << 9) | 0x1ffu;
    const float g = sbd::gumbel_noise(w);
    max_noise = std::max(max_noise, static_cast<double>(g));
    min_margin = std::min(min_margin, static_cast<double>(sbd::gumbel_noise_bound(w)) - g);
    const double u = static_cast<double>(sbd::philox_uniform(w));
    max_err = std::max(max_err, std::fabs(g - (-std::log(-std::log(u)))));
  }
  for (uint32_t i = sbd::float_bits(0x1p-26f); i < sbd::float_bits(64.0f); i += 61) {
    const float x = sbd::bits_float(i);
    const double truth = std::log(static_cast<double>(x));
    if (truth != 0.0) max_log_rel = std::max(max_log_rel, std::fabs((sbd::log_f32(x) - truth) / truth));
  }
  out[0] = max_noise;
  out[1] = min_margin;
  out[2] = max_err;
  out[3] = max_log_rel;
  out[4] = sbd::kGumbelNoiseMax;
}

// The Gumbel-max token of each row of fp32 logits [N, V] (row stride V) by brute force: every entry's exact score
// sbd::gumbel_score, no bound, no skipping, first index of the maximum. The kernels' fast paths must give these.
void emu_gumbel_argmax(const float* x, int64_t N, int64_t V, double temperature, uint64_t seed, uint64_t offset,
                       int64_t* tok) {
  const float t = static_cast<float>(temperature);
  for (int64_t row = 0; row < N; ++row) {
    float best = -INFINITY;
    int64_t index = 0;
    for (int64_t j = 0; j < V; ++j) {
      const uint32_t w = sbd::philox_for_vocab_quad(seed, offset, static_cast<uint32_t>(row),
                                                    static_cast<uint32_t>(j >> 2)).x[j & 3];
      const float s = sbd::gumbel_score(x[row * V + j], t, w);
      if (s > best) {
        best = s;
        index = j;
      }
    }
    tok[row] = index;
  }
}

// ptrs: q, k, v, k_cache, v_cache, out, cache_lens, n_commit, n_valid.
// ints: lens_i64, commit_i64, valid_i64, q strides (3), k (3), v (3), k_cache (3), v_cache (3), B, Hq, Hkv, T, S, D.
// status: the kernel's record of the first invalid sequence (sbd::BlockAttentionStatus, zeroed by the caller).
// softcap, window_left: the model features (0 and -1: off).
int emu_block_attention(void** ptrs, const int64_t* ints, double scale, double softcap, int64_t window_left, int dtype,
                        int num_sms, int force_simt, int* splits_out, sbd::BlockAttentionStatus* status) {
  sbd_cuda::BlockAttentionParams p{};
  p.q = ptrs[0];
  p.k = ptrs[1];
  p.v = ptrs[2];
  p.k_cache = ptrs[3];
  p.v_cache = ptrs[4];
  p.out = ptrs[5];
  p.cache_lens = ptrs[6];
  p.n_commit = ptrs[7];
  p.n_valid = ptrs[8];
  p.cache_lens_i64 = ints[0], p.n_commit_i64 = ints[1], p.n_valid_i64 = ints[2];
  p.q_sb = ints[3], p.q_sh = ints[4], p.q_st = ints[5];
  p.k_sb = ints[6], p.k_sh = ints[7], p.k_st = ints[8];
  p.v_sb = ints[9], p.v_sh = ints[10], p.v_st = ints[11];
  p.kc_sb = ints[12], p.kc_sh = ints[13], p.kc_st = ints[14];
  p.vc_sb = ints[15], p.vc_sh = ints[16], p.vc_st = ints[17];
  p.B = ints[18];
  p.Hq = ints[19];
  p.Hkv = ints[20];
  p.T = ints[21];
  p.S = ints[22];
  p.D = ints[23];
  p.status = status;
  p.scale = static_cast<float>(scale);
  p.softcap = static_cast<float>(softcap);
  p.window_left = window_left;
  p.force_simt = force_simt != 0;
  // The shared memory per SM the plan sizes the pipeline by (SBD_EMU_SMEM_PER_SM, bytes; default an H100's 228 KiB).
  const char* smem = std::getenv("SBD_EMU_SMEM_PER_SM");
  sbd_cuda::block_attention_plan(p, num_sms, smem != nullptr ? std::atoi(smem) : 228 * 1024);
  *splits_out = p.splits;
  Guarded ws(sbd_cuda::block_attention_workspace_bytes(p), /*poison=*/true);
  p.workspace = ws.data();
  sbd_emu::register_range(ws.data(), ws.n);
  const int err = dispatch(dtype, [&](auto tag) {
    return static_cast<int>(sbd_cuda::launch_block_attention<decltype(tag)>(p, nullptr));
  });
  return err ? err : (ws.intact() ? 0 : 1000);
}

}  // extern "C"
