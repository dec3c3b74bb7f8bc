// sim_device.cc — SimDevice: budgeted host memory and one copy-engine thread per direction.
#include "tiermem/sim_device.h"

#include <chrono>
#include <cstdlib>
#include <cstring>

#include "gpu/caching_allocator.h"
#include "tiermem/error.h"
#include "tiermem/log.h"

namespace tiermem {
namespace {

class SimEventState final : public detail::DeviceEventState {
 public:
  bool ready() override {
    std::lock_guard lock(mu_);
    return done_;
  }
  void wait() override {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return done_; });
    if (error_) std::rethrow_exception(error_);
  }
  std::exception_ptr error() override {
    std::lock_guard lock(mu_);
    return done_ ? error_ : nullptr;
  }
  void finish(std::exception_ptr e) {
    {
      std::lock_guard lock(mu_);
      done_ = true;
      error_ = e;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;              // guarded by mu_
  std::exception_ptr error_;       // guarded by mu_
};

}  // namespace

class SimDevice::Engine {
 public:
  Engine(const char* name, double gbps) : name_(name), gbps_(gbps), thread_([this] { run(); }) {}
  ~Engine() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  // Queues `op` (which moves `bytes` bytes) and returns its event.
  DeviceEvent enqueue(std::function<void()> op, std::uint64_t bytes) {
    auto state = std::make_shared<SimEventState>();
    {
      std::lock_guard lock(mu_);
      queue_.push_back({std::move(op), bytes, state});
    }
    cv_.notify_one();
    return DeviceEvent(state);
  }

 private:
  struct Task {
    std::function<void()> op;
    std::uint64_t bytes;
    std::shared_ptr<SimEventState> state;
  };

  void run() {
    while (true) {
      Task t;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stop_ and drained
        t = std::move(queue_.front());
        queue_.pop_front();
      }
      auto start = std::chrono::steady_clock::now();
      std::exception_ptr err;
      try {
        t.op();
      } catch (...) {
        err = std::current_exception();
      }
      if (gbps_ > 0 && t.bytes > 0) {
        auto want = std::chrono::duration<double>(static_cast<double>(t.bytes) / (gbps_ * 1e9));
        std::this_thread::sleep_until(
            start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(want));
      }
      t.state->finish(err);
    }
  }

  const char* name_;
  double gbps_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_;  // guarded by mu_
  bool stop_ = false;       // guarded by mu_
  std::thread thread_;      // last: starts after the members above exist
};

SimDevice::SimDevice(SimDeviceOptions options) : options_(options) {
  alloc_ = std::make_unique<detail::CachingAllocator>(
      options_.budget_bytes,
      [](std::uint64_t bytes) -> void* {
        void* p = nullptr;
        std::size_t align = bytes >= 4096 ? 4096 : 256;
        return posix_memalign(&p, align, bytes) == 0 ? p : nullptr;
      },
      [](void* p, std::uint64_t) { std::free(p); });
  h2d_ = std::make_unique<Engine>("h2d", options_.h2d_gbps);
  d2h_ = std::make_unique<Engine>("d2h", options_.d2h_gbps);
}

SimDevice::~SimDevice() {
  h2d_.reset();  // drains and joins
  d2h_.reset();
}

std::uint64_t SimDevice::allocation_size(std::uint64_t bytes) const noexcept {
  return detail::CachingAllocator::round(bytes);
}

void* SimDevice::try_allocate(std::uint64_t bytes) noexcept { return alloc_->try_allocate(bytes); }

void* SimDevice::allocate(std::uint64_t bytes) {
  void* p = alloc_->try_allocate(bytes);
  if (p == nullptr) {
    throw OutOfMemoryError(Tier::kDevice, allocation_size(bytes), alloc_->available(),
                           "SimDevice budget " + format_bytes(options_.budget_bytes) +
                               " (tiermem.device_budget_bytes)");
  }
  return p;
}

void SimDevice::free(void* ptr) noexcept {
  if (ptr == nullptr) return;
  if (!alloc_->free(ptr)) TM_LOG_ERROR("GPU", "SimDevice::free of unknown pointer {}", ptr);
}

void SimDevice::empty_cache() { alloc_->empty_cache(); }

void SimDevice::check_device_range(const void* p, std::uint64_t bytes, const char* what) const {
  if (!alloc_->contains(p, bytes)) {
    throw Error(std::string("SimDevice: ") + what + " range [" +
                std::to_string(reinterpret_cast<std::uintptr_t>(p)) + ", +" +
                std::to_string(bytes) + ") is not inside a live device allocation");
  }
}

DeviceEvent SimDevice::copy_h2d_async(void* dst, const void* src, std::uint64_t bytes) {
  if (bytes == 0) return {};
  check_device_range(dst, bytes, "copy_h2d_async destination");
  {
    std::lock_guard lock(stats_mu_);
    copy_stats_.h2d_bytes += bytes;
    ++copy_stats_.h2d_copies;
  }
  return h2d_->enqueue([=] { std::memcpy(dst, src, bytes); }, bytes);
}

DeviceEvent SimDevice::copy_d2h_async(void* dst, const void* src, std::uint64_t bytes) {
  if (bytes == 0) return {};
  check_device_range(src, bytes, "copy_d2h_async source");
  {
    std::lock_guard lock(stats_mu_);
    copy_stats_.d2h_bytes += bytes;
    ++copy_stats_.d2h_copies;
  }
  return d2h_->enqueue([=] { std::memcpy(dst, src, bytes); }, bytes);
}

DeviceEvent SimDevice::copy_d2d_async(void* dst, const void* src, std::uint64_t bytes) {
  if (bytes == 0) return {};
  check_device_range(dst, bytes, "copy_d2d_async destination");
  check_device_range(src, bytes, "copy_d2d_async source");
  {
    std::lock_guard lock(stats_mu_);
    copy_stats_.d2d_bytes += bytes;
    ++copy_stats_.d2d_copies;
  }
  return h2d_->enqueue([=] { std::memmove(dst, src, bytes); }, 0);
}

DeviceEvent SimDevice::memset_async(void* dst, int value, std::uint64_t bytes) {
  if (bytes == 0) return {};
  check_device_range(dst, bytes, "memset_async destination");
  return h2d_->enqueue([=] { std::memset(dst, value, bytes); }, 0);
}

void SimDevice::synchronize() {
  DeviceEvent a = h2d_->enqueue([] {}, 0);
  DeviceEvent b = d2h_->enqueue([] {}, 0);
  a.wait();
  b.wait();
}

DeviceStats SimDevice::stats() const {
  DeviceStats s;
  {
    std::lock_guard lock(stats_mu_);
    s = copy_stats_;
  }
  alloc_->fill_stats(s);
  return s;
}

}  // namespace tiermem
