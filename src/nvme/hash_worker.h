// src/nvme/hash_worker.h — the thread that verifies SwapSpace's reads (tiermem.checksum), so the
// io engine's completion thread only reaps.
//
// Why: IoRequest::on_complete callbacks run on the engine's completion thread and must be quick
// (io_engine.h). Hashing a 12 MB extent there (1-3 ms from DRAM) kept that thread from reaping
// and refilling the ring, so the drive idled while it hashed: on GPT-2 124 M with parameters and
// optimizer state on NVMe, checksums cost 0.8 s of a 4.8 s step (docs/benchmarks.md#checksums).
// A read's completion now posts its verification here, and the ring keeps moving.
//
// Contract: post(job) runs `job` on the worker thread, in post order, once. The thread starts at
// the first post. The destructor runs every job already posted, then joins (a job must not post
// more after the owner began destruction). Jobs must not throw (an escaping exception terminates,
// as on any thread) and must not wait for the I/O of the engine whose completions post them.
// Thread-safety: post is thread-safe. Errors: std::system_error if the thread cannot start.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace tiermem::detail {

class HashWorker {
 public:
  HashWorker() = default;
  HashWorker(const HashWorker&) = delete;
  HashWorker& operator=(const HashWorker&) = delete;
  ~HashWorker();

  void post(std::function<void()> job);

 private:
  void run();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  bool stopping_ = false;
  std::thread thread_;  // started by the first post
};

}  // namespace tiermem::detail
