// tiermem-bench nvme — fio-like throughput and latency of the NVMe tier's IoEngine on one file.
//
//   cmake --build build-nvme --target tiermem-bench
//   build-nvme/bin/tiermem-bench nvme --path /mnt/nvme --rw read --bs 1M --qd 16 --size 1G
//       --runtime 5 --engine uring [--sqpoll] [--fixed-bufs] [--huge-pages on|off]
//       [--size-to-device on|off] [--json]
//
// The I/O buffers (qd * jobs * bs bytes) come from a PinnedHostPool, populated and page-locked
// at start (unlocked, with the pool's warning, when RLIMIT_MEMLOCK is too low): in 2 MiB
// pages where the system allows (--huge-pages on, the default; the pool's own rule), so that a
// request is a few physical segments, as for training's buffers; --huge-pages off gives 4 KiB
// pages (what a heap buffer has) for comparison. Pieces are sized to the file's device
// (IoEngine::piece_bytes; printed) unless --size-to-device off. `--huge-pages off
// --size-to-device off` is what this bench did before both existed.
//
// --path is a directory or an existing file, as in fio:
//   - a directory: the bench's own data file DIR/tiermem-bench-nvme.dat is created there (written
//     once sequentially when smaller than --size, since reads of never-written blocks would not
//     touch the device) and removed at exit, unless --keep;
//   - an existing file (the user's): its own size is the default --size; a read job never writes
//     to it (a --size above the file's size is refused, exit 2, naming both sizes); a write job
//     writes to it within --size, as fio does. The file is never removed.
//   A path that does not exist (or a file under a missing directory) exits 2 with "does not
//   exist": only a directory gets a file created in it. One the run cannot write where it must (a
//   directory for its own file: /proc, /sys, a read-only mount; the user's file for a write job)
//   exits 2 with "is not writable" and the system's reason, before the free-space check.
// The file is opened with O_DIRECT (page cache bypassed, like fio direct=1) unless --buffered
// (fio direct=0), which a filesystem without O_DIRECT (tmpfs) needs. Each of
// --jobs threads keeps --qd requests of --bs bytes in flight for --runtime seconds: sequential
// jobs start at job * size / jobs and wrap; random jobs pick bs-aligned offsets uniformly
// (fixed seed). One engine with one ring per job, block_size = bs (no splitting). Latency is
// submit -> completion callback, per request. gbps = 1e9 bytes/s; MB/s = 1e6 bytes/s.
// With --json the last line is {"engine","rw","bs","qd","jobs","bytes","seconds","gbps","iops",
// "huge_bytes","buffer_bytes","piece_bytes","lat_us":{"p50","p99","p999"}}. Bad arguments: one line on stderr, exit status 2.
// SIGINT or SIGTERM during the timed run stops it as fio does on Ctrl-C: the same report for the
// time run, marked "interrupted by SIG..." (JSON: "interrupted":"SIGINT"), then the process ends
// by that signal (130/143 in a shell); its own data file is removed in every case.
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <random>
#include <thread>

#include <nlohmann/json.hpp>

#include "bench/bench.h"
#include "core/cli_checks.h"
#include "tiermem/config.h"
#include "tiermem/error.h"
#include "tiermem/io_engine.h"
#include "tiermem/pinned_host_pool.h"

namespace tiermem::bench {
namespace {

struct NvmeOpts {
  std::string path;
  std::string rw = "read";
  std::string bs = "1M";
  int qd = 16;
  std::string size = "1G";
  int jobs = 1;
  double runtime = 5;
  std::string engine = "uring";
  bool sqpoll = false;
  bool fixed_bufs = false;
  bool buffered = false;
  bool keep = false;
  bool json = false;
  std::string huge_pages = "on";
  std::string size_to_device = "on";
  bool size_given = false;
};

// SIGINT and SIGTERM (Ctrl-C, `timeout`) while it lives, and the bench's own data file (`path`;
// empty: none, the user's file or --keep), removed when it goes, whichever way the run ends. The
// handler removes the file at once, then: during the timed run (begin_run() to end_run()) it
// records the signal, the jobs stop submitting, and the run reports what it measured before
// it ends the process with the signal (die_of: exit status 130/143 in a shell), as fio does on
// Ctrl-C; at any other time, or at a second signal, it re-raises the signal with its default
// action. The old handlers come back when it goes. One at a time (the handler reads static state).
class InterruptGuard {
 public:
  explicit InterruptGuard(std::string path) : path_(std::move(path)) {
    if (path_.size() < sizeof signal_path_)
      std::memcpy(signal_path_, path_.c_str(), path_.size() + 1);
    struct sigaction sa {};
    sa.sa_handler = &InterruptGuard::on_signal;
    sigemptyset(&sa.sa_mask);
    handlers_ =
        ::sigaction(SIGINT, &sa, &old_int_) == 0 && ::sigaction(SIGTERM, &sa, &old_term_) == 0;
  }
  ~InterruptGuard() {
    if (handlers_) {
      ::sigaction(SIGINT, &old_int_, nullptr);
      ::sigaction(SIGTERM, &old_term_, nullptr);
    }
    signal_path_[0] = '\0';
    state_.store(kIdle);
    if (!path_.empty()) ::unlink(path_.c_str());
  }
  InterruptGuard(const InterruptGuard&) = delete;
  InterruptGuard& operator=(const InterruptGuard&) = delete;

  void begin_run() { state_.store(kRunning); }
  // The signal that stopped the timed run (SIGINT or SIGTERM), or 0.
  int end_run() {
    const int s = state_.exchange(kIdle);
    return s > 0 ? s : 0;
  }
  // Whether a signal has stopped the timed run (the jobs' completion callbacks ask).
  static bool interrupted() { return state_.load(std::memory_order_relaxed) > 0; }

 private:
  static constexpr int kIdle = 0, kRunning = -1;  // else: the signal that stopped the run
  static_assert(std::atomic<int>::is_always_lock_free,
                "the signal handler needs a lock-free atomic");
  static void on_signal(int sig) {  // async-signal-safe calls only
    if (signal_path_[0] != '\0') ::unlink(signal_path_);
    int running = kRunning;
    if (state_.compare_exchange_strong(running, sig)) return;  // the run stops and reports
    ::signal(sig, SIG_DFL);
    ::raise(sig);
  }
  static inline char signal_path_[4096] = {};
  static inline std::atomic<int> state_{kIdle};
  std::string path_;
  bool handlers_ = false;
  struct sigaction old_int_ {}, old_term_ {};
};

// Ends the process with signal `sig`'s default action, as if the signal had not been caught (a
// shell reports 128 + sig).
[[noreturn]] void die_of(int sig) {
  ::signal(sig, SIG_DFL);
  ::raise(sig);
  std::_Exit(128 + sig);  // not reached: SIGINT and SIGTERM end the process
}

struct JobResult {
  std::uint64_t bytes = 0;
  std::vector<double> lat_us;
};

// One job: qd requests in flight until `deadline` or a signal (InterruptGuard). Each completion
// callback (on the engine's completion thread) records the latency and submits the slot's next
// request at once, so a request costs one thread wake-up, as in fio; this thread only waits for
// the end.
JobResult run_job(IoEngine& engine, IoFile file, char* bufs, std::uint64_t bs, int qd,
                  std::uint64_t size, bool write, bool random, int job, int jobs, double deadline) {
  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    JobResult res;
    std::exception_ptr first_error;
    int in_flight = 0;
    std::uint64_t next_block = 0;
    std::mt19937_64 rng;
    std::vector<double> start;
  } sh;
  sh.res.lat_us.reserve(1 << 20);
  const std::uint64_t blocks = size / bs;
  sh.next_block = blocks * static_cast<std::uint64_t>(job) / static_cast<std::uint64_t>(jobs);
  sh.rng.seed(1234 + static_cast<std::uint64_t>(job));
  sh.start.resize(static_cast<std::size_t>(qd));
  std::function<void(int)> submit = [&](int slot) {
    std::uint64_t block;
    {
      std::lock_guard<std::mutex> lock(sh.mu);
      block = random ? sh.rng() % blocks : sh.next_block++ % blocks;
      sh.start[static_cast<std::size_t>(slot)] = now_s();
    }
    char* buf = bufs + static_cast<std::uint64_t>(slot) * bs;
    IoRequest r = write ? engine.submit_write(file, block * bs, bs, buf)
                        : engine.submit_read(file, block * bs, bs, buf);
    r.on_complete([&, slot](std::exception_ptr e) {
      double t = now_s();
      bool again;
      {
        std::lock_guard<std::mutex> lock(sh.mu);
        if (e && !sh.first_error) sh.first_error = e;
        sh.res.lat_us.push_back((t - sh.start[static_cast<std::size_t>(slot)]) * 1e6);
        sh.res.bytes += bs;
        again = t < deadline && !sh.first_error && !InterruptGuard::interrupted();
        if (!again && --sh.in_flight == 0) sh.cv.notify_all();
      }
      if (again) submit(slot);
    });
  };
  {
    std::lock_guard<std::mutex> lock(sh.mu);
    sh.in_flight = qd;
  }
  for (int s = 0; s < qd; ++s) submit(s);
  std::unique_lock<std::mutex> lock(sh.mu);
  sh.cv.wait(lock, [&] { return sh.in_flight == 0; });
  if (sh.first_error) std::rethrow_exception(sh.first_error);
  return std::move(sh.res);
}

int run_nvme(const NvmeOpts& o) {
  std::uint64_t bs, size;
  try {
    bs = parse_size(o.bs, "--bs");
    size = parse_size(o.size, "--size");
  } catch (const ConfigError& e) {
    std::fprintf(stderr, "tiermem-bench: error: %s\n", e.what());
    return 2;
  }
  auto bad = [](const std::string& m) {
    std::fprintf(stderr, "tiermem-bench: error: %s\n", m.c_str());
    return 2;
  };
  if (bs == 0 || bs % kDirectAlignment != 0)
    return bad("--bs " + o.bs + " must be a positive multiple of 4096 bytes");
  if (o.qd < 1 || o.qd > 4096) return bad("--qd " + std::to_string(o.qd) + " must be in 1..4096");
  if (o.jobs < 1 || o.jobs > 64)
    return bad("--jobs " + std::to_string(o.jobs) + " must be in 1..64");
  if (!(o.runtime > 0) || o.runtime > 3600) {
    char text[64];
    std::snprintf(text, sizeof text, "%g", o.runtime);
    return bad(std::string("--runtime ") + text + " must be in (0, 3600] seconds");
  }
  const bool write = o.rw == "write" || o.rw == "randwrite";

  // Which file, and whose: a directory gets the bench's own file; an existing file is the user's.
  std::string file_path = o.path;
  bool own_file = false;
  struct stat st {};
  if (::stat(o.path.c_str(), &st) != 0) {
    const int e = errno;
    return bad("--path '" + o.path + "' does not exist" +
               (e == ENOENT || e == ENOTDIR
                    ? std::string()
                    : std::string(" or cannot be read: ") + std::strerror(e)) +
               ": give a directory (the bench creates its data file there) or an existing file");
  }
  if (S_ISDIR(st.st_mode)) {
    file_path = o.path + "/tiermem-bench-nvme.dat";
    own_file = true;
  } else if (!S_ISREG(st.st_mode) && !S_ISBLK(st.st_mode)) {
    return bad("--path '" + o.path + "' is neither a directory nor a regular file");
  } else {
    // The user's file: its size is the default --size, and a read job must fit in it.
    const auto file_bytes = static_cast<std::uint64_t>(st.st_size);
    if (!o.size_given) {
      if (S_ISBLK(st.st_mode)) return bad("--path '" + o.path + "' is a block device: give --size");
      if (file_bytes < bs)
        return bad("--path '" + o.path + "' holds " + std::to_string(file_bytes) +
                   " bytes, less than one --bs block (" + std::to_string(bs) + " bytes): " +
                   (write ? "give --size to write that much into it"
                          : "nothing to read (a read job never writes to an existing file)"));
      size = file_bytes;
    } else if (!write && !S_ISBLK(st.st_mode) && size > file_bytes) {
      return bad("--size " + o.size + " (" + std::to_string(size) +
                 " bytes) is larger than --path '" + o.path + "' (" + std::to_string(file_bytes) +
                 " bytes): a read job never writes to an existing file; give " +
                 (file_bytes >= bs ? "--size " + std::to_string(file_bytes / bs * bs) + " or less, or a directory"
                                   : std::string("a directory (the file holds less than one --bs block)")));
    }
  }
  if (size < bs)
    return bad("--size " + std::to_string(size) + " bytes must be at least --bs (" +
               std::to_string(bs) + " bytes)");
  size = size / bs * bs;

  // Somewhere to write: the bench's own file is created in the directory, and a write job writes
  // into the user's file. Tried first (the file created and removed again, or opened for writing),
  // so that a directory no one can write to (/proc, /sys, a read-only mount) is called that, not
  // short of space (such filesystems have 0 bytes free).
  if (!S_ISBLK(st.st_mode) && (own_file || write)) {
    struct stat fst {};
    const bool exists = ::lstat(file_path.c_str(), &fst) == 0;
    const int fd =
        ::open(file_path.c_str(),
               O_WRONLY | O_CLOEXEC | (exists ? 0 : O_CREAT | O_EXCL), 0600);
    if (fd < 0) {
      const int e = errno;
      return bad("--path '" + o.path + "' is not writable: cannot " +
                 (exists ? "open '" + file_path + "' for writing" : "create '" + file_path + "'") +
                 ": " + std::strerror(e) + ": give " +
                 (own_file
                      ? "a directory you can write to (the bench creates its data file there)"
                      : "a file you can write to (a write job writes into it), or a directory"));
    }
    ::close(fd);
    if (!exists) ::unlink(file_path.c_str());
  }

  // Room for what this run writes: the bench's own file is laid out to --size, and a write job may
  // grow the user's regular file to --size. Refused before anything is written when the
  // filesystem has less free (filling it would fail mid-run; on tmpfs it would fill memory).
  if (!S_ISBLK(st.st_mode) && (own_file || write)) {
    std::uint64_t have = 0;
    struct stat fst {};
    if (::stat(file_path.c_str(), &fst) == 0) have = static_cast<std::uint64_t>(fst.st_size);
    struct statvfs vs {};
    if (size > have && ::statvfs(o.path.c_str(), &vs) == 0) {
      const std::uint64_t free_bytes = static_cast<std::uint64_t>(vs.f_bavail) * vs.f_frsize;
      if (size - have > free_bytes) {
        const std::uint64_t fits = (have + free_bytes) / bs * bs;
        return bad("--size " + o.size + " (" + std::to_string(size) + " bytes) needs " +
                   std::to_string(size - have) + " bytes more in '" + file_path + "', but its filesystem has " +
                   std::to_string(free_bytes) + " bytes (" + format_bytes(free_bytes) + ") free: give --size " +
                   (fits >= bs ? std::to_string(fits) + " or less" : std::string("below the free space")) +
                   ", or a --path on a larger filesystem");
      }
    }
  }

  IoEngineOptions eo;
  eo.kind = o.engine == "posix" ? IoEngineKind::kPosix : IoEngineKind::kUring;
  eo.block_size_bytes = bs;
  eo.queue_depth = o.qd;
  eo.rings = o.jobs;
  eo.sqpoll = o.sqpoll;
  eo.fixed_buffers = o.fixed_bufs;
  eo.o_direct = !o.buffered;
  eo.size_to_device = o.size_to_device == "on";
  auto engine = make_io_engine(eo);
  std::optional<InterruptGuard> guard;
  {
    // Remove only a file this run creates (a kept one from an earlier run stays kept).
    struct stat fst {};
    const bool remove = own_file && !o.keep && ::stat(file_path.c_str(), &fst) != 0;
    guard.emplace(remove ? file_path : std::string());
  }
  IoFile file;
  try {
    file = engine->open_file(file_path, /*create=*/own_file);
  } catch (const IoError& e) {
    if (e.err() == EINVAL && !o.buffered) {
      return bad("--path '" + o.path +
                 "' is on a filesystem without O_DIRECT (e.g. tmpfs): put it "
                 "on a disk, or add --buffered to go through the page cache (fio's direct=0)");
    }
    throw;
  }

  // The I/O buffers come from a PinnedHostPool, as training's do: one populated mapping, in
  // 2 MiB pages unless --huge-pages off (then 4 KiB pages, as a plain heap buffer has).
  const std::uint64_t pool_bytes = bs * static_cast<std::uint64_t>(o.qd) * static_cast<std::uint64_t>(o.jobs);
  std::unique_ptr<PinnedHostPool> pool_holder = make_io_buffer_pool(pool_bytes, o.huge_pages == "on");
  PinnedHostPool& host_pool = *pool_holder;
  char* const buf_base = static_cast<char*>(host_pool.allocate(pool_bytes));
  std::unique_ptr<char, PoolFree<char>> pool(buf_base, PoolFree<char>{&host_pool});
  for (std::uint64_t i = 0; i < pool_bytes; ++i) pool.get()[i] = static_cast<char>(i * 131 + 7);
  const HostRegion region = host_pool.regions().front();
  // Registered always, for its page layout; as fixed buffers only with --fixed-bufs.
  const bool registered = engine->register_buffers(region.base, region.bytes, region.contiguous_bytes);
  struct Unregister {
    IoEngine* e;
    void* base;
    ~Unregister() { e->unregister_buffers(base); }
  } unregister{engine.get(), region.base};
  const std::uint64_t piece = engine->piece_bytes(file, pool.get(), bs);

  if (own_file && engine->file_size(file) < size) {  // lay our file out: write it once, in order
    std::vector<IoRequest> reqs;
    for (std::uint64_t off = 0; off < size; off += bs) {
      reqs.push_back(engine->submit_write(file, off, bs, pool.get() + (off / bs % o.qd) * bs));
      if (reqs.size() >= static_cast<std::size_t>(o.qd)) {
        wait_all(reqs);
        reqs.clear();
      }
    }
    wait_all(reqs);
  }

  const bool random = o.rw == "randread" || o.rw == "randwrite";
  std::vector<JobResult> results(static_cast<std::size_t>(o.jobs));
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(o.jobs));
  guard->begin_run();
  double t0 = now_s();
  double deadline = t0 + o.runtime;
  std::vector<std::thread> threads;
  for (int j = 0; j < o.jobs; ++j) {
    threads.emplace_back([&, j] {
      try {
        results[j] = run_job(*engine, file, pool.get() + static_cast<std::uint64_t>(j) * o.qd * bs, bs,
                             o.qd, size, write, random, j, o.jobs, deadline);
      } catch (...) {
        errors[j] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  double seconds = now_s() - t0;
  const int stopped_by = guard->end_run();  // a signal: what ran so far is reported, then it ends
  const char* const signal_name = stopped_by == SIGINT ? "SIGINT" : "SIGTERM";
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  engine->close_file(file);

  std::uint64_t bytes = 0;
  std::vector<double> lat;
  for (auto& r : results) {
    bytes += r.bytes;
    lat.insert(lat.end(), r.lat_us.begin(), r.lat_us.end());
  }
  double ios = static_cast<double>(lat.size());
  double gbps = static_cast<double>(bytes) / seconds / 1e9;
  double iops = ios / seconds;
  double p50 = quantile(lat, 0.5), p99 = quantile(lat, 0.99), p999 = quantile(lat, 0.999);

  std::printf("nvme: rw=%s bs=%s qd=%d jobs=%d engine=%s%s%s file=%s size=%s\n", o.rw.c_str(),
              format_bytes(bs).c_str(), o.qd, o.jobs, engine->name(),
              engine->sqpoll_active() ? " sqpoll" : "", registered ? " fixed-bufs" : "",
              file_path.c_str(), format_bytes(size).c_str());
  if (stopped_by != 0)
    std::printf(
        "  interrupted by %s after %.2f s of --runtime %g: the figures below cover those %.2f s\n",
        signal_name, seconds, o.runtime, seconds);
  std::printf("  buffers: %s in %s pages (%s of it in 2 MiB pages); pieces of %s\n",
              format_bytes(pool_bytes).c_str(),
              host_pool.page_kind() == HostPageKind::kHugetlb       ? "hugetlbfs 2 MiB"
              : host_pool.page_kind() == HostPageKind::kTransparent ? "transparent huge"
                                                                    : "4 KiB",
              format_bytes(host_pool.huge_bytes()).c_str(), format_bytes(piece).c_str());
  std::printf("  %s: IOPS=%.0f, BW=%.1fMB/s (%.3f GB/s), %.1f MB in %.2f s\n", write ? "write" : "read",
              iops, gbps * 1e3, gbps, static_cast<double>(bytes) / 1e6, seconds);
  std::printf("  lat (usec): p50=%.1f, p99=%.1f, p99.9=%.1f\n", p50, p99, p999);
  if (o.json) {
    nlohmann::json j = {{"engine", engine->name()}, {"rw", o.rw}, {"bs", bs}, {"qd", o.qd},
                        {"jobs", o.jobs}, {"bytes", bytes}, {"seconds", seconds}, {"gbps", gbps},
                        {"iops", iops}, {"huge_bytes", host_pool.huge_bytes()},
                        {"buffer_bytes", pool_bytes}, {"piece_bytes", piece}, {"lat_us", {{"p50", p50}, {"p99", p99}, {"p999", p999}}}};
    if (stopped_by != 0) j["interrupted"] = signal_name;
    std::printf("%s\n", j.dump().c_str());
  }
  if (stopped_by != 0) {
    std::fflush(stdout);
    guard.reset();  // the file removed, the old handlers back
    die_of(stopped_by);
  }
  return 0;
}

std::function<int()> setup_nvme(CLI::App& sub) {
  auto o = std::make_shared<NvmeOpts>();
  sub.add_option("--path", o->path,
                 "directory (the bench creates tiermem-bench-nvme.dat there, removed at exit "
                 "unless --keep) or an existing file (never written by a read job; its size is "
                 "the default --size)")
      ->required();
  sub.add_option("--rw", o->rw, "read|write|randread|randwrite")
      ->check(CLI::IsMember({"read", "write", "randread", "randwrite"}));
  sub.add_option("--bs", o->bs, "request size (4K multiple), e.g. 1M, 4K");
  sub.add_option("--qd", o->qd, "requests in flight per job")->check(tiermem::cli::whole_number_check())->check(tiermem::cli::within(1, 4096));
  sub.add_option("--size", o->size,
                 "bytes of the file used, e.g. 1G [default: an existing file's size, else 1G]");
  sub.add_option("--jobs", o->jobs, "threads, each with its own ring")->check(tiermem::cli::whole_number_check())->check(tiermem::cli::within(1, 64));
  sub.add_option("--runtime", o->runtime, "seconds")->check(tiermem::cli::number_check());
  sub.add_option("--engine", o->engine, "uring|posix")->check(CLI::IsMember({"uring", "posix"}));
  sub.add_flag("--sqpoll", o->sqpoll, "IORING_SETUP_SQPOLL");
  sub.add_flag("--fixed-bufs", o->fixed_bufs, "register the buffers (fixed buffers)");
  sub.add_flag("--buffered", o->buffered,
               "open without O_DIRECT (through the page cache; fio direct=0)");
  sub.add_flag("--keep", o->keep,
               "keep the bench's own data file (DIR/tiermem-bench-nvme.dat) at exit");
  sub.add_flag("--json", o->json, "last line: one JSON object");
  sub.add_option("--huge-pages", o->huge_pages,
                 "on: the I/O buffers are in 2 MiB pages where the system allows (as the host "
                 "pool's are); off: 4 KiB pages")
      ->check(CLI::IsMember({"on", "off"}));
  sub.add_option("--size-to-device", o->size_to_device,
                 "on: requests no larger than the device takes unsplit (sysfs limits); off: "
                 "always --bs")
      ->check(CLI::IsMember({"on", "off"}));
  CLI::App* app = &sub;
  return [o, app] {
    o->size_given = app->count("--size") > 0;
    return run_nvme(*o);
  };
}

}  // namespace

TIERMEM_BENCH_COMMAND(nvme, "nvme", "NVMe tier: IoEngine throughput and latency on one file (fio-like)",
                      setup_nvme);

}  // namespace tiermem::bench
