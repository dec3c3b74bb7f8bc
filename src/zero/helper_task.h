// src/zero/helper_task.h — one task at a time on a thread of the engine's own, beside the driving
// thread, and the wait for it: the gradient hand-off (GradientReducer::hand_off) and the deferred
// update running ahead of its gather (UpdateScheduler::start_ahead, update_scheduler.h) each
// own one. The task runs under a TensorStore::HelperThread scope, so its store stalls, which
// overlap the driving thread's work, count apart (TensorStoreStats::helper_stall_ns); the driving
// thread's waits for it are what join() returns and waited_ns() sums.
//
// Units: nanoseconds. Ownership: the task owns what it captures; it may use its owner's state that
// the driving thread leaves alone until join(). Thread-safety: start/join/running/waited_ns from
// the driving thread only; the task runs on this object's one thread (made at the first start).
// Errors: the task's exception is rethrown by the join() after it. Destruction waits for a task in
// flight (its error logged with `what`, never thrown): an owner whose task uses its other members
// declares this one last.
#pragma once

#include <cstdint>
#include <functional>
#include <future>
#include <memory>

namespace boost::asio {
class thread_pool;
}

namespace tiermem::detail {

class HelperTask {
 public:
  // `what`: the task, as the log names it if it fails with no join to report it ("the gradient
  // hand-off"); a string literal.
  explicit HelperTask(const char* what);
  HelperTask(const HelperTask&) = delete;
  HelperTask& operator=(const HelperTask&) = delete;
  ~HelperTask();

  bool running() const { return task_.valid(); }
  // Runs `work` on this object's thread. Requires !running().
  void start(std::function<void()> work);
  // Waits for the task in flight, if any; the nanoseconds waited. Rethrows the task's error.
  std::uint64_t join();
  std::uint64_t waited_ns() const { return waited_ns_; }  // every join()'s wait, summed

 private:
  const char* what_;
  std::unique_ptr<boost::asio::thread_pool> pool_;
  std::future<void> task_;
  std::uint64_t waited_ns_ = 0;
};

}  // namespace tiermem::detail
