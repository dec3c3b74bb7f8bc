// gpt/model.cc — GptConfig, the per-module parameter layout, GPT-2 init, and the Model's steps.
#include "gpt/model.h"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <string>

#include <fmt/format.h>

#include "gpt/kernels_cpu.h"
#include "tiermem/error.h"

namespace tiermem::gpt {

// ---------------------------------------------------------------------------------------------
// GptConfig

void GptConfig::validate() const {
  auto positive = [](const char* key, int v) {
    if (v <= 0) throw ConfigError(fmt::format("gpt.{}", key), std::to_string(v), "must be > 0");
  };
  positive("n_layer", n_layer);
  positive("n_head", n_head);
  positive("d_model", d_model);
  positive("seq_len", seq_len);
  positive("vocab_size", vocab_size);
  if (d_model % n_head != 0) {
    throw ConfigError("gpt.d_model", std::to_string(d_model),
                      fmt::format("must be divisible by n_head ({})", n_head));
  }
}

namespace {
struct Named {
  const char* name;
  GptConfig cfg;
};
const Named kNamed[] = {
    {"tiny", {2, 2, 32, 16, 64}},
    {"mini", {4, 4, 256, 128, 256}},
    {"gpt2", {12, 12, 768, 1024, 50257}},
    {"gpt2-medium", {24, 16, 1024, 1024, 50257}},
    {"gpt2-large", {36, 20, 1280, 1024, 50257}},
    {"gpt2-xl", {48, 25, 1600, 1024, 50257}},
};
}  // namespace

GptConfig GptConfig::named(std::string_view name) {
  for (const auto& n : kNamed) {
    if (name == n.name) return n.cfg;
  }
  std::string all;
  for (const auto& n : kNamed) all += (all.empty() ? "" : ", ") + std::string(n.name);
  throw ConfigError("gpt.model", std::string(name), "unknown model; one of: " + all);
}

std::vector<std::string> GptConfig::names() {
  std::vector<std::string> v;
  for (const auto& n : kNamed) v.emplace_back(n.name);
  return v;
}

std::string GptConfig::describe(std::string_view name) const {
  return fmt::format("{}: {} layers, {} heads, d_model {}, seq_len {}, vocab {}, {:.2f} M params",
                     name, n_layer, n_head, d_model, seq_len, vocab_size,
                     static_cast<double>(num_params(*this)) / 1e6);
}

// ---------------------------------------------------------------------------------------------
// Layout

int num_modules(const GptConfig& cfg) { return cfg.n_layer + 2; }

ModuleLayout module_layout(const GptConfig& cfg, int module) {
  cfg.validate();
  if (module < 0 || module >= num_modules(cfg)) {
    throw Error(fmt::format("gpt: module {} out of range [0, {})", module, num_modules(cfg)));
  }
  const std::int64_t C = cfg.d_model, V = cfg.vocab_size, T = cfg.seq_len;
  ModuleLayout m;
  m.index = module;
  auto add = [&m](const char* name, std::vector<std::int64_t> shape) {
    ParamTensor t;
    t.name = name;
    t.numel = 1;
    for (auto d : shape) t.numel *= d;
    t.shape = std::move(shape);
    t.offset = m.numel;
    m.numel += t.numel;
    m.tensors.push_back(std::move(t));
  };
  if (module == 0) {
    m.name = "embed";
    add("wte", {V, C});
    add("wpe", {T, C});
  } else if (module <= cfg.n_layer) {
    m.name = fmt::format("block.{}", module - 1);
    add("ln1_w", {C});
    add("ln1_b", {C});
    add("qkv_w", {3 * C, C});
    add("qkv_b", {3 * C});
    add("proj_w", {C, C});
    add("proj_b", {C});
    add("ln2_w", {C});
    add("ln2_b", {C});
    add("fc_w", {4 * C, C});
    add("fc_b", {4 * C});
    add("fc_proj_w", {C, 4 * C});
    add("fc_proj_b", {C});
  } else {
    m.name = "ln_f";
    add("lnf_w", {C});
    add("lnf_b", {C});
  }
  return m;
}

std::vector<ModuleLayout> module_layouts(const GptConfig& cfg) {
  std::vector<ModuleLayout> v;
  for (int m = 0; m < num_modules(cfg); ++m) v.push_back(module_layout(cfg, m));
  return v;
}

std::int64_t num_params(const GptConfig& cfg) {
  std::int64_t n = 0;
  for (int m = 0; m < num_modules(cfg); ++m) n += module_layout(cfg, m).numel;
  return n;
}

double forward_flops_per_token(const GptConfig& cfg, int seq_len) {
  cfg.validate();
  const double T = seq_len > 0 ? seq_len : cfg.seq_len;
  const double C = cfg.d_model, L = cfg.n_layer, V = cfg.vocab_size;
  const double linear_macs = L * (3 * C * C + C * C + 4 * C * C + 4 * C * C) + V * C;
  const double attn_macs = L * 2 * T * C;  // q·k over T keys and att·v, per token
  return 2 * (linear_macs + attn_macs);
}

double flops_per_token(const GptConfig& cfg, int seq_len) {
  return 3 * forward_flops_per_token(cfg, seq_len);
}

// ---------------------------------------------------------------------------------------------
// Init

namespace {
std::uint64_t splitmix64(std::uint64_t& x) {
  std::uint64_t z = (x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
// Standard normal by Box-Muller over splitmix64: the same numbers on every platform.
struct Normal {
  std::uint64_t state;
  bool have = false;
  double spare = 0;
  double next() {
    if (have) {
      have = false;
      return spare;
    }
    double u1 = (static_cast<double>(splitmix64(state) >> 11) + 1.0) * 0x1.0p-53;  // (0, 1]
    double u2 = static_cast<double>(splitmix64(state) >> 11) * 0x1.0p-53;
    double r = std::sqrt(-2.0 * std::log(u1)), th = 2.0 * M_PI * u2;
    spare = r * std::sin(th);
    have = true;
    return r * std::cos(th);
  }
};
}  // namespace

void init_module(const GptConfig& cfg, int module, std::uint64_t seed, std::span<float> out) {
  ModuleLayout m = module_layout(cfg, module);
  if (static_cast<std::int64_t>(out.size()) != m.numel) {
    throw Error(fmt::format("gpt init: module {} ({}) needs {} elements, got {}", module, m.name,
                            m.numel, out.size()));
  }
  std::uint64_t s = seed ^ (0x5851f42d4c957f2dull * static_cast<std::uint64_t>(module + 1));
  Normal rng{splitmix64(s)};
  const double std_base = 0.02, std_resid = 0.02 / std::sqrt(2.0 * cfg.n_layer);
  for (const auto& t : m.tensors) {
    float* p = out.data() + t.offset;
    const std::string& n = t.name;
    const bool is_ln_w = n == "ln1_w" || n == "ln2_w" || n == "lnf_w";
    const bool is_bias = n.size() >= 2 && n.compare(n.size() - 2, 2, "_b") == 0;
    if (is_ln_w) {
      std::fill(p, p + t.numel, 1.0f);
    } else if (is_bias) {
      std::fill(p, p + t.numel, 0.0f);
    } else {
      const double sd = (n == "proj_w" || n == "fc_proj_w") ? std_resid : std_base;
      for (std::int64_t i = 0; i < t.numel; ++i) p[i] = static_cast<float>(sd * rng.next());
    }
  }
}

std::vector<std::vector<float>> init_params(const GptConfig& cfg, std::uint64_t seed) {
  std::vector<std::vector<float>> v(num_modules(cfg));
  for (int m = 0; m < num_modules(cfg); ++m) {
    v[m].resize(module_layout(cfg, m).numel);
    init_module(cfg, m, seed, v[m]);
  }
  return v;
}

// ---------------------------------------------------------------------------------------------
// Steps

std::vector<Step> forward_steps(const GptConfig& cfg) {
  std::vector<Step> v;
  v.push_back({StepKind::kEmbed, 0, -1});
  for (int l = 0; l < cfg.n_layer; ++l) v.push_back({StepKind::kBlock, l + 1, l});
  v.push_back({StepKind::kFinalNorm, cfg.n_layer + 1, -1});
  v.push_back({StepKind::kHead, 0, -1});
  return v;
}

std::vector<Step> backward_steps(const GptConfig& cfg) {
  std::vector<Step> v = forward_steps(cfg);
  std::reverse(v.begin(), v.end());
  return v;
}

std::string step_name(const Step& s) {
  switch (s.kind) {
    case StepKind::kEmbed: return "embed";
    case StepKind::kBlock: return fmt::format("block.{}", s.layer);
    case StepKind::kFinalNorm: return "ln_f";
    case StepKind::kHead: return "head";
  }
  return "?";
}

// ---------------------------------------------------------------------------------------------
// Model

std::uint64_t activation_bytes(const GptConfig& cfg, int batch_size, int seq_len, bool checkpoint_blocks) {
  // In long double (exact below 2^64) so that absurd sizes cannot wrap; the same sizes as the
  // constructor's vectors below (tests hold the two together).
  const long double N = static_cast<long double>(batch_size) * seq_len, C = cfg.d_model;
  const long double L = cfg.n_layer, V = cfg.vocab_size;
  const long double att = static_cast<long double>(batch_size) * cfg.n_head * seq_len * seq_len;
  const long double layers = checkpoint_blocks ? 1 : L;
  const long double floats = (L + 1) * N * C + layers * (15 * N * C + 4 * N + att) + 16 * N * C + 2 * N + N * V + att;
  const long double bytes = floats * sizeof(float);
  return bytes >= 18446744073709551615.0L ? UINT64_MAX : static_cast<std::uint64_t>(bytes);
}

namespace {

// Activations beyond the machine's physical memory are refused with a ConfigError before any is
// allocated: asking for them would end in std::bad_alloc or, with overcommit, in the kernel's OOM
// killer part-way through (a --d-model 1048576 run grew to 24 GB first).
void refuse_beyond_memory(const GptConfig& cfg, int batch_size, int seq_len, bool checkpoint_blocks) {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return;  // unknown: let the allocation decide
  const long double phys = static_cast<long double>(pages) * page;
  const long double bytes = activation_bytes(cfg, batch_size, seq_len, checkpoint_blocks);
  if (bytes <= phys) return;
  throw ConfigError("gpt.batch_size", std::to_string(batch_size),
                    fmt::format("the CPU model's activations for batch {} x seq {} (n_layer {}, d_model {}, vocab {}) "
                                "need {:.3g} GiB, more than this machine's {:.3g} GiB of memory: lower --batch or "
                                "--seq-len, add --activation-checkpointing, or choose a smaller model",
                                batch_size, seq_len, cfg.n_layer, cfg.d_model, cfg.vocab_size,
                                static_cast<double>(bytes / (1ull << 30)), static_cast<double>(phys / (1ull << 30))));
}

}  // namespace

Model::Model(const GptConfig& cfg, int batch_size, int seq_len, ModelOptions options)
    : cfg_(cfg), options_(options) {
  cfg_.validate();
  if (seq_len == 0) seq_len = cfg_.seq_len;
  if (batch_size <= 0) {
    throw ConfigError("gpt.batch_size", std::to_string(batch_size), "must be > 0");
  }
  if (seq_len <= 0 || seq_len > cfg_.seq_len) {
    throw ConfigError("gpt.seq_len", std::to_string(seq_len),
                      fmt::format("micro-batch sequence length must be in [1, {}]", cfg_.seq_len));
  }
  B_ = batch_size;
  T_ = seq_len;
  refuse_beyond_memory(cfg_, batch_size, seq_len, options_.checkpoint_blocks);
  const std::size_t N = static_cast<std::size_t>(B_) * T_, C = cfg_.d_model;
  const std::size_t NH = cfg_.n_head, V = cfg_.vocab_size, L = cfg_.n_layer;
  const std::size_t att = static_cast<std::size_t>(B_) * NH * T_ * T_;
  tokens_.resize(N);
  targets_.resize(N);
  resid_.assign(L + 1, std::vector<float>(N * C));
  layers_.resize(options_.checkpoint_blocks ? 1 : L);
  for (auto& l : layers_) {
    l.ln1.resize(N * C);
    l.ln1_mean.resize(N);
    l.ln1_rstd.resize(N);
    l.qkv.resize(N * 3 * C);
    l.att.resize(att);
    l.atty.resize(N * C);
    l.resid_mid.resize(N * C);
    l.ln2.resize(N * C);
    l.ln2_mean.resize(N);
    l.ln2_rstd.resize(N);
    l.fch.resize(N * 4 * C);
    l.fch_gelu.resize(N * 4 * C);
  }
  lnf_.resize(N * C);
  lnf_mean_.resize(N);
  lnf_rstd_.resize(N);
  probs_.resize(N * V);
  d_resid_.resize(N * C);
  d_resid_mid_.resize(N * C);
  d_ln_.resize(N * C);
  d_qkv_.resize(N * 3 * C);
  d_att_.resize(att);
  d_atty_.resize(N * C);
  d_fch_.resize(N * 4 * C);
  d_fch_gelu_.resize(N * 4 * C);
}

std::size_t Model::activation_bytes() const {
  std::size_t n = 0;
  auto add = [&n](const std::vector<float>& v) { n += v.size() * sizeof(float); };
  for (const auto& r : resid_) add(r);
  for (const auto& l : layers_) {
    for (const auto* v : {&l.ln1, &l.ln1_mean, &l.ln1_rstd, &l.qkv, &l.att, &l.atty, &l.resid_mid,
                          &l.ln2, &l.ln2_mean, &l.ln2_rstd, &l.fch, &l.fch_gelu}) {
      add(*v);
    }
  }
  for (const auto* v : {&lnf_, &lnf_mean_, &lnf_rstd_, &probs_, &d_resid_, &d_resid_mid_, &d_ln_,
                        &d_qkv_, &d_att_, &d_atty_, &d_fch_, &d_fch_gelu_}) {
    add(*v);
  }
  return n;
}

std::size_t Model::block_input_bytes() const {
  std::size_t n = 0;
  for (const auto& r : resid_) n += r.size() * sizeof(float);
  return n;
}

Model::Layer& Model::layer_activations(int layer) {
  return layers_[options_.checkpoint_blocks ? 0 : static_cast<std::size_t>(layer)];
}

void Model::set_batch(std::span<const std::int32_t> tokens, std::span<const std::int32_t> targets) {
  const std::size_t N = static_cast<std::size_t>(B_) * T_;
  if (tokens.size() != N || targets.size() != N) {
    throw Error(fmt::format("gpt set_batch: tokens and targets must have batch_size*seq_len = {}*{} "
                            "= {} ids, got {} and {}",
                            B_, T_, N, tokens.size(), targets.size()));
  }
  for (std::size_t i = 0; i < N; ++i) {
    for (auto [what, v] : {std::pair{"token", tokens[i]}, std::pair{"target", targets[i]}}) {
      if (v < 0 || v >= cfg_.vocab_size) {
        throw Error(fmt::format("gpt set_batch: {} at position {} is {}, outside [0, {})", what, i,
                                v, cfg_.vocab_size));
      }
    }
  }
  std::copy(tokens.begin(), tokens.end(), tokens_.begin());
  std::copy(targets.begin(), targets.end(), targets_.begin());
  next_forward_ = 0;
  next_backward_ = -1;
}

void Model::check_step(const Step& s, bool backward) {
  const std::vector<Step> order = backward ? backward_steps(cfg_) : forward_steps(cfg_);
  const int i = backward ? next_backward_ : next_forward_;
  // A forward pass may always restart at kEmbed (e.g. evaluation without backward).
  if (!backward && s.kind == StepKind::kEmbed) {
    next_forward_ = 0;
    next_backward_ = -1;
    return;
  }
  if (i < 0 || i >= static_cast<int>(order.size()) || order[i].kind != s.kind ||
      order[i].layer != s.layer || order[i].module != s.module) {
    throw Error(fmt::format("gpt {}: step {} (module {}) out of order; expected {}",
                            backward ? "backward" : "forward", step_name(s), s.module,
                            (i >= 0 && i < static_cast<int>(order.size()))
                                ? step_name(order[i])
                                : std::string(backward ? "a forward pass first" : "set_batch")));
  }
}

std::span<const float> Model::as_f32(const Step& s, ParamView params, bool allow_empty) {
  const std::size_t need = module_layout(cfg_, s.module).numel;
  if (allow_empty && params.numel() == 0) return {};
  if (params.numel() != need) {
    throw Error(fmt::format("gpt step {}: module {} parameters must have {} elements, got {}",
                            step_name(s), s.module, need, params.numel()));
  }
  if (params.dtype() == DType::kF32) return params.f32();
  scratch_params_.resize(need);
  auto bits = params.bf16_bits();
#pragma omp parallel for schedule(static) if(need >= (1u << 16))
  for (std::size_t i = 0; i < need; ++i) scratch_params_[i] = bf16_to_f32(bits[i]);
  return {scratch_params_.data(), need};
}

void Model::block_forward(int layer, std::span<const float> p, Layer& a,
                          bool intermediates_only) {
  const int B = B_, T = T_, C = cfg_.d_model, NH = cfg_.n_head;
  const int N = B * T;
  const std::int64_t NC = static_cast<std::int64_t>(N) * C;
  BlockTensors<const float> w(p.data(), C);
  const float* x = resid_[layer].data();
  cpu::layernorm_forward(a.ln1.data(), a.ln1_mean.data(), a.ln1_rstd.data(), x, w.ln1_w, w.ln1_b,
                         N, C);
  cpu::matmul_forward(a.qkv.data(), a.ln1.data(), w.qkv_w, w.qkv_b, N, C, 3 * C);
  cpu::attention_forward(a.atty.data(), a.att.data(), a.qkv.data(), B, T, C, NH);
  cpu::matmul_forward(a.resid_mid.data(), a.atty.data(), w.proj_w, w.proj_b, N, C, C);
  cpu::residual_forward(a.resid_mid.data(), a.resid_mid.data(), x, NC);
  cpu::layernorm_forward(a.ln2.data(), a.ln2_mean.data(), a.ln2_rstd.data(), a.resid_mid.data(),
                         w.ln2_w, w.ln2_b, N, C);
  cpu::matmul_forward(a.fch.data(), a.ln2.data(), w.fc_w, w.fc_b, N, C, 4 * C);
  cpu::gelu_forward(a.fch_gelu.data(), a.fch.data(), 4 * NC);
  if (intermediates_only) return;  // the block's backward reads fch_gelu, not the output
  float* y = resid_[layer + 1].data();
  cpu::matmul_forward(y, a.fch_gelu.data(), w.fc_proj_w, w.fc_proj_b, N, 4 * C, C);
  cpu::residual_forward(y, y, a.resid_mid.data(), NC);
}

void Model::forward(const Step& s, ParamView params) {
  check_step(s, false);
  std::span<const float> p = as_f32(s, params, false);
  const int B = B_, T = T_, C = cfg_.d_model, V = cfg_.vocab_size;
  const int N = B * T;
  switch (s.kind) {
    case StepKind::kEmbed: {
      const float* wte = p.data();
      const float* wpe = wte + static_cast<std::int64_t>(V) * C;
      cpu::encoder_forward(resid_[0].data(), tokens_.data(), wte, wpe, B, T, C);
      break;
    }
    case StepKind::kBlock:
      block_forward(s.layer, p, layer_activations(s.layer), /*intermediates_only=*/false);
      break;
    case StepKind::kFinalNorm:
      cpu::layernorm_forward(lnf_.data(), lnf_mean_.data(), lnf_rstd_.data(),
                             resid_[cfg_.n_layer].data(), p.data(), p.data() + C, N, C);
      break;
    case StepKind::kHead:
      cpu::matmul_forward(probs_.data(), lnf_.data(), p.data(), static_cast<const float*>(nullptr),
                          N, C, V);
      loss_ = cpu::crossentropy_forward(probs_.data(), targets_.data(), N, V);
      break;
  }
  if (s.kind == StepKind::kHead) {
    next_forward_ = 0;
    next_backward_ = 0;
  } else {
    ++next_forward_;
  }
}

void Model::backward(const Step& s, ParamView params, std::span<float> grads) {
  check_step(s, true);
  std::span<const float> p = as_f32(s, params, s.kind == StepKind::kEmbed);
  const std::size_t need = module_layout(cfg_, s.module).numel;
  if (grads.size() != need) {
    throw Error(fmt::format("gpt backward {}: module {} gradient must have {} elements, got {}",
                            step_name(s), s.module, need, grads.size()));
  }
  const int B = B_, T = T_, C = cfg_.d_model, NH = cfg_.n_head, V = cfg_.vocab_size;
  const int N = B * T;
  const std::int64_t NC = static_cast<std::int64_t>(N) * C;
  float* g = grads.data();
  switch (s.kind) {
    case StepKind::kHead:
      cpu::crossentropy_backward(probs_.data(), targets_.data(), N, V, 1.0f / N);
      // probs_ now holds dlogits; d_ln_ = dL/d lnf_out; dwte += dlogitsᵀ·lnf_out.
      cpu::matmul_backward(d_ln_.data(), g, static_cast<float*>(nullptr), probs_.data(),
                           lnf_.data(), p.data(), N, C, V);
      break;
    case StepKind::kFinalNorm:
      std::fill(d_resid_.begin(), d_resid_.end(), 0.0f);
      cpu::layernorm_backward(d_resid_.data(), g, g + C, d_ln_.data(), resid_[cfg_.n_layer].data(),
                              p.data(), lnf_mean_.data(), lnf_rstd_.data(), N, C);
      break;
    case StepKind::kBlock: {
      BlockTensors<const float> w(p.data(), C);
      BlockTensors<float> dw(g, C);
      Layer& a = layer_activations(s.layer);
      // Checkpointing: the shared buffers hold another block's intermediates (or a later step's
      // recompute); rebuild this block's from its kept input, with the parameters given here.
      if (options_.checkpoint_blocks) block_forward(s.layer, p, a, /*intermediates_only=*/true);
      // d_resid_ = dL/d resid_[l+1]. MLP branch:
      std::copy(d_resid_.begin(), d_resid_.end(), d_resid_mid_.begin());
      cpu::matmul_backward(d_fch_gelu_.data(), dw.fc_proj_w, dw.fc_proj_b, d_resid_.data(),
                           a.fch_gelu.data(), w.fc_proj_w, N, 4 * C, C);
      cpu::gelu_backward(d_fch_.data(), a.fch.data(), d_fch_gelu_.data(), 4 * NC);
      cpu::matmul_backward(d_ln_.data(), dw.fc_w, dw.fc_b, d_fch_.data(), a.ln2.data(), w.fc_w, N,
                           C, 4 * C);
      cpu::layernorm_backward(d_resid_mid_.data(), dw.ln2_w, dw.ln2_b, d_ln_.data(),
                              a.resid_mid.data(), w.ln2_w, a.ln2_mean.data(), a.ln2_rstd.data(), N,
                              C);
      // d_resid_mid_ = dL/d resid_mid. Attention branch:
      std::copy(d_resid_mid_.begin(), d_resid_mid_.end(), d_resid_.begin());
      cpu::matmul_backward(d_atty_.data(), dw.proj_w, dw.proj_b, d_resid_mid_.data(),
                           a.atty.data(), w.proj_w, N, C, C);
      cpu::attention_backward(d_qkv_.data(), d_att_.data(), d_atty_.data(), a.qkv.data(),
                              a.att.data(), B, T, C, NH);
      cpu::matmul_backward(d_ln_.data(), dw.qkv_w, dw.qkv_b, d_qkv_.data(), a.ln1.data(), w.qkv_w,
                           N, C, 3 * C);
      cpu::layernorm_backward(d_resid_.data(), dw.ln1_w, dw.ln1_b, d_ln_.data(),
                              resid_[s.layer].data(), w.ln1_w, a.ln1_mean.data(),
                              a.ln1_rstd.data(), N, C);
      break;
    }
    case StepKind::kEmbed:
      cpu::encoder_backward(g, g + static_cast<std::int64_t>(V) * C, d_resid_.data(),
                            tokens_.data(), B, T, C);
      break;
  }
  ++next_backward_;
  if (next_backward_ >= static_cast<int>(backward_steps(cfg_).size())) next_backward_ = -1;
}

float Model::forward_all(const std::vector<std::vector<float>>& params,
                         std::span<const std::int32_t> tokens,
                         std::span<const std::int32_t> targets) {
  if (static_cast<int>(params.size()) != num_modules(cfg_)) {
    throw Error(fmt::format("gpt: {} module parameter buffers given, the model has {}",
                            params.size(), num_modules(cfg_)));
  }
  set_batch(tokens, targets);
  for (const Step& s : forward_steps(cfg_)) forward(s, params[s.module]);
  return loss_;
}

float Model::forward_backward(const std::vector<std::vector<float>>& params,
                              std::vector<std::vector<float>>& grads,
                              std::span<const std::int32_t> tokens,
                              std::span<const std::int32_t> targets) {
  float loss = forward_all(params, tokens, targets);
  if (static_cast<int>(grads.size()) != num_modules(cfg_)) {
    throw Error(fmt::format("gpt: {} module gradient buffers given, the model has {}",
                            grads.size(), num_modules(cfg_)));
  }
  for (const Step& s : backward_steps(cfg_)) backward(s, params[s.module], grads[s.module]);
  return loss;
}

}  // namespace tiermem::gpt
