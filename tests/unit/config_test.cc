#include "tiermem/config.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <map>
#include <optional>
#include <string>
#include <vector>

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
  ASSERT_EQ(c.unknown_key_suggestions.size(), 2u);
  EXPECT_EQ(c.unknown_key_suggestions[0], "") << "nothing is spelt near 'bogus'";
  EXPECT_EQ(c.unknown_key_suggestions[1], "");
}

// A slip of spelling is answered with the key meant, from the same section, given or not.
TEST(Config, AnUnknownKeyNamesTheKnownKeyItIsNearest) {
  Config c = parse_config(R"({"tiermem": {"host_budget": "1GiB"},
                              "zero_optimisation": {"stage": 3},
                              "aio": {"Queue_Depth": 8, "block_size": 1048576}})");
  ASSERT_EQ(c.unknown_keys.size(), 3u);
  std::map<std::string, std::string> near;
  for (std::size_t i = 0; i < c.unknown_keys.size(); ++i) near[c.unknown_keys[i]] = c.unknown_key_suggestions.at(i);
  EXPECT_EQ(near["tiermem.host_budget"], "tiermem.host_budget_bytes");
  EXPECT_EQ(near["zero_optimisation"], "zero_optimization");
  EXPECT_EQ(near["aio.Queue_Depth"], "aio.queue_depth");
  EXPECT_EQ(c.tiermem.host_budget_bytes, 0u) << "an unknown key sets nothing";
}

// DeepSpeed takes each stage3_ key under its field name too ("param_persistence_threshold"): it
// was an unknown key here, warned and ignored, so the run used the default threshold. Found by
// comparing DeepSpeed 0.19.8's zero config fields with what parse_config reads.
TEST(Config, Stage3KeysAreReadUnderDeepSpeedsFieldNamesToo) {
  Config c = parse_config(R"({"zero_optimization": {"param_persistence_threshold": 0, "prefetch_bucket_size": 1000,
                                                     "max_live_parameters": 2000, "max_reuse_distance": 3000}})");
  EXPECT_TRUE(c.unknown_keys.empty()) << c.unknown_keys.front();
  EXPECT_EQ(c.zero.stage3_param_persistence_threshold_elems, 0u);
  EXPECT_EQ(c.zero.stage3_prefetch_bucket_size_elems, 1000u);
  EXPECT_EQ(c.zero.stage3_max_live_parameters_elems, 2000u);
  EXPECT_EQ(c.zero.stage3_max_reuse_distance_elems, 3000u);
  Config same = parse_config(R"({"zero_optimization": {"stage3_param_persistence_threshold": 7, "param_persistence_threshold": 7}})");
  EXPECT_EQ(same.zero.stage3_param_persistence_threshold_elems, 7u);
  expect_key_error(R"({"zero_optimization": {"stage3_param_persistence_threshold": 7, "param_persistence_threshold": 8}})",
                   "zero_optimization.param_persistence_threshold");
  // The rest of DeepSpeed's zero keys are accepted with one warning each, none unknown.
  Config rest = parse_config(R"({"zero_optimization": {"leaf_module": {"classes": ["X"]}, "zenflow": {},
                                                       "allgather_sequential": false, "cpu_offload_param": true}})");
  EXPECT_TRUE(rest.unknown_keys.empty()) << rest.unknown_keys.front();
  EXPECT_EQ(rest.inert_keys.size(), 4u);
  Config opt = parse_config(R"({"zero_optimization": {"offload_optimizer": {"super_offload": true, "cpuadam_cores_perc": 0.8}}})");
  EXPECT_TRUE(opt.unknown_keys.empty()) << opt.unknown_keys.front();
  EXPECT_EQ(opt.inert_keys.size(), 2u);
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
  expect_key_error(R"({"tiermem": {"prefetch_eviction": "belady"}})", "tiermem.prefetch_eviction");
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

// Each text is a ConfigError whose message holds every one of `says` and does not call the value
// the wrong type.
void expect_error_not_wrong_type(std::initializer_list<const char*> texts, std::initializer_list<const char*> says) {
  for (const char* text : texts) {
    try {
      parse_config(text);
      ADD_FAILURE() << "no ConfigError for " << text;
    } catch (const ConfigError& e) {
      const std::string m = e.what();
      for (const char* s : says) EXPECT_NE(m.find(s), std::string::npos) << m;
      EXPECT_EQ(m.find("wrong type"), std::string::npos) << m;
    }
  }
}

TEST(Config, AWholeNumberBeyond63BitsIsOutOfRangeNotTheWrongType) {
  expect_error_not_wrong_type({R"({"gradient_accumulation_steps": 1e30})", R"({"zero_optimization": {"sub_group_size": 1e20}})"},
                              {"is out of range: an integer of at most 63 bits"});
}

TEST(Config, ANegativeSizeIsOutOfRangeNotTheWrongType) {
  expect_error_not_wrong_type({R"({"zero_optimization": {"sub_group_size": -5}})", R"({"tiermem": {"host_budget_bytes": -1}})",
                               R"({"aio": {"block_size": -4096.0}})"},
                              {"is out of range: allowed 0 or more"});
}

TEST(Config, AnEmptyNvmePathIsSaidToBeEmptyNotTheWrongType) {
  expect_error_not_wrong_type({R"({"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": ""}}})",
                               R"({"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": ["/a", ""]}}})"},
                              {"nvme_path", "a path is empty: name a directory"});
}

TEST(Config, MalformedJsonIsConfigError) {
  EXPECT_THROW(parse_config("{\"aio\": "), ConfigError);
  EXPECT_THROW(parse_config("[1,2]"), ConfigError);
  EXPECT_THROW(load_config("/nonexistent/ds_config.json"), ConfigError);
}

// nlohmann keeps the last of two equal keys; DeepSpeed's loader refuses them, and so does tiermem,
// naming the key's whole path — at the top, nested, and inside an array's objects — while the
// same key in two different objects is fine.
TEST(Config, DuplicateKeysAreRefusedWithTheirPath) {
  expect_key_error(R"({"train_batch_size": 8, "train_batch_size": 16})", "train_batch_size");
  expect_key_error(R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                       "stage": 2}})",
                   "zero_optimization.stage");
  expect_key_error(R"({"zero_optimization": {"offload_param": {"device": "cpu", "device": "nvme"}}})",
                   "zero_optimization.offload_param.device");
  expect_key_error(R"({"x": [{"a": 1, "a": 2}]})", "x.[].a");
  try {
    parse_config(R"({"fp16": {"enabled": false}, "fp16": {"enabled": true}})", "ds.json");
    FAIL() << "no ConfigError for a duplicated section";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.key_path(), "fp16");
    EXPECT_NE(std::string(e.what()).find("given twice in ds.json"), std::string::npos) << e.what();
  }
  const Config c = parse_config(R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                   "offload_optimizer": {"device": "cpu"}}})");
  EXPECT_EQ(c.zero.offload_param.device, OffloadDevice::kCpu);
}

// Found by tests/fuzz/config_fuzz: a number too large for a double made nlohmann throw
// out_of_range, which escaped as a non-ConfigError.
TEST(Config, FuzzFoundNumberOverflowIsConfigError) {
  EXPECT_THROW(parse_config(R"({"fp16": {"min_loss_scale": 5555555555555555555555555555e551}})"), ConfigError);
}

TEST(Config, RoundTripsThroughJson) {
  Config c = parse_config(
      R"({"zero_optimization": {"stage": 2}, "tiermem": {"checksum": false, "prefetch_eviction": "min"}})");
  Config d = parse_config(config_to_json(c));
  EXPECT_EQ(d.zero.stage, 2);
  EXPECT_FALSE(d.tiermem.checksum);
  EXPECT_EQ(d.tiermem.prefetch_eviction, "min");
  EXPECT_TRUE(d.unknown_keys.empty());
}

// Expects `fn` to throw a ConfigError whose message contains every one of `needles`.
template <typename Fn>
void expect_message(Fn fn, std::initializer_list<std::string> needles) {
  try {
    fn();
    FAIL() << "no ConfigError";
  } catch (const ConfigError& e) {
    for (const std::string& n : needles)
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos)
          << "no '" << n << "' in: " << e.what();
  }
}

TEST(BatchSizes, DerivedAsDeepSpeedDoes) {
  using O = std::optional<long long>;
  auto d = [](O t, O m, O a, int w) { return derive_batch_sizes(t, m, a, w); };
  BatchSizes b = d(8, 2, std::nullopt, 1);  // the issue's example: accumulation 4, not 1
  EXPECT_EQ(b.train_batch_size, 8);
  EXPECT_EQ(b.micro_batch_per_gpu, 2);
  EXPECT_EQ(b.gradient_accumulation_steps, 4);
  b = d(32, std::nullopt, std::nullopt, 1);  // train_batch_size alone: micro-batch 32, not 1
  EXPECT_EQ(b.micro_batch_per_gpu, 32);
  EXPECT_EQ(b.gradient_accumulation_steps, 1);
  b = d(32, std::nullopt, std::nullopt, 4);
  EXPECT_EQ(b.micro_batch_per_gpu, 8);
  b = d(32, std::nullopt, 2, 4);
  EXPECT_EQ(b.micro_batch_per_gpu, 4);
  b = d(std::nullopt, 3, 5, 2);
  EXPECT_EQ(b.train_batch_size, 30);
  b = d(std::nullopt, 3, std::nullopt, 2);
  EXPECT_EQ(b.train_batch_size, 6);
  EXPECT_EQ(b.gradient_accumulation_steps, 1);
  b = d(24, 3, 4, 2);  // consistent triple
  EXPECT_EQ(b.train_batch_size, 24);
}

TEST(BatchSizes, InconsistentOrIndivisibleTriplesNameTheKeys) {
  using O = std::optional<long long>;
  expect_message([] { derive_batch_sizes(8, 2, 3, 1); },
                 {"train_batch_size", "= 8", "train_micro_batch_size_per_gpu", "= 2",
                  "gradient_accumulation_steps", "= 3", "1 rank", "must equal"});
  expect_message([] { derive_batch_sizes(7, 2, std::nullopt, 1); },
                 {"train_batch_size", "= 7", "train_micro_batch_size_per_gpu", "multiple"});
  expect_message([] { derive_batch_sizes(9, std::nullopt, 2, 1); },
                 {"train_batch_size", "gradient_accumulation_steps", "multiple"});
  expect_message([] { derive_batch_sizes(6, std::nullopt, std::nullopt, 4); },
                 {"train_batch_size", "= 6", "4 ranks"});
  expect_message([] { derive_batch_sizes(O{}, O{}, 2, 1); },
                 {"train_batch_size", "train_micro_batch_size_per_gpu", "neither"});
  BatchKeyNames flags;
  flags.micro = "--batch";
  expect_message([&] { derive_batch_sizes(8, 3, O{}, 1, flags); }, {"--batch", "= 3"});
}

TEST(BatchSizes, ResolvedFromTheDocument) {
  Config c = parse_config(R"({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2})");
  resolve_batch_sizes(c, 1);
  EXPECT_EQ(c.gradient_accumulation_steps, 4);
  c = parse_config(R"({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
                       "gradient_accumulation_steps": 2})");
  EXPECT_THROW(resolve_batch_sizes(c, 1), ConfigError);
  c = parse_config(R"({"train_batch_size": 8, "train_micro_batch_size_per_gpu": "auto"})");
  resolve_batch_sizes(c, 2);
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 4);
  c = parse_config("{}");
  resolve_batch_sizes(c, 3);
  EXPECT_EQ(c.train_batch_size, 3);
}

TEST(Config, KeysReadButNotActedOnAreNamedOnceWithAReason) {
  Config c = parse_config(R"({
    "activation_checkpointing": {"partition_activations": true, "cpu_checkpointing": true},
    "steps_per_print": 10, "wall_clock_breakdown": false,
    "zero_optimization": {"stage": 2, "contiguous_gradients": true,
                          "allgather_bucket_size": 5e8, "round_robin_gradients": true},
    "tiermem": {"log_level": "debug"}
  })");
  EXPECT_TRUE(c.unknown_keys.empty());
  std::vector<std::string> keys;
  for (const InertKey& k : c.inert_keys) {
    keys.push_back(k.key);
    EXPECT_FALSE(k.why.empty()) << k.key;
  }
  for (const char* k :
       {"activation_checkpointing.partition_activations", "steps_per_print",
        "wall_clock_breakdown", "zero_optimization.contiguous_gradients",
        "zero_optimization.allgather_bucket_size", "zero_optimization.round_robin_gradients",
        "tiermem.log_level"}) {
    EXPECT_EQ(std::count(keys.begin(), keys.end(), k), 1) << k;
  }
  EXPECT_EQ(keys.size(), 7u);  // cpu_checkpointing is honoured: no warning
  // Still typed: a wrong type for a warned key that tiermem range-checks is an error.
  expect_key_error(R"({"zero_optimization": {"allgather_bucket_size": "lots"}})",
                   "zero_optimization.allgather_bucket_size");
}

// DeepSpeed's activation_checkpointing section turns the trainer's checkpointing on; its
// cpu_checkpointing is read, the keys without an effect here are warned one by one.
// A decay schedule that ends before its warm-up runs, as DeepSpeed lets it, with one warning (it
// was accepted silently): the peak lr is never reached.
TEST(Config, ADecayShorterThanItsWarmupIsDoubted) {
  const Config c = parse_config(
      R"({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 1, "warmup_num_steps": 5}}})");
  ASSERT_EQ(c.doubtful_values.size(), 1u);
  EXPECT_EQ(c.doubtful_values[0].key, "scheduler.params.total_num_steps");
  EXPECT_NE(c.doubtful_values[0].why.find("1 is below warmup_num_steps (5)"), std::string::npos) << c.doubtful_values[0].why;
  EXPECT_TRUE(parse_config(R"({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 10,
      "warmup_num_steps": 5}}})").doubtful_values.empty());
}

TEST(Config, ActivationCheckpointingSectionIsRead) {
  EXPECT_FALSE(parse_config("{}").activation_checkpointing.enabled);
  Config c = parse_config(R"({"activation_checkpointing": {}})");
  EXPECT_TRUE(c.activation_checkpointing.enabled);
  EXPECT_FALSE(c.activation_checkpointing.cpu_checkpointing);
  EXPECT_TRUE(c.inert_keys.empty());
  c = parse_config(R"({"activation_checkpointing": {"partition_activations": false,
      "cpu_checkpointing": true, "contiguous_memory_optimization": false,
      "number_checkpoints": null, "synchronize_checkpoint_boundary": false, "profile": false}})");
  EXPECT_TRUE(c.activation_checkpointing.enabled);
  EXPECT_TRUE(c.activation_checkpointing.cpu_checkpointing);
  EXPECT_TRUE(c.unknown_keys.empty());
  EXPECT_EQ(c.inert_keys.size(), 5u);
  // A section of null is absent, as DeepSpeed reads it; the round trip keeps the section.
  EXPECT_FALSE(parse_config(R"({"activation_checkpointing": null})").activation_checkpointing.enabled);
  const Config d = parse_config(config_to_json(c));
  EXPECT_TRUE(d.activation_checkpointing.enabled);
  EXPECT_TRUE(d.activation_checkpointing.cpu_checkpointing);
  expect_key_error(R"({"activation_checkpointing": {"cpu_checkpointing": 1}})",
                   "activation_checkpointing.cpu_checkpointing");
  expect_key_error(R"({"activation_checkpointing": true})", "activation_checkpointing");
  EXPECT_EQ(parse_config(R"({"activation_checkpointing": {"checkpoint_everything": 1}})")
                .unknown_keys,
            std::vector<std::string>{"activation_checkpointing.checkpoint_everything"});
}

TEST(Config, SchedulerSectionIsRead) {
  Config c = parse_config(R"({"scheduler": {"type": "WarmupDecayLR", "params": {
      "warmup_min_lr": 1e-5, "warmup_max_lr": "auto", "warmup_num_steps": 50,
      "total_num_steps": 500, "warmup_type": "linear"}}})");
  EXPECT_EQ(c.scheduler.type, "WarmupDecayLR");
  ASSERT_TRUE(c.scheduler.warmup_min_lr.has_value());
  EXPECT_DOUBLE_EQ(*c.scheduler.warmup_min_lr, 1e-5);
  EXPECT_FALSE(c.scheduler.warmup_max_lr.has_value());  // "auto": the trainer fills it
  EXPECT_EQ(c.scheduler.warmup_num_steps.value_or(-1), 50);
  EXPECT_EQ(c.scheduler.total_num_steps.value_or(-1), 500);
  EXPECT_EQ(c.scheduler.warmup_type, "linear");
  EXPECT_TRUE(c.is_auto("scheduler.params.warmup_max_lr"));
  Config d = parse_config(config_to_json(c));
  EXPECT_EQ(d.scheduler.type, "WarmupDecayLR");
  EXPECT_EQ(d.scheduler.total_num_steps.value_or(-1), 500);

  c = parse_config(R"({"scheduler": {"type": "WarmupCosineLR", "params": {
      "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01, "warmup_num_steps": 5}}})");
  EXPECT_DOUBLE_EQ(c.scheduler.warmup_min_ratio, 0.1);
  EXPECT_DOUBLE_EQ(c.scheduler.cos_min_ratio, 0.01);
  EXPECT_FALSE(c.scheduler.total_num_steps.has_value());

  expect_message([] { parse_config(R"({"scheduler": {"type": "OneCycle"}})"); },
                 {"scheduler.type", "OneCycle", "WarmupLR"});
  expect_message(
      [] {
        parse_config(R"({"scheduler": {"type": "WarmupLR", "params": {"total_num_steps": 9}}})");
      },
      {"scheduler.params.total_num_steps", "9", "WarmupDecayLR"});
  expect_message(
      [] {
        parse_config(
            R"({"scheduler": {"type": "WarmupCosineLR", "params": {"warmup_max_lr": 0.1}}})");
      },
      {"scheduler.params.warmup_max_lr", "0.1", "optimizer.params.lr"});
  expect_message(
      [] {
        parse_config(R"({"scheduler": {"type": "WarmupLR", "params": {"cos_min_ratio": 0.5}}})");
      },
      {"scheduler.params.cos_min_ratio", "0.5", "WarmupCosineLR"});
  expect_key_error(R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cubic"}}})",
                   "scheduler.params.warmup_type");
  expect_key_error(R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": -1}}})",
                   "scheduler.params.warmup_num_steps");
}

TEST(Config, EveryRuleErrorNamesKeyValueAndRule) {
  expect_message([] { parse_config(R"({"tiermem": {"pipeline_chunk_bytes": 5000}})"); },
                 {"tiermem.pipeline_chunk_bytes", "5000", "multiple of 4096"});
  expect_message([] { parse_config(R"({"tiermem": {"stripe_bytes": 5000}})"); },
                 {"tiermem.stripe_bytes", "5000", "multiple of 4096"});
  expect_message([] { parse_config(R"({"aio": {"block_size": 5000}})"); },
                 {"aio.block_size", "5000", "multiple of 4096"});
  // 0 s would fail every access that waits for a read in flight (a new user's finding: generate()
  // failed on and off with budgets that work).
  expect_message([] { parse_config(R"({"tiermem": {"acquire_timeout_s": 0}})"); },
                 {"tiermem.acquire_timeout_s", "0", "must be > 0"});
}

TEST(Config, SwapMaxBelowTheInitialSize) {
  // Only the maximum given: the initial size (a default) is capped to it.
  Config c = parse_config(R"({"tiermem": {"swap_max_bytes": 65536}})");
  EXPECT_EQ(c.tiermem.swap_max_bytes, 65536u);
  EXPECT_EQ(c.tiermem.swap_initial_bytes, 65536u);
  // Both given and contradictory: refused, naming both keys and values.
  expect_message(
      [] {
        parse_config(R"({"tiermem": {"swap_max_bytes": 65536, "swap_initial_bytes": "1MiB"}})");
      },
      {"tiermem.swap_initial_bytes", "1048576", "tiermem.swap_max_bytes", "65536"});
  c = parse_config(R"({"tiermem": {"swap_max_bytes": 0, "swap_initial_bytes": "1MiB"}})");
  EXPECT_EQ(c.tiermem.swap_initial_bytes, 1u << 20);  // 0 = no maximum
}

TEST(Config, AutoResolvedLineListsEveryAutoKeyWithItsValue) {
  Config c = parse_config(R"({"gradient_clipping": "auto", "train_micro_batch_size_per_gpu": "auto",
                              "zero_optimization": {"reduce_bucket_size": "auto"}})");
  EXPECT_EQ(c.given_keys.size(), 0u);
  c.train_micro_batch_size_per_gpu = 4;
  c.gradient_clipping = 1.0;
  const std::string line = auto_resolved_line(c, {{"train_micro_batch_size_per_gpu", "--batch"}});
  EXPECT_EQ(line.rfind("\"auto\" resolved: ", 0), 0u) << line;
  EXPECT_NE(line.find("gradient_clipping=1.0"), std::string::npos) << line;
  EXPECT_NE(line.find("train_micro_batch_size_per_gpu=4 (--batch)"), std::string::npos) << line;
  EXPECT_NE(line.find("zero_optimization.reduce_bucket_size=500000000"), std::string::npos) << line;
  EXPECT_EQ(auto_resolved_line(parse_config("{}")), "");
  // Not resolved here (the engine resolves the device and logs it): left out, not shown as "auto".
  Config d = parse_config(R"({"tiermem": {"device": "auto"}, "gradient_clipping": "auto"})");
  d.gradient_clipping = 1.0;
  EXPECT_EQ(auto_resolved_line(d), "\"auto\" resolved: gradient_clipping=1.0");
  EXPECT_EQ(auto_resolved_line(parse_config(R"({"tiermem": {"device": "auto"}})")), "");
}

// Swap checksums are on unless the config turns them off (issue 17).
TEST(Config, ChecksumsAreOnByDefault) {
  EXPECT_TRUE(parse_config("{}").tiermem.checksum);
  EXPECT_TRUE(parse_config(R"({"tiermem": {"device": "sim"}})").tiermem.checksum);
  EXPECT_FALSE(parse_config(R"({"tiermem": {"checksum": false}})").tiermem.checksum);
}

// The NVMe rates of the I/O bound (issue 41): the keys are non-negative GB/s, default 0
// (unknown); tiermem.machine_profile supplies what they do not, from tiermem-bench's output.
TEST(Config, NvmeRatesFromKeysOrTheMachineProfile) {
  const Config none = parse_config("{}");
  EXPECT_EQ(none.tiermem.nvme_read_gbps, 0.0);
  EXPECT_EQ(none.tiermem.machine_profile, "");
  const NvmeRates unknown = resolve_nvme_rates(none);
  EXPECT_EQ(unknown.read_gbps, 0.0);
  EXPECT_EQ(unknown.write_gbps, 0.0);
  EXPECT_EQ(unknown.source, "");
  expect_message([] { parse_config(R"({"tiermem": {"nvme_read_gbps": -1}})"); },
                 {"tiermem.nvme_read_gbps", "-1", "out of range"});
  expect_message([] { parse_config(R"({"tiermem": {"nvme_write_gbps": "fast"}})"); },
                 {"tiermem.nvme_write_gbps", "fast", "GB/s"});
  expect_key_error(R"({"tiermem": {"machine_profile": 3}})", "tiermem.machine_profile");

  const Config keys = parse_config(R"({"tiermem": {"nvme_read_gbps": 2.5, "nvme_write_gbps": 1.5,
                                       "machine_profile": "/nonexistent/profile.json"}})");
  NvmeRates r = resolve_nvme_rates(keys);  // both given: the profile is not read
  EXPECT_EQ(r.read_gbps, 2.5);
  EXPECT_EQ(r.write_gbps, 1.5);
  EXPECT_EQ(r.source, "config");
  EXPECT_EQ(parse_config(config_to_json(keys)).tiermem.machine_profile, "/nonexistent/profile.json");

  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    ("tiermem-config-profile-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream((dir / name).string()) << text;
    return (dir / name).string();
  };
  // tiermem-bench profile --json: text lines, then {"profile": {...}} last.
  const std::string good = write("good.json", "nvme: 2.6 GB/s read\n{\"profile\": {\"nvme_read_gbps\": 2.64, "
                                              "\"nvme_write_gbps\": 5.71, \"h2d_gbps\": 12}}\n");
  Config c = parse_config(R"({"tiermem": {"machine_profile": ")" + good + R"("}})");
  r = resolve_nvme_rates(c);
  EXPECT_EQ(r.read_gbps, 2.64);
  EXPECT_EQ(r.write_gbps, 5.71);
  EXPECT_EQ(r.source, "profile " + good);
  c.tiermem.nvme_write_gbps = 3;  // a key wins over the profile
  r = resolve_nvme_rates(c);
  EXPECT_EQ(r.read_gbps, 2.64);
  EXPECT_EQ(r.write_gbps, 3.0);
  EXPECT_EQ(r.source, "config and profile " + good);

  auto with_profile = [](const std::string& path) {
    Config x;
    x.tiermem.machine_profile = path;
    return x;
  };
  const std::string missing = (dir / "missing.json").string();
  expect_message([&] { resolve_nvme_rates(with_profile(missing)); },
                 {"tiermem.machine_profile", missing, "tiermem-bench profile --json"});
  const std::string garbage = write("garbage.json", "not json at all\n");
  expect_message([&] { resolve_nvme_rates(with_profile(garbage)); },
                 {"tiermem.machine_profile", garbage, "not a machine profile", "tiermem-bench profile --json"});
  expect_message([&] { resolve_nvme_rates(with_profile(dir.string())); },  // was "no JSON object"
                 {"tiermem.machine_profile", "is a directory, not a profile file", "tiermem-bench profile --json"});
  const std::string no_rate = write("no_rate.json", R"({"profile": {"nvme_read_gbps": 2.0}})");
  expect_message([&] { resolve_nvme_rates(with_profile(no_rate)); },
                 {"tiermem.machine_profile", no_rate, "nvme_write_gbps", "tiermem-bench profile --json"});
  const std::string zero = write("zero.json", R"({"nvme_read_gbps": 0, "nvme_write_gbps": 1})");
  expect_message([&] { resolve_nvme_rates(with_profile(zero)); }, {"nvme_read_gbps", "it is 0"});
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tiermem
