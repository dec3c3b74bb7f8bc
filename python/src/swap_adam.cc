// python/src/swap_adam.cc — the pieces tiermem.torch builds its optimizers from:
//   _tiermem.SwapSpace: tiermem's NVMe swap space (extents in preallocated swap files under one or
//                       more directories) with its own IoEngine; asynchronous reads and writes of
//                       arrays into extents, each returning a Request.
//   _tiermem.adam_step: one AdamW step of tiermem's SIMD kernel (AVX-512/AVX2/scalar, OpenMP) over
//                       fp32 arrays, with the optional fused bf16/fp16 copy of the new weights.
//
// Thread-safety: SwapSpace methods may be called from any Python thread (the C++ object is
// thread-safe); Request.wait() and adam_step release the GIL while they run.
#include <cerrno>
#include <cmath>
#include <map>
#include <memory>
#include <mutex>

#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "bindings.h"
#include "tiermem/adam.h"
#include "tiermem/error.h"
#include "tiermem/io_engine.h"
#include "tiermem/swap_space.h"

namespace tiermem::py {
namespace {

// An in-flight transfer: the request and the array it reads into / writes from (kept alive).
class Request {
 public:
  Request(IoRequest r, nb::object keep) : request_(std::move(r)), keep_(std::move(keep)) {}
  // Blocks with the GIL released; raises tiermem.IoError on failure (every call raises it again).
  void wait() {
    {
      nb::gil_scoped_release release;
      request_.wait();
    }
  }
  bool ready() const { return request_.ready(); }

 private:
  IoRequest request_;
  nb::object keep_;
};

class PySwapSpace {
 public:
  PySwapSpace(std::vector<std::string> dirs, std::int64_t block_size, std::int64_t queue_depth,
              std::int64_t intra_op_parallelism, bool o_direct, std::int64_t initial_bytes,
              bool checksum, bool make_dirs) {
    if (dirs.empty())
      throw nb::value_error("SwapSpace: argument 'dirs' must name at least one directory");
    if (block_size <= 0 || block_size % 4096 != 0)
      throw nb::value_error(str_printf("SwapSpace: argument 'block_size' must be a positive "
                                       "multiple of 4096, got %lld",
                                       static_cast<long long>(block_size)).c_str());
    if (queue_depth <= 0 || intra_op_parallelism <= 0 || initial_bytes <= 0)
      throw nb::value_error("SwapSpace: 'queue_depth', 'intra_op_parallelism' and 'initial_bytes' "
                            "must be > 0");
    IoEngineOptions eo;
    eo.block_size_bytes = static_cast<std::uint64_t>(block_size);
    eo.queue_depth = static_cast<int>(queue_depth);
    eo.rings = static_cast<int>(intra_op_parallelism);
    eo.o_direct = o_direct;
    engine_ = make_io_engine(eo);
    SwapSpaceOptions so;
    so.initial_bytes_per_path = static_cast<std::uint64_t>(initial_bytes);
    so.checksum = checksum;
    // make_dirs: the missing directories are made (marked) and removed again with the swap space
    // when nothing else is left in them (make_swap_dirs, swap_space.h).
    std::vector<std::string> made;
    if (make_dirs) {
      for (const std::string& d : dirs) {
        for (std::string& m : make_swap_dirs(d)) made.push_back(std::move(m));
      }
    }
    try {
      swap_ = std::make_unique<SwapSpace>(so, std::move(dirs), *engine_);
    } catch (...) {
      for (const std::string& m : made) remove_swap_dir_if_unused(m);
      throw;
    }
    swap_->remove_when_done(std::move(made));
  }
  ~PySwapSpace() {
    // Registered regions first (they name memory the arrays own), then the swap files.
    for (auto& [base, keep] : registered_) engine_->unregister_buffers(base);
  }

  // Reserves `nbytes` (> 0); returns the extent's id.
  std::uint64_t allocate(std::int64_t nbytes) {
    if (nbytes <= 0)
      throw nb::value_error(str_printf("SwapSpace.allocate: argument 'nbytes' must be > 0, got %lld",
                                       static_cast<long long>(nbytes)).c_str());
    SwapExtent e = swap_->allocate(static_cast<std::uint64_t>(nbytes));
    std::lock_guard<std::mutex> lock(mu_);
    std::uint64_t id = e.id;
    extents_.emplace(id, std::move(e));
    return id;
  }
  void free(std::uint64_t id) {
    SwapExtent e = take(id);
    swap_->free(e);
  }
  std::uint64_t extent_bytes(std::uint64_t id) { return get(id).bytes; }

  Request write(std::uint64_t id, nb::handle array) {
    ArrayView v = view_array(array, "SwapSpace.write", "array", /*writable=*/false);
    SwapExtent e = get(id);
    check_fits("SwapSpace.write", v, e);
    return Request(swap_->write(e, v.data, v.nbytes), nb::borrow(array));
  }
  Request read(std::uint64_t id, nb::handle array) {
    ArrayView v = view_array(array, "SwapSpace.read", "array", /*writable=*/true);
    SwapExtent e = get(id);
    check_fits("SwapSpace.read", v, e);
    return Request(swap_->read(e, v.data, v.nbytes), nb::borrow(array));
  }

  // Registers a (page-locked) array's memory as io_uring fixed buffers; the SwapSpace keeps a
  // reference to the array until it is destroyed. Returns whether the engine accepted it.
  bool register_buffer(nb::handle array) {
    ArrayView v = view_array(array, "SwapSpace.register_buffer", "array", /*writable=*/true);
    bool ok = engine_->register_buffers(v.data, v.nbytes);
    if (ok) registered_.emplace_back(v.data, nb::borrow(array));
    return ok;
  }

  nb::dict stats() const {
    SwapStats s = swap_->stats();
    IoStats io = engine_->stats();
    nb::dict d;
    d["capacity_bytes"] = s.capacity_bytes;
    d["used_bytes"] = s.used_bytes;
    d["free_bytes"] = s.free_bytes;
    d["extents"] = s.extents;
    d["alignment_bytes"] = s.alignment_bytes;
    d["bytes_read"] = io.bytes_read;
    d["bytes_written"] = io.bytes_written;
    d["fixed_buffer_pieces"] = io.fixed_buffer_pieces;
    d["bounced_pieces"] = io.bounced_pieces;
    d["engine"] = std::string(engine_->name());
    d["o_direct"] = engine_->options().o_direct;
    nb::list files;
    for (std::uint32_t i = 0; i < swap_->dirs().size(); ++i) files.append(swap_->file_path(i));
    d["files"] = files;
    return d;
  }

 private:
  static void check_fits(const char* fn, const ArrayView& v, const SwapExtent& e) {
    if (v.nbytes > e.bytes)
      throw nb::value_error(str_printf("%s: argument 'array' is %llu bytes, more than the extent's "
                                       "%llu", fn, static_cast<unsigned long long>(v.nbytes),
                                       static_cast<unsigned long long>(e.bytes)).c_str());
  }
  SwapExtent get(std::uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = extents_.find(id);
    if (it == extents_.end())
      throw nb::key_error(str_printf("SwapSpace: no live extent %llu",
                                     static_cast<unsigned long long>(id)).c_str());
    return it->second;
  }
  SwapExtent take(std::uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = extents_.find(id);
    if (it == extents_.end())
      throw nb::key_error(str_printf("SwapSpace.free: no live extent %llu",
                                     static_cast<unsigned long long>(id)).c_str());
    SwapExtent e = std::move(it->second);
    extents_.erase(it);
    return e;
  }

  std::unique_ptr<IoEngine> engine_;  // declared first: destroyed after swap_
  std::unique_ptr<SwapSpace> swap_;
  std::mutex mu_;  // guards extents_
  std::map<std::uint64_t, SwapExtent> extents_;
  std::vector<std::pair<void*, nb::object>> registered_;
};

void adam_step_py(nb::handle param, nb::handle grad, nb::handle exp_avg, nb::handle exp_avg_sq,
                  double lr, double beta1, double beta2, double eps, double weight_decay,
                  std::int64_t step, double grad_scale, nb::handle half) {
  const char* fn = "adam_step";
  ArrayView p = view_array(param, fn, "param", true);
  ArrayView g = view_array(grad, fn, "grad", false);
  ArrayView m = view_array(exp_avg, fn, "exp_avg", true);
  ArrayView v = view_array(exp_avg_sq, fn, "exp_avg_sq", true);
  const std::pair<const char*, const ArrayView*> all[] = {
      {"param", &p}, {"grad", &g}, {"exp_avg", &m}, {"exp_avg_sq", &v}};
  for (auto& [name, a] : all) {
    if (!is_f32(a->dtype))
      throw nb::value_error(str_printf("%s: argument '%s' must be float32, got %s", fn, name,
                                       dtype_name(a->dtype).c_str()).c_str());
    if (a->elems != p.elems)
      throw nb::value_error(str_printf("%s: argument '%s' has %llu elements, 'param' has %llu", fn,
                                       name, static_cast<unsigned long long>(a->elems),
                                       static_cast<unsigned long long>(p.elems)).c_str());
  }
  if (step < 1)
    throw nb::value_error(str_printf("%s: argument 'step' must be >= 1, got %lld", fn,
                                     static_cast<long long>(step)).c_str());
  if (!(beta1 >= 0 && beta1 < 1) || !(beta2 >= 0 && beta2 < 1))
    throw nb::value_error(str_printf("%s: 'beta1' and 'beta2' must be in [0, 1), got %g, %g", fn,
                                     beta1, beta2).c_str());
  // As CPUAdamW checks them (a negative lr climbed the loss, a NaN one made every parameter NaN).
  const std::pair<const char*, double> scalars[] = {{"lr", lr}, {"eps", eps}, {"weight_decay", weight_decay}};
  for (const auto& [name, value] : scalars) {
    if (!(value >= 0) || !std::isfinite(static_cast<float>(value)))  // the kernel's float32 (1e300 is inf)
      throw nb::value_error(str_printf("%s: '%s' must be a finite float32 number >= 0, got %g", fn, name, value).c_str());
  }
  if (!(grad_scale > 0) || !std::isfinite(static_cast<float>(grad_scale)))
    throw nb::value_error(str_printf("%s: 'grad_scale' must be a finite number > 0, got %g", fn, grad_scale).c_str());
  void* half_ptr = nullptr;
  DType half_dtype = DType::kBF16;
  if (!half.is_none()) {
    ArrayView h = view_array(half, fn, "half", true);
    if (is_bf16(h.dtype)) {
      half_dtype = DType::kBF16;
    } else if (is_f16(h.dtype)) {
      half_dtype = DType::kF16;
    } else {
      throw nb::value_error(str_printf("%s: argument 'half' must be bfloat16 or float16, got %s",
                                       fn, dtype_name(h.dtype).c_str()).c_str());
    }
    if (h.elems != p.elems)
      throw nb::value_error(str_printf("%s: argument 'half' has %llu elements, 'param' has %llu",
                                       fn, static_cast<unsigned long long>(h.elems),
                                       static_cast<unsigned long long>(p.elems)).c_str());
    half_ptr = h.data;
  }
  AdamParams ap;
  ap.lr = static_cast<float>(lr);
  ap.beta1 = beta1;
  ap.beta2 = beta2;
  ap.eps = static_cast<float>(eps);
  ap.weight_decay = static_cast<float>(weight_decay);
  ap.step = step;
  ap.grad_scale = static_cast<float>(grad_scale);
  nb::gil_scoped_release release;
  adam_step(ap, static_cast<float*>(p.data), static_cast<const float*>(g.data),
            static_cast<float*>(m.data), static_cast<float*>(v.data), p.elems, half_ptr, half_dtype);
}

}  // namespace

void bind_swap(nb::module_& m) {
  nb::class_<Request>(m, "Request",
                      "An asynchronous swap-space transfer; keeps its array alive until dropped.")
      .def("wait", &Request::wait,
           "Blocks (GIL released) until the transfer is complete; raises tiermem.IoError.")
      .def("ready", &Request::ready, "True once complete (never blocks, never raises).");
  nb::class_<PySwapSpace>(m, "SwapSpace")
      .def(nb::init<std::vector<std::string>, std::int64_t, std::int64_t, std::int64_t, bool,
                    std::int64_t, bool, bool>(),
           nb::arg("dirs"), nb::arg("block_size") = 1 << 20, nb::arg("queue_depth") = 32,
           nb::arg("intra_op_parallelism") = 1, nb::arg("o_direct") = true,
           nb::arg("initial_bytes") = 64 << 20, nb::arg("checksum") = false, nb::arg("make_dirs") = false,
           "Swap files in `dirs` (each locked for this object's lifetime). Each must exist, unless "
           "`make_dirs`: then the missing ones are made, and removed with this object when empty.")
      .def("allocate", &PySwapSpace::allocate, nb::arg("nbytes"),
           "Reserves an extent of `nbytes` bytes; returns its id.")
      .def("free", &PySwapSpace::free, nb::arg("extent"))
      .def("extent_bytes", &PySwapSpace::extent_bytes, nb::arg("extent"))
      .def("write", &PySwapSpace::write, nb::arg("extent"), nb::arg("array"),
           "Starts writing the array's bytes to the start of the extent; returns a Request.")
      .def("read", &PySwapSpace::read, nb::arg("extent"), nb::arg("array"),
           "Starts reading array.nbytes bytes from the start of the extent; returns a Request.")
      .def("register_buffer", &PySwapSpace::register_buffer, nb::arg("array"))
      .def("stats", &PySwapSpace::stats);
}

void bind_adam(nb::module_& m) {
  m.def("adam_step", &adam_step_py, nb::arg("param").none(), nb::arg("grad").none(), nb::arg("exp_avg").none(),
        nb::arg("exp_avg_sq").none(), nb::arg("lr"), nb::arg("beta1"), nb::arg("beta2"), nb::arg("eps"),
        nb::arg("weight_decay"), nb::arg("step"), nb::arg("grad_scale") = 1.0,
        nb::arg("half").none() = nb::none(),
        "One AdamW step in place (tiermem/adam.h): param, exp_avg, exp_avg_sq float32 (written), "
        "grad float32 (read), all with the same element count, contiguous, on the CPU; step >= 1 "
        "(bias corrections use it); half: None or a bfloat16/float16 array receiving the rounded "
        "new param in the same pass. Releases the GIL.");
  m.def("adam_isa", [] { return std::string(adam_isa_name(adam_best_isa())); },
        "The AdamW kernel this CPU runs: 'avx512', 'avx2' or 'scalar'.");
}

}  // namespace tiermem::py
