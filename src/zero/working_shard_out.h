// src/zero/working_shard_out.h — where each optimizer sub-group's new working parameters go,
// sub-groups taken in order (a module's are consecutive), as step() and import publish them: a
// stored module's shard is acquired for overwrite at its first sub-group (every element gets
// written; at the device tier when that is home, else at shape.publish_tier — the device when
// publishes_working_on_device, else the host — written down by the store when evicted) and
// released dirty after its last; other modules write into their engine buffer (mem_shard).
// Destroyed without finish() (an error), the pin is released clean. `publish_tier`, when given,
// replaces shape.publish_tier (a deferred update at a gather: the tier the gather reads).
//
// A module whose working shard is its fp32 master (ZeroModule::shared_master) is acquired with
// its contents instead (at `phase`; an access outside the step is added to the module's replay
// list), and dest(p) is then also where sub-group p's master is read and written in place.
//
// A device the CPU cannot address (shape.opaque): dest() of a device-homed shard is a device-
// staging host buffer of one sub-group (DeviceStaging's publish buffers), copied up to the pinned
// shard when the next dest() or finish() is called — so the caller must have written every byte
// of dest(p) by then (sub-groups written one after the other, as step() and import do). Two
// device-staging buffers alternate, so the copy of sub-group k overlaps the AdamW of k + 1.
//
// Units: a sub-group's destination holds p.size() working elements (shape.wsize bytes each).
// Ownership: a destination is valid until the next dest()/device_dest()/finish(); the shard's pin
// is held by this object. Thread-safety: none; the engine's driving thread, one writer at a time
// (one object per step, import or deferred update). Errors: the store's (acquire) and the
// device's (copies; from the call that waits for them — never from the destructor, which logs).
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <vector>

#include "tiermem/device.h"
#include "tiermem/tensor_store.h"
#include "zero/device_staging.h"
#include "zero/zero_types.h"

namespace tiermem::detail {

class WorkingShardOut {
 public:
  // `sub_group_elems`: the plan's sub-group size (a publish buffer is made at least that large).
  WorkingShardOut(std::vector<ZeroModule>& mods, const std::unique_ptr<TensorStore>& store,
                  const EngineShape& shape, DeviceStaging& staging, std::size_t sub_group_elems,
                  Phase phase = Phase::kOptimizer, std::optional<Tier> publish_tier = std::nullopt)
      : mods_(mods), store_(store), shape_(shape), staging_(staging), sub_group_elems_(sub_group_elems), phase_(phase),
        publish_tier_(publish_tier.value_or(shape.publish_tier)) {}
  ~WorkingShardOut();  // waits for staged copies still in flight (never throws)
  WorkingShardOut(const WorkingShardOut&) = delete;
  WorkingShardOut& operator=(const WorkingShardOut&) = delete;

  // Before sub-group p's own tensors (state, gradient) are acquired: when p starts another module,
  // the previous module's shard is released and p's module's pinned (stored modules). Each module's
  // sub-groups are sized to the room its own shard leaves (ZeroPlan::module_sub_group_elems), so they
  // must not be acquired while the previous module's shard is still held.
  void begin(const SubGroup& p);
  // Sub-group p's destination, host-addressable memory.
  std::byte* dest(const SubGroup& p);
  // As dest(), for a writer in device memory (the device-resident optimizer): the sub-group's
  // place in the module's shard when that is pinned at the device tier (any device: no staging),
  // else null (the destination is host memory: write it through dest()).
  std::byte* device_dest(const SubGroup& p);
  void finish();  // the last module's shard released dirty

 private:
  void open(const SubGroup& p);  // the module's shard pinned for overwrite, the previous one finished
  void upload_staged();       // the staged sub-group, if any, on its way to the device
  void wait_uploads();
  std::vector<ZeroModule>& mods_;
  const std::unique_ptr<TensorStore>& store_;
  const EngineShape& shape_;
  DeviceStaging& staging_;
  const std::size_t sub_group_elems_;
  const Phase phase_;              // of a shared-master module's acquire
  const Tier publish_tier_;        // of stored modules not homed on the device
  TensorStore::Pin pin_;
  int module_ = -1;
  int stage_ = 0;                  // publish buffer dest() handed out last
  std::size_t staged_offset_ = 0;  // bytes into the shard of the staged sub-group
  std::size_t staged_bytes_ = 0;   // 0: nothing staged
  DeviceEvent upload_[2];          // copy of publish buffer b in flight
};

}  // namespace tiermem::detail
