// The io_uring engine: `rings` rings, each with its own lock-protected submission queue of pieces,
// at most queue_depth in flight, and one completion thread that reaps, checks (EngineBase), resubmits
// short transfers and retries, and refills the ring. Files are registered (fixed files) and pinned
// pools can be registered as fixed buffers (sparse tables, updated in place).
#include <liburing.h>

#include <cerrno>
#include <condition_variable>
#include <deque>
#include <thread>

#include "core/thread_name.h"
#include "nvme/engine_internal.h"
#include "tiermem/error.h"
#include "tiermem/log.h"

// A Piece travels from the submitting thread to the ring's completion thread through the kernel
// (SQE user_data -> CQE user_data). The kernel orders that handoff (liburing reads the CQ tail with
// acquire semantics), but ThreadSanitizer cannot see through io_uring and reports every Piece
// field as a data race. These annotations tell it about the edge; they compile to nothing
// otherwise.
#if defined(__SANITIZE_THREAD__)
#define TM_HAS_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define TM_HAS_TSAN 1
#endif
#endif
#ifdef TM_HAS_TSAN
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
#define TM_TSAN_RELEASE(p) __tsan_release(p)
#define TM_TSAN_ACQUIRE(p) __tsan_acquire(p)
#else
#define TM_TSAN_RELEASE(p) ((void)(p))
#define TM_TSAN_ACQUIRE(p) ((void)(p))
#endif

namespace tiermem::detail {
namespace {

using Result = std::pair<Piece*, std::int64_t>;

unsigned ring_entries(int qd) {
  unsigned n = 8;
  while (n < static_cast<unsigned>(qd) + 1) n <<= 1;
  return n;
}

class UringEngine final : public EngineBase {
 public:
  explicit UringEngine(IoEngineOptions options) : EngineBase(std::move(options)) {
    bool sqpoll = options_.sqpoll;
    for (int i = 0; i < ring_count(); ++i) {
      auto r = std::make_unique<Ring>();
      io_uring_params p{};
      if (sqpoll) {
        p.flags |= IORING_SETUP_SQPOLL;
        p.sq_thread_idle = 1000;  // ms before the kernel thread sleeps
      }
      int rc = io_uring_queue_init_params(ring_entries(options_.queue_depth), &r->ring, &p);
      if (rc < 0 && sqpoll) {
        TM_LOG_INFO("NVME", "io_uring SQPOLL unavailable ({}); using rings without SQPOLL",
                    errno_message("io_uring_queue_init", -rc));
        sqpoll = false;
        p = io_uring_params{};
        rc = io_uring_queue_init_params(ring_entries(options_.queue_depth), &r->ring, &p);
      }
      if (rc < 0) {
        shutdown();
        throw NotSupportedError(errno_message("io_uring_queue_init", -rc));
      }
      r->initialized = true;
      r->fixed_files = options_.fixed_files &&
                       io_uring_register_files_sparse(&r->ring, kMaxFiles) == 0;
      r->fixed_bufs = options_.fixed_buffers &&
                      io_uring_register_buffers_sparse(&r->ring, kMaxBufferSlots) == 0;
      rings_.push_back(std::move(r));
    }
    sqpoll_ = sqpoll;
    for (auto& r : rings_) {
      Ring* rp = r.get();
      rp->thread = std::thread([this, rp] { reap(*rp); });
    }
  }

  ~UringEngine() override { shutdown(); }

  const char* name() const noexcept override { return "uring"; }
  bool sqpoll_active() const noexcept override { return sqpoll_; }

 protected:
  void on_file_opened(std::uint32_t index, int f) override {
    bool all = true;
    for (auto& r : rings_) {
      if (!r->fixed_files || io_uring_register_files_update(&r->ring, index, &f, 1) != 1) all = false;
    }
    file_fixed_[index].store(all);
    if (!all) {
      int none = -1;
      for (auto& r : rings_)
        if (r->fixed_files) io_uring_register_files_update(&r->ring, index, &none, 1);
    }
  }
  void on_file_closed(std::uint32_t index) override {
    if (!file_fixed_[index].exchange(false)) return;
    int none = -1;
    for (auto& r : rings_) io_uring_register_files_update(&r->ring, index, &none, 1);
  }
  bool register_slot(int slot, void* base, std::uint64_t bytes, std::string* why) override {
    for (std::size_t i = 0; i < rings_.size(); ++i) {
      iovec iov{base, bytes};
      int rc = rings_[i]->fixed_bufs
                   ? io_uring_register_buffers_update_tag(&rings_[i]->ring, slot, &iov, nullptr, 1)
                   : -EOPNOTSUPP;
      if (rc != 1) {
        *why = rings_[i]->fixed_bufs
                   ? errno_message("io_uring_register_buffers_update_tag", rc < 0 ? -rc : EIO)
                   : std::string("the ring has no buffer table (fixed_buffers off or unsupported)");
        for (std::size_t j = 0; j < i; ++j) clear_slot(*rings_[j], slot);
        return false;
      }
    }
    return true;
  }
  void unregister_slot(int slot) override {
    for (auto& r : rings_) clear_slot(*r, slot);
  }

  void enqueue(std::vector<Piece*>& pieces) override {
    std::vector<std::vector<Piece*>> by_ring(rings_.size());
    for (Piece* p : pieces) by_ring[p->ring].push_back(p);
    pieces.clear();
    for (std::size_t i = 0; i < rings_.size(); ++i) {
      if (by_ring[i].empty()) continue;
      Ring& r = *rings_[i];
      std::vector<Result> synthetic;
      {
        std::lock_guard<std::mutex> lock(r.mu);
        for (Piece* p : by_ring[i]) r.queue.push_back(p);
        fill(r, &synthetic);
      }
      process(r, synthetic, 0);
    }
  }

 private:
  struct Ring {
    io_uring ring{};
    bool initialized = false;
    bool fixed_files = false;
    bool fixed_bufs = false;
    std::mutex mu;  // guards the SQ side, queue, inflight, stop
    std::condition_variable idle_cv;
    std::deque<Piece*> queue;
    int inflight = 0;
    bool stop = false;
    std::thread thread;
  };

  static void clear_slot(Ring& r, int slot) {
    iovec iov{nullptr, 0};
    if (r.fixed_bufs) io_uring_register_buffers_update_tag(&r.ring, slot, &iov, nullptr, 1);
  }

  // Moves queued pieces into the SQ up to queue_depth in flight and submits. Pieces the
  // interceptor fails are returned in *synthetic. Requires r.mu.
  void fill(Ring& r, std::vector<Result>* synthetic) {
    int prepared = 0;
    while (r.inflight < options_.queue_depth && !r.queue.empty() &&
           io_uring_sq_space_left(&r.ring) > 0) {
      Piece* p = r.queue.front();
      r.queue.pop_front();
      std::uint64_t len = 0;
      int err = before_issue(*p, &len);
      if (err != 0) {
        synthetic->emplace_back(p, -static_cast<std::int64_t>(err));
        continue;
      }
      io_uring_sqe* sqe = io_uring_get_sqe(&r.ring);
      bool fixed_file = file_fixed_[p->file].load(std::memory_order_relaxed);
      int fdv = fixed_file ? static_cast<int>(p->file) : fd(p->file);
      char* buf = p->io_buf + p->done;
      auto n = static_cast<unsigned>(std::min<std::uint64_t>(len, 1u << 30));
      std::uint64_t off = p->offset + p->done;
      if (p->kind == IoOpKind::kRead) {
        if (p->fixed_index >= 0) io_uring_prep_read_fixed(sqe, fdv, buf, n, off, p->fixed_index);
        else io_uring_prep_read(sqe, fdv, buf, n, off);
      } else {
        if (p->fixed_index >= 0) io_uring_prep_write_fixed(sqe, fdv, buf, n, off, p->fixed_index);
        else io_uring_prep_write(sqe, fdv, buf, n, off);
      }
      if (fixed_file) sqe->flags |= IOSQE_FIXED_FILE;
      TM_TSAN_RELEASE(p);  // the completion thread acquires it with the CQE
      io_uring_sqe_set_data(sqe, p);
      ++r.inflight;
      ++prepared;
      if (options_.single_submit) submit(r);
    }
    if (prepared > 0 && !options_.single_submit) submit(r);
  }

  static void submit(Ring& r) {
    for (;;) {
      int rc = io_uring_submit(&r.ring);
      if (rc >= 0) return;
      if (rc == -EINTR || rc == -EAGAIN || rc == -EBUSY) {
        std::this_thread::yield();  // EBUSY: completions pending; the reaper drains them
        continue;
      }
      TM_LOG_ERROR("NVME", "{}; retrying", errno_message("io_uring_submit", -rc));
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

  // Checks results (completions or synthetic failures); resubmits what needs it; refills.
  void process(Ring& r, std::vector<Result>& results, int reaped) {
    std::vector<Piece*> resubmit;
    while (true) {
      for (auto& [p, res] : results)
        if (on_result(p, res) == Action::kResubmit) resubmit.push_back(p);
      results.clear();
      std::lock_guard<std::mutex> lock(r.mu);
      r.inflight -= reaped;
      reaped = 0;
      for (auto it = resubmit.rbegin(); it != resubmit.rend(); ++it) r.queue.push_front(*it);
      resubmit.clear();
      fill(r, &results);
      if (r.inflight == 0 && r.queue.empty()) r.idle_cv.notify_all();
      if (results.empty()) return;
    }
  }

  void reap(Ring& r) {
    detail::name_this_thread("tm-uring-reap");
    std::vector<Result> results;
    for (;;) {
      io_uring_cqe* cqe = nullptr;
      int rc = io_uring_wait_cqe(&r.ring, &cqe);
      if (rc == -EINTR || rc == -EAGAIN) continue;
      if (rc < 0) {
        TM_LOG_ERROR("NVME", "{}", errno_message("io_uring_wait_cqe", -rc));
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        continue;
      }
      unsigned head, n = 0;
      bool wake = false;
      io_uring_for_each_cqe(&r.ring, head, cqe) {
        auto* p = static_cast<Piece*>(io_uring_cqe_get_data(cqe));
        if (p == nullptr) wake = true;
        else {
          TM_TSAN_ACQUIRE(p);
          results.emplace_back(p, cqe->res);
        }
        ++n;
      }
      io_uring_cq_advance(&r.ring, n);
      int real = static_cast<int>(results.size());
      process(r, results, real);
      if (wake) {
        std::lock_guard<std::mutex> lock(r.mu);
        if (r.stop) return;
      }
    }
  }

  void shutdown() {
    for (auto& rp : rings_) {
      Ring& r = *rp;
      if (!r.initialized) continue;
      if (r.thread.joinable()) {
        {
          std::unique_lock<std::mutex> lock(r.mu);
          r.idle_cv.wait(lock, [&] { return r.inflight == 0 && r.queue.empty(); });
          r.stop = true;
          io_uring_sqe* sqe = io_uring_get_sqe(&r.ring);
          while (sqe == nullptr) {
            submit(r);
            sqe = io_uring_get_sqe(&r.ring);
          }
          io_uring_prep_nop(sqe);
          io_uring_sqe_set_data(sqe, nullptr);
          submit(r);
        }
        r.thread.join();
      }
      io_uring_queue_exit(&r.ring);
      r.initialized = false;
    }
    rings_.clear();
  }

  std::vector<std::unique_ptr<Ring>> rings_;
  std::array<std::atomic<bool>, kMaxFiles> file_fixed_{};
  bool sqpoll_ = false;
};

}  // namespace

std::unique_ptr<IoEngine> make_uring_engine(const IoEngineOptions& options) {
  return std::make_unique<UringEngine>(options);
}

}  // namespace tiermem::detail
