// src/zero/zero_state.cc — ZeroEngine's state in and out, one optimizer sub-group at a time: the
// per-rank checkpoint export/import (ZeroOptimizerState, streamed or as vectors), export_master,
// and set_module_params (a module's parameters written back). See include/tiermem/zero_engine.h.
#include <algorithm>
#include <fmt/format.h>

#include "zero/zero_impl.h"

namespace tiermem {

// --------------------------------------------------------------------------------- export

std::vector<float> ZeroEngine::export_master(int module) {
  Impl& I = *impl_;
  if (module < 0 || module >= num_modules()) throw Error("ZeroEngine::export_master: unknown module " + std::to_string(module));
  if (I.plan_in.planned && !I.plan_in.finalized) {  // registration still open: each module was written when registered
    const bool frozen = I.mods[static_cast<std::size_t>(module)].frozen;
    return frozen ? I.frozen_params(module) : I.gather_state(module, 0);
  }
  I.finalize();
  I.updates.refuse_half_step("export_master");
  I.sync();
  I.updates.apply(module, Phase::kOutsideStep);
  if (I.mods[static_cast<std::size_t>(module)].frozen) return I.frozen_params(module);
  return I.gather_state(module, 0);
}

std::vector<float> ZeroEngine::Impl::gather_state(int module, std::size_t third) {
  const detail::ZeroModule& m = mods[static_cast<std::size_t>(module)];
  std::vector<float> full(m.shard.padded);
  float* mine = full.data() + static_cast<std::size_t>(shape.opt_rank) * m.shard.shard;
  std::vector<float> tmp;
  if (m.shared_master && third == 0) {  // the master is the fp32 working shard
    store->read(m.param, std::as_writable_bytes(std::span<float>(mine, m.shard.shard)));
  } else {
    const std::size_t slots = m.shared_master ? 2 : 3, slot = m.shared_master ? third - 1 : third;
    for (int pi : m.sub_groups) {
      const detail::SubGroup& p = sub_groups[static_cast<std::size_t>(pi)];
      tmp.resize(slots * p.size());
      store->read(p.optim, std::as_writable_bytes(std::span<float>(tmp)));
      std::copy_n(tmp.begin() + static_cast<std::ptrdiff_t>(slot * p.size()), p.size(), mine + p.begin);
    }
  }
  if (shape.opt_world > 1) comm.all_gather(mine, full.data(), m.shard.shard, DType::kF32);
  full.resize(m.numel);
  return full;
}

void ZeroEngine::Impl::set_state(int module, std::size_t third, std::span<const float> values) {
  const detail::ZeroModule& m = mods[static_cast<std::size_t>(module)];
  const ElemRange r = m.shard.range(shape.opt_rank);
  // Shard elements [p.begin, p.end) are module elements r.begin + [p.begin, p.end); padding past
  // the module's end stays 0. The other thirds of each sub-group are kept.
  rewrite_state(module, /*keep=*/true, [&](const detail::SubGroup& p, float* s) {
    const std::size_t lo = std::min(r.begin + p.begin, m.numel), hi = std::min(r.begin + p.end, m.numel);
    std::copy(values.begin() + static_cast<std::ptrdiff_t>(lo), values.begin() + static_cast<std::ptrdiff_t>(hi),
              s + third * p.size());
  });
}

namespace {
const char* state_kind_name(OptimizerStateKind k) {
  return k == OptimizerStateKind::kMaster ? "master" : k == OptimizerStateKind::kExpAvg ? "exp_avg" : "exp_avg_sq";
}

// Module `module` of `mods` exists and trains, or Error naming `call`.
const detail::ZeroModule& trained_module(const std::vector<detail::ZeroModule>& mods, int module, const char* call) {
  if (module < 0 || static_cast<std::size_t>(module) >= mods.size()) {
    throw Error(fmt::format("ZeroEngine::{}: unknown module {}", call, module));
  }
  const detail::ZeroModule& m = mods[static_cast<std::size_t>(module)];
  if (m.frozen) {
    throw Error(fmt::format("ZeroEngine::{}: module {} (\"{}\") is frozen: it has no gradient or optimizer state",
                            call, module, m.name));
  }
  return m;
}
}  // namespace

std::vector<float> ZeroEngine::export_module_state(int module, OptimizerStateKind kind) {
  Impl& I = *impl_;
  I.finalize();
  trained_module(I.mods, module, "export_module_state");
  I.updates.refuse_half_step("export_module_state");
  I.sync();
  I.updates.apply(module, Phase::kOutsideStep);
  return I.gather_state(module, static_cast<std::size_t>(kind));
}

void ZeroEngine::set_module_state(int module, OptimizerStateKind kind, std::span<const float> values) {
  Impl& I = *impl_;
  I.finalize();
  const detail::ZeroModule& m = trained_module(I.mods, module, "set_module_state");
  I.updates.refuse_half_step("set_module_state");
  if (kind == OptimizerStateKind::kMaster) return set_module_params(module, values);
  if (values.size() != m.numel) {
    throw Error(fmt::format("ZeroEngine::set_module_state(\"{}\", {}): {} values given, the module has {} elements",
                            m.name, state_kind_name(kind), values.size(), m.numel));
  }
  I.sync();
  if (I.updates.pending(module)) I.updates.apply(module, Phase::kOutsideStep);
  I.set_state(module, static_cast<std::size_t>(kind), values);
}

std::vector<float> ZeroEngine::export_grad(int module) {
  Impl& I = *impl_;
  I.finalize();
  const detail::ZeroModule& m = trained_module(I.mods, module, "export_grad");
  if (m.stepped_in_backward) {
    throw Error(fmt::format("ZeroEngine::export_grad: module {} (\"{}\") was updated in this backward pass "
                            "(step_in_backward) and its gradient consumed; read gradients before step() with "
                            "tiermem.update_in_backward false",
                            module, m.name));
  }
  I.sync();
  I.updates.apply(module, Phase::kOutsideStep);  // after a deferring step() its gradient is consumed
  std::vector<float> full(m.shard.padded, 0.0f);
  if (I.shape.stage <= 1) {  // the whole local gradient, not reduced yet: its sum over ranks
    std::copy(m.full_grad.begin(), m.full_grad.end(), full.begin());
    if (I.shape.world > 1) I.comm.all_reduce(full.data(), full.data(), full.size(), DType::kF32, ReduceOp::kSum);
  } else {  // this rank's reduced partitions, all-gathered
    float* mine = full.data() + static_cast<std::size_t>(I.shape.opt_rank) * m.shard.shard;
    for (int pi : m.sub_groups) {
      const detail::SubGroup& p = I.sub_groups[static_cast<std::size_t>(pi)];
      if (p.grad_fresh) continue;  // no gradient since the last step: zeros
      I.store->read(p.grad, std::as_writable_bytes(std::span<float>(mine + p.begin, p.size())));
    }
    if (I.shape.opt_world > 1) I.comm.all_gather(mine, full.data(), m.shard.shard, DType::kF32);
  }
  int micro = 1;
  for (const auto& x : I.mods) micro = std::max(micro, x.grad_calls);
  double div = static_cast<double>(I.shape.world) * (I.opts.mean_over_micro_batches ? micro : 1);
  if (I.scaler) div *= I.scaler->scale();
  const float inv = static_cast<float>(1.0 / div);
  for (float& x : full) x *= inv;
  full.resize(m.numel);
  return full;
}

// A frozen module has no master: its working parameters, gathered, as fp32.
std::vector<float> ZeroEngine::Impl::frozen_params(int module) {
  const detail::ZeroModule& m = mods[static_cast<std::size_t>(module)];
  std::vector<float> full(m.shard.padded);
  std::vector<std::byte> work(m.shard.padded * shape.wsize);
  std::byte* mine = work.data() + static_cast<std::size_t>(shape.opt_rank) * m.shard.shard * shape.wsize;
  if (m.quantized()) {  // at rest in fewer bytes: the dequantized values (not the originals)
    std::vector<std::byte> rest(at_rest_bytes(m.at_rest, m.shard.shard, shape.wsize));
    store->read(m.param, std::span<std::byte>(rest.data(), rest.size()));
    read_at_rest(m.at_rest, rest.data(), m.shard.shard, shape.wdtype, mine);
  } else if (m.stored) {
    store->read(m.param, std::span<std::byte>(mine, m.shard.shard * shape.wsize));  // from any tier; stays clean
  } else {
    std::memcpy(mine, m.mem_shard.b(), m.shard.shard * shape.wsize);
  }
  if (shape.opt_world > 1 && m.shard.shard > 0) {
    comm.all_gather(mine, work.data(), m.shard.shard, shape.comm_dtype);
    ++st.all_gather_calls;
  }
  if (shape.wsize == 4) {
    std::memcpy(full.data(), work.data(), full.size() * sizeof(float));
  } else {
    const auto* h = reinterpret_cast<const std::uint16_t*>(work.data());
    if (shape.wdtype == DType::kBF16) bf16_to_f32_n(h, full.data(), full.size());
    else f16_to_f32_n(h, full.data(), full.size());
  }
  full.resize(m.numel);
  return full;
}

namespace {
// The state's header: partition fields, step counts, the loss scaler's state; no vectors.
ZeroOptimizerState state_header(const detail::EngineShape& shape, std::size_t alignment_elems,
                                const std::vector<detail::ZeroModule>& mods, const ZeroStats& st,
                                const DynamicLossScaler* scaler) {
  ZeroOptimizerState out;
  out.world_size = shape.opt_world;
  out.rank = shape.opt_rank;
  out.alignment_elems = alignment_elems;
  for (const auto& m : mods) {
    if (!m.frozen) out.module_numels.push_back(m.numel);  // the modules with optimizer state
  }
  out.steps = st.steps;
  out.skipped_steps = st.skipped_steps;
  if (scaler) out.loss_scaler = scaler->state();
  return out;
}

// Everything import checks before it changes anything, against this engine's partition (shape,
// alignment, modules; a rank-flat shard of R elements) and loss scaler. `vectors`: the vector form
// (each vector holds the whole shard) or the streamed one (they must be empty).
void validate_import(const ZeroOptimizerState& state, bool vectors, const detail::EngineShape& shape,
                     std::size_t alignment_elems, std::size_t R, const std::vector<detail::ZeroModule>& mods,
                     const DynamicLossScaler* scaler) {
  auto mismatch = [](const std::string& what, const std::string& got, const std::string& want) {
    return Error("ZeroEngine::import_optimizer_state: " + what + " is " + got + " in the imported state but " +
                 want + " in this engine (import the shard this rank exported, with the same world size, "
                 "modules and alignment)");
  };
  if (state.world_size != shape.opt_world) {
    throw mismatch("the optimizer partition's world size", std::to_string(state.world_size),
                   std::to_string(shape.opt_world));
  }
  if (state.rank != shape.opt_rank) {
    throw mismatch("the shard's rank", std::to_string(state.rank), std::to_string(shape.opt_rank));
  }
  if (state.alignment_elems != alignment_elems) {
    throw mismatch("alignment_elems", std::to_string(state.alignment_elems), std::to_string(alignment_elems));
  }
  std::vector<const detail::ZeroModule*> trained;  // frozen modules have no optimizer state
  for (const auto& m : mods) {
    if (!m.frozen) trained.push_back(&m);
  }
  if (state.module_numels.size() != trained.size()) {
    throw mismatch("the module count (modules that train)", std::to_string(state.module_numels.size()),
                   std::to_string(trained.size()));
  }
  for (std::size_t i = 0; i < trained.size(); ++i) {
    if (state.module_numels[i] != trained[i]->numel) {
      throw mismatch("module " + std::to_string(trained[i] - mods.data()) + " (" + trained[i]->name + ")'s numel",
                     std::to_string(state.module_numels[i]), std::to_string(trained[i]->numel));
    }
  }
  for (const auto& [name, vec] : {std::pair<const char*, const std::vector<float>*>{"master", &state.master},
                                  {"exp_avg", &state.exp_avg},
                                  {"exp_avg_sq", &state.exp_avg_sq}}) {
    if (vectors && vec->size() != R) {
      throw mismatch(std::string(name) + "'s length (elements)", std::to_string(vec->size()), std::to_string(R));
    }
    if (!vectors && !vec->empty()) {
      throw Error("ZeroEngine::import_optimizer_state: the streamed import takes the state from its source; the "
                  "header's " + std::string(name) + " must be empty (it has " + std::to_string(vec->size()) +
                  " elements)");
    }
  }
  if (state.steps < 0 || state.skipped_steps < 0) {
    throw Error("ZeroEngine::import_optimizer_state: step counts must be >= 0 (steps " + std::to_string(state.steps) +
                ", skipped_steps " + std::to_string(state.skipped_steps) + ")");
  }
  if (state.loss_scaler.has_value() != (scaler != nullptr)) {
    throw mismatch("fp16 loss-scaler state", state.loss_scaler ? "present" : "absent",
                   scaler ? "expected (fp16.enabled)" : "not expected (fp16 disabled)");
  }
  if (state.loss_scaler) {
    DynamicLossScaler probe = *scaler;
    probe.restore(*state.loss_scaler);  // throws on an impossible state, before anything changes
  }
}

// A checkpoint's device staging of device-homed state, uncounted however the scope ends.
struct StateStageScope {
  detail::DeviceStaging& staging;
  ~StateStageScope() { staging.state_done(); }
};
}  // namespace

void ZeroEngine::Impl::export_state(const std::function<void(const ZeroStateChunk&)>& sink) {
  detail::AlignedBuf buf;
  const StateStageScope uncount{staging};
  const std::size_t B = stepper.buffer_count();
  TensorStore::Pin master_pin;  // a shared_master module's working shard, while its sub-groups go out
  int master_module = -1;
  for (std::size_t k = 0; k < sub_groups.size(); ++k) {
    const detail::SubGroup& p = sub_groups[k];
    const std::size_t n = p.size();
    if (p.on_device) {
      float* f = staging.state_buffer(buf, 12 * plan.sub_group_elems);
      store->read(p.optim, std::as_writable_bytes(std::span<float>(f, 3 * n)));
      sink(ZeroStateChunk{p.flat, n, f, f + n, f + 2 * n});
      continue;
    }
    std::vector<TensorId> ahead;
    for (std::size_t j = k + 1; j < sub_groups.size() && j < k + B; ++j) {
      if (!sub_groups[j].on_device) ahead.push_back(sub_groups[j].optim);
    }
    if (!ahead.empty()) store->prefetch(ahead, Tier::kHost);
    // A new module's sub-groups are sized to fit next to its own shard: the last one's goes first.
    if (master_module != p.module) master_pin = TensorStore::Pin();
    TensorStore::Pin pin = store->acquire(p.optim, Tier::kHost, Phase::kOutsideStep);
    float* s = pin.as<float>();  // [master | m | v], or [m | v] with the master in the working shard
    const detail::ZeroModule& m = mods[static_cast<std::size_t>(p.module)];
    if (!m.shared_master) {
      sink(ZeroStateChunk{p.flat, n, s, s + n, s + 2 * n});
      continue;
    }
    if (master_module != p.module) {
      master_pin = store->acquire(m.param, m.update_tier(shape.publish_tier),
                                  Phase::kOutsideStep);  // host-addressable at either (shared_master)
      master_module = p.module;
    }
    sink(ZeroStateChunk{p.flat, n, master_pin.as<float>() + p.begin, s, s + n});
  }
}

void ZeroEngine::Impl::rewrite_state(int module, bool keep,
                                     const std::function<void(const detail::SubGroup&, float*)>& fill) {
  detail::AlignedBuf buf, whole;  // whole: [master | m | v] of a shared_master sub-group
  const StateStageScope uncount{staging};
  detail::WorkingShardOut working = stepper.working_out(Phase::kOutsideStep);
  for (const detail::SubGroup& p : sub_groups) {
    if (module >= 0 && p.module != module) continue;  // a module's sub-groups are consecutive
    const std::size_t n = p.size();
    TensorStore::Pin state;  // host-tier pin; acquired for overwrite unless the old state is kept
    float* s = nullptr;
    if (mods[static_cast<std::size_t>(p.module)].shared_master) {
      // `fill` sees the three slots as always; the master goes to (and comes from) the working
      // shard, which dest(p) holds with its contents, and the moments to the 2-slot state.
      if (whole.bytes < 12 * n) whole = detail::AlignedBuf(12 * n);
      float* w = whole.f();
      float* master = reinterpret_cast<float*>(working.dest(p));
      state = keep ? store->acquire(p.optim, Tier::kHost, Phase::kOutsideStep)
                   : store->acquire_for_overwrite(p.optim, Tier::kHost);
      if (keep) {
        std::copy_n(master, n, w);
        std::copy_n(state.as<float>(), 2 * n, w + n);
      }
      fill(p, w);
      std::copy_n(w + n, 2 * n, state.as<float>());
      state.mark_dirty();
      std::copy_n(w, n, master);
      continue;
    }
    if (p.on_device) {
      s = staging.state_buffer(buf, 12 * plan.sub_group_elems);
      if (keep) store->read(p.optim, std::as_writable_bytes(std::span<float>(s, 3 * n)));
    } else {
      working.begin(p);  // a new module: the last one's shard released first
      state = keep ? store->acquire(p.optim, Tier::kHost, Phase::kOutsideStep)
                   : store->acquire_for_overwrite(p.optim, Tier::kHost);
      s = state.as<float>();
    }
    fill(p, s);
    if (p.on_device) {
      store->write(p.optim, std::as_bytes(std::span<const float>(s, 3 * n)));
    } else {
      state.mark_dirty();  // written back to its home by the store
    }
    stepper.to_working(s, working.dest(p), n);
  }
  working.finish();
}

void ZeroEngine::set_module_params(int module, std::span<const float> values) {
  Impl& I = *impl_;
  I.finalize();
  if (module < 0 || module >= num_modules()) {
    throw Error("ZeroEngine::set_module_params: unknown module " + std::to_string(module));
  }
  I.updates.refuse_half_step("set_module_params");
  detail::ZeroModule& m = I.mods[static_cast<std::size_t>(module)];
  if (values.size() != m.numel) {
    throw Error(fmt::format("ZeroEngine::set_module_params(\"{}\"): {} values given, the module has {} elements",
                            m.name, values.size(), m.numel));
  }
  I.sync();
  if (m.frozen) {  // no master: the working params themselves (written back once, by the store)
    const ElemRange r = m.shard.range(I.shape.opt_rank);
    const std::size_t lo = std::min(r.begin, m.numel), hi = std::min(r.end, m.numel);
    I.write_working(module, values.subspan(lo, hi - lo));
    return;
  }
  if (I.updates.pending(module)) I.updates.apply(module, Phase::kOutsideStep);  // else it would overwrite the new values
  I.set_state(module, 0, values);  // the moments are kept; only the master changes
  I.gatherer.publish_whole_modules(module);
}

ZeroOptimizerState ZeroEngine::export_optimizer_state(const std::function<void(const ZeroStateChunk&)>& sink) {
  Impl& I = *impl_;
  I.finalize();
  I.updates.refuse_half_step("export_optimizer_state");
  I.sync();
  I.updates.apply_all(Phase::kOutsideStep);
  I.export_state(sink);
  return state_header(I.shape, I.opts.alignment_elems, I.mods, I.st, I.scaler.get());
}

ZeroOptimizerState ZeroEngine::export_optimizer_state() {
  const std::size_t R = shard_numel();
  std::vector<float> master(R), exp_avg(R), exp_avg_sq(R);
  ZeroOptimizerState out = export_optimizer_state([&](const ZeroStateChunk& c) {
    std::copy(c.master, c.master + c.n, master.begin() + static_cast<std::ptrdiff_t>(c.offset));
    std::copy(c.exp_avg, c.exp_avg + c.n, exp_avg.begin() + static_cast<std::ptrdiff_t>(c.offset));
    std::copy(c.exp_avg_sq, c.exp_avg_sq + c.n, exp_avg_sq.begin() + static_cast<std::ptrdiff_t>(c.offset));
  });
  out.master = std::move(master);
  out.exp_avg = std::move(exp_avg);
  out.exp_avg_sq = std::move(exp_avg_sq);
  return out;
}

void ZeroEngine::import_optimizer_state(const ZeroOptimizerState& header,
                                        const std::function<void(const ZeroStateChunk&)>& source) {
  Impl& I = *impl_;
  I.finalize();
  validate_import(header, /*vectors=*/false, I.shape, I.opts.alignment_elems, I.plan.rank_flat_elems, I.mods,
                  I.scaler.get());
  I.updates.refuse_half_step("import_optimizer_state");
  I.sync();
  I.updates.drop_all();  // a pending update is overwritten by the imported state: dropped
  // The next forward applies no update: its order is not the recorded one, on purpose.
  if (I.store) I.store->forget_trace();
  I.zero_grad();

  // Each sub-group in order: filled in place at the host tier by `source` (acquired for
  // overwrite: the old state is never read) and written back to its home by the store — or, homed
  // on the device, filled in a device-staging host buffer and written there; the working shard of its module is
  // rewritten from the new master in the same pass, as step() publishes it.
  I.rewrite_state(-1, /*keep=*/false, [&](const detail::SubGroup& p, float* s) {
    const std::size_t n = p.size();
    source(ZeroStateChunk{p.flat, n, s, s + n, s + 2 * n});
  });
  I.st.steps = header.steps;
  I.st.skipped_steps = header.skipped_steps;
  if (I.scaler) I.scaler->restore(*header.loss_scaler);

  I.gatherer.publish_whole_modules(-1);  // the modules kept whole: all-gather their new working params
}

void ZeroEngine::import_optimizer_state(const ZeroOptimizerState& state) {
  Impl& I = *impl_;
  I.finalize();
  validate_import(state, /*vectors=*/true, I.shape, I.opts.alignment_elems, I.plan.rank_flat_elems, I.mods,
                  I.scaler.get());
  ZeroOptimizerState header = state;
  header.master.clear();
  header.exp_avg.clear();
  header.exp_avg_sq.clear();
  import_optimizer_state(header, [&](const ZeroStateChunk& c) {
    const auto b = static_cast<std::ptrdiff_t>(c.offset), e = static_cast<std::ptrdiff_t>(c.offset + c.n);
    std::copy(state.master.begin() + b, state.master.begin() + e, c.master);
    std::copy(state.exp_avg.begin() + b, state.exp_avg.begin() + e, c.exp_avg);
    std::copy(state.exp_avg_sq.begin() + b, state.exp_avg_sq.begin() + e, c.exp_avg_sq);
  });
}

}  // namespace tiermem
