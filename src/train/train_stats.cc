// src/train/train_stats.cc — progress lines and summary (train_stats.h).
#include "train/train_stats.h"

#include <algorithm>
#include <cmath>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "tiermem/error.h"

namespace tiermem::train {
namespace {

std::string pair_name(int from, int to) {
  return fmt::format("{}->{}", tier_name(static_cast<Tier>(from)), tier_name(static_cast<Tier>(to)));
}

nlohmann::json traffic_json(const TierTraffic& t) {
  nlohmann::json j = nlohmann::json::object();
  for (int a = 0; a < kNumTiers; ++a)
    for (int b = 0; b < kNumTiers; ++b)
      if (a != b && t.bytes[a][b]) j[pair_name(a, b)] = t.bytes[a][b];
  return j;
}

std::string traffic_text(const TierTraffic& t) {
  std::string s;
  for (int a = 0; a < kNumTiers; ++a)
    for (int b = 0; b < kNumTiers; ++b)
      if (a != b && t.bytes[a][b]) {
        static const char* kShort[] = {"dev", "host", "nvme"};
        s += fmt::format(" {}>{} {}", kShort[a], kShort[b], format_gb(t.bytes[a][b]));
      }
  return s.empty() ? " no tier moves" : s;
}

double finite_or_zero(double x) { return std::isfinite(x) ? x : 0.0; }

}  // namespace

TierTraffic TierTraffic::operator-(const TierTraffic& o) const {
  TierTraffic r;
  for (int a = 0; a < kNumTiers; ++a)
    for (int b = 0; b < kNumTiers; ++b) r.bytes[a][b] = bytes[a][b] - o.bytes[a][b];
  return r;
}

TierTraffic& TierTraffic::operator+=(const TierTraffic& o) {
  for (int a = 0; a < kNumTiers; ++a)
    for (int b = 0; b < kNumTiers; ++b) bytes[a][b] += o.bytes[a][b];
  return *this;
}

std::uint64_t TierTraffic::total() const {
  std::uint64_t s = 0;
  for (auto& row : bytes)
    for (auto v : row) s += v;
  return s;
}

std::string format_gb(std::uint64_t bytes) {
  double gb = static_cast<double>(bytes) / 1e9;
  if (gb >= 10) return fmt::format("{:.1f}GB", gb);
  if (gb >= 0.01) return fmt::format("{:.2f}GB", gb);
  return fmt::format("{:.1f}MB", static_cast<double>(bytes) / 1e6);
}

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  long s = std::lround(seconds);
  if (s >= 3600) return fmt::format("{}h{:02d}m", s / 3600, (s / 60) % 60);
  if (s >= 60) return fmt::format("{}m{:02d}s", s / 60, s % 60);
  return fmt::format("{}s", s);
}

Reporter::Reporter(bool json, bool live, std::FILE* out) : json_(json), live_(live), out_(out) {}

void Reporter::header(const std::string& text) {
  if (json_ || !out_) return;
  std::fputs(text.c_str(), out_);
  std::fflush(out_);
}

void Reporter::step(const StepReport& r, bool keep_line) {
  if (!out_) return;
  const double tps = r.seconds > 0 ? static_cast<double>(r.tokens) / r.seconds : 0;
  const double gflops = r.seconds > 0 ? r.flops / r.seconds / 1e9 : 0;
  // TensorStore counts every caller's wait, prefetch workers' included: cap at the step time.
  const double stall_pct = r.seconds > 0 ? std::min(100.0, 100.0 * r.stall_seconds / r.seconds) : 0;
  if (json_) {
    nlohmann::json j;
    j["step"] = r.step;
    j["steps"] = r.steps;
    j["loss"] = r.loss;
    j["lr"] = r.lr;
    if (std::isfinite(r.grad_norm)) j["grad_norm"] = r.grad_norm;
    j["tokens"] = r.tokens;
    j["seconds"] = r.seconds;
    j["tokens_per_s"] = tps;
    j["gflops"] = gflops;
    j["moved_bytes"] = traffic_json(r.moved);
    j["stall_seconds"] = r.stall_seconds;
    j["stall_pct"] = stall_pct;
    j["eta_seconds"] = r.eta_seconds;
    std::fprintf(out_, "%s\n", j.dump().c_str());
    std::fflush(out_);
    return;
  }
  const int w = static_cast<int>(std::to_string(r.steps).size());
  std::string line = fmt::format(
      "step {:>{}}/{} | loss {:.4f} | {:>7.0f} tok/s | {:>6.2f} GFLOP/s |{} | stall {:>3.0f}% | "
      "ETA {}",
      r.step, w, r.steps, r.loss, tps, gflops, traffic_text(r.moved), stall_pct,
      format_duration(r.eta_seconds));
  if (live_) {
    std::fprintf(out_, "\r\033[K%s%s", line.c_str(), keep_line ? "\n" : "");
    pending_cr_ = !keep_line;
  } else {
    std::fprintf(out_, "%s\n", line.c_str());
  }
  std::fflush(out_);
}

void Reporter::flush_line() {
  if (!out_ || !pending_cr_) return;
  std::fputs("\n", out_);
  std::fflush(out_);
  pending_cr_ = false;
}

void Reporter::eval(int step, double loss) {
  if (!out_) return;
  if (json_) {
    nlohmann::json j;
    j["eval"] = {{"step", step}, {"loss", loss}};
    std::fprintf(out_, "%s\n", j.dump().c_str());
  } else {
    if (pending_cr_) std::fputs("\n", out_);
    pending_cr_ = false;
    std::fprintf(out_, "eval  step %d | held-out loss %.4f\n", step, loss);
  }
  std::fflush(out_);
}

std::string io_bound_line(const StepIo& io) {
  if (io.read_gbps <= 0 || io.write_gbps <= 0) {
    return "I/O bound       - (NVMe rates unknown: tiermem-bench profile --json > profile.json, then "
           "\"tiermem\": {\"machine_profile\": \"profile.json\"} in --config, or tiermem.nvme_read_gbps / "
           "nvme_write_gbps)\n";
  }
  // "1.37 s", or "4.20 ms" below a tenth of a second (a small model's step).
  auto secs = [](double x) { return x >= 0.1 ? fmt::format("{:.2f} s", x) : fmt::format("{:.2f} ms", 1e3 * x); };
  return fmt::format("I/O bound       {}/step ({} read at {:.2f} GB/s, {} written at {:.2f} GB/s) beside "
                     "compute {}/step; step {} (the last step)\n",
                     secs(io.io_bound_seconds), format_gb(io.nvme_read_bytes), io.read_gbps,
                     format_gb(io.nvme_written_bytes), io.write_gbps, secs(io.compute_seconds), secs(io.wall_seconds));
}

namespace {
// " (8.0x the device budget)", or for state well inside the budget " (5 % of the device budget)"
// (was "0.0x" for e.g. mini's 50 MiB in a 1 GiB budget).
std::string state_vs_budget(double ratio) {
  if (ratio >= 0.95) return fmt::format(" ({:.1f}x the device budget)", ratio);
  return fmt::format(" ({:.2g} % of the device budget)", 100.0 * ratio);
}
}  // namespace

void Reporter::summary(const Summary& s) {
  if (!out_) return;
  const double tps = s.seconds > 0 ? static_cast<double>(s.tokens) / s.seconds : 0;
  const double gflops = s.seconds > 0 ? s.flops / s.seconds / 1e9 : 0;
  if (json_) {
    nlohmann::json j;
    j["model"] = s.model;
    j["world_size"] = s.world_size;
    j["zero_stage"] = s.zero_stage;
    j["param_offload"] = s.param_offload;
    j["optimizer_offload"] = s.optimizer_offload;
    j["device"] = s.device_kind;
    j["steps"] = s.steps;
    j["final_step"] = s.final_step;
    j["tokens"] = s.tokens;
    j["seconds"] = s.seconds;
    j["tokens_per_s"] = tps;
    j["gflops"] = gflops;
    j["initial_loss"] = s.initial_loss;
    j["final_loss"] = s.final_loss;
    if (s.final_eval_loss) j["final_eval_loss"] = *s.final_eval_loss;
    j["param_count"] = s.param_count;
    j["vocab_size"] = s.vocab_size;
    j["param_bytes"] = s.param_bytes;
    j["optimizer_bytes"] = s.optimizer_bytes;
    j["device_budget_bytes"] = s.device_budget_bytes;
    j["device_peak_bytes"] = s.device_peak_bytes;
    j["host_budget_bytes"] = s.host_budget_bytes;
    j["host_peak_bytes"] = s.host_peak_bytes;
    j["host_pool_peak_bytes"] = s.host_pool_peak_bytes;
    j["host_bounce_bytes"] = s.host_bounce_bytes;
    j["host_engine_peak_bytes"] = s.host_engine_peak_bytes;
    j["host_grad_buffer_peak_bytes"] = s.host_grad_buffer_peak_bytes;
    j["updates_in_backward"] = s.updates_in_backward;
    j["activation_bytes"] = s.activation_bytes;
    j["activation_peak_bytes"] = s.activation_bytes;  // allocated once: the same number
    j["activation_checkpointing"] = s.activation_checkpointing;
    j["activation_checkpoint_bytes"] = s.activation_checkpoint_bytes;
    j["host_sim_device_bytes"] = s.host_sim_device_bytes;
    j["max_rss_bytes"] = s.max_rss_bytes;
    j["nvme_peak_bytes"] = s.nvme_peak_bytes;
    j["nvme_bytes_read"] = s.nvme_bytes_read;
    j["nvme_bytes_written"] = s.nvme_bytes_written;
    j["moved_bytes"] = traffic_json(s.moved);
    j["stall_seconds"] = s.stall_seconds;
    j["time_split_seconds"] = {{"compute", s.split.compute},
                               {"io_wait", s.split.io_wait},
                               {"communication", s.split.comm},
                               {"optimizer", s.split.optimizer},
                               {"other", s.split.other}};
    // tiermem-plan --check (plan.h): fields the planner predicts, and the inputs it plans from.
    j["step_seconds"] = s.step_seconds;
    j["step_seconds_mean"] = s.step_seconds_mean;
    // Shares of the steps after the first (each the median of the steps' own): the first records
    // the prefetch trace, which the planner leaves out as it leaves it out of step_seconds.
    j["compute_share"] = s.steady_shares.compute;
    j["io_wait_share"] = s.steady_shares.io_wait;
    j["communication_share"] = s.steady_shares.comm;
    j["optimizer_share"] = s.steady_shares.optimizer;
    j["shares_of_steps"] = s.steps > 1 ? "after the first" : "all";
    j["steady_seconds"] = s.steady_seconds;
    j["plan_inputs"] = {{"batch", s.batch}, {"grad_accum", s.grad_accum}, {"seq_len", s.seq_len},
                        {"n_layer", s.gpt.n_layer}, {"n_head", s.gpt.n_head},
                        {"d_model", s.gpt.d_model}, {"context", s.gpt.context},
                        {"vocab", s.gpt.vocab}};
    const StepIo& io = s.last_step_io;
    j["last_step_io"] = {{"nvme_read_bytes", io.nvme_read_bytes},   {"nvme_written_bytes", io.nvme_written_bytes},
                         {"wall_seconds", io.wall_seconds},         {"stall_seconds", io.stall_seconds},
                         {"compute_seconds", io.compute_seconds},   {"io_bound_seconds", io.io_bound_seconds},
                         {"nvme_read_gbps", io.read_gbps},          {"nvme_write_gbps", io.write_gbps}};
    nlohmann::json out;
    out["summary"] = std::move(j);
    std::fprintf(out_, "%s\n", out.dump().c_str());
    std::fflush(out_);
    return;
  }
  if (pending_cr_) std::fputs("\n", out_);
  pending_cr_ = false;
  auto pct = [&](double x) { return s.seconds > 0 ? 100.0 * x / s.seconds : 0.0; };
  std::string text;
  text += fmt::format("\n== summary: {} ({} parameters, vocabulary {}), {} step{} in {}, {} rank{}\n",
                      s.model, s.param_count, s.vocab_size, s.steps, s.steps == 1 ? "" : "s",
                      format_duration(s.seconds), s.world_size, s.world_size == 1 ? "" : "s");
  text += fmt::format("loss            {:.4f} -> {:.4f}", s.initial_loss, s.final_loss);
  if (s.final_eval_loss) text += fmt::format(" (held-out {:.4f})", *s.final_eval_loss);
  text += fmt::format("\nthroughput      {:.0f} tokens/s, {:.2f} GFLOP/s\n", tps, gflops);
  text += fmt::format("state           params {} + optimizer {} = {}{}\n", format_bytes(s.param_bytes),
                      format_bytes(s.optimizer_bytes), format_bytes(s.param_bytes + s.optimizer_bytes),
                      s.device_budget_bytes
                          ? state_vs_budget(static_cast<double>(s.param_bytes + s.optimizer_bytes) /
                                            static_cast<double>(s.device_budget_bytes))
                          : std::string());
  text += fmt::format("zero            stage {}, params -> {}, optimizer -> {}, device {}\n",
                      s.zero_stage, s.param_offload, s.optimizer_offload, s.device_kind);
  if (s.device_budget_bytes == 0 && s.device_peak_bytes == 0) {
    text += "peak device     - (no device tier: this engine computes from host memory)\n";
  } else {
    text += fmt::format("peak device     {} of budget {}{}\n", format_bytes(s.device_peak_bytes),
                        format_bytes(s.device_budget_bytes),
                        s.device_peak_bytes <= s.device_budget_bytes ? "" : "  ** OVER BUDGET **");
  }
  text += fmt::format("peak host       {}: pool {}{}, bounce {}, engine {}, gradients {}, "
                      "activations {}{}\n",
                      format_bytes(s.host_peak_bytes), format_bytes(s.host_pool_peak_bytes),
                      s.host_budget_bytes
                          ? fmt::format(" of budget {}", format_bytes(s.host_budget_bytes))
                          : std::string(),
                      format_bytes(s.host_bounce_bytes), format_bytes(s.host_engine_peak_bytes),
                      format_bytes(s.host_grad_buffer_peak_bytes), format_bytes(s.activation_bytes),
                      s.host_sim_device_bytes
                          ? fmt::format(", sim device {}", format_bytes(s.host_sim_device_bytes))
                          : std::string());
  if (s.activation_checkpointing) {
    text += fmt::format("activations     {} peak, checkpointed: {} of block inputs kept, each "
                        "block recomputed in backward\n",
                        format_bytes(s.activation_bytes),
                        format_bytes(s.activation_checkpoint_bytes));
  }
  text += fmt::format("max RSS         {} (the OS's count; {} beyond the peak host: code, "
                      "libraries, thread stacks, the data set)\n",
                      format_bytes(s.max_rss_bytes),
                      s.max_rss_bytes > s.host_peak_bytes
                          ? format_bytes(s.max_rss_bytes - s.host_peak_bytes)
                          : std::string("nothing"));
  text += fmt::format("peak nvme       {}\n", format_bytes(s.nvme_peak_bytes));
  text += fmt::format("moved          {}  (nvme read {}, written {})\n", traffic_text(s.moved),
                      format_gb(s.nvme_bytes_read), format_gb(s.nvme_bytes_written));
  text += fmt::format(
      "time            compute {:.1f}s ({:.0f}%), I/O wait {:.1f}s ({:.0f}%), communication "
      "{:.1f}s ({:.0f}%), optimizer {:.1f}s ({:.0f}%), other {:.1f}s\n",
      s.split.compute, pct(s.split.compute), s.split.io_wait, pct(s.split.io_wait), s.split.comm,
      pct(s.split.comm), s.split.optimizer, pct(s.split.optimizer), finite_or_zero(s.split.other));
  if (s.nvme_bytes_read + s.nvme_bytes_written > 0) text += io_bound_line(s.last_step_io);
  std::fputs(text.c_str(), out_);
  std::fflush(out_);
}

}  // namespace tiermem::train
