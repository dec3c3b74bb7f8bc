// Helpers shared by the NVMe tier's tests: temp directories on the real disk, patterned data,
// and the engine configurations every I/O test runs under.
#pragma once

#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "tiermem/io_engine.h"

namespace tiermem::test {

// A fresh directory under $TMPDIR or /tmp (ext4 here: O_DIRECT works), removed on destruction.
class TempDir {
 public:
  explicit TempDir(const char* base = nullptr) {
    std::string b = base ? base : (std::getenv("TMPDIR") ? std::getenv("TMPDIR") : "/tmp");
    std::string tmpl = b + "/tiermem-nvme-XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    if (mkdtemp(buf.data()) != nullptr) path_ = buf.data();
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  bool ok() const { return !path_.empty(); }

 private:
  std::string path_;
};

// 4096-aligned heap buffer.
struct AlignedBuf {
  explicit AlignedBuf(std::size_t n) : size(n) {
    void* p = nullptr;
    if (posix_memalign(&p, 4096, std::max<std::size_t>(n, 1)) != 0) throw std::bad_alloc();
    data = static_cast<char*>(p);
  }
  ~AlignedBuf() { std::free(data); }
  AlignedBuf(const AlignedBuf&) = delete;
  char* data;
  std::size_t size;
};

// Deterministic content that differs by seed and position.
inline void fill_pattern(char* p, std::size_t n, std::uint64_t seed) {
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    std::memcpy(p + i, &x, 8);
  }
  x ^= x << 13;
  if (i < n) std::memcpy(p + i, &x, n - i);  // the last 1..7 bytes
}

struct EngineConfig {
  const char* name;
  IoEngineKind kind;
  bool fixed_buffers;
  bool sqpoll;
};

inline std::vector<EngineConfig> all_engine_configs() {
  return {{"uring_plain", IoEngineKind::kUring, false, false},
          {"uring_fixed_buffers", IoEngineKind::kUring, true, false},
          {"uring_sqpoll", IoEngineKind::kUring, true, true},
          {"posix", IoEngineKind::kPosix, false, false}};
}

inline IoEngineOptions options_for(const EngineConfig& c) {
  IoEngineOptions o;
  o.kind = c.kind;
  o.fixed_buffers = c.fixed_buffers;
  o.sqpoll = c.sqpoll;
  o.block_size_bytes = 256 << 10;
  o.queue_depth = 16;
  o.rings = 2;
  return o;
}

}  // namespace tiermem::test
