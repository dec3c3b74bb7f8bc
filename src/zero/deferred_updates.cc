// src/zero/deferred_updates.cc — see deferred_updates.h.
#include "zero/deferred_updates.h"

#include <string>

#include "tiermem/error.h"

namespace tiermem::detail {

std::size_t DeferredUpdates::index(int module, const char* what) const {
  if (module < 0 || static_cast<std::size_t>(module) >= pending_.size()) {
    throw Error(std::string("DeferredUpdates::") + what + ": module " + std::to_string(module) +
                " is not one of the engine's " + std::to_string(pending_.size()) + " modules");
  }
  return static_cast<std::size_t>(module);
}

void DeferredUpdates::defer(int module, const AdamParams& params) {
  const std::size_t i = index(module, "defer");
  params_ = params;
  if (pending_[i]) return;
  pending_[i] = true;
  ++count_;
}

bool DeferredUpdates::pending(int module) const { return pending_[index(module, "pending")]; }

std::optional<AdamParams> DeferredUpdates::take(int module) {
  const std::size_t i = index(module, "take");
  if (!pending_[i]) return std::nullopt;
  pending_[i] = false;
  --count_;
  return params_;
}

void DeferredUpdates::drop_all() {
  pending_.assign(pending_.size(), false);
  count_ = 0;
}

}  // namespace tiermem::detail
