// src/nvme/device_limits.h — what the block layer accepts in one request, read from sysfs, and
// the largest piece the engine may issue so that the block layer never has to split it.
//
// Pure logic over plain data (the sysfs root is a parameter, so tests use a fake tree); the
// engine calls read_block_device_limits once per opened file and unsplit_piece_bytes per op.
// Thread-safety: free functions without shared state.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>

namespace tiermem::detail {

// One block device's request limits (from /sys/dev/block/MAJ:MIN, or its parent disk's queue/
// for a partition). A field of 0 is unknown (then it limits nothing).
struct BlockDeviceLimits {
  std::string disk;                    // the disk whose queue/ was read ("vda", "nvme0n1"); "" unknown
  std::uint64_t max_request_bytes = 0;  // queue/max_sectors_kb * 1024
  std::uint32_t max_segments = 0;       // queue/max_segments (scatter-gather entries per request)
  std::uint64_t max_segment_bytes = 0;  // queue/max_segment_size
  std::uint32_t logical_block_bytes = 0;  // queue/logical_block_size
  bool known() const noexcept { return max_request_bytes != 0 || max_segments != 0; }
};

// Reads the limits of the block device `dev` (a file's st_dev) under `sysfs_root` ("/sys"):
// resolves sysfs_root/dev/block/MAJ:MIN, goes to the parent disk when it is a partition (it has a
// `partition` file), and reads queue/{max_sectors_kb,max_segments,max_segment_size,
// logical_block_size}. Anything missing (tmpfs, overlay, btrfs' anonymous devices, containers
// without /sys) gives an unknown field; never throws.
BlockDeviceLimits read_block_device_limits(dev_t dev, const std::string& sysfs_root = "/sys");

// The largest piece (bytes) the engine issues in one request for a buffer that is physically
// contiguous in naturally aligned units of `contiguous_bytes` (4096: nothing known; 2 MiB: huge
// pages), such that the block layer does not split it: at most limits.max_request_bytes, and at
// most the worst-case byte count that still fits max_segments segments (a 4096-aligned piece may
// start anywhere inside a unit; units larger than max_segment_bytes count as several segments).
// Never more than `block_size_bytes` (the user's bound, aio.block_size), never less than 4096,
// and a multiple of 4096 and of the logical block size.
std::uint64_t unsplit_piece_bytes(const BlockDeviceLimits& limits, std::uint64_t contiguous_bytes,
                                  std::uint64_t block_size_bytes);

}  // namespace tiermem::detail
