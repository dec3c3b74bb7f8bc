// gpt/layer_math.h — the per-row math of every GPT layer, written once as __host__ __device__
// functions: the CPU kernels (kernels_cpu.cc) call them inside OpenMP loops and the CUDA kernels
// (kernels_cuda.cu) call them one thread per row, so the CPU tests (in double precision) cover the
// math both paths run. Templated on the real type R (float or double).
//
// Conventions: N = B·T rows, C = d_model, NH = heads, hs = C/NH, qkv rows are [q | k | v] each of
// width C with head h at columns h·hs .. h·hs+hs-1. att is [B, NH, T, T] (row t holds the softmax
// over keys 0..t, zeros after). Every function touches only the row(s) it is given.
// Thread-safety: pure functions over the given pointers; rows may run concurrently.
#pragma once

#include <math.h>

#if defined(__CUDACC__)
#define TM_GPT_HD __host__ __device__ inline
#else
#define TM_GPT_HD inline
#endif

namespace tiermem::gpt::math {

TM_GPT_HD float m_exp(float x) { return expf(x); }
TM_GPT_HD double m_exp(double x) { return exp(x); }
TM_GPT_HD float m_log(float x) { return logf(x); }
TM_GPT_HD double m_log(double x) { return log(x); }
// tanh through one expf (cheaper than tanhf on the CPU; absolute error ~1e-7, saturates to ±1).
TM_GPT_HD float m_tanh(float x) { return 1.0f - 2.0f / (1.0f + expf(2.0f * x)); }
TM_GPT_HD double m_tanh(double x) { return tanh(x); }
TM_GPT_HD float m_sqrt(float x) { return sqrtf(x); }
TM_GPT_HD double m_sqrt(double x) { return sqrt(x); }

constexpr double kLayerNormEps = 1e-5;

// Lets the host compiler vectorise the sum into `s` that follows (reassociating it) under OpenMP;
// a no-op in device code and without OpenMP.
#if defined(_OPENMP) && !defined(__CUDA_ARCH__)
#define TM_GPT_SIMD_SUM_S _Pragma("omp simd reduction(+ : s)")
#define TM_GPT_SIMD _Pragma("omp simd")  // the loop that follows has no aliasing between rows
#else
#define TM_GPT_SIMD_SUM_S
#define TM_GPT_SIMD
#endif

// GELU, tanh approximation (Hendrycks & Gimpel 2016; the form GPT-2 uses):
//   gelu(x) = 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))
template <class R>
TM_GPT_HD R gelu(R x) {
  const R k = R(0.7978845608028654);  // sqrt(2/pi)
  R u = k * (x + R(0.044715) * x * x * x);
  return R(0.5) * x * (R(1) + m_tanh(u));
}
// d gelu / dx
template <class R>
TM_GPT_HD R gelu_grad(R x) {
  const R k = R(0.7978845608028654);
  R u = k * (x + R(0.044715) * x * x * x);
  R th = m_tanh(u);
  R sech2 = R(1) - th * th;
  return R(0.5) * (R(1) + th) + R(0.5) * x * sech2 * k * (R(1) + R(3) * R(0.044715) * x * x);
}

// LayerNorm of one row of C: out = (x − mean)·rstd·w + b, rstd = 1/√(var + 1e-5) (biased var).
template <class R>
TM_GPT_HD void layernorm_row_forward(const R* x, const R* w, const R* b, R* out, R* mean_out,
                                     R* rstd_out, int C) {
  R m = 0;
  for (int i = 0; i < C; ++i) m += x[i];
  m /= R(C);
  R v = 0;
  for (int i = 0; i < C; ++i) {
    R d = x[i] - m;
    v += d * d;
  }
  v /= R(C);
  R rs = R(1) / m_sqrt(v + R(kLayerNormEps));
  for (int i = 0; i < C; ++i) out[i] = (x[i] - m) * rs * w[i] + b[i];
  *mean_out = m;
  *rstd_out = rs;
}
// dx += dLayerNorm/dx for one row, given dout, the saved mean and rstd:
//   dx_i += rstd·(g_i − mean(g) − x̂_i·mean(g·x̂)),  g = dout·w,  x̂ = (x − mean)·rstd
template <class R>
TM_GPT_HD void layernorm_row_backward_dx(const R* dout, const R* x, const R* w, R mean, R rstd,
                                         R* dx, int C) {
  R mg = 0, mgx = 0;
  for (int i = 0; i < C; ++i) {
    R g = dout[i] * w[i];
    mg += g;
    mgx += g * (x[i] - mean) * rstd;
  }
  mg /= R(C);
  mgx /= R(C);
  for (int i = 0; i < C; ++i) {
    R xh = (x[i] - mean) * rstd;
    dx[i] += rstd * (dout[i] * w[i] - mg - xh * mgx);
  }
}

// Causal self-attention forward for query row (b, t, h): scores s_j = q·k_j/√hs for j <= t,
// att_j = softmax(s)_j (att_j = 0 for j > t), out = Σ_j att_j v_j.
template <class R>
TM_GPT_HD void attention_row_forward(const R* qkv, R* att, R* out, int T, int C, int NH, int b,
                                     int t, int h) {
  const int hs = C / NH;
  const R scale = R(1) / m_sqrt(R(hs));
  const R* q = qkv + (static_cast<long>(b) * T + t) * 3 * C + h * hs;
  R* a = att + ((static_cast<long>(b) * NH + h) * T + t) * T;
  R mx = R(-1e30);
  for (int j = 0; j <= t; ++j) {
    const R* k = qkv + (static_cast<long>(b) * T + j) * 3 * C + C + h * hs;
    R s = 0;
    TM_GPT_SIMD_SUM_S
    for (int i = 0; i < hs; ++i) s += q[i] * k[i];
    s *= scale;
    a[j] = s;
    if (s > mx) mx = s;
  }
  R sum = 0;
  for (int j = 0; j <= t; ++j) {
    a[j] = m_exp(a[j] - mx);
    sum += a[j];
  }
  R inv = R(1) / sum;
  for (int j = 0; j <= t; ++j) a[j] *= inv;
  for (int j = t + 1; j < T; ++j) a[j] = 0;
  R* o = out + (static_cast<long>(b) * T + t) * C + h * hs;
  for (int i = 0; i < hs; ++i) o[i] = 0;
  for (int j = 0; j <= t; ++j) {
    const R* v = qkv + (static_cast<long>(b) * T + j) * 3 * C + 2 * C + h * hs;
    const R aj = a[j];
    TM_GPT_SIMD
    for (int i = 0; i < hs; ++i) o[i] += aj * v[i];
  }
}

// Attention backward, phase 1, query row (b, t, h): the gradient of the (scaled) scores,
//   dpre_j = att_j·(datt_j − Σ_k att_k·datt_k),  datt_j = dout·v_j   (j <= t; 0 after)
// dpre has the layout of att.
template <class R>
TM_GPT_HD void attention_row_dpre(const R* qkv, const R* att, const R* dout, R* dpre, int T, int C,
                                  int NH, int b, int t, int h) {
  const int hs = C / NH;
  const long row = ((static_cast<long>(b) * NH + h) * T + t) * T;
  const R* a = att + row;
  R* d = dpre + row;
  const R* go = dout + (static_cast<long>(b) * T + t) * C + h * hs;
  R dot = 0;
  for (int j = 0; j <= t; ++j) {
    const R* v = qkv + (static_cast<long>(b) * T + j) * 3 * C + 2 * C + h * hs;
    R s = 0;
    TM_GPT_SIMD_SUM_S
    for (int i = 0; i < hs; ++i) s += go[i] * v[i];
    d[j] = s;
    dot += a[j] * s;
  }
  for (int j = 0; j <= t; ++j) d[j] = a[j] * (d[j] - dot);
  for (int j = t + 1; j < T; ++j) d[j] = 0;
}

// Phase 2, query row (b, t, h): dq = (1/√hs)·Σ_{j<=t} dpre_tj·k_j (written, not accumulated).
template <class R>
TM_GPT_HD void attention_row_dq(const R* qkv, const R* dpre, R* dqkv, int T, int C, int NH, int b,
                                int t, int h) {
  const int hs = C / NH;
  const R scale = R(1) / m_sqrt(R(hs));
  const R* d = dpre + ((static_cast<long>(b) * NH + h) * T + t) * T;
  R* dq = dqkv + (static_cast<long>(b) * T + t) * 3 * C + h * hs;
  for (int i = 0; i < hs; ++i) dq[i] = 0;
  for (int j = 0; j <= t; ++j) {
    const R* k = qkv + (static_cast<long>(b) * T + j) * 3 * C + C + h * hs;
    R s = d[j] * scale;
    TM_GPT_SIMD
    for (int i = 0; i < hs; ++i) dq[i] += s * k[i];
  }
}

// Phase 3, key row (b, j, h): dk_j = (1/√hs)·Σ_{t>=j} dpre_tj·q_t, dv_j = Σ_{t>=j} att_tj·dout_t
// (written, not accumulated).
template <class R>
TM_GPT_HD void attention_row_dkv(const R* qkv, const R* att, const R* dpre, const R* dout, R* dqkv,
                                 int T, int C, int NH, int b, int j, int h) {
  const int hs = C / NH;
  const R scale = R(1) / m_sqrt(R(hs));
  R* dk = dqkv + (static_cast<long>(b) * T + j) * 3 * C + C + h * hs;
  R* dv = dk + C;
  for (int i = 0; i < hs; ++i) dk[i] = dv[i] = 0;
  const long base = (static_cast<long>(b) * NH + h) * T;
  for (int t = j; t < T; ++t) {
    R dp = dpre[(base + t) * T + j] * scale;
    R a = att[(base + t) * T + j];
    const R* q = qkv + (static_cast<long>(b) * T + t) * 3 * C + h * hs;
    const R* go = dout + (static_cast<long>(b) * T + t) * C + h * hs;
    TM_GPT_SIMD
    for (int i = 0; i < hs; ++i) {
      dk[i] += dp * q[i];
      dv[i] += a * go[i];
    }
  }
}

// Softmax cross-entropy of one row of V logits, in place: logits become probabilities; returns
// −log p[target] (computed from the max-shifted log-sum-exp, finite for any finite logits).
template <class R>
TM_GPT_HD R softmax_xent_row_forward(R* logits, int V, int target) {
  R mx = logits[0];
  for (int i = 1; i < V; ++i) mx = logits[i] > mx ? logits[i] : mx;
  R sum = 0;
  for (int i = 0; i < V; ++i) sum += m_exp(logits[i] - mx);
  R lt = logits[target] - mx - m_log(sum);
  R inv = R(1) / sum;
  for (int i = 0; i < V; ++i) logits[i] = m_exp(logits[i] - mx) * inv;
  return -lt;
}
// dlogits = (p − onehot(target))·dloss, in place over the probabilities of one row.
template <class R>
TM_GPT_HD void softmax_xent_row_backward(R* probs, int V, int target, R dloss) {
  for (int i = 0; i < V; ++i) probs[i] = (probs[i] - (i == target ? R(1) : R(0))) * dloss;
}

}  // namespace tiermem::gpt::math
