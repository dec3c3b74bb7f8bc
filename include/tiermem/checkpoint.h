// tiermem/checkpoint.h — one rank's checkpoint: a JSON manifest plus one state file, written
// durably, verified by xxHash64 on load. The format tiermem-train (src/train) and tiermem.torch
// (python/src/train_state.cc: _tiermem.CheckpointWriter / CheckpointReader) both write and read;
// the library is tiermem::train_state (src/train/checkpoint.cc, checkpoint_manifest.cc).
//
// Units: every size and offset is in BYTES (std::uint64_t), a step is an optimizer step count.
// Ownership: the caller's buffers are only read (add_tensor, write_part) or written (read_tensor,
// read_part) during the call; writer and reader own their file descriptors and close them in
// their destructors (which never throw).
//
// Layout of `--save DIR` (one subdirectory per rank, so ranks never write the same file):
//   DIR/rank<r>/manifest.json         the manifest (the commit point)
//   DIR/rank<r>/state-<step>.bin      the tensors, each at an offset aligned to 4 KiB
// manifest.json:
//   {"format":"tiermem-train-checkpoint","version":1,"rank":r,"world_size":R,"step":N,
//    "meta":{ model config, effective config, seed, data position, RNG state, ... },
//    "tensors":[{"name","dtype","shape","bytes","tier","file","offset","xxh64"}, ...]}
//   where "tier" is the tier the tensor lived in during training (device/host/nvme) and
//   "file"/"offset" its location in the checkpoint; xxh64 is the XXH64 (seed 0) of its bytes,
//   as 16 hex digits.
// Durability: the state file is written to "<name>.tmp", fsynced and renamed; then the manifest
// the same way; then the directory is fsynced. A crash at any point leaves either the previous
// checkpoint (old manifest + its state file, which is deleted only after the new manifest is in
// place) or the new one — never a manifest that names missing data.
// Permissions: files are created 0666 and directories 0777, less the user's umask (as torch.save
// does; umask 077 makes checkpoints private); temporary files are opened with O_NOFOLLOW (a
// symlink planted at their name is an IoError, ELOOP, never followed); a rank directory owned by
// another user or world-writable without the sticky bit is refused (IoError naming it and why).
//
// Errors: CheckpointError (a tiermem::Error) naming the file and what is wrong: a missing or
// unparsable manifest, a missing key (with its name), a state file shorter than the manifest says
// (expected vs found bytes), a checksum mismatch (tensor name, expected vs found), a tensor of
// another size than the program expects. I/O failures while writing are IoError (path, offset).
//
// Thread-safety: a writer or reader object is used by one thread at a time; different objects
// (other ranks, other directories) are independent. parse_manifest and checksum64 are pure and
// reentrant. One writer per rank directory at a time (remove_stale_checkpoint_files too).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tiermem/error.h"
#include "tiermem/export.h"
#include "tiermem/tier.h"

namespace tiermem {

class TIERMEM_API CheckpointError : public Error {
 public:
  explicit CheckpointError(const std::string& message) : Error(message) {}
};

inline constexpr const char* kCheckpointFormat = "tiermem-train-checkpoint";
inline constexpr int kCheckpointVersion = 1;

// XXH64 (seed 0) of `bytes` bytes at `data`.
TIERMEM_API std::uint64_t checksum64(const void* data, std::uint64_t bytes);

struct TIERMEM_API CheckpointTensor {
  std::string name;
  std::string dtype;               // "f32", "bf16", ...
  std::vector<std::int64_t> shape;
  std::uint64_t bytes = 0;
  Tier tier = Tier::kHost;         // where it lived while training
  std::string file;                // relative to the rank directory
  std::uint64_t offset = 0;        // bytes into `file`
  std::uint64_t xxh64 = 0;
};

// A parsed, validated manifest.json (see the layout above).
struct TIERMEM_API CheckpointManifest {
  int rank = 0, world_size = 1, step = 0;
  std::string state_file;          // a plain file name inside the rank directory
  std::uint64_t state_bytes = 0;   // the state file's exact size
  nlohmann::json meta;             // an object
  std::vector<CheckpointTensor> tensors;  // unique names, each inside [0, state_bytes)
};

// Parses the text of a manifest without touching any file: JSON syntax, format, version, every
// required key with its type and range (rank < world_size, non-negative integers, known tiers,
// hex checksums, each tensor inside state_bytes without overflow, no duplicate names). `path`
// only names the file in messages. Throws CheckpointError naming the key and the value found;
// never anything else for any input. Pure and reentrant.
TIERMEM_API CheckpointManifest parse_manifest(const std::string& text, const std::string& path);

// Writes one rank's checkpoint. Tensors are streamed to the temporary state file as they are
// added (the caller's buffer is only read during add_tensor). commit() makes it durable.
class TIERMEM_API CheckpointWriter {
 public:
  // Creates DIR/rank<rank>/ (and DIR) if needed. Throws IoError.
  CheckpointWriter(std::string dir, int rank, int world_size, int step);
  ~CheckpointWriter();  // an uncommitted checkpoint's temporary file is removed
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  void add_tensor(const std::string& name, Tier tier, const void* data, std::uint64_t bytes,
                  const std::string& dtype = "f32", std::vector<std::int64_t> shape = {});

  // A tensor written in parts, for state too large to hold in memory at once: begin_tensor
  // reserves `bytes` bytes for it in the state file and returns its handle; write_part appends
  // the next part (in order; several streamed tensors may be open at once and interleave). The
  // checksum is computed as the parts go by. commit() throws CheckpointError if a streamed
  // tensor did not get exactly its `bytes`; write_part throws CheckpointError past the end.
  int begin_tensor(const std::string& name, Tier tier, std::uint64_t bytes,
                   const std::string& dtype = "f32", std::vector<std::int64_t> shape = {});
  void write_part(int handle, const void* data, std::uint64_t bytes);
  // Writes the manifest with `meta`, fsyncs, renames, fsyncs the directory, then removes older
  // state files of this rank. Returns the manifest path.
  std::string commit(const nlohmann::json& meta);

 private:
  std::string rank_dir_, state_name_, tmp_path_;
  int rank_, world_size_, step_;
  int fd_ = -1;
  std::uint64_t offset_ = 0;
  bool committed_ = false;
  std::vector<CheckpointTensor> tensors_;
  struct Stream {
    std::size_t tensor = 0;      // index into tensors_
    std::uint64_t written = 0;   // bytes so far
    std::shared_ptr<void> hash;  // XXH64_state_t, owned
  };
  std::vector<Stream> streams_;
};

// Deletes what crashed writers left in DIR/rank<rank>: state files (and temporaries) the current
// manifest does not name, and manifest.json.tmp. Does nothing when there is no manifest or it
// does not parse (nothing is deleted on doubt). Call before writing into DIR; one writer per
// rank directory at a time. Returns the number of files removed.
TIERMEM_API int remove_stale_checkpoint_files(const std::string& dir, int rank);

// Reads one rank's checkpoint. The constructor parses and validates the manifest (format,
// version, required keys, every tensor inside the state file's size); tensors are read and
// checksum-verified by read_tensor.
class TIERMEM_API CheckpointReader {
 public:
  CheckpointReader(std::string dir, int rank);
  ~CheckpointReader();
  CheckpointReader(const CheckpointReader&) = delete;
  CheckpointReader& operator=(const CheckpointReader&) = delete;

  int step() const { return step_; }
  int world_size() const { return world_size_; }
  const nlohmann::json& meta() const { return meta_; }
  const std::string& manifest_path() const { return manifest_path_; }
  const std::string& dir() const { return dir_; }  // the checkpoint directory (holds rank<r>/)
  const std::vector<CheckpointTensor>& tensors() const { return tensors_; }
  bool has(const std::string& name) const;

  // Reads tensor `name` into dst (exactly `bytes` bytes, which must equal the manifest's) and
  // verifies its checksum. Throws CheckpointError.
  void read_tensor(const std::string& name, void* dst, std::uint64_t bytes);

  // For tensors too large to read at once: verify_tensor checks that tensor `name` has exactly
  // `bytes` bytes and that its checksum matches, reading it in bounded chunks (no tensor-sized
  // buffer); read_part then reads `bytes` bytes at `offset` into the tensor (no checksum: verify
  // first). Both throw CheckpointError (missing tensor, wrong size, range outside the tensor,
  // checksum mismatch, short file) or IoError.
  void verify_tensor(const std::string& name, std::uint64_t bytes);
  void read_part(const std::string& name, std::uint64_t offset, void* dst, std::uint64_t bytes);

 private:
  const CheckpointTensor& find(const std::string& name) const;
  // Throws CheckpointError naming the tensor when `found` is not its manifest checksum.
  void check_checksum(const CheckpointTensor& t, std::uint64_t found) const;
  std::string dir_, rank_dir_, manifest_path_, state_path_;
  int fd_ = -1;
  int step_ = 0, world_size_ = 1;
  nlohmann::json meta_;
  std::vector<CheckpointTensor> tensors_;
};

}  // namespace tiermem
