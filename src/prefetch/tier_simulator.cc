// The tier simulator: FIFO copy engines per tier pair, one compute stream, budgets per tier.
#include "tiermem/tier_simulator.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <memory>
#include <sstream>
#include <unordered_map>

#include <fmt/format.h>

#include "tiermem/error.h"
#include "tiermem/reuse_distance.h"

namespace tiermem {
namespace {

constexpr double kNever = std::numeric_limits<double>::infinity();

// What the baseline policies may ask the simulator (TensorStore's state, for the emulations).
class SimState {
 public:
  virtual ~SimState() = default;
  virtual bool on_host_or_arriving(TensorId id) const = 0;
  virtual std::span<const Access> trace() const = 0;
};

// Plain LRU: no prefetch, keep on release, evict the least recently accessed.
class LruPolicy final : public ResidencyPolicy {
 public:
  std::vector<PrefetchHint> on_access(TensorId id, std::uint64_t, Tier, Phase,
                                      const ResidencyView&) override {
    last_[id] = ++tick_;
    return {};
  }
  bool keep_on_release(TensorId, Tier, const ResidencyView&) override { return true; }
  TensorId choose_victim(Tier, std::span<const TensorId> c) override {
    return *std::min_element(c.begin(), c.end(), [&](TensorId a, TensorId b) {
      return std::pair(tick(a), a) < std::pair(tick(b), b);
    });
  }

 private:
  std::uint64_t tick(TensorId id) const {
    auto it = last_.find(id);
    return it == last_.end() ? 0 : it->second;
  }
  std::uint64_t tick_ = 0;
  std::unordered_map<TensorId, std::uint64_t> last_;
};

// ZeRO-Infinity stage-3 emulation: the trace is known from the start (DeepSpeed records it too);
// release unless the reuse distance is under the threshold; prefetch the bucket to the device but
// stop at the first tensor not on the host; NVMe reads only for the bucket; LRU on pressure.
class DeepSpeedPolicy final : public ResidencyPolicy {
 public:
  DeepSpeedPolicy(const SimState& sim, const PrefetcherOptions& o) : sim_(sim), o_(o) {
    reuse_ = reuse_distances(sim.trace(), ReuseMode::kCyclic);
  }
  void begin_step() override { pos_ = 0; }
  std::vector<PrefetchHint> on_access(TensorId id, std::uint64_t b, Tier t, Phase ph,
                                      const ResidencyView& v) override {
    lru_.on_access(id, b, t, ph, v);
    auto tr = sim_.trace();
    const std::size_t n = tr.size();
    cur_ = pos_++ % n;
    std::vector<PrefetchHint> hints;
    std::uint64_t window = 0;
    bool stopped = false;
    for (std::size_t k = 1; k < n; ++k) {
      const Access& x = tr[(cur_ + k) % n];
      if (window > 0 && window + x.bytes > o_.prefetch_bucket_bytes) break;
      if (v.resident_bytes[0] + window + x.bytes > o_.max_live_bytes) break;
      window += x.bytes;
      if (!sim_.on_host_or_arriving(x.id)) {
        hints.push_back({x.id, Tier::kHost});  // swap in from NVMe ...
        stopped = true;                        // ... and stop prefetching to the device here
      }
      if (!stopped) hints.push_back({x.id, Tier::kDevice});
    }
    return hints;
  }
  bool keep_on_release(TensorId, Tier, const ResidencyView&) override {
    return reuse_[cur_].bytes <= o_.max_reuse_distance_bytes;
  }
  TensorId choose_victim(Tier t, std::span<const TensorId> c) override {
    return lru_.choose_victim(t, c);
  }

 private:
  const SimState& sim_;
  PrefetcherOptions o_;
  std::vector<ReuseDistance> reuse_;
  LruPolicy lru_;
  std::size_t pos_ = 0, cur_ = 0;
};

class Simulator final : public SimState {
 public:
  Simulator(std::span<const Access> trace, const TierModel& m) : m_(m) {
    if (!(m.nvme_to_host_gbps > 0) || !(m.host_to_device_gbps > 0) || !(m.compute_gbps > 0)) {
      throw ConfigError("tier model", "", "bandwidths (GB/s) must be positive");
    }
    if (m.home != Tier::kNvme && m.home != Tier::kHost) {
      throw ConfigError("tier model home", std::string(tier_name(m.home)), "home must be nvme or host");
    }
    std::unordered_map<TensorId, TensorId> dense;
    for (const Access& a : trace) {
      auto [it, fresh] = dense.emplace(a.id, static_cast<TensorId>(dense.size()));
      if (fresh) bytes_.push_back(a.bytes);
      Access d = a;
      d.id = it->second;
      d.tier = Tier::kDevice;
      d.bytes = bytes_[d.id];
      trace_.push_back(d);
    }
    t_.resize(bytes_.size());
    for (std::uint64_t b : bytes_) {
      if (b > m.device_budget_bytes) {
        throw OutOfMemoryError(Tier::kDevice, b, m.device_budget_bytes,
                               "a tensor of the trace is larger than the simulated device budget");
      }
      if (m.home == Tier::kNvme && b > m.host_budget_bytes) {
        throw OutOfMemoryError(Tier::kHost, b, m.host_budget_bytes,
                               "a tensor of the trace is larger than the simulated host budget");
      }
    }
  }

  bool on_host_or_arriving(TensorId id) const override {
    return m_.home == Tier::kHost || t_[id].host;
  }
  std::span<const Access> trace() const override { return trace_; }

  SimResult run(ResidencyPolicy& policy, std::string name) {
    policy_ = &policy;
    SimResult r;
    r.policy = std::move(name);
    double step_start = 0;
    for (int s = 0; s < m_.steps; ++s) {
      const bool last = s + 1 == m_.steps;
      counting_ = last;
      n2h_ = h2d_ = 0;
      std::uint64_t hits = 0;
      double stall = 0, compute = 0;
      policy.begin_step();
      for (const Access& a : trace_) {
        const double t_access = now_;
        pinned_ = a.id;
        auto hints = policy.on_access(a.id, a.bytes, Tier::kDevice, a.phase, view());
        const Tensor& t = t_[a.id];
        if (t.dev && t.dev_ready <= now_) ++hits;
        const double ready = ensure_device(a.id, /*demand=*/true);
        for (const PrefetchHint& h : hints) {
          if (h.id >= t_.size()) {
            throw Error(fmt::format("simulate({}): policy hinted unknown tensor {}", r.policy, h.id));
          }
          if (h.tier == Tier::kDevice) {
            ensure_device(h.id, false);
          } else if (h.tier == Tier::kHost && !t_[h.id].dev) {  // on the device is above host
            ensure_host(h.id, false);
          }
        }
        const double start = std::max(now_, ready);
        const double c = static_cast<double>(a.bytes) / (m_.compute_gbps * 1e9) *
                         (a.phase == Phase::kBackward ? m_.backward_factor : 1.0);
        stall += start - t_access;
        compute += c;
        now_ = start + c;
        if (!policy.keep_on_release(a.id, Tier::kDevice, view())) evict(a.id, Tier::kDevice);
        pinned_ = kInvalidTensor;
      }
      policy.end_step();
      if (last) {
        r.accesses = trace_.size();
        r.device_hits = hits;
        r.hit_rate = r.accesses ? static_cast<double>(hits) / static_cast<double>(r.accesses) : 0;
        r.bytes_nvme_to_host = n2h_;
        r.bytes_host_to_device = h2d_;
        r.bytes_moved = n2h_ + h2d_;
        r.compute_seconds = compute;
        r.stall_seconds = stall;
        r.step_seconds = now_ - step_start;
        r.ideal_seconds = ideal_seconds(compute);
        r.efficiency = r.step_seconds > 0 ? r.ideal_seconds / r.step_seconds : 1.0;
      }
      step_start = now_;
    }
    r.peak_device_bytes = peak_[0];
    r.peak_host_bytes = peak_[1];
    return r;
  }

 private:
  struct Tensor {
    bool dev = false, host = false;
    double dev_ready = 0, host_ready = 0;
    double host_busy_until = 0;  // an in-flight host->device copy reads the host copy
  };

  // A lower bound on a steady-state step, the same for every policy: compute is one stream, and
  // at a step's start at most `budget` bytes are resident on a tier, so everything else must
  // cross into it during the step: host->device at least (distinct bytes - device budget), and,
  // NVMe-homed, NVMe->host at least (distinct bytes - host budget - device budget).
  double ideal_seconds(double compute) const {
    std::uint64_t all = 0;
    for (std::uint64_t b : bytes_) all += b;
    auto beyond = [](std::uint64_t a, std::uint64_t b) { return a > b ? a - b : 0; };
    const double h2d = static_cast<double>(beyond(all, m_.device_budget_bytes)) /
                       (m_.host_to_device_gbps * 1e9);
    const double n2h =
        m_.home == Tier::kNvme
            ? static_cast<double>(beyond(all, m_.device_budget_bytes + m_.host_budget_bytes)) /
                  (m_.nvme_to_host_gbps * 1e9)
            : 0.0;
    return std::max({compute, h2d, n2h});
  }

  ResidencyView view() const {
    ResidencyView v;
    v.resident_bytes[0] = used_[0];
    v.resident_bytes[1] = used_[1];
    v.budget_bytes[0] = m_.device_budget_bytes;
    v.budget_bytes[1] = m_.home == Tier::kNvme ? m_.host_budget_bytes : 0;
    return v;
  }

  void evict(TensorId id, Tier tier) {
    Tensor& t = t_[id];
    const int k = static_cast<int>(tier);
    bool& present = tier == Tier::kDevice ? t.dev : t.host;
    if (!present) return;
    present = false;
    used_[k] -= bytes_[id];
    policy_->on_evicted(id, tier);
  }

  void admit(TensorId id, Tier tier) {
    const int k = static_cast<int>(tier);
    used_[k] += bytes_[id];
    peak_[k] = std::max(peak_[k], used_[k]);
  }

  // Frees room for `incoming` on `tier` now. A demand waits (advancing now_) for in-flight copies
  // to become evictable; a prefetch first plans all its victims and evicts none unless the policy
  // accepts every one (evict_for_prefetch), so a refused prefetch costs nothing.
  bool make_room(Tier tier, TensorId incoming, bool demand) {
    const int k = static_cast<int>(tier);
    const std::uint64_t bytes = bytes_[incoming];
    const std::uint64_t budget = tier == Tier::kDevice ? m_.device_budget_bytes : m_.host_budget_bytes;
    while (used_[k] + bytes > budget) {
      std::vector<TensorId> cand;
      double next_free = kNever;
      for (TensorId i = 0; i < t_.size(); ++i) {
        const Tensor& t = t_[i];
        if (i == pinned_) continue;
        if (tier == Tier::kDevice && t.dev) {
          if (t.dev_ready <= now_) cand.push_back(i); else next_free = std::min(next_free, t.dev_ready);
        } else if (tier == Tier::kHost && t.host) {
          const double busy = std::max(t.host_ready, t.host_busy_until);
          if (busy <= now_) cand.push_back(i); else next_free = std::min(next_free, busy);
        }
      }
      if (!demand) {
        std::vector<TensorId> plan;
        std::uint64_t freed = 0;
        while (used_[k] - freed + bytes > budget) {
          if (cand.empty()) return false;
          const TensorId v = pick(tier, cand);
          if (!policy_->evict_for_prefetch(tier, incoming, v)) return false;
          plan.push_back(v);
          freed += bytes_[v];
          cand.erase(std::find(cand.begin(), cand.end(), v));
        }
        for (TensorId v : plan) evict(v, tier);
        return true;
      }
      if (cand.empty()) {
        if (next_free == kNever) {
          throw OutOfMemoryError(tier, bytes, budget - used_[k],
                                 "simulator: everything resident is pinned");
        }
        now_ = next_free;  // wait for a copy to land
        continue;
      }
      evict(pick(tier, cand), tier);
    }
    return true;
  }

  TensorId pick(Tier tier, const std::vector<TensorId>& cand) {
    const TensorId v = policy_->choose_victim(tier, cand);
    if (std::find(cand.begin(), cand.end(), v) == cand.end()) {
      throw Error(fmt::format("simulator: policy chose victim {} that is not a candidate", v));
    }
    return v;
  }

  // Returns when the host copy of `id` is ready (kNever when a prefetch was dropped).
  double ensure_host(TensorId id, bool demand) {
    Tensor& t = t_[id];
    if (m_.home == Tier::kHost) return 0;
    if (t.host) return t.host_ready;
    if (!make_room(Tier::kHost, id, demand)) return kNever;
    const double start = std::max(now_, nvme_free_);
    t.host_ready = nvme_free_ = start + static_cast<double>(bytes_[id]) / (m_.nvme_to_host_gbps * 1e9);
    t.host = true;
    admit(id, Tier::kHost);
    if (counting_) n2h_ += bytes_[id];
    return t.host_ready;
  }

  double ensure_device(TensorId id, bool demand) {
    Tensor& t = t_[id];
    if (t.dev) return t.dev_ready;
    const double host_ready = ensure_host(id, demand);
    if (host_ready == kNever) return kNever;
    if (!make_room(Tier::kDevice, id, demand)) return kNever;
    const double start = std::max({now_, host_ready, h2d_free_});
    t.dev_ready = h2d_free_ = start + static_cast<double>(bytes_[id]) / (m_.host_to_device_gbps * 1e9);
    t.host_busy_until = std::max(t.host_busy_until, t.dev_ready);
    t.dev = true;
    admit(id, Tier::kDevice);
    if (counting_) h2d_ += bytes_[id];
    return t.dev_ready;
  }

  TierModel m_;
  std::vector<Access> trace_;
  std::vector<std::uint64_t> bytes_;
  std::vector<Tensor> t_;
  ResidencyPolicy* policy_ = nullptr;
  TensorId pinned_ = kInvalidTensor;
  double now_ = 0, nvme_free_ = 0, h2d_free_ = 0;
  std::uint64_t used_[2] = {0, 0};
  std::uint64_t peak_[2] = {0, 0};
  bool counting_ = false;
  std::uint64_t n2h_ = 0, h2d_ = 0;
};

}  // namespace

std::string_view sim_policy_name(SimPolicy p) {
  switch (p) {
    case SimPolicy::kLru: return "lru";
    case SimPolicy::kDeepSpeed: return "deepspeed";
    case SimPolicy::kBelady: return "belady";
  }
  return "?";
}

SimResult simulate(std::span<const Access> trace, const TierModel& model, SimPolicy policy,
                   const PrefetcherOptions& options) {
  Simulator sim(trace, model);
  std::unique_ptr<ResidencyPolicy> p;
  Prefetcher* prefetcher = nullptr;
  switch (policy) {
    case SimPolicy::kLru: p = std::make_unique<LruPolicy>(); break;
    case SimPolicy::kDeepSpeed: p = std::make_unique<DeepSpeedPolicy>(sim, options); break;
    case SimPolicy::kBelady: {
      auto pf = std::make_unique<Prefetcher>(options);
      prefetcher = pf.get();
      p = std::move(pf);
      break;
    }
  }
  SimResult r = sim.run(*p, std::string(sim_policy_name(policy)));
  if (prefetcher) r.trace_invalidations = prefetcher->trace().invalidations();
  return r;
}

std::uint64_t distinct_bytes(std::span<const Access> trace) {
  std::unordered_map<TensorId, std::uint64_t> seen;
  std::uint64_t sum = 0;
  for (const Access& a : trace) {
    if (seen.emplace(a.id, a.bytes).second) sum += a.bytes;
  }
  return sum;
}

// ---- generated traces -------------------------------------------------------------------------

namespace {

struct ModelShape {
  const char* name;
  bool llama;
  std::uint64_t layers, d, ff, vocab, kv_dim, ctx;
};

constexpr ModelShape kModels[] = {
    {"gpt2-small", false, 12, 768, 3072, 50257, 768, 1024},
    {"gpt2-medium", false, 24, 1024, 4096, 50257, 1024, 1024},
    {"gpt2-xl", false, 48, 1600, 6400, 50257, 1600, 1024},
    {"llama-7b", true, 32, 4096, 11008, 32000, 4096, 0},
    {"llama-70b", true, 80, 8192, 28672, 32000, 1024, 0},  // GQA: 8 KV heads of 128
};

}  // namespace

std::vector<std::string> model_names() {
  std::vector<std::string> v;
  for (const auto& m : kModels) v.emplace_back(m.name);
  return v;
}

std::vector<Access> generate_model_trace(std::string_view model, DType dtype) {
  const ModelShape* shape = nullptr;
  for (const auto& m : kModels) {
    if (model == m.name) shape = &m;
  }
  if (!shape) {
    std::string names;
    for (const auto& n : model_names()) names += (names.empty() ? "" : ", ") + n;
    throw ConfigError("--model", std::string(model), "unknown model; one of: " + names);
  }
  const ModelShape& s = *shape;
  const std::uint64_t es = dtype_size(dtype);
  std::vector<std::uint64_t> elems;  // tensor sizes in elements, by id
  auto tensor = [&](std::uint64_t n) {
    elems.push_back(n);
    return static_cast<TensorId>(elems.size() - 1);
  };
  // Ids in forward order of first use.
  std::vector<TensorId> pre, post;
  std::vector<std::vector<TensorId>> layers(s.layers);
  const std::uint64_t d = s.d;
  if (!s.llama) {
    const TensorId wte = tensor(s.vocab * d);
    pre = {wte, tensor(s.ctx * d)};  // token and position embeddings
    for (auto& l : layers) {
      l = {tensor(2 * d), tensor(3 * d * d + 3 * d), tensor(d * d + d),  // ln_1, c_attn, c_proj
           tensor(2 * d), tensor(d * s.ff + s.ff), tensor(s.ff * d + d)};  // ln_2, c_fc, c_proj
    }
    post = {tensor(2 * d), wte};  // ln_f, lm_head tied to wte
  } else {
    pre = {tensor(s.vocab * d)};
    for (auto& l : layers) {
      l = {tensor(d), tensor(d * d), tensor(d * s.kv_dim), tensor(d * s.kv_dim), tensor(d * d),
           tensor(d), tensor(d * s.ff), tensor(d * s.ff), tensor(s.ff * d)};
    }
    post = {tensor(d), tensor(s.vocab * d)};  // final norm, lm_head (untied)
  }
  std::vector<Access> trace;
  auto add = [&](TensorId id, Phase p) { trace.push_back({id, elems[id] * es, p, Tier::kDevice}); };
  for (TensorId id : pre) add(id, Phase::kForward);
  for (const auto& l : layers) for (TensorId id : l) add(id, Phase::kForward);
  for (TensorId id : post) add(id, Phase::kForward);
  for (auto it = post.rbegin(); it != post.rend(); ++it) add(*it, Phase::kBackward);
  for (auto l = layers.rbegin(); l != layers.rend(); ++l) {
    for (auto it = l->rbegin(); it != l->rend(); ++it) add(*it, Phase::kBackward);
  }
  for (auto it = pre.rbegin(); it != pre.rend(); ++it) add(*it, Phase::kBackward);
  return trace;
}

// ---- text traces ------------------------------------------------------------------------------

std::vector<Access> parse_trace(std::string_view text, std::string_view source) {
  std::vector<Access> out;
  std::unordered_map<std::string, TensorId> ids;
  std::size_t line_no = 0;
  std::size_t pos = 0;
  while (pos <= text.size()) {
    std::size_t eol = text.find('\n', pos);
    if (eol == std::string_view::npos) eol = text.size();
    std::string line(text.substr(pos, eol - pos));
    pos = eol + 1;
    ++line_no;
    if (auto hash = line.find('#'); hash != std::string::npos) line.resize(hash);
    std::istringstream in(line);
    std::string id, bytes, phase, extra;
    if (!(in >> id)) {
      if (pos > text.size()) break;
      continue;  // blank
    }
    const std::string where = fmt::format("{}:{}", source, line_no);
    if (!(in >> bytes >> phase) || (in >> extra)) {
      throw ConfigError(where, line, "expected three fields `id bytes phase`");
    }
    Access a;
    try {
      a.bytes = parse_size(bytes, where);
    } catch (const ConfigError&) {
      throw ConfigError(where, line, fmt::format("bytes `{}` is not a size", bytes));
    }
    if (a.bytes == 0) throw ConfigError(where, line, "bytes must be positive");
    if (phase == "forward" || phase == "fwd") a.phase = Phase::kForward;
    else if (phase == "backward" || phase == "bwd") a.phase = Phase::kBackward;
    else if (phase == "optimizer" || phase == "opt") a.phase = Phase::kOptimizer;
    else if (phase == "other") a.phase = Phase::kOther;
    else if (phase == "outside-step" || phase == "eval") a.phase = Phase::kOutsideStep;
    else {
      throw ConfigError(where, line, fmt::format("phase `{}` is not "
                                                 "forward|backward|optimizer|other|outside-step|eval",
                                                 phase));
    }
    a.id = ids.emplace(id, static_cast<TensorId>(ids.size())).first->second;
    a.tier = Tier::kDevice;
    out.push_back(a);
    if (pos > text.size()) break;
  }
  if (out.empty()) throw ConfigError(std::string(source), "", "the trace has no accesses");
  return out;
}

std::vector<Access> load_trace_file(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw ConfigError(path, "", errno_message("cannot open the trace file", errno));
  std::stringstream ss;
  ss << f.rdbuf();
  return parse_trace(ss.str(), path);
}

}  // namespace tiermem
