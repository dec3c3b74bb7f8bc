// Config loading: a small typed walker over nlohmann::json that records which keys it consumed,
// so that everything left over is reported once as unknown.
#include "tiermem/config.h"

#include <cctype>
#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>

#include <nlohmann/json.hpp>

#include "tiermem/error.h"
#include "tiermem/log.h"

namespace tiermem {
namespace {

using json = nlohmann::json;

std::string show(const json& v) {
  std::string s = v.dump();
  if (s.size() > 80) s = s.substr(0, 77) + "...";
  return s;
}

std::string join_path(std::string_view parent, std::string_view key) {
  return parent.empty() ? std::string(key) : std::string(parent) + "." + std::string(key);
}

// One JSON object being read. get_*() consume a key; finish() reports what was not consumed.
class Section {
 public:
  Section(const json& obj, std::string path, Config& cfg) : obj_(obj), path_(std::move(path)), cfg_(cfg) {
    if (!obj_.is_object()) {
      throw ConfigError(path_, show(obj_),
                        (path_.empty() ? std::string("the config must be a JSON object {...}")
                                       : "config key '" + path_ + "' must be a JSON object") +
                            ", got " + show(obj_));
    }
  }
  ~Section() = default;

  const json* find(const char* key) {
    auto it = obj_.find(key);
    if (it == obj_.end()) return nullptr;
    seen_.push_back(key);
    if (it->is_string() && it->get<std::string>() == "auto") {
      cfg_.auto_keys.push_back(join_path(path_, key));
      return nullptr;  // keep the default
    }
    return &*it;
  }

  std::string path(const char* key) const { return join_path(path_, key); }

  void get(const char* key, bool& out) {
    if (const json* v = find(key)) {
      if (!v->is_boolean()) bad(key, *v, "true or false");
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
    for (char c : s) lower.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
    std::string list;
    for (const char* a : allowed) {
      if (lower == a) {
        out = lower;
        return;
      }
      list += list.empty() ? std::string("\"") + a + "\"" : std::string(", \"") + a + "\"";
    }
    throw ConfigError(path(key), s, "config key '" + path(key) + "' = \"" + s + "\": allowed values are " + list);
  }

  void get_int(const char* key, int& out, long long lo, long long hi) {
    if (const json* v = find(key)) {
      long long x = integral(key, *v);
      if (x < lo || x > hi) range(key, *v, lo, hi);
      out = static_cast<int>(x);
    }
  }

  void get_double(const char* key, double& out, double lo, double hi) {
    if (const json* v = find(key)) {
      if (!v->is_number()) bad(key, *v, "a number");
      double x = v->get<double>();
      if (!(x >= lo && x <= hi)) {
        std::ostringstream os;
        os << "config key '" << path(key) << "' = " << show(*v) << " is out of range: allowed " << lo
           << " to " << hi;
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
      if (x < lo || x > hi) range(key, *v, static_cast<long long>(lo), static_cast<long long>(std::min<std::uint64_t>(hi, std::numeric_limits<long long>::max())));
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
          if (!e.is_string() || e.get<std::string>().empty()) bad(key, *v, "a path or a list of paths");
          out.push_back(e.get<std::string>());
        }
      } else {
        bad(key, *v, "a path or a list of paths");
      }
      for (const auto& p : out) {
        if (p.empty()) bad(key, *v, "a non-empty path");
      }
    }
  }

  std::optional<Section> sub(const char* key) {
    auto it = obj_.find(key);
    if (it == obj_.end()) return std::nullopt;
    seen_.push_back(key);
    if (it->is_null()) return std::nullopt;
    return Section(*it, path(key), cfg_);
  }

  void ignore(const char* key) {
    if (obj_.contains(key)) seen_.push_back(key);
  }

  void finish() {
    for (auto it = obj_.begin(); it != obj_.end(); ++it) {
      bool used = false;
      for (const auto& s : seen_) used = used || s == it.key();
      if (!used) cfg_.unknown_keys.push_back(path(it.key().c_str()));
    }
  }

 private:
  [[noreturn]] void bad(const char* key, const json& v, const char* expected) {
    throw ConfigError(path(key), show(v), "config key '" + path(key) + "' = " + show(v) +
                                              " has the wrong type: expected " + expected);
  }
  [[noreturn]] void range(const char* key, const json& v, long long lo, long long hi) {
    throw ConfigError(path(key), show(v), "config key '" + path(key) + "' = " + show(v) +
                                              " is out of range: allowed " + std::to_string(lo) +
                                              " to " + std::to_string(hi));
  }
  long long integral(const char* key, const json& v, bool allow_negative = true) {
    if (v.is_number_integer()) {
      if (v.is_number_unsigned()) {
        auto u = v.get<std::uint64_t>();
        if (u > static_cast<std::uint64_t>(std::numeric_limits<long long>::max())) bad(key, v, "an integer that fits 63 bits");
        return static_cast<long long>(u);
      }
      long long x = v.get<long long>();
      if (!allow_negative && x < 0) bad(key, v, "a non-negative integer");
      return x;
    }
    if (v.is_number_float()) {
      double d = v.get<double>();
      if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.2e18) {
        if (!allow_negative && d < 0) bad(key, v, "a non-negative integer");
        return static_cast<long long>(d);
      }
    }
    bad(key, v, "an integer");
  }

  const json& obj_;
  std::string path_;
  Config& cfg_;
  std::vector<std::string> seen_;
};

void read_offload(Section& s, OffloadConfig& o) {
  std::string dev = std::string(offload_device_name(o.device));
  s.get_choice("device", dev, {"none", "cpu", "nvme"});
  o.device = dev == "cpu" ? OffloadDevice::kCpu : dev == "nvme" ? OffloadDevice::kNvme : OffloadDevice::kNone;
  s.get_paths("nvme_path", o.nvme_path);
  s.get("pin_memory", o.pin_memory);
  s.get_int("buffer_count", o.buffer_count, 1, 1 << 20);
  s.get_size("buffer_size", o.buffer_size_elems, 1);
  s.get_size("max_in_cpu", o.max_in_cpu_elems);
  s.get("pipeline_read", o.pipeline_read);
  s.get("pipeline_write", o.pipeline_write);
  s.ignore("pipeline");
  s.ignore("fast_init");
  s.get_double("ratio", o.ratio, 0.0, 1.0);
  if (o.device == OffloadDevice::kNvme && o.nvme_path.empty()) {
    throw ConfigError(s.path("nvme_path"), "",
                      "config key '" + s.path("device") + "' is \"nvme\" but '" + s.path("nvme_path") +
                          "' is missing: give the directory (or list of directories) for swap files");
  }
  s.finish();
}

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
  else if (suffix == "kb") mult = 1e3;
  else if (suffix == "mb") mult = 1e6;
  else if (suffix == "gb") mult = 1e9;
  else if (suffix == "tb") mult = 1e12;
  else return fail("unknown unit '" + suffix + "'");
  double bytes = value * mult;
  if (!std::isfinite(bytes) || bytes >= 1.8e19) return fail("too large");
  if (bytes != std::floor(bytes)) return fail("not a whole number of bytes");
  return static_cast<std::uint64_t>(bytes);
}

Config parse_config(std::string_view json_text, std::string_view source) {
  json root;
  try {
    root = json::parse(json_text.begin(), json_text.end(), nullptr, /*allow_exceptions=*/true,
                       /*ignore_comments=*/true);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for number overflow
    throw ConfigError("", "", std::string(source) + ": not valid JSON: " + e.what());
  }
  Config cfg;
  Section top(root, "", cfg);
  top.get_int("train_micro_batch_size_per_gpu", cfg.train_micro_batch_size_per_gpu, 1, 1 << 24);
  top.get_int("gradient_accumulation_steps", cfg.gradient_accumulation_steps, 1, 1 << 24);
  top.get_double("gradient_clipping", cfg.gradient_clipping, 0, 1e30);
  for (const char* k : {"train_batch_size", "steps_per_print", "wall_clock_breakdown", "scheduler",
                        "zero_allow_untested_optimizer", "prescale_gradients", "wandb", "tensorboard",
                        "flops_profiler", "activation_checkpointing", "comms_logger", "dump_state"}) {
    top.ignore(k);
  }
  if (auto s = top.sub("bf16")) {
    s->get("enabled", cfg.bf16);
    s->ignore("immediate_grad_update");
    s->finish();
  }
  if (auto s = top.sub("fp16")) {
    auto& f = cfg.fp16;
    s->get("enabled", f.enabled);
    s->get_double("loss_scale", f.loss_scale, 0, 1e30);
    s->get_int("initial_scale_power", f.initial_scale_power, 0, 64);
    s->get_int("loss_scale_window", f.loss_scale_window, 1, 1 << 30);
    s->get_int("hysteresis", f.hysteresis, 1, 1 << 20);
    s->get_double("min_loss_scale", f.min_loss_scale, 1e-30, 1e30);
    s->ignore("auto_cast");
    s->ignore("consecutive_hysteresis");
    s->finish();
  }
  if (cfg.bf16 && cfg.fp16.enabled) {
    throw ConfigError("fp16.enabled", "true", "config keys 'bf16.enabled' and 'fp16.enabled' are both true: choose one");
  }
  if (auto s = top.sub("optimizer")) {
    // Every optimizer in tiermem is Adam with decoupled weight decay (DeepSpeed's adam_w_mode).
    s->get_choice("type", cfg.optimizer.type, {"adam", "adamw"});
    if (auto p = s->sub("params")) {
      p->get_double("lr", cfg.optimizer.lr, 0, 1e6);
      p->get_double("eps", cfg.optimizer.eps, 0, 1);
      p->get_double("weight_decay", cfg.optimizer.weight_decay, 0, 1e6);
      if (const json* b = p->find("betas")) {
        if (!b->is_array() || b->size() != 2 || !(*b)[0].is_number() || !(*b)[1].is_number()) {
          throw ConfigError(p->path("betas"), show(*b),
                            "config key '" + p->path("betas") + "' = " + show(*b) + " must be [beta1, beta2]");
        }
        cfg.optimizer.beta1 = (*b)[0].get<double>();
        cfg.optimizer.beta2 = (*b)[1].get<double>();
        for (double x : {cfg.optimizer.beta1, cfg.optimizer.beta2}) {
          if (!(x >= 0 && x < 1)) {
            throw ConfigError(p->path("betas"), show(*b),
                              "config key '" + p->path("betas") + "' = " + show(*b) + ": each beta must be in [0, 1)");
          }
        }
      }
      p->ignore("torch_adam");
      p->ignore("adam_w_mode");
      p->finish();
    }
    s->finish();
  }
  if (auto s = top.sub("aio")) {
    auto& a = cfg.aio;
    s->get_size("block_size", a.block_size_bytes, 4096, 1ull << 30);
    if (a.block_size_bytes % 4096 != 0) {
      throw ConfigError("aio.block_size", std::to_string(a.block_size_bytes),
                        "config key 'aio.block_size' = " + std::to_string(a.block_size_bytes) +
                            " must be a multiple of 4096 bytes");
    }
    s->get_int("queue_depth", a.queue_depth, 1, 4096);
    s->get_int("intra_op_parallelism", a.intra_op_parallelism, 1, 64);
    s->get_int("thread_count", a.intra_op_parallelism, 1, 64);  // older DeepSpeed name
    s->get("single_submit", a.single_submit);
    s->get("overlap_events", a.overlap_events);
    s->ignore("use_gds");
    s->finish();
  }
  if (auto s = top.sub("zero_optimization")) {
    auto& z = cfg.zero;
    s->get_int("stage", z.stage, 0, 3);
    s->get("overlap_comm", z.overlap_comm);
    s->get("contiguous_gradients", z.contiguous_gradients);
    s->get("reduce_scatter", z.reduce_scatter);
    s->get_size("reduce_bucket_size", z.reduce_bucket_size_elems, 1);
    s->get_size("allgather_bucket_size", z.allgather_bucket_size_elems, 1);
    s->get_size("stage3_prefetch_bucket_size", z.stage3_prefetch_bucket_size_elems);
    s->get_size("stage3_param_persistence_threshold", z.stage3_param_persistence_threshold_elems);
    s->get_size("stage3_max_live_parameters", z.stage3_max_live_parameters_elems);
    s->get_size("stage3_max_reuse_distance", z.stage3_max_reuse_distance_elems);
    s->get_size("sub_group_size", z.sub_group_size_elems, 1);
    s->get("stage3_gather_16bit_weights_on_model_save", z.stage3_gather_16bit_weights_on_model_save);
    s->get("stage3_gather_fp16_weights_on_model_save", z.stage3_gather_16bit_weights_on_model_save);
    for (const char* k : {"allgather_partitions", "round_robin_gradients", "load_from_fp32_weights",
                          "elastic_checkpoint", "ignore_unused_parameters", "cpu_offload",
                          "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients",
                          "memory_efficient_linear", "mics_shard_size", "stage3_module_granularity_threshold"}) {
      s->ignore(k);
    }
    if (auto p = s->sub("offload_param")) read_offload(*p, z.offload_param);
    z.offload_optimizer.buffer_count = 4;
    if (auto p = s->sub("offload_optimizer")) read_offload(*p, z.offload_optimizer);
    if (z.offload_param.device != OffloadDevice::kNone && z.stage != 3) {
      throw ConfigError("zero_optimization.offload_param.device",
                        std::string(offload_device_name(z.offload_param.device)),
                        "config key 'zero_optimization.offload_param.device' = \"" +
                            std::string(offload_device_name(z.offload_param.device)) +
                            "\" needs 'zero_optimization.stage' = 3 (it is " +
                            std::to_string(z.stage) + ")");
    }
    if (z.offload_optimizer.device != OffloadDevice::kNone && z.stage == 0) {
      throw ConfigError("zero_optimization.offload_optimizer.device",
                        std::string(offload_device_name(z.offload_optimizer.device)),
                        "config key 'zero_optimization.offload_optimizer.device' needs 'zero_optimization.stage' >= 1");
    }
    s->finish();
  }
  if (auto s = top.sub("tiermem")) {
    auto& t = cfg.tiermem;
    s->get_choice("device", t.device, {"auto", "cuda", "sim"});
    s->get_size("device_budget_bytes", t.device_budget_bytes);
    s->get_size("host_budget_bytes", t.host_budget_bytes);
    s->get_int("numa_node", t.numa_node, -1, 1023);
    s->get_double("sim_h2d_gbps", t.sim_h2d_gbps, 0, 1e4);
    s->get_double("sim_d2h_gbps", t.sim_d2h_gbps, 0, 1e4);
    s->get_choice("io_engine", t.io_engine, {"auto", "uring", "posix"});
    s->get("o_direct", t.o_direct);
    s->get("sqpoll", t.sqpoll);
    s->get("fixed_buffers", t.fixed_buffers);
    s->get("checksum", t.checksum);
    s->get_size("stripe_bytes", t.stripe_bytes, 4096, 1ull << 32);
    if (t.stripe_bytes % 4096 != 0) {
      throw ConfigError("tiermem.stripe_bytes", std::to_string(t.stripe_bytes),
                        "config key 'tiermem.stripe_bytes' = " + std::to_string(t.stripe_bytes) +
                            " must be a multiple of 4096 bytes");
    }
    s->get_size("swap_initial_bytes", t.swap_initial_bytes);
    s->get_size("swap_max_bytes", t.swap_max_bytes);
    s->get_size("pipeline_chunk_bytes", t.pipeline_chunk_bytes, 4096, 1ull << 32);
    s->get_int("pipeline_chunks", t.pipeline_chunks, 1, 1024);
    s->get_size("nvme_prefetch_bytes", t.nvme_prefetch_bytes);
    s->get_double("acquire_timeout_s", t.acquire_timeout_s, 0, 1e6);
    s->get("trace_path", t.trace_path);
    s->get_choice("log_level", t.log_level, {"trace", "debug", "info", "warn", "error", "off"});
    s->finish();
  }
  top.finish();
  if (!cfg.unknown_keys.empty()) {
    std::string list;
    for (const auto& k : cfg.unknown_keys) list += (list.empty() ? "" : ", ") + k;
    TM_LOG_WARN("CONFIG", "{}: ignoring unknown keys: {}", source, list);
  }
  if (!cfg.auto_keys.empty()) {
    std::string list;
    for (const auto& k : cfg.auto_keys) list += (list.empty() ? "" : ", ") + k;
    TM_LOG_INFO("CONFIG", "{}: \"auto\" resolved to defaults for: {}", source, list);
  }
  return cfg;
}

Config load_config(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw ConfigError("", path, errno_message("cannot read config file '" + path + "'", errno));
  }
  std::ostringstream ss;
  ss << in.rdbuf();
  return parse_config(ss.str(), path);
}

std::string config_to_json(const Config& c, int indent) {
  auto off = [](const OffloadConfig& o) {
    return json{{"device", offload_device_name(o.device)},
                {"nvme_path", o.nvme_path},
                {"pin_memory", o.pin_memory},
                {"buffer_count", o.buffer_count},
                {"buffer_size", o.buffer_size_elems},
                {"max_in_cpu", o.max_in_cpu_elems},
                {"pipeline_read", o.pipeline_read},
                {"pipeline_write", o.pipeline_write},
                {"ratio", o.ratio}};
  };
  const auto& z = c.zero;
  const auto& t = c.tiermem;
  json j = {
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
        {"single_submit", c.aio.single_submit},
        {"overlap_events", c.aio.overlap_events}}},
      {"zero_optimization",
       {{"stage", z.stage},
        {"overlap_comm", z.overlap_comm},
        {"contiguous_gradients", z.contiguous_gradients},
        {"reduce_scatter", z.reduce_scatter},
        {"reduce_bucket_size", z.reduce_bucket_size_elems},
        {"allgather_bucket_size", z.allgather_bucket_size_elems},
        {"stage3_prefetch_bucket_size", z.stage3_prefetch_bucket_size_elems},
        {"stage3_param_persistence_threshold", z.stage3_param_persistence_threshold_elems},
        {"stage3_max_live_parameters", z.stage3_max_live_parameters_elems},
        {"stage3_max_reuse_distance", z.stage3_max_reuse_distance_elems},
        {"sub_group_size", z.sub_group_size_elems},
        {"stage3_gather_16bit_weights_on_model_save", z.stage3_gather_16bit_weights_on_model_save},
        {"offload_param", off(z.offload_param)},
        {"offload_optimizer", off(z.offload_optimizer)}}},
      {"tiermem",
       {{"device", t.device},
        {"device_budget_bytes", t.device_budget_bytes},
        {"host_budget_bytes", t.host_budget_bytes},
        {"numa_node", t.numa_node},
        {"sim_h2d_gbps", t.sim_h2d_gbps},
        {"sim_d2h_gbps", t.sim_d2h_gbps},
        {"io_engine", t.io_engine},
        {"o_direct", t.o_direct},
        {"sqpoll", t.sqpoll},
        {"fixed_buffers", t.fixed_buffers},
        {"checksum", t.checksum},
        {"stripe_bytes", t.stripe_bytes},
        {"swap_initial_bytes", t.swap_initial_bytes},
        {"swap_max_bytes", t.swap_max_bytes},
        {"pipeline_chunk_bytes", t.pipeline_chunk_bytes},
        {"pipeline_chunks", t.pipeline_chunks},
        {"nvme_prefetch_bytes", t.nvme_prefetch_bytes},
        {"acquire_timeout_s", t.acquire_timeout_s},
        {"trace_path", t.trace_path},
        {"log_level", t.log_level}}},
  };
  return j.dump(indent);
}

}  // namespace tiermem
