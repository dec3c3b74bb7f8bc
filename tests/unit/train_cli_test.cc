// tiermem-train's command line against bad input (issue 8): each case must end in ONE line
// "tiermem-train: error: ..." on stderr, exit code 2, and no training step:
//   negative / absurd / zero sizes and counts; a device budget smaller than the largest single
//   tensor (the message names the tensor and what it needs); a --swap-dir on a filesystem without
//   O_DIRECT (a ramfs mount; skipped loudly when mount is not permitted); a read-only directory
//   (a read-only bind mount, else chattr +i, else skipped loudly: root ignores permission bits);
//   a --swap-dir / --save / --resume that is a file or lies under a file; a --resume directory
//   that holds no checkpoint; a bad --config file.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#ifndef TIERMEM_TRAIN_BIN
#error "TIERMEM_TRAIN_BIN must name the tiermem-train executable"
#endif

namespace {
namespace fs = std::filesystem;

struct Result {
  int exit_code = -1;
  std::string out, err;
};

std::string slurp(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool sh(const std::string& cmd) { return std::system((cmd + " >/dev/null 2>&1").c_str()) == 0; }

class TrainCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("tiermem_train_cli_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    std::string text;
    for (int i = 0; i < 200; ++i)
      text += "bad input, one line, exit code two " + std::to_string(i) + "\n";
    std::ofstream(dir_ / "corpus.txt") << text;
    std::ofstream(dir_ / "a_file") << "not a directory\n";
  }
  void TearDown() override {
    for (const fs::path& m : mounts_) sh("umount " + m.string());
    if (!immutable_.empty()) sh("chattr -i " + immutable_.string());
    fs::remove_all(dir_);
  }

  // `env`: what goes before the binary on the shell line (VAR=value ..., or env -u VAR ...).
  Result run(const std::string& args, const std::string& env = "") {
    const fs::path out = dir_ / "stdout.txt", err = dir_ / "stderr.txt";
    // Small defaults for what `args` does not set itself.
    std::string base = " --model tiny --eval-every 0 --json";
    if (args.find("--data") == std::string::npos) base += " --data corpus.txt";
    for (const char* flag : {"--seq-len 16", "--batch 2", "--steps 2"}) {
      const std::string f(flag);
      if (args.find(f.substr(0, f.find(' '))) == std::string::npos) base += " " + f;
    }
    const std::string cmd = "cd " + dir_.string() + " && OMP_NUM_THREADS=1 " + env + " " + TIERMEM_TRAIN_BIN +
                            base + " " + args + " >" + out.string() + " 2>" + err.string();
    const int status = std::system(cmd.c_str());
    Result r;
    r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    r.out = slurp(out);
    r.err = slurp(err);
    return r;
  }

  // The contract: exit 2, exactly one line on stderr that starts with the program's prefix and
  // contains every `needles`, no step run.
  void expect_usage_error(const std::string& args, std::initializer_list<std::string> needles) {
    SCOPED_TRACE(args);
    Result r = run(args);
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_EQ(r.err.rfind("tiermem-train: error: ", 0), 0u) << r.err;
    EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << "not one line: " << r.err;
    for (const std::string& n : needles) EXPECT_NE(r.err.find(n), std::string::npos) << r.err;
    EXPECT_EQ(r.out.find("\"step\""), std::string::npos) << "a step ran: " << r.out;
  }

  fs::path dir_;
  std::vector<fs::path> mounts_;
  fs::path immutable_;
};

TEST_F(TrainCli, AMissingOrTooSmallDataFileIsBadInputExit2) {
  expect_usage_error("--data missing.txt", {"--data missing.txt", "no such file or directory"});
  {
    std::ofstream f(dir_ / "one_byte.txt");
    f << "x";
  }
  expect_usage_error("--data one_byte.txt", {"--data one_byte.txt"});
}

TEST_F(TrainCli, NegativeAbsurdAndZeroSizes) {
  expect_usage_error("--device-budget -5", {"--device-budget"});
  expect_usage_error("--device-budget=-5", {"--device-budget", "negative"});
  expect_usage_error("--device-budget 1EB", {"--device-budget"});
  expect_usage_error("--device-budget 2048TB", {"--device-budget", "1 PiB"});
  expect_usage_error("--device-budget 1e18", {"--device-budget", "1 PiB"});
  expect_usage_error("--device-budget 0", {"--device-budget", "> 0"});
  expect_usage_error("--device-budget 99999999999999999999999", {"--device-budget"});
  expect_usage_error("--batch 0", {"--batch"});
  expect_usage_error("--batch -3", {"--batch"});
  expect_usage_error("--steps 0", {"--steps"});
  expect_usage_error("--seq-len 0", {"--seq-len"});
  expect_usage_error("--seq-len 100000", {"--seq-len", "context"});
  expect_usage_error("--grad-accum 0", {"--grad-accum"});
  expect_usage_error("--lr -1", {"--lr"});
  expect_usage_error("--save-every 0 --save ck", {"--save-every"});
  expect_usage_error("--save-every 2", {"--save-every", "--save"});
}

TEST_F(TrainCli, AValueThatIsNotANumberIsCalledThatNotOutOfRange) {
  for (const char* bad : {"--lr abc", "--steps ten", "--warmup x", "--batch 1x"}) {
    expect_usage_error(bad, {std::string(bad).substr(0, std::string(bad).find(' ')), "number"});
    Result r = run(bad);
    EXPECT_EQ(r.err.find("not in range"), std::string::npos) << bad << ": " << r.err;
  }
  // A learning rate outside its range, with the bounds as --help shows them; NaN is no number.
  expect_usage_error("--lr 0", {"--lr", "0 is outside [1e-12, 10]"});
  expect_usage_error("--lr nan", {"--lr", "'nan' is not a finite number"});
  // An integer option given a fraction: not a whole number, not out of range.
  for (const char* bad : {"--steps 1.5", "--batch 2e3", "--warmup 0.5"}) {
    expect_usage_error(bad, {std::string(bad).substr(0, std::string(bad).find(' ')), "is not a whole number"});
  }
  // An option given twice: said so, not CLI11's "At Most 1 required but received 2".
  expect_usage_error("--model tiny --model gpt2", {"--model was given ", " times: give it once"});
}

TEST_F(TrainCli, DeviceBudgetBelowTheLargestTensorNamesIt) {
  // tiny on byte-level text: the largest module is a transformer block (50816 bytes, fp32; 53248
  // in 4 KiB device pages).
  expect_usage_error("--device-budget 4KiB", {"--device-budget", "largest tensor",
                                              "'block.0.param'", "needs 52.0 KiB (53248 bytes"});
  expect_usage_error("--device-budget 50816", {"--device-budget", "'block.0.param'"});
  expect_usage_error("--device-budget 53247", {"--device-budget", "'block.0.param'"});
  // A budget that holds it is accepted (the run trains its two steps).
  Result ok = run("--device-budget 53248 --swap-dir swap");
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
}

TEST_F(TrainCli, PathThatIsAFile) {
  expect_usage_error("--swap-dir a_file", {"--swap-dir", "a_file", "is a file"});
  expect_usage_error("--swap-dir a_file/sub", {"--swap-dir", "a_file/sub", "cannot create"});
  expect_usage_error("--swap-dir swap --save a_file", {"--save", "a_file", "is a file"});
  expect_usage_error("--swap-dir swap --save a_file/ck", {"--save", "cannot create"});
  expect_usage_error("--swap-dir swap --resume a_file", {"--resume", "a_file"});
  expect_usage_error("--swap-dir swap --config a_dir_that_is_missing.json", {"--config"});
  expect_usage_error("--swap-dir ''", {"--swap-dir", "empty"});
  expect_usage_error("--swap-dir swap --save ''", {"--save", "empty"});
  // A directory as the trace file was found only when the run ended (exit 1 after training).
  expect_usage_error("--swap-dir swap --trace .", {"--trace", "is a directory: give a file path"});
}

// A --resume directory that holds no checkpoint is bad input, refused before the engine is set up
// (it was refused by the checkpoint reader after the engine's setup, exit 1): exit 2, one line
// naming the directory and what a checkpoint directory holds, no swap directory made.
TEST_F(TrainCli, ResumeFromADirectoryThatIsNoCheckpointIsRefusedUpFront) {
  fs::create_directories(dir_ / "empty_dir");
  fs::create_directories(dir_ / "partial" / "rank0");  // a save that never wrote its manifest
  std::ofstream(dir_ / "partial" / "rank0" / "state-00000001.bin.tmp") << "x";
  for (const char* d : {"empty_dir", "partial", "."}) {
    expect_usage_error(std::string("--swap-dir swap --resume ") + d,
                       {"--resume", std::string("'") + d + "' is not a checkpoint directory",
                        "no rank0/manifest.json", "rank<r>/manifest.json"});
  }
  EXPECT_FALSE(fs::exists(dir_ / "swap")) << "the engine was set up before the refusal";
}

// A bad --config file is bad input too: exit 2 and one line naming the file or the key.
TEST_F(TrainCli, BadConfigFile) {
  std::ofstream(dir_ / "not_json.json") << "zero_optimization: {stage: 3}\n";
  expect_usage_error("--swap-dir swap --config not_json.json", {"not_json.json"});
  std::ofstream(dir_ / "bad_stage.json") << R"({"zero_optimization": {"stage": 7}})";
  expect_usage_error("--swap-dir swap --config bad_stage.json", {"zero_optimization.stage", "7"});
  std::ofstream(dir_ / "bad_size.json")
      << R"({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "lots"}})";
  expect_usage_error("--swap-dir swap --config bad_size.json",
                     {"zero_optimization.stage3_prefetch_bucket_size", "lots"});
}

// Counts the lines of `text` that contain `needle`.
int lines_with(const std::string& text, const std::string& needle) {
  std::istringstream in(text);
  int n = 0;
  for (std::string line; std::getline(in, line);) n += line.find(needle) != std::string::npos;
  return n;
}

// DeepSpeed's batch triple (issue 14): an inconsistent or indivisible one is refused naming the
// keys (and the flag that set one); a pipeline chunk that breaks its rule names key, value, rule.
TEST_F(TrainCli, InconsistentBatchTripleAndBrokenRulesExitWithCode2) {
  std::ofstream(dir_ / "triple.json")
      << R"({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3})";
  // The harness passes --batch 2, which beats the file's micro-batch: the message names the flag.
  expect_usage_error("--swap-dir swap --config triple.json",
                     {"train_batch_size", "= 8", "'--batch' = 2", "gradient_accumulation_steps",
                      "= 3", "must equal"});
  std::ofstream(dir_ / "global.json") << R"({"train_batch_size": 7})";
  expect_usage_error("--swap-dir swap --config global.json",
                     {"train_batch_size", "= 7", "--batch"});
  std::ofstream(dir_ / "chunk.json") << R"({"tiermem": {"pipeline_chunk_bytes": 5000}})";
  expect_usage_error("--swap-dir swap --config chunk.json",
                     {"tiermem.pipeline_chunk_bytes", "5000", "multiple of 4096"});
  std::ofstream(dir_ / "swapmax.json")
      << R"({"tiermem": {"swap_max_bytes": 65536, "swap_initial_bytes": "1MiB"}})";
  expect_usage_error("--swap-dir swap --config swapmax.json",
                     {"tiermem.swap_initial_bytes", "tiermem.swap_max_bytes"});
}

// "auto" values become tiermem-train's (one line lists them), and each key read but not acted on
// is named once, with why.
TEST_F(TrainCli, AutoIsResolvedInOneLineAndInertKeysWarnOnce) {
  std::ofstream(dir_ / "auto.json") << R"({
    "train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto",
    "optimizer": {"params": {"lr": "auto"}},
    "activation_checkpointing": {"partition_activations": true},
    "steps_per_print": 10,
    "zero_optimization": {"stage": 3, "contiguous_gradients": true}})";
  Result r = run("--swap-dir swap --config auto.json --steps 1");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(lines_with(r.err, "\"auto\" resolved:"), 1) << r.err;
  EXPECT_EQ(lines_with(r.err, "train_micro_batch_size_per_gpu=2 (--batch)"), 1) << r.err;
  EXPECT_EQ(lines_with(r.err, "gradient_clipping=1.0"), 1) << r.err;
  EXPECT_EQ(lines_with(r.err, "optimizer.params.lr=0.003"), 1) << r.err;  // tiny's demo lr
  for (const char* k : {"'activation_checkpointing.partition_activations'", "'steps_per_print'",
                        "'zero_optimization.contiguous_gradients'"})
    EXPECT_EQ(lines_with(r.err, k), 1) << k << " in: " << r.err;
  EXPECT_EQ(lines_with(r.err, "no model parallelism to partition over"), 1) << r.err;
  // train_batch_size 6 with --batch 2 (the harness's) trains 3 micro-batches per step:
  // 6 sequences x 16 tokens = 96 tokens per step, not 32.
  std::ofstream(dir_ / "global.json") << R"({"train_batch_size": 6})";
  Result g = run("--config global.json --swap-dir swap --steps 1 --seq-len 16");
  ASSERT_EQ(g.exit_code, 0) << g.err;
  EXPECT_NE(g.out.find("\"tokens\":96,"), std::string::npos) << g.out;
}

// --device: cuda without a usable GPU is refused in one line with exit 2 (never a silent CPU
// run); auto says in one line which device it picked. On a machine with a GPU, auto picks cuda
// and the refusal cannot happen: that part skips, saying so.
TEST_F(TrainCli, DeviceCudaWithoutAGpuIsRefusedAndAutoSaysWhatItPicked) {
  Result a = run("--device auto --swap-dir swap --steps 1");
  ASSERT_EQ(a.exit_code, 0) << a.err;
  const bool picked_cuda = lines_with(a.err, "auto picked cuda") == 1;
  EXPECT_EQ(lines_with(a.err, "auto picked cuda") + lines_with(a.err, "auto picked sim"), 1)
      << a.err;
  if (picked_cuda) GTEST_SKIP() << "a CUDA device is visible: --device cuda is not refused here";
  expect_usage_error("--device cuda --swap-dir swap", {"error: --device: no usable CUDA device for 'cuda'"});
  // The same from the config file, naming its key.
  std::ofstream(dir_ / "cuda.json") << R"({"tiermem": {"device": "cuda"}})";
  expect_usage_error("--config cuda.json --swap-dir swap",
                     {"error: tiermem.device: no usable CUDA device for 'cuda'"});
  // --device sim is quiet about devices and trains.
  Result s = run("--device sim --swap-dir swap --steps 1");
  EXPECT_EQ(s.exit_code, 0) << s.err;
  EXPECT_EQ(lines_with(s.err, "auto picked"), 0) << s.err;
}

// Every "loss" of a --json run's step lines, as printed.
std::vector<std::string> step_losses(const std::string& out) {
  std::vector<std::string> losses;
  const std::regex loss("\"loss\":([-0-9.e+]+)");
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);) {
    std::smatch m;
    if (line.find("\"step\"") != std::string::npos && std::regex_search(line, m, loss))
      losses.push_back(m[1]);
  }
  return losses;
}

// A config of only {"zero_optimization": {"stage": 3}} trains the same run as no config: the
// micro-batch, lr, weight decay and clipping are tiermem-train's, not the library's defaults.
TEST_F(TrainCli, OnlyAZeroStageTrainsTheSameLossesAsNoConfig) {
  std::ofstream(dir_ / "stage3.json") << R"({"zero_optimization": {"stage": 3}})";
  std::ofstream(dir_ / "autos.json") << R"({"zero_optimization": {"stage": 3},
      "train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto",
      "optimizer": {"params": {"lr": "auto", "weight_decay": "auto"}}})";
  auto losses = [&](const std::string& extra) {
    const std::string cmd = "cd " + dir_.string() + " && OMP_NUM_THREADS=1 " + TIERMEM_TRAIN_BIN +
                            " --model tiny --eval-every 0 --json --data corpus.txt --seq-len 16"
                            " --steps 4 --swap-dir swap " +
                            extra + " >out.txt 2>err.txt";
    EXPECT_EQ(std::system(cmd.c_str()), 0) << slurp(dir_ / "err.txt");
    return step_losses(slurp(dir_ / "out.txt"));
  };
  const std::vector<std::string> none = losses("");
  ASSERT_EQ(none.size(), 4u);
  EXPECT_EQ(losses("--config stage3.json"), none);
  EXPECT_EQ(losses("--config autos.json"), none);
}

// The summary's I/O bound (issue 41): the last step's NVMe bytes priced at the rates of the
// machine profile the config names (tiermem.machine_profile: tiermem-bench profile --json's
// output), or, without one, a line saying how to get it; a profile that cannot be read is refused
// naming the key and the path.
TEST_F(TrainCli, IoBoundFromTheMachineProfile) {
  std::ofstream(dir_ / "profile.json") << "profile: measured\n{\"profile\": {\"nvme_read_gbps\": 2.5, "
                                          "\"nvme_write_gbps\": 1.25}}\n";
  std::ofstream(dir_ / "prof.json") << R"({"tiermem": {"machine_profile": "profile.json"}})";
  std::ofstream(dir_ / "missing.json") << R"({"tiermem": {"machine_profile": "nope/profile.json"}})";
  const std::string offload = "--engine zero --offload nvme --swap-dir swap --device sim --device-budget 256KiB "
                              "--host-budget 256KiB --steps 3 ";
  Result r = run(offload + "--config prof.json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string::size_type at = r.out.rfind("{\"summary\"");
  ASSERT_NE(at, std::string::npos) << r.out;
  const std::string summary = r.out.substr(at);
  for (const char* key : {"\"last_step_io\"", "\"io_bound_seconds\"", "\"nvme_read_gbps\":2.5",
                          "\"nvme_write_gbps\":1.25"}) {
    EXPECT_NE(summary.find(key), std::string::npos) << key << " in " << summary;
  }
  const std::regex bound(R"re("io_bound_seconds":([0-9.e+-]+))re");
  std::smatch m;
  ASSERT_TRUE(std::regex_search(summary, m, bound)) << summary;
  EXPECT_GT(std::stod(m[1]), 0.0) << summary;

  // Text: the bound line beside compute and the step; without rates, how to measure them.
  auto text = [&](const std::string& extra) {
    const std::string cmd = "cd " + dir_.string() + " && OMP_NUM_THREADS=1 " + TIERMEM_TRAIN_BIN +
                            " --model tiny --eval-every 0 --data corpus.txt --seq-len 16 --batch 2 " + offload +
                            extra + " >out.txt 2>err.txt";
    EXPECT_EQ(std::system(cmd.c_str()), 0) << slurp(dir_ / "err.txt");
    return slurp(dir_ / "out.txt");
  };
  const std::string known = text("--config prof.json");
  EXPECT_TRUE(std::regex_search(known, std::regex(R"(I/O bound +[0-9.]+ m?s/step \(.* read at 2\.50 GB/s, .* )"
                                                  R"(written at 1\.25 GB/s\) beside compute [0-9.]+ m?s/step; step )")))
      << known;
  const std::string unknown = text("");
  EXPECT_NE(unknown.find("I/O bound       - (NVMe rates unknown: tiermem-bench profile --json > profile.json"),
            std::string::npos)
      << unknown;

  expect_usage_error(offload + "--config missing.json", {"tiermem.machine_profile", "nope/profile.json",
                                                         "tiermem-bench profile --json"});
  // A device (or FIFO) is refused before it is read: /dev/zero would be read until memory ran out.
  std::ofstream(dir_ / "device.json") << R"({"tiermem": {"machine_profile": "/dev/zero"}})";
  expect_usage_error(offload + "--config device.json", {"tiermem.machine_profile", "/dev/zero",
                                                        "is not a regular file"});
  // The resident engine moves nothing to price, and refuses a profile it cannot read all the same.
  Result resident = run("--engine resident --config missing.json --swap-dir swap");
  EXPECT_EQ(resident.exit_code, 2) << resident.err;
  EXPECT_NE(resident.err.find("tiermem.machine_profile"), std::string::npos) << resident.err;
}

// A budget is honoured or refused: with a config of stage 0 and no offload, --engine auto would
// pick the resident engine, which holds everything in plain memory; a host budget makes it
// ZeroEngine, which refuses a budget below the state's host homes. --engine resident says it
// ignores the budget.
TEST_F(TrainCli, AHostBudgetIsNeverSilentlyIgnored) {
  std::ofstream(dir_ / "stage0.json") << R"({"zero_optimization": {"stage": 0}})";
  expect_usage_error("--config stage0.json --host-budget 64KiB --swap-dir swap",
                     {"host budget", "tiermem.host_budget_bytes", "host homes"});
  Result r = run("--config stage0.json --host-budget 64KiB --engine resident --swap-dir swap");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("--engine resident ignores the host and device budgets"), std::string::npos) << r.err;
  Result plain = run("--config stage0.json --swap-dir swap");  // no budget: the resident engine, quietly
  EXPECT_EQ(plain.exit_code, 0) << plain.err;
  EXPECT_EQ(plain.err.find("ignores the host"), std::string::npos) << plain.err;
  // A budget beyond what the address space holds is refused before training, naming the key.
  Result huge = run("--host-budget 100TiB --swap-dir swap");
  EXPECT_EQ(huge.exit_code, 2) << huge.err;
  EXPECT_NE(huge.err.find("tiermem-train: error: tiermem.host_budget_bytes = 109951162777600: the host pool "
                          "cannot reserve the 200.0 TiB of address space"),
            std::string::npos)
      << huge.err;
  EXPECT_EQ(huge.err.find("step 1"), std::string::npos) << huge.err;  // refused before training
}

// A run refused after its paths were checked (here: a device budget below the largest tensor)
// leaves no directory it created behind: not the swap directory, not the checkpoint directory.
TEST_F(TrainCli, RefusedRunLeavesNoDirectoriesBehind) {
  expect_usage_error("--device-budget 4KiB --swap-dir fresh/swap --save fresh_ck/a",
                     {"--device-budget", "largest tensor"});
  EXPECT_FALSE(fs::exists(dir_ / "fresh")) << "swap directory left behind";
  EXPECT_FALSE(fs::exists(dir_ / "fresh_ck")) << "checkpoint directory left behind";
  // A run that goes ahead still gets its directories (the engine and the writer create them).
  Result ok = run("--swap-dir fresh/swap --save fresh_ck/a");
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
  EXPECT_TRUE(fs::exists(dir_ / "fresh_ck" / "a"));
}

// `tiermem-train ... | head -3`: a closed stdout stops the run like SIGTERM (exit 143) and leaves
// no swap file or lock behind (issue 14), instead of dying of SIGPIPE with them in place.
TEST_F(TrainCli, ClosedStdoutStopsLikeSigtermAndCleansUp) {
  const std::string cmd = "cd " + dir_.string() + " && (OMP_NUM_THREADS=1 " + TIERMEM_TRAIN_BIN +
                          " --model tiny --eval-every 0 --json --data corpus.txt --seq-len 16"
                          " --batch 2 --steps 20000 --swap-dir swap 2>err.txt; echo $? >rc.txt)"
                          " | head -3 >head.txt";
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  EXPECT_EQ(slurp(dir_ / "rc.txt"), "143\n") << slurp(dir_ / "err.txt");
  EXPECT_EQ(lines_with(slurp(dir_ / "head.txt"), "\"step\""), 3);
  // The swap directory the run made went with it (src/nvme/made_dirs.h), and nothing in it.
  EXPECT_FALSE(fs::exists(dir_ / "swap"));
  int files = 0;
  if (fs::exists(dir_ / "swap")) {
    for (const auto& e : fs::recursive_directory_iterator(dir_ / "swap"))
      if (e.is_regular_file()) ADD_FAILURE() << "left behind: " << e.path() << " (" << ++files << ")";
  }
}

// SIGTERM while the engine writes its initial state (TIERMEM_TEST_TERM_AT=init sends it at the
// start of initialisation, deterministically): the run stops before step 1 with exit 143, says
// why once, prints its summary and leaves no swap file or lock behind.
TEST_F(TrainCli, SigtermDuringInitialisationStopsCleanly) {
  const std::string cmd = "cd " + dir_.string() + " && OMP_NUM_THREADS=1 TIERMEM_TEST_TERM_AT=init:1 " +
                          TIERMEM_TRAIN_BIN +
                          " --model tiny --eval-every 0 --json --data corpus.txt --seq-len 16"
                          " --batch 2 --steps 5 --offload nvme --swap-dir swap >out.txt 2>err.txt;"
                          " echo $? >rc.txt";
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  const std::string err = slurp(dir_ / "err.txt");
  EXPECT_EQ(slurp(dir_ / "rc.txt"), "143\n") << err;
  EXPECT_EQ(lines_with(err, "SIGTERM received during initialisation"), 1) << err;
  EXPECT_EQ(lines_with(slurp(dir_ / "out.txt"), "\"step\""), 0) << "no step may run";
  EXPECT_EQ(lines_with(slurp(dir_ / "out.txt"), "\"summary\""), 1);
  EXPECT_FALSE(fs::exists(dir_ / "swap")) << "the swap directory the run made goes with it";
  if (fs::exists(dir_ / "swap")) {
    for (const auto& e : fs::recursive_directory_iterator(dir_ / "swap"))
      if (e.is_regular_file()) ADD_FAILURE() << "left behind: " << e.path();
  }
}

TEST_F(TrainCli, SwapDirWithoutODirect) {
  const fs::path m = dir_ / "ramfs";
  fs::create_directories(m);
  if (!sh("mount -t ramfs ramfs " + m.string()))
    GTEST_SKIP() << "cannot mount a ramfs here (not root / no CAP_SYS_ADMIN): the O_DIRECT "
                    "refusal of --swap-dir is untested in this run (SwapSpace's own O_DIRECT "
                    "message is tested by the nvme unit tests through the I/O interceptor)";
  mounts_.push_back(m);
  expect_usage_error("--swap-dir ramfs/swap", {"--swap-dir", "ramfs/swap", "O_DIRECT"});
  // With tiermem.o_direct false the same directory is accepted.
  std::ofstream(dir_ / "no_odirect.json") << R"({"tiermem": {"o_direct": false}})";
  Result ok = run("--swap-dir ramfs/swap --config no_odirect.json");
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
}

TEST_F(TrainCli, ReadOnlyDirectory) {
  const fs::path ro = dir_ / "ro";
  fs::create_directories(ro);
  std::string how;
  if (sh("mount --bind " + ro.string() + " " + ro.string())) {
    mounts_.push_back(ro);
    if (sh("mount -o remount,ro,bind " + ro.string())) how = "read-only bind mount";
  }
  if (how.empty() && sh("chattr +i " + ro.string())) {
    immutable_ = ro;
    how = "chattr +i";
  }
  if (how.empty() && ::geteuid() != 0 && sh("chmod 555 " + ro.string())) how = "chmod 555";
  if (how.empty())
    GTEST_SKIP() << "no way to make a read-only directory here (root ignores permission bits; "
                    "mount and chattr failed): read-only --swap-dir / --save untested";
  SCOPED_TRACE(how);
  expect_usage_error("--swap-dir ro", {"--swap-dir", "ro", "not writable"});
  expect_usage_error("--swap-dir ro/sub", {"--swap-dir", "ro/sub", "cannot create"});
  expect_usage_error("--swap-dir swap --save ro", {"--save", "ro", "not writable"});
}

}  // namespace

namespace {

// Shared and hostile directories (issue 17): a --swap-dir or --save owned by another user, or
// world-writable without the sticky bit, is refused with exit 2 naming it and why; a swap
// directory tiermem creates is 0700; the sticky bit (like /tmp) is accepted.
TEST_F(TrainCli, DirectoryOthersCanTamperWithIsRefused) {
  fs::create_directories(dir_ / "open");
  fs::permissions(dir_ / "open", fs::perms::all, fs::perm_options::replace);  // 0777, no sticky
  expect_usage_error("--swap-dir open", {"--swap-dir", "'open'", "world-writable (mode 0777) "
                                         "without the sticky bit"});
  expect_usage_error("--swap-dir swap --save open", {"--save", "'open'", "world-writable"});
  fs::create_directories(dir_ / "sticky");
  fs::permissions(dir_ / "sticky", fs::perms::all | fs::perms::sticky_bit,
                  fs::perm_options::replace);
  Result ok = run("--swap-dir sticky/swap --save sticky");
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
  // The swap directory it created (private to the user while it existed: 0700, made_dirs_test)
  // went with the run; the user's own directory stays.
  EXPECT_FALSE(fs::exists(dir_ / "sticky" / "swap"));
  EXPECT_TRUE(fs::exists(dir_ / "sticky"));
}

TEST_F(TrainCli, DirectoryOfAnotherUserIsRefused) {
  if (::geteuid() != 0)
    GTEST_SKIP() << "needs root to chown a directory to another uid: the refusal of a --swap-dir "
                    "/ --save owned by someone else is untested in this run";
  fs::create_directories(dir_ / "theirs");
  ASSERT_EQ(::chown((dir_ / "theirs").c_str(), 4242, 4242), 0);
  expect_usage_error("--swap-dir theirs", {"--swap-dir", "'theirs'", "owned by uid 4242"});
  expect_usage_error("--swap-dir swap --save theirs", {"--save", "'theirs'", "owned by uid 4242"});
  EXPECT_TRUE(fs::is_empty(dir_ / "theirs")) << "something was written into it";
}

}  // namespace

// OpenBLAS (DYNAMIC_ARCH) falls back to its generic pre-AVX2 kernels on a CPU model it does not
// know (Debian 12's 0.3.21 on Intel family 6 model 207: GEMMs 4x slower). tiermem-train then
// restarts once with the kernels the CPU can run and says so in one line; a user's
// OPENBLAS_CORETYPE is never overridden. OPENBLAS_VERBOSE=2 makes OpenBLAS print "Core: <name>"
// each time it loads, so the test sees which kernels each start got. Only one branch can run on
// a given machine: the other is named in the output.
TEST_F(TrainCli, OpenBlasGenericKernelsAreReplacedOnceAndAUsersChoiceIsKept) {
  auto cores = [](const std::string& err) {
    std::vector<std::string> out;
    std::istringstream in(err);
    for (std::string line; std::getline(in, line);) {
      if (line.rfind("Core: ", 0) == 0) out.push_back(line.substr(6));
    }
    return out;
  };
  const std::string note = "OpenBLAS chose its generic";
  Result a = run("--engine resident --steps 1", "env -u OPENBLAS_CORETYPE OPENBLAS_VERBOSE=2");
  ASSERT_EQ(a.exit_code, 0) << a.err;
  const std::vector<std::string> seen = cores(a.err);
  ASSERT_FALSE(seen.empty()) << "OPENBLAS_VERBOSE=2 printed no \"Core:\" line: " << a.err;
  const std::string first = seen.front();
  const bool generic = first == "Prescott" || first == "Core2" || first == "Penryn" || first == "Dunnington" ||
                       first == "Nehalem" || first == "Atom";
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (generic && avx2) {
    EXPECT_EQ(lines_with(a.err, note), 1) << a.err;
    EXPECT_TRUE(seen.back() == "SkylakeX" || seen.back() == "Haswell") << a.err;
    EXPECT_NE(lines_with(a.err, "using " + seen.back()), 0) << a.err;
  } else {
    std::cout << "OpenBLAS chose " << first << " here: nothing to replace (the other branch needs a CPU it does not know)\n";
    EXPECT_EQ(lines_with(a.err, note), 0) << a.err;
    for (const std::string& c : seen) EXPECT_EQ(c, first) << a.err;
  }
  // The user's choice stands, even a slow one, and nothing is said.
  Result u = run("--engine resident --steps 1", "OPENBLAS_CORETYPE=Prescott OPENBLAS_VERBOSE=2");
  ASSERT_EQ(u.exit_code, 0) << u.err;
  EXPECT_EQ(lines_with(u.err, note), 0) << u.err;
  for (const std::string& c : cores(u.err)) EXPECT_EQ(c, "Prescott") << u.err;
}
