// src/zero/step_io_meter.h — the last optimizer step's I/O, wall time and bound (ZeroStats'
// last_step_* figures), as bookkeeping of its own.
//
// The contract: a step's window opens at the first in-step call after the previous step() ended
// (a gather or prefetch_gather of the forward or backward pass, a reduce_gradients, or step()
// itself when nothing came before it; evaluation gathers, Phase::kOutsideStep, do not open it) and
// closes when step() returns. The figures of the last closed window are the differences of the
// counters the engine passes (NVMe bytes read and written; the driving thread's waits: its own
// store stalls and its waits for the engine's helper threads, not those threads' own stalls,
// which overlap its work) between its two ends, its wall time, and from them:
//   compute_ns  = wall_ns - stall_ns (0 if the waits exceed the wall)
//   io_bound_ns = read_bytes / read_gbps + written_bytes / write_gbps, in ns — the time the NVMe
//                 needs for the step's traffic at the given rates; 0 when either rate is unknown
//                 (0).
// Time between a step's end and the next window (checkpoints, evaluation, data loading) is in no
// step's figures; its I/O neither.
//
// No I/O: the caller passes the counters and the times (ns on one monotonic clock), so tests drive
// it with made-up values. Units: bytes, ns, GB/s = 1e9 bytes/s. Thread-safety: none; the
// engine's driving thread only. No errors.
#pragma once

#include <cstdint>

namespace tiermem {
struct Config;
struct ZeroStats;
}

namespace tiermem::detail {

class StepIoMeter {
 public:
  // The store's cumulative counters at one moment (TensorStoreStats).
  struct Counters {
    std::uint64_t nvme_read_bytes = 0, nvme_written_bytes = 0, stall_ns = 0;
  };
  // NVMe rates in GB/s; 0: unknown (no bound is computed).
  StepIoMeter(double read_gbps = 0, double write_gbps = 0)
      : read_gbps_(read_gbps), write_gbps_(write_gbps) {}

  // True between open() and close(): an in-step call need not read the counters again.
  bool is_open() const { return open_; }
  // Opens the window at `now_ns` with the counters then (ignored when open).
  void open(std::uint64_t now_ns, const Counters& c);
  // Closes the window at `now_ns` (opened now with the same counters if it was not open): the
  // last step's figures become this window's.
  void close(std::uint64_t now_ns, const Counters& c);

  // Writes the last step's figures and the rates into s (last_step_*, nvme_*_gbps).
  void add_stats(ZeroStats& s) const;

 private:
  double read_gbps_, write_gbps_;
  bool open_ = false;
  std::uint64_t start_ns_ = 0;
  Counters start_;
  // The last closed window.
  Counters last_;
  std::uint64_t last_wall_ns_ = 0;
};

// A meter at the config's NVMe rates (resolve_nvme_rates, tiermem/config.h: tiermem.machine_profile
// or tiermem.nvme_read_gbps / nvme_write_gbps). Reads the machine profile the config names: the
// one function here that does I/O, and throws ConfigError when it cannot.
StepIoMeter step_io_meter_for(const Config& config);

}  // namespace tiermem::detail
