// tiermem-bench pipeline — NVMe -> device through pinned bounce chunks (TensorStore's load path) and
// device -> NVMe (its write-back path), against each stage measured alone in the same run.
//
//   cmake --build build --target tiermem-bench
//   build/bin/tiermem-bench pipeline --path /mnt/nvme --tensor-size 64M --tensors 4 --json
//
// Each repetition (interleaved, --reps, medians reported) times, on --tensors tensors of
// --tensor-size bytes:
//   nvme_read   swap-space reads of the tensors' chunks into a host buffer (NVMe alone)
//   h2d         device copies of the same bytes from pinned host memory (copy engine alone)
//   pipeline    TensorStore::acquire(kDevice) of NVMe-home tensors (NVMe -> bounce -> device)
//   d2h, nvme_write, writeback   the reverse: evict() of dirty device copies
// ratio_to_slowest_stage = pipeline GB/s / the slower of its two stages alone. With --json the
// last line is one JSON object: gbps, slowest_stage, slowest_stage_gbps, ratio_to_slowest_stage
// (load direction) and write_* fields for the reverse direction.
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
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
#include "tiermem/io_engine.h"
#include "tiermem/pinned_host_pool.h"
#include "tiermem/swap_space.h"
#include "tiermem/tensor_store.h"
#include "tiermem/zero_plan.h"

namespace tiermem::bench {
namespace {

struct PipeOptions {
  std::string path = "/tmp";
  std::string device = "auto";
  std::string tensor_size = "64M";
  std::string chunk = "8M";
  int chunks = 4;
  int tensors = 4;
  int reps = 3;
  bool o_direct = true;
  bool json = false;
};

int run_pipeline(const PipeOptions& o) {
  const std::uint64_t tbytes = parse_size_within(o.tensor_size, "--tensor-size", "4K", "16G");
  const std::uint64_t chunk = parse_size_within(o.chunk, "--chunk", "4K", "1G");
  if (chunk % 4096 != 0) throw ConfigError("--chunk", o.chunk, "must be a multiple of 4K (4096 bytes)");
  const std::uint64_t total = tbytes * static_cast<std::uint64_t>(o.tensors);
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(o.path, ec)) {  // only a directory gets the bench's own files in it
    std::fprintf(stderr, "tiermem-bench: error: --path '%s' %s: give an existing directory\n",
                 o.path.c_str(), fs::exists(o.path, ec) ? "is not a directory" : "does not exist");
    return 2;
  }
  // Refused up front rather than when allocated: the simulated device's two tensors, the tensors'
  // initial contents and the stage-alone buffer hold about four tensors of host memory, and the
  // swap directory is laid out to twice the tensors' bytes.
  if (const std::uint64_t phys = physical_memory_bytes(); phys > 0 && 4 * tbytes > phys / 2) {
    throw ConfigError("--tensor-size", o.tensor_size,
                      fmt::format("the run holds about four tensors in host memory, {}, more than half of this "
                                  "machine's {}: give {} or less",
                                  format_bytes(4 * tbytes), format_bytes(phys), format_bytes(phys / 8)));
  }
  if (const std::uint64_t drive = drive_free_bytes(o.path); drive > 0 && 2 * total > drive) {
    throw ConfigError("--tensor-size", o.tensor_size,
                      fmt::format("{} tensors of it need {} on the drive under --path {}, which has {} free: give "
                                  "fewer or smaller tensors, or a --path on a larger drive",
                                  o.tensors, format_bytes(2 * total), o.path, format_bytes(drive)));
  }
  fs::path dir = fs::path(o.path) / ("tiermem-bench-pipeline-" + std::to_string(getpid()));
  fs::create_directories(dir);
  struct Cleanup {
    fs::path d;
    ~Cleanup() {
      std::error_code ec;
      fs::remove_all(d, ec);
    }
  } cleanup{dir};

  Config cfg;
  cfg.tiermem.device = o.device;
  cfg.tiermem.device_budget_bytes = tbytes * 2 + (32 << 20);
  std::shared_ptr<Device> dev = make_device(cfg);
  IoEngineOptions io = IoEngineOptions::from_config(cfg);
  io.o_direct = o.o_direct;
  auto engine = make_io_engine(io);
  SwapSpaceOptions so;
  so.initial_bytes_per_path = total * 2 + (64 << 20);
  auto swap = std::make_shared<SwapSpace>(so, std::vector<std::string>{dir.string()}, *engine);

  TensorStoreOptions to;
  to.device_budget_bytes = tbytes + (16 << 20);  // one tensor at a time: every acquire loads
  to.host_budget_bytes = 16 << 20;
  to.pipeline_chunk_bytes = chunk;
  to.pipeline_chunks = o.chunks;
  TensorStore store(to, dev, swap);
  std::vector<TensorId> ids;
  // Same non-zero contents as the stage-alone extents (virtual disks may read zeros faster).
  std::vector<std::byte> init(tbytes, std::byte{7});
  for (int i = 0; i < o.tensors; ++i) {
    TensorSpec spec;
    spec.initial = init;
    spec.name = "w" + std::to_string(i);
    spec.bytes = tbytes;
    spec.home = Tier::kNvme;
    ids.push_back(store.register_tensor(spec));
  }
  init = {};

  // Stage-alone resources: extents of the same chunking, a pinned host buffer, a device buffer.
  std::vector<std::vector<SwapExtent>> ext(static_cast<std::size_t>(o.tensors));
  PinnedHostPoolOptions po;
  po.budget_bytes = PinnedHostPool::allocation_size(tbytes);
  po.verify_huge_pages = true;  // the pool's 2 MiB pages are then known to the engine (piece sizing)
  PinnedHostPool pool(po);
  char* host = static_cast<char*>(pool.allocate(tbytes));
  std::memset(host, 7, tbytes);
  engine->register_buffers(host, po.budget_bytes, pool.regions().front().contiguous_bytes);
  if (dev->kind() == DeviceKind::kCuda) dev->register_host(host, po.budget_bytes);
  for (auto& v : ext) {
    for (std::uint64_t off = 0; off < tbytes; off += chunk) {
      v.push_back(swap->allocate(std::min(chunk, tbytes - off)));
      swap->write(v.back(), host + off, std::min(chunk, tbytes - off)).wait();
    }
  }
  void* dbuf = dev->allocate(tbytes);

  auto gbps = [&](double s) { return static_cast<double>(total) / s / 1e9; };
  std::vector<double> r_nvme, r_h2d, r_pipe, w_d2h, w_nvme, w_pipe;
  for (int rep = 0; rep < o.reps; ++rep) {
    double t0 = now_s();
    for (auto& v : ext) {
      std::vector<IoRequest> reqs;
      // Same concurrency as the pipeline: at most `chunks` chunk reads in flight.
      for (std::size_t k = 0; k < v.size(); ++k) {
        if (reqs.size() >= static_cast<std::size_t>(o.chunks)) reqs[k - o.chunks].wait();
        reqs.push_back(swap->read(v[k], host + k * chunk, v[k].bytes));
      }
      wait_all(reqs);
    }
    r_nvme.push_back(gbps(now_s() - t0));
    t0 = now_s();
    for (int i = 0; i < o.tensors; ++i) dev->copy_h2d(dbuf, host, tbytes);
    r_h2d.push_back(gbps(now_s() - t0));
    t0 = now_s();
    for (TensorId id : ids) {
      TensorStore::Pin p = store.acquire(id, Tier::kDevice);
      p.release();
      store.evict(id, Tier::kDevice);  // clean: dropped, no I/O
    }
    r_pipe.push_back(gbps(now_s() - t0));

    t0 = now_s();
    for (int i = 0; i < o.tensors; ++i) dev->copy_d2h(host, dbuf, tbytes);
    w_d2h.push_back(gbps(now_s() - t0));
    t0 = now_s();
    for (auto& v : ext) {
      std::vector<IoRequest> reqs;
      for (std::size_t k = 0; k < v.size(); ++k) {
        if (reqs.size() >= static_cast<std::size_t>(o.chunks)) reqs[k - o.chunks].wait();
        reqs.push_back(swap->write(v[k], host + k * chunk, v[k].bytes));
      }
      wait_all(reqs);
    }
    w_nvme.push_back(gbps(now_s() - t0));
    double tw = 0;
    for (TensorId id : ids) {
      TensorStore::Pin p = store.acquire(id, Tier::kDevice);
      p.mark_dirty();
      p.release();
      double s = now_s();
      store.evict(id, Tier::kDevice);  // dirty: device -> bounce -> NVMe
      tw += now_s() - s;
    }
    w_pipe.push_back(gbps(tw));
  }
  dev->free(dbuf);
  for (auto& v : ext) {
    for (auto& x : v) swap->free(x);
  }
  engine->unregister_buffers(host);
  if (dev->kind() == DeviceKind::kCuda) dev->unregister_host(host);
  pool.free(host);

  double nv = median(r_nvme), h = median(r_h2d), p = median(r_pipe);
  double d = median(w_d2h), nw = median(w_nvme), w = median(w_pipe);
  std::string slow = nv <= h ? "nvme_read" : "h2d";
  double slow_g = std::min(nv, h);
  std::string wslow = nw <= d ? "nvme_write" : "d2h";
  double wslow_g = std::min(nw, d);
  TensorStoreStats st = store.stats();
  std::cout << fmt::format(
      "pipeline: device {}, engine {}, {} tensors x {}, chunk {} x {}, o_direct {}, {} reps (median)\n"
      "  load   nvme_read {:.2f} GB/s  h2d {:.2f} GB/s  pipeline {:.2f} GB/s  ratio_to_slowest_stage {:.3f} ({})\n"
      "  store  d2h {:.2f} GB/s  nvme_write {:.2f} GB/s  pipeline {:.2f} GB/s  ratio_to_slowest_stage {:.3f} ({})\n"
      "  peak device resident {} of budget {}\n",
      dev->name(), engine->name(), o.tensors, format_bytes(tbytes), o.chunks, format_bytes(chunk), o.o_direct,
      o.reps, nv, h, p, p / slow_g, slow, d, nw, w, w / wslow_g, wslow,
      format_bytes(st.peak_resident_bytes[0]), format_bytes(st.budget_bytes[0]));
  if (o.json) {
    nlohmann::json j{{"bench", "pipeline"},
                     {"device", dev->name()},
                     {"engine", engine->name()},
                     {"tensor_bytes", tbytes},
                     {"tensors", o.tensors},
                     {"chunk_bytes", chunk},
                     {"chunks", o.chunks},
                     {"nvme_read_gbps", nv},
                     {"h2d_gbps", h},
                     {"gbps", p},
                     {"slowest_stage", slow},
                     {"slowest_stage_gbps", slow_g},
                     {"ratio_to_slowest_stage", p / slow_g},
                     {"d2h_gbps", d},
                     {"nvme_write_gbps", nw},
                     {"write_gbps", w},
                     {"write_slowest_stage", wslow},
                     {"write_slowest_stage_gbps", wslow_g},
                     {"write_ratio_to_slowest_stage", w / wslow_g}};
    std::cout << j.dump() << "\n";
  }
  return 0;
}

}  // namespace

TIERMEM_BENCH_COMMAND(pipeline, "pipeline",
                      "NVMe -> device through pinned bounce chunks (and back) vs each stage alone",
                      [](CLI::App& sub) -> std::function<int()> {
                        auto o = std::make_shared<PipeOptions>();
                        sub.add_option("--path", o->path, "directory for the swap file (an NVMe mount)")->default_val("/tmp");
                        sub.add_option("--device", o->device, "auto | cuda | sim")->default_val("auto");
                        sub.add_option("--tensor-size", o->tensor_size, "bytes per tensor")->default_val("64M");
                        sub.add_option("--tensors", o->tensors, "tensors per repetition")->default_val(4)->check(tiermem::cli::whole_number_check())->check(CLI::Range(1, 100000));
                        sub.add_option("--chunk", o->chunk, "pipeline chunk (tiermem.pipeline_chunk_bytes)")->default_val("8M");
                        sub.add_option("--chunks", o->chunks, "bounce chunks (tiermem.pipeline_chunks)")->default_val(4)->check(tiermem::cli::whole_number_check())->check(CLI::Range(1, 1024));
                        sub.add_option("--reps", o->reps, "interleaved repetitions (median)")->default_val(3)->check(tiermem::cli::whole_number_check())->check(CLI::Range(1, 100000));
                        sub.add_option("--o-direct", o->o_direct, "open the swap file with O_DIRECT")->default_val(true)->check(tiermem::cli::bool_check());
                        sub.add_flag("--json", o->json, "print one JSON object as the last line");
                        return [o] { return run_pipeline(*o); };
                      });

}  // namespace tiermem::bench
