// tiermem/device_choice.h: tiermem.device ("auto" | "cuda" | "sim") parsed and resolved once, and
// make_device making the kind it was given without deciding again.
#include <gtest/gtest.h>

#include <string>

#include "tiermem/device_choice.h"
#include "tiermem/error.h"

namespace tiermem {
namespace {

TEST(DeviceChoice, ParsesTheThreeValuesExactly) {
  EXPECT_EQ(parse_device_choice("auto", "tiermem.device"), DeviceChoice::kAuto);
  EXPECT_EQ(parse_device_choice("cuda", "tiermem.device"), DeviceChoice::kCuda);
  EXPECT_EQ(parse_device_choice("sim", "tiermem.device"), DeviceChoice::kSim);
  for (const char* bad : {"tpu", "", "CUDA", "sim "}) {
    try {
      parse_device_choice(bad, "--device");
      FAIL() << "no error for '" << bad << "'";
    } catch (const ConfigError& e) {
      EXPECT_EQ(e.key_path(), "--device");  // names where the value came from
      EXPECT_EQ(e.value(), bad);
      EXPECT_NE(std::string(e.what()).find("must be one of auto, cuda, sim"), std::string::npos) << e.what();
    }
  }
}

TEST(DeviceChoice, AutoFollowsWhetherCudaIsUsableExplicitChoicesDoNot) {
  EXPECT_EQ(resolve_device_kind(DeviceChoice::kAuto, true), DeviceKind::kCuda);
  EXPECT_EQ(resolve_device_kind(DeviceChoice::kAuto, false), DeviceKind::kSim);
  EXPECT_EQ(resolve_device_kind(DeviceChoice::kSim, true), DeviceKind::kSim);
  EXPECT_EQ(resolve_device_kind(DeviceChoice::kCuda, false), DeviceKind::kCuda);
  EXPECT_EQ(device_kind_name(DeviceKind::kSim), "sim");
  EXPECT_EQ(device_kind_name(DeviceKind::kCuda), "cuda");
}

TEST(DeviceChoice, ResolveLooksForCudaOnlyForAutoAndSaysWhy) {
  const ResolvedDevice sim = resolve_device(DeviceChoice::kSim);
  EXPECT_EQ(sim.kind, DeviceKind::kSim);
  EXPECT_TRUE(sim.why.empty());
  const ResolvedDevice cuda = resolve_device(DeviceChoice::kCuda);
  EXPECT_EQ(cuda.kind, DeviceKind::kCuda);  // as asked; make_device refuses it without a GPU
  const ResolvedDevice autod = resolve_device(DeviceChoice::kAuto);
  EXPECT_EQ(autod.asked, DeviceChoice::kAuto);
  EXPECT_EQ(autod.kind, cuda_device_available() ? DeviceKind::kCuda : DeviceKind::kSim);
  EXPECT_FALSE(autod.why.empty());
}

TEST(DeviceChoice, MakeDeviceMakesTheResolvedKind) {
  DeviceOptions o;
  o.choice = DeviceChoice::kCuda;  // not read: the resolution decides
  o.budget_bytes = 4 << 20;
  ResolvedDevice sim;
  sim.asked = DeviceChoice::kAuto;
  sim.kind = DeviceKind::kSim;
  sim.why = "test";
  auto d = make_device(o, sim);
  EXPECT_EQ(d->kind(), DeviceKind::kSim);
  EXPECT_EQ(d->budget_bytes(), 4u << 20);
  if (!cuda_device_available()) {
    ResolvedDevice cuda;
    cuda.asked = DeviceChoice::kCuda;
    cuda.kind = DeviceKind::kCuda;
    EXPECT_THROW(make_device(o, cuda), NotSupportedError);
  }
}

}  // namespace
}  // namespace tiermem
