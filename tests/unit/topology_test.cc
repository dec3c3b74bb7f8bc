// topology: NUMA queries return sane values and never throw.
#include "tiermem/topology.h"

#include <gtest/gtest.h>
#include <sys/mman.h>

namespace tiermem {
namespace {

TEST(Topology, NodesAndCurrentNode) {
  int n = numa_node_count();
  EXPECT_GE(n, 1);
  int cur = current_numa_node();
  EXPECT_GE(cur, 0);
  EXPECT_LT(cur, n);
  EXPECT_NE(topology_summary().find("NUMA"), std::string::npos);
}

TEST(Topology, UnknownPciDeviceIsMinusOne) {
  EXPECT_EQ(numa_node_of_pci("ffff:ff:1f.7"), -1);
}

TEST(Topology, BindRejectsBadNode) {
  void* p = mmap(nullptr, 1 << 16, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(p, MAP_FAILED);
  EXPECT_FALSE(bind_to_numa_node(p, 1 << 16, 100000));
  EXPECT_FALSE(bind_to_numa_node(p, 1 << 16, -1));
  munmap(p, 1 << 16);
}

}  // namespace
}  // namespace tiermem
