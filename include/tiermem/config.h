// tiermem/config.h — the one configuration document: DeepSpeed-compatible JSON plus our keys.
//
// A DeepSpeed ds_config.json is read unchanged where meanings match: `aio`,
// `zero_optimization` (with `offload_param` / `offload_optimizer`), `bf16`, `fp16`,
// `train_micro_batch_size_per_gpu`, `gradient_accumulation_steps`, `optimizer.params`.
// Our own keys live under `tiermem`. docs/config.md lists every key with default and unit.
//
// Units: keys copied from DeepSpeed keep DeepSpeed's units — `reduce_bucket_size`,
// `stage3_prefetch_bucket_size`, `stage3_max_live_parameters`, `stage3_max_reuse_distance`,
// `stage3_param_persistence_threshold`, `sub_group_size`, `offload_*.buffer_size` are ELEMENTS
// (fields end in `_elems`); `aio.block_size` and every `tiermem.*` size are BYTES (fields end in
// `_bytes`). Sizes accept JSON numbers (1e9 is fine when integral) or strings: "64MiB", "1GiB",
// "4K" (binary), "500MB" (decimal), "1e8". The value "auto" takes the default here and is listed
// in Config::auto_keys; a program resolves it with its own values and prints auto_resolved_line.
//
// Errors: a wrong type, a negative or out-of-range value, or malformed JSON throws ConfigError
// naming the key path (e.g. "zero_optimization.offload_param.buffer_count"), the value, and what
// is allowed. Unknown keys are not errors: one warning lists them all (Config::unknown_keys).
// DeepSpeed keys read but not acted on get one warning each, with why (Config::inert_keys).
//
// Thread-safety: Config is a plain value; loading functions are reentrant.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tiermem/export.h"

namespace tiermem {

// Where offloaded state lives (DeepSpeed's offload_*.device).
enum class OffloadDevice { kNone, kCpu, kNvme };
TIERMEM_API std::string_view offload_device_name(OffloadDevice d);

struct TIERMEM_API AioConfig {
  std::uint64_t block_size_bytes = 1ull << 20;  // aio.block_size: split requests into this size
  int queue_depth = 32;                         // aio.queue_depth: max in flight per ring
  int intra_op_parallelism = 1;                 // aio.intra_op_parallelism: number of rings
  bool single_submit = false;                   // aio.single_submit: submit one SQE per syscall
  bool overlap_events = true;                   // aio.overlap_events: submit while reaping
};

struct TIERMEM_API OffloadConfig {
  OffloadDevice device = OffloadDevice::kNone;
  std::vector<std::string> nvme_path;  // one swap file per path; string or list in JSON
  // Where nvme_path came from when not this section's key (a program's flag, e.g. "--swap-dir"):
  // errors about the directories name it. Not read from JSON.
  std::string nvme_path_from;
  bool pin_memory = false;             // DeepSpeed default false; tiermem falls back with a warning
  int buffer_count = 5;                // pinned staging buffers (param default 5, optimizer 4)
  bool buffer_count_given = false;     // the config set buffer_count (tiermem says it is not used)
  std::uint64_t buffer_size_elems = 100'000'000;  // offload_param.buffer_size (elements)
  std::uint64_t max_in_cpu_elems = 1'000'000'000; // offload_param.max_in_cpu (elements)
  bool pipeline_read = false;   // offload_optimizer.pipeline_read
  bool pipeline_write = false;  // offload_optimizer.pipeline_write
  double ratio = 1.0;           // offload_optimizer.ratio: share of the optimizer state offloaded; the
                                // rest (stage 3) is homed on the device and stepped there
  static constexpr double kRatioAuto = -1.0;  // "auto": the share the device's idle room holds
};

struct TIERMEM_API ZeroConfig {
  int stage = 0;  // 0..3
  bool overlap_comm = false;  // the parser sets true at stage 3 when the key is absent (DeepSpeed)
  bool contiguous_gradients = true;
  bool reduce_scatter = true;
  std::uint64_t reduce_bucket_size_elems = 500'000'000;
  std::uint64_t allgather_bucket_size_elems = 500'000'000;
  std::uint64_t stage3_prefetch_bucket_size_elems = 50'000'000;
  std::uint64_t stage3_param_persistence_threshold_elems = 100'000;
  std::uint64_t stage3_max_live_parameters_elems = 1'000'000'000;
  std::uint64_t stage3_max_reuse_distance_elems = 1'000'000'000;
  std::uint64_t sub_group_size_elems = 1'000'000'000;
  bool stage3_gather_16bit_weights_on_model_save = false;
  // DeepSpeed's name: true stores frozen (requires_grad=False) modules' working shards as int8
  // with a per-group scale (tiermem.frozen_dtype "int8"; the parser folds it into that key)
  bool zero_quantized_nontrainable_weights = false;
  OffloadConfig offload_param;
  OffloadConfig offload_optimizer;  // buffer_count default 4
};

struct TIERMEM_API Fp16Config {
  bool enabled = false;
  double loss_scale = 0;         // 0 = dynamic
  int initial_scale_power = 16;  // initial scale 2^16
  int loss_scale_window = 1000;  // steps without overflow before the scale doubles
  int hysteresis = 2;            // overflows tolerated before lowering the scale
  double min_loss_scale = 1;
};

// optimizer: type "adam"/"adamw" (AdamW, decoupled decay), "lion" (Chen et al. 2023: betas
// default [0.9, 0.99], decoupled decay) or "adagrad" (torch.optim.Adagrad's rule: L2 decay added to
// the gradient, eps default 1e-10, lr_decay, initial_accumulator_value). Parsed lowercase.
struct TIERMEM_API OptimizerConfig {
  std::string type = "AdamW";
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
  double lr_decay = 0.0;                   // adagrad
  double initial_accumulator_value = 0.0;  // adagrad: the sum's starting value
};

// Our own keys (the `tiermem` section). Sizes in bytes, bandwidths in GB/s (1e9 bytes/s).
struct TIERMEM_API TiermemConfig {
  std::string device = "auto";              // auto | cuda | sim
  std::uint64_t device_budget_bytes = 0;    // 0 = all free device memory (sim: 1 GiB)
  std::uint64_t host_budget_bytes = 0;      // host tier pool; 0 = 1/16 of RAM in [256 MiB, 1 GiB]
  int numa_node = -1;                       // -1 = nearest the GPU (or the calling thread)
  double sim_h2d_gbps = 0;                  // SimDevice copy throttle; 0 = unthrottled
  double sim_d2h_gbps = 0;
  bool sim_host_addressable = true;         // false: SimDevice as CudaDevice (copies only)
  std::string io_engine = "auto";           // auto | uring | posix
  bool o_direct = true;                     // open swap files with O_DIRECT
  bool sqpoll = false;                      // IORING_SETUP_SQPOLL
  bool fixed_buffers = true;                // register pinned pools with io_uring
  bool checksum = true;                     // per-extent XXH3-64, verified on read
  std::uint64_t stripe_bytes = 1ull << 20;  // striping unit across nvme_path entries
  std::uint64_t swap_initial_bytes = 64ull << 20;  // fallocate at open, per path
  std::uint64_t swap_max_bytes = 0;         // growth limit per path; 0 = free space of the fs
  std::uint64_t pipeline_chunk_bytes = 8ull << 20;  // NVMe->host->device pipeline chunk
  int pipeline_chunks = 4;                  // pinned bounce chunks in flight
  std::uint64_t nvme_prefetch_bytes = 256ull << 20;  // NVMe->host prefetch look-ahead
  bool demote_to_host = true;  // a clean device copy evicted goes to the host tier (TensorStoreOptions)
  // ZeRO-3: each module's AdamW update at its next gather; unset ("auto"): on when the optimizer
  // state is on NVMe (offload_optimizer.device nvme)
  std::optional<bool> overlap_optimizer_step;
  // ZeRO-3 on one rank, no gradient clipping, no fp16: at the accumulation boundary each module's
  // update runs during backward once its gradient is complete (ZeroEngine::step_in_backward)
  bool update_in_backward = false;
  // fp32 training, ZeRO-3: a module's working shard is its fp32 master (one copy on its home tier,
  // not two) when the parameters and the optimizer state share a home tier
  bool fp32_single_copy = true;
  bool host_eviction_plan = true;           // Prefetcher: Belady plan of the host tier (write-behind, read-ahead room)
  // What a prefetch may evict (PrefetcherOptions::aggressive_prefetch): "min" (what Belady's MIN
  // evicts before the prefetched tensor's use), "aggressive" (anything used after it), "auto" (=
  // "aggressive" on a forward-only engine, "min" otherwise)
  std::string prefetch_eviction = "auto";
  std::string device_optimizer = "auto";    // auto | on | off: offload_optimizer none on the device
  // How frozen modules' stage-3 working shards are stored on their tier (tiermem/quantize.h):
  // "auto" = the working dtype, "bf16", or "int8" (per-128 absmax; also set by
  // zero_optimization.zero_quantized_nontrainable_weights); dequantized at every gather
  std::string frozen_dtype = "auto";
  double acquire_timeout_s = 30;            // wait for a release before OutOfMemoryError; > 0
  // The rule a value of acquire_timeout_s <= 0 breaks, as its ConfigError says it (parse time, and
  // TensorStoreOptions::from_config for a Config built in code).
  static constexpr const char* kAcquireTimeoutRule =
      "must be > 0 seconds: an access waits up to this long for its tensor's read in flight and for a "
      "full tier to free up, so 0 fails accesses that would succeed (the default is 30)";
  // The NVMe's rates, for ZeroStats' I/O bound of a step (nothing else reads them); 0 = unknown:
  // machine_profile's, when given. resolve_nvme_rates says which apply.
  double nvme_read_gbps = 0;
  double nvme_write_gbps = 0;
  std::string machine_profile;              // path of tiermem-bench profile --json's output; "" = none
  std::string trace_path;                   // Chrome trace output ("" = off; env TIERMEM_TRACE)
  std::string log_level = "info";           // trace|debug|info|warn|error|off
};

// DeepSpeed's `scheduler` section (deepspeed/runtime/lr_schedules.py). tiermem-train and
// tiermem.torch map it onto a learning rate per step (tiermem/lr_schedule.h, tiermem::train_state);
// the engine itself has no schedule.
// A parameter that is absent or "auto" stays unset here, and the trainer fills it with its own
// value (peak lr, warm-up steps, total steps); the shape parameters take DeepSpeed's defaults.
struct TIERMEM_API SchedulerConfig {
  std::string type;                           // "" (no section: the trainer's own schedule),
                                              // "WarmupLR", "WarmupDecayLR" or "WarmupCosineLR"
  std::optional<double> warmup_min_lr;        // WarmupLR/WarmupDecayLR: start of the warm-up; 0
  std::optional<double> warmup_max_lr;        // WarmupLR/WarmupDecayLR: peak lr; unset = trainer's
  std::optional<long long> warmup_num_steps;  // steps of warm-up; unset = trainer's warm-up
  std::optional<long long> total_num_steps;   // WarmupDecayLR/WarmupCosineLR; unset = run length
  std::string warmup_type = "log";            // "log" or "linear" (DeepSpeed's default: log)
  double warmup_min_ratio = 0.0;              // WarmupCosineLR: lr / peak at step 0
  double cos_min_ratio = 0.0001;              // WarmupCosineLR: lr / peak at total_num_steps
};

// DeepSpeed's `activation_checkpointing` section (deepspeed/runtime/activation_checkpointing/
// config.py). The library only reads it; tiermem-train's GPT checkpoints every transformer block
// when the section is present (or with --activation-checkpointing): it keeps each block's input
// and recomputes the block's forward in its backward step (src/gpt/model.h).
// partition_activations, contiguous_memory_optimization, number_checkpoints,
// synchronize_checkpoint_boundary and profile are read and warned (Config::inert_keys).
struct TIERMEM_API ActivationCheckpointingConfig {
  bool enabled = false;            // the section is present (or the trainer's flag)
  bool cpu_checkpointing = false;  // keep the block inputs in host memory (the CPU model's
                                   // activations are host memory, so true is what it does)
};

// A key that was read but has no effect, with the reason (one warning each, at parse time).
struct TIERMEM_API InertKey {
  std::string key;  // full key path, e.g. "zero_optimization.contiguous_gradients"
  std::string why;
};

struct TIERMEM_API Config {
  // DeepSpeed's batch triple: train_batch_size = micro-batch x accumulation x world size. The
  // parser only reads them; resolve_batch_sizes() derives the missing one (given_keys says which
  // were written with a value) once the world size is known.
  int train_batch_size = 1;
  int train_micro_batch_size_per_gpu = 1;
  int gradient_accumulation_steps = 1;
  double gradient_clipping = 0;  // 0 = off
  bool bf16 = false;
  Fp16Config fp16;
  OptimizerConfig optimizer;
  AioConfig aio;
  ZeroConfig zero;
  TiermemConfig tiermem;
  SchedulerConfig scheduler;
  ActivationCheckpointingConfig activation_checkpointing;

  std::vector<std::string> unknown_keys;  // full key paths, for the one warning
  // Per unknown key (same order): the known key of its section it is nearest to in spelling, as a
  // full path ("tiermem.host_budget_bytes" for "tiermem.host_budget"), or "" when none is near.
  std::vector<std::string> unknown_key_suggestions;
  std::vector<std::string> auto_keys;     // keys given as "auto" and resolved to defaults
  std::vector<std::string> given_keys;    // keys written with a value (not absent, not "auto")
  std::vector<InertKey> inert_keys;       // keys read but not acted on (one warning each)
  std::vector<InertKey> doubtful_values;  // values that run but are likely a slip (one warning each)

  // True when `key_path` ("optimizer.params.lr") was written in the document with a value.
  bool given(std::string_view key_path) const;
  // True when `key_path` was written as "auto".
  bool is_auto(std::string_view key_path) const;
};

// The batch triple as DeepSpeed derives it (runtime/config.py, _set_batch_related_parameters):
// each of the three may be unset; the missing one comes from the other two and the world size
// (only train_batch_size: accumulation 1; only the micro-batch: accumulation 1). Throws
// ConfigError naming the keys (or the names in `names`, e.g. a command-line flag) when the three
// disagree, a division leaves a remainder, or neither train_batch_size nor the micro-batch is set.
struct TIERMEM_API BatchSizes {
  long long train_batch_size = 0, micro_batch_per_gpu = 0, gradient_accumulation_steps = 0;
};
struct TIERMEM_API BatchKeyNames {
  std::string train = "train_batch_size";
  std::string micro = "train_micro_batch_size_per_gpu";
  std::string accum = "gradient_accumulation_steps";
};
TIERMEM_API BatchSizes derive_batch_sizes(std::optional<long long> train_batch,
                              std::optional<long long> micro_batch,
                              std::optional<long long> grad_accum, int world_size,
                              const BatchKeyNames& names = {});

// Applies derive_batch_sizes to `config` with the keys its document gave, writing all three.
TIERMEM_API void resolve_batch_sizes(Config& config, int world_size);

// "auto" resolved: key=value, ... for every key in config.auto_keys, with the value it has now
// in `config` (config_to_json) and, when `sources` names one, where it came from
// ("train_micro_batch_size_per_gpu=8 (--batch)"). A key still "auto" (tiermem.device, resolved
// when the engine starts, which logs its choice) is left out. Empty when no key is listed.
TIERMEM_API std::string auto_resolved_line(
    const Config& config, const std::vector<std::pair<std::string, std::string>>& sources = {});

// The NVMe rates (GB/s = 1e9 bytes/s) ZeroStats prices a step's I/O at: each of
// tiermem.nvme_read_gbps / nvme_write_gbps when > 0, else the figure of the profile
// tiermem.machine_profile names (the JSON tiermem-bench profile --json prints, its last line
// {"profile": {...}}, or a written profile object), else 0 (unknown). `source` says where they came
// from ("config", "profile <path>", "config and profile <path>", "" when both are 0). Reads the
// profile file only when a rate is not in the config. Throws ConfigError naming
// tiermem.machine_profile, the path and what to do when the file cannot be read, is not JSON, or
// lacks a positive, finite nvme_read_gbps / nvme_write_gbps.
struct TIERMEM_API NvmeRates {
  double read_gbps = 0, write_gbps = 0;
  std::string source;
};
TIERMEM_API NvmeRates resolve_nvme_rates(const Config& config);

// Parses JSON text. `source` names it in errors (a path or "<string>"). Logs one warning listing
// unknown keys and one warning per key read but not acted on (Config::inert_keys); the "auto"
// keys are listed at debug level only (a program prints auto_resolved_line once it has resolved
// them). Throws ConfigError naming the key path, the value and the rule.
TIERMEM_API Config parse_config(std::string_view json_text, std::string_view source = "<string>");

// Reads and parses a file. A missing/unreadable file is a ConfigError naming the path.
TIERMEM_API Config load_config(const std::string& path);

// "64MiB" -> 67108864. Accepts an unsigned integer, scientific notation that is integral ("1e9"),
// and suffixes K/M/G/T (binary, like fio), KiB/MiB/GiB/TiB (binary), KB/MB/GB/TB (decimal),
// B. Case-insensitive; blanks between number and suffix allowed. Throws ConfigError with key_path
// (a key_path starting with "-" is named as a command-line option in the message).
TIERMEM_API std::uint64_t parse_size(std::string_view text, std::string_view key_path = "size");

// The effective configuration as JSON (every key, resolved), for logs and checkpoint manifests.
TIERMEM_API std::string config_to_json(const Config& config, int indent = 2);

}  // namespace tiermem
