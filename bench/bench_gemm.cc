// tiermem-bench gemm — the GPU's bf16 GEMM peak through the same cuBLAS call the CUDA model
// backend makes (gpt::cuda::matmul_forward: bf16 inputs, fp32 accumulate and output): the
// practical ceiling the trainer's TFLOP/s is measured against.
//
//   cmake --build build --target tiermem-bench
//   build/bin/tiermem-bench gemm --rows 8192 --d-model 1600 --reps 20 --json
//
// Shape: [rows, d] x [d, 4d] (the MLP's first linear of a d-wide GPT, the model's most common
// GEMM), every element 1/64 so the check before timing is exact: each output must be d/4096.
// Reported: median TFLOP/s (2·rows·d·4d per GEMM) over --reps timed GEMMs after one warm-up.
// Needs a CUDA build and a GPU: NotSupportedError (exit 1, one line) otherwise.
#include <fmt/format.h>

#include <cmath>
#include <iostream>
#include <nlohmann/json.hpp>
#include <vector>

#include "bench/bench.h"
#include "core/cli_checks.h"
#include "tiermem/error.h"

#if TIERMEM_HAVE_CUDA
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "gpt/cublas_loader.h"
#include "gpt/kernels_cuda.h"
#endif

namespace tiermem::bench {
namespace {

struct GemmOptions {
  int rows = 8192, d_model = 1600, reps = 20;
  bool json = false;
};

#if TIERMEM_HAVE_CUDA
void check(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess) throw CudaError(fmt::format("bench gemm: {}: {}", what, cudaGetErrorString(rc)));
}

int run_gemm(const GemmOptions& o) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    cudaGetLastError();
    throw NotSupportedError("tiermem-bench gemm needs a CUDA device; none is visible");
  }
  const long N = o.rows, C = o.d_model, OC = 4L * o.d_model;
  std::uint16_t *a = nullptr, *w = nullptr;
  float* c = nullptr;
  check(cudaMalloc(&a, N * C * 2), "cudaMalloc a");
  check(cudaMalloc(&w, OC * C * 2), "cudaMalloc w");
  check(cudaMalloc(&c, N * OC * 4), "cudaMalloc c");
  const std::uint16_t kOne64 = 0x3C80;  // bf16 1/64
  std::vector<std::uint16_t> fill(static_cast<std::size_t>(std::max(N, OC) * C), kOne64);
  check(cudaMemcpy(a, fill.data(), N * C * 2, cudaMemcpyHostToDevice), "upload a");
  check(cudaMemcpy(w, fill.data(), OC * C * 2, cudaMemcpyHostToDevice), "upload w");
  cublasHandle_t h = nullptr;
  if (gpt::cuda::cublas_api().create(&h) != CUBLAS_STATUS_SUCCESS) throw CudaError("bench gemm: cublasCreate failed");
  cudaStream_t s = nullptr;
  check(cudaStreamCreate(&s), "cudaStreamCreate");
  cudaEvent_t e0, e1;
  check(cudaEventCreate(&e0), "cudaEventCreate");
  check(cudaEventCreate(&e1), "cudaEventCreate");
  gpt::cuda::matmul_forward(h, c, a, w, nullptr, static_cast<int>(N), static_cast<int>(C),
                            static_cast<int>(OC), s);  // warm-up and the check
  check(cudaStreamSynchronize(s), "warm-up");
  std::vector<float> out(static_cast<std::size_t>(N * OC));
  check(cudaMemcpy(out.data(), c, N * OC * 4, cudaMemcpyDeviceToHost), "download c");
  const float want = static_cast<float>(C) / 4096.0f;
  for (float v : out) {
    if (std::abs(v - want) > 1e-3f * want) {
      throw Error(fmt::format("bench gemm: output {} where {} was expected: the GEMM is wrong", v, want));
    }
  }
  std::vector<double> tflops;
  const double flops = 2.0 * static_cast<double>(N) * static_cast<double>(C) * static_cast<double>(OC);
  for (int r = 0; r < o.reps; ++r) {
    check(cudaEventRecord(e0, s), "cudaEventRecord");
    gpt::cuda::matmul_forward(h, c, a, w, nullptr, static_cast<int>(N), static_cast<int>(C),
                              static_cast<int>(OC), s);
    check(cudaEventRecord(e1, s), "cudaEventRecord");
    check(cudaEventSynchronize(e1), "cudaEventSynchronize");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, e0, e1), "cudaEventElapsedTime");
    tflops.push_back(flops / (static_cast<double>(ms) * 1e-3) / 1e12);
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  const double t = median(tflops);
  std::cout << fmt::format("gemm: {} bf16 [{}, {}] x [{}, {}] (fp32 accumulate): {:.1f} TFLOP/s "
                           "(median of {})\n",
                           prop.name, N, C, C, OC, t, o.reps);
  if (o.json) {
    nlohmann::json j{{"bench", "gemm"}, {"device", prop.name}, {"rows", N}, {"d_model", C},
                     {"tflops", t}, {"reps", o.reps}};
    std::cout << j.dump() << "\n";
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaStreamDestroy(s);
  gpt::cuda::cublas_api().destroy(h);
  cudaFree(a);
  cudaFree(w);
  cudaFree(c);
  return 0;
}
#else
int run_gemm(const GemmOptions&) {
  throw NotSupportedError("tiermem-bench gemm: this build has no CUDA");
}
#endif

std::function<int()> setup_gemm(CLI::App& sub) {
  auto o = std::make_shared<GemmOptions>();
  sub.add_option("--rows", o->rows, "rows of the input (B·T tokens)")->default_val(o->rows)->check(tiermem::cli::whole_number_check())->check(CLI::Range(1, 1 << 20));
  sub.add_option("--d-model", o->d_model, "model width d (the GEMM is [rows, d] x [d, 4d])")->default_val(o->d_model)->check(tiermem::cli::whole_number_check())->check(CLI::Range(1, 1 << 16));
  sub.add_option("--reps", o->reps, "timed GEMMs (median reported)")->default_val(o->reps)->check(tiermem::cli::whole_number_check())->check(CLI::Range(1, 10000));
  sub.add_flag("--json", o->json, "print one JSON object as the last line");
  return [o] { return run_gemm(*o); };
}

}  // namespace

TIERMEM_BENCH_COMMAND(gemm, "gemm", "the GPU's bf16 GEMM TFLOP/s (cuBLAS, the CUDA model's call)",
                      setup_gemm);

}  // namespace tiermem::bench
