// tiermem/cuda_device.h — CudaDevice: the device tier on an NVIDIA GPU (compiled when the build has
// CUDA, TIERMEM_HAVE_CUDA). HBM from a caching allocator over cudaMalloc (steady state does no
// cudaMalloc), separate non-blocking streams for H2D, D2H and D2D copies and one compute stream,
// an event (cudaEventDisableTiming) recorded after each operation.
//
// Copies from/to pageable host memory work but are staged by the driver (slower, and the call may
// return only after the source was consumed); register_host() (cudaHostRegister) or memory from a
// PinnedHostPool makes them truly asynchronous.
//
// Thread-safety: as Device (every method thread-safe; CUDA streams are thread-safe).
// Errors: every CUDA call is checked (TM_CUDA_CHECK) and throws CudaError with the call, the CUDA
// error string and file:line.
#pragma once

#include <cstdint>
#include <memory>

#include "tiermem/device.h"
#include "tiermem/export.h"

namespace tiermem {

// Makes a CudaDevice on GPU `ordinal`. budget_bytes 0: the free memory of the GPU minus 5%.
// Throws NotSupportedError when this build has no CUDA or no GPU is visible, CudaError otherwise.
TIERMEM_API std::unique_ptr<Device> make_cuda_device(int ordinal, std::uint64_t budget_bytes);

}  // namespace tiermem
