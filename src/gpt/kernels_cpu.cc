// gpt/kernels_cpu.cc — CPU layers: OpenBLAS GEMMs, OpenMP loops over the rows of layer_math.h.
#include "gpt/kernels_cpu.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "gpt/layer_math.h"
#include "tiermem/env.h"

namespace tiermem::gpt::cpu {

bool prefer_openblas_core_for_this_cpu() {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return false;  // the user's choice (or ours, restarted)
  const char* picked = openblas_get_corename();
  if (picked == nullptr) return false;
  // openblas_get_corename()'s names for its pre-AVX2 x86 targets.
  constexpr std::array<std::string_view, 6> kPreAvx2 = {"Prescott", "Core2", "Penryn", "Dunnington", "Nehalem",
                                                        "Atom"};
  if (std::find(kPreAvx2.begin(), kPreAvx2.end(), std::string_view(picked)) == kPreAvx2.end()) return false;
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return false;  // its choice fits
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                      __builtin_cpu_supports("avx512cd");
  if (::setenv("OPENBLAS_CORETYPE", avx512 ? "SkylakeX" : "Haswell", 1) != 0) return false;
  ::setenv("TIERMEM_OPENBLAS_FALLBACK", picked, 1);
  return true;
}

bool prefer_idle_openblas_threads() {
  if (std::getenv("OPENBLAS_THREAD_TIMEOUT") != nullptr) return false;  // the user's choice (or ours, restarted)
  return ::setenv("OPENBLAS_THREAD_TIMEOUT", kOpenblasThreadTimeoutLog2, 1) == 0;
}

std::string openblas_core_note() {
  const auto fallback = env_param("TIERMEM_OPENBLAS_FALLBACK");
  const auto forced = env_param("OPENBLAS_CORETYPE");
  if (!fallback || !forced) return "";
  const char* now = openblas_get_corename();
  return "OpenBLAS chose its generic " + *fallback + " kernels for this CPU (a model it does not know); using " +
         (now != nullptr ? std::string(now) : *forced) +
         " instead, as the CPU has the instructions (set OPENBLAS_CORETYPE to choose another)";
}

namespace {

// Column blocks for reductions over rows (dw, db, dbias, dwpe): each thread owns whole columns.
constexpr int kColBlock = 64;
// Loops with fewer element operations than this run on the calling thread: forking a team costs
// microseconds, and on a loaded machine a barrier waits for a descheduled thread.
constexpr long kParallelMin = 1L << 15;

// GEMMs under this many multiply-adds run on one OpenBLAS thread: waking the pool costs more than
// it saves, and on a busy machine it can cost milliseconds.
constexpr double kBlasParallelMacs = 1 << 20;

// Sets OpenBLAS's thread count for a GEMM of m·n·k multiply-adds (only when it changes).
void set_blas_threads(int m, int n, int k) {
  static int current = -1;
  const int want = static_cast<double>(m) * n * k >= kBlasParallelMacs ? omp_get_max_threads() : 1;
  if (want != current) {
    openblas_set_num_threads(want);
    current = want;
  }
}

void gemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int m, int n, int k, float alpha, const float* a,
          int lda, const float* b, int ldb, float beta, float* c, int ldc) {
  set_blas_threads(m, n, k);
  cblas_sgemm(CblasRowMajor, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
void gemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int m, int n, int k, double alpha,
          const double* a, int lda, const double* b, int ldb, double beta, double* c, int ldc) {
  set_blas_threads(m, n, k);
  cblas_dgemm(CblasRowMajor, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

}  // namespace

int compute_threads() { return omp_get_max_threads(); }


template <class R>
void encoder_forward(R* out, const std::int32_t* tokens, const R* wte, const R* wpe, int B, int T,
                     int C) {
  const long N = static_cast<long>(B) * T;
#pragma omp parallel for schedule(static) if(N * C >= kParallelMin)
  for (long n = 0; n < N; ++n) {
    const R* e = wte + static_cast<long>(tokens[n]) * C;
    const R* p = wpe + (n % T) * C;
    R* o = out + n * C;
    for (int c = 0; c < C; ++c) o[c] = e[c] + p[c];
  }
}

template <class R>
void encoder_backward(R* dwte, R* dwpe, const R* dout, const std::int32_t* tokens, int B, int T,
                      int C) {
  const long N = static_cast<long>(B) * T;
  const int nblk = (C + kColBlock - 1) / kColBlock;
#pragma omp parallel for schedule(static) if(N * C >= kParallelMin)
  for (int blk = 0; blk < nblk; ++blk) {
    const int c0 = blk * kColBlock, c1 = std::min(C, c0 + kColBlock);
    for (long n = 0; n < N; ++n) {
      const R* g = dout + n * C;
      R* e = dwte + static_cast<long>(tokens[n]) * C;
      R* p = dwpe + (n % T) * C;
      for (int c = c0; c < c1; ++c) {
        e[c] += g[c];
        p[c] += g[c];
      }
    }
  }
}

template <class R>
void layernorm_forward(R* out, R* mean, R* rstd, const R* inp, const R* w, const R* b, int N,
                       int C) {
#pragma omp parallel for schedule(static) if(static_cast<long>(N) * C >= kParallelMin)
  for (int n = 0; n < N; ++n) {
    math::layernorm_row_forward(inp + static_cast<long>(n) * C, w, b,
                                out + static_cast<long>(n) * C, mean + n, rstd + n, C);
  }
}

template <class R>
void layernorm_backward(R* dinp, R* dw, R* db, const R* dout, const R* inp, const R* w,
                        const R* mean, const R* rstd, int N, int C) {
#pragma omp parallel for schedule(static) if(static_cast<long>(N) * C >= kParallelMin)
  for (int n = 0; n < N; ++n) {
    const long o = static_cast<long>(n) * C;
    math::layernorm_row_backward_dx(dout + o, inp + o, w, mean[n], rstd[n], dinp + o, C);
  }
  const int nblk = (C + kColBlock - 1) / kColBlock;
#pragma omp parallel for schedule(static) if(static_cast<long>(N) * C >= kParallelMin)
  for (int blk = 0; blk < nblk; ++blk) {
    const int c0 = blk * kColBlock, c1 = std::min(C, c0 + kColBlock);
    for (int n = 0; n < N; ++n) {
      const long o = static_cast<long>(n) * C;
      for (int c = c0; c < c1; ++c) {
        R xh = (inp[o + c] - mean[n]) * rstd[n];
        dw[c] += dout[o + c] * xh;
        db[c] += dout[o + c];
      }
    }
  }
}

template <class R>
void matmul_forward(R* out, const R* inp, const R* w, const R* bias, int N, int C, int OC) {
  R beta = 0;
  if (bias != nullptr) {
#pragma omp parallel for schedule(static) if(static_cast<long>(N) * OC >= kParallelMin)
    for (int n = 0; n < N; ++n) {
      std::memcpy(out + static_cast<long>(n) * OC, bias, sizeof(R) * OC);
    }
    beta = 1;
  }
  gemm(CblasNoTrans, CblasTrans, N, OC, C, R(1), inp, C, w, C, beta, out, OC);
}

template <class R>
void matmul_backward(R* dinp, R* dw, R* dbias, const R* dout, const R* inp, const R* w, int N,
                     int C, int OC) {
  if (dinp != nullptr) gemm(CblasNoTrans, CblasNoTrans, N, C, OC, R(1), dout, OC, w, C, R(0), dinp, C);
  gemm(CblasTrans, CblasNoTrans, OC, C, N, R(1), dout, OC, inp, C, R(1), dw, C);
  if (dbias != nullptr) {
    const int nblk = (OC + kColBlock - 1) / kColBlock;
#pragma omp parallel for schedule(static) if(static_cast<long>(N) * OC >= kParallelMin)
    for (int blk = 0; blk < nblk; ++blk) {
      const int c0 = blk * kColBlock, c1 = std::min(OC, c0 + kColBlock);
      for (int n = 0; n < N; ++n) {
        const R* g = dout + static_cast<long>(n) * OC;
        for (int c = c0; c < c1; ++c) dbias[c] += g[c];
      }
    }
  }
}

template <class R>
void attention_forward(R* out, R* att, const R* qkv, int B, int T, int C, int NH) {
  const long rows = static_cast<long>(B) * NH * T;
#pragma omp parallel for schedule(dynamic, 16) if(rows * T >= kParallelMin)
  for (long r = 0; r < rows; ++r) {
    const int t = static_cast<int>(r % T), h = static_cast<int>((r / T) % NH),
              b = static_cast<int>(r / (static_cast<long>(T) * NH));
    math::attention_row_forward(qkv, att, out, T, C, NH, b, t, h);
  }
}

template <class R>
void attention_backward(R* dqkv, R* dpre, const R* dout, const R* qkv, const R* att, int B, int T,
                        int C, int NH) {
  const long rows = static_cast<long>(B) * NH * T;
#pragma omp parallel if(rows * T >= kParallelMin)
  {
#pragma omp for schedule(dynamic, 16)
    for (long r = 0; r < rows; ++r) {
      const int t = static_cast<int>(r % T), h = static_cast<int>((r / T) % NH),
                b = static_cast<int>(r / (static_cast<long>(T) * NH));
      math::attention_row_dpre(qkv, att, dout, dpre, T, C, NH, b, t, h);
    }
#pragma omp for schedule(dynamic, 16)
    for (long r = 0; r < rows; ++r) {
      const int t = static_cast<int>(r % T), h = static_cast<int>((r / T) % NH),
                b = static_cast<int>(r / (static_cast<long>(T) * NH));
      math::attention_row_dq(qkv, dpre, dqkv, T, C, NH, b, t, h);
      math::attention_row_dkv(qkv, att, dpre, dout, dqkv, T, C, NH, b, t, h);
    }
  }
}

template <class R>
void gelu_forward(R* out, const R* inp, std::int64_t n) {
#pragma omp parallel for schedule(static) if(n >= kParallelMin)
  for (std::int64_t i = 0; i < n; ++i) out[i] = math::gelu(inp[i]);
}

template <class R>
void gelu_backward(R* dinp, const R* inp, const R* dout, std::int64_t n) {
#pragma omp parallel for schedule(static) if(n >= kParallelMin)
  for (std::int64_t i = 0; i < n; ++i) dinp[i] = math::gelu_grad(inp[i]) * dout[i];
}

template <class R>
void residual_forward(R* out, const R* a, const R* b, std::int64_t n) {
#pragma omp parallel for schedule(static) if(n >= kParallelMin)
  for (std::int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

template <class R>
R crossentropy_forward(R* logits, const std::int32_t* targets, int N, int V) {
  double sum = 0;
#pragma omp parallel for schedule(static) reduction(+ : sum) \
    if(static_cast<long>(N) * V >= kParallelMin)
  for (int n = 0; n < N; ++n) {
    sum += static_cast<double>(
        math::softmax_xent_row_forward(logits + static_cast<long>(n) * V, V, targets[n]));
  }
  return static_cast<R>(sum / N);
}

template <class R>
void crossentropy_backward(R* probs, const std::int32_t* targets, int N, int V, R dloss) {
#pragma omp parallel for schedule(static) if(static_cast<long>(N) * V >= kParallelMin)
  for (int n = 0; n < N; ++n) {
    math::softmax_xent_row_backward(probs + static_cast<long>(n) * V, V, targets[n], dloss);
  }
}

#define TM_GPT_INSTANTIATE(R)                                                                    \
  template void encoder_forward<R>(R*, const std::int32_t*, const R*, const R*, int, int, int);  \
  template void encoder_backward<R>(R*, R*, const R*, const std::int32_t*, int, int, int);       \
  template void layernorm_forward<R>(R*, R*, R*, const R*, const R*, const R*, int, int);        \
  template void layernorm_backward<R>(R*, R*, R*, const R*, const R*, const R*, const R*,        \
                                      const R*, int, int);                                       \
  template void matmul_forward<R>(R*, const R*, const R*, const R*, int, int, int);              \
  template void matmul_backward<R>(R*, R*, R*, const R*, const R*, const R*, int, int, int);     \
  template void attention_forward<R>(R*, R*, const R*, int, int, int, int);                      \
  template void attention_backward<R>(R*, R*, const R*, const R*, const R*, int, int, int, int); \
  template void gelu_forward<R>(R*, const R*, std::int64_t);                                     \
  template void gelu_backward<R>(R*, const R*, const R*, std::int64_t);                          \
  template void residual_forward<R>(R*, const R*, const R*, std::int64_t);                       \
  template R crossentropy_forward<R>(R*, const std::int32_t*, int, int);                         \
  template void crossentropy_backward<R>(R*, const std::int32_t*, int, int, R);

TM_GPT_INSTANTIATE(float)
TM_GPT_INSTANTIATE(double)

}  // namespace tiermem::gpt::cpu
