// src/core/profile_file.h — the machine-profile file `tiermem-bench profile --json` writes, read
// for the engine's tiermem.machine_profile (config.cc) and for tiermem-plan's profile
// (plan/profile.cc) by one reader, so both accept and refuse the same files.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace tiermem {

// The profile object of the file at `path`: its last line that is a JSON object when the whole
// file is not JSON (tiermem-bench's output, `{"profile": {...}}`), else the whole file; the object
// under "profile" when there is one. Throws ConfigError(key, path, prefix + what was wrong + how to
// write one) for a directory, a file that is not regular (a device, FIFO or socket: never read),
// one that cannot be read, or one holding no JSON object. `prefix` names the file in the message
// ("" where describe() adds "key = path: ").
nlohmann::json read_profile_file(const std::string& path, const std::string& key, const std::string& prefix);

}  // namespace tiermem
