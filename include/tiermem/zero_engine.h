// tiermem/zero_engine.h — the ZeRO partitioner: optimizer state (stage 1), gradients (stage 2)
// and parameters (stage 3) sharded over the ranks of a Communicator, every byte of it a tensor of
// the engine's TensorStore on the tiers the config names, stepped by sub-group AdamW.
// docs/zero.md describes the stages, the tiers each kind of state lives on, the streamed and the
// overlapped step, the device-resident optimizer and checkpoints; this header is the contract.
//
// Usage: every rank makes the same calls in the same order: register_module for each module
// (full fp32 values), then per micro-batch gather(m) before module m runs (forward and backward)
// and reduce_gradients(m, grad) after its backward, then step(). tiermem-train
// (src/train/train_engine_zero.cc), tiermem.torch (python/tiermem/torch/_hooks.py) and
// examples/zero_mlp.cc drive it so.
//
// Gradient convention: reduce_gradients() takes this rank's gradient of ONE micro-batch (with
// fp16, of the loss times loss_scale()). step() uses (sum over ranks and micro-batches) /
// (world size x micro-batches) / loss_scale, or the sum over micro-batches when
// ZeroEngineOptions::mean_over_micro_batches is false (torch's convention); optional global-norm
// clipping (gradient_clipping > 0) applies to that.
//
// Units: counts are ELEMENTS; *_bytes are bytes. Ownership: the engine owns every buffer it
// allocates; a Gathered view is valid until it is destroyed, and the engine must outlive it.
// Thread-safety: not thread-safe; one thread drives an engine (collectives must be issued in the
// same order on every rank). The Communicator must outlive the engine.
// Errors: ConfigError (key path named) for configs the engine cannot run — sub_group_size below
// the alignment, an unsupported optimizer type, offload_param nvme without stage 3,
// tiermem.device_optimizer on with an offloaded optimizer or stage 0, a budget below the minimum
// (the key, its value and the minimum), an NVMe directory without room; Error for API misuse
// (registering after the first gather, wrong gradient size, unknown module); CommError and
// IoError from collectives and swap I/O; OutOfMemoryError when a tier cannot make room in time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "tiermem/config.h"
#include "tiermem/dtype.h"
#include "tiermem/export.h"
#include "tiermem/loss_scaler.h"
#include "tiermem/quantize.h"
#include "tiermem/tensor_store.h"
#include "tiermem/zero_plan.h"

namespace tiermem {

class Communicator;
class Device;

// Engine settings that are not in Config.
struct TIERMEM_API ZeroEngineOptions {
  // Shards and sub-groups are aligned to this many elements (1024 fp32 = 4 KiB, the NVMe block).
  std::size_t alignment_elems = 1024;
  // With overlap_comm, at most this many reduce-scatter buckets are in flight; more waits.
  int max_inflight_buckets = 4;
  // true: step() averages the gradients over the micro-batches handed in since the last step
  // (tiermem-train's convention: each reduce_gradients() call carries one micro-batch's mean).
  // false: it sums them (torch's convention: loss.backward() accumulates, and the caller divides
  // the loss by gradient_accumulation_steps itself, as DeepSpeed's engine.backward does). Both
  // still divide by the world size (the mean over ranks).
  bool mean_over_micro_batches = true;
  // Module i (in registration order) is frozen: a weight that is used but not trained (a LoRA
  // base, an RL reference model, a teacher). Its working parameters are partitioned, homed and
  // gathered exactly as a trainable module's (in the working dtype, on offload_param's tier), but
  // it has no fp32 master weights, no gradient and no optimizer state, takes no room in the
  // rank-flat optimizer shard (ZeroOptimizerState lists only the modules that train), and is
  // never written back once registered (its working shard is only read). reduce_gradients and
  // gradient_buffer throw Error for it; step() skips it; export_master returns its working
  // parameters as fp32; set_module_params rewrites them. Empty or shorter than the module list:
  // the modules past its end train. An engine whose every module is frozen runs forward only.
  std::vector<bool> frozen_modules;
};

// What this rank holds and moved, in bytes (for tests, logs and the trainer's summary).
struct TIERMEM_API ZeroStats {
  // Sizes of this rank's state, wherever it lives.
  std::uint64_t optimizer_state_bytes = 0;  // fp32 master + m + v (12 B per shard element)
  std::uint64_t gradient_bytes = 0;         // fp32 gradient partitions / full gradient buffers
  std::uint64_t working_param_bytes = 0;    // working params in engine host buffers (stages 0-2,
                                            // persistent stage-3 modules: shard + full copy)
  std::uint64_t param_store_bytes = 0;      // stage-3 working shards held in the TensorStore
  std::uint64_t frozen_param_bytes = 0;     // ... of which frozen modules' (ZeroEngineOptions), in
                                            // their at-rest format's bytes (frozen_at_rest)
  // How frozen modules' stored shards sit on their tier (tiermem.frozen_dtype, tiermem/quantize.h):
  // kWorking = the working dtype; else bf16 or int8, dequantized at every gather.
  FrozenDtype frozen_at_rest = FrozenDtype::kWorking;
  // Whether the parameter Prefetcher prefetches aggressively (tiermem.prefetch_eviction as
  // resolved: "aggressive", or "auto" on an engine whose every module is frozen); false: MIN.
  bool aggressive_prefetch = false;
  // Homes (ZeroPlan): where each kind of state lives between uses.
  Tier param_home = Tier::kHost, optimizer_home = Tier::kHost, gradient_home = Tier::kHost;
  std::size_t sub_group_elems = 0;          // optimizer sub-group size used
  std::size_t sub_groups = 0;
  // Memory, accounted (allocator-rounded). Host: the store's pool (homes + caches + sub-groups in
  // flight), its pinned bounce chunks, and the engine's own host buffers (working copies, full
  // gradients of stages 0-1, reduce-scatter buckets in flight). Device: the store's device tier
  // plus all-gathered modules. Peaks are maxima since construction.
  std::uint64_t host_budget_bytes = 0;
  std::uint64_t host_pool_peak_bytes = 0;   // <= host_budget_bytes
  std::uint64_t host_bounce_bytes = 0;      // bounce chunks committed (at their first NVMe transfer,
                                            // up to pipeline_chunks) x pipeline_chunk_bytes
  std::uint64_t host_engine_bytes = 0;      // now
  std::uint64_t host_engine_peak_bytes = 0;
  std::uint64_t device_budget_bytes = 0;    // 0: no device tier (stages 0-2, all persistent)
  std::uint64_t device_peak_bytes = 0;      // store device peak + gathered peak (+ the device
                                            // optimizer's scratch sub-groups) <= budget
  std::uint64_t gathered_bytes_peak = 0;    // largest total of live stage-3 gathered buffers
  bool host_pinned = false;                 // pin_memory asked for (the pool may fall back)
  // Traffic (TensorStore transfers, every kind of state together).
  std::uint64_t nvme_read_bytes = 0;        // NVMe -> host and NVMe -> device
  std::uint64_t nvme_written_bytes = 0;     // host -> NVMe and device -> NVMe
  // The same traffic by kind of state (the four sum to the totals above): trainable working
  // params, frozen working params (written once, at registration), optimizer state (fp32 master
  // and moments, without the gradients), and the stage 2-3 gradient partitions.
  std::uint64_t nvme_read_trainable_bytes = 0, nvme_read_frozen_bytes = 0, nvme_read_optimizer_bytes = 0;
  std::uint64_t nvme_written_trainable_bytes = 0, nvme_written_frozen_bytes = 0, nvme_written_optimizer_bytes = 0;
  std::uint64_t nvme_read_gradient_bytes = 0, nvme_written_gradient_bytes = 0;
  std::uint64_t host_to_device_bytes = 0;  // and the engine's own staging copies (a device
  std::uint64_t device_to_host_bytes = 0;  // the CPU cannot address: zero_device.cc)
  std::uint64_t store_hits = 0, store_misses = 0;  // acquires that found / had to load a copy
  // Copies moved between the memory tiers on eviction instead of dropped (TensorStoreStats):
  // device copies kept in host memory (demote_to_host), read-in-place host copies moved to free
  // device room. Counts.
  std::uint64_t store_demotions = 0, store_promotions = 0;
  std::uint64_t stall_ns = 0;               // time acquires waited for loads and room (compute + step)
  // The calling (driving) thread's share: its acquires' waits plus its waits for the engine's
  // update and gradient threads, not those threads' own stalls, which overlap its work. Never
  // more than the wall time of the calls it was made in.
  std::uint64_t driving_stall_ns = 0;
  // Wall time of the deferred AdamW updates (tiermem.overlap_optimizer_step) that gather() and
  // prefetch_gather() applied before reading a module, their stalls included: optimizer time
  // spent inside those calls. An update that ran ahead on the engine's update thread while the
  // previous module computed (one rank, host-addressable memory: zero.md) counts only the time a
  // call then waited for it.
  std::uint64_t deferred_update_ns = 0;
  std::uint64_t deferred_update_stall_ns = 0;  // ... of which the caller waited (part of driving_stall_ns)
  std::uint64_t deferred_updates_ahead = 0;    // modules whose deferred update ran ahead (count)
  std::uint64_t updates_in_backward = 0;       // modules updated during backward (step_in_backward; count)
  // The NVMe traffic, stalls and I/O busy time by training phase (TensorStoreStats::phases,
  // indexed by Phase value; the phase is the one gather()/the step passed to the store). Each sums
  // over phases to nvme_read_bytes, nvme_written_bytes, stall_ns.
  PhaseIoStats phases[kNumPhases] = {};
  // The last step (step_io_meter.h): from the first gather/reduce_gradients after the previous
  // step() (or the first ever) to the end of the latest step(), skipped steps included; 0 before
  // the first. wall: its wall time; stall: the time the calling (driving) thread waited — its
  // acquires' stalls and its waits for the engine's update and gradient threads, not those
  // threads' own stalls, which overlap its work (so not stall_ns's share of the step);
  // compute: wall - stall; io_bound: the time the NVMe needs for its traffic, read /
  // nvme_read_gbps + written / nvme_write_gbps (0 when a rate is unknown).
  std::uint64_t last_step_nvme_read_bytes = 0, last_step_nvme_written_bytes = 0;
  std::uint64_t last_step_stall_ns = 0, last_step_wall_ns = 0, last_step_compute_ns = 0;
  std::uint64_t last_step_io_bound_ns = 0;
  // The NVMe rates io_bound uses, GB/s (1e9 bytes/s): tiermem.nvme_read_gbps / nvme_write_gbps,
  // else tiermem.machine_profile's (resolve_nvme_rates); 0 = unknown.
  double nvme_read_gbps = 0, nvme_write_gbps = 0;
  std::uint64_t prefetches_issued = 0;
  // The Prefetcher's hints (TensorStoreStats::prefetch_hints), and of those the ones given while a
  // step recorded its order: the first, by the modules' registration order (expect_order), and one
  // recorded afresh, by the previous step's (Prefetcher::rerecord).
  std::uint64_t prefetch_hints = 0, prefetch_hints_recording = 0;
  std::uint64_t reduce_scatter_calls = 0;   // bucketed reduce-scatter collectives issued
  std::uint64_t all_gather_calls = 0;
  std::uint64_t all_gathers_prefetched = 0;  // of those, started by prefetch_gather
  std::int64_t steps = 0;                   // optimizer steps taken (skipped ones excluded)
  std::int64_t skipped_steps = 0;           // fp16 overflows
};

// One rank's optimizer shard as a per-rank checkpoint holds it (as in DeepSpeed's ZeRO
// checkpoints, each rank saves and loads only its own partition of the optimizer state).
// The three vectors are this rank's rank-flat shard: shard_numel() fp32 elements each, the
// registered modules' shards back to back in registration order, each padded to the alignment
// (padding elements stay 0). The partition fields describe which shard it is; import checks them.
struct TIERMEM_API ZeroOptimizerState {
  int world_size = 1;                      // ranks the optimizer state is split over (1: stage 0)
  int rank = 0;                            // this shard's index among them
  std::size_t alignment_elems = 0;         // ZeroEngineOptions::alignment_elems of the writer
  std::vector<std::size_t> module_numels;  // numel of every module that trains (not frozen), in order
  std::vector<float> master;               // fp32 master weights
  std::vector<float> exp_avg;              // Adam first moment (m)
  std::vector<float> exp_avg_sq;           // Adam second moment (v)
  std::int64_t steps = 0;                  // optimizer steps taken (bias correction: steps + 1 next)
  std::int64_t skipped_steps = 0;          // fp16 overflows so far (statistics)
  std::optional<LossScalerState> loss_scaler;  // present iff fp16 is enabled
};

// One optimizer sub-group's slice of this rank's shard, as the streamed export/import hand it
// over: elements [offset, offset + n) of the rank-flat shard (ZeroOptimizerState's layout) of the
// fp32 master weights and the two Adam moments. Non-owning; valid during the callback only.
// Which third of a sub-group's optimizer state (export_module_state, set_module_state).
enum class OptimizerStateKind { kMaster = 0, kExpAvg = 1, kExpAvgSq = 2 };

struct TIERMEM_API ZeroStateChunk {
  std::size_t offset = 0;  // elements into the rank-flat shard
  std::size_t n = 0;       // elements in each span
  float* master = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
};

class TIERMEM_API ZeroEngine {
 public:
  // A module's full working parameters for as long as the scope lives (stage 3: gathered into a
  // buffer freed on destruction; other stages: a view of the persistent full copy).
  // Move-only. data() has numel() elements of dtype() (padding excluded).
  // Where: on_device() says whether data() is device memory (stored stage-3 modules: the pinned
  // shard with one rank, the all-gathered device buffer with several) or host memory (stages
  // 0-2, persistent modules with several ranks). Device memory of a device that is not
  // host-addressable (engine.device()->host_addressable() false: CudaDevice, or SimDevice with
  // tiermem.sim_host_addressable false) must never be read by the CPU: pass data() to device
  // kernels or copy it with the Device's copy API; f32()/half() are then views to hand on, not
  // to dereference.
  class Gathered {
   public:
    Gathered() = default;
    Gathered(Gathered&& o) noexcept;
    Gathered& operator=(Gathered&& o) noexcept;
    Gathered(const Gathered&) = delete;
    Gathered& operator=(const Gathered&) = delete;
    ~Gathered();

    const void* data() const { return data_; }
    std::size_t numel() const { return numel_; }
    bool on_device() const { return owned_ ? owned_on_device_ : pin_.valid() && pin_.tier() == Tier::kDevice; }
    DType dtype() const { return dtype_; }
    // Typed views; throw Error when dtype() differs (f32(): kF32; half(): kBF16 or kF16).
    std::span<const float> f32() const;
    std::span<const std::uint16_t> half() const;
    // Ends the scope early (idempotent).
    void release();

   private:
    friend class ZeroEngine;
    ZeroEngine* engine_ = nullptr;
    int module_ = -1;
    const void* data_ = nullptr;
    std::size_t numel_ = 0;
    DType dtype_ = DType::kF32;
    bool owned_ = false;          // stage-3 gathered buffer to free on release
    bool owned_on_device_ = false;  // ... allocated from the engine's Device
    TensorStore::Pin pin_;        // one rank: the working shard itself, pinned at the compute tier
  };

  struct StepResult {
    bool skipped = false;      // fp16 overflow: nothing was updated
    double loss_scale = 1.0;   // the scale to use for the next micro-batches
    double grad_norm = 0.0;    // global L2 norm of the mean gradient (before clipping)
    std::int64_t step = 0;     // optimizer steps taken so far
  };

  // Validates what the engine needs beyond parse_config (throws ConfigError naming the key).
  // `comm` must outlive the engine. With offload nvme, creates <nvme_path>/rank<r>/.
  ZeroEngine(const Config& config, Communicator& comm, ZeroEngineOptions options = {});
  // As above, with every module's element count announced up front (the register_module calls
  // must follow in this order): the plan is made and checked now — a ConfigError naming the
  // budget key, its value and the minimum (ZeroPlan::why) or an NVMe directory without room,
  // before anything is written — and each register_module writes its module's tensors to their
  // homes at once, so initialisation streams module by module and never holds the model.
  ZeroEngine(const Config& config, Communicator& comm, std::span<const std::size_t> module_numels,
             ZeroEngineOptions options = {});
  // The plan this engine uses (valid after the numels are known: at construction with them, else
  // after the first gather/reduce_gradients/step).
  const ZeroPlan& plan() const;
  ~ZeroEngine();
  ZeroEngine(const ZeroEngine&) = delete;
  ZeroEngine& operator=(const ZeroEngine&) = delete;

  // Registers the next module (index returned, from 0) with its full initial fp32 parameters
  // (numel = init.size(), identical on every rank; only this rank's shard is kept). Only before
  // the first gather/reduce_gradients/step. Throws Error afterwards.
  int register_module(const std::string& name, std::span<const float> init);

  int num_modules() const;
  // The module was registered frozen (ZeroEngineOptions::frozen_modules). Error for an unknown one.
  bool is_frozen(int module) const;
  std::size_t module_numel(int module) const;
  DType working_dtype() const { return working_dtype_; }

  // The module's full working parameters (see Gathered). Stage 3: a blocking all-gather, or the
  // wait for the one prefetch_gather(module) started.
  Gathered gather(int module, Phase phase = Phase::kOther);
  // Starts module's stage-3 all-gather now (async on the communicator) so that the compute of the
  // module before it hides it; the next gather(module) waits for it and takes its buffer. Returns
  // false, doing nothing, where there is nothing to start: one rank (the Prefetcher already
  // loads shards ahead), a module not stored, device memory the CPU cannot address. At most two
  // are pending: a third first completes and frees the oldest (a prediction that did not come
  // true). step(), synchronize(), zero_grad() and every state import/export complete and free
  // those not taken. Collective: every rank must call it for the same modules in the same order
  // as its other collectives. The buffer counts in gathered_bytes_peak from the start.
  // Errors: as gather(); a CommError of the collective surfaces from the gather that takes it.
  bool prefetch_gather(int module, Phase phase = Phase::kOther);

  // Adds this rank's micro-batch gradient of `module` (full fp32, numel elements; the caller's
  // buffer may be reused when the call returns). Stage 2/3: reduce-scatters it now in buckets
  // (async with overlap_comm; completed by the next step()/synchronize()).
  void reduce_gradients(int module, std::span<const float> grad);
  // As above, taking the buffer (grad.size() == numel): with one rank and stage 2/3 the call
  // returns once the gradient partitions it adds into that already hold a gradient are pinned
  // (in call order, so the access trace stays deterministic), and the rest — fresh partitions
  // acquired for overwrite (with any write-back that makes room for them), the additions, the
  // folded norm — runs on the engine's gradient thread while the caller goes on with backward; one call is in flight at a time (the next call, step(),
  // synchronize(), zero_grad() and the state export wait for it), so at most one buffer and one
  // module's partitions are held beyond the caller's. Otherwise the same as the span form. The
  // buffer is freed by the engine. Errors as the span form; one raised on the gradient thread is
  // rethrown by the next of those calls.
  void reduce_gradients(int module, std::vector<float>&& grad);
  // As the taking form, with memory the caller lends instead of gives: `grad` (numel fp32
  // elements) must stay valid and unchanged until the engine drops `keep` (the caller's hold on
  // that memory; its deleter releases it). With one rank and stage 2/3 the engine drops it on the
  // gradient thread once the additions are done (so the deleter runs there, and must not block
  // on anything the caller holds while it waits on the engine); otherwise the call is the span
  // form, and `keep` is dropped before it returns. The engine neither frees nor writes `grad`, and
  // does not count it in its host bytes. For a framework's own gradient tensor (tiermem.torch
  // lends its flat gradient buffer). Errors as the taking form; `keep` is dropped on every path.
  void reduce_gradients(int module, std::span<const float> grad, std::shared_ptr<const void> keep);
  // A zeroed fp32 buffer of module_numel(module) elements for the module's gradient, to be handed
  // back through reduce_gradients(module, std::vector&&): the buffer of the hand-off before the
  // last one when it was big enough (zeroed on the gradient thread after its additions, so the
  // caller's thread neither allocates, faults pages in nor clears 4 x numel bytes), else a new
  // one. At most one such spare is kept between two reduce calls and none across step(); it is
  // counted in ZeroStats::host_engine_bytes. Errors: Error for an unknown module; std::bad_alloc.
  std::vector<float> gradient_buffer(int module);

  // As reduce_gradients, with the gradient in device memory of the engine's device (device()):
  // `grad_device` points at `numel` fp32 elements (numel == module_numel(module)), allocated from
  // that Device (or, on CUDA, any device memory of its GPU), written by kernels that have
  // completed before the call (on CUDA: synchronise the stream that wrote it first; the engine's
  // copy runs on the device's D2H stream). The caller keeps ownership; the buffer may be reused
  // or freed when the call returns. On a host-addressable device (SimDevice) the gradient is
  // reduced in place, exactly as reduce_gradients would; otherwise it is copied to a host buffer
  // of the largest module's gradient (4 x numel bytes, made at the first call and kept; counted
  // in ZeroStats::host_engine_bytes) and reduced from there: the same arithmetic, so the result
  // is bit for bit that of reduce_gradients on the same values. Not thread-safe (as every call).
  // Errors: Error for an unknown module, a wrong numel, a null pointer, or an engine without a
  // device tier (stages 0-2, or every stage-3 module persistent: device() is null); the copy's
  // error (CudaError, or Error from SimDevice for a pointer outside its allocations); then as
  // reduce_gradients.
  void reduce_gradients_from_device(int module, const float* grad_device, std::size_t numel);

  // The device stage-3 gathers land on and a device-resident optimizer steps on (the Device
  // tiermem.device names), or null when the engine has no device tier (stages 0-2 without a
  // device-resident optimizer, every stage-3 module persistent) or has not made it yet: it is
  // made with the plan (see plan()). Owned by the engine.
  Device* device() const noexcept;

  // Waits for every in-flight reduce-scatter.
  void synchronize();

  // Hands the engine's memory back between training phases (DeepSpeed's offload_states; RL
  // colocation: room for an inference engine): waits for what is in flight, applies pending
  // overlapped updates, drops the gradient buffer kept for reuse, writes every dirty tensor to its
  // home tier and drops every cached copy above it (TensorStore::offload), returns the host
  // pool's free pages and the device allocator's cache, then glibc's free heap (malloc_trim).
  // State homed on NVMe leaves memory entirely; state homed in host or device memory (offload
  // "cpu"/"none", modules kept whole, engine buffers of stages 0-2) stays. Call between steps
  // (copies a live Gathered pins stay). Nothing needs reloading: the next gather or step reads
  // what it needs back from its home, bit for bit. Returns the bytes of the copies dropped.
  // Errors: IoError of a write-back.
  std::uint64_t offload_states();

  // Zeroes the gradient accumulation (step() does this itself after stepping or skipping).
  void zero_grad();

  // Reduces what is left, checks for overflow (fp16), clips, steps AdamW over every sub-group,
  // refreshes the working params (with the overlapped step: those of stored stage-3 modules at
  // their next gather, see above; grad_norm is returned now either way). Counts micro-batches
  // itself (no gradient_accumulation_steps bookkeeping needed by the caller).
  StepResult step();

  // A forward-only engine's (every module frozen) pass boundary, its counterpart of step(): the
  // store's trace of accesses ends here. The Prefetcher records the first pass and replays every
  // later one that gathers the same modules in the same order: it reads ahead from NVMe (across
  // the boundary, into the next pass) and evicts by next use (Belady's MIN) instead of least
  // recently used. Why: generate() runs the model's forward once per token over the same modules,
  // a cycle; with caches smaller than the model, LRU over a cycle keeps nothing the next pass can
  // use, and gathers outside a step got no read-ahead at all. Gathers of the pass must use
  // Phase::kForward (kOutsideStep is not traced). The last-step figures (ZeroStats::last_step_*)
  // then cover the last pass. Thread-safety: the driving thread, between passes. Errors: Error on
  // an engine with a trainable module (its steps end at step()).
  void end_forward_pass();

  // Declares that the coming backward pass completes this step's gradients (the last micro-batch
  // of an accumulation) and that step() follows it at learning rate `lr`: each module's update may
  // then run during that backward, on the engine's update thread beside the calling thread's
  // compute, once the module's gradient is complete, so its gradient partitions need not go to
  // NVMe and its state's reads and write-backs overlap backward instead of the next forward. The
  // rule of the update running ahead in forward holds: one module at a time, started by a backward
  // gather (Phase::kBackward) once the module's last hand-off has completed, only with room for it
  // beside every pin held, and waited for by the next call. step() updates what is left. Every
  // result equals the deferred or eager step bit for bit (the same scalars, gradients and state).
  // Applies (returns true) with tiermem.update_in_backward true, ZeRO-3 on one rank,
  // host-addressable memory, the host optimizer, no gradient clipping and no fp16 loss scaler;
  // else false, and nothing changes. Once armed, until step():
  //   - a module's gradient must be complete at its last reduce_gradients of the backward, and its
  //     working params not read again in it (true of autograd: every use of a trained weight adds
  //     to its gradient before the gradient is final); a module gathered again after its hand-off
  //     is left to step(). A second gradient for a module already updated is an Error (nothing
  //     more is updated; call with tiermem.update_in_backward false for such a model);
  //   - step() with another learning rate uses `lr` (a warning names both): the updates already
  //     ran with it; likewise the micro-batch count of mean_over_micro_batches, taken at the first
  //     update (the most reduce calls of any module then);
  //   - after any update the step is half done (the updated modules' params and state are this
  //     step's, the others' the last step's) until step(): export_grad of an updated module and
  //     zero_grad() (the gradient was consumed), and every read or write of the model but a
  //     backward gather (gather of another phase, export_master, export_module_state,
  //     export_optimizer_state, set_module_params, set_module_state, import_optimizer_state,
  //     offload_states) are Errors, and change nothing.
  // Thread-safety: the driving thread, between steps. Errors: an update's IoError or
  // OutOfMemoryError from the call that waits for it.
  bool step_in_backward(double lr);
  // Modules updated in backward since step_in_backward, step() not yet called (0 otherwise): the
  // step is half done while this is above 0.
  int updated_in_backward() const;

  // Sets the AdamW learning rate used by the next step() calls (a schedule's value for the
  // step; the config's optimizer.params.lr until called). Must be finite and >= 0, else throws
  // ConfigError naming optimizer.params.lr. Call it between steps, from the stepping thread.
  void set_learning_rate(double lr);

  // The fp16 loss scale (1 unless fp16 is enabled): multiply the loss by it before backward.
  double loss_scale() const;

  // Replaces the module's parameters with `values` (full fp32, numel elements, identical on every
  // rank): this rank's part of the fp32 master weights is overwritten (Adam moments and step count
  // are kept) and the working parameters are republished from it exactly as step() publishes them
  // (to the working dtype; a stored stage-3 shard at its home; stages 1-2 and persistent modules
  // all-gathered), so the next gather() sees the new values. A pending overlapped update of the
  // module is applied first. Between steps only: gradients accumulated since the last step are
  // kept. Collective with several ranks (the all-gather of modules kept whole): call on every
  // rank. Errors: Error for an unknown module or a wrong element count (nothing changed);
  // IoError from the swap space / parameter store.
  void set_module_params(int module, std::span<const float> values);

  // The module's full fp32 master weights (numel elements), all-gathered — every rank gets them,
  // rank 0 typically saves them. Reads NVMe-resident state as needed. A frozen module: its working
  // (or dequantized at-rest) values as fp32. Called before every module is registered, on an
  // engine constructed with the modules' sizes, it reads a registered module as written and leaves
  // registration open (initialize gives a model its values back this way when a later
  // registration fails); otherwise it ends registration (the first training call).
  std::vector<float> export_master(int module);

  // One module's full fp32 optimizer state of `kind` (numel elements): kMaster is export_master;
  // kExpAvg / kExpAvgSq the Adam moments, all-gathered from every rank's shard. Between steps;
  // collective with several ranks (call on every rank). Error for an unknown or frozen module
  // (it has no optimizer state); IoError from the swap space.
  std::vector<float> export_module_state(int module, OptimizerStateKind kind);
  // Replaces one module's fp32 optimizer state of `kind` with `values` (full, numel elements,
  // identical on every rank); kMaster is set_module_params (the working params republished).
  // The other two kinds are kept. Between steps; collective. Errors as export_module_state, and
  // Error for a wrong element count (nothing changed).
  void set_module_state(int module, OptimizerStateKind kind, std::span<const float> values);
  // The module's gradient as the next step() would use it (numel fp32 elements): the mean over
  // ranks of what reduce_gradients was given since the last step (summed over micro-batches, or
  // their mean with mean_over_micro_batches), divided by the fp16 loss scale; zeros where none
  // arrived. Valid between the backward and step() (after step() it is zero). Waits for the
  // reductions in flight; collective with several ranks. Error for an unknown or frozen module.
  std::vector<float> export_grad(int module);

  // Elements of this rank's rank-flat optimizer shard (the size of each vector of
  // ZeroOptimizerState). Finalizes the module registration (collective: call on every rank).
  std::size_t shard_numel();

  // Copies this rank's optimizer shard (master, exp_avg, exp_avg_sq: shard_numel() fp32 each),
  // step counts and fp16 loss-scaler state out, for a per-rank checkpoint. With offload_optimizer
  // nvme it reads every sub-group's [master | m | v] extent through a staging buffer (blocking
  // I/O, about 12 × shard_numel() bytes). Call between steps: gradients in flight are waited for
  // but not part of the state. Finalizes first if needed (collective: call on every rank).
  // Throws IoError from the swap space.
  ZeroOptimizerState export_optimizer_state();

  // Replaces this rank's optimizer shard, step counts and loss-scaler state with `state` (as
  // export_optimizer_state returned it, typically from a checkpoint of the same rank), writes it
  // where the state lives (host vectors, or each sub-group's NVMe extent through a staging
  // buffer), then republishes the working parameters from the imported master exactly as step()
  // does (to the working dtype; stage 3 shards in the parameter store are rewritten at their
  // home; stages 1–2 and persistent stage-3 modules are all-gathered), so the next gather() sees
  // the restored weights and the next step() continues bit for bit as the saved run would have.
  // Accumulated gradients are discarded (as zero_grad()). The partition may differ in stage (1–3
  // share it), offload devices and sub_group_size, not in world size, rank, alignment or modules.
  // Collective (the all-gathers): call on every rank, between steps, from the stepping thread.
  // Throws Error naming what differs (world size, rank, alignment, module count or a module's
  // numel, a vector's length, loss-scaler state present vs fp16 enabled, a negative step count,
  // an impossible loss-scaler state); nothing is changed then. IoError from the swap space /
  // parameter store (the state is then partly written: import again or discard the engine).
  void import_optimizer_state(const ZeroOptimizerState& state);

  // The same two calls, streamed one optimizer sub-group at a time, so that a checkpoint of any
  // size needs no host memory beyond the engine's budget: no shard-sized vectors.
  //
  // Export: calls `sink` once per sub-group, in increasing `offset`, the chunks tiling
  // [0, shard_numel()); the spans point into the sub-group as the store holds it at the host tier
  // and are valid only during the call (read them, do not keep them). The returned state has the
  // partition fields, step counts and loss-scaler state, and empty vectors. The next sub-groups
  // are prefetched while `sink` runs. Accesses are Phase::kOutsideStep (the step's access trace
  // is untouched). Errors: as the vector form, plus whatever `sink` throws (propagated; nothing
  // changed).
  ZeroOptimizerState export_optimizer_state(const std::function<void(const ZeroStateChunk&)>& sink);

  // Import: validates `header` (its vectors must be empty) as the vector form does — nothing is
  // changed on an error — then calls `source` once per sub-group, in increasing `offset`, to fill
  // the chunk's three spans (`n` elements each; every element must be written), writes each
  // sub-group at its home and republishes the working parameters from it, as the vector form
  // does. If `source` throws, the exception propagates and the state is partly written (import
  // again or discard the engine). Collective, as the vector form.
  void import_optimizer_state(const ZeroOptimizerState& header,
                              const std::function<void(const ZeroStateChunk&)>& source);

  ZeroStats stats() const;
  // Bytes the engine's store has written to NVMe so far. Thread-safe (unlike the other calls):
  // a monitor thread may poll it while the engine works.
  std::uint64_t nvme_bytes_written() const;
  // "sim" or "cuda" for the device the stage-3 working shards are computed on; "host" when the
  // engine has no device tier (stages 0-2, every module persistent).
  std::string device_name() const;
  const Config& config() const { return config_; }

 private:
  struct TIERMEM_LOCAL Impl;
  friend class Gathered;
  void release_gathered(Gathered& g) noexcept;

  Config config_;
  DType working_dtype_ = DType::kF32;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tiermem
