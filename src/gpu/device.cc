// device.cc — DeviceOptions::from_config, the CUDA probes and make_device (the kind resolved by
// device_choice.cc).
#include "tiermem/device.h"

#include "gpu/gpu_log.h"
#include "tiermem/config.h"
#include "tiermem/cuda_device.h"
#include "tiermem/device_choice.h"
#include "tiermem/error.h"
#include "tiermem/log.h"
#include "tiermem/sim_device.h"

#if TIERMEM_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace tiermem {

namespace detail {
void gpu_log_warn(const std::string& message) { TM_LOG_WARN("GPU", "{}", message); }
void gpu_log_error(const std::string& message) { TM_LOG_ERROR("GPU", "{}", message); }
}  // namespace detail

DeviceOptions DeviceOptions::from_config(const Config& config) {
  DeviceOptions o;
  o.choice = parse_device_choice(config.tiermem.device, "tiermem.device");
  o.budget_bytes = config.tiermem.device_budget_bytes;
  o.sim_h2d_gbps = config.tiermem.sim_h2d_gbps;
  o.sim_d2h_gbps = config.tiermem.sim_d2h_gbps;
  o.sim_host_addressable = config.tiermem.sim_host_addressable;
  return o;
}

bool cuda_device_available() noexcept {
#if TIERMEM_HAVE_CUDA
  int n = 0;
  cudaError_t rc = cudaGetDeviceCount(&n);
  if (rc != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
#else
  return false;
#endif
}

CudaProbe probe_cuda() noexcept {
  CudaProbe p;
#if TIERMEM_HAVE_CUDA
  p.built_with_cuda = true;
  try {
    int n = 0;
    const cudaError_t rc = cudaGetDeviceCount(&n);
    if (rc != cudaSuccess) {
      cudaGetLastError();
      p.reason = std::string("cudaGetDeviceCount: ") + cudaGetErrorString(rc);
      if (rc == cudaErrorInsufficientDriver || rc == cudaErrorNoDevice)
        p.reason += rc == cudaErrorNoDevice ? " (no GPU)" : " (no GPU driver, or one too old)";
      return p;
    }
    if (n <= 0) {
      p.reason = "cudaGetDeviceCount found no device (check CUDA_VISIBLE_DEVICES)";
      return p;
    }
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) {
      p.device0_name = prop.name;
    } else {
      cudaGetLastError();
    }
    p.device_count = n;
  } catch (...) {  // std::string allocation: report no device rather than throw
    p.device_count = 0;
  }
#else
  p.reason = "this build has no CUDA (make build-cuda, or configure with -DTIERMEM_WITH_CUDA=ON, on a machine with nvcc)";
#endif
  return p;
}

DeviceEvent Device::adam_step_async(const AdamParams&, const DeviceAdamTensor*, std::size_t, DType) {
  throw NotSupportedError(name() + ": this device runs no AdamW (adam_step_async)");
}

namespace {
std::unique_ptr<Device> make_sim(const DeviceOptions& o) {
  SimDeviceOptions so;
  if (o.budget_bytes != 0) so.budget_bytes = o.budget_bytes;
  so.h2d_gbps = o.sim_h2d_gbps;
  so.d2h_gbps = o.sim_d2h_gbps;
  so.host_addressable = o.sim_host_addressable;
  so.adam_kernel = o.sim_adam_kernel;
  return std::make_unique<SimDevice>(so);
}
}  // namespace

std::unique_ptr<Device> make_device(const DeviceOptions& options, const ResolvedDevice& device) {
  if (device.kind == DeviceKind::kSim) {
    auto d = make_sim(options);
    // Every rank's simulated device is alike: rank 0 says it (a CUDA line names each GPU).
    if (log_rank() == 0) {
      if (device.asked == DeviceChoice::kAuto) {
        TM_LOG_INFO("GPU", "device: sim (tiermem.device = auto: {}), budget {}", device.why,
                    format_bytes(d->budget_bytes()));
      } else {
        TM_LOG_INFO("GPU", "device: {} (tiermem.device = sim), budget {}", d->name(), format_bytes(d->budget_bytes()));
      }
    }
    return d;
  }
#if !TIERMEM_HAVE_CUDA
  throw NotSupportedError(
      "tiermem.device = cuda but this build has no CUDA (configure with -DTIERMEM_WITH_CUDA=ON "
      "on a machine with nvcc, or use tiermem.device = sim)");
#else
  if (device.asked == DeviceChoice::kCuda && !cuda_device_available()) {
    throw NotSupportedError(
        "tiermem.device = cuda but no CUDA device is visible (cudaGetDeviceCount found none; "
        "check the driver and CUDA_VISIBLE_DEVICES, or use tiermem.device = sim)");
  }
  auto d = make_cuda_device(options.cuda_device, options.budget_bytes);
  if (device.asked == DeviceChoice::kAuto) {
    TM_LOG_INFO("GPU", "device: {} (tiermem.device = auto: {}), budget {}", d->name(), device.why,
                format_bytes(d->budget_bytes()));
  } else {
    TM_LOG_INFO("GPU", "device: {} (tiermem.device = cuda), budget {}", d->name(), format_bytes(d->budget_bytes()));
  }
  return d;
#endif
}

std::unique_ptr<Device> make_device(const DeviceOptions& options) {
  return make_device(options, resolve_device(options.choice));
}

std::unique_ptr<Device> make_device(const Config& config) {
  return make_device(DeviceOptions::from_config(config));
}

#if !TIERMEM_HAVE_CUDA
std::unique_ptr<Device> make_cuda_device(int, std::uint64_t) {
  throw NotSupportedError("CudaDevice: this build has no CUDA (configure with -DTIERMEM_WITH_CUDA=ON)");
}
#endif

}  // namespace tiermem
