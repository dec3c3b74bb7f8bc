// src/zero/step_io_meter.cc — the last step's I/O figures (step_io_meter.h).
#include "zero/step_io_meter.h"

#include <cmath>

#include "tiermem/config.h"
#include "tiermem/zero_engine.h"

namespace tiermem::detail {

void StepIoMeter::open(std::uint64_t now_ns, const Counters& c) {
  if (open_) return;
  open_ = true;
  start_ns_ = now_ns;
  start_ = c;
}

void StepIoMeter::close(std::uint64_t now_ns, const Counters& c) {
  open(now_ns, c);
  auto delta = [](std::uint64_t now, std::uint64_t then) { return now >= then ? now - then : 0; };
  last_.nvme_read_bytes = delta(c.nvme_read_bytes, start_.nvme_read_bytes);
  last_.nvme_written_bytes = delta(c.nvme_written_bytes, start_.nvme_written_bytes);
  last_.stall_ns = delta(c.stall_ns, start_.stall_ns);
  last_wall_ns_ = delta(now_ns, start_ns_);
  open_ = false;
}

void StepIoMeter::add_stats(ZeroStats& s) const {
  s.last_step_nvme_read_bytes = last_.nvme_read_bytes;
  s.last_step_nvme_written_bytes = last_.nvme_written_bytes;
  s.last_step_stall_ns = last_.stall_ns;
  s.last_step_wall_ns = last_wall_ns_;
  s.last_step_compute_ns = last_wall_ns_ > last_.stall_ns ? last_wall_ns_ - last_.stall_ns : 0;
  s.nvme_read_gbps = read_gbps_;
  s.nvme_write_gbps = write_gbps_;
  s.last_step_io_bound_ns = 0;
  if (read_gbps_ > 0 && write_gbps_ > 0) {  // bytes / (GB/s) = ns
    s.last_step_io_bound_ns = static_cast<std::uint64_t>(
        std::llround(static_cast<double>(last_.nvme_read_bytes) / read_gbps_ +
                     static_cast<double>(last_.nvme_written_bytes) / write_gbps_));
  }
}

StepIoMeter step_io_meter_for(const Config& config) {
  const NvmeRates r = resolve_nvme_rates(config);
  return StepIoMeter(r.read_gbps, r.write_gbps);
}

}  // namespace tiermem::detail
