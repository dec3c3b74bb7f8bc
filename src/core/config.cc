// src/core/config.cc — the config's values (tiermem/config.h) outside the document's sections:
// sizes with units, offload device names, batch sizes derived from one another, the "auto" line,
// loading a file and writing the config back as JSON. parse_config is in config_parse.cc.
#include "tiermem/config.h"

#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/profile_file.h"
#include "tiermem/error.h"
#include "tiermem/log.h"

namespace tiermem {
namespace {
using json = nlohmann::json;
}  // namespace

std::string_view offload_device_name(OffloadDevice d) {
  switch (d) {
    case OffloadDevice::kNone: return "none";
    case OffloadDevice::kCpu: return "cpu";
    case OffloadDevice::kNvme: return "nvme";
  }
  return "none";
}

std::uint64_t parse_size(std::string_view text, std::string_view key_path) {
  auto fail = [&](const std::string& why) -> std::uint64_t {
    // A command-line option ("--device-budget") is named as such, not as a config key.
    const char* what = key_path.starts_with('-') ? "option '" : "config key '";
    throw ConfigError(std::string(key_path), std::string(text),
                      what + std::string(key_path) + "' = \"" + std::string(text) +
                          "\" is not a valid size: " + why +
                          " (use a number of bytes or e.g. \"4KiB\", \"64MiB\", \"1G\", \"500MB\", \"1e9\")");
  };
  std::size_t i = 0;
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  std::size_t start = i;
  if (i < text.size() && (text[i] == '-' || text[i] == '+')) {
    if (text[i] == '-') return fail("negative");
    ++i;
  }
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) ++i;
  if (i < text.size() && (text[i] == 'e' || text[i] == 'E') && i + 1 < text.size() &&
      (std::isdigit(static_cast<unsigned char>(text[i + 1])) || text[i + 1] == '+')) {
    ++i;
    if (text[i] == '+') ++i;
    while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) ++i;
  }
  std::string num(text.substr(start, i - start));
  if (num.empty() || num == "+" || num == ".") return fail("no number");
  double value = 0;
  try {
    std::size_t used = 0;
    value = std::stod(num, &used);
    if (used != num.size()) return fail("malformed number");
  } catch (const std::exception&) {
    return fail("malformed number");
  }
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  std::string suffix;
  for (; i < text.size(); ++i) {
    if (std::isspace(static_cast<unsigned char>(text[i]))) break;
    suffix.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(text[i]))));
  }
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  if (i != text.size()) return fail("trailing characters");
  double mult = 1;
  if (suffix.empty() || suffix == "b") mult = 1;
  else if (suffix == "k" || suffix == "kib") mult = 1024.0;
  else if (suffix == "m" || suffix == "mib") mult = 1024.0 * 1024;
  else if (suffix == "g" || suffix == "gib") mult = 1024.0 * 1024 * 1024;
  else if (suffix == "t" || suffix == "tib") mult = 1024.0 * 1024 * 1024 * 1024;
  else if (suffix == "p" || suffix == "pib") mult = 1024.0 * 1024 * 1024 * 1024 * 1024;
  else if (suffix == "kb") mult = 1e3;
  else if (suffix == "mb") mult = 1e6;
  else if (suffix == "gb") mult = 1e9;
  else if (suffix == "tb") mult = 1e12;
  else if (suffix == "pb") mult = 1e15;
  else return fail("unknown unit '" + suffix + "' (known: B, KiB, MiB, GiB, TiB, PiB, kB, MB, GB, TB, PB)");
  double bytes = value * mult;
  if (!std::isfinite(bytes) || bytes >= 1.8e19) return fail("too large");
  if (bytes != std::floor(bytes)) return fail("not a whole number of bytes");
  return static_cast<std::uint64_t>(bytes);
}

bool Config::given(std::string_view key_path) const {
  for (const auto& k : given_keys)
    if (k == key_path) return true;
  return false;
}

bool Config::is_auto(std::string_view key_path) const {
  for (const auto& k : auto_keys)
    if (k == key_path) return true;
  return false;
}

BatchSizes derive_batch_sizes(std::optional<long long> train, std::optional<long long> micro,
                              std::optional<long long> accum, int world_size,
                              const BatchKeyNames& n) {
  if (world_size < 1) world_size = 1;
  const long long w = world_size;
  const std::string ranks = std::to_string(w) + (w == 1 ? " rank" : " ranks");
  auto v = [](const std::optional<long long>& x) { return std::to_string(*x); };
  BatchSizes b;
  if (train && micro && accum) {
    b = {*train, *micro, *accum};
  } else if (train && micro) {
    if (*train % (*micro * w) != 0) {
      throw ConfigError(n.train, v(train),
                        "'" + n.train + "' = " + v(train) + " is not a multiple of '" + n.micro +
                            "' = " + v(micro) + " x " + ranks +
                            ": gradient_accumulation_steps = train_batch_size / (micro-batch x "
                            "world size) must be a whole number");
    }
    b = {*train, *micro, *train / (*micro * w)};
  } else if (train && accum) {
    if (*train % (*accum * w) != 0) {
      throw ConfigError(n.train, v(train),
                        "'" + n.train + "' = " + v(train) + " is not a multiple of '" + n.accum +
                            "' = " + v(accum) + " x " + ranks +
                            ": train_micro_batch_size_per_gpu = train_batch_size / "
                            "(accumulation x world size) must be a whole number");
    }
    b = {*train, *train / (*accum * w), *accum};
  } else if (micro && accum) {
    b = {*micro * *accum * w, *micro, *accum};
  } else if (train) {
    if (*train % w != 0) {
      throw ConfigError(n.train, v(train),
                        "'" + n.train + "' = " + v(train) + " is not a multiple of " + ranks +
                            ": each rank's micro-batch must be a whole number of sequences");
    }
    b = {*train, *train / w, 1};
  } else if (micro) {
    b = {*micro * w, *micro, 1};
  } else {
    throw ConfigError(n.train, "",
                      "neither '" + n.train + "' nor '" + n.micro +
                          "' is set: give one (DeepSpeed derives the others from it)");
  }
  if (b.train_batch_size != b.micro_batch_per_gpu * b.gradient_accumulation_steps * w) {
    throw ConfigError(
        n.train, std::to_string(b.train_batch_size),
        "'" + n.train + "' = " + std::to_string(b.train_batch_size) + " but '" + n.micro +
            "' = " + std::to_string(b.micro_batch_per_gpu) + " x '" + n.accum +
            "' = " + std::to_string(b.gradient_accumulation_steps) + " x " + ranks + " = " +
            std::to_string(b.micro_batch_per_gpu * b.gradient_accumulation_steps * w) +
            ": train_batch_size must equal micro-batch x accumulation x world size");
  }
  if (b.micro_batch_per_gpu < 1 || b.gradient_accumulation_steps < 1) {
    throw ConfigError(n.train, std::to_string(b.train_batch_size),
                      "'" + n.train + "' = " + std::to_string(b.train_batch_size) +
                          " is too small for " + ranks +
                          ": each rank needs a micro-batch of at least 1");
  }
  return b;
}

void resolve_batch_sizes(Config& c, int world_size) {
  auto opt = [&](const char* key, int value) -> std::optional<long long> {
    if (c.given(key)) return value;
    return std::nullopt;
  };
  std::optional<long long> train = opt("train_batch_size", c.train_batch_size);
  std::optional<long long> micro =
      opt("train_micro_batch_size_per_gpu", c.train_micro_batch_size_per_gpu);
  std::optional<long long> accum =
      opt("gradient_accumulation_steps", c.gradient_accumulation_steps);
  if (!train && !micro) micro = c.train_micro_batch_size_per_gpu;  // the library's default, 1
  const BatchSizes b = derive_batch_sizes(train, micro, accum, world_size);
  if (b.train_batch_size > (1ll << 30) || b.micro_batch_per_gpu > (1 << 24)) {
    throw ConfigError("train_batch_size", std::to_string(b.train_batch_size),
                      "config key 'train_batch_size' = " + std::to_string(b.train_batch_size) +
                          " is out of range: allowed 1 to " + std::to_string(1 << 30));
  }
  c.train_batch_size = static_cast<int>(b.train_batch_size);
  c.train_micro_batch_size_per_gpu = static_cast<int>(b.micro_batch_per_gpu);
  c.gradient_accumulation_steps = static_cast<int>(b.gradient_accumulation_steps);
}

std::string auto_resolved_line(const Config& c,
                               const std::vector<std::pair<std::string, std::string>>& sources) {
  if (c.auto_keys.empty()) return "";
  const json all = json::parse(config_to_json(c, -1));
  std::string line;
  for (const std::string& key : c.auto_keys) {
    std::string pointer = "/" + key;
    for (char& ch : pointer)
      if (ch == '.') ch = '/';
    std::string value = "(default)";
    try {
      const json::json_pointer ptr(pointer);
      if (all.contains(ptr)) {
        const json& j = all.at(ptr);
        value = j.is_string() ? j.get<std::string>() : j.dump();
      }
    } catch (const json::exception&) {  // a key name json_pointer cannot hold: keep "(default)"
    }
    if (value == "auto") continue;  // resolved later, by what logs its own choice (the device at engine start)
    std::string item = key + "=" + value;
    for (const auto& [k, src] : sources)
      if (k == key && !src.empty()) item += " (" + src + ")";
    line += (line.empty() ? "" : ", ") + item;
  }
  return line.empty() ? "" : "\"auto\" resolved: " + line;
}

Config load_config(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw ConfigError("", path, errno_message("cannot read config file '" + path + "'", errno));
  }
  std::ostringstream ss;
  ss << in.rdbuf();
  try {
    return parse_config(ss.str(), path);
  } catch (const ConfigError& e) {
    // A key's error names the file it is in (the message of a whole-file error does already).
    const std::string what = e.what();
    if (what.find(path) != std::string::npos) throw;
    throw ConfigError(e.key_path(), e.value(), what + " (in " + path + ")");
  }
}

json read_profile_file(const std::string& path, const std::string& key, const std::string& prefix) {
  const std::string make = "write one with: tiermem-bench profile --json > profile.json";
  if (std::error_code ec; std::filesystem::is_directory(path, ec)) {
    throw ConfigError(key, path, prefix + "is a directory, not a profile file; " + make);
  }
  if (std::error_code ec; std::filesystem::exists(path, ec) && !std::filesystem::is_regular_file(path, ec)) {
    throw ConfigError(key, path, prefix + "is not a regular file (a device, FIFO or socket), not a profile file; " + make);
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError(key, path, errno_message(prefix + "cannot read the profile", errno) + "; " + make);
  std::ostringstream ss;
  ss << in.rdbuf();
  json j = json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    std::istringstream lines(ss.str());
    for (std::string line; std::getline(lines, line);) {
      if (line.empty() || line[0] != '{') continue;
      json l = json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (!l.is_discarded()) j = std::move(l);
    }
  }
  if (j.is_discarded() || !j.is_object()) {
    throw ConfigError(key, path, prefix + "is not a machine profile (no JSON object); " + make);
  }
  return j.contains("profile") ? j["profile"] : j;
}

namespace {

// The profile's rate `name` (GB/s): a positive, finite number, else a ConfigError.
double profile_rate(const json& profile, const char* name, const std::string& path) {
  const json* v = profile.is_object() && profile.contains(name) ? &profile.at(name) : nullptr;
  if (v == nullptr || !v->is_number() || !std::isfinite(v->get<double>()) || v->get<double>() <= 0) {
    throw ConfigError("tiermem.machine_profile", path,
                      "config key 'tiermem.machine_profile' = \"" + path + "\": the profile has no positive " + name +
                          (v ? " (it is " + v->dump() + ")" : std::string()) +
                          "; measure it with: tiermem-bench profile --json > profile.json, or set tiermem." + name);
  }
  return v->get<double>();
}

}  // namespace

NvmeRates resolve_nvme_rates(const Config& config) {
  const TiermemConfig& t = config.tiermem;
  NvmeRates r{t.nvme_read_gbps, t.nvme_write_gbps, ""};
  const bool from_config = r.read_gbps > 0 || r.write_gbps > 0;
  if ((r.read_gbps > 0 && r.write_gbps > 0) || t.machine_profile.empty()) {
    r.source = from_config ? "config" : "";
    return r;
  }
  const json profile = read_profile_file(t.machine_profile, "tiermem.machine_profile",
                                         "config key 'tiermem.machine_profile' = \"" + t.machine_profile + "\": ");
  if (r.read_gbps <= 0) r.read_gbps = profile_rate(profile, "nvme_read_gbps", t.machine_profile);
  if (r.write_gbps <= 0) r.write_gbps = profile_rate(profile, "nvme_write_gbps", t.machine_profile);
  r.source = (from_config ? "config and profile " : "profile ") + t.machine_profile;
  return r;
}

// Keys read but not acted on (Config::inert_keys) are left out: they would say something the run
// does not do, and a document written by this function reads back without warnings.
std::string config_to_json(const Config& c, int indent) {
  auto off = [](const OffloadConfig& o) {
    return json{{"device", offload_device_name(o.device)},
                {"nvme_path", o.nvme_path},
                {"pin_memory", o.pin_memory},
                {"buffer_count", o.buffer_count}};
  };
  auto off_optimizer = [&](const OffloadConfig& o) {  // with its ratio (a number, or "auto")
    json j = off(o);
    if (o.ratio < 0) j["ratio"] = "auto";
    else j["ratio"] = o.ratio;
    return j;
  };
  const auto& z = c.zero;
  const auto& t = c.tiermem;
  const auto& sc = c.scheduler;
  json sched = nullptr;
  if (!sc.type.empty()) {
    json params = json::object();
    auto put = [&](const char* k, const auto& o) {
      if (o) params[k] = *o;
    };
    put("warmup_min_lr", sc.warmup_min_lr);
    put("warmup_max_lr", sc.warmup_max_lr);
    put("warmup_num_steps", sc.warmup_num_steps);
    put("total_num_steps", sc.total_num_steps);
    params["warmup_type"] = sc.warmup_type;
    if (sc.type == "WarmupCosineLR") {
      params["warmup_min_ratio"] = sc.warmup_min_ratio;
      params["cos_min_ratio"] = sc.cos_min_ratio;
    }
    sched = {{"type", sc.type}, {"params", params}};
  }
  json j = {
      {"train_batch_size", c.train_batch_size},
      {"train_micro_batch_size_per_gpu", c.train_micro_batch_size_per_gpu},
      {"gradient_accumulation_steps", c.gradient_accumulation_steps},
      {"gradient_clipping", c.gradient_clipping},
      {"bf16", {{"enabled", c.bf16}}},
      {"fp16",
       {{"enabled", c.fp16.enabled},
        {"loss_scale", c.fp16.loss_scale},
        {"initial_scale_power", c.fp16.initial_scale_power},
        {"loss_scale_window", c.fp16.loss_scale_window},
        {"hysteresis", c.fp16.hysteresis},
        {"min_loss_scale", c.fp16.min_loss_scale}}},
      {"optimizer",
       {{"type", c.optimizer.type},
        {"params",
         {{"lr", c.optimizer.lr},
          {"betas", {c.optimizer.beta1, c.optimizer.beta2}},
          {"eps", c.optimizer.eps},
          {"weight_decay", c.optimizer.weight_decay}}}}},
      {"aio",
       {{"block_size", c.aio.block_size_bytes},
        {"queue_depth", c.aio.queue_depth},
        {"intra_op_parallelism", c.aio.intra_op_parallelism},
        {"single_submit", c.aio.single_submit}}},
      {"zero_optimization",
       {{"stage", z.stage},
        {"overlap_comm", z.overlap_comm},
        {"reduce_bucket_size", z.reduce_bucket_size_elems},
        {"stage3_prefetch_bucket_size", z.stage3_prefetch_bucket_size_elems},
        {"stage3_param_persistence_threshold", z.stage3_param_persistence_threshold_elems},
        {"stage3_max_live_parameters", z.stage3_max_live_parameters_elems},
        {"stage3_max_reuse_distance", z.stage3_max_reuse_distance_elems},
        {"sub_group_size", z.sub_group_size_elems},
        {"offload_param", off(z.offload_param)},
        {"offload_optimizer", off_optimizer(z.offload_optimizer)}}},
      {"tiermem",
       {{"device", t.device},
        {"device_budget_bytes", t.device_budget_bytes},
        {"host_budget_bytes", t.host_budget_bytes},
        {"numa_node", t.numa_node},
        {"sim_h2d_gbps", t.sim_h2d_gbps},
        {"sim_d2h_gbps", t.sim_d2h_gbps},
        {"sim_host_addressable", t.sim_host_addressable},
        {"io_engine", t.io_engine},
        {"o_direct", t.o_direct},
        {"sqpoll", t.sqpoll},
        {"fixed_buffers", t.fixed_buffers},
        {"checksum", t.checksum},
        {"fp32_single_copy", t.fp32_single_copy},
        {"stripe_bytes", t.stripe_bytes},
        {"swap_initial_bytes", t.swap_initial_bytes},
        {"swap_max_bytes", t.swap_max_bytes},
        {"pipeline_chunk_bytes", t.pipeline_chunk_bytes},
        {"pipeline_chunks", t.pipeline_chunks},
        {"nvme_prefetch_bytes", t.nvme_prefetch_bytes},
        {"demote_to_host", t.demote_to_host},
        {"overlap_optimizer_step", t.overlap_optimizer_step ? json(*t.overlap_optimizer_step) : json("auto")},
        {"update_in_backward", t.update_in_backward},
        {"host_eviction_plan", t.host_eviction_plan},
        {"prefetch_eviction", t.prefetch_eviction},
        {"device_optimizer", t.device_optimizer},
        {"acquire_timeout_s", t.acquire_timeout_s},
        {"nvme_read_gbps", t.nvme_read_gbps},
        {"nvme_write_gbps", t.nvme_write_gbps},
        {"machine_profile", t.machine_profile}}},
  };
  if (!sched.is_null()) j["scheduler"] = sched;
  if (c.activation_checkpointing.enabled) {
    j["activation_checkpointing"] = {
        {"cpu_checkpointing", c.activation_checkpointing.cpu_checkpointing}};
  }
  return j.dump(indent);
}

}  // namespace tiermem
