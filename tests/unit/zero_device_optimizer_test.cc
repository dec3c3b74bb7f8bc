// ZeroEngine's device-resident optimizer (offload_optimizer none, tiermem.device_optimizer on):
// the optimizer state — and, on a host-addressable device, the gradient partitions — homed in
// device memory and stepped there by Device::adam_step_async. On SimDevice it runs the host
// optimizer's own kernel, so every stage and working dtype must give, bit for bit, the masters,
// working params and losses of the host optimizer (device_optimizer off), on the addressable
// SimDevice and on its PROT_NONE twin (the CPU twin of a GPU). A step moves no optimizer state
// (and, where they are homed on the device, no gradient) between device and host; checkpoints
// export and import the device-homed state. The CUDA version:
// tests/gpu/zero_device_optimizer_cuda_test.cc.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>

#include "mpi/zero_mlp.h"
#include "tiermem/device.h"
#include "tiermem/error.h"
#include "tiermem/zero_engine.h"
#include "tiermem/zero_plan.h"

namespace tiermem {
namespace {

using testing::mlp_config;

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

std::string tmp_dir() {
  auto d =
      std::filesystem::temp_directory_path() / ("tiermem-zero-devopt-" + std::to_string(getpid()));
  std::filesystem::create_directories(d);
  return d.string();
}

struct Case {
  int stage;
  const char* dtype;  // "fp32", "bf16", "fp16"
  bool addressable;
  double clip = 0;
};

Config make_config(const Case& c, const std::string& dir, bool on_device, int micro = 2) {
  Config cfg = mlp_config(c.stage, "none", dir, micro);
  cfg.tiermem.device = "sim";
  cfg.tiermem.sim_host_addressable = c.addressable;
  cfg.tiermem.device_budget_bytes = 8 << 20;
  cfg.tiermem.device_optimizer = on_device ? "on" : "off";
  cfg.bf16 = std::string(c.dtype) == "bf16";
  cfg.fp16.enabled = std::string(c.dtype) == "fp16";
  cfg.gradient_clipping = c.clip;
  return cfg;
}

// The MLP's mean loss over all samples with the engine's current working params.
float mlp_loss(ZeroEngine& eng) {
  auto a = eng.gather(0);
  auto b = eng.gather(1);
  const auto p0 = testing::to_f32_host(eng, a), p1 = testing::to_f32_host(eng, b);
  std::vector<float> g0, g1;
  return testing::mlp_forward_backward(testing::mlp_data(), p0.data(), p1.data(), 0,
                                       testing::kSamples, g0, g1);
}

class ZeroDeviceOptimizer : public ::testing::TestWithParam<Case> {};

// Ten MLP steps of two micro-batches: the device optimizer's masters, working params and loss
// after every step equal the host optimizer's bit for bit; the state lives on the device.
TEST_P(ZeroDeviceOptimizer, EqualsTheHostOptimizerBitForBit) {
  auto comm = make_single_communicator();
  const Case c = GetParam();
  const std::string dir = tmp_dir();
  ZeroEngine host(make_config(c, dir, false), *comm), dev(make_config(c, dir, true), *comm);
  auto init = testing::mlp_init();
  for (ZeroEngine* e : {&host, &dev}) {
    e->register_module("fc1", init[0]);
    e->register_module("fc2", init[1]);
  }
  for (int step = 0; step < 10; ++step) {
    testing::mlp_train_steps(host, *comm, 1, 2);
    testing::mlp_train_steps(dev, *comm, 1, 2);
    const float lh = mlp_loss(host), ld = mlp_loss(dev);
    ASSERT_EQ(std::memcmp(&lh, &ld, sizeof(float)), 0)
        << "loss after step " << step << ": " << lh << " vs " << ld;
  }
  for (int m = 0; m < 2; ++m) {
    EXPECT_TRUE(same_bits(host.export_master(m), dev.export_master(m))) << "master " << m;
    auto a = host.gather(m);
    auto b = dev.gather(m);
    EXPECT_TRUE(same_bits(testing::to_f32_host(host, a), testing::to_f32_host(dev, b)))
        << "working params " << m;
  }
  EXPECT_EQ(dev.stats().steps, host.stats().steps);
  const ZeroStats hs = host.stats(), ds = dev.stats();
  EXPECT_EQ(hs.optimizer_home, Tier::kHost);
  EXPECT_EQ(ds.optimizer_home, Tier::kDevice);
  EXPECT_TRUE(dev.plan().optimizer_on_device);
  if (c.stage >= 2) {
    EXPECT_EQ(ds.gradient_home, c.addressable ? Tier::kDevice : Tier::kHost);
  }
  ASSERT_NE(dev.device(), nullptr);
  EXPECT_EQ(dev.device()->host_addressable(), c.addressable);
  EXPECT_LE(ds.device_peak_bytes, ds.device_budget_bytes);
  EXPECT_GE(dev.device()->stats().peak_allocated_bytes,
            12u * dev.shard_numel());  // the state is there
  std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(
    StageDtypeDevice, ZeroDeviceOptimizer,
    ::testing::Values(Case{1, "fp32", true}, Case{1, "bf16", true}, Case{2, "fp32", true},
                      Case{2, "bf16", true}, Case{3, "fp32", true}, Case{3, "bf16", true},
                      Case{1, "fp32", false}, Case{1, "bf16", false}, Case{2, "fp32", false},
                      Case{2, "bf16", false}, Case{3, "fp32", false}, Case{3, "bf16", false},
                      Case{2, "fp16", true}, Case{3, "fp16", false}, Case{2, "fp32", true, 0.05},
                      Case{3, "bf16", false, 0.05}),
    [](const auto& info) {
      const Case& c = info.param;
      return "stage" + std::to_string(c.stage) + "_" + c.dtype +
             (c.addressable ? "_addressable" : "_opaque") + (c.clip > 0 ? "_clip" : "");
    });

// Device <-> host bytes over `steps` training steps (device copies plus the store's moves).
struct Traffic {
  std::uint64_t h2d = 0, d2h = 0, dev_h2d = 0, dev_d2h = 0;
};
Traffic traffic(const ZeroEngine& e) {
  const ZeroStats s = e.stats();
  const DeviceStats d = e.device()->stats();
  return {s.host_to_device_bytes, s.device_to_host_bytes, d.h2d_bytes, d.d2h_bytes};
}

// On the addressable device, stage 3 with its params on the device: after the first step a whole
// training step (gathers, gradients added in place, AdamW) moves no byte between device and host.
// Stage 2: only the new working params come down (2 B x shard per step in bf16), nothing goes up.
// On the opaque device the step moves no optimizer state: only each sub-group's gradient goes up
// (4 B x shard) and, at stage 2, the new working params down.
TEST(ZeroDeviceOptimizerTraffic, StepsMoveNoOptimizerStateOrGradientBytes) {
  auto comm = make_single_communicator();
  const std::string dir = tmp_dir();
  for (int stage : {2, 3}) {
    for (bool addressable : {true, false}) {
      SCOPED_TRACE("stage " + std::to_string(stage) + (addressable ? " addressable" : " opaque"));
      Config cfg = make_config(Case{stage, "bf16", addressable}, dir, true, 1);
      cfg.zero.stage3_param_persistence_threshold_elems = 0;  // both modules stored at stage 3
      ZeroEngine eng(cfg, *comm);
      auto init = testing::mlp_init();
      eng.register_module("fc1", init[0]);
      eng.register_module("fc2", init[1]);
      testing::mlp_train_steps(eng, *comm, 1, 1);  // the first step
      const std::uint64_t R = eng.shard_numel();
      testing::MlpData D = testing::mlp_data();
      constexpr int kSteps = 3;
      std::uint64_t step_h2d = 0, step_d2h = 0, dev_h2d = 0, dev_d2h = 0;
      const Traffic t0 = traffic(eng);
      for (int s = 0; s < kSteps; ++s) {
        std::vector<float> p0, p1, g0, g1;
        {
          auto a = eng.gather(0);
          auto b = eng.gather(1);
          p0 = testing::to_f32_host(eng, a);  // opaque: the test's own copies down (as a model's)
          p1 = testing::to_f32_host(eng, b);
        }
        testing::mlp_forward_backward(D, p0.data(), p1.data(), 0, testing::kSamples, g0, g1);
        eng.reduce_gradients(1, g1);
        eng.reduce_gradients(0, g0);
        const Traffic a = traffic(eng);
        eng.step();
        const Traffic b = traffic(eng);
        step_h2d += b.h2d - a.h2d;
        step_d2h += b.d2h - a.d2h;
        dev_h2d += b.dev_h2d - a.dev_h2d;
        dev_d2h += b.dev_d2h - a.dev_d2h;
      }
      const Traffic t1 = traffic(eng);
      const std::uint64_t working = stage == 2 ? kSteps * 2 * R : 0;  // bf16 params to host buffers
      const std::uint64_t grads = addressable ? 0 : kSteps * 4 * R;
      EXPECT_EQ(step_h2d, grads);
      EXPECT_EQ(step_d2h, working);
      EXPECT_EQ(dev_h2d, grads);
      EXPECT_EQ(dev_d2h, working);
      if (addressable) {  // nothing at all crossed in whole steps (gathers and gradients too)
        EXPECT_EQ(t1.h2d - t0.h2d, 0u);
        EXPECT_EQ(t1.d2h - t0.d2h, working);
      }
    }
  }
  std::filesystem::remove_all(dir);
}

// A checkpoint of device-homed state: export equals the host optimizer's export of the same run;
// imported into a fresh engine (zeroed initial params) on the same kind of device, training
// continues bit for bit as the uninterrupted run; export_master reads the device-homed masters.
TEST(ZeroDeviceOptimizerCheckpoint, ExportImportAndExportMaster) {
  auto comm = make_single_communicator();
  const std::string dir = tmp_dir();
  for (int stage : {1, 2, 3}) {
    for (bool addressable : {true, false}) {
      SCOPED_TRACE("stage " + std::to_string(stage) + (addressable ? " addressable" : " opaque"));
      const Case c{stage, "bf16", addressable};
      ZeroEngine host(make_config(c, dir, false), *comm),
          straight(make_config(c, dir, true), *comm);
      testing::mlp_train_engine(host, *comm, 4, 2);
      testing::mlp_train_engine(straight, *comm, 4, 2);
      const ZeroOptimizerState want = host.export_optimizer_state();
      const ZeroOptimizerState saved = straight.export_optimizer_state();
      EXPECT_TRUE(same_bits(saved.master, want.master));
      EXPECT_TRUE(same_bits(saved.exp_avg, want.exp_avg));
      EXPECT_TRUE(same_bits(saved.exp_avg_sq, want.exp_avg_sq));
      EXPECT_EQ(saved.steps, 4);
      for (int m = 0; m < 2; ++m)
        EXPECT_TRUE(same_bits(straight.export_master(m), host.export_master(m)));

      ZeroEngine resumed(make_config(c, dir, true), *comm);
      auto init = testing::mlp_init();
      for (auto& v : init) std::fill(v.begin(), v.end(), 0.0f);  // overwritten by the import
      resumed.register_module("fc1", init[0]);
      resumed.register_module("fc2", init[1]);
      resumed.import_optimizer_state(saved);
      EXPECT_EQ(mlp_loss(resumed), mlp_loss(straight));
      testing::mlp_train_steps(resumed, *comm, 3, 2);
      testing::mlp_train_steps(straight, *comm, 3, 2);
      for (int m = 0; m < 2; ++m) {
        EXPECT_TRUE(same_bits(resumed.export_master(m), straight.export_master(m)))
            << "master " << m;
      }
      const ZeroOptimizerState a = resumed.export_optimizer_state(),
                               b = straight.export_optimizer_state();
      EXPECT_TRUE(same_bits(a.exp_avg_sq, b.exp_avg_sq));
      EXPECT_EQ(a.steps, 7);
    }
  }
  std::filesystem::remove_all(dir);
}

// plan_zero's arithmetic (pure): the device optimizer homes the state (and, on an addressable
// device, the gradient partitions) on the device at stages 1-3 with offload_optimizer none only,
// its device minimum counts every sub-group's allocation and the scratch, and a budget below it
// does not fit, naming the key.
TEST(ZeroDeviceOptimizerPlan, HomesAndMinimumDeviceBudget) {
  const std::vector<std::size_t> numels = {5000, 3000};  // shards 5120 + 3072 = 8192 elements
  ZeroPlanOptions po;
  po.device_optimizer = true;
  for (int stage : {0, 1, 2, 3}) {
    for (bool addressable : {true, false}) {
      SCOPED_TRACE("stage " + std::to_string(stage) + (addressable ? " addressable" : " opaque"));
      po.device_host_addressable = addressable;
      Config cfg = mlp_config(stage, "none", "/unused", 1);
      cfg.zero.sub_group_size_elems = 4096;
      const ZeroPlan p = plan_zero(cfg, numels, po);
      if (stage == 0) {
        EXPECT_FALSE(p.optimizer_on_device);
        EXPECT_EQ(p.optimizer_home, Tier::kHost);
        continue;
      }
      EXPECT_TRUE(p.optimizer_on_device);
      EXPECT_TRUE(needs_device(p));
      EXPECT_EQ(p.optimizer_home, Tier::kDevice);
      const bool grads_on_device = stage >= 2 && addressable;
      EXPECT_EQ(p.gradient_home, grads_on_device ? Tier::kDevice : Tier::kHost);
      EXPECT_EQ(p.sub_group_elems, 4096u);
      const std::uint64_t R = 8192;
      const std::uint64_t scratch = (grads_on_device ? 0 : 4 * 4096) + 4 * 4096;  // fp32 working
      EXPECT_EQ(p.device_scratch_bytes, scratch);
      const std::uint64_t state = 12 * R + (grads_on_device ? 4 * R : 0);  // page multiples here
      EXPECT_GE(p.device_min_bytes, state + scratch);
      if (stage < 3) {
        EXPECT_EQ(p.device_min_bytes, state + scratch);
      }
      EXPECT_NE(p.device_min_why.find("optimizer state"), std::string::npos) << p.device_min_why;
      // The host pool holds neither the state nor the device-homed gradients.
      const ZeroPlan host = plan_zero(cfg, numels, ZeroPlanOptions{});
      EXPECT_LT(p.host_home_bytes, host.host_home_bytes);
      cfg.tiermem.device_budget_bytes = p.device_min_bytes - 1;
      const ZeroPlan tight = plan_zero(cfg, numels, po);
      EXPECT_FALSE(tight.fits);
      EXPECT_NE(tight.why.find("tiermem.device_budget_bytes"), std::string::npos) << tight.why;
      cfg.tiermem.device_budget_bytes = p.device_min_bytes;
      EXPECT_TRUE(plan_zero(cfg, numels, po).fits);
    }
  }
  Config cpu = mlp_config(2, "cpu", "/unused", 1);  // an offloaded optimizer stays offloaded
  EXPECT_FALSE(plan_zero(cpu, numels, po).optimizer_on_device);
}

// What the config may ask for: auto keeps SimDevice runs on the host optimizer; on refuses a
// device budget below the state's minimum (naming the key and the minimum), an offloaded
// optimizer and stage 0.
TEST(ZeroDeviceOptimizerConfig, AutoOnSimIsHostAndOnRefusesWhatCannotWork) {
  auto comm = make_single_communicator();
  const std::string dir = tmp_dir();
  auto init = testing::mlp_init();
  auto start = [&](const Config& cfg) {
    ZeroEngine e(cfg, *comm);
    e.register_module("fc1", init[0]);
    e.register_module("fc2", init[1]);
    e.shard_numel();
    return e.stats().optimizer_home;
  };
  Config cfg = make_config(Case{2, "fp32", true}, dir, true);
  cfg.tiermem.device_optimizer = "auto";
  EXPECT_EQ(start(cfg), Tier::kHost);
  cfg.tiermem.device_optimizer = "on";
  EXPECT_EQ(start(cfg), Tier::kDevice);
  cfg.tiermem.device_budget_bytes = 8192;  // the state needs 2 sub-groups x (12 + 4) KiB + scratch
  try {
    start(cfg);
    ADD_FAILURE() << "no ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("tiermem.device_budget_bytes"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("optimizer state"), std::string::npos) << e.what();
  }
  Config off = make_config(Case{2, "fp32", true}, dir, true);
  off.zero.offload_optimizer.device = OffloadDevice::kCpu;
  EXPECT_THROW(start(off), ConfigError);
  Config s0 = make_config(Case{0, "fp32", true}, dir, true);
  EXPECT_THROW(start(s0), ConfigError);
  EXPECT_THROW(parse_config(R"({"tiermem": {"device_optimizer": "maybe"}})"), ConfigError);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tiermem

namespace tiermem {
namespace {

// offload_optimizer.ratio < 1 (DeepSpeed's partial offload), stage 3: the last sub-groups —
// whole, at least (1 - ratio) of the elements — are homed on the device (with their gradient
// partitions on an addressable device) and stepped there; the rest stream from NVMe. On SimDevice
// the device step is the host kernel, so masters, exported state and a resume equal full offload
// bit for bit, on the addressable device and its opaque twin.
Config ratio_config(const std::string& dir, double ratio, bool addressable, bool bf16) {
  Config cfg = testing::with_param_offload(mlp_config(3, "nvme", dir, 2, R"(, "gradient_clipping": 0.05)"), "nvme", dir);
  cfg.zero.stage3_param_persistence_threshold_elems = 0;
  cfg.zero.offload_optimizer.ratio = ratio;
  cfg.tiermem.device = "sim";
  cfg.tiermem.sim_host_addressable = addressable;
  cfg.tiermem.device_budget_bytes = 8 << 20;
  cfg.bf16 = bf16;
  cfg.tiermem.fp32_single_copy = false;  // the bytes compared below are the two-copy layout's
  return cfg;
}

TEST(ZeroPartialOffload, RatioKeepsTheLastSubGroupsOnTheDeviceAndChangesNoBit) {
  auto comm = make_single_communicator();
  const std::string dir = tmp_dir() + "/ratio";
  for (bool addressable : {true, false}) {
    for (bool bf16 : {false, true}) {
      SCOPED_TRACE(std::string(addressable ? "addressable" : "opaque") + (bf16 ? " bf16" : " fp32"));
      ZeroEngine full(ratio_config(dir + "/a", 1.0, addressable, bf16), *comm);
      ZeroEngine part(ratio_config(dir + "/b", 0.5, addressable, bf16), *comm);
      testing::mlp_train_engine(full, *comm, 5, 2);
      testing::mlp_train_engine(part, *comm, 5, 2);

      const ZeroPlan& p = part.plan();
      const std::size_t R = part.shard_numel();
      EXPECT_EQ(full.plan().device_optimizer_elems, 0u);
      EXPECT_GE(p.device_optimizer_elems, R / 2);
      EXPECT_LT(p.device_optimizer_elems, R / 2 + p.sub_group_elems) << "whole sub-groups, no more than needed";
      EXPECT_EQ(p.device_optimizer_from + p.device_optimizer_elems, R) << "the last sub-groups";
      const bool grads_nvme = full.plan().gradient_home == Tier::kNvme;
      EXPECT_EQ(p.nvme_optimizer_bytes + 12 * p.device_optimizer_elems +
                    (addressable && grads_nvme ? 4 * p.device_optimizer_elems : 0),
                full.plan().nvme_optimizer_bytes);
      EXPECT_GE(p.device_min_bytes, full.plan().device_min_bytes + 12 * p.device_optimizer_elems);
      const ZeroStats ps = part.stats();
      EXPECT_LE(ps.device_peak_bytes, ps.device_budget_bytes);
      EXPECT_GE(part.device()->stats().peak_allocated_bytes, 12 * p.device_optimizer_elems);

      for (int m = 0; m < 2; ++m) EXPECT_TRUE(same_bits(part.export_master(m), full.export_master(m))) << "master " << m;
      const ZeroOptimizerState want = full.export_optimizer_state(), got = part.export_optimizer_state();
      EXPECT_TRUE(same_bits(got.master, want.master));
      EXPECT_TRUE(same_bits(got.exp_avg, want.exp_avg));
      EXPECT_TRUE(same_bits(got.exp_avg_sq, want.exp_avg_sq));

      // Resume the partial engine from the full one's state: both go on equal.
      ZeroEngine resumed(ratio_config(dir + "/c", 0.5, addressable, bf16), *comm);
      auto init = testing::mlp_init();
      for (auto& v : init) std::fill(v.begin(), v.end(), 0.0f);
      resumed.register_module("fc1", init[0]);
      resumed.register_module("fc2", init[1]);
      resumed.import_optimizer_state(want);
      testing::mlp_train_steps(resumed, *comm, 2, 2);
      testing::mlp_train_steps(full, *comm, 2, 2);
      for (int m = 0; m < 2; ++m) EXPECT_TRUE(same_bits(resumed.export_master(m), full.export_master(m))) << "resumed " << m;
    }
  }
  std::filesystem::remove_all(tmp_dir());
}

// ratio "auto": the device's idle room decides — all of a small state with a roomy budget, a part
// (whole sub-groups from the end) with a tight one — never beyond the budget, the same bits.
TEST(ZeroPartialOffload, AutoRatioFillsTheIdleDeviceRoomOnly) {
  auto comm = make_single_communicator();
  const std::string dir = tmp_dir() + "/ratio-auto";
  ZeroEngine full(ratio_config(dir + "/f", 1.0, true, false), *comm);
  testing::mlp_train_engine(full, *comm, 3, 2);
  const std::size_t R = full.shard_numel();
  const std::vector<std::size_t> numels = {full.module_numel(0), full.module_numel(1)};
  // The plan (pure) over budgets from the ratio-1 minimum up: the share grows with the room, by
  // whole sub-groups, and never past the budget; one budget gives a part, a roomy one all.
  std::uint64_t partial_budget = 0;
  std::size_t last = 0;
  for (std::uint64_t b = full.plan().device_min_bytes; b <= (1u << 20); b += 4096) {
    Config cfg = ratio_config(dir + "/p", OffloadConfig::kRatioAuto, true, false);
    cfg.tiermem.device_budget_bytes = b;
    const ZeroPlan p = plan_zero(cfg, numels);
    ASSERT_TRUE(p.fits) << "budget " << b << ": " << p.why;
    EXPECT_LE(p.device_min_bytes, b);
    EXPECT_GE(p.device_optimizer_elems, last) << "budget " << b;
    last = p.device_optimizer_elems;
    if (partial_budget == 0 && p.device_optimizer_elems > 0 && p.device_optimizer_elems < R) partial_budget = b;
  }
  EXPECT_EQ(last, R) << "a roomy budget takes all";
  ASSERT_NE(partial_budget, 0u) << "some budget takes a part";
  for (const std::uint64_t budget : {partial_budget, std::uint64_t{8} << 20}) {
    SCOPED_TRACE("device budget " + std::to_string(budget));
    Config cfg = ratio_config(dir + "/a", OffloadConfig::kRatioAuto, true, false);
    cfg.tiermem.device_budget_bytes = budget;
    ZeroEngine e(cfg, *comm);
    testing::mlp_train_engine(e, *comm, 3, 2);
    EXPECT_EQ(e.plan().device_optimizer_elems == R, budget != partial_budget);
    EXPECT_GT(e.plan().device_optimizer_elems, 0u);
    EXPECT_LE(e.stats().device_peak_bytes, e.stats().device_budget_bytes);
    EXPECT_LE(e.device()->stats().peak_allocated_bytes, budget);
    for (int m = 0; m < 2; ++m) EXPECT_TRUE(same_bits(e.export_master(m), full.export_master(m))) << "master " << m;
  }
  Config parsed = parse_config(R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": "auto"}}})");
  EXPECT_LT(parsed.zero.offload_optimizer.ratio, 0.0) << "\"auto\" is kept as kRatioAuto";
  try {  // a word other than "auto": the error names the key, the value and both valid forms
    parse_config(R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": "half"}}})");
    ADD_FAILURE() << "expected a ConfigError";
  } catch (const ConfigError& err) {
    const std::string what = err.what();
    for (const char* part : {"zero_optimization.offload_optimizer.ratio", "half", "0 to 1", "\"auto\""}) {
      EXPECT_NE(what.find(part), std::string::npos) << part << " in: " << what;
    }
  }
  std::filesystem::remove_all(tmp_dir());
}

// A device budget that cannot hold the device's share is refused at the start, naming the ratio;
// where the ratio cannot apply (stage 2: no stage-3 device tier) nothing moves to the device.
TEST(ZeroPartialOffload, ABudgetTooSmallForTheShareIsRefusedAndStage2IgnoresIt) {
  auto comm = make_single_communicator();
  const std::string dir = tmp_dir() + "/ratio-bad";
  Config cfg = ratio_config(dir, 0.0, true, false);
  ZeroEngine probe(ratio_config(dir + "/p", 1.0, true, false), *comm);
  testing::mlp_train_engine(probe, *comm, 1, 2);
  cfg.tiermem.device_budget_bytes = probe.plan().device_min_bytes + 4096;  // enough without the share
  try {
    ZeroEngine e(cfg, *comm);
    testing::mlp_train_engine(e, *comm, 1, 2);
    ADD_FAILURE() << "expected a ConfigError";
  } catch (const ConfigError& err) {
    EXPECT_NE(std::string(err.what()).find("offload_optimizer.ratio"), std::string::npos) << err.what();
    EXPECT_NE(std::string(err.what()).find("tiermem.device_budget_bytes"), std::string::npos) << err.what();
  }
  Config s2 = mlp_config(2, "nvme", dir + "/s2", 2);
  s2.zero.offload_optimizer.ratio = 0.5;
  ZeroEngine e2(s2, *comm);
  testing::mlp_train_engine(e2, *comm, 1, 2);
  EXPECT_EQ(e2.plan().device_optimizer_elems, 0u);
  std::filesystem::remove_all(tmp_dir());
}

}  // namespace
}  // namespace tiermem
