// IoRequest and its shared completion state.
#include <utility>

#include "tiermem/io_engine.h"

namespace tiermem {
namespace detail {

void IoRequestState::add_pending(std::uint64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  pending_ += n;
}

void IoRequestState::finish_one(std::exception_ptr error) {
  std::vector<Callback> cbs;
  std::exception_ptr err;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (error && !error_) error_ = std::move(error);
    if (pending_ > 0) --pending_;
    if (pending_ != 0) return;
    cbs.swap(callbacks_);
    err = error_;
    cv_.notify_all();
  }
  for (auto& cb : cbs) cb(err);
}

void IoRequestState::wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return pending_ == 0; });
  if (error_) std::rethrow_exception(error_);
}

bool IoRequestState::wait_for(std::chrono::nanoseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_for(lock, timeout, [&] { return pending_ == 0; });
}

bool IoRequestState::ready() {
  std::lock_guard<std::mutex> lock(mu_);
  return pending_ == 0;
}

std::exception_ptr IoRequestState::error() {
  std::lock_guard<std::mutex> lock(mu_);
  return pending_ == 0 ? error_ : nullptr;
}

void IoRequestState::on_complete(Callback cb) {
  std::exception_ptr err;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (pending_ != 0) {
      callbacks_.push_back(std::move(cb));
      return;
    }
    err = error_;
  }
  cb(err);
}

}  // namespace detail

void IoRequest::wait() const {
  if (state_) state_->wait();
}
bool IoRequest::ready() const { return !state_ || state_->ready(); }
bool IoRequest::wait_for(std::chrono::nanoseconds timeout) const {
  return !state_ || state_->wait_for(timeout);
}
std::exception_ptr IoRequest::error() const { return state_ ? state_->error() : nullptr; }
void IoRequest::on_complete(std::function<void(std::exception_ptr)> cb) const {
  if (state_) state_->on_complete(std::move(cb));
  else cb(nullptr);
}

void wait_all(std::span<const IoRequest> requests) {
  std::exception_ptr first;
  for (const auto& r : requests) {
    try {
      r.wait();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

}  // namespace tiermem
