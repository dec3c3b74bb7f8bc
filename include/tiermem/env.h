// tiermem/env.h — the one place environment variables are read (TIERMEM_*, RANK, WORLD_SIZE...).
// Each name is read once per process and cached, so later setenv() calls are not seen.
// Thread-safety: thread-safe.
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "tiermem/export.h"

namespace tiermem {

// The value of environment variable `name`, or nullopt when unset or empty.
TIERMEM_API std::optional<std::string> env_param(std::string_view name);

// For a program's main(), first thing (argv as main got it): libgomp reads OMP_WAIT_POLICY once,
// when it is loaded, before main. Its default spins the team's threads after every parallel
// region, and on a small machine they take the cores from OpenBLAS's threads and tiermem's own
// (a gpt2 step of tiermem-train 2-3x slower on 2 cores; docs/benchmarks.md "Threading defaults (OpenMP, OpenBLAS)"). Unless the
// user chose (OMP_WAIT_POLICY or GOMP_SPINCOUNT set), this sets OMP_WAIT_POLICY=PASSIVE and
// starts the program again, once, from its own path (/proc/self/exe resolved, so that ps and top
// still show its name) with the same arguments; it returns only
// when nothing was to be done or the exec failed (the program then carries on as it is).
// `restart`: start again even when the user chose the policy (another variable read at load time
// was set by the caller, e.g. gpt::cpu::prefer_openblas_core_for_this_cpu()).
// Call it before any thread, MPI_Init or file is opened.
TIERMEM_API void prefer_passive_omp_wait(char** argv, bool restart = false);

}  // namespace tiermem
