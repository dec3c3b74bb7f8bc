// src/zero/helper_task.cc — one task at a time on an engine thread (helper_task.h).
#include "zero/helper_task.h"

#include <chrono>
#include <exception>
#include <utility>

#include <boost/asio/post.hpp>
#include <boost/asio/thread_pool.hpp>

#include "tiermem/log.h"
#include "tiermem/tensor_store.h"
#include "core/thread_name.h"

namespace tiermem::detail {

HelperTask::HelperTask(const char* what) : what_(what) {}

HelperTask::~HelperTask() {
  try {
    join();
  } catch (const std::exception& e) {
    TM_LOG_ERROR("ZERO", "{} failed at engine destruction: {}", what_, e.what());
  }
  if (pool_) pool_->join();
}

void HelperTask::start(std::function<void()> work) {
  if (!pool_) pool_ = std::make_unique<boost::asio::thread_pool>(1);
  auto task = std::make_shared<std::packaged_task<void()>>([w = std::move(work)] {
    detail::name_pool_thread("tm-helper");
    const TensorStore::HelperThread helper;  // its waits overlap the driving thread's work
    w();
  });
  task_ = task->get_future();
  boost::asio::post(*pool_, [task] { (*task)(); });
}

std::uint64_t HelperTask::join() {
  if (!task_.valid()) return 0;
  const auto t0 = std::chrono::steady_clock::now();
  std::future<void> f = std::move(task_);
  f.wait();
  const auto waited = static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
  waited_ns_ += waited;
  f.get();  // rethrows
  return waited;
}

}  // namespace tiermem::detail
