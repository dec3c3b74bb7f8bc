// gpt/cublas_loader.h — cuBLAS, loaded on first use (dlopen of libcublas.so.<major>) instead of
// linked: a program that never runs the CUDA model (tiermem-train --device sim, on a machine with
// or without a GPU) then never maps cuBLAS and cuBLASLt, whose load alone costs ~150 MiB of RSS
// at startup (tiermem-train's memory promises count RSS). CUDA builds only.
//
// Thread-safety: cublas_api() loads once (a function-local static); the table is then read-only.
// Errors: cublas_api() throws tiermem::CudaError naming the library and dlerror() when the library
// or one of its functions cannot be loaded; every call after a failed load throws again.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

namespace tiermem::gpt::cuda {

// The cuBLAS functions the model uses (the _v2 entry points cublas_v2.h maps the names to).
struct CublasApi {
  cublasStatus_t (*create)(cublasHandle_t*);
  cublasStatus_t (*destroy)(cublasHandle_t);
  cublasStatus_t (*set_stream)(cublasHandle_t, cudaStream_t);
  cublasStatus_t (*gemm_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                            const void*, const void*, cudaDataType, int, const void*, cudaDataType,
                            int, const void*, void*, cudaDataType, int, cublasComputeType_t,
                            cublasGemmAlgo_t);
};

const CublasApi& cublas_api();

}  // namespace tiermem::gpt::cuda
