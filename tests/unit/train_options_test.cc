// Tests of tiermem-train's command line and effective configuration (train_options.h).
#include "train/train_options.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
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

// A config file in the test's temporary directory, removed at the end.
class ConfigFile {
 public:
  explicit ConfigFile(const std::string& json) {
    path_ = (std::filesystem::temp_directory_path() /
             ("tiermem_train_options_" + std::to_string(::getpid()) + "_" +
              std::to_string(next_++) + ".json"))
                .string();
    std::ofstream(path_) << json;
  }
  ~ConfigFile() { std::filesystem::remove(path_); }
  const std::string& path() const { return path_; }

 private:
  static inline int next_ = 0;
  std::string path_;
};

Config with_config(const std::string& json, std::vector<std::string> args, int world = 1) {
  ConfigFile f(json);
  args.insert(args.end(), {"--config", f.path()});
  TrainOptions o;
  EXPECT_EQ(parse(args, &o), -1);
  return effective_config(o, 0, world);
}

TEST(TrainOptions, OnlyAZeroStageTrainsTheSameRunAsNoConfig) {
  TrainOptions o;
  ASSERT_EQ(parse({"--model", "tiny"}, &o), -1);
  const Config none = effective_config(o, 0, 1);
  const Config stage3 = with_config(R"({"zero_optimization": {"stage": 3}})", {"--model", "tiny"});
  const Config autos = with_config(R"({"zero_optimization": {"stage": 3},
      "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
      "train_batch_size": "auto", "gradient_clipping": "auto",
      "optimizer": {"params": {"lr": "auto", "weight_decay": "auto"}}})",
                                   {"--model", "tiny"});
  for (const Config* c : {&stage3, &autos}) {
    EXPECT_EQ(c->train_micro_batch_size_per_gpu, none.train_micro_batch_size_per_gpu);
    EXPECT_EQ(c->gradient_accumulation_steps, none.gradient_accumulation_steps);
    EXPECT_EQ(c->train_batch_size, none.train_batch_size);
    EXPECT_DOUBLE_EQ(c->optimizer.lr, none.optimizer.lr);
    EXPECT_DOUBLE_EQ(c->optimizer.weight_decay, none.optimizer.weight_decay);
    EXPECT_DOUBLE_EQ(c->gradient_clipping, none.gradient_clipping);
    EXPECT_DOUBLE_EQ(c->optimizer.beta1, none.optimizer.beta1);
    EXPECT_DOUBLE_EQ(c->optimizer.eps, none.optimizer.eps);
  }
  const DemoDefaults d = demo_defaults("tiny");
  EXPECT_EQ(none.train_micro_batch_size_per_gpu, d.batch);
  EXPECT_DOUBLE_EQ(none.optimizer.lr, d.lr);
  EXPECT_DOUBLE_EQ(none.gradient_clipping, 1.0);  // the trainer's clipping default
  EXPECT_DOUBLE_EQ(none.optimizer.weight_decay, 0.0);
  // A value the file gives is kept.
  const Config given = with_config(
      R"({"gradient_clipping": 0.5, "optimizer": {"params": {"lr": 0.02}}})", {"--model", "tiny"});
  EXPECT_DOUBLE_EQ(given.gradient_clipping, 0.5);
  EXPECT_DOUBLE_EQ(given.optimizer.lr, 0.02);
}

TEST(TrainOptions, BatchTripleDerivedAsDeepSpeedDoes) {
  Config c = with_config(R"({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2})",
                         {"--model", "tiny"});
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 2);
  EXPECT_EQ(c.gradient_accumulation_steps, 4);
  c = with_config(R"({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2})",
                  {"--model", "tiny"}, /*world=*/2);
  EXPECT_EQ(c.gradient_accumulation_steps, 2);
  c = with_config(R"({"train_batch_size": 32})", {"--model", "tiny"});
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 32);
  EXPECT_EQ(c.gradient_accumulation_steps, 1);
  c = with_config(R"({"train_batch_size": 32})", {"--model", "tiny", "--batch", "4"});
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 4);
  EXPECT_EQ(c.gradient_accumulation_steps, 8);
  c = with_config(R"({"gradient_accumulation_steps": 3})", {"--model", "tiny", "--batch", "2"}, 2);
  EXPECT_EQ(c.train_batch_size, 12);
}

TEST(TrainOptions, InconsistentBatchTripleNamesTheKeysAndFlags) {
  auto message = [](const std::string& json, std::vector<std::string> args) {
    try {
      with_config(json, std::move(args));
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("no ConfigError");
  };
  std::string m = message(R"({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
                              "gradient_accumulation_steps": 2})",
                          {"--model", "tiny"});
  for (const char* n : {"train_batch_size", "= 8", "train_micro_batch_size_per_gpu", "= 2",
                        "gradient_accumulation_steps", "must equal"})
    EXPECT_NE(m.find(n), std::string::npos) << n << " not in: " << m;
  m = message(R"({"train_batch_size": 8})", {"--model", "tiny", "--batch", "3"});
  EXPECT_NE(m.find("--batch"), std::string::npos) << m;
  EXPECT_NE(m.find("train_batch_size"), std::string::npos) << m;
  m = message(R"({"train_batch_size": 8})",
              {"--model", "tiny", "--batch", "2", "--grad-accum", "2"});
  EXPECT_NE(m.find("--grad-accum"), std::string::npos) << m;
}

TEST(TrainOptions, SchedulerParametersDefaultToTheTrainersValues) {
  Config c = with_config(R"({"scheduler": {"type": "WarmupDecayLR"}})",
                         {"--model", "tiny", "--steps", "50", "--lr", "0.01"});
  EXPECT_DOUBLE_EQ(c.scheduler.warmup_max_lr.value_or(-1), 0.01);
  EXPECT_DOUBLE_EQ(c.scheduler.warmup_min_lr.value_or(-1), 0.0);
  EXPECT_EQ(c.scheduler.total_num_steps.value_or(-1), 50);
  EXPECT_EQ(c.scheduler.warmup_num_steps.value_or(-1),
            std::min(demo_defaults("tiny").warmup, 50 / 10));
  // Given in the file: kept, and the peak is the lr the run reports.
  c = with_config(R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.005,
                      "warmup_num_steps": 7}}})",
                  {"--model", "tiny"});
  EXPECT_DOUBLE_EQ(*c.scheduler.warmup_max_lr, 0.005);
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 0.005);
  EXPECT_EQ(*c.scheduler.warmup_num_steps, 7);
  EXPECT_FALSE(c.scheduler.total_num_steps.has_value());
  // An "auto" peak is the optimizer's lr from the file.
  c = with_config(R"({"optimizer": {"params": {"lr": 0.004}},
                      "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}})",
                  {"--model", "tiny"});
  EXPECT_DOUBLE_EQ(*c.scheduler.warmup_max_lr, 0.004);
  // Flags beat the file.
  c = with_config(R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.005,
                      "warmup_num_steps": 7}}})",
                  {"--model", "tiny", "--lr", "0.02", "--warmup", "3"});
  EXPECT_DOUBLE_EQ(*c.scheduler.warmup_max_lr, 0.02);
  EXPECT_EQ(*c.scheduler.warmup_num_steps, 3);
}

TEST(TrainOptions, TextDataChangesAPresetsVocabularyWithOneNote) {
  TrainOptions o;
  ASSERT_EQ(parse({"--model", "gpt2", "--data", "corpus.txt"}, &o), -1);
  const std::string note = vocab_change_note(o);
  EXPECT_NE(note.find("50257 -> 256"), std::string::npos) << note;
  EXPECT_NE(note.find("M parameters"), std::string::npos) << note;
  EXPECT_NE(note.find("124.44 M"), std::string::npos) << note;  // what the preset would have been
  ASSERT_EQ(parse({"--model", "mini", "--data", "corpus.txt"}, &o), -1);
  EXPECT_EQ(vocab_change_note(o), "");  // mini's vocabulary is 256 already
  ASSERT_EQ(parse({"--model", "gpt2", "--data", "tokens.bin"}, &o), -1);
  EXPECT_EQ(vocab_change_note(o), "");  // token files keep the vocabulary
  EXPECT_EQ(train_vocab_size(o), 50257);
  // --model custom has GPT-2's vocabulary too: the same note.
  ASSERT_EQ(parse({"--model", "custom", "--layers", "2", "--d-model", "64", "--data", "c.txt"}, &o),
            -1);
  EXPECT_NE(vocab_change_note(o).find("50257 -> 256"), std::string::npos);
  EXPECT_EQ(train_vocab_size(o), 256);
}

TEST(TrainOptions, VocabSizeChoosesTheVocabulary) {
  TrainOptions o;
  ASSERT_EQ(parse({"--model", "gpt2", "--data", "corpus.txt", "--vocab-size", "50257"}, &o), -1);
  EXPECT_EQ(train_vocab_size(o), 50257);
  EXPECT_EQ(vocab_change_note(o), "");  // what was asked: nothing to say
  ASSERT_EQ(parse({"--model", "tiny", "--data", "corpus.txt", "--vocab-size", "1000"}, &o), -1);
  EXPECT_EQ(train_vocab_size(o), 1000);
  ASSERT_EQ(parse({"--model", "gpt2", "--data", "tokens.bin", "--vocab-size", "100"}, &o), -1);
  EXPECT_EQ(train_vocab_size(o), 100);  // a token file's ids are checked when it loads
  ASSERT_EQ(parse({"--model", "tiny", "--data", "corpus.txt", "--vocab-size", "255"}, &o), -1);
  try {
    (void)train_vocab_size(o);
    FAIL() << "no UsageError";
  } catch (const UsageError& e) {
    EXPECT_EQ(e.key_path(), "--vocab-size");
    EXPECT_NE(std::string(e.what()).find("at least 256"), std::string::npos) << e.what();
  }
  EXPECT_EQ(parse({"--vocab-size", "0"}, &o), 2);
}

TEST(TrainOptions, ActivationCheckpointingFlagOrSection) {
  TrainOptions o;
  ASSERT_EQ(parse({"--model", "tiny"}, &o), -1);
  EXPECT_FALSE(effective_config(o, 0, 1).activation_checkpointing.enabled);
  ASSERT_EQ(parse({"--model", "tiny", "--activation-checkpointing"}, &o), -1);
  EXPECT_TRUE(effective_config(o, 0, 1).activation_checkpointing.enabled);
}

}  // namespace
// --save's room is checked before the first step, not found missing at the first save; nothing is
// created by the check, also for a directory that does not exist yet.
TEST(TrainOptions, SaveRoomIsCheckedUpFrontNamingBothSizes) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "tiermem_save_room_test" / "ck";
  std::filesystem::remove_all(dir.parent_path());
  EXPECT_NO_THROW(check_save_room(dir.string(), 4096));
  try {
    check_save_room(dir.string(), std::uint64_t{1} << 60);
    FAIL() << "1 EiB fitted";
  } catch (const UsageError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("1152921504606846976 bytes"), std::string::npos) << m;
    EXPECT_NE(m.find("free"), std::string::npos) << m;
    EXPECT_NE(m.find("--save"), std::string::npos) << m;
  }
  EXPECT_FALSE(std::filesystem::exists(dir.parent_path())) << "the check created a directory";
}

}  // namespace tiermem::train
