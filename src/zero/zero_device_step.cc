// src/zero/zero_device_step.cc — the OptimizerStepper's device-resident sub-groups (optimizer_stepper.h)
// and ZeroEngine's device-resident optimizer (offload_optimizer none
// with tiermem.device_optimizer; plan.optimizer_on_device): every sub-group's fp32
// [master | m | v] is homed in device memory and stepped there by Device::adam_step_async —
// gpu_adam_step on CudaDevice, the host optimizer's own CPU kernel on SimDevice (its CPU twin) —
// with the new working params written by the same pass straight into the working shard when that
// is pinned at the device tier (no device staging).
//   gradients   homed on the device too when the device is host-addressable (the engine adds into
//               them in place: no byte crosses); on an opaque device (CUDA, SimDevice with
//               sim_host_addressable false) and at stage 1 they are host memory, and each
//               sub-group's goes up once per step into a scratch sub-group;
//   working     a shard pinned at the device tier gets the new params from the kernel (bf16/fp16)
//               or a device-to-device copy of the master (fp32); host destinations (stages 1-2,
//               shards published at the host tier) get them through a scratch sub-group copied
//               down;
//   checkpoint  export/import (zero_state.cc) read and write a device-homed sub-group through the
//               store (TensorStore::read/write move its bytes with the device's copies) via one
//               host sub-group of device staging (DeviceStaging::state_buffer).
//   The same path steps the device's share under offload_optimizer.ratio < 1 (SubGroup::on_device).
#include <fmt/format.h>

#include <algorithm>

#include "tiermem/log.h"
#include "zero/optimizer_stepper.h"

namespace tiermem::detail {

void device_adam_kernel(const AdamParams& params, float* master, const float* grad,
                        float* m, float* v, std::size_t n, void* half, DType half_dtype) {
  adam_step(params, master, grad, m, v, n, half, half_dtype);
}

void OptimizerStepper::update_on_device(std::size_t k, const AdamParams& ap, WorkingShardOut& working, Phase phase,
                                        const OnGrad& on_grad) {
  SubGroup& p = sub_groups_[k];
  const std::size_t n = p.size();
  TensorStore::Pin state = store_->acquire(p.optim, Tier::kDevice, phase);
  if (phase == Phase::kOutsideStep)
    mods_[static_cast<std::size_t>(p.module)].replay.emplace_back(p.optim, Tier::kDevice);
  float* s = state.as<float>();  // device memory: [master | m | v]

  // The gradient, in device memory: its partition where it is homed there (and readable by the
  // CPU for the norm hook: p.gtier is the device only on a host-addressable device), else its
  // host copy uploaded into the scratch sub-group.
  TensorStore::Pin gpin;
  const float* g = grad(p, gpin, phase);
  if (on_grad) on_grad(k, g);
  const float* g_dev = g;
  if (shape_.stage < 2 || p.gtier != Tier::kDevice) {
    g_dev = staging_.gradient_to_scratch(g, n, plan_.sub_group_elems);
  }

  // Where the new working params go: the shard itself when it is pinned at the device tier.
  const bool half = shape_.wsize == 2;
  std::byte* dev_out = working.device_dest(p);
  DeviceAdamTensor t;
  t.master = s;
  t.grad = g_dev;
  t.m = s + n;
  t.v = s + 2 * n;
  t.n = n;
  void* scratch = nullptr;  // device memory for the new half params bound for host memory
  if (half) {
    if (dev_out == nullptr) scratch = staging_.out_scratch(shape_.wsize * plan_.sub_group_elems);
    t.half = reinterpret_cast<std::uint16_t*>(dev_out != nullptr ? dev_out : static_cast<std::byte*>(scratch));
  }
  device_->adam_step_async(ap, &t, 1, shape_.wdtype).wait();
  if (dev_out != nullptr) {
    if (!half) device_->copy_d2d_async(dev_out, s, 4ull * n).wait();
  } else {  // host memory (an engine buffer, or a shard published at the host tier)
    std::byte* host_out = working.dest(p);
    staging_.copy_down(host_out, half ? scratch : static_cast<const void*>(s), shape_.wsize * n);
  }
  state.mark_dirty();
  state.release();
  gpin.release();
  if (shape_.stage >= 2) {  // consumed: the next accumulation overwrites it
    store_->discard(p.grad);
    p.grad_fresh = true;
  }
}

}  // namespace tiermem::detail
