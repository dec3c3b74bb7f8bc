// src/zero/update_scheduler.h — when each module's optimizer update runs: eagerly in step(),
// deferred to the module's next gather (the overlapped step), ahead of that gather on a thread of
// its own, or during the backward pass once the module's gradient is complete (the updates in
// backward). The update itself is the optimizer stepper's (optimizer_stepper.h), run through the
// hooks the engine gives; this part owns the deferred updates (DeferredUpdates,
// deferred_updates.h), the update running ahead (a HelperTask, helper_task.h), the state of the
// updates in backward, and their counters.
//
// The overlapped step (tiermem.overlap_optimizer_step): step() defers a stored module's update
// (defer) instead of running it; apply(m) runs module m's, if any, exactly once — at m's next
// gather (before_gather), its next reduce_gradients, an export or rewrite of its state, zero_grad,
// or the next step (apply_all). An import of the whole state drops them (drop_all).
//
// The update running ahead (start_ahead): after the forward gather of module `after`, the update
// of the next module still pending starts on this part's thread while the driving thread
// computes `after`, when nothing but its own pins can stand in its way: one rank (no collective),
// memory the CPU addresses (no device-staging buffers, which are the driving thread's), the host
// optimizer, and room for its working shard and buffer_count sub-groups beside every pin held now
// (hooks.fits_now; the driving thread pins nothing more before join(), so the update never waits
// for a pin of the driving thread). The update's accesses come between this gather and the next,
// as they did at the next gather, so the store's recorded order of accesses is kept.
//
// The updates in backward (ZeroEngine::step_in_backward, tiermem.update_in_backward): at the
// accumulation boundary, without gradient clipping or an fp16 overflow check, nothing a module's
// update reads depends on another module's gradient. So each module's update can run as soon as
// its own gradient is complete, during the backward pass, rather than in step() or at its next
// gather: its gradient partitions are consumed while still in host memory (never written to
// NVMe), and its state's reads and write-backs overlap backward's compute, where the drive is
// otherwise idle. It is the first half of SuperOffload's speculation-then-validation
// (SuperOffload, 2025: the update runs before the global norm is known, and is redone when a clip
// turns out to apply): with no clip there is nothing to validate, and nothing is ever redone.
// Armed (arm_backward) until step() or zero_grad (disarm_backward). A module's gradient is
// complete once its last hand-off has finished — counted at the next reduce_gradients, which waits
// for it (note_gradient), never when it happens to finish, so every step takes the same decisions
// and the store's recorded trace holds. At each backward gather (start_in_backward) the oldest
// complete module no more than twice the gathered module's size starts its update on this part's
// thread, under the rule of the update running ahead; a module gathered again after a gradient of
// it came is left to step().
//
// Every update started on the thread is joined by the next engine call (join()): one at a time.
//
// Units: modules are engine module indices; times in ns; counts. Ownership: reads and writes the
// engine's modules (ZeroModule::stepped_in_backward, replay; reads numel, stored, grad_calls)
// through a reference that must outlive it. Thread-safety: every call from the engine's driving
// thread; the update started on this part's thread (hooks.run) uses the engine's state the
// driving thread leaves alone until join(). Errors: tiermem::Error for a module index outside
// [0, modules), refuse_half_step's and note_gradient's refusals (below); the hooks' errors, an
// update's on the thread rethrown by join().
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <utility>
#include <vector>

#include "tiermem/adam.h"
#include "tiermem/tensor_store.h"
#include "zero/deferred_updates.h"
#include "zero/helper_task.h"
#include "zero/zero_types.h"

namespace tiermem {
struct ZeroStats;
}

namespace tiermem::detail {

class UpdateScheduler {
 public:
  // What the scheduler asks of the engine; each set once, none empty.
  struct Hooks {
    // Module `module`'s update with `ap`, its working shard written at `publish` (nullopt: the
    // engine's publish tier); `pending(q)`: whether module q's update is still to come (what
    // to read ahead). OptimizerStepper::update_module. May run on the scheduler's thread.
    std::function<void(int module, const AdamParams& ap, Phase phase, std::optional<Tier> publish,
                       const std::function<bool(int)>& pending)>
        run;
    // Whether module m's update, its shard written at `publish`, has room to run beside the
    // driving thread now (OptimizerStepper::module_fits_now).
    std::function<bool(const ZeroModule& m, Tier publish)> fits_now;
    // Where module m's next gather reads its working shard (DeviceStaging::gather_tier).
    std::function<Tier(const ZeroModule& m)> gather_tier;
    // Module m's accesses outside the step shown to the store now (OptimizerStepper::replay).
    std::function<void(ZeroModule& m)> replay;
    // The driving thread's waits so far, ns (ZeroStats::driving_stall_ns): what an update's
    // caller waited is counted from it.
    std::function<std::uint64_t()> driving_stall_ns;
  };

  // `shape`: world, opaque (read at each call); `mean_over_micro_batches`: the updates in
  // backward divide by the micro-batches (ZeroEngineOptions).
  UpdateScheduler(const EngineShape& shape, std::vector<ZeroModule>& mods, bool mean_over_micro_batches, Hooks hooks)
      : shape_(shape), mods_(mods), mean_over_micro_batches_(mean_over_micro_batches), hooks_(std::move(hooks)) {}

  // Grows to `modules` modules (registration adds them one at a time); none pending.
  void resize(std::size_t modules) { deferred_.resize(modules); }

  // --- the overlapped step
  // Module `module`'s update waits for its next use, with `ap` (this step's scalars).
  void defer(int module, const AdamParams& ap) { deferred_.defer(module, ap); }
  bool pending(int module) const { return deferred_.pending(module); }
  std::size_t pending_count() const { return deferred_.count(); }
  // Module `module`'s pending update, if any, run now on the calling thread (once).
  void apply(int module, Phase phase, std::optional<Tier> publish = std::nullopt);
  void apply_all(Phase phase);  // every pending update, in module order
  // Every pending update dropped unapplied, and every module's accesses outside the step
  // forgotten (the whole state is being replaced: the next forward's order is not the recorded one).
  void drop_all();
  // A step ended deferring its updates: true the first time only (the engine re-records the
  // store's trace once).
  bool first_deferring_step() { return deferred_.first_deferring_step(); }
  // Before module `module`'s working shard is read by a gather of `phase`: its pending update
  // (written where the gather reads, on a host-addressable device; timed into
  // ZeroStats::deferred_update_ns and _stall_ns), else the replay of its accesses outside the
  // step (not for a gather outside the step).
  void before_gather(int module, Phase phase);

  // --- the update running ahead
  // After the forward gather of module `after`: the next pending module's update starts on the
  // scheduler's thread when it can run there (see the top). No-op while one runs.
  void start_ahead(int after);
  // Waits for the update on the thread, if any (every engine call but a forward gather's compute
  // does, first); the wait is counted in ZeroStats::deferred_update_ns and _stall_ns. Rethrows
  // the update's error.
  void join();
  std::uint64_t waited_ns() const { return task_.waited_ns(); }  // every join's wait, summed

  // --- the updates in backward
  bool backward_armed() const { return bwd_.armed; }
  // Armed for this step with `ap` (its grad_scale set at the first update). Requires !armed.
  void arm_backward(const AdamParams& ap);
  // The learning rate of an armed step whose updates have not started (later: kept).
  void set_backward_lr(float lr) {
    if (bwd_.stepped.empty()) bwd_.ap.lr = lr;
  }
  // Module `module`'s reduce_gradients begins (after the previous hand-off was waited for):
  // `complete`, its gradient is added already (no hand-off). Error when the module was updated
  // in this backward already (its gradient was taken as complete).
  void note_gradient(int module, bool complete);
  // At the backward gather of `gathered`: the oldest complete module's update starts on the
  // scheduler's thread when it can run there (see the top).
  void start_in_backward(int gathered);
  int updated_in_backward() const { return static_cast<int>(bwd_.stepped.size()); }
  const AdamParams& backward_params() const { return bwd_.ap; }  // the updates' scalars
  int backward_micro_batches() const { return bwd_.micro; }      // ... their micro-batches
  // Throws Error naming `call` while a step is half done: modules updated in backward, step() not
  // yet called (their state and params are this step's, the others' the last step's).
  void refuse_half_step(const char* call) const;
  // The step's end (or zero_grad before any update): nothing armed, the updated modules' marks
  // cleared.
  void disarm_backward();
  // A step with updates in backward: true the first time only (the engine re-records the trace).
  bool first_step_with_backward_updates() { return updated_in_backward() > 0 && !std::exchange(bwd_.seen, true); }

  // deferred_update_ns, deferred_update_stall_ns, deferred_updates_ahead, updates_in_backward
  // (added to `s`).
  void add_stats(ZeroStats& s) const;

 private:
  struct BackwardStep {
    bool armed = false;
    AdamParams ap;
    std::deque<int> ready;  // complete and not yet updated, oldest first
    // Each module's part this step: reduced, or gathered again after a gradient came (left to step()).
    enum ModuleState : unsigned char { kNone, kReduced, kLeftToStep };
    std::vector<ModuleState> state;
    std::vector<int> stepped;  // updated so far (ZeroModule::stepped_in_backward set)
    int handing = -1;          // the module whose hand-off may be in flight (-1: none)
    int micro = 0;             // the micro-batches the updates divided by (mean_over_micro_batches)
    bool seen = false;         // a step has had updates in backward
  };
  ZeroModule& module(int m) { return mods_[static_cast<std::size_t>(m)]; }
  // Starts module `next`'s update with `ap` on the thread, its shard written at `at`.
  void start(int next, const AdamParams& ap, Tier at, std::vector<bool> still_pending);

  const EngineShape& shape_;
  std::vector<ZeroModule>& mods_;
  const bool mean_over_micro_batches_;
  const Hooks hooks_;
  DeferredUpdates deferred_;
  BackwardStep bwd_;
  std::uint64_t update_ns_ = 0, update_stall_ns_ = 0;  // the driving thread's time in updates
  std::uint64_t ahead_ = 0, in_backward_ = 0;          // updates started on the thread
  // Last, so that it is destroyed first: its task uses the members above.
  HelperTask task_{"a deferred update running ahead"};
};

}  // namespace tiermem::detail
