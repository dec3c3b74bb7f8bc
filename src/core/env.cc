#include "tiermem/env.h"

#include <unistd.h>

#include <cstdlib>
#include <map>
#include <mutex>

namespace tiermem {

std::optional<std::string> env_param(std::string_view name) {
  static std::mutex mu;
  static std::map<std::string, std::optional<std::string>, std::less<>> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(name);
  if (it != cache.end()) return it->second;
  std::string key(name);
  const char* v = std::getenv(key.c_str());
  std::optional<std::string> value;
  if (v != nullptr && *v != '\0') value = v;
  cache.emplace(key, value);
  return value;
}

void prefer_passive_omp_wait(char** argv, bool restart) {
  const bool user_chose = std::getenv("OMP_WAIT_POLICY") != nullptr || std::getenv("GOMP_SPINCOUNT") != nullptr;
  if (!user_chose && ::setenv("OMP_WAIT_POLICY", "PASSIVE", 1) == 0) restart = true;
  if (!restart) return;
  // The program's own path, so that ps and top still show its name (exec of /proc/self/exe
  // itself would name the process "exe").
  char path[4096];
  const ssize_t n = ::readlink("/proc/self/exe", path, sizeof path - 1);
  if (n > 0) {
    path[n] = '\0';
    ::execv(path, argv);  // returns only on failure
  }
  ::execv("/proc/self/exe", argv);
}

}  // namespace tiermem
