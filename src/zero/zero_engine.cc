// src/zero/zero_engine.cc — ZeroEngine (see include/tiermem/zero_engine.h): shard bookkeeping,
// bucketed reduce-scatter, the sub-group AdamW step (host or NVMe-pipelined) and stage-3 gathers
// (from host memory, or through a TensorStore + Prefetcher when offload_param is cpu or nvme).
#include "tiermem/zero_engine.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <string>

#include "tiermem/adam.h"
#include "tiermem/communicator.h"
#include "tiermem/error.h"
#include "tiermem/io_engine.h"
#include "tiermem/log.h"
#include "tiermem/loss_scaler.h"
#include "tiermem/pinned_host_pool.h"
#include "tiermem/prefetcher.h"
#include "tiermem/shard.h"
#include "tiermem/swap_space.h"
#include "tiermem/tensor_store.h"

namespace tiermem {
namespace {

// 4 KiB-aligned heap buffer (O_DIRECT-friendly staging).
struct AlignedBuf {
  void* p = nullptr;
  std::size_t bytes = 0;
  AlignedBuf() = default;
  explicit AlignedBuf(std::size_t n) : bytes(n) {
    if (n == 0) return;
    p = std::aligned_alloc(4096, (n + 4095) / 4096 * 4096);
    if (!p) throw OutOfMemoryError(Tier::kHost, n, 0, "ZeroEngine staging buffer");
    std::memset(p, 0, n);
  }
  AlignedBuf(AlignedBuf&& o) noexcept : p(o.p), bytes(o.bytes) { o.p = nullptr; o.bytes = 0; }
  AlignedBuf& operator=(AlignedBuf&& o) noexcept {
    std::swap(p, o.p);
    std::swap(bytes, o.bytes);
    return *this;
  }
  ~AlignedBuf() { std::free(p); }
  float* f() const { return static_cast<float*>(p); }
  std::byte* b() const { return static_cast<std::byte*>(p); }
};

// Collective counts are bounded (MPI uses int); big buffers go in pieces of this many elements.
constexpr std::size_t kMaxCollectiveElems = std::size_t{1} << 28;

std::string lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

}  // namespace

struct ZeroEngine::Impl {
  Communicator& comm;
  ZeroEngineOptions opts;
  int rank = 0, world = 1;
  int opt_world = 1, opt_rank = 0;  // stage 0: optimizer state is not partitioned
  int stage = 0;
  std::size_t wsize = 4;  // working dtype bytes
  DType comm_dtype = DType::kF32;

  // Registration.
  std::vector<std::string> names;
  std::vector<std::size_t> numels;
  std::vector<std::vector<float>> init_shards;  // until finalize
  bool finalized = false;

  // Layout.
  ShardLayout layout;
  std::vector<std::size_t> full_off;  // module's offset in the full (padded) flat space
  std::vector<bool> persistent;       // stage 3: kept whole
  std::vector<ElemRange> sub_groups;  // of the rank-flat space

  // Optimizer state (host) or its NVMe home.
  bool nvme_opt = false;
  std::vector<float> master, m, v;  // host: rank_flat each
  // Staging buffers (buffer_count × 3 × max sub-group fp32) from a PinnedHostPool that honours
  // offload_optimizer.pin_memory. Declared before `io`: outlives the engine's registrations.
  struct Staging {
    void* p = nullptr;
    std::size_t bytes = 0;
    float* f() const { return static_cast<float*>(p); }
  };
  std::unique_ptr<PinnedHostPool> staging_pool;
  std::vector<Staging> staging;
  std::unique_ptr<IoEngine> io;
  std::shared_ptr<SwapSpace> swap;
  std::vector<SwapExtent> sg_extents;  // [master | m | v] per sub-group

  // Gradients.
  std::vector<float> full_grad;   // stages 0, 1: full padded flat
  std::vector<float> shard_grad;  // stages 1–3: rank flat
  std::vector<int> grad_calls;
  struct Inflight {
    CommHandle handle;
    std::vector<float> send, recv;
    std::size_t dst = 0;  // rank-flat offset
  };
  std::deque<Inflight> inflight;

  // Working parameters. Without a parameter store work_shard holds the whole rank-flat shard
  // (stage 0: the full copy) and shard_off == flat_offset; with one it holds only the persistent
  // modules' shards, packed (shard_off), and the others live in pstore.
  AlignedBuf work_shard;
  std::vector<std::size_t> shard_off;      // module's offset in work_shard (elements)
  std::vector<AlignedBuf> work_full;       // per module, padded × wsize (stages 1–2, persistent)
  bool nvme_param = false;
  // Stage 3 + offload_param cpu|nvme: each non-persistent module's working shard is a tensor of
  // pstore with home host|nvme, acquired at the host tier for gathers and for the AdamW output,
  // prefetched by the Prefetcher (the policy pstore owns) from the recorded trace of a step.
  bool store_param = false;
  std::unique_ptr<TensorStore> pstore;     // after swap/io: destroyed first
  std::vector<TensorId> ptensor;           // per module; kInvalidTensor when not in pstore
  std::uint64_t gathered_live = 0;

  std::unique_ptr<DynamicLossScaler> scaler;
  ZeroStats st;

  Impl(Communicator& c, ZeroEngineOptions o) : comm(c), opts(o) {}

  void finalize(const Config& cfg);
  void make_param_store(const Config& cfg, const std::vector<float>& init_flat);

  float* grad_ptr() { return stage == 0 ? full_grad.data() : shard_grad.data(); }

  std::byte* work_ptr(int mod) {
    if (stage == 0) return work_shard.b() + layout.flat_offset[mod] * wsize;
    return work_full[mod].b();
  }

  // The module's working shard in work_shard (not for modules in pstore).
  std::byte* mem_shard(std::size_t mod) { return work_shard.b() + shard_off[mod] * wsize; }

  bool in_store(std::size_t mod) const { return store_param && ptensor[mod] != kInvalidTensor; }

  // The module whose rank-flat shard range contains element `a` (a < rank_flat).
  std::size_t module_at(std::size_t a) const {
    auto it = std::upper_bound(layout.flat_offset.begin(), layout.flat_offset.end(), a);
    return static_cast<std::size_t>(it - layout.flat_offset.begin()) - 1;
  }

  // fp32 -> working dtype (n elements).
  void to_working(const float* src, std::byte* dst, std::size_t n, bool bf16) const {
    if (wsize == 4) {
      std::memcpy(dst, src, n * sizeof(float));
      return;
    }
    auto* d = reinterpret_cast<std::uint16_t*>(dst);
    for (std::size_t i = 0; i < n; ++i) d[i] = bf16 ? f32_to_bf16(src[i]) : f32_to_f16(src[i]);
  }

  void complete_front() {
    Inflight f = std::move(inflight.front());
    inflight.pop_front();
    f.handle.wait();
    float* g = shard_grad.data() + f.dst;
    for (std::size_t i = 0; i < f.recv.size(); ++i) g[i] += f.recv[i];
  }

  void sync() {
    while (!inflight.empty()) complete_front();
  }

  // Chunked collectives over big flat buffers.
  void all_reduce_sum(float* buf, std::size_t n) {
    for (std::size_t b = 0; b < n; b += kMaxCollectiveElems) {
      comm.all_reduce(buf + b, buf + b, std::min(kMaxCollectiveElems, n - b), DType::kF32, ReduceOp::kSum);
    }
  }

  // Copies [a, b) of the rank-flat master shard into dst (from host or NVMe).
  void read_master(std::size_t a, std::size_t b, float* dst) {
    if (!nvme_opt) {
      std::copy(master.begin() + static_cast<std::ptrdiff_t>(a), master.begin() + static_cast<std::ptrdiff_t>(b), dst);
      return;
    }
    for (std::size_t k = 0; k < sub_groups.size(); ++k) {
      const ElemRange& g = sub_groups[k];
      std::size_t lo = std::max(a, g.begin), hi = std::min(b, g.end);
      if (lo >= hi) continue;
      swap->read(sg_extents[k], staging[0].p, g.size() * 4).wait();  // master part only
      st.optimizer_nvme_read_bytes += g.size() * 4;
      std::copy(staging[0].f() + (lo - g.begin), staging[0].f() + (hi - g.begin), dst + (lo - a));
    }
  }
};

// ---------------------------------------------------------------------------------------------

ZeroEngine::Gathered::Gathered(Gathered&& o) noexcept { *this = std::move(o); }

ZeroEngine::Gathered& ZeroEngine::Gathered::operator=(Gathered&& o) noexcept {
  if (this != &o) {
    release();
    engine_ = o.engine_;
    module_ = o.module_;
    data_ = o.data_;
    numel_ = o.numel_;
    dtype_ = o.dtype_;
    owned_ = o.owned_;
    o.engine_ = nullptr;
    o.data_ = nullptr;
    o.owned_ = false;
  }
  return *this;
}

ZeroEngine::Gathered::~Gathered() { release(); }

void ZeroEngine::Gathered::release() {
  if (engine_) engine_->release_gathered(*this);
  engine_ = nullptr;
  data_ = nullptr;
  owned_ = false;
}

std::span<const float> ZeroEngine::Gathered::f32() const {
  if (dtype_ != DType::kF32) {
    throw Error("ZeroEngine::Gathered::f32(): module " + std::to_string(module_) + " is " +
                std::string(dtype_name(dtype_)) + ", use half()");
  }
  return {static_cast<const float*>(data_), numel_};
}

std::span<const std::uint16_t> ZeroEngine::Gathered::half() const {
  if (dtype_ == DType::kF32) {
    throw Error("ZeroEngine::Gathered::half(): module " + std::to_string(module_) + " is f32, use f32()");
  }
  return {static_cast<const std::uint16_t*>(data_), numel_};
}

void ZeroEngine::release_gathered(Gathered& g) noexcept {
  if (g.owned_) {
    std::free(const_cast<void*>(g.data_));
    impl_->gathered_live -= impl_->layout.modules[g.module_].padded * impl_->wsize;
  }
}

// ---------------------------------------------------------------------------------------------

ZeroEngine::ZeroEngine(const Config& config, Communicator& comm, ZeroEngineOptions options)
    : config_(config), impl_(std::make_unique<Impl>(comm, options)) {
  Impl& I = *impl_;
  const ZeroConfig& z = config_.zero;
  if (z.stage < 0 || z.stage > 3) {
    throw ConfigError("zero_optimization.stage", std::to_string(z.stage), "ZeRO stage must be 0, 1, 2 or 3");
  }
  if (options.alignment_elems == 0) throw Error("ZeroEngineOptions::alignment_elems must be >= 1");
  if (z.sub_group_size_elems < options.alignment_elems) {
    throw ConfigError("zero_optimization.sub_group_size", std::to_string(z.sub_group_size_elems),
                      "config key 'zero_optimization.sub_group_size' = " + std::to_string(z.sub_group_size_elems) +
                          " is smaller than the shard alignment of " + std::to_string(options.alignment_elems) +
                          " elements; use a multiple of it");
  }
  std::string opt = lower(config_.optimizer.type);
  if (opt != "adamw" && opt != "adam") {
    throw ConfigError("optimizer.type", config_.optimizer.type,
                      "config key 'optimizer.type' = \"" + config_.optimizer.type +
                          "\" is not supported by ZeroEngine (Adam, AdamW)");
  }
  if (z.offload_optimizer.device != OffloadDevice::kNone && z.stage == 0) {
    throw ConfigError("zero_optimization.offload_optimizer.device",
                      std::string(offload_device_name(z.offload_optimizer.device)),
                      "config key 'zero_optimization.offload_optimizer.device' needs stage >= 1");
  }
  if (z.offload_param.device != OffloadDevice::kNone && z.stage != 3) {
    throw ConfigError("zero_optimization.offload_param.device",
                      std::string(offload_device_name(z.offload_param.device)),
                      "config key 'zero_optimization.offload_param.device' needs stage 3");
  }
  for (const auto* o : {&z.offload_optimizer, &z.offload_param}) {
    const char* key = o == &z.offload_param ? "zero_optimization.offload_param" : "zero_optimization.offload_optimizer";
    if (o->device == OffloadDevice::kNvme && o->nvme_path.empty()) {
      throw ConfigError(std::string(key) + ".nvme_path", "", std::string("config key '") + key +
                                                                 ".device' is \"nvme\" but no nvme_path is given");
    }
    if (o->buffer_count < 1) {
      throw ConfigError(std::string(key) + ".buffer_count", std::to_string(o->buffer_count),
                        std::string("config key '") + key + ".buffer_count' must be >= 1");
    }
  }
  if (config_.fp16.enabled && config_.bf16) {
    throw ConfigError("fp16.enabled", "true", "fp16 and bf16 cannot both be enabled");
  }
  working_dtype_ = config_.bf16 ? DType::kBF16 : config_.fp16.enabled ? DType::kF16 : DType::kF32;
  I.wsize = dtype_size(working_dtype_);
  I.comm_dtype = working_dtype_ == DType::kF32 ? DType::kF32 : DType::kU16;
  I.stage = z.stage;
  I.rank = comm.rank();
  I.world = comm.world_size();
  I.opt_world = z.stage == 0 ? 1 : I.world;
  I.opt_rank = z.stage == 0 ? 0 : I.rank;
  I.nvme_opt = z.offload_optimizer.device == OffloadDevice::kNvme;
  I.nvme_param = z.offload_param.device == OffloadDevice::kNvme;
  I.store_param = z.stage == 3 && z.offload_param.device != OffloadDevice::kNone;
  if (config_.fp16.enabled) I.scaler = std::make_unique<DynamicLossScaler>(config_.fp16);
}

ZeroEngine::~ZeroEngine() {
  try {
    impl_->sync();
  } catch (const std::exception& e) {
    TM_LOG_ERROR("ZERO", "reduce-scatter pending at ZeroEngine destruction failed: {}", e.what());
  }
  impl_->pstore.reset();  // frees its swap extents
  if (impl_->swap) {
    for (auto& e : impl_->sg_extents) impl_->swap->free(e);
  }
}

int ZeroEngine::register_module(const std::string& name, std::span<const float> init) {
  Impl& I = *impl_;
  if (I.finalized) {
    throw Error("ZeroEngine::register_module(\"" + name +
                "\"): modules must be registered before the first gather/reduce_gradients/step");
  }
  ModuleShard s = make_module_shard(init.size(), I.opt_world, I.opts.alignment_elems);
  ElemRange r = s.range(I.opt_rank);
  std::vector<float> shard(s.shard, 0.0f);
  for (std::size_t i = r.begin; i < std::min(r.end, init.size()); ++i) shard[i - r.begin] = init[i];
  I.names.push_back(name);
  I.numels.push_back(init.size());
  I.init_shards.push_back(std::move(shard));
  return static_cast<int>(I.names.size()) - 1;
}

int ZeroEngine::num_modules() const { return static_cast<int>(impl_->names.size()); }

std::size_t ZeroEngine::module_numel(int module) const {
  if (module < 0 || module >= num_modules()) throw Error("ZeroEngine: unknown module " + std::to_string(module));
  return impl_->numels[module];
}

namespace {
std::vector<std::string> rank_dirs(const std::vector<std::string>& paths, int rank) {
  std::vector<std::string> out;
  for (const auto& p : paths) {
    std::filesystem::path d = std::filesystem::path(p) / ("rank" + std::to_string(rank));
    std::error_code ec;
    std::filesystem::create_directories(d, ec);
    if (ec) throw IoError(d.string(), 0, 0, ec.value(), "mkdir", "ZeroEngine swap directory: " + ec.message());
    out.push_back(d.string());
  }
  return out;
}
}  // namespace


// Computes the layout, allocates every buffer, writes the initial state to its home.
void ZeroEngine::Impl::finalize(const Config& cfg) {
  if (finalized) return;
  finalized = true;
  const ZeroConfig& z = cfg.zero;
  const std::size_t A = opts.alignment_elems;
  layout = make_shard_layout(numels, opt_world, A);
  const std::size_t R = layout.rank_flat;
  std::size_t off = 0;
  for (const auto& s : layout.modules) {
    full_off.push_back(off);
    off += s.padded;
  }
  for (std::size_t n : numels) {
    persistent.push_back(stage == 3 && n < z.stage3_param_persistence_threshold_elems);
  }
  sub_groups = make_sub_groups(R, z.sub_group_size_elems, A);
  grad_calls.assign(numels.size(), 0);

  // Gradients.
  if (stage <= 1) full_grad.assign(layout.full_flat, 0.0f);
  if (stage >= 1) shard_grad.assign(R, 0.0f);

  // Working params: the rank's shard (stage 0: everything), written from the initial master.
  std::vector<float> init_flat(R);
  for (std::size_t i = 0; i < numels.size(); ++i) {
    std::copy(init_shards[i].begin(), init_shards[i].end(), init_flat.begin() + static_cast<std::ptrdiff_t>(layout.flat_offset[i]));
  }
  init_shards.clear();
  init_shards.shrink_to_fit();
  std::size_t mem_elems = 0;
  for (std::size_t i = 0; i < numels.size(); ++i) {
    const bool stored = store_param && !persistent[i] && layout.modules[i].shard > 0;
    shard_off.push_back(store_param ? mem_elems : layout.flat_offset[i]);
    if (store_param && !stored) mem_elems += layout.modules[i].shard;
  }
  work_shard = AlignedBuf((store_param ? mem_elems : R) * wsize);
  for (std::size_t i = 0; i < numels.size(); ++i) {
    if (store_param && (!persistent[i] || layout.modules[i].shard == 0)) continue;
    if (!store_param && i > 0) continue;  // the whole rank-flat range at once
    const std::size_t n = store_param ? layout.modules[i].shard : R;
    to_working(init_flat.data() + (store_param ? layout.flat_offset[i] : 0), mem_shard(store_param ? i : 0), n,
               cfg.bf16);
  }
  work_full.resize(numels.size());
  for (std::size_t i = 0; i < numels.size(); ++i) {
    if (stage == 1 || stage == 2 || persistent[i]) {
      work_full[i] = AlignedBuf(layout.modules[i].padded * wsize);
      comm.all_gather(mem_shard(i), work_full[i].p, layout.modules[i].shard, comm_dtype);
      ++st.all_gather_calls;
    }
  }

  // Optimizer state.
  if (nvme_opt || nvme_param) {
    io = make_io_engine(cfg);
    const auto& paths = nvme_opt ? z.offload_optimizer.nvme_path : z.offload_param.nvme_path;
    swap = std::make_shared<SwapSpace>(cfg, rank_dirs(paths, rank), *io);
  }
  if (store_param) make_param_store(cfg, init_flat);
  if (!nvme_opt) {
    master = std::move(init_flat);
    m.assign(R, 0.0f);
    v.assign(R, 0.0f);
  } else {
    std::size_t max_sg = 0;
    for (const auto& g : sub_groups) max_sg = std::max(max_sg, g.size());
    const int nbuf = std::max(1, z.offload_optimizer.buffer_count);
    const std::size_t buf_bytes = 3 * max_sg * sizeof(float);
    PinnedHostPoolOptions po;
    po.budget_bytes = static_cast<std::uint64_t>(nbuf) * PinnedHostPool::allocation_size(buf_bytes);
    po.mapping_bytes = po.budget_bytes;
    po.pin_memory = z.offload_optimizer.pin_memory;
    po.numa_node = cfg.tiermem.numa_node;
    po.map_now = true;
    staging_pool = std::make_unique<PinnedHostPool>(po);
    for (int b = 0; b < nbuf; ++b) staging.push_back({staging_pool->allocate(buf_bytes), buf_bytes});
    for (const HostRegion& r : staging_pool->regions()) io->register_buffers(r.base, r.bytes);
    for (const auto& g : sub_groups) {
      SwapExtent e = swap->allocate(3 * g.size() * sizeof(float));
      float* s = staging[0].f();
      std::copy(init_flat.begin() + static_cast<std::ptrdiff_t>(g.begin), init_flat.begin() + static_cast<std::ptrdiff_t>(g.end), s);
      std::fill(s + g.size(), s + 3 * g.size(), 0.0f);
      swap->write(e, s, 3 * g.size() * sizeof(float)).wait();
      sg_extents.push_back(e);
    }
  }
  TM_LOG_INFO("ZERO",
              "stage {}: {} modules, rank {} of {}: {} elements of optimizer state ({} in {} sub-groups, {}), "
              "working {}",
              stage, numels.size(), rank, world, R, format_bytes(12 * R), sub_groups.size(),
              nvme_opt ? "nvme" : "host", dtype_name(cfg.bf16 ? DType::kBF16 : cfg.fp16.enabled ? DType::kF16 : DType::kF32));
}

// Stage 3 + offload_param cpu|nvme: registers every non-persistent module's working shard in a
// TensorStore (home host|nvme) driven by the Prefetcher, and opens the first recorded step.
void ZeroEngine::Impl::make_param_store(const Config& cfg, const std::vector<float>& init_flat) {
  TensorStoreOptions so = TensorStoreOptions::from_config(cfg);
  so.pin_memory = cfg.zero.offload_param.pin_memory;
  const Tier home = nvme_param ? Tier::kNvme : Tier::kHost;
  std::uint64_t homes = 0, largest = 0;
  for (std::size_t i = 0; i < numels.size(); ++i) {
    if (persistent[i] || layout.modules[i].shard == 0) continue;
    const std::uint64_t a = PinnedHostPool::allocation_size(layout.modules[i].shard * wsize);
    homes += a;
    largest = std::max(largest, a);
  }
  // Home host: every shard lives in the pool. Home nvme: the pool caches shards; it must hold at
  // least the largest (acquire pins one at a time).
  const std::uint64_t need = home == Tier::kHost ? homes : largest;
  if (so.host_budget_bytes < need) {
    TM_LOG_WARN("ZERO", "parameter store host budget raised from {} to {} (offload_param {}: {})",
                format_bytes(so.host_budget_bytes), format_bytes(need), nvme_param ? "nvme" : "cpu",
                home == Tier::kHost ? "every shard lives in host memory" : "the largest shard");
    so.host_budget_bytes = need;
  }
  so.device_budget_bytes = 0;
  pstore = std::make_unique<TensorStore>(so, nullptr, nvme_param ? swap : nullptr,
                                         std::make_unique<Prefetcher>(PrefetcherOptions::from_config(
                                             cfg, wsize == 4 ? DType::kF32 : cfg.bf16 ? DType::kBF16 : DType::kF16)));
  ptensor.assign(numels.size(), kInvalidTensor);
  std::vector<std::byte> tmp;
  for (std::size_t i = 0; i < numels.size(); ++i) {
    const std::size_t n = layout.modules[i].shard;
    if (persistent[i] || n == 0) continue;
    tmp.resize(n * wsize);
    to_working(init_flat.data() + layout.flat_offset[i], tmp.data(), n, cfg.bf16);
    TensorSpec spec;
    spec.name = "zero.param." + names[i];
    spec.dtype = wsize == 4 ? DType::kF32 : cfg.bf16 ? DType::kBF16 : DType::kF16;
    spec.shape = {static_cast<std::int64_t>(n)};
    spec.home = home;
    spec.initial = tmp;
    ptensor[i] = pstore->register_tensor(spec);
  }
  pstore->begin_step();
}

ZeroEngine::Gathered ZeroEngine::gather(int module) {
  Impl& I = *impl_;
  I.finalize(config_);
  if (module < 0 || module >= num_modules()) throw Error("ZeroEngine::gather: unknown module " + std::to_string(module));
  Gathered g;
  g.module_ = module;
  g.numel_ = I.numels[module];
  g.dtype_ = working_dtype_;
  if (I.stage < 3 || I.persistent[module]) {
    g.data_ = I.work_ptr(module);
    return g;
  }
  const ModuleShard& s = I.layout.modules[module];
  AlignedBuf buf(s.padded * I.wsize);
  std::byte* mine = buf.b() + static_cast<std::size_t>(I.rank) * s.shard * I.wsize;
  if (I.in_store(static_cast<std::size_t>(module))) {
    // Resident at the host tier (read from NVMe unless prefetched); acquiring it feeds the
    // Prefetcher, whose hints start reading the next modules' shards while this one computes.
    TensorStore::Pin pin = I.pstore->acquire(I.ptensor[module], Tier::kHost);
    std::memcpy(mine, pin.data(), s.shard * I.wsize);
  } else {
    std::memcpy(mine, I.mem_shard(static_cast<std::size_t>(module)), s.shard * I.wsize);
  }
  I.comm.all_gather(mine, buf.p, s.shard, I.comm_dtype);  // in place
  ++I.st.all_gather_calls;
  I.gathered_live += s.padded * I.wsize;
  I.st.gathered_bytes_peak = std::max(I.st.gathered_bytes_peak, I.gathered_live);
  g.data_ = buf.p;
  buf.p = nullptr;  // ownership moves to the Gathered
  g.owned_ = true;
  g.engine_ = this;
  return g;
}

void ZeroEngine::reduce_gradients(int module, std::span<const float> grad) {
  Impl& I = *impl_;
  I.finalize(config_);
  if (module < 0 || module >= num_modules()) {
    throw Error("ZeroEngine::reduce_gradients: unknown module " + std::to_string(module));
  }
  if (grad.size() != I.numels[module]) {
    throw Error("ZeroEngine::reduce_gradients: module " + std::to_string(module) + " (" + I.names[module] +
                ") gradient has " + std::to_string(grad.size()) + " elements, expected " +
                std::to_string(I.numels[module]));
  }
  ++I.grad_calls[module];
  if (I.stage <= 1) {
    float* dst = I.full_grad.data() + I.full_off[module];
    for (std::size_t i = 0; i < grad.size(); ++i) dst[i] += grad[i];
    return;
  }
  const ModuleShard& s = I.layout.modules[module];
  const std::size_t n = grad.size();
  for (const ElemRange& c : make_reduce_chunks(s.shard, I.world, config_.zero.reduce_bucket_size_elems,
                                               I.opts.alignment_elems)) {
    Impl::Inflight f;
    const std::size_t len = c.size();
    f.send.assign(len * static_cast<std::size_t>(I.world), 0.0f);
    f.recv.assign(len, 0.0f);
    f.dst = I.layout.flat_offset[module] + c.begin;
    for (int r = 0; r < I.world; ++r) {
      std::size_t src = static_cast<std::size_t>(r) * s.shard + c.begin;
      std::size_t hi = std::min(src + len, n);
      if (src < hi) std::copy(grad.begin() + static_cast<std::ptrdiff_t>(src), grad.begin() + static_cast<std::ptrdiff_t>(hi),
                              f.send.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(r) * len));
    }
    f.handle = I.comm.reduce_scatter_async(f.send.data(), f.recv.data(), len, DType::kF32, ReduceOp::kSum);
    ++I.st.reduce_scatter_calls;
    I.inflight.push_back(std::move(f));
    if (!config_.zero.overlap_comm) {
      I.complete_front();
    } else {
      while (I.inflight.size() > static_cast<std::size_t>(std::max(1, I.opts.max_inflight_buckets))) I.complete_front();
    }
  }
}

void ZeroEngine::synchronize() { impl_->sync(); }

void ZeroEngine::zero_grad() {
  Impl& I = *impl_;
  I.sync();
  std::fill(I.full_grad.begin(), I.full_grad.end(), 0.0f);
  std::fill(I.shard_grad.begin(), I.shard_grad.end(), 0.0f);
  std::fill(I.grad_calls.begin(), I.grad_calls.end(), 0);
}

void ZeroEngine::set_learning_rate(double lr) {
  if (!std::isfinite(lr) || lr < 0) {
    throw ConfigError("optimizer.params.lr", fmt::format("{}", lr),
                      fmt::format("learning rate {} must be finite and >= 0", lr));
  }
  config_.optimizer.lr = lr;
}

double ZeroEngine::loss_scale() const { return impl_->scaler ? impl_->scaler->scale() : 1.0; }

ZeroEngine::StepResult ZeroEngine::step() {
  Impl& I = *impl_;
  I.finalize(config_);
  I.sync();
  const std::size_t R = I.layout.rank_flat;
  int micro = 1;
  for (int c : I.grad_calls) micro = std::max(micro, c);

  // Finish the reduction stages 0 and 1 left for now.
  if (I.stage == 0) {
    I.all_reduce_sum(I.full_grad.data(), I.full_grad.size());
  } else if (I.stage == 1) {
    for (std::size_t i = 0; i < I.numels.size(); ++i) {
      const ModuleShard& s = I.layout.modules[i];
      if (s.shard == 0) continue;
      I.comm.reduce_scatter(I.full_grad.data() + I.full_off[i], I.shard_grad.data() + I.layout.flat_offset[i], s.shard,
                            DType::kF32, ReduceOp::kSum);
      ++I.st.reduce_scatter_calls;
    }
  }
  float* gp = I.grad_ptr();

  StepResult res;
  // fp16: a non-finite gradient anywhere skips the step on every rank.
  if (I.scaler) {
    float bad = static_cast<float>(count_nonfinite(gp, R));
    if (I.stage > 0) I.comm.all_reduce(&bad, &bad, 1, DType::kF32, ReduceOp::kSum);
    const double used_scale = I.scaler->scale();
    if (I.scaler->update(bad > 0)) {
      ++I.st.skipped_steps;
      TM_LOG_WARN("ZERO", "fp16 gradient overflow: step skipped, loss scale {} -> {}", used_scale, I.scaler->scale());
      zero_grad();
      if (I.pstore) {
        I.pstore->end_step();
        I.pstore->begin_step();
      }
      res.skipped = true;
      res.loss_scale = I.scaler->scale();
      res.step = I.st.steps;
      return res;
    }
    res.loss_scale = used_scale;
  }
  double grad_scale = 1.0 / (static_cast<double>(I.world) * micro * (I.scaler ? res.loss_scale : 1.0));

  // Global gradient norm (of the mean gradient) and clipping.
  double sumsq = 0;
#pragma omp parallel for reduction(+ : sumsq) if (R > (1u << 18))
  for (std::size_t i = 0; i < R; ++i) sumsq += static_cast<double>(gp[i]) * gp[i];
  if (I.stage > 0) {
    float f = static_cast<float>(sumsq);
    I.comm.all_reduce(&f, &f, 1, DType::kF32, ReduceOp::kSum);
    sumsq = f;
  }
  res.grad_norm = std::sqrt(sumsq) * grad_scale;
  if (config_.gradient_clipping > 0 && res.grad_norm > config_.gradient_clipping) {
    grad_scale *= config_.gradient_clipping / (res.grad_norm + 1e-6);
  }

  AdamParams ap;
  ap.lr = static_cast<float>(config_.optimizer.lr);
  ap.beta1 = static_cast<float>(config_.optimizer.beta1);
  ap.beta2 = static_cast<float>(config_.optimizer.beta2);
  ap.eps = static_cast<float>(config_.optimizer.eps);
  ap.weight_decay = static_cast<float>(config_.optimizer.weight_decay);
  ap.step = I.st.steps + 1;
  ap.grad_scale = static_cast<float>(grad_scale);
  const bool half = I.wsize == 2;

  // One sub-group: state pointers given; writes the working shard in the same pass. Split at
  // module boundaries: a module's shard is in work_shard or in the parameter store (acquired at
  // the host tier and marked dirty: the store writes it back to NVMe when it evicts it).
  auto step_group = [&](const ElemRange& g, float* pm, float* mm, float* vm) {
    for (std::size_t a = g.begin; a < g.end;) {
      const std::size_t mod = I.module_at(a);
      const std::size_t mb = I.layout.flat_offset[mod];
      const std::size_t hi = std::min(g.end, mb + I.layout.modules[mod].shard);
      const std::size_t k = a - g.begin;
      TensorStore::Pin pin;
      std::byte* out;
      if (I.in_store(mod)) {
        pin = I.pstore->acquire(I.ptensor[mod], Tier::kHost, Phase::kOptimizer);
        out = pin.as<std::byte>() + (a - mb) * I.wsize;
      } else {
        out = I.mem_shard(mod) + (a - mb) * I.wsize;
      }
      adam_step(ap, pm + k, gp + a, mm + k, vm + k, hi - a, half ? out : nullptr, working_dtype_);
      if (!half) std::memcpy(out, pm + k, (hi - a) * sizeof(float));
      if (pin.valid()) pin.mark_dirty();
      a = hi;
    }
  };

  if (!I.nvme_opt) {
    for (const ElemRange& g : I.sub_groups) {
      step_group(g, I.master.data() + g.begin, I.m.data() + g.begin, I.v.data() + g.begin);
    }
  } else {
    // Pipeline over sub-groups with B staging buffers: reads run ahead up to B-1 sub-groups, a
    // buffer is read into only after its previous write completed (we wait, never fail).
    const std::size_t n = I.sub_groups.size();
    const std::size_t B = I.staging.size();
    std::vector<IoRequest> reads(n), writes(n);
    std::size_t issued = 0;
    auto bytes_of = [&](std::size_t k) { return 3 * I.sub_groups[k].size() * sizeof(float); };
    for (std::size_t k = 0; k < n; ++k) {
      while (issued < n && issued < k + B) {
        if (issued >= B) {
          const IoRequest& prev = writes[issued - B];
          if (issued == k) prev.wait();        // needed now: wait for the buffer
          else if (!prev.ready()) break;       // read-ahead only when the buffer is free
          else prev.wait();                    // rethrows its error, if any
        }
        reads[issued] = I.swap->read(I.sg_extents[issued], I.staging[issued % B].p, bytes_of(issued));
        I.st.optimizer_nvme_read_bytes += bytes_of(issued);
        ++issued;
      }
      reads[k].wait();
      const ElemRange& g = I.sub_groups[k];
      float* s = I.staging[k % B].f();
      step_group(g, s, s + g.size(), s + 2 * g.size());
      writes[k] = I.swap->write(I.sg_extents[k], s, bytes_of(k));
      I.st.optimizer_nvme_written_bytes += bytes_of(k);
    }
    wait_all(writes);
  }

  // Publish the new working params.
  for (std::size_t i = 0; i < I.numels.size(); ++i) {
    const ModuleShard& s = I.layout.modules[i];
    if (I.stage == 1 || I.stage == 2 || I.persistent[i]) {
      I.comm.all_gather(I.mem_shard(i), I.work_full[i].p, s.shard, I.comm_dtype);
      ++I.st.all_gather_calls;
    }
  }
  if (I.pstore) {  // the step's trace ends here (the Prefetcher records the first, replays later)
    I.pstore->end_step();
    I.pstore->begin_step();
  }
  ++I.st.steps;
  zero_grad();
  res.step = I.st.steps;
  if (I.scaler) res.loss_scale = I.scaler->scale();
  return res;
}

std::vector<float> ZeroEngine::export_master(int module) {
  Impl& I = *impl_;
  I.finalize(config_);
  if (module < 0 || module >= num_modules()) throw Error("ZeroEngine::export_master: unknown module " + std::to_string(module));
  const ModuleShard& s = I.layout.modules[module];
  std::vector<float> full(s.padded);
  const std::size_t off = I.layout.flat_offset[module];
  float* mine = full.data() + static_cast<std::size_t>(I.opt_rank) * s.shard;
  I.read_master(off, off + s.shard, mine);
  if (I.opt_world > 1) I.comm.all_gather(mine, full.data(), s.shard, DType::kF32);
  full.resize(s.numel);
  return full;
}

std::size_t ZeroEngine::shard_numel() {
  impl_->finalize(config_);
  return impl_->layout.rank_flat;
}

ZeroOptimizerState ZeroEngine::export_optimizer_state() {
  Impl& I = *impl_;
  I.finalize(config_);
  I.sync();
  const std::size_t R = I.layout.rank_flat;
  ZeroOptimizerState out;
  out.world_size = I.opt_world;
  out.rank = I.opt_rank;
  out.alignment_elems = I.opts.alignment_elems;
  out.module_numels = I.numels;
  out.steps = I.st.steps;
  out.skipped_steps = I.st.skipped_steps;
  if (I.scaler) out.loss_scaler = I.scaler->state();
  if (!I.nvme_opt) {
    out.master = I.master;
    out.exp_avg = I.m;
    out.exp_avg_sq = I.v;
    return out;
  }
  out.master.resize(R);
  out.exp_avg.resize(R);
  out.exp_avg_sq.resize(R);
  for (std::size_t k = 0; k < I.sub_groups.size(); ++k) {  // extent k: [master | m | v]
    const ElemRange& g = I.sub_groups[k];
    const std::size_t n = g.size();
    I.swap->read(I.sg_extents[k], I.staging[0].p, 3 * n * sizeof(float)).wait();
    const float* s = I.staging[0].f();
    std::copy(s, s + n, out.master.begin() + static_cast<std::ptrdiff_t>(g.begin));
    std::copy(s + n, s + 2 * n, out.exp_avg.begin() + static_cast<std::ptrdiff_t>(g.begin));
    std::copy(s + 2 * n, s + 3 * n, out.exp_avg_sq.begin() + static_cast<std::ptrdiff_t>(g.begin));
  }
  return out;
}

void ZeroEngine::import_optimizer_state(const ZeroOptimizerState& state) {
  Impl& I = *impl_;
  I.finalize(config_);
  const std::size_t R = I.layout.rank_flat;
  // Validate everything before changing anything.
  auto mismatch = [](const std::string& what, const std::string& got, const std::string& want) {
    return Error("ZeroEngine::import_optimizer_state: " + what + " is " + got + " in the imported state but " +
                 want + " in this engine (import the shard this rank exported, with the same world size, "
                 "modules and alignment)");
  };
  if (state.world_size != I.opt_world) {
    throw mismatch("the optimizer partition's world size", std::to_string(state.world_size),
                   std::to_string(I.opt_world));
  }
  if (state.rank != I.opt_rank) {
    throw mismatch("the shard's rank", std::to_string(state.rank), std::to_string(I.opt_rank));
  }
  if (state.alignment_elems != I.opts.alignment_elems) {
    throw mismatch("alignment_elems", std::to_string(state.alignment_elems), std::to_string(I.opts.alignment_elems));
  }
  if (state.module_numels.size() != I.numels.size()) {
    throw mismatch("the module count", std::to_string(state.module_numels.size()), std::to_string(I.numels.size()));
  }
  for (std::size_t i = 0; i < I.numels.size(); ++i) {
    if (state.module_numels[i] != I.numels[i]) {
      throw mismatch("module " + std::to_string(i) + " (" + I.names[i] + ")'s numel",
                     std::to_string(state.module_numels[i]), std::to_string(I.numels[i]));
    }
  }
  for (const auto& [name, vec] : {std::pair<const char*, const std::vector<float>*>{"master", &state.master},
                                  {"exp_avg", &state.exp_avg},
                                  {"exp_avg_sq", &state.exp_avg_sq}}) {
    if (vec->size() != R) {
      throw mismatch(std::string(name) + "'s length (elements)", std::to_string(vec->size()), std::to_string(R));
    }
  }
  if (state.steps < 0 || state.skipped_steps < 0) {
    throw Error("ZeroEngine::import_optimizer_state: step counts must be >= 0 (steps " + std::to_string(state.steps) +
                ", skipped_steps " + std::to_string(state.skipped_steps) + ")");
  }
  if (state.loss_scaler.has_value() != (I.scaler != nullptr)) {
    throw mismatch("fp16 loss-scaler state", state.loss_scaler ? "present" : "absent",
                   I.scaler ? "expected (fp16.enabled)" : "not expected (fp16 disabled)");
  }
  if (state.loss_scaler) {
    DynamicLossScaler probe = *I.scaler;
    probe.restore(*state.loss_scaler);  // throws on an impossible state, before anything changes
  }

  zero_grad();  // also waits for in-flight reduce-scatters
  // 1. The optimizer state, where it lives.
  if (!I.nvme_opt) {
    I.master = state.master;
    I.m = state.exp_avg;
    I.v = state.exp_avg_sq;
  } else {
    for (std::size_t k = 0; k < I.sub_groups.size(); ++k) {
      const ElemRange& g = I.sub_groups[k];
      const std::size_t n = g.size();
      const auto b = static_cast<std::ptrdiff_t>(g.begin), e = static_cast<std::ptrdiff_t>(g.end);
      float* s = I.staging[0].f();
      std::copy(state.master.begin() + b, state.master.begin() + e, s);
      std::copy(state.exp_avg.begin() + b, state.exp_avg.begin() + e, s + n);
      std::copy(state.exp_avg_sq.begin() + b, state.exp_avg_sq.begin() + e, s + 2 * n);
      I.swap->write(I.sg_extents[k], s, 3 * n * sizeof(float)).wait();
    }
  }
  I.st.steps = state.steps;
  I.st.skipped_steps = state.skipped_steps;
  if (I.scaler) I.scaler->restore(*state.loss_scaler);

  // 2. The working params from the imported master, as step() publishes them.
  std::vector<std::byte> tmp;
  for (std::size_t i = 0; i < I.numels.size(); ++i) {
    const std::size_t n = I.layout.modules[i].shard;
    if (n == 0) continue;
    const float* src = state.master.data() + I.layout.flat_offset[i];
    if (I.in_store(i)) {
      tmp.resize(n * I.wsize);
      I.to_working(src, tmp.data(), n, config_.bf16);
      I.pstore->write(I.ptensor[i], tmp);  // at home; cached copies dropped
    } else {
      I.to_working(src, I.mem_shard(i), n, config_.bf16);
    }
  }
  for (std::size_t i = 0; i < I.numels.size(); ++i) {
    if (I.stage == 1 || I.stage == 2 || I.persistent[i]) {
      I.comm.all_gather(I.mem_shard(i), I.work_full[i].p, I.layout.modules[i].shard, I.comm_dtype);
      ++I.st.all_gather_calls;
    }
  }
}

ZeroStats ZeroEngine::stats() const {
  const Impl& I = *impl_;
  ZeroStats s = I.st;
  const std::uint64_t R = I.finalized ? I.layout.rank_flat : 0;
  s.optimizer_state_bytes = 12 * R;
  if (I.nvme_opt) {
    s.optimizer_nvme_bytes = 12 * R;
    for (const auto& b : I.staging) s.optimizer_host_bytes += b.bytes;
  } else {
    s.optimizer_host_bytes = 12 * R;
  }
  s.gradient_bytes = 4 * (I.full_grad.size() + I.shard_grad.size());
  s.working_param_bytes = I.work_shard.bytes;
  for (const auto& b : I.work_full) s.working_param_bytes += b.bytes;
  if (I.pstore) {
    TensorStoreStats t = I.pstore->stats();
    const int h = static_cast<int>(Tier::kHost), n = static_cast<int>(Tier::kNvme);
    s.param_store_host_bytes = t.resident_bytes[h];
    s.param_store_host_peak_bytes = t.peak_resident_bytes[h];
    s.param_store_host_budget_bytes = t.budget_bytes[h];
    s.param_store_nvme_reads = t.moves[n][h];
    s.param_store_nvme_read_bytes = t.bytes_moved[n][h];
    s.param_store_nvme_written_bytes = t.bytes_moved[h][n];
    s.param_store_nvme_writes = t.moves[h][n];
    s.param_store_hits = t.hits;
    s.param_store_misses = t.misses;
    s.param_prefetches_issued = t.prefetches_issued;
    for (std::size_t i = 0; i < I.ptensor.size(); ++i) {
      if (I.ptensor[i] != kInvalidTensor) s.param_store_bytes += I.layout.modules[i].shard * I.wsize;
    }
  }
  if (I.staging_pool) s.optimizer_staging_pinned = I.staging_pool->pinned();
  return s;
}

}  // namespace tiermem
