// tiermem/tier.h — the three memory tiers.
// Thread-safety: plain values and pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <string_view>

namespace tiermem {

// Fastest to slowest. The numeric order is the paging order: data moves down on eviction.
enum class Tier : std::uint8_t {
  kDevice = 0,  // GPU HBM (CudaDevice) or SimDevice's capped host memory
  kHost = 1,    // pinned (page-locked) host DRAM
  kNvme = 2,    // extents of swap files on NVMe
};
inline constexpr int kNumTiers = 3;

constexpr std::string_view tier_name(Tier t) {
  switch (t) {
    case Tier::kDevice: return "device";
    case Tier::kHost: return "host";
    case Tier::kNvme: return "nvme";
  }
  return "?";
}

}  // namespace tiermem
