// src/core/cli_checks.h — CLI11 checks the command-line tools (tiermem-train, tiermem-plan,
// tiermem-bench) place before a CLI::Range, which calls a value that is no number, or not a
// whole one, "not in range" ("--lr abc", "--steps 1.5"). Each returns a message naming the
// value; neither adds anything to --help.
//
// Header-only: it needs CLI11's headers, which tiermem::core does not link; only the tools that
// include it do. The validators are built once (function-local statics, thread-safe); no errors
// are thrown.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdlib>
#include <string>

namespace tiermem::cli {

// "'abc' is not a number" unless the whole value parses as a floating-point number (strtod).
inline const CLI::Validator& number_check() {
  static const CLI::Validator check(
      [](std::string& v) {
        char* end = nullptr;
        std::strtod(v.c_str(), &end);
        const bool number = !v.empty() && end == v.c_str() + v.size();
        return number ? std::string() : "'" + v + "' is not a number";
      },
      "");
  return check;
}

// "'1.5' is not a whole number" unless the whole value parses as a base-10 integer (strtoll).
inline const CLI::Validator& whole_number_check() {
  static const CLI::Validator check(
      [](std::string& v) {
        char* end = nullptr;
        std::strtoll(v.c_str(), &end, 10);
        const bool whole = !v.empty() && end == v.c_str() + v.size();
        return whole ? std::string() : "'" + v + "' is not a whole number";
      },
      "");
  return check;
}

}  // namespace tiermem::cli
