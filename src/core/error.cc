#include "tiermem/error.h"

#include <cerrno>
#include <cstdio>
#include <cstring>

namespace tiermem {
namespace {

std::string io_message(const std::string& op, const std::string& path, std::uint64_t offset,
                       std::uint64_t bytes, int err, const std::string& detail) {
  // A position only for an operation on a file's bytes (mkdir, open, flock... have none).
  std::string m = op + " failed on '" + path + "'";
  if (offset != 0 || bytes != 0) m += " at offset " + std::to_string(offset) + ", " + std::to_string(bytes) + " bytes";
  m += ": ";
  if (!detail.empty()) {
    m += detail;
    if (err != 0) m += " (" + std::string(std::strerror(err)) + ", errno " + std::to_string(err) + ")";
  } else {
    m += std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")";
  }
  return m;
}

std::string oom_message(Tier tier, std::uint64_t requested, std::uint64_t available,
                        const std::string& detail) {
  std::string m = "out of " + std::string(tier_name(tier)) + " memory: requested " +
                  format_bytes(requested) + " (" + std::to_string(requested) + " bytes), available " +
                  format_bytes(available) + " (" + std::to_string(available) + " bytes)";
  if (!detail.empty()) m += "; " + detail;
  return m;
}

}  // namespace

ConfigError::ConfigError(std::string key_path, std::string value, const std::string& message)
    : Error(message), key_path_(std::move(key_path)), value_(std::move(value)) {}

IoError::IoError(std::string path, std::uint64_t offset, std::uint64_t bytes, int err,
                 const std::string& op, const std::string& detail)
    : Error(io_message(op, path, offset, bytes, err, detail)),
      path_(std::move(path)),
      offset_(offset),
      bytes_(bytes),
      err_(err) {}

IoError IoError::corrupt(std::string path, std::uint64_t offset, std::uint64_t bytes,
                         const std::string& detail) {
  IoError e(std::move(path), offset, bytes, 0, "read", detail);
  e.corrupt_ = true;
  return e;
}

IoError::IoError(Rewrap, const std::string& message, const IoError& from)
    : Error(message),
      path_(from.path_),
      offset_(from.offset_),
      bytes_(from.bytes_),
      err_(from.err_),
      corrupt_(from.corrupt_) {}

IoError IoError::with_context(const std::string& context) const {
  return IoError(Rewrap{}, context + ": " + what(), *this);
}

OutOfMemoryError::OutOfMemoryError(Tier tier, std::uint64_t requested, std::uint64_t available,
                                   const std::string& detail)
    : Error(oom_message(tier, requested, available, detail)),
      detail_(detail),
      tier_(tier),
      requested_(requested),
      available_(available) {}

std::string describe(const ConfigError& e) {
  const std::string what = e.what();
  if (e.key_path().empty() || what.find("'" + e.key_path() + "'") != std::string::npos) return what;
  return e.value().empty() ? e.key_path() + ": " + what : e.key_path() + " = " + e.value() + ": " + what;
}

std::string errno_message(std::string_view what, int err) {
  return std::string(what) + ": " + std::strerror(err) + " (errno " + std::to_string(err) + ")";
}

std::string format_bytes(std::uint64_t bytes) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 5) {
    v /= 1024.0;
    ++u;
  }
  char buf[64];
  if (u == 0) std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(bytes));
  else std::snprintf(buf, sizeof buf, "%.1f %s", v, units[u]);
  return buf;
}

namespace detail {
void throw_errno(const char* expr, int err, const char* file, int line) {
  throw Error(errno_message(std::string(expr) + " at " + file + ":" + std::to_string(line), err));
}
}  // namespace detail

}  // namespace tiermem
