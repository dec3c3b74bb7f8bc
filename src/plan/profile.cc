// src/plan/profile.cc — a machine profile (plan.h): read from tiermem-bench's JSON or a written
// one, each figure checked (the rates it gives are priced in plan.cc).
#include "plan/plan.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/profile_file.h"
#include "tiermem/error.h"

namespace tiermem::plan {
namespace {

// The figure `key` of `j`, named in errors as "<source><sep><key>" (": " for a profile's own
// figures, "." for one inside a keyed table, as the table's key errors name it).
double number(const nlohmann::json& j, const std::string& key, const std::string& source,
              bool required, const char* sep = ": ") {
  const std::string where = source + sep + key;
  if (!j.contains(key)) {
    if (required) {
      throw ConfigError(where, "(missing)",
                        "required number is missing (tiermem-bench profile --json writes every figure)");
    }
    return 0;
  }
  const auto& v = j.at(key);
  if (!v.is_number()) throw ConfigError(where, v.dump(), "must be a number");
  const double x = v.get<double>();
  if (!std::isfinite(x) || x < 0 || (required && x == 0)) {
    throw ConfigError(where, v.dump(), required ? "must be > 0" : "must be >= 0");
  }
  // Every figure is a rate in GB/s, GFLOP/s or per second, a byte count or a count: a positive
  // one this small is a typo or a unit slip, and would make predictions infinite.
  if (x > 0 && x < 1e-6) throw ConfigError(where, v.dump(), "is positive but below 1e-6: check its unit");
  return x;
}

}  // namespace

MachineProfile parse_profile(const nlohmann::json& j, const std::string& source) {
  if (!j.is_object()) throw ConfigError(source, j.dump().substr(0, 40), "a profile is one JSON object");
  MachineProfile m;
  m.name = j.value("name", source);
  if (j.contains("device")) {
    const nlohmann::json& d = j["device"];
    if (!d.is_string() || (d != "sim" && d != "cuda")) {
      throw ConfigError(source + ": device", d.dump(), "must be \"sim\" or \"cuda\"");
    }
    m.device = d == "cuda" ? DeviceKind::kCuda : DeviceKind::kSim;
  }
  if (j.contains("cpu_isa") && j["cpu_isa"].is_string()) m.cpu_isa = j["cpu_isa"].get<std::string>();
  // gpus and threads: counts of at least 1 where given; absent, 0 (gpus then 1).
  auto count = [&](const char* key, const char* what) {
    if (!j.contains(key)) return 0;
    const double n = number(j, key, source, true);
    if (n < 1) throw ConfigError(source + ": " + key, j[key].dump(), std::string("must be >= 1 (") + what + ")");
    return static_cast<int>(n);
  };
  m.gpus = std::max(1, count("gpus", "devices per machine"));
  m.compute_gflops = number(j, "compute_gflops", source, true);
  // Figures keyed by a size: {"<size>": rate, ...}, sizes > 0 (widths, module elements).
  // `zero_ok`: a rate of 0 means "no such cost" (else every rate must be > 0).
  auto keyed = [&](const char* key, const char* what, std::vector<std::pair<int, double>>& out, bool zero_ok = false) {
    if (!j.contains(key)) return;
    const auto& w = j[key];
    if (!w.is_object()) throw ConfigError(source + ": " + key, w.dump(), "must be an object");
    for (const auto& [k, v] : w.items()) {
      int d = 0;  // the whole key, digits only: "768.5", " 900" or "1e3" is not a size
      const auto [end, ec] = std::from_chars(k.data(), k.data() + k.size(), d);
      if (ec != std::errc() || end != k.data() + k.size() || d <= 0) {
        throw ConfigError(source + ": " + key + "." + k, k, std::string("keys are ") + what);
      }
      out.emplace_back(d, number(w, k, source + ": " + key, !zero_ok, "."));
    }
    std::sort(out.begin(), out.end());
  };
  keyed("compute_gflops_by_width", "widths (d_model > 0)", m.compute_gflops_by_width);
  keyed("compute_gflops_by_width_128", "widths (d_model > 0)", m.compute_gflops_by_width_128);
  keyed("grad_handoff_gbps_by_width", "widths (d_model > 0)", m.grad_handoff_gbps_by_width);
  keyed("grad_handoff_pass_gbps_by_width", "widths (d_model > 0)", m.grad_handoff_pass_gbps_by_width, true);
  keyed("grad_handoff_gbps_by_module_elems", "module sizes (elements > 0)", m.grad_handoff_gbps_by_module_elems);
  keyed("optimizer_params_per_s_by_module_elems", "module sizes (elements > 0)",
        m.optimizer_params_per_s_by_module_elems);
  m.grad_handoff_gbps = number(j, "grad_handoff_gbps", source, false);
  m.checksum_gbps = number(j, "checksum_gbps", source, false);
  m.threads = count("threads", "the OpenMP threads the figures used");
  m.optimizer_params_per_s = number(j, "optimizer_params_per_s", source, false);
  m.cpu_adam_params_per_s = number(j, "cpu_adam_params_per_s", source, true);
  m.h2d_gbps = number(j, "h2d_gbps", source, true);
  m.d2h_gbps = number(j, "d2h_gbps", source, false);
  m.nvme_read_gbps = number(j, "nvme_read_gbps", source, true);
  m.nvme_write_gbps = number(j, "nvme_write_gbps", source, true);
  m.nvme_read_beside_writes_gbps = number(j, "nvme_read_beside_writes_gbps", source, false);
  m.comm_gbps = number(j, "comm_gbps", source, false);
  m.host_memory_bytes = static_cast<std::uint64_t>(number(j, "host_memory_bytes", source, true));
  m.device_memory_bytes = static_cast<std::uint64_t>(number(j, "device_memory_bytes", source, false));
  m.nvme_free_bytes = static_cast<std::uint64_t>(number(j, "nvme_free_bytes", source, false));
  if (j.contains("sources")) {
    if (!j["sources"].is_object()) throw ConfigError(source + ": sources", j["sources"].dump(), "must be an object");
    for (const auto& [k, v] : j["sources"].items()) m.sources[k] = v.is_string() ? v.get<std::string>() : v.dump();
  }
  return m;
}

MachineProfile load_profile(const std::string& path) {
  return parse_profile(read_profile_file(path, "--profile", ""), path);
}

}  // namespace tiermem::plan
