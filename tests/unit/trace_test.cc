#include "tiermem/trace.h"

#include <cstdio>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace tiermem {
namespace {

TEST(Trace, WritesChromeTraceJson) {
  std::string path = ::testing::TempDir() + "/tiermem_trace_test.json";
  Trace& t = Trace::global();
  t.start(path, "test", 3);
  {
    TraceSpan s("step", "compute");
  }
  t.complete("read", "nvme->host", Trace::now_ns(), 1000, R"({"bytes": 4096})");
  t.counter("device_bytes", 42);
  t.stop();
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  auto j = nlohmann::json::parse(ss.str());
  ASSERT_TRUE(j.contains("traceEvents"));
  int spans = 0;
  for (const auto& e : j["traceEvents"]) {
    if (e["ph"] == "X") {
      ++spans;
      EXPECT_EQ(e["pid"], 3);
    }
  }
  EXPECT_EQ(spans, 2);
  std::remove(path.c_str());
}

}  // namespace
}  // namespace tiermem
