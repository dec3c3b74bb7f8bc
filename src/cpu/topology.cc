// topology.cc — NUMA nodes (libnuma) and PCI locality (hwloc).
#include "tiermem/topology.h"

#include <hwloc.h>
#include <numa.h>
#include <numaif.h>
#include <sched.h>

#include <fmt/format.h>

namespace tiermem {

int numa_node_count() noexcept {
  if (numa_available() < 0) return 1;
  int n = numa_max_node() + 1;
  return n < 1 ? 1 : n;
}

int current_numa_node() noexcept {
  if (numa_available() < 0) return 0;
  int cpu = sched_getcpu();
  if (cpu < 0) return 0;
  int node = numa_node_of_cpu(cpu);
  return node < 0 ? 0 : node;
}

int numa_node_of_pci(std::string_view pci_bus_id) noexcept {
  hwloc_topology_t topo;
  if (hwloc_topology_init(&topo) != 0) return -1;
  int result = -1;
  hwloc_topology_set_io_types_filter(topo, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
  if (hwloc_topology_load(topo) == 0) {
    std::string id(pci_bus_id);
    hwloc_obj_t pci = hwloc_get_pcidev_by_busidstring(topo, id.c_str());
    if (pci != nullptr) {
      hwloc_obj_t parent = hwloc_get_non_io_ancestor_obj(topo, pci);
      if (parent != nullptr && parent->nodeset != nullptr) {
        int first = hwloc_bitmap_first(parent->nodeset);
        if (first >= 0) result = first;
      }
    }
  }
  hwloc_topology_destroy(topo);
  return result;
}

bool bind_to_numa_node(void* base, std::size_t bytes, int node) noexcept {
  if (numa_available() < 0 || node < 0 || node > numa_max_node()) return false;
  unsigned long mask[16] = {};
  if (node >= static_cast<int>(sizeof(mask) * 8)) return false;
  mask[node / (8 * sizeof(unsigned long))] |= 1ul << (node % (8 * sizeof(unsigned long)));
  return mbind(base, bytes, MPOL_PREFERRED, mask, sizeof(mask) * 8, 0) == 0;
}

std::string topology_summary() {
  return fmt::format("{} NUMA node(s); current node {}", numa_node_count(), current_numa_node());
}

}  // namespace tiermem
