// libFuzzer target for the JSON config loader: any input must give either a Config or a
// ConfigError (with a key path when the error is about a key) — never a crash, hang or other
// exception type.
//
//   cmake -S . -B build/fuzz -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_COMPILER=clang -DTIERMEM_BUILD_FUZZ=ON
//   cmake --build build/fuzz --target config_fuzz && build/fuzz/tests/fuzz/config_fuzz tests/fuzz/corpus/config -max_total_time=30
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "tiermem/config.h"
#include "tiermem/error.h"
#include "tiermem/log.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static bool quiet = [] {
    tiermem::set_log_level("off");
    return true;
  }();
  (void)quiet;
  std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    tiermem::Config c = tiermem::parse_config(text, "<fuzz>");
    // A valid config must survive its own round trip.
    tiermem::Config d = tiermem::parse_config(tiermem::config_to_json(c), "<roundtrip>");
    if (d.zero.stage != c.zero.stage || d.aio.queue_depth != c.aio.queue_depth ||
        d.tiermem.device_budget_bytes != c.tiermem.device_budget_bytes) {
      std::fprintf(stderr, "round trip changed the config\n");
      std::abort();
    }
  } catch (const tiermem::ConfigError&) {
    // expected for bad input
  }
  // Any other exception escapes and libFuzzer reports it as a crash.
  return 0;
}
