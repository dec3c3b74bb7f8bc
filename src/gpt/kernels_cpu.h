// gpt/kernels_cpu.h — the CPU layers of the GPT model over whole batches, templated on the real
// type R (float for the model, double for the finite-difference gradient checks). GEMMs go to
// OpenBLAS (cblas_sgemm / cblas_dgemm), called from one thread outside any OpenMP region with
// OpenBLAS's thread count set to OpenMP's (so the two pools take turns on the same cores rather
// than oversubscribe them; small GEMMs use one thread); the rest loops over rows with OpenMP
// (small loops stay on the calling thread) and calls gpt/layer_math.h.
//
// Shapes: N = B·T rows, C inputs, OC outputs; every buffer row-major, caller-owned, not aliased
// unless said. "+=" marks outputs that are accumulated into, "=" outputs that are overwritten.
// Thread-safety: functions are reentrant over distinct buffers, but each uses the OpenMP and
// OpenBLAS thread pools, so call them from one thread at a time.
#pragma once

#include <cstdint>
#include <string>

namespace tiermem::gpt::cpu {

// Threads the CPU kernels use (OpenMP's omp_get_max_threads(); OMP_NUM_THREADS sets it).
int compute_threads();

// OpenBLAS built with DYNAMIC_ARCH picks its kernels from the CPU model when it is loaded, and a
// model it does not know gets its generic Prescott (SSE3) kernels: Debian 12's 0.3.21 on an Intel
// family 6 model 207 ran sgemm (1024^3, 2 threads) at 57 GFLOP/s against 215 with its SkylakeX
// kernels forced, and a gpt2 step took 1.15 s instead of 0.54 s. For a program's main(), before
// any thread: when OPENBLAS_CORETYPE is unset and OpenBLAS chose a pre-AVX2 core (Prescott, Core2,
// Penryn, Dunnington, Nehalem, Atom) on a CPU with AVX2+FMA, this sets OPENBLAS_CORETYPE to
// SkylakeX (AVX-512 F/BW/VL/DQ/CD) or Haswell (AVX2), and TIERMEM_OPENBLAS_FALLBACK to the core
// OpenBLAS had chosen, and returns true: the caller must restart the process, since OpenBLAS
// reads the variable only when it is loaded (tiermem::prefer_passive_omp_wait(argv, true) does).
// Returns false when there is nothing to do (the user's OPENBLAS_CORETYPE is always kept).
// Thread-safety: not thread-safe (setenv); call it first thing in main().
bool prefer_openblas_core_for_this_cpu();
// OpenBLAS's pthreads build keeps each worker spinning on sched_yield() for 2^28 TSC cycles (about
// 0.1 s) after every parallel GEMM before it sleeps (OPENBLAS_THREAD_TIMEOUT, the log2 of that
// count, clamped to [4, 30]; OpenMathLib/OpenBLAS issues #1614, #5171). With the engine's own
// threads (I/O completions and their checksums, the gradient hand-off, the optimizer) on the same
// cores, the spin takes their time: on 2 vCPUs a gpt2 1 x 64 NVMe-offloaded step spent 0.6 s of
// system time per step, mostly in sched_yield, against 0.15 s with the timeout at 2^4 (docs/
// benchmarks.md "Threading defaults (OpenMP, OpenBLAS)"). For a program's main(), before any thread: when
// OPENBLAS_THREAD_TIMEOUT is unset, sets it to kOpenblasThreadTimeoutLog2 and returns true (the
// caller restarts, as for the core above); false when the user set it (kept) or setenv failed.
// Thread-safety: not thread-safe (setenv); call it first thing in main().
inline constexpr const char* kOpenblasThreadTimeoutLog2 = "4";
bool prefer_idle_openblas_threads();
// After such a restart, one sentence for the run's log saying what was forced and why (names the
// core OpenBLAS had chosen and the one in use); "" otherwise.
std::string openblas_core_note();

// out[n, c] = wte[tokens[n], c] + wpe[n % T, c]      (=)
template <class R>
void encoder_forward(R* out, const std::int32_t* tokens, const R* wte, const R* wpe, int B, int T,
                     int C);
// dwte[tokens[n]] += dout[n]; dwpe[n % T] += dout[n]   (+=)
template <class R>
void encoder_backward(R* dwte, R* dwpe, const R* dout, const std::int32_t* tokens, int B, int T,
                      int C);

// LayerNorm over the last dim: out (=), mean and rstd [N] (=).
template <class R>
void layernorm_forward(R* out, R* mean, R* rstd, const R* inp, const R* w, const R* b, int N,
                       int C);
// dinp, dw, db (+=).
template <class R>
void layernorm_backward(R* dinp, R* dw, R* db, const R* dout, const R* inp, const R* w,
                        const R* mean, const R* rstd, int N, int C);

// out[N, OC] = inp[N, C]·w[OC, C]ᵀ + bias[OC] (=); bias may be null.
template <class R>
void matmul_forward(R* out, const R* inp, const R* w, const R* bias, int N, int C, int OC);
// dinp[N, C] = dout·w (=, skipped when null); dw[OC, C] += doutᵀ·inp; dbias[OC] += Σ_n dout
// (skipped when null).
template <class R>
void matmul_backward(R* dinp, R* dw, R* dbias, const R* dout, const R* inp, const R* w, int N,
                     int C, int OC);

// Causal multi-head attention: qkv [N, 3C] -> out [N, C] (=), att [B, NH, T, T] (=).
template <class R>
void attention_forward(R* out, R* att, const R* qkv, int B, int T, int C, int NH);
// dqkv [N, 3C] (=); dpre [B, NH, T, T] scratch (=).
template <class R>
void attention_backward(R* dqkv, R* dpre, const R* dout, const R* qkv, const R* att, int B, int T,
                        int C, int NH);

// out = gelu(inp) (=), n elements.
template <class R>
void gelu_forward(R* out, const R* inp, std::int64_t n);
// dinp = gelu'(inp)·dout (=).
template <class R>
void gelu_backward(R* dinp, const R* inp, const R* dout, std::int64_t n);

// out = a + b (=); out may alias a or b.
template <class R>
void residual_forward(R* out, const R* a, const R* b, std::int64_t n);

// Softmax cross-entropy over [N, V], in place: logits become probabilities; returns the mean of
// −log p[target] over the N rows (accumulated in double).
template <class R>
R crossentropy_forward(R* logits, const std::int32_t* targets, int N, int V);
// probs become dlogits = (p − onehot)·dloss, in place (dloss is usually 1/N for a mean loss).
template <class R>
void crossentropy_backward(R* probs, const std::int32_t* targets, int N, int V, R dloss);

}  // namespace tiermem::gpt::cpu
