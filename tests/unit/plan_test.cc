// tests/unit/plan_test.cc — tiermem-plan (src/plan/plan.h) against what the engine does:
//   - activation bytes: the planner's formula equals gpt::Model's allocation;
//   - bytes per tier: tiny and mini runs of tiermem-train (offload none / cpu / nvme) held
//     against the planner's prediction with --check: the state (NVMe peak; the device peak, the
//     stored working shards) exactly, the host peak within kHostBound;
//   - a configuration the planner says cannot fit is refused by the engine with the same minimum;
//   - bad input: exit 2 and one line naming the key, value or path.
#include "unit/train_run.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <sstream>
#include <vector>

#include "gpt/model.h"
#include "plan/plan.h"
#include "tiermem/error.h"
#include "tiermem/zero_plan.h"

#ifndef TIERMEM_PLAN_BIN
#error "TIERMEM_PLAN_BIN must name the tiermem-plan executable"
#endif

namespace tiermem_train_test {
namespace {

// The host peak's stated bound: the planner counts the pool at what the homes, the NVMe-homed
// caches and the sub-groups in flight can occupy (capped by the budget); the store may evict
// earlier than that, so the measured pool may be lower, never higher. 5 % of the peak.
constexpr double kHostBound = 0.05;
// NVMe bytes streamed per step (optimizer state and gradient partitions a small pool cannot keep):
// the planner's estimate against the run's, relative (mini, 32 MiB host: +9.9 % measured, 32.9 MB
// planned against 30.0; -12.6 % before the parameters were kept at the device, December 2026).
constexpr double kTrafficBound = 0.25;

// Rates are irrelevant to bytes; memory large enough that budgets come from the summary.
const char* kProfile = R"({"name": "test", "compute_gflops": 10, "cpu_adam_params_per_s": 1e8,
  "h2d_gbps": 10, "d2h_gbps": 10, "nvme_read_gbps": 1, "nvme_write_gbps": 1,
  "host_memory_bytes": 17179869184, "nvme_free_bytes": 1099511627776})";

class PlanTest : public TrainBinaryTest {
 protected:
  void SetUp() override {
    TrainBinaryTest::SetUp();
    std::ofstream(dir_ / "profile.json") << kProfile;
    // The two-copy fp32 layout (master beside the working params) some tests were sized for.
    std::ofstream(dir_ / "two_copies.json") << R"({"tiermem": {"fp32_single_copy": false}})";
  }
  RunResult plan(const std::string& args) {
    const std::string out = (dir_ / "plan_out.txt").string(), err = (dir_ / "plan_err.txt").string();
    const std::string cmd = "cd " + dir_.string() + " && " + TIERMEM_PLAN_BIN + " " + args + " >" + out +
                            " 2>" + err;
    const int status = std::system(cmd.c_str());
    RunResult r;
    r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    r.out = slurp(out);
    r.err = slurp(err);
    const auto nl = r.out.find_last_of('\n', r.out.size() >= 2 ? r.out.size() - 2 : 0);
    const std::string last = nl == std::string::npos ? r.out : r.out.substr(nl + 1);
    r.summary = json::parse(last, nullptr, false);
    return r;
  }
  static int lines(const std::string& s) { return static_cast<int>(std::count(s.begin(), s.end(), '\n')); }
};

TEST(PlanActivations, FormulaEqualsTheModelsAllocation) {
  for (const char* name : {"tiny", "mini"}) {
    for (int b : {1, 3}) {
      tiermem::gpt::GptConfig cfg = tiermem::gpt::GptConfig::named(name);
      for (int t : {8, cfg.seq_len}) {
        tiermem::gpt::Model model(cfg, b, t);
        EXPECT_EQ(tiermem::plan::activation_bytes(cfg, b, t), model.activation_bytes()) << name << " " << b << " " << t;
      }
    }
  }
}

TEST_F(PlanTest, BytesPerTierMatchTheEnginesPeaks) {
  for (const std::string offload : {"none", "cpu", "nvme"}) {
    // tiny at the default budgets; mini with budgets (its demo budgets, a quarter and an eighth
    // of its state, are below what --offload none needs: the planner and the engine refuse that).
    for (const std::string model : {"tiny", "mini --host-budget 64MiB --device-budget 64MiB"}) {
      SCOPED_TRACE(model + " --offload " + offload);
      const RunResult t = run("--model " + model + " --seq-len 16 --batch 2 --steps 2 --eval-every 0 --offload " +
                              offload + " --swap-dir swap --json --data " + corpus());
      ASSERT_EQ(t.exit_code, 0) << t.err;
      std::ofstream(dir_ / "run.jsonl") << t.out;
      const RunResult c = plan("--check run.jsonl --profile profile.json --json");
      ASSERT_EQ(c.exit_code, 0) << c.err;
      ASSERT_TRUE(c.summary.is_object()) << c.out;
      const json& j = c.summary;
      // State: exactly.
      EXPECT_EQ(j["nvme_peak_bytes_predicted"].get<double>(), j["nvme_peak_bytes_measured"].get<double>());
      EXPECT_EQ(j["device_peak_bytes_predicted"].get<double>(), j["device_peak_bytes_measured"].get<double>());
      if (offload == "nvme") {
        EXPECT_GT(j["nvme_peak_bytes_measured"].get<double>(), 0);
      }
      if (offload == "none") {
        EXPECT_EQ(j["nvme_peak_bytes_measured"].get<double>(), 0);
      }
      // Host (state + workspace): within the stated bound.
      EXPECT_LE(j["host_peak_bytes_rel_error"].get<double>(), kHostBound)
          << "predicted " << j["host_peak_bytes_predicted"] << " measured " << j["host_peak_bytes_measured"];
      // Every compared field is there, as the issue names them.
      for (const char* f : {"step_seconds", "compute_share", "io_wait_share", "communication_share",
                            "optimizer_share"}) {
        EXPECT_TRUE(j.contains(std::string(f) + "_predicted") && j.contains(std::string(f) + "_measured") &&
                    j.contains(std::string(f) + "_rel_error"))
            << f;
      }
      EXPECT_GT(j["step_seconds_predicted"].get<double>(), 0);
    }
  }
}

// offload_optimizer.ratio < 1 (a config both programs read): the device holds its share of the
// optimizer state beside the working shards; the planner's device and NVMe peaks equal the run's.
TEST_F(PlanTest, PartialOffloadPeaksMatchThePlan) {
  std::ofstream(dir_ / "ratio.json") << R"({"zero_optimization": {"stage": 3,
    "offload_optimizer": {"device": "nvme", "nvme_path": "swap", "ratio": 0.5},
    "offload_param": {"device": "nvme", "nvme_path": "swap"}}})";
  const RunResult t = run("--model mini --host-budget 64MiB --device-budget 64MiB --seq-len 16 --batch 2 --steps 2 "
                          "--eval-every 0 --offload nvme --config ratio.json --swap-dir swap --json --data " + corpus());
  ASSERT_EQ(t.exit_code, 0) << t.err;
  EXPECT_NE(t.err.find("offload_optimizer.ratio 0.5"), std::string::npos) << t.err;
  std::ofstream(dir_ / "run.jsonl") << t.out;
  const RunResult c = plan("--check run.jsonl --config ratio.json --profile profile.json --json");
  ASSERT_EQ(c.exit_code, 0) << c.err;
  const json& j = c.summary;
  ASSERT_TRUE(j.is_object()) << c.out;
  EXPECT_EQ(j["device_peak_bytes_predicted"].get<double>(), j["device_peak_bytes_measured"].get<double>());
  EXPECT_EQ(j["nvme_peak_bytes_predicted"].get<double>(), j["nvme_peak_bytes_measured"].get<double>());
  EXPECT_LE(j["host_peak_bytes_rel_error"].get<double>(), kHostBound);
}

// A host pool smaller than the NVMe-homed state: what the planner says streams from NVMe each
// step (the optimizer state and gradient partitions the pool's planned room cannot keep; the
// working params stay on the device) against what the run moves once steady. The bound is the
// stated one of docs/plan.md: the engine's Belady plan keeps a little less than the planner's room.
TEST_F(PlanTest, StreamedOptimizerStateMatchesTheRunsTraffic) {
  const std::string flags = "--model mini --host-budget 32MiB --seq-len 32 --batch 2 --offload nvme";
  const RunResult t = run(flags + " --steps 8 --eval-every 0 --swap-dir swap --json --data " + corpus());
  ASSERT_EQ(t.exit_code, 0) << t.err;
  std::vector<double> reads;  // steps 4..8: the trace replayed, the pool settled
  std::istringstream in(t.out);
  for (std::string line; std::getline(in, line);) {
    const json j = json::parse(line, nullptr, false);
    if (j.is_object() && j.contains("step") && j["step"].get<int>() >= 4) {
      reads.push_back(j["moved_bytes"].value("nvme->host", 0.0));
    }
  }
  ASSERT_EQ(reads.size(), 5u) << t.out;
  // The least of them: the steady step without the re-reads that timing adds to some steps (a
  // prefetch that finds no room yet is dropped and read again at its use). Here idle, steps 4..8
  // read 30.0-37.4 MB, median 33.1 MB, with this round's engine as with the previous round's; under
  // ctest -j 2 the median once reached 36.3 MB, past the bound.
  std::sort(reads.begin(), reads.end());
  const double measured = reads[0];
  ASSERT_GT(measured, 0) << "the pool was meant to be too small for the state";
  const RunResult p = plan(flags + " --profile profile.json --json");
  ASSERT_EQ(p.exit_code, 0) << p.err;
  const double predicted = p.summary["traffic_bytes"]["nvme_read"].get<double>();
  EXPECT_NEAR(predicted / measured, 1.0, kTrafficBound) << "predicted " << predicted << ", measured " << measured;
}

// Several ranks under mpirun (ZeroEngine stage 3 over MPI, each rank its own shard): rank 0's
// peaks, as the summary reports them, against the plan at that world size — the state exactly
// (NVMe; the device: the store's shards plus the one all-gathered module tiermem-train holds at a
// time), the host within kHostBound (the engine buffers: one reduce-scatter bucket at a time
// without overlap_comm). World 3 pads every shard.
TEST_F(PlanTest, RanksPeaksMatchThePlanAtTheirWorldSize) {
  if (std::system("command -v mpirun >/dev/null 2>&1") != 0) GTEST_SKIP() << "no mpirun";
  struct Case {
    int world;
    std::string offload;
  } cases[] = {{2, "none"}, {2, "cpu"}, {2, "nvme"}, {3, "nvme"}};
  for (const Case& c : cases) {
    SCOPED_TRACE("-np " + std::to_string(c.world) + " --offload " + c.offload);
    const RunResult t = run("--model tiny --seq-len 16 --batch 2 --steps 2 --eval-every 0 --offload " + c.offload +
                                " --swap-dir swap --json --data " + corpus(),
                            "mpirun --allow-run-as-root --oversubscribe -np " + std::to_string(c.world) + " env");
    ASSERT_EQ(t.exit_code, 0) << t.err;
    ASSERT_TRUE(t.summary.is_object()) << t.out;
    ASSERT_EQ(t.summary["world_size"].get<int>(), c.world);
    std::ofstream(dir_ / "run.jsonl") << t.out;
    const RunResult k = plan("--check run.jsonl --profile profile.json --json");
    ASSERT_EQ(k.exit_code, 0) << k.err;
    const json& j = k.summary;
    EXPECT_EQ(j["nvme_peak_bytes_predicted"].get<double>(), j["nvme_peak_bytes_measured"].get<double>());
    EXPECT_EQ(j["device_peak_bytes_predicted"].get<double>(), j["device_peak_bytes_measured"].get<double>());
    EXPECT_GT(j["device_peak_bytes_measured"].get<double>(), 0);
    if (c.offload == "nvme") {
      EXPECT_GT(j["nvme_peak_bytes_measured"].get<double>(), 0);
    }
    EXPECT_LE(j["host_peak_bytes_rel_error"].get<double>(), kHostBound)
        << "predicted " << j["host_peak_bytes_predicted"] << " measured " << j["host_peak_bytes_measured"];
    // The plan of one rank of this world is not the plan of one rank alone.
    const RunResult one = plan("--model tiny --seq-len 16 --batch 2 --offload " + c.offload + " --json");
    ASSERT_EQ(one.exit_code, 0) << one.err;
    if (c.offload == "nvme") {
      EXPECT_LT(j["nvme_peak_bytes_predicted"].get<double>(), one.summary["nvme_peak_bytes"].get<double>());
    }
  }
}

TEST_F(PlanTest, WhatThePlannerRefusesTheEngineRefusesWithTheSameMinimum) {
  struct Case {
    std::string base, too_small, tier;  // tier: which minimum ("host" or "device")
    bool runs_at_min = true;            // raising that one budget to its minimum is enough
  } cases[] = {
      {"--model tiny --seq-len 16 --offload cpu", "--host-budget 16KiB", "host"},
      // The mini demo's own budgets (a quarter and an eighth of its state) with --offload none,
      // which keeps the optimizer state in host memory (then the device budget is short too).
      {"--model mini --seq-len 16 --offload none", "", "host", false},
      // Every working shard homed on the device, more than the budget (but above the largest
      // tensor, which tiermem-train checks itself before the engine).
      {"--model tiny --seq-len 16 --offload none", "--device-budget 96KiB", "device"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.base + " " + c.too_small);
    const RunResult p = plan(c.base + " " + c.too_small + " --profile profile.json --json");
    EXPECT_EQ(p.exit_code, 1) << p.out << p.err;
    ASSERT_TRUE(p.summary.is_object()) << p.out;
    EXPECT_FALSE(p.summary["fits"].get<bool>());
    const std::uint64_t min = p.summary[c.tier + "_min_bytes"].get<std::uint64_t>();
    EXPECT_GT(min, p.summary[c.tier + "_budget_bytes"].get<std::uint64_t>());
    EXPECT_NE(p.summary["fix"].get<std::string>().find(std::to_string(min)), std::string::npos) << p.summary["fix"];

    const RunResult t = run(c.base + " " + c.too_small + " --steps 1 --swap-dir swap --data " + corpus());
    EXPECT_EQ(t.exit_code, 2) << t.err;
    EXPECT_NE(t.err.find("is below the " + tiermem::format_bytes(min)), std::string::npos)
        << "planner minimum " << tiermem::format_bytes(min) << "; engine said: " << t.err;

    // At the planner's minimum, both run.
    if (!c.runs_at_min) continue;
    const std::string at_min = c.base + " --" + c.tier + "-budget " + std::to_string(min);
    const RunResult pok = plan(at_min + " --profile profile.json --json");
    EXPECT_EQ(pok.exit_code, 0) << pok.out << pok.err;
    const RunResult ok = run(at_min + " --steps 1 --swap-dir swap --data " + corpus());
    EXPECT_EQ(ok.exit_code, 0) << ok.err;
  }
}

TEST_F(PlanTest, BadInputExitsTwoWithOneLineNamingIt) {
  struct Case {
    std::string args, file, content, names;
  } cases[] = {
      {"--model nosuch --profile profile.json", "", "", "nosuch"},
      {"--model gpt2 --profile bad.json", "bad.json", "{not json", "bad.json"},
      {"--model gpt2 --profile p.json", "p.json", R"({"compute_gflops": 1})", "cpu_adam_params_per_s"},
      {"--model gpt2 --profile p.json", "p.json",
       R"({"compute_gflops": -3, "cpu_adam_params_per_s": 1, "h2d_gbps": 1, "nvme_read_gbps": 1,
           "nvme_write_gbps": 1, "host_memory_bytes": 1})",
       "compute_gflops"},
      {"--model gpt2 --profile missing.json", "", "", "missing.json"},
      {"--check nosummary.txt --profile profile.json", "nosummary.txt", "hello\n", "nosummary.txt"},
      {"--model gpt2 --batch 0", "", "", "--batch"},
      {"--model gpt2 --host-budget lots", "", "", "lots"},
      {"--model gpt2 --layers 3", "", "", "--layers"},
      {"--model gpt2 --no-such-flag", "", "", "no-such-flag"},
      // What tiermem-train refuses, the planner refuses too (it plans that run).
      {"--model mini --device-budget 0", "", "", "--device-budget"},
      {"--model mini --vocab 100", "", "", "--vocab = 100"},
      {"--model mini --swap-dir afile/swap", "afile", "x", "'afile' is a file"},
      {"--model custom --layers 5000 --d-model 64", "", "", "--layers"},
      {"--model custom --layers five --d-model 64", "", "", "--layers: 'five' is not a whole number"},
      {"--model custom --layers 2.5 --d-model 64", "", "", "--layers: '2.5' is not a whole number"},
      {"--model mini --host-budget 100TiB", "", "", "cannot reserve the 200.0 TiB of address space"},
      {"--model mini --data nonexistent.txt", "", "", "nonexistent.txt"},
      {"--model mini --config sg.json", "sg.json", R"({"zero_optimization": {"stage": 3, "sub_group_size": 10}})",
       "'zero_optimization.sub_group_size' = 10 is smaller than the shard alignment of 1024"},
      {"--model mini --config lion.json", "lion.json",
       R"({"zero_optimization": {"stage": 3}, "optimizer": {"type": "Lion"}, "tiermem": {"device_optimizer": "on"}})",
       "tiermem.device_optimizer \"on\" steps AdamW on the device"},
      {"--model mini --config ratio.json", "ratio.json",
       R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}},
           "optimizer": {"type": "Adagrad"}})",
       "offload_optimizer.ratio < 1 steps part of the state on the device, which runs AdamW only"},
      {"--model gpt2 --profile .", "", "", "is a directory"},
      {"--model gpt2 --profile /dev/null", "", "", "is not a regular file"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.args);
    if (!c.file.empty()) std::ofstream(dir_ / c.file) << c.content;
    const RunResult r = plan(c.args);
    EXPECT_EQ(r.exit_code, 2) << r.out << r.err;
    EXPECT_EQ(lines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find(c.names), std::string::npos) << r.err;
  }
}

// A host budget above this machine's memory bounds nothing: planned, with the engine's warning.
TEST_F(PlanTest, AHostBudgetAboveThisMachinesMemoryIsWarnedAbout) {
  const std::uint64_t phys = tiermem::physical_memory_bytes();
  if (phys == 0) GTEST_SKIP() << "the OS does not say how much memory this machine has";
  const RunResult r = plan("--model mini --profile profile.json --host-budget " + std::to_string(phys + (1ull << 30)));
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("tiermem-plan: warning: --host-budget"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("is more than this machine's memory"), std::string::npos) << r.err;
  const RunResult fine = plan("--model mini --profile profile.json --host-budget 64MiB");
  EXPECT_EQ(fine.err.find("warning"), std::string::npos) << fine.err;
}

// --check plans the run its summary describes, and only that: flags describing another run are
// refused, and so is a summary whose stage or homes the plan does not reproduce (a run made with a
// --config the check was not given); measured figures no run produces, a summary line that is not
// JSON, and a directory are bad input, named; a one-step run is checked with a note.
TEST_F(PlanTest, CheckHoldsTheSummarysOwnRunAndRefusesBadOnes) {
  const RunResult t = run("--model tiny --seq-len 16 --batch 2 --steps 2 --eval-every 0 --offload nvme "
                          "--swap-dir swap --json --data " + corpus());
  ASSERT_EQ(t.exit_code, 0) << t.err;
  std::ofstream(dir_ / "run.jsonl") << t.out;
  ASSERT_EQ(plan("--check run.jsonl --profile profile.json").exit_code, 0);
  const json good = t.summary;
  ASSERT_TRUE(good.contains("plan_inputs")) << t.out;

  const RunResult flag = plan("--check run.jsonl --profile profile.json --model gpt2");
  EXPECT_EQ(flag.exit_code, 2);
  EXPECT_NE(flag.err.find("--model = gpt2: --check reads the run's model"), std::string::npos) << flag.err;

  struct Case {
    const char* what;
    std::function<void(json&)> edit;
    std::string names;
  } cases[] = {
      {"homes", [](json& s) { s["optimizer_offload"] = "host"; }, "give --check the run's own --config"},
      {"negative step", [](json& s) { s["step_seconds"] = -1.0; }, "summary.step_seconds = -1.0"},
      {"share", [](json& s) { s["compute_share"] = 2.5; }, "summary.compute_share = 2.5"},
      {"peak", [](json& s) { s["host_peak_bytes"] = -5; }, "summary.host_peak_bytes = -5"},
      {"layers", [](json& s) { s["plan_inputs"]["n_layer"] = 1000000000000LL; }, "summary.plan_inputs.n_layer"},
      {"context", [](json& s) { s["plan_inputs"]["seq_len"] = s["plan_inputs"]["context"].get<int>() + 1; },
       "exceeds the model's context"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    json s = good;
    c.edit(s);
    std::ofstream(dir_ / "edited.jsonl") << json{{"summary", s}}.dump() << "\n";
    const RunResult r = plan("--check edited.jsonl --profile profile.json");
    EXPECT_EQ(r.exit_code, 2) << r.out;
    EXPECT_EQ(lines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find(c.names), std::string::npos) << r.err;
  }
  std::ofstream(dir_ / "truncated.jsonl") << t.out.substr(0, t.out.size() / 2);
  const RunResult cut = plan("--check truncated.jsonl --profile profile.json");
  EXPECT_EQ(cut.exit_code, 2);
  EXPECT_NE(cut.err.find("truncated.jsonl: line "), std::string::npos) << cut.err;
  EXPECT_NE(cut.err.find("not valid JSON"), std::string::npos) << cut.err;
  const RunResult dir = plan("--check . --profile profile.json");
  EXPECT_EQ(dir.exit_code, 2);
  EXPECT_NE(dir.err.find("is a directory"), std::string::npos) << dir.err;

  std::ofstream(dir_ / "empty_summary.jsonl") << R"({"summary": {}})" << "\n";  // was "no {"summary": ...} object"
  const RunResult empty = plan("--check empty_summary.jsonl --profile profile.json");
  EXPECT_EQ(empty.exit_code, 2);
  EXPECT_NE(empty.err.find("no 'model' field of a tiermem-train --json summary"), std::string::npos) << empty.err;

  json one = good;
  one["steps"] = 1;
  std::ofstream(dir_ / "one.jsonl") << json{{"summary", one}}.dump() << "\n";
  const RunResult o = plan("--check one.jsonl --profile profile.json");
  EXPECT_EQ(o.exit_code, 0) << o.err;
  EXPECT_NE(o.err.find("has 1 step(s)"), std::string::npos) << o.err;
  // The text table signs the error and gives bytes in binary units.
  EXPECT_NE(o.out.find("MiB"), std::string::npos) << o.out;
}

// A model given by its modules (a tiermem.torch run's summary: plan_inputs.modules, frozen,
// flops_per_token, head_tied) is priced as tiermem-train's GPT of the same modules and FLOPs, less
// the trainer's gradient buffers and activations (its framework's memory, not the engine's); a
// frozen module has no optimizer state or gradient, and its shard leaves the host pool once
// written; bad module lists are bad input, named.
TEST_F(PlanTest, AModelGivenByItsModulesIsPricedAsTheSameGpt) {
  const RunResult t = run("--model tiny --seq-len 16 --batch 2 --steps 2 --eval-every 0 --offload nvme "
                          "--swap-dir swap --json --data " + corpus());
  ASSERT_EQ(t.exit_code, 0) << t.err;
  std::ofstream(dir_ / "run.jsonl") << t.out;
  const RunResult own = plan("--check run.jsonl --profile profile.json --json");
  ASSERT_EQ(own.exit_code, 0) << own.err;

  tiermem::gpt::GptConfig g = tiermem::gpt::GptConfig::named("tiny");
  const json& in = t.summary["plan_inputs"];
  g.n_layer = in["n_layer"].get<int>();
  g.n_head = in["n_head"].get<int>();
  g.d_model = in["d_model"].get<int>();
  g.seq_len = in["context"].get<int>();
  g.vocab_size = in["vocab"].get<int>();
  json modules = json::array();
  for (const auto& l : tiermem::gpt::module_layouts(g)) modules.push_back(l.numel);
  json given = t.summary;
  given["plan_inputs"]["modules"] = modules;
  given["plan_inputs"]["flops_per_token"] = tiermem::gpt::flops_per_token(g, in["seq_len"].get<int>());
  std::ofstream(dir_ / "given.jsonl") << json{{"summary", given}}.dump() << "\n";
  const RunResult r = plan("--check given.jsonl --profile profile.json --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json& a = own.summary["prediction"];
  const json& b = r.summary["prediction"];
  EXPECT_NEAR(b["step_seconds"].get<double>(), a["step_seconds"].get<double>(), 1e-9);
  EXPECT_EQ(b["nvme_peak_bytes"], a["nvme_peak_bytes"]);
  EXPECT_EQ(b["device_peak_bytes"], a["device_peak_bytes"]);
  EXPECT_EQ(b["host_peak_parts"]["pool"], a["host_peak_parts"]["pool"]);
  EXPECT_EQ(b["host_peak_parts"]["gradient_buffers"], 0);
  EXPECT_EQ(b["host_peak_parts"]["activations"], 0);
  EXPECT_EQ(b["host_peak_bytes"].get<std::uint64_t>(),
            a["host_peak_bytes"].get<std::uint64_t>() - a["host_peak_parts"]["gradient_buffers"].get<std::uint64_t>() -
                a["host_peak_parts"]["activations"].get<std::uint64_t>());

  // The last block frozen: its optimizer state off NVMe (12 bytes an element less the fp32 master
  // its working shard holds, tiermem.fp32_single_copy's default) and its gradient partition where
  // that is homed on NVMe, at the optimizer shard's 1024-element alignment; less to step.
  json frozen = given;
  std::vector<bool> f(modules.size(), false);
  f[modules.size() - 2] = true;
  frozen["plan_inputs"]["frozen"] = f;
  std::ofstream(dir_ / "frozen.jsonl") << json{{"summary", frozen}}.dump() << "\n";
  const RunResult fr = plan("--check frozen.jsonl --profile profile.json --json");
  ASSERT_EQ(fr.exit_code, 0) << fr.err;
  const std::uint64_t block = modules[modules.size() - 2].get<std::uint64_t>();
  const std::uint64_t per_elem = 8 + (a["homes"]["gradients"] == "nvme" ? 4 : 0);
  EXPECT_EQ(a["nvme_peak_bytes"].get<std::uint64_t>() - fr.summary["prediction"]["nvme_peak_bytes"].get<std::uint64_t>(),
            per_elem * ((block + 1023) / 1024 * 1024));
  EXPECT_LT(fr.summary["prediction"]["time_seconds"]["adam"].get<double>(), a["time_seconds"]["adam"].get<double>());
  // A frozen module's working shard stays in the host pool only while it is written at
  // registration (the engine evicts it then): with two frozen blocks the pool holds the larger of
  // their shards, not both, beside the other modules' state.
  json frozen2 = frozen;
  f[modules.size() - 3] = true;
  frozen2["plan_inputs"]["frozen"] = f;
  std::ofstream(dir_ / "frozen2.jsonl") << json{{"summary", frozen2}}.dump() << "\n";
  const RunResult fr2 = plan("--check frozen2.jsonl --profile profile.json --json");
  ASSERT_EQ(fr2.exit_code, 0) << fr2.err;
  const json& p1 = fr.summary["prediction"];
  const json& p2 = fr2.summary["prediction"];
  ASSERT_LT(p1["host_peak_parts"]["pool"].get<std::uint64_t>(), p1["host_budget_bytes"].get<std::uint64_t>());
  // The pool loses the second block's shard and its optimizer state (what leaves NVMe), and its
  // gradient partition where that is homed in host memory (a page-rounded home).
  const std::uint64_t aligned = (block + 1023) / 1024 * 1024;
  const std::uint64_t drop = p1["host_peak_parts"]["pool"].get<std::uint64_t>() -
                             p2["host_peak_parts"]["pool"].get<std::uint64_t>();
  const std::uint64_t state = p1["nvme_peak_bytes"].get<std::uint64_t>() - p2["nvme_peak_bytes"].get<std::uint64_t>();
  EXPECT_GE(drop, 4 * aligned + state);
  EXPECT_LE(drop, 4 * aligned + state + (a["homes"]["gradients"] == "host" ? 4 * aligned + 4096 : 0));

  struct Case {
    const char* what;
    std::function<void(json&)> edit;
    std::string names;
  } cases[] = {
      {"not a list", [](json& s) { s["plan_inputs"]["modules"] = 5; }, "summary.plan_inputs.modules = 5"},
      {"a zero", [](json& s) { s["plan_inputs"]["modules"][1] = 0; }, "summary.plan_inputs.modules[1] = 0"},
      {"frozen length", [](json& s) { s["plan_inputs"]["frozen"] = {true}; }, "summary.plan_inputs.frozen"},
      {"no flops", [](json& s) { s["plan_inputs"].erase("flops_per_token"); }, "summary.plan_inputs.flops_per_token"},
      {"head", [](json& s) { s["plan_inputs"]["head_tied"] = 1; }, "summary.plan_inputs.head_tied = 1"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    json s = given;
    c.edit(s);
    std::ofstream(dir_ / "edited.jsonl") << json{{"summary", s}}.dump() << "\n";
    const RunResult e = plan("--check edited.jsonl --profile profile.json");
    EXPECT_EQ(e.exit_code, 2) << e.out;
    EXPECT_EQ(lines(e.err), 1) << e.err;
    EXPECT_NE(e.err.find(c.names), std::string::npos) << e.err;
  }
}

// The update running ahead of its gather (one rank, a SimDevice: UpdateScheduler::start_ahead)
// runs beside the previous module's forward compute: the gathers wait for each update's excess
// over the compute it ran beside (the embedding's and the first block's whole, as nothing computes
// before them), and that wait is the optimizer time; the compute beside it takes no longer (a
// traced gpt2 run's forward blocks did not). gpt2's blocks at two AdamW rates: below and above a
// block's forward compute.
// offload_param cpu on the simulated device (the CPU addresses it): a frozen module is read in
// place at its host home (DeviceStaging::gather_tier), so the plan gives it no device room and no
// host->device traffic; the same modules trained do take both.
TEST(PlanFrozen, AFrozenModuleHomedOnTheHostOfTheSimulatedDeviceTakesNoDeviceRoomAndMovesNothing) {
  using tiermem::plan::Prediction;
  const tiermem::plan::MachineProfile m = tiermem::plan::parse_profile(json::parse(kProfile), "test");
  constexpr std::size_t kNumel = 1 << 20;  // 4 MiB of fp32 working params each
  auto predict = [&](bool frozen) {
    tiermem::plan::RunShape run;
    run.model = tiermem::gpt::GptConfig::named("tiny");
    run.batch = 1;
    run.seq_len = 16;
    run.modules.numels = {kNumel, kNumel, kNumel};
    run.modules.frozen = {frozen, frozen, false};
    run.modules.head_tied = false;
    run.config = tiermem::parse_config(R"({"train_micro_batch_size_per_gpu": 1,
      "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
        "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
      "tiermem": {"host_budget_bytes": "1GiB", "device_budget_bytes": "256MiB"}})");
    return tiermem::plan::predict(run, m);
  };
  const Prediction trained = predict(false), lora = predict(true);
  const std::uint64_t two = 2 * 4 * kNumel;
  EXPECT_EQ(trained.device_peak_bytes - lora.device_peak_bytes, two) << "the frozen modules' device copies";
  EXPECT_GE(trained.h2d_bytes, lora.h2d_bytes + two) << "the frozen modules' copies to the device";
}

TEST_F(PlanTest, TheUpdateAheadWaitsOnlyForWhatTheComputeBesideItLeaves) {
  tiermem::gpt::GptConfig gpt2 = tiermem::gpt::GptConfig::named("gpt2");
  gpt2.vocab_size = 256;
  const auto layouts = tiermem::gpt::module_layouts(gpt2);
  const double embed = static_cast<double>(layouts.at(0).numel), block = static_cast<double>(layouts.at(1).numel),
               ln_f = static_cast<double>(layouts.back().numel);
  const double total = embed + gpt2.n_layer * block + ln_f;
  for (const double rate : {2e8, 4e7}) {
    SCOPED_TRACE(rate);
    json prof = json::parse(kProfile);
    prof["optimizer_params_per_s"] = rate;
    std::ofstream(dir_ / "ahead.json") << prof.dump();
    // Every module's state in a 4 GiB pool: no reads, the updates' AdamW alone.
    const RunResult r = plan("--model gpt2 --seq-len 64 --batch 1 --offload nvme --host-budget 4GiB "
                             "--device-budget 1GiB --config two_copies.json --profile ahead.json --json");
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const json& t = r.summary["time_seconds"];
    ASSERT_EQ(r.summary["traffic_bytes"]["nvme_read"].get<double>(), 0);
    const double adam = t["adam"].get<double>(), wait = t["optimizer"].get<double>();
    const double c = t["compute"].get<double>() / 3.0 * block / (total - embed);  // one block's forward
    const double a = adam * block / total;
    double expected = adam * (embed + block) / total;
    for (int i = 2; i <= gpt2.n_layer; ++i) expected += std::max(0.0, a - c);
    expected += std::max(0.0, adam * ln_f / total - c);
    EXPECT_NEAR(wait, expected, 1e-9);
    EXPECT_EQ(a > c, rate < 1e8) << "the two rates were meant to fall either side of a block's compute";
    EXPECT_NEAR(r.summary["step_seconds"].get<double>(),
                t["compute"].get<double>() + wait + t["gradient_handoff"].get<double>(), 1e-9);
  }
}

// When the optimizer state and the parameters are on NVMe already, the smallest fix does not
// say to offload them: the host's working set is what is too big.
TEST_F(PlanTest, SmallestFixWhenEverythingIsOnNvmeAlready) {
  const RunResult p = plan("--model custom --layers 2 --d-model 16384 --heads 128 --offload nvme "
                           "--profile profile.json --json");
  EXPECT_EQ(p.exit_code, 1) << p.out << p.err;
  ASSERT_TRUE(p.summary.is_object()) << p.out;
  const std::string fix = p.summary["fix"].get<std::string>();
  EXPECT_EQ(fix.find("offload the"), std::string::npos) << fix;
  EXPECT_NE(fix.find("nothing more can move to NVMe"), std::string::npos) << fix;
}

// A host budget below its minimum: the error names the move to NVMe only for what the host
// homes (with both on NVMe already, raising the budget is the fix; small persistent modules stay).
TEST_F(PlanTest, HostBudgetErrorSuggestsNvmeOnlyForWhatTheHostHomes) {
  const RunResult nvme = plan("--model gpt2 --offload nvme --host-budget 1MiB --json");
  EXPECT_EQ(nvme.exit_code, 1) << nvme.out << nvme.err;
  ASSERT_TRUE(nvme.summary.is_object()) << nvme.out;
  const std::string why_nvme = nvme.summary["why"].get<std::string>();
  EXPECT_NE(why_nvme.find("raise tiermem.host_budget_bytes (tiermem-train --host-budget) to at least"), std::string::npos)
      << why_nvme;
  EXPECT_EQ(why_nvme.find("on NVMe ("), std::string::npos) << why_nvme;
  const RunResult cpu = plan("--model gpt2 --offload cpu --host-budget 1MiB --json");
  EXPECT_EQ(cpu.exit_code, 1) << cpu.out << cpu.err;
  ASSERT_TRUE(cpu.summary.is_object()) << cpu.out;
  const std::string why_cpu = cpu.summary["why"].get<std::string>();
  EXPECT_NE(why_cpu.find("or home parameters and optimizer state on NVMe (offload_param and offload_optimizer "
                         "device \"nvme\"; --offload nvme)"),
            std::string::npos)
      << why_cpu;
}

// Both budgets too small: both said at once (the device's showed only after the host's was fixed),
// and the largest model says it raised them.
TEST_F(PlanTest, BothBudgetsBelowTheirMinimumsAreSaidTogether) {
  const RunResult p = plan("--model gpt2 --offload none --host-budget 64MiB --device-budget 1KiB --json");
  EXPECT_EQ(p.exit_code, 1) << p.out << p.err;
  ASSERT_TRUE(p.summary.is_object()) << p.out;
  const std::string why = p.summary["why"].get<std::string>(), fix = p.summary["fix"].get<std::string>();
  EXPECT_NE(why.find("host budget 64.0 MiB"), std::string::npos) << why;
  EXPECT_NE(why.find("; and the device budget 1.0 KiB (tiermem.device_budget_bytes) is below"), std::string::npos) << why;
  EXPECT_NE(why.find("raise tiermem.device_budget_bytes (tiermem-train --device-budget) to at least"), std::string::npos) << why;
  EXPECT_NE(fix.find("raise the host budget"), std::string::npos) << fix;
  EXPECT_NE(fix.find("; and raise the device budget"), std::string::npos) << fix;
  const RunResult text = plan("--model gpt2 --offload none --host-budget 64MiB --device-budget 1KiB");
  EXPECT_NE(text.out.find("at this configuration, budgets raised to their minimums"), std::string::npos) << text.out;
}

TEST_F(PlanTest, PlanNamesTheBottleneckAndTheLargestModel) {
  json fast = json::parse(kProfile);
  fast["compute_gflops"] = 1e5;  // compute out of the way: the NVMe link must be the bottleneck
  fast["nvme_read_gbps"] = 0.5;
  fast["nvme_write_gbps"] = 0.5;
  std::ofstream(dir_ / "fast.json") << fast.dump();
  const RunResult r = plan("--model gpt2 --offload nvme --config two_copies.json --profile fast.json --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json& j = r.summary;
  ASSERT_TRUE(j.is_object()) << r.out;
  EXPECT_TRUE(j["fits"].get<bool>());
  EXPECT_FALSE(j["bottleneck"].get<std::string>().empty());
  const json& t = j["time_seconds"];
  // gpt2's working params stay on the 1 GiB sim device; the optimizer state and gradient partitions
  // the 1 GiB host pool cannot keep (~0.37 GB) go to NVMe and back each step: at 0.5 GB/s each way
  // (~1.5 s) the link dominates Adam at 1e8 params/s (0.86 s).
  EXPECT_EQ(j["bottleneck"], "nvme") << t;
  EXPECT_GT(j["largest_model"]["params"].get<double>(), j["params"].get<double>());
  tiermem::gpt::GptConfig gpt2 = tiermem::gpt::GptConfig::named("gpt2");
  gpt2.vocab_size = 256;  // text data: byte-level, as tiermem-train
  EXPECT_EQ(j["params"].get<std::int64_t>(), tiermem::gpt::num_params(gpt2));
  EXPECT_GT(j["tokens_per_s"].get<double>(), 0);
  // Without a profile: bytes only.
  const RunResult m = plan("--model gpt2 --offload nvme --config two_copies.json --json");
  ASSERT_EQ(m.exit_code, 0) << m.err;
  EXPECT_EQ(m.summary["nvme_peak_bytes"], j["nvme_peak_bytes"]);
  EXPECT_FALSE(m.summary.contains("step_seconds"));
  // The config's tiermem.machine_profile (the file tiermem-train prices its I/O bound with) is
  // the profile when --profile is not given; --profile wins over it.
  std::ofstream(dir_ / "with_profile.json")
      << R"({"tiermem": {"fp32_single_copy": false, "machine_profile": "fast.json"}})";
  const RunResult c = plan("--model gpt2 --offload nvme --config with_profile.json --json");
  ASSERT_EQ(c.exit_code, 0) << c.err;
  EXPECT_EQ(c.summary["step_seconds"], j["step_seconds"]);
  EXPECT_EQ(c.summary["bottleneck"], "nvme");
  const RunResult w = plan("--model gpt2 --offload nvme --config with_profile.json --profile profile.json --json");
  ASSERT_EQ(w.exit_code, 0) << w.err;
  EXPECT_NE(w.summary["step_seconds"], j["step_seconds"]);
  // The config's profile is read as tiermem-train reads it: a missing one is refused naming the
  // key (--profile given or not); one with only the NVMe rates (enough for tiermem-train) plans
  // bytes only, with a note.
  std::ofstream(dir_ / "missing_profile.json") << R"({"tiermem": {"machine_profile": "nosuch.json"}})";
  for (const char* extra : {"", " --profile profile.json"}) {
    const RunResult r = plan(std::string("--model gpt2 --config missing_profile.json --json") + extra);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_NE(r.err.find("config key 'tiermem.machine_profile' = \"nosuch.json\": cannot read"), std::string::npos)
        << r.err;
  }
  std::ofstream(dir_ / "rates.json") << R"({"profile": {"nvme_read_gbps": 1.5, "nvme_write_gbps": 1.2}})";
  std::ofstream(dir_ / "rates_only.json") << R"({"tiermem": {"machine_profile": "rates.json"}})";
  const RunResult b = plan("--model gpt2 --config rates_only.json --json");
  ASSERT_EQ(b.exit_code, 0) << b.err;
  EXPECT_NE(b.err.find("is not a full machine profile"), std::string::npos) << b.err;
  EXPECT_FALSE(b.summary.contains("step_seconds"));
}

// A host budget whose room is below the largest working shard: the engine streams that shard
// through its bounce buffers (tiermem-train runs it), and the planner predicts its time too
// (its tier simulation refused it as "out of host memory", exit 2).
TEST_F(PlanTest, AHostRoomBelowTheLargestShardStillPredictsTime) {
  const RunResult r = plan("--model mini --offload nvme --device-budget 64MiB --host-budget 4MiB --profile profile.json --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_GT(r.summary["step_seconds"].get<double>(), 0) << r.out;
}

// The overlapped optimizer step with a pool too small for the optimizer state: the reads of what
// the pool cannot keep wait for room the forward frees (and for the write-backs of updated state
// that make it), so the last modules' state arrives after its update is due (optimizer_wait > 0,
// part of the optimizer's time as tiermem-train counts it) even
// where the whole forward is longer than the reads; with a pool that keeps everything there is
// no wait. On the simulated device each NVMe byte's checksum
// is priced at checksum_gbps spread over the profile's threads, and only with tiermem.checksum on.
TEST_F(PlanTest, GatedReadsAndChecksumsPriceTheOverlappedNvmeStep) {
  const std::string args =
      "--model gpt2 --seq-len 64 --batch 1 --offload nvme --device-budget 1GiB --config two_copies.json --json ";
  const RunResult small = plan(args + "--host-budget 1GiB --profile profile.json");
  ASSERT_EQ(small.exit_code, 0) << small.err;
  const json& t = small.summary["time_seconds"];
  const double read = small.summary["traffic_bytes"]["nvme_read"].get<double>();
  ASSERT_GT(read, 0) << "1 GiB of pool was meant to be too small for gpt2's optimizer state";
  // The forward (compute / 3 at 10 GFLOP/s, plus AdamW) is far longer than reading it all at 1 GB/s:
  EXPECT_GT(t["compute"].get<double>() / 3.0, read / 1e9);
  EXPECT_GT(t["optimizer_wait"].get<double>(), 0);
  // At most reading all of it, and writing all of it back, after the forward:
  const double written = small.summary["traffic_bytes"]["nvme_write"].get<double>();
  EXPECT_LE(t["optimizer_wait"].get<double>(), (read + written) / 1e9 + 1e-9);
  EXPECT_EQ(t["checksum"].get<double>(), 0);  // the profile has no checksum_gbps
  // The updated state's write-backs that make room for the later reads share the drive with
  // them (a trace of gpt2 at the default budgets shows the forward's reads slowed by them): a drive that writes 100 times faster makes the forward wait less.
  json fast_write = json::parse(kProfile);
  fast_write["nvme_write_gbps"] = 100.0;
  std::ofstream(dir_ / "fastwrite.json") << fast_write.dump();
  const RunResult fw = plan(args + "--host-budget 1GiB --profile fastwrite.json");
  ASSERT_EQ(fw.exit_code, 0) << fw.err;
  EXPECT_LT(fw.summary["time_seconds"]["optimizer_wait"].get<double>(), t["optimizer_wait"].get<double>());
  EXPECT_GT(fw.summary["time_seconds"]["optimizer_wait"].get<double>(), 0);  // the reads still wait for room

  EXPECT_NE(small.summary.value("optimizer_reads_from", "").find("in turn"), std::string::npos) << small.summary.dump();
  // A profile that measured the drive's reads beside writes (nvme_read_beside_writes_gbps; on the
  // development VM's drive reads go on beside writes rather than stopping for them): the reads stream at that rate and the write-backs take none of their time. At the
  // read rate alone the wait is below the in-turn one and still above 0 (the room); at a tenth
  // of it, above.
  for (const double beside : {1.0, 0.1}) {
    json b = json::parse(kProfile);
    b["nvme_read_beside_writes_gbps"] = beside;
    std::ofstream(dir_ / "beside.json") << b.dump();
    const RunResult r = plan(args + "--host-budget 1GiB --profile beside.json");
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_NE(r.summary.value("optimizer_reads_from", "").find("beside the write-backs"), std::string::npos);
    const double wait = r.summary["time_seconds"]["optimizer_wait"].get<double>();
    if (beside == 1.0) {
      EXPECT_LT(wait, t["optimizer_wait"].get<double>());
      EXPECT_GT(wait, 0);
    } else {
      EXPECT_GT(wait, t["optimizer_wait"].get<double>());
    }
  }

  const RunResult big = plan(args + "--host-budget 4GiB --profile profile.json");
  ASSERT_EQ(big.exit_code, 0) << big.err;
  EXPECT_EQ(big.summary["traffic_bytes"]["nvme_read"].get<double>(), 0);
  EXPECT_EQ(big.summary["time_seconds"]["optimizer_wait"].get<double>(), 0);

  json hashed = json::parse(kProfile);
  hashed["checksum_gbps"] = 5.0;
  hashed["threads"] = 2;
  std::ofstream(dir_ / "hashed.json") << hashed.dump();
  const RunResult h = plan(args + "--host-budget 1GiB --profile hashed.json");
  ASSERT_EQ(h.exit_code, 0) << h.err;
  const double traffic = h.summary["traffic_bytes"]["nvme_read"].get<double>() +
                         h.summary["traffic_bytes"]["nvme_write"].get<double>();
  const double checksum = traffic / 5e9 / 2;
  EXPECT_NEAR(h.summary["time_seconds"]["checksum"].get<double>(), checksum, 1e-9);
  EXPECT_NEAR(h.summary["step_seconds"].get<double>() - small.summary["step_seconds"].get<double>(), checksum, 1e-6);

  std::ofstream(dir_ / "nohash.json") << R"({"tiermem": {"checksum": false, "fp32_single_copy": false}})";
  std::string no_hash_args = args;
  no_hash_args.replace(no_hash_args.find("two_copies.json"), std::string("two_copies.json").size(), "nohash.json");
  const RunResult off = plan(no_hash_args + "--host-budget 1GiB --profile hashed.json");
  ASSERT_EQ(off.exit_code, 0) << off.err;
  EXPECT_EQ(off.summary["time_seconds"]["checksum"].get<double>(), 0);
  EXPECT_NEAR(off.summary["step_seconds"].get<double>(), small.summary["step_seconds"].get<double>(), 1e-9);
}

// The overlapped optimizer step on a host-addressable device (a SimDevice) writes each module's
// new working shard where its gather reads it, the device, so the parameters live at the device's
// cache and take no host-pool room: the pool caches the optimizer state and the gradient
// partitions alone (plan.cc, predict_time). gpt2 (86 M parameters, 344 MB fp32; 1.03 GB of
// NVMe-homed optimizer state and gradients) with a 512 MiB device budget, which holds every
// working shard but not twice (so the engine's step would publish them at the host without the
// overlapped step). Until December 2026 the planner counted the 344 MB of parameters in the pool
// and streamed the optimizer state it then could not hold: gpt2-medium --offload nvme --seq-len 64
// --batch 1 planned 3.95 GB read a step against 2.96-3.38 GB measured.
TEST_F(PlanTest, TheOverlappedStepKeepsTheParametersAtTheDeviceNotInThePool) {
  const std::string args = "--model gpt2 --seq-len 64 --batch 1 --offload nvme --profile profile.json --json ";
  // 1200 MiB of pool: room for the optimizer state (less the host plan's margin), not for it and
  // the parameters.
  const RunResult fits = plan(args + "--device-budget 512MiB --host-budget 1200MiB");
  ASSERT_EQ(fits.exit_code, 0) << fits.err;
  EXPECT_EQ(fits.summary["traffic_bytes"]["nvme_read"].get<double>(), 0) << fits.summary.dump();
  EXPECT_EQ(fits.summary["traffic_bytes"]["nvme_write"].get<double>(), 0);
  EXPECT_EQ(fits.summary["time_seconds"]["optimizer_wait"].get<double>(), 0);
  // 900 MiB: what streams is the optimizer state beyond the pool's room less the host plan's
  // margin (two of the largest sub-groups' 12 bytes an element), read and written back once.
  const RunResult small = plan(args + "--device-budget 512MiB --host-budget 900MiB");
  ASSERT_EQ(small.exit_code, 0) << small.err;
  const double room = 900.0 * (1 << 20);
  const double margin =
      std::max(room / 32, 2.0 * 12 * small.summary["sub_group_elems"].get<double>());
  const double state = 12.0 * small.summary["params"].get<double>();
  EXPECT_NEAR(small.summary["traffic_bytes"]["nvme_read"].get<double>() / (state - (room - margin)), 1.0, 1e-3);
  EXPECT_EQ(small.summary["traffic_bytes"]["nvme_write"].get<double>(),
            small.summary["traffic_bytes"]["nvme_read"].get<double>());
  // A device that cannot hold every working shard: the ones it misses are read from NVMe every
  // step (their host copies are not kept) and written back, updated.
  const RunResult dev = plan(args + "--device-budget 256MiB --host-budget 1200MiB");
  ASSERT_EQ(dev.exit_code, 0) << dev.err;
  EXPECT_GT(dev.summary["traffic_bytes"]["nvme_read"].get<double>(), 0);
  EXPECT_EQ(dev.summary["traffic_bytes"]["nvme_write"].get<double>(),
            dev.summary["traffic_bytes"]["nvme_read"].get<double>());
  // Without the overlapped step, step() publishes the new shards at the host: they pass through
  // the pool, and optimizer state streams at the same budgets.
  std::ofstream(dir_ / "no_overlap.json") << R"({"tiermem": {"overlap_optimizer_step": false}})";
  const RunResult off = plan(args + "--device-budget 512MiB --host-budget 1200MiB --config no_overlap.json");
  ASSERT_EQ(off.exit_code, 0) << off.err;
  EXPECT_GT(off.summary["traffic_bytes"]["nvme_read"].get<double>(), 0);
}

// The engine's measured rates (tiermem-bench profile): the world-1 gradient hand-off is priced at
// grad_handoff_gbps and the optimizer step at optimizer_params_per_s, each interpolated in
// log(elements) by the run's largest module; without them, a copy at d2h_gbps and Adam at
// cpu_adam_params_per_s.
TEST_F(PlanTest, MeasuredEngineRatesPriceTheHandOffAndTheStep) {
  tiermem::gpt::GptConfig gpt2 = tiermem::gpt::GptConfig::named("gpt2");
  gpt2.vocab_size = 256;
  const double params = static_cast<double>(tiermem::gpt::num_params(gpt2));
  std::size_t largest = 0;
  double shard = 0;  // the rank's optimizer shard: every module padded to the 1024-element alignment
  for (const auto& l : tiermem::gpt::module_layouts(gpt2)) {
    largest = std::max<std::size_t>(largest, l.numel);
    shard += static_cast<double>((l.numel + 1023) / 1024 * 1024);
  }
  // Keyed figures around the block's size, so that the interpolation is exercised.
  const double lo = 1 << 20, hi = 1 << 24;
  const double f = std::log(static_cast<double>(largest) / lo) / std::log(hi / lo);
  ASSERT_GT(f, 0);
  ASSERT_LT(f, 1);
  json measured = json::parse(kProfile);
  measured["grad_handoff_gbps"] = 2.0;
  measured["grad_handoff_gbps_by_module_elems"] = {{std::to_string(1 << 20), 3.0}, {std::to_string(1 << 24), 1.0}};
  measured["optimizer_params_per_s"] = 5e7;
  measured["optimizer_params_per_s_by_module_elems"] = {{std::to_string(1 << 20), 4e7}, {std::to_string(1 << 24), 8e7}};
  std::ofstream(dir_ / "measured.json") << measured.dump();
  const std::string args = "--model gpt2 --offload cpu --host-budget 4GiB --device-budget 2GiB --json --profile ";
  const RunResult r = plan(args + "measured.json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json& t = r.summary["time_seconds"];
  const double handoff = 3.0 + f * (1.0 - 3.0), step = 4e7 + f * (8e7 - 4e7);
  EXPECT_NEAR(t["gradient_handoff"].get<double>(), 4.0 * params / (handoff * 1e9), 1e-9);
  EXPECT_NEAR(t["adam"].get<double>(), shard / step, 1e-9);
  // The measured step includes writing the new working parameters: nothing added for them.
  EXPECT_NEAR(t["optimizer"].get<double>(), shard / step, 1e-9);

  // Without the engine's figures: one copy at d2h_gbps, Adam at cpu_adam_params_per_s.
  const RunResult b = plan(args + "profile.json");
  ASSERT_EQ(b.exit_code, 0) << b.err;
  const json& u = b.summary["time_seconds"];
  EXPECT_NEAR(u["gradient_handoff"].get<double>(), 4.0 * params / 10e9, 1e-9);
  // ... and the plan says the hand-off fell back to that copy, in the JSON and in the table.
  EXPECT_EQ(b.summary["gradient_handoff_from"], "one copy at d2h_gbps (the profile has no grad_handoff_* figure)");
  const RunResult bt = plan("--model gpt2 --offload cpu --host-budget 4GiB --device-budget 2GiB --profile profile.json");
  ASSERT_EQ(bt.exit_code, 0) << bt.err;
  EXPECT_NE(bt.out.find("gradient hand-off (from one copy at d2h_gbps"), std::string::npos) << bt.out;
  EXPECT_NEAR(u["adam"].get<double>(), shard / 1e8, 1e-9);
  EXPECT_GT(u["optimizer"].get<double>(), u["adam"].get<double>());  // plus the parameters' copy

  // A keyed figure with a key that is not a size is bad input, named.
  measured["grad_handoff_gbps_by_module_elems"] = {{"big", 1.0}};
  std::ofstream(dir_ / "badkey.json") << measured.dump();
  const RunResult e = plan("--model gpt2 --profile badkey.json");
  EXPECT_EQ(e.exit_code, 2);
  EXPECT_NE(e.err.find("grad_handoff_gbps_by_module_elems.big"), std::string::npos) << e.err;
}

// The hand-off measured against the model's own backward (what tiermem-bench profile measures):
// per backward pass (micro-batch), one block's and the embedding's gradient bytes at
// grad_handoff_pass_gbps_by_width (exposed at the pass's end), the rest at
// grad_handoff_gbps_by_width, both interpolated in log(d_model); these take precedence over the
// by-module-size figure; a per-pass rate of 0 prices every byte at the per-byte rate; a negative
// one is bad input, named.
TEST_F(PlanTest, HandOffByWidthHasAPerByteAndAPerPassPart) {
  tiermem::gpt::GptConfig gpt2 = tiermem::gpt::GptConfig::named("gpt2");
  gpt2.vocab_size = 256;
  const double params = static_cast<double>(tiermem::gpt::num_params(gpt2));
  const auto layouts = tiermem::gpt::module_layouts(gpt2);
  const double pass_bytes = 4.0 * static_cast<double>(layouts.at(0).numel + layouts.at(1).numel);
  const double f = std::log(768.0 / 512.0) / std::log(2.0);  // gpt2's width between 512 and 1024
  const double per_byte = 4.0 + f * (2.0 - 4.0), per_pass = 1.0 + f * (0.5 - 1.0);
  json measured = json::parse(kProfile);
  measured["grad_handoff_gbps"] = 2.0;
  measured["grad_handoff_gbps_by_width"] = {{"512", 4.0}, {"1024", 2.0}};
  measured["grad_handoff_pass_gbps_by_width"] = {{"512", 1.0}, {"1024", 0.5}};
  measured["grad_handoff_gbps_by_module_elems"] = {{std::to_string(1 << 20), 9.0}};  // not used
  std::ofstream(dir_ / "bywidth.json") << measured.dump();
  const std::string args = "--model gpt2 --offload cpu --host-budget 4GiB --device-budget 2GiB --json ";
  for (const int accum : {1, 3}) {
    const RunResult r = plan(args + "--grad-accum " + std::to_string(accum) + " --profile bywidth.json");
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const double expected = (4.0 * params - pass_bytes) * accum / (per_byte * 1e9) + accum * pass_bytes / (per_pass * 1e9);
    EXPECT_NEAR(r.summary["time_seconds"]["gradient_handoff"].get<double>(), expected, 1e-9) << "accum " << accum;
  }

  measured["grad_handoff_pass_gbps_by_width"] = {{"512", 0.0}, {"1024", 0.0}};  // no per-pass cost
  std::ofstream(dir_ / "nopass.json") << measured.dump();
  const RunResult z = plan(args + "--profile nopass.json");
  ASSERT_EQ(z.exit_code, 0) << z.err;
  EXPECT_NEAR(z.summary["time_seconds"]["gradient_handoff"].get<double>(), 4.0 * params / (per_byte * 1e9), 1e-9);

  measured["grad_handoff_pass_gbps_by_width"] = {{"512", -1.0}};
  std::ofstream(dir_ / "negpass.json") << measured.dump();
  const RunResult e = plan(args + "--profile negpass.json");
  EXPECT_EQ(e.exit_code, 2);
  // Named as a bad key is: <file>: <table>.<key> (one form for both).
  EXPECT_NE(e.err.find("negpass.json: grad_handoff_pass_gbps_by_width.512"), std::string::npos) << e.err;
  EXPECT_NE(e.err.find("-1"), std::string::npos) << e.err;

  // A width that is not a whole number, and a rate so small it would make the step infinite.
  measured["grad_handoff_pass_gbps_by_width"] = {{"512", 1.0}};
  measured["grad_handoff_gbps_by_width"] = {{"768.5", 1.0}, {"1024", 2.0}};
  std::ofstream(dir_ / "fracwidth.json") << measured.dump();
  const RunResult fw = plan(args + "--profile fracwidth.json");
  EXPECT_EQ(fw.exit_code, 2);
  EXPECT_NE(fw.err.find("grad_handoff_gbps_by_width.768.5"), std::string::npos) << fw.err;
  measured["grad_handoff_gbps_by_width"] = {{"768", 1e-300}};
  std::ofstream(dir_ / "tiny.json") << measured.dump();
  const RunResult tiny = plan(args + "--profile tiny.json");
  EXPECT_EQ(tiny.exit_code, 2);
  EXPECT_NE(tiny.err.find("below 1e-6"), std::string::npos) << tiny.err;
}

}  // namespace
}  // namespace tiermem_train_test
