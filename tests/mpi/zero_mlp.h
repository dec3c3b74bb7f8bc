// tests/mpi/zero_mlp.h — a tiny deterministic MLP driven through ZeroEngine the way the GPT
// trainer drives it, and the same model trained by plain single-process fp32 AdamW (the
// reference). Shared by tests/unit/zero_engine_test.cc (one rank) and tests/mpi (1-4 ranks).
//
// Model: y = W2 · tanh(W1 · x + b1) + b2, loss = mean over samples of 0.5·|y − t|².
// Modules: 0 = [W1 (16×8), b1 (16)] (144 elements), 1 = [W2 (4×16), b2 (4)] (68 elements).
// Data: 24 fixed samples; every step uses all 24 (the global batch), split evenly over ranks and
// then over micro-batches, so the mean gradient equals the reference's.
#pragma once

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "tiermem/adam.h"
#include "tiermem/communicator.h"
#include "tiermem/config.h"
#include "tiermem/device.h"
#include "tiermem/zero_engine.h"

namespace tiermem::testing {

// Deterministic per-(module, step, element) gradient in [-0.5, 0.5).
inline float synthetic_grad(std::size_t m, int step, std::size_t i) {
  std::uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ (m << 40) ^ (static_cast<std::uint64_t>(step) << 52);
  x ^= x >> 29;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 32;
  return static_cast<float>(x & 0xFFFF) / 65536.0f - 0.5f;
}


constexpr int kIn = 8, kHidden = 16, kOut = 4, kSamples = 24;

struct MlpData {
  std::vector<float> x, t;  // [kSamples][kIn], [kSamples][kOut]
};

inline MlpData mlp_data() {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  MlpData D;
  for (int i = 0; i < kSamples * kIn; ++i) D.x.push_back(d(rng));
  for (int i = 0; i < kSamples * kOut; ++i) D.t.push_back(d(rng));
  return D;
}

inline std::vector<std::vector<float>> mlp_init() {
  std::mt19937 rng(3);
  std::normal_distribution<float> d(0.0f, 0.3f);
  std::vector<std::vector<float>> p(2);
  p[0].resize(kHidden * kIn + kHidden);
  p[1].resize(kOut * kHidden + kOut);
  for (auto& m : p)
    for (auto& x : m) x = d(rng);
  return p;
}

// Mean loss over samples [s0, s1) and its gradient (fp32, overwritten) for both modules.
inline float mlp_forward_backward(const MlpData& D, const float* p0, const float* p1, int s0, int s1,
                                  std::vector<float>& g0, std::vector<float>& g1) {
  g0.assign(kHidden * kIn + kHidden, 0.0f);
  g1.assign(kOut * kHidden + kOut, 0.0f);
  const float *W1 = p0, *b1 = p0 + kHidden * kIn, *W2 = p1, *b2 = p1 + kOut * kHidden;
  const float inv = 1.0f / static_cast<float>(s1 - s0);
  float loss = 0;
  for (int s = s0; s < s1; ++s) {
    const float* x = &D.x[s * kIn];
    const float* t = &D.t[s * kOut];
    float h[kHidden], y[kOut], dy[kOut], dh[kHidden];
    for (int j = 0; j < kHidden; ++j) {
      float a = b1[j];
      for (int i = 0; i < kIn; ++i) a += W1[j * kIn + i] * x[i];
      h[j] = std::tanh(a);
    }
    for (int k = 0; k < kOut; ++k) {
      float a = b2[k];
      for (int j = 0; j < kHidden; ++j) a += W2[k * kHidden + j] * h[j];
      y[k] = a;
      dy[k] = (y[k] - t[k]) * inv;
      loss += 0.5f * (y[k] - t[k]) * (y[k] - t[k]) * inv;
    }
    for (int j = 0; j < kHidden; ++j) {
      float a = 0;
      for (int k = 0; k < kOut; ++k) {
        a += W2[k * kHidden + j] * dy[k];
        g1[k * kHidden + j] += dy[k] * h[j];
      }
      dh[j] = a * (1.0f - h[j] * h[j]);
    }
    for (int k = 0; k < kOut; ++k) g1[kOut * kHidden + k] += dy[k];
    for (int j = 0; j < kHidden; ++j) {
      for (int i = 0; i < kIn; ++i) g0[j * kIn + i] += dh[j] * x[i];
      g0[kHidden * kIn + j] += dh[j];
    }
  }
  return loss;
}

// The reference: one process, fp32, full batch, scalar AdamW with the config's hyper-parameters.
inline std::vector<std::vector<float>> mlp_reference(const Config& cfg, int steps) {
  MlpData D = mlp_data();
  auto p = mlp_init();
  std::vector<std::vector<float>> m(2), v(2);
  for (int i = 0; i < 2; ++i) {
    m[i].assign(p[i].size(), 0.0f);
    v[i].assign(p[i].size(), 0.0f);
  }
  std::vector<float> g0, g1;
  for (int s = 1; s <= steps; ++s) {
    mlp_forward_backward(D, p[0].data(), p[1].data(), 0, kSamples, g0, g1);
    AdamParams a;
    a.lr = static_cast<float>(cfg.optimizer.lr);
    a.beta1 = static_cast<float>(cfg.optimizer.beta1);
    a.beta2 = static_cast<float>(cfg.optimizer.beta2);
    a.eps = static_cast<float>(cfg.optimizer.eps);
    a.weight_decay = static_cast<float>(cfg.optimizer.weight_decay);
    a.step = s;
    std::vector<float>* g[2] = {&g0, &g1};
    for (int i = 0; i < 2; ++i) {
      adam_step(a, p[i].data(), g[i]->data(), m[i].data(), v[i].data(), p[i].size(), nullptr, DType::kBF16,
                {AdamIsa::kScalar, 1});
    }
  }
  return p;
}

inline std::vector<float> to_f32(const ZeroEngine::Gathered& g) {
  if (g.dtype() == DType::kF32) return {g.f32().begin(), g.f32().end()};
  std::vector<float> out;
  for (std::uint16_t h : g.half()) out.push_back(g.dtype() == DType::kBF16 ? bf16_to_f32(h) : f16_to_f32(h));
  return out;
}

// The gathered params as fp32 host values wherever they are: device memory the CPU may not
// address (engine.device()->host_addressable() false) is copied down with the device's copy API,
// as a GPU model backend would read it (a CPU read of it would fault).
inline std::vector<float> to_f32_host(const ZeroEngine& engine, const ZeroEngine::Gathered& g) {
  Device* dev = engine.device();
  if (!g.on_device() || dev == nullptr || dev->host_addressable()) return to_f32(g);
  std::vector<std::uint16_t> half(g.dtype() == DType::kF32 ? 0 : g.numel());
  std::vector<float> out(g.numel());
  void* dst = g.dtype() == DType::kF32 ? static_cast<void*>(out.data()) : static_cast<void*>(half.data());
  dev->copy_d2h(dst, g.data(), g.numel() * dtype_size(g.dtype()));
  for (std::size_t i = 0; i < half.size(); ++i) {
    out[i] = g.dtype() == DType::kBF16 ? bf16_to_f32(half[i]) : f16_to_f32(half[i]);
  }
  return out;
}

// Hands a host gradient to the engine from device memory, as a GPU model backend would: copied
// up into a buffer of the engine's device, then reduce_gradients_from_device.
inline void reduce_from_device(ZeroEngine& engine, int module, const std::vector<float>& grad) {
  Device* dev = engine.device();
  void* d = dev->allocate(grad.size() * sizeof(float));
  dev->copy_h2d(d, grad.data(), grad.size() * sizeof(float));
  engine.reduce_gradients_from_device(module, static_cast<const float*>(d), grad.size());
  dev->free(d);
}

// Runs `steps` more training steps of the MLP through an engine whose two modules are
// registered (the same data every step). `micro` micro-batches per step (kSamples must divide by
// world × micro). Gathered params are read through to_f32_host; with `device_grads` (and an
// engine with a device tier) gradients are handed over from device memory.
// With `prefetch`, module 1's all-gather is started (prefetch_gather) before module 0's gather,
// and a prefetch that no gather takes (module 0, after the backward) is left for step() to drop.
// `phase`: of the gathers (Phase::kForward lets a deferred update run ahead: UpdateScheduler::start_ahead).
inline void mlp_train_steps(ZeroEngine& engine, Communicator& comm, int steps, int micro,
                            bool device_grads = false, bool prefetch = false, Phase phase = Phase::kOther) {
  MlpData D = mlp_data();
  const int per_rank = kSamples / comm.world_size();
  const int per_micro = per_rank / micro;
  std::vector<float> g0, g1;
  for (int s = 0; s < steps; ++s) {
    for (int mb = 0; mb < micro; ++mb) {
      const int s0 = comm.rank() * per_rank + mb * per_micro;
      std::vector<float> p0, p1;
      {  // forward + backward of both modules inside their gather scopes
        if (prefetch) engine.prefetch_gather(1, Phase::kForward);
        auto a = engine.gather(0, phase);
        auto b = engine.gather(1, phase);
        p0 = to_f32_host(engine, a);
        p1 = to_f32_host(engine, b);
      }
      mlp_forward_backward(D, p0.data(), p1.data(), s0, s0 + per_micro, g0, g1);
      const float scale = static_cast<float>(engine.loss_scale());
      if (scale != 1.0f) {
        for (auto& x : g0) x *= scale;
        for (auto& x : g1) x *= scale;
      }
      if (device_grads && engine.device() != nullptr) {
        reduce_from_device(engine, 1, g1);
        reduce_from_device(engine, 0, g0);
      } else {
        // Backward order: last module first. The first is handed over (one rank, stages 2-3:
        // accumulated on the engine's thread), the second copied: both forms, and their mix.
        engine.reduce_gradients(1, std::vector<float>(g1));
        engine.reduce_gradients(0, g0);
      }
      if (prefetch && mb + 1 == micro) engine.prefetch_gather(0, Phase::kForward);  // never taken
    }
    engine.step();
  }
}

// Registers the MLP's modules, trains it for `steps` steps through the engine (see
// mlp_train_steps); returns the exported fp32 masters.
inline std::vector<std::vector<float>> mlp_train_engine(ZeroEngine& engine, Communicator& comm, int steps, int micro,
                                                       bool device_grads = false, bool prefetch = false) {
  auto init = mlp_init();
  engine.register_module("fc1", init[0]);
  engine.register_module("fc2", init[1]);
  mlp_train_steps(engine, comm, steps, micro, device_grads, prefetch);
  return {engine.export_master(0), engine.export_master(1)};
}

// A config for the matrix: stage × optimizer offload, small sub-groups and buckets so every
// path (several sub-groups, several buckets) runs.
inline Config mlp_config(int stage, const std::string& offload, const std::string& nvme_dir, int micro,
                         const std::string& extra = "") {
  std::string j = R"({"gradient_accumulation_steps": )" + std::to_string(micro) +
                  R"(, "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
      "tiermem": {"o_direct": false, "swap_initial_bytes": "1MiB", "host_budget_bytes": "16MiB"},
      "zero_optimization": {"stage": )" + std::to_string(stage) +
                  R"(, "sub_group_size": 1024, "reduce_bucket_size": 2048, "overlap_comm": )" +
                  (stage == 2 ? "true" : "false") + R"(, "stage3_param_persistence_threshold": 100)";
  if (offload != "none") {
    j += R"(, "offload_optimizer": {"device": ")" + offload + R"(", "buffer_count": 2)";
    if (offload == "nvme") j += R"(, "nvme_path": ")" + nvme_dir + R"(")";
    j += "}";
  }
  j += "}" + extra + "}";
  return parse_config(j);
}

// The same config on a SimDevice whose memory is not host-addressable (tiermem.device sim,
// sim_host_addressable false): the CPU twin of a CudaDevice.
inline Config on_opaque_device(Config cfg) {
  cfg.tiermem.device = "sim";
  cfg.tiermem.sim_host_addressable = false;
  return cfg;
}

// The same config with stage-3 parameter offload: offload_param.device = `param` ("none", "cpu"
// or "nvme"; nvme under nvme_dir) and small pipeline chunks (64 KiB, 2 in flight).
inline Config with_param_offload(Config cfg, const std::string& param, const std::string& nvme_dir) {
  cfg.zero.offload_param.device = param == "nvme" ? OffloadDevice::kNvme
                                  : param == "cpu" ? OffloadDevice::kCpu
                                                   : OffloadDevice::kNone;
  if (param == "nvme") cfg.zero.offload_param.nvme_path = {nvme_dir};
  cfg.tiermem.pipeline_chunk_bytes = 64 << 10;
  cfg.tiermem.pipeline_chunks = 2;
  return cfg;
}

}  // namespace tiermem::testing
