// src/plan/plan_report.cc — a prediction as output (plan.h): checked against a run's summary, and
// as JSON.
#include "plan/plan.h"

#include <cmath>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "tiermem/error.h"

namespace tiermem::plan {

std::vector<CheckRow> check_against(const Prediction& p, const nlohmann::json& s, const std::string& source) {
  const double step = p.time.step_s;
  const std::pair<const char*, double> predicted[] = {
      {"step_seconds", step},
      // World 1: the gradient hand-off's copies in the compute, its last hand-offs in the I/O wait
      // (TimePrediction::handoff_*_s), as tiermem-train counts them.
      {"compute_share", step > 0 ? (p.time.compute_s + p.time.handoff_compute_s) / step : 0},
      {"io_wait_share", step > 0 ? (p.time.stall_s + p.time.handoff_wait_s) / step : 0},
      {"communication_share", step > 0 ? p.time.comm_s / step : 0},
      {"optimizer_share", step > 0 ? p.time.optimizer_s / step : 0},
      {"device_peak_bytes", static_cast<double>(p.device_peak_bytes)},
      {"host_peak_bytes", static_cast<double>(p.host_peak_bytes)},
      {"nvme_peak_bytes", static_cast<double>(p.nvme_peak_bytes)},
  };
  std::vector<CheckRow> rows;
  for (const auto& [field, pred] : predicted) {
    if (!s.contains(field) || !s[field].is_number()) {
      throw ConfigError(source + ": summary." + field, s.contains(field) ? s[field].dump() : "(missing)",
                        "a tiermem-train --json summary has this number (is the summary from an older build?)");
    }
    // A figure a run can produce: finite, not negative; a step above 0, a share of the run at most 1.
    const double v = s[field].get<double>();
    const std::string_view f = field;
    const bool share = f.ends_with("_share"), step = f == "step_seconds";
    if (!std::isfinite(v) || v < 0 || (step && v == 0) || (share && v > 1.0 + 1e-9)) {
      throw ConfigError(source + ": summary." + field, s[field].dump(),
                        step ? "must be > 0 seconds" : share ? "a share of the run's time is in [0, 1]" : "must be >= 0 bytes");
    }
    CheckRow r;
    r.field = field;
    r.predicted = pred;
    r.measured = v;
    r.rel_error = r.measured != 0 ? std::abs(pred - r.measured) / std::abs(r.measured) : (pred == 0 ? 0 : 1);
    rows.push_back(r);
  }
  return rows;
}

nlohmann::json prediction_json(const Prediction& p) {
  const ZeroPlan& z = p.zero;
  nlohmann::json j;
  j["fits"] = p.fits;
  if (!p.fits) {
    j["why"] = p.why;
    j["fix"] = p.fix;
  }
  j["params"] = p.params;
  j["homes"] = {{"params", std::string(tier_name(z.param_home))},
                {"optimizer", std::string(tier_name(z.optimizer_home))},
                {"gradients", std::string(tier_name(z.gradient_home))}};
  j["sub_group_elems"] = z.sub_group_elems;
  j["host_budget_bytes"] = z.host_budget_bytes;
  j["host_min_bytes"] = z.host_min_bytes;
  j["host_min_why"] = z.host_min_why;
  j["device_budget_bytes"] = z.device_budget_bytes;
  j["device_min_bytes"] = z.device_min_bytes;
  j["device_min_why"] = z.device_min_why;
  j["device_peak_bytes"] = p.device_peak_bytes;
  j["host_peak_bytes"] = p.host_peak_bytes;
  j["host_peak_parts"] = {{"pool", p.host_pool_peak_bytes}, {"bounce", p.host_bounce_bytes},
                          {"engine", p.host_engine_bytes}, {"gradient_buffers", p.grad_buffer_peak_bytes},
                          {"activations", p.activation_bytes}, {"sim_device", p.sim_device_bytes}};
  j["device_activation_bytes"] = p.device_activation_bytes;
  j["nvme_peak_bytes"] = p.nvme_peak_bytes;
  if (!p.fits || p.time.step_s <= 0) return j;  // no time without a profile's rates
  const TimePrediction& t = p.time;
  j["step_seconds"] = t.step_s;
  j["time_seconds"] = {{"compute", t.compute_s}, {"io_wait", t.stall_s}, {"nvme", t.nvme_s},
                       {"host_to_device", t.h2d_s}, {"gradient_handoff", t.d2h_s},
                       {"communication", t.comm_s}, {"adam", t.adam_s}, {"optimizer", t.optimizer_s}, {"optimizer_wait", t.optimizer_wait_s},
                       {"checksum", t.checksum_s}};
  if (!t.handoff_from.empty()) j["gradient_handoff_from"] = t.handoff_from;
  if (!t.io_wait_from.empty()) j["optimizer_reads_from"] = t.io_wait_from;
  j["bottleneck"] = t.bottleneck;
  j["traffic_bytes"] = {{"nvme_read", p.nvme_read_bytes}, {"nvme_write", p.nvme_write_bytes},
                        {"host_to_device", p.h2d_bytes}, {"collectives", p.comm_bytes}};
  j["tokens_per_step"] = p.tokens_per_step;
  j["tokens_per_s"] = p.tokens_per_s;
  j["tflops"] = p.tflops;
  return j;
}

}  // namespace tiermem::plan
