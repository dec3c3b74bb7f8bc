// Helpers of the fault tests (tests/fault): a random fault injector for the IoEngine, temp
// directories and patterned tensor contents.
#pragma once

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "tiermem/io_engine.h"

namespace tiermem::fault {

// A fresh directory under $TMPDIR or /tmp, removed on destruction.
class TempDir {
 public:
  explicit TempDir(const std::string& tag) {
    const char* t = std::getenv("TMPDIR");
    std::string tmpl = std::string(t ? t : "/tmp") + "/tiermem-fault-" + tag + "-XXXXXX";
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    if (::mkdtemp(buf.data()) != nullptr) path_ = buf.data();
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  bool ok() const { return !path_.empty(); }

 private:
  std::string path_;
};

// Byte i of generation `gen` of tensor `tensor`.
inline std::uint8_t pattern(std::uint32_t tensor, std::uint32_t gen, std::uint64_t i) {
  std::uint64_t x = i * 0x9E3779B97F4A7C15ull + std::uint64_t{tensor} * 0xD1B54A32D192ED03ull +
                    std::uint64_t{gen} * 0x8CB92BA72F3D8DD7ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;  // splitmix64's finalizer
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return static_cast<std::uint8_t>(x >> 56);
}
inline std::vector<std::byte> make_bytes(std::uint32_t tensor, std::uint32_t gen, std::uint64_t n) {
  std::vector<std::byte> v(n);
  for (std::uint64_t i = 0; i < n; ++i) v[i] = std::byte{pattern(tensor, gen, i)};
  return v;
}
inline void fill(void* p, std::uint32_t tensor, std::uint32_t gen, std::uint64_t n) {
  auto* b = static_cast<std::uint8_t*>(p);
  for (std::uint64_t i = 0; i < n; ++i) b[i] = pattern(tensor, gen, i);
}
// Index of the first byte that differs from the pattern, or n when all match.
inline std::uint64_t first_mismatch(const void* p, std::uint32_t tensor, std::uint32_t gen,
                                    std::uint64_t n) {
  const auto* b = static_cast<const std::uint8_t*>(p);
  for (std::uint64_t i = 0; i < n; ++i) {
    if (b[i] != pattern(tensor, gen, i)) return i;
  }
  return n;
}

// Injects faults into every read/write piece an engine issues, at random (a splitmix64 stream
// over an atomic counter: thread-safe, lock-free): EIO, ENOSPC (writes only), EAGAIN (the engine
// retries it) and short transfers of whole 4 KiB blocks (the engine resubmits the rest), each with its own probability
// in parts per million. Also fails fallocate with ENOSPC at `fallocate_ppm`. Counts what it did.
// All members may be changed while I/O runs.
class RandomFaults : public IoInterceptor {
 public:
  explicit RandomFaults(std::uint64_t seed) : state_(seed) {}

  std::atomic<bool> enabled{false};
  std::atomic<std::uint32_t> eio_ppm{0}, enospc_ppm{0}, eagain_ppm{0}, short_ppm{0},
      fallocate_ppm{0};
  // Counters of injected faults.
  std::atomic<std::uint64_t> ios{0}, eio{0}, enospc{0}, eagain{0}, shorts{0}, fallocate_enospc{0};

  std::uint64_t injected() const {
    return eio.load() + enospc.load() + eagain.load() + shorts.load() + fallocate_enospc.load();
  }

  Decision before_io(IoOpKind kind, const std::string&, std::uint64_t,
                     std::uint64_t bytes) override {
    Decision d;
    if (!enabled.load(std::memory_order_relaxed) || kind == IoOpKind::kOpen) return d;
    const std::uint64_t r = next();
    const std::uint32_t roll = static_cast<std::uint32_t>(r % 1000000);
    if (kind == IoOpKind::kFallocate) {
      if (roll < fallocate_ppm.load()) {
        ++fallocate_enospc;
        d.fail_errno = ENOSPC;
      }
      return d;
    }
    ++ios;
    std::uint32_t edge = eio_ppm.load();
    if (roll < edge) {
      ++eio;
      d.fail_errno = EIO;
      return d;
    }
    if (kind == IoOpKind::kWrite) {
      edge += enospc_ppm.load();
      if (roll < edge) {
        ++enospc;
        d.fail_errno = ENOSPC;
        return d;
      }
    }
    edge += eagain_ppm.load();
    if (roll < edge) {
      ++eagain;
      d.fail_errno = EAGAIN;
      return d;
    }
    edge += short_ppm.load();
    if (roll < edge && bytes > 4096) {
      // As the kernel shortens O_DIRECT transfers: a whole number of 4 KiB blocks, < bytes.
      ++shorts;
      d.max_bytes = 4096 * (1 + (r >> 32) % ((bytes - 1) / 4096));
    }
    return d;
  }

 private:
  std::uint64_t next() {
    std::uint64_t z = state_.fetch_add(0x9E3779B97F4A7C15ull, std::memory_order_relaxed);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  std::atomic<std::uint64_t> state_;
};

// Reads an environment variable as a number, `fallback` when unset or not a number.
inline double env_number(const char* name, double fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  double x = std::strtod(v, &end);
  return end != v ? x : fallback;
}

}  // namespace tiermem::fault
