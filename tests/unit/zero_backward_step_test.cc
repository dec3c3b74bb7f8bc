// ZeroEngine::step_in_backward (tiermem.update_in_backward): at the accumulation boundary, each
// module's update runs during the backward pass once its gradient is complete, and the training
// is bit for bit that of the overlapped (deferred) step and of the eager step: masters, moments,
// step counts and grad norms. What it cannot keep exact it refuses: a clip (the norm is needed
// first), a second gradient for a module already updated, and after an update zero_grad,
// export_grad, the state's export and every read or write of the model but backward's gathers;
// a learning rate changed after the updates ran is warned about and the step keeps the one they
// used.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "mpi/zero_mlp.h"
#include "tiermem/error.h"
#include "tiermem/zero_engine.h"
#include "unit/nvme_test_util.h"

namespace tiermem {
namespace {

enum class Mode { kInBackward, kDeferred, kEager };

Config config(const std::string& dir, Mode mode, const std::string& type = "adamw", double clip = 0) {
  Config cfg = testing::with_param_offload(testing::mlp_config(3, "nvme", dir, 2), "nvme", dir);
  cfg.zero.stage3_param_persistence_threshold_elems = 0;  // both modules stored
  cfg.tiermem.host_budget_bytes = 4 << 20;
  cfg.gradient_clipping = clip;
  cfg.optimizer.type = type;
  cfg.tiermem.overlap_optimizer_step = mode != Mode::kEager;
  cfg.tiermem.update_in_backward = mode == Mode::kInBackward;
  return cfg;
}

struct Trained {
  std::vector<std::vector<float>> master;
  ZeroOptimizerState state;
  std::vector<double> norms;
  std::vector<bool> armed;
  ZeroStats stats;
};

// A third module (a "head" of kHead elements) beside the MLP's two: not used by the MLP's loss;
// its gradient is a fixed function of the step and micro-batch. It gives the backward pass a
// module whose update runs while another module's gradient is still being added on the engine's
// gradient thread.
constexpr std::size_t kHead = 300;

std::vector<float> head_grad(int s, int mb) {
  std::vector<float> g(kHead);
  for (std::size_t i = 0; i < kHead; ++i) g[i] = 0.01f * static_cast<float>((i * 7 + s * 3 + mb) % 11) - 0.05f;
  return g;
}

// One training step as a framework drives it: micro-batches of forward (gathers) and backward,
// last module first, each module's backward gather then its gradient: the head's handed off, the
// second layer's handed off (the head's hand-off complete then: its update starts at the next
// backward gather and runs beside this hand-off), the first layer's copied (complete at once).
// At the last micro-batch the step is declared first (step_in_backward at `lr`). `lr_at_step`: the
// learning rate step() is given (the same unless a test changes it in between).
bool train_step(ZeroEngine& e, int s, double lr, double lr_at_step, std::vector<double>& norms) {
  const testing::MlpData D = testing::mlp_data();
  const int micro = 2, per_micro = testing::kSamples / micro;
  bool armed = false;
  for (int mb = 0; mb < micro; ++mb) {
    const int s0 = mb * per_micro;
    std::vector<float> p0, p1, g0, g1;
    {
      auto a = e.gather(0, Phase::kForward);
      auto b = e.gather(1, Phase::kForward);
      auto h = e.gather(2, Phase::kForward);
      p0 = testing::to_f32_host(e, a);
      p1 = testing::to_f32_host(e, b);
    }
    if (mb + 1 == micro) armed = e.step_in_backward(lr);
    testing::mlp_forward_backward(D, p0.data(), p1.data(), s0, s0 + per_micro, g0, g1);
    { auto h = e.gather(2, Phase::kBackward); }
    e.reduce_gradients(2, head_grad(s, mb));
    { auto b = e.gather(1, Phase::kBackward); }
    e.reduce_gradients(1, std::vector<float>(g1));
    { auto a = e.gather(0, Phase::kBackward); }  // the head's update starts here
    e.reduce_gradients(0, g0);
  }
  e.set_learning_rate(lr_at_step);
  norms.push_back(e.step().grad_norm);
  return armed;
}

Trained train(const Config& cfg, int steps, double lr_at_step_1 = 0.01) {
  auto comm = make_single_communicator();
  ZeroEngine e(cfg, *comm);
  auto init = testing::mlp_init();
  e.register_module("fc1", init[0]);
  e.register_module("fc2", init[1]);
  std::vector<float> head(kHead);
  for (std::size_t i = 0; i < kHead; ++i) head[i] = 0.001f * static_cast<float>(i % 17);
  e.register_module("head", head);
  Trained r;
  for (int s = 0; s < steps; ++s) r.armed.push_back(train_step(e, s, 0.01, s == 1 ? lr_at_step_1 : 0.01, r.norms));
  r.master = {e.export_master(0), e.export_master(1), e.export_master(2)};
  r.state = e.export_optimizer_state();
  r.stats = e.stats();
  return r;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

void expect_same(const Trained& a, const Trained& b) {
  for (std::size_t m = 0; m < a.master.size(); ++m) EXPECT_TRUE(same_bits(a.master[m], b.master[m])) << "module " << m << " master";
  EXPECT_TRUE(same_bits(a.state.exp_avg, b.state.exp_avg));
  EXPECT_TRUE(same_bits(a.state.exp_avg_sq, b.state.exp_avg_sq));
  EXPECT_EQ(a.state.steps, b.state.steps);
  ASSERT_EQ(a.norms.size(), b.norms.size());
  for (std::size_t i = 0; i < a.norms.size(); ++i) EXPECT_EQ(a.norms[i], b.norms[i]) << "step " << i;
}

TEST(ZeroBackwardStep, UpdatesInBackwardEqualTheDeferredAndTheEagerStep) {
  for (const char* type : {"adamw", "lion", "adagrad"}) {
    SCOPED_TRACE(type);
    test::TempDir d0, d1, d2;
    const Trained bwd = train(config(d0.path(), Mode::kInBackward, type), 4);
    const Trained def = train(config(d1.path(), Mode::kDeferred, type), 4);
    const Trained eager = train(config(d2.path(), Mode::kEager, type), 4);
    expect_same(bwd, def);
    expect_same(bwd, eager);
    // The head (its hand-off waited for by the second layer's) was updated in each step's
    // backward, at the first layer's gather; the layers' gradients complete after the last
    // backward gather, so step() updates them.
    EXPECT_EQ(bwd.armed, std::vector<bool>(4, true));
    EXPECT_EQ(bwd.stats.updates_in_backward, 4u);
    EXPECT_EQ(def.armed, std::vector<bool>(4, false));
    EXPECT_EQ(def.stats.updates_in_backward, 0u);
    EXPECT_EQ(eager.stats.updates_in_backward, 0u);
  }
}

TEST(ZeroBackwardStep, DoesNotApplyWhereTheNormIsNeededFirst) {
  test::TempDir d;
  auto comm = make_single_communicator();
  ZeroEngine e(config(d.path(), Mode::kInBackward, "adamw", 0.5), *comm);
  auto init = testing::mlp_init();
  e.register_module("fc1", init[0]);
  e.register_module("fc2", init[1]);
  EXPECT_FALSE(e.step_in_backward(0.01)) << "a clip needs the global norm before any update";
  EXPECT_THROW(e.step_in_backward(-1.0), ConfigError);
}

// The learning rate step() is given differs from the one declared: the step keeps the declared
// one (the updates in backward used it), so it equals a run at that rate throughout.
TEST(ZeroBackwardStep, ALearningRateChangedAfterTheUpdatesKeepsTheirs) {
  test::TempDir d0, d1;
  const Trained changed = train(config(d0.path(), Mode::kInBackward), 3, 0.05);
  const Trained ref = train(config(d1.path(), Mode::kDeferred), 3);
  expect_same(changed, ref);
}

TEST(ZeroBackwardStep, RefusesWhatWouldLoseExactness) {
  test::TempDir d;
  auto comm = make_single_communicator();
  ZeroEngine e(config(d.path(), Mode::kInBackward), *comm);
  auto init = testing::mlp_init();
  e.register_module("fc1", init[0]);
  e.register_module("fc2", init[1]);
  const testing::MlpData D = testing::mlp_data();
  std::vector<float> p0, p1, g0, g1;
  {
    auto a = e.gather(0, Phase::kForward);
    auto b = e.gather(1, Phase::kForward);
    p0 = testing::to_f32_host(e, a);
    p1 = testing::to_f32_host(e, b);
  }
  ASSERT_TRUE(e.step_in_backward(0.01));
  testing::mlp_forward_backward(D, p0.data(), p1.data(), 0, 12, g0, g1);
  e.reduce_gradients(1, g1);
  { auto a = e.gather(0, Phase::kBackward); }  // starts module 1's update
  e.reduce_gradients(0, g0);                   // waits for it
  EXPECT_EQ(e.stats().updates_in_backward, 1u);
  try {
    e.reduce_gradients(1, g1);
    ADD_FAILURE() << "a second gradient for an updated module was taken";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("fc2"), std::string::npos) << err.what();
    EXPECT_NE(std::string(err.what()).find("update_in_backward"), std::string::npos) << err.what();
  }
  EXPECT_THROW(e.export_grad(1), Error);
  EXPECT_THROW(e.zero_grad(), Error);
  EXPECT_THROW(e.export_optimizer_state(), Error) << "half a step would be saved";
  // Half the modules hold this step's values: reading or writing the model now would mix steps.
  EXPECT_THROW(e.export_master(0), Error);
  EXPECT_THROW(e.gather(0, Phase::kForward), Error);
  EXPECT_THROW(e.set_module_params(0, std::vector<float>(e.module_numel(0), 0.0f)), Error);
  EXPECT_THROW(e.offload_states(), Error);
  // The step still finishes: module 0 updated now, module 1 not twice.
  const ZeroEngine::StepResult r = e.step();
  EXPECT_EQ(r.step, 1);
  EXPECT_FALSE(e.export_grad(1).empty());  // after the step: a fresh (zero) gradient again
}

}  // namespace
}  // namespace tiermem
