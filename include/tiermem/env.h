// tiermem/env.h — the one place environment variables are read (TIERMEM_*, RANK, WORLD_SIZE...).
// Each name is read once per process and cached, so later setenv() calls are not seen.
// Thread-safety: thread-safe.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace tiermem {

// The value of environment variable `name`, or nullopt when unset or empty.
std::optional<std::string> env_param(std::string_view name);

}  // namespace tiermem
