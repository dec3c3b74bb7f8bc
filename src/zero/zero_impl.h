// src/zero/zero_impl.h — ZeroEngine's internal state, shared by its files:
//   zero_engine.cc      the public calls: construction, gather, reduce_gradients, stats
//   zero_setup.cc       layout, plan, the device and TensorStore, every module's tensors (registration)
//   zero_step.cc        the optimizer step over sub-groups ("pieces"), in phases; deferred updates applied
//   zero_state.cc       checkpoints, export_master, set_module_params (one rewrite_state loop)
//   zero_device.cc      working-param destinations; a device the CPU cannot address
//   zero_device_step.cc the device-resident optimizer (plan.optimizer_on_device)
// and the parts it owns, each with its own header and test: partition_layout.h, norm_fold.h,
// grad_reducer.h, deferred_updates.h, tier_setup.h.
// Not a public header. Thread-safety: one thread drives an engine (see zero_engine.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <optional>
#include <future>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <boost/asio/post.hpp>
#include <boost/asio/thread_pool.hpp>

#include "tiermem/adam.h"
#include "tiermem/cast.h"
#include "tiermem/communicator.h"
#include "tiermem/device.h"
#include "tiermem/device_choice.h"
#include "tiermem/dtype.h"
#include "tiermem/error.h"
#include "tiermem/io_engine.h"
#include "tiermem/loss_scaler.h"
#include "tiermem/shard.h"
#include "tiermem/swap_space.h"
#include "tiermem/tensor_store.h"
#include "tiermem/zero_engine.h"
#include "tiermem/zero_plan.h"
#include "zero/deferred_updates.h"
#include "zero/grad_reducer.h"
#include "zero/norm_fold.h"
#include "zero/partition_layout.h"
#include "zero/tier_setup.h"

namespace tiermem::detail {

// 4 KiB-aligned zeroed heap buffer (engine host buffers; counted in ZeroStats::host_engine_bytes).
struct AlignedBuf {
  void* p = nullptr;
  std::size_t bytes = 0;
  AlignedBuf() = default;
  explicit AlignedBuf(std::size_t n) : bytes(n) {
    if (n == 0) return;
    p = std::aligned_alloc(4096, (n + 4095) / 4096 * 4096);
    if (!p) throw OutOfMemoryError(Tier::kHost, n, 0, "ZeroEngine host buffer");
    std::memset(p, 0, n);
  }
  AlignedBuf(AlignedBuf&& o) noexcept : p(o.p), bytes(o.bytes) {
    o.p = nullptr;
    o.bytes = 0;
  }
  AlignedBuf& operator=(AlignedBuf&& o) noexcept {
    std::swap(p, o.p);
    std::swap(bytes, o.bytes);
    return *this;
  }
  ~AlignedBuf() { std::free(p); }
  float* f() const { return static_cast<float*>(p); }
  std::byte* b() const { return static_cast<std::byte*>(p); }
};

// sumsq_lanes, copy_sumsq_lanes, copy_lanes: the gradient norm's lane sums (norm_fold.h).

// tiermem::adam_step (default options) as a SimAdamKernel: the device optimizer's CPU twin runs
// exactly the host optimizer's kernel (zero_device_step.cc).
void device_adam_kernel(const AdamParams& params, float* master, const float* grad, float* m, float* v,
                        std::size_t n, void* half, DType half_dtype);

// A device buffer owned by the engine (freed on destruction; the device must outlive it).
struct DeviceBuf {
  std::shared_ptr<Device> device;
  void* p = nullptr;
  std::uint64_t bytes = 0;
  DeviceBuf() = default;
  DeviceBuf(const DeviceBuf&) = delete;
  DeviceBuf& operator=(const DeviceBuf&) = delete;
  ~DeviceBuf() {
    if (p != nullptr) device->free(p);
  }
  // At least `n` bytes (reallocated when smaller; contents undefined).
  void reserve(const std::shared_ptr<Device>& d, std::uint64_t n) {
    if (p != nullptr && bytes >= n) return;
    if (p != nullptr) device->free(p);
    p = nullptr;
    device = d;
    p = device->allocate(n);
    bytes = n;
  }
  float* f() const { return static_cast<float*>(p); }
  std::byte* b() const { return static_cast<std::byte*>(p); }
};

// One optimizer sub-group: a range of one module's shard.
struct Piece {
  int module = 0;
  std::size_t begin = 0, end = 0;  // within the module's shard (elements)
  std::size_t flat = 0;            // rank-flat offset of `begin`
  TensorId optim = kInvalidTensor; // fp32 [master | exp_avg | exp_avg_sq], 3 x size()
  TensorId grad = kInvalidTensor;  // stages 2-3: fp32 gradient partition, size()
  bool grad_fresh = true;          // no gradient since the last step: contents undefined
  // Its state is homed on the device and stepped there (the device-resident optimizer, or the
  // device's share under offload_optimizer.ratio < 1); gtier: where its gradient partition is
  // accumulated and read (the device when homed there, else the host).
  bool on_device = false;
  Tier gtier = Tier::kHost;
  std::size_t acc_elems = 0;       // elements accumulated so far in the current reduce call
  std::size_t size() const { return end - begin; }
};

// TensorSpec::group of the engine's tensors (the NVMe traffic split of ZeroStats).
inline constexpr std::uint8_t kGroupTrainable = 1, kGroupFrozen = 2, kGroupOptimizer = 3;

struct ZeroModule {
  std::string name;
  std::size_t numel = 0;
  ModuleShard shard;
  std::size_t flat = 0;        // rank-flat offset of the shard
  bool persistent = false;     // stage 3, below the persistence threshold: kept whole
  bool stored = false;         // stage 3 working shard is a store tensor (`param`)
  bool registered = false;     // tensors written (registration streamed or finalized)
  bool frozen = false;         // no master, gradient or optimizer state (ZeroEngineOptions)
  TensorId param = kInvalidTensor;
  Tier home = Tier::kHost;     // of `param` (stored modules)
  AlignedBuf mem_shard;        // working shard when !stored (stage 0: the full copy)
  AlignedBuf full;             // stages 1-2 and persistent: the all-gathered working params
  std::vector<float> full_grad;   // stages 0-1: full padded fp32 gradient
  std::vector<float> shard_grad;  // stage 1: the reduce-scattered shard
  std::vector<float> init_shard;  // deferred registration only (no numels up front)
  std::vector<int> pieces;        // indices into Impl::pieces
  int grad_calls = 0;
  // Optimizer-phase accesses its update made outside a step (a checkpoint export, an eval
  // gather): shown to the store's policy at the next in-step gather (touch) so the recorded
  // access trace still matches.
  std::vector<std::pair<TensorId, Tier>> replay;  // the tensor and the tier it was pinned at
  ModuleNormFold norm;  // the clipping norm folded into accumulation (stages 2-3; norm_fold.h)
};

}  // namespace tiermem::detail

namespace tiermem {

struct ZeroEngine::Impl {
  Communicator& comm;
  ZeroEngineOptions opts;
  const Config& cfg;  // ZeroEngine::config_ (declared before impl_, so it outlives this)
  int rank = 0, world = 1;
  int opt_world = 1, opt_rank = 0;  // stage 0: optimizer state is not partitioned
  int stage = 0;
  std::size_t wsize = 4;
  DType wdtype = DType::kF32;
  DType comm_dtype = DType::kF32;

  std::vector<detail::ZeroModule> mods;
  std::vector<detail::Piece> pieces;
  std::vector<std::size_t> expected_numels;  // given up front (streamed registration)
  bool planned = false;    // plan + store exist
  bool finalized = false;  // every module registered; training calls allowed
  ZeroPlan plan;
  ZeroPlanOptions plan_opts;             // what `plan` was made with
  std::vector<std::size_t> plan_numels;  // ... and for which modules

  // tiermem.device resolved once, by make_plan (auto probes CUDA there, and only there): the plan
  // assumes this kind and make_tiers makes it.
  ResolvedDevice device_choice;
  // Tiers. Destruction order (reverse of declaration): store first, then swap spaces, io, device.
  std::shared_ptr<Device> device;
  std::unique_ptr<IoEngine> io;
  std::shared_ptr<SwapSpace> param_swap, optim_swap;  // may be the same object
  std::unique_ptr<TensorStore> store;
  // Device-resident optimizer (plan.optimizer_on_device; zero_device_step.cc): scratch sub-groups
  // in device memory, for a gradient that is not homed on the device (stage 1; an opaque device)
  // and for new working params bound for host memory. Declared after `device`: freed before it.
  detail::DeviceBuf grad_scratch, out_scratch;
  std::uint64_t state_stage_live = 0;  // host bytes staging a checkpoint of device-homed state
  std::uint64_t device_scratch_bytes() const {  // as the device's allocator counts them
    return (grad_scratch.p ? device->allocation_size(grad_scratch.bytes) : 0) +
           (out_scratch.p ? device->allocation_size(out_scratch.bytes) : 0);
  }
  Tier compute_tier = Tier::kHost;     // where gathers pin working shards
  Tier grad_tier = Tier::kHost;        // where gradient partitions are accumulated and read (home
                                       // device: the device-resident optimizer, addressable device)
  Tier publish_tier = Tier::kHost;     // where step() writes stored shards homed below the device
  // The device's memory is not host-addressable (CudaDevice; SimDevice with
  // tiermem.sim_host_addressable false): the engine touches it only through the Device's copy
  // API, staging through the host buffers below (zero_device.cc; counted in engine_host_bytes).
  bool opaque = false;
  detail::AlignedBuf publish_stage[2];  // new working params of one sub-group, on their way up
  detail::AlignedBuf grad_stage;        // reduce_gradients_from_device: the module's gradient
  std::uint64_t gather_stage_live = 0;  // host bytes of an all-gather being staged now
  // Bytes the engine itself copied host <-> device (staging above; the store counts its own).
  std::uint64_t engine_h2d_bytes = 0, engine_d2h_bytes = 0;

  // Reduce-scatter buckets in flight (stages 2-3, several ranks).
  struct Inflight {
    CommHandle handle;
    std::vector<float> send, recv;
    int module = 0;
    std::size_t begin = 0;  // shard-local offset of recv[0]
  };
  std::deque<Inflight> inflight;
  std::uint64_t bucket_bytes_live = 0;

  // The one-rank gradient hand-off (reduce_gradients taking the buffer, stages 2-3): the caller
  // pins the partitions that already hold a gradient (an access the Prefetcher records, so in
  // call order), a one-thread pool acquires the fresh ones for overwrite and adds into them all.
  // At most one call in flight.
  struct GradPiece {
    int piece = 0;
    TensorStore::Pin pin;
    std::size_t lo = 0, hi = 0;  // shard-local range the call covers within the piece
    bool fresh = false;          // acquired for overwrite: elements outside [lo, hi) are zeroed
  };
  std::unique_ptr<boost::asio::thread_pool> grad_pool;
  std::future<void> grad_task;
  std::uint64_t grad_task_bytes = 0;
  // The hand-off's buffer (zeroed by the task after its additions) and, once the task is waited
  // for, the spare that gradient_buffer() hands out again (dropped at step()).
  std::shared_ptr<std::vector<float>> grad_task_buf;
  std::vector<float> grad_spare;

  std::uint64_t gathered_live = 0;
  // Stage-3 all-gathers started ahead of their gather() (ZeroEngine::prefetch_gather, several
  // ranks, host-addressable buffers): each buffer is counted in gathered_live from its start.
  struct PendingGather {
    int module = -1;
    void* buf = nullptr;
    bool on_device = false;
    CommHandle handle;
  };
  std::deque<PendingGather> pending_gathers;
  // The all-gather buffer of module m: host memory, or device memory (addressable) when computing
  // there; counted in gathered_live (and its peak) until freed. count_gather_buf counts one made
  // elsewhere (the opaque device's, zero_device.cc).
  void* alloc_gather_buf(const detail::ZeroModule& m, bool on_device);
  void free_gather_buf(const detail::ZeroModule& m, void* buf, bool on_device) noexcept;
  void count_gather_buf(const detail::ZeroModule& m);
  // Starts module's all-gather (host-addressable buffers) from its pinned working shard, which it
  // releases; take_gather waits for one and returns its buffer (freed, and the error rethrown,
  // when the collective failed).
  PendingGather start_gather(int module, TensorStore::Pin pin);
  void* take_gather(PendingGather&& pg);
  // Waits for every pending gather and frees its buffer (they were issued on every rank, so each
  // completes); rethrows the first CommError after all are freed.
  void drop_pending_gathers();
  // Before module's working shard is read for a gather: its deferred update of the last step, or
  // the replay of its accesses outside the step (zero_engine.cc).
  void before_gather(int module, Phase phase);
  std::unique_ptr<DynamicLossScaler> scaler;
  ZeroStats st;

  Impl(Communicator& c, ZeroEngineOptions o, const Config& config) : comm(c), opts(o), cfg(config) {}

  // zero_setup.cc
  void make_plan(std::span<const std::size_t> numels);
  void make_tiers();
  void fall_back_to_host_optimizer();  // re-plans with the optimizer state in the host pool (logged)
  void add_module(const std::string& name, std::size_t numel);
  void write_module(int i, std::span<const float> init_shard);
  void write_working(int i, std::span<const float> init_shard);  // working params only (zero_setup.cc)
  void finalize();
  std::uint64_t engine_host_bytes() const;

  // zero_device.cc: the engine's side of a device it cannot address.
  std::uint64_t staging_host_bytes() const {
    return publish_stage[0].bytes + publish_stage[1].bytes + grad_stage.bytes + gather_stage_live +
           state_stage_live;
  }
  // Several ranks: module m's working shard (pinned at the device tier) all-gathered into a new
  // device buffer of m.shard.padded elements (the caller frees it with device->free): through a
  // host staging buffer unless the communicator takes device buffers (NCCL). Releases `pin`.
  void* all_gather_to_device(const detail::ZeroModule& m, TensorStore::Pin& pin);
  // The tier gather() pins module m's working shard at: the compute tier, except when an opaque
  // device's all-gather is staged through host memory anyway (several ranks, a host
  // communicator) and the shard is not homed on the device: then the host tier (no copy down).
  Tier gather_tier(const detail::ZeroModule& m) const {
    if (opaque && world > 1 && !comm.device_buffers() && m.home != Tier::kDevice) return Tier::kHost;
    return compute_tier;
  }
  // Copies `bytes` host bytes to offset `offset` of a device-tier pin (synchronously).
  void upload(const TensorStore::Pin& pin, std::size_t offset, const void* src, std::size_t bytes);

  // zero_step.cc
  StepResult step();
  // step()'s phases, in the order it runs them.
  struct NormSum {  // sums of squares so far: of every module done, and of the current module
    double total = 0, module = 0;
  };
  int finish_reductions();                  // stages 0-1; returns the micro-batch count
  bool folded_sumsq(double& sumsq) const;   // the folded norm, when every module has it
  bool norm_pre_pass(bool folded, NormSum& sum, StepResult& res);  // false: fp16 overflow, skipped
  AdamParams step_params(double grad_scale) const;
  void stream_update(const AdamParams& ap, bool defer, NormSum* norm);
  void end_step(bool defer);
  void add_sumsq(NormSum& sum, std::size_t k, const float* g) const;  // piece k's squares, in order
  double sum_over_ranks(double sumsq);      // the norm's all-reduce (fp32, as tiermem-train's)
  void prefetch_after(std::size_t k, bool with_state);
  // The overlapped optimizer step (tiermem.overlap_optimizer_step): step() leaves the stored
  // modules' updates pending in `deferred` (its contract: deferred_updates.h); apply_pending(m)
  // applies module m's, if any, exactly once — called by gather() before it pins the shard, by
  // reduce_gradients, and by whatever reads or rewrites m's state; apply_all_pending: every one.
  // replay_outside_accesses(m): see ZeroModule::replay.
  detail::DeferredUpdates deferred;
  bool deferred_before = false;  // a step has deferred updates (the Prefetcher re-records after it)
  void apply_pending(int module, Phase phase);
  void apply_all_pending(Phase phase);
  void replay_outside_accesses(int module);
  // Piece p's gradient for the update (stages 0-1: engine buffers; 2-3: its partition, pinned
  // into `pin`; zero when none arrived since the last step).
  const float* piece_grad(detail::Piece& p, TensorStore::Pin& pin, Phase phase);
  ZeroOptimizerState state_header() const;
  std::vector<float> frozen_params(int module);
  const detail::ZeroModule& trained_module(int module, const char* call) const;  // or Error  // a frozen module's working params as fp32 (zero_state.cc)  // partition fields, steps, scaler; no vectors

  // Where each sub-group's new working parameters go, sub-groups taken in order (a module's are
  // consecutive), as step() and import publish them: a stored module's shard is acquired for
  // overwrite at its first sub-group (every element gets written; at the device tier when that
  // is home, else at publish_tier — the device when publishes_working_on_device, else the host —
  // written down by the store when evicted) and released dirty after its last; other modules
  // write into their engine buffer. Destroyed without finish() (an error), the pin is released
  // clean.
  // A device the CPU cannot address (opaque): dest() of a device-homed shard is a host staging
  // buffer of one sub-group, copied up to the pinned shard when the next dest() or finish() is
  // called — so the caller must have written every byte of dest(p) by then (sub-groups written
  // one after the other, as step() and import do). Two staging buffers alternate, so the copy of
  // sub-group k overlaps the AdamW of k + 1. (zero_device.cc)
  class WorkingShardOut {
   public:
    explicit WorkingShardOut(Impl& impl) : I_(impl) {}
    ~WorkingShardOut();  // waits for staged copies still in flight (never throws)
    WorkingShardOut(const WorkingShardOut&) = delete;
    WorkingShardOut& operator=(const WorkingShardOut&) = delete;
    std::byte* dest(const detail::Piece& p);
    // As dest(), for a writer in device memory (the device-resident optimizer): the sub-group's
    // place in the module's shard when that is pinned at the device tier (any device: no staging),
    // else null (the destination is host memory: write it through dest()).
    std::byte* device_dest(const detail::Piece& p);
    void finish();  // the last module's shard released dirty

   private:
    void upload_staged();  // the staged sub-group, if any, on its way to the device
    void wait_uploads();
    Impl& I_;
    TensorStore::Pin pin_;
    int module_ = -1;
    int stage_ = 0;                  // publish_stage buffer dest() handed out last
    std::size_t staged_offset_ = 0;  // bytes into the shard of the staged sub-group
    std::size_t staged_bytes_ = 0;   // 0: nothing staged
    DeviceEvent upload_[2];          // copy of publish_stage[b] in flight
  };
  // The module's running sum of squares after piece k (g: its gradient partition), continuing
  // `running` (reset at the module's first piece) exactly as step() adds them (zero_step.cc).
  // `partial`: the sum of squares of g's real elements (detail::sumsq_lanes) when the caller has
  // it already (a fused copy).
  double piece_sumsq(std::size_t k, const float* g, double running, std::optional<double> partial = {}) const;
  // AdamW on piece k with `ap`, its new working params into `working`; its gradient partition is
  // discarded after (stages 2-3). `on_grad(k, g)` sees the gradient first when given.
  void update_piece(std::size_t k, const AdamParams& ap, WorkingShardOut& working, Phase phase,
                    const std::function<void(std::size_t, const float*)>& on_grad);
  // zero_device_step.cc: the device-resident optimizer (Piece::on_device). AdamW on piece k in
  // device memory (Device::adam_step_async), as update_piece.
  void update_piece_on_device(std::size_t k, const AdamParams& ap, WorkingShardOut& working, Phase phase,
                              const std::function<void(std::size_t, const float*)>& on_grad);
  // The checkpoint's state, one sub-group at a time in order (zero_step.cc): host-tier pins for
  // sub-groups homed below the device, one host sub-group of staging (state_stage_live) for
  // device-homed ones.
  void export_state(const std::function<void(const ZeroStateChunk&)>& sink);
  // Rewrites the optimizer state of every sub-group (module -1) or of one module's, in order, in
  // one loop (import_optimizer_state, set_module_params): `fill(p, s)` writes piece p's
  // s = [master | exp_avg | exp_avg_sq] (3 x p.size() fp32, host memory, valid during the call),
  // which holds the old state first when `keep`, else undefined (acquired for overwrite). The
  // piece's working params are rewritten from the new master in the same pass, as step() does.
  void rewrite_state(int module, bool keep, const std::function<void(const detail::Piece&, float*)>& fill);
  // All-gathers the new working params of the modules kept whole (every module, or `module`).
  void publish_whole_modules(int module);
  // `buf`, made one host sub-group of staging at its first use (counted in state_stage_live).
  float* state_stage(detail::AlignedBuf& buf);
  bool fold_norm() const;  // step()'s clipping norm is folded into accumulate_grad
  void fold_piece_norm(int pi, const float* g, std::optional<double> partial = {});
  std::size_t valid_len(std::size_t k) const;  // piece k's real (not padding) elements, from its begin
  bool module_has_real(const detail::ZeroModule& m) const;   // this rank holds a real element
  bool module_norm_ready(const detail::ZeroModule& m) const;  // every piece folded, in order
  detail::ModuleNormFold::ValidLen module_valid_len(const detail::ZeroModule& m) const;  // by sub-group
  void validate_import(const ZeroOptimizerState& state, bool vectors) const;

  // Helpers.
  void to_working(const float* src, std::byte* dst, std::size_t n) const {
    if (wsize == 4) {
      std::memcpy(dst, src, n * sizeof(float));
      return;
    }
    // The bulk casts of tiermem/cast.h: the same bits as f32_to_bf16 / f32_to_f16 per element,
    // with the best vector kernel the CPU has (F16C / AVX-512).
    auto* d = reinterpret_cast<std::uint16_t*>(dst);
    if (wdtype == DType::kBF16) f32_to_bf16_n(src, d, n);
    else f32_to_f16_n(src, d, n);
  }
  // Adds `n` fp32 values at shard-local offset `begin` of module `m` into its gradient pieces:
  // pin_grad (the store accesses, on the driving thread) then add_grad (the arithmetic and the
  // folded norm; any one thread at a time, in call order).
  void accumulate_grad(int m, std::size_t begin, const float* src, std::size_t n);
  std::vector<GradPiece> pin_grad(int m, std::size_t begin, std::size_t n);
  // `clear`: nullptr, or src itself (the caller's to clobber), whose every element read is then
  // left zero; returns how many were cleared.
  std::size_t add_grad(std::vector<GradPiece>& work, std::size_t begin, const float* src, float* clear = nullptr);
  void wait_grad_task();  // rethrows the in-flight hand-off's error
  void complete_front();
  void sync() {
    wait_grad_task();
    while (!inflight.empty()) complete_front();
    drop_pending_gathers();  // what follows may change the shards they read
  }
  void zero_grad();
};

}  // namespace tiermem
