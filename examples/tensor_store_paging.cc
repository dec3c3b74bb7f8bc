// examples/tensor_store_paging.cc — TensorStore paging eight 1 MiB tensors homed on NVMe through a
// 3 MiB host tier and a 2 MiB device: each pass prefetches the next tensor, pins the current one
// on the device, adds 1 to each element there and marks it dirty; the store evicts and writes
// back as its budgets require. At the end every tensor is read from its home and checked.
//
// Build and run (from the repository root):
//   cmake --preset cpu && cmake --build --preset cpu -j2 --target tensor_store_paging
//   build/cpu/examples/tensor_store_paging   # prints the traffic per tier pair, then "ok"
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <unistd.h>

#include "tiermem/io_engine.h"
#include "tiermem/sim_device.h"
#include "tiermem/swap_space.h"
#include "tiermem/tensor_store.h"

namespace {

constexpr int kTensors = 8, kPasses = 3;
constexpr std::int64_t kElems = 256 * 1024;  // fp32: 1 MiB per tensor

// Runs the paging loop with the swap files under `dir`; returns whether every value is right.
bool page(const std::string& dir) {
  using tiermem::Tier;
  tiermem::IoEngineOptions io;
  io.o_direct = false;  // the temp dir may be tmpfs
  auto engine = tiermem::make_io_engine(io);
  tiermem::SwapSpaceOptions so;
  so.initial_bytes_per_path = 16 << 20;
  auto swap = std::make_shared<tiermem::SwapSpace>(so, std::vector<std::string>{dir}, *engine);
  auto device = std::make_shared<tiermem::SimDevice>(tiermem::SimDeviceOptions{.budget_bytes = 2 << 20});

  tiermem::TensorStoreOptions opts;
  opts.device_budget_bytes = 2 << 20;  // two tensors on the device at most
  opts.host_budget_bytes = 3 << 20;    // three cached on the host
  opts.pipeline_chunk_bytes = 256 << 10;
  tiermem::TensorStore store(opts, device, swap);

  // Register the tensors, zero-filled at their NVMe homes.
  std::vector<tiermem::TensorId> ids;
  for (int i = 0; i < kTensors; ++i) {
    ids.push_back(store.register_tensor({.name = "w" + std::to_string(i), .dtype = tiermem::DType::kF32,
                                         .shape = {kElems}, .home = Tier::kNvme, .swap = nullptr}));
  }

  // The paging loop: prefetch ahead, compute on the pinned device copy, mark it dirty.
  for (int pass = 0; pass < kPasses; ++pass) {
    for (int i = 0; i < kTensors; ++i) {
      const tiermem::TensorId next = ids[(i + 1) % kTensors];
      store.prefetch({&next, 1}, Tier::kDevice);
      tiermem::TensorStore::Pin pin = store.acquire(ids[i], Tier::kDevice);
      float* w = pin.as<float>();  // SimDevice memory is host-addressable
      for (std::int64_t k = 0; k < kElems; ++k) w[k] += 1.0f;
      pin.mark_dirty();
    }  // the pin is released here: the copy may now be evicted (and written back)
  }
  store.flush();  // every dirty copy back at its NVMe home

  // Check: each element was incremented once per pass.
  bool ok = true;
  std::vector<float> back(kElems);
  for (int i = 0; i < kTensors; ++i) {
    store.read(ids[i], std::as_writable_bytes(std::span<float>(back)));
    for (float v : back) ok = ok && v == static_cast<float>(kPasses);
  }

  const tiermem::TensorStoreStats st = store.stats();
  for (Tier from : {Tier::kNvme, Tier::kHost, Tier::kDevice}) {
    for (Tier to : {Tier::kNvme, Tier::kHost, Tier::kDevice}) {
      const auto bytes = st.bytes_moved[static_cast<int>(from)][static_cast<int>(to)];
      if (bytes != 0) {
        std::printf("%6s -> %-6s %8.1f MiB\n", std::string(tiermem::tier_name(from)).c_str(),
                    std::string(tiermem::tier_name(to)).c_str(), bytes / 1048576.0);
      }
    }
  }
  std::printf("peak device %.1f MiB (budget %.1f), peak host %.1f MiB (budget %.1f)\n",
              st.peak_resident_bytes[0] / 1048576.0, st.budget_bytes[0] / 1048576.0,
              st.peak_resident_bytes[1] / 1048576.0, st.budget_bytes[1] / 1048576.0);
  return ok;
}

}  // namespace

int main() {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("tiermem-paging-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const bool ok = page(dir.string());
  fs::remove_all(dir);
  std::printf("%s\n", ok ? "ok: every tensor holds its value" : "FAILED: a tensor holds a wrong value");
  return ok ? EXIT_SUCCESS : EXIT_FAILURE;
}
