// src/zero/gatherer.h — the engine's stage-3 all-gathers of working parameters: the buffers
// gathers land in, the asynchronous all-gathers started ahead of their gather() (prefetch), and
// the gathered-bytes accounting (live and peak, ZeroStats::gathered_bytes_peak) with the gather
// counters. What to gather and when (the deferred update before a read, the store's pin at the
// compute tier) is the engine's; the gatherer starts, finishes and frees. It also publishes the
// modules kept whole after a step or an import (publish_whole_modules).
//
// Buffers: a module's all-gather buffer holds shard.padded x wsize bytes, in host memory (4 KiB
// aligned) or in device memory (when gathers compute on an addressable device); it is counted live
// from its allocation until free(). The engine owns a buffer handed out by take()/gather(), and
// gives it back with free() (a Gathered's release). A pending gather's buffer is the gatherer's.
//
// Completion: start() copies this rank's shard into its place in a new buffer (a frozen module
// stored in fewer bytes, ZeroModule::quantized(), is dequantized there instead: tiermem/quantize.h)
// and starts the in-place all-gather; the buffer is complete when take() returns it. A collective that fails
// frees its buffer before its CommError is rethrown (take, gather, drop_pending), so no error
// leaks a buffer. Every pending gather was issued on every rank, so each completes.
//
// Thread-safety: none; the engine's driving thread only. Units: bytes, elements as named.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <vector>

#include "tiermem/communicator.h"
#include "tiermem/device.h"
#include "tiermem/tensor_store.h"
#include "tiermem/zero_engine.h"
#include "zero/zero_types.h"

namespace tiermem::detail {

class Gatherer {
 public:
  // `device`: the engine's (may be null until its tiers are made, and stay null without one).
  Gatherer(Communicator& comm, const EngineShape& shape, const std::vector<ZeroModule>& mods,
           const std::shared_ptr<Device>& device)
      : comm_(comm), shape_(shape), mods_(mods), device_(device) {}
  Gatherer(const Gatherer&) = delete;
  Gatherer& operator=(const Gatherer&) = delete;
  ~Gatherer();  // frees what is still pending (errors logged)

  // A gathered module's buffer and where it lives.
  struct Buffer {
    void* data = nullptr;
    bool on_device = false;
  };

  // The all-gather of `module` from its pinned working shard (released once copied), finished
  // now: the whole module's working params (shape.compute_tier decides host or device memory).
  // With one rank it is the engine's way to a quantized module's working params (the copy is
  // the dequantize; the all-gather of one rank is a no-op).
  Buffer gather(int module, TensorStore::Pin pin);
  // As gather(), but left running (prefetch_gather): its buffer waits in the pending queue for
  // take(module). Counted in ZeroStats::all_gathers_prefetched.
  void prefetch(int module, TensorStore::Pin pin);
  bool pending(int module) const;
  std::size_t pending_count() const { return pending_.size(); }
  // The pending gather of `module`, waited for and taken out of the queue; nullopt when none.
  std::optional<Buffer> take(int module);
  // Finishes and frees the oldest pending gathers until fewer than `max` are pending (a
  // prediction that did not come true holds no more); rethrows a failed one's error.
  void trim(std::size_t max);
  // Waits for every pending gather and frees its buffer; rethrows the first CommError after all
  // are freed.
  void drop_pending();

  // A buffer the engine made itself (an opaque device's staged all-gather, device_staging.h):
  // counted as one all-gather and live bytes until free().
  void adopt(int module);
  // Frees a buffer handed out by gather(), take() or counted by adopt().
  void free(int module, const Buffer& buf) noexcept;

  // The modules kept whole (stages 1-2, and stage 3's persistent ones; every module but the frozen
  // ones, or only `module` when >= 0): each all-gathers its new working params from every rank's
  // shard (mem_shard) into its whole copy (full), now. Collective: every rank calls it alike.
  // Counted in all_gather_calls.
  void publish_whole_modules(int module);

  std::uint64_t live_bytes() const { return live_bytes_; }
  // gathered_bytes_peak, all_gather_calls (added to the count already in `s`), all_gathers_prefetched.
  void add_stats(ZeroStats& s) const;

 private:
  struct Pending {
    int module = -1;
    Buffer buf;
    CommHandle handle;
  };
  std::uint64_t buffer_bytes(int module) const;
  Buffer alloc(int module);
  void count(int module);
  Pending start(int module, TensorStore::Pin pin);
  void* finish(Pending&& pg);  // waits; frees the buffer and rethrows when the collective failed

  Communicator& comm_;
  const EngineShape& shape_;
  const std::vector<ZeroModule>& mods_;
  const std::shared_ptr<Device>& device_;
  std::deque<Pending> pending_;
  std::uint64_t live_bytes_ = 0, peak_bytes_ = 0;
  std::uint64_t calls_ = 0, prefetched_ = 0;
};

}  // namespace tiermem::detail
