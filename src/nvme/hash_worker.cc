// src/nvme/hash_worker.cc — see hash_worker.h.
#include "nvme/hash_worker.h"

#include <utility>

#include "core/thread_name.h"

namespace tiermem::detail {

HashWorker::~HashWorker() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void HashWorker::post(std::function<void()> job) {
  // Notified under the lock: the job may finish its request at once, and the request's waiter may
  // then destroy this worker; the destructor's lock waits until this call is done with cv_.
  std::lock_guard lock(mu_);
  jobs_.push_back(std::move(job));
  if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
  cv_.notify_one();
}

void HashWorker::run() {
  detail::name_this_thread("tm-hash");
  std::unique_lock lock(mu_);
  while (true) {
    cv_.wait(lock, [this] { return stopping_ || !jobs_.empty(); });
    if (jobs_.empty()) return;  // stopping, and every job ran
    std::function<void()> job = std::move(jobs_.front());
    jobs_.pop_front();
    lock.unlock();
    job();
    job = nullptr;  // its captures go before the next wait (and before the owner is destroyed)
    lock.lock();
  }
}

}  // namespace tiermem::detail
