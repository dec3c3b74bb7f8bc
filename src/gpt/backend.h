// gpt/backend.h — the GPT model's compute behind one interface, so that the training loop does
// not know where it runs:
//   CPU backend  (make_cpu_backend)   gpt::Model: activations in host memory, OpenBLAS + OpenMP
//                                     kernels (kernels_cpu.h); the backend of SimDevice and of the
//                                     host-only reference engine.
//   CUDA backend (make_cuda_backend)  activations, workspace and a module-sized parameter and
//                                     gradient staging area in device memory, allocated once at
//                                     construction (device_bytes(); no cudaMalloc afterwards);
//                                     cuBLAS GEMMs in bf16 with fp32 accumulation and the CUDA row
//                                     kernels (kernels_cuda.h) on the backend's own compute stream.
// Both run the same steps in the same order with the same contract as gpt::Model (model.h):
// set_batch, forward steps in forward_steps() order, loss(), backward steps in backward_steps()
// order, gradients ACCUMULATED (+=) into the caller's host span.
//
// Parameters: a ParamView of fp32 or bf16 values. The CPU backend reads them with the CPU (host
// memory, or SimDevice memory, which is host memory). The CUDA backend accepts either device
// memory (a CudaDevice buffer: used in place) or host memory (copied to its staging area first);
// it asks the CUDA runtime which (cudaPointerGetAttributes). Gradients are always a host span
// (the engines reduce them from host memory); the CUDA backend copies the module's accumulated
// gradient in, accumulates on the device and copies it back before backward() returns.
//
// Completion: parameter and gradient buffers may be released or reused as soon as a call
// returns. The CUDA backend copies a module's parameters into its own staging area and waits for
// that copy only, so forward() returns while the step's kernels still run (the engine fetches the
// next module meanwhile); backward() returns with the gradient accumulated into the host span,
// and loss() waits for the head's kernels.
// Units: elements unless a name ends in _bytes. Thread-safety: a backend is driven by one thread.
// Errors: as gpt::Model (Error for wrong sizes or order, ConfigError for bad shapes);
// CudaError for CUDA failures; NotSupportedError from make_cuda_backend in a build without CUDA.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "gpt/model.h"

namespace tiermem::gpt {

class ModelBackend {
 public:
  virtual ~ModelBackend() = default;
  ModelBackend(const ModelBackend&) = delete;
  ModelBackend& operator=(const ModelBackend&) = delete;

  virtual std::string name() const = 0;  // "cpu" or "cuda:0 (NVIDIA H200)"
  virtual const GptConfig& config() const = 0;
  virtual int batch_size() const = 0;
  virtual int seq_len() const = 0;
  // Activation and workspace memory the backend holds: host bytes (CPU), device bytes (CUDA).
  virtual std::size_t activation_bytes() const = 0;
  virtual bool on_device() const = 0;  // true: activation_bytes() is device memory
  // Activation checkpointing (ModelOptions::checkpoint_blocks, CPU backend only): whether each
  // block is recomputed in backward, and the bytes of the block inputs kept for it (0 without).
  virtual bool checkpoints_blocks() const { return false; }
  virtual std::size_t block_input_bytes() const { return 0; }

  // As gpt::Model (model.h).
  virtual void set_batch(std::span<const std::int32_t> tokens,
                         std::span<const std::int32_t> targets) = 0;
  virtual void forward(const Step& s, ParamView params) = 0;
  virtual float loss() = 0;  // mean cross-entropy of the last kHead forward step
  virtual void backward(const Step& s, ParamView params, std::span<float> grads) = 0;

 protected:
  ModelBackend() = default;
};

// The CPU backend over gpt::Model(cfg, batch_size, seq_len, options). Throws ConfigError on bad
// sizes.
std::unique_ptr<ModelBackend> make_cpu_backend(const GptConfig& cfg, int batch_size,
                                               int seq_len, ModelOptions options = {});

// Device bytes make_cuda_backend(cfg, batch_size, seq_len) allocates (pure; for budgets).
std::uint64_t cuda_backend_bytes(const GptConfig& cfg, int batch_size, int seq_len);

// The CUDA backend on CUDA device `ordinal` (made the calling thread's current device; -1: the
// current device). Throws NotSupportedError without CUDA in the build, CudaError when the device
// cannot give its memory or cuBLAS cannot start.
std::unique_ptr<ModelBackend> make_cuda_backend(const GptConfig& cfg, int batch_size,
                                                int seq_len, int ordinal = -1);

}  // namespace tiermem::gpt
