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
// "4K" (binary), "500MB" (decimal), "1e8". The value "auto" takes the default and is logged.
//
// Errors: a wrong type, a negative or out-of-range value, or malformed JSON throws ConfigError
// naming the key path (e.g. "zero_optimization.offload_param.buffer_count"), the value, and what
// is allowed. Unknown keys are not errors: one warning lists them all (Config::unknown_keys).
//
// Thread-safety: Config is a plain value; loading functions are reentrant.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace tiermem {

// Where offloaded state lives (DeepSpeed's offload_*.device).
enum class OffloadDevice { kNone, kCpu, kNvme };
std::string_view offload_device_name(OffloadDevice d);

struct AioConfig {
  std::uint64_t block_size_bytes = 1ull << 20;  // aio.block_size: split requests into this size
  int queue_depth = 32;                         // aio.queue_depth: max in flight per ring
  int intra_op_parallelism = 1;                 // aio.intra_op_parallelism: number of rings
  bool single_submit = false;                   // aio.single_submit: submit one SQE per syscall
  bool overlap_events = true;                   // aio.overlap_events: submit while reaping
};

struct OffloadConfig {
  OffloadDevice device = OffloadDevice::kNone;
  std::vector<std::string> nvme_path;  // one swap file per path; string or list in JSON
  bool pin_memory = false;             // DeepSpeed default false; tiermem falls back with a warning
  int buffer_count = 5;                // pinned staging buffers (param default 5, optimizer 4)
  std::uint64_t buffer_size_elems = 100'000'000;  // offload_param.buffer_size (elements)
  std::uint64_t max_in_cpu_elems = 1'000'000'000; // offload_param.max_in_cpu (elements)
  bool pipeline_read = false;   // offload_optimizer.pipeline_read
  bool pipeline_write = false;  // offload_optimizer.pipeline_write
  double ratio = 1.0;           // offload_optimizer.ratio (fraction offloaded; only 1.0 supported)
};

struct ZeroConfig {
  int stage = 0;  // 0..3
  bool overlap_comm = false;
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
  OffloadConfig offload_param;
  OffloadConfig offload_optimizer;  // buffer_count default 4
};

struct Fp16Config {
  bool enabled = false;
  double loss_scale = 0;         // 0 = dynamic
  int initial_scale_power = 16;  // initial scale 2^16
  int loss_scale_window = 1000;  // steps without overflow before the scale doubles
  int hysteresis = 2;            // overflows tolerated before lowering the scale
  double min_loss_scale = 1;
};

struct OptimizerConfig {
  std::string type = "AdamW";
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.01;
};

// Our own keys (the `tiermem` section). Sizes in bytes, bandwidths in GB/s (1e9 bytes/s).
struct TiermemConfig {
  std::string device = "auto";              // auto | cuda | sim
  std::uint64_t device_budget_bytes = 0;    // 0 = all free device memory (sim: 1 GiB)
  std::uint64_t host_budget_bytes = 0;      // pinned host pool; 0 = 1/4 of physical memory
  int numa_node = -1;                       // -1 = nearest the GPU (or the calling thread)
  double sim_h2d_gbps = 0;                  // SimDevice copy throttle; 0 = unthrottled
  double sim_d2h_gbps = 0;
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
  double acquire_timeout_s = 30;            // wait for a release before OutOfMemoryError
  std::string trace_path;                   // Chrome trace output ("" = off; env TIERMEM_TRACE)
  std::string log_level = "info";           // trace|debug|info|warn|error|off
};

struct Config {
  int train_micro_batch_size_per_gpu = 1;
  int gradient_accumulation_steps = 1;
  double gradient_clipping = 0;  // 0 = off
  bool bf16 = false;
  Fp16Config fp16;
  OptimizerConfig optimizer;
  AioConfig aio;
  ZeroConfig zero;
  TiermemConfig tiermem;

  std::vector<std::string> unknown_keys;  // full key paths, for the one warning
  std::vector<std::string> auto_keys;     // keys given as "auto" and resolved to defaults
};

// Parses JSON text. `source` names it in errors (a path or "<string>"). Logs one warning listing
// unknown keys and one info line listing resolved "auto" keys. Throws ConfigError.
Config parse_config(std::string_view json_text, std::string_view source = "<string>");

// Reads and parses a file. A missing/unreadable file is a ConfigError naming the path.
Config load_config(const std::string& path);

// "64MiB" -> 67108864. Accepts an unsigned integer, scientific notation that is integral ("1e9"),
// and suffixes K/M/G/T (binary, like fio), KiB/MiB/GiB/TiB (binary), KB/MB/GB/TB (decimal),
// B. Case-insensitive; blanks between number and suffix allowed. Throws ConfigError with key_path
// (a key_path starting with "-" is named as a command-line option in the message).
std::uint64_t parse_size(std::string_view text, std::string_view key_path = "size");

// The effective configuration as JSON (every key, resolved), for logs and checkpoint manifests.
std::string config_to_json(const Config& config, int indent = 2);

}  // namespace tiermem
