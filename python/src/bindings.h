// python/src/bindings.h — what the binding sources of the `tiermem._tiermem` extension share:
// array views over DLPack / buffer-protocol objects, page-locked allocations, error translation.
//
// Arrays: every buffer argument is any object nanobind can import without a copy — a numpy array
// (buffer protocol or __dlpack__) or a torch tensor (__dlpack__) on the CPU. It must be
// C-contiguous; a destination must be writable. A wrong object raises TypeError, a wrong
// dtype/size/layout ValueError; both name the function and the argument. The extension never
// copies an array to make it fit (a read into a copy would be lost).
//
// Thread-safety: the helpers here need the GIL (they touch Python objects).
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <string>

namespace tiermem::py {

namespace nb = nanobind;

// A borrowed view of a contiguous CPU array. `data` stays valid while the caller holds the
// Python object it came from.
struct ArrayView {
  void* data = nullptr;
  std::uint64_t nbytes = 0;
  std::uint64_t elems = 0;
  nb::dlpack::dtype dtype{};
};

// Views `obj` (argument `arg` of function `fn`) as a contiguous CPU array. `writable`: the array
// is written (a read destination); a torch tensor that requires grad is viewed as its data.
// Throws nb::type_error (None, not an array: a meta or sparse tensor says so), nb::value_error
// (not on the CPU, not contiguous, a negated view, read-only when writable).
ArrayView view_array(nb::handle obj, const char* fn, const char* arg, bool writable);

// Name of a DLPack dtype, e.g. "float32", "bfloat16".
std::string dtype_name(nb::dlpack::dtype dt);
bool is_f32(nb::dlpack::dtype dt);
bool is_bf16(nb::dlpack::dtype dt);
bool is_f16(nb::dlpack::dtype dt);

// A new page-locked (mlock, best effort), 4096-aligned, zero-filled block of `nbytes` bytes as a
// 1-D uint8 numpy array that owns it (unmapped when the last reference goes). `locked` reports
// whether mlock succeeded (RLIMIT_MEMLOCK can refuse it; the memory still works, unpinned).
nb::object new_locked_array(std::uint64_t nbytes, bool* locked);

// Formats like std::format for the few messages here (the project's fmt is not needed).
std::string str_printf(const char* format, ...) __attribute__((format(printf, 1, 2)));

// Registers the module's exception class tiermem.IoError (an OSError subclass with errno,
// strerror, filename, offset and length) and the translator of every tiermem exception:
// IoError -> tiermem.IoError, ConfigError -> ValueError, OutOfMemoryError -> MemoryError,
// NotSupportedError -> NotImplementedError, any other tiermem::Error -> RuntimeError.
void register_errors(nb::module_& m);

// Raises tiermem.IoError(err, message, path) with offset/length set (throws nb::python_error).
[[noreturn]] void raise_io_error(int err, const std::string& message, const std::string& path,
                                 std::uint64_t offset, std::uint64_t length);

void bind_aio_handle(nb::module_& m);
void bind_swap(nb::module_& m);
void bind_adam(nb::module_& m);
void bind_zero_engine(nb::module_& m);
void bind_train_state(nb::module_& m);

}  // namespace tiermem::py
