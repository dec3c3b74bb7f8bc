// python/src/zero_engine.cc — tiermem.torch's bridge to the C++ ZeroEngine:
//   _tiermem.Config      a parsed ds_config (tiermem::parse_config: the same parser, errors and
//                        "auto" rules as tiermem-train), as a value; to_json() gives every key.
//   _tiermem.ZeroEngine  one ZeroEngine over a Communicator: module registration, gathers returned
//                        as torch tensors that VIEW the engine's memory (DLPack, no copy),
//                        gradient reduction, the AdamW step, parameter write-back, checkpoint
//                        export/import one sub-group at a time, statistics.
//
// Lifetime: a gathered tensor owns its ZeroEngine::Gathered scope. The scope ends (stage 3: the
// working shard is unpinned, an all-gathered buffer freed) when torch frees the tensor's storage,
// i.e. when the last view of it goes; the engine itself lives until the last such tensor and the
// Python object are gone. So no torch view can ever read memory the engine has given back.
//
// Thread-safety: one Python thread drives an engine (as ZeroEngine requires). Every call keeps the
// GIL, so a tensor freed on another thread (its deleter takes the GIL) cannot end a scope while a
// call is inside the engine.
//
// Errors: as the rest of the extension (tiermem::ConfigError -> ValueError naming the key,
// IoError -> tiermem.IoError, OutOfMemoryError -> MemoryError, other tiermem::Error ->
// RuntimeError); argument errors are TypeError/ValueError naming the call and the argument.
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include <nanobind/stl/function.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "bindings.h"
#include "tiermem/communicator.h"
#include "tiermem/config.h"
#include "tiermem/device.h"
#include "tiermem/error.h"
#include "tiermem/zero_engine.h"

namespace tiermem::py {
namespace {

struct PyConfig {
  Config config;
};

// Arrays lent to the engine (reduce_gradients(lend=True)). The engine drops its hold on one on its
// gradient thread, which must not take the GIL (the driving thread may hold it while it waits for
// that thread), so the hold only moves the object here; release() lets it go with the GIL held.
struct LentArrays {
  std::mutex mu;
  std::vector<PyObject*> dropped;
  void drop(PyObject* o) noexcept {
    std::lock_guard<std::mutex> lock(mu);
    try {
      dropped.push_back(o);
    } catch (...) {  // no room to record it: the object leaks rather than being released without the GIL
    }
  }
  void release() noexcept {  // with the GIL held
    std::vector<PyObject*> v;
    {
      std::lock_guard<std::mutex> lock(mu);
      v.swap(dropped);
    }
    for (PyObject* o : v) Py_DECREF(o);
  }
};

// The engine and the communicator it runs over, shared by the Python object and every gathered
// tensor's owner.
struct EngineBox {
  std::unique_ptr<Communicator> comm;
  std::unique_ptr<ZeroEngine> engine;
  LentArrays lent;  // outlives the engine, which drops what it holds when it goes
  ~EngineBox() {     // with the GIL held (the last PyZeroEngine or gathered tensor going)
    engine.reset();  // before the communicator it uses
    comm.reset();
    lent.release();
  }
};

// Owner of one gathered tensor's memory (a DLPack capsule's payload).
struct GatheredOwner {
  std::shared_ptr<EngineBox> box;
  ZeroEngine::Gathered gathered;
  ~GatheredOwner() {
    gathered.release();  // never throws; before `box` can go
  }
};

nb::dlpack::dtype dlpack_dtype(DType d) {
  using code = nb::dlpack::dtype_code;
  if (d == DType::kBF16) return nb::dlpack::dtype{static_cast<std::uint8_t>(code::Bfloat), 16, 1};
  if (d == DType::kF16) return nb::dlpack::dtype{static_cast<std::uint8_t>(code::Float), 16, 1};
  return nb::dtype<float>();
}

const char* phase_error = "phase must be 'forward', 'backward' or 'other'";

Phase phase_of(const std::string& p) {
  if (p == "forward") return Phase::kForward;
  if (p == "backward") return Phase::kBackward;
  if (p == "other") return Phase::kOther;
  if (p == "outside") return Phase::kOutsideStep;
  throw nb::value_error((std::string("ZeroEngine.gather: ") + phase_error + ", got '" + p + "'").c_str());
}

// A contiguous fp32 CPU array of exactly `n` elements (the call and argument named in errors).
const float* f32_array(nb::handle obj, std::size_t n, const char* fn, const char* arg) {
  ArrayView v = view_array(obj, fn, arg, /*writable=*/false);
  if (!is_f32(v.dtype))
    throw nb::value_error(str_printf("%s: argument '%s' must be float32, got %s", fn, arg,
                                     dtype_name(v.dtype).c_str()).c_str());
  if (v.elems != n)
    throw nb::value_error(str_printf("%s: argument '%s' has %llu elements, expected %zu", fn, arg,
                                     static_cast<unsigned long long>(v.elems), n).c_str());
  return static_cast<const float*>(v.data);
}

// Collectives over torch.distributed (gloo on CPU tensors): `ops` is a Python object whose methods
// all_gather(send, recv), reduce_scatter(send, recv, average), all_reduce(send, recv, average),
// broadcast(buf, root) and barrier() take 1-D torch tensors viewing the engine's buffers (no copy)
// and run the collective synchronously (python/tiermem/torch/_dist.py). The engine calls every
// collective from the thread that drives it, inside an engine call that holds the GIL, so the calls
// into Python are made with the GIL held; a Python exception becomes a CommError naming the
// operation. Handles are returned complete.
class TorchDistCommunicator final : public Communicator {
 public:
  TorchDistCommunicator(nb::object ops, int rank, int world) : ops_(std::move(ops)), rank_(rank), world_(world) {}
  ~TorchDistCommunicator() override {
    nb::gil_scoped_acquire gil;
    ops_.reset();
  }
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string_view backend() const override { return "torch.distributed"; }
  bool device_buffers() const override { return false; }

  // The two collectives the engine overlaps with compute run asynchronously on the process group
  // (DistOps.*_async return a pending object, or None when already done); the rest block.
  CommHandle all_gather_async(const void* send, void* recv, std::size_t count, DType dtype) override {
    nb::object pending;
    call("all_gather", [&] {
      pending = ops_.attr("all_gather_async")(view(send, count, dtype), view(recv, count * world_, dtype));
    });
    return handle("all_gather", std::move(pending));
  }
  CommHandle reduce_scatter_async(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op) override {
    nb::object pending;
    call("reduce_scatter", [&] {
      pending = ops_.attr("reduce_scatter_async")(view(send, count * world_, dtype), view(recv, count, dtype),
                                                  op == ReduceOp::kAvg);
    });
    return handle("reduce_scatter", std::move(pending));
  }
  CommHandle all_reduce_async(const void* send, void* recv, std::size_t count, DType dtype, ReduceOp op) override {
    call("all_reduce", [&] {
      ops_.attr("all_reduce")(view(send, count, dtype), view(recv, count, dtype), op == ReduceOp::kAvg);
    });
    return {};
  }
  CommHandle broadcast_async(void* buf, std::size_t count, DType dtype, int root) override {
    call("broadcast", [&] { ops_.attr("broadcast")(view(buf, count, dtype), root); });
    return {};
  }
  void barrier() override {
    call("barrier", [&] { ops_.attr("barrier")(); });
  }

 private:
  static nb::object view(const void* p, std::size_t n, DType dtype) {
    const std::size_t shape[1] = {n};
    nb::dlpack::dtype dt;
    switch (dtype) {
      case DType::kF32: dt = nb::dtype<float>(); break;
      case DType::kBF16: case DType::kF16: case DType::kU16: dt = nb::dtype<std::int16_t>(); break;  // bits only
      default: throw CommError("torch.distributed: dtype " + std::string(dtype_name(dtype)) + " is not supported");
    }
    return nb::ndarray<nb::pytorch>(const_cast<void*>(p), 1, shape, nb::handle(), nullptr, dt)
        .cast(nb::rv_policy::reference);
  }
  // A collective torch.distributed runs in the background: wait() blocks (torch releases the GIL
  // while it waits) and finishes it (DistOps copies the result where the engine expects it).
  class Pending final : public detail::CommRequest {
   public:
    Pending(TorchDistCommunicator& c, const char* op, nb::object p) : c_(c), op_(op), p_(std::move(p)) {}
    ~Pending() override {
      nb::gil_scoped_acquire gil;
      p_.reset();
    }
    bool test() override {
      bool done = false;
      c_.call(op_, [&] { done = nb::cast<bool>(p_.attr("is_completed")()); });
      if (done) wait();
      return done;
    }
    void wait() override { c_.call(op_, [&] { p_.attr("wait")(); }); }

   private:
    TorchDistCommunicator& c_;
    const char* op_;
    nb::object p_;
  };
  CommHandle handle(const char* op, nb::object pending) {
    nb::gil_scoped_acquire gil;
    if (!pending.is_valid() || pending.is_none()) return {};
    return CommHandle(std::make_unique<Pending>(*this, op, std::move(pending)));
  }

  template <class F>
  void call(const char* op, F&& f) {
    nb::gil_scoped_acquire gil;
    try {
      f();
    } catch (nb::python_error& e) {
      throw CommError(std::string("torch.distributed ") + op + " failed on rank " + std::to_string(rank_) + " of " +
                      std::to_string(world_) + ": " + e.what());
    }
  }
  nb::object ops_;
  int rank_, world_;
};

// A numpy view (no copy, no owner) of one span of a ZeroStateChunk: valid during the callback only.
nb::object chunk_view(float* p, std::size_t n) {
  const std::size_t shape[1] = {n};
  return nb::ndarray<nb::numpy, float>(p, 1, shape, nb::handle()).cast(nb::rv_policy::reference);
}

class PyZeroEngine {
 public:
  PyZeroEngine(const PyConfig& cfg, std::vector<std::size_t> numels, bool mean_over_micro_batches,
               const std::string& comm_backend, nb::object dist_ops, std::vector<bool> frozen)
      : box_(std::make_shared<EngineBox>()) {
    CommOptions co;
    co.backend = comm_backend;
    if (comm_backend == "torch") {
      if (dist_ops.is_none()) throw nb::value_error("ZeroEngine: comm 'torch' needs dist_ops");
      box_->comm = std::make_unique<TorchDistCommunicator>(dist_ops, nb::cast<int>(dist_ops.attr("rank")),
                                                           nb::cast<int>(dist_ops.attr("world_size")));
    } else {
      box_->comm = comm_backend == "single" ? make_single_communicator() : make_communicator(co);
    }
    ZeroEngineOptions opts;
    opts.mean_over_micro_batches = mean_over_micro_batches;
    if (!frozen.empty() && frozen.size() != numels.size()) {
      throw nb::value_error("ZeroEngine: frozen must have one flag per module (or be empty)");
    }
    opts.frozen_modules = std::move(frozen);
    box_->engine = std::make_unique<ZeroEngine>(cfg.config, *box_->comm, numels, opts);
  }

  ZeroEngine& e() {
    if (!box_ || !box_->engine) throw std::runtime_error("ZeroEngine: the engine has been closed");  // RuntimeError
    box_->lent.release();  // arrays the engine is done with
    return *box_->engine;
  }

  int register_module(const std::string& name, nb::handle values, std::size_t numel) {
    const float* p = f32_array(values, numel, "ZeroEngine.register_module", "values");
    return e().register_module(name, std::span<const float>(p, numel));
  }

  nb::object gather(int module, const std::string& phase) {
    ZeroEngine& en = e();
    auto owner = std::make_unique<GatheredOwner>();
    owner->box = box_;
    owner->gathered = en.gather(module, phase_of(phase));
    const ZeroEngine::Gathered& g = owner->gathered;
    if (g.on_device() && en.device() != nullptr && !en.device()->host_addressable())
      throw nb::value_error("ZeroEngine.gather: the module's parameters are in device memory the CPU cannot "
                            "address; tiermem.torch computes on CPU tensors here (set tiermem.device to "
                            "\"sim\")");
    const std::size_t shape[1] = {g.numel()};
    void* data = const_cast<void*>(g.data());
    const DType dt = g.dtype();
    nb::capsule cap(owner.release(), [](void* p) noexcept { delete static_cast<GatheredOwner*>(p); });
    return nb::ndarray<nb::pytorch>(data, 1, shape, cap, nullptr, dlpack_dtype(dt)).cast();
  }

  bool prefetch_gather(int module, const std::string& phase) { return e().prefetch_gather(module, phase_of(phase)); }

  void reduce_gradients(int module, nb::handle grad, bool lend) {
    ZeroEngine& en = e();
    const std::size_t n = en.module_numel(module);
    const float* p = f32_array(grad, n, "ZeroEngine.reduce_gradients", "grad");
    if (!lend) {
      en.reduce_gradients(module, std::span<const float>(p, n));
      return;
    }
    // The engine holds `grad` (one reference) until its additions are done; LentArrays lets it go.
    LentArrays* lent = &box_->lent;
    PyObject* o = grad.ptr();
    Py_INCREF(o);
    std::shared_ptr<const void> keep(o, [lent](const void* q) { lent->drop(static_cast<PyObject*>(const_cast<void*>(q))); });
    en.reduce_gradients(module, std::span<const float>(p, n), std::move(keep));
  }

  void set_module_params(int module, nb::handle values) {
    ZeroEngine& en = e();
    const std::size_t n = en.module_numel(module);
    const float* p = f32_array(values, n, "ZeroEngine.set_module_params", "values");
    en.set_module_params(module, std::span<const float>(p, n));
  }

  nb::dict step() {
    ZeroEngine::StepResult r = e().step();
    box_->lent.release();  // the step waited for the last hand-off: its gradient goes now
    nb::dict d;
    d["skipped"] = r.skipped;
    d["loss_scale"] = r.loss_scale;
    d["grad_norm"] = r.grad_norm;
    d["step"] = r.step;
    return d;
  }

  // This rank's optimizer state, one sub-group at a time: sink(offset, master, exp_avg,
  // exp_avg_sq) with three float32 numpy arrays viewing the engine's memory, valid during the
  // call only. Returns the header (a dict).
  nb::dict export_state(const nb::callable& sink) {
    ZeroOptimizerState h = e().export_optimizer_state([&](const ZeroStateChunk& c) {
      sink(c.offset, chunk_view(c.master, c.n), chunk_view(c.exp_avg, c.n), chunk_view(c.exp_avg_sq, c.n));
    });
    return header_dict(h);
  }

  // Replaces this rank's optimizer state: source(offset, master, exp_avg, exp_avg_sq) fills the
  // three writable float32 arrays (every element). `header` as export_state returned it.
  void import_state(const nb::dict& header, const nb::callable& source) {
    ZeroOptimizerState h;
    h.world_size = nb::cast<int>(header["world_size"]);
    h.rank = nb::cast<int>(header["rank"]);
    h.alignment_elems = nb::cast<std::size_t>(header["alignment_elems"]);
    h.module_numels = nb::cast<std::vector<std::size_t>>(header["module_numels"]);
    h.steps = nb::cast<std::int64_t>(header["steps"]);
    h.skipped_steps = nb::cast<std::int64_t>(header["skipped_steps"]);
    if (header.contains("loss_scale")) {
      LossScalerState s;
      s.scale = nb::cast<double>(header["loss_scale"]);
      s.hysteresis_left = nb::cast<int>(header["loss_scale_hysteresis_left"]);
      s.iter = nb::cast<std::int64_t>(header["loss_scale_iter"]);
      s.last_overflow_iter = nb::cast<std::int64_t>(header["loss_scale_last_overflow_iter"]);
      h.loss_scaler = s;
    }
    e().import_optimizer_state(h, [&](const ZeroStateChunk& c) {
      source(c.offset, chunk_view(c.master, c.n), chunk_view(c.exp_avg, c.n), chunk_view(c.exp_avg_sq, c.n));
    });
  }

  nb::object export_master(int module) { return to_torch(e().export_master(module)); }

  // "master", "exp_avg" or "exp_avg_sq" (DeepSpeed's optim_state_key), else ValueError.
  static OptimizerStateKind state_kind(const std::string& key) {
    if (key == "master" || key == "fp32") return OptimizerStateKind::kMaster;
    if (key == "exp_avg") return OptimizerStateKind::kExpAvg;
    if (key == "exp_avg_sq") return OptimizerStateKind::kExpAvgSq;
    throw nb::value_error(("ZeroEngine: optimizer state key '" + key +
                           "' is not one of 'exp_avg', 'exp_avg_sq' (Adam/AdamW) or 'master'").c_str());
  }

  nb::object export_module_state(int module, const std::string& key) {
    return to_torch(e().export_module_state(module, state_kind(key)));
  }

  void set_module_state(int module, const std::string& key, nb::handle values) {
    ZeroEngine& en = e();
    const OptimizerStateKind kind = state_kind(key);
    const std::size_t n = en.module_numel(module);
    const float* p = f32_array(values, n, "ZeroEngine.set_module_state", "values");
    en.set_module_state(module, kind, std::span<const float>(p, n));
  }

  nb::object export_grad(int module) { return to_torch(e().export_grad(module)); }

  // A new 1-D float32 torch tensor owning `v`.
  static nb::object to_torch(std::vector<float>&& v) {
    auto* heap = new std::vector<float>(std::move(v));
    nb::capsule cap(heap, [](void* p) noexcept { delete static_cast<std::vector<float>*>(p); });
    const std::size_t shape[1] = {heap->size()};
    return nb::ndarray<nb::pytorch, float>(heap->data(), 1, shape, cap).cast();
  }

  nb::dict stats() {
    ZeroStats s = e().stats();
    nb::dict d;
    d["optimizer_state_bytes"] = s.optimizer_state_bytes;
    d["gradient_bytes"] = s.gradient_bytes;
    d["working_param_bytes"] = s.working_param_bytes;
    d["param_store_bytes"] = s.param_store_bytes;
    d["frozen_param_bytes"] = s.frozen_param_bytes;
    // "working" (the working dtype), "bf16" or "int8": how frozen shards sit on their tier
    d["frozen_dtype"] = std::string(frozen_dtype_name(s.frozen_at_rest));
    // tiermem.prefetch_eviction as this engine resolved it: "aggressive" or "min"
    d["prefetch_eviction"] = std::string(s.aggressive_prefetch ? "aggressive" : "min");
    d["param_home"] = std::string(tier_name(s.param_home));
    d["optimizer_home"] = std::string(tier_name(s.optimizer_home));
    d["gradient_home"] = std::string(tier_name(s.gradient_home));
    d["sub_group_elems"] = s.sub_group_elems;
    d["sub_groups"] = s.sub_groups;
    d["host_budget_bytes"] = s.host_budget_bytes;
    d["host_pool_peak_bytes"] = s.host_pool_peak_bytes;
    d["host_bounce_bytes"] = s.host_bounce_bytes;
    d["host_engine_peak_bytes"] = s.host_engine_peak_bytes;
    d["device_budget_bytes"] = s.device_budget_bytes;
    d["device_peak_bytes"] = s.device_peak_bytes;
    d["nvme_read_bytes"] = s.nvme_read_bytes;
    d["nvme_written_bytes"] = s.nvme_written_bytes;
    d["nvme_read_trainable_bytes"] = s.nvme_read_trainable_bytes;
    d["nvme_read_frozen_bytes"] = s.nvme_read_frozen_bytes;
    d["nvme_read_optimizer_bytes"] = s.nvme_read_optimizer_bytes;
    d["nvme_written_trainable_bytes"] = s.nvme_written_trainable_bytes;
    d["nvme_written_frozen_bytes"] = s.nvme_written_frozen_bytes;
    d["nvme_written_optimizer_bytes"] = s.nvme_written_optimizer_bytes;
    d["nvme_read_gradient_bytes"] = s.nvme_read_gradient_bytes;
    d["nvme_written_gradient_bytes"] = s.nvme_written_gradient_bytes;
    d["host_to_device_bytes"] = s.host_to_device_bytes;
    d["device_to_host_bytes"] = s.device_to_host_bytes;
    d["store_hits"] = s.store_hits;
    d["store_misses"] = s.store_misses;
    d["store_demotions"] = s.store_demotions;
    d["store_promotions"] = s.store_promotions;
    d["stall_ns"] = s.stall_ns;
    d["driving_stall_ns"] = s.driving_stall_ns;
    d["deferred_update_ns"] = s.deferred_update_ns;
    d["deferred_update_stall_ns"] = s.deferred_update_stall_ns;
    d["deferred_updates_ahead"] = s.deferred_updates_ahead;
    d["updates_in_backward"] = s.updates_in_backward;
    // By phase, named as gather() takes them ("outside": Phase::kOutsideStep).
    nb::dict phases;
    static constexpr const char* kPhaseKeys[kNumPhases] = {"forward", "backward", "optimizer", "other", "outside"};
    for (int p = 0; p < kNumPhases; ++p) {
      const PhaseIoStats& x = s.phases[p];
      nb::dict ph;
      ph["nvme_read_bytes"] = x.nvme_read_bytes;
      ph["nvme_written_bytes"] = x.nvme_written_bytes;
      ph["stall_ns"] = x.stall_ns;
      ph["helper_stall_ns"] = x.helper_stall_ns;
      ph["io_busy_ns"] = x.io_busy_ns;
      ph["hidden_io_ns"] = x.hidden_io_ns();
      phases[kPhaseKeys[p]] = ph;
    }
    d["phases"] = phases;
    // The last step (ZeroStats::last_step_*), seconds; the NVMe rates its bound used (GB/s, 0: unknown).
    d["last_step_nvme_read_bytes"] = s.last_step_nvme_read_bytes;
    d["last_step_nvme_written_bytes"] = s.last_step_nvme_written_bytes;
    d["step_wall_s"] = static_cast<double>(s.last_step_wall_ns) / 1e9;
    d["stall_s"] = static_cast<double>(s.last_step_stall_ns) / 1e9;
    d["compute_s"] = static_cast<double>(s.last_step_compute_ns) / 1e9;
    d["io_bound_s"] = static_cast<double>(s.last_step_io_bound_ns) / 1e9;
    d["nvme_read_gbps"] = s.nvme_read_gbps;
    d["nvme_write_gbps"] = s.nvme_write_gbps;
    d["prefetches_issued"] = s.prefetches_issued;
    d["prefetch_hints"] = s.prefetch_hints;
    d["prefetch_hints_recording"] = s.prefetch_hints_recording;
    d["all_gather_calls"] = s.all_gather_calls;
    d["all_gathers_prefetched"] = s.all_gathers_prefetched;
    d["reduce_scatter_calls"] = s.reduce_scatter_calls;
    d["steps"] = s.steps;
    d["skipped_steps"] = s.skipped_steps;
    return d;
  }

  void close() {
    if (!box_) return;
    if (box_->engine) box_->engine->synchronize();
    box_->lent.release();  // what the engine was lent (synchronize waited for it)
    box_.reset();  // the engine goes with the last gathered tensor
  }

  std::shared_ptr<EngineBox> box_;

 private:
  static nb::dict header_dict(const ZeroOptimizerState& h) {
    nb::dict d;
    d["world_size"] = h.world_size;
    d["rank"] = h.rank;
    d["alignment_elems"] = h.alignment_elems;
    d["module_numels"] = h.module_numels;
    d["steps"] = h.steps;
    d["skipped_steps"] = h.skipped_steps;
    if (h.loss_scaler) {
      d["loss_scale"] = h.loss_scaler->scale;
      d["loss_scale_hysteresis_left"] = h.loss_scaler->hysteresis_left;
      d["loss_scale_iter"] = h.loss_scaler->iter;
      d["loss_scale_last_overflow_iter"] = h.loss_scaler->last_overflow_iter;
    }
    return d;
  }
};

}  // namespace

double lr_at_step(const Config& c, double optimizer_lr, long long t);  // train_state.cc

void bind_zero_engine(nb::module_& m) {
  nb::class_<PyConfig>(m, "Config",
                       "A parsed ds_config (tiermem::parse_config). Made by parse_config(); a plain value.")
      .def("to_json", [](const PyConfig& c) { return config_to_json(c.config, -1); },
           "Every key with its resolved value, as a JSON string.")
      .def("resolve_batch_sizes", [](PyConfig& c, int world) { resolve_batch_sizes(c.config, world); },
           nb::arg("world_size"),
           "Derives the missing one of train_batch_size / train_micro_batch_size_per_gpu / "
           "gradient_accumulation_steps as DeepSpeed does (ValueError naming the keys when they disagree).")
      .def("auto_resolved_line", [](const PyConfig& c) { return auto_resolved_line(c.config); },
           "key=value for every key given as \"auto\", with the value it has now ('' when none).")
      .def_prop_ro("unknown_keys", [](const PyConfig& c) { return c.config.unknown_keys; })
      .def_prop_ro("auto_keys", [](const PyConfig& c) { return c.config.auto_keys; });
  m.def(
      "lr_at", [](const PyConfig& c, double lr, long long t) { return lr_at_step(c.config, lr, t); },
      nb::arg("config"), nb::arg("optimizer_lr"), nb::arg("step"),
      "The learning rate of optimizer step `step` (1-based) under the config's scheduler section; "
      "the optimizer's lr when there is none. ValueError for a schedule that needs total_num_steps.");
  m.def(
      "parse_config",
      [](const std::string& text, const std::string& source) { return PyConfig{parse_config(text, source)}; },
      nb::arg("text"), nb::arg("source") = "<dict>",
      "Parses ds_config JSON text; `source` names it in errors. ValueError names key, value and rule.");

  nb::class_<PyZeroEngine>(m, "ZeroEngine",
                           "tiermem::ZeroEngine for tiermem.torch (see python/src/zero_engine.cc).")
      .def(nb::init<const PyConfig&, std::vector<std::size_t>, bool, const std::string&, nb::object,
                    std::vector<bool>>(),
           nb::arg("config"), nb::arg("module_numels"), nb::arg("mean_over_micro_batches") = false,
           nb::arg("comm") = "single", nb::arg("dist_ops") = nb::none(), nb::arg("frozen") = std::vector<bool>{},
           "Plans for the modules' element counts (ValueError naming the budget key and the minimum "
           "when a budget cannot hold them; nothing is written then). register_module must follow "
           "for each, in order. frozen[i]: module i is used but not trained (no master, gradient or "
           "optimizer state; never written back); empty: every module trains.")
      .def("register_module", &PyZeroEngine::register_module, nb::arg("name"), nb::arg("values").none(),
           nb::arg("numel"), "Writes the module's initial fp32 parameters (a CPU float32 array of numel) to their homes.")
      .def("gather", &PyZeroEngine::gather, nb::arg("module"), nb::arg("phase") = "other",
           "The module's full working parameters as a 1-D torch tensor viewing the engine's memory "
           "(float32, bfloat16 or float16: the working dtype). Valid while any view of it lives.")
      .def("prefetch_gather", &PyZeroEngine::prefetch_gather, nb::arg("module"), nb::arg("phase") = "other",
           "Starts the module's all-gather now (several ranks, stage 3) so that compute hides it; the next "
           "gather(module) takes it. False where there is nothing to start (one rank, a module kept whole). "
           "Collective: every rank must call it for the same modules in the same order.")
      .def("reduce_gradients", &PyZeroEngine::reduce_gradients, nb::arg("module"), nb::arg("grad").none(),
           nb::arg("lend") = false,
           "Adds this rank's gradient of the module (a contiguous CPU float32 array of numel). lend=False: "
           "read before the call returns. lend=True: the engine keeps a reference and may read it on its "
           "gradient thread after the call returns (one rank, stage 2/3; at most one in flight, waited for "
           "by the next reduce_gradients, step(), synchronize() or zero_grad(); step() and synchronize() "
           "also drop the engine's reference), so the caller must not write it until then; an error "
           "there is raised by that next call.")
      .def("set_module_params", &PyZeroEngine::set_module_params, nb::arg("module"), nb::arg("values").none(),
           "Replaces the module's master weights and working parameters (float32, numel).")
      .def("step", &PyZeroEngine::step, "AdamW over every sub-group; returns {skipped, loss_scale, grad_norm, step}.")
      .def("zero_grad", [](PyZeroEngine& p) { p.e().zero_grad(); })
      .def("synchronize", [](PyZeroEngine& p) {
        p.e().synchronize();
        p.box_->lent.release();  // what the engine was lent (synchronize waited for it)
      })
      .def("offload_states", [](PyZeroEngine& p) { return p.e().offload_states(); },
           "Writes every dirty tensor home and drops the cached copies above it; returns the host pool's "
           "free pages and the device's cache (ZeroEngine::offload_states). Returns the bytes dropped.")
      .def("set_learning_rate", [](PyZeroEngine& p, double lr) { p.e().set_learning_rate(lr); }, nb::arg("lr"))
      .def("end_forward_pass", [](PyZeroEngine& p) { p.e().end_forward_pass(); },
           "A forward-only engine's pass boundary (ZeroEngine::end_forward_pass): the Prefetcher records the first "
           "pass's gathers and replays later passes (read-ahead, Belady eviction). Raises on a trainable engine.")
      .def("step_in_backward", [](PyZeroEngine& p, double lr) { return p.e().step_in_backward(lr); }, nb::arg("lr"),
           "Declares that the coming backward pass completes this step's gradients and that step() follows at "
           "learning rate lr: each module's update may run during that backward once its gradient is complete "
           "(ZeroEngine::step_in_backward). True when it applies (tiermem.update_in_backward, ZeRO-3 on one rank, "
           "no clipping, no fp16).")
      .def("updated_in_backward", [](PyZeroEngine& p) { return p.e().updated_in_backward(); },
           "Modules updated in backward since step_in_backward and before step(): the step is half done while "
           "above 0.")
      .def("loss_scale", [](PyZeroEngine& p) { return p.e().loss_scale(); })
      .def("module_numel", [](PyZeroEngine& p, int m) { return p.e().module_numel(m); }, nb::arg("module"))
      .def("num_modules", [](PyZeroEngine& p) { return p.e().num_modules(); })
      .def("is_frozen", [](PyZeroEngine& p, int m) { return p.e().is_frozen(m); }, nb::arg("module"))
      .def("shard_numel", [](PyZeroEngine& p) { return p.e().shard_numel(); })
      .def("export_module_state", &PyZeroEngine::export_module_state, nb::arg("module"), nb::arg("key"),
           "The module's full fp32 optimizer state 'exp_avg', 'exp_avg_sq' or 'master' as a new torch tensor "
           "(collective with several ranks). ValueError for a frozen module or an unknown key.")
      .def("set_module_state", &PyZeroEngine::set_module_state, nb::arg("module"), nb::arg("key"), nb::arg("values").none(),
           "Replaces the module's fp32 optimizer state of `key` (float32, numel; collective).")
      .def("export_grad", &PyZeroEngine::export_grad, nb::arg("module"),
           "The module's gradient as the next step would use it (mean over ranks, unscaled), float32 numel; "
           "valid between backward and step (collective with several ranks).")
      .def("export_master", &PyZeroEngine::export_master, nb::arg("module"),
           "The module's full fp32 master weights as a new torch tensor.")
      .def("export_state", &PyZeroEngine::export_state, nb::arg("sink"))
      .def("import_state", &PyZeroEngine::import_state, nb::arg("header"), nb::arg("source"))
      .def("stats", &PyZeroEngine::stats)
      .def("device_name", [](PyZeroEngine& p) { return p.e().device_name(); })
      .def("rank", [](PyZeroEngine& p) { return p.box_->comm->rank(); })
      .def("world_size", [](PyZeroEngine& p) { return p.box_->comm->world_size(); })
      .def("comm_backend", [](PyZeroEngine& p) { return std::string(p.box_->comm->backend()); })
      .def("working_dtype", [](PyZeroEngine& p) { return std::string(tiermem::dtype_name(p.e().working_dtype())); })
      .def("close", &PyZeroEngine::close,
           "Ends the engine (its swap files are removed once the last gathered tensor is freed).");
}

}  // namespace tiermem::py
