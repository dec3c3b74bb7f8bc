// src/train/kill_point.cc — TEST-ONLY crash injection (kill_point.h).
#include "train/kill_point.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "tiermem/env.h"

namespace tiermem::train {
namespace {

struct KillAt {
  std::string phase;
  long n = 0;  // 0: disarmed
};

KillAt parse_at(const char* name) {
  {
    KillAt r;
    const auto v = env_param(name);
    if (!v) return r;
    const auto colon = v->rfind(':');
    char* end = nullptr;
    const long n = colon == std::string::npos ? 0 : std::strtol(v->c_str() + colon + 1, &end, 10);
    if (colon == std::string::npos || colon == 0 || n <= 0 || !end || *end != '\0') {
      std::fprintf(stderr,
                   "tiermem-train: warning: ignoring %s='%s' (expected <phase>:<n>, n >= 1)\n",
                   name, v->c_str());
      return r;
    }
    r.phase = v->substr(0, colon);
    r.n = n;
    return r;
  }
}

const KillAt& kill_at() {
  static const KillAt k = parse_at("TIERMEM_TEST_KILL_AT");
  return k;
}

const KillAt& term_at() {
  static const KillAt k = parse_at("TIERMEM_TEST_TERM_AT");
  return k;
}

std::atomic<long> g_passes{0}, g_term_passes{0};

}  // namespace

bool kill_point_armed(const char* phase) {
  const KillAt& k = kill_at();
  return k.n > 0 && k.phase == phase;
}

void kill_point(const char* phase) {
  const KillAt& t = term_at();
  if (t.n > 0 && t.phase == phase && g_term_passes.fetch_add(1) + 1 == t.n) ::kill(::getpid(), SIGTERM);
  if (!kill_point_armed(phase)) return;
  if (g_passes.fetch_add(1) + 1 == kill_at().n) ::kill(::getpid(), SIGKILL);
}

}  // namespace tiermem::train
