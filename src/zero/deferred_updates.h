// src/zero/deferred_updates.h — the optimizer stepper's deferred updates (the overlapped step,
// tiermem.overlap_optimizer_step), as bookkeeping of their own.
//
// The contract: step() may leave a module's AdamW update pending (defer) instead of applying it,
// with that step's scalars. The update is applied exactly once, and before anything reads or
// overwrites the module's optimizer state or working parameters: UpdateScheduler::apply(m)
// takes it (take) at the module's next gather, its next reduce_gradients, an export of its state
// or gradient, set_module_params, zero_grad, or the next step (which applies every one left). An
// import of the whole state drops them (drop_all): the imported state replaces what they would
// have updated.
// Every pending update belongs to the latest step: step() applies the earlier ones before it
// defers new ones, so one set of scalars serves them all.
//
// No I/O and no arithmetic here: the caller runs the update. Units: modules are engine module
// indices. Thread-safety: none; the engine's driving thread only. Errors: a module index outside
// [0, modules) throws tiermem::Error.
#pragma once

#include <cstddef>
#include <optional>
#include <utility>
#include <vector>

#include "tiermem/adam.h"

namespace tiermem::detail {

class DeferredUpdates {
 public:
  // Grows to `modules` modules (registration adds them one at a time); none pending.
  void resize(std::size_t modules) { pending_.resize(modules, false); }
  std::size_t modules() const { return pending_.size(); }

  // Module `module`'s update waits, with `params` (the step's scalars, shared by every pending
  // update). Deferring a module already pending keeps one update.
  void defer(int module, const AdamParams& params);
  bool pending(int module) const;
  std::size_t count() const { return count_; }  // modules pending

  // The module's update is due: its scalars the first time after defer, then nothing (applied
  // exactly once). The caller applies the update.
  std::optional<AdamParams> take(int module);

  // Every pending update dropped, unapplied (the whole state is being replaced).
  void drop_all();

  // A step ended deferring its updates: true the first time only (from then on every step has
  // updates inside its forward pass; the engine re-records the store's trace once).
  bool first_deferring_step() { return !std::exchange(deferred_before_, true); }

 private:
  std::size_t index(int module, const char* what) const;
  std::vector<bool> pending_;
  std::size_t count_ = 0;
  AdamParams params_;
  bool deferred_before_ = false;  // a step has deferred updates
};

}  // namespace tiermem::detail
