// tiermem-bench gpt — forward+backward speed of the GPT model on the CPU, against OpenBLAS.
//
//   cmake --build build --target tiermem-bench
//   build/bin/tiermem-bench gpt --model mini --batch 8 --seq 128 --reps 5 --json
//
// Each repetition times one full training step of the model (every forward and backward step,
// parameters resident) and then, interleaved, an OpenBLAS sgemm of the model's most common GEMM
// shape (the MLP's first linear: [B·T, d] × [d, 4d]) through the same wrapper the model uses.
// Reported: medians of the repetitions; model GFLOP/s = flops_per_token() × B·T / step time (the
// 6·N + attention convention), and its ratio to the sgemm GFLOP/s (the practical ceiling).
// The output is checked before timing: the loss at init must be within 0.5 of ln(vocab).
#include <cmath>
#include <iostream>
#include <random>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "bench/bench.h"
#include "core/cli_checks.h"
#include "gpt/kernels_cpu.h"
#include "gpt/model.h"
#include "tiermem/error.h"

namespace tiermem::bench {
namespace {

struct GptOptions {
  std::string model = "mini";
  int batch = 8;
  int seq = 0;  // 0: 128, or the config's seq_len where smaller
  int reps = 5;
  bool json = false;
};

int run_gpt(const GptOptions& o) {
  const gpt::GptConfig cfg = gpt::GptConfig::named(o.model);
  if (o.seq > cfg.seq_len) {
    throw ConfigError("--seq", std::to_string(o.seq),
                      fmt::format("is above --model {}'s seq_len, {}: give at most that", o.model, cfg.seq_len));
  }
  const int T = o.seq > 0 ? o.seq : std::min(128, cfg.seq_len), B = o.batch;
  const long N = static_cast<long>(B) * T;
  auto params = gpt::init_params(cfg, 1234);
  std::vector<std::vector<float>> grads(params.size());
  for (std::size_t m = 0; m < params.size(); ++m) grads[m].assign(params[m].size(), 0.0f);
  std::vector<std::int32_t> tok(N), tgt(N);
  std::mt19937 g(7);
  std::uniform_int_distribution<int> d(0, cfg.vocab_size - 1);
  for (long i = 0; i < N; ++i) tok[i] = d(g), tgt[i] = d(g);
  gpt::Model model(cfg, B, T);

  // Check before timing (also the warm-up).
  const float loss0 = model.forward_backward(params, grads, tok, tgt);
  const double lnv = std::log(static_cast<double>(cfg.vocab_size));
  if (!(std::abs(loss0 - lnv) < 0.5)) {
    throw Error(fmt::format("bench gpt: loss at init {} is not near ln(vocab) = {}", loss0, lnv));
  }

  const int C = cfg.d_model, OC = 4 * cfg.d_model;
  std::vector<float> a(N * C), w(static_cast<long>(OC) * C), c(N * OC);
  for (auto& x : a) x = 0.01f * static_cast<float>(d(g) % 7);
  for (auto& x : w) x = 0.01f * static_cast<float>(d(g) % 5);
  gpt::cpu::matmul_forward<float>(c.data(), a.data(), w.data(), nullptr, N, C, OC);  // warm-up
  const double gemm_flops = 2.0 * N * C * OC;
  const int gemm_inner = std::max(1, static_cast<int>(2e9 / gemm_flops));  // ~2 GFLOP per sample

  std::vector<double> step_s, gemm_gflops;
  for (int r = 0; r < o.reps; ++r) {
    double t0 = now_s();
    model.forward_backward(params, grads, tok, tgt);
    step_s.push_back(now_s() - t0);
    t0 = now_s();
    for (int i = 0; i < gemm_inner; ++i) {
      gpt::cpu::matmul_forward<float>(c.data(), a.data(), w.data(), nullptr, N, C, OC);
    }
    gemm_gflops.push_back(gemm_flops * gemm_inner / (now_s() - t0) / 1e9);
  }
  const double step = median(step_s), sgemm = median(gemm_gflops);
  const double fpt = gpt::flops_per_token(cfg, T);
  const double model_gflops = fpt * N / step / 1e9;
  const double ratio = model_gflops / sgemm;

  std::cout << cfg.describe(o.model) << "\n"
            << fmt::format("batch {} x seq {} = {} tokens, {} threads, {} reps (median)\n", B, T,
                           N, gpt::cpu::compute_threads(), o.reps)
            << fmt::format("fwd+bwd step {:.1f} ms = {:.2f} us/token, {:.0f} tokens/s\n",
                           step * 1e3, step / N * 1e6, N / step)
            << fmt::format("model {:.2f} GFLOP/s ({:.1f} MFLOP/token), sgemm [{}x{}]x[{}x{}] "
                           "{:.2f} GFLOP/s, ratio {:.2f}\n",
                           model_gflops, fpt / 1e6, N, C, C, OC, sgemm, ratio);
  if (o.json) {
    nlohmann::json j = {{"bench", "gpt"},
                        {"model", o.model},
                        {"params", gpt::num_params(cfg)},
                        {"batch", B},
                        {"seq", T},
                        {"threads", gpt::cpu::compute_threads()},
                        {"reps", o.reps},
                        {"loss_at_init", loss0},
                        {"step_ms", step * 1e3},
                        {"us_per_token", step / N * 1e6},
                        {"flops_per_token", fpt},
                        {"model_gflops", model_gflops},
                        {"sgemm_gflops", sgemm},
                        {"sgemm_shape", {N, C, OC}},
                        {"ratio_to_sgemm", ratio}};
    std::cout << j.dump() << "\n";
  }
  return 0;
}

std::function<int()> setup_gpt(CLI::App& sub) {
  auto o = std::make_shared<GptOptions>();
  sub.add_option("--model", o->model, "named config: tiny, mini, gpt2, gpt2-medium, ...")
      ->capture_default_str();
  sub.add_option("--batch", o->batch, "sequences per step")->capture_default_str()->check(tiermem::cli::whole_number_check())->check(CLI::Range(1, 65536));
  sub.add_option("--seq", o->seq, "tokens per sequence, at most the config's seq_len [default: 128, or its seq_len where smaller]")->check(tiermem::cli::whole_number_check())->check(CLI::Range(1, 1 << 20));
  sub.add_option("--reps", o->reps, "timed repetitions (median reported)")->capture_default_str()->check(tiermem::cli::whole_number_check())->check(CLI::Range(1, 100000));
  sub.add_flag("--json", o->json, "print one JSON object as the last line");
  return [o] { return run_gpt(*o); };
}

}  // namespace

TIERMEM_BENCH_COMMAND(gpt, "gpt", "GPT model forward+backward on the CPU vs OpenBLAS sgemm",
                      setup_gpt);

}  // namespace tiermem::bench
