// tiermem-plan — before a run: bytes per tier, minimum budgets, the largest model that fits, and
// the step time split by resource, predicted from a machine profile; after a run: the prediction
// held against the run's summary. docs/plan.md describes the model and its limits.
//
//   cmake --build build/default --target tiermem-plan tiermem-bench
//   build/default/bin/tiermem-bench profile --json > me.json        # measure this machine
//   build/default/bin/tiermem-plan --model gpt2 --offload nvme --profile me.json
//   build/default/bin/tiermem-train --model gpt2 --offload nvme --json > run.jsonl
//   build/default/bin/tiermem-plan --check run.jsonl --profile me.json [--json]
//
// A summary whose plan_inputs give the model's modules (a tiermem.torch run's, written by
// bench/compare_torch.py --plan-check) is planned with those modules instead of tiermem-train's
// GPT (plan::RunShape::modules).
//
// The run is described with tiermem-train's own flags (--model, --batch, --seq-len, --config,
// --offload, budgets ...) and resolved by the same code (effective_config, make_train_plan), so
// the plan is that of the run tiermem-train would make. The machine profile is --profile's, else
// the --config's tiermem.machine_profile; without either only bytes are predicted (budgets
// resolve for this machine's memory); time needs rates.
// Exit: 0 the configuration runs (or --check printed), 1 it cannot run (why and the smallest
// fix printed), 2 bad input (one line naming the flag, key or path).
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>
#include <string_view>

#include "core/cli_checks.h"
#include "gpt/model.h"
#include "plan/plan.h"
#include "tiermem/device_choice.h"
#include "tiermem/error.h"
#include "tiermem/log.h"
#include "tiermem/swap_space.h"
#include "train/train_loop.h"
#include "train/train_options.h"

namespace {

using namespace tiermem;
using nlohmann::json;

struct PlanArgs {
  train::TrainOptions run;
  std::string profile_path, check_path;
  int world_size = 1;
  int vocab = 0;
  int context = 0;  // --check: the model's context (rows of wpe) from the summary
  plan::RunShape::Modules modules;  // --check of a model given by its modules (a tiermem.torch run)
  bool json = false;
};

int fail(const std::string& msg) {
  std::fprintf(stderr, "tiermem-plan: error: %s\n", msg.c_str());
  return 2;
}

// This machine's memory (no rates): what a plan without --profile resolves budgets against.
plan::MachineProfile memory_only_profile(const std::string& swap_dir) {
  plan::MachineProfile m;
  m.name = "this machine (memory only; give --profile for time)";
  m.host_memory_bytes = static_cast<std::uint64_t>(sysconf(_SC_PHYS_PAGES)) *
                        static_cast<std::uint64_t>(sysconf(_SC_PAGESIZE));
  m.nvme_free_bytes = drive_free_bytes(swap_dir);
  return m;
}

// The summary object of a tiermem-train --json output (the last {"summary":..} line), or of a
// file holding just that object.
json read_summary(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    throw ConfigError("--check", path, "is a directory: give the file tiermem-train --json wrote");
  }
  std::ifstream in(path);
  if (!in) throw ConfigError("--check", path, "cannot open the summary file");
  std::string line;
  json found;
  int line_no = 0, bad_line = 0, summaries = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.empty() || line[0] != '{') continue;
    json j = json::parse(line, nullptr, false);
    if (j.is_discarded()) {
      if (bad_line == 0) bad_line = line_no;
    } else if (j.is_object() && j.contains("summary")) {
      found = j["summary"];
      ++summaries;
    }
  }
  if (summaries > 1) {
    std::fprintf(stderr, "tiermem-plan: note: %s holds %d summaries (several runs' output?): the last is checked\n",
                 path.c_str(), summaries);
  }
  if (found.is_null()) {
    std::ifstream again(path);
    std::stringstream ss;
    ss << again.rdbuf();
    json j = json::parse(ss.str(), nullptr, false);
    if (!j.is_discarded() && j.is_object()) found = j.contains("summary") ? j["summary"] : j;
  }
  if (!found.is_object() || !found.contains("model")) {
    if (bad_line > 0) {
      throw ConfigError(fmt::format("--check {}: line {}", path, bad_line), "",
                        "not valid JSON (truncated, or NaN/Infinity, which JSON has not), and no "
                        "{\"summary\": ...} line of tiermem-train --json after it");
    }
    if (found.is_object()) {  // a JSON object, but not tiermem-train's summary (empty, or its fields missing)
      throw ConfigError("--check", path, "its JSON has no 'model' field of a tiermem-train --json summary: give that "
                                         "output unchanged");
    }
    throw ConfigError("--check", path, "no {\"summary\": ...} object of tiermem-train --json in it");
  }
  return found;
}

// Overrides the run's options with what the summary says ran. Every number is checked as a
// profile's is: a whole number in its range, named by file and key when it is not.
void apply_summary(const json& s, const std::string& path, PlanArgs& a) {
  auto get_int = [&](const json& o, const char* key, const std::string& where, long long lo, long long hi) {
    if (!o.contains(key) || !o[key].is_number_integer()) {
      throw ConfigError(path + ": " + where + key, o.contains(key) ? o[key].dump() : "(missing)",
                        "expected an integer (a summary of this build's tiermem-train --json)");
    }
    // Unsigned JSON integers above INT64_MAX read as negative here: out of range either way.
    const long long v = o[key].is_number_unsigned() && o[key].get<std::uint64_t>() > static_cast<std::uint64_t>(hi)
                            ? hi + 1
                            : o[key].get<long long>();
    if (v < lo || v > hi) {
      throw ConfigError(path + ": " + where + key, o[key].dump(),
                        fmt::format("out of range [{}, {}]: not a tiermem-train summary's value", lo, hi));
    }
    return v;
  };
  if (!s.contains("plan_inputs") || !s["plan_inputs"].is_object()) {
    throw ConfigError(path + ": summary.plan_inputs", "(missing)",
                      "the summary predates tiermem-plan: rerun tiermem-train --json from this build");
  }
  const json& in = s["plan_inputs"];
  const std::string pi = "summary.plan_inputs.";
  constexpr long long kInt = std::numeric_limits<int>::max();
  constexpr long long kBytes = std::numeric_limits<long long>::max();
  // tiermem-train's own limits (train_options.cc): layers and heads up to 4096.
  a.run.model = "custom";
  a.run.n_layer = static_cast<int>(get_int(in, "n_layer", pi, 1, 4096));
  a.run.n_head = static_cast<int>(get_int(in, "n_head", pi, 1, 4096));
  a.run.d_model = static_cast<int>(get_int(in, "d_model", pi, 1, kInt));
  a.run.seq_len = static_cast<int>(get_int(in, "seq_len", pi, 1, kInt));
  a.vocab = static_cast<int>(get_int(in, "vocab", pi, 1, kInt));
  a.run.batch = static_cast<int>(get_int(in, "batch", pi, 1, kInt));
  a.run.batch_given = true;
  a.run.grad_accum = static_cast<int>(get_int(in, "grad_accum", pi, 1, kInt));
  a.run.grad_accum_given = true;
  a.world_size = static_cast<int>(get_int(s, "world_size", "summary.", 1, 1 << 16));
  a.run.host_budget_bytes = static_cast<std::uint64_t>(get_int(s, "host_budget_bytes", "summary.", 0, kBytes));
  const auto dev = static_cast<std::uint64_t>(get_int(s, "device_budget_bytes", "summary.", 0, kBytes));
  if (dev) a.run.device_budget_bytes = dev;
  a.context = static_cast<int>(get_int(in, "context", pi, 1, kInt));
  if (a.run.seq_len > a.context) {
    throw ConfigError(path + ": " + pi + "seq_len", std::to_string(a.run.seq_len),
                      fmt::format("exceeds the model's context ({}): tiermem-train runs no such model", a.context));
  }
  // A model tiermem-train does not build (a tiermem.torch run: bench/compare_torch.py --plan-check):
  // its engine modules, which are frozen, its FLOPs per token and whether its head is tied.
  if (in.contains("modules")) {
    const json& mods = in["modules"];
    if (!mods.is_array() || mods.empty()) {
      throw ConfigError(path + ": " + pi + "modules", mods.dump(), "expected a non-empty array of module sizes");
    }
    for (std::size_t i = 0; i < mods.size(); ++i) {
      if (!mods[i].is_number_integer() || mods[i].get<long long>() < 1) {
        throw ConfigError(fmt::format("{}: {}modules[{}]", path, pi, i), mods[i].dump(),
                          "expected a module's element count, a whole number >= 1");
      }
      a.modules.numels.push_back(mods[i].get<std::size_t>());
    }
    if (in.contains("frozen")) {
      const json& fr = in["frozen"];
      if (!fr.is_array() || fr.size() != mods.size() ||
          !std::all_of(fr.begin(), fr.end(), [](const json& x) { return x.is_boolean(); })) {
        throw ConfigError(path + ": " + pi + "frozen", fr.dump(),
                          fmt::format("expected {} booleans, one per module", mods.size()));
      }
      for (const json& x : fr) a.modules.frozen.push_back(x.get<bool>());
    }
    const json f = in.value("flops_per_token", json());
    if (!f.is_number() || !std::isfinite(f.get<double>()) || f.get<double>() <= 0) {
      throw ConfigError(path + ": " + pi + "flops_per_token", in.contains("flops_per_token") ? f.dump() : "(missing)",
                        "a summary that gives its modules gives its model's FLOPs per token, a number > 0");
    }
    a.modules.flops_per_token = f.get<double>();
    const json tied = in.value("head_tied", json(true));
    if (!tied.is_boolean()) throw ConfigError(path + ": " + pi + "head_tied", tied.dump(), "expected true or false");
    a.modules.head_tied = tied.get<bool>();
  }
  // Where the state lived (stage 3): the --offload shortcut that puts it there.
  const std::string ph = s.value("param_offload", ""), oh = s.value("optimizer_offload", "");
  if (s.value("zero_stage", 0) == 3) {
    if (ph == "nvme" && oh == "nvme") a.run.offload = "nvme";
    if (ph == "host" && oh == "host") a.run.offload = "cpu";
    if (ph == "device" && oh == "host") a.run.offload = "none";
  }
}

// The planned run must be the summary's: its ZeRO stage and where its parameters and optimizer
// state lived. A run made with a --config the check was not given (offload_optimizer only, a
// partial ratio, another stage) would be held against another run's plan.
void check_same_run(const json& s, const train::TrainPlan& run, const plan::Prediction& p, const std::string& path) {
  const ZeroPlan& z = p.zero;
  const std::string ph(z.uses_device ? tier_name(z.param_home) : std::string_view("host")), oh(tier_name(z.optimizer_home));
  const int stage = run.config.zero.stage;
  const json st = s.value("zero_stage", json()), sp = s.value("param_offload", json()),
             so = s.value("optimizer_offload", json());
  if (!st.is_number_integer() || !sp.is_string() || !so.is_string()) {
    throw ConfigError(path + ": summary.zero_stage/param_offload/optimizer_offload",
                      st.dump() + " " + sp.dump() + " " + so.dump(),
                      "a tiermem-train --json summary has these (is the summary from an older build?)");
  }
  if (st.get<int>() != stage || sp.get<std::string>() != ph || so.get<std::string>() != oh) {
    throw ConfigError(path + ": summary",
                      fmt::format("stage {}, params -> {}, optimizer -> {}", st.get<int>(), sp.get<std::string>(),
                                  so.get<std::string>()),
                      fmt::format("the plan for these inputs is stage {}, params -> {}, optimizer -> {}: give "
                                  "--check the run's own --config{}",
                                  stage, ph, oh,
                                  st.get<int>() == 0 && stage != 0
                                      ? " (a run of --engine resident is planned with zero_optimization.stage 0)"
                                      : ""));
  }
}

// The NVMe swap directories the run would make (train::swap_dirs): each must be creatable, which
// the planner checks without creating anything: the nearest existing ancestor must be a directory
// (tiermem-train makes the rest and refuses a path under a file).
void check_swap_dirs(const train::TrainOptions& o, const Config& cfg) {
  for (const std::string& d : train::swap_dirs(o, cfg)) {
    std::error_code ec;
    std::filesystem::path probe = d;
    while (!probe.empty() && !std::filesystem::exists(probe, ec)) probe = probe.parent_path();
    if (!probe.empty() && !std::filesystem::is_directory(probe, ec)) {
      throw ConfigError(train::swap_dir_key(o), d,
                        fmt::format("'{}' is a file, so the swap directory cannot be made under it: give a "
                                    "directory on the NVMe drive",
                                    probe.string()));
    }
  }
}

std::string seconds_text(double s) {
  if (s >= 1) return fmt::format("{:.2f} s", s);
  if (s >= 1e-3) return fmt::format("{:.1f} ms", s * 1e3);
  return fmt::format("{:.0f} us", s * 1e6);
}

void print_text(const train::TrainPlan& run, const plan::MachineProfile& m, const plan::Prediction& p,
                const plan::LargestModel& big, bool timed) {
  const ZeroPlan& z = p.zero;
  std::string t;
  t += fmt::format("tiermem-plan: {} ({:.2f} M params; {} layers, d_model {}, vocab {}), batch {} x seq {} x "
                   "accum {}, {} rank{}\n",
                   run.model_name, static_cast<double>(p.params) / 1e6, run.model.n_layer, run.model.d_model,
                   run.model.vocab_size, run.batch, run.seq_len, run.grad_accum, run.world_size,
                   run.world_size == 1 ? "" : "s");
  t += fmt::format("profile         {}{}\n", m.name, m.cpu_isa.empty() ? "" : fmt::format(" (CPU {})", m.cpu_isa));
  t += fmt::format("zero            stage {}: params -> {}, optimizer -> {}, gradients -> {}, sub-groups of {} "
                   "elements\n",
                   run.config.zero.stage, tier_name(z.param_home), tier_name(z.optimizer_home),
                   tier_name(z.gradient_home), z.sub_group_elems);
  t += "memory (one rank)\n";
  t += fmt::format("  device        peak {:>10}   {}budget {}, minimum {}{}\n", format_bytes(p.device_peak_bytes),
                   p.device_activation_bytes ? "the engine's " : "",
                   p.device_activation_bytes && !p.fits && z.device_budget_bytes <= 4096
                       ? std::string("none left")
                       : format_bytes(z.device_budget_bytes),
                   format_bytes(z.device_min_bytes),
                   z.device_min_why.empty() ? "" : " (" + z.device_min_why + ")");
  if (p.device_activation_bytes) {
    t += fmt::format("                = the engine's {} + the CUDA model's activations and workspace {}\n",
                     format_bytes(p.device_peak_bytes - p.device_activation_bytes), format_bytes(p.device_activation_bytes));
  }
  t += fmt::format("  host          peak {:>10}   budget {}, minimum {} ({})\n", format_bytes(p.host_peak_bytes),
                   format_bytes(z.host_budget_bytes), format_bytes(z.host_min_bytes), z.host_min_why);
  t += fmt::format("                = pool {} + bounce {} + engine {} + gradient buffers {} + activations {}{}\n",
                   format_bytes(p.host_pool_peak_bytes), format_bytes(p.host_bounce_bytes),
                   format_bytes(p.host_engine_bytes), format_bytes(p.grad_buffer_peak_bytes),
                   format_bytes(p.activation_bytes),
                   p.sim_device_bytes ? " + sim device " + format_bytes(p.sim_device_bytes) : "");
  t += fmt::format("  nvme          peak {:>10}{}\n", format_bytes(p.nvme_peak_bytes),
                   m.nvme_free_bytes ? fmt::format("   free {}", format_bytes(m.nvme_free_bytes)) : "");
  // It is sized with each budget raised to its minimum where it is below (as a user would): said so
  // when this run's own budgets are below.
  t += fmt::format("largest model   {} layers, {:.2f} B params at this configuration{}{}\n", big.n_layer,
                   static_cast<double>(big.params) / 1e9, p.zero.fits ? "" : ", budgets raised to their minimums",
                   big.limit.empty() ? "" : " (next size: " + big.limit + ")");
  if (!p.fits) {
    t += fmt::format("CANNOT RUN      {}\nsmallest fix    {}\n", p.why, p.fix);
  } else if (timed) {
    const plan::TimePrediction& x = p.time;
    auto pct = [&](double v) { return x.step_s > 0 ? 100.0 * v / x.step_s : 0.0; };
    t += fmt::format("step time       {} (predicted; bottleneck: {})\n", seconds_text(x.step_s), x.bottleneck);
    t += fmt::format("  compute       {:>10} ({:.0f} %)  {:.3g} GFLOP at {:.0f} GFLOP/s{}\n", seconds_text(x.compute_s),
                     pct(x.compute_s), p.flops_per_step / run.world_size / 1e9,
                     plan::compute_gflops(m, run.model.d_model, static_cast<double>(run.batch) * run.seq_len),
                     x.checksum_s > 0 ? " + " + seconds_text(x.checksum_s) + " of NVMe checksums on the same cores" : "");
    t += fmt::format("  I/O wait      {:>10} ({:.0f} %)  parameters not yet on the device\n", seconds_text(x.stall_s),
                     pct(x.stall_s));
    t += fmt::format("  nvme link     {:>10} busy      read {}, write {}\n", seconds_text(x.nvme_s),
                     format_bytes(p.nvme_read_bytes), format_bytes(p.nvme_write_bytes));
    t += fmt::format("  host->device  {:>10} busy      {}\n", seconds_text(x.h2d_s), format_bytes(p.h2d_bytes));
    if (run.world_size == 1) {
      t += fmt::format("  hand-off      {:>10} ({:.0f} %)  world 1, no collectives: the gradient hand-off (from {}): {} of "
                       "copies on the compute's cores, {} waited for at backward's end (counted by tiermem-train as "
                       "compute and I/O wait)\n",
                       seconds_text(x.d2h_s), pct(x.d2h_s), x.handoff_from, seconds_text(x.handoff_compute_s),
                       seconds_text(x.handoff_wait_s));
    } else {
      t += fmt::format("  communication {:>10} ({:.0f} %)  {} of collectives\n", seconds_text(x.comm_s), pct(x.comm_s),
                       format_bytes(p.comm_bytes));
    }
    t += fmt::format("  optimizer     {:>10} ({:.0f} %)  {} {}{}\n", seconds_text(x.optimizer_s), pct(x.optimizer_s),
                     x.adam_measured_step ? "the engine's step" : "Adam", seconds_text(x.adam_s),
                     x.optimizer_deferred
                         ? fmt::format(", deferred into the forward pass{} (counted here, as tiermem-train times it), "
                                       "{} of it waiting for optimizer state not yet in the host pool{}",
                                       x.optimizer_ahead ? ", each update running ahead of its gather beside the "
                                                           "previous module's compute: what the forward waited for"
                                                         : "",
                                       seconds_text(x.optimizer_wait_s),
                                       x.io_wait_from.empty() ? "" : " (" + x.io_wait_from + ")")
                         : "");
    t += fmt::format("throughput      {:.0f} tokens/s, {:.3f} TFLOP/s\n", p.tokens_per_s, p.tflops);
  } else {
    t += "step time       - (give --profile, e.g. from tiermem-bench profile --json)\n";
  }
  std::fputs(t.c_str(), stdout);
}

}  // namespace

int main(int argc, char** argv) {
  PlanArgs a;
  CLI::App app{"tiermem-plan: predict a tiermem-train run's memory per tier and step time from a machine "
               "profile, before the run; --check holds a run's --json summary against the prediction"};
  app.set_help_flag("-h,--help", "print this help and exit");
  std::string device_budget, host_budget;
  app.add_option("--model", a.run.model, "model preset (tiny, mini, gpt2, gpt2-medium, gpt2-large, gpt2-xl) or "
                                         "custom")->default_val(a.run.model);
  // The same ranges as tiermem-train's flags (train_options.cc).
  app.add_option("--layers", a.run.n_layer, "--model custom: layers")
      ->check(tiermem::cli::whole_number_check())->check(CLI::Range(1, 4096));
  app.add_option("--heads", a.run.n_head, "--model custom: heads [d_model / 64]")
      ->check(tiermem::cli::whole_number_check())->check(CLI::Range(1, 4096));
  app.add_option("--d-model", a.run.d_model, "--model custom: width")
      ->check(tiermem::cli::whole_number_check())->check(CLI::Range(1, 1 << 20));
  app.add_option("--vocab,--vocab-size", a.vocab, "vocabulary [the preset's; 256 for text data, as tiermem-train]")
      ->check(tiermem::cli::whole_number_check())->check(CLI::Range(1, 1 << 24));
  app.add_option("--data", a.run.data, "the run's data: text trains a byte-level vocabulary (256), *.bin keeps "
                                       "the preset's")
      ->check(CLI::ExistingPath);
  app.add_option("--batch", a.run.batch, "micro-batch per rank (sequences)")
      ->check(tiermem::cli::whole_number_check())->check(CLI::Range(1, 1 << 20));
  app.add_option("--grad-accum", a.run.grad_accum, "micro-batches per step")
      ->check(tiermem::cli::whole_number_check())->check(CLI::Range(1, 1 << 20));
  app.add_option("--seq-len", a.run.seq_len, "tokens per sequence")
      ->check(tiermem::cli::whole_number_check())->check(CLI::Range(1, 1 << 20));
  app.add_option("--world-size", a.world_size, "ranks (GPUs) [1]")
      ->check(tiermem::cli::whole_number_check())->check(CLI::Range(1, 1 << 16));
  app.add_option("--config", a.run.config_path, "DeepSpeed-style ds_config.json (as tiermem-train)")
      ->check(CLI::ExistingFile);
  app.add_option("--offload", a.run.offload, "offload_param and offload_optimizer device: none, cpu, nvme")
      ->check(CLI::IsMember({"none", "cpu", "nvme"}));
  app.add_option("--device", a.run.device, "auto | cuda | sim [the profile's device]")
      ->check(CLI::IsMember({"auto", "cuda", "sim"}));
  app.add_option("--device-budget", device_budget, "device budget, e.g. 64MiB");
  app.add_option("--host-budget", host_budget, "host pool budget, e.g. 2GiB");
  app.add_option("--swap-dir", a.run.swap_dir, "NVMe swap directory (its free space bounds the NVMe state)");
  app.add_option("--profile", a.profile_path, "machine profile JSON (tiermem-bench profile --json, or profiles/*.json) [the --config's tiermem.machine_profile]");
  app.add_option("--check", a.check_path, "a tiermem-train --json output (or a tiermem.torch run's summary, "
                                          "bench/compare_torch.py --plan-check): print predicted vs measured per field");
  app.add_flag("--json", a.json, "one JSON object (the last line printed)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::fputs(app.help().c_str(), stdout);
    return 0;
  } catch (const CLI::ParseError& e) {
    return fail(cli::parse_error_text(e));
  }
  set_log_level("warn");
  try {
    if (!device_budget.empty()) a.run.device_budget_bytes = parse_size(device_budget, "--device-budget");
    if (!host_budget.empty()) a.run.host_budget_bytes = parse_size(host_budget, "--host-budget");
    // As tiermem-train's flags: a budget given is above 0 (0 would read as "the default").
    if (!device_budget.empty() && a.run.device_budget_bytes == 0) throw ConfigError("--device-budget", device_budget, "must be > 0");
    if (!host_budget.empty() && a.run.host_budget_bytes == 0) throw ConfigError("--host-budget", host_budget, "must be > 0");
    // As the engine refuses it, and warns (zero_plan.h).
    if (const std::string why = host_budget_refusal(a.run.host_budget_bytes); !why.empty()) {
      throw ConfigError("--host-budget", host_budget, why);
    }
    if (const std::string why = host_budget_warning(a.run.host_budget_bytes); !why.empty()) {
      std::fprintf(stderr, "tiermem-plan: warning: --host-budget %s\n", why.c_str());
    }
    a.run.batch_given = app.count("--batch") > 0;
    a.run.grad_accum_given = app.count("--grad-accum") > 0;
    const bool custom_dims = app.count("--layers") + app.count("--heads") + app.count("--d-model") > 0;
    if (a.run.model == "custom" && (a.run.n_layer == 0 || a.run.d_model == 0)) {
      throw ConfigError("--model", "custom", "needs --layers and --d-model (and optionally --heads)");
    }
    if (a.run.model != "custom" && custom_dims) {
      throw ConfigError("--layers/--heads/--d-model", a.run.model, "only with --model custom");
    }
    json summary;
    if (!a.check_path.empty()) {
      // The run is read from its summary; a flag describing another run would be ignored.
      for (const char* flag : {"--model", "--layers", "--heads", "--d-model", "--vocab", "--data", "--batch",
                               "--grad-accum", "--seq-len", "--world-size", "--offload", "--device-budget",
                               "--host-budget"}) {
        if (app.count(flag) > 0) {
          throw ConfigError(flag, app.get_option(flag)->as<std::string>(),
                            "--check reads the run's model, batch, offload and budgets from its summary: drop "
                            "this flag (with --check give only --config, --swap-dir, --device, --profile, --json)");
        }
      }
      summary = read_summary(a.check_path);
      apply_summary(summary, a.check_path, a);
    }
    // The config's tiermem.machine_profile: read as tiermem-train reads it (the same refusals,
    // naming the key), and the machine profile when --profile is not given. One that gives
    // tiermem-train its NVMe rates but not every figure the planner needs plans bytes only.
    std::optional<plan::MachineProfile> config_profile;
    if (!a.run.config_path.empty()) {
      const Config given = load_config(a.run.config_path);
      resolve_nvme_rates(given);
      const std::string& from_config = given.tiermem.machine_profile;
      if (a.profile_path.empty() && !from_config.empty()) {
        try {
          config_profile = plan::load_profile(from_config);
          a.profile_path = from_config;
        } catch (const ConfigError& e) {
          std::fprintf(stderr,
                       "tiermem-plan: note: the config's tiermem.machine_profile \"%s\" is not a full machine "
                       "profile (%s): bytes only; for time, give --profile with tiermem-bench profile --json's "
                       "output\n",
                       from_config.c_str(), describe(e).c_str());
        }
      }
    }
    const plan::MachineProfile m = config_profile      ? *std::move(config_profile)
                                   : a.profile_path.empty() ? memory_only_profile(a.run.swap_dir)
                                                            : plan::load_profile(a.profile_path);
    if (a.run.device.empty()) a.run.device = std::string(device_kind_name(m.device));  // the profile's
    Config cfg = train::effective_config(a.run, 0, a.world_size);
    check_swap_dirs(a.run, cfg);
    train::TrainPlan run = train::make_train_plan(a.run, cfg, 0, a.world_size);
    if (a.context > 0) run.model.seq_len = a.context;
    // Vocabulary as tiermem-train makes it: byte-level for text data (not *.bin), unless --vocab.
    const bool bin = std::filesystem::path(a.run.data).extension() == ".bin";
    if (a.vocab > 0 && !bin && a.vocab < 256) {
      throw ConfigError("--vocab", std::to_string(a.vocab),
                        "too small for text data, which is byte-level (token ids 0 to 255): at least 256, as "
                        "tiermem-train --vocab-size");
    }
    if (a.vocab > 0) {
      run.model.vocab_size = a.vocab;
    } else if (!bin) {
      run.model.vocab_size = 256;
    }
    if (!summary.is_null()) run.model_name = summary.value("model", run.model_name);
    run.model.validate();
    const plan::RunShape shape{run.model, run.batch, run.grad_accum, run.seq_len, run.world_size, run.config, a.modules};
    const plan::Prediction p = plan::predict(shape, m);
    const bool timed = !a.profile_path.empty();
    if (!a.check_path.empty()) {
      if (!timed) throw ConfigError("--profile", "(none)", "--check compares step time too: give --profile");
      check_same_run(summary, run, p, a.check_path);
      if (summary.value("steps", 0) < 2) {
        std::fprintf(stderr, "tiermem-plan: note: %s has %s step(s): its step_seconds and shares include the "
                     "first step's trace recording (a run of several steps gives those of the steps after the first)\n",
                     a.check_path.c_str(), summary.contains("steps") ? summary["steps"].dump().c_str() : "no");
      }
      const std::vector<plan::CheckRow> rows = plan::check_against(p, summary, a.check_path);
      if (a.json) {
        json j;
        for (const auto& r : rows) {
          j[r.field + "_predicted"] = r.predicted;
          j[r.field + "_measured"] = r.measured;
          j[r.field + "_rel_error"] = r.rel_error;
        }
        j["prediction"] = plan::prediction_json(p);
        std::printf("%s\n", j.dump().c_str());
      } else {
        // Text: bytes in binary units, seconds and shares as numbers, and the error signed
        // (predicted / measured - 1: + over-predicted, - under); --json keeps |error| as rel_error.
        std::printf("tiermem-plan --check %s (profile %s)\n%-22s %14s %14s %10s\n", a.check_path.c_str(),
                    m.name.c_str(), "field", "predicted", "measured", "error");
        for (const auto& r : rows) {
          const bool bytes = std::string_view(r.field).ends_with("_bytes");
          auto text = [&](double v) {
            return bytes ? format_bytes(static_cast<std::uint64_t>(v)) : fmt::format("{:.6g}", v);
          };
          const std::string err = r.measured != 0 ? fmt::format("{:+.1f} %", 100.0 * (r.predicted / r.measured - 1.0))
                                  : r.predicted == 0 ? std::string("0.0 %")
                                                     : std::string("(0 measured)");
          std::printf("%-22s %14s %14s %10s\n", r.field.c_str(), text(r.predicted).c_str(), text(r.measured).c_str(),
                      err.c_str());
        }
      }
      return 0;
    }
    const plan::LargestModel big = plan::largest_model(shape, m);
    if (a.json) {
      json j = plan::prediction_json(p);
      j["model"] = run.model_name;
      j["profile"] = m.name;
      j["largest_model"] = {{"n_layer", big.n_layer}, {"params", big.params}, {"limit", big.limit}};
      if (!timed) j["time"] = "needs --profile";
      std::printf("%s\n", j.dump().c_str());
    } else {
      print_text(run, m, p, big, timed);
    }
    return p.fits ? 0 : 1;
  } catch (const ConfigError& e) {
    return fail(describe(e));
  } catch (const std::exception& e) {
    return fail(e.what());
  }
}
