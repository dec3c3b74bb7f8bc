// tiermem-train trains the model asked for, and says each thing once (issue 14):
//   - activation checkpointing (--activation-checkpointing, or a config's activation_checkpointing
//     section): the same losses as without it, bit for bit (fp32; the recompute is the same
//     kernels on the same values), a lower activation peak in --json, and no access-trace
//     divergence (ZeroEngine gathers each module as often as without it);
//   - the vocabulary: text data shrinks a GPT-2-vocabulary model to 256 with ONE line saying so
//     and the parameter count; --vocab-size chooses; the summary reports both as trained;
//   - messages said once: the unpinned host pool warning once per run (every pool of the
//     process would say it), each config key's warning once.
// The binary runs with small settings (tests/unit/train_run.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "unit/train_run.h"

namespace {
using namespace tiermem_train_test;
using TrainModel = TrainBinaryTest;

// Occurrences of `needle` in `hay`.
int count_of(const std::string& hay, const std::string& needle) {
  int n = 0;
  for (auto at = hay.find(needle); at != std::string::npos; at = hay.find(needle, at + 1)) ++n;
  return n;
}

// Held-out losses of a run's {"eval": ...} lines.
std::vector<double> eval_losses(const RunResult& r) {
  std::vector<double> v;
  std::istringstream in(r.out);
  for (std::string line; std::getline(in, line);) {
    const json j = json::parse(line, nullptr, false);
    if (!j.is_discarded() && j.contains("eval")) v.push_back(j["eval"]["loss"].get<double>());
  }
  return v;
}

const char* kTiny = "--model tiny --seq-len 16 --batch 4 --json --seed 11 ";

TEST_F(TrainModel, ActivationCheckpointingTrainsTheSameLossesWithALowerActivationPeak) {
  // ZeroEngine, stage 3 with params and Adam on NVMe under a small device budget (the
  // Prefetcher replays its trace), an evaluation every 2 steps between the steps.
  const std::string zero = std::string(kTiny) + "--data " + corpus() +
                           " --steps 6 --eval-every 2 --engine zero --offload nvme --device sim "
                           "--device-budget 96KiB --host-budget 256KiB ";
  const RunResult plain = run(zero + "--swap-dir swap-a");
  ASSERT_EQ(plain.exit_code, 0) << plain.err;
  const RunResult flag = run(zero + "--swap-dir swap-b --activation-checkpointing");
  ASSERT_EQ(flag.exit_code, 0) << flag.err;
  std::ofstream(dir_ / "ac.json") << R"({"zero_optimization": {"stage": 3,
      "stage3_param_persistence_threshold": 0},
      "activation_checkpointing": {"cpu_checkpointing": true}})";
  const RunResult config = run(zero + "--swap-dir swap-c --config ac.json");
  ASSERT_EQ(config.exit_code, 0) << config.err;
  const auto a = losses(plain);
  ASSERT_EQ(a.size(), 6u);
  EXPECT_GT(a.front() - a.back(), 0.05) << "the loss should fall";
  for (const RunResult* r : {&flag, &config}) {
    EXPECT_EQ(losses(*r), a) << "bitwise the same losses";
    EXPECT_EQ(eval_losses(*r), eval_losses(plain));
    EXPECT_EQ(r->summary["activation_checkpointing"], true);
    EXPECT_LT(r->summary["activation_peak_bytes"].get<std::uint64_t>(),
              plain.summary["activation_peak_bytes"].get<std::uint64_t>());
    EXPECT_GT(r->summary["activation_checkpoint_bytes"].get<std::uint64_t>(), 0u);
    EXPECT_LT(r->summary["host_peak_bytes"].get<std::uint64_t>(),
              plain.summary["host_peak_bytes"].get<std::uint64_t>());
    // Each module is gathered as often as without checkpointing: the recorded access trace
    // replays, and nothing says it diverged unless the plain run says so too.
    EXPECT_EQ(count_of(r->err, "access trace diverged"), count_of(plain.err, "access trace diverged"))
        << r->err;
    EXPECT_EQ(count_of(r->err, "activation checkpointing ("), 1) << r->err;
  }
  EXPECT_EQ(plain.summary["activation_checkpointing"], false);
  EXPECT_EQ(count_of(plain.err, "access trace diverged"), 0) << plain.err;
  // The config's keys without an effect are named, once each; cpu_checkpointing is honoured.
  EXPECT_EQ(count_of(config.err, "is read but has no effect"), 0) << config.err;

  // The resident reference engine: the same again.
  const RunResult res = run(std::string(kTiny) + "--data " + corpus() +
                            " --steps 6 --eval-every 0 --engine resident --activation-checkpointing");
  ASSERT_EQ(res.exit_code, 0) << res.err;
  const RunResult res_plain =
      run(std::string(kTiny) + "--data " + corpus() + " --steps 6 --eval-every 0 --engine resident");
  ASSERT_EQ(res_plain.exit_code, 0) << res_plain.err;
  EXPECT_EQ(losses(res), losses(res_plain));
}

// A model with GPT-2's vocabulary on text: one line says it becomes 256, with the parameter
// count; --vocab-size keeps it (or sets another); the summary says what was trained.
TEST_F(TrainModel, TheVocabularyIsTheOneAskedForOrOneLineSaysSo) {
  const std::string custom = "--model custom --layers 1 --d-model 32 --heads 2 --seq-len 16 "
                             "--batch 2 --steps 1 --eval-every 0 --json --engine resident "
                             "--data " + corpus() + " ";
  const RunResult shrunk = run(custom);
  ASSERT_EQ(shrunk.exit_code, 0) << shrunk.err;
  EXPECT_EQ(count_of(shrunk.err, "vocabulary 50257 -> 256"), 1) << shrunk.err;
  EXPECT_EQ(count_of(shrunk.err, "--vocab-size 50257 keeps"), 1) << shrunk.err;
  EXPECT_EQ(shrunk.summary["vocab_size"], 256);
  // Parameters of 1 block of d 32 (12·d² + 13·d), ln_f (2·d), wte (V·d), wpe (16·d).
  auto params = [](std::uint64_t V) { return 12 * 32 * 32 + 13 * 32 + 2 * 32 + V * 32 + 16 * 32; };
  EXPECT_EQ(shrunk.summary["param_count"].get<std::uint64_t>(), params(256));
  const RunResult kept = run(custom + "--vocab-size 50257");
  ASSERT_EQ(kept.exit_code, 0) << kept.err;
  EXPECT_EQ(count_of(kept.err, "vocabulary"), 0) << kept.err;  // what was asked: no note
  EXPECT_EQ(kept.summary["vocab_size"], 50257);
  EXPECT_EQ(kept.summary["param_count"].get<std::uint64_t>(), params(50257));
  const RunResult tiny = run(std::string(kTiny) + "--steps 1 --eval-every 0 --engine resident "
                             "--vocab-size 300 --data " + corpus());
  ASSERT_EQ(tiny.exit_code, 0) << tiny.err;
  EXPECT_EQ(tiny.summary["vocab_size"], 300);
  // Text is byte-level: a vocabulary below 256 cannot hold it (exit 2, naming the flag).
  const RunResult small = run(std::string(kTiny) + "--steps 1 --vocab-size 100 --data " + corpus());
  EXPECT_EQ(small.exit_code, 2) << small.err;
  EXPECT_NE(small.err.find("--vocab-size"), std::string::npos) << small.err;
  EXPECT_NE(small.err.find("256"), std::string::npos) << small.err;
  EXPECT_EQ(count_of(small.err, "\n"), 1) << small.err;  // one line
}

// One message per cause per process: a config key without an effect is named once. The host
// pools' memory without pin_memory is no warning (nothing on the CPU needs it locked: see
// PinnedHostPool's constructor).
TEST_F(TrainModel, EachWarningIsSaidOnce) {
  std::ofstream(dir_ / "inert.json") << R"({"zero_optimization": {"stage": 3,
      "offload_param": {"device": "nvme", "nvme_path": "swap", "pin_memory": false},
      "offload_optimizer": {"device": "nvme", "nvme_path": "swap", "pin_memory": false},
      "contiguous_gradients": true}, "steps_per_print": 5})";
  const RunResult r = run(std::string(kTiny) + "--steps 2 --eval-every 0 --swap-dir swap "
                          "--config inert.json --data " + corpus());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(count_of(r.err, "page-locked"), 0) << r.err;
  EXPECT_EQ(count_of(r.err, "'zero_optimization.contiguous_gradients'"), 1) << r.err;
  EXPECT_EQ(count_of(r.err, "'steps_per_print'"), 1) << r.err;
  // No line of stderr is said twice.
  std::istringstream in(r.err);
  std::vector<std::string> seen;
  for (std::string line; std::getline(in, line);) {
    EXPECT_EQ(std::count(seen.begin(), seen.end(), line), 0) << "said twice: " << line;
    seen.push_back(line);
  }
}

}  // namespace
