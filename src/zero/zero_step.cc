// src/zero/zero_step.cc — ZeroEngine's optimizer step (AdamW streamed over sub-groups through the
// TensorStore), the overlapped step's deferred updates, and the gradient norm's lane sums. The
// state's export/import (checkpoints, export_master, set_module_params) is in zero_state.cc.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fmt/format.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "tiermem/adam.h"
#include "tiermem/log.h"
#include "tiermem/prefetcher.h"
#include "zero/zero_impl.h"

namespace tiermem {
namespace {

// Collective counts are bounded (MPI uses int); big buffers go in pieces of this many elements.
constexpr std::size_t kMaxCollectiveElems = std::size_t{1} << 28;

void all_reduce_sum(Communicator& comm, float* buf, std::size_t n) {
  for (std::size_t b = 0; b < n; b += kMaxCollectiveElems) {
    comm.all_reduce(buf + b, buf + b, std::min(kMaxCollectiveElems, n - b), DType::kF32, ReduceOp::kSum);
  }
}

}  // namespace

ZeroEngine::StepResult ZeroEngine::Impl::step() {
  finalize();
  sync();
  apply_all_pending(Phase::kOptimizer);  // a module not gathered since the last step
  int micro = 1;
  for (const auto& m : mods) micro = std::max(micro, m.grad_calls);

  // Finish the reduction stages 0 and 1 left for now.
  for (auto& m : mods) {
    if (stage == 0) {
      all_reduce_sum(comm, m.full_grad.data(), m.full_grad.size());
    } else if (stage == 1 && m.shard.shard > 0) {
      comm.reduce_scatter(m.full_grad.data(), m.shard_grad.data(), m.shard.shard, DType::kF32, ReduceOp::kSum);
      ++st.reduce_scatter_calls;
    }
  }

  // The gradient of piece p: host buffers (stages 0-1) or its partition in the store (2-3). A
  // partition no module wrote since the last step is zero.
  auto grad_of = [&](detail::Piece& p, TensorStore::Pin& pin) { return piece_grad(p, pin, Phase::kOptimizer); };
  const int B = std::max(1, cfg.zero.offload_optimizer.buffer_count);
  auto prefetch_after = [&](std::size_t k, bool with_state) {
    std::vector<TensorId> ids;
    for (std::size_t j = k + 1; j < pieces.size() && j < k + static_cast<std::size_t>(B); ++j) {
      if (pieces[j].on_device) continue;  // state (and gradient) already where it is used
      if (with_state) ids.push_back(pieces[j].optim);
      if (stage >= 2 && !pieces[j].grad_fresh) ids.push_back(pieces[j].grad);
    }
    if (!ids.empty()) store->prefetch(ids, Tier::kHost);
  };

  StepResult res;
  const bool pre_pass = scaler != nullptr || cfg.gradient_clipping > 0;
  double sumsq = 0;
  double module_sumsq = 0;
  auto add_sumsq = [&](std::size_t k, const float* g) {
    module_sumsq = piece_sumsq(k, g, module_sumsq);
    if (static_cast<std::size_t>(mods[static_cast<std::size_t>(pieces[k].module)].pieces.back()) == k) {
      sumsq += module_sumsq;
    }
  };
  // The norm folded into accumulation (no second read of the gradient partitions) when every
  // module with a gradient this step had all its pieces complete, in order, in its last reduce.
  bool folded = fold_norm();
  auto has_grad = [&](const detail::ZeroModule& m) {
    return !m.pieces.empty() && !pieces[static_cast<std::size_t>(m.pieces.front())].grad_fresh;
  };
  for (const auto& m : mods) {
    if (folded && has_grad(m) && !module_norm_ready(m)) folded = false;
  }
  if (folded) {
    for (const auto& m : mods) {  // module order, as the pre-pass adds them
      if (has_grad(m) && module_has_real(m)) sumsq += m.norm_running;
    }
  }

  if (pre_pass) {  // overflow check (fp16) and the global norm before anything is updated
    float bad = 0;
    for (std::size_t k = 0; k < pieces.size() && !folded; ++k) {
      prefetch_after(k, false);
      TensorStore::Pin pin;
      const float* g = grad_of(pieces[k], pin);
      const std::size_t n = pieces[k].size();
      if (scaler) bad += static_cast<float>(count_nonfinite(g, n));
      add_sumsq(k, g);
    }
    if (scaler) {
      if (stage > 0 && world > 1) comm.all_reduce(&bad, &bad, 1, DType::kF32, ReduceOp::kSum);
      const double used_scale = scaler->scale();
      if (scaler->update(bad > 0)) {
        ++st.skipped_steps;
        TM_LOG_WARN("ZERO", "fp16 gradient overflow: step skipped, loss scale {} -> {}", used_scale, scaler->scale());
        zero_grad();
        store->end_step();
        store->begin_step();
        res.skipped = true;
        res.loss_scale = scaler->scale();
        res.step = st.steps;
        return res;
      }
      res.loss_scale = used_scale;
    }
    if (stage > 0 && world > 1) {
      float f = static_cast<float>(sumsq);
      comm.all_reduce(&f, &f, 1, DType::kF32, ReduceOp::kSum);
      sumsq = f;
    }
  }
  // In fp32 as tiermem-train's loop computes it for its other engines (bitwise-equal runs).
  if (!opts.mean_over_micro_batches) micro = 1;  // the caller scaled each micro-batch's loss
  double grad_scale = static_cast<float>(1.0 / (static_cast<double>(world) * micro * (scaler ? res.loss_scale : 1.0)));
  if (pre_pass) {
    res.grad_norm = std::sqrt(sumsq) * grad_scale;
    if (cfg.gradient_clipping > 0 && res.grad_norm > cfg.gradient_clipping) {
      grad_scale = static_cast<float>(grad_scale * cfg.gradient_clipping / (res.grad_norm + 1e-6));
    }
  }

  AdamParams ap;
  ap.lr = static_cast<float>(cfg.optimizer.lr);
  ap.beta1 = cfg.optimizer.beta1;  // double: 1 - beta computed from the configured value
  ap.beta2 = cfg.optimizer.beta2;
  ap.eps = static_cast<float>(cfg.optimizer.eps);
  ap.weight_decay = static_cast<float>(cfg.optimizer.weight_decay);
  ap.step = st.steps + 1;
  ap.grad_scale = static_cast<float>(grad_scale);

  // Overlapped with the next forward (tiermem.overlap_optimizer_step): with the norm known
  // without reading a gradient (folded into accumulation; no fp16 overflow check), each stored
  // stage-3 module's update waits for its next gather (apply_pending), so its sub-groups' NVMe
  // reads and write-backs run beside the forward pass instead of before it. Bit for bit the same
  // update, with this step's scalars.
  // "auto": on when the optimizer state streams from NVMe and the working parameters stay on the
  // device (publish_tier), so the deferred updates have the host pool to themselves during the
  // forward pass; where parameters page through the host pool too they would fight for it (gpt2-xl,
  // 1 GiB device / 2 GiB host: step 2 read 55 GB and took 39.8 s deferred, 35 GB and 25.8 s eager).
  const bool defer = defers_optimizer_step(plan, cfg, publish_tier == Tier::kDevice, folded && !scaler);
  pending_ap = ap;

  // Sub-groups in order; AdamW writes every element of each module's working shard.
  WorkingShardOut working(*this);
  const std::function<void(std::size_t, const float*)> norm_hook =
      !pre_pass && !folded ? std::function<void(std::size_t, const float*)>(add_sumsq) : nullptr;
  for (std::size_t k = 0; k < pieces.size(); ++k) {
    detail::Piece& p = pieces[k];
    detail::ZeroModule& m = mods[static_cast<std::size_t>(p.module)];
    if (defer && m.stored) {
      if (!m.pending) ++pending_modules;
      m.pending = true;
      continue;
    }
    prefetch_after(k, true);
    update_piece(k, ap, working, Phase::kOptimizer, norm_hook);
  }
  working.finish();
  if (!pre_pass) {
    if (stage > 0 && world > 1) {
      float f = static_cast<float>(sumsq);
      comm.all_reduce(&f, &f, 1, DType::kF32, ReduceOp::kSum);
      sumsq = f;
    }
    res.grad_norm = std::sqrt(sumsq) * grad_scale;
  }

  // Publish the new working params of the modules kept whole.
  for (auto& m : mods) {
    if (m.full.p != nullptr && (stage == 1 || stage == 2 || m.persistent)) {
      comm.all_gather(m.mem_shard.p, m.full.p, m.shard.shard, comm_dtype);
      ++st.all_gather_calls;
    }
  }
  store->end_step();  // the step's trace ends here (the Prefetcher records the first, replays later)
  if (defer && !deferred_before) {
    // The trace recorded so far has no updates inside the forward pass; from now on every step
    // has them: record the next step afresh (a new Prefetcher), instead of diverging on it.
    store->set_policy(std::make_unique<Prefetcher>(PrefetcherOptions::from_config(cfg, wdtype)));
    deferred_before = true;
  }
  store->begin_step();
  ++st.steps;
  zero_grad();
  res.step = st.steps;
  if (scaler) res.loss_scale = scaler->scale();
  return res;
}

const float* ZeroEngine::Impl::piece_grad(detail::Piece& p, TensorStore::Pin& pin, Phase phase) {
  detail::ZeroModule& m = mods[static_cast<std::size_t>(p.module)];
  if (stage == 0) return m.full_grad.data() + p.begin;
  if (stage == 1) return m.shard_grad.data() + p.begin;
  if (p.grad_fresh) {  // no gradient since the last step: zero
    pin = store->acquire_for_overwrite(p.grad, p.gtier);
    std::memset(pin.data(), 0, pin.bytes());
    p.grad_fresh = false;
  } else {
    pin = store->acquire(p.grad, p.gtier, phase);
    if (phase == Phase::kOutsideStep) m.replay.emplace_back(p.grad, p.gtier);
  }
  return pin.as<const float>();
}

void ZeroEngine::Impl::update_piece(std::size_t k, const AdamParams& ap, WorkingShardOut& working, Phase phase,
                                    const std::function<void(std::size_t, const float*)>& on_grad) {
  detail::Piece& p = pieces[k];
  if (p.on_device) return update_piece_on_device(k, ap, working, phase, on_grad);  // zero_device_step.cc
  TensorStore::Pin state = store->acquire(p.optim, Tier::kHost, phase);
  if (phase == Phase::kOutsideStep) mods[static_cast<std::size_t>(p.module)].replay.emplace_back(p.optim, Tier::kHost);
  TensorStore::Pin gpin;
  const float* g = piece_grad(p, gpin, phase);
  if (on_grad) on_grad(k, g);
  std::byte* out = working.dest(p);
  float* s = state.as<float>();
  const std::size_t n = p.size();
  // The new working params are written by the same pass (bf16/fp16 rounded, or an fp32 copy).
  adam_step(ap, s, g, s + n, s + 2 * n, n, out, wdtype);
  state.mark_dirty();
  state.release();
  gpin.release();
  if (stage >= 2) {  // consumed: the next accumulation overwrites it, so it is never written down
    store->discard(p.grad);
    p.grad_fresh = true;
  }
}

void ZeroEngine::Impl::apply_pending(int mi, Phase phase) {
  detail::ZeroModule& m = mods[static_cast<std::size_t>(mi)];
  if (!m.pending) return;
  m.pending = false;
  --pending_modules;
  const int B = std::max(1, cfg.zero.offload_optimizer.buffer_count);
  WorkingShardOut working(*this);
  for (std::size_t j = 0; j < m.pieces.size(); ++j) {
    // The module's next sub-groups on their way while this one steps (across modules the
    // Prefetcher's look-ahead runs ahead of the gathers).
    std::vector<TensorId> ids;
    for (std::size_t q = j + 1; q < m.pieces.size() && q < j + static_cast<std::size_t>(B); ++q) {
      const detail::Piece& nxt = pieces[static_cast<std::size_t>(m.pieces[q])];
      if (nxt.on_device) continue;  // already where it is stepped
      ids.push_back(nxt.optim);
      if (!nxt.grad_fresh) ids.push_back(nxt.grad);
    }
    if (!ids.empty()) store->prefetch(ids, Tier::kHost);
    update_piece(static_cast<std::size_t>(m.pieces[j]), pending_ap, working, phase, nullptr);
  }
  working.finish();
}

void ZeroEngine::Impl::apply_all_pending(Phase phase) {
  for (int i = 0; i < static_cast<int>(mods.size()) && pending_modules > 0; ++i) apply_pending(i, phase);
}

void ZeroEngine::Impl::replay_outside_accesses(int mi) {
  detail::ZeroModule& m = mods[static_cast<std::size_t>(mi)];
  for (const auto& [id, tier] : m.replay) store->touch(id, tier, Phase::kOptimizer);
  m.replay.clear();
}

// WorkingShardOut (where each sub-group's new working params go): zero_device.cc.

// Adds the squares of piece k's real (not padding) gradient elements as tiermem-train's loop does
// for its other engines — one reduction per module, in element order — so that one rank's clipped
// steps equal theirs bit for bit (exactly when a module is one sub-group or small enough for one
// thread). Used by step()'s pre-pass and, folded, by accumulate_grad: the same arithmetic.
std::size_t ZeroEngine::Impl::valid_len(std::size_t k) const {
  const detail::Piece& p = pieces[k];
  const detail::ZeroModule& m = mods[static_cast<std::size_t>(p.module)];
  const ElemRange valid = m.shard.valid(opt_rank);
  const std::size_t valid_end = valid.end - m.shard.range(opt_rank).begin;  // shard-local
  return std::min(p.end, std::max(valid_end, p.begin)) - p.begin;
}

namespace {
// 32 double lanes (element i in lane i mod 32) as four 8-wide vectors (GCC vector extensions: the
// same lanes whatever instructions the compiler picks, so the sum does not depend on the ISA; a
// float product is exact in double, so neither does FMA contraction). Lane order at the end.
typedef float F8 __attribute__((vector_size(32), aligned(4)));
typedef double D8 __attribute__((vector_size(64)));
constexpr std::size_t kLanes = 32;

inline void add_block(D8 acc[4], const float* x) {
  for (int q = 0; q < 4; ++q) {
    F8 f;
    std::memcpy(&f, x + 8 * q, sizeof f);
    const D8 d = __builtin_convertvector(f, D8);
    acc[q] += d * d;
  }
}

inline double lane_sum(const D8 acc[4], const float* tail, std::size_t rest) {
  double lane[kLanes];
  for (int q = 0; q < 4; ++q)
    for (int j = 0; j < 8; ++j) lane[8 * q + j] = acc[q][j];
  for (std::size_t j = 0; j < rest; ++j) lane[j] += static_cast<double>(tail[j]) * tail[j];
  double sum = 0;
  for (double x : lane) sum += x;
  return sum;
}
}  // namespace

double detail::sumsq_lanes(const float* g, std::size_t n) {
  D8 acc[4] = {};
  std::size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) add_block(acc, g + i);
  return lane_sum(acc, g + i, n - i);
}

namespace {
// One block of kLanes floats from src to dst; with `stream`, by non-temporal stores (dst 16-byte
// aligned): the destination is a gradient partition the CPU reads next at the optimizer step, or
// never (it is written to NVMe), so its lines need not be read for ownership nor kept in cache.
inline void copy_block(float* dst, const float* src, bool stream) {
#if defined(__x86_64__)
  if (stream) {
    for (std::size_t k = 0; k < kLanes; k += 4) _mm_stream_ps(dst + k, _mm_loadu_ps(src + k));
    return;
  }
#endif
  (void)stream;
  std::memcpy(dst, src, kLanes * sizeof(float));
}

inline void stream_fence(bool stream) {
#if defined(__x86_64__)
  if (stream) _mm_sfence();  // the streamed stores are seen before the pin's release
#endif
  (void)stream;
}

// Below this many floats the destination may as well stay in cache.
constexpr std::size_t kStreamMinElems = std::size_t{1} << 16;  // 256 KiB

inline bool streamable(const float* dst, std::size_t n) {
#if defined(__x86_64__)
  return n >= kStreamMinElems && reinterpret_cast<std::uintptr_t>(dst) % 16 == 0;
#else
  (void)dst, (void)n;
  return false;
#endif
}

// Copies src[0, n) to dst (non-temporal stores when `stream`), whole blocks of kLanes below `m`
// one at a time, each handed to on_block while in cache and then zeroed in `clear` when given; the
// rest (the tail, and what lies past m) by memcpy. Returns where the whole blocks ended.
template <class OnBlock>
std::size_t copy_blocks(float* dst, const float* src, std::size_t n, std::size_t m, float* clear, bool stream,
                        OnBlock on_block) {
  std::size_t i = 0;
  for (; i + kLanes <= m; i += kLanes) {
    copy_block(dst + i, src + i, stream);
    on_block(src + i);
    if (clear) std::memset(clear + i, 0, kLanes * sizeof(float));  // its lines are in cache now
  }
  std::memcpy(dst + i, src + i, (n - i) * sizeof(float));
  if (clear) std::memset(clear + i, 0, (n - i) * sizeof(float));
  stream_fence(stream);
  return i;
}
}  // namespace

double detail::copy_sumsq_lanes(float* dst, const float* src, std::size_t n, std::size_t n_sum, float* clear) {
  const std::size_t m = std::min(n, n_sum);
  D8 acc[4] = {};
  // Whole blocks are summed from src before `clear` zeroes them; the last partial block from its
  // copy in dst (the same values), since `clear` may be src.
  const auto add = [&](const float* block) { add_block(acc, block); };
  const std::size_t i = copy_blocks(dst, src, n, m, clear, streamable(dst, n), add);
  return lane_sum(acc, dst + i, m - i);
}

void detail::copy_lanes(float* dst, const float* src, std::size_t n, float* clear, bool read_next) {
  copy_blocks(dst, src, n, n, clear, !read_next && streamable(dst, n), [](const float*) {});
}

double ZeroEngine::Impl::piece_sumsq(std::size_t k, const float* g, double running,
                                      std::optional<double> partial) const {
  const detail::Piece& p = pieces[k];
  const detail::ZeroModule& m = mods[static_cast<std::size_t>(p.module)];
  const std::int64_t n = static_cast<std::int64_t>(valid_len(k));
  const bool first = static_cast<std::size_t>(m.pieces.front()) == k;
  const bool last = static_cast<std::size_t>(m.pieces.back()) == k;
  if (first && last) {
    double part = 0;
#pragma omp parallel for reduction(+ : part) schedule(static) if (n > (1 << 18))
    for (std::int64_t i = 0; i < n; ++i) part += static_cast<double>(g[i]) * g[i];
    return part;
  }
  // A module of several sub-groups: its sub-groups' sums (sumsq_lanes, or `partial` when the
  // caller computed it in its own pass over g) added in order.
  if (first) running = 0;
  return running + (partial ? *partial : detail::sumsq_lanes(g, static_cast<std::size_t>(n)));
}

bool ZeroEngine::Impl::fold_norm() const { return stage >= 2 && scaler == nullptr; }

// Piece pi's partition g holds its gradient as of the reduce call that just completed it: the
// module's running sum of squares moves on by this piece when it is the next in order.
// Pieces with no real element (all padding: possible on the last ranks) are never completed by
// an accumulation; they add nothing but their place in the order (the first one resets the sum).
void ZeroEngine::Impl::fold_piece_norm(int pi, const float* g, std::optional<double> partial) {
  detail::ZeroModule& m = mods[static_cast<std::size_t>(pieces[static_cast<std::size_t>(pi)].module)];
  const std::size_t first = static_cast<std::size_t>(m.pieces.front());  // a module's pieces are consecutive
  const std::size_t j = static_cast<std::size_t>(pi) - first;
  auto skip_empty = [&] {
    while (m.norm_next < m.pieces.size() && valid_len(first + m.norm_next) == 0) {
      if (m.norm_next == 0) m.norm_running = 0;
      ++m.norm_next;
    }
  };
  std::size_t first_real = 0;
  while (first_real < m.pieces.size() && valid_len(first + first_real) == 0) ++first_real;
  if (j == first_real) {  // the module's first piece of this reduce call
    m.norm_next = 0;
    m.norm_broken = false;
  }
  skip_empty();
  if (j != m.norm_next) {
    m.norm_broken = true;
    return;
  }
  m.norm_running = piece_sumsq(static_cast<std::size_t>(pi), g, m.norm_running, partial);
  ++m.norm_next;
  skip_empty();
}

bool ZeroEngine::Impl::module_has_real(const detail::ZeroModule& m) const {
  for (int k : m.pieces) {
    if (valid_len(static_cast<std::size_t>(k)) > 0) return true;
  }
  return false;
}

bool ZeroEngine::Impl::module_norm_ready(const detail::ZeroModule& m) const {
  if (!module_has_real(m)) return true;  // adds nothing
  return !m.norm_broken && m.norm_next == m.pieces.size();
}

}  // namespace tiermem
