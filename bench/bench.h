// bench/bench.h — what every tiermem-bench subcommand shares: registration, timing statistics and
// the JSON line. Each subcommand lives in bench/bench_<name>.cc and registers itself with
// TIERMEM_BENCH_COMMAND; tools/tiermem-bench/bench_main.cc only dispatches.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "tiermem/config.h"
#include "tiermem/error.h"
#include "tiermem/pinned_host_pool.h"

namespace tiermem::bench {

// A PinnedHostPool of one populated mapping with room for `bytes`, for I/O buffers laid out as
// training's are: 2 MiB pages where the system allows (4 KiB with huge_pages false), page-locked
// when RLIMIT_MEMLOCK allows, else the same pages unlocked (the pool warns). Throws as the pool.
inline std::unique_ptr<PinnedHostPool> make_io_buffer_pool(std::uint64_t bytes, bool huge_pages = true) {
  PinnedHostPoolOptions po;
  po.budget_bytes = PinnedHostPool::allocation_size(bytes);
  po.huge_pages = huge_pages;
  po.verify_huge_pages = true;  // one slot, committed once: its 2 MiB pages are known to the engine
  po.pin_memory = true;
  try {
    return std::make_unique<PinnedHostPool>(po);
  } catch (const OutOfMemoryError&) {
    throw;
  } catch (const Error&) {  // the memlock limit
    po.pin_memory = false;
    return std::make_unique<PinnedHostPool>(po);
  }
}

// Frees a block of a PinnedHostPool (for std::unique_ptr).
template <class T>
struct PoolFree {
  PinnedHostPool* pool;
  void operator()(T* p) const { pool->free(p); }
};

// A subcommand: `setup` adds its options to `sub` and returns the function to run (exit code).
using CommandSetup = std::function<std::function<int()>(CLI::App& sub)>;

struct CommandInfo {
  std::string name;
  std::string description;
  CommandSetup setup;
};

std::vector<CommandInfo>& commands();

struct Registrar {
  Registrar(std::string name, std::string description, CommandSetup setup) {
    commands().push_back({std::move(name), std::move(description), std::move(setup)});
  }
};

#define TIERMEM_BENCH_COMMAND(ident, name, description, setup_fn) \
  static ::tiermem::bench::Registrar tiermem_bench_registrar_##ident(name, description, setup_fn)

// Seconds since an arbitrary origin (steady clock).
inline double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The q-quantile (0..1) of `v` by nearest rank; 0 for an empty vector. Sorts a copy.
inline double quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  std::size_t i = static_cast<std::size_t>(q * static_cast<double>(v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}
inline double median(std::vector<double> v) { return quantile(std::move(v), 0.5); }

// The directories a subcommand makes for its files: make() creates one with its missing parents and
// remembers those it made; they go again (deepest first, each only when empty) when this does, on
// a return or an error. Declare it before what puts files in them.
class MadeDirs {
 public:
  MadeDirs() = default;
  MadeDirs(const MadeDirs&) = delete;
  MadeDirs& operator=(const MadeDirs&) = delete;
  ~MadeDirs() {
    std::error_code ec;
    for (const std::filesystem::path& d : made_) std::filesystem::remove(d, ec);  // only when empty
  }
  void make(const std::filesystem::path& dir) {
    std::vector<std::filesystem::path> fresh;
    for (std::filesystem::path p = std::filesystem::absolute(dir); !p.empty() && !std::filesystem::exists(p);
         p = p.parent_path()) {
      fresh.push_back(p);
    }
    std::filesystem::create_directories(dir);
    made_.insert(made_.begin(), fresh.begin(), fresh.end());
  }

 private:
  std::vector<std::filesystem::path> made_;  // deepest first
};

// The size option `option` = `text` (parse_size) when it lies within [lo, hi], themselves sizes
// ("4K", "1G"); else a ConfigError naming the option: "must be at least LO and at most HI".
inline std::uint64_t parse_size_within(const std::string& text, const char* option, const char* lo, const char* hi) {
  const std::uint64_t v = parse_size(text, option);
  if (v < parse_size(lo) || v > parse_size(hi)) {
    throw ConfigError(option, text, std::string("must be at least ") + lo + " and at most " + hi);
  }
  return v;
}

}  // namespace tiermem::bench
