// src/train/train_loop.cc — the training run (train_loop.h), top-down: plan, data, engine,
// resume, the step loop, eval, checkpoint, summary.
#include "train/train_loop.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <optional>
#include <vector>

#include "tiermem/checkpoint.h"
#include "tiermem/dir_lock.h"
#include "tiermem/error.h"
#include "tiermem/log.h"
#include "tiermem/lr_schedule.h"
#include "tiermem/trace.h"
#include "train/data.h"
#include "train/kill_point.h"
#include "train/resume_checks.h"
#include "gpt/kernels_cpu.h"
#include "gpt/backend.h"
#include "train/train_device.h"
#include "train/train_engine.h"
#include "train/train_engines.h"
#include "train/train_stats.h"
#include "train/train_step.h"

namespace tiermem::train {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// The run's time split so far, less `before` (an earlier split): compute from the trainer's timers
// (seconds, cumulative), the rest from the engine's counters, optimizer waits as optimizer time.
TimeSplit time_split(double compute, const EngineStats& st, double seconds, const TimeSplit& before = {}) {
  TimeSplit x;
  x.compute = compute - before.compute;
  x.io_wait = std::max(0.0, st.stall_seconds - st.optimizer_stall_seconds) - before.io_wait;
  x.comm = st.comm_seconds - before.comm;
  x.optimizer = st.optimizer_seconds - before.optimizer;
  x.other = std::max(0.0, seconds - (x.compute + x.io_wait + x.comm + x.optimizer));
  return x;
}

TrainPlan make_plan(const TrainOptions& o, const Config& cfg, int rank, int world) {
  TrainPlan p;
  p.model_name = o.model;
  p.model = asked_model(o);
  // Text data is byte-level: the vocabulary becomes 256 unless --vocab-size says otherwise (one
  // line says so when that shrinks the model: vocab_change_note, printed by run_training).
  p.model.vocab_size = train_vocab_size(o);
  const DemoDefaults d = demo_defaults(o.model);
  p.steps = o.steps > 0 ? o.steps : d.steps;
  // Batch and accumulation: command line > --config > demo default.
  p.batch = o.batch_given ? o.batch
            : !o.config_path.empty() ? cfg.train_micro_batch_size_per_gpu
                                      : d.batch;
  p.grad_accum = cfg.gradient_accumulation_steps;
  p.seq_len = o.seq_len > 0 ? o.seq_len : std::min(d.seq_len, p.model.seq_len);
  if (p.seq_len > p.model.seq_len) {
    throw UsageError("--seq-len", std::to_string(p.seq_len),
                      fmt::format("exceeds model '{}' context of {} tokens", o.model,
                                  p.model.seq_len));
  }
  p.lr = o.lr_given ? o.lr : !o.config_path.empty() ? cfg.optimizer.lr : d.lr;
  p.warmup = o.warmup >= 0 ? o.warmup : std::min(d.warmup, std::max(0, p.steps / 10));
  if (cfg.scheduler.warmup_num_steps) p.warmup = static_cast<int>(*cfg.scheduler.warmup_num_steps);
  p.eval_every = o.eval_every >= 0 ? o.eval_every : d.eval_every;
  p.eval_batches = o.eval_batches;
  p.seed = o.seed;
  p.rank = rank;
  p.world_size = world;
  p.config = cfg;
  // The demo (the mini model, no config, no budget) shows paging: a device budget of 1/8 of its
  // state (fp32 params + fp32 master and Adam moments, 16 B per parameter). Every other run
  // without a budget gets the device's own default, never a share of the model.
  if (o.model == "mini" && o.config_path.empty() && p.config.tiermem.device_budget_bytes == 0) {
    const std::uint64_t state = static_cast<std::uint64_t>(gpt::num_params(p.model)) * 16;
    p.config.tiermem.device_budget_bytes = (state / 8 + 4095) / 4096 * 4096;
    // ... and a host budget of a quarter of it, so that state also pages between host and NVMe.
    if (p.config.tiermem.host_budget_bytes == 0) {
      p.config.tiermem.host_budget_bytes = (state / 4 + (1 << 20) - 1) / (1 << 20) * (1 << 20);
    }
  }
  p.config.optimizer.lr = p.lr;  // engines that take no per-step lr use this one
  p.config.train_micro_batch_size_per_gpu = p.batch;
  return p;
}

// A device budget must hold the largest single tensor (a module's fp32 parameters), which is
// acquired whole on the device to compute with it.
void check_device_budget(const TrainOptions& o, const TrainPlan& p) {
  const std::uint64_t budget = p.config.tiermem.device_budget_bytes;
  if (budget == 0) return;  // auto
  const gpt::ModuleLayout* largest = nullptr;
  const auto layouts = gpt::module_layouts(p.model);
  for (const auto& l : layouts)
    if (!largest || l.numel > largest->numel) largest = &l;
  if (!largest) return;
  const std::uint64_t bytes = static_cast<std::uint64_t>(largest->numel) * 4;
  const std::uint64_t need = (bytes + 4095) / 4096 * 4096;  // the device allocates 4 KiB pages
  if (budget < need) {
    throw UsageError(o.device_budget_bytes ? "--device-budget" : "tiermem.device_budget_bytes",
                     format_bytes(budget),
                     fmt::format("device budget {} is smaller than the largest tensor: '{}.param' "
                                 "of model '{}' needs {} ({} bytes, fp32, in 4 KiB pages)",
                                 format_bytes(budget), largest->name, p.model_name,
                                 format_bytes(need), need));
  }
}

nlohmann::json model_json(const TrainPlan& p) {
  return {{"name", p.model_name},         {"n_layer", p.model.n_layer},
          {"n_head", p.model.n_head},     {"d_model", p.model.d_model},
          {"seq_len", p.model.seq_len},   {"vocab_size", p.model.vocab_size}};
}

void save_checkpoint(const std::string& dir, int step, const TrainPlan& plan,
                     TrainEngine& engine, const BatchSampler& sampler, const Corpus& corpus,
                     double last_loss, double initial_loss) {
  TraceSpan span("checkpoint", "checkpoint");
  CheckpointWriter w(dir, plan.rank, plan.world_size, step);
  engine.save(w);
  nlohmann::json meta;
  meta["model"] = model_json(plan);
  meta["step"] = step;
  meta["steps"] = plan.steps;
  meta["seed"] = plan.seed;
  meta["data"] = {{"sampler", "splitmix64"},
                  {"seed", sampler.seed()},
                  {"position", sampler.position()},
                  {"path", corpus.path},
                  {"tokens", corpus.tokens.size()}};
  meta["batch"] = plan.batch;
  meta["grad_accum"] = plan.grad_accum;
  meta["seq_len"] = plan.seq_len;
  meta["lr"] = plan.lr;
  meta["warmup"] = plan.warmup;
  meta["initial_loss"] = initial_loss;
  meta["last_loss"] = last_loss;
  meta["engine"] = {{"zero_stage", engine.zero_stage()},
                    {"param_home", engine.param_home()},
                    {"optimizer_home", engine.optimizer_home()}};
  meta["config"] = nlohmann::json::parse(config_to_json(plan.config));
  const std::string path = w.commit(meta);
  TM_LOG_INFO("TRAIN", "checkpoint of step {} written: {}", step, path);
}

// A resume at another world size (the ZeRO engine re-partitions the optimizer state,
// checkpoint_reshard.h) reads the same sequences as the saved run would when the global batch is
// kept: the sampler's position counts sequences of the whole job and ranks split each global
// batch in rank order. The losses then equal a resume at the saved size's up to fp32 summation order.
void check_global_batch(const std::string& mf, const nlohmann::json& meta, int saved_world, const TrainPlan& plan) {
  const long long batch = meta.value("batch", 0), saved = batch * saved_world,
                  now = static_cast<long long>(plan.batch) * plan.world_size;
  if (saved == now) return;
  throw CheckpointError(fmt::format(
      "checkpoint {}: saved by {} ranks with --batch {} (a global batch of {} sequences); {} ranks with --batch {} "
      "make {}, and the continuation would read other data: {}", mf, saved_world, batch, saved, plan.world_size,
      plan.batch, now, saved % plan.world_size == 0 ? fmt::format("give --batch {}", saved / plan.world_size)
                                                    : fmt::format("resume at a world size that divides {}", saved)));
}

// SIGINT / SIGTERM: the first one asks the step loop to stop after the current step (with
// --save, checkpointing first), print the summary and clean up (swap files, locks); the handler
// is reset by it (SA_RESETHAND), so a second signal ends the process at once.
std::atomic<int> g_stop_signal{0};

extern "C" void on_stop_signal(int sig) { g_stop_signal.store(sig); }

void install_stop_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESETHAND;
  for (int sig : {SIGINT, SIGTERM}) sigaction(sig, &sa, nullptr);
}

// ---- The run's phases, in the order run_training calls them.

// 1. Rank, configuration and plan; the device, decided once (train_device.h): --device cuda
// without a usable GPU stops here with one line and exit 2; what auto picked is said once the
// run's input is checked (device.note).
struct ResolvedRun {
  TrainPlan plan;
  DeviceDecision device;
};

ResolvedRun resolve_run(const TrainOptions& opts) {
  const RankInfo ranks = detect_ranks();
  set_log_rank(ranks.rank);  // what every rank would say alike, rank 0 says (tiermem/log.h)
  Config cfg = effective_config(opts, ranks.rank);
  TrainPlan plan = make_plan(opts, cfg, ranks.rank, ranks.world_size);
  check_run_paths(opts, cfg);
  const std::string key = opts.device.empty() ? "tiermem.device" : "--device";
  const DeviceChoice asked = parse_device_choice(plan.config.tiermem.device, key);
  const DeviceDecision device =
      decide_device(asked, key, asked == DeviceChoice::kSim ? CudaProbe{} : probe_cuda());
  // The run's own plan records what it computes on: the engine's config then names the kind and
  // nothing downstream looks for CUDA again (checkpoints keep the device the run had).
  plan.config.tiermem.device = std::string(device_kind_name(device.kind));

  if (plan.rank == 0) {
    const std::string note = vocab_change_note(opts);
    if (!note.empty()) TM_LOG_WARN("TRAIN", "{}", note);
  }
  return {std::move(plan), device};
}

// 2. Data, loaded before anything heavy is built. Text is byte-level (make_plan). Members are
// made in order (the samplers point into the split).
struct RunData {
  RunData(const std::string& path, const TrainPlan& plan)
      : corpus(load_corpus(path, plan.model.vocab_size)),
        split(split_corpus(corpus, plan.seq_len)),
        sampler(split.train, split.train_tokens, plan.seq_len, plan.seed),
        eval_sampler(split.eval, split.eval_tokens, plan.seq_len, plan.seed ^ 0x5eed0e7a1ull) {}
  Corpus corpus;
  const Split split;
  BatchSampler sampler;
  const BatchSampler eval_sampler;
};

// 3. Engine (parameters, gradients, optimizer state) into `engine`, and the model (activations),
// returned. SIGINT/SIGTERM from here on stop the run cleanly (swap files and locks removed): one
// that arrives while the engine writes the initial state (minutes for a model of tens of GB)
// takes effect when that is done, before the first step; a second one ends the process at once.
std::unique_ptr<gpt::ModelBackend> build_engine(const TrainOptions& opts, const TrainPlan& plan,
                                                const DeviceDecision& device,
                                                std::unique_ptr<TrainEngine>& engine) {
  g_stop_signal.store(0);
  install_stop_handlers();
  kill_point("init");  // TEST-ONLY (kill_point.h)
  // The model's backend first: on CUDA its activations come out of the device budget, and the
  // engine is given what is left.
  ModelOnDevice on_device = make_model_backend(
      plan, device, opts.device_budget_bytes ? "--device-budget" : "tiermem.device_budget_bytes");
  std::unique_ptr<gpt::ModelBackend> backend = std::move(on_device.backend);
  gpt::ModelBackend& model = *backend;
  engine = make_engine(plan, opts, on_device.engine_device_budget_bytes);
  const bool lead = plan.rank == 0;
  if (lead && !device.note.empty()) TM_LOG_INFO("TRAIN", "{}", device.note);
  if (const std::string blas = gpt::cpu::openblas_core_note(); lead && !blas.empty()) TM_LOG_INFO("TRAIN", "{}", blas);
  if (lead && model.checkpoints_blocks()) {
    TM_LOG_INFO("TRAIN", "activation checkpointing ({}): {} block inputs kept ({}), every block "
                "recomputed in backward; activations {} in all",
                opts.activation_checkpointing ? "--activation-checkpointing"
                                              : "the config's activation_checkpointing",
                plan.model.n_layer + 1, format_bytes(model.block_input_bytes()),
                format_bytes(model.activation_bytes()));
  }

  if (!opts.trace_path.empty()) {
    std::string path = opts.trace_path;
    if (plan.world_size > 1) path += fmt::format(".rank{}", plan.rank);
    Trace::global().start(path, fmt::format("tiermem-train rank {}", plan.rank), plan.rank);
  }
  return backend;
}

// What the step loop carries from step to step and hands to the summary.
struct LoopState {
  int first_step = 1;
  int last_step = 0;
  int steps_run = 0;
  int stopped_by = 0;  // the signal that ended the loop early
  double initial_loss = std::nan("");
  double last_loss = std::nan("");
  std::optional<double> last_eval;
  Timers timers;
  Clock::time_point t_loop;
  EngineStats prev;  // the engine's counters at the end of the previous step
  TimeSplit start_split;  // the counters before step 1 (registration waits too): not in the split
  double first_seconds = 0;
  std::vector<double> step_seconds;  // wall time of each step run (summary: step_seconds)
  std::vector<TimeSplit> step_splits;  // each step's own split (eval between steps not in it)
};

// 4. Resume from --resume (the engine's state, the sampler's position, the first step and the
// initial loss into `loop`), at the saved world size or another (check_global_batch). Returns false when the checkpoint is already at the last step: a
// run restarted after it had finished (a crash-restart loop, a rerun of the same command) has
// nothing left to do, and says so.
bool resume(const TrainOptions& opts, const TrainPlan& plan, RunData& data, TrainEngine& engine,
            LoopState& loop) {
  // This rank's own files when the checkpoint has them; a rank the saved run did not have reads
  // rank 0's meta (the same on every rank: step, data position, schedule, loss scale).
  const int saved_world = CheckpointReader(opts.resume_dir, 0).world_size();
  CheckpointReader r(opts.resume_dir, plan.rank < saved_world ? plan.rank : 0);
  const std::string& mf = r.manifest_path();
  expect_same(mf, "meta.model", r.meta().at("model"), model_json(plan));
  if (saved_world == plan.world_size) {
    expect_same(mf, "meta.batch", r.meta().value("batch", 0), plan.batch);
  } else {
    check_global_batch(mf, r.meta(), saved_world, plan);
  }
  expect_same(mf, "meta.grad_accum", r.meta().value("grad_accum", 0), plan.grad_accum);
  expect_same(mf, "meta.seq_len", r.meta().value("seq_len", 0), plan.seq_len);
  expect_same(mf, "meta.seed", r.meta().value("seed", std::uint64_t{0}), plan.seed);
  const nlohmann::json& meta = r.meta();
  expect_same_optimizer(mf, meta, plan.config.optimizer.type);
  warn_if_changed(mf, meta, "/data/path", "--data", data.corpus.path);
  warn_if_changed(mf, meta, "/data/tokens", "data tokens", data.corpus.tokens.size());
  warn_if_changed(mf, meta, "/steps", "--steps", plan.steps);
  warn_if_changed(mf, meta, "/lr", "--lr", plan.lr);
  warn_if_changed(mf, meta, "/warmup", "--warmup", plan.warmup);
  warn_if_changed(mf, meta, "/engine/param_home", "params home", engine.param_home());
  warn_if_changed(mf, meta, "/engine/optimizer_home", "optimizer home", engine.optimizer_home());
  engine.load(r);
  data.sampler.set_position(r.meta().at("data").at("position").get<std::uint64_t>());
  loop.first_step = r.step() + 1;
  loop.initial_loss = r.meta().value("initial_loss", std::nan(""));
  TM_LOG_INFO("TRAIN", "resumed from {} at step {}", mf, r.step());
  const int until = opts.stop_at > 0 ? std::min(opts.stop_at, plan.steps) : plan.steps;
  if (loop.first_step > until) {
    TM_LOG_WARN("TRAIN", "the checkpoint in '{}' is already at step {}: nothing left to run "
                "up to {} {}; give a larger --steps to train further", opts.resume_dir,
                r.step(), opts.stop_at > 0 && opts.stop_at < plan.steps ? "--stop-at" : "--steps",
                until);
    return false;
  }
  return true;
}

// One writer per checkpoint directory and rank: a second run saving into the same --save would
// delete this one's files as stale and overwrite its manifest. The lock lives in
// DIR/rank<r>.lock for the whole run (a crashed run's is reclaimed, with one log line). Files a
// crashed run left in the checkpoint directory (a state file written but never named by a
// manifest, or an old one the crash kept from being deleted) go now.
void lock_save_dir(const TrainOptions& opts, const TrainPlan& plan, const TrainEngine& engine,
                   std::optional<DirLock>& save_lock) {
  if (opts.save_dir.empty()) return;
  // A rank's state file: its share of the master weights and optimizer state (a lower bound).
  check_save_room(opts.save_dir, engine.optimizer_bytes() / static_cast<std::uint64_t>(plan.world_size));
  std::error_code ec;
  std::filesystem::create_directories(opts.save_dir, ec);  // checked at startup; errors below
  save_lock.emplace(
      (std::filesystem::path(opts.save_dir) / fmt::format("rank{}.lock", plan.rank)).string(),
      fmt::format("checkpoint directory '{}' (rank {})", opts.save_dir, plan.rank),
      "give each run its own --save directory", "TRAIN");
  if (const int n = remove_stale_checkpoint_files(opts.save_dir, plan.rank))
    TM_LOG_INFO("TRAIN", "removed {} stale file{} of an interrupted checkpoint from {}", n,
                n == 1 ? "" : "s", opts.save_dir);
}

// 5. The header (only rank 0 prints).
void print_header(Reporter& reporter, const TrainPlan& plan, const RunData& data, TrainEngine& engine,
                  std::uint64_t tokens_per_step) {
  const Corpus& corpus = data.corpus;
  reporter.header(fmt::format(
      "tiermem-train: {}\n"
      "data    {} ({}, {} file{}, {} tokens: {} train / {} held out)\n"
      "batch   {} x {} tokens x {} micro-batch{} x {} rank{} = {} tokens/step, {} steps, lr {} "
      "(warm-up {})\n"
      "engine  {}\n"
      "state   params {} + optimizer {} = {}; device budget {}\n\n",
      plan.model.describe(plan.model_name), corpus.path, corpus_format_name(corpus.format),
      corpus.files.size(), corpus.files.size() == 1 ? "" : "s", corpus.tokens.size(),
      data.split.train_tokens, data.split.eval_tokens, plan.batch, plan.seq_len, plan.grad_accum,
      plan.grad_accum == 1 ? "" : "es", plan.world_size, plan.world_size == 1 ? "" : "s",
      tokens_per_step, plan.steps, plan.lr, plan.warmup, engine.describe(),
      format_bytes(engine.param_bytes()), format_bytes(engine.optimizer_bytes()),
      format_bytes(engine.param_bytes() + engine.optimizer_bytes()),
      engine.stats().budget_bytes[0] ? format_bytes(engine.stats().budget_bytes[0])
                                     : std::string("unbounded")));
}

// The stop signal the ranks agree on (a signal may reach them at different steps): this rank's,
// or SIGTERM when only another rank got one; 0 when none.
int agreed_stop_signal(const TrainPlan& plan, TrainEngine& engine) {
  int sig = g_stop_signal.load();
  if (plan.world_size > 1) {
    const double any = engine.all_reduce_sum(sig != 0 ? 1.0 : 0.0);
    if (any > 0 && sig == 0) sig = SIGTERM;
  }
  return sig;
}

// The optimizer step of step `t` over the accumulated gradients; returns the global L2 norm of
// the mean gradient (DeepSpeed's gradient_clipping scales the whole gradient by clip / norm when
// the norm exceeds it, as torch.nn.utils.clip_grad_norm_). `os` gets the step's settings.
double optimizer_step(const TrainPlan& plan, TrainEngine& engine, int t, OptimStep& os) {
  os.t = t;
  os.lr = static_cast<float>(learning_rate(plan, t));
  os.beta1 = plan.config.optimizer.beta1;
  os.beta2 = plan.config.optimizer.beta2;
  os.eps = static_cast<float>(plan.config.optimizer.eps);
  os.weight_decay = static_cast<float>(plan.config.optimizer.weight_decay);
  os.grad_scale = 1.0f / static_cast<float>(plan.grad_accum * plan.world_size);
  double grad_norm = std::nan("");
  if (!engine.clips_gradients()) {
    double sumsq = 0;
    for (int m = 0; m < gpt::num_modules(plan.model); ++m) {
      const std::span<float> g = engine.grads(m);
      const std::int64_t n = static_cast<std::int64_t>(g.size());
#pragma omp parallel for reduction(+ : sumsq) schedule(static) if (n > (1 << 18))
      for (std::int64_t i = 0; i < n; ++i) sumsq += static_cast<double>(g[i]) * g[i];
    }
    grad_norm = std::sqrt(sumsq) * os.grad_scale;
    const double clip = plan.config.gradient_clipping;
    if (clip > 0 && grad_norm > clip) {
      os.grad_scale = static_cast<float>(os.grad_scale * clip / (grad_norm + 1e-6));
    }
  }
  {
    TraceSpan span(fmt::format("adamw step {}", t), "optimizer");
    engine.step(os);
  }
  if (engine.clips_gradients()) grad_norm = engine.last_grad_norm();
  return grad_norm;
}

// 6. The step loop, from loop.first_step to loop.last_step, or until a stop signal.
void train_steps(const TrainOptions& opts, const TrainPlan& plan, RunData& data, gpt::ModelBackend& model,
                 TrainEngine& engine, Reporter& reporter, std::uint64_t tokens_per_step,
                 double flops_per_step, LoopState& loop) {
  const bool lead = plan.rank == 0;
  Batch batch;
  EngineStats& prev = loop.prev;
  for (int t = loop.first_step; t <= loop.last_step && loop.stopped_by == 0; ++t) {
    kill_point("step");  // TEST-ONLY (kill_point.h)
    const auto t0 = Clock::now();
    // The counters as the step starts (an eval since the last step is not this step's).
    const TimeSplit at_start = time_split(loop.timers.compute, engine.stats(), 0);
    engine.begin_step();
    engine.zero_grad();
    double loss_sum = 0;
    for (int micro = 0; micro < plan.grad_accum; ++micro) {
      data.sampler.next_batch(plan.batch * plan.world_size, plan.rank * plan.batch, plan.batch, &batch);
      if (micro + 1 == plan.grad_accum) engine.before_last_micro_batch(static_cast<float>(learning_rate(plan, t)));
      loss_sum += run_micro_batch(model, engine, batch, /*backward=*/true, &loop.timers);
    }
    OptimStep os;
    const double grad_norm = optimizer_step(plan, engine, t, os);
    engine.end_step();
    const double loss = engine.all_reduce_sum(loss_sum) / (plan.grad_accum * plan.world_size);
    if (std::isnan(loop.initial_loss)) loop.initial_loss = loss;
    loop.last_loss = loss;
    ++loop.steps_run;

    const EngineStats now = engine.stats();
    StepReport rep;
    rep.step = t;
    rep.steps = plan.steps;
    rep.loss = loss;
    rep.lr = os.lr;
    rep.grad_norm = grad_norm;
    rep.tokens = tokens_per_step;
    rep.seconds = seconds_since(t0);
    loop.step_seconds.push_back(rep.seconds);
    loop.step_splits.push_back(time_split(loop.timers.compute, now, rep.seconds, at_start));
    rep.flops = flops_per_step;
    rep.moved = now.moved - prev.moved;
    rep.stall_seconds = now.stall_seconds - prev.stall_seconds;
    const double per_step = seconds_since(loop.t_loop) / loop.steps_run;
    rep.eta_seconds = per_step * (plan.steps - t);
    prev = now;
    if (loop.steps_run == 1) loop.first_seconds = seconds_since(loop.t_loop);
    const bool eval_now = plan.eval_every > 0 && (t % plan.eval_every == 0 || t == plan.steps);
    reporter.step(rep, eval_now || t == loop.last_step || t == loop.first_step);
    if (!std::isfinite(loss)) {
      throw Error(fmt::format("loss is {} at step {} (diverged): lower --lr", loss, t));
    }
    if (eval_now) {
      TraceSpan span(fmt::format("eval after step {}", t), "eval");
      loop.last_eval = evaluate(model, engine, data.eval_sampler, plan, &loop.timers);
      reporter.eval(t, *loop.last_eval);
    }
    const int sig = agreed_stop_signal(plan, engine);
    const bool interrupted = sig != 0 && t < loop.last_step;
    if (interrupted && lead) {
      reporter.flush_line();
      TM_LOG_WARN("TRAIN", "{} received: stopping after step {}{}; a second one ends the "
                  "process at once", sig == SIGINT ? "SIGINT" : "SIGTERM", t,
                  opts.save_dir.empty() ? "" : fmt::format(", checkpointing to {}", opts.save_dir));
    }
    if (!opts.save_dir.empty() &&
        (t == loop.last_step || interrupted || (opts.save_every > 0 && t % opts.save_every == 0))) {
      save_checkpoint(opts.save_dir, t, plan, engine, data.sampler, data.corpus, loop.last_loss,
                      loop.initial_loss);
    }
    if (interrupted) {
      loop.stopped_by = sig;
      break;
    }
  }
}

// 7. The summary: what ran, the losses, the memory of each tier and where the time went.
Summary make_summary(const TrainPlan& plan, const gpt::ModelBackend& model, TrainEngine& engine,
                     std::uint64_t tokens_per_step, double flops_per_step, const LoopState& loop) {
  const EngineStats st = engine.stats();
  Summary s;
  s.model = plan.model_name;
  s.world_size = plan.world_size;
  s.zero_stage = engine.zero_stage();
  s.param_offload = engine.param_home();
  s.optimizer_offload = engine.optimizer_home();
  s.device_kind = engine.device_kind();
  s.steps = loop.steps_run;
  s.final_step = plan.steps;
  s.tokens = tokens_per_step * static_cast<std::uint64_t>(loop.steps_run);
  s.seconds = seconds_since(loop.t_loop);
  // Steady state: the steps after the first (which records the prefetch trace); their median
  // (what a step takes, less a shared machine's occasional stall) and their mean.
  if (!loop.step_seconds.empty()) {
    const std::size_t skip = loop.step_seconds.size() > 1 ? 1 : 0;
    std::vector<double> t(loop.step_seconds.begin() + static_cast<std::ptrdiff_t>(skip), loop.step_seconds.end());
    double sum = 0;
    for (double x : t) sum += x;
    s.step_seconds_mean = sum / static_cast<double>(t.size());
    std::sort(t.begin(), t.end());
    const std::size_t h = t.size() / 2;
    s.step_seconds = t.size() % 2 == 1 ? t[h] : 0.5 * (t[h - 1] + t[h]);
  }
  s.batch = plan.batch;
  s.grad_accum = plan.grad_accum;
  s.seq_len = plan.seq_len;
  s.gpt = {plan.model.n_layer, plan.model.n_head, plan.model.d_model, plan.model.seq_len,
           plan.model.vocab_size};
  s.initial_loss = loop.initial_loss;
  s.final_loss = loop.last_loss;
  s.final_eval_loss = loop.last_eval;
  s.param_count = static_cast<std::uint64_t>(gpt::num_params(plan.model));
  s.vocab_size = plan.model.vocab_size;
  s.activation_checkpointing = model.checkpoints_blocks();
  s.activation_checkpoint_bytes = model.checkpoints_blocks() ? model.block_input_bytes() : 0;
  s.param_bytes = engine.param_bytes();
  s.optimizer_bytes = engine.optimizer_bytes();
  s.activation_bytes = model.activation_bytes();
  // Activations live in device memory with the CUDA backend (taken out of the device budget
  // before the engine got the rest), in host memory with the CPU backend.
  const std::uint64_t device_activations = model.on_device() ? s.activation_bytes : 0;
  s.device_budget_bytes = st.budget_bytes[0] ? st.budget_bytes[0] + device_activations : 0;
  s.device_peak_bytes = st.peak_bytes[0] + device_activations;
  s.host_budget_bytes = st.budget_bytes[1];
  s.host_peak_bytes = st.peak_bytes[1] + (model.on_device() ? 0 : s.activation_bytes);
  s.host_pool_peak_bytes = st.host_pool_peak_bytes;
  s.host_bounce_bytes = st.host_bounce_bytes;
  s.host_engine_peak_bytes = st.host_engine_peak_bytes;
  s.host_grad_buffer_peak_bytes = st.host_grad_buffer_peak_bytes;
  s.updates_in_backward = st.updates_in_backward;
  s.host_sim_device_bytes = st.host_sim_device_bytes;
  {
    struct rusage ru {};
    if (::getrusage(RUSAGE_SELF, &ru) == 0) s.max_rss_bytes = static_cast<std::uint64_t>(ru.ru_maxrss) * 1024;
  }
  s.nvme_peak_bytes = st.peak_bytes[2];
  s.nvme_bytes_read = st.nvme_read_bytes;
  s.nvme_bytes_written = st.nvme_written_bytes;
  s.moved = st.moved;
  s.stall_seconds = st.stall_seconds;
  s.last_step_io = st.last_step_io;
  s.flops = flops_per_step * loop.steps_run;
  s.split = time_split(loop.timers.compute, st, s.seconds, loop.start_split);
  s.steady_seconds = loop.steps_run > 1 ? s.seconds - loop.first_seconds : s.seconds;
  // Each share the median over the steps after the first (all of them for a one-step run) of that
  // step's share, as step_seconds is their median: one step unlike the others (with the overlapped
  // optimizer step, the second applies the first's deferred updates reading their state on
  // demand, before the prefetcher's plan holds it) moves neither.
  const std::size_t skip = loop.step_splits.size() > 1 ? 1 : 0;
  auto median_share = [&](double TimeSplit::*part) {
    std::vector<double> v;
    for (std::size_t i = skip; i < loop.step_splits.size(); ++i) {
      const double wall = loop.step_seconds.at(i);
      v.push_back(wall > 0 ? std::clamp(loop.step_splits[i].*part / wall, 0.0, 1.0) : 0.0);
    }
    if (v.empty()) return 0.0;
    std::sort(v.begin(), v.end());
    const std::size_t h = v.size() / 2;
    return v.size() % 2 == 1 ? v[h] : 0.5 * (v[h - 1] + v[h]);
  };
  s.steady_shares = {median_share(&TimeSplit::compute), median_share(&TimeSplit::io_wait),
                     median_share(&TimeSplit::comm), median_share(&TimeSplit::optimizer),
                     median_share(&TimeSplit::other)};
  return s;
}

// Ends the --trace file, if one was started (an Error when it could not be written).
void finish_trace() {
  if (!Trace::global().enabled()) return;
  const std::string trace_path = Trace::global().path();
  if (!Trace::global().stop()) {  // the reason was logged by Trace
    throw Error(fmt::format("the trace was not written to '{}' (see the error above)", trace_path));
  }
  TM_LOG_INFO("TRAIN", "trace written to {} (open in https://ui.perfetto.dev)", trace_path);
}

}  // namespace

TrainPlan make_train_plan(const TrainOptions& opts, const Config& cfg, int rank, int world_size) {
  return make_plan(opts, cfg, rank, world_size);
}

double learning_rate(const TrainPlan& plan, int t) {
  // The config's scheduler section (WarmupLR, WarmupDecayLR, WarmupCosineLR), else the trainer's
  // own warm-up + cosine decay (lr_schedule.h; the same values as before, bit for bit).
  return lr_at_optimizer_step(make_lr_schedule(plan.config.scheduler, plan.lr, plan.warmup, plan.steps), t);
}

int run_training(const TrainOptions& opts) {
  const auto t_start = Clock::now();
  std::unique_ptr<TrainEngine> engine;
  // One line on stderr, then the exit code. With several ranks the job is aborted (MPI_Abort):
  // the other ranks would wait for this one in their next collective forever.
  auto fail = [&engine](std::string msg, int rc) {
    for (char& c : msg)
      if (c == '\n') c = ' ';
    if (engine && engine->world_size() > 1) {
      std::fprintf(stderr, "tiermem-train: error: rank %d: %s (aborting all ranks)\n",
                   engine->rank(), msg.c_str());
      std::fflush(stderr);
      engine->abort_job(rc);
    }
    engine.reset();
    std::fprintf(stderr, "tiermem-train: error: %s\n", msg.c_str());
    return rc;
  };
  try {
    ResolvedRun run = resolve_run(opts);  // 1
    TrainPlan& plan = run.plan;
    check_device_budget(opts, plan);  // 2
    RunData data(opts.data.empty() ? kDefaultCorpus : opts.data, plan);
    const std::unique_ptr<gpt::ModelBackend> backend = build_engine(opts, plan, run.device, engine);  // 3
    LoopState loop;
    if (!opts.resume_dir.empty() && !resume(opts, plan, data, *engine, loop)) {  // 4
      engine.reset();
      return 0;
    }
    std::optional<DirLock> save_lock;
    lock_save_dir(opts, plan, *engine, save_lock);

    const bool lead = plan.rank == 0;  // 5
    Reporter reporter(opts.json, !opts.json && ::isatty(STDOUT_FILENO), lead ? stdout : nullptr);
    const std::uint64_t tokens_per_step = static_cast<std::uint64_t>(plan.batch) *
                                          plan.seq_len * plan.grad_accum * plan.world_size;
    print_header(reporter, plan, data, *engine, tokens_per_step);

    const double flops_per_step =  // 6
        gpt::flops_per_token(plan.model, plan.seq_len) * static_cast<double>(tokens_per_step);
    loop.timers.io_only = opts.io_only;
    loop.t_loop = Clock::now();
    loop.prev = engine->stats();
    loop.start_split = time_split(0.0, loop.prev, 0.0);
    loop.last_step = opts.stop_at > 0 ? std::min(opts.stop_at, plan.steps) : plan.steps;
    // A signal during initialisation: stop before the first step (ranks agree).
    if (const int sig = agreed_stop_signal(plan, *engine); sig != 0) {
      if (lead) {
        TM_LOG_WARN("TRAIN", "{} received during initialisation: stopping before step {}",
                    sig == SIGINT ? "SIGINT" : "SIGTERM", loop.first_step);
      }
      loop.stopped_by = sig;
    }
    train_steps(opts, plan, data, *backend, *engine, reporter, tokens_per_step, flops_per_step, loop);

    reporter.summary(make_summary(plan, *backend, *engine, tokens_per_step, flops_per_step, loop));  // 7
    finish_trace();
    engine.reset();
    TM_LOG_DEBUG("TRAIN", "done in {:.1f}s", seconds_since(t_start));
    return loop.stopped_by != 0 ? 128 + loop.stopped_by : 0;  // as a shell reports a signal
  } catch (const UsageError& e) {
    return fail(e.key_path() + ": " + e.what(), 2);
  } catch (const ConfigError& e) {  // a bad --config file or value: bad input, like a bad option
    return fail(describe(e), 2);
  } catch (const DataError& e) {  // a missing or unusable --data: bad input too
    return fail(e.what(), 2);
  } catch (const IoError& e) {
    if (!e.corrupt_data()) return fail(e.what(), 1);
    // Swapped state changed on disk (checksum mismatch, also after a re-read): stop before
    // anything else is written, and say how to continue.
    return fail(fmt::format("{}; stopped without writing anything more: {}", e.what(),
                            opts.save_dir.empty()
                                ? "the run must start again (give --save DIR to checkpoint it)"
                                : fmt::format("continue from the last checkpoint with --resume {} "
                                              "(its tensors are verified as they load)",
                                              opts.save_dir)),
                1);
  } catch (const std::exception& e) {
    return fail(e.what(), 1);
  }
}

}  // namespace tiermem::train
