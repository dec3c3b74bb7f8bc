// thread_name.h — names tiermem's own threads ("tm-..."), so top -H, perf and /proc/<pid>/task/*/comm
// say which is which (internal, not installed).
#pragma once

#include <pthread.h>

namespace tiermem::detail {

// Sets the calling thread's name (at most 15 characters; longer ones are cut). Best effort: a
// failure changes nothing else.
inline void name_this_thread(const char* name) noexcept {
  char buf[16] = {};
  for (int i = 0; i < 15 && name[i] != '\0'; ++i) buf[i] = name[i];
  pthread_setname_np(pthread_self(), buf);
}

// For a pool's threads, which the pool starts itself: names the calling thread once.
inline void name_pool_thread(const char* name) noexcept {
  thread_local bool named = false;
  if (!named) {
    name_this_thread(name);
    named = true;
  }
}

}  // namespace tiermem::detail
