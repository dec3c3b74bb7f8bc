#include "tiermem/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <atomic>
#include <mutex>
#include <set>
#include <string>

#include "tiermem/env.h"

namespace tiermem {

spdlog::logger& logger() {
  static std::shared_ptr<spdlog::logger> log = [] {
    auto l = spdlog::stderr_color_mt("tiermem");
    l->set_pattern("%^[%l]%$ %v");
    l->set_level(spdlog::level::info);
    if (auto lvl = env_param("TIERMEM_LOG_LEVEL")) {
      auto parsed = spdlog::level::from_str(*lvl);
      if (parsed == spdlog::level::off && *lvl != "off") {
        l->warn("[CONFIG] TIERMEM_LOG_LEVEL={} is not a level (trace|debug|info|warn|error|off)", *lvl);
      } else {
        l->set_level(parsed);
      }
    }
    return l;
  }();
  return *log;
}

void set_log_level(std::string_view level) {
  auto parsed = spdlog::level::from_str(std::string(level));
  if (parsed == spdlog::level::off && level != "off") {
    logger().warn("[CONFIG] log level '{}' is not one of trace|debug|info|warn|error|off", level);
    return;
  }
  logger().set_level(parsed);
}

namespace {
std::atomic<int> g_log_rank{0};
}  // namespace

// A cause is remembered only while warnings are logged: a silenced process (a fuzzer parsing
// millions of configs with the level off) keeps no growing set; what it would have said is lost
// anyway.
bool first_time(std::string_view cause) {
  if (!logger().should_log(spdlog::level::warn)) return false;
  static std::mutex mu;
  static std::set<std::string, std::less<>> seen;
  std::lock_guard<std::mutex> lock(mu);
  if (seen.find(cause) != seen.end()) return false;
  seen.emplace(cause);
  return true;
}

void set_log_rank(int rank) { g_log_rank.store(rank); }
int log_rank() { return g_log_rank.load(); }

}  // namespace tiermem
