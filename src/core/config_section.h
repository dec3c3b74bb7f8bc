// src/core/config_section.h — the walker parse_config reads the JSON document with: one object
// at a time, typed getters that record each key consumed (given, or "auto"), and finish() listing
// what was left over as unknown. Internal to src/core (config.cc, config_parse.cc).
//
// Thread-safety: a Section writes into the Config it was given; one thread per document.
#pragma once

#include <algorithm>
#include <cctype>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "tiermem/config.h"
#include "tiermem/error.h"

namespace tiermem::detail {

using json = nlohmann::json;

inline std::string show(const json& v) {
  std::string s = v.dump();
  if (s.size() > 80) s = s.substr(0, 77) + "...";
  return s;
}

inline std::string join_path(std::string_view parent, std::string_view key) {
  return parent.empty() ? std::string(key) : std::string(parent) + "." + std::string(key);
}

// One JSON object being read. get_*() consume a key; finish() reports what was not consumed.
class Section {
 public:
  Section(const json& obj, std::string path, Config& cfg)
      : obj_(obj), path_(std::move(path)), cfg_(cfg) {
    if (!obj_.is_object()) {
      throw ConfigError(path_, show(obj_),
                        (path_.empty() ? std::string("the config must be a JSON object {...}")
                                       : "config key '" + path_ + "' must be a JSON object") +
                            ", got " + show(obj_));
    }
  }
  ~Section() = default;

  const json* find(const char* key) {
    asked_.push_back(key);
    auto it = obj_.find(key);
    if (it == obj_.end()) return nullptr;
    seen_.push_back(key);
    if (it->is_string() && it->get<std::string>() == "auto") {
      cfg_.auto_keys.push_back(join_path(path_, key));
      return nullptr;  // keep the default
    }
    cfg_.given_keys.push_back(join_path(path_, key));
    return &*it;
  }

  std::string path(const char* key) const { return join_path(path_, key); }
  // Whether the document gives `key` a value other than "auto" (what find() reads).
  bool has(const char* key) const { return obj_.contains(key) && !is_auto(key); }
  bool is_auto(const char* key) const {
    auto it = obj_.find(key);
    return it != obj_.end() && it->is_string() && it->get<std::string>() == "auto";
  }

  void get(const char* key, bool& out) {
    if (const json* v = find(key)) {
      if (!v->is_boolean()) bad(key, *v, "true or false");
      out = v->get<bool>();
    }
  }

  void get(const char* key, std::optional<bool>& out) {
    if (const json* v = find(key)) {
      if (!v->is_boolean()) bad(key, *v, "true, false or \"auto\"");
      out = v->get<bool>();
    }
  }

  void get(const char* key, std::string& out) {
    if (const json* v = find(key)) {
      if (!v->is_string()) bad(key, *v, "a string");
      out = v->get<std::string>();
    }
  }

  void get_choice(const char* key, std::string& out, std::initializer_list<const char*> allowed) {
    std::string s = out;
    get(key, s);
    std::string lower;
    for (char c : s)
      lower.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
    std::string list;
    for (const char* a : allowed) {
      if (lower == a) {
        out = lower;
        return;
      }
      list += list.empty() ? std::string("\"") + a + "\"" : std::string(", \"") + a + "\"";
    }
    throw ConfigError(path(key), s,
                      "config key '" + path(key) + "' = \"" + s + "\": allowed values are " + list);
  }

  void get_int(const char* key, int& out, long long lo, long long hi) {
    if (const json* v = find(key)) {
      long long x = integral(key, *v);
      if (x < lo || x > hi) range(key, *v, lo, hi);
      out = static_cast<int>(x);
    }
  }

  // `expect`: what the error says a valid value is (default "a number").
  void get_double(const char* key, double& out, double lo, double hi,
                  const char* expect = "a number") {
    if (const json* v = find(key)) {
      if (!v->is_number()) bad(key, *v, expect);
      double x = v->get<double>();
      if (!(x >= lo && x <= hi)) {
        std::ostringstream os;
        os << "config key '" << path(key) << "' = " << show(*v) << " is out of range: allowed "
           << lo << " to " << hi;
        throw ConfigError(path(key), show(*v), os.str());
      }
      out = x;
    }
  }

  // A size in bytes or elements: number or string with a suffix.
  void get_size(const char* key, std::uint64_t& out, std::uint64_t lo = 0,
                std::uint64_t hi = std::numeric_limits<std::uint64_t>::max()) {
    if (const json* v = find(key)) {
      std::uint64_t x = 0;
      if (v->is_string()) {
        x = parse_size(v->get<std::string>(), path(key));
      } else if (v->is_number()) {
        x = static_cast<std::uint64_t>(integral(key, *v, /*allow_negative=*/false));
      } else {
        bad(key, *v, "a size (a number, or a string such as \"64MiB\")");
      }
      if (x < lo || x > hi)
        range(key, *v, static_cast<long long>(lo),
              static_cast<long long>(
                  std::min<std::uint64_t>(hi, std::numeric_limits<long long>::max())));
      out = x;
    }
  }

  void get_paths(const char* key, std::vector<std::string>& out) {
    if (const json* v = find(key)) {
      out.clear();
      if (v->is_null()) return;
      if (v->is_string()) {
        out.push_back(v->get<std::string>());
      } else if (v->is_array()) {
        for (const auto& e : *v) {
          if (!e.is_string()) bad(key, *v, "a path or a list of paths");
          out.push_back(e.get<std::string>());
        }
      } else {
        bad(key, *v, "a path or a list of paths");
      }
      for (const auto& p : out) {
        if (p.empty()) broken(key, show(*v), "a path is empty: name a directory (on the NVMe drive to swap to)");
      }
    }
  }

  std::optional<Section> sub(const char* key) {
    asked_.push_back(key);
    auto it = obj_.find(key);
    if (it == obj_.end()) return std::nullopt;
    seen_.push_back(key);
    if (it->is_null()) return std::nullopt;
    return Section(*it, path(key), cfg_);
  }

  // A key tiermem reads but does not act on: accepted with any value, one warning saying why.
  void inert(const char* key, const std::string& why) {
    asked_.push_back(key);
    if (!obj_.contains(key)) return;
    seen_.push_back(key);
    cfg_.inert_keys.push_back({path(key), why});
  }

  // A value that passed its type check but breaks a rule: names key path, value and rule.
  [[noreturn]] void broken(const char* key, const std::string& value, const std::string& rule) {
    throw ConfigError(path(key), value, "config key '" + path(key) + "' = " + value + ": " + rule);
  }

  // Each key left over is unknown; the key this section reads that is nearest to it (edit
  // distance at most a third of its length, at least 2, case ignored; a key that begins with the
  // other, as "host_budget" and "host_budget_bytes", counts as 1) is offered as the one meant.
  void finish() {
    for (auto it = obj_.begin(); it != obj_.end(); ++it) {
      bool used = false;
      for (const auto& s : seen_) used = used || s == it.key();
      if (used) continue;
      cfg_.unknown_keys.push_back(path(it.key().c_str()));
      const std::string_view k = it.key();
      std::string best;
      std::size_t best_d = std::max<std::size_t>(2, k.size() / 3) + 1;
      for (const auto& a : asked_) {
        // k is not a itself (it would have been seen), so a prefix of either is one edit away.
        const bool prefix = std::min(k.size(), a.size()) >= 4 && (a.starts_with(k) || k.starts_with(a));
        const std::size_t d = prefix ? 1 : edit_distance(k, a);
        if (d < best_d) {
          best_d = d;
          best = a;
        }
      }
      cfg_.unknown_key_suggestions.push_back(best.empty() ? std::string() : path(best.c_str()));
    }
  }

 private:
  [[noreturn]] void bad(const char* key, const json& v, const char* expected) {
    throw ConfigError(path(key), show(v),
                      "config key '" + path(key) + "' = " + show(v) +
                          " has the wrong type: expected " + expected);
  }
  [[noreturn]] void range(const char* key, const json& v, long long lo, long long hi) {
    throw ConfigError(path(key), show(v),
                      "config key '" + path(key) + "' = " + show(v) + " is out of range: allowed " +
                          std::to_string(lo) + " to " + std::to_string(hi));
  }
  // A number of the right type below zero where sizes and counts are meant.
  [[noreturn]] void negative(const char* key, const json& v) {
    throw ConfigError(path(key), show(v),
                      "config key '" + path(key) + "' = " + show(v) + " is out of range: allowed 0 or more");
  }
  long long integral(const char* key, const json& v, bool allow_negative = true) {
    if (v.is_number_integer()) {
      if (v.is_number_unsigned()) {
        auto u = v.get<std::uint64_t>();
        if (u > static_cast<std::uint64_t>(std::numeric_limits<long long>::max()))
          bad(key, v, "an integer that fits 63 bits");
        return static_cast<long long>(u);
      }
      long long x = v.get<long long>();
      if (!allow_negative && x < 0) negative(key, v);
      return x;
    }
    if (v.is_number_float()) {
      double d = v.get<double>();
      if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.2e18) {
        if (!allow_negative && d < 0) negative(key, v);
        return static_cast<long long>(d);
      }
      if (std::isfinite(d) && d == std::floor(d)) {  // whole, but beyond 63 bits: too large, not mistyped
        throw ConfigError(path(key), show(v),
                          "config key '" + path(key) + "' = " + show(v) +
                              " is out of range: an integer of at most 63 bits (9.2e18) is allowed");
      }
    }
    bad(key, v, "an integer");
  }

  // Levenshtein distance, letters compared without case.
  static std::size_t edit_distance(std::string_view a, std::string_view b) {
    std::vector<std::size_t> row(b.size() + 1);
    for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
    for (std::size_t i = 1; i <= a.size(); ++i) {
      std::size_t diag = row[0];
      row[0] = i;
      for (std::size_t j = 1; j <= b.size(); ++j) {
        const std::size_t up = row[j];
        const bool same = std::tolower(static_cast<unsigned char>(a[i - 1])) ==
                          std::tolower(static_cast<unsigned char>(b[j - 1]));
        row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (same ? 0 : 1)});
        diag = up;
      }
    }
    return row[b.size()];
  }

  const json& obj_;
  std::string path_;
  Config& cfg_;
  std::vector<std::string> seen_;
  std::vector<std::string> asked_;  // every key this section looked for, given or not
};

}  // namespace tiermem::detail
