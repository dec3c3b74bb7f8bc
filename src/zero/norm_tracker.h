// src/zero/norm_tracker.h — the engine's clipping norm: the global sum of squares of the
// gradient, either folded into accumulation as each sub-group's gradient partition completes
// (stages 2-3 without fp16: the gradient reducer calls fold()), or added by step() as it reads
// each partition (add()). Both add the same numbers in the same order — tiermem-train's order
// for its other engines (one reduction per module, in element order) — so one rank's clipped
// steps equal theirs bit for bit. It owns every module's fold (ModuleNormFold, norm_fold.h: the
// pure in-order bookkeeping and the lane sums); the engine owns the modules and sub-groups it reads.
//
// Units: k, pi are indices into the engine's sub-groups; sums of squares are doubles over real (not
// padding) gradient elements, before any scaling. Ownership: reads the modules, sub-groups and shape
// through references that must outlive it; holds no buffer. Thread-safety: none; one thread at a
// time (fold() runs on the gradient reducer's hand-off thread while the driving thread waits for
// nothing else of it; everything else on the driving thread). Errors: only the communicator's
// (sum_over_ranks).
#pragma once

#include <cstddef>
#include <optional>
#include <vector>

#include "tiermem/communicator.h"
#include "zero/norm_fold.h"
#include "zero/zero_types.h"

namespace tiermem::detail {

class NormTracker {
 public:
  NormTracker(Communicator& comm, const EngineShape& shape, const std::vector<ZeroModule>& mods,
              const std::vector<SubGroup>& sub_groups)
      : comm_(comm), shape_(shape), mods_(mods), sub_groups_(sub_groups) {}

  // Grows to `modules` modules (registration adds them one at a time).
  void resize(std::size_t modules) { folds_.resize(modules); }
  // The norm is folded into accumulation (stages 2-3, no fp16 overflow check).
  bool folds() const { return shape_.stage >= 2 && !shape_.loss_scaled; }
  // Sub-group k's real (not padding) elements, from its begin.
  std::size_t valid_len(std::size_t k) const;

  // The module's running sum of squares after sub-group k (g: its gradient, valid_len(k) elements
  // read), continuing `running` (reset at the module's first sub-group). `partial`: the sum of
  // squares of g's real elements (sumsq_lanes) when the caller has it already (a fused copy).
  double sub_group_sumsq(std::size_t k, const float* g, double running, std::optional<double> partial = {}) const;

  // Sub-group pi's partition g holds its gradient as of the reduce call that just completed it: its
  // module's fold moves on by it when it is the next in order (else the fold breaks).
  void fold(int pi, const float* g, std::optional<double> partial = {});
  // The folded sum when every module with a gradient this step (its first sub-group not fresh) had all
  // its sub-groups complete in order: true, with the modules' sums added to `sumsq` in module order
  // (as add() would). False when folding is off or a fold broke.
  bool folded_sumsq(double& sumsq) const;
  bool module_has_real(int module) const;  // this rank holds a real element of the module
  void clear();                            // zero_grad: every module's next reduce call starts afresh

  // step()'s sums of squares so far: of every module done, and of the current module.
  struct Sum {
    double total = 0, module = 0;
  };
  // Sub-group k's squares (g: its gradient) added in order; at its module's last sub-group the module's
  // sum joins the total.
  void add(Sum& sum, std::size_t k, const float* g) const;
  // The norm's all-reduce (fp32, as tiermem-train's): the sum over ranks, except at stage 0 or on
  // one rank (every rank has the whole gradient already).
  double sum_over_ranks(double sumsq);

 private:
  ModuleNormFold::ValidLen module_valid_len(const ZeroModule& m) const;  // by sub-group
  bool module_ready(std::size_t module) const;                           // every sub-group folded, in order

  Communicator& comm_;
  const EngineShape& shape_;
  const std::vector<ZeroModule>& mods_;
  const std::vector<SubGroup>& sub_groups_;
  std::vector<ModuleNormFold> folds_;  // one a module
};

}  // namespace tiermem::detail
