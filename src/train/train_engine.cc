// src/train/train_engine.cc — ResidentEngine and the shared AdamW update (train_engine.h).
#include "train/train_engine.h"

#include <chrono>
#include <cstring>
#include <fmt/format.h>

#include "tiermem/adam.h"
#include "tiermem/checkpoint.h"

namespace tiermem::train {

void adamw_update(const OptimStep& s, float* param, const float* grad, float* m, float* v,
                  std::size_t n) {
  AdamParams p;
  p.lr = s.lr;
  p.beta1 = s.beta1;
  p.beta2 = s.beta2;
  p.eps = s.eps;
  p.weight_decay = s.weight_decay;
  p.step = s.t;
  p.grad_scale = s.grad_scale;
  adam_step(p, param, grad, m, v, n);
}

ResidentEngine::ResidentEngine(const gpt::GptConfig& cfg, std::uint64_t seed) : cfg_(cfg) {
  params_ = gpt::init_params(cfg, seed);
  for (const auto& p : params_) {
    grads_.emplace_back(p.size(), 0.0f);
    m_.emplace_back(p.size(), 0.0f);
    v_.emplace_back(p.size(), 0.0f);
  }
}

std::string ResidentEngine::describe() const {
  return "all resident: fp32 parameters, gradients and AdamW state in host memory";
}

std::uint64_t ResidentEngine::param_bytes() const {
  return static_cast<std::uint64_t>(gpt::num_params(cfg_)) * 4;
}
std::uint64_t ResidentEngine::optimizer_bytes() const { return 2 * param_bytes(); }

gpt::ParamView ResidentEngine::acquire_params(int module, Phase) {
  return gpt::ParamView(params_.at(static_cast<std::size_t>(module)));
}

std::span<float> ResidentEngine::grads(int module) {
  return grads_.at(static_cast<std::size_t>(module));
}

void ResidentEngine::zero_grad() {
  for (auto& g : grads_) std::memset(g.data(), 0, g.size() * sizeof(float));
}

void ResidentEngine::step(const OptimStep& s) {
  auto t0 = std::chrono::steady_clock::now();
  for (std::size_t i = 0; i < params_.size(); ++i)
    adamw_update(s, params_[i].data(), grads_[i].data(), m_[i].data(), v_[i].data(),
                 params_[i].size());
  optimizer_seconds_ +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void ResidentEngine::save(CheckpointWriter& w) {
  auto layouts = gpt::module_layouts(cfg_);
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const std::string& n = layouts[i].name;
    const std::int64_t numel = layouts[i].numel;
    w.add_tensor(n + ".param", Tier::kHost, params_[i].data(), params_[i].size() * 4, "f32",
                 {numel});
    w.add_tensor(n + ".adam_m", Tier::kHost, m_[i].data(), m_[i].size() * 4, "f32", {numel});
    w.add_tensor(n + ".adam_v", Tier::kHost, v_[i].data(), v_[i].size() * 4, "f32", {numel});
  }
}

void ResidentEngine::load(CheckpointReader& r) {
  auto layouts = gpt::module_layouts(cfg_);
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const std::string& n = layouts[i].name;
    r.read_tensor(n + ".param", params_[i].data(), params_[i].size() * 4);
    r.read_tensor(n + ".adam_m", m_[i].data(), m_[i].size() * 4);
    r.read_tensor(n + ".adam_v", v_[i].data(), v_[i].size() * 4);
  }
}

EngineStats ResidentEngine::stats() const {
  EngineStats s;
  s.peak_bytes[static_cast<int>(Tier::kHost)] = param_bytes() * 4;  // params, grads, m, v
  s.optimizer_seconds = optimizer_seconds_;
  return s;
}

}  // namespace tiermem::train
