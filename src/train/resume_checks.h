// src/train/resume_checks.h — what tiermem-train's --resume holds a checkpoint's meta (its
// manifest's "meta" object, train_loop.cc's save) against before it loads anything: settings that
// must be the same (a CheckpointError naming the key and both values), settings a resumed run may
// change on purpose (one warning), and the optimizer whose state the checkpoint holds.
//
// Thread-safety: plain functions of their arguments. Errors: CheckpointError (tiermem/checkpoint.h).
#pragma once

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <string>

#include "tiermem/checkpoint.h"

namespace tiermem::train {

// `saved` (the checkpoint's, under `key` of `manifest`) equal to `now`, else a CheckpointError.
template <typename T>
void expect_same(const std::string& manifest, const char* key, const T& saved, const T& now) {
  if (saved != now) {
    throw CheckpointError(fmt::format("checkpoint {}: key '{}' is {} but this run has {} "
                                      "(resume with the same settings)",
                                      manifest, key, nlohmann::json(saved).dump(),
                                      nlohmann::json(now).dump()));
  }
}

// Settings a resumed run may change on purpose (a longer run, new data, another tier), but that
// make it no longer the same run: one warning naming the key, the saved and the new value.
// `where` is a JSON pointer into the checkpoint's meta ("/data/path"); absent = nothing to say.
void warn_if_changed(const std::string& manifest, const nlohmann::json& meta, const char* where,
                     const char* key, const nlohmann::json& now);

// The optimizer state is its own kind's (AdamW's two moments, Lion's one, Adagrad's sum): a run
// whose optimizer.type keeps another kind (Adam and AdamW keep the same) would take it for its
// own. A CheckpointError naming both types; nothing to check in a meta without config.optimizer.
void expect_same_optimizer(const std::string& manifest, const nlohmann::json& meta, const std::string& type);

}  // namespace tiermem::train
