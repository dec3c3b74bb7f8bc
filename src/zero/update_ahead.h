// src/zero/update_ahead.h — the deferred update of the module the forward pass gathers next, run
// on a thread of its own while the module gathered now computes: the second half of the
// overlapped optimizer step (tiermem.overlap_optimizer_step). The engine starts it at the end of
// a forward gather (ZeroEngine::Impl::start_update_ahead, zero_step.cc) and joins it before it
// touches its state again (ZeroEngine::Impl::join_update_ahead, at every call's finalize()), so
// the update still lands before its module is gathered, exactly once, with the same arithmetic
// on the same bytes: results are unchanged bit for bit. At most one in flight.
//
// Units: join() returns nanoseconds. Ownership: the work it is given owns what it captures; it
// may use the engine's state the driving thread leaves alone until join(). Thread-safety:
// start/join/running from the engine's driving thread only; the work runs on this
// object's one thread (made at the first start). Errors: the work's exception is rethrown by the
// join() after it. Destruction waits for the work in flight (its error logged, never thrown).
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <utility>

#include <boost/asio/post.hpp>
#include <boost/asio/thread_pool.hpp>

#include "tiermem/log.h"
#include "tiermem/tensor_store.h"

namespace tiermem::detail {

class UpdateAhead {
 public:
  UpdateAhead() = default;
  UpdateAhead(const UpdateAhead&) = delete;
  UpdateAhead& operator=(const UpdateAhead&) = delete;
  ~UpdateAhead() {
    try {
      join();
    } catch (const std::exception& e) {
      TM_LOG_ERROR("ZERO", "a deferred update running ahead failed at engine destruction: {}", e.what());
    }
  }

  bool running() const { return task_.valid(); }

  // Runs `work` (one module's update) on this object's thread. Requires !running().
  void start(std::function<void()> work) {
    if (!pool_) pool_ = std::make_unique<boost::asio::thread_pool>(1);
    auto task = std::make_shared<std::packaged_task<void()>>([w = std::move(work)] {
      const TensorStore::HelperThread helper;  // its waits overlap the driving thread's work
      w();
    });
    task_ = task->get_future();
    boost::asio::post(*pool_, [task] { (*task)(); });
  }

  // Waits for the work in flight, if any; the nanoseconds waited. Rethrows the work's error.
  std::uint64_t join() {
    if (!task_.valid()) return 0;
    const auto t0 = std::chrono::steady_clock::now();
    std::future<void> f = std::move(task_);
    f.wait();
    const auto waited = static_cast<std::uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
    f.get();  // rethrows
    return waited;
  }

 private:
  std::unique_ptr<boost::asio::thread_pool> pool_;
  std::future<void> task_;
};

}  // namespace tiermem::detail
