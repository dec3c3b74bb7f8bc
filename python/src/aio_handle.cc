// python/src/aio_handle.cc — tiermem.aio_handle: DeepSpeed's aio_handle interface over tiermem's
// IoEngine (io_uring with fixed files and registered buffers; a pread/pwrite pool when no ring).
//
// Semantics (the Python docstring in tiermem/__init__.py repeats them for users):
//   - Every call names a whole file by path; the handle opens it for the call (O_DIRECT unless the
//     filesystem refuses it, e.g. tmpfs: then buffered, once per handle noted in
//     get_buffered_fallbacks()) and closes it when the operation is reaped by wait().
//   - A read transfers buffer.nbytes bytes from `file_offset`; the file must hold them
//     (ValueError naming 'buffer' otherwise). A write creates the file when missing and writes
//     buffer.nbytes bytes at `file_offset`; the file is not truncated, and when O_DIRECT padding
//     (lengths are padded to 4096 with zeros) grew it past max(old size, file_offset + nbytes) it
//     is cut back to that when the write is reaped.
//   - file_offset must be >= 0, and a multiple of 4096 for O_DIRECT files (ValueError naming
//     'file_offset'). Buffers may have any address; unaligned ones go through a bounce copy.
//   - async_* return 0 at once; wait() blocks until every pending operation is complete, reaps
//     them all and returns how many there were (0 at once when none). The first failure among
//     them is raised by wait() as tiermem.IoError (after all have completed). sync_* and
//     pread/pwrite(async=False) submit and then wait(), returning wait()'s count (as DeepSpeed).
//   - validate=True re-reads the file range after the transfer with plain pread and compares it
//     with the buffer; a mismatch raises tiermem.IoError (errno 0).
//
// Buffers must stay alive and untouched until wait() reaped their operation; the handle keeps a
// reference to each buffer object until then, so dropping it early is safe.
//
// Thread-safety: several Python threads may share a handle: submissions are serialised by an
// internal mutex; wait() takes every op pending when it starts (a concurrent wait() reaps only
// later ones) and releases the GIL while it blocks. The destructor waits for pending operations (errors dropped,
// and the O_DIRECT padding of their unaligned writes is not cut back: call wait() first).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include <nanobind/stl/string.h>

#include "bindings.h"
#include "tiermem/error.h"
#include "tiermem/io_engine.h"

namespace tiermem::py {
namespace {

class AioHandle {
 public:
  AioHandle(std::int64_t block_size, std::int64_t queue_depth, bool single_submit,
            bool overlap_events, std::int64_t intra_op_parallelism)
      : block_size_(block_size),
        queue_depth_(queue_depth),
        single_submit_(single_submit),
        overlap_events_(overlap_events),
        intra_op_parallelism_(intra_op_parallelism) {
    if (block_size <= 0 || block_size % static_cast<std::int64_t>(kDirectAlignment) != 0)
      throw nb::value_error(str_printf("aio_handle: argument 'block_size' must be a positive "
                                       "multiple of 4096 bytes, got %lld",
                                       static_cast<long long>(block_size)).c_str());
    if (queue_depth <= 0 || queue_depth > 4096)
      throw nb::value_error(str_printf("aio_handle: argument 'queue_depth' must be in [1, 4096], "
                                       "got %lld", static_cast<long long>(queue_depth)).c_str());
    if (intra_op_parallelism <= 0 || intra_op_parallelism > 64)
      throw nb::value_error(str_printf("aio_handle: argument 'intra_op_parallelism' must be in "
                                       "[1, 64], got %lld",
                                       static_cast<long long>(intra_op_parallelism)).c_str());
    direct_ = make_io_engine(options(/*o_direct=*/true));
  }

  ~AioHandle() {
    // Never throw, never leave I/O into buffers that are about to be released.
    for (auto& p : pending_) {
      try {
        p.request.wait();
      } catch (...) {
      }
      p.engine->close_file(p.file);
    }
  }

  std::int64_t get_block_size() const { return block_size_; }
  std::int64_t get_queue_depth() const { return queue_depth_; }
  bool get_single_submit() const { return single_submit_; }
  bool get_overlap_events() const { return overlap_events_; }
  std::int64_t get_intra_op_parallelism() const { return intra_op_parallelism_; }
  std::string get_engine() const { return direct_->name(); }
  std::int64_t get_buffered_fallbacks() const { return buffered_fallbacks_; }
  std::int64_t get_pending() const { return static_cast<std::int64_t>(pending_.size()); }

  // Starts one operation; `fn` names the Python method for messages.
  void submit(const char* fn, nb::handle buffer, const std::string& path, std::int64_t file_offset,
              bool is_write, bool validate) {
    ArrayView v = view_array(buffer, fn, "buffer", /*writable=*/!is_write);
    if (path.empty())
      throw nb::value_error(str_printf("%s: argument 'filename' is empty", fn).c_str());
    if (file_offset < 0)
      throw nb::value_error(str_printf("%s: argument 'file_offset' must be >= 0, got %lld", fn,
                                       static_cast<long long>(file_offset)).c_str());
    std::lock_guard<std::mutex> lock(mu_);
    auto [engine, file] = open(path, is_write);
    auto offset = static_cast<std::uint64_t>(file_offset);
    try {
      if (engine == direct_.get() && offset % kDirectAlignment != 0)
        throw nb::value_error(str_printf("%s: argument 'file_offset' (%llu) must be a multiple of "
                                         "4096 bytes: '%s' is opened with O_DIRECT",
                                         fn, static_cast<unsigned long long>(offset),
                                         path.c_str()).c_str());
      std::uint64_t size = engine->file_size(file);
      Pending p;
      p.engine = engine;
      p.file = file;
      p.keep = nb::borrow(buffer);
      p.path = path;
      p.offset = offset;
      p.bytes = v.nbytes;
      p.data = v.data;
      p.is_write = is_write;
      p.validate = validate;
      if (!is_write && offset + v.nbytes > size)
        throw nb::value_error(str_printf("%s: argument 'buffer' is %llu bytes but '%s' has only "
                                         "%llu bytes from offset %llu",
                                         fn, static_cast<unsigned long long>(v.nbytes),
                                         path.c_str(),
                                         static_cast<unsigned long long>(size > offset ? size - offset : 0),
                                         static_cast<unsigned long long>(offset)).c_str());
      if (is_write) p.keep_size = std::max(size, offset + v.nbytes);
      if (v.nbytes > 0) {
        p.request = is_write ? engine->submit_write(file, offset, v.nbytes, v.data)
                             : engine->submit_read(file, offset, v.nbytes, v.data);
      }
      pending_.push_back(std::move(p));
    } catch (...) {
      engine->close_file(file);
      throw;
    }
  }

  // Waits for every pending operation; returns how many; raises the first failure.
  std::int64_t wait() {
    std::vector<Pending> batch;
    {
      std::lock_guard<std::mutex> lock(mu_);
      batch.swap(pending_);
    }
    if (batch.empty()) return 0;
    std::exception_ptr first;
    {
      nb::gil_scoped_release release;
      for (auto& p : batch) {
        try {
          p.request.wait();
        } catch (...) {
          if (!first) first = std::current_exception();
          p.failed = true;
        }
      }
    }
    // Padded O_DIRECT writes: cut each file back to the largest size one of its writes asked for.
    std::map<std::string, std::uint64_t> keep;
    for (auto& p : batch)
      if (p.is_write && !p.failed) keep[p.path] = std::max(keep[p.path], p.keep_size);
    for (auto& p : batch) {
      auto it = keep.find(p.path);
      if (it == keep.end()) continue;
      try {
        if (p.engine->file_size(p.file) > it->second && ftruncate_path(p.path, it->second) != 0)
          throw IoError(p.path, it->second, 0, errno, "truncate");
      } catch (...) {  // every file is still closed below
        if (!first) first = std::current_exception();
      }
      keep.erase(it);
    }
    for (auto& p : batch) {
      if (p.validate && !p.failed && !first) first = check(p);
      p.engine->close_file(p.file);
    }
    std::int64_t n = static_cast<std::int64_t>(batch.size());
    batch.clear();  // drops the buffer references (GIL held)
    if (first) std::rethrow_exception(first);
    return n;
  }

 private:
  struct Pending {
    IoEngine* engine = nullptr;
    IoFile file;
    IoRequest request;  // invalid (complete) for 0-byte operations
    nb::object keep;    // the buffer, alive until reaped
    std::string path;
    std::uint64_t offset = 0, bytes = 0, keep_size = 0;
    void* data = nullptr;
    bool is_write = false, validate = false, failed = false;
  };

  static int ftruncate_path(const std::string& path, std::uint64_t size) {
    return ::truncate(path.c_str(), static_cast<off_t>(size));
  }

  IoEngineOptions options(bool o_direct) const {
    IoEngineOptions o;
    o.block_size_bytes = static_cast<std::uint64_t>(block_size_);
    o.queue_depth = static_cast<int>(queue_depth_);
    o.rings = static_cast<int>(intra_op_parallelism_);
    o.single_submit = single_submit_;
    o.o_direct = o_direct;
    return o;
  }

  // Opens `path` with O_DIRECT, or buffered when the filesystem refuses O_DIRECT (EINVAL).
  std::pair<IoEngine*, IoFile> open(const std::string& path, bool create) {
    try {
      return {direct_.get(), direct_->open_file(path, create)};
    } catch (const IoError& e) {
      if (e.err() != EINVAL) throw;
    }
    if (!buffered_) buffered_ = make_io_engine(options(/*o_direct=*/false));
    ++buffered_fallbacks_;
    return {buffered_.get(), buffered_->open_file(path, create)};
  }

  // validate=True: compares the file range with the buffer through a plain pread.
  static std::exception_ptr check(const Pending& p) {
    int fd = ::open(p.path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return std::make_exception_ptr(IoError(p.path, p.offset, p.bytes, errno, "validate"));
    std::vector<char> got(p.bytes);
    std::uint64_t done = 0;
    int err = 0;
    while (done < p.bytes) {
      ssize_t r = ::pread(fd, got.data() + done, p.bytes - done, static_cast<off_t>(p.offset + done));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) {
        err = r < 0 ? errno : 0;
        break;
      }
      done += static_cast<std::uint64_t>(r);
    }
    ::close(fd);
    if (done < p.bytes)
      return std::make_exception_ptr(IoError(p.path, p.offset + done, p.bytes - done, err,
                                             "validate", "could not re-read the range"));
    if (std::memcmp(got.data(), p.data, p.bytes) != 0)
      return std::make_exception_ptr(IoError(p.path, p.offset, p.bytes, 0, "validate",
                                             "file contents differ from the buffer"));
    return nullptr;
  }

  std::int64_t block_size_, queue_depth_;
  bool single_submit_, overlap_events_;
  std::int64_t intra_op_parallelism_;
  std::unique_ptr<IoEngine> direct_;
  std::unique_ptr<IoEngine> buffered_;  // made on the first O_DIRECT refusal
  std::int64_t buffered_fallbacks_ = 0;
  std::mutex mu_;  // guards pending_ and the engines' lazily made members
  std::vector<Pending> pending_;
};

// DeepSpeed's new_cpu_locked_tensor is implemented in Python (tiermem/__init__.py) over
// new_locked_array, so that the extension never needs torch.

}  // namespace

void bind_aio_handle(nb::module_& m) {
  nb::class_<AioHandle>(m, "_AioHandle")
      .def(nb::init<std::int64_t, std::int64_t, bool, bool, std::int64_t>(),
           nb::arg("block_size") = 1 << 20, nb::arg("queue_depth") = 128,
           nb::arg("single_submit") = false, nb::arg("overlap_events") = true,
           nb::arg("intra_op_parallelism") = 1)
      .def("get_block_size", &AioHandle::get_block_size)
      .def("get_queue_depth", &AioHandle::get_queue_depth)
      .def("get_single_submit", &AioHandle::get_single_submit)
      .def("get_overlap_events", &AioHandle::get_overlap_events)
      .def("get_intra_op_parallelism", &AioHandle::get_intra_op_parallelism)
      .def("get_engine", &AioHandle::get_engine)
      .def("get_buffered_fallbacks", &AioHandle::get_buffered_fallbacks)
      .def("get_pending", &AioHandle::get_pending)
      .def(
          "async_pread",
          [](AioHandle& h, nb::handle buffer, const std::string& filename, std::int64_t file_offset) {
            h.submit("async_pread", buffer, filename, file_offset, false, false);
            return 0;
          },
          nb::arg("buffer").none(), nb::arg("filename"), nb::arg("file_offset") = 0,
          "Starts reading buffer.nbytes bytes of `filename` from `file_offset` into `buffer`; "
          "returns 0 at once. wait() completes it.")
      .def(
          "async_pwrite",
          [](AioHandle& h, nb::handle buffer, const std::string& filename, std::int64_t file_offset) {
            h.submit("async_pwrite", buffer, filename, file_offset, true, false);
            return 0;
          },
          nb::arg("buffer").none(), nb::arg("filename"), nb::arg("file_offset") = 0,
          "Starts writing `buffer` to `filename` at `file_offset` (created when missing); returns 0 "
          "at once. wait() completes it.")
      .def(
          "sync_pread",
          [](AioHandle& h, nb::handle buffer, const std::string& filename, std::int64_t file_offset) {
            h.submit("sync_pread", buffer, filename, file_offset, false, false);
            return h.wait();
          },
          nb::arg("buffer").none(), nb::arg("filename"), nb::arg("file_offset") = 0,
          "Reads and waits; returns wait()'s count (this op and any still pending).")
      .def(
          "sync_pwrite",
          [](AioHandle& h, nb::handle buffer, const std::string& filename, std::int64_t file_offset) {
            h.submit("sync_pwrite", buffer, filename, file_offset, true, false);
            return h.wait();
          },
          nb::arg("buffer").none(), nb::arg("filename"), nb::arg("file_offset") = 0,
          "Writes and waits; returns wait()'s count (this op and any still pending).")
      .def(
          "pread",
          [](AioHandle& h, nb::handle buffer, const std::string& filename, bool validate,
             bool async, std::int64_t file_offset) -> std::int64_t {
            h.submit("pread", buffer, filename, file_offset, false, validate);
            return async ? 0 : h.wait();
          },
          nb::arg("buffer").none(), nb::arg("filename"), nb::arg("validate"), nb::arg("async"),
          nb::arg("file_offset") = 0,
          "Reads; async=True returns 0 at once, else waits and returns wait()'s count. validate "
          "re-reads the range with pread and compares when the op is reaped.")
      .def(
          "pwrite",
          [](AioHandle& h, nb::handle buffer, const std::string& filename, bool validate,
             bool async, std::int64_t file_offset) -> std::int64_t {
            h.submit("pwrite", buffer, filename, file_offset, true, validate);
            return async ? 0 : h.wait();
          },
          nb::arg("buffer").none(), nb::arg("filename"), nb::arg("validate"), nb::arg("async"),
          nb::arg("file_offset") = 0, "Writes; as pread.")
      .def(
          "read",
          [](AioHandle& h, nb::handle buffer, const std::string& filename, bool validate,
             std::int64_t file_offset) {
            h.submit("read", buffer, filename, file_offset, false, validate);
            return h.wait();
          },
          nb::arg("buffer").none(), nb::arg("filename"), nb::arg("validate") = false,
          nb::arg("file_offset") = 0, "Synchronous read (pread with async=False).")
      .def(
          "write",
          [](AioHandle& h, nb::handle buffer, const std::string& filename, bool validate,
             std::int64_t file_offset) {
            h.submit("write", buffer, filename, file_offset, true, validate);
            return h.wait();
          },
          nb::arg("buffer").none(), nb::arg("filename"), nb::arg("validate") = false,
          nb::arg("file_offset") = 0, "Synchronous write (pwrite with async=False).")
      .def("wait", &AioHandle::wait,
           "Blocks (GIL released) until every pending op is complete; returns how many there "
           "were (0 at once when none) and raises the first failure as tiermem.IoError.");
}

}  // namespace tiermem::py
