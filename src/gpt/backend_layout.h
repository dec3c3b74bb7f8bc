// gpt/backend_layout.h — where the CUDA backend's buffers lie inside its one device allocation
// (backend_cuda.cu), as plain host code so that the byte count (cuda_backend_bytes) and the
// layout's tests need no GPU. Every buffer starts on a 256-byte boundary; none overlap.
//
// Shapes (N = B·T rows, C = d_model, NH heads, V vocab, M = the largest module's elements):
//   resid[l]          [N, C]  l = 0..L (input of block l; resid[L] is the input of ln_f)
//   per layer         ln1, atty, resid_mid, ln2 [N, C]; qkv [N, 3C]; fch, fch_gelu [N, 4C];
//                     ln1_mean, ln1_rstd, ln2_mean, ln2_rstd [N]; att [B, NH, T, T]
//   lnf [N, C], lnf_mean, lnf_rstd, losses [N], probs [N, V]
//   d_resid, d_resid_mid, d_ln, d_atty [N, C]; d_qkv [N, 3C]; d_fch, d_fch_gelu [N, 4C];
//   d_att [B, NH, T, T]
//   params32[2], grads [M] fp32; params16[2] [M] bf16 (two staging buffers: module i+1 is
//   copied in while module i computes); in16 [N, 4C] bf16 (a GEMM input),
//   out16 [N, max(4C, V)] bf16 (a GEMM output gradient); tokens, targets [N] int32.
// Thread-safety: a value type.
#pragma once

#include <cstdint>
#include <vector>

#include "gpt/model.h"

namespace tiermem::gpt {

struct CudaBackendLayout {
  struct Layer {
    float *ln1, *ln1_mean, *ln1_rstd, *qkv, *att, *atty, *resid_mid, *ln2, *ln2_mean, *ln2_rstd,
        *fch, *fch_gelu;
  };
  std::vector<float*> resid;
  std::vector<Layer> layers;
  float *lnf, *lnf_mean, *lnf_rstd, *probs, *losses;
  float *d_resid, *d_resid_mid, *d_ln, *d_qkv, *d_att, *d_atty, *d_fch, *d_fch_gelu;
  float *params32[2], *grads;
  std::uint16_t *params16[2], *in16, *out16;
  std::int32_t *tokens, *targets;
  std::uint64_t max_module_elems = 0;
  std::uint64_t bytes = 0;  // the allocation the layout needs, bytes

  // Lays the buffers out from `base` (0: only counts; the pointers are then offsets from 0).
  CudaBackendLayout(const GptConfig& cfg, int B, int T, std::uintptr_t base) {
    cfg.validate();
    const std::uint64_t N = static_cast<std::uint64_t>(B) * static_cast<std::uint64_t>(T);
    const std::uint64_t C = static_cast<std::uint64_t>(cfg.d_model);
    const std::uint64_t V = static_cast<std::uint64_t>(cfg.vocab_size);
    const std::uint64_t att = static_cast<std::uint64_t>(B) * static_cast<std::uint64_t>(cfg.n_head) *
                              static_cast<std::uint64_t>(T) * static_cast<std::uint64_t>(T);
    for (int m = 0; m < num_modules(cfg); ++m) {
      const std::uint64_t n = static_cast<std::uint64_t>(module_layout(cfg, m).numel);
      if (n > max_module_elems) max_module_elems = n;
    }
    auto take = [&](std::uint64_t elems, std::uint64_t elem_bytes) {
      const std::uintptr_t p = base + bytes;
      bytes += (elems * elem_bytes + 255) / 256 * 256;
      return p;
    };
    auto f32 = [&](std::uint64_t n) { return reinterpret_cast<float*>(take(n, 4)); };
    auto b16 = [&](std::uint64_t n) { return reinterpret_cast<std::uint16_t*>(take(n, 2)); };
    auto i32 = [&](std::uint64_t n) { return reinterpret_cast<std::int32_t*>(take(n, 4)); };
    for (int l = 0; l <= cfg.n_layer; ++l) resid.push_back(f32(N * C));
    layers.resize(static_cast<std::size_t>(cfg.n_layer));
    for (Layer& a : layers) {
      a.ln1 = f32(N * C), a.ln1_mean = f32(N), a.ln1_rstd = f32(N), a.qkv = f32(N * 3 * C);
      a.att = f32(att), a.atty = f32(N * C), a.resid_mid = f32(N * C), a.ln2 = f32(N * C);
      a.ln2_mean = f32(N), a.ln2_rstd = f32(N), a.fch = f32(N * 4 * C), a.fch_gelu = f32(N * 4 * C);
    }
    lnf = f32(N * C), lnf_mean = f32(N), lnf_rstd = f32(N), probs = f32(N * V), losses = f32(N);
    d_resid = f32(N * C), d_resid_mid = f32(N * C), d_ln = f32(N * C), d_qkv = f32(N * 3 * C);
    d_att = f32(att), d_atty = f32(N * C), d_fch = f32(N * 4 * C), d_fch_gelu = f32(N * 4 * C);
    params32[0] = f32(max_module_elems), params32[1] = f32(max_module_elems);
    grads = f32(max_module_elems);
    params16[0] = b16(max_module_elems), params16[1] = b16(max_module_elems);
    in16 = b16(N * 4 * C);
    out16 = b16(N * (V > 4 * C ? V : 4 * C));
    tokens = i32(N), targets = i32(N);
  }
};

}  // namespace tiermem::gpt
