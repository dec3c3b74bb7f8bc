#include "tiermem/config.h"

#include <gtest/gtest.h>

#include "tiermem/error.h"

namespace tiermem {
namespace {

// Expects parse_config(text) to throw a ConfigError whose key_path is `key`.
void expect_key_error(const std::string& text, const std::string& key) {
  try {
    parse_config(text);
    FAIL() << "no ConfigError for " << text;
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.key_path(), key) << e.what();
    EXPECT_NE(std::string(e.what()).find(key), std::string::npos) << e.what();
  }
}

TEST(ParseSize, AcceptsUnitsAndNumbers) {
  EXPECT_EQ(parse_size("0"), 0u);
  EXPECT_EQ(parse_size("4096"), 4096u);
  EXPECT_EQ(parse_size("4K"), 4096u);
  EXPECT_EQ(parse_size("4KiB"), 4096u);
  EXPECT_EQ(parse_size("64MiB"), 64ull << 20);
  EXPECT_EQ(parse_size("64 mib"), 64ull << 20);
  EXPECT_EQ(parse_size("1G"), 1ull << 30);
  EXPECT_EQ(parse_size("2TiB"), 2ull << 40);
  EXPECT_EQ(parse_size("500MB"), 500'000'000u);
  EXPECT_EQ(parse_size("1e9"), 1'000'000'000u);
  EXPECT_EQ(parse_size("1.5GiB"), 3ull << 29);
  EXPECT_EQ(parse_size("5e8B"), 500'000'000u);
}

TEST(ParseSize, RejectsGarbage) {
  for (const char* bad : {"", "-1", "abc", "12XB", "1.5", "1e400", "64 MiB x", "MiB", "."}) {
    EXPECT_THROW(parse_size(bad, "k"), ConfigError) << bad;
  }
}

TEST(Config, DefaultsFromEmptyDocument) {
  Config c = parse_config("{}");
  EXPECT_EQ(c.zero.stage, 0);
  EXPECT_EQ(c.aio.block_size_bytes, 1u << 20);
  EXPECT_EQ(c.aio.queue_depth, 32);
  EXPECT_EQ(c.zero.offload_param.device, OffloadDevice::kNone);
  EXPECT_EQ(c.tiermem.device, "auto");
  EXPECT_TRUE(c.unknown_keys.empty());
}

TEST(Config, ReadsDeepSpeedConfigUnchanged) {
  const char* ds = R"({
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": "auto",
    "bf16": {"enabled": true},
    "aio": {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 2,
            "single_submit": false, "overlap_events": true},
    "zero_optimization": {
      "stage": 3, "overlap_comm": true, "reduce_bucket_size": 5e8,
      "stage3_prefetch_bucket_size": 5e7, "stage3_param_persistence_threshold": 1e5,
      "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9, "sub_group_size": 1e9,
      "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": true,
                        "buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9},
      "offload_optimizer": {"device": "nvme", "nvme_path": ["/nvme0", "/nvme1"], "pin_memory": true,
                            "buffer_count": 4, "fast_init": false}
    }
  })";
  Config c = parse_config(ds);
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 4);
  EXPECT_EQ(c.gradient_accumulation_steps, 1);
  ASSERT_EQ(c.auto_keys.size(), 1u);
  EXPECT_EQ(c.auto_keys[0], "gradient_accumulation_steps");
  EXPECT_TRUE(c.bf16);
  EXPECT_EQ(c.aio.queue_depth, 8);
  EXPECT_EQ(c.aio.intra_op_parallelism, 2);
  EXPECT_EQ(c.zero.stage, 3);
  EXPECT_TRUE(c.zero.overlap_comm);
  EXPECT_EQ(c.zero.reduce_bucket_size_elems, 500'000'000u);
  EXPECT_EQ(c.zero.offload_param.device, OffloadDevice::kNvme);
  ASSERT_EQ(c.zero.offload_param.nvme_path.size(), 1u);
  EXPECT_EQ(c.zero.offload_param.nvme_path[0], "/local_nvme");
  ASSERT_EQ(c.zero.offload_optimizer.nvme_path.size(), 2u);
  EXPECT_EQ(c.zero.offload_optimizer.buffer_count, 4);
  EXPECT_TRUE(c.unknown_keys.empty());
}

TEST(Config, UnknownKeysAreCollectedNotFatal) {
  Config c = parse_config(R"({"aio": {"queue_depth": 4, "bogus": 1}, "nonsense": true})");
  ASSERT_EQ(c.unknown_keys.size(), 2u);
  EXPECT_EQ(c.unknown_keys[0], "aio.bogus");
  EXPECT_EQ(c.unknown_keys[1], "nonsense");
}

TEST(Config, BadValuesNameTheKey) {
  expect_key_error(R"({"zero_optimization": {"stage": 4}})", "zero_optimization.stage");
  expect_key_error(R"({"zero_optimization": {"stage": "three"}})", "zero_optimization.stage");
  expect_key_error(R"({"aio": {"queue_depth": -1}})", "aio.queue_depth");
  expect_key_error(R"({"aio": {"queue_depth": 1.5}})", "aio.queue_depth");
  expect_key_error(R"({"aio": {"block_size": "1000"}})", "aio.block_size");
  expect_key_error(R"({"aio": {"block_size": "lots"}})", "aio.block_size");
  expect_key_error(R"({"aio": {"single_submit": "yes"}})", "aio.single_submit");
  expect_key_error(R"({"aio": 7})", "aio");
  expect_key_error(R"({"tiermem": {"device": "tpu"}})", "tiermem.device");
  expect_key_error(R"({"tiermem": {"device_budget_bytes": -5}})", "tiermem.device_budget_bytes");
  expect_key_error(R"({"tiermem": {"device_budget_bytes": "-5MiB"}})", "tiermem.device_budget_bytes");
  expect_key_error(R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})",
                   "zero_optimization.offload_param.nvme_path");
  expect_key_error(
      R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "buffer_count": 0}}})",
      "zero_optimization.offload_param.buffer_count");
  expect_key_error(R"({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})",
                   "zero_optimization.offload_param.device");
  expect_key_error(R"({"optimizer": {"params": {"betas": [0.9]}}})", "optimizer.params.betas");
  expect_key_error(R"({"bf16": {"enabled": true}, "fp16": {"enabled": true}})", "fp16.enabled");
}

TEST(Config, MalformedJsonIsConfigError) {
  EXPECT_THROW(parse_config("{\"aio\": "), ConfigError);
  EXPECT_THROW(parse_config("[1,2]"), ConfigError);
  EXPECT_THROW(load_config("/nonexistent/ds_config.json"), ConfigError);
}

// Found by tests/fuzz/config_fuzz: a number too large for a double made nlohmann throw
// out_of_range, which escaped as a non-ConfigError.
TEST(Config, FuzzFoundNumberOverflowIsConfigError) {
  EXPECT_THROW(parse_config(R"({"fp16": {"min_loss_scale": 5555555555555555555555555555e551}})"), ConfigError);
}

TEST(Config, RoundTripsThroughJson) {
  Config c = parse_config(R"({"zero_optimization": {"stage": 2}, "tiermem": {"checksum": false}})");
  Config d = parse_config(config_to_json(c));
  EXPECT_EQ(d.zero.stage, 2);
  EXPECT_FALSE(d.tiermem.checksum);
  EXPECT_TRUE(d.unknown_keys.empty());
}

// Swap checksums are on unless the config turns them off (issue 17).
TEST(Config, ChecksumsAreOnByDefault) {
  EXPECT_TRUE(parse_config("{}").tiermem.checksum);
  EXPECT_TRUE(parse_config(R"({"tiermem": {"device": "sim"}})").tiermem.checksum);
  EXPECT_FALSE(parse_config(R"({"tiermem": {"checksum": false}})").tiermem.checksum);
}

}  // namespace
}  // namespace tiermem
