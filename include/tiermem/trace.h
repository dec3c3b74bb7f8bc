// tiermem/trace.h — a timeline of what tiermem does, in Chrome trace JSON (opens in Perfetto,
// https://ui.perfetto.dev, or chrome://tracing).
//
// Events are "complete" spans on named tracks ("compute", "nvme->host", "host->device",
// "allgather", "wait", ...); each track is one row in the viewer, so overlap is visible.
// The file is {"traceEvents":[...]} with timestamps in microseconds since the recorder started.
// Enable with Trace::global().start(path) or the environment variable TIERMEM_TRACE=path
// (read at first use; the file is then also written at normal process exit, so a program that
// never calls save() — a Python script — still gets it). Disabled recording costs one relaxed
// atomic load per event.
//
// Thread-safety: every method is thread-safe. save() writes to "<path>.tmp", fsyncs and renames.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "tiermem/export.h"

namespace tiermem {

class TIERMEM_API Trace {
 public:
  // The process-wide recorder. Starts itself if TIERMEM_TRACE is set.
  static Trace& global();

  // Starts recording; events are kept in memory until save(). `process_name` labels the process
  // row (e.g. "rank 0"); `pid` separates ranks when traces are merged.
  void start(std::string path, std::string process_name = "tiermem", int pid = 0);
  bool enabled() const noexcept { return enabled_.load(std::memory_order_relaxed); }

  // Nanoseconds on the trace clock (steady_clock).
  static std::uint64_t now_ns() noexcept;

  // A span on `track` from start_ns lasting dur_ns. `args_json` is "" or a JSON object text.
  void complete(std::string_view name, std::string_view track, std::uint64_t start_ns,
                std::uint64_t dur_ns, std::string_view args_json = {});
  // A counter sample (a line graph in the viewer).
  void counter(std::string_view name, double value, std::uint64_t at_ns = 0);

  // Writes the file (atomically) and keeps recording. Returns false (and logs) on I/O failure.
  bool save();
  // save() and stop recording; returns save()'s result.
  bool stop();
  // The file start() was given ("" before start()).
  std::string path() const;

  std::size_t event_count() const;

 private:
  Trace() = default;
  int track_id(std::string_view track);  // needs mu_

  std::atomic<bool> enabled_{false};
  mutable std::mutex mu_;
  std::string path_;             // guarded by mu_
  std::string process_name_;     // guarded by mu_
  int pid_ = 0;                  // guarded by mu_
  std::uint64_t origin_ns_ = 0;  // guarded by mu_
  std::vector<std::string> events_;                   // guarded by mu_: JSON objects
  std::unordered_map<std::string, int> tracks_;       // guarded by mu_
};

// RAII span: records [construction, destruction) on `track` when tracing is enabled.
class TIERMEM_API TraceSpan {
 public:
  TraceSpan(std::string_view name, std::string_view track)
      : enabled_(Trace::global().enabled()) {
    if (enabled_) {
      name_ = name;
      track_ = track;
      start_ns_ = Trace::now_ns();
    }
  }
  ~TraceSpan() {
    if (enabled_) Trace::global().complete(name_, track_, start_ns_, Trace::now_ns() - start_ns_, args_);
  }
  void set_args(std::string args_json) { args_ = std::move(args_json); }
  TraceSpan(const TraceSpan&) = delete;
  TraceSpan& operator=(const TraceSpan&) = delete;

 private:
  bool enabled_;
  std::string name_, track_, args_;
  std::uint64_t start_ns_ = 0;
};

}  // namespace tiermem
