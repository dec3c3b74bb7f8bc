// sim_device.cc — SimDevice: budgeted host memory and one copy-engine thread per direction.
#include "tiermem/sim_device.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <vector>

#include "gpu/caching_allocator.h"
#include "tiermem/error.h"
#include "tiermem/log.h"
#include "core/thread_name.h"

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
    detail::name_this_thread(std::string("tm-sim-").append(name_).c_str());
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

// Device memory the CPU may not address: each block is a memfd mapped twice, a PROT_NONE view
// (the device pointer) and a read-write view only the copy engines use.
class SimDevice::OpaqueMemory {
 public:
  // A block of at least `bytes` (page-rounded), or nullptr (logged) when the kernel refuses.
  void* allocate(std::uint64_t bytes) noexcept {
    const std::uint64_t page = static_cast<std::uint64_t>(sysconf(_SC_PAGESIZE));
    const std::uint64_t len = (std::max<std::uint64_t>(bytes, 1) + page - 1) / page * page;
    const int fd = memfd_create("tiermem-sim-device", MFD_CLOEXEC);
    if (fd < 0) {
      TM_LOG_ERROR("GPU", "SimDevice (not host-addressable): memfd_create failed: {}", std::strerror(errno));
      return nullptr;
    }
    void* view = MAP_FAILED;
    void* rw = MAP_FAILED;
    if (ftruncate(fd, static_cast<off_t>(len)) == 0) {
      view = mmap(nullptr, len, PROT_NONE, MAP_SHARED, fd, 0);
      rw = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    }
    const int err = errno;
    close(fd);
    if (view == MAP_FAILED || rw == MAP_FAILED) {
      if (view != MAP_FAILED) munmap(view, len);
      if (rw != MAP_FAILED) munmap(rw, len);
      TM_LOG_ERROR("GPU", "SimDevice (not host-addressable): mapping {} bytes failed: {}", len, std::strerror(err));
      return nullptr;
    }
    try {
      std::lock_guard lock(mu_);
      blocks_.emplace(static_cast<const char*>(view), Block{static_cast<char*>(rw), len});
    } catch (...) {
      munmap(view, len);
      munmap(rw, len);
      return nullptr;
    }
    return view;
  }

  void free(void* view) noexcept {
    Block b;
    {
      std::lock_guard lock(mu_);
      auto it = blocks_.find(static_cast<const char*>(view));
      if (it == blocks_.end()) return;
      b = it->second;
      blocks_.erase(it);
    }
    munmap(view, b.len);
    munmap(b.rw, b.len);
  }

  // The read-write address of device address p (inside a block: the caller checked the range).
  void* translate(const void* p) const {
    const char* c = static_cast<const char*>(p);
    std::lock_guard lock(mu_);
    auto it = blocks_.upper_bound(c);
    if (it == blocks_.begin()) throw Error("SimDevice: device pointer outside every block");
    --it;
    if (c >= it->first + it->second.len) throw Error("SimDevice: device pointer outside every block");
    return it->second.rw + (c - it->first);
  }

 private:
  struct Block {
    char* rw = nullptr;
    std::uint64_t len = 0;
  };
  mutable std::mutex mu_;
  std::map<const char*, Block> blocks_;  // guarded by mu_: view -> read-write view
};

// Device memory the CPU addresses: the process's own anonymous mappings, not malloc's (blocks of
// 0.1-150 MB freed and made again as tensors move in and out of the device tier would fragment
// glibc's heap, whose freed pages stay in the process: max RSS +0.5 GiB on GPT-2 124 M at 256 MiB
// budgets). A fresh mapping costs a page fault and a zeroed page per 4 KiB on first touch, which
// is most of a copy into it (9 MiB: 5.0 ms fresh against 0.4 ms warm on the 2-core VM the
// benchmarks ran on; GPT-2 124 M at 256 MiB budgets: step 3.28 -> 3.19 s, median of 4 interleaved
// pairs), and the CachingAllocator above frees cached blocks exactly when the budget is full and a
// block of another size is wanted. So a freed block's pages are not returned at once: they are kept until
// the next allocations, which take them over with mremap (page tables moved, nothing copied or
// zeroed); what one allocation does not need stays kept for the next. Kept pages count against
// nothing: they are bytes the allocator freed, and an allocation takes kept pages before it maps
// any fresh ones, so fresh pages are mapped only when nothing is kept and mapped bytes (live,
// cached and kept) never pass the budget. (Unmapping the rest after each allocation, as this did
// before, zeroed those bytes again at the next: 246 M LoRA at 256 MiB budgets spent ~0.06
// core-seconds a step faulting the copy thread's destinations in.) flush() unmaps what is kept
// (SimDevice::empty_cache, the destructor). Blocks below a page keep malloc.
class SimDevice::HostMemory {
 public:
  ~HostMemory() { flush(); }

  void* allocate(std::uint64_t bytes) noexcept {
    if (bytes < kPage) {
      void* p = nullptr;
      return posix_memalign(&p, 256, bytes) == 0 ? p : nullptr;
    }
    const std::uint64_t len = round(bytes);
    void* fresh = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (fresh == MAP_FAILED) return nullptr;
    char* dst = static_cast<char*>(fresh);
    std::lock_guard lock(mu_);
    // Kept blocks' pages placed over the fresh mapping's start, one after the other (MREMAP_FIXED
    // replaces the untouched pages there); a failed move leaves the fresh pages, still valid.
    std::uint64_t off = 0;
    while (off < len && !kept_.empty()) {
      auto [p, n] = kept_.back();
      const std::uint64_t take = std::min(n, len - off);
      // The kept block's tail: its head stays kept for the next allocation.
      if (mremap(p + (n - take), take, take, MREMAP_MAYMOVE | MREMAP_FIXED, dst + off) == MAP_FAILED) {
        // (A kernel before 6.17 cannot move a range that earlier moves made of several mappings.)
        flush_locked();
        break;
      }
      if (take < n) {
        kept_.back().second = n - take;
      } else {
        kept_.pop_back();
      }
      off += take;
    }
    return dst;
  }

  void free(void* p, std::uint64_t bytes) noexcept {
    if (bytes < kPage) return std::free(p);
    std::lock_guard lock(mu_);
    try {
      kept_.emplace_back(static_cast<char*>(p), round(bytes));
    } catch (...) {
      munmap(p, round(bytes));
    }
  }

  void flush() noexcept {
    std::lock_guard lock(mu_);
    flush_locked();
  }

 private:
  static constexpr std::uint64_t kPage = 4096;
  static std::uint64_t round(std::uint64_t bytes) { return (bytes + kPage - 1) / kPage * kPage; }
  void flush_locked() noexcept {
    for (auto [p, n] : kept_) munmap(p, n);
    kept_.clear();
  }
  std::mutex mu_;
  std::vector<std::pair<char*, std::uint64_t>> kept_;  // guarded by mu_: freed, pages still mapped
};

SimDevice::SimDevice(SimDeviceOptions options) : options_(options) {
  if (options_.host_addressable) {
    host_ = std::make_unique<HostMemory>();
    alloc_ = std::make_unique<detail::CachingAllocator>(
        options_.budget_bytes, [this](std::uint64_t bytes) { return host_->allocate(bytes); },
        [this](void* p, std::uint64_t bytes) { host_->free(p, bytes); });
  } else {
    opaque_ = std::make_unique<OpaqueMemory>();
    alloc_ = std::make_unique<detail::CachingAllocator>(
        options_.budget_bytes, [this](std::uint64_t bytes) { return opaque_->allocate(bytes); },
        [this](void* p, std::uint64_t) { opaque_->free(p); });
  }
  h2d_ = std::make_unique<Engine>("h2d", options_.h2d_gbps);
  d2h_ = std::make_unique<Engine>("d2h", options_.d2h_gbps);
}

SimDevice::~SimDevice() {
  h2d_.reset();  // drains and joins
  d2h_.reset();
  alloc_.reset();  // returns every block to opaque_ (declared before it, destroyed after)
}

void* SimDevice::engine_ptr(const void* p) const {
  return opaque_ ? opaque_->translate(p) : const_cast<void*>(p);
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

void SimDevice::empty_cache() {
  alloc_->empty_cache();
  if (host_) host_->flush();  // the freed blocks' pages too
}

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
  void* d = engine_ptr(dst);
  return h2d_->enqueue([=] { std::memcpy(d, src, bytes); }, bytes);
}

DeviceEvent SimDevice::copy_d2h_async(void* dst, const void* src, std::uint64_t bytes) {
  if (bytes == 0) return {};
  check_device_range(src, bytes, "copy_d2h_async source");
  {
    std::lock_guard lock(stats_mu_);
    copy_stats_.d2h_bytes += bytes;
    ++copy_stats_.d2h_copies;
  }
  const void* s = engine_ptr(src);
  return d2h_->enqueue([=] { std::memcpy(dst, s, bytes); }, bytes);
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
  void* d = engine_ptr(dst);
  const void* s = engine_ptr(src);
  return h2d_->enqueue([=] { std::memmove(d, s, bytes); }, 0);
}

DeviceEvent SimDevice::memset_async(void* dst, int value, std::uint64_t bytes) {
  if (bytes == 0) return {};
  check_device_range(dst, bytes, "memset_async destination");
  void* d = engine_ptr(dst);
  return h2d_->enqueue([=] { std::memset(d, value, bytes); }, 0);
}

DeviceEvent SimDevice::adam_step_async(const AdamParams& params, const DeviceAdamTensor* tensors,
                                       std::size_t count, DType half_dtype) {
  if (options_.adam_kernel == nullptr) {
    throw NotSupportedError(
        "SimDevice::adam_step_async: no CPU AdamW kernel was given (SimDeviceOptions::adam_kernel, "
        "DeviceOptions::sim_adam_kernel)");
  }
  if (count > 0 && tensors == nullptr) throw Error("SimDevice::adam_step_async: null tensor array");
  bool any_half = false;
  std::vector<DeviceAdamTensor> work(tensors, tensors + count);
  for (DeviceAdamTensor& t : work) {  // checked and translated now: errors at once, as copies
    if (t.n == 0) continue;
    const std::uint64_t fb = 4ull * t.n;
    check_device_range(t.master, fb, "adam_step_async master");
    check_device_range(t.grad, fb, "adam_step_async grad");
    check_device_range(t.m, fb, "adam_step_async exp_avg");
    check_device_range(t.v, fb, "adam_step_async exp_avg_sq");
    t.master = static_cast<float*>(engine_ptr(t.master));
    t.grad = static_cast<const float*>(engine_ptr(t.grad));
    t.m = static_cast<float*>(engine_ptr(t.m));
    t.v = static_cast<float*>(engine_ptr(t.v));
    if (t.half != nullptr) {
      check_device_range(t.half, 2ull * t.n, "adam_step_async half");
      t.half = static_cast<std::uint16_t*>(engine_ptr(t.half));
      any_half = true;
    }
  }
  if (any_half && half_dtype != DType::kBF16 && half_dtype != DType::kF16) {
    throw NotSupportedError("SimDevice::adam_step_async: half dtype " + std::string(dtype_name(half_dtype)) +
                            " is not bf16 or f16");
  }
  const SimAdamKernel kernel = options_.adam_kernel;
  // On the H2D engine: the simulated device's one queue that also runs D2D copies and memsets.
  return h2d_->enqueue(
      [kernel, params, half_dtype, work = std::move(work)] {
        for (const DeviceAdamTensor& t : work) {
          if (t.n > 0) kernel(params, t.master, t.grad, t.m, t.v, t.n, t.half, half_dtype);
        }
      },
      0);
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
