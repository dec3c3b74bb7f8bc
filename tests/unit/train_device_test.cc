// decide_device (src/train/train_device.h): which device tiermem-train computes on, over
// every probe outcome, without needing (or touching) a GPU; the CPU model's backend leaves the
// plan as it was.
#include <gtest/gtest.h>

#include <map>
#include <optional>
#include <string>

#include "train/train_device.h"

namespace tiermem::train {
namespace {

CudaProbe no_driver() {
  CudaProbe p;
  p.built_with_cuda = true;
  p.reason = "cudaGetDeviceCount: CUDA driver version is insufficient for CUDA runtime version";
  return p;
}
CudaProbe one_h200() {
  CudaProbe p;
  p.built_with_cuda = true;
  p.device_count = 1;
  p.device0_name = "NVIDIA H200";
  return p;
}

TEST(TrainDevice, CudaWithoutAUsableDeviceIsAUsageErrorNamingTheKeyAndTheReason) {
  try {
    decide_device(DeviceChoice::kCuda, "--device", no_driver());
    FAIL() << "no error";
  } catch (const UsageError& e) {
    EXPECT_EQ(e.key_path(), "--device");
    const std::string what = e.what();
    EXPECT_NE(what.find("no usable CUDA device for 'cuda'"), std::string::npos) << what;
    EXPECT_NE(what.find("driver version is insufficient"), std::string::npos) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
  }
  CudaProbe no_build;
  no_build.reason = "this build has no CUDA";
  EXPECT_THROW(decide_device(DeviceChoice::kCuda, "tiermem.device", no_build), UsageError);
  EXPECT_THROW(decide_device(DeviceChoice::kCuda, "--device", CudaProbe{}), UsageError);  // no reason given
}

TEST(TrainDevice, AutoPicksCudaWhenVisibleAndSaysWhich) {
  const DeviceDecision d = decide_device(DeviceChoice::kAuto, "--device", one_h200());
  EXPECT_EQ(d.kind, DeviceKind::kCuda);
  EXPECT_EQ(d.cuda_devices, 1);
  EXPECT_NE(d.note.find("cuda:0 (NVIDIA H200)"), std::string::npos) << d.note;
  EXPECT_NE(d.note.find("auto picked cuda"), std::string::npos) << d.note;
  CudaProbe two = one_h200();
  two.device_count = 2;
  EXPECT_NE(decide_device(DeviceChoice::kAuto, "--device", two).note.find("1 of 2 visible"), std::string::npos);
}

TEST(TrainDevice, AutoFallsBackToSimWithTheReason) {
  const DeviceDecision d = decide_device(DeviceChoice::kAuto, "tiermem.device", no_driver());
  EXPECT_EQ(d.kind, DeviceKind::kSim);
  EXPECT_NE(d.note.find("auto picked sim"), std::string::npos) << d.note;
  EXPECT_NE(d.note.find("driver version is insufficient"), std::string::npos) << d.note;
}

TEST(TrainDevice, ExplicitChoicesAndBadValues) {
  EXPECT_EQ(decide_device(DeviceChoice::kSim, "--device", one_h200()).kind, DeviceKind::kSim);
  EXPECT_TRUE(decide_device(DeviceChoice::kSim, "--device", one_h200()).note.empty());
  const DeviceDecision c = decide_device(DeviceChoice::kCuda, "--device", one_h200());
  EXPECT_EQ(c.kind, DeviceKind::kCuda);
  EXPECT_NE(c.note.find("computes on the GPU"), std::string::npos) << c.note;
  EXPECT_THROW(parse_device_choice("tpu", "tiermem.device"), ConfigError);  // before deciding
}

TEST(TrainDevice, CudaActivationsComeOutOfTheDeviceBudget) {
  EXPECT_EQ(engine_device_budget(0, 123, "--device-budget"), 0u);  // auto: measured after
  EXPECT_EQ(engine_device_budget(1000, 300, "--device-budget"), 700u);
  try {
    engine_device_budget(1 << 20, 1 << 20, "tiermem.device_budget_bytes");
    FAIL() << "no error";
  } catch (const UsageError& e) {
    EXPECT_EQ(e.key_path(), "tiermem.device_budget_bytes");
    EXPECT_NE(std::string(e.what()).find("activations"), std::string::npos) << e.what();
  }
}

TEST(TrainDevice, TheCpuModelLeavesThePlanAndTheBudgetAsTheyWere) {
  TrainPlan plan;
  plan.model.n_layer = 1;
  plan.model.n_head = 2;
  plan.model.d_model = 32;
  plan.model.seq_len = 16;
  plan.batch = 1;
  plan.seq_len = 16;
  plan.config.tiermem.device = "sim";
  plan.config.tiermem.device_budget_bytes = 64 << 20;
  const std::string before = config_to_json(plan.config);
  DeviceDecision sim;  // kSim
  const ModelOnDevice m = make_model_backend(plan, sim, "--device-budget");
  ASSERT_NE(m.backend, nullptr);
  EXPECT_EQ(m.engine_device_budget_bytes, 64u << 20);  // no CUDA activations to take out
  EXPECT_EQ(config_to_json(plan.config), before);       // read, not changed
}

TEST(TrainDevice, OneGpuPerLocalRank) {
  EXPECT_EQ(cuda_ordinal_for(0, 8), 0);
  EXPECT_EQ(cuda_ordinal_for(3, 8), 3);
  EXPECT_EQ(cuda_ordinal_for(9, 8), 1);
  EXPECT_EQ(cuda_ordinal_for(2, 0), 0);
  std::map<std::string, std::string, std::less<>> env;
  auto lookup = [&env](std::string_view name) -> std::optional<std::string> {
    const auto it = env.find(name);
    return it == env.end() ? std::nullopt : std::optional<std::string>(it->second);
  };
  EXPECT_EQ(local_rank_from(lookup), 0);
  env["LOCAL_RANK"] = "5";
  EXPECT_EQ(local_rank_from(lookup), 5);
  env["OMPI_COMM_WORLD_LOCAL_RANK"] = "2";  // mpirun's wins
  EXPECT_EQ(local_rank_from(lookup), 2);
  env["OMPI_COMM_WORLD_LOCAL_RANK"] = "two";
  EXPECT_THROW(local_rank_from(lookup), ConfigError);
  env["OMPI_COMM_WORLD_LOCAL_RANK"] = "-1";
  EXPECT_THROW(local_rank_from(lookup), ConfigError);
}

TEST(TrainDevice, ProbeNeverThrowsAndExplainsAnAbsentDevice) {
  const CudaProbe p = probe_cuda();
  if (p.usable()) {
    EXPECT_GT(p.device_count, 0);
    EXPECT_TRUE(p.reason.empty());
  } else {
    EXPECT_FALSE(p.reason.empty()) << "an unusable probe must say why";
  }
  EXPECT_EQ(p.usable(), cuda_device_available());
}

}  // namespace
}  // namespace tiermem::train
