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
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <regex>
#include <string>

namespace tiermem::cli {

// "'abc' is not a number" unless the whole value parses as a finite floating-point number
// (strtod; "nan" and "inf" are refused, as no range holds them).
inline const CLI::Validator& number_check() {
  static const CLI::Validator check(
      [](std::string& v) {
        char* end = nullptr;
        const double x = std::strtod(v.c_str(), &end);
        const bool number = !v.empty() && end == v.c_str() + v.size();
        if (!number) return "'" + v + "' is not a number";
        return std::isfinite(x) ? std::string() : "'" + v + "' is not a finite number";
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

// "'maybe' is not true or false" unless the value is one CLI11 reads as a bool (true/false, 1/0,
// yes/no, on/off, in any case).
inline const CLI::Validator& bool_check() {
  static const CLI::Validator check(
      [](std::string& v) {
        std::string l;
        for (char ch : v) l += static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
        for (const char* ok : {"true", "false", "1", "0", "yes", "no", "on", "off"}) {
          if (l == ok) return std::string();
        }
        return "'" + v + "' is not true or false";
      },
      "");
  return check;
}

// For a floating-point option whose CLI::Range prints its bounds with six decimals ("not in range
// 0.000000 to 10.000000" for a bound of 1e-12): placed between number_check() and the Range,
// "0 is outside [1e-12, 10]", the bounds as --help shows them.
inline CLI::Validator within(double lo, double hi) {
  return CLI::Validator(
      [lo, hi](std::string& v) {
        const double x = std::strtod(v.c_str(), nullptr);
        if (x >= lo && x <= hi) return std::string();
        char text[96];
        std::snprintf(text, sizeof text, "[%g, %g]", lo, hi);
        return v + " is outside " + text;
      },
      "");
}

// A parse error's text for the one-line message. CLI11 says an option given twice as "--model:
// At Most 1 required but received 2"; this says "--model was given 2 times: give it once".
// Every other error's text is CLI11's own.
inline std::string parse_error_text(const CLI::ParseError& e) {
  std::string text = e.what();
  static const std::regex repeated(R"(^(\S+): At Most 1 required but received (\d+)$)");
  std::smatch m;
  if (std::regex_match(text, m, repeated)) return m[1].str() + " was given " + m[2].str() + " times: give it once";
  for (char& c : text)
    if (c == '\n') c = ' ';
  return text;
}

}  // namespace tiermem::cli
