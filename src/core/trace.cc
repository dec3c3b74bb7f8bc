#include "tiermem/trace.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include <nlohmann/json.hpp>

#include "tiermem/env.h"
#include "tiermem/error.h"
#include "tiermem/log.h"

namespace tiermem {

Trace& Trace::global() {
  static Trace* t = [] {
    auto* tr = new Trace();  // leaked on purpose: usable from other static destructors
    if (auto p = env_param("TIERMEM_TRACE")) {
      tr->start(*p);
      // A program that never calls save()/stop() (a Python script, a user's C++ program) still
      // gets its file: it is written at normal process exit. A program that stopped the trace
      // itself (tiermem-train) is not written twice.
      std::atexit([] {
        Trace& t = Trace::global();
        if (t.enabled()) t.stop();
      });
    }
    return tr;
  }();
  return *t;
}

std::uint64_t Trace::now_ns() noexcept {
  return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                        std::chrono::steady_clock::now().time_since_epoch())
                                        .count());
}

void Trace::start(std::string path, std::string process_name, int pid) {
  std::lock_guard<std::mutex> lock(mu_);
  path_ = std::move(path);
  process_name_ = std::move(process_name);
  pid_ = pid;
  origin_ns_ = now_ns();
  events_.clear();
  tracks_.clear();
  enabled_.store(true, std::memory_order_relaxed);
}

int Trace::track_id(std::string_view track) {
  auto it = tracks_.find(std::string(track));
  if (it != tracks_.end()) return it->second;
  int id = static_cast<int>(tracks_.size()) + 1;
  tracks_.emplace(std::string(track), id);
  nlohmann::json meta = {{"ph", "M"}, {"name", "thread_name"}, {"pid", pid_}, {"tid", id},
                         {"args", {{"name", std::string(track)}}}};
  events_.push_back(meta.dump());
  nlohmann::json order = {{"ph", "M"}, {"name", "thread_sort_index"}, {"pid", pid_}, {"tid", id},
                          {"args", {{"sort_index", id}}}};
  events_.push_back(order.dump());
  return id;
}

void Trace::complete(std::string_view name, std::string_view track, std::uint64_t start_ns,
                     std::uint64_t dur_ns, std::string_view args_json) {
  if (!enabled()) return;
  std::lock_guard<std::mutex> lock(mu_);
  int tid = track_id(track);
  double ts = start_ns >= origin_ns_ ? static_cast<double>(start_ns - origin_ns_) / 1e3 : 0.0;
  nlohmann::json e = {{"ph", "X"},  {"name", std::string(name)}, {"pid", pid_}, {"tid", tid},
                      {"ts", ts},   {"dur", static_cast<double>(dur_ns) / 1e3}};
  if (!args_json.empty()) {
    auto parsed = nlohmann::json::parse(args_json, nullptr, /*allow_exceptions=*/false);
    if (!parsed.is_discarded()) e["args"] = parsed;
  }
  events_.push_back(e.dump());
}

void Trace::counter(std::string_view name, double value, std::uint64_t at_ns) {
  if (!enabled()) return;
  if (at_ns == 0) at_ns = now_ns();
  std::lock_guard<std::mutex> lock(mu_);
  double ts = at_ns >= origin_ns_ ? static_cast<double>(at_ns - origin_ns_) / 1e3 : 0.0;
  nlohmann::json e = {{"ph", "C"}, {"name", std::string(name)}, {"pid", pid_}, {"ts", ts},
                      {"args", {{"value", value}}}};
  events_.push_back(e.dump());
}

std::size_t Trace::event_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return events_.size();
}

bool Trace::save() {
  std::lock_guard<std::mutex> lock(mu_);
  if (path_.empty()) return false;
  std::string tmp = path_ + ".tmp";
  // O_NOFOLLOW: a symlink planted at the temporary name is refused (ELOOP), never written through.
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0666);
  FILE* f = fd < 0 ? nullptr : ::fdopen(fd, "w");
  if (f == nullptr) {
    const int err = errno;
    if (fd >= 0) ::close(fd);
    TM_LOG_ERROR("TRACE", "{}", errno_message("cannot write trace file '" + tmp + "'", err));
    return false;
  }
  nlohmann::json meta = {{"ph", "M"}, {"name", "process_name"}, {"pid", pid_},
                         {"args", {{"name", process_name_}}}};
  std::fputs("{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n", f);
  std::fputs(meta.dump().c_str(), f);
  for (const auto& e : events_) {
    std::fputs(",\n", f);
    std::fputs(e.c_str(), f);
  }
  std::fputs("\n]}\n", f);
  bool ok = std::fflush(f) == 0 && ::fsync(fileno(f)) == 0;
  ok = (std::fclose(f) == 0) && ok;
  if (!ok || std::rename(tmp.c_str(), path_.c_str()) != 0) {
    TM_LOG_ERROR("TRACE", "{}", errno_message("cannot write trace file '" + path_ + "'", errno));
    return false;
  }
  return true;
}

bool Trace::stop() {
  const bool ok = save();
  enabled_.store(false, std::memory_order_relaxed);
  return ok;
}

std::string Trace::path() const {
  std::lock_guard<std::mutex> lock(mu_);
  return path_;
}

}  // namespace tiermem
