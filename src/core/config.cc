// Config loading: a small typed walker over nlohmann::json that records which keys it consumed,
// so that everything left over is reported once as unknown.
#include "tiermem/config.h"

#include <cctype>
#include <cmath>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <string>
#include <vector>

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
    cfg_.given_keys.push_back(join_path(path_, key));
    return &*it;
  }

  std::string path(const char* key) const { return join_path(path_, key); }
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

  // `expect`: what the error says a valid value is (default "a number").
  void get_double(const char* key, double& out, double lo, double hi, const char* expect = "a number") {
    if (const json* v = find(key)) {
      if (!v->is_number()) bad(key, *v, expect);
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

  // A key tiermem reads but does not act on: accepted with any value, one warning saying why.
  void inert(const char* key, const std::string& why) {
    if (!obj_.contains(key)) return;
    seen_.push_back(key);
    cfg_.inert_keys.push_back({path(key), why});
  }

  // A value that passed its type check but breaks a rule: names key path, value and rule.
  [[noreturn]] void broken(const char* key, const std::string& value, const std::string& rule) {
    throw ConfigError(path(key), value, "config key '" + path(key) + "' = " + value + ": " + rule);
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
  const bool optimizer_section = s.path("ratio").find("offload_optimizer") != std::string::npos;
  s.get_double("ratio", o.ratio, 0.0, 1.0, optimizer_section ? "a number from 0 to 1, or \"auto\"" : "a number");
  if (s.is_auto("ratio") && optimizer_section) {
    o.ratio = OffloadConfig::kRatioAuto;  // ZeroEngine sizes the device's share from its idle room
  }
  // Read (and range-checked) above for compatibility, but nothing acts on them.
  s.inert("buffer_size",
          "tiermem sizes its staging by the host budget "
          "(tiermem.host_budget_bytes, tiermem.pipeline_chunk_bytes)");
  s.inert("max_in_cpu", "what stays in host memory is bounded by tiermem.host_budget_bytes");
  for (const char* k : {"pipeline_read", "pipeline_write", "pipeline"}) {
    s.inert(k, "tiermem always overlaps optimizer-state swaps with the step");
  }
  if (!optimizer_section) {
    s.inert("ratio", "ratio is the share of the optimizer state offloaded (offload_optimizer.ratio)");
  }
  s.inert("fast_init",
          "tiermem initialises parameters tensor by tensor in their home tier "
          "already");
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
  // A key given twice in one object is refused, as DeepSpeed's config loader refuses it: nlohmann
  // would keep the last value silently, and the user cannot tell which of the two the run took.
  // The parser callback sees each key in order; `open` holds, per object being read, its key path
  // and the keys seen in it so far (an array's elements are named '[]').
  struct Object {
    std::string path;
    std::set<std::string> keys;
    std::string last;
  };
  std::vector<Object> open;
  std::string duplicate;
  auto on_event = [&](int, json::parse_event_t event, json& parsed) {
    auto child = [&] {
      if (open.empty()) return std::string();
      Object& o = open.back();
      return o.path.empty() ? o.last : o.path + "." + o.last;
    };
    switch (event) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:  // an array's elements are named '<path>.[]'
        open.push_back({child(), {}, "[]"});
        break;
      case json::parse_event_t::key:
        if (!open.empty()) {
          Object& o = open.back();
          o.last = parsed.get<std::string>();
          if (!o.keys.insert(o.last).second && duplicate.empty()) duplicate = child();
        }
        break;
      case json::parse_event_t::object_end:
      case json::parse_event_t::array_end:
        if (!open.empty()) open.pop_back();
        break;
      case json::parse_event_t::value:
        break;
    }
    return true;
  };
  try {
    root = json::parse(json_text.begin(), json_text.end(), on_event, /*allow_exceptions=*/true,
                       /*ignore_comments=*/true);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for number overflow
    throw ConfigError("", "", std::string(source) + ": not valid JSON: " + e.what());
  }
  if (!duplicate.empty()) {
    throw ConfigError(duplicate, "",
                      "config key '" + duplicate + "' is given twice in " + std::string(source) +
                          " (in the same object): keep the one you mean and delete the other; "
                          "DeepSpeed refuses duplicate keys too");
  }
  Config cfg;
  Section top(root, "", cfg);
  top.get_int("train_batch_size", cfg.train_batch_size, 1, 1 << 30);
  top.get_int("train_micro_batch_size_per_gpu", cfg.train_micro_batch_size_per_gpu, 1, 1 << 24);
  top.get_int("gradient_accumulation_steps", cfg.gradient_accumulation_steps, 1, 1 << 24);
  top.get_double("gradient_clipping", cfg.gradient_clipping, 0, 1e30);
  if (auto s = top.sub("activation_checkpointing")) {
    auto& ac = cfg.activation_checkpointing;
    ac.enabled = true;  // a section present asks for checkpointing, as a DeepSpeed model would
    s->get("cpu_checkpointing", ac.cpu_checkpointing);
    s->inert("partition_activations",
             "there is no model parallelism to partition over: each rank keeps its own block "
             "inputs whole");
    s->inert("contiguous_memory_optimization",
             "the block inputs are allocated once, at start, one buffer per block");
    s->inert("number_checkpoints", "every transformer block is checkpointed");
    s->inert("synchronize_checkpoint_boundary",
             "the model computes synchronously: there is nothing to synchronize");
    s->inert("profile", "use tiermem-train --trace for the time of each recompute");
    s->finish();
  }
  for (const char* k : {"steps_per_print", "wall_clock_breakdown"}) {
    top.inert(k,
              "tiermem-train prints every step and the time split in its summary; the library "
              "prints nothing per step");
  }
  for (const char* k : {"wandb", "tensorboard", "csv_monitor", "comms_logger", "flops_profiler"}) {
    top.inert(k, "no monitor or profiler is built in: use tiermem-train --json or --trace");
  }
  top.inert("prescale_gradients", "gradients are always averaged after the reduction");
  top.inert("gradient_predivide_factor", "gradients are always averaged after the reduction");
  top.inert("zero_allow_untested_optimizer",
            "the only optimizer is AdamW (optimizer.type), which ZeRO supports");
  top.inert("dump_state", "tiermem does not print its state at start-up");
  if (auto s = top.sub("scheduler")) {
    auto& sc = cfg.scheduler;
    sc.type = "WarmupLR";  // a section without "type": DeepSpeed's own default would fail; be kind
    s->get("type", sc.type);
    if (sc.type != "WarmupLR" && sc.type != "WarmupDecayLR" && sc.type != "WarmupCosineLR") {
      s->broken("type", "\"" + sc.type + "\"",
                "allowed values are \"WarmupLR\", \"WarmupDecayLR\", \"WarmupCosineLR\" "
                "(LRRangeTest and OneCycle are not implemented)");
    }
    if (auto p = s->sub("params")) {
      auto opt_double = [&](const char* key, std::optional<double>& out, double lo, double hi) {
        double v = 0;
        p->get_double(key, v, lo, hi);
        if (cfg.given(p->path(key))) out = v;
      };
      auto opt_int = [&](const char* key, std::optional<long long>& out, long long lo) {
        int v = 0;
        p->get_int(key, v, lo, 1 << 30);
        if (cfg.given(p->path(key))) out = v;
      };
      opt_double("warmup_min_lr", sc.warmup_min_lr, 0, 1e6);
      opt_double("warmup_max_lr", sc.warmup_max_lr, 0, 1e6);
      opt_int("warmup_num_steps", sc.warmup_num_steps, 0);
      opt_int("total_num_steps", sc.total_num_steps, 1);
      p->get_choice("warmup_type", sc.warmup_type, {"log", "linear"});
      p->get_double("warmup_min_ratio", sc.warmup_min_ratio, 0, 1);
      p->get_double("cos_min_ratio", sc.cos_min_ratio, 0, 1);
      p->inert("last_batch_iteration",
               "tiermem-train resumes the schedule at the checkpoint's step");
      const bool cosine = sc.type == "WarmupCosineLR";
      auto num = [](double x) {
        std::ostringstream os;
        os << x;
        return os.str();
      };
      for (auto [k, x] : {std::pair<const char*, const std::optional<double>*>{"warmup_min_lr",
                                                                               &sc.warmup_min_lr},
                          {"warmup_max_lr", &sc.warmup_max_lr}}) {
        if (cosine && x->has_value()) {
          p->broken(k, num(**x),
                    "WarmupCosineLR has no such parameter: its peak is "
                    "optimizer.params.lr and its start warmup_min_ratio x that");
        }
      }
      for (auto [k, x] : {std::pair<const char*, double>{"warmup_min_ratio", sc.warmup_min_ratio},
                          {"cos_min_ratio", sc.cos_min_ratio}}) {
        if (!cosine && cfg.given(p->path(k))) {
          p->broken(
              k, num(x),
              "only WarmupCosineLR has this parameter (scheduler.type is \"" + sc.type + "\")");
        }
      }
      if (sc.type == "WarmupLR" && cfg.given(p->path("total_num_steps"))) {
        p->broken("total_num_steps", std::to_string(*sc.total_num_steps),
                  "WarmupLR has no total_num_steps (it holds the peak lr after the warm-up); use "
                  "WarmupDecayLR or WarmupCosineLR to decay");
      }
      p->finish();
    }
    s->finish();
  }
  if (auto s = top.sub("bf16")) {
    s->get("enabled", cfg.bf16);
    s->inert("immediate_grad_update", "gradients are always accumulated in fp32 partitions");
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
    s->inert("auto_cast", "tiermem does not cast the model's inputs");
    s->inert("consecutive_hysteresis",
             "the hysteresis counter is not reset by a step without "
             "overflow (DeepSpeed's default, false)");
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
      p->inert("torch_adam", "tiermem steps AdamW with its own CPU/GPU kernels");
      p->inert("adam_w_mode", "tiermem always uses decoupled weight decay (AdamW)");
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
    s->inert("overlap_events",
             "the io_uring engine always reaps completions on their own thread "
             "while new requests are submitted");
    s->inert("use_gds",
             "GPUDirect Storage is not implemented: NVMe data goes through pinned host "
             "memory");
    s->finish();
  }
  if (auto s = top.sub("zero_optimization")) {
    auto& z = cfg.zero;
    s->get_int("stage", z.stage, 0, 3);
    s->get("overlap_comm", z.overlap_comm);
    s->get("contiguous_gradients", z.contiguous_gradients);
    s->inert("contiguous_gradients", "tiermem always packs gradients into contiguous buckets");
    s->get("reduce_scatter", z.reduce_scatter);
    s->inert("reduce_scatter", "ZeRO stage 2 and 3 always reduce-scatter gradients in buckets");
    s->get_size("reduce_bucket_size", z.reduce_bucket_size_elems, 1);
    s->get_size("allgather_bucket_size", z.allgather_bucket_size_elems, 1);
    s->inert("allgather_bucket_size", "parameters are all-gathered one module at a time");
    s->get_size("stage3_prefetch_bucket_size", z.stage3_prefetch_bucket_size_elems);
    s->get_size("stage3_param_persistence_threshold", z.stage3_param_persistence_threshold_elems);
    s->get_size("stage3_max_live_parameters", z.stage3_max_live_parameters_elems);
    s->get_size("stage3_max_reuse_distance", z.stage3_max_reuse_distance_elems);
    s->get_size("sub_group_size", z.sub_group_size_elems, 1);
    s->get("stage3_gather_16bit_weights_on_model_save", z.stage3_gather_16bit_weights_on_model_save);
    s->get("stage3_gather_fp16_weights_on_model_save", z.stage3_gather_16bit_weights_on_model_save);
    for (const char* k : {"stage3_gather_16bit_weights_on_model_save",
                          "stage3_gather_fp16_weights_on_model_save"}) {
      s->inert(k,
               "checkpoints keep each rank's fp32 partition; no gathered 16-bit copy is written");
    }
    s->inert("allgather_partitions", "parameters are always all-gathered from their partitions");
    s->inert("round_robin_gradients", "gradient partitions are assigned in order");
    s->inert("load_from_fp32_weights", "resume always loads the fp32 master weights");
    s->inert("elastic_checkpoint", "a checkpoint resumes at any world size (re-partitioned as it loads)");
    s->inert("ignore_unused_parameters", "every GPT parameter is used in every step");
    s->inert("cpu_offload", "deprecated in DeepSpeed: use offload_optimizer.device \"cpu\"");
    for (const char* k : {"zero_hpz_partition_size", "zero_quantized_weights",
                          "zero_quantized_gradients", "mics_shard_size"}) {
      s->inert(k, "ZeRO++ / MiCS are not implemented: plain ZeRO partitioning is used");
    }
    s->inert("memory_efficient_linear", "tiermem's linear layers keep their inputs for backward");
    s->inert("stage3_module_granularity_threshold", "parameters are fetched one module at a time");
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
                        "config key 'zero_optimization.offload_optimizer.device' = \"" +
                            std::string(offload_device_name(z.offload_optimizer.device)) +
                            "\" needs 'zero_optimization.stage' >= 1 (it is 0)");
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
    s->get("sim_host_addressable", t.sim_host_addressable);
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
    if (t.swap_max_bytes > 0 && t.swap_initial_bytes > t.swap_max_bytes) {
      if (cfg.given("tiermem.swap_initial_bytes")) {
        throw ConfigError(
            "tiermem.swap_initial_bytes", std::to_string(t.swap_initial_bytes),
            "config key 'tiermem.swap_initial_bytes' = " + std::to_string(t.swap_initial_bytes) +
                " is above 'tiermem.swap_max_bytes' = " + std::to_string(t.swap_max_bytes) +
                ": the initial swap file size must not exceed the maximum");
      }
      if (log_rank() == 0) {
        TM_LOG_INFO("CONFIG",
                    "tiermem.swap_initial_bytes (default {}) capped to tiermem.swap_max_bytes "
                    "= {} bytes",
                    t.swap_initial_bytes, t.swap_max_bytes);
      }
      t.swap_initial_bytes = t.swap_max_bytes;
    }
    s->get_size("pipeline_chunk_bytes", t.pipeline_chunk_bytes, 4096, 1ull << 32);
    if (t.pipeline_chunk_bytes % 4096 != 0) {
      s->broken("pipeline_chunk_bytes", std::to_string(t.pipeline_chunk_bytes),
                "must be a multiple of 4096 bytes (the O_DIRECT alignment)");
    }
    s->get_int("pipeline_chunks", t.pipeline_chunks, 1, 1024);
    s->get_size("nvme_prefetch_bytes", t.nvme_prefetch_bytes);
    s->get("overlap_optimizer_step", t.overlap_optimizer_step);
    s->get("host_eviction_plan", t.host_eviction_plan);
    s->get_choice("device_optimizer", t.device_optimizer, {"auto", "on", "off"});
    s->get_double("acquire_timeout_s", t.acquire_timeout_s, 0, 1e6);
    s->get("trace_path", t.trace_path);
    s->inert("trace_path",
             "a trace is started by the program: tiermem-train --trace PATH, or "
             "TIERMEM_TRACE=PATH for any program");
    s->get_choice("log_level", t.log_level, {"trace", "debug", "info", "warn", "error", "off"});
    s->inert("log_level",
             "the log level is read once from the environment: set "
             "TIERMEM_LOG_LEVEL instead");
    s->finish();
  }
  top.finish();
  if (!cfg.unknown_keys.empty()) {
    std::string list;
    for (const auto& k : cfg.unknown_keys) list += (list.empty() ? "" : ", ") + k;
    // Every rank reads the same document: rank 0 says it, once per document and key.
    TM_LOG_WARN_ONCE_RANK0("CONFIG", "config-unknown:" + std::string(source) + ":" + list,
                           "{}: ignoring unknown keys: {}", source, list);
  }
  for (const InertKey& k : cfg.inert_keys) {
    TM_LOG_WARN_ONCE_RANK0("CONFIG", "config-inert:" + std::string(source) + ":" + k.key,
                           "{}: '{}' is read but has no effect: {}", source, k.key, k.why);
  }
  if (!cfg.auto_keys.empty()) {
    std::string list;
    for (const auto& k : cfg.auto_keys) list += (list.empty() ? "" : ", ") + k;
    TM_LOG_DEBUG("CONFIG", "{}: \"auto\" keys: {}", source, list);
  }
  return cfg;
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
    std::string item = key + "=" + value;
    for (const auto& [k, src] : sources)
      if (k == key && !src.empty()) item += " (" + src + ")";
    line += (line.empty() ? "" : ", ") + item;
  }
  return "\"auto\" resolved: " + line;
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
        {"stripe_bytes", t.stripe_bytes},
        {"swap_initial_bytes", t.swap_initial_bytes},
        {"swap_max_bytes", t.swap_max_bytes},
        {"pipeline_chunk_bytes", t.pipeline_chunk_bytes},
        {"pipeline_chunks", t.pipeline_chunks},
        {"nvme_prefetch_bytes", t.nvme_prefetch_bytes},
        {"overlap_optimizer_step", t.overlap_optimizer_step ? json(*t.overlap_optimizer_step) : json("auto")},
        {"host_eviction_plan", t.host_eviction_plan},
        {"device_optimizer", t.device_optimizer},
        {"acquire_timeout_s", t.acquire_timeout_s}}},
  };
  if (!sched.is_null()) j["scheduler"] = sched;
  if (c.activation_checkpointing.enabled) {
    j["activation_checkpointing"] = {
        {"cpu_checkpointing", c.activation_checkpointing.cpu_checkpointing}};
  }
  return j.dump(indent);
}

}  // namespace tiermem
