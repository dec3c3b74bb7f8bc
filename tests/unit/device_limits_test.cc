// The device-sized pieces of the NVMe engine: reading block-queue limits from a fake sysfs tree
// (disk, partition, missing entries) and the unsplit piece size for 4 KiB and 2 MiB layouts.
#include <gtest/gtest.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include "nvme/device_limits.h"

namespace tiermem::detail {
namespace {

namespace fs = std::filesystem;
constexpr std::uint64_t kKiB = 1024, kMiB = 1024 * 1024;

// A throwaway sysfs look-alike: devices/.../block/<disk>[/<part>] and dev/block/MAJ:MIN links.
class FakeSysfs {
 public:
  FakeSysfs() {
    root_ = fs::temp_directory_path() /
            ("tiermem-fake-sysfs-" + std::to_string(::getpid()) + "-" + std::to_string(counter_++));
    fs::create_directories(root_ / "dev" / "block");
  }
  ~FakeSysfs() {
    std::error_code ec;
    fs::remove_all(root_, ec);
  }
  const fs::path& root() const { return root_; }
  // A disk with its queue/ files; returns its directory.
  fs::path add_disk(const std::string& name, int maj, int min, std::uint64_t max_sectors_kb,
                    std::uint64_t max_segments, std::uint64_t max_segment_size, std::uint64_t lbs) {
    fs::path d = root_ / "devices" / "pci0000:00" / "virtio1" / "block" / name;
    fs::create_directories(d / "queue");
    write(d / "queue" / "max_sectors_kb", max_sectors_kb);
    write(d / "queue" / "max_segments", max_segments);
    write(d / "queue" / "max_segment_size", max_segment_size);
    write(d / "queue" / "logical_block_size", lbs);
    link(d, maj, min);
    return d;
  }
  void add_partition(const fs::path& disk, const std::string& name, int maj, int min) {
    fs::path p = disk / name;
    fs::create_directories(p);
    write(p / "partition", 1);
    link(p, maj, min);
  }

 private:
  static void write(const fs::path& p, std::uint64_t v) { std::ofstream(p) << v << "\n"; }
  void link(const fs::path& target, int maj, int min) {
    fs::create_directory_symlink(fs::relative(target, root_ / "dev" / "block"),
                                 root_ / "dev" / "block" / (std::to_string(maj) + ":" + std::to_string(min)));
  }
  static inline int counter_ = 0;
  fs::path root_;
};

TEST(DeviceLimits, ReadsTheDiskQueue) {
  FakeSysfs sys;
  sys.add_disk("vda", 254, 0, 4096, 254, 4294967295ull, 512);
  BlockDeviceLimits l = read_block_device_limits(makedev(254, 0), sys.root().string());
  EXPECT_TRUE(l.known());
  EXPECT_EQ(l.disk, "vda");
  EXPECT_EQ(l.max_request_bytes, 4 * kMiB);
  EXPECT_EQ(l.max_segments, 254u);
  EXPECT_EQ(l.max_segment_bytes, 4294967295ull);
  EXPECT_EQ(l.logical_block_bytes, 512u);
}

TEST(DeviceLimits, PartitionUsesItsParentDisksQueue) {
  FakeSysfs sys;
  fs::path disk = sys.add_disk("nvme0n1", 259, 0, 128, 127, 4096, 4096);
  sys.add_partition(disk, "nvme0n1p2", 259, 2);
  BlockDeviceLimits l = read_block_device_limits(makedev(259, 2), sys.root().string());
  EXPECT_EQ(l.disk, "nvme0n1");
  EXPECT_EQ(l.max_request_bytes, 128 * kKiB);
  EXPECT_EQ(l.max_segments, 127u);
  EXPECT_EQ(l.logical_block_bytes, 4096u);
}

TEST(DeviceLimits, MissingSysfsIsUnknownAndLimitsNothing) {
  FakeSysfs sys;
  // An anonymous device (overlay, tmpfs, btrfs subvolume): no dev/block entry at all.
  BlockDeviceLimits l = read_block_device_limits(makedev(0, 42), sys.root().string());
  EXPECT_FALSE(l.known());
  EXPECT_EQ(l.disk, "");
  EXPECT_EQ(unsplit_piece_bytes(l, 4096, 1 * kMiB), 1 * kMiB);
  EXPECT_EQ(unsplit_piece_bytes(l, 2 * kMiB, 8 * kMiB), 8 * kMiB);
  // No sysfs at all (a container without /sys).
  l = read_block_device_limits(makedev(254, 0), (sys.root() / "absent").string());
  EXPECT_FALSE(l.known());
}

TEST(DeviceLimits, PartialQueueKeepsWhatItHas) {
  FakeSysfs sys;
  fs::path d = sys.add_disk("sdb", 8, 16, 512, 128, 65536, 512);
  fs::remove(d / "queue" / "max_segments");
  BlockDeviceLimits l = read_block_device_limits(makedev(8, 16), sys.root().string());
  EXPECT_EQ(l.max_request_bytes, 512 * kKiB);
  EXPECT_EQ(l.max_segments, 0u);
  EXPECT_EQ(unsplit_piece_bytes(l, 4096, 1 * kMiB), 512 * kKiB);
}

TEST(DeviceLimits, PieceFitsTheSegmentsOfSmallPages) {
  BlockDeviceLimits vda{"vda", 4 * kMiB, 254, 4294967295ull, 512};
  // 254 segments of 4 KiB: a 1 MiB piece over scattered pages would be split at 1016 KiB.
  EXPECT_EQ(unsplit_piece_bytes(vda, 4096, 1 * kMiB), 1016 * kKiB);
  EXPECT_EQ(unsplit_piece_bytes(vda, 4096, 512 * kKiB), 512 * kKiB);  // the user's bound wins
  // Over 2 MiB pages the request size is the limit.
  EXPECT_EQ(unsplit_piece_bytes(vda, 2 * kMiB, 1 * kMiB), 1 * kMiB);
  EXPECT_EQ(unsplit_piece_bytes(vda, 2 * kMiB, 16 * kMiB), 4 * kMiB);
}

TEST(DeviceLimits, SegmentSizeSmallerThanTheUnitCountsSeveralSegments) {
  // A SCSI-like queue: 64 KiB segments, 128 of them, 32 MiB requests allowed.
  BlockDeviceLimits sd{"sda", 32 * kMiB, 128, 64 * kKiB, 512};
  // 2 MiB pages are cut into 64 KiB segments: (128 - 1) * 64 KiB + 4 KiB.
  EXPECT_EQ(unsplit_piece_bytes(sd, 2 * kMiB, 64 * kMiB), 127 * 64 * kKiB + 4 * kKiB);
  // A device with 4 KiB logical blocks and a tiny max_sectors_kb: never below one block.
  BlockDeviceLimits tiny{"x", 2 * kKiB, 1, 0, 4096};
  EXPECT_EQ(unsplit_piece_bytes(tiny, 4096, 1 * kMiB), 4096u);
}

// The obvious twin: count the segments of every placement of a piece exhaustively (in 4 KiB
// steps across one unit) and check the computed size is the largest that always fits.
int worst_segments(std::uint64_t piece, std::uint64_t unit, std::uint64_t max_seg) {
  int worst = 0;
  for (std::uint64_t start = 0; start < unit; start += 4096) {
    int segs = 0;
    std::uint64_t pos = start, end = start + piece;
    while (pos < end) {
      std::uint64_t run_end = std::min(end, (pos / unit + 1) * unit);  // end of this unit
      std::uint64_t run = run_end - pos;
      segs += static_cast<int>((run + max_seg - 1) / max_seg);
      pos = run_end;
    }
    worst = std::max(worst, segs);
  }
  return worst;
}

TEST(DeviceLimits, PieceIsTheLargestThatAlwaysFitsByExhaustiveCount) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const std::uint64_t unit = 4096ull << (rng() % 10);          // 4 KiB .. 2 MiB
    const std::uint64_t max_seg = 4096ull << (rng() % 11);       // 4 KiB .. 4 MiB
    const std::uint32_t segs = 1 + rng() % 64;
    BlockDeviceLimits l{"d", 1ull << 40, segs, max_seg, 512};
    const std::uint64_t piece = unsplit_piece_bytes(l, unit, 1ull << 40);
    ASSERT_EQ(piece % 4096, 0u);
    EXPECT_LE(worst_segments(piece, unit, max_seg), static_cast<int>(segs))
        << "unit " << unit << " max_seg " << max_seg << " segs " << segs;
    if (piece > 4096) {
      EXPECT_GT(worst_segments(piece + 4096, unit, max_seg), static_cast<int>(segs))
          << "unit " << unit << " max_seg " << max_seg << " segs " << segs << " piece " << piece;
    }
  }
}

}  // namespace
}  // namespace tiermem::detail
