#include "pipeline/runtime/stage_runtime.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "pipeline/core/pipemare_math.h"
#include "pipeline/model/model.h"

namespace pipemare {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kSeed = 11;
constexpr int64_t kBatch = 5;

v1::ModelSpec Mlp(const std::vector<int64_t>& layers, const std::string& activation = "relu") {
  v1::ModelSpec m;
  m.set_type("mlp");
  for (int64_t w : layers) m.add_layers(w);
  m.set_activation(activation);
  return m;
}

v1::StageAssignment Assignment(const std::string& schedule, int stage, int num_stages,
                               int first_unit, int units, const v1::ModelSpec& model,
                               double lr = 0.1, int microbatches_per_step = 1) {
  v1::StageAssignment a;
  a.set_job_id("job");
  a.set_stage(stage);
  a.set_num_stages(num_stages);
  a.set_first_unit(first_unit);
  a.set_units(units);
  *a.mutable_model() = model;
  a.mutable_optimizer()->set_type("sgd");
  a.mutable_optimizer()->set_lr(lr);
  a.mutable_schedule()->set_type(schedule);
  a.mutable_schedule()->set_stages(num_stages);
  a.mutable_schedule()->set_microbatch_size(kBatch);
  a.mutable_schedule()->set_microbatches_per_step(microbatches_per_step);
  a.set_seed(kSeed);
  return a;
}

// The three-unit model [4, 3, 3, 2] on one stage (first and last).
v1::StageAssignment SingleStage(const std::string& schedule, int microbatches_per_step) {
  return Assignment(schedule, 0, 1, 0, 3, Mlp({4, 3, 3, 2}), 0.1, microbatches_per_step);
}

// A backward, then the optimizer step after every N-th one: what a plan's
// B and U run (pipeline/runtime/stage_executor.h).
absl::StatusOr<torch::Tensor> BackwardStep(StageRuntime& rt, uint64_t microbatch,
                                           const torch::Tensor& grad_output) {
  auto grad_input = rt.Backward(microbatch, grad_output);
  if (grad_input.ok() && rt.backwards_since_step() == rt.microbatches_per_step()) {
    if (auto st = rt.Step(); !st.ok()) return st;
  }
  return grad_input;
}

std::unique_ptr<StageRuntime> MustCreate(const v1::StageAssignment& a) {
  auto rt = StageRuntime::Create(a);
  EXPECT_TRUE(rt.ok()) << rt.status();
  return rt.ok() ? std::move(*rt) : nullptr;
}

torch::nn::Sequential MustBuild(const v1::ModelSpec& m, int first, int units,
                                int64_t seed = kSeed) {
  auto s = BuildUnits(m, first, units, seed, TensorType{{m.layers(first)}, false});
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? s->module : torch::nn::Sequential();
}

std::vector<torch::Tensor> Snapshot(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> out;
  for (const auto& p : params) out.push_back(p.detach().clone());
  return out;
}

double MaxAbsDiff(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    m = std::max(m, (a[i].detach() - b[i].detach()).abs().max().item<double>());
  }
  return m;
}

void ExpectAllClose(const std::vector<torch::Tensor>& actual,
                    const std::vector<torch::Tensor>& expected, double rtol, double atol) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i) {
    ASSERT_EQ(actual[i].sizes(), expected[i].sizes()) << "parameter " << i;
    EXPECT_TRUE(torch::allclose(actual[i].detach(), expected[i].detach(), rtol, atol))
        << "parameter " << i << " max diff "
        << (actual[i].detach() - expected[i].detach()).abs().max().item<double>();
  }
}

torch::Tensor Inputs(int64_t seed, int64_t width = 4) {
  torch::manual_seed(seed);
  return torch::randn({kBatch, width});
}

torch::Tensor Targets(int64_t seed, int64_t classes = 2) {
  torch::manual_seed(seed);
  return torch::randint(0, classes, {kBatch}, torch::kInt64);
}

// ---------------------------------------------------------------------------
// gpipe

TEST(StageRuntimeGPipeTest, AccumulatesNMicrobatchesIntoOneSgdStep) {
  const v1::StageAssignment a = SingleStage("gpipe", 2);
  auto rt = MustCreate(a);
  ASSERT_NE(rt, nullptr);
  EXPECT_TRUE(rt->is_first());
  EXPECT_TRUE(rt->is_last());
  EXPECT_EQ(rt->schedule(), ScheduleKind::kGPipe);
  EXPECT_EQ(rt->microbatches_per_step(), 2);
  EXPECT_EQ(rt->Stats().parameters, 4 * 3 + 3 + 3 * 3 + 3 + 3 * 2 + 2);
  EXPECT_EQ(rt->Stats().analytic_delay, 0);

  torch::nn::Sequential ref = MustBuild(a.model(), 0, 3);
  const auto initial = Snapshot(ref->parameters());
  ExpectAllClose(rt->Parameters(), initial, 0, 0);

  const torch::Tensor x1 = Inputs(101), y1 = Targets(102);
  const torch::Tensor x2 = Inputs(103), y2 = Targets(104);

  auto r1 = rt->ForwardLoss(1, x1, y1, true);
  ASSERT_TRUE(r1.ok()) << r1.status();
  {
    torch::NoGradGuard no_grad;
    torch::Tensor out = ref->forward(x1);
    EXPECT_NEAR(r1->loss, torch::nn::functional::cross_entropy(out, y1).item<double>(), 1e-6);
    EXPECT_EQ(r1->correct, out.argmax(1).eq(y1).sum().item<int64_t>());
    EXPECT_EQ(r1->count, kBatch);
  }
  ASSERT_TRUE(rt->ForwardLoss(2, x2, y2, true).ok());
  EXPECT_EQ(rt->Stats().forwards, 2);

  auto g1 = BackwardStep(*rt, 1, torch::Tensor());
  ASSERT_TRUE(g1.ok()) << g1.status();
  EXPECT_FALSE(g1->defined()) << "the first stage returns no input gradient";
  EXPECT_EQ(rt->Stats().steps, 0);
  ExpectAllClose(rt->Parameters(), initial, 0, 0);  // no update before the N-th backward

  auto g2 = BackwardStep(*rt, 2, torch::Tensor());
  ASSERT_TRUE(g2.ok()) << g2.status();
  StageStats stats = rt->Stats();
  EXPECT_EQ(stats.steps, 1);
  EXPECT_EQ(stats.backwards, 2);
  EXPECT_DOUBLE_EQ(stats.learning_rate, 0.1);

  torch::Tensor loss = torch::nn::functional::cross_entropy(ref->forward(x1), y1) / 2 +
                       torch::nn::functional::cross_entropy(ref->forward(x2), y2) / 2;
  loss.backward();
  std::vector<torch::Tensor> expected;
  for (const auto& p : ref->parameters()) expected.push_back(p.detach() - 0.1 * p.grad());
  EXPECT_GT(MaxAbsDiff(expected, initial), 1e-4) << "the step should move the weights";
  ExpectAllClose(rt->Parameters(), expected, 1e-5, 1e-6);
}

// One step of two microbatches (ids 2k+1, 2k+2) through a single-stage
// runtime; returns the same step's loss on `ref`, for a reference optimizer.
torch::Tensor TwoMicrobatchStep(StageRuntime& rt, torch::nn::Sequential& ref, int step) {
  const uint64_t m1 = 2 * step + 1, m2 = 2 * step + 2;
  const torch::Tensor x1 = Inputs(200 + m1), y1 = Targets(300 + m1);
  const torch::Tensor x2 = Inputs(200 + m2), y2 = Targets(300 + m2);
  EXPECT_TRUE(rt.ForwardLoss(m1, x1, y1, true).ok());
  EXPECT_TRUE(rt.ForwardLoss(m2, x2, y2, true).ok());
  EXPECT_TRUE(BackwardStep(rt, m1, torch::Tensor()).ok());
  EXPECT_TRUE(BackwardStep(rt, m2, torch::Tensor()).ok());
  return torch::nn::functional::cross_entropy(ref->forward(x1), y1) / 2 +
         torch::nn::functional::cross_entropy(ref->forward(x2), y2) / 2;
}

TEST(StageRuntimeGPipeTest, MomentumMatchesTorchSgdOverTwoSteps) {
  v1::StageAssignment a = SingleStage("gpipe", 2);
  a.mutable_optimizer()->set_momentum(0.9);
  auto rt = MustCreate(a);
  ASSERT_NE(rt, nullptr);
  torch::nn::Sequential ref = MustBuild(a.model(), 0, 3);
  torch::optim::SGD sgd(ref->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));

  for (int step = 0; step < 2; ++step) {
    const torch::Tensor loss_of_ref = TwoMicrobatchStep(*rt, ref, step);

    sgd.zero_grad();
    loss_of_ref.backward();
    sgd.step();
    EXPECT_EQ(rt->Stats().steps, step + 1);
    ExpectAllClose(rt->Parameters(), ref->parameters(), 1e-5, 1e-6);
  }
}

TEST(StageRuntimeGPipeTest, IgnoresPipeMareKnobs) {
  v1::StageAssignment a = Assignment("gpipe", 0, 4, 0, 1, Mlp({4, 3, 3, 3, 2}));
  a.set_lr_anneal_steps(100);
  a.mutable_schedule()->set_discrepancy_decay(0.1);
  auto rt = MustCreate(a);
  ASSERT_NE(rt, nullptr);
  EXPECT_EQ(rt->Stats().analytic_delay, 0);
  EXPECT_DOUBLE_EQ(rt->Stats().learning_rate, 0.1);
  torch::nn::Sequential ref = MustBuild(a.model(), 0, 1);
  const torch::Tensor x = Inputs(7);
  torch::manual_seed(8);
  const torch::Tensor g = torch::randn({kBatch, 3});
  ASSERT_TRUE(rt->Forward(1, x, true).ok());
  ASSERT_TRUE(BackwardStep(*rt, 1, g).ok());
  ref->forward(x).backward(g);
  std::vector<torch::Tensor> expected;
  for (const auto& p : ref->parameters()) expected.push_back(p.detach() - 0.1 * p.grad());
  ExpectAllClose(rt->Parameters(), expected, 1e-5, 1e-6);
  EXPECT_DOUBLE_EQ(rt->Stats().learning_rate, 0.1);
}

// ---------------------------------------------------------------------------
// pipemare T1

TEST(StageRuntimePipeMareTest, T1ScalesTheFirstStepsByTau) {
  const v1::ModelSpec model = Mlp({4, 3, 3, 3, 2});
  v1::StageAssignment a = Assignment("pipemare", 0, 4, 0, 1, model);
  a.set_lr_anneal_steps(100);
  auto rt = MustCreate(a);
  ASSERT_NE(rt, nullptr);
  EXPECT_EQ(rt->schedule(), ScheduleKind::kPipeMare);
  EXPECT_EQ(rt->Stats().analytic_delay, 3);
  EXPECT_NEAR(rt->Stats().learning_rate, 0.1 / 3, 1e-12);

  torch::nn::Sequential ref = MustBuild(model, 0, 1);
  const torch::Tensor x = Inputs(21);
  torch::manual_seed(22);
  const torch::Tensor g = torch::randn({kBatch, 3});
  ASSERT_TRUE(rt->Forward(1, x, true).ok());
  auto gi = BackwardStep(*rt, 1, g);
  ASSERT_TRUE(gi.ok()) << gi.status();
  EXPECT_FALSE(gi->defined());
  EXPECT_EQ(rt->Stats().steps, 1);
  EXPECT_NEAR(rt->Stats().learning_rate, 0.1 * std::pow(3.0, -1.0), 1e-12);

  // The step really used α/τ (T2 is off: no discrepancy_decay).
  ref->forward(x).backward(g);
  std::vector<torch::Tensor> expected;
  for (const auto& p : ref->parameters()) expected.push_back(p.detach() - (0.1 / 3) * p.grad());
  ExpectAllClose(rt->Parameters(), expected, 1e-5, 1e-7);

  ASSERT_TRUE(rt->Forward(2, x, true).ok());
  ASSERT_TRUE(BackwardStep(*rt, 2, g).ok());
  EXPECT_NEAR(rt->Stats().learning_rate, 0.1 * std::pow(3.0, -(1.0 - 1.0 / 100)), 1e-12);
  EXPECT_NEAR(rt->Stats().learning_rate, T1LearningRate(0.1, 1, 100, 3), 1e-15);
}

// Spike compensation: each step moves w by −α·(a·v + b·g) with v ← m·v + g,
// a = m^τ, b = (1 − m^τ)/(1 − m); τ = 3 on stage 0 of 4. The test keeps its
// own v from the gradients it reads before each step. Off, the same
// sequence is plain momentum (−α·v), so the check tells the two apart.
TEST(StageRuntimePipeMareTest, SpikeCompensationAppliesAVPlusBG) {
  const v1::ModelSpec model = Mlp({4, 3, 3, 3, 2});
  for (const bool on : {true, false}) {
    SCOPED_TRACE(on ? "spike compensation on" : "off");
    v1::StageAssignment a = Assignment("pipemare", 0, 4, 0, 1, model);
    a.mutable_optimizer()->set_momentum(0.9);
    a.mutable_optimizer()->set_weight_decay(0.01);
    a.mutable_schedule()->set_spike_compensation(on);
    auto rt = MustCreate(a);
    ASSERT_NE(rt, nullptr);
    const SpikeCoefficients c = on ? SpikeCompensation(0.9, 3) : SpikeCoefficients{};
    if (on) {
      EXPECT_NEAR(c.a, 0.729, 1e-12);
      EXPECT_NEAR(c.b, 1 + 0.9 + 0.81, 1e-12);
    }
    std::vector<torch::Tensor> v;
    for (uint64_t mb = 1; mb <= 3; ++mb) {
      const torch::Tensor x = Inputs(30 + mb);
      torch::manual_seed(40 + mb);
      ASSERT_TRUE(rt->Forward(mb, x, true).ok());
      ASSERT_TRUE(rt->Backward(mb, torch::randn({kBatch, 3})).ok());
      std::vector<torch::Tensor> w_old, expected;
      std::vector<torch::Tensor> params = rt->Parameters();
      for (size_t j = 0; j < params.size(); ++j) {
        const torch::Tensor w = params[j].detach().clone();
        const torch::Tensor g = params[j].grad().detach() + 0.01 * w;
        if (v.size() <= j) {
          v.push_back(g.clone());
        } else {
          v[j] = 0.9 * v[j] + g;
        }
        expected.push_back(w - 0.1 * SpikeCompensatedDirection(v[j], g, c));
      }
      ASSERT_TRUE(rt->Step().ok());
      ExpectAllClose(rt->Parameters(), expected, 1e-5, 1e-7);
    }
  }
}

// Weight prediction: after a step, a training forward on stage 0 of 4
// (τ = 3) runs at ŵ = w − τ·α·d, d the momentum buffer (sgd) or Adam's
// m̂/(√v̂ + ε); the live weights stay w; an evaluation forward uses w.
TEST(StageRuntimePipeMareTest, WeightPredictionForwardsAtWMinusTauAlphaD) {
  const v1::ModelSpec model = Mlp({4, 3, 3, 3, 2});
  for (const char* optimizer : {"sgd", "adam"}) {
    SCOPED_TRACE(optimizer);
    v1::StageAssignment a = Assignment("async", 0, 4, 0, 1, model);
    a.mutable_optimizer()->set_type(optimizer);
    if (std::string(optimizer) == "sgd") a.mutable_optimizer()->set_momentum(0.9);
    a.mutable_schedule()->set_weight_prediction(true);
    auto rt = MustCreate(a);
    ASSERT_NE(rt, nullptr);
    const torch::Tensor x = Inputs(51);
    torch::nn::Sequential at_w = MustBuild(model, 0, 1);
    // Before any step there is no direction: the forward is at w.
    auto first = rt->Forward(1, x, true);
    ASSERT_TRUE(first.ok()) << first.status();
    EXPECT_TRUE(torch::allclose(*first, at_w->forward(x))) << "no step yet";
    torch::manual_seed(52);
    ASSERT_TRUE(rt->Backward(1, torch::randn({kBatch, 3})).ok());
    std::vector<torch::Tensor> g;
    for (const auto& p : rt->Parameters()) g.push_back(p.grad().detach().clone());
    ASSERT_TRUE(rt->Step().ok());
    const std::vector<torch::Tensor> w = Snapshot(rt->Parameters());

    torch::nn::Sequential at_predicted = MustBuild(model, 0, 1);
    {
      torch::NoGradGuard no_grad;
      auto params = at_predicted->parameters();
      for (size_t j = 0; j < params.size(); ++j) {
        const torch::Tensor d =
            std::string(optimizer) == "sgd"
                ? g[j]  // v after the first step
                : AdamDirection(0.1 * g[j], 0.001 * g[j] * g[j], 1, 0.9, 0.999, 1e-8);
        params[j].copy_(PredictedWeights(w[j], d, 0.1, 3));
      }
    }
    auto second = rt->Forward(2, x, true);
    ASSERT_TRUE(second.ok()) << second.status();
    EXPECT_TRUE(torch::allclose(*second, at_predicted->forward(x), 1e-5, 1e-6));
    {
      torch::NoGradGuard no_grad;
      auto params = at_w->parameters();
      for (size_t j = 0; j < params.size(); ++j) params[j].copy_(w[j]);
    }
    EXPECT_FALSE(torch::allclose(*second, at_w->forward(x), 1e-5, 1e-6)) << "prediction moved";
    EXPECT_EQ(MaxAbsDiff(rt->Parameters(), w), 0) << "the live weights are untouched";
    auto eval = rt->Forward(3, x, false);
    ASSERT_TRUE(eval.ok());
    EXPECT_TRUE(torch::allclose(*eval, at_w->forward(x), 1e-6, 1e-7)) << "evaluation at w";
  }
}

// Delay compensation with Adam (the float64 replay covers SGD): the gradient
// Adam takes is g + λ0/(√v̂ + ε)·g·g·τ·δ, v̂ its second moment before the
// step, δ the velocity the stage keeps for it; Adam's new second moment
// shows which gradient it took.
TEST(StageRuntimePipeMareTest, DelayCompensationWithAdamUsesItsSecondMoment) {
  const v1::ModelSpec model = Mlp({4, 3, 3, 3, 2});
  v1::StageAssignment a = Assignment("async", 0, 4, 0, 1, model);  // τ = 3
  a.mutable_optimizer()->set_type("adam");
  a.mutable_schedule()->set_delay_compensation(2);
  auto rt = MustCreate(a);
  ASSERT_NE(rt, nullptr);
  const torch::Tensor x = Inputs(61);
  torch::manual_seed(62);
  for (uint64_t m = 1; m <= 2; ++m) {
    ASSERT_TRUE(rt->Forward(m, x, true).ok());
    ASSERT_TRUE(rt->Backward(m, torch::randn({kBatch, 3})).ok());
    if (m == 2) break;
    ASSERT_TRUE(rt->Step().ok());
  }
  // The state before the second step, by parameter in order.
  auto state = [&](const char* prefix, const char* suffix) {
    std::vector<torch::Tensor> out;
    const StageSnapshot snapshot = rt->Snapshot();
    for (const auto& [key, t] : snapshot.units.at(0).tensors) {
      const std::string k = key;
      if (k.rfind(prefix, 0) == 0 && k.size() >= std::strlen(suffix) &&
          k.compare(k.size() - std::strlen(suffix), std::string::npos, suffix) == 0) {
        out.push_back(t);
      }
    }
    return out;
  };
  const auto delta = state("t2/", "");
  const auto v = state("optim/", "/exp_avg_sq");
  std::vector<torch::Tensor> g;
  for (const auto& p : rt->Parameters()) g.push_back(p.grad().detach().clone());
  ASSERT_EQ(delta.size(), g.size());
  ASSERT_EQ(v.size(), g.size());
  ASSERT_TRUE(rt->Step().ok());
  const auto v_after = state("optim/", "/exp_avg_sq");
  for (size_t j = 0; j < g.size(); ++j) {
    EXPECT_GT(delta[j].abs().max().item<double>(), 0) << "δ follows the first step";
    const torch::Tensor ms = v[j] / (1 - 0.999);  // v̂ after one step
    const torch::Tensor corrected = DelayCompensatedGradient(g[j], 3.0 * delta[j], ms, 2.0);
    EXPECT_TRUE(
        torch::allclose(v_after[j], 0.999 * v[j] + 0.001 * corrected * corrected, 1e-5, 1e-12))
        << j;
    EXPECT_FALSE(torch::allclose(v_after[j], 0.999 * v[j] + 0.001 * g[j] * g[j], 1e-5, 1e-12))
        << j << ": the correction changed the gradient";
  }
}

TEST(StageRuntimePipeMareTest, AnalyticDelayPerStage) {
  const v1::ModelSpec model = Mlp({4, 3, 3, 3, 2});
  const int expected_n1[] = {3, 2, 1, 0};
  const int expected_n2[] = {2, 1, 1, 0};
  for (int stage = 0; stage < 4; ++stage) {
    auto rt1 = MustCreate(Assignment("pipemare", stage, 4, stage, 1, model, 0.1, 1));
    auto rt2 = MustCreate(Assignment("pipemare", stage, 4, stage, 1, model, 0.1, 2));
    ASSERT_NE(rt1, nullptr);
    ASSERT_NE(rt2, nullptr);
    EXPECT_EQ(rt1->Stats().analytic_delay, expected_n1[stage]) << stage;
    EXPECT_EQ(rt2->Stats().analytic_delay, expected_n2[stage]) << stage;
    EXPECT_EQ(rt1->is_first(), stage == 0);
    EXPECT_EQ(rt1->is_last(), stage == 3);
  }
}

TEST(StageRuntimePipeMareTest, T1OffOnLastStageAndWithoutK) {
  const v1::ModelSpec model = Mlp({4, 3, 3, 3, 2});
  v1::StageAssignment last = Assignment("pipemare", 3, 4, 3, 1, model);
  last.set_lr_anneal_steps(100);
  auto rt = MustCreate(last);
  ASSERT_NE(rt, nullptr);
  EXPECT_DOUBLE_EQ(rt->Stats().learning_rate, 0.1);
  auto first = MustCreate(Assignment("pipemare", 0, 4, 0, 1, model));  // K = 0
  ASSERT_NE(first, nullptr);
  EXPECT_DOUBLE_EQ(first->Stats().learning_rate, 0.1);
}

// ---------------------------------------------------------------------------
// pipemare T2

// A by-hand PipeMare T2 stage: weights w, velocity δ, a module to take
// gradients at u = w - τ δ, and plain SGD.
class T2Reference {
 public:
  T2Reference(const v1::ModelSpec& model, int first, int units, double lr, int tau, double gamma)
      : module_(MustBuild(model, first, units)), lr_(lr), tau_(tau), gamma_(gamma) {
    w_ = Snapshot(module_->parameters());
    for (const auto& p : w_) delta_.push_back(torch::zeros_like(p));
  }

  // One microbatch forward + backward + step; returns dL/dx at u.
  torch::Tensor Step(const torch::Tensor& x, const torch::Tensor& g) {
    auto params = module_->parameters();
    {
      torch::NoGradGuard no_grad;
      for (size_t j = 0; j < params.size(); ++j) {
        params[j].copy_(T2BackwardWeights(w_[j], delta_[j], tau_));
        params[j].mutable_grad() = torch::Tensor();
      }
    }
    torch::Tensor xin = x.detach().clone().requires_grad_(true);
    module_->forward(xin).backward(g);
    torch::NoGradGuard no_grad;
    for (size_t j = 0; j < params.size(); ++j) {
      torch::Tensor w_next = w_[j] - lr_ * params[j].grad();
      delta_[j] = T2Velocity(delta_[j], w_next, w_[j], gamma_);
      w_[j] = w_next;
    }
    return xin.grad().detach();
  }

  const std::vector<torch::Tensor>& weights() const { return w_; }
  // ||u_bkwd - w_t|| for the next backward, computed the long way.
  double CorrectionNorm() const {
    double sq = 0;
    for (size_t j = 0; j < w_.size(); ++j) {
      sq += (T2BackwardWeights(w_[j], delta_[j], tau_) - w_[j]).pow(2).sum().item<double>();
    }
    return std::sqrt(sq);
  }

 private:
  torch::nn::Sequential module_;
  double lr_;
  int tau_;
  double gamma_;
  std::vector<torch::Tensor> w_;
  std::vector<torch::Tensor> delta_;
};

// Plain SGD by hand (u = w), to check that T2 made a difference.
std::vector<torch::Tensor> PlainSgd(const v1::ModelSpec& model, int first, int units, double lr,
                                    const std::vector<torch::Tensor>& xs,
                                    const std::vector<torch::Tensor>& gs) {
  T2Reference plain(model, first, units, lr, 0, 0.0);
  for (size_t m = 0; m < xs.size(); ++m) plain.Step(xs[m], gs[m]);
  return plain.weights();
}

TEST(StageRuntimePipeMareTest, T2BackwardAtDiscrepancyCorrectedWeights) {
  const v1::ModelSpec model = Mlp({4, 3, 3, 3, 2}, "tanh");
  v1::StageAssignment a = Assignment("pipemare", 0, 4, 0, 2, model, 0.1);
  a.mutable_schedule()->set_discrepancy_decay(0.1);
  a.set_lr_anneal_steps(0);
  auto rt = MustCreate(a);
  ASSERT_NE(rt, nullptr);
  ASSERT_EQ(rt->Stats().analytic_delay, 3);
  const double gamma = std::pow(0.1, 1.0 / 3.0);
  EXPECT_NEAR(T2Gamma(0.1, 3), gamma, 1e-15);

  T2Reference ref(model, 0, 2, 0.1, 3, gamma);
  std::vector<torch::Tensor> xs, gs;
  for (int m = 0; m < 3; ++m) {
    xs.push_back(Inputs(400 + m));
    torch::manual_seed(500 + m);
    gs.push_back(torch::randn({kBatch, 3}));
  }
  for (int m = 0; m < 3; ++m) {
    ASSERT_TRUE(rt->Forward(m + 1, xs[m], true).ok());
    const double correction = ref.CorrectionNorm();
    auto gi = BackwardStep(*rt, m + 1, gs[m]);
    ASSERT_TRUE(gi.ok()) << gi.status();
    EXPECT_FALSE(gi->defined()) << "stage 0 has no input gradient";
    EXPECT_NEAR(rt->Stats().t2_correction_norm, correction, 1e-6 + 1e-5 * correction);
    ref.Step(xs[m], gs[m]);
    EXPECT_EQ(rt->Stats().steps, m + 1);
    EXPECT_DOUBLE_EQ(rt->Stats().learning_rate, 0.1);
    ExpectAllClose(rt->Parameters(), ref.weights(), 1e-5, 1e-6);
  }
  const auto plain = PlainSgd(model, 0, 2, 0.1, xs, gs);
  EXPECT_GT(MaxAbsDiff(plain, ref.weights()), 1e-4)
      << "the test inputs should make T2 differ from plain SGD";
  EXPECT_GT(MaxAbsDiff(plain, rt->Parameters()), 1e-4);
}

TEST(StageRuntimePipeMareTest, T2InputGradientOnAMiddleStage) {
  const v1::ModelSpec model = Mlp({4, 3, 3, 3, 2}, "tanh");
  v1::StageAssignment a = Assignment("pipemare", 1, 4, 1, 2, model, 0.2);
  a.mutable_schedule()->set_discrepancy_decay(0.3);
  auto rt = MustCreate(a);
  ASSERT_NE(rt, nullptr);
  ASSERT_EQ(rt->Stats().analytic_delay, 2);
  T2Reference ref(model, 1, 2, 0.2, 2, std::sqrt(0.3));
  for (int m = 0; m < 3; ++m) {
    const torch::Tensor x = Inputs(600 + m, 3);
    torch::manual_seed(700 + m);
    const torch::Tensor g = torch::randn({kBatch, 3});
    ASSERT_TRUE(rt->Forward(m, x, true).ok());
    auto gi = BackwardStep(*rt, m, g);
    ASSERT_TRUE(gi.ok()) << gi.status();
    ASSERT_TRUE(gi->defined());
    torch::Tensor expected = ref.Step(x, g);
    EXPECT_EQ(gi->sizes(), x.sizes());
    EXPECT_TRUE(torch::allclose(*gi, expected, 1e-5, 1e-6)) << m << "\n" << *gi << expected;
    ExpectAllClose(rt->Parameters(), ref.weights(), 1e-5, 1e-6);
  }
}

TEST(StageRuntimePipeMareTest, T2OffWithNegativeDecay) {
  const v1::ModelSpec model = Mlp({4, 3, 3, 3, 2}, "tanh");
  v1::StageAssignment a = Assignment("pipemare", 0, 4, 0, 2, model, 0.1);
  a.mutable_schedule()->set_discrepancy_decay(-1);
  auto rt = MustCreate(a);
  ASSERT_NE(rt, nullptr);
  std::vector<torch::Tensor> xs, gs;
  for (int m = 0; m < 3; ++m) {
    xs.push_back(Inputs(800 + m));
    torch::manual_seed(900 + m);
    gs.push_back(torch::randn({kBatch, 3}));
    ASSERT_TRUE(rt->Forward(m, xs[m], true).ok());
    ASSERT_TRUE(BackwardStep(*rt, m, gs[m]).ok());
  }
  ExpectAllClose(rt->Parameters(), PlainSgd(model, 0, 2, 0.1, xs, gs), 1e-5, 1e-6);
}

// ---------------------------------------------------------------------------
// Delay bookkeeping

TEST(StageRuntimeStatsTest, MeasuredDelayCountsStepsBetweenForwardAndBackward) {
  auto rt = MustCreate(SingleStage("gpipe", 1));
  ASSERT_NE(rt, nullptr);
  for (uint64_t m = 1; m <= 3; ++m) {
    ASSERT_TRUE(rt->ForwardLoss(m, Inputs(m), Targets(10 + m), true).ok());
  }
  for (uint64_t m = 1; m <= 3; ++m) ASSERT_TRUE(BackwardStep(*rt, m, torch::Tensor()).ok());
  StageStats s = rt->Stats();
  EXPECT_EQ(s.forwards, 3);
  EXPECT_EQ(s.backwards, 3);
  EXPECT_EQ(s.steps, 3);
  EXPECT_DOUBLE_EQ(s.measured_delay, (0.0 + 1.0 + 2.0) / 3.0);
}

TEST(StageRuntimeStatsTest, InterleavedHasNoDelay) {
  auto rt = MustCreate(SingleStage("gpipe", 1));
  ASSERT_NE(rt, nullptr);
  for (uint64_t m = 1; m <= 3; ++m) {
    ASSERT_TRUE(rt->ForwardLoss(m, Inputs(m), Targets(10 + m), true).ok());
    ASSERT_TRUE(BackwardStep(*rt, m, torch::Tensor()).ok());
  }
  EXPECT_DOUBLE_EQ(rt->Stats().measured_delay, 0.0);
  EXPECT_EQ(rt->Stats().steps, 3);
}

TEST(StageRuntimeStatsTest, EvalForwardsAreNotCountedOrSaved) {
  auto rt = MustCreate(SingleStage("gpipe", 1));
  ASSERT_NE(rt, nullptr);
  auto r = rt->ForwardLoss(1, Inputs(1), Targets(2), false);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->count, kBatch);
  // Eval may reuse an id, and there is nothing to differentiate.
  ASSERT_TRUE(rt->ForwardLoss(1, Inputs(1), Targets(2), false).ok());
  EXPECT_EQ(rt->Stats().forwards, 0);
  EXPECT_EQ(BackwardStep(*rt, 1, torch::Tensor()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------------------
// Errors

TEST(StageRuntimeErrorTest, BackwardOfUnknownMicrobatch) {
  auto rt = MustCreate(SingleStage("gpipe", 1));
  ASSERT_NE(rt, nullptr);
  auto g = BackwardStep(*rt, 42, torch::Tensor());
  EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(g.status().message()), HasSubstr("42"));
  // A backward consumes the saved microbatch: a second one is unknown.
  ASSERT_TRUE(rt->ForwardLoss(1, Inputs(1), Targets(2), true).ok());
  ASSERT_TRUE(BackwardStep(*rt, 1, torch::Tensor()).ok());
  EXPECT_FALSE(BackwardStep(*rt, 1, torch::Tensor()).ok());
}

TEST(StageRuntimeErrorTest, DuplicateTrainingForward) {
  const v1::ModelSpec model = Mlp({4, 3, 3, 3, 2});
  auto rt = MustCreate(Assignment("pipemare", 0, 4, 0, 1, model));
  ASSERT_NE(rt, nullptr);
  ASSERT_TRUE(rt->Forward(7, Inputs(1), true).ok());
  auto again = rt->Forward(7, Inputs(1), true);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(again.status().message()), HasSubstr("7"));
  EXPECT_TRUE(rt->Forward(7, Inputs(1), false).ok()) << "eval forwards do not collide";
  EXPECT_EQ(rt->Stats().forwards, 1);
}

TEST(StageRuntimeErrorTest, WrongInputWidthIsAStatus) {
  const v1::ModelSpec model = Mlp({4, 3, 3, 3, 2});
  auto rt = MustCreate(Assignment("pipemare", 0, 4, 0, 1, model));
  ASSERT_NE(rt, nullptr);
  auto out = rt->Forward(1, Inputs(1, 7), true);
  EXPECT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument) << out.status();
  EXPECT_EQ(rt->Stats().forwards, 0);
  // The failed forward saved nothing: the id is still free.
  auto ok = rt->Forward(1, Inputs(1), true);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->sizes(), (std::vector<int64_t>{kBatch, 3}));

  auto last = MustCreate(SingleStage("gpipe", 1));
  ASSERT_NE(last, nullptr);
  EXPECT_FALSE(last->ForwardLoss(1, Inputs(1, 5), Targets(2), true).ok());
}

TEST(StageRuntimeErrorTest, ForwardLossOnANonLastStage) {
  const v1::ModelSpec model = Mlp({4, 3, 3, 3, 2});
  auto rt = MustCreate(Assignment("pipemare", 0, 4, 0, 1, model));
  ASSERT_NE(rt, nullptr);
  auto r = rt->ForwardLoss(1, Inputs(1), Targets(2), true);
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(StageRuntimeErrorTest, TargetsOutOfRangeAreInvalidArgument) {
  auto rt = MustCreate(SingleStage("gpipe", 1));
  ASSERT_NE(rt, nullptr);
  uint64_t id = 1;
  // Class ids outside 0..1.
  for (int64_t bad : {2, -1}) {
    torch::Tensor t = torch::zeros({kBatch}, torch::kInt64);
    t[3] = bad;
    auto r = rt->ForwardLoss(id++, Inputs(1), t, true);
    EXPECT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    EXPECT_THAT(std::string(r.status().message()), HasSubstr("0..1"));
  }
}

TEST(StageRuntimeErrorTest, BadTargetTypesAndShapes) {
  auto rt = MustCreate(SingleStage("gpipe", 1));
  ASSERT_NE(rt, nullptr);
  const torch::Tensor x = Inputs(1);
  uint64_t id = 1;
  // Wrong dtype, length and rank.
  EXPECT_EQ(rt->ForwardLoss(id++, x, torch::zeros({kBatch}, torch::kFloat32), true).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(rt->ForwardLoss(id++, x, torch::zeros({kBatch}, torch::kInt32), true).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      rt->ForwardLoss(id++, x, torch::zeros({kBatch + 1}, torch::kInt64), true).status().code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      rt->ForwardLoss(id++, x, torch::zeros({kBatch, 1}, torch::kInt64), true).status().code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(rt->Stats().steps, 0);
}

TEST(StageRuntimeErrorTest, MissingOrMisshapenGradientOnANonLastStage) {
  const v1::ModelSpec model = Mlp({4, 3, 3, 3, 2});
  auto rt = MustCreate(Assignment("pipemare", 0, 4, 0, 1, model));
  ASSERT_NE(rt, nullptr);
  ASSERT_TRUE(rt->Forward(1, Inputs(1), true).ok());
  auto g = BackwardStep(*rt, 1, torch::Tensor());
  EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(rt->Forward(2, Inputs(2), true).ok());
  auto h = BackwardStep(*rt, 2, torch::zeros({kBatch, 4}));
  EXPECT_FALSE(h.ok());
  EXPECT_EQ(rt->Stats().steps, 0);
}

TEST(StageRuntimeErrorTest, MisshapenGradientIsInvalidArgument) {
  const v1::ModelSpec model = Mlp({4, 3, 3, 3, 2});
  auto rt = MustCreate(Assignment("pipemare", 0, 4, 0, 1, model));
  ASSERT_NE(rt, nullptr);
  ASSERT_TRUE(rt->Forward(1, Inputs(1), true).ok());
  auto h = BackwardStep(*rt, 1, torch::zeros({kBatch, 4}));
  EXPECT_EQ(h.status().code(), absl::StatusCode::kInvalidArgument) << h.status();
  EXPECT_THAT(std::string(h.status().message()), HasSubstr("shape"));
}

TEST(StageRuntimeErrorTest, FailedT2BackwardLeavesWeightsAtWt) {
  // T2 swaps the parameters to u_bkwd for the backward; a backward that
  // fails must not leave them there.
  const v1::ModelSpec model = Mlp({4, 3, 3, 3, 2}, "tanh");
  v1::StageAssignment a = Assignment("pipemare", 0, 4, 0, 2, model, 0.1);
  a.mutable_schedule()->set_discrepancy_decay(0.1);
  auto rt = MustCreate(a);
  ASSERT_NE(rt, nullptr);
  torch::manual_seed(5);
  ASSERT_TRUE(rt->Forward(1, Inputs(1), true).ok());
  ASSERT_TRUE(BackwardStep(*rt, 1, torch::randn({kBatch, 3})).ok());  // δ is now non-zero
  const auto w_t = Snapshot(rt->Parameters());
  ASSERT_TRUE(rt->Forward(2, Inputs(2), true).ok());
  auto bad = BackwardStep(*rt, 2, torch::zeros({kBatch, 4}));  // wrong gradient shape
  EXPECT_FALSE(bad.ok());
  EXPECT_EQ(rt->Stats().steps, 1);
  ExpectAllClose(rt->Parameters(), w_t, 0, 0);
}

TEST(StageRuntimeErrorTest, CreateRejectsBadAssignments) {
  const v1::ModelSpec model = Mlp({4, 3, 3, 2});
  struct Case {
    const char* field;
    v1::StageAssignment a;
  };
  std::vector<Case> cases;
  cases.push_back({"stage", Assignment("gpipe", 1, 1, 0, 3, model)});
  cases.push_back({"stage", Assignment("gpipe", 4, 2, 0, 3, model)});
  cases.push_back({"stage", Assignment("gpipe", -1, 2, 0, 3, model)});
  cases.push_back({"num_stages", Assignment("gpipe", 0, 0, 0, 3, model)});
  cases.push_back({"schedule.type", Assignment("foo", 0, 1, 0, 3, model)});
  cases.push_back({"optimizer.lr", Assignment("gpipe", 0, 1, 0, 3, model, 0.0)});
  cases.push_back(
      {"schedule.microbatches_per_step", Assignment("gpipe", 0, 1, 0, 3, model, 0.1, 0)});
  Case adam{"optimizer.type", Assignment("gpipe", 0, 1, 0, 3, model)};
  adam.a.mutable_optimizer()->set_type("rmsprop");
  cases.push_back(adam);
  for (const auto& c : cases) {
    SCOPED_TRACE(c.a.ShortDebugString());
    auto rt = StageRuntime::Create(c.a);
    EXPECT_EQ(rt.status().code(), absl::StatusCode::kInvalidArgument) << rt.status();
    EXPECT_THAT(std::string(rt.status().message()), HasSubstr(c.field));
  }
}

TEST(StageRuntimeErrorTest, CreateRejectsBadUnitRangeAndModelAsInvalidArgument) {
  const v1::ModelSpec model = Mlp({4, 3, 3, 2});
  struct Case {
    const char* field;
    v1::StageAssignment a;
  };
  std::vector<Case> cases;
  cases.push_back({"units", Assignment("gpipe", 0, 2, 2, 2, model)});
  cases.push_back({"units", Assignment("gpipe", 0, 2, 3, 1, model)});
  cases.push_back({"units", Assignment("gpipe", 0, 2, 0, 0, model)});
  cases.push_back({"units", Assignment("gpipe", 0, 2, -1, 1, model)});
  Case cnn{"model.type", Assignment("gpipe", 0, 1, 0, 3, model)};
  cnn.a.mutable_model()->set_type("cnn");
  cases.push_back(cnn);
  for (const auto& c : cases) {
    SCOPED_TRACE(c.a.ShortDebugString());
    auto rt = StageRuntime::Create(c.a);
    EXPECT_FALSE(rt.ok());
    EXPECT_EQ(rt.status().code(), absl::StatusCode::kInvalidArgument) << rt.status();
    EXPECT_THAT(std::string(rt.status().message()), HasSubstr(c.field));
  }
}

TEST(ParseScheduleKindTest, Values) {
  EXPECT_EQ(*ParseScheduleKind("gpipe"), ScheduleKind::kGPipe);
  EXPECT_EQ(*ParseScheduleKind("pipemare"), ScheduleKind::kPipeMare);
  auto bad = ParseScheduleKind("PipeMare");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("pipemare, gpipe"));
}

}  // namespace
}  // namespace pipemare

namespace pipemare {
namespace {

TEST(StageRuntimeMemoryTest, CountsTheTensorsTheStageHolds) {
  // Stage 0 of 4 holds Linear(4,3) (12 + 3) and Linear(3,3) (9 + 3): 27 floats.
  const v1::ModelSpec model = Mlp({4, 3, 3, 3, 2}, "tanh");
  v1::StageAssignment a = Assignment("pipemare", 0, 4, 0, 2, model, 0.1);
  a.mutable_optimizer()->set_momentum(0.9);
  a.mutable_schedule()->set_discrepancy_decay(0.1);
  auto rt = MustCreate(a);
  ASSERT_NE(rt, nullptr);
  const int64_t weights = 27 * 4;
  StageStats s = rt->Stats();
  EXPECT_EQ(s.parameters, 27);
  EXPECT_EQ(s.memory.weights, weights);
  EXPECT_EQ(s.memory.t2_velocity, weights);  // one δ per parameter
  EXPECT_EQ(s.memory.optimizer_state, 0);    // momentum buffers appear at the first step
  EXPECT_EQ(s.memory.saved_activations, 0);
  EXPECT_EQ(s.memory.stash, 0);

  const torch::Tensor x1 = Inputs(1), x2 = Inputs(2);
  ASSERT_TRUE(rt->Forward(1, x1, true).ok());
  ASSERT_TRUE(rt->Forward(2, x2, true).ok());
  s = rt->Stats();
  EXPECT_EQ(s.in_flight, 2);
  EXPECT_EQ(s.memory.saved_activations, 2 * kBatch * 4 * 4);
  ASSERT_TRUE(rt->Forward(3, x1, /*train=*/false).ok());  // eval saves nothing
  EXPECT_EQ(rt->Stats().memory.saved_activations, 2 * kBatch * 4 * 4);

  torch::manual_seed(5);
  ASSERT_TRUE(BackwardStep(*rt, 1, torch::randn({kBatch, 3})).ok());
  s = rt->Stats();
  EXPECT_EQ(s.in_flight, 1);
  EXPECT_EQ(s.memory.saved_activations, kBatch * 4 * 4);
  EXPECT_EQ(s.memory.optimizer_state, weights);  // SGD momentum: one buffer per parameter
  EXPECT_EQ(s.t2_correction_norm, 0);            // δ was 0 at the first backward
  EXPECT_GT(s.last_step_seconds, 0);

  ASSERT_TRUE(BackwardStep(*rt, 2, torch::randn({kBatch, 3})).ok());
  EXPECT_GT(rt->Stats().t2_correction_norm, 0) << "after one step δ != 0, so u_bkwd != w";
  EXPECT_EQ(rt->Stats().in_flight, 0);
  EXPECT_EQ(rt->Stats().memory.saved_activations, 0);
}

}  // namespace
}  // namespace pipemare

namespace pipemare {
namespace {

// Stage 1 of 4 (one unit, Linear(3,3)+tanh), τ_1 = 2: microbatches 1 and 2
// are forwarded at weight version 0; the backward of 1 steps to version 1;
// 3 is forwarded at version 1; then the backward of 2 runs.
struct Interleaved {
  std::unique_ptr<StageRuntime> rt;
  std::vector<torch::Tensor> w0, w1, w2;  // weights at versions 0, 1, 2
  torch::Tensor grad_input_2;             // dL/dx of microbatch 2
  StageStats after_forward_3, after_backward_2;
};

std::vector<torch::Tensor> Snapshot(const StageRuntime& rt) {
  std::vector<torch::Tensor> w;
  for (const auto& p : rt.Parameters()) w.push_back(p.detach().clone());
  return w;
}

Interleaved RunInterleaved(const std::string& schedule) {
  Interleaved r;
  const v1::ModelSpec model = Mlp({4, 3, 3, 3, 2}, "tanh");
  r.rt = MustCreate(Assignment(schedule, 1, 4, 1, 1, model, 0.5));
  if (!r.rt) return r;
  EXPECT_EQ(r.rt->Stats().analytic_delay, 2);
  r.w0 = Snapshot(*r.rt);
  EXPECT_TRUE(r.rt->Forward(1, Inputs(1, 3), true).ok());
  EXPECT_TRUE(r.rt->Forward(2, Inputs(2, 3), true).ok());
  EXPECT_TRUE(BackwardStep(*r.rt, 1, Inputs(11, 3)).ok());
  r.w1 = Snapshot(*r.rt);
  EXPECT_TRUE(r.rt->Forward(3, Inputs(3, 3), true).ok());
  r.after_forward_3 = r.rt->Stats();
  auto g = BackwardStep(*r.rt, 2, Inputs(12, 3));
  EXPECT_TRUE(g.ok()) << g.status();
  if (g.ok()) r.grad_input_2 = *g;
  r.w2 = Snapshot(*r.rt);
  r.after_backward_2 = r.rt->Stats();
  return r;
}

// The reference: microbatch 2 alone, forward and backward at version 0.
Interleaved RunAloneAtVersion0() {
  Interleaved r;
  r.rt = MustCreate(Assignment("gpipe", 1, 4, 1, 1, Mlp({4, 3, 3, 3, 2}, "tanh"), 0.5));
  r.w0 = Snapshot(*r.rt);
  EXPECT_TRUE(r.rt->Forward(2, Inputs(2, 3), true).ok());
  auto g = BackwardStep(*r.rt, 2, Inputs(12, 3));
  EXPECT_TRUE(g.ok());
  if (g.ok()) r.grad_input_2 = *g;
  r.w1 = Snapshot(*r.rt);
  return r;
}

TEST(StageRuntimePipeDreamTest, BackwardUsesTheWeightsItsForwardUsed) {
  Interleaved pd = RunInterleaved("pipedream");
  Interleaved ref = RunAloneAtVersion0();
  ASSERT_TRUE(pd.rt && ref.rt);
  // Versions: microbatch 2 was forwarded at 0 and differentiated at 0.
  EXPECT_EQ(pd.after_backward_2.last_backward_version, 0);
  EXPECT_EQ(pd.after_backward_2.steps, 2);
  // Its input gradient is the one at version 0 ...
  EXPECT_TRUE(torch::allclose(pd.grad_input_2, ref.grad_input_2, 1e-6, 1e-7));
  // ... and so is the update it applied: w2 - w1 == (w0 - lr g_2(w0)) - w0.
  for (size_t j = 0; j < pd.w2.size(); ++j) {
    EXPECT_TRUE(torch::allclose(pd.w2[j] - pd.w1[j], ref.w1[j] - ref.w0[j], 1e-6, 1e-7)) << j;
  }
  // The backward restored the current weights before stepping from them.
  EXPECT_FALSE(torch::allclose(pd.w1[0], pd.w0[0]));
}

TEST(StageRuntimePipeDreamTest, StashHoldsOneCopyPerVersionInFlight) {
  Interleaved pd = RunInterleaved("pipedream");
  ASSERT_TRUE(pd.rt);
  const int64_t weights = (9 + 3) * 4;  // Linear(3,3), float32
  // After forward 3: microbatch 2 needs version 0, microbatch 3 version 1.
  EXPECT_EQ(pd.after_forward_3.stashed_versions, 2);
  EXPECT_EQ(pd.after_forward_3.memory.stash, 2 * weights);
  EXPECT_EQ(pd.after_backward_2.stashed_versions, 1);
  EXPECT_EQ(pd.after_backward_2.memory.stash, weights);
  ASSERT_TRUE(BackwardStep(*pd.rt, 3, Inputs(13, 3)).ok());
  EXPECT_EQ(pd.rt->Stats().stashed_versions, 0);
  EXPECT_EQ(pd.rt->Stats().memory.stash, 0);
  EXPECT_EQ(pd.rt->Stats().peak_memory.stash, 2 * weights) << "the peak stays";
  EXPECT_EQ(pd.rt->Stats().memory.t2_velocity, 0);
}

TEST(StageRuntimeAsyncTest, BackwardUsesTheCurrentWeightsAndStashesNothing) {
  Interleaved as = RunInterleaved("async");
  Interleaved ref = RunAloneAtVersion0();
  ASSERT_TRUE(as.rt && ref.rt);
  EXPECT_EQ(as.after_backward_2.last_backward_version, 1);  // forwarded at 0
  EXPECT_EQ(as.after_forward_3.memory.stash, 0);
  EXPECT_EQ(as.after_forward_3.memory.t2_velocity, 0);
  EXPECT_FALSE(torch::allclose(as.grad_input_2, ref.grad_input_2, 1e-6, 1e-7))
      << "the naive schedule differentiates at the newer weights";
  // Its update is the gradient at version 1, on the same saved input.
  auto at_w1 = MustCreate(Assignment("gpipe", 1, 4, 1, 1, Mlp({4, 3, 3, 3, 2}, "tanh"), 0.5));
  ASSERT_NE(at_w1, nullptr);
  {
    torch::NoGradGuard no_grad;
    auto params = at_w1->Parameters();
    for (size_t j = 0; j < params.size(); ++j) params[j].copy_(as.w1[j]);
  }
  ASSERT_TRUE(at_w1->Forward(2, Inputs(2, 3), true).ok());
  auto g = BackwardStep(*at_w1, 2, Inputs(12, 3));
  ASSERT_TRUE(g.ok());
  EXPECT_TRUE(torch::allclose(as.grad_input_2, *g, 1e-6, 1e-7));
  EXPECT_TRUE(torch::allclose(as.w2[0], at_w1->Parameters()[0], 1e-6, 1e-7));
}

TEST(ParseScheduleKindTest, AllFourSchedules) {
  EXPECT_EQ(*ParseScheduleKind("pipedream"), ScheduleKind::kPipeDream);
  EXPECT_EQ(*ParseScheduleKind("async"), ScheduleKind::kAsync);
  EXPECT_FALSE(IsAsynchronous(ScheduleKind::kGPipe));
  for (auto k : {ScheduleKind::kPipeDream, ScheduleKind::kAsync, ScheduleKind::kPipeMare}) {
    EXPECT_TRUE(IsAsynchronous(k));
  }
}

}  // namespace
}  // namespace pipemare

namespace pipemare {
namespace {

// T3: two synchronous steps (as gpipe), then pipemare with T1 counting from
// the switch and T2 correcting with the velocity the warm-up kept warm.
TEST(StageRuntimeWarmupTest, SwitchesAtTheConfiguredStepAndDelaysChangeThen) {
  v1::StageAssignment a = Assignment("pipemare", 1, 4, 1, 1, Mlp({4, 3, 3, 3, 2}, "tanh"), 0.5);
  a.set_warmup_steps(2);
  a.set_lr_anneal_steps(10);
  a.mutable_schedule()->set_discrepancy_decay(0.1);
  auto rt = MustCreate(a);
  ASSERT_NE(rt, nullptr);
  ASSERT_EQ(rt->Stats().analytic_delay, 2);
  EXPECT_EQ(rt->Stats().async_from_step, -1);
  auto forward = [&](uint64_t m) { ASSERT_TRUE(rt->Forward(m, Inputs(m, 3), true).ok()); };
  auto backward = [&](uint64_t m) { ASSERT_TRUE(BackwardStep(*rt, m, Inputs(10 + m, 3)).ok()); };

  // Warm-up: forward then backward of each microbatch, at w_t, no T1.
  forward(1);
  backward(1);
  EXPECT_DOUBLE_EQ(rt->Stats().learning_rate, 0.5) << "T1 would give 0.5 * 2^-1";
  forward(2);
  backward(2);
  EXPECT_EQ(rt->Stats().t2_correction_norm, 0) << "no correction during the warm-up";
  EXPECT_EQ(rt->Stats().measured_delay, 0);
  EXPECT_EQ(rt->Stats().steps, 2);
  EXPECT_EQ(rt->Stats().async_from_step, 2);
  EXPECT_GT(rt->Stats().memory.t2_velocity, 0);

  // Asynchronous from step 2: 1F1B with τ = 2 in steady state.
  forward(3);
  forward(4);
  forward(5);
  backward(3);  // forwarded at 2, differentiated at 2: delay 0 (pipeline fill)
  EXPECT_GT(rt->Stats().t2_correction_norm, 0) << "δ from the warm-up steps";
  EXPECT_DOUBLE_EQ(rt->Stats().learning_rate, 0.5 * std::pow(2.0, -1.0))
      << "T1 at k - W = 0: α · τ^-1";
  forward(6);
  backward(4);  // forwarded at 2, now 3
  forward(7);
  backward(5);  // forwarded at 2, now 4: τ = 2
  EXPECT_NEAR(rt->Stats().measured_delay, (0 + 1 + 2) / 3.0, 1e-12)
      << "counted from the switch: the warm-up's zeros are not in the mean";
  backward(6);  // forwarded at 3, now 5
  backward(7);  // forwarded at 4, now 6
  EXPECT_NEAR(rt->Stats().measured_delay, (0 + 1 + 2 + 2 + 2) / 5.0, 1e-12);
  EXPECT_DOUBLE_EQ(rt->Stats().learning_rate, 0.5 * std::pow(2.0, -(1.0 - 4.0 / 10.0)))
      << "the step from 6 to 7 is k = 6, k - W = 4 of K = 10";
}

TEST(StageRuntimeWarmupTest, GPipeIgnoresIt) {
  v1::StageAssignment a = Assignment("gpipe", 1, 4, 1, 1, Mlp({4, 3, 3, 3, 2}, "tanh"), 0.5);
  a.set_warmup_steps(2);
  auto rt = MustCreate(a);
  ASSERT_NE(rt, nullptr);
  ASSERT_TRUE(rt->Forward(1, Inputs(1, 3), true).ok());
  ASSERT_TRUE(BackwardStep(*rt, 1, Inputs(11, 3)).ok());
  ASSERT_TRUE(rt->Forward(2, Inputs(2, 3), true).ok());
  ASSERT_TRUE(BackwardStep(*rt, 2, Inputs(12, 3)).ok());
  EXPECT_EQ(rt->Stats().async_from_step, -1);
  EXPECT_EQ(rt->Stats().last_delay, 0);
}

}  // namespace
}  // namespace pipemare

namespace pipemare {
namespace {

// Adam and AdamW, a step schedule and per-stage clipping, against the same
// model trained by plain LibTorch on the same microbatches.
template <typename Optimizer, typename Options>
void ExpectMatchesTorch(const std::string& type, Options options) {
  v1::StageAssignment a = SingleStage("gpipe", 2);
  auto* o = a.mutable_optimizer();
  o->set_type(type);
  o->set_lr(0.01);
  o->set_weight_decay(0.05);
  o->set_beta1(0.8);
  o->set_beta2(0.99);
  o->set_eps(1e-7);
  o->set_grad_clip_norm(0.5);
  o->set_lr_schedule("step");
  o->set_lr_step_size(2);
  o->set_lr_step_gamma(0.5);
  auto rt = MustCreate(a);
  ASSERT_NE(rt, nullptr);
  torch::nn::Sequential ref = MustBuild(a.model(), 0, 3);
  Optimizer opt(ref->parameters(),
                options.betas(std::make_tuple(0.8, 0.99)).eps(1e-7).weight_decay(0.05));
  for (int step = 0; step < 4; ++step) {
    const torch::Tensor loss_of_ref = TwoMicrobatchStep(*rt, ref, step);

    opt.zero_grad();
    loss_of_ref.backward();
    const double norm = torch::nn::utils::clip_grad_norm_(ref->parameters(), 0.5);
    const double lr = 0.01 * std::pow(0.5, step / 2);
    for (auto& group : opt.param_groups()) group.options().set_lr(lr);
    opt.step();
    EXPECT_DOUBLE_EQ(rt->Stats().learning_rate, lr) << type << " step " << step;
    EXPECT_NEAR(rt->Stats().last_grad_norm, norm, 1e-6 * norm) << type;
    ExpectAllClose(rt->Parameters(), ref->parameters(), 1e-5, 1e-7);
  }
  // Two moments per parameter.
  EXPECT_EQ(rt->Stats().memory.optimizer_state, 2 * rt->Stats().memory.weights) << type;
}

TEST(StageRuntimeOptimizerTest, AdamMatchesTorchWithStepScheduleAndClipping) {
  ExpectMatchesTorch<torch::optim::Adam>("adam", torch::optim::AdamOptions(0.01));
}

TEST(StageRuntimeOptimizerTest, AdamWMatchesTorchWithStepScheduleAndClipping) {
  ExpectMatchesTorch<torch::optim::AdamW>("adamw", torch::optim::AdamWOptions(0.01));
}

TEST(StageRuntimeOptimizerTest, ClippingBoundsTheStagesUpdate) {
  // Plain SGD, clip at 1e-3: the update is exactly lr · 1e-3 long.
  v1::StageAssignment a = SingleStage("gpipe", 1);
  a.mutable_optimizer()->set_grad_clip_norm(1e-3);
  auto rt = MustCreate(a);
  ASSERT_NE(rt, nullptr);
  const auto w0 = Snapshot(rt->Parameters());
  ASSERT_TRUE(rt->ForwardLoss(1, Inputs(1), Targets(2), true).ok());
  ASSERT_TRUE(BackwardStep(*rt, 1, torch::Tensor()).ok());
  double sq = 0;
  const auto w1 = rt->Parameters();
  for (size_t j = 0; j < w0.size(); ++j) sq += (w1[j] - w0[j]).pow(2).sum().item<double>();
  // torch divides by (norm + 1e-6): the length is lr · 1e-3 to 1e-4 relative.
  EXPECT_NEAR(std::sqrt(sq), 0.1 * 1e-3, 1e-4 * 0.1 * 1e-3);
  EXPECT_GT(rt->Stats().last_grad_norm, 1e-3);
}

TEST(StageRuntimeOptimizerTest, T1ScalesAdamsStepOnADelayedStage) {
  // Adam's first update is ±lr per element (m / sqrt(v) = sign(g)), so the
  // largest change shows the step size T1 gave the stage: α · τ^-1.
  v1::StageAssignment a = Assignment("pipemare", 1, 4, 1, 1, Mlp({4, 3, 3, 3, 2}, "tanh"), 0.01);
  a.mutable_optimizer()->set_type("adam");
  a.set_lr_anneal_steps(100);
  auto rt = MustCreate(a);
  ASSERT_NE(rt, nullptr);
  ASSERT_EQ(rt->Stats().analytic_delay, 2);
  const auto w0 = Snapshot(rt->Parameters());
  ASSERT_TRUE(rt->Forward(1, Inputs(1, 3), true).ok());
  ASSERT_TRUE(BackwardStep(*rt, 1, Inputs(11, 3)).ok());
  EXPECT_NEAR(MaxAbsDiff(rt->Parameters(), w0), 0.01 / 2, 1e-6);
  EXPECT_DOUBLE_EQ(rt->Stats().learning_rate, 0.005);
}

TEST(StageRuntimeOptimizerTest, CreateRefusesOptimizerFieldsOfAnotherType) {
  v1::StageAssignment a = SingleStage("gpipe", 1);
  a.mutable_optimizer()->set_type("adam");
  a.mutable_optimizer()->set_momentum(0.9);
  auto rt = StageRuntime::Create(a);
  ASSERT_FALSE(rt.ok());
  EXPECT_THAT(std::string(rt.status().message()), HasSubstr("optimizer.momentum"));
}

TEST(VirtualDeviceTest, ParsesMillisecondsPerUnitAndNamesTheFlag) {
  auto v = ParseVirtualDevice("2,4.5", "--virtual-device");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_TRUE(v->enabled);
  EXPECT_DOUBLE_EQ(v->forward_seconds_per_unit, 0.002);
  EXPECT_DOUBLE_EQ(v->backward_seconds_per_unit, 0.0045);
  // Three values: B's and W's shares of the backward.
  auto split = ParseVirtualDevice("2,4,6", "--virtual-device");
  ASSERT_TRUE(split.ok()) << split.status();
  EXPECT_DOUBLE_EQ(split->backward_seconds_per_unit, 0.010);
  EXPECT_DOUBLE_EQ(split->weight_seconds_per_unit, 0.006);
  EXPECT_DOUBLE_EQ(v->weight_seconds_per_unit, 0.00225) << "half the backward unless given";
  for (const char* bad : {"", "2", "2,", ",4", "a,b", "-1,2", "2,4,6,8", "2,4,", "nan,1"}) {
    auto b = ParseVirtualDevice(bad, "--virtual-device");
    ASSERT_FALSE(b.ok()) << bad;
    EXPECT_THAT(std::string(b.status().message()), HasSubstr("--virtual-device")) << bad;
    EXPECT_THAT(std::string(b.status().message()), HasSubstr("FWD_MS,BWD_MS")) << bad;
  }
}

// The virtual device keeps shapes, messages and schedule decisions real and
// replaces compute: zeros out, zeros back, weights untouched, steps counted.
TEST(VirtualDeviceTest, KeepsShapesStepsAndDelaysButNotValues) {
  const v1::ModelSpec model = Mlp({4, 3, 3, 2});
  VirtualDevice virt{true, 0.0005, 0.001};
  auto first = StageRuntime::Create(Assignment("pipemare", 0, 2, 0, 2, model), torch::kCPU,
                                    torch::kFloat32, virt);
  auto last = StageRuntime::Create(Assignment("pipemare", 1, 2, 2, 1, model), torch::kCPU,
                                   torch::kFloat32, virt);
  ASSERT_TRUE(first.ok() && last.ok());
  std::vector<torch::Tensor> before;
  for (const auto& p : (*first)->Parameters()) before.push_back(p.detach().clone());
  // 1F1B with τ_0 = 1: F1 F2 B1 F3 B2 B3 on stage 0.
  std::map<uint64_t, torch::Tensor> act;
  auto fwd = [&](uint64_t m) {
    auto out = (*first)->Forward(m, Inputs(m), true);
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(out->sizes().vec(), (std::vector<int64_t>{kBatch, 3}));
    EXPECT_EQ(out->abs().sum().item<double>(), 0.0);
    auto loss = (*last)->ForwardLoss(m, *out, Targets(m), true);
    ASSERT_TRUE(loss.ok()) << loss.status();
    EXPECT_NEAR(loss->loss, std::log(2.0), 1e-6);  // zero logits over 2 classes
    auto g = BackwardStep(*(*last), m, torch::Tensor());
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ(g->sizes().vec(), (std::vector<int64_t>{kBatch, 3}));
    act[m] = *g;
  };
  auto bwd = [&](uint64_t m) {
    auto g = BackwardStep(*(*first), m, act[m]);
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_FALSE(g->defined());  // first stage
  };
  fwd(1);
  fwd(2);
  bwd(1);
  fwd(3);
  bwd(2);
  bwd(3);
  StageStats s = (*first)->Stats();
  EXPECT_EQ(s.steps, 3);
  EXPECT_EQ(s.forwards, 3);
  EXPECT_EQ(s.analytic_delay, 1);
  EXPECT_DOUBLE_EQ(s.measured_delay, (0.0 + 1.0 + 1.0) / 3.0);
  auto after = (*first)->Parameters();
  for (size_t j = 0; j < before.size(); ++j) EXPECT_TRUE(torch::equal(before[j], after[j]));
  // A shape the first unit does not take is still refused.
  auto bad = (*first)->Forward(9, torch::zeros({kBatch, 5}), true);
  EXPECT_FALSE(bad.ok());
}

// ---------------------------------------------------------------------------
// Models with state and randomness, and language-model losses

v1::StageAssignment SequentialStage(const std::vector<v1::UnitSpec>& units,
                                    const std::vector<int64_t>& input_shape, bool tokens = false) {
  v1::ModelSpec m;
  m.set_type("sequential");
  for (const auto& u : units) *m.add_units() = u;
  v1::StageAssignment a = Assignment("gpipe", 0, 1, 0, static_cast<int>(units.size()), m, 1.0);
  for (int64_t d : input_shape) a.add_input_shape(d);
  a.set_token_input(tokens);
  return a;
}

v1::UnitSpec Layer(const std::string& type, int64_t out = 0) {
  v1::UnitSpec u;
  u.set_type(type);
  u.set_out(out);
  return u;
}

TEST(StageRuntimeModelTest, ARestoredStageDrawsTheDropoutMasksTheCutWouldHave) {
  v1::UnitSpec drop = Layer("dropout");
  drop.set_p(0.5);
  const v1::StageAssignment a =
      SequentialStage({Layer("linear", 8), drop, Layer("linear", 3)}, {4});
  // Inputs first: making them reseeds the generator.
  std::vector<torch::Tensor> x, y;
  for (int i = 0; i < 3; ++i) {
    x.push_back(Inputs(200 + i));
    y.push_back(Targets(300 + i, 3));
  }
  auto rt = MustCreate(a);
  ASSERT_NE(rt, nullptr);
  for (uint64_t m = 1; m <= 2; ++m) {
    ASSERT_TRUE(rt->ForwardLoss(m, x[m - 1], y[m - 1], true).ok());
    ASSERT_TRUE(BackwardStep(*rt, m, {}).ok());
  }
  const StageSnapshot cut = rt->Snapshot();
  auto next = rt->ForwardLoss(3, x[2], y[2], true);
  ASSERT_TRUE(next.ok());

  auto restored = MustCreate(a);
  ASSERT_NE(restored, nullptr);
  ASSERT_TRUE(restored->Restore(cut.units, 2).ok());
  auto again = restored->ForwardLoss(3, x[2], y[2], true);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->loss, next->loss) << "the same mask as the uninterrupted stage";

  // Without the generator's state the masks differ (the test can fail).
  std::vector<UnitState> without = cut.units;
  for (auto& u : without) {
    u.tensors.erase(std::remove_if(u.tensors.begin(), u.tensors.end(),
                                   [](const auto& t) { return t.first == "rng/state"; }),
                    u.tensors.end());
  }
  auto reseeded = MustCreate(a);
  ASSERT_NE(reseeded, nullptr);
  ASSERT_TRUE(reseeded->Restore(without, 2).ok());
  auto other = reseeded->ForwardLoss(3, x[2], y[2], true);
  ASSERT_TRUE(other.ok());
  EXPECT_NE(other->loss, next->loss);

  // A cut taken on a GPU holds the CUDA generator's state, which a CPU
  // generator cannot take: the CPU stage restores everything else and keeps
  // its generator as seeded (before, the restore failed).
  std::vector<UnitState> from_gpu = without;
  for (auto& u : from_gpu) {
    u.tensors.emplace_back("rng/cuda_state", torch::zeros({16}, torch::kUInt8));
  }
  auto on_cpu = MustCreate(a);
  ASSERT_NE(on_cpu, nullptr);
  const absl::Status restored_from_gpu = on_cpu->Restore(from_gpu, 2);
  EXPECT_TRUE(restored_from_gpu.ok()) << restored_from_gpu;
  EXPECT_EQ(RngKey(torch::Device(torch::kCPU)), "rng/state");
  EXPECT_EQ(RngKey(torch::Device(torch::kCUDA, 0)), "rng/cuda_state");
}

TEST(StageRuntimeModelTest, TheBackwardReplaysTheForwardsDropoutMask) {
  v1::UnitSpec drop = Layer("dropout");
  drop.set_p(0.5);
  const v1::StageAssignment a =
      SequentialStage({Layer("linear", 8), drop, Layer("linear", 3)}, {4});
  auto rt = MustCreate(a);
  ASSERT_NE(rt, nullptr);
  const auto before = Snapshot(rt->Parameters());
  torch::Tensor x = Inputs(5), y = Targets(6, 3);
  // The reference: the same weights, the same generator state, one plain
  // training step of plain LibTorch.
  auto reference = BuildUnits(a.model(), 0, 3, kSeed, TensorType{{4}, false});
  ASSERT_TRUE(reference.ok());
  torch::nn::Sequential ref = reference->module;
  auto gen = at::detail::getDefaultCPUGenerator();
  torch::Tensor state = gen.get_state();
  ASSERT_TRUE(rt->ForwardLoss(1, x, y, true).ok());
  // Another draw between the forward and its backward must not matter.
  torch::rand({100});
  ASSERT_TRUE(BackwardStep(*rt, 1, torch::Tensor()).ok());
  gen.set_state(state);
  ref->train();
  torch::nn::functional::cross_entropy(ref->forward(x), y).backward();
  const auto after = rt->Parameters();
  const auto ref_params = ref->parameters();
  for (size_t i = 0; i < after.size(); ++i) {
    EXPECT_TRUE(torch::allclose(before[i] - after[i], ref_params[i].grad(), 1e-5, 1e-6))
        << "parameter " << i;
  }
}

TEST(StageRuntimeModelTest, BatchNormUpdatesItsRunningStatsOncePerTrainingForward) {
  const v1::StageAssignment a =
      SequentialStage({Layer("batchnorm2d"), Layer("flatten"), Layer("linear", 2)}, {2, 3, 3});
  auto rt = MustCreate(a);
  ASSERT_NE(rt, nullptr);
  torch::manual_seed(7);
  torch::Tensor x = torch::randn({kBatch, 2, 3, 3}) + 1;
  ASSERT_TRUE(rt->ForwardLoss(1, x, Targets(8), true).ok());
  auto back = BackwardStep(*rt, 1, torch::Tensor());
  ASSERT_TRUE(back.ok()) << back.status();
  // momentum 0.1 from a running mean of 0: one update, not two.
  torch::Tensor running_mean;
  for (const auto& p : rt->Buffers()) {
    if (p.dim() == 1 && p.size(0) == 2 && p.scalar_type() == torch::kFloat) {
      running_mean = p;
      break;
    }
  }
  ASSERT_TRUE(running_mean.defined());
  EXPECT_TRUE(torch::allclose(running_mean, 0.1 * x.mean({0, 2, 3}), 1e-5, 1e-6))
      << running_mean << " vs " << 0.1 * x.mean({0, 2, 3});
  // Evaluation uses the running statistics (and changes nothing).
  auto eval = rt->ForwardLoss(2, x, Targets(8), false);
  ASSERT_TRUE(eval.ok());
  EXPECT_TRUE(torch::allclose(running_mean, 0.1 * x.mean({0, 2, 3}), 1e-5, 1e-6));
}

TEST(StageRuntimeModelTest, LanguageModelLossIsPerTokenAndCountsTokens) {
  v1::UnitSpec embed = Layer("embedding");
  embed.set_vocab(11);
  embed.set_dim(6);
  const v1::StageAssignment a = SequentialStage({embed, Layer("linear", 11)}, {7}, true);
  auto rt = MustCreate(a);
  ASSERT_NE(rt, nullptr);
  torch::manual_seed(9);
  torch::Tensor x = torch::randint(0, 11, {kBatch, 7}, torch::kLong);
  torch::Tensor y = (x + 1) % 11;  // learnable: the next id
  double first = 0;
  for (int i = 1; i <= 30; ++i) {
    auto r = rt->ForwardLoss(i, x, y, true);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->count, kBatch);
    EXPECT_EQ(r->predictions, kBatch * 7);
    if (i == 1) first = r->loss;
    if (i == 1) EXPECT_NEAR(first, std::log(11.0), 0.5) << "near uniform at the start";
    ASSERT_TRUE(BackwardStep(*rt, i, torch::Tensor()).ok());
  }
  auto last = rt->ForwardLoss(100, x, y, false);
  EXPECT_LT(last->loss, first * 0.7);
  // Targets that do not match the output are refused, not a crash.
  auto bad = rt->ForwardLoss(101, x, y.slice(1, 0, 3), false);
  EXPECT_THAT(bad.status().message(), HasSubstr("do not match the model's output"));
}

TEST(StageRuntimeModelTest, CreateRefusesAnInputShapeOutOfRange) {
  v1::StageAssignment a = SequentialStage({Layer("flatten"), Layer("linear", 2)}, {2, -3});
  EXPECT_THAT(StageRuntime::Create(a).status().message(), HasSubstr("input_shape"));
  a = SequentialStage({Layer("flatten"), Layer("linear", 2)}, {1 << 20, 1 << 20});
  EXPECT_THAT(StageRuntime::Create(a).status().message(), HasSubstr("input_shape"));
}

}  // namespace
}  // namespace pipemare
