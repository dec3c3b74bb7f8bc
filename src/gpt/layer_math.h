// gpt/layer_math.h — the per-row math of every GPT layer, written once as __host__ __device__
// functions: the CPU kernels (kernels_cpu.cc) call them inside OpenMP loops and the CUDA kernels
// (kernels_cuda.cu) call them with several threads per row, so the CPU tests (in double
// precision) cover the math both paths run. Templated on the real type R (float or double).
//
// Lanes. A row's work is split into PHASES, each a function taking (lane, lanes): lane k of
// `lanes` handles elements k, k + lanes, k + 2·lanes, ... and returns its partial result; the
// caller combines the partials of every lane (a sum or a max: warp shuffles and shared memory on
// the GPU) before the next phase, which gets the combined value. The CPU runs each phase with
// lane 0 of 1 (the plain sequential loop); the whole-row functions (layernorm_row_forward, ...)
// are exactly that. tests/unit/gpt_row_math_test.cc runs the phases with 32 lanes on the CPU and
// checks that they give the whole-row result: the decomposition the GPU kernels use is tested
// here without a GPU.
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
// Phases: sum of x -> mean = sum / C; sum of (x − mean)² -> rstd; apply.
template <class R>
TM_GPT_HD R layernorm_row_sum(const R* x, int C, int lane, int lanes) {
  R s = 0;
  for (int i = lane; i < C; i += lanes) s += x[i];
  return s;
}
template <class R>
TM_GPT_HD R layernorm_row_sq_dev(const R* x, R mean, int C, int lane, int lanes) {
  R v = 0;
  for (int i = lane; i < C; i += lanes) {
    const R d = x[i] - mean;
    v += d * d;
  }
  return v;
}
template <class R>
TM_GPT_HD R layernorm_rstd(R sq_dev_sum, int C) {
  return R(1) / m_sqrt(sq_dev_sum / R(C) + R(kLayerNormEps));
}
template <class R>
TM_GPT_HD void layernorm_row_apply(const R* x, const R* w, const R* b, R* out, R mean, R rstd,
                                   int C, int lane, int lanes) {
  for (int i = lane; i < C; i += lanes) out[i] = (x[i] - mean) * rstd * w[i] + b[i];
}
template <class R>
TM_GPT_HD void layernorm_row_forward(const R* x, const R* w, const R* b, R* out, R* mean_out,
                                     R* rstd_out, int C) {
  const R m = layernorm_row_sum(x, C, 0, 1) / R(C);
  const R rs = layernorm_rstd(layernorm_row_sq_dev(x, m, C, 0, 1), C);
  layernorm_row_apply(x, w, b, out, m, rs, C, 0, 1);
  *mean_out = m;
  *rstd_out = rs;
}
// dx += dLayerNorm/dx for one row, given dout, the saved mean and rstd:
//   dx_i += rstd·(g_i − mean(g) − x̂_i·mean(g·x̂)),  g = dout·w,  x̂ = (x − mean)·rstd
// Phases: the sums of g and g·x̂ (both at once) -> their means; apply.
template <class R>
TM_GPT_HD void layernorm_row_dx_sums(const R* dout, const R* x, const R* w, R mean, R rstd,
                                     int C, int lane, int lanes, R* sum_g, R* sum_gx) {
  R mg = 0, mgx = 0;
  for (int i = lane; i < C; i += lanes) {
    const R g = dout[i] * w[i];
    mg += g;
    mgx += g * (x[i] - mean) * rstd;
  }
  *sum_g = mg;
  *sum_gx = mgx;
}
template <class R>
TM_GPT_HD void layernorm_row_dx_apply(const R* dout, const R* x, const R* w, R mean, R rstd,
                                      R mean_g, R mean_gx, R* dx, int C, int lane, int lanes) {
  for (int i = lane; i < C; i += lanes) {
    const R xh = (x[i] - mean) * rstd;
    dx[i] += rstd * (dout[i] * w[i] - mean_g - xh * mean_gx);
  }
}
template <class R>
TM_GPT_HD void layernorm_row_backward_dx(const R* dout, const R* x, const R* w, R mean, R rstd,
                                         R* dx, int C) {
  R sg, sgx;
  layernorm_row_dx_sums(dout, x, w, mean, rstd, C, 0, 1, &sg, &sgx);
  layernorm_row_dx_apply(dout, x, w, mean, rstd, sg / R(C), sgx / R(C), dx, C, 0, 1);
}

// The most negative finite value: the start of a max over lanes that may own no element.
template <class R>
TM_GPT_HD R lowest() {
  return R(-3.0e38);
}

// Causal self-attention forward for query row (b, t, h): scores s_j = q·k_j/√hs for j <= t,
// att_j = softmax(s)_j (att_j = 0 for j > t), out = Σ_j att_j v_j.
// Phases: scores (lanes over keys j; returns the partial max) -> exp (lanes over j; returns the
// partial sum) -> normalize by 1/sum (lanes over j, zeros after t) -> out (lanes over the head's
// dims i). Each phase reads what the previous one wrote for every lane.
template <class R>
TM_GPT_HD R attention_row_scores(const R* qkv, R* att, int T, int C, int NH, int b, int t, int h,
                                 int lane, int lanes) {
  const int hs = C / NH;
  const R scale = R(1) / m_sqrt(R(hs));
  const R* q = qkv + (static_cast<long>(b) * T + t) * 3 * C + h * hs;
  R* a = att + ((static_cast<long>(b) * NH + h) * T + t) * T;
  R mx = lowest<R>();
  for (int j = lane; j <= t; j += lanes) {
    const R* k = qkv + (static_cast<long>(b) * T + j) * 3 * C + C + h * hs;
    R s = 0;
    TM_GPT_SIMD_SUM_S
    for (int i = 0; i < hs; ++i) s += q[i] * k[i];
    s *= scale;
    a[j] = s;
    if (s > mx) mx = s;
  }
  return mx;
}
template <class R>
TM_GPT_HD R attention_row_exp(R* att, R mx, int T, int NH, int b, int t, int h, int lane,
                              int lanes) {
  R* a = att + ((static_cast<long>(b) * NH + h) * T + t) * T;
  R sum = 0;
  for (int j = lane; j <= t; j += lanes) {
    a[j] = m_exp(a[j] - mx);
    sum += a[j];
  }
  return sum;
}
template <class R>
TM_GPT_HD void attention_row_normalize(R* att, R inv_sum, int T, int NH, int b, int t, int h,
                                       int lane, int lanes) {
  R* a = att + ((static_cast<long>(b) * NH + h) * T + t) * T;
  for (int j = lane; j < T; j += lanes) a[j] = j <= t ? a[j] * inv_sum : R(0);
}
template <class R>
TM_GPT_HD void attention_row_out(const R* qkv, const R* att, R* out, int T, int C, int NH, int b,
                                 int t, int h, int lane, int lanes) {
  const int hs = C / NH;
  const R* a = att + ((static_cast<long>(b) * NH + h) * T + t) * T;
  R* o = out + (static_cast<long>(b) * T + t) * C + h * hs;
  for (int i = lane; i < hs; i += lanes) o[i] = 0;
  for (int j = 0; j <= t; ++j) {
    const R* v = qkv + (static_cast<long>(b) * T + j) * 3 * C + 2 * C + h * hs;
    const R aj = a[j];
    TM_GPT_SIMD
    for (int i = lane; i < hs; i += lanes) o[i] += aj * v[i];
  }
}
template <class R>
TM_GPT_HD void attention_row_forward(const R* qkv, R* att, R* out, int T, int C, int NH, int b,
                                     int t, int h) {
  const R mx = attention_row_scores(qkv, att, T, C, NH, b, t, h, 0, 1);
  const R sum = attention_row_exp(att, mx, T, NH, b, t, h, 0, 1);
  attention_row_normalize(att, R(1) / sum, T, NH, b, t, h, 0, 1);
  attention_row_out(qkv, att, out, T, C, NH, b, t, h, 0, 1);
}

// Attention backward, phase 1, query row (b, t, h): the gradient of the (scaled) scores,
//   dpre_j = att_j·(datt_j − Σ_k att_k·datt_k),  datt_j = dout·v_j   (j <= t; 0 after)
// dpre has the layout of att. Phases: dots (lanes over j: dpre_j = datt_j; returns the partial
// Σ att_j·datt_j) -> apply (lanes over j).
template <class R>
TM_GPT_HD R attention_row_dpre_dots(const R* qkv, const R* att, const R* dout, R* dpre, int T,
                                    int C, int NH, int b, int t, int h, int lane, int lanes) {
  const int hs = C / NH;
  const long row = ((static_cast<long>(b) * NH + h) * T + t) * T;
  const R* a = att + row;
  R* d = dpre + row;
  const R* go = dout + (static_cast<long>(b) * T + t) * C + h * hs;
  R dot = 0;
  for (int j = lane; j <= t; j += lanes) {
    const R* v = qkv + (static_cast<long>(b) * T + j) * 3 * C + 2 * C + h * hs;
    R s = 0;
    TM_GPT_SIMD_SUM_S
    for (int i = 0; i < hs; ++i) s += go[i] * v[i];
    d[j] = s;
    dot += a[j] * s;
  }
  return dot;
}
template <class R>
TM_GPT_HD void attention_row_dpre_apply(const R* att, R* dpre, R dot, int T, int NH, int b, int t,
                                        int h, int lane, int lanes) {
  const long row = ((static_cast<long>(b) * NH + h) * T + t) * T;
  for (int j = lane; j < T; j += lanes) dpre[row + j] = j <= t ? att[row + j] * (dpre[row + j] - dot) : R(0);
}
template <class R>
TM_GPT_HD void attention_row_dpre(const R* qkv, const R* att, const R* dout, R* dpre, int T, int C,
                                  int NH, int b, int t, int h) {
  const R dot = attention_row_dpre_dots(qkv, att, dout, dpre, T, C, NH, b, t, h, 0, 1);
  attention_row_dpre_apply(att, dpre, dot, T, NH, b, t, h, 0, 1);
}

// Phase 2, query row (b, t, h): dq = (1/√hs)·Σ_{j<=t} dpre_tj·k_j (written, not accumulated).
// Lanes over the head's dims i.
template <class R>
TM_GPT_HD void attention_row_dq(const R* qkv, const R* dpre, R* dqkv, int T, int C, int NH, int b,
                                int t, int h, int lane = 0, int lanes = 1) {
  const int hs = C / NH;
  const R scale = R(1) / m_sqrt(R(hs));
  const R* d = dpre + ((static_cast<long>(b) * NH + h) * T + t) * T;
  R* dq = dqkv + (static_cast<long>(b) * T + t) * 3 * C + h * hs;
  for (int i = lane; i < hs; i += lanes) dq[i] = 0;
  for (int j = 0; j <= t; ++j) {
    const R* k = qkv + (static_cast<long>(b) * T + j) * 3 * C + C + h * hs;
    R s = d[j] * scale;
    TM_GPT_SIMD
    for (int i = lane; i < hs; i += lanes) dq[i] += s * k[i];
  }
}

// Phase 3, key row (b, j, h): dk_j = (1/√hs)·Σ_{t>=j} dpre_tj·q_t, dv_j = Σ_{t>=j} att_tj·dout_t
// (written, not accumulated). Lanes over the head's dims i.
template <class R>
TM_GPT_HD void attention_row_dkv(const R* qkv, const R* att, const R* dpre, const R* dout, R* dqkv,
                                 int T, int C, int NH, int b, int j, int h, int lane = 0,
                                 int lanes = 1) {
  const int hs = C / NH;
  const R scale = R(1) / m_sqrt(R(hs));
  R* dk = dqkv + (static_cast<long>(b) * T + j) * 3 * C + C + h * hs;
  R* dv = dk + C;
  for (int i = lane; i < hs; i += lanes) dk[i] = dv[i] = 0;
  const long base = (static_cast<long>(b) * NH + h) * T;
  for (int t = j; t < T; ++t) {
    R dp = dpre[(base + t) * T + j] * scale;
    R a = att[(base + t) * T + j];
    const R* q = qkv + (static_cast<long>(b) * T + t) * 3 * C + h * hs;
    const R* go = dout + (static_cast<long>(b) * T + t) * C + h * hs;
    TM_GPT_SIMD
    for (int i = lane; i < hs; i += lanes) {
      dk[i] += dp * q[i];
      dv[i] += a * go[i];
    }
  }
}

// Softmax cross-entropy of one row of V logits, in place: logits become probabilities; returns
// −log p[target] (computed from the max-shifted log-sum-exp, finite for any finite logits).
// Phases: max (lanes over i) -> sum of exp(l − max) -> the loss (read the target's logit BEFORE
// the apply phase overwrites it) -> apply (lanes over i).
template <class R>
TM_GPT_HD R xent_row_max(const R* logits, int V, int lane, int lanes) {
  R mx = lowest<R>();
  for (int i = lane; i < V; i += lanes) mx = logits[i] > mx ? logits[i] : mx;
  return mx;
}
template <class R>
TM_GPT_HD R xent_row_sumexp(const R* logits, R mx, int V, int lane, int lanes) {
  R sum = 0;
  for (int i = lane; i < V; i += lanes) sum += m_exp(logits[i] - mx);
  return sum;
}
template <class R>
TM_GPT_HD R xent_row_loss(R target_logit, R mx, R sum) {
  return -(target_logit - mx - m_log(sum));
}
template <class R>
TM_GPT_HD void xent_row_apply(R* logits, R mx, R inv_sum, int V, int lane, int lanes) {
  for (int i = lane; i < V; i += lanes) logits[i] = m_exp(logits[i] - mx) * inv_sum;
}
template <class R>
TM_GPT_HD R softmax_xent_row_forward(R* logits, int V, int target) {
  const R mx = xent_row_max(logits, V, 0, 1);
  const R sum = xent_row_sumexp(logits, mx, V, 0, 1);
  const R loss = xent_row_loss(logits[target], mx, sum);
  xent_row_apply(logits, mx, R(1) / sum, V, 0, 1);
  return loss;
}
// dlogits = (p − onehot(target))·dloss, in place over the probabilities of one row.
template <class R>
TM_GPT_HD void softmax_xent_row_backward(R* probs, int V, int target, R dloss, int lane = 0,
                                         int lanes = 1) {
  for (int i = lane; i < V; i += lanes) probs[i] = (probs[i] - (i == target ? R(1) : R(0))) * dloss;
}

}  // namespace tiermem::gpt::math
