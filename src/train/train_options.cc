// src/train/train_options.cc — command line and effective configuration (train_options.h).
#include "train/train_options.h"

#include "core/cli_checks.h"

#include <charconv>

#include "tiermem/env.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fmt/format.h>
#include <optional>
#include <utility>
#include <vector>

#include "train/data.h"
#include "gpt/model.h"
#include "tiermem/dir_lock.h"
#include "tiermem/error.h"
#include "tiermem/log.h"
#include "train/train_engines.h"

namespace tiermem::train {
namespace {

constexpr const char* kPresets[] = {"tiny",       "mini",       "gpt2", "gpt2-medium",
                                    "gpt2-large", "gpt2-xl",    "custom",  nullptr};

bool known_preset(const std::string& name) {
  for (const char* const* p = kPresets; *p; ++p)
    if (name == *p) return true;
  return false;
}

std::string preset_list() {
  std::string s;
  for (const char* const* p = kPresets; *p; ++p) s += (s.empty() ? "" : ", ") + std::string(*p);
  return s;
}

}  // namespace

const char* const* model_preset_names() { return kPresets; }

DemoDefaults demo_defaults(const std::string& model) {
  if (model == "tiny") return {20, 4, 16, 2, 10, 3e-3};
  if (model == "mini") return {kMiniDemoSteps, 8, 128, 10, 25, 2e-3};
  return {3, 1, 128, 1, 0, 3e-4};  // gpt2*: a few steps to measure throughput
}

gpt::GptConfig asked_model(const TrainOptions& o) {
  if (o.model != "custom") return gpt::GptConfig::named(o.model);
  gpt::GptConfig m;
  m.n_layer = o.n_layer;
  m.d_model = o.d_model;
  m.n_head = o.n_head > 0 ? o.n_head : std::max(1, o.d_model / 64);
  m.seq_len = o.seq_len > 0 ? o.seq_len : 1024;
  m.vocab_size = 50257;  // GPT-2's
  m.validate();
  return m;
}

bool data_is_token_file(const TrainOptions& opts) {
  const std::string data = opts.data.empty() ? std::string(kDefaultCorpus) : opts.data;
  std::error_code ec;
  return std::filesystem::path(data).extension() == ".bin" &&
         !std::filesystem::is_directory(data, ec);
}

int train_vocab_size(const TrainOptions& opts) {
  const bool bin = data_is_token_file(opts);
  if (opts.vocab_size > 0) {
    if (!bin && opts.vocab_size < kByteVocab) {
      throw UsageError("--vocab-size", std::to_string(opts.vocab_size),
                       fmt::format("--vocab-size {} is too small for text data, which is "
                                   "byte-level: token ids 0 to 255 need a vocabulary of at least "
                                   "{}",
                                   opts.vocab_size, kByteVocab));
    }
    return opts.vocab_size;
  }
  return bin ? asked_model(opts).vocab_size : kByteVocab;
}

std::string vocab_change_note(const TrainOptions& opts) {
  gpt::GptConfig m = asked_model(opts);
  const int trained = train_vocab_size(opts);
  // Only a model whose vocabulary is larger (the GPT-2 family: 50257) becomes a smaller one.
  if (opts.vocab_size > 0 || trained >= m.vocab_size) return "";
  const int asked = m.vocab_size;
  const double asked_params = static_cast<double>(gpt::num_params(m));
  m.vocab_size = trained;
  return fmt::format(
      "--model {} with text data: vocabulary {} -> {} (byte-level tokens), so it trains {:.2f} M "
      "parameters, not the {}'s {:.2f} M (--vocab-size {} keeps them; a uint16 token file *.bin "
      "keeps the vocabulary)",
      opts.model, asked, trained, static_cast<double>(gpt::num_params(m)) / 1e6,
      opts.model == "custom" ? "model" : "preset", asked_params / 1e6, asked);
}

int parse_train_options(int argc, char** argv, TrainOptions* out) {
  TrainOptions o;
  CLI::App app{
      "tiermem-train: trains a GPT whose parameters and optimizer state do not fit the device,\n"
      "paging them through pinned host memory and NVMe (ZeRO stage 3 over tiermem).\n"
      "With no arguments: the `mini` model on the fortunes corpus, byte-level tokens, ZeRO-3\n"
      "with parameters and Adam state offloaded to NVMe in ./tiermem-swap, on a device budget\n"
      "8x smaller than that state (under a minute on two idle CPU cores; README.md).",
      "tiermem-train"};
  app.get_formatter()->column_width(34);
  std::string budget_text, host_budget_text, offload_text;

  app.add_option("--model", o.model, "model preset: " + preset_list())
      ->default_val(o.model)
      ->check([](const std::string& v) {
        return known_preset(v) ? std::string() : "unknown model '" + v + "' (known: " +
                                                     preset_list() + ")";
      });
  app.add_option("--layers", o.n_layer, "--model custom: transformer blocks")
      ->check(cli::whole_number_check())->check(CLI::Range(1, 4096));
  app.add_option("--heads", o.n_head, "--model custom: attention heads [default: d_model / 64]")
      ->check(cli::whole_number_check())->check(CLI::Range(1, 4096));
  app.add_option("--d-model", o.d_model, "--model custom: embedding width (a multiple of --heads)")
      ->check(cli::whole_number_check())->check(CLI::Range(1, 1 << 20));
  app.add_flag("--io-only", o.io_only,
               "benchmarks only: run every gather, gradient reduction and optimizer step with "
               "zero gradients and no model compute (the losses are meaningless)");
  app.add_option("--vocab-size", o.vocab_size,
                 "vocabulary of the model [default: the preset's with a token file *.bin; 256 "
                 "(byte-level tokens) with text data, said in one line when that shrinks the "
                 "model]; with text, at least 256 (larger keeps e.g. gpt2's 124 M parameters)")
      ->check(cli::whole_number_check())->check(CLI::Range(1, 1 << 24));
  app.add_flag("--activation-checkpointing", o.activation_checkpointing,
               "keep only each transformer block's input in forward and recompute the block in "
               "backward: less activation memory for one more forward per step (config: an "
               "activation_checkpointing section)");
  app.add_option("--data", o.data,
                 "training data: a text file, a directory of text files (recursive), or a "
                 "uint16 token file *.bin (llm.c with header, or nanoGPT headerless) "
                 "[default: /usr/share/games/fortunes]");
  app.add_option("--steps", o.steps, "optimizer steps [default: the demo's, per model]")
      ->check(cli::whole_number_check())->check(CLI::Range(1, 100000000));
  app.add_option("--batch", o.batch,
                 "micro-batch per rank, sequences (config: train_micro_batch_size_per_gpu)")
      ->check(cli::whole_number_check())->check(CLI::Range(1, 1 << 20));
  app.add_option("--grad-accum", o.grad_accum,
                 "micro-batches per optimizer step (config: gradient_accumulation_steps)")
      ->check(cli::whole_number_check())->check(CLI::Range(1, 1 << 20));
  app.add_option("--seq-len", o.seq_len, "tokens per sequence [default: the model's]")
      ->check(cli::whole_number_check())->check(CLI::Range(1, 1 << 20));
  app.add_option("--lr", o.lr, "peak learning rate (config: optimizer.params.lr)")
      ->check(cli::number_check())->check(cli::within(1e-12, 10.0))->check(CLI::Range(1e-12, 10.0));
  app.add_option("--warmup", o.warmup, "linear warm-up steps, then cosine decay to lr/10")
      ->check(cli::whole_number_check())->check(CLI::Range(0, 100000000));
  app.add_option("--eval-every", o.eval_every,
                 "held-out eval loss every N steps and at the end; 0 = never")
      ->check(cli::whole_number_check())->check(CLI::Range(0, 100000000));
  app.add_option("--eval-batches", o.eval_batches, "micro-batches per eval")
      ->default_val(o.eval_batches)
      ->check(cli::whole_number_check())->check(CLI::Range(1, 100000));
  app.add_option("--config", o.config_path,
                 "DeepSpeed-style ds_config.json (zero_optimization, bf16/fp16, aio, tiermem; "
                 "see docs/config.md)")
      ->check(CLI::ExistingFile);
  app.add_option("--device", o.device, "compute device: auto (CUDA if visible, else sim), cuda, sim")
      ->check(CLI::IsMember({"auto", "cuda", "sim"}));
  auto size_check = [](const char* flag) {
    return [flag](const std::string& v) {
      try {
        if (parse_size(v, flag) == 0) return std::string("must be > 0");
        return std::string();
      } catch (const Error& e) {
        return std::string(e.what());
      }
    };
  };
  app.add_option("--device-budget", budget_text,
                 "device memory tiermem may use, e.g. 64MiB [default: the device's (sim: 1 GiB); "
                 "the no-argument demo: (params + optimizer state) / 8]")
      ->check(size_check("--device-budget"));
  app.add_option("--host-budget", host_budget_text,
                 "host memory for the tier pool (homes, caches, optimizer sub-groups), e.g. 2GiB "
                 "[default: 1/16 of RAM within 256 MiB..1 GiB; the demo: state / 4]")
      ->check(size_check("--host-budget"));
  app.add_option("--swap-dir", o.swap_dir,
                 "NVMe swap directory; rank r uses DIR/rank<r> [default: the config's nvme_path, "
                 "else ./tiermem-swap]");
  app.add_option("--offload", offload_text,
                 "shortcut: offload_param and offload_optimizer device (none, cpu, nvme); "
                 "cpu/nvme imply ZeRO stage 3")
      ->check(CLI::IsMember({"none", "cpu", "nvme"}));
  app.add_option("--engine", o.engine,
                 "who holds parameters and optimizer state: zero (tiermem::ZeroEngine: device, "
                 "host and NVMe tiers under budgets, any number of ranks), resident (plain host "
                 "memory, the reference), auto (resident for stage 0 without offload on one "
                 "rank, else zero); store is a synonym of zero")
      ->default_val(o.engine)
      ->check(CLI::IsMember({"auto", "store", "zero", "resident"}));
  app.add_option("--save", o.save_dir, "write a checkpoint to DIR at the end (and --save-every)");
  app.add_option("--save-every", o.save_every, "checkpoint every N steps (needs --save)")
      ->check(cli::whole_number_check())->check(CLI::Range(1, 100000000));
  app.add_option("--stop-at", o.stop_at,
                 "stop after step N as if interrupted (checkpointing first with --save); the "
                 "schedule still runs to --steps, so --resume continues exactly")
      ->check(cli::whole_number_check())->check(CLI::Range(1, 100000000));
  app.add_option("--resume", o.resume_dir, "continue from the checkpoint in DIR (at the saved world size or another: "
                 "keep --batch x ranks as saved)")
      ->check(CLI::ExistingDirectory);
  app.add_option("--trace", o.trace_path,
                 "write a Chrome trace (open in https://ui.perfetto.dev)");
  app.add_flag("--json", o.json,
               "stdout: one JSON object per step, and {\"summary\": {...}} as the last line");
  app.add_option("--seed", o.seed, "seed of the initial weights and the data order")
      ->default_val(o.seed);

  try {
    app.parse(argc, argv);
    if (!budget_text.empty()) o.device_budget_bytes = parse_size(budget_text, "--device-budget");
    if (!host_budget_text.empty()) o.host_budget_bytes = parse_size(host_budget_text, "--host-budget");
    o.offload = offload_text;
    o.batch_given = app.count("--batch") > 0;
    o.grad_accum_given = app.count("--grad-accum") > 0;
    o.lr_given = app.count("--lr") > 0;
    for (const auto& [flag, value] : {std::pair<const char*, const std::string*>{"--swap-dir", &o.swap_dir},
                                      {"--save", &o.save_dir}, {"--trace", &o.trace_path}}) {
      if (app.count(flag) > 0 && value->empty())
        throw CLI::ValidationError(flag, "is empty: give a path");
    }
    // A --resume directory must hold a checkpoint: said now, before the engine is built
    // (CheckpointReader still verifies the manifest and the state files as the run resumes).
    if (!o.resume_dir.empty()) {
      std::error_code ec;
      if (!std::filesystem::is_regular_file(
              std::filesystem::path(o.resume_dir) / "rank0" / "manifest.json", ec))
        throw CLI::ValidationError(
            "--resume",
            "'" + o.resume_dir +
                "' is not a checkpoint directory: it has no rank0/manifest.json (a checkpoint "
                "directory holds rank<r>/manifest.json and the state file it names, per rank "
                "saved); give the directory a run's --save DIR wrote");
    }
    const bool custom_dims = app.count("--layers") + app.count("--heads") + app.count("--d-model") > 0;
    if (o.model == "custom" && (o.n_layer == 0 || o.d_model == 0))
      throw CLI::ValidationError("--model custom", "needs --layers and --d-model (and optionally --heads)");
    if (o.model != "custom" && custom_dims)
      throw CLI::ValidationError("--layers/--heads/--d-model", "only with --model custom");
    if (o.save_every > 0 && o.save_dir.empty())
      throw CLI::ValidationError("--save-every", "needs --save DIR");
    if (o.stop_at > 0 && app.count("--steps") > 0 && o.stop_at > o.steps)
      throw CLI::ValidationError("--stop-at", fmt::format("step {} is past --steps {}", o.stop_at, o.steps));
    // TIERMEM_STOP_AT=N: the documented commands run as printed but stop after step N (the README
    // doc test, tests/doc/run_doc_commands.py); as --stop-at, the schedule still spans --steps.
    if (auto v = env_param("TIERMEM_STOP_AT"); v && o.stop_at == 0) {
      int n = 0;
      const auto [end, ec] = std::from_chars(v->data(), v->data() + v->size(), n);
      if (ec != std::errc() || end != v->data() + v->size() || n < 1)
        throw CLI::ValidationError("TIERMEM_STOP_AT", "must be a whole number >= 1, got '" + *v + "'");
      o.stop_at = n;
      std::fprintf(stderr, "tiermem-train: TIERMEM_STOP_AT=%d: stopping after step %d\n", n, n);
    }
  } catch (const CLI::CallForHelp&) {
    std::fputs(app.help().c_str(), stdout);
    return 0;
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "tiermem-train: error: %s (see --help)\n", cli::parse_error_text(e).c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tiermem-train: error: %s (see --help)\n", e.what());
    return 2;
  }
  *out = std::move(o);
  return -1;
}

Config effective_config(const TrainOptions& opts, int rank) {
  return effective_config(opts, rank, detect_ranks().world_size);
}

Config effective_config(const TrainOptions& opts, int rank, int world_size) {
  const DemoDefaults d = demo_defaults(opts.model);
  Config c;
  if (!opts.config_path.empty()) {
    c = load_config(opts.config_path);
  } else {
    // The demo: ZeRO-3, parameters and optimizer state with their home on NVMe.
    c.zero.stage = 3;
    c.zero.offload_param.device = OffloadDevice::kNvme;
    c.zero.offload_optimizer.device = OffloadDevice::kNvme;
    // The demo pages every module (DeepSpeed's default keeps modules under 1e5 elements whole
    // on the device, which for the demo's small models would be nearly all of them).
    c.zero.stage3_param_persistence_threshold_elems = 0;
  }
  // Where each value "auto" became came from, for the one line.
  std::vector<std::pair<std::string, std::string>> sources;
  auto from_trainer = [&](const char* key, const char* flag, bool flag_given) {
    sources.emplace_back(key, flag_given ? flag : "tiermem-train's default");
  };

  // ---- The batch triple: flags > config > derived > the demo's micro-batch.
  std::optional<long long> train, micro, accum;
  BatchKeyNames names;
  if (c.given("train_batch_size")) train = c.train_batch_size;
  if (opts.batch_given) {
    micro = opts.batch;
    names.micro = "--batch";
  } else if (c.given("train_micro_batch_size_per_gpu")) {
    micro = c.train_micro_batch_size_per_gpu;
  } else if (!train) {
    micro = d.batch;
  }
  if (opts.grad_accum_given) {
    accum = opts.grad_accum;
    names.accum = "--grad-accum";
  } else if (c.given("gradient_accumulation_steps")) {
    accum = c.gradient_accumulation_steps;
  }
  const BatchSizes b = derive_batch_sizes(train, micro, accum, world_size, names);
  if (b.micro_batch_per_gpu > (1 << 20)) {
    throw ConfigError("train_batch_size", std::to_string(b.train_batch_size),
                      fmt::format("config key 'train_batch_size' = {} makes a micro-batch of {} "
                                  "sequences per rank: allowed 1 to {}",
                                  b.train_batch_size, b.micro_batch_per_gpu, 1 << 20));
  }
  c.train_batch_size = static_cast<int>(b.train_batch_size);
  c.train_micro_batch_size_per_gpu = static_cast<int>(b.micro_batch_per_gpu);
  c.gradient_accumulation_steps = static_cast<int>(b.gradient_accumulation_steps);
  from_trainer("train_micro_batch_size_per_gpu", "--batch", opts.batch_given);
  from_trainer("gradient_accumulation_steps", "--grad-accum", opts.grad_accum_given);
  sources.emplace_back("train_batch_size", "micro-batch x accumulation x world size");

  // ---- Optimizer, clipping: flags > config > the demo's.
  if (opts.lr_given) {
    c.optimizer.lr = opts.lr;
  } else if (!c.given("optimizer.params.lr")) {
    c.optimizer.lr = d.lr;
  }
  from_trainer("optimizer.params.lr", "--lr", opts.lr_given);
  if (!c.given("optimizer.params.weight_decay")) c.optimizer.weight_decay = kDemoWeightDecay;
  from_trainer("optimizer.params.weight_decay", "", false);
  if (!c.given("gradient_clipping")) c.gradient_clipping = kDemoGradientClipping;
  from_trainer("gradient_clipping", "", false);

  // ---- Scheduler: its peak lr, warm-up and length default to the trainer's.
  SchedulerConfig& sc = c.scheduler;
  if (!sc.type.empty()) {
    const int steps = opts.steps > 0 ? opts.steps : d.steps;
    const bool cosine = sc.type == "WarmupCosineLR";
    if (!cosine) {
      if (opts.lr_given || !sc.warmup_max_lr) sc.warmup_max_lr = c.optimizer.lr;
      if (!sc.warmup_min_lr) sc.warmup_min_lr = 0.0;
      c.optimizer.lr = *sc.warmup_max_lr;  // the peak the header and checkpoints report
    }
    if (opts.warmup >= 0) {
      sc.warmup_num_steps = opts.warmup;
    } else if (!sc.warmup_num_steps) {
      sc.warmup_num_steps = std::min(d.warmup, std::max(0, steps / 10));
    }
    if (sc.type != "WarmupLR" && !sc.total_num_steps) sc.total_num_steps = steps;
    if (!opts.lr_given && c.given("optimizer.params.lr")) {
      sources.emplace_back("scheduler.params.warmup_max_lr", "optimizer.params.lr");
    } else {
      from_trainer("scheduler.params.warmup_max_lr", "--lr", opts.lr_given);
    }
    from_trainer("scheduler.params.warmup_num_steps", "--warmup", opts.warmup >= 0);
    from_trainer("scheduler.params.total_num_steps", "--steps", opts.steps > 0);
  }

  if (!opts.offload.empty()) {
    OffloadDevice dev = opts.offload == "nvme"  ? OffloadDevice::kNvme
                        : opts.offload == "cpu" ? OffloadDevice::kCpu
                                                : OffloadDevice::kNone;
    c.zero.offload_param.device = dev;
    c.zero.offload_optimizer.device = dev;
    if (dev != OffloadDevice::kNone) c.zero.stage = 3;
  }
  if (!opts.device.empty()) c.tiermem.device = opts.device;
  if (opts.device_budget_bytes) c.tiermem.device_budget_bytes = opts.device_budget_bytes;
  if (opts.host_budget_bytes) c.tiermem.host_budget_bytes = opts.host_budget_bytes;
  // Swap directories: --swap-dir, else the config's nvme_path, else ./tiermem-swap. The engines
  // put rank r's files in <dir>/rank<r>.
  for (OffloadConfig* oc : {&c.zero.offload_param, &c.zero.offload_optimizer}) {
    if (oc->device != OffloadDevice::kNvme) continue;
    if (!opts.swap_dir.empty()) {
      oc->nvme_path = {opts.swap_dir};
      oc->nvme_path_from = "--swap-dir";
    } else if (oc->nvme_path.empty()) {
      oc->nvme_path = {"./tiermem-swap"};
    }
  }
  if (!opts.trace_path.empty()) c.tiermem.trace_path = opts.trace_path;
  if (opts.activation_checkpointing) c.activation_checkpointing.enabled = true;
  if (rank == 0) {
    const std::string line = auto_resolved_line(c, sources);
    if (!line.empty()) TM_LOG_INFO("CONFIG", "{}", line);
  }
  return c;
}

namespace {

// Removes, when the check ends, the directories it created (deepest first, each only if still
// empty): a run refused later (bad data, a budget too small) leaves nothing behind. The engines
// and the checkpoint writer create the directories again when the run goes ahead.
class CreatedDirs {
 public:
  explicit CreatedDirs(const std::filesystem::path& dir) {
    std::error_code ec;
    for (std::filesystem::path p = dir; !p.empty() && !std::filesystem::exists(p, ec);
         p = p.parent_path()) {
      created_.push_back(p);
      if (p == p.parent_path()) break;
    }
  }
  ~CreatedDirs() {
    std::error_code ec;
    for (const auto& p : created_) std::filesystem::remove(p, ec);  // fails (kept) when not empty
  }
  CreatedDirs(const CreatedDirs&) = delete;
  CreatedDirs& operator=(const CreatedDirs&) = delete;

 private:
  std::vector<std::filesystem::path> created_;  // deepest first
};

// Creates `dir` if needed (mode 0700 when `private_dir`, else as the umask says; missing parents
// as the umask says), refuses it when another user could tamper with it (unsafe_directory_reason)
// and proves a file can be created in it (with O_DIRECT when asked); removes what it created when
// done (the engines create the directories again, 0700, when the run goes ahead).
void check_dir(const std::string& key, const std::string& dir, bool o_direct,
               const char* what, bool private_dir) {
  namespace fs = std::filesystem;
  for (int attempt = 0;; ++attempt) {
    std::error_code ec;
    const fs::file_status st = fs::status(dir, ec);
    if (fs::exists(st) && !fs::is_directory(st))
      throw UsageError(key, dir, fmt::format("{} '{}' is a file, not a directory", what, dir));
    const CreatedDirs created(fs::path(dir).lexically_normal());
    ec.clear();  // status() of a missing path set it
    if (!fs::exists(st)) {
      fs::path p = fs::path(dir).lexically_normal();
      if (!p.has_filename()) p = p.parent_path();  // "a/b/" -> "a/b"
      if (p.has_parent_path()) fs::create_directories(p.parent_path(), ec);
      if (!ec && ::mkdir(p.c_str(), private_dir ? 0700 : 0777) != 0 && errno != EEXIST)
        ec = std::error_code(errno, std::generic_category());
    }
    // ENOENT here or at the probe below: another rank checking the same path removed what it had
    // created (each rank's check removes the directories it made) between our look and our use.
    if (ec == std::errc::no_such_file_or_directory && attempt < 20) continue;
    if (ec)
      throw UsageError(key, dir, fmt::format("cannot create {} '{}': {}", what, dir, ec.message()));
    if (const std::string why = unsafe_directory_reason(dir); !why.empty())
      throw UsageError(key, dir, fmt::format("{} '{}' is refused: {}; use a directory only you can "
                                             "write (e.g. mkdir -m 700)",
                                             what, dir, why));
    const std::string probe = (fs::path(dir) / fmt::format(".tiermem-probe-{}", ::getpid())).string();
    int fd = ::open(probe.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | (o_direct ? O_DIRECT : 0),
                    0600);
    if (fd < 0 && o_direct && errno == EINVAL) {
      // EINVAL on create with O_DIRECT: the filesystem cannot do direct I/O (the file may exist).
      ::unlink(probe.c_str());
      throw UsageError(key, dir,
                       fmt::format("{} '{}' is on a filesystem without O_DIRECT (e.g. tmpfs, ramfs); "
                                   "put it on a local disk, or set tiermem.o_direct false in "
                                   "--config",
                                   what, dir));
    }
    if (fd < 0 && errno == ENOENT && attempt < 20) continue;  // as above: look again
    if (fd < 0) {
      const int e = errno;
      throw UsageError(key, dir, fmt::format("{} '{}' is not writable: {}", what, dir,
                                             std::strerror(e)));
    }
    ::close(fd);
    ::unlink(probe.c_str());
    return;
  }
}

}  // namespace

void check_save_room(const std::string& dir, std::uint64_t checkpoint_bytes) {
  std::filesystem::path p = std::filesystem::absolute(dir);
  std::error_code ec;
  while (!std::filesystem::exists(p, ec) && p.has_parent_path() && p.parent_path() != p) p = p.parent_path();
  struct statvfs vs {};
  if (::statvfs(p.c_str(), &vs) != 0) return;  // unreadable: the save itself will say why
  const std::uint64_t free_bytes = static_cast<std::uint64_t>(vs.f_bavail) * vs.f_frsize;
  if (checkpoint_bytes <= free_bytes) return;
  throw UsageError("--save", dir,
                   fmt::format("a checkpoint of this run needs {} ({} bytes) but the filesystem of '{}' has {} "
                               "free: free space there, or give --save a directory on a larger filesystem",
                               format_bytes(checkpoint_bytes), checkpoint_bytes, p.string(), format_bytes(free_bytes)));
}

std::vector<std::string> swap_dirs(const TrainOptions& opts, const Config& cfg) {
  std::vector<std::string> dirs;
  if (opts.engine == "resident") return dirs;  // it never swaps
  for (const OffloadConfig* oc : {&cfg.zero.offload_param, &cfg.zero.offload_optimizer}) {
    if (oc->device != OffloadDevice::kNvme) continue;
    for (const std::string& d : oc->nvme_path)
      if (std::find(dirs.begin(), dirs.end(), d) == dirs.end()) dirs.push_back(d);
  }
  return dirs;
}

std::string swap_dir_key(const TrainOptions& opts) {
  return opts.swap_dir.empty() ? "zero_optimization.offload_*.nvme_path" : "--swap-dir";
}

void check_run_paths(const TrainOptions& opts, const Config& cfg) {
  constexpr std::uint64_t kPiB = std::uint64_t{1} << 50;
  if (cfg.tiermem.device_budget_bytes > kPiB) {
    const bool flag = opts.device_budget_bytes != 0;
    throw UsageError(flag ? "--device-budget" : "tiermem.device_budget_bytes",
                     std::to_string(cfg.tiermem.device_budget_bytes),
                     fmt::format("device budget {} is absurd: more than 1 PiB",
                                 format_bytes(cfg.tiermem.device_budget_bytes)));
  }
  for (const std::string& d : swap_dirs(opts, cfg)) {
    check_dir(swap_dir_key(opts), d, cfg.tiermem.o_direct, "swap directory", /*private_dir=*/true);
  }
  if (!opts.save_dir.empty())
    check_dir("--save", opts.save_dir, false, "checkpoint directory", /*private_dir=*/false);
  if (!opts.trace_path.empty()) {
    // The trace is written at the end through "<path>.tmp", then renamed over the path: find out
    // now that it cannot be (a directory there took the whole run to say so).
    if (std::error_code ec; std::filesystem::is_directory(opts.trace_path, ec)) {
      throw UsageError("--trace", opts.trace_path, "is a directory: give a file path, e.g. " +
                                                       (std::filesystem::path(opts.trace_path) / "trace.json").string());
    }
    const std::string probe = opts.trace_path + ".tmp";
    const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0 && errno != EEXIST) {
      throw UsageError("--trace", opts.trace_path,
                       fmt::format("cannot write the trace file '{}': {}", probe,
                                   std::strerror(errno)));
    }
    if (fd >= 0) {
      ::close(fd);
      ::unlink(probe.c_str());
    }
  }
}

}  // namespace tiermem::train
