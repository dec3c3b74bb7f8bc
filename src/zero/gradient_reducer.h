// src/zero/gradient_reducer.h — the engine's gradient reduce path: a module's gradient, handed
// over by reduce_gradients, reduced over the ranks and added into this rank's gradient storage,
// by stage and world:
//   stages 0-1       added into the module's full fp32 buffer (ZeroModule::full_grad); the
//                    collective runs once per step (finish_step: all-reduce at stage 0,
//                    reduce-scatter into shard_grad at stage 1);
//   stages 2-3, 1 rank    added straight into the sub-groups' gradient partitions (store
//                    tensors); reduce_gradients taking the buffer (hand_off) adds on a one-thread
//                    pool while the caller goes on, at most one call in flight;
//   stages 2-3, several ranks  bucketed reduce-scatters (chunks: make_reduce_chunks; send
//                    buffers: pack_reduce_bucket, reduce_bucket.h), each received part added into the
//                    partitions as it completes, in issue order, at most max_inflight buckets in
//                    flight (all but one waited for at once without overlap_comm).
// Adding into the partitions folds the clipping norm (NormTracker::fold) as each sub-group's
// gradient completes.
//
// Buffers: send/receive buffers of buckets in flight, the hand-off's buffer and one spare (the
// zeroed buffer gradient_buffer() hands out again) are the reducer's, counted in host_bytes().
// The partitions are the store's, pinned only while added into. Completion: a module's gradient
// is in its storage once sync() returns (and before the next reduce of the same partitions).
// Thread-safety: every call from the engine's driving thread; the hand-off's task runs on the
// reducer's own thread, touching only the sub-groups and partitions it was given (pinned or announced
// to the store on the driving thread, in call order) and the NormTracker, until wait_hand_off().
// Errors: a failed collective's CommError from the call that waits for it (sync, the next reduce);
// the hand-off's error from the next call that waits for it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <vector>

#include "tiermem/communicator.h"
#include "tiermem/tensor_store.h"
#include "tiermem/zero_engine.h"
#include "zero/helper_task.h"
#include "zero/norm_tracker.h"
#include "zero/zero_types.h"

namespace tiermem::detail {

class GradientReducer {
 public:
  struct Options {
    std::size_t bucket_elems = 0;  // zero_optimization.reduce_bucket_size_elems
    bool overlap = true;           // zero_optimization.overlap_comm
    int max_inflight = 2;          // ZeroEngineOptions::max_inflight_buckets (at least 1 used)
    std::size_t alignment_elems = 1;
  };
  // `store`: the engine's (made after the reducer; set before the first reduce at stage 2-3).
  GradientReducer(Communicator& comm, const EngineShape& shape, Options opts, std::vector<ZeroModule>& mods,
                  std::vector<SubGroup>& sub_groups, const std::unique_ptr<TensorStore>& store, NormTracker& norm,
                  HostPeakSampler sample_host_peak);
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;
  ~GradientReducer();  // joins the hand-off thread (a task still running finishes first)

  // Module `module`'s full gradient (numel elements, host memory read during the call only),
  // reduced and added by stage and world (see the top). Buckets may still be in flight on return.
  void reduce(int module, std::span<const float> grad);
  // The same for stages 2-3 on one rank, taking the buffer: the pins are taken now (in call
  // order), the additions run on the reducer's thread. The buffer comes back zeroed as the spare.
  void hand_off(int module, std::vector<float>&& grad);
  // The same with memory the caller lends: `grad` is read (never written) on the reducer's
  // thread, which drops `keep` (the caller's hold on that memory) once its additions are done.
  void lend(int module, std::span<const float> grad, std::shared_ptr<const void> keep);
  // A zeroed buffer of `numel` elements: the spare when it is large enough, else a new one.
  std::vector<float> buffer(std::size_t numel);
  void wait_hand_off();  // rethrows the hand-off's error
  // With `on`, a hand-off started from now keeps its partitions pinned until wait_hand_off()
  // (the driving thread) instead of letting them go when its additions are done: the pins held
  // then change only on the driving thread, in call order (ZeroEngine::step_in_backward's room
  // checks take the same decisions on every step).
  void hold_pins(bool on) { hold_pins_ = on; }
  // Nanoseconds the driving thread has waited in wait_hand_off() (cumulative).
  std::uint64_t waited_ns() const { return task_.waited_ns(); }
  void sync();           // the hand-off and every bucket in flight complete
  void drop_spare() { std::vector<float>().swap(spare_); }  // not held through the forward pass
  // Stages 0-1 at the step: every module's full gradient reduced (the collective they defer);
  // returns the micro-batches accumulated (the most reduce calls any module had).
  int finish_step();

  // Host bytes the reducer holds now (buckets in flight, the hand-off's buffer, the spare).
  std::uint64_t host_bytes() const;
  void add_stats(ZeroStats& s) const;  // reduce_scatter_calls

 private:
  struct Bucket {  // one reduce-scatter in flight
    CommHandle handle;
    std::vector<float> send, recv;
    int module = 0;
    std::size_t begin = 0;  // shard-local offset of recv[0]
  };
  // One sub-group's share of an addition: its partition pinned (or, fresh, announced for overwrite).
  struct Work {
    int sub_group = 0;
    TensorStore::Pin pin;
    std::size_t lo = 0, hi = 0;  // shard-local range the call covers within the sub-group
    bool fresh = false;          // acquired for overwrite: elements outside [lo, hi) are zeroed
  };
  // Adds `n` fp32 values at shard-local offset `begin` of module m into its gradient sub-groups:
  // pin (the store accesses, on the driving thread) then add (the arithmetic and the folded norm;
  // any one thread at a time, in call order).
  void accumulate(int m, std::size_t begin, const float* src, std::size_t n);
  std::vector<Work> pin(int m, std::size_t begin, std::size_t n);
  // `clear`: nullptr, or src itself (the caller's to clobber), whose every element read is then
  // left zero; returns how many were cleared.
  std::size_t add(std::vector<Work>& work, std::size_t begin, const float* src, float* clear = nullptr);
  void complete_front();
  // hand_off and lend: pins now (driving thread), adds on the reducer's thread, clearing `clear`
  // (nullptr or grad's own memory) as it reads, then drops `keep`.
  void start_task(int module, std::span<const float> grad, std::shared_ptr<const void> keep, float* clear);

  Communicator& comm_;
  const EngineShape& shape_;
  const Options opts_;
  std::vector<ZeroModule>& mods_;
  std::vector<SubGroup>& sub_groups_;
  const std::unique_ptr<TensorStore>& store_;
  NormTracker& norm_;
  const HostPeakSampler sample_host_peak_;

  std::deque<Bucket> inflight_;
  std::uint64_t bucket_bytes_live_ = 0;
  std::shared_ptr<std::vector<float>> task_buf_;  // zeroed by the task after its additions
  std::shared_ptr<std::vector<Work>> task_work_;  // the pins a hand-off holds until waited for (hold_pins)
  bool hold_pins_ = false;
  std::uint64_t task_bytes_ = 0;
  std::vector<float> spare_;  // once the task is waited for: what buffer() hands out again
  std::uint64_t reduce_scatter_calls_ = 0;
  // Last, so that it is destroyed first (the hand-off's task uses the members above).
  HelperTask task_{"the gradient hand-off"};
};

}  // namespace tiermem::detail
