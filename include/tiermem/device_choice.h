// tiermem/device_choice.h — the device the user asked for ("auto" | "cuda" | "sim", from
// tiermem.device or a program's --device), turned into a DeviceKind once, at the edge where the
// string is read. Nothing downstream compares the string: it takes the DeviceKind, or the config
// whose tiermem.device the edge wrote as "cuda" or "sim".
//
//   const DeviceChoice asked = parse_device_choice(cfg.tiermem.device, "tiermem.device");
//   const ResolvedDevice d = resolve_device(asked);         // probes CUDA only for auto
//   std::unique_ptr<Device> dev = make_device(DeviceOptions::from_config(cfg), d);  // no probe
//
// Thread-safety: pure functions, except resolve_device (probes CUDA; never throws), and
// make_device (see device.h).
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "tiermem/device.h"
#include "tiermem/export.h"

namespace tiermem {

// "auto", "cuda" or "sim" (exactly, lower case). `key` names where the value came from
// ("tiermem.device", "--device") for the error. Throws ConfigError(key, value, "must be one of
// auto, cuda, sim") for anything else.
TIERMEM_API DeviceChoice parse_device_choice(std::string_view value, std::string_view key);

// The kind a choice becomes: cuda and sim as asked; auto is cuda when `cuda_usable` (a CUDA device
// is visible: CudaProbe::usable(), or for a planner the machine profile's device), else sim. Does
// not check that cuda can be made (make_device does, and tiermem-train's decide_device).
TIERMEM_API DeviceKind resolve_device_kind(DeviceChoice choice, bool cuda_usable) noexcept;

// "sim" or "cuda": the kind as tiermem.device spells it (for configs, logs and summaries).
TIERMEM_API std::string_view device_kind_name(DeviceKind kind) noexcept;

// A choice with the kind it became, and for auto why (the log line of make_device).
struct TIERMEM_API ResolvedDevice {
  DeviceChoice asked = DeviceChoice::kSim;
  DeviceKind kind = DeviceKind::kSim;
  std::string why;  // auto only: "a CUDA device is visible", "no CUDA device is visible", ...
};

// Resolves `asked`, looking for a CUDA device (cuda_device_available) only when it is auto.
// Never throws.
TIERMEM_API ResolvedDevice resolve_device(DeviceChoice asked) noexcept;

// Makes the device `device` resolved to, with the budgets and Sim settings of `options` (its
// `choice` is not read), and logs it once (GPU tag) as make_device(options) does. Looks for CUDA
// again only when cuda was asked explicitly (to refuse it with a clear NotSupportedError when no
// device is visible). Throws as make_device(options).
TIERMEM_API std::unique_ptr<Device> make_device(const DeviceOptions& options,
                                                const ResolvedDevice& device);

}  // namespace tiermem
