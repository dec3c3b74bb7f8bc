// ZeroEngine with a frozen module stored in fewer bytes (tiermem.frozen_dtype, tiermem/quantize.h):
// for each format at rest (the working dtype, bf16, int8 per-128 absmax) and each home (host pool,
// NVMe), the gathered values are the originals (working dtype: bit for bit) or within the
// format's bound; the store, the plan and the NVMe traffic count the smaller bytes; exports give
// the dequantized values; set_module_params quantizes again; the trainable module beside it
// steps; and the configurations it cannot serve are refused naming the key.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <memory>
#include <random>
#include <string>

#include "mpi/zero_mlp.h"
#include "tiermem/config.h"
#include "tiermem/error.h"
#include "tiermem/quantize.h"
#include "tiermem/zero_engine.h"

namespace tiermem {
namespace {

constexpr std::size_t kBase = 6000, kHead = 300;  // a frozen base and a trainable head (elements)

std::string nvme_dir() {
  auto d = std::filesystem::temp_directory_path() / ("tiermem-zero-at-rest-" + std::to_string(getpid()));
  std::filesystem::create_directories(d);
  return d.string();
}

std::vector<float> values(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 0.05f);
  std::vector<float> x(n);
  for (auto& v : x) v = d(rng);
  return x;
}

// |got - want| within the format's bound, per group of 128 (exact for the working dtype).
void expect_within_format(FrozenDtype d, const std::vector<float>& want, const std::vector<float>& got) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t g0 = 0; g0 < want.size(); g0 += kInt8GroupElems) {
    const std::size_t g1 = std::min(want.size(), g0 + kInt8GroupElems);
    float amax = 0;
    for (std::size_t i = g0; i < g1; ++i) amax = std::max(amax, std::fabs(want[i]));
    for (std::size_t i = g0; i < g1; ++i) {
      const float bound = d == FrozenDtype::kWorking ? 0.0f
                          : d == FrozenDtype::kBF16  ? std::fabs(want[i]) * 0x1p-8f
                                                     : amax / 254.0f + amax * 0x1p-22f;
      ASSERT_LE(std::fabs(got[i] - want[i]), bound) << frozen_dtype_name(d) << " element " << i;
    }
  }
}

struct Case {
  const char* at_rest;  // tiermem.frozen_dtype
  const char* param;    // offload_param.device
};

class ZeroFrozenAtRest : public ::testing::TestWithParam<Case> {};

TEST_P(ZeroFrozenAtRest, StoresFewerBytesAndGathersWithinTheFormatsBound) {
  auto comm = make_single_communicator();
  const std::string dir = nvme_dir();
  Config cfg = testing::with_param_offload(testing::mlp_config(3, "nvme", dir, 1), GetParam().param, dir);
  cfg.tiermem.frozen_dtype = GetParam().at_rest;
  const FrozenDtype d = frozen_dtype_of(GetParam().at_rest, DType::kF32);
  ZeroEngineOptions o;
  o.frozen_modules = {true, false};
  const std::vector<float> base = values(kBase, 1), head = values(kHead, 2);
  const std::size_t numels[] = {kBase, kHead};
  auto owned = std::make_unique<ZeroEngine>(cfg, *comm, numels, o);
  ZeroEngine& engine = *owned;
  engine.register_module("base", base);
  engine.register_module("head", head);
  const std::uint64_t shard = (kBase + 1023) / 1024 * 1024;  // one rank: the padded module
  const ZeroStats st0 = engine.stats();
  EXPECT_EQ(st0.frozen_at_rest, d);
  EXPECT_EQ(st0.frozen_param_bytes, at_rest_bytes(d, shard, 4));
  EXPECT_EQ(engine.plan().frozen_param_bytes, st0.frozen_param_bytes);  // the plan counts what is stored
  if (d == FrozenDtype::kInt8) {
    EXPECT_LT(st0.frozen_param_bytes, shard * 4 / 3);
  }

  std::vector<float> first;
  for (int s = 0; s < 3; ++s) {
    std::vector<float> got;
    {
      auto x = engine.gather(0, Phase::kForward);
      auto y = engine.gather(1, Phase::kForward);
      got = testing::to_f32_host(engine, x);
    }
    expect_within_format(d, base, got);
    if (s == 0) first = got;
    EXPECT_EQ(got, first) << "step " << s;  // the same values at every gather
    engine.reduce_gradients(1, std::vector<float>(kHead, 0.01f));
    engine.step();
  }
  EXPECT_NE(engine.export_master(1), head);   // the head trained beside it
  EXPECT_EQ(engine.export_master(0), first);  // the export: the dequantized values, as gathered
  const ZeroStats st = engine.stats();
  EXPECT_LE(st.host_pool_peak_bytes, st.host_budget_bytes);
  EXPECT_LE(st.device_peak_bytes, st.device_budget_bytes);
  if (std::string(GetParam().param) == "nvme") {
    // Written once at registration, in the smaller format; read back in it at every gather.
    EXPECT_LE(st.nvme_written_frozen_bytes, (at_rest_bytes(d, shard, 4) + 4095) / 4096 * 4096);
    EXPECT_GT(st.nvme_written_frozen_bytes, 0u);
  }
  // A rewrite (load_state_dict's write-through) is quantized again.
  std::vector<float> other = values(kBase, 9);
  engine.set_module_params(0, other);
  auto z = engine.gather(0, Phase::kForward);
  expect_within_format(d, other, testing::to_f32_host(engine, z));
  z = {};
  owned.reset();
  std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(FormatHome, ZeroFrozenAtRest,
                         ::testing::Values(Case{"auto", "nvme"}, Case{"bf16", "nvme"}, Case{"int8", "nvme"},
                                           Case{"bf16", "cpu"}, Case{"int8", "cpu"}, Case{"int8", "none"}),
                         [](const ::testing::TestParamInfo<Case>& i) {
                           return std::string(i.param.at_rest) + "_" + i.param.param;
                         });

// bf16 working params with int8 at rest: gathered as bf16 (the dequantized value, rounded once).
TEST(ZeroFrozenAtRestBf16, Int8IntoBf16WorkingParams) {
  auto comm = make_single_communicator();
  const std::string dir = nvme_dir();
  Config cfg = testing::with_param_offload(testing::mlp_config(3, "nvme", dir, 1), "nvme", dir);
  cfg.bf16 = true;
  cfg.tiermem.frozen_dtype = "int8";
  ZeroEngineOptions o;
  o.frozen_modules = {true, false};
  const std::vector<float> base = values(kBase, 3);
  const std::size_t numels[] = {kBase, kHead};
  auto owned = std::make_unique<ZeroEngine>(cfg, *comm, numels, o);
  owned->register_module("base", base);
  owned->register_module("head", values(kHead, 4));
  {
    auto x = owned->gather(0, Phase::kForward);
    ASSERT_EQ(x.dtype(), DType::kBF16);
    const std::vector<float> got = testing::to_f32_host(*owned, x);
    std::vector<float> int8_vals = owned->export_master(0);  // the dequantized fp32 values, then bf16
    for (std::size_t i = 0; i < kBase; ++i) ASSERT_EQ(got[i], bf16_to_f32(f32_to_bf16(int8_vals[i]))) << i;
  }
  owned.reset();
  std::filesystem::remove_all(dir);
}

// The keys' refusals: each names the key(s) and what to do.
TEST(ZeroFrozenAtRestConfig, RefusesWhatCannotApply) {
  auto msg = [](const std::string& json) -> std::string {
    try {
      parse_config(json, "test");
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "";
  };
  const std::string s3 = R"("zero_optimization": {"stage": 3)";
  EXPECT_NE(msg("{" + s3 + R"(, "zero_quantized_nontrainable_weights": true}, "tiermem": {"frozen_dtype": "bf16"}})")
                .find("contradict"),
            std::string::npos);
  EXPECT_NE(msg("{" + s3 + R"(, "zero_quantized_nontrainable_weights": false}, "tiermem": {"frozen_dtype": "int8"}})")
                .find("zero_quantized_nontrainable_weights"),
            std::string::npos);
  EXPECT_NE(msg(R"({"zero_optimization": {"stage": 2}, "tiermem": {"frozen_dtype": "int8"}})").find("stage"),
            std::string::npos);
  EXPECT_NE(msg("{" + s3 + R"(}, "fp16": {"enabled": true}, "tiermem": {"frozen_dtype": "bf16"}})")
                .find("tiermem.frozen_dtype"),
            std::string::npos);
  EXPECT_NE(msg("{" + s3 + R"(}, "tiermem": {"frozen_dtype": "int4"}})").find("frozen_dtype"), std::string::npos);
  // DeepSpeed's key alone is int8; both saying int8 agree.
  EXPECT_EQ(parse_config("{" + s3 + R"(, "zero_quantized_nontrainable_weights": true}})", "t").tiermem.frozen_dtype,
            "int8");
  EXPECT_EQ(parse_config("{" + s3 + R"(, "zero_quantized_nontrainable_weights": true}, "tiermem": {"frozen_dtype": "int8"}})",
                         "t")
                .tiermem.frozen_dtype,
            "int8");
  EXPECT_EQ(parse_config("{" + s3 + "}}", "t").tiermem.frozen_dtype, "auto");  // off by default
}

// A device the CPU cannot address has no dequantize kernel: refused at construction, naming the key.
TEST(ZeroFrozenAtRestConfig, RefusesAnOpaqueDevice) {
  auto comm = make_single_communicator();
  const std::string dir = nvme_dir();
  Config cfg = testing::with_param_offload(testing::mlp_config(3, "nvme", dir, 1), "nvme", dir);
  cfg.tiermem.frozen_dtype = "int8";
  cfg.tiermem.sim_host_addressable = false;
  ZeroEngineOptions o;
  o.frozen_modules = {true, false};
  const std::size_t numels[] = {kBase, kHead};
  try {
    ZeroEngine engine(cfg, *comm, numels, o);
    FAIL() << "an opaque device took an int8 frozen base";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("frozen_dtype"), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tiermem
