// src/gpu/device_choice.cc — tiermem.device resolved once (tiermem/device_choice.h): the one place
// "auto" / "cuda" / "sim" are read and auto becomes a kind.
#include "tiermem/device_choice.h"

#include "tiermem/error.h"

namespace tiermem {

DeviceChoice parse_device_choice(std::string_view value, std::string_view key) {
  if (value == "auto") return DeviceChoice::kAuto;
  if (value == "cuda") return DeviceChoice::kCuda;
  if (value == "sim") return DeviceChoice::kSim;
  throw ConfigError(std::string(key), std::string(value), "must be one of auto, cuda, sim");
}

DeviceKind resolve_device_kind(DeviceChoice choice, bool cuda_usable) noexcept {
  switch (choice) {
    case DeviceChoice::kCuda: return DeviceKind::kCuda;
    case DeviceChoice::kSim: return DeviceKind::kSim;
    case DeviceChoice::kAuto: break;
  }
  return cuda_usable ? DeviceKind::kCuda : DeviceKind::kSim;
}

std::string_view device_kind_name(DeviceKind kind) noexcept {
  return kind == DeviceKind::kCuda ? "cuda" : "sim";
}

ResolvedDevice resolve_device(DeviceChoice asked) noexcept {
  ResolvedDevice d;
  d.asked = asked;
  if (asked != DeviceChoice::kAuto) {
    d.kind = resolve_device_kind(asked, false);
    return d;
  }
#if TIERMEM_HAVE_CUDA
  const bool visible = cuda_device_available();
  d.kind = resolve_device_kind(asked, visible);
  try {
    d.why = visible ? "a CUDA device is visible" : "no CUDA device is visible";
  } catch (...) {  // std::string allocation: the log line loses its reason, nothing else
  }
#else
  d.kind = DeviceKind::kSim;
  try {
    d.why = "this build has no CUDA";
  } catch (...) {
  }
#endif
  return d;
}

}  // namespace tiermem
