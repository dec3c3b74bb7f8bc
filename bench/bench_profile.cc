// tiermem-bench profile — measure this machine into the profile tiermem-plan reads (docs/plan.md).
//
//   cmake --build build/default --target tiermem-bench
//   build/default/bin/tiermem-bench profile --path ./tiermem-swap --json > profiles/this-machine.json
//
// Measures, in about 40 seconds (each figure the median of --reps repetitions, or more):
//   nvme_read_gbps / nvme_write_gbps  the IoEngine at the engine's settings (the default config's
//                                     aio block size, queue depth and rings; O_DIRECT unless the
//                                     filesystem refuses it), --size bytes in pipeline_chunk_bytes
//                                     requests, all in flight, on a file under --path (removed)
//   nvme_read_beside_writes_gbps      the same reads (half of --size) while the other half is
//                                     written, requests submitted alternately: the read's GB/s
//   h2d_gbps / d2h_gbps               copies of --copy-size through the Device the engine would make
//                                     (tiermem.device auto: CUDA when visible, else SimDevice)
//   cpu_adam_params_per_s             tiermem::adam_step (best ISA, all OpenMP threads), 16 M params
//   gemm_gflops                       OpenBLAS sgemm [512 x 768] x [768 x 3072] (the model's MLP)
//   checksum_gbps                     the XXH3-64 SwapSpace computes per extent (tiermem.checksum),
//                                     one thread over 64 MiB from memory (not cache), GB/s
//   grad_handoff_gbps_by_width, grad_handoff_pass_gbps_by_width   one rank's gradient hand-off
//                                     as tiermem-train makes it (the engine's recycled buffer per
//                                     module, handed back to ZeroEngine::reduce_gradients: world
//                                     1, on the gradient thread), priced by what it adds to the
//                                     model's own backward pass (6 blocks, 128 tokens, vocab 256)
//                                     at d_model 256, 768 and 1024: per pass, one block's and the
//                                     embedding's bytes at what they add to the pass's tail (the
//                                     last block's hand-off, beside only the embedding's
//                                     backward), the rest per byte (GB/s of fp32 gradient per
//                                     second added); grad_handoff_gbps is d 1024's per-byte
//   optimizer_params_per_s(_by_module_elems)   ZeroEngine::step() with modules of 4 M and 16 M
//                                     elements (8 and 4, stage 3, state in host memory): AdamW
//                                     over the sub-groups, the norm, the new working parameters
//                                     written to their home (the Device's memory); parameters/s
//   compute_gflops, compute_gflops_by_width(_128)   the GPT model's own forward+backward (2 layers,
//                                     seq 128, vocab 256, batch 4 = 512 tokens; _128: batch 1) at
//                                     d_model 256 / 768 / 1024, model FLOPs (gpt::flops_per_token)
//                                     per second (repeated for at least a second, median);
//                                     compute_gflops is d 768's at 512 tokens
//   host_memory_bytes, host_available_bytes   /proc/meminfo MemTotal, MemAvailable
//   nvme_free_bytes                   the free space of the drive under --path (drive_free_bytes)
// With --json the last line is {"profile": {...}}; tiermem-plan --profile reads it.
#include <omp.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "bench/bench.h"
#include "core/cli_checks.h"
#include "gpt/kernels_cpu.h"
#include "gpt/model.h"
#include "nvme/checksum.h"
#include "tiermem/adam.h"
#include "tiermem/communicator.h"
#include "tiermem/config.h"
#include "tiermem/device.h"
#include "tiermem/error.h"
#include "tiermem/io_engine.h"
#include "tiermem/log.h"
#include "tiermem/pinned_host_pool.h"
#include "tiermem/swap_space.h"
#include "tiermem/zero_engine.h"

namespace tiermem::bench {
namespace {

struct ProfileOpts {
  std::string path = "tiermem-swap";
  std::string nvme_size = "256MiB";
  std::string copy_size = "256MiB";
  int reps = 3;
  bool json = false;
};

struct AlignedFree {
  void operator()(void* p) const { std::free(p); }
};
std::unique_ptr<std::byte, AlignedFree> aligned(std::uint64_t bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, 4096, bytes) != 0) throw OutOfMemoryError(Tier::kHost, bytes, 0);
  std::memset(p, 0x5a, bytes);
  return std::unique_ptr<std::byte, AlignedFree>(static_cast<std::byte*>(p));
}

struct NvmeRates {
  double read = 0, write = 0;
  double read_beside_writes = 0;  // reads while as many bytes of writes are in flight
};

// NVMe: write then read `bytes` in chunk-sized requests, all submitted at once (the engine splits
// them into block_size pieces and keeps queue_depth in flight per ring); then the first half read
// while the second half is written, the requests submitted alternately, the read's rate taken when
// its last request completes (the overlapped optimizer step's reads beside its write-backs).
NvmeRates measure_nvme(const ProfileOpts& o, std::uint64_t bytes, std::string* note) {
  namespace fs = std::filesystem;
  Config cfg;
  // The directories this run makes go again after its file, also on an error.
  if (std::error_code ec; fs::exists(o.path, ec) && !fs::is_directory(o.path, ec)) {
    throw ConfigError("--path", o.path, "is a file, not a directory: give a directory on the drive to measure");
  }
  MadeDirs dirs;
  dirs.make(o.path);
  const std::string file = (fs::path(o.path) / fmt::format("tiermem-profile-{}.dat", ::getpid())).string();
  struct RemoveFile {
    const std::string& file;
    ~RemoveFile() {
      std::error_code ec;
      fs::remove(file, ec);
    }
  } remove_file{file};
  std::unique_ptr<IoEngine> io = make_io_engine(cfg);
  IoFile f;
  try {
    f = io->open_file(file, true);
  } catch (const IoError&) {
    cfg.tiermem.o_direct = false;  // tmpfs and others: buffered, said in the profile
    io = make_io_engine(cfg);
    f = io->open_file(file, true);
    *note = "buffered (the filesystem refuses O_DIRECT): figures include the page cache";
  }
  const std::uint64_t chunk = cfg.tiermem.pipeline_chunk_bytes;
  bytes = bytes / chunk * chunk;
  // The buffer comes from a PinnedHostPool in 2 MiB pages, as the engine's are: a request into a
  // heap buffer of 4 KiB pages is split into far more physical segments and read here at about
  // 40 % of the rate the engine gets (1.19 against 2.8-3.0 GB/s measured;
  // docs/notes/2026-11-30-planner-traced-step-model.md).
  std::unique_ptr<PinnedHostPool> pool = make_io_buffer_pool(bytes);
  std::unique_ptr<std::byte, PoolFree<std::byte>> buf(static_cast<std::byte*>(pool->allocate(bytes)),
                                                       PoolFree<std::byte>{pool.get()});
  io->allocate_space(f, 0, bytes);
  auto pass = [&](bool write) {
    std::vector<IoRequest> reqs;
    const double t0 = now_s();
    for (std::uint64_t off = 0; off < bytes; off += chunk) {
      reqs.push_back(write ? io->submit_write(f, off, chunk, buf.get() + off)
                           : io->submit_read(f, off, chunk, buf.get() + off));
    }
    wait_all(reqs);
    return static_cast<double>(bytes) / (now_s() - t0) / 1e9;
  };
  auto mixed = [&] {
    const std::uint64_t half = bytes / 2 / chunk * chunk;
    std::vector<IoRequest> reads, writes;
    const double t0 = now_s();
    for (std::uint64_t off = 0; off < half; off += chunk) {
      reads.push_back(io->submit_read(f, off, chunk, buf.get() + off));
      writes.push_back(io->submit_write(f, half + off, chunk, buf.get() + half + off));
    }
    wait_all(reads);
    const double read_s = now_s() - t0;
    wait_all(writes);
    return static_cast<double>(half) / read_s / 1e9;
  };
  std::vector<double> w, r, m;
  for (int i = 0; i < o.reps; ++i) w.push_back(pass(true));
  ::sync();
  for (int i = 0; i < o.reps; ++i) r.push_back(pass(false));
  for (int i = 0; i < o.reps; ++i) m.push_back(mixed());
  io->close_file(f);
  return {median(r), median(w), median(m)};
}

std::pair<double, double> measure_copies(const ProfileOpts& o, std::uint64_t bytes, std::string* device) {
  std::unique_ptr<Device> dev = make_device(Config{});
  *device = dev->kind() == DeviceKind::kSim ? "sim" : "cuda";
  auto host = aligned(bytes);
  dev->register_host(host.get(), bytes);
  void* d = dev->allocate(bytes);
  std::vector<double> h2d, d2h;
  for (int i = 0; i < o.reps + 1; ++i) {  // the first pass touches the pages: not counted
    double t0 = now_s();
    dev->copy_h2d_async(d, host.get(), bytes).wait();
    const double a = static_cast<double>(bytes) / (now_s() - t0) / 1e9;
    t0 = now_s();
    dev->copy_d2h_async(host.get(), d, bytes).wait();
    const double b = static_cast<double>(bytes) / (now_s() - t0) / 1e9;
    if (i > 0) {
      h2d.push_back(a);
      d2h.push_back(b);
    }
  }
  dev->free(d);
  dev->unregister_host(host.get());
  return {median(h2d), median(d2h)};
}

double measure_adam(const ProfileOpts& o) {
  const std::size_t n = 16u << 20;
  std::vector<float> master(n, 0.5f), grad(n, 0.01f), m(n, 0.f), v(n, 0.f);
  AdamParams p;
  adam_step(p, master.data(), grad.data(), m.data(), v.data(), n);  // warm-up, first touch
  std::vector<double> rates;
  for (int i = 0; i < o.reps; ++i) {
    p.step = i + 2;
    const double t0 = now_s();
    adam_step(p, master.data(), grad.data(), m.data(), v.data(), n);
    rates.push_back(static_cast<double>(n) / (now_s() - t0));
  }
  return median(rates);
}

double measure_checksum(const ProfileOpts& o) {
  // Four 64 MiB buffers in turn, so each hash reads memory, as a completion's verify does.
  const std::size_t n = 64u << 20;
  std::vector<std::vector<unsigned char>> bufs(4, std::vector<unsigned char>(n));
  for (std::size_t b = 0; b < bufs.size(); ++b) {
    for (std::size_t i = 0; i < n; i += 64) bufs[b][i] = static_cast<unsigned char>(i * 31 + b);
  }
  std::uint64_t sink = 0;
  std::vector<double> rates;
  for (int i = 0; i < std::max(4, o.reps); ++i) {
    const double t0 = now_s();
    sink ^= detail::extent_checksum(bufs[static_cast<std::size_t>(i) % bufs.size()].data(), n);
    rates.push_back(static_cast<double>(n) / (now_s() - t0) / 1e9);
  }
  if (sink == 0x5eed) std::fprintf(stderr, " ");  // keeps the hashes from being optimised away
  return median(rates);
}

double measure_gemm(const ProfileOpts& o) {
  const int N = 512, C = 768, OC = 3072;
  std::vector<float> a(static_cast<std::size_t>(N) * C, 0.01f), w(static_cast<std::size_t>(OC) * C, 0.02f),
      c(static_cast<std::size_t>(N) * OC);
  gpt::cpu::matmul_forward<float>(c.data(), a.data(), w.data(), nullptr, N, C, OC);
  std::vector<double> rates;
  for (int i = 0; i < o.reps; ++i) {
    const double t0 = now_s();
    gpt::cpu::matmul_forward<float>(c.data(), a.data(), w.data(), nullptr, N, C, OC);
    rates.push_back(2.0 * N * C * OC / (now_s() - t0) / 1e9);
  }
  return median(rates);
}

// The GPT the profile measures: `layers` blocks at `d_model` (64-wide heads), sequences of 128
// tokens, a byte-level vocabulary of 256 (the matrix's corpus).
gpt::GptConfig profile_gpt(int d_model, int layers) {
  gpt::GptConfig cfg;
  cfg.n_layer = layers;
  cfg.d_model = d_model;
  cfg.n_head = std::max(1, d_model / 64);
  cfg.seq_len = 128;
  cfg.vocab_size = 256;
  return cfg;
}

// `n` random token ids and targets in [0, 256), from `seed`.
std::pair<std::vector<std::int32_t>, std::vector<std::int32_t>> random_batch(std::size_t n, unsigned seed) {
  std::vector<std::int32_t> tok(n), tgt(n);
  std::mt19937 rng(seed);
  for (std::size_t i = 0; i < n; ++i) {
    tok[i] = static_cast<std::int32_t>(rng() % 256);
    tgt[i] = static_cast<std::int32_t>(rng() % 256);
  }
  return {std::move(tok), std::move(tgt)};
}

// ZeroEngine as tiermem-train makes it at world 1 for the profile's engine figures: stage 3,
// gradient clipping on (tiermem-train's default), the given host and device budgets (bytes; 0:
// the engine's default).
Config profile_engine_config(std::uint64_t host_budget, std::uint64_t device_budget) {
  return parse_config(fmt::format(R"({{"zero_optimization": {{"stage": 3}}, "gradient_clipping": 1.0,
      "tiermem": {{"host_budget_bytes": {}, "device_budget_bytes": {}}}}})", host_budget, device_budget));
}

// The model's forward+backward at one width: model FLOPs per second.
double measure_model(const ProfileOpts& o, int d_model, int batch) {
  const gpt::GptConfig cfg = profile_gpt(d_model, 2);
  const int B = batch, T = 128;
  auto params = gpt::init_params(cfg, 1);
  std::vector<std::vector<float>> grads;
  for (const auto& p : params) grads.emplace_back(p.size(), 0.f);
  const auto [tok, tgt] = random_batch(static_cast<std::size_t>(B) * T, 7);
  gpt::Model model(cfg, B, T);
  model.forward_backward(params, grads, tok, tgt);  // warm-up
  // At least two repetitions, and at least a second in all: a narrow model's step takes
  // milliseconds, and a few of them say little on a shared CPU (the median of more does).
  std::vector<double> rates;
  double spent = 0;
  for (int i = 0; i < std::min(o.reps, 2) || (spent < 1.0 && i < 400); ++i) {
    const double t0 = now_s();
    model.forward_backward(params, grads, tok, tgt);
    const double dt = now_s() - t0;
    spent += dt;
    rates.push_back(gpt::flops_per_token(cfg, T) * B * T / dt / 1e9);
  }
  return median(rates);
}

// ZeroEngine::step() at world 1 as tiermem-train drives it: `modules` modules of `module_elems`
// elements, stage 3, gradient clipping on (tiermem-train's default), the state in host memory,
// the working parameters on the Device the engine makes. Each repetition hands every module's
// gradient off through the engine's recycled buffer (gradient_buffer(), reduce_gradients(module,
// std::move)) and then times step(): AdamW over the sub-groups, the norm, the new working
// parameters written to their home. The first repetition (the prefetcher's recorded step, first
// touch) is not counted. Parameters stepped per second.
double measure_step(const ProfileOpts& o, std::size_t module_elems, int modules) {
  const std::uint64_t state = 16ull * module_elems * static_cast<std::uint64_t>(modules);
  const Config cfg = profile_engine_config(2 * state, 0);  // device 0: the engine's default
  auto comm = make_single_communicator();
  const std::vector<std::size_t> numels(static_cast<std::size_t>(modules), module_elems);
  ZeroEngine e(cfg, *comm, numels);
  {
    std::vector<float> init(module_elems, 0.01f);
    for (int m = 0; m < modules; ++m) e.register_module(fmt::format("m{}", m), init);
  }
  std::vector<double> rates;
  for (int r = 0; r < o.reps + 1; ++r) {
    for (int m = modules; m-- > 0;) {
      std::vector<float> g = e.gradient_buffer(m);
      g[static_cast<std::size_t>(m)] = 1e-3f;
      e.reduce_gradients(m, std::move(g));
    }
    e.synchronize();  // the hand-offs done: the step alone is timed
    const double t0 = now_s();
    e.step();
    const double dt = now_s() - t0;
    if (r > 0) rates.push_back(static_cast<double>(module_elems) * modules / dt);
  }
  return median(rates);
}

// The gradient hand-off against the model's own backward pass: a GPT of `layers` blocks at
// d_model `d_model` (vocab 256, one sequence of 128 tokens), its backward steps run after a
// forward pass each, in turn (which first alternates): into plain resident buffers, and as
// tiermem-train's ZeroEngine path does it (world 1, stage 3, clipping on, state in host memory):
// each module's buffer from gradient_buffer(), handed back through reduce_gradients(module,
// std::move) as its gradient completes (the gradient thread then copies it into the partition
// with the folded norm and zeroes it, beside the next module's backward), and synchronize() at
// the end. What the second adds to the first is what tiermem-train's step pays: the copies' CPU
// time taken from the compute's cores, and the last block's hand-off, beside which only the
// embedding's short backward runs: its tail, from the end of the last block's backward step to the
// end of the pass, is timed in both. Returns the medians of what the second adds, in all and to
// the tail (first repetition not counted; at least --reps of them and three seconds in all), the
// fp32 gradient bytes, and the bytes of one block and the embedding.
struct HandoffRun {
  double added_s = 0, tail_s = 0, grad_bytes = 0, pass_bytes = 0;
};
HandoffRun measure_handoff(const ProfileOpts& o, int d_model, int layers) {
  const gpt::GptConfig cfg = profile_gpt(d_model, layers);
  const int B = 1, T = 128;
  const std::vector<std::vector<float>> params = gpt::init_params(cfg, 1);
  std::vector<std::vector<float>> grads;
  std::vector<std::size_t> numels;
  std::uint64_t elems = 0;
  for (const auto& p : params) {
    grads.emplace_back(p.size(), 0.f);
    numels.push_back(p.size());
    elems += p.size();
  }
  const auto [tok, tgt] = random_batch(static_cast<std::size_t>(B) * T, 11);
  gpt::Model model(cfg, B, T);
  const Config zc = profile_engine_config(32 * elems, 8 * elems);
  auto comm = make_single_communicator();
  ZeroEngine e(zc, *comm, numels);
  for (std::size_t m = 0; m < params.size(); ++m) e.register_module(fmt::format("m{}", m), params[m]);
  const std::vector<gpt::Step> steps = gpt::backward_steps(cfg);
  // Each pass returns {its time, its tail: from the end of the first block's (module 1's, the
  // last block backward reaches) backward step to the end}.
  auto plain = [&] {
    model.forward_all(params, tok, tgt);
    const double t0 = now_s();
    double t1 = t0;
    for (const gpt::Step& s : steps) {
      model.backward(s, params[s.module], grads[s.module]);
      if (s.module == 1) t1 = now_s();
    }
    const double t2 = now_s();
    return std::pair{t2 - t0, t2 - t1};
  };
  auto engine = [&] {
    std::vector<std::vector<float>> g(params.size());
    model.forward_all(params, tok, tgt);
    const double t0 = now_s();
    double t1 = t0;
    for (const gpt::Step& s : steps) {
      std::vector<float>& b = g[static_cast<std::size_t>(s.module)];
      if (b.empty()) b = e.gradient_buffer(s.module);
      model.backward(s, params[s.module], b);
      // Module 0 (the tied embedding) is complete only after the embedding's own step.
      if (s.module != 0 || s.kind == gpt::StepKind::kEmbed) {
        e.reduce_gradients(s.module, std::move(b));
        std::vector<float>().swap(b);
      }
      if (s.module == 1) t1 = now_s();
    }
    e.synchronize();
    const double t2 = now_s();
    e.step();  // not timed: the accumulation starts over, as at the trainer's step
    return std::pair{t2 - t0, t2 - t1};
  };
  // A narrow model's pass takes milliseconds, and the hand-off's share of it is a difference of
  // two noisy times: many repetitions, their median.
  std::vector<double> added, tail;
  const double t_begin = now_s();
  for (int r = 0; r < o.reps + 1 || (now_s() - t_begin < 3.0 && r < 400); ++r) {
    std::pair<double, double> p, q;
    if (r % 2 == 0) {
      p = plain();
      q = engine();
    } else {
      q = engine();
      p = plain();
    }
    if (r > 0) {
      added.push_back(q.first - p.first);
      tail.push_back(q.second - p.second);
    }
  }
  HandoffRun out;
  out.added_s = median(added);
  out.tail_s = median(tail);
  out.grad_bytes = 4.0 * static_cast<double>(elems);
  out.pass_bytes = 4.0 * static_cast<double>(numels[0] + numels[1]);
  return out;
}

// The hand-off's price at one width, from the model with 6 blocks: the exposed part (what the
// tail adds: one block's and the embedding's bytes per second) and the rest per byte (what the
// pass adds beyond the tail, GB/s of the other modules' gradient per second added). Each is held
// to at least 0.1 ms per 100 MB: a hand-off the compute hid entirely (or noise below it) reads as
// a very high rate, not as infinite or negative. Returns {per-byte GB/s, per-pass GB/s}.
std::pair<double, double> handoff_rates(const ProfileOpts& o, int d_model) {
  const HandoffRun h = measure_handoff(o, d_model, 6);
  const double rest_bytes = h.grad_bytes - h.pass_bytes;
  const double tail_s = std::max(h.tail_s, 1e-4 * h.pass_bytes / 1e8);
  const double rest_s = std::max(h.added_s - tail_s, 1e-4 * rest_bytes / 1e8);
  return {rest_bytes / rest_s / 1e9, h.pass_bytes / tail_s / 1e9};
}

std::uint64_t meminfo(const char* key) {
  std::ifstream in("/proc/meminfo");
  std::string k;
  std::uint64_t kb = 0;
  std::string unit;
  while (in >> k >> kb >> unit) {
    if (k == std::string(key) + ":") return kb * 1024;
  }
  return 0;
}

int run_profile(const ProfileOpts& o) {
  // Bad input is a ConfigError: tiermem-bench prints it on one line and exits 2.
  const std::uint64_t nvme_bytes = parse_size(o.nvme_size, "--size");
  const std::uint64_t copy_bytes = parse_size_within(o.copy_size, "--copy-size", "4KiB", "1GiB");
  if (nvme_bytes < (8u << 20)) throw ConfigError("--size", o.nvme_size, "must be at least 8MiB");
  // Refused up front rather than when the file is laid out or the buffer allocated: --size bytes
  // go to a file under --path and come back into a host buffer of the same size.
  if (const std::uint64_t avail = meminfo("MemAvailable"); avail > 0 && nvme_bytes > avail / 2) {
    throw ConfigError("--size", o.nvme_size,
                      fmt::format("is read back into a host buffer of that size, and this machine has {} of "
                                  "memory available: give {} or less",
                                  format_bytes(avail), format_bytes(avail / 2)));
  }
  if (const std::uint64_t drive = drive_free_bytes(o.path); drive > 0 && nvme_bytes > drive) {
    throw ConfigError("--size", o.nvme_size,
                      fmt::format("needs {} on the drive under --path {}, which has {} free: give a smaller size, "
                                  "or a --path on a larger drive",
                                  format_bytes(nvme_bytes), o.path, format_bytes(drive)));
  }
  const double t_start = now_s();
  std::string note, device;
  const NvmeRates nvme = measure_nvme(o, nvme_bytes, &note);
  const auto [h2d, d2h] = measure_copies(o, copy_bytes, &device);
  const double adam = measure_adam(o);
  const double gemm = measure_gemm(o);
  const double checksum = measure_checksum(o);
  // The optimizer step with modules the size of a small model's blocks (8 of 4 M elements) and of
  // a large one's (4 of 16 M); the hand-off on the model at the presets' widths.
  nlohmann::json optimizer_by, handoff_by, handoff_pass_by;
  double optimizer = 0;
  for (const std::size_t me : {std::size_t{4} << 20, std::size_t{16} << 20}) {
    optimizer = measure_step(o, me, me == (std::size_t{4} << 20) ? 8 : 4);
    optimizer_by[std::to_string(me)] = optimizer;
  }
  const spdlog::level::level_enum log_level = logger().level();  // six engines: their setup lines are noise here
  if (log_level < spdlog::level::warn) logger().set_level(spdlog::level::warn);
  for (const int d : {256, 768, 1024}) {
    const auto [per_byte, pass] = handoff_rates(o, d);
    handoff_by[std::to_string(d)] = per_byte;
    handoff_pass_by[std::to_string(d)] = pass;
  }
  logger().set_level(log_level);
  nlohmann::json by_width, by_width_128;
  for (int d : {256, 768, 1024}) {
    by_width[std::to_string(d)] = measure_model(o, d, 4);
    by_width_128[std::to_string(d)] = measure_model(o, d, 1);
  }
  // The drive's free space, read after measure_nvme removed the directories it made.
  const std::uint64_t free_bytes = drive_free_bytes(o.path);
  const Config cfg;
  nlohmann::json p;
  p["name"] = "this machine (tiermem-bench profile)";
  p["device"] = device;
  p["cpu_isa"] = std::string(adam_isa_name(adam_best_isa()));
  p["threads"] = omp_get_max_threads();
  p["gpus"] = 1;
  p["compute_gflops"] = by_width["768"];
  p["compute_gflops_by_width"] = by_width;          // micro-batches of 512 tokens
  p["compute_gflops_by_width_128"] = by_width_128;  // micro-batches of 128 tokens
  p["gemm_gflops"] = gemm;
  p["checksum_gbps"] = checksum;
  p["cpu_adam_params_per_s"] = adam;
  p["grad_handoff_gbps"] = handoff_by["1024"];
  p["grad_handoff_gbps_by_width"] = handoff_by;
  p["grad_handoff_pass_gbps_by_width"] = handoff_pass_by;
  p["optimizer_params_per_s"] = optimizer;
  p["optimizer_params_per_s_by_module_elems"] = optimizer_by;
  p["h2d_gbps"] = h2d;
  p["d2h_gbps"] = d2h;
  p["nvme_read_gbps"] = nvme.read;
  p["nvme_write_gbps"] = nvme.write;
  // Measured only when --size holds two requests (a read beside a write); else left out, which
  // the planner reads as "not measured" (it then prices reads and writes in turn).
  if (nvme.read_beside_writes > 0) p["nvme_read_beside_writes_gbps"] = nvme.read_beside_writes;
  p["nvme_settings"] = {{"block_size", cfg.aio.block_size_bytes}, {"queue_depth", cfg.aio.queue_depth},
                        {"rings", cfg.aio.intra_op_parallelism}, {"request_bytes", cfg.tiermem.pipeline_chunk_bytes},
                        {"o_direct", note.empty()}, {"path", o.path}};
  if (!note.empty()) p["note"] = note;
  p["host_memory_bytes"] = meminfo("MemTotal");
  p["host_available_bytes"] = meminfo("MemAvailable");
  p["nvme_free_bytes"] = free_bytes;
  p["seconds"] = now_s() - t_start;
  std::printf("profile: %s, CPU %s, %d threads\n", device.c_str(), p["cpu_isa"].get<std::string>().c_str(),
              omp_get_max_threads());
  const std::string beside = nvme.read_beside_writes > 0
                                 ? fmt::format("{:.2f} GB/s", nvme.read_beside_writes)
                                 : fmt::format("not measured (it needs --size {} or more)",
                                               format_bytes(2 * cfg.tiermem.pipeline_chunk_bytes));
  std::printf("  nvme       read %.2f GB/s, write %.2f GB/s, read beside writes %s (%s)%s\n", nvme.read,
              nvme.write, beside.c_str(), o.path.c_str(), note.empty() ? "" : (", " + note).c_str());
  std::printf("  copies     h2d %.2f GB/s, d2h %.2f GB/s\n", h2d, d2h);
  std::printf("  cpu adam   %.3g params/s; checksum (XXH3-64, one thread) %.2f GB/s\n", adam, checksum);
  std::printf("  engine     gradient hand-off %.2f / %.2f / %.2f GB/s per byte, %.2f / %.2f / %.2f GB/s per pass "
              "(d_model 256 / 768 / 1024); optimizer step %.3g / %.3g params/s (modules of 4 M / 16 M elements)\n",
              handoff_by["256"].get<double>(), handoff_by["768"].get<double>(), handoff_by["1024"].get<double>(),
              handoff_pass_by["256"].get<double>(), handoff_pass_by["768"].get<double>(),
              handoff_pass_by["1024"].get<double>(), optimizer_by["4194304"].get<double>(), optimizer);
  std::printf("  compute    sgemm %.1f GFLOP/s; model fwd+bwd d256 %.1f, d768 %.1f, d1024 %.1f GFLOP/s "
              "(512 tokens), %.1f, %.1f, %.1f (128 tokens)\n",
              gemm, by_width["256"].get<double>(), by_width["768"].get<double>(), by_width["1024"].get<double>(),
              by_width_128["256"].get<double>(), by_width_128["768"].get<double>(),
              by_width_128["1024"].get<double>());
  std::printf("  memory     %s total, %s available; %s free under %s (%.1f s)\n",
              format_bytes(p["host_memory_bytes"]).c_str(), format_bytes(p["host_available_bytes"]).c_str(),
              format_bytes(free_bytes).c_str(), o.path.c_str(), p["seconds"].get<double>());
  if (o.json) std::printf("%s\n", nlohmann::json{{"profile", p}}.dump().c_str());
  return 0;
}

CommandSetup setup_profile() {
  return [](CLI::App& sub) -> std::function<int()> {
    auto o = std::make_shared<ProfileOpts>();
    sub.add_option("--path", o->path, "directory on the NVMe drive the swap files go to")->default_val(o->path);
    sub.add_option("--size", o->nvme_size, "bytes written then read per repetition")->default_val(o->nvme_size);
    sub.add_option("--copy-size", o->copy_size, "bytes per host<->device copy")->default_val(o->copy_size);
    sub.add_option("--reps", o->reps, "repetitions (medians)")->default_val(o->reps)->check(tiermem::cli::whole_number_check())->check(CLI::Range(1, 100));
    sub.add_flag("--json", o->json, "last line: {\"profile\": {...}} for tiermem-plan --profile");
    return [o] { return run_profile(*o); };
  };
}

}  // namespace

TIERMEM_BENCH_COMMAND(profile, "profile",
                      "measure this machine (NVMe, host<->device, CPU Adam, GEMM, memory) for tiermem-plan",
                      setup_profile());

}  // namespace tiermem::bench
