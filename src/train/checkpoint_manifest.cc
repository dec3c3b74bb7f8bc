// src/train/checkpoint_manifest.cc — parse_manifest (tiermem/checkpoint.h): the manifest's text to a
// validated CheckpointManifest, with no file access (fuzzed by tests/fuzz/manifest_fuzz.cc, so it
// depends on nlohmann-json, fmt and tiermem's error.cc only).
#include <fmt/format.h>

#include <limits>
#include <utility>

#include "tiermem/checkpoint.h"

namespace tiermem {
namespace {

[[noreturn]] void bad(const std::string& file, const std::string& what) {
  throw CheckpointError(fmt::format("checkpoint {}: {}", file, what));
}

const nlohmann::json& need(const nlohmann::json& j, const char* key, const std::string& file,
                           const std::string& where) {
  auto it = j.find(key);
  if (it == j.end()) bad(file, fmt::format("missing key '{}{}'", where, key));
  return *it;
}

std::string get_string(const nlohmann::json& j, const char* key, const std::string& file,
                       const std::string& where = {}) {
  const nlohmann::json& v = need(j, key, file, where);
  if (!v.is_string())
    bad(file, fmt::format("key '{}{}' must be a string, found {}", where, key, v.type_name()));
  return v.get<std::string>();
}

// An integer in [lo, hi]; a float, a string or an out-of-range value is an error naming the key.
std::int64_t get_int(const nlohmann::json& j, const char* key, std::int64_t lo, std::int64_t hi,
                     const std::string& file, const std::string& where = {}) {
  const nlohmann::json& v = need(j, key, file, where);
  if (!v.is_number_integer())
    bad(file, fmt::format("key '{}{}' must be an integer, found {}", where, key, v.type_name()));
  const bool too_big =
      v.is_number_unsigned() &&
      v.get<std::uint64_t>() > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
  const std::int64_t x = too_big ? hi : v.get<std::int64_t>();
  if (too_big || x < lo || x > hi)
    bad(file,
        fmt::format("key '{}{}' = {} is out of range [{}, {}]", where, key, v.dump(), lo, hi));
  return x;
}

std::uint64_t get_u64(const nlohmann::json& j, const char* key, const std::string& file,
                      const std::string& where = {}) {
  const nlohmann::json& v = need(j, key, file, where);
  if (!v.is_number_unsigned())
    bad(file, fmt::format("key '{}{}' must be a non-negative integer, found {}", where, key,
                          v.is_number() ? v.dump() : std::string(v.type_name())));
  return v.get<std::uint64_t>();
}

Tier tier_from_name(const std::string& s, const std::string& file, const std::string& where) {
  if (s == "device") return Tier::kDevice;
  if (s == "host") return Tier::kHost;
  if (s == "nvme") return Tier::kNvme;
  bad(file, fmt::format("key '{}tier' = '{}' is not a tier (device, host, nvme)", where, s));
}

constexpr std::int64_t kMaxInt = std::numeric_limits<int>::max();

}  // namespace

CheckpointManifest parse_manifest(const std::string& text, const std::string& path) {
  nlohmann::json m;
  try {
    m = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    bad(path, fmt::format("manifest is not valid JSON (byte {}): {}", e.byte, e.what()));
  } catch (const nlohmann::json::exception& e) {
    // e.g. out_of_range 406: a number literal that overflows a double (found by manifest_fuzz).
    bad(path, fmt::format("manifest is not valid JSON: {}", e.what()));
  }
  if (!m.is_object())
    bad(path, fmt::format("manifest must be a JSON object, found {}", m.type_name()));
  CheckpointManifest out;
  const std::string format = get_string(m, "format", path);
  if (format != kCheckpointFormat)
    bad(path, fmt::format("key 'format': expected '{}', found '{}'", kCheckpointFormat, format));
  const auto version = get_int(m, "version", 0, kMaxInt, path);
  if (version != kCheckpointVersion)
    bad(path, fmt::format("key 'version': expected {}, found {}", kCheckpointVersion, version));
  out.step = static_cast<int>(get_int(m, "step", 0, kMaxInt, path));
  out.world_size = static_cast<int>(get_int(m, "world_size", 1, kMaxInt, path));
  out.rank = static_cast<int>(get_int(m, "rank", 0, out.world_size - 1, path));
  out.state_file = get_string(m, "state_file", path);
  if (out.state_file.empty() || out.state_file.find('/') != std::string::npos ||
      out.state_file == "." || out.state_file == "..")
    bad(path, fmt::format("key 'state_file' = '{}' must be a file name inside the rank directory",
                          out.state_file));
  out.state_bytes = get_u64(m, "state_bytes", path);
  out.meta = need(m, "meta", path, "");
  if (!out.meta.is_object())
    bad(path, fmt::format("key 'meta' must be an object, found {}", out.meta.type_name()));
  const nlohmann::json& tensors = need(m, "tensors", path, "");
  if (!tensors.is_array())
    bad(path, fmt::format("key 'tensors' must be an array, found {}", tensors.type_name()));
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const nlohmann::json& j = tensors[i];
    const std::string where = fmt::format("tensors[{}].", i);
    if (!j.is_object())
      bad(path, fmt::format("key 'tensors[{}]' must be an object, found {}", i, j.type_name()));
    CheckpointTensor t;
    t.name = get_string(j, "name", path, where);
    t.dtype = get_string(j, "dtype", path, where);
    const nlohmann::json& shape = need(j, "shape", path, where);
    if (!shape.is_array())
      bad(path, fmt::format("key '{}shape' must be an array, found {}", where, shape.type_name()));
    for (std::size_t d = 0; d < shape.size(); ++d) {
      if (!shape[d].is_number_integer() || shape[d].get<std::int64_t>() < 0 ||
          (shape[d].is_number_unsigned() &&
           shape[d].get<std::uint64_t>() >
               static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())))
        bad(path, fmt::format("key '{}shape[{}]' = {} is not a dimension (integer >= 0)", where, d,
                              shape[d].dump()));
      t.shape.push_back(shape[d].get<std::int64_t>());
    }
    t.bytes = get_u64(j, "bytes", path, where);
    // dtype, shape and bytes must agree (an edited shape or dtype would be read wrongly).
    static constexpr std::pair<const char*, std::uint64_t> kDtypes[] = {
        {"f32", 4}, {"f64", 8}, {"i64", 8}, {"i32", 4}, {"bf16", 2}, {"f16", 2}, {"u8", 1}};
    std::uint64_t elem = 0;
    for (const auto& [name, size] : kDtypes)
      if (t.dtype == name) elem = size;
    if (elem == 0)
      bad(path, fmt::format("key '{}dtype' = '{}' is not one of f32, f64, i64, i32, bf16, f16, u8",
                            where, t.dtype));
    if (!t.shape.empty()) {
      std::uint64_t n = elem;
      bool overflow = false;
      for (std::int64_t d : t.shape)
        overflow |= __builtin_mul_overflow(n, static_cast<std::uint64_t>(d), &n);
      if (overflow || n != t.bytes)
        bad(path, fmt::format("key '{}bytes' = {} does not match tensor '{}''s shape and dtype {} "
                              "({} bytes)", where, t.bytes, t.name, t.dtype,
                              overflow ? std::string("overflowing") : std::to_string(n)));
    } else if (t.bytes % elem != 0) {
      bad(path, fmt::format("key '{}bytes' = {} is not a whole number of {} elements of tensor "
                            "'{}'", where, t.bytes, t.dtype, t.name));
    }
    t.tier = tier_from_name(get_string(j, "tier", path, where), path, where);
    t.file = get_string(j, "file", path, where);
    t.offset = get_u64(j, "offset", path, where);
    const std::string hex = get_string(j, "xxh64", path, where);
    if (hex.empty() || hex.size() > 16 ||
        hex.find_first_not_of("0123456789abcdefABCDEF") != std::string::npos)
      bad(path,
          fmt::format("key '{}xxh64' = '{}' is not a hex checksum (1-16 hex digits)", where, hex));
    t.xxh64 = std::stoull(hex, nullptr, 16);
    if (t.file != out.state_file)
      bad(path, fmt::format("key '{}file': tensor '{}' is in file '{}', expected '{}'", where,
                            t.name, t.file, out.state_file));
    if (t.offset > out.state_bytes || t.bytes > out.state_bytes - t.offset)
      bad(path, fmt::format("key '{}offset': tensor '{}' needs bytes [{}, {}+{}) but key "
                            "'state_bytes' is {}",
                            where, t.name, t.offset, t.offset, t.bytes, out.state_bytes));
    for (const CheckpointTensor& prev : out.tensors)
      if (prev.name == t.name)
        bad(path, fmt::format("key '{}name': tensor '{}' appears twice", where, t.name));
    out.tensors.push_back(std::move(t));
  }
  return out;
}

}  // namespace tiermem
