// tiermem-bench adam — CPU AdamW throughput (fp32 master + moments, fused bf16 copy-out) against
// the machine's STREAM-triad bandwidth measured in the same run.
//
//   cmake --build build --target tiermem-bench
//   build/bin/tiermem-bench adam --params 64M,128M --reps 5 --json
//
// Bytes counted per parameter: read master, grad, m, v (16) + write master, m, v (12) + bf16 (2)
// = 30 (28 with --half none: no copy-out). Triad a[i] = b[i] + s*c[i] over fp32 counts 12 bytes
// per element (bench/triad_kernel.h: STREAM's convention, no write-allocate; until issue 12 it
// counted 24, STREAM's figure for doubles, which doubled the triad and halved the ratio).
// roofline_ratio = Adam GB/s / triad GB/s (it can exceed 1: the triad's store also costs a
// read-for-ownership that the count leaves out, Adam's read-modify-writes do not). Each
// repetition runs triad, the best vector kernel and the scalar kernel back to back
// (interleaved); figures are medians.
#include <omp.h>

#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/bench.h"
#include "core/cli_checks.h"
#include "bench/triad_kernel.h"
#include "tiermem/adam.h"
#include "tiermem/config.h"
#include "tiermem/error.h"
#include "tiermem/zero_plan.h"

namespace tiermem::bench {
namespace {

struct AdamOpts {
  std::string params = "64M,128M";
  int reps = 5;
  int threads = 0;
  bool json = false;
  bool no_scalar = false;
  std::string half = "bf16";
};

// Fills [0, n) of each array with `value` from `threads` threads (first touch places pages).
void parallel_fill(std::vector<float*> arrays, std::size_t n, float value, int threads) {
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      std::size_t b = n * t / threads, e = n * (t + 1) / threads;
      for (float* a : arrays) std::fill(a + b, a + e, value);
    });
  }
  for (auto& t : ts) t.join();
}

// One STREAM triad pass over n elements on `threads` threads; returns seconds.
double triad_once(float* a, const float* b, const float* c, std::size_t n, int threads) {
  const float s = 3.0f;
  double t0 = now_s();
  {
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t) {
      ts.emplace_back([=] {
        std::size_t lo = n * t / threads, hi = n * (t + 1) / threads;
        triad_range(a, b, c, s, lo, hi);
      });
    }
    for (auto& t : ts) t.join();
  }
  return now_s() - t0;
}

// The --params list: counts of at least 4096 (the kernel check's step covers 4096 elements), each
// small enough that its five arrays (18 bytes a parameter) fit this machine's memory.
std::vector<std::size_t> parse_list(const std::string& text) {
  std::vector<std::size_t> out;
  std::size_t pos = 0;
  while (pos <= text.size()) {
    std::size_t comma = text.find(',', pos);
    std::string item = text.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    std::uint64_t n = 0;
    try {
      n = parse_size(item, "--params");
    } catch (const ConfigError&) {
      throw ConfigError("--params", text,
                        "'" + item + "' is not a parameter count (a whole number, with K/M/G or an exponent: 64M, 1e8)");
    }
    if (n < 4096) throw ConfigError("--params", text, "'" + item + "' is below the smallest count, 4096");
    const std::uint64_t phys = physical_memory_bytes();
    if (phys > 0 && n > phys / 18) {
      throw ConfigError("--params", text,
                        "'" + item + "' needs " + format_bytes(18 * n) + " (18 bytes a parameter), more than this machine's " +
                            format_bytes(phys));
    }
    out.push_back(n);
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

int run_adam(const AdamOpts& o) {
  const int threads = o.threads > 0 ? o.threads : omp_get_max_threads();
  const AdamIsa isa = adam_best_isa();
  nlohmann::json sizes = nlohmann::json::array();
  nlohmann::json last;
  for (std::size_t n : parse_list(o.params)) {
    // State: master, grad, m, v (fp32) and the bf16 copy. Triad reuses master/grad/m as a, b, c.
    std::unique_ptr<float[]> p(new float[n]), g(new float[n]), m(new float[n]), v(new float[n]);
    std::unique_ptr<std::uint16_t[]> half(new std::uint16_t[n]);
    parallel_fill({p.get(), g.get(), m.get(), v.get()}, n, 0.0f, threads);
    parallel_fill({g.get()}, n, 0.01f, threads);
    std::fill(half.get(), half.get() + n, 0);

    // Check output before timing: one step from zero state with grad 0.01 and lr 1e-3 moves every
    // master weight to -lr (Adam's first step is lr * sign(g)), in both kernels.
    AdamParams ap;
    ap.lr = 1e-3f;
    ap.step = 1;
    adam_step(ap, p.get(), g.get(), m.get(), v.get(), 4096, half.get(), DType::kBF16, {isa, threads});
    if (std::abs(p[17] + 1e-3f) > 1e-6f || half[17] != f32_to_bf16(p[17])) {
      std::fprintf(stderr, "adam: kernel output check failed (p=%g)\n", static_cast<double>(p[17]));
      return 1;
    }

    std::uint16_t* const hp = o.half == "bf16" ? half.get() : nullptr;
    const double bytes_per_param = hp != nullptr ? 30.0 : 28.0;
    std::vector<double> t_triad, t_vec, t_scalar;
    for (int r = 0; r < o.reps; ++r) {
      t_triad.push_back(triad_once(p.get(), g.get(), m.get(), n, threads));
      ap.step = r + 2;
      t_vec.push_back(0);
      double t0 = now_s();
      adam_step(ap, p.get(), g.get(), m.get(), v.get(), n, hp, DType::kBF16, {isa, threads});
      t_vec.back() = now_s() - t0;
      if (!o.no_scalar) {
        t0 = now_s();
        adam_step(ap, p.get(), g.get(), m.get(), v.get(), n, hp, DType::kBF16,
                  {AdamIsa::kScalar, threads});
        t_scalar.push_back(now_s() - t0);
      }
    }
    const double tv = median(t_vec), tt = median(t_triad);
    const double dn = static_cast<double>(n);
    nlohmann::json j;
    j["params"] = n;
    j["isa"] = std::string(adam_isa_name(isa));
    j["threads"] = threads;
    j["reps"] = o.reps;
    j["params_per_s"] = dn / tv;
    j["half"] = o.half;
    j["bytes_per_param"] = bytes_per_param;
    j["gbps"] = bytes_per_param * dn / tv / 1e9;
    j["triad_gbps"] = kTriadBytesPerElem * dn / tt / 1e9;
    j["roofline_ratio"] = (bytes_per_param * dn / tv) / (kTriadBytesPerElem * dn / tt);
    j["step_ms"] = tv * 1e3;
    if (!t_scalar.empty()) {
      j["scalar_params_per_s"] = dn / median(t_scalar);
      j["speedup_vs_scalar"] = median(t_scalar) / tv;
    }
    std::printf("adam  %5.0fM params  %-6s %d thr  %7.1f Mparams/s  %6.2f GB/s  triad %6.2f GB/s  "
                "roofline %.2f  scalar x%.2f\n",
                dn / 1e6, adam_isa_name(isa).data(), threads, dn / tv / 1e6, j["gbps"].get<double>(),
                j["triad_gbps"].get<double>(), j["roofline_ratio"].get<double>(),
                j.value("speedup_vs_scalar", 0.0));
    sizes.push_back(j);
    last = j;
  }
  if (o.json) {
    nlohmann::json out = last;  // top-level figures: the largest (last) size
    out["bench"] = "adam";
    out["sizes"] = sizes;
    std::printf("%s\n", out.dump().c_str());
  }
  return 0;
}

std::function<int()> setup_adam(CLI::App& sub) {
  auto o = std::make_shared<AdamOpts>();
  sub.add_option("--params", o->params, "comma-separated parameter counts (64M, 128M, 1e8)")->capture_default_str();
  sub.add_option("--reps", o->reps, "interleaved repetitions per size (median reported)")->capture_default_str()->check(tiermem::cli::whole_number_check())->check(CLI::Range(1, 100000));
  sub.add_option("--threads", o->threads, "threads (0 = OpenMP default)")->capture_default_str()->check(tiermem::cli::whole_number_check())->check(CLI::Range(0, 4096));
  sub.add_flag("--no-scalar", o->no_scalar, "skip the scalar baseline");
  sub.add_option("--half", o->half, "the fused copy-out: bf16, or none (28 bytes per param)")
      ->capture_default_str()
      ->check(CLI::IsMember({"bf16", "none"}));
  sub.add_flag("--json", o->json, "print one JSON object as the last line");
  return [o] { return run_adam(*o); };
}

}  // namespace

TIERMEM_BENCH_COMMAND(adam, "adam", "CPU AdamW (fused bf16 copy-out) vs STREAM triad bandwidth", setup_adam);

}  // namespace tiermem::bench
