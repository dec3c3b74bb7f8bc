// Tests of tiermem-train's command line and effective configuration (train_options.h).
#include "train_options.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace tiermem::train {
namespace {

int parse(std::vector<std::string> args, TrainOptions* o) {
  args.insert(args.begin(), "tiermem-train");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return parse_train_options(static_cast<int>(argv.size()), argv.data(), o);
}

TEST(TrainOptions, DefaultsAreTheDemo) {
  TrainOptions o;
  ASSERT_EQ(parse({}, &o), -1);
  EXPECT_EQ(o.model, "mini");
  EXPECT_TRUE(o.data.empty());
  Config c = effective_config(o, 0);
  EXPECT_EQ(c.zero.stage, 3);
  EXPECT_EQ(c.zero.offload_param.device, OffloadDevice::kNvme);
  EXPECT_EQ(c.zero.offload_optimizer.device, OffloadDevice::kNvme);
  ASSERT_EQ(c.zero.offload_param.nvme_path.size(), 1u);
  EXPECT_EQ(c.zero.offload_param.nvme_path[0], "./tiermem-swap");
}

TEST(TrainOptions, FlagsParseAndOverride) {
  TrainOptions o;
  ASSERT_EQ(parse({"--model", "tiny", "--steps", "7", "--batch", "3", "--grad-accum", "2",
                   "--device-budget", "64MiB", "--swap-dir", "/tmp/sw", "--offload", "cpu",
                   "--json", "--seed", "9", "--lr", "0.01", "--device", "sim"},
                  &o),
            -1);
  EXPECT_EQ(o.steps, 7);
  EXPECT_EQ(o.device_budget_bytes, 64ull << 20);
  EXPECT_TRUE(o.json);
  EXPECT_EQ(o.seed, 9u);
  Config c = effective_config(o, 1);
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 3);
  EXPECT_EQ(c.gradient_accumulation_steps, 2);
  EXPECT_EQ(c.zero.offload_param.device, OffloadDevice::kCpu);
  EXPECT_EQ(c.tiermem.device, "sim");
  EXPECT_EQ(c.tiermem.device_budget_bytes, 64ull << 20);
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 0.01);
  ASSERT_EQ(parse({"--offload", "nvme", "--swap-dir", "/tmp/sw"}, &o), -1);
  c = effective_config(o, 1);
  EXPECT_EQ(c.zero.offload_optimizer.nvme_path.at(0), "/tmp/sw");
}

TEST(TrainOptions, BadValuesExitWithCode2) {
  TrainOptions o;
  EXPECT_EQ(parse({"--steps", "0"}, &o), 2);
  EXPECT_EQ(parse({"--steps", "ten"}, &o), 2);
  EXPECT_EQ(parse({"--model", "gpt5"}, &o), 2);
  EXPECT_EQ(parse({"--device", "tpu"}, &o), 2);
  EXPECT_EQ(parse({"--device-budget", "lots"}, &o), 2);
  EXPECT_EQ(parse({"--no-such-flag"}, &o), 2);
  EXPECT_EQ(parse({"--config", "/nonexistent/ds_config.json"}, &o), 2);
  EXPECT_EQ(parse({"--save-every", "5"}, &o), 2);  // needs --save
  EXPECT_EQ(parse({"--help"}, &o), 0);
}

}  // namespace
}  // namespace tiermem::train
