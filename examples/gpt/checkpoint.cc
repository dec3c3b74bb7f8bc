// examples/gpt/checkpoint.cc — durable checkpoints with a verified manifest (checkpoint.h).
#include "checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <sstream>

namespace tiermem::train {
namespace fs = std::filesystem;

namespace {

constexpr std::uint64_t kAlign = 4096;

std::string hex64(std::uint64_t v) { return fmt::format("{:016x}", v); }

void write_all(int fd, const std::string& path, const void* data, std::uint64_t bytes,
               std::uint64_t offset) {
  const char* p = static_cast<const char*>(data);
  std::uint64_t done = 0;
  while (done < bytes) {
    ssize_t n = ::pwrite(fd, p + done, bytes - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      throw IoError(path, offset + done, bytes - done, errno, "pwrite", "writing checkpoint");
    }
    if (n == 0) throw IoError(path, offset + done, bytes - done, 0, "pwrite", "wrote 0 bytes");
    done += static_cast<std::uint64_t>(n);
  }
}

void fsync_or_throw(int fd, const std::string& path) {
  if (::fsync(fd) != 0) throw IoError(path, 0, 0, errno, "fsync", "checkpoint");
}

void fsync_dir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw IoError(dir, 0, 0, errno, "open", "fsync of the checkpoint directory");
  int rc = ::fsync(fd);
  int e = errno;
  ::close(fd);
  if (rc != 0) throw IoError(dir, 0, 0, e, "fsync", "checkpoint directory");
}

void rename_or_throw(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0)
    throw IoError(to, 0, 0, errno, "rename", "from " + from);
}

[[noreturn]] void bad(const std::string& file, const std::string& what) {
  throw CheckpointError(fmt::format("checkpoint {}: {}", file, what));
}

template <typename T>
T get_key(const nlohmann::json& j, const char* key, const std::string& file,
          const std::string& where = {}) {
  auto it = j.find(key);
  if (it == j.end()) bad(file, fmt::format("missing key '{}{}'", where, key));
  try {
    return it->template get<T>();
  } catch (const nlohmann::json::exception& e) {
    bad(file, fmt::format("key '{}{}' has the wrong type: {}", where, key, e.what()));
  }
}

Tier tier_from_name(const std::string& s, const std::string& file) {
  if (s == "device") return Tier::kDevice;
  if (s == "host") return Tier::kHost;
  if (s == "nvme") return Tier::kNvme;
  bad(file, fmt::format("unknown tier '{}'", s));
}

}  // namespace

std::uint64_t checksum64(const void* data, std::uint64_t bytes) {
  return XXH64(data, static_cast<std::size_t>(bytes), 0);
}

CheckpointWriter::CheckpointWriter(std::string dir, int rank, int world_size, int step)
    : rank_(rank), world_size_(world_size), step_(step) {
  rank_dir_ = (fs::path(dir) / fmt::format("rank{}", rank)).string();
  std::error_code ec;
  fs::create_directories(rank_dir_, ec);
  if (ec) throw IoError(rank_dir_, 0, 0, ec.value(), "mkdir", "checkpoint directory");
  state_name_ = fmt::format("state-{:08d}.bin", step);
  tmp_path_ = (fs::path(rank_dir_) / (state_name_ + ".tmp")).string();
  fd_ = ::open(tmp_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) throw IoError(tmp_path_, 0, 0, errno, "open", "checkpoint state file");
}

CheckpointWriter::~CheckpointWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(tmp_path_.c_str());
}

void CheckpointWriter::add_tensor(const std::string& name, Tier tier, const void* data,
                                  std::uint64_t bytes, const std::string& dtype,
                                  std::vector<std::int64_t> shape) {
  CheckpointTensor t;
  t.name = name;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.bytes = bytes;
  t.tier = tier;
  t.file = state_name_;
  t.offset = offset_;
  t.xxh64 = checksum64(data, bytes);
  write_all(fd_, tmp_path_, data, bytes, offset_);
  offset_ = (offset_ + bytes + kAlign - 1) / kAlign * kAlign;
  tensors_.push_back(std::move(t));
}

std::string CheckpointWriter::commit(const nlohmann::json& meta) {
  // Pad the state file to its aligned length so every offset is inside the file.
  if (::ftruncate(fd_, static_cast<off_t>(offset_)) != 0)
    throw IoError(tmp_path_, offset_, 0, errno, "ftruncate", "checkpoint state file");
  fsync_or_throw(fd_, tmp_path_);
  ::close(fd_);
  fd_ = -1;
  const std::string state_path = (fs::path(rank_dir_) / state_name_).string();
  rename_or_throw(tmp_path_, state_path);
  committed_ = true;

  nlohmann::json m;
  m["format"] = kCheckpointFormat;
  m["version"] = kCheckpointVersion;
  m["rank"] = rank_;
  m["world_size"] = world_size_;
  m["step"] = step_;
  m["state_file"] = state_name_;
  m["state_bytes"] = offset_;
  m["meta"] = meta;
  nlohmann::json ts = nlohmann::json::array();
  for (const CheckpointTensor& t : tensors_) {
    ts.push_back({{"name", t.name},
                  {"dtype", t.dtype},
                  {"shape", t.shape},
                  {"bytes", t.bytes},
                  {"tier", std::string(tier_name(t.tier))},
                  {"file", t.file},
                  {"offset", t.offset},
                  {"xxh64", hex64(t.xxh64)}});
  }
  m["tensors"] = std::move(ts);
  const std::string text = m.dump(1) + "\n";
  const std::string manifest = (fs::path(rank_dir_) / "manifest.json").string();
  const std::string manifest_tmp = manifest + ".tmp";
  int fd = ::open(manifest_tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw IoError(manifest_tmp, 0, 0, errno, "open", "checkpoint manifest");
  try {
    write_all(fd, manifest_tmp, text.data(), text.size(), 0);
    fsync_or_throw(fd, manifest_tmp);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  rename_or_throw(manifest_tmp, manifest);
  fsync_dir(rank_dir_);
  // The new manifest is durable: older state files are garbage now.
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(rank_dir_, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("state-", 0) == 0 && name != state_name_) fs::remove(e.path(), ec);
  }
  return manifest;
}

CheckpointReader::CheckpointReader(std::string dir, int rank) {
  rank_dir_ = (fs::path(dir) / fmt::format("rank{}", rank)).string();
  manifest_path_ = (fs::path(rank_dir_) / "manifest.json").string();
  std::ifstream in(manifest_path_);
  if (!in) {
    if (!fs::exists(dir)) bad(dir, "no such directory");
    if (!fs::exists(rank_dir_))
      bad(dir, fmt::format("has no rank{} directory (was it saved with fewer ranks?)", rank));
    bad(manifest_path_, "missing manifest.json (partial checkpoint?)");
  }
  std::stringstream ss;
  ss << in.rdbuf();
  nlohmann::json m;
  try {
    m = nlohmann::json::parse(ss.str());
  } catch (const nlohmann::json::parse_error& e) {
    bad(manifest_path_, fmt::format("manifest is not valid JSON (byte {}): {}", e.byte, e.what()));
  }
  const auto format = get_key<std::string>(m, "format", manifest_path_);
  if (format != kCheckpointFormat)
    bad(manifest_path_, fmt::format("key 'format': expected '{}', found '{}'", kCheckpointFormat,
                                    format));
  const int version = get_key<int>(m, "version", manifest_path_);
  if (version != kCheckpointVersion)
    bad(manifest_path_, fmt::format("key 'version': expected {}, found {}", kCheckpointVersion,
                                    version));
  step_ = get_key<int>(m, "step", manifest_path_);
  world_size_ = get_key<int>(m, "world_size", manifest_path_);
  const int file_rank = get_key<int>(m, "rank", manifest_path_);
  if (file_rank != rank)
    bad(manifest_path_, fmt::format("key 'rank': expected {}, found {}", rank, file_rank));
  const auto state_file = get_key<std::string>(m, "state_file", manifest_path_);
  const auto state_bytes = get_key<std::uint64_t>(m, "state_bytes", manifest_path_);
  meta_ = get_key<nlohmann::json>(m, "meta", manifest_path_);
  auto tensors = get_key<nlohmann::json>(m, "tensors", manifest_path_);
  if (!tensors.is_array()) bad(manifest_path_, "key 'tensors' is not an array");

  state_path_ = (fs::path(rank_dir_) / state_file).string();
  fd_ = ::open(state_path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) {
    bad(state_path_, errno_message("state file named by the manifest cannot be opened", errno));
  }
  struct stat st {};
  if (::fstat(fd_, &st) != 0) bad(state_path_, errno_message("cannot stat", errno));
  const auto found = static_cast<std::uint64_t>(st.st_size);
  if (found != state_bytes) {
    bad(state_path_, fmt::format("size mismatch: the manifest expects {} bytes, the file has {} "
                                 "(truncated or partial checkpoint)",
                                 state_bytes, found));
  }
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const nlohmann::json& j = tensors[i];
    const std::string where = fmt::format("tensors[{}].", i);
    CheckpointTensor t;
    t.name = get_key<std::string>(j, "name", manifest_path_, where);
    t.dtype = get_key<std::string>(j, "dtype", manifest_path_, where);
    t.shape = get_key<std::vector<std::int64_t>>(j, "shape", manifest_path_, where);
    t.bytes = get_key<std::uint64_t>(j, "bytes", manifest_path_, where);
    t.tier = tier_from_name(get_key<std::string>(j, "tier", manifest_path_, where),
                            manifest_path_);
    t.file = get_key<std::string>(j, "file", manifest_path_, where);
    t.offset = get_key<std::uint64_t>(j, "offset", manifest_path_, where);
    const auto hex = get_key<std::string>(j, "xxh64", manifest_path_, where);
    try {
      std::size_t pos = 0;
      t.xxh64 = std::stoull(hex, &pos, 16);
      if (pos != hex.size()) throw std::invalid_argument(hex);
    } catch (const std::exception&) {
      bad(manifest_path_, fmt::format("key '{}xxh64' = '{}' is not a hex checksum", where, hex));
    }
    if (t.file != state_file)
      bad(manifest_path_, fmt::format("tensor '{}' is in file '{}', expected '{}'", t.name,
                                      t.file, state_file));
    if (t.offset + t.bytes > found)
      bad(state_path_, fmt::format("tensor '{}' needs bytes [{}, {}) but the file has {} bytes",
                                   t.name, t.offset, t.offset + t.bytes, found));
    tensors_.push_back(std::move(t));
  }
}

CheckpointReader::~CheckpointReader() {
  if (fd_ >= 0) ::close(fd_);
}

bool CheckpointReader::has(const std::string& name) const {
  for (const auto& t : tensors_)
    if (t.name == name) return true;
  return false;
}

const CheckpointTensor& CheckpointReader::find(const std::string& name) const {
  for (const auto& t : tensors_)
    if (t.name == name) return t;
  bad(manifest_path_, fmt::format("no tensor named '{}' (the model or configuration differs from "
                                  "the saved run?)",
                                  name));
}

void CheckpointReader::read_tensor(const std::string& name, void* dst, std::uint64_t bytes) {
  const CheckpointTensor& t = find(name);
  if (t.bytes != bytes)
    bad(manifest_path_, fmt::format("tensor '{}': expected {} bytes, the checkpoint has {}", name,
                                    bytes, t.bytes));
  char* p = static_cast<char*>(dst);
  std::uint64_t done = 0;
  while (done < bytes) {
    ssize_t n = ::pread(fd_, p + done, bytes - done, static_cast<off_t>(t.offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      throw IoError(state_path_, t.offset + done, bytes - done, errno, "pread", "checkpoint");
    }
    if (n == 0)
      bad(state_path_, fmt::format("tensor '{}': unexpected end of file at offset {}", name,
                                   t.offset + done));
    done += static_cast<std::uint64_t>(n);
  }
  const std::uint64_t found = checksum64(dst, bytes);
  if (found != t.xxh64)
    bad(state_path_, fmt::format("tensor '{}' (offset {}, {} bytes): checksum mismatch: "
                                 "manifest xxh64 {}, data has {}",
                                 name, t.offset, bytes, hex64(t.xxh64), hex64(found)));
}

}  // namespace tiermem::train
