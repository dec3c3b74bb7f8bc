// src/plan/update_replay.h — the planner's replay of the overlapped optimizer step's forward
// (tiermem.overlap_optimizer_step): each module's deferred update at its gather, or running ahead
// of it beside the previous module's compute, and the waits for the optimizer state the host pool
// cannot keep. predict_time (plan.cc) calls it; docs/plan.md, "Time", says what it models.
//
// gated_read_wait: the forward's wait for the NVMe-homed optimizer state (and gradient partitions)
// the host pool cannot keep, with the overlapped optimizer step. The Prefetcher's host plan keeps
// the modules the forward updates first and streams the last ones (miss_bytes in all), and their
// reads can begin only as room frees: the pool's slack at the forward's start, then each module's
// gradient partition as its deferred AdamW retires it (pool_grad_bytes in all). The drive serves
// one request stream in the order the forward needs it: a streamed module's read at the NVMe read
// rate, and, once its update is done and a later streamed module needs the room, the write-back of
// its updated optimizer state (write_share of its streamed bytes: the gradient partitions are not
// written back) at the write rate — a trace of gpt2 at the default budgets shows those write-backs
// beside the forward's last reads, not in the backward
// (docs/notes/2026-12-02-planner-handoff-against-backward.md). A module whose state has not arrived
// when its update is due waits for it, and where the retired partitions cannot make the room by
// then, the room is taken at once (the engine writes back updated state in its place). write_gbps
// 0: the drive reads at read_gbps beside the write-backs (the profile's
// nvme_read_beside_writes_gbps), which then take none of the reads' time.
// Modules are numels' order (for tiermem-train's GPT: embed, the blocks, ln_f); the forward
// compute of one micro-batch (fwd_compute_s) follows the gathers of the modules after the first,
// split by element count (forward_compute_shares: tiermem-train's GPT's blocks evenly); AdamW and
// the bytes are split by element count. docs/plan.md, "Time".
//
// `ahead`: the update running ahead (one rank, memory the CPU addresses; UpdateScheduler::
// start_ahead): module i's update (its reads' wait and its AdamW) starts on the engine's update
// thread at module i - 1's gather, beside that module's forward compute; gather i waits only for
// what is left of it. Returned then: the forward's whole wait for the updates (AdamW not hidden
// included; the first module's update runs at its own gather), not the reads' alone. The update
// beside the compute costs the compute nothing: on a SimDevice, whose model computes on the host's
// cores, a traced gpt2 run's forward blocks took no longer with the updates beside them than in the
// first step without them (docs/notes/2026-12-05-planner-second-step-and-torch-runs.md).
//
// Units: seconds, bytes, GB/s (1e9 bytes/s); element counts. Thread-safety: pure functions.
// Errors: none (empty or all-zero module lists give no wait).
#pragma once

#include <cstddef>
#include <vector>

namespace tiermem::plan::detail {

// Each module's share of a micro-batch's forward compute, run after its gather: none for the
// first (the embedding's lookup), the others by element count (the linear layers' FLOPs; for
// tiermem-train's GPT the blocks evenly and the final norm next to nothing).
std::vector<double> forward_compute_shares(const std::vector<std::size_t>& numels);

// `numels`: the trained modules' elements (a frozen module's 0: no update, no optimizer state);
// `compute_share`: forward_compute_shares of every module.
double gated_read_wait(const std::vector<std::size_t>& numels, const std::vector<double>& compute_share,
                       double miss_bytes, double nvme_bytes, double pool_grad_bytes, double slack, double fwd_compute_s,
                       double adam_s, double read_gbps, double write_gbps, double write_share, bool ahead);

}  // namespace tiermem::plan::detail
