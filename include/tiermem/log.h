// tiermem/log.h — leveled logging with a subsystem tag, on spdlog, to stderr.
//
//   TM_LOG_INFO("NVME", "opened {} ({} rings)", path, n);   // -> "[info] [NVME] opened ..."
//
// Tags in use: CONFIG, NVME, HOST, GPU, PREFETCH, RUNTIME, COMM, ZERO, TRAIN, BENCH.
// The level comes from TIERMEM_LOG_LEVEL (trace|debug|info|warn|error|off, read once; default
// info) or set_log_level(). Output goes to stderr so that stdout stays clean for --json.
// Thread-safety: all functions are thread-safe.
#pragma once

#include <string_view>

#include <spdlog/spdlog.h>

namespace tiermem {

// The process-wide logger (created on first use).
spdlog::logger& logger();

// Sets the level by name; an unknown name is ignored with a warning.
void set_log_level(std::string_view level);

}  // namespace tiermem

#define TM_LOG_(lvl, tag, fmt_, ...) ::tiermem::logger().lvl("[" tag "] " fmt_ __VA_OPT__(, ) __VA_ARGS__)
#define TM_LOG_TRACE(tag, fmt_, ...) TM_LOG_(trace, tag, fmt_ __VA_OPT__(, ) __VA_ARGS__)
#define TM_LOG_DEBUG(tag, fmt_, ...) TM_LOG_(debug, tag, fmt_ __VA_OPT__(, ) __VA_ARGS__)
#define TM_LOG_INFO(tag, fmt_, ...) TM_LOG_(info, tag, fmt_ __VA_OPT__(, ) __VA_ARGS__)
#define TM_LOG_WARN(tag, fmt_, ...) TM_LOG_(warn, tag, fmt_ __VA_OPT__(, ) __VA_ARGS__)
#define TM_LOG_ERROR(tag, fmt_, ...) TM_LOG_(error, tag, fmt_ __VA_OPT__(, ) __VA_ARGS__)
