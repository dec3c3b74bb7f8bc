// src/plan/update_replay.cc — the overlapped step's forward replayed module by module
// (update_replay.h).
#include "plan/update_replay.h"

#include <algorithm>
#include <numeric>
#include <utility>

namespace tiermem::plan::detail {

std::vector<double> forward_compute_shares(const std::vector<std::size_t>& numels) {
  std::vector<double> w(numels.size(), 0.0);
  double rest = 0;
  for (std::size_t i = 1; i < numels.size(); ++i) rest += static_cast<double>(numels[i]);
  for (std::size_t i = 1; i < numels.size() && rest > 0; ++i) w[i] = static_cast<double>(numels[i]) / rest;
  return w;
}

double gated_read_wait(const std::vector<std::size_t>& numels, const std::vector<double>& compute_share,
                       double miss_bytes, double nvme_bytes, double pool_grad_bytes, double slack, double fwd_compute_s,
                       double adam_s, double read_gbps, double write_gbps, double write_share, bool ahead) {
  double wait = 0;
  const double total = static_cast<double>(std::accumulate(numels.begin(), numels.end(), std::size_t{0}));
  if (total <= 0 || (!ahead && (miss_bytes <= 0 || read_gbps <= 0))) return 0;
  if (read_gbps <= 0) miss_bytes = 0;
  const std::size_t n = numels.size();
  std::vector<double> miss(n, 0.0);
  double left = std::min(miss_bytes, nvme_bytes);
  std::size_t last_miss = n;  // the last streamed module: its write-back can wait for the backward
  for (std::size_t i = n; i-- > 0 && left > 0;) {  // the last modules the forward updates
    miss[i] = std::min(left, nvme_bytes * static_cast<double>(numels[i]) / total);
    left -= miss[i];
    if (miss[i] > 0 && last_miss == n) last_miss = i;
  }
  std::vector<std::pair<double, double>> freed;  // (time, room freed by then), in time order
  double t = 0, reads_free_at = 0, need = 0, retired = 0;
  double last_gather = 0;  // ahead: when the driving thread left the previous gather
  std::size_t next_room = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const double f = static_cast<double>(numels[i]) / total, a = adam_s * f;
    if (f == 0) {  // frozen: nothing to update; its compute follows its gather
      t += fwd_compute_s * compute_share[i];
      continue;
    }
    // Where the update starts: at this module's gather, or (ahead) at the previous one's.
    const double start = ahead && i > 0 ? last_gather : t;
    double ready = start;
    if (miss[i] > 0) {
      need += miss[i];
      // The first moment the freed room holds what is read so far (need only grows, so the scan
      // resumes where it stopped); else the room is taken at once, when the update is due.
      while (next_room < freed.size() && slack + freed[next_room].second < need) ++next_room;
      const double room_at = slack >= need ? 0 : next_room < freed.size() ? freed[next_room].first : start;
      const double done = std::max(reads_free_at, room_at) + miss[i] / (read_gbps * 1e9);
      reads_free_at = done;
      ready = std::max(ready, done);
    }
    double end = 0;  // when the update is done
    if (ahead) {  // the gather joins what is left of it
      end = ready + a;
      if (end > t) { wait += end - t; t = end; }
      last_gather = t;
    } else {  // at its gather, on the driving thread; AdamW is priced apart: the wait is the reads'
      if (ready > t) { wait += ready - t; t = ready; }
      t += a;
      end = t;
    }
    if (miss[i] > 0 && i != last_miss && write_gbps > 0) {  // its updated state makes room for the next reads
      reads_free_at = std::max(reads_free_at, end) + write_share * miss[i] / (write_gbps * 1e9);
    }
    retired += pool_grad_bytes * f;
    freed.emplace_back(end, retired);
    t += fwd_compute_s * compute_share[i];
  }
  return wait;
}

}  // namespace tiermem::plan::detail
