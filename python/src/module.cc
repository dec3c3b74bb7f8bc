// python/src/module.cc — the `tiermem._tiermem` extension: array views, page-locked arrays,
// exception translation, and the module's definition. See bindings.h.
#include <sys/mman.h>

#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <new>
#include <algorithm>

#include "bindings.h"
#include "tiermem/error.h"

namespace tiermem::py {

std::string str_printf(const char* format, ...) {
  va_list ap;
  va_start(ap, format);
  char small[512];
  va_list ap2;
  va_copy(ap2, ap);
  int n = std::vsnprintf(small, sizeof small, format, ap);
  va_end(ap);
  std::string out;
  if (n < static_cast<int>(sizeof small)) {
    out.assign(small, n < 0 ? 0 : n);
  } else {
    out.resize(static_cast<std::size_t>(n) + 1);
    std::vsnprintf(out.data(), out.size(), format, ap2);
    out.resize(static_cast<std::size_t>(n));
  }
  va_end(ap2);
  return out;
}

bool is_f32(nb::dlpack::dtype dt) {
  return dt.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float) && dt.bits == 32 &&
         dt.lanes == 1;
}
bool is_bf16(nb::dlpack::dtype dt) {
  return dt.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Bfloat) && dt.bits == 16 &&
         dt.lanes == 1;
}
bool is_f16(nb::dlpack::dtype dt) {
  return dt.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float) && dt.bits == 16 &&
         dt.lanes == 1;
}

std::string dtype_name(nb::dlpack::dtype dt) {
  const char* kind = "unknown";
  switch (static_cast<nb::dlpack::dtype_code>(dt.code)) {
    case nb::dlpack::dtype_code::Int: kind = "int"; break;
    case nb::dlpack::dtype_code::UInt: kind = "uint"; break;
    case nb::dlpack::dtype_code::Float: kind = "float"; break;
    case nb::dlpack::dtype_code::Bfloat: kind = "bfloat"; break;
    case nb::dlpack::dtype_code::Complex: kind = "complex"; break;
    case nb::dlpack::dtype_code::Bool: kind = "bool"; break;
    default: break;
  }
  return str_printf("%s%d", kind, static_cast<int>(dt.bits));
}

ArrayView view_array(nb::handle obj, const char* fn, const char* arg, bool writable) {
  if (obj.is_none())
    throw nb::type_error(str_printf("%s: argument '%s' is None; expected a CPU numpy array or torch "
                                    "tensor", fn, arg).c_str());
  // A torch tensor with its negative bit set (x._neg_view(), a lazily negated view) exports its
  // memory unnegated through DLPack: it would be read with the wrong sign.
  if (nb::hasattr(obj, "is_neg") && nb::cast<bool>(obj.attr("is_neg")()))
    throw nb::value_error(str_printf("%s: argument '%s' is a negated view (its is_neg() is True); call "
                                     ".resolve_neg() first", fn, arg).c_str());
  nb::ndarray<nb::ro> a;
  if (!nb::try_cast(obj, a, /*convert=*/false)) {
    std::string type = nb::type_name(obj.type()).c_str();
    // Why a torch tensor has no view: the hint that fits it, none for other objects. (A tensor that
    // requires grad has one: nanobind takes it detached.)
    auto flag = [&](const char* name) { return nb::hasattr(obj, name) && nb::cast<bool>(obj.attr(name)); };
    const char* hint = "";
    if (flag("is_meta")) hint = " (a meta tensor has no data: materialize it first, e.g. .to_empty(device='cpu'))";
    else if (flag("is_sparse") || flag("is_sparse_csr")) hint = " (a sparse tensor: call .to_dense() first)";
    throw nb::type_error(
        str_printf("%s: argument '%s' must be a CPU array supporting DLPack or the buffer protocol "
                   "(numpy array, torch tensor), got %s%s", fn, arg, type.c_str(), hint)
            .c_str());
  }
  int dev = a.device_type();
  if (dev != nb::device::cpu::value && dev != nb::device::cuda_host::value)
    throw nb::value_error(
        str_printf("%s: argument '%s' is on DLPack device type %d; only CPU memory can be used",
                   fn, arg, dev).c_str());
  // C-contiguous: strides (in elements) are the suffix products of the shape; size-1 dims are free.
  std::int64_t expect = 1;
  for (std::size_t i = a.ndim(); a.size() > 0 && i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expect)
      throw nb::value_error(str_printf("%s: argument '%s' is not contiguous (call .contiguous() or "
                                       "numpy.ascontiguousarray first)", fn, arg).c_str());
    expect *= static_cast<std::int64_t>(a.shape(i));
  }
  if (writable) {
    nb::ndarray<> w;
    if (!nb::try_cast(obj, w, /*convert=*/false))
      throw nb::value_error(
          str_printf("%s: argument '%s' is read-only but is written by this call", fn, arg).c_str());
  }
  ArrayView v;
  v.data = const_cast<void*>(a.data());
  v.nbytes = a.nbytes();
  v.elems = a.size();
  v.dtype = a.dtype();
  return v;
}

namespace {

struct LockedBlock {
  void* base;
  std::size_t bytes;  // mapped length (a multiple of the page size)
  bool locked;
};

void free_locked_block(void* p) noexcept {
  auto* b = static_cast<LockedBlock*>(p);
  if (b->locked) munlock(b->base, b->bytes);
  munmap(b->base, b->bytes);
  delete b;
}

PyObject* g_io_error = nullptr;  // the class tiermem.IoError (owned by the module)

}  // namespace

nb::object new_locked_array(std::uint64_t nbytes, bool* locked) {
  std::size_t map_bytes = static_cast<std::size_t>((std::max<std::uint64_t>(nbytes, 1) + 4095) /
                                                   4096 * 4096);
  void* base = mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED)
    throw std::bad_alloc();  // MemoryError
  bool ok = mlock(base, map_bytes) == 0;
  if (locked) *locked = ok;
  auto* block = new LockedBlock{base, map_bytes, ok};
  nb::capsule owner(block, free_locked_block);
  std::size_t shape[1] = {static_cast<std::size_t>(nbytes)};
  return nb::ndarray<nb::numpy, std::uint8_t, nb::ndim<1>>(base, 1, shape, owner).cast();
}

[[noreturn]] void raise_io_error(int err, const std::string& message, const std::string& path,
                                 std::uint64_t offset, std::uint64_t length) {
  nb::object cls = nb::borrow(g_io_error);
  nb::object e = cls(err, nb::str(message.c_str()), nb::str(path.c_str()));
  e.attr("offset") = offset;
  e.attr("length") = length;
  PyErr_SetObject(g_io_error, e.ptr());
  throw nb::python_error();
}

void register_errors(nb::module_& m) {
  g_io_error = PyErr_NewExceptionWithDoc(
      "tiermem.IoError",
      "An I/O operation of tiermem failed. An OSError: errno, strerror (tiermem's full message) and "
      "filename (the file) as usual, plus offset and length (bytes) of the failing piece. errno is "
      "0 for failures that are not an errno (unexpected end of file, checksum or validation "
      "mismatch).",
      PyExc_OSError, nullptr);
  if (!g_io_error) throw nb::python_error();
  m.attr("IoError") = nb::borrow(g_io_error);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const IoError& e) {
      nb::object cls = nb::borrow(g_io_error);
      nb::object inst = cls(e.err(), nb::str(e.what()), nb::str(e.path().c_str()));
      inst.attr("offset") = e.offset();
      inst.attr("length") = e.bytes();
      PyErr_SetObject(g_io_error, inst.ptr());
    } catch (const ConfigError& e) {
      // The key and value, when the message does not name the key itself.
      std::string msg = e.what();
      if (!e.key_path().empty() && msg.find(e.key_path()) == std::string::npos) {
        msg = "config key '" + e.key_path() + "' = " + e.value() + ": " + msg;
      }
      PyErr_SetString(PyExc_ValueError, msg.c_str());
    } catch (const OutOfMemoryError& e) {
      PyErr_SetString(PyExc_MemoryError, e.what());
    } catch (const NotSupportedError& e) {
      PyErr_SetString(PyExc_NotImplementedError, e.what());
    } catch (const Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });
}

}  // namespace tiermem::py

NB_MODULE(_tiermem, m) {
  namespace py = tiermem::py;
  m.doc() = "tiermem's C++ core: the io_uring engine, swap space and CPU AdamW (see tiermem/__init__.py)";
  // Engines live in reference cycles with the models they hook (model -> hooks -> engine), which
  // the interpreter may leave uncollected at exit; that is not a leak worth a report.
  py::nb::set_leak_warnings(false);
  py::register_errors(m);
  m.def(
      "new_locked_array",
      [](std::int64_t nbytes) {
        if (nbytes < 0)
          throw py::nb::value_error(
              py::str_printf("new_locked_array: argument 'nbytes' must be >= 0, got %lld",
                             static_cast<long long>(nbytes)).c_str());
        bool locked = false;
        py::nb::object a = py::new_locked_array(static_cast<std::uint64_t>(nbytes), &locked);
        return py::nb::make_tuple(a, locked);
      },
      py::nb::arg("nbytes"),
      "A new zero-filled, 4096-aligned block of `nbytes` bytes as a 1-D uint8 numpy array that owns "
      "it, page-locked with mlock when RLIMIT_MEMLOCK allows. Returns (array, locked).");
  py::bind_aio_handle(m);
  py::bind_swap(m);
  py::bind_adam(m);
  py::bind_zero_engine(m);
  py::bind_train_state(m);
}
