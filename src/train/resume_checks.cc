// src/train/resume_checks.cc — the checks --resume makes of a checkpoint's meta (resume_checks.h).
#include "train/resume_checks.h"

#include <cctype>

#include "tiermem/log.h"

namespace tiermem::train {
namespace {

// The kind of state an optimizer.type keeps: Adam and AdamW the same two moments.
std::string optimizer_family(std::string type) {
  for (char& c : type) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return type == "adam" ? "adamw" : type;
}

}  // namespace

void warn_if_changed(const std::string& manifest, const nlohmann::json& meta, const char* where,
                     const char* key, const nlohmann::json& now) {
  const nlohmann::json::json_pointer ptr(where);
  if (meta.contains(ptr) && meta.at(ptr) != now) {
    TM_LOG_WARN("TRAIN", "resuming {} with {} = {} (the checkpoint has {}): the run continues, but "
                "not as the saved one would have", manifest, key, now.dump(), meta.at(ptr).dump());
  }
}

void expect_same_optimizer(const std::string& manifest, const nlohmann::json& meta, const std::string& type) {
  const nlohmann::json::json_pointer ptr("/config/optimizer/type");
  if (!meta.contains(ptr) || !meta.at(ptr).is_string()) return;
  const std::string saved = meta.at(ptr).get<std::string>();
  if (optimizer_family(saved) != optimizer_family(type)) {
    throw CheckpointError(fmt::format("checkpoint {}: its optimizer state is {}'s (optimizer.type \"{}\") but this run's "
                                      "optimizer.type is \"{}\": the state does not carry over; resume with "
                                      "optimizer.type \"{}\", or start a new run",
                                      manifest, saved, saved, type, saved));
  }
}

}  // namespace tiermem::train
