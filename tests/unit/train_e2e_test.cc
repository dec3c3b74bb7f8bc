// End-to-end tests of the tiermem-train program (tools/tiermem-train/train_main.cc): the binary is run
// with small settings (the `tiny` model, a few steps) and its --json output is checked.
//   1. offloaded (params + Adam state on NVMe, small SimDevice budget) vs all-resident: the same
//      losses, bit for bit, for 20 steps;
//   2. on the default corpus (fortunes) the loss falls below a stated threshold;
//   3. resume: the losses after the resume point equal the uninterrupted run's, bit for bit;
//      a corrupt checkpoint is refused with a message naming the tensor; a swap file damaged
//      during a run (default settings: checksums on) stops it naming the tensor, and --resume
//      from the last checkpoint continues bit for bit;
//   5. the device's measured peak never exceeds its budget;
//   gradient_clipping from the config clips (and grad_norm is reported per step);
//   data errors: each bad --data gives one line naming the file and a nonzero exit before any
//   step; bad flags exit with code 2.
// (4, mpirun -np 2, is tests/unit/train_mpi_test.cc, label "mpi".)
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tiermem/dir_lock.h"
#include "unit/train_run.h"


namespace {
using namespace tiermem_train_test;
using TrainE2E = TrainBinaryTest;

const char* kTiny = "--model tiny --seq-len 16 --batch 4 --eval-every 0 --json --seed 7";

TEST_F(TrainE2E, OffloadedEqualsResidentBitwiseAndPeakWithinBudget) {
  const std::string data = " --data " + corpus() + " --steps 20 ";
  RunResult resident = run(std::string(kTiny) + data + "--engine resident");
  ASSERT_EQ(resident.exit_code, 0) << resident.err;
  RunResult offloaded = run(std::string(kTiny) + data +
                            "--engine zero --offload nvme --swap-dir swap --device sim "
                            "--device-budget 96KiB --host-budget 256KiB");
  ASSERT_EQ(offloaded.exit_code, 0) << offloaded.err;
  const auto a = losses(resident), b = losses(offloaded);
  ASSERT_EQ(a.size(), 20u);
  ASSERT_EQ(b.size(), 20u);
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i], b[i]) << "step " << i + 1 << ": resident " << a[i] << " vs offloaded " << b[i];
  }
  // The state really lived on NVMe and paged through a device 8x smaller than it... 
  const json& s = offloaded.summary;
  ASSERT_FALSE(s.is_null()) << offloaded.out;
  EXPECT_EQ(s["param_offload"], "nvme");
  EXPECT_EQ(s["optimizer_offload"], "nvme");
  EXPECT_GT(s["nvme_bytes_read"].get<std::uint64_t>(), 0u);
  EXPECT_GT(s["nvme_bytes_written"].get<std::uint64_t>(), 0u);
  const auto budget = s["device_budget_bytes"].get<std::uint64_t>();
  const auto peak = s["device_peak_bytes"].get<std::uint64_t>();
  EXPECT_EQ(budget, 96u * 1024);
  // ...and (5) its measured peak never exceeded the budget.
  EXPECT_GT(peak, 0u);
  EXPECT_LE(peak, budget);
  EXPECT_GE(s["param_bytes"].get<std::uint64_t>() + s["optimizer_bytes"].get<std::uint64_t>(),
            4 * budget);
  // The time shares tiermem-plan --check compares are of the steps after the first (which
  // records the prefetch trace), each the median over those steps of the step's own share, as
  // step_seconds is their median: their wall time holds steps 2-20 and not the whole run, and a
  // share of one step is at most the whole run's time for that part.
  EXPECT_EQ(s["shares_of_steps"], "after the first");
  double later_steps = 0;
  for (std::size_t i = 1; i < offloaded.steps.size(); ++i) later_steps += offloaded.steps[i]["seconds"].get<double>();
  const double steady = s["steady_seconds"].get<double>();
  EXPECT_GE(steady, later_steps);
  EXPECT_LT(steady, s["seconds"].get<double>() - offloaded.steps[0]["seconds"].get<double>() + 1e-9);
  EXPECT_LT(s["compute_share"].get<double>() * s["step_seconds"].get<double>(),
            s["time_split_seconds"]["compute"].get<double>());
  for (const char* f : {"compute_share", "io_wait_share", "communication_share", "optimizer_share"}) {
    EXPECT_GE(s[f].get<double>(), 0) << f;
    EXPECT_LE(s[f].get<double>(), 1) << f;
  }
  // The split's parts are disjoint: together at most the run's wall time (the deferred updates a
  // gather applies are optimizer time, the waits inside gathers I/O wait, once each).
  const json& split = s["time_split_seconds"];
  double parts = 0;
  for (const char* f : {"compute", "io_wait", "communication", "optimizer"}) parts += split[f].get<double>();
  EXPECT_LE(parts, s["seconds"].get<double>() * 1.01 + 0.01) << split.dump();
  // The summary is the last line printed.
  EXPECT_NE(offloaded.out.rfind("{\"summary\""), std::string::npos);
  EXPECT_EQ(offloaded.out.find('\n', offloaded.out.rfind("{\"summary\"")), offloaded.out.size() - 1);
}

// gradient_clipping (DeepSpeed key): each step reports the pre-clip global norm; a threshold
// above every norm changes nothing (bitwise); one below them rescales every step's gradient to
// that norm, which Adam sees from step 2 on (its first update is scale-invariant).
TEST_F(TrainE2E, GradientClippingFromTheConfig) {
  const std::string data = " --data " + corpus() + " --steps 6 --engine zero --offload nvme "
                           "--swap-dir swap --device sim ";
  auto with_clip = [&](const char* name, double clip) {
    const fs::path cfg = dir_ / name;
    std::ofstream(cfg) << "{\"zero_optimization\": {\"stage\": 3}, \"gradient_clipping\": " << clip
                       << ", \"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 0.003}}}";
    return run(std::string(kTiny) + data + "--config " + cfg.string());
  };
  const RunResult off = with_clip("off.json", 0), high = with_clip("high.json", 1e9),
                  low = with_clip("low.json", 0.05);
  for (const RunResult* r : {&off, &high, &low}) {
    ASSERT_EQ(r->exit_code, 0) << r->err;
    ASSERT_EQ(r->steps.size(), 6u) << r->out;
    for (const json& s : r->steps) {
      ASSERT_TRUE(s.contains("grad_norm")) << s.dump();
      EXPECT_GT(s["grad_norm"].get<double>(), 0.05) << "the low threshold must really clip";
    }
  }
  EXPECT_EQ(losses(off), losses(high));
  EXPECT_EQ(off.steps[0]["grad_norm"].get<double>(), low.steps[0]["grad_norm"].get<double>());
  const auto a = losses(off, 3), b = losses(low, 3);
  bool differs = false;
  for (std::size_t i = 0; i < a.size(); ++i) differs |= a[i] != b[i];
  EXPECT_TRUE(differs) << "clipping to 0.05 left the trajectory unchanged";
}

// tiermem.update_in_backward (no clipping): the last micro-batch's backward runs the modules'
// updates as their gradients complete; the losses and grad norms are the same, bit for bit, as
// with it off, with gradient accumulation, params and optimizer state paged through NVMe.
TEST_F(TrainE2E, UpdatesInBackwardChangeNothing) {
  const std::string data = " --data " + corpus() + " --steps 5 --grad-accum 2 --engine zero --offload nvme "
                           "--swap-dir swap --device sim ";
  auto with = [&](const char* name, bool on) {
    const fs::path cfg = dir_ / name;
    std::ofstream(cfg) << R"({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},)"
                       << R"( "gradient_clipping": 0, "tiermem": {"update_in_backward": )" << (on ? "true" : "false")
                       << "}}";
    return run(std::string(kTiny) + data + "--config " + cfg.string());
  };
  const RunResult off = with("off.json", false), on = with("on.json", true);
  ASSERT_EQ(off.exit_code, 0) << off.err;
  ASSERT_EQ(on.exit_code, 0) << on.err;
  ASSERT_EQ(losses(on).size(), 5u);
  EXPECT_EQ(losses(on), losses(off));
  for (std::size_t i = 0; i < 5; ++i) EXPECT_EQ(on.steps[i]["grad_norm"], off.steps[i]["grad_norm"]) << i;
  EXPECT_EQ(off.summary["updates_in_backward"].get<int>(), 0);
  // At least one module a step: the tiny model's last block's update starts at the first block's
  // backward gather (the embedding's and the first block's gradients complete after the last).
  EXPECT_GE(on.summary["updates_in_backward"].get<int>(), 5) << on.summary.dump();
}

// A ds_config with stage 3 and no offload on one rank: the parameters' home is the (sim) device
// and AdamW updates them there; same losses as the all-resident engine, bit for bit.
TEST_F(TrainE2E, Stage3WithoutOffloadEqualsResident) {
  const std::string data = " --data " + corpus() + " --steps 5 ";
  std::ofstream(dir_ / "s3.json") << R"({"zero_optimization": {"stage": 3}})";
  const RunResult resident = run(std::string(kTiny) + data + "--engine resident --config s3.json");
  const RunResult s3 = run(std::string(kTiny) + data + "--device sim --config s3.json");
  ASSERT_EQ(resident.exit_code, 0) << resident.err;
  ASSERT_EQ(s3.exit_code, 0) << s3.err;
  ASSERT_EQ(losses(s3).size(), 5u);
  EXPECT_EQ(losses(s3), losses(resident));
  EXPECT_EQ(s3.summary["param_offload"], "device") << s3.summary.dump();
}

// The GPU data path on the CPU twin of a GPU: a SimDevice whose memory the CPU cannot address
// (tiermem.sim_host_addressable false; any host access of it faults). ZeroEngine gathers stage-3
// modules into device memory, publishes AdamW's new params through host staging, and the CPU
// model reads each module through a copy down — the same losses, bit for bit, as the default
// SimDevice, with params homed on the device (offload none) and paged from NVMe (offload nvme).
TEST_F(TrainE2E, NonAddressableDeviceEqualsAddressableBitwise) {
  const std::string data = " --data " + corpus() + " --steps 5 ";
  std::ofstream(dir_ / "s3.json") << R"({"zero_optimization": {"stage": 3}})";
  std::ofstream(dir_ / "opaque.json")
      << R"({"zero_optimization": {"stage": 3}, "tiermem": {"sim_host_addressable": false}})";
  for (const char* offload : {"none", "nvme"}) {
    SCOPED_TRACE(offload);
    const std::string args = std::string(kTiny) + data + "--device sim --offload " + offload + " --swap-dir swap ";
    const RunResult plain = run(args + "--config s3.json");
    const RunResult opaque = run(args + "--config opaque.json");
    ASSERT_EQ(plain.exit_code, 0) << plain.err;
    ASSERT_EQ(opaque.exit_code, 0) << opaque.err;
    ASSERT_EQ(losses(opaque).size(), 5u);
    EXPECT_EQ(losses(opaque), losses(plain));
    EXPECT_LE(opaque.summary["device_peak_bytes"].get<double>(),
              opaque.summary["device_budget_bytes"].get<double>());
  }
}

// --offload none with the device-resident optimizer (tiermem.device_optimizer on; a GPU's
// default, here its CPU twin on SimDevice, addressable and not): stages 2 and 3 give the same
// losses, bit for bit, as the host optimizer (device_optimizer off), the summary says the state
// lived on the device, and a checkpoint saved at step 3 resumes to the same losses.
TEST_F(TrainE2E, DeviceOptimizerEqualsHostOptimizerBitwise) {
  const std::string data = " --data " + corpus() + " --steps 6 ";
  for (int stage : {2, 3}) {
    for (bool addressable : {true, false}) {
      SCOPED_TRACE("stage " + std::to_string(stage) + (addressable ? " addressable" : " opaque"));
      for (const char* mode : {"on", "off"}) {
        std::ofstream(dir_ / (std::string(mode) + ".json"))
            << R"({"zero_optimization": {"stage": )" << stage << R"(}, "tiermem": {"device_optimizer": ")" << mode
            << R"(", "sim_host_addressable": )" << (addressable ? "true" : "false") << "}}";
      }
      const std::string args = std::string(kTiny) + data + "--device sim --offload none ";
      const RunResult host = run(args + "--config off.json");
      const RunResult dev = run(args + "--config on.json");
      ASSERT_EQ(host.exit_code, 0) << host.err;
      ASSERT_EQ(dev.exit_code, 0) << dev.err;
      ASSERT_EQ(losses(dev).size(), 6u);
      EXPECT_EQ(losses(dev), losses(host));
      EXPECT_EQ(dev.summary["optimizer_offload"], "device") << dev.summary.dump();
      EXPECT_EQ(host.summary["optimizer_offload"], "host") << host.summary.dump();
      fs::remove_all(dir_ / "ck");
      const RunResult first = run(args + "--config on.json --save ck --stop-at 3");
      ASSERT_EQ(first.exit_code, 0) << first.err;
      const RunResult second = run(args + "--config on.json --resume ck");
      ASSERT_EQ(second.exit_code, 0) << second.err;
      EXPECT_EQ(losses(second), losses(host, 4, 6));
    }
  }
}

// Two runs saving into one --save directory would delete each other's files: the second is
// refused, naming the directory and the first one's pid, and the first one's checkpoint is
// untouched. A lock left by a dead run is taken over (crash_loop_test kills runs mid-save).
TEST_F(TrainE2E, SecondWriterOfACheckpointDirectoryIsRefused) {
  const std::string args = std::string(kTiny) + " --data " + corpus() +
                           " --steps 3 --engine zero --offload nvme --save ck";
  ASSERT_EQ(run(args + " --swap-dir swap").exit_code, 0);
  const std::string manifest = slurp((dir_ / "ck" / "rank0" / "manifest.json").string());
  ASSERT_FALSE(manifest.empty());
  {
    // This process plays the first writer, still running.
    tiermem::DirLock held((dir_ / "ck" / "rank0.lock").string(), "checkpoint directory 'ck'",
                          "test");
    const RunResult second = run(args + " --swap-dir swap2");
    EXPECT_NE(second.exit_code, 0);
    EXPECT_NE(second.err.find("checkpoint directory 'ck' (rank 0) is in use by process " +
                              std::to_string(::getpid())),
              std::string::npos)
        << second.err;
    EXPECT_TRUE(second.steps.empty()) << second.out;
    EXPECT_EQ(slurp((dir_ / "ck" / "rank0" / "manifest.json").string()), manifest);
  }
  const RunResult third = run(args + " --swap-dir swap");  // the lock was released: it runs
  EXPECT_EQ(third.exit_code, 0) << third.err;
  EXPECT_FALSE(fs::exists(dir_ / "ck" / "rank0.lock"));  // removed at exit
}

// Ctrl-C (SIGINT) in the middle of a long run with --save: the step in flight finishes, a
// checkpoint of it is written, the summary is printed, the swap file and the locks are removed,
// and the exit code is 130 (128 + SIGINT); --resume continues from that step.
TEST_F(TrainE2E, SigintCheckpointsAndCleansUp) {
  const std::string cmd = std::string(TIERMEM_TRAIN_BIN) + " " + kTiny + " --data " + corpus() +
                          " --steps 1000000 --engine zero --offload nvme --swap-dir swap --save ck";
  // Start it, wait for its first step line, then send SIGINT (a script file: no quoting games).
  std::ofstream(dir_ / "interrupt.sh")
      << "cd '" << dir_.string() << "'\n"
      << "OMP_NUM_THREADS=1 " << cmd << " >out.txt 2>err.txt &\n"
      << "pid=$!\n"
      << "for i in $(seq 1200); do grep -q '\"step\"' out.txt 2>/dev/null && break; sleep 0.05; done\n"
      << "kill -INT $pid\n"
      << "wait $pid\n"
      << "echo $? >rc.txt\n";
  ASSERT_EQ(std::system(("bash " + (dir_ / "interrupt.sh").string()).c_str()), 0);
  const std::string out = slurp((dir_ / "out.txt").string()), err = slurp((dir_ / "err.txt").string());
  EXPECT_EQ(std::stoi(slurp((dir_ / "rc.txt").string())), 130) << err;
  EXPECT_NE(err.find("SIGINT received: stopping after step"), std::string::npos) << err;
  const std::size_t at = out.rfind("{\"summary\"");
  ASSERT_NE(at, std::string::npos) << out;
  const json summary = json::parse(out.substr(at))["summary"];
  const int stopped = summary["steps"].get<int>();
  EXPECT_GE(stopped, 1);
  // Nothing left behind but the checkpoint: the swap files and the rank directory tiermem made.
  EXPECT_FALSE(fs::exists(dir_ / "swap" / "rank0")) << "the rank directory is left behind";
  if (fs::exists(dir_ / "swap" / "rank0")) {
    for (const auto& e : fs::directory_iterator(dir_ / "swap" / "rank0"))
      ADD_FAILURE() << "left in the swap directory: " << e.path();
  }
  EXPECT_FALSE(fs::exists(dir_ / "ck" / "rank0.lock"));
  // It resumes from the interrupted step.
  const RunResult resumed =
      run(std::string(kTiny) + " --data " + corpus() + " --steps " + std::to_string(stopped + 2) +
          " --engine zero --offload nvme --swap-dir swap --resume ck");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
  ASSERT_EQ(resumed.steps.size(), 2u) << resumed.out;
  EXPECT_EQ(resumed.steps.front()["step"].get<int>(), stopped + 1);
  // A changed --steps is allowed, and said (the schedule is no longer the saved run's).
  EXPECT_NE(resumed.err.find("with --steps = " + std::to_string(stopped + 2)), std::string::npos)
      << resumed.err;
}

TEST_F(TrainE2E, DefaultCorpusLossFalls) {
  if (!fs::exists("/usr/share/games/fortunes")) GTEST_SKIP() << "fortunes not installed";
  // The default corpus and engine (ZeRO-3 over TensorStore, params + Adam on NVMe), shortened:
  // the `tiny` model widened to byte vocabulary, 60 steps. ln(256) = 5.55 at the start.
  RunResult r = run("--model tiny --seq-len 16 --batch 8 --steps 60 --eval-every 0 --json "
                    "--swap-dir swap");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const double first = r.summary["initial_loss"].get<double>();
  const double last = r.summary["final_loss"].get<double>();
  EXPECT_GT(first, 5.0);
  EXPECT_LT(first, 6.0);
  EXPECT_LT(last, 3.6) << "loss " << first << " -> " << last;
  EXPECT_EQ(r.summary["param_offload"], "nvme");
}

TEST_F(TrainE2E, ResumeIsBitwiseIdentical) {
  const std::string base = std::string(kTiny) + " --data " + corpus() +
                           " --steps 20 --swap-dir swap ";
  RunResult full = run(base);
  ASSERT_EQ(full.exit_code, 0) << full.err;
  RunResult first = run(base + "--save ckpt --stop-at 10");
  ASSERT_EQ(first.exit_code, 0) << first.err;
  ASSERT_EQ(losses(first).size(), 10u);
  ASSERT_TRUE(fs::exists(dir_ / "ckpt/rank0/manifest.json"));
  RunResult second = run(base + "--resume ckpt");
  ASSERT_EQ(second.exit_code, 0) << second.err;
  const auto want = losses(full, 11, 20), got = losses(second);
  ASSERT_EQ(got.size(), 10u);
  ASSERT_EQ(want.size(), 10u);
  for (std::size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(want[i], got[i]) << "step " << i + 11;
  }
  // Another optimizer would take AdamW's moments for its own state (Lion's was accepted silently).
  std::ofstream(dir_ / "lion.json") << R"({"optimizer": {"type": "Lion"}})";
  RunResult lion = run(base + "--config lion.json --resume ckpt");
  EXPECT_NE(lion.exit_code, 0);
  EXPECT_NE(lion.err.find("its optimizer state is AdamW's"), std::string::npos) << lion.err;
  EXPECT_NE(lion.err.find("optimizer.type is \"lion\""), std::string::npos) << lion.err;
  EXPECT_TRUE(lion.steps.empty());
  // Corrupt one byte of the state: a clear error naming the tensor, before any step.
  fs::path state;
  for (const auto& e : fs::directory_iterator(dir_ / "ckpt/rank0"))
    if (e.path().extension() == ".bin") state = e.path();
  ASSERT_FALSE(state.empty());
  {
    std::fstream f(state, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(64);
    char c = 0;
    f.read(&c, 1);
    f.seekp(64);
    f.put(static_cast<char>(c ^ 0x40));
  }
  RunResult bad = run(base + "--resume ckpt");
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_NE(bad.err.find("checksum mismatch"), std::string::npos) << bad.err;
  EXPECT_NE(bad.err.find("tensor '"), std::string::npos) << bad.err;
  EXPECT_TRUE(bad.steps.empty());
}

TEST_F(TrainE2E, BadDataFailsBeforeTrainingNamingTheFile) {
  std::ofstream(dir_ / "empty.txt") << "";
  std::ofstream(dir_ / "odd.bin") << "abc";
  {
    std::ofstream f(dir_ / "big.bin", std::ios::binary);
    for (int i = 0; i < 1000; ++i) {
      const std::uint16_t t = i == 500 ? 300 : 10;
      f.write(reinterpret_cast<const char*>(&t), 2);
    }
  }
  fs::create_directories(dir_ / "nothing");
  struct Case {
    std::string path, expect;
  } cases[] = {
      {(dir_ / "missing.txt").string(), "no such file"},
      {(dir_ / "empty.txt").string(), "empty"},
      {(dir_ / "odd.bin").string(), "not a multiple of 2"},
      {(dir_ / "big.bin").string(), "token 300 (index 500"},
      {(dir_ / "nothing").string(), "no non-empty text files"},
  };
  for (const Case& c : cases) {
    RunResult r = run(std::string(kTiny) + " --steps 2 --engine resident --data " + c.path);
    EXPECT_EQ(r.exit_code, 2) << c.path;  // bad input, as a bad option or --config value
    EXPECT_TRUE(r.steps.empty()) << c.path;
    EXPECT_NE(r.err.find(c.path), std::string::npos) << r.err;
    EXPECT_NE(r.err.find(c.expect), std::string::npos) << r.err;
    EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << "one line: " << r.err;
  }
}

TEST_F(TrainE2E, BadFlagsExitWithCode2) {
  for (const char* args : {"--steps -1", "--model nope", "--device-budget 12parsecs",
                           "--batch x", "--frobnicate"}) {
    RunResult r = run(args);
    EXPECT_EQ(r.exit_code, 2) << args;
    EXPECT_NE(r.err.find("tiermem-train: error:"), std::string::npos) << r.err;
    EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << "one line: " << r.err;
  }
}

}  // namespace

namespace {

// Flips one byte in every 4 KiB page of `file` (a failing drive, a bad cable, another process).
// Returns the number of pages flipped.
int flip_every_page(const fs::path& file) {
  const int fd = ::open(file.c_str(), O_RDWR);
  if (fd < 0) return 0;
  struct stat st {};
  int n = 0;
  if (::fstat(fd, &st) == 0) {
    for (off_t at = 123; at < st.st_size; at += 4096) {
      char c = 0;
      if (::pread(fd, &c, 1, at) != 1) break;
      c = static_cast<char>(c ^ 0x20);
      if (::pwrite(fd, &c, 1, at) == 1) ++n;
    }
  }
  ::close(fd);
  return n;
}

// Issue 17: with default settings, bytes of the swap file changed during a run stop it with exit 1
// and a last line naming the tensor, the file, the offset, the hashes and what to do (--resume);
// no summary, and the checkpoint is not newer than the last step reported; --resume from that
// (verified) checkpoint then continues exactly as an uninterrupted run.
TEST_F(TrainE2E, FlippedSwapBytesStopTheRunNamingTheTensorAndResumeIsExact) {
  const std::string base = std::string(kTiny) + " --data " + corpus() +
                           " --steps 400 --engine zero --offload nvme --swap-dir swap "
                           "--host-budget 256KiB ";  // smaller than the state: it pages to NVMe
  const RunResult full = run(base + "--stop-at 30");
  ASSERT_EQ(full.exit_code, 0) << full.err;
  ASSERT_EQ(losses(full).size(), 30u);

  // The damaged run: started in the background, its swap file flipped once step 3 is reported.
  std::ofstream(dir_ / "damaged.sh")
      << "cd '" << dir_.string() << "'\n"
      // timeout: a run that never notices the damage is killed (137), never hangs the suite.
      << "OMP_NUM_THREADS=1 timeout -s KILL 120 " << TIERMEM_TRAIN_BIN << " " << base
      << "--save ck --save-every 2 >out.txt 2>err.txt\n"
      << "echo $? >rc.txt\n";
  std::thread runner([&] { std::system(("bash " + (dir_ / "damaged.sh").string()).c_str()); });
  int flipped = 0;
  for (int i = 0; i < 2400 && flipped == 0 && !fs::exists(dir_ / "rc.txt"); ++i) {
    if (slurp((dir_ / "out.txt").string()).find("\"step\":3,") != std::string::npos) {
      for (const auto& e : fs::directory_iterator(dir_ / "swap" / "rank0"))
        if (e.path().filename().string().rfind("tiermem-swap-", 0) == 0)
          flipped += flip_every_page(e.path());
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  runner.join();
  ASSERT_GT(flipped, 0) << "the swap file was never damaged";
  const std::string out = slurp((dir_ / "out.txt").string());
  const std::string err = slurp((dir_ / "err.txt").string());
  ASSERT_EQ(std::stoi(slurp((dir_ / "rc.txt").string())), 1) << err;
  EXPECT_EQ(err.find("tiermem-train: error: tensor '"), err.rfind('\n', err.size() - 2) + 1) << err;
  for (const char* needle : {"checksum mismatch", "on a re-read", "written", "tiermem-swap-",
                             " at offset ", "--resume ck"})
    EXPECT_NE(err.find(needle), std::string::npos) << needle << " missing in: " << err;
  EXPECT_EQ(out.find("\"summary\""), std::string::npos) << "a damaged run finished";
  int last_step = 0;
  {
    std::istringstream lines(out);
    std::string line;
    while (std::getline(lines, line)) {
      json j = json::parse(line, nullptr, false);
      if (!j.is_discarded() && j.contains("step")) last_step = j["step"].get<int>();
    }
  }
  EXPECT_LT(last_step, 400);
  // The checkpoint is not newer than the last step reported before the error.
  const json manifest = json::parse(slurp((dir_ / "ck" / "rank0" / "manifest.json").string()),
                                    nullptr, false);
  ASSERT_FALSE(manifest.is_discarded());
  const int saved = manifest["step"].get<int>();
  EXPECT_LE(saved, last_step);
  ASSERT_LT(saved, 28) << "the damage was seen too late for the resume check";

  const RunResult resumed = run(base + "--resume ck --stop-at 30");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
  const auto want = losses(full, saved + 1, 30), got = losses(resumed);
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < want.size(); ++i)
    EXPECT_EQ(want[i], got[i]) << "step " << saved + 1 + static_cast<int>(i);
}

}  // namespace
