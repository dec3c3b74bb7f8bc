// gpt/backend_cuda.cc — the CUDA backend (backend.h): the model's steps as cuBLAS GEMMs (bf16
// inputs, fp32 accumulation) and the CUDA row kernels (kernels_cuda.h), over activations in one
// device allocation laid out by backend_layout.h. Host C++ (compiled only in a CUDA build): it
// launches kernels through kernels_cuda.h and owns no kernels itself. The step bodies mirror
// Model::forward / Model::backward (model.cc) line for line, so the CPU backend is its twin.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <fmt/format.h>

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "gpt/backend.h"
#include "gpt/backend_layout.h"
#include "gpt/cublas_loader.h"
#include "gpt/kernels_cuda.h"
#include "tiermem/error.h"

namespace tiermem::gpt {
namespace {

void cuda_check(cudaError_t rc, const char* what, int line) {
  if (rc != cudaSuccess) {
    throw CudaError(fmt::format("{}: {} (backend_cuda.cc:{})", what, cudaGetErrorString(rc), line));
  }
}
#define TM_BACKEND_CUDA(expr) cuda_check((expr), #expr, __LINE__)

bool is_device_memory(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();  // an unregistered host pointer on old runtimes
    return false;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

class CudaBackend final : public ModelBackend {
 public:
  CudaBackend(const GptConfig& cfg, int batch_size, int seq_len)
      : cfg_(cfg), B_(batch_size), T_(seq_len == 0 ? cfg.seq_len : seq_len),
        checker_(cfg, batch_size, seq_len),  // validates sizes and step order, as the CPU does
        layout_(cfg, batch_size, T_, 0) {
    int dev = 0;
    TM_BACKEND_CUDA(cudaGetDevice(&dev));
    cudaDeviceProp prop{};
    TM_BACKEND_CUDA(cudaGetDeviceProperties(&prop, dev));
    name_ = fmt::format("cuda:{} ({})", dev, prop.name);
    const cudaError_t rc = cudaMalloc(&base_, layout_.bytes);
    if (rc != cudaSuccess) {
      cudaGetLastError();
      throw CudaError(fmt::format("the CUDA model backend cannot allocate its {} bytes of "
                                  "activations and workspace on {}: {} (a smaller --batch or "
                                  "--seq-len needs less)",
                                  layout_.bytes, name_, cudaGetErrorString(rc)));
    }
    layout_ = CudaBackendLayout(cfg, batch_size, T_, reinterpret_cast<std::uintptr_t>(base_));
    try {
      TM_BACKEND_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
      TM_BACKEND_CUDA(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking));
      for (int b = 0; b < 2; ++b) {
        TM_BACKEND_CUDA(cudaEventCreateWithFlags(&staged_[b], cudaEventDisableTiming));
        TM_BACKEND_CUDA(cudaEventCreateWithFlags(&consumed_[b], cudaEventDisableTiming));
        TM_BACKEND_CUDA(cudaEventRecord(consumed_[b], stream_));  // both buffers start free
      }
      if (cuda::cublas_api().create(&cublas_) != CUBLAS_STATUS_SUCCESS) {
        throw CudaError("cublasCreate failed (the CUDA backend's cuBLAS handle)");
      }
      if (cuda::cublas_api().set_stream(cublas_, stream_) != CUBLAS_STATUS_SUCCESS) {
        throw CudaError("cublasSetStream failed (the CUDA backend's compute stream)");
      }
    } catch (...) {
      if (cublas_) cuda::cublas_api().destroy(cublas_);
      destroy_events_and_streams();
      cudaFree(base_);
      throw;
    }
    losses_host_.resize(static_cast<std::size_t>(B_) * T_);
  }
  ~CudaBackend() override {
    cudaStreamSynchronize(stream_);
    cudaStreamSynchronize(copy_stream_);
    cuda::cublas_api().destroy(cublas_);  // loaded: the constructor used it
    destroy_events_and_streams();
    cudaFree(base_);
  }

  std::string name() const override { return name_; }
  const GptConfig& config() const override { return cfg_; }
  int batch_size() const override { return B_; }
  int seq_len() const override { return T_; }
  std::size_t activation_bytes() const override { return layout_.bytes; }
  bool on_device() const override { return true; }

  void set_batch(std::span<const std::int32_t> tokens,
                 std::span<const std::int32_t> targets) override {
    checker_.set_batch(tokens, targets);  // sizes and id ranges, with the CPU's messages
    TM_BACKEND_CUDA(cudaMemcpyAsync(layout_.tokens, tokens.data(), tokens.size_bytes(),
                                    cudaMemcpyHostToDevice, stream_));
    TM_BACKEND_CUDA(cudaMemcpyAsync(layout_.targets, targets.data(), targets.size_bytes(),
                                    cudaMemcpyHostToDevice, stream_));
    TM_BACKEND_CUDA(cudaStreamSynchronize(stream_));  // the caller may reuse its batch
    loss_valid_ = false;
  }

  void forward(const Step& s, ParamView params) override {
    check_order(s, /*backward=*/false);
    stage_params(s, params);
    const int B = B_, T = T_, C = cfg_.d_model, NH = cfg_.n_head, V = cfg_.vocab_size, N = B * T;
    const std::int64_t NC = static_cast<std::int64_t>(N) * C;
    const float* p = cur32_;
    const std::uint16_t* p16 = cur16_;
    std::uint16_t* in16 = layout_.in16;
    switch (s.kind) {
      case StepKind::kEmbed:
        cuda::encoder_forward(layout_.resid[0], layout_.tokens, p,
                              p + static_cast<std::int64_t>(V) * C, B, T, C, stream_);
        break;
      case StepKind::kBlock: {
        const BlockTensors<const float> w(p, C);
        const BlockTensors<const std::uint16_t> w16(p16, C);
        const CudaBackendLayout::Layer& a = layout_.layers[static_cast<std::size_t>(s.layer)];
        const float* x = layout_.resid[static_cast<std::size_t>(s.layer)];
        float* y = layout_.resid[static_cast<std::size_t>(s.layer) + 1];
        cuda::layernorm_forward(a.ln1, a.ln1_mean, a.ln1_rstd, x, w.ln1_w, w.ln1_b, N, C, stream_);
        linear(a.qkv, a.ln1, w16.qkv_w, w.qkv_b, N, C, 3 * C);
        cuda::attention_forward(a.atty, a.att, a.qkv, B, T, C, NH, stream_);
        linear(a.resid_mid, a.atty, w16.proj_w, w.proj_b, N, C, C);
        cuda::residual_forward(a.resid_mid, a.resid_mid, x, NC, stream_);
        cuda::layernorm_forward(a.ln2, a.ln2_mean, a.ln2_rstd, a.resid_mid, w.ln2_w, w.ln2_b, N, C,
                                stream_);
        linear(a.fch, a.ln2, w16.fc_w, w.fc_b, N, C, 4 * C);
        cuda::gelu_forward(a.fch_gelu, a.fch, 4 * NC, stream_);
        linear(y, a.fch_gelu, w16.fc_proj_w, w.fc_proj_b, N, 4 * C, C);
        cuda::residual_forward(y, y, a.resid_mid, NC, stream_);
        break;
      }
      case StepKind::kFinalNorm:
        cuda::layernorm_forward(layout_.lnf, layout_.lnf_mean, layout_.lnf_rstd,
                                layout_.resid[static_cast<std::size_t>(cfg_.n_layer)], p, p + C, N,
                                C, stream_);
        break;
      case StepKind::kHead:
        cuda::cast_f32_to_bf16(in16, layout_.lnf, NC, stream_);
        cuda::matmul_forward(cublas_, layout_.probs, in16, p16, nullptr, N, C, V, stream_);
        cuda::crossentropy_forward(layout_.probs, layout_.losses, layout_.targets, N, V, stream_);
        loss_valid_ = false;
        break;
    }
    // Not synchronised: the step's kernels read only the staged copy of the parameters (waited
    // for in stage_params), so the engine may release them and fetch the next module's while
    // this step computes; the next module is staged into the other buffer meanwhile.
    release_staging();
  }

  float loss() override {
    if (!loss_valid_) {
      TM_BACKEND_CUDA(cudaMemcpyAsync(losses_host_.data(), layout_.losses,
                                      losses_host_.size() * sizeof(float), cudaMemcpyDeviceToHost,
                                      stream_));
      TM_BACKEND_CUDA(cudaStreamSynchronize(stream_));
      double sum = 0;  // in double, as the CPU's crossentropy_forward
      for (float l : losses_host_) sum += l;
      loss_ = static_cast<float>(sum / static_cast<double>(losses_host_.size()));
      loss_valid_ = true;
    }
    return loss_;
  }

  void backward(const Step& s, ParamView params, std::span<float> grads) override {
    check_order(s, /*backward=*/true);
    const std::size_t need = static_cast<std::size_t>(module_layout(cfg_, s.module).numel);
    if (grads.size() != need) {
      throw Error(fmt::format("gpt backward {}: module {} gradient must have {} elements, got {}",
                              step_name(s), s.module, need, grads.size()));
    }
    const bool staged = s.kind != StepKind::kEmbed || params.numel() != 0;
    if (staged) stage_params(s, params);
    // The module's gradient so far (the tied embedding accumulates over two steps) comes in,
    // is accumulated on the device, and goes back out.
    float* g = layout_.grads;
    TM_BACKEND_CUDA(cudaMemcpyAsync(g, grads.data(), grads.size_bytes(), cudaMemcpyHostToDevice,
                                    stream_));
    const int B = B_, T = T_, C = cfg_.d_model, NH = cfg_.n_head, V = cfg_.vocab_size, N = B * T;
    const std::int64_t NC = static_cast<std::int64_t>(N) * C;
    const CudaBackendLayout& L = layout_;
    switch (s.kind) {
      case StepKind::kHead:
        cuda::crossentropy_backward(L.probs, L.targets, N, V, 1.0f / static_cast<float>(N),
                                    stream_);
        linear_backward(L.d_ln, g, nullptr, L.probs, L.lnf, cur16_, N, C, V);
        break;
      case StepKind::kFinalNorm:
        TM_BACKEND_CUDA(cudaMemsetAsync(L.d_resid, 0, NC * sizeof(float), stream_));
        cuda::layernorm_backward(L.d_resid, g, g + C, L.d_ln,
                                 L.resid[static_cast<std::size_t>(cfg_.n_layer)], cur32_,
                                 L.lnf_mean, L.lnf_rstd, N, C, stream_);
        break;
      case StepKind::kBlock: {
        const BlockTensors<const float> w(cur32_, C);
        const BlockTensors<const std::uint16_t> w16(cur16_, C);
        const BlockTensors<float> dw(g, C);
        const CudaBackendLayout::Layer& a = L.layers[static_cast<std::size_t>(s.layer)];
        copy(L.d_resid_mid, L.d_resid, NC);
        linear_backward(L.d_fch_gelu, dw.fc_proj_w, dw.fc_proj_b, L.d_resid, a.fch_gelu,
                        w16.fc_proj_w, N, 4 * C, C);
        cuda::gelu_backward(L.d_fch, a.fch, L.d_fch_gelu, 4 * NC, stream_);
        linear_backward(L.d_ln, dw.fc_w, dw.fc_b, L.d_fch, a.ln2, w16.fc_w, N, C, 4 * C);
        cuda::layernorm_backward(L.d_resid_mid, dw.ln2_w, dw.ln2_b, L.d_ln, a.resid_mid, w.ln2_w,
                                 a.ln2_mean, a.ln2_rstd, N, C, stream_);
        copy(L.d_resid, L.d_resid_mid, NC);
        linear_backward(L.d_atty, dw.proj_w, dw.proj_b, L.d_resid_mid, a.atty, w16.proj_w, N, C,
                        C);
        cuda::attention_backward(L.d_qkv, L.d_att, L.d_atty, a.qkv, a.att, B, T, C, NH, stream_);
        linear_backward(L.d_ln, dw.qkv_w, dw.qkv_b, L.d_qkv, a.ln1, w16.qkv_w, N, C, 3 * C);
        cuda::layernorm_backward(L.d_resid, dw.ln1_w, dw.ln1_b, L.d_ln,
                                 L.resid[static_cast<std::size_t>(s.layer)], w.ln1_w, a.ln1_mean,
                                 a.ln1_rstd, N, C, stream_);
        break;
      }
      case StepKind::kEmbed:
        cuda::encoder_backward(g, g + static_cast<std::int64_t>(V) * C, L.d_resid, L.tokens, B, T,
                               C, stream_);
        break;
    }
    if (staged) release_staging();
    TM_BACKEND_CUDA(cudaMemcpyAsync(grads.data(), g, grads.size_bytes(), cudaMemcpyDeviceToHost,
                                    stream_));
    TM_BACKEND_CUDA(cudaStreamSynchronize(stream_));
  }

 private:
  // The CPU twin's checks (Model's constructor, set_batch and check_step): the same sizes, ids
  // and step order are refused with the same messages, without allocating host activations.
  struct OrderCheck {
    GptConfig cfg;
    int B, T;
    int next_forward = 0, next_backward = -1;
    OrderCheck(const GptConfig& c, int b, int t) : cfg(c), B(b), T(t == 0 ? c.seq_len : t) {
      cfg.validate();
      if (B <= 0) throw ConfigError("gpt.batch_size", std::to_string(B), "must be > 0");
      if (T <= 0 || T > cfg.seq_len) {
        throw ConfigError("gpt.seq_len", std::to_string(T),
                          fmt::format("micro-batch sequence length must be in [1, {}]", cfg.seq_len));
      }
    }
    void set_batch(std::span<const std::int32_t> tokens, std::span<const std::int32_t> targets) {
      const std::size_t N = static_cast<std::size_t>(B) * T;
      if (tokens.size() != N || targets.size() != N) {
        throw Error(fmt::format("gpt set_batch: tokens and targets must have batch_size*seq_len = "
                                "{}*{} = {} ids, got {} and {}",
                                B, T, N, tokens.size(), targets.size()));
      }
      for (std::size_t i = 0; i < N; ++i) {
        for (auto [what, v] : {std::pair{"token", tokens[i]}, std::pair{"target", targets[i]}}) {
          if (v < 0 || v >= cfg.vocab_size) {
            throw Error(fmt::format("gpt set_batch: {} at position {} is {}, outside [0, {})",
                                    what, i, v, cfg.vocab_size));
          }
        }
      }
      next_forward = 0;
      next_backward = -1;
    }
  };

  void check_order(const Step& s, bool backward) {
    OrderCheck& c = checker_;
    if (!backward && s.kind == StepKind::kEmbed) {
      c.next_forward = 1;
      c.next_backward = -1;
      return;
    }
    const std::vector<Step> order = backward ? backward_steps(cfg_) : forward_steps(cfg_);
    const int i = backward ? c.next_backward : c.next_forward;
    if (i < 0 || i >= static_cast<int>(order.size()) || order[i].kind != s.kind ||
        order[i].layer != s.layer || order[i].module != s.module) {
      throw Error(fmt::format("gpt {}: step {} (module {}) out of order", backward ? "backward" : "forward",
                              step_name(s), s.module));
    }
    if (backward) {
      c.next_backward = i + 1 >= static_cast<int>(order.size()) ? -1 : i + 1;
    } else if (s.kind == StepKind::kHead) {
      c.next_forward = 0;
      c.next_backward = 0;
    } else {
      c.next_forward = i + 1;
    }
  }

  // The module's parameters as fp32 and bf16 in device memory, in staging buffer `buf_`: copied
  // (host -> device, or device -> device) and cast on the copy stream, after the compute that
  // last read that buffer (consumed_), so module i+1 is staged while module i computes. Returns
  // once the copy is done (the caller may then release its buffer); the compute stream waits
  // for it on the device (staged_).
  void stage_params(const Step& s, ParamView params) {
    const std::size_t need = static_cast<std::size_t>(module_layout(cfg_, s.module).numel);
    if (params.numel() != need) {
      throw Error(fmt::format("gpt step {}: module {} parameters must have {} elements, got {}",
                              step_name(s), s.module, need, params.numel()));
    }
    const std::int64_t n = static_cast<std::int64_t>(need);
    buf_ ^= 1;
    float* p32 = layout_.params32[buf_];
    std::uint16_t* p16 = layout_.params16[buf_];
    TM_BACKEND_CUDA(cudaStreamWaitEvent(copy_stream_, consumed_[buf_], 0));
    if (params.dtype() == DType::kF32) {
      const float* src = params.f32().data();
      TM_BACKEND_CUDA(cudaMemcpyAsync(p32, src, need * sizeof(float),
                                      is_device_memory(src) ? cudaMemcpyDeviceToDevice
                                                            : cudaMemcpyHostToDevice,
                                      copy_stream_));
      cuda::cast_f32_to_bf16(p16, p32, n, copy_stream_);
    } else {
      const std::uint16_t* src = params.bf16_bits().data();
      TM_BACKEND_CUDA(cudaMemcpyAsync(p16, src, need * sizeof(std::uint16_t),
                                      is_device_memory(src) ? cudaMemcpyDeviceToDevice
                                                            : cudaMemcpyHostToDevice,
                                      copy_stream_));
      cuda::cast_bf16_to_f32(p32, p16, n, copy_stream_);
    }
    TM_BACKEND_CUDA(cudaEventRecord(staged_[buf_], copy_stream_));
    TM_BACKEND_CUDA(cudaEventSynchronize(staged_[buf_]));
    TM_BACKEND_CUDA(cudaStreamWaitEvent(stream_, staged_[buf_], 0));
    cur32_ = p32;
    cur16_ = p16;
  }
  // The kernels enqueued so far are the last readers of the current staging buffer.
  void release_staging() { TM_BACKEND_CUDA(cudaEventRecord(consumed_[buf_], stream_)); }

  void destroy_events_and_streams() noexcept {
    for (int b = 0; b < 2; ++b) {
      if (staged_[b]) cudaEventDestroy(staged_[b]);
      if (consumed_[b]) cudaEventDestroy(consumed_[b]);
    }
    if (copy_stream_) cudaStreamDestroy(copy_stream_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  // out[N, OC] = inp[N, C]·wᵀ + bias, with inp cast to bf16 first.
  void linear(float* out, const float* inp, const std::uint16_t* w16, const float* bias, int N,
              int C, int OC) {
    cuda::cast_f32_to_bf16(layout_.in16, inp, static_cast<std::int64_t>(N) * C, stream_);
    cuda::matmul_forward(cublas_, out, layout_.in16, w16, bias, N, C, OC, stream_);
  }
  void linear_backward(float* dinp, float* dw, float* dbias, const float* dout, const float* inp,
                       const std::uint16_t* w16, int N, int C, int OC) {
    cuda::cast_f32_to_bf16(layout_.out16, dout, static_cast<std::int64_t>(N) * OC, stream_);
    cuda::cast_f32_to_bf16(layout_.in16, inp, static_cast<std::int64_t>(N) * C, stream_);
    cuda::matmul_backward(cublas_, dinp, dw, dbias, layout_.out16, dout, layout_.in16, w16, N, C,
                          OC, stream_);
  }
  void copy(float* dst, const float* src, std::int64_t n) {
    TM_BACKEND_CUDA(cudaMemcpyAsync(dst, src, static_cast<std::size_t>(n) * sizeof(float),
                                    cudaMemcpyDeviceToDevice, stream_));
  }

  GptConfig cfg_;
  int B_, T_;
  OrderCheck checker_;
  CudaBackendLayout layout_;
  std::string name_;
  void* base_ = nullptr;
  cudaStream_t stream_ = nullptr;       // the model's kernels, the gradient copies
  cudaStream_t copy_stream_ = nullptr;  // parameter staging
  cudaEvent_t staged_[2] = {};          // staging buffer b holds the next module's parameters
  cudaEvent_t consumed_[2] = {};        // the last kernel reading staging buffer b is done
  int buf_ = 1;                         // the staging buffer in use (the first stage takes 0)
  const float* cur32_ = nullptr;        // the current module's parameters, fp32 and bf16
  const std::uint16_t* cur16_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  std::vector<float> losses_host_;
  float loss_ = 0;
  bool loss_valid_ = false;
};

}  // namespace

std::unique_ptr<ModelBackend> make_cuda_backend(const GptConfig& cfg, int batch_size,
                                                int seq_len, int ordinal) {
  if (ordinal >= 0) TM_BACKEND_CUDA(cudaSetDevice(ordinal));
  return std::make_unique<CudaBackend>(cfg, batch_size, seq_len);
}

}  // namespace tiermem::gpt
