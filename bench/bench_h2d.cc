// tiermem-bench h2d | d2h — host<->device copy bandwidth, pinned vs pageable host memory.
//
//   cmake --build build --target tiermem-bench
//   build/bin/tiermem-bench h2d --device auto --min-size 4K --max-size 256M --json
//   build/bin/tiermem-bench d2h --device sim
//
// For each size (powers of 4 from --min-size to --max-size) it times --reps copies of each kind,
// interleaving pinned and pageable runs, and reports the median GB/s (1e9 bytes/s). "pinned" is
// page-locked memory from a PinnedHostPool registered with the device (cudaHostRegister on CUDA;
// on SimDevice it is prefaulted host memory, locked when RLIMIT_MEMLOCK allows); "pageable" is a
// fresh std::vector. With --json the last line is one JSON object: per-size results and
// gbps = the pinned GB/s at the largest size. On CUDA it also times the reference peak: plain
// synchronous cudaMemcpy between cudaMallocHost memory and cudaMalloc memory at the largest size
// (outside tiermem, the number the pinned path should reach), as cudamemcpy_gbps and
// ratio_to_cudamemcpy = gbps / cudamemcpy_gbps (absent on SimDevice or when it cannot run).
#include <sys/mman.h>

#include <cstring>
#include <iostream>
#include <memory>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "bench/bench.h"
#include "core/cli_checks.h"
#include "tiermem/config.h"
#include "tiermem/device.h"
#include "tiermem/error.h"
#include "tiermem/pinned_host_pool.h"

#if TIERMEM_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace tiermem::bench {
namespace {

struct CopyOptions {
  std::string device = "auto";
  std::string min_size = "4K", max_size = "256M";
  int reps = 5;
  bool json = false;
};

DeviceOptions device_options(const std::string& choice, std::uint64_t budget) {
  Config c;
  c.tiermem.device = choice;
  c.tiermem.device_budget_bytes = budget;
  return DeviceOptions::from_config(c);
}

// The reference peak: median GB/s of `reps` synchronous cudaMemcpy of `bytes` between
// cudaMallocHost and cudaMalloc buffers; 0 when CUDA is absent or an allocation fails.
double cudamemcpy_peak_gbps(std::uint64_t bytes, bool h2d, int reps) {
#if TIERMEM_HAVE_CUDA
  void* host = nullptr;
  void* dev = nullptr;
  if (cudaMallocHost(&host, bytes) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  if (cudaMalloc(&dev, bytes) != cudaSuccess) {
    cudaGetLastError();
    cudaFreeHost(host);
    return 0;
  }
  std::memset(host, 1, bytes);
  std::vector<double> t;
  bool ok = true;
  for (int r = 0; r < reps + 1 && ok; ++r) {  // the first is a warm-up
    const double t0 = now_s();
    ok = (h2d ? cudaMemcpy(dev, host, bytes, cudaMemcpyHostToDevice)
              : cudaMemcpy(host, dev, bytes, cudaMemcpyDeviceToHost)) == cudaSuccess;
    if (r > 0) t.push_back(static_cast<double>(bytes) / (now_s() - t0) / 1e9);
  }
  if (!ok) cudaGetLastError();
  cudaFree(dev);
  cudaFreeHost(host);
  return ok ? median(t) : 0;
#else
  (void)bytes, (void)h2d, (void)reps;
  return 0;
#endif
}

int run_copy(const CopyOptions& o, bool h2d) {
  // Sizes step by 4x from --min-size (its top is --max-size's, checked below); each is copied
  // 64 MiB / size times a repetition.
  const std::uint64_t lo = parse_size_within(o.min_size, "--min-size", "4K", "1P");
  const std::uint64_t hi = parse_size_within(o.max_size, "--max-size", "4K", "1G");
  if (hi < lo) {
    throw ConfigError("--max-size", o.max_size, "is below --min-size (" + format_bytes(lo) + "): give a larger one");
  }
  auto dev = make_device(device_options(o.device, hi + (16 << 20)));

  PinnedHostPoolOptions po;
  po.budget_bytes = PinnedHostPool::allocation_size(hi);
  po.pin_memory = false;
  PinnedHostPool pool(po);
  void* pinned = pool.allocate(hi);
  std::memset(pinned, 1, hi);  // prefault
  // Lock it when the limit allows (the pool itself was made unlocked so this never throws).
  bool locked = mlock(pinned, hi) == 0;
  bool registered = dev->kind() == DeviceKind::kCuda ? dev->register_host(pinned, hi) : locked;
  void* d = dev->allocate(hi);

  const char* dir = h2d ? "h2d" : "d2h";
  std::cout << fmt::format("{}: device {}, pinned buffer {} ({}), sizes {}..{}, {} reps (median)\n", dir,
                           dev->name(), format_bytes(hi), registered ? "page-locked" : "NOT locked: RLIMIT_MEMLOCK",
                           format_bytes(lo), format_bytes(hi), o.reps);
  std::cout << fmt::format("{:>12} {:>14} {:>14}\n", "size", "pinned GB/s", "pageable GB/s");
  nlohmann::json results = nlohmann::json::array();
  double last_pinned = 0;
  for (std::uint64_t size = lo; size <= hi; size *= 4) {
    std::vector<char> pageable(size, 1);
    std::vector<double> tp, tq;
    const int inner = static_cast<int>(std::max<std::uint64_t>(1, (64ull << 20) / size));
    for (int r = 0; r < o.reps; ++r) {
      for (int kind = 0; kind < 2; ++kind) {
        void* host = kind == 0 ? pinned : pageable.data();
        double t0 = now_s();
        DeviceEvent ev;
        for (int i = 0; i < inner; ++i) {
          ev = h2d ? dev->copy_h2d_async(d, host, size) : dev->copy_d2h_async(host, d, size);
        }
        ev.wait();
        double gbps = static_cast<double>(size) * inner / (now_s() - t0) / 1e9;
        (kind == 0 ? tp : tq).push_back(gbps);
      }
    }
    double p = median(tp), q = median(tq);
    last_pinned = p;
    std::cout << fmt::format("{:>12} {:>14.2f} {:>14.2f}\n", format_bytes(size), p, q);
    results.push_back({{"bytes", size}, {"pinned_gbps", p}, {"pageable_gbps", q}});
    if (size > hi / 4) break;
  }
  dev->free(d);
  if (locked) munlock(pinned, hi);
  if (dev->kind() == DeviceKind::kCuda && registered) dev->unregister_host(pinned);
  pool.free(pinned);
  const double peak = dev->kind() == DeviceKind::kCuda
                          ? cudamemcpy_peak_gbps(std::min<std::uint64_t>(hi, 1ull << 30), h2d, o.reps)
                          : 0;
  if (peak > 0) {
    std::cout << fmt::format("reference: cudaMemcpy from cudaMallocHost memory {:.2f} GB/s; "
                             "pinned path / reference = {:.3f}\n",
                             peak, last_pinned / peak);
  }
  if (o.json) {
    nlohmann::json j{{"bench", dir}, {"device", dev->name()}, {"pinned_locked", registered},
                     {"results", results}, {"gbps", last_pinned}};
    if (peak > 0) {
      j["cudamemcpy_gbps"] = peak;
      j["ratio_to_cudamemcpy"] = last_pinned / peak;
    }
    std::cout << j.dump() << "\n";
  }
  return 0;
}

std::function<int()> setup(CLI::App& sub, bool h2d) {
  auto o = std::make_shared<CopyOptions>();
  sub.add_option("--device", o->device, "auto | cuda | sim")->default_val("auto");
  sub.add_option("--min-size", o->min_size, "smallest copy (bytes, 4K, 1M, ...)")->default_val("4K");
  sub.add_option("--max-size", o->max_size, "largest copy (up to 1G; 256M fits this machine)")->default_val("256M");
  sub.add_option("--reps", o->reps, "interleaved repetitions per size (median reported)")->default_val(5)->check(tiermem::cli::whole_number_check())->check(CLI::Range(1, 100000));
  sub.add_flag("--json", o->json, "print one JSON object as the last line");
  return [o, h2d] { return run_copy(*o, h2d); };
}

}  // namespace

TIERMEM_BENCH_COMMAND(h2d, "h2d", "host -> device copy bandwidth, pinned vs pageable",
                      [](CLI::App& sub) { return setup(sub, true); });
TIERMEM_BENCH_COMMAND(d2h, "d2h", "device -> host copy bandwidth, pinned vs pageable",
                      [](CLI::App& sub) { return setup(sub, false); });

}  // namespace tiermem::bench
