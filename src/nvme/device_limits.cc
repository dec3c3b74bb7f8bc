// src/nvme/device_limits.cc — sysfs block-queue limits and the unsplit piece size. See
// device_limits.h.
#include "nvme/device_limits.h"

#include <sys/sysmacros.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <system_error>

namespace tiermem::detail {
namespace {

namespace fs = std::filesystem;

// The first unsigned number in `path`, or 0 when it is missing or unreadable.
std::uint64_t read_number(const fs::path& path) {
  std::ifstream f(path);
  std::uint64_t v = 0;
  if (!(f >> v)) return 0;
  return v;
}

constexpr std::uint64_t kPage = 4096;

std::uint64_t floor_pow2(std::uint64_t x) {
  std::uint64_t p = 1;
  while (p <= x / 2) p *= 2;
  return p;
}

}  // namespace

BlockDeviceLimits read_block_device_limits(dev_t dev, const std::string& sysfs_root) {
  BlockDeviceLimits out;
  std::error_code ec;
  const fs::path link = fs::path(sysfs_root) / "dev" / "block" /
                        (std::to_string(major(dev)) + ":" + std::to_string(minor(dev)));
  fs::path node = fs::canonical(link, ec);
  if (ec) return out;
  if (fs::exists(node / "partition", ec)) node = node.parent_path();
  const fs::path queue = node / "queue";
  if (!fs::is_directory(queue, ec)) return out;
  out.disk = node.filename().string();
  out.max_request_bytes = read_number(queue / "max_sectors_kb") * 1024;
  out.max_segments = static_cast<std::uint32_t>(
      std::min<std::uint64_t>(read_number(queue / "max_segments"), UINT32_MAX));
  out.max_segment_bytes = read_number(queue / "max_segment_size");
  out.logical_block_bytes = static_cast<std::uint32_t>(
      std::min<std::uint64_t>(read_number(queue / "logical_block_size"), 1u << 20));
  return out;
}

std::uint64_t unsplit_piece_bytes(const BlockDeviceLimits& limits, std::uint64_t contiguous_bytes,
                                  std::uint64_t block_size_bytes) {
  std::uint64_t piece = std::max(block_size_bytes, kPage);
  if (limits.max_request_bytes != 0) piece = std::min(piece, limits.max_request_bytes);
  if (limits.max_segments != 0) {
    // A segment is at most one physically contiguous run, split at max_segment_bytes: the unit E
    // counted per segment is the contiguous unit, or the largest power of two within
    // max_segment_bytes when that is smaller. A 4096-aligned piece of L bytes starting anywhere
    // in a unit touches at most ceil((E - 4096 + L) / E) units, so L <= (S - 1) * E + 4096.
    std::uint64_t unit = floor_pow2(std::max(contiguous_bytes, kPage));
    if (limits.max_segment_bytes != 0 && limits.max_segment_bytes < unit) {
      unit = std::max(kPage, floor_pow2(limits.max_segment_bytes));
    }
    const std::uint64_t segs = limits.max_segments;
    const std::uint64_t fit = unit == kPage ? segs * kPage : (segs - 1) * unit + kPage;
    piece = std::min(piece, fit);
  }
  const std::uint64_t grain = std::max<std::uint64_t>(kPage, limits.logical_block_bytes);
  piece = piece / grain * grain;
  return std::max(piece, grain);
}

}  // namespace tiermem::detail
