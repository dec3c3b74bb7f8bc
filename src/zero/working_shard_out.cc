// src/zero/working_shard_out.cc — see working_shard_out.h.
#include "zero/working_shard_out.h"

#include <exception>

#include "tiermem/log.h"

namespace tiermem::detail {

WorkingShardOut::~WorkingShardOut() {
  try {
    wait_uploads();
  } catch (const std::exception& e) {
    TM_LOG_ERROR("ZERO", "working-parameter upload failed while abandoning a step: {}", e.what());
  }
}

void WorkingShardOut::open(const SubGroup& p) {
  if (module_ == p.module) return;
  finish();
  ZeroModule& m = mods_[static_cast<std::size_t>(p.module)];
  const Tier tier = m.update_tier(publish_tier_);
  if (m.shared_master) {  // the master weights: read, then updated in place
    pin_ = store_->acquire(m.param, tier, phase_);
    if (phase_ == Phase::kOutsideStep) m.replay.emplace_back(m.param, tier);
  } else {
    pin_ = store_->acquire_for_overwrite(m.param, tier);
  }
  module_ = p.module;
}

void WorkingShardOut::begin(const SubGroup& p) {
  if (module_ == p.module) return;
  if (mods_[static_cast<std::size_t>(p.module)].stored) {
    open(p);
    return;
  }
  finish();
  module_ = p.module;
}

std::byte* WorkingShardOut::dest(const SubGroup& p) {
  ZeroModule& m = mods_[static_cast<std::size_t>(p.module)];
  upload_staged();  // the previous sub-group is complete now
  if (!m.stored) return m.mem_shard.b() + p.begin * shape_.wsize;
  open(p);
  if (!shape_.opaque || pin_.tier() != Tier::kDevice) return pin_.as<std::byte>() + p.begin * shape_.wsize;
  // Opaque device memory: AdamW writes a host staging sub-group, copied up by the next call.
  const std::size_t bytes = p.size() * shape_.wsize;
  stage_ ^= 1;
  upload_[stage_].wait();  // its previous copy has left the buffer
  upload_[stage_] = DeviceEvent();
  std::byte* buf = staging_.publish_buffer(stage_, bytes, sub_group_elems_ * shape_.wsize);
  staged_offset_ = p.begin * shape_.wsize;
  staged_bytes_ = bytes;
  return buf;
}

std::byte* WorkingShardOut::device_dest(const SubGroup& p) {
  const ZeroModule& m = mods_[static_cast<std::size_t>(p.module)];
  if (!m.stored) return nullptr;
  open(p);
  if (pin_.tier() != Tier::kDevice) return nullptr;
  return pin_.as<std::byte>() + p.begin * shape_.wsize;
}

void WorkingShardOut::upload_staged() {
  if (staged_bytes_ == 0) return;
  upload_[stage_] = staging_.publish_async(pin_.as<std::byte>() + staged_offset_, stage_, staged_bytes_);
  staged_bytes_ = 0;
}

void WorkingShardOut::wait_uploads() {
  for (DeviceEvent& e : upload_) {
    DeviceEvent mine = e;
    e = DeviceEvent();
    mine.wait();
  }
}

void WorkingShardOut::finish() {
  upload_staged();
  wait_uploads();  // the pin is released only once every byte of the shard has arrived
  if (pin_.valid()) pin_.mark_dirty();
  pin_.release();
}

}  // namespace tiermem::detail
