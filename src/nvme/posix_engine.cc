// The posix fallback engine: a Boost.Asio thread pool doing blocking pread/pwrite, rings *
// queue_depth threads, so the same number of pieces is in flight as with io_uring. Chosen when a
// ring cannot be set up (seccomp, old kernel) or with tiermem.io_engine = "posix".
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <thread>

#include <boost/asio/post.hpp>
#include <boost/asio/thread_pool.hpp>

#include "core/thread_name.h"
#include "nvme/engine_internal.h"
#include "tiermem/error.h"
#include "tiermem/log.h"

namespace tiermem::detail {
namespace {

class PosixEngine final : public EngineBase {
 public:
  explicit PosixEngine(IoEngineOptions options)
      : EngineBase(std::move(options)),
        pool_(static_cast<std::size_t>(std::clamp(options_.queue_depth * options_.rings, 1, 256))) {}
  ~PosixEngine() override { pool_.join(); }  // every piece already posted completes first
  const char* name() const noexcept override { return "posix"; }

 protected:
  void enqueue(std::vector<Piece*>& pieces) override {
    for (Piece* p : pieces) boost::asio::post(pool_, [this, p] { run(p); });
    pieces.clear();
  }

 private:
  // Issues piece p until it is done (on_result retries short transfers and EAGAIN/EINTR).
  void run(Piece* p) {
    detail::name_pool_thread("tm-posix-io");
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
      if (on_result(p, res) == Action::kDone) return;
      if (p->retries > retries_before && p->retries > 16)  // an EAGAIN storm: back off a little
        std::this_thread::sleep_for(std::chrono::microseconds(std::min(p->retries, 100)));
    }
  }

  boost::asio::thread_pool pool_;
};

}  // namespace

std::unique_ptr<IoEngine> make_posix_engine(const IoEngineOptions& options) {
  return std::make_unique<PosixEngine>(options);
}

}  // namespace tiermem::detail
