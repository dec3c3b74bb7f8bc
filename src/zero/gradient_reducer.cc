// src/zero/gradient_reducer.cc — see gradient_reducer.h.
#include "zero/gradient_reducer.h"

#include <algorithm>
#include <cstring>
#include <optional>


#include "zero/reduce_bucket.h"
#include "zero/norm_fold.h"

namespace tiermem::detail {
namespace {

// Collective counts are bounded (MPI uses int); big buffers go in chunks of this many elements.
constexpr std::size_t kMaxCollectiveElems = std::size_t{1} << 28;

void all_reduce_sum(Communicator& comm, float* buf, std::size_t n) {
  for (std::size_t b = 0; b < n; b += kMaxCollectiveElems) {
    comm.all_reduce(buf + b, buf + b, std::min(kMaxCollectiveElems, n - b), DType::kF32, ReduceOp::kSum);
  }
}

}  // namespace

GradientReducer::GradientReducer(Communicator& comm, const EngineShape& shape, Options opts,
                                 std::vector<ZeroModule>& mods, std::vector<SubGroup>& sub_groups,
                                 const std::unique_ptr<TensorStore>& store, NormTracker& norm,
                                 HostPeakSampler sample_host_peak)
    : comm_(comm),
      shape_(shape),
      opts_(opts),
      mods_(mods),
      sub_groups_(sub_groups),
      store_(store),
      norm_(norm),
      sample_host_peak_(std::move(sample_host_peak)) {}

GradientReducer::~GradientReducer() = default;  // task_, the last member, goes first

std::vector<GradientReducer::Work> GradientReducer::pin(int mi, std::size_t begin, std::size_t n) {
  ZeroModule& m = mods_[static_cast<std::size_t>(mi)];
  const std::size_t end = begin + n;
  std::vector<Work> work;
  for (int pi : m.sub_groups) {
    SubGroup& p = sub_groups_[static_cast<std::size_t>(pi)];
    const std::size_t lo = std::max(begin, p.begin), hi = std::min(end, p.end);
    if (lo >= hi) continue;
    Work w;
    w.sub_group = pi;
    w.lo = lo;
    w.hi = hi;
    w.fresh = p.grad_fresh;
    if (p.grad_fresh) {
      // First gradient since the step: no need to read the old partition. Pinned by add
      // (acquire_for_overwrite is no access the Prefetcher records, so it may run on the gradient
      // thread, and so may the write-back of whatever it evicts for room). The policy hears of it
      // here, in call order: it needs room now, and that shapes what the pool can hold.
      store_->touch(p.grad, p.gtier, Phase::kBackward, /*overwrite=*/true);
      p.grad_fresh = false;
    } else {
      w.pin = store_->acquire(p.grad, p.gtier, Phase::kBackward);
    }
    work.push_back(std::move(w));
  }
  return work;
}

std::size_t GradientReducer::add(std::vector<Work>& work, std::size_t begin, const float* src, float* clear) {
  std::size_t cleared = 0;
  for (Work& w : work) {
    const int pi = w.sub_group;
    SubGroup& p = sub_groups_[static_cast<std::size_t>(pi)];
    if (!w.pin.valid()) w.pin = store_->acquire_for_overwrite(p.grad, p.gtier);
    float* g = w.pin.as<float>();
    const std::size_t lo = w.lo, hi = w.hi;
    const float* s = src + (lo - begin);
    float* c = clear ? clear + (lo - begin) : nullptr;
    const std::size_t t = norm_.valid_len(static_cast<std::size_t>(pi));
    std::optional<double> partial;  // its sum of squares, when the copy computed it
    if (w.fresh) {  // the covered range is copied, the rest zeroed: one pass, no read of g
      std::memset(g, 0, (lo - p.begin) * sizeof(float));
      const bool whole = lo == p.begin && hi >= p.begin + t;  // every real element arrives now
      const bool several = mods_[static_cast<std::size_t>(p.module)].sub_groups.size() > 1;
      if (whole && several && norm_.folds()) {
        partial = copy_sumsq_lanes(g, s, hi - lo, t, c);  // the norm's read in the same pass
      } else {
        copy_lanes(g + (lo - p.begin), s, hi - lo, c, /*read_next=*/norm_.folds());  // the norm reads g
      }
      std::memset(g + (hi - p.begin), 0, (p.end - hi) * sizeof(float));
    } else {
      float* d = g + (lo - p.begin);
      for (std::size_t k = 0; k < hi - lo; ++k) d[k] += s[k];
      if (c) std::fill(c, c + (hi - lo), 0.0f);
    }
    if (c) cleared += hi - lo;
    // Count the real elements this call gave the sub-group: when all have arrived (exactly once per
    // reduce call), its partition holds the gradient as of this call — fold its norm now.
    const std::size_t vlo = std::max(lo, p.begin), vhi = std::min(hi, p.begin + t);
    if (vhi > vlo) p.acc_elems += vhi - vlo;
    if (t > 0 && p.acc_elems == t) {
      p.acc_elems = 0;
      if (norm_.folds()) norm_.fold(pi, g, partial);
    }
    w.pin.mark_dirty();
    w.pin.release();
  }
  return cleared;
}

void GradientReducer::accumulate(int mi, std::size_t begin, const float* src, std::size_t n) {
  std::vector<Work> work = pin(mi, begin, n);
  add(work, begin, src);
}

void GradientReducer::complete_front() {
  Bucket f = std::move(inflight_.front());
  inflight_.pop_front();
  f.handle.wait();
  bucket_bytes_live_ -= 4 * (f.send.size() + f.recv.size());
  accumulate(f.module, f.begin, f.recv.data(), f.recv.size());
}

void GradientReducer::reduce(int module, std::span<const float> grad) {
  ZeroModule& m = mods_[static_cast<std::size_t>(module)];
  if (shape_.stage <= 1) {
    float* dst = m.full_grad.data();
    for (std::size_t i = 0; i < grad.size(); ++i) dst[i] += grad[i];
    return;
  }
  if (shape_.world == 1) {  // the shard is the module: straight into the gradient partitions
    accumulate(module, 0, grad.data(), grad.size());
    return;
  }
  for (const ElemRange& c : make_reduce_chunks(m.shard.shard, shape_.world, opts_.bucket_elems, opts_.alignment_elems)) {
    Bucket f;
    const std::size_t len = c.size();
    f.send = pack_reduce_bucket(grad, m.shard, shape_.world, c);  // reduce_bucket.h
    f.recv.assign(len, 0.0f);
    f.module = module;
    f.begin = c.begin;
    f.handle = comm_.reduce_scatter_async(f.send.data(), f.recv.data(), len, DType::kF32, ReduceOp::kSum);
    ++reduce_scatter_calls_;
    bucket_bytes_live_ += 4 * (f.send.size() + f.recv.size());
    sample_host_peak_(0);
    inflight_.push_back(std::move(f));
    if (!opts_.overlap) {
      complete_front();
    } else {
      while (inflight_.size() > static_cast<std::size_t>(std::max(1, opts_.max_inflight))) complete_front();
    }
  }
}

void GradientReducer::hand_off(int module, std::vector<float>&& grad) {
  auto buf = std::make_shared<std::vector<float>>(std::move(grad));
  // Leaves what it read zero: the buffer is ready to be handed out again (buffer()).
  start_task(module, std::span<const float>(*buf), buf, buf->data());
  task_buf_ = buf;
  task_bytes_ = buf->size() * sizeof(float);
  // The spare is not sampled here: it is the buffer the caller's next buffer() takes (counted by
  // the caller then), and until then it stands for the one the caller just gave up.
  sample_host_peak_(spare_.capacity() * sizeof(float));
}

void GradientReducer::lend(int module, std::span<const float> grad, std::shared_ptr<const void> keep) {
  // The caller's memory: not counted in host_bytes(), never cleared.
  start_task(module, grad, std::move(keep), nullptr);
}

void GradientReducer::start_task(int module, std::span<const float> grad, std::shared_ptr<const void> keep,
                                 float* clear) {
  auto work = std::make_shared<std::vector<Work>>(pin(module, 0, grad.size()));
  const bool hold = hold_pins_;
  if (hold) task_work_ = work;  // released by wait_hand_off(), on the driving thread
  task_.start([this, work, grad, keep = std::move(keep), clear, hold]() mutable {
    try {
      const std::size_t zeroed = add(*work, 0, grad.data(), clear);
      if (clear != nullptr && zeroed != grad.size()) std::fill(clear, clear + grad.size(), 0.0f);
    } catch (...) {
      work->clear();  // the pins go before the error is reported
      keep.reset();
      throw;
    }
    if (!hold) work->clear();
    keep.reset();  // done with the memory: the owner may reuse it before the task is joined
  });
}

std::vector<float> GradientReducer::buffer(std::size_t n) {
  if (spare_.capacity() < n) return std::vector<float>(n);
  std::vector<float> v = std::move(spare_);  // zeroed; resize() zeroes any growth
  spare_ = {};
  v.resize(n);
  return v;
}

void GradientReducer::wait_hand_off() {
  if (!task_.running()) return;
  std::shared_ptr<std::vector<float>> buf = std::move(task_buf_);
  task_bytes_ = 0;
  std::shared_ptr<std::vector<Work>> held = std::move(task_work_);
  task_.join();  // rethrows
  held.reset();  // the pins it held (hold_pins), released here
  // Its buffer, zeroed by the task, becomes the spare for the next buffer() call.
  if (buf && buf->capacity() >= spare_.capacity()) spare_ = std::move(*buf);
}

void GradientReducer::sync() {
  wait_hand_off();
  while (!inflight_.empty()) complete_front();
}

int GradientReducer::finish_step() {
  int micro = 1;
  for (const auto& m : mods_) micro = std::max(micro, m.grad_calls);
  for (auto& m : mods_) {
    if (m.frozen) continue;  // no gradient
    if (shape_.stage == 0) {
      all_reduce_sum(comm_, m.full_grad.data(), m.full_grad.size());
    } else if (shape_.stage == 1 && m.shard.shard > 0) {
      comm_.reduce_scatter(m.full_grad.data(), m.shard_grad.data(), m.shard.shard, DType::kF32, ReduceOp::kSum);
      ++reduce_scatter_calls_;
    }
  }
  return micro;
}

std::uint64_t GradientReducer::host_bytes() const {
  return bucket_bytes_live_ + task_bytes_ + spare_.capacity() * sizeof(float);
}

void GradientReducer::add_stats(ZeroStats& s) const { s.reduce_scatter_calls += reduce_scatter_calls_; }

}  // namespace tiermem::detail
