// src/zero/zero_device_step.cc — ZeroEngine's device-resident optimizer (offload_optimizer none
// with tiermem.device_optimizer; plan.optimizer_on_device): every sub-group's fp32
// [master | m | v] is homed in device memory and stepped there by Device::adam_step_async —
// gpu_adam_step on CudaDevice, the host optimizer's own CPU kernel on SimDevice (its CPU twin) —
// with the new working params written by the same pass straight into the working shard when that
// is pinned at the device tier (no host staging).
//   gradients   homed on the device too when the device is host-addressable (the engine adds into
//               them in place: no byte crosses); on an opaque device (CUDA, SimDevice with
//               sim_host_addressable false) and at stage 1 they are host memory, and each
//               sub-group's goes up once per step into a scratch sub-group;
//   working     a shard pinned at the device tier gets the new params from the kernel (bf16/fp16)
//               or a device-to-device copy of the master (fp32); host destinations (stages 1-2,
//               shards published at the host tier) get them through a scratch sub-group copied
//               down;
//   checkpoint  export/import read and write each sub-group through the store (TensorStore::read
//               and write move device-homed bytes with the device's copies) via one host
//               sub-group of staging, counted in the engine's host bytes while it lives.
#include <fmt/format.h>

#include <algorithm>

#include "tiermem/log.h"
#include "zero_impl.h"

namespace tiermem {

void detail::device_adam_kernel(const AdamParams& params, float* master, const float* grad,
                                float* m, float* v, std::size_t n, void* half, DType half_dtype) {
  adam_step(params, master, grad, m, v, n, half, half_dtype);
}

void ZeroEngine::Impl::update_piece_on_device(
    std::size_t k, const AdamParams& ap, WorkingShardOut& working, Phase phase,
    const std::function<void(std::size_t, const float*)>& on_grad) {
  detail::Piece& p = pieces[k];
  const std::size_t n = p.size();
  TensorStore::Pin state = store->acquire(p.optim, Tier::kDevice, phase);
  if (phase == Phase::kOutsideStep)
    mods[static_cast<std::size_t>(p.module)].replay.emplace_back(p.optim, Tier::kDevice);
  float* s = state.as<float>();  // device memory: [master | m | v]

  // The gradient, in device memory: its partition where it is homed there (and readable by the
  // CPU for the norm hook: p.gtier is the device only on a host-addressable device), else its
  // host copy uploaded into the scratch sub-group.
  TensorStore::Pin gpin;
  const float* g = piece_grad(p, gpin, phase);
  if (on_grad) on_grad(k, g);
  const float* g_dev = g;
  if (stage < 2 || p.gtier != Tier::kDevice) {
    grad_scratch.reserve(device, 4ull * plan.piece_elems);
    device->copy_h2d(grad_scratch.p, g, 4ull * n);
    engine_h2d_bytes += 4ull * n;
    g_dev = grad_scratch.f();
  }

  // Where the new working params go: the shard itself when it is pinned at the device tier.
  const bool half = wsize == 2;
  std::byte* dev_out = working.device_dest(p);
  DeviceAdamTensor t;
  t.master = s;
  t.grad = g_dev;
  t.m = s + n;
  t.v = s + 2 * n;
  t.n = n;
  if (half) {
    if (dev_out == nullptr) out_scratch.reserve(device, wsize * plan.piece_elems);
    t.half = reinterpret_cast<std::uint16_t*>(dev_out != nullptr ? dev_out : out_scratch.b());
  }
  device->adam_step_async(ap, &t, 1, wdtype).wait();
  if (dev_out != nullptr) {
    if (!half) device->copy_d2d_async(dev_out, s, 4ull * n).wait();
  } else {  // host memory (an engine buffer, or a shard published at the host tier)
    std::byte* host_out = working.dest(p);
    device->copy_d2h(host_out, half ? out_scratch.p : static_cast<const void*>(s), wsize * n);
    engine_d2h_bytes += wsize * n;
  }
  state.mark_dirty();
  state.release();
  gpin.release();
  if (stage >= 2) {  // consumed: the next accumulation overwrites it
    store->discard(p.grad);
    p.grad_fresh = true;
  }
}

namespace {
// Sets a byte count back to 0 however the scope ends (a checkpoint's staging, uncounted).
struct ZeroOnExit {
  std::uint64_t& bytes;
  ~ZeroOnExit() { bytes = 0; }
};
}  // namespace

void ZeroEngine::Impl::export_device_state(const std::function<void(const ZeroStateChunk&)>& sink) {
  detail::AlignedBuf buf(12 * plan.piece_elems);
  state_stage_live = buf.bytes;  // counted in the engine's host bytes while it lives
  const ZeroOnExit uncount{state_stage_live};
  st.host_engine_peak_bytes = std::max(st.host_engine_peak_bytes, engine_host_bytes());
  for (const detail::Piece& p : pieces) {
    const std::size_t n = p.size();
    if (!p.on_device) {  // offload_optimizer.ratio < 1: the offloaded share, pinned at the host
      TensorStore::Pin pin = store->acquire(p.optim, Tier::kHost, Phase::kOutsideStep);
      float* s = pin.as<float>();
      sink(ZeroStateChunk{p.flat, n, s, s + n, s + 2 * n});
      continue;
    }
    float* f = buf.f();
    store->read(p.optim, std::as_writable_bytes(std::span<float>(f, 3 * n)));
    sink(ZeroStateChunk{p.flat, n, f, f + n, f + 2 * n});
  }
}

void ZeroEngine::Impl::import_device_state(
    const std::function<void(const ZeroStateChunk&)>& source) {
  detail::AlignedBuf buf(12 * plan.piece_elems);
  state_stage_live = buf.bytes;  // counted in the engine's host bytes while it lives
  const ZeroOnExit uncount{state_stage_live};
  st.host_engine_peak_bytes = std::max(st.host_engine_peak_bytes, engine_host_bytes());
  WorkingShardOut working(*this);
  for (const detail::Piece& p : pieces) {
    const std::size_t n = p.size();
    if (!p.on_device) {  // offload_optimizer.ratio < 1: the offloaded share, filled at the host
      TensorStore::Pin state = store->acquire_for_overwrite(p.optim, Tier::kHost);
      float* s = state.as<float>();
      source(ZeroStateChunk{p.flat, n, s, s + n, s + 2 * n});
      state.mark_dirty();
      to_working(s, working.dest(p), n);
      continue;
    }
    float* f = buf.f();
    source(ZeroStateChunk{p.flat, n, f, f + n, f + 2 * n});
    store->write(p.optim, std::as_bytes(std::span<const float>(f, 3 * n)));
    to_working(f, working.dest(p), n);
  }
  working.finish();
}

}  // namespace tiermem
