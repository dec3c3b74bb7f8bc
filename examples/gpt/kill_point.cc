// examples/gpt/kill_point.cc — TEST-ONLY crash injection (kill_point.h).
#include "kill_point.h"

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

const KillAt& kill_at() {
  static const KillAt k = [] {
    KillAt r;
    const auto v = env_param("TIERMEM_TEST_KILL_AT");
    if (!v) return r;
    const auto colon = v->rfind(':');
    char* end = nullptr;
    const long n = colon == std::string::npos ? 0 : std::strtol(v->c_str() + colon + 1, &end, 10);
    if (colon == std::string::npos || colon == 0 || n <= 0 || !end || *end != '\0') {
      std::fprintf(stderr,
                   "tiermem-train: warning: ignoring TIERMEM_TEST_KILL_AT='%s' "
                   "(expected <phase>:<n>, n >= 1)\n",
                   v->c_str());
      return r;
    }
    r.phase = v->substr(0, colon);
    r.n = n;
    return r;
  }();
  return k;
}

std::atomic<long> g_passes{0};

}  // namespace

bool kill_point_armed(const char* phase) {
  const KillAt& k = kill_at();
  return k.n > 0 && k.phase == phase;
}

void kill_point(const char* phase) {
  if (!kill_point_armed(phase)) return;
  if (g_passes.fetch_add(1) + 1 == kill_at().n) ::kill(::getpid(), SIGKILL);
}

}  // namespace tiermem::train
