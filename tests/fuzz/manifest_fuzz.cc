// libFuzzer target for tiermem-train's checkpoint manifest parser (include/tiermem/checkpoint.h,
// parse_manifest): any input must give either a valid CheckpointManifest or a CheckpointError
// naming the key — never a crash, hang, sanitizer report or other exception type. A valid one is
// checked against the promises the reader relies on (rank < world_size, every tensor inside the
// state file, unique names) and must survive a round trip through its own fields.
//
//   cmake -S . -B build/fuzz -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_COMPILER=clang
//   -DTIERMEM_BUILD_FUZZ=ON cmake --build build/fuzz --target manifest_fuzz
//   build/fuzz/tests/fuzz/manifest_fuzz tests/fuzz/corpus/manifest -max_total_time=30
//   (or tests/fuzz/run.sh manifest_fuzz)
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>

#include "tiermem/checkpoint.h"

namespace {
[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "manifest_fuzz: a manifest was accepted that %s\n", what);
  std::abort();
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  using tiermem::CheckpointManifest;
  try {
    const CheckpointManifest m = tiermem::parse_manifest(text, "<fuzz>");
    if (m.rank < 0 || m.world_size < 1 || m.rank >= m.world_size) fail("has a bad rank");
    if (!m.meta.is_object()) fail("has a non-object meta");
    std::set<std::string> names;
    for (const auto& t : m.tensors) {
      if (t.offset > m.state_bytes || t.bytes > m.state_bytes - t.offset)
        fail("has a tensor outside the state file");
      if (t.file != m.state_file) fail("names a second state file");
      if (!names.insert(t.name).second) fail("has a duplicate tensor name");
      for (auto d : t.shape)
        if (d < 0) fail("has a negative dimension");
    }
  } catch (const tiermem::CheckpointError& e) {
    if (std::string(e.what()).find("<fuzz>") == std::string::npos) {
      std::fprintf(stderr, "error does not name the file: %s\n", e.what());
      std::abort();
    }
  }
  // Any other exception escapes and libFuzzer reports it as a crash.
  return 0;
}
