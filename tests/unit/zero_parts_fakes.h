// Small honest fakes for testing ZeroEngine's parts (src/zero/) directly: a communicator that
// plays one rank of a world whose other ranks hold known values, with failures injected per call,
// and the engine's modules and sub-groups laid out by hand.
#pragma once

#include <cstddef>
#include <cstring>
#include <memory>
#include <string_view>
#include <vector>

#include "tiermem/communicator.h"
#include "tiermem/error.h"
#include "tiermem/shard.h"
#include "zero/zero_types.h"

namespace tiermem::detail::testing {

// Rank `rank` of `world`. The other ranks are simulated: in an all-gather every other rank's part
// is filled with the byte (other rank + 1); in a reduce-scatter and an all-reduce every rank sent
// the same data, so the result is world x this rank's. Collectives run when waited for (so a test
// sees in-order completion), and the next `fail_next` ones throw CommError there.
class FakeComm final : public Communicator {
 public:
  FakeComm(int rank, int world) : rank_(rank), world_(world) {}
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string_view backend() const override { return "fake"; }
  bool device_buffers() const override { return false; }
  CommHandle all_gather_async(const void*, void* recv, std::size_t count, DType dtype) override {
    ++all_gathers;
    const std::size_t part = count * dtype_size(dtype);
    return make([this, recv, part] {
      for (int r = 0; r < world_; ++r) {
        if (r != rank_) std::memset(static_cast<std::byte*>(recv) + r * part, r + 1, part);
      }
    });
  }
  CommHandle reduce_scatter_async(const void* send, void* recv, std::size_t count, DType, ReduceOp) override {
    ++reduce_scatters;
    return make([this, send, recv, count] {
      const float* s = static_cast<const float*>(send) + static_cast<std::size_t>(rank_) * count;
      float* d = static_cast<float*>(recv);
      for (std::size_t i = 0; i < count; ++i) d[i] = s[i] * static_cast<float>(world_);
    });
  }
  CommHandle all_reduce_async(const void* send, void* recv, std::size_t count, DType, ReduceOp) override {
    return make([this, send, recv, count] {
      const float* s = static_cast<const float*>(send);
      float* d = static_cast<float*>(recv);
      for (std::size_t i = 0; i < count; ++i) d[i] = s[i] * static_cast<float>(world_);
    });
  }
  CommHandle broadcast_async(void*, std::size_t, DType, int) override { return {}; }
  void barrier() override {}

  int fail_next = 0;  // collectives still to fail, at their wait
  int all_gathers = 0, reduce_scatters = 0;

 private:
  template <class Fn>
  struct Request final : detail::CommRequest {
    Fn fn;
    bool fail;
    bool done = false;
    Request(Fn f, bool x) : fn(std::move(f)), fail(x) {}
    bool test() override {
      wait();
      return true;
    }
    void wait() override {
      if (done) return;
      done = true;
      if (fail) throw CommError("FakeComm: injected failure");
      fn();
    }
  };
  template <class Fn>
  CommHandle make(Fn fn) {
    const bool fail = fail_next > 0;
    if (fail) --fail_next;
    return CommHandle(std::make_unique<Request<Fn>>(std::move(fn), fail));
  }
  int rank_, world_;
};

// Appends a module of `numel` elements laid out for `shape` (world, opt_rank), its shard cut
// into sub-groups of `sub_group_elems` (the last one shorter), the sub-groups indexed after the existing.
inline void add_module(std::vector<ZeroModule>& mods, std::vector<SubGroup>& sub_groups, const EngineShape& shape,
                       std::size_t numel, std::size_t sub_group_elems, std::size_t alignment = 1) {
  ZeroModule m;
  m.name = "m" + std::to_string(mods.size());
  m.numel = numel;
  m.shard = make_module_shard(numel, shape.opt_world, alignment);
  m.flat = mods.empty() ? 0 : mods.back().flat + mods.back().shard.shard;
  m.stored = true;
  for (std::size_t b = 0; b < m.shard.shard; b += sub_group_elems) {
    SubGroup p;
    p.module = static_cast<int>(mods.size());
    p.begin = b;
    p.end = std::min(m.shard.shard, b + sub_group_elems);
    p.flat = m.flat + b;
    m.sub_groups.push_back(static_cast<int>(sub_groups.size()));
    sub_groups.push_back(p);
  }
  mods.push_back(std::move(m));
}

}  // namespace tiermem::detail::testing
