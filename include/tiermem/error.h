// tiermem/error.h — the exceptions tiermem throws, and the check macros that raise them.
//
// Every failure tiermem reports derives from tiermem::Error and says what failed and where
// (path, offset, bytes, errno, key). Async operations deliver these through the future of the
// operation that failed. Nothing in tiermem calls abort()/assert() on user input or I/O errors.
//
// Thread-safety: the exception types are immutable values; copying them is thread-safe.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include "tiermem/export.h"
#include "tiermem/tier.h"

namespace tiermem {

// Base of every tiermem exception. what() is a complete, one-line, human-readable message.
// The message is this object's own std::string, not std::runtime_error's: libstdc++ keeps that
// one in a reference-counted copy-on-write buffer shared by every copy, so an error made on an
// I/O completion thread and read by the waiting thread would share a buffer whose count lives in
// uninstrumented libstdc++ code (ThreadSanitizer reports the last release as a race). The base
// holds an empty string (libstdc++'s static empty representation: never counted or freed).
class TIERMEM_API Error : public std::runtime_error {
 public:
  explicit Error(std::string message) : std::runtime_error(""), message_(std::move(message)) {}
  const char* what() const noexcept override { return message_.c_str(); }

 private:
  std::string message_;
};

// A configuration value is wrong. key_path is the JSON path ("zero_optimization.stage"),
// value the offending value as text (may be empty for a missing key).
class TIERMEM_API ConfigError : public Error {
 public:
  ConfigError(std::string key_path, std::string value, const std::string& message);
  const std::string& key_path() const noexcept { return key_path_; }
  const std::string& value() const noexcept { return value_; }

 private:
  std::string key_path_;
  std::string value_;
};

// An I/O operation failed. offset and bytes are in bytes; err is the errno (0 when the failure is
// not an errno, e.g. a checksum mismatch, which is then named in detail).
class TIERMEM_API IoError : public Error {
 public:
  IoError(std::string path, std::uint64_t offset, std::uint64_t bytes, int err,
          const std::string& op, const std::string& detail = {});
  // The bytes read back are not the bytes written (a checksum mismatch, seen again after a
  // re-read): the data is lost, not just unreachable. errno 0; `detail` names both hashes.
  static IoError corrupt(std::string path, std::uint64_t offset, std::uint64_t bytes,
                         const std::string& detail);
  // True for errors made by corrupt() (kept through with_context).
  bool corrupt_data() const noexcept { return corrupt_; }
  const std::string& path() const noexcept { return path_; }
  std::uint64_t offset() const noexcept { return offset_; }
  std::uint64_t bytes() const noexcept { return bytes_; }
  int err() const noexcept { return err_; }
  // The same error (path, offset, bytes, errno) with `context` put in front of the message:
  // "<context>: <what()>". Layers use it to say what was being moved, e.g. TensorStore's
  // "tensor 'layer0.w' (nvme->device)". Never throws other than std::bad_alloc.
  IoError with_context(const std::string& context) const;

 private:
  struct Rewrap {};
  IoError(Rewrap, const std::string& message, const IoError& from);
  std::string path_;
  std::uint64_t offset_;
  std::uint64_t bytes_;
  int err_;
  bool corrupt_ = false;
};

// A tier cannot satisfy an allocation. requested and available are in bytes.
class TIERMEM_API OutOfMemoryError : public Error {
 public:
  OutOfMemoryError(Tier tier, std::uint64_t requested, std::uint64_t available,
                   const std::string& detail = {});
  Tier tier() const noexcept { return tier_; }
  std::uint64_t requested() const noexcept { return requested_; }
  std::uint64_t available() const noexcept { return available_; }
  // What the caller added after the "out of <tier> memory: requested .., available .." clause.
  // Wrap with it, not what(): a rethrow that names its own sizes says the clause once.
  const std::string& detail() const noexcept { return detail_; }

 private:
  std::string detail_;
  Tier tier_;
  std::uint64_t requested_;
  std::uint64_t available_;
};

// The operation needs a backend or feature this build or machine does not have.
class TIERMEM_API NotSupportedError : public Error {
 public:
  explicit NotSupportedError(const std::string& message) : Error(message) {}
};

// A collective failed (MPI or NCCL), or ranks disagree.
class TIERMEM_API CommError : public Error {
 public:
  explicit CommError(const std::string& message) : Error(message) {}
};

// A CUDA runtime/driver call failed.
class TIERMEM_API CudaError : public Error {
 public:
  explicit CudaError(const std::string& message) : Error(message) {}
};

// A ConfigError as one line for a command's stderr: "<key> = <value>: <what>" ("<key>: <what>"
// without a value), or <what> alone when it is about no key or already quotes it ('<key>', as the
// config's own errors do).
TIERMEM_API std::string describe(const ConfigError& e);

// Formats "<what>: <strerror(err)> (errno <err>)".
TIERMEM_API std::string errno_message(std::string_view what, int err);

// Human-readable byte count: "64.0 MiB".
TIERMEM_API std::string format_bytes(std::uint64_t bytes);

namespace detail {
[[noreturn]] void throw_errno(const char* expr, int err, const char* file, int line);
}  // namespace detail

}  // namespace tiermem

// TM_CHECK_ERRNO(expr): expr returns -1 and sets errno on failure (POSIX style); throws tiermem::Error
// naming the expression, errno and file:line. Use only where no richer context exists; I/O on
// files throws IoError with path and offset instead.
#define TM_CHECK_ERRNO(expr)                                                      \
  do {                                                                            \
    if ((expr) == -1) ::tiermem::detail::throw_errno(#expr, errno, __FILE__, __LINE__); \
  } while (0)

// TM_CHECK_NEG_ERRNO(expr): expr returns -errno on failure (liburing style).
#define TM_CHECK_NEG_ERRNO(expr)                                                   \
  do {                                                                             \
    int tm_rc_ = (expr);                                                           \
    if (tm_rc_ < 0) ::tiermem::detail::throw_errno(#expr, -tm_rc_, __FILE__, __LINE__); \
  } while (0)
