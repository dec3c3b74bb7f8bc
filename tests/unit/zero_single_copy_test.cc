// tiermem.fp32_single_copy: in fp32 ZeRO-3 training with the parameters homed where the optimizer
// state is, each module's working shard is its master (one fp32 copy, not two). Bit for bit the
// two-copy engine's training, state export and import (checkpoints cross the setting both ways),
// for AdamW, Lion and Adagrad, with and without the overlapped step; and fewer bytes written to
// NVMe.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <memory>
#include <string>

#include "mpi/zero_mlp.h"
#include "tiermem/zero_engine.h"

namespace tiermem {
namespace {

struct Dir {
  std::string path;
  explicit Dir(const std::string& tag) {
    auto d = std::filesystem::temp_directory_path() /
             ("tiermem-single-copy-" + tag + "-" + std::to_string(getpid()));
    std::filesystem::create_directories(d);
    path = d.string();
  }
  ~Dir() { std::filesystem::remove_all(path); }
};

Config config(const std::string& param, const std::string& optim, bool single, const std::string& dir,
              const std::string& type = "adamw", bool overlap = false) {
  Config cfg = testing::with_param_offload(testing::mlp_config(3, optim, dir, 2), param, dir);
  cfg.gradient_clipping = 0.05;  // clips some steps and not others
  cfg.tiermem.overlap_optimizer_step = overlap;
  cfg.tiermem.fp32_single_copy = single;
  cfg.optimizer.type = type;
  return cfg;
}

struct Trained {
  std::vector<std::vector<float>> master;
  ZeroOptimizerState state;
  ZeroStats stats;
  bool single = false;  // the plan kept one copy
  std::size_t single_elems = 0;
};

Trained train(const Config& cfg, int steps) {
  auto comm = make_single_communicator();
  ZeroEngine engine(cfg, *comm);
  Trained r;
  r.master = testing::mlp_train_engine(engine, *comm, steps, 2);
  r.state = engine.export_optimizer_state();
  r.stats = engine.stats();
  r.single = engine.plan().fp32_single_copy;
  r.single_elems = engine.plan().single_copy_elems;
  return r;
}

struct Case {
  const char* param;
  const char* optim;
  const char* type;
  bool overlap;
};

class SingleCopy : public ::testing::TestWithParam<Case> {};

TEST_P(SingleCopy, BitForBitTheTwoCopyEngine) {
  const Case c = GetParam();
  Dir a("a"), b("b");
  const Trained two = train(config(c.param, c.optim, false, a.path, c.type, c.overlap), 5);
  const Trained one = train(config(c.param, c.optim, true, b.path, c.type, c.overlap), 5);
  const bool eligible = std::string(c.param) == c.optim;  // homed together
  EXPECT_EQ(one.single, eligible);
  EXPECT_FALSE(two.single);
  if (eligible) {
    EXPECT_GT(one.single_elems, 0u);
    EXPECT_EQ(one.stats.optimizer_state_bytes + 4 * one.single_elems, two.stats.optimizer_state_bytes);
  }
  EXPECT_EQ(one.master, two.master);
  EXPECT_EQ(one.state.master, two.state.master);
  EXPECT_EQ(one.state.exp_avg, two.state.exp_avg);
  EXPECT_EQ(one.state.exp_avg_sq, two.state.exp_avg_sq);
  EXPECT_EQ(one.state.steps, two.state.steps);
  if (std::string(c.param) == "nvme" && std::string(c.optim) == "nvme") {
    // The master is not written a second time: fewer bytes to NVMe (the tiny MLP may still fit
    // the host budget between steps, so this is <=, and < when anything was written at all).
    EXPECT_LE(one.stats.nvme_written_bytes, two.stats.nvme_written_bytes);
  }
}

INSTANTIATE_TEST_SUITE_P(Homes, SingleCopy,
                         ::testing::Values(Case{"nvme", "nvme", "adamw", false}, Case{"nvme", "nvme", "adamw", true},
                                           Case{"cpu", "cpu", "adamw", false}, Case{"nvme", "nvme", "lion", false},
                                           Case{"nvme", "nvme", "adagrad", false},
                                           Case{"nvme", "cpu", "adamw", false}),  // homes differ: two copies
                         [](const auto& info) {
                           return std::string(info.param.param) + "_" + info.param.optim + "_" + info.param.type +
                                  (info.param.overlap ? "_overlap" : "");
                         });

// A checkpoint of one setting resumes under the other, and the runs continue bit for bit.
TEST(SingleCopy, StateCrossesTheSettingBothWays) {
  for (bool from_single : {true, false}) {
    Dir a("x"), b("y"), c("z");
    auto comm = make_single_communicator();
    ZeroEngine src(config("nvme", "nvme", from_single, a.path), *comm);
    testing::mlp_train_engine(src, *comm, 3, 2);
    const ZeroOptimizerState saved = src.export_optimizer_state();
    const std::vector<float> m0 = src.export_master(0), m1 = src.export_master(1);
    testing::mlp_train_steps(src, *comm, 2, 2);

    ZeroEngine dst(config("nvme", "nvme", !from_single, b.path), *comm);
    auto init = testing::mlp_init();
    dst.register_module("fc1", init[0]);
    dst.register_module("fc2", init[1]);
    dst.import_optimizer_state(saved);
    EXPECT_EQ(dst.export_master(0), m0);
    EXPECT_EQ(dst.export_master(1), m1);
    testing::mlp_train_steps(dst, *comm, 2, 2);
    EXPECT_EQ(dst.export_master(0), src.export_master(0)) << "from single copy: " << from_single;
    EXPECT_EQ(dst.export_master(1), src.export_master(1));
    const ZeroOptimizerState x = dst.export_optimizer_state(), y = src.export_optimizer_state();
    EXPECT_EQ(x.exp_avg, y.exp_avg);
    EXPECT_EQ(x.exp_avg_sq, y.exp_avg_sq);
  }
}

// set_module_params rewrites the master (the working shard itself) and keeps the moments.
TEST(SingleCopy, SetModuleParamsRewritesTheMasterInPlace) {
  Dir a("s");
  auto comm = make_single_communicator();
  ZeroEngine engine(config("nvme", "nvme", true, a.path), *comm);
  testing::mlp_train_engine(engine, *comm, 2, 2);
  const std::vector<float> m = engine.export_module_state(1, OptimizerStateKind::kExpAvg);
  std::vector<float> v(engine.module_numel(1));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = 0.001f * static_cast<float>(i % 97);
  engine.set_module_params(1, v);
  EXPECT_EQ(engine.export_master(1), v);
  EXPECT_EQ(engine.export_module_state(1, OptimizerStateKind::kExpAvg), m);
  auto g = engine.gather(1);
  EXPECT_EQ(testing::to_f32_host(engine, g), v);
}

}  // namespace
}  // namespace tiermem
