// src/train/checkpoint.cc — durable checkpoints with a verified manifest (tiermem/checkpoint.h).
#include "tiermem/checkpoint.h"
#include "train/kill_point.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <sstream>

#include "tiermem/dir_lock.h"

namespace tiermem {
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

// Opens a temporary file for writing (created, or truncated when a crashed writer left it):
// mode 0666 less the umask, as torch.save and every other tool's output; never through a
// symlink planted at its name (O_NOFOLLOW: IoError ELOOP naming the path).
int open_new_file(const std::string& path, const char* what) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0666);
  if (fd < 0) {
    const int err = errno;
    throw IoError(path, 0, 0, err, "open",
                  err == ELOOP ? std::string(what) + ": a symbolic link is in its place; tiermem "
                                                     "does not follow it (remove it if it is yours)"
                               : std::string(what));
  }
  return fd;
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
  if (const std::string why = unsafe_directory_reason(rank_dir_); !why.empty())
    throw IoError(rank_dir_, 0, 0, EPERM, "mkdir", "checkpoint directory is refused: " + why);
  state_name_ = fmt::format("state-{:08d}.bin", step);
  // Never overwrite an existing state file: the current manifest may name it (a run resumed from
  // an older checkpoint saving the same step into this directory), and a crash between that
  // rename and the manifest's would leave the manifest naming data it did not checksum.
  for (int k = 1; fs::exists(fs::path(rank_dir_) / state_name_); ++k)
    state_name_ = fmt::format("state-{:08d}-{}.bin", step, k);
  tmp_path_ = (fs::path(rank_dir_) / (state_name_ + ".tmp")).string();
  fd_ = open_new_file(tmp_path_, "checkpoint state file");
}

CheckpointWriter::~CheckpointWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(tmp_path_.c_str());
}

void CheckpointWriter::add_tensor(const std::string& name, Tier tier, const void* data,
                                  std::uint64_t bytes, const std::string& dtype,
                                  std::vector<std::int64_t> shape) {
  write_part(begin_tensor(name, tier, bytes, dtype, std::move(shape)), data, bytes);  // one part
}

int CheckpointWriter::begin_tensor(const std::string& name, Tier tier, std::uint64_t bytes,
                                   const std::string& dtype, std::vector<std::int64_t> shape) {
  CheckpointTensor t;
  t.name = name;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.bytes = bytes;
  t.tier = tier;
  t.file = state_name_;
  t.offset = offset_;
  offset_ = (offset_ + bytes + kAlign - 1) / kAlign * kAlign;
  tensors_.push_back(std::move(t));
  Stream s;
  s.tensor = tensors_.size() - 1;
  s.hash = std::shared_ptr<void>(XXH64_createState(), [](void* p) {
    XXH64_freeState(static_cast<XXH64_state_t*>(p));
  });
  if (!s.hash) throw std::bad_alloc();
  XXH64_reset(static_cast<XXH64_state_t*>(s.hash.get()), 0);
  streams_.push_back(std::move(s));
  return static_cast<int>(streams_.size() - 1);
}

void CheckpointWriter::write_part(int handle, const void* data, std::uint64_t bytes) {
  if (handle < 0 || static_cast<std::size_t>(handle) >= streams_.size())
    throw CheckpointError(fmt::format("checkpoint writer: no streamed tensor {}", handle));
  Stream& s = streams_[static_cast<std::size_t>(handle)];
  CheckpointTensor& t = tensors_[s.tensor];
  if (s.written + bytes > t.bytes)
    throw CheckpointError(fmt::format("checkpoint {}: tensor '{}': a part of {} bytes at {} runs "
                                      "past its {} bytes", tmp_path_, t.name, bytes, s.written,
                                      t.bytes));
  XXH64_update(static_cast<XXH64_state_t*>(s.hash.get()), data, static_cast<std::size_t>(bytes));
  write_all(fd_, tmp_path_, data, bytes, t.offset + s.written);
  s.written += bytes;
  if (s.written == t.bytes) {
    t.xxh64 = XXH64_digest(static_cast<XXH64_state_t*>(s.hash.get()));
    train::kill_point("ckpt-tensor");  // TEST-ONLY (kill_point.h)
  }
}

std::string CheckpointWriter::commit(const nlohmann::json& meta) {
  for (const Stream& s : streams_) {
    const CheckpointTensor& t = tensors_[s.tensor];
    if (s.written != t.bytes)
      throw CheckpointError(fmt::format("checkpoint {}: tensor '{}' got {} of its {} bytes",
                                        tmp_path_, t.name, s.written, t.bytes));
  }
  // Pad the state file to its aligned length so every offset is inside the file.
  if (::ftruncate(fd_, static_cast<off_t>(offset_)) != 0)
    throw IoError(tmp_path_, offset_, 0, errno, "ftruncate", "checkpoint state file");
  fsync_or_throw(fd_, tmp_path_);
  ::close(fd_);
  fd_ = -1;
  const std::string state_path = (fs::path(rank_dir_) / state_name_).string();
  rename_or_throw(tmp_path_, state_path);
  committed_ = true;
  // The state file's name must be durable before a manifest naming it can be.
  fsync_dir(rank_dir_);
  train::kill_point("ckpt-state");  // TEST-ONLY (kill_point.h)

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
  int fd = open_new_file(manifest_tmp, "checkpoint manifest");
  try {
    write_all(fd, manifest_tmp, text.data(), text.size(), 0);
    fsync_or_throw(fd, manifest_tmp);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  train::kill_point("ckpt-manifest");  // TEST-ONLY (kill_point.h)
  rename_or_throw(manifest_tmp, manifest);
  fsync_dir(rank_dir_);
  train::kill_point("ckpt-gc");  // TEST-ONLY (kill_point.h)
  // The new manifest is durable: older state files are garbage now.
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(rank_dir_, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("state-", 0) == 0 && name != state_name_) fs::remove(e.path(), ec);
  }
  return manifest;
}

int remove_stale_checkpoint_files(const std::string& dir, int rank) {
  const fs::path rank_dir = fs::path(dir) / fmt::format("rank{}", rank);
  std::ifstream in(rank_dir / "manifest.json");
  if (!in) return 0;
  std::stringstream ss;
  ss << in.rdbuf();
  std::string keep;
  try {
    keep = parse_manifest(ss.str(), (rank_dir / "manifest.json").string()).state_file;
  } catch (const CheckpointError&) {
    return 0;
  }
  int removed = 0;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(rank_dir, ec)) {
    const std::string name = e.path().filename().string();
    if ((name.rfind("state-", 0) == 0 && name != keep) || name == "manifest.json.tmp") {
      if (fs::remove(e.path(), ec)) ++removed;
    }
  }
  return removed;
}

CheckpointReader::CheckpointReader(std::string dir, int rank) : dir_(dir) {
  rank_dir_ = (fs::path(dir) / fmt::format("rank{}", rank)).string();
  manifest_path_ = (fs::path(rank_dir_) / "manifest.json").string();
  std::ifstream in(manifest_path_);
  if (!in) {
    if (!fs::exists(dir)) bad(dir, "no such directory");
    if (!fs::exists(rank_dir_) && rank == 0)
      bad(dir, "is not a checkpoint: it has no rank0/manifest.json (give the directory a save wrote)");
    if (!fs::exists(rank_dir_))
      bad(dir, fmt::format("has no rank{} directory (was it saved with fewer ranks?)", rank));
    bad(manifest_path_, "missing manifest.json (partial checkpoint?)");
  }
  std::stringstream ss;
  ss << in.rdbuf();
  CheckpointManifest m = parse_manifest(ss.str(), manifest_path_);
  if (m.rank != rank)
    bad(manifest_path_, fmt::format("key 'rank': expected {}, found {}", rank, m.rank));
  step_ = m.step;
  world_size_ = m.world_size;
  meta_ = std::move(m.meta);

  state_path_ = (fs::path(rank_dir_) / m.state_file).string();
  fd_ = ::open(state_path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) {
    bad(state_path_, errno_message("state file named by the manifest cannot be opened", errno));
  }
  struct stat st {};
  if (::fstat(fd_, &st) != 0) bad(state_path_, errno_message("cannot stat", errno));
  const auto found = static_cast<std::uint64_t>(st.st_size);
  if (found != m.state_bytes) {
    bad(state_path_, fmt::format("size mismatch: the manifest expects {} bytes, the file has {} "
                                 "(truncated or partial checkpoint)",
                                 m.state_bytes, found));
  }
  // parse_manifest checked every tensor lies inside state_bytes, which is the file's size.
  tensors_ = std::move(m.tensors);
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
  read_part(name, 0, dst, bytes);
  check_checksum(t, checksum64(dst, bytes));
}

void CheckpointReader::check_checksum(const CheckpointTensor& t, std::uint64_t found) const {
  if (found != t.xxh64)
    bad(state_path_, fmt::format("tensor '{}' (offset {}, {} bytes): checksum mismatch: "
                                 "manifest xxh64 {}, data has {}",
                                 t.name, t.offset, t.bytes, hex64(t.xxh64), hex64(found)));
}

void CheckpointReader::read_part(const std::string& name, std::uint64_t offset, void* dst,
                                 std::uint64_t bytes) {
  const CheckpointTensor& t = find(name);
  if (offset > t.bytes || bytes > t.bytes - offset)
    bad(manifest_path_, fmt::format("tensor '{}' has {} bytes: cannot read {} at offset {}", name,
                                    t.bytes, bytes, offset));
  char* p = static_cast<char*>(dst);
  std::uint64_t done = 0;
  while (done < bytes) {
    const std::uint64_t at = t.offset + offset + done;
    ssize_t n = ::pread(fd_, p + done, bytes - done, static_cast<off_t>(at));
    if (n < 0) {
      if (errno == EINTR) continue;
      throw IoError(state_path_, at, bytes - done, errno, "pread", "checkpoint");
    }
    if (n == 0)
      bad(state_path_, fmt::format("tensor '{}': unexpected end of file at offset {}", name, at));
    done += static_cast<std::uint64_t>(n);
  }
}

void CheckpointReader::verify_tensor(const std::string& name, std::uint64_t bytes) {
  const CheckpointTensor& t = find(name);
  if (t.bytes != bytes)
    bad(manifest_path_, fmt::format("tensor '{}': expected {} bytes, the checkpoint has {}", name,
                                    bytes, t.bytes));
  constexpr std::uint64_t kChunk = 8u << 20;
  std::vector<char> buf(static_cast<std::size_t>(std::min(kChunk, bytes)));
  std::unique_ptr<XXH64_state_t, XXH_errorcode (*)(XXH64_state_t*)> h(XXH64_createState(),
                                                                       XXH64_freeState);
  if (!h) throw std::bad_alloc();
  XXH64_reset(h.get(), 0);
  for (std::uint64_t off = 0; off < bytes; off += kChunk) {
    const std::uint64_t n = std::min(kChunk, bytes - off);
    read_part(name, off, buf.data(), n);
    XXH64_update(h.get(), buf.data(), static_cast<std::size_t>(n));
  }
  check_checksum(t, XXH64_digest(h.get()));
}

}  // namespace tiermem
