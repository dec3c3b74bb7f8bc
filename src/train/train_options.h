// src/train/train_options.h — tiermem-train's command line (CLI11) and how it combines with
// the DeepSpeed-style `--config` file.
//
// Precedence: a flag given on the command line > the --config file > the built-in default. The
// built-in default is the demo: ZeRO stage 3 with parameters and optimizer state offloaded to
// NVMe under --swap-dir, on the simulated device when no GPU is visible.
//
// Thread-safety: plain values and reentrant functions.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "gpt/model.h"
#include "tiermem/config.h"
#include "tiermem/error.h"

namespace tiermem::train {

struct TrainOptions {
  std::string model = "mini";      // preset name (tiny, mini, gpt2, gpt2-medium, ...) or custom
  int n_layer = 0, n_head = 0, d_model = 0;  // --model custom (n_head 0: d_model / 64, at least 1)
  bool io_only = false;  // --io-only: the engine's traffic without the model's compute (benches)
  std::string data;                // "" = the default corpus (data.h)
  int steps = 0;                   // optimizer steps; 0 = the demo default for the model
  int batch = 0;                   // micro-batch per rank (sequences); 0 = config / default
  int grad_accum = 0;              // micro-batches per step; 0 = config / 1
  int seq_len = 0;                 // tokens per sequence; 0 = the model's default
  double lr = 0;                   // peak learning rate; 0 = config optimizer.params.lr / default
  int warmup = -1;                 // linear warm-up steps; -1 = default (steps / 10, max 100)
  int eval_every = -1;             // eval loss every N steps (and at the end); 0 = never
  int eval_batches = 4;            // held-out micro-batches per eval
  std::string config_path;         // --config ds_config.json
  std::string device;              // auto | cuda | sim; "" = config / auto
  std::uint64_t device_budget_bytes = 0;  // 0 = auto: (params + optimizer state) / 8 ... see .cc
  std::uint64_t host_budget_bytes = 0;    // 0 = the engine's default (see tiermem/zero_plan.h)
  std::string swap_dir;            // "" = config nvme_path, else ./tiermem-swap
  std::string offload;             // none | cpu | nvme: shortcut for both offload_* devices
  std::string engine = "auto";     // auto | store | zero | resident (train_engines.h)
  std::string save_dir;
  int save_every = 0;
  int stop_at = 0;                 // stop after this step, as if interrupted (0 = run to --steps)              // 0 = only at the end (when --save is given)
  std::string resume_dir;
  std::string trace_path;
  bool json = false;
  std::uint64_t seed = 1337;
  int vocab_size = 0;              // --vocab-size; 0 = the preset's (text data: 256, with a note)
  bool activation_checkpointing = false;  // --activation-checkpointing (config: the section)

  // Which values came from the command line (they override the config file).
  bool batch_given = false, grad_accum_given = false, lr_given = false;
};

// A command-line value that parses but cannot work (a swap or save path that is a file, on a
// read-only filesystem or without O_DIRECT; an absurd or too small device budget). run_training
// prints it as one line and exits with code 2, like a flag CLI11 rejects.
class UsageError : public ConfigError {
 public:
  using ConfigError::ConfigError;
};

// Parses argv. On --help prints the help to stdout and returns 0; on a bad flag or value prints
// one line "tiermem-train: error: ..." to stderr and returns 2; on success returns -1 and fills
// *out. Never throws.
int parse_train_options(int argc, char** argv, TrainOptions* out);

// The demo's own settings per model preset: what a value not given on the command line, or
// absent / "auto" in --config, becomes.
struct DemoDefaults {
  int steps, batch, seq_len, warmup, eval_every;
  double lr;
};
DemoDefaults demo_defaults(const std::string& model);
inline constexpr double kDemoGradientClipping = 1.0;  // gradient_clipping absent or "auto"
inline constexpr double kDemoWeightDecay = 0.0;       // optimizer.params.weight_decay absent

// Builds the effective Config: the --config file (or the demo's defaults), then the command-line
// overrides. A key that is absent or "auto" takes tiermem-train's own value, as in Hugging Face's
// DeepSpeed integration: the micro-batch (--batch, else the demo's), optimizer.params.lr (--lr,
// else the demo's), weight_decay 0, gradient_clipping 1.0, and the scheduler's peak lr, warm-up
// and total steps (--lr, --warmup, --steps). The batch triple is then derived as DeepSpeed does
// (derive_batch_sizes) over `world_size` ranks. Rank 0 logs one line listing every value "auto"
// became. nvme_path holds the base swap directories; rank r's engine swaps into <dir>/rank<r>.
// Throws ConfigError (bad file or value; an inconsistent batch triple names the keys or flags).
Config effective_config(const TrainOptions& opts, int rank, int world_size);
// The same, with the world size from the launcher's environment (detect_ranks).
Config effective_config(const TrainOptions& opts, int rank);

// The model the options ask for: the preset, or --model custom's dimensions (GPT-2's vocabulary
// 50257, seq_len --seq-len or 1024), before the data decides the vocabulary.
gpt::GptConfig asked_model(const TrainOptions& opts);

// True when --data names a uint16 token file (*.bin); text otherwise (byte-level tokens).
bool data_is_token_file(const TrainOptions& opts);

// The vocabulary a run trains: --vocab-size when given (at least 256 with text data, else a
// UsageError naming the flag; a token file's ids are checked against it when it loads), else the
// preset's own, except that text data is byte-level (256).
int train_vocab_size(const TrainOptions& opts);

// When train_vocab_size() makes the model smaller than asked (text data and a preset with a
// larger vocabulary: the GPT-2 family and custom, 50257), the one line saying so with the
// parameter count it trains ("--model gpt2 with text data: vocabulary 50257 -> 256 (byte-level
// tokens), so it trains 85.xx M parameters, not the preset's 124.44 M ...; --vocab-size 50257
// keeps it"); empty otherwise (tiny's 64 grows to 256 without a word: it is a test model).
std::string vocab_change_note(const TrainOptions& opts);

// Checks, before anything is built, that every directory the run will write is usable: each
// swap directory (nvme offload; created 0700 if missing; a probe file opened with O_DIRECT unless
// tiermem.o_direct is false) and the --save directory (created if missing, as the umask says; a
// probe file written). Either is refused when owned by another user or world-writable without
// the sticky bit (unsafe_directory_reason, tiermem/dir_lock.h). Also rejects a device budget
// above 1 PiB (no device has that). Throws UsageError naming the flag (or config key), the path
// and the reason (errno text, or who owns it / its mode); leaves no probe files and removes
// the (empty) directories it created, so a run refused afterwards leaves nothing behind.
void check_run_paths(const TrainOptions& opts, const Config& cfg);

// The NVMe swap directories the run uses (every nvme_path of an offload to NVMe, once each; none
// for --engine resident), and the key that names them in errors (--swap-dir when given).
// --save's room, before the first step: UsageError (exit 2) when the filesystem that holds `dir`
// (or, while it does not exist yet, its nearest existing parent) has fewer than `checkpoint_bytes`
// free, naming both; a checkpoint is written new before the old one goes, so this is what one
// save needs even when an older checkpoint is there. Without it a run too big for its --save
// filesystem trained until its first save and failed there (ENOSPC). Nothing is created.
void check_save_room(const std::string& dir, std::uint64_t checkpoint_bytes);

std::vector<std::string> swap_dirs(const TrainOptions& opts, const Config& cfg);
std::string swap_dir_key(const TrainOptions& opts);

// The model presets tiermem-train accepts.
const char* const* model_preset_names();  // nullptr-terminated

}  // namespace tiermem::train
