// tiermem-bench train-offload — how much of ZeroEngine's NVMe traffic hides behind compute in
// tiermem-train: the same few steps run three ways, interleaved and rotated over rounds:
//   resident   --engine resident: every tensor in host memory (compute alone)
//   offloaded  --offload nvme: params, gradients and optimizer state paged through NVMe
//   io-only    --offload nvme --io-only: the same engine traffic with no model compute
// overlap_efficiency = max(resident step, io-only step) / offloaded step (medians of the steps
// after the first four of every run: step 1 records the access trace, step 2 is the first replay,
// which with the overlapped optimizer step also applies step 1's deferred updates, and steps 3-4
// still settle: gpt2 1 x 64 io-only read 0.70, 0.66, 0.54, 0.52, 0.50 s for steps 3-7); 1 means
// the offloaded step is as fast as its slower part.
//
// --compute-threads N sets OMP_NUM_THREADS=N for all three runs: the model's GEMMs and loops and the
// engine's OpenMP loops (AdamW, the gradient norm) use N threads; the engine's I/O-completion,
// checksum, gradient and transfer threads are not limited. With N below the core count the model's
// compute leaves cores to the engine, as a GPU's compute would: on the simulated device the model's
// kernels and the engine's copies and checksums otherwise share the same host cores, which a run on
// a GPU does not (docs/benchmarks.md, "tiermem-train: overlap of NVMe traffic with compute").
//
//   build/default/bin/tiermem-bench train-offload --model gpt2 --json
//   build/default/bin/tiermem-bench train-offload --model mini --steps 6 --rounds 3
//
// It runs the tiermem-train binary next to this one (build/<preset>/bin/), or --train.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "bench/bench.h"
#include "core/cli_checks.h"
#include "tiermem/error.h"

namespace tiermem::bench {
namespace {

namespace fs = std::filesystem;

struct Options {
  std::string model = "gpt2";
  int steps = 8, rounds = 3, seq_len = 64, batch = 1;
  std::string swap_dir = "/var/tmp/tiermem-train-offload";
  std::string host_budget, device_budget, config, data, train;
  int compute_threads = 0;  // 0: OMP_NUM_THREADS as the environment has it
  bool json = false;
};

struct Mode {
  const char* name;
  const char* args;
};
constexpr int kWarmupSteps = 4;  // not timed: trace recording, first replay, two settling
constexpr Mode kModes[] = {{"resident", "--engine resident"},
                           {"offloaded", "--offload nvme"},
                           {"io-only", "--offload nvme --io-only"}};

// Runs the trainer once; returns the seconds of every step after the first.
std::vector<double> run_once(const Options& o, const Mode& mode) {
  std::string cmd = fmt::format("'{}' --model {} --steps {} --seq-len {} --batch {} --eval-every 0 --json "
                                "--swap-dir '{}' {}",
                                o.train, o.model, o.steps, o.seq_len, o.batch, o.swap_dir, mode.args);
  if (!o.data.empty()) cmd += " --data '" + o.data + "'";
  if (!o.host_budget.empty() && std::string(mode.name) != "resident") cmd += " --host-budget " + o.host_budget;
  if (!o.device_budget.empty() && std::string(mode.name) != "resident") cmd += " --device-budget " + o.device_budget;
  if (!o.config.empty() && std::string(mode.name) != "resident") cmd += " --config '" + o.config + "'";
  const fs::path out = fs::temp_directory_path() / fmt::format("tiermem-train-offload-{}.out", ::getpid());
  cmd += " >'" + out.string() + "' 2>&1";
  const int status = std::system(cmd.c_str());
  std::ifstream in(out);
  std::stringstream text;
  text << in.rdbuf();
  fs::remove(out);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    throw Error(fmt::format("train-offload: '{}' failed (status {}):\n{}", cmd, status, text.str()));
  }
  std::vector<double> secs;
  std::string line;
  while (std::getline(text, line)) {
    if (line.empty() || line[0] != '{') continue;
    const auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_object() && j.contains("step") && j.contains("seconds") && j["step"].get<int>() > kWarmupSteps) {
      secs.push_back(j["seconds"].get<double>());
    }
  }
  if (secs.empty()) throw Error("train-offload: no step after the first four in the output of '" + cmd + "'");
  return secs;
}

std::function<int()> setup(CLI::App& sub) {
  auto o = std::make_shared<Options>();
  sub.add_option("--model", o->model, "tiermem-train model preset")->default_val(o->model);
  sub.add_option("--steps", o->steps, "steps per run (>= 5; the first four are not timed)")
      ->default_val(o->steps)->check(tiermem::cli::whole_number_check())->check(CLI::Range(kWarmupSteps + 1, 1000));
  sub.add_option("--rounds", o->rounds, "interleaved rounds of the three runs")->default_val(o->rounds)
      ->check(tiermem::cli::whole_number_check())->check(CLI::Range(1, 100));
  sub.add_option("--seq-len", o->seq_len, "tokens per sequence")->default_val(o->seq_len)->check(tiermem::cli::whole_number_check())->check(CLI::Range(1, 1 << 20));
  sub.add_option("--batch", o->batch, "sequences per step")->default_val(o->batch)->check(tiermem::cli::whole_number_check())->check(CLI::Range(1, 65536));
  sub.add_option("--swap-dir", o->swap_dir, "NVMe swap directory")->default_val(o->swap_dir);
  sub.add_option("--host-budget", o->host_budget, "tiermem-train --host-budget for the NVMe runs");
  sub.add_option("--device-budget", o->device_budget, "tiermem-train --device-budget for the NVMe runs");
  sub.add_option("--config", o->config, "tiermem-train --config (a ds_config.json) for the NVMe runs")
      ->check(CLI::ExistingFile);
  sub.add_option("--data", o->data, "tiermem-train --data (default: its own corpus)");
  sub.add_option("--train", o->train, "the tiermem-train binary [default: next to this one]");
  sub.add_option("--compute-threads", o->compute_threads,
                 "OMP_NUM_THREADS in all three runs (the model's compute and the engine's AdamW; 0: as the "
                 "environment has it); below the core count it leaves cores to the engine's I/O threads, as a "
                 "GPU's compute would")
      ->default_val(o->compute_threads)->check(tiermem::cli::whole_number_check())->check(CLI::Range(0, 4096));
  sub.add_flag("--json", o->json, "one JSON object as the last line");
  return [o]() -> int {
    if (o->train.empty()) {
      const fs::path self = fs::read_symlink("/proc/self/exe");
      o->train = (self.parent_path() / "tiermem-train").string();
    }
    if (!fs::exists(o->train)) {
      std::cerr << "tiermem-bench train-offload: no tiermem-train at '" << o->train << "' (build it, or --train)\n";
      return 2;
    }
    if (o->compute_threads > 0) ::setenv("OMP_NUM_THREADS", std::to_string(o->compute_threads).c_str(), 1);
    std::vector<double> all[3];
    for (int r = 0; r < o->rounds; ++r) {
      for (int k = 0; k < 3; ++k) {  // rotated: each mode runs first in some round
        const int m = (k + r) % 3;
        const std::vector<double> s = run_once(*o, kModes[m]);
        all[m].insert(all[m].end(), s.begin(), s.end());
        std::fprintf(stderr, "round %d %-9s step median %.3f s\n", r + 1, kModes[m].name, median(s));
      }
    }
    const double resident = median(all[0]), offloaded = median(all[1]), io = median(all[2]);
    const double eff = std::max(resident, io) / offloaded;
    const std::string threads =
        o->compute_threads > 0 ? fmt::format(", {} compute thread{}", o->compute_threads, o->compute_threads > 1 ? "s" : "")
                               : "";
    std::printf("train-offload %s: %d rounds x %d steps (seq %d, batch %d%s), medians of steps 5..: resident %.3f s, "
                "io-only %.3f s, offloaded %.3f s -> overlap_efficiency %.2f\n",
                o->model.c_str(), o->rounds, o->steps, o->seq_len, o->batch, threads.c_str(), resident, io, offloaded,
                eff);
    if (o->json) {
      nlohmann::json j = {{"bench", "train-offload"},       {"model", o->model},
                          {"rounds", o->rounds},            {"steps", o->steps},
                          {"seq_len", o->seq_len},          {"batch", o->batch},
                          {"resident_step_s", resident},    {"offloaded_step_s", offloaded},
                          {"io_only_step_s", io},           {"overlap_efficiency", eff},
                          {"resident_steps_s", all[0]},     {"offloaded_steps_s", all[1]},
                          {"io_only_steps_s", all[2]},
                          {"compute_threads", o->compute_threads}};
      std::cout << j.dump() << std::endl;
    }
    return 0;
  };
}

}  // namespace

TIERMEM_BENCH_COMMAND(train_offload, "train-offload",
                      "tiermem-train resident vs NVMe-offloaded vs I/O alone: overlap efficiency", setup);

}  // namespace tiermem::bench
