// The posix fallback engine: a pool of threads doing pread/pwrite, rings * queue_depth of them,
// so the same number of pieces is in flight as with io_uring. Chosen when a ring cannot be set
// up (seccomp, old kernel) or with tiermem.io_engine = "posix".
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <deque>
#include <thread>

#include "nvme/engine_internal.h"
#include "tiermem/error.h"
#include "tiermem/log.h"

namespace tiermem::detail {
namespace {

class PosixEngine final : public EngineBase {
 public:
  explicit PosixEngine(IoEngineOptions options) : EngineBase(std::move(options)) {
    int n = std::clamp(options_.queue_depth * options_.rings, 1, 256);
    workers_.reserve(n);
    for (int i = 0; i < n; ++i) workers_.emplace_back([this] { run(); });
  }
  ~PosixEngine() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;  // workers drain the queue first
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  const char* name() const noexcept override { return "posix"; }

 protected:
  void enqueue(std::vector<Piece*>& pieces) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (Piece* p : pieces) queue_.push_back(p);
    }
    pieces.clear();
    cv_.notify_all();
  }

 private:
  void run() {
    for (;;) {
      Piece* p;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        p = queue_.front();
        queue_.pop_front();
      }
      for (;;) {
        std::uint64_t len = 0;
        std::int64_t res;
        int err = before_issue(*p, &len);
        if (err != 0) {
          res = -err;
        } else {
          int f = fd(p->file);
          ssize_t r = p->kind == IoOpKind::kRead
                          ? ::pread(f, p->io_buf + p->done, len, static_cast<off_t>(p->offset + p->done))
                          : ::pwrite(f, p->io_buf + p->done, len, static_cast<off_t>(p->offset + p->done));
          res = r < 0 ? -errno : r;
        }
        int retries_before = p->retries;
        if (on_result(p, res) == Action::kDone) break;
        if (p->retries > retries_before && p->retries > 16)  // an EAGAIN storm: back off a little
          std::this_thread::sleep_for(std::chrono::microseconds(std::min(p->retries, 100)));
      }
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Piece*> queue_;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace

std::unique_ptr<IoEngine> make_posix_engine(const IoEngineOptions& options) {
  return std::make_unique<PosixEngine>(options);
}

}  // namespace tiermem::detail
