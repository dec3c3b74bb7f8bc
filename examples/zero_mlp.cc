// examples/zero_mlp.cc — a two-layer MLP trained through ZeroEngine: the loop a framework writes
// around its own forward and backward (register the modules, then per step gather, forward,
// backward, reduce_gradients, step). One rank, ZeRO stage 3, optimizer state on NVMe in a
// temporary directory.
//
// Build and run (from the repository root):
//   cmake --preset cpu && cmake --build --preset cpu -j2 --target zero_mlp
//   build/cpu/examples/zero_mlp            # prints the loss of each step; it falls
// or against an installed tiermem, outside this tree: README "Link tiermem into your framework"
// (find_package(tiermem) with examples/consumer/CMakeLists.txt, or pkg-config).
//
// Model: y = W2 · tanh(W1 · x + b1) + b2, loss = mean over samples of 0.5 · |y - t|².
// Module 0 ("fc1") holds [W1 | b1], module 1 ("fc2") holds [W2 | b2], fp32.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include <unistd.h>

#include "tiermem/communicator.h"
#include "tiermem/config.h"
#include "tiermem/device.h"
#include "tiermem/version.h"
#include "tiermem/zero_engine.h"

namespace {

constexpr int kIn = 4, kHidden = 32, kOut = 2, kSamples = 64, kSteps = 30;

// The module's parameters as host floats, wherever the engine put them (a GPU's memory is copied).
std::vector<float> to_host(const tiermem::ZeroEngine& engine, const tiermem::ZeroEngine::Gathered& g) {
  std::vector<float> out(g.numel());
  tiermem::Device* dev = engine.device();
  if (g.on_device() && dev != nullptr && !dev->host_addressable()) {
    dev->copy_d2h(out.data(), g.data(), out.size() * sizeof(float));
  } else {
    out.assign(g.f32().begin(), g.f32().end());
  }
  return out;
}

// Trains the MLP with its optimizer state under `swap_dir`; returns whether the loss fell.
bool train(const std::string& swap_dir) {
  // 1. The engine: a DeepSpeed-style config (o_direct off: the temp dir may be tmpfs).
  tiermem::Config cfg = tiermem::parse_config(R"({
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
    "tiermem": {"o_direct": false, "swap_initial_bytes": "1MiB", "host_budget_bytes": "16MiB"},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
      "offload_optimizer": {"device": "nvme", "nvme_path": ")" + swap_dir + R"("}}})");
  auto comm = tiermem::make_single_communicator();
  tiermem::ZeroEngine engine(cfg, *comm);

  // 2. Register the modules with their initial fp32 values.
  std::mt19937 rng(1);
  std::normal_distribution<float> init(0.0f, 0.4f);
  std::vector<float> fc1(kHidden * kIn + kHidden), fc2(kOut * kHidden + kOut);
  for (float& w : fc1) w = init(rng);
  for (float& w : fc2) w = init(rng);
  engine.register_module("fc1", fc1);
  engine.register_module("fc2", fc2);

  // The data: targets from a fixed smooth function of the inputs.
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> x(kSamples * kIn), t(kSamples * kOut);
  for (float& v : x) v = u(rng);
  for (int s = 0; s < kSamples; ++s) {
    t[s * kOut] = std::sin(x[s * kIn] + x[s * kIn + 1]);
    t[s * kOut + 1] = x[s * kIn + 2] * x[s * kIn + 3];
  }

  // 3. The training loop.
  double first_loss = 0, loss = 0;
  for (int step = 1; step <= kSteps; ++step) {
    std::vector<float> p1 = to_host(engine, engine.gather(0));  // gather: stage 3 pages it in
    std::vector<float> p2 = to_host(engine, engine.gather(1));
    const float *W1 = p1.data(), *b1 = W1 + kHidden * kIn, *W2 = p2.data(), *b2 = W2 + kOut * kHidden;
    std::vector<float> g1(p1.size(), 0.0f), g2(p2.size(), 0.0f);
    loss = 0;
    for (int s = 0; s < kSamples; ++s) {  // forward and backward, one sample at a time
      const float* xs = &x[s * kIn];
      float h[kHidden], dy[kOut];
      for (int j = 0; j < kHidden; ++j) {
        float a = b1[j];
        for (int i = 0; i < kIn; ++i) a += W1[j * kIn + i] * xs[i];
        h[j] = std::tanh(a);
      }
      for (int k = 0; k < kOut; ++k) {
        float y = b2[k];
        for (int j = 0; j < kHidden; ++j) y += W2[k * kHidden + j] * h[j];
        const float err = y - t[s * kOut + k];
        loss += 0.5 * err * err / kSamples;
        dy[k] = err / kSamples;
        g2[kOut * kHidden + k] += dy[k];
        for (int j = 0; j < kHidden; ++j) g2[k * kHidden + j] += dy[k] * h[j];
      }
      for (int j = 0; j < kHidden; ++j) {
        float dh = 0;
        for (int k = 0; k < kOut; ++k) dh += W2[k * kHidden + j] * dy[k];
        dh *= 1.0f - h[j] * h[j];
        for (int i = 0; i < kIn; ++i) g1[j * kIn + i] += dh * xs[i];
        g1[kHidden * kIn + j] += dh;
      }
    }
    engine.reduce_gradients(1, g2);  // backward order: the last module first
    engine.reduce_gradients(0, g1);
    engine.step();  // AdamW over the sub-groups, streamed from NVMe
    if (step == 1) first_loss = loss;
    std::printf("step %2d  loss %.6f\n", step, loss);
  }

  const tiermem::ZeroStats st = engine.stats();
  std::printf("loss %.6f -> %.6f; optimizer state on %s, %llu bytes written to NVMe\n", first_loss, loss,
              std::string(tiermem::tier_name(st.optimizer_home)).c_str(),
              static_cast<unsigned long long>(st.nvme_written_bytes));
  return loss < first_loss;
}

}  // namespace

int main() {
  std::printf("%s\n", tiermem::version_string().c_str());  // the library this binary runs on
  namespace fs = std::filesystem;
  const fs::path swap_dir = fs::temp_directory_path() / ("tiermem-zero-mlp-" + std::to_string(::getpid()));
  fs::create_directories(swap_dir);
  const bool fell = train(swap_dir.string());
  fs::remove_all(swap_dir);
  return fell ? EXIT_SUCCESS : EXIT_FAILURE;
}
