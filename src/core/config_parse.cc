// src/core/config_parse.cc — parse_config (tiermem/config.h): the JSON checked for duplicate keys,
// then one reader per section, in the order the document's sections are read (the first error
// thrown, and the order of the warnings, follow it).
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "core/config_section.h"
#include "tiermem/config.h"
#include "tiermem/error.h"
#include "tiermem/log.h"

namespace tiermem {
namespace {

using detail::Section;
using detail::show;
using json = nlohmann::json;

// The document as JSON. A key given twice in one object is refused, as DeepSpeed's config loader
// refuses it: nlohmann would keep the last value silently, and the user cannot tell which of the
// two the run took. The parser callback sees each key in order; `open` holds, per object being
// read, its key path and the keys seen in it so far (an array's elements are named '[]').
json parse_json_checked(std::string_view json_text, std::string_view source) {
  json root;
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
  return root;
}

// The batch sizes and clipping at the top level.
void read_batch_keys(Section& top, Config& cfg) {
  top.get_int("train_batch_size", cfg.train_batch_size, 1, 1 << 30);
  top.get_int("train_micro_batch_size_per_gpu", cfg.train_micro_batch_size_per_gpu, 1, 1 << 24);
  top.get_int("gradient_accumulation_steps", cfg.gradient_accumulation_steps, 1, 1 << 24);
  top.get_double("gradient_clipping", cfg.gradient_clipping, 0, 1e30);
}

void read_activation_checkpointing(Section& s, Config& cfg) {
  auto& ac = cfg.activation_checkpointing;
  ac.enabled = true;  // a section present asks for checkpointing, as a DeepSpeed model would
  s.get("cpu_checkpointing", ac.cpu_checkpointing);
  s.inert("partition_activations",
          "there is no model parallelism to partition over: each rank keeps its own block "
          "inputs whole");
  s.inert("contiguous_memory_optimization",
          "the block inputs are allocated once, at start, one buffer per block");
  s.inert("number_checkpoints", "every transformer block is checkpointed");
  s.inert("synchronize_checkpoint_boundary",
          "the model computes synchronously: there is nothing to synchronize");
  s.inert("profile", "use tiermem-train --trace for the time of each recompute");
  s.finish();
}

// DeepSpeed's top-level keys for monitors, printing and gradient scaling: read, not acted on.
void read_inert_top_keys(Section& top) {
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
}

void read_scheduler_params(Section& p, Config& cfg) {
  auto& sc = cfg.scheduler;
  auto opt_double = [&](const char* key, std::optional<double>& out, double lo, double hi) {
    double v = 0;
    p.get_double(key, v, lo, hi);
    if (cfg.given(p.path(key))) out = v;
  };
  auto opt_int = [&](const char* key, std::optional<long long>& out, long long lo) {
    int v = 0;
    p.get_int(key, v, lo, 1 << 30);
    if (cfg.given(p.path(key))) out = v;
  };
  opt_double("warmup_min_lr", sc.warmup_min_lr, 0, 1e6);
  opt_double("warmup_max_lr", sc.warmup_max_lr, 0, 1e6);
  opt_int("warmup_num_steps", sc.warmup_num_steps, 0);
  opt_int("total_num_steps", sc.total_num_steps, 1);
  p.get_choice("warmup_type", sc.warmup_type, {"log", "linear"});
  p.get_double("warmup_min_ratio", sc.warmup_min_ratio, 0, 1);
  p.get_double("cos_min_ratio", sc.cos_min_ratio, 0, 1);
  p.inert("last_batch_iteration", "tiermem-train resumes the schedule at the checkpoint's step");
  const bool cosine = sc.type == "WarmupCosineLR";
  auto num = [](double x) {
    std::ostringstream os;
    os << x;
    return os.str();
  };
  for (auto [k, x] :
       {std::pair<const char*, const std::optional<double>*>{"warmup_min_lr", &sc.warmup_min_lr},
        {"warmup_max_lr", &sc.warmup_max_lr}}) {
    if (cosine && x->has_value()) {
      p.broken(k, num(**x),
               "WarmupCosineLR has no such parameter: its peak is "
               "optimizer.params.lr and its start warmup_min_ratio x that");
    }
  }
  for (auto [k, x] : {std::pair<const char*, double>{"warmup_min_ratio", sc.warmup_min_ratio},
                      {"cos_min_ratio", sc.cos_min_ratio}}) {
    if (!cosine && cfg.given(p.path(k))) {
      p.broken(k, num(x),
               "only WarmupCosineLR has this parameter (scheduler.type is \"" + sc.type + "\")");
    }
  }
  // DeepSpeed warns about it too: the decay would begin before the warm-up ends.
  if (sc.type != "WarmupLR" && sc.total_num_steps && sc.warmup_num_steps && *sc.total_num_steps < *sc.warmup_num_steps) {
    cfg.doubtful_values.push_back(
        {p.path("total_num_steps"),
         fmt::format("{} is below warmup_num_steps ({}): the schedule ends before its warm-up does, so the peak lr is "
                     "never reached; give total_num_steps >= warmup_num_steps",
                     *sc.total_num_steps, *sc.warmup_num_steps)});
  }
  if (sc.type == "WarmupLR" && cfg.given(p.path("total_num_steps"))) {
    p.broken("total_num_steps", std::to_string(*sc.total_num_steps),
             "WarmupLR has no total_num_steps (it holds the peak lr after the warm-up); use "
             "WarmupDecayLR or WarmupCosineLR to decay");
  }
  p.finish();
}

void read_scheduler(Section& s, Config& cfg) {
  auto& sc = cfg.scheduler;
  sc.type = "WarmupLR";  // a section without "type": DeepSpeed's own default would fail; be kind
  s.get("type", sc.type);
  if (sc.type != "WarmupLR" && sc.type != "WarmupDecayLR" && sc.type != "WarmupCosineLR") {
    s.broken("type", "\"" + sc.type + "\"",
             "allowed values are \"WarmupLR\", \"WarmupDecayLR\", \"WarmupCosineLR\" "
             "(LRRangeTest and OneCycle are not implemented)");
  }
  if (auto p = s.sub("params")) read_scheduler_params(*p, cfg);
  s.finish();
}

void read_bf16(Section& s, Config& cfg) {
  s.get("enabled", cfg.bf16);
  s.inert("immediate_grad_update", "gradients are always accumulated in fp32 partitions");
  s.finish();
}

void read_fp16(Section& s, Config& cfg) {
  auto& f = cfg.fp16;
  s.get("enabled", f.enabled);
  s.get_double("loss_scale", f.loss_scale, 0, 1e30);
  s.get_int("initial_scale_power", f.initial_scale_power, 0, 64);
  s.get_int("loss_scale_window", f.loss_scale_window, 1, 1 << 30);
  s.get_int("hysteresis", f.hysteresis, 1, 1 << 20);
  s.get_double("min_loss_scale", f.min_loss_scale, 1e-30, 1e30);
  s.inert("auto_cast", "tiermem does not cast the model's inputs");
  s.inert("consecutive_hysteresis",
          "the hysteresis counter is not reset by a step without "
          "overflow (DeepSpeed's default, false)");
  s.finish();
}

void read_optimizer(Section& s, Config& cfg) {
  // Adam is AdamW (decoupled weight decay: DeepSpeed's adam_w_mode); Lion and Adagrad as
  // DeepSpeed's CPU optimizers name them (tiermem/optim_kernels.h has their rules).
  s.get_choice("type", cfg.optimizer.type, {"adam", "adamw", "lion", "adagrad"});
  const bool lion = cfg.optimizer.type == "lion", adagrad = cfg.optimizer.type == "adagrad";
  if (lion) cfg.optimizer.beta2 = 0.99;  // Lion's defaults (betas [0.9, 0.99])
  if (adagrad) cfg.optimizer.eps = 1e-10;  // torch.optim.Adagrad's
  if (auto p = s.sub("params")) {
    p->get_double("lr", cfg.optimizer.lr, 0, 1e6);
    p->get_double("eps", cfg.optimizer.eps, 0, 1);
    if (adagrad) {
      p->get_double("lr_decay", cfg.optimizer.lr_decay, 0, 1e6);
      p->get_double("initial_accumulator_value", cfg.optimizer.initial_accumulator_value, 0, 1e6);
    }
    p->get_double("weight_decay", cfg.optimizer.weight_decay, 0, 1e6);
    if (const json* b = p->find("betas")) {
      if (!b->is_array() || b->size() != 2 || !(*b)[0].is_number() || !(*b)[1].is_number()) {
        throw ConfigError(
            p->path("betas"), show(*b),
            "config key '" + p->path("betas") + "' = " + show(*b) + " must be [beta1, beta2]");
      }
      cfg.optimizer.beta1 = (*b)[0].get<double>();
      cfg.optimizer.beta2 = (*b)[1].get<double>();
      for (double x : {cfg.optimizer.beta1, cfg.optimizer.beta2}) {
        if (!(x >= 0 && x < 1)) {
          throw ConfigError(p->path("betas"), show(*b),
                            "config key '" + p->path("betas") + "' = " + show(*b) +
                                ": each beta must be in [0, 1)");
        }
      }
    }
    p->inert("torch_adam", "tiermem steps AdamW with its own CPU/GPU kernels");
    p->inert("adam_w_mode", "tiermem always uses decoupled weight decay (AdamW)");
    p->finish();
  }
  s.finish();
}

void read_aio(Section& s, Config& cfg) {
  auto& a = cfg.aio;
  s.get_size("block_size", a.block_size_bytes, 4096, 1ull << 30);
  if (a.block_size_bytes % 4096 != 0) {
    throw ConfigError("aio.block_size", std::to_string(a.block_size_bytes),
                      "config key 'aio.block_size' = " + std::to_string(a.block_size_bytes) +
                          " must be a multiple of 4096 bytes");
  }
  s.get_int("queue_depth", a.queue_depth, 1, 4096);
  s.get_int("intra_op_parallelism", a.intra_op_parallelism, 1, 64);
  s.get_int("thread_count", a.intra_op_parallelism, 1, 64);  // older DeepSpeed name
  s.get("single_submit", a.single_submit);
  s.get("overlap_events", a.overlap_events);
  s.inert("overlap_events",
          "the io_uring engine always reaps completions on their own thread "
          "while new requests are submitted");
  s.inert("use_gds",
          "GPUDirect Storage is not implemented: NVMe data goes through pinned host "
          "memory");
  s.finish();
}

void read_offload(Section& s, OffloadConfig& o) {
  std::string dev = std::string(offload_device_name(o.device));
  s.get_choice("device", dev, {"none", "cpu", "nvme"});
  o.device = dev == "cpu"    ? OffloadDevice::kCpu
             : dev == "nvme" ? OffloadDevice::kNvme
                             : OffloadDevice::kNone;
  s.get_paths("nvme_path", o.nvme_path);
  s.get("pin_memory", o.pin_memory);
  o.buffer_count_given = s.find("buffer_count") != nullptr;
  s.get_int("buffer_count", o.buffer_count, 1, 1 << 20);
  s.get_size("buffer_size", o.buffer_size_elems, 1);
  s.get_size("max_in_cpu", o.max_in_cpu_elems);
  s.get("pipeline_read", o.pipeline_read);
  s.get("pipeline_write", o.pipeline_write);
  const bool optimizer_section = s.path("ratio").find("offload_optimizer") != std::string::npos;
  s.get_double("ratio", o.ratio, 0.0, 1.0,
               optimizer_section ? "a number from 0 to 1, or \"auto\"" : "a number");
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
    s.inert("ratio",
            "ratio is the share of the optimizer state offloaded (offload_optimizer.ratio)");
  }
  s.inert("fast_init",
          "tiermem initialises parameters tensor by tensor in their home tier "
          "already");
  if (o.device == OffloadDevice::kNvme && o.nvme_path.empty()) {
    throw ConfigError(
        s.path("nvme_path"), "",
        "config key '" + s.path("device") + "' is \"nvme\" but '" + s.path("nvme_path") +
            "' is missing: give the directory (or list of directories) for swap files");
  }
  s.finish();
}

// A stage3_ size key of zero_optimization, given as "stage3_<name>" or "<name>" (DeepSpeed's field
// name); both given with different values is a ConfigError naming both.
void read_stage3_size(Section& s, const char* name, std::uint64_t& out) {
  const std::string prefixed = std::string("stage3_") + name;
  std::uint64_t a = out, b = out;
  s.get_size(prefixed.c_str(), a);
  s.get_size(name, b);
  const bool given = s.has(prefixed.c_str());
  if (given && s.has(name) && a != b) {
    throw ConfigError(s.path(name), std::to_string(b),
                      "config keys '" + s.path(prefixed.c_str()) + "' = " + std::to_string(a) + " and '" +
                          s.path(name) + "' = " + std::to_string(b) +
                          " are one DeepSpeed key under two names, given different values: keep one");
  }
  out = given ? a : b;
}

void read_zero_optimization(Section& s, Config& cfg) {
  auto& z = cfg.zero;
  s.get_int("stage", z.stage, 0, 3);
  z.overlap_comm = z.stage == 3;  // DeepSpeed's default when the key is absent: on at stage 3 only
  s.get("overlap_comm", z.overlap_comm);
  s.get("contiguous_gradients", z.contiguous_gradients);
  s.inert("contiguous_gradients", "tiermem always packs gradients into contiguous buckets");
  s.get("reduce_scatter", z.reduce_scatter);
  s.inert("reduce_scatter", "ZeRO stage 2 and 3 always reduce-scatter gradients in buckets");
  s.get_size("reduce_bucket_size", z.reduce_bucket_size_elems, 1);
  s.get_size("allgather_bucket_size", z.allgather_bucket_size_elems, 1);
  s.inert("allgather_bucket_size", "parameters are all-gathered one module at a time");
  // DeepSpeed's config model takes each stage3_ key under its field name too (pydantic's
  // populate_by_name): "param_persistence_threshold" is the same key. Both given: they must agree.
  read_stage3_size(s, "prefetch_bucket_size", z.stage3_prefetch_bucket_size_elems);
  read_stage3_size(s, "param_persistence_threshold", z.stage3_param_persistence_threshold_elems);
  read_stage3_size(s, "max_live_parameters", z.stage3_max_live_parameters_elems);
  read_stage3_size(s, "max_reuse_distance", z.stage3_max_reuse_distance_elems);
  s.get_size("sub_group_size", z.sub_group_size_elems, 1);
  s.get("stage3_gather_16bit_weights_on_model_save", z.stage3_gather_16bit_weights_on_model_save);
  s.get("stage3_gather_fp16_weights_on_model_save", z.stage3_gather_16bit_weights_on_model_save);
  s.get("gather_16bit_weights_on_model_save", z.stage3_gather_16bit_weights_on_model_save);
  for (const char* k : {"stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
                        "gather_16bit_weights_on_model_save"}) {
    s.inert(k, "checkpoints keep each rank's fp32 partition; no gathered 16-bit copy is written");
  }
  s.inert("allgather_partitions", "parameters are always all-gathered from their partitions");
  s.inert("round_robin_gradients", "gradient partitions are assigned in order");
  s.inert("load_from_fp32_weights", "resume always loads the fp32 master weights");
  s.inert("elastic_checkpoint", "a checkpoint resumes at any world size (re-partitioned as it loads)");
  s.inert("ignore_unused_parameters", "every GPT parameter is used in every step");
  s.inert("cpu_offload", "deprecated in DeepSpeed: use offload_optimizer.device \"cpu\"");
  for (const char* k : {"zero_hpz_partition_size", "zero_quantized_weights",
                        "zero_quantized_gradients", "mics_shard_size"}) {
    s.inert(k, "ZeRO++ / MiCS are not implemented: plain ZeRO partitioning is used");
  }
  s.get("zero_quantized_nontrainable_weights", z.zero_quantized_nontrainable_weights);
  s.inert("memory_efficient_linear", "tiermem's linear layers keep their inputs for backward");
  for (const char* k : {"stage3_module_granularity_threshold", "module_granularity_threshold"}) {
    s.inert(k, "parameters are fetched one module at a time");
  }
  // The rest of DeepSpeed 0.19.8's zero_optimization keys (under both names where it has two):
  // accepted with a warning, as every key tiermem does not act on.
  for (const char* k : {"stage3_model_persistence_threshold", "model_persistence_threshold"}) {
    s.inert(k, "no model-wide persistence limit: stage3_param_persistence_threshold alone decides");
  }
  for (const char* k : {"stage3_use_all_reduce_for_fetch_params", "use_all_reduce_for_fetch_params",
                        "stage3_allgather_sequential", "allgather_sequential", "use_multi_rank_bucket_allreduce"}) {
    s.inert(k, "tiermem's collectives are its own: an all-gather per module, a reduce-scatter per bucket");
  }
  s.inert("cpu_offload_param", "deprecated in DeepSpeed: use offload_param.device \"cpu\"");
  s.inert("cpu_offload_use_pin_memory", "deprecated in DeepSpeed: use offload_param / offload_optimizer pin_memory");
  s.inert("leaf_module",
          "not read from the config: mark leaf modules with tiermem.torch.set_z3_leaf_modules(model, classes) before "
          "initialize");
  for (const char* k : {"compute_grad_norm", "zenflow", "legacy_stage1", "parameter_alignment",
                        "pipeline_loading_checkpoint", "override_module_apply", "log_trace_cache_warnings",
                        "enable_sanity_checks", "save_muon_momentum_buffer_in_memory"}) {
    s.inert(k, "not implemented by tiermem");
  }
  if (auto p = s.sub("offload_param")) read_offload(*p, z.offload_param);
  z.offload_optimizer.buffer_count = 4;
  if (auto p = s.sub("offload_optimizer")) {
    // DeepSpeed 0.19.8's offload_optimizer keys that offload_param does not have.
    p->inert("super_offload", "not implemented by tiermem");
    p->inert("cpuadam_cores_perc", "not implemented by tiermem");
    read_offload(*p, z.offload_optimizer);
  }
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
  s.finish();
}

void read_tiermem(Section& s, Config& cfg) {
  auto& t = cfg.tiermem;
  s.get_choice("device", t.device, {"auto", "cuda", "sim"});
  s.get_size("device_budget_bytes", t.device_budget_bytes);
  s.get_size("host_budget_bytes", t.host_budget_bytes);
  s.get_int("numa_node", t.numa_node, -1, 1023);
  s.get_double("sim_h2d_gbps", t.sim_h2d_gbps, 0, 1e4);
  s.get_double("sim_d2h_gbps", t.sim_d2h_gbps, 0, 1e4);
  s.get("sim_host_addressable", t.sim_host_addressable);
  s.get_choice("io_engine", t.io_engine, {"auto", "uring", "posix"});
  s.get("o_direct", t.o_direct);
  s.get("sqpoll", t.sqpoll);
  s.get("fixed_buffers", t.fixed_buffers);
  s.get("checksum", t.checksum);
  s.get_size("stripe_bytes", t.stripe_bytes, 4096, 1ull << 32);
  if (t.stripe_bytes % 4096 != 0) {
    throw ConfigError("tiermem.stripe_bytes", std::to_string(t.stripe_bytes),
                      "config key 'tiermem.stripe_bytes' = " + std::to_string(t.stripe_bytes) +
                          " must be a multiple of 4096 bytes");
  }
  s.get_size("swap_initial_bytes", t.swap_initial_bytes);
  s.get_size("swap_max_bytes", t.swap_max_bytes);
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
  s.get_size("pipeline_chunk_bytes", t.pipeline_chunk_bytes, 4096, 1ull << 32);
  if (t.pipeline_chunk_bytes % 4096 != 0) {
    s.broken("pipeline_chunk_bytes", std::to_string(t.pipeline_chunk_bytes),
             "must be a multiple of 4096 bytes (the O_DIRECT alignment)");
  }
  s.get_int("pipeline_chunks", t.pipeline_chunks, 1, 1024);
  s.get_size("nvme_prefetch_bytes", t.nvme_prefetch_bytes);
  s.get("demote_to_host", t.demote_to_host);
  s.get("overlap_optimizer_step", t.overlap_optimizer_step);
  s.get("update_in_backward", t.update_in_backward);
  s.get("fp32_single_copy", t.fp32_single_copy);
  s.get("host_eviction_plan", t.host_eviction_plan);
  s.get_choice("prefetch_eviction", t.prefetch_eviction, {"auto", "min", "aggressive"});
  s.get_choice("device_optimizer", t.device_optimizer, {"auto", "on", "off"});
  s.get_choice("frozen_dtype", t.frozen_dtype, {"auto", "bf16", "int8"});
  s.get_double("acquire_timeout_s", t.acquire_timeout_s, 0, 1e6);
  if (!(t.acquire_timeout_s > 0)) {
    s.broken("acquire_timeout_s", fmt::format("{}", t.acquire_timeout_s), TiermemConfig::kAcquireTimeoutRule);
  }
  s.get_double("nvme_read_gbps", t.nvme_read_gbps, 0, 1e6, "a number of GB/s");
  s.get_double("nvme_write_gbps", t.nvme_write_gbps, 0, 1e6, "a number of GB/s");
  s.get("machine_profile", t.machine_profile);
  s.get("trace_path", t.trace_path);
  s.inert("trace_path",
          "a trace is started by the program: tiermem-train --trace PATH, or "
          "TIERMEM_TRACE=PATH for any program");
  s.get_choice("log_level", t.log_level, {"trace", "debug", "info", "warn", "error", "off"});
  s.inert("log_level",
          "the log level is read once from the environment: set "
          "TIERMEM_LOG_LEVEL instead");
  s.finish();
}

// tiermem.frozen_dtype and DeepSpeed's zero_optimization.zero_quantized_nontrainable_weights say
// one thing: the first folds into the second's "int8"; a contradiction, or a format that cannot
// apply, is refused naming the keys.
void resolve_frozen_dtype(Config& cfg) {
  constexpr const char* kDs = "zero_optimization.zero_quantized_nontrainable_weights";
  constexpr const char* kOurs = "tiermem.frozen_dtype";
  std::string& d = cfg.tiermem.frozen_dtype;
  if (cfg.given(kDs)) {
    const bool q = cfg.zero.zero_quantized_nontrainable_weights;
    if ((q && cfg.given(kOurs) && d != "int8") || (!q && d == "int8")) {
      throw ConfigError(kOurs, d,
                        fmt::format("config keys '{}' = {} and '{}' = \"{}\" contradict each other: the first "
                                    "means int8 at rest; give one of them",
                                    kDs, q ? "true" : "false", kOurs, d));
    }
    if (q) d = "int8";
  }
  if (d == "auto") return;
  const char* key = cfg.given(kOurs) ? kOurs : kDs;
  if (cfg.zero.stage != 3) {
    throw ConfigError(key, d,
                      fmt::format("config key '{}' (frozen weights at rest in {}) applies to ZeRO stage 3's "
                                  "partitioned parameters: set 'zero_optimization.stage' to 3 (it is {})",
                                  key, d, cfg.zero.stage));
  }
  if (d == "bf16" && cfg.fp16.enabled) {
    throw ConfigError(key, d,
                      fmt::format("config key '{}' = \"bf16\" with 'fp16.enabled': bf16 is no smaller than the "
                                  "fp16 working dtype and keeps fewer mantissa bits; use \"int8\" or \"auto\"",
                                  key));
  }
}

// What the document had that the run ignores: unknown keys and inert ones, said once each.
void warn_about_keys(const Config& cfg, std::string_view source) {
  if (!cfg.unknown_keys.empty()) {
    std::string list;
    for (std::size_t i = 0; i < cfg.unknown_keys.size(); ++i) {
      list += (list.empty() ? "" : ", ") + cfg.unknown_keys[i];
      const std::string& near = i < cfg.unknown_key_suggestions.size() ? cfg.unknown_key_suggestions[i] : "";
      if (!near.empty()) list += " (did you mean '" + near + "'?)";
    }
    // Every rank reads the same document: rank 0 says it, once per document and key.
    TM_LOG_WARN_ONCE_RANK0("CONFIG", "config-unknown:" + std::string(source) + ":" + list,
                           "{}: ignoring unknown keys: {}", source, list);
  }
  for (const InertKey& k : cfg.inert_keys) {
    TM_LOG_WARN_ONCE_RANK0("CONFIG", "config-inert:" + std::string(source) + ":" + k.key,
                           "{}: '{}' is read but has no effect: {}", source, k.key, k.why);
  }
  for (const InertKey& k : cfg.doubtful_values) {
    TM_LOG_WARN_ONCE_RANK0("CONFIG", "config-doubtful:" + std::string(source) + ":" + k.key, "{}: '{}' = {}", source,
                           k.key, k.why);
  }
  if (!cfg.auto_keys.empty()) {
    std::string list;
    for (const auto& k : cfg.auto_keys) list += (list.empty() ? "" : ", ") + k;
    TM_LOG_DEBUG("CONFIG", "{}: \"auto\" keys: {}", source, list);
  }
}

}  // namespace

Config parse_config(std::string_view json_text, std::string_view source) {
  const json root = parse_json_checked(json_text, source);
  Config cfg;
  Section top(root, "", cfg);
  read_batch_keys(top, cfg);
  if (auto s = top.sub("activation_checkpointing")) read_activation_checkpointing(*s, cfg);
  read_inert_top_keys(top);
  if (auto s = top.sub("scheduler")) read_scheduler(*s, cfg);
  if (auto s = top.sub("bf16")) read_bf16(*s, cfg);
  if (auto s = top.sub("fp16")) read_fp16(*s, cfg);
  if (cfg.bf16 && cfg.fp16.enabled) {
    throw ConfigError("fp16.enabled", "true",
                      "config keys 'bf16.enabled' and 'fp16.enabled' are both true: choose one");
  }
  if (auto s = top.sub("optimizer")) read_optimizer(*s, cfg);
  if (auto s = top.sub("aio")) read_aio(*s, cfg);
  if (auto s = top.sub("zero_optimization")) read_zero_optimization(*s, cfg);
  if (auto s = top.sub("tiermem")) read_tiermem(*s, cfg);
  resolve_frozen_dtype(cfg);
  top.finish();
  warn_about_keys(cfg, source);
  return cfg;
}

}  // namespace tiermem
