// tiermem/topology.h — where memory should live: NUMA nodes and their distance to PCI devices
// (GPUs, NVMe), from hwloc and libnuma.
//
// Thread-safety: all functions are thread-safe (hwloc topology loaded per call; cheap enough for
// setup paths, not for hot paths).
#pragma once

#include <string>
#include <string_view>

#include "tiermem/export.h"

namespace tiermem {

// Number of NUMA nodes (>= 1; 1 when libnuma reports NUMA unavailable).
TIERMEM_API int numa_node_count() noexcept;

// The NUMA node of the CPU the calling thread runs on (0 when unknown).
TIERMEM_API int current_numa_node() noexcept;

// The NUMA node nearest the PCI device with bus id `pci_bus_id` ("0000:3b:00.0", as
// cudaDeviceGetPCIBusId prints it), or -1 when hwloc does not know the device or its locality.
TIERMEM_API int numa_node_of_pci(std::string_view pci_bus_id) noexcept;

// Binds [base, base + bytes) (page-aligned) to `node` (mbind MPOL_PREFERRED). Returns false when
// NUMA is unavailable or the call fails (not an error: placement is an optimisation).
TIERMEM_API bool bind_to_numa_node(void* base, std::size_t bytes, int node) noexcept;

// One line for logs: "2 NUMA nodes; current node 0".
TIERMEM_API std::string topology_summary();

}  // namespace tiermem
