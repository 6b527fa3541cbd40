// Exactness: the pipeline (PipelineHarness: the workers' stage runtimes,
// following their plans) against Replay, a one-process reading of the
// algorithm notes (../shared/docs/pipemare-algorithm.md, docs/algorithm.md)
// that shares no code with the runtime but the paper's formulas. float64,
// fixed seeds, relative tolerance 1e-6.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>
#include <set>
#include <string>

#include "pipeline/core/job_spec.h"
#include "pipeline/core/lr_schedule.h"
#include "pipeline/core/partition.h"
#include "pipeline/core/pipemare_math.h"
#include "pipeline/model/model.h"
#include "pipeline/runtime/harness.h"

namespace pipemare {
namespace {

// ---------------------------------------------------------------------------
// The replay. One epoch of M = K·N microbatches, in order. Stage i's weights
// have versions 0, 1, 2, ... (one per optimizer step); every stage has
// applied floor((m-1)/N) steps when the backward of microbatch m reaches it.
//   forward of m at stage i, at version:
//     synchronous (gpipe, warm-up steps):  floor((m-1)/N)
//     1F1B (pipemare, pipedream, async):   floor(b/N), b = the backwards the
//       stage has run before it: m0 + max(0, m - m0 - (P - i)), where m0 is
//       the number of synchronous microbatches before the 1F1B part
//   backward of m at stage i, at weights:
//     gpipe, async, warm-up:  the current ones
//     pipedream:              the forward's version
//     pipemare:               T2's u_bkwd = w - τ_i δ (the current w and δ)
//   after every N-th microbatch each stage steps: SGD with the base schedule,
//   times T1's τ_i^-(1 - min((k - W)/K, 1)) after the warm-up (pipemare);
//   then T2's δ follows the change of the weights. With
//   schedule.spike_compensation the replay steps by hand instead:
//   g = the summed gradient + weight decay · w, v ← m·v + g (v = g at the
//   first step), w ← w − α·(a·v + b·g) with a, b = SpikeCompensation(m, τ_i)
//   after the warm-up (a = 1, b = 0 before it: plain momentum). With
//   schedule.weight_prediction (steps by hand too) a 1F1B forward at version
//   t ≥ 1 runs at ŵ = w_t − τ_i·α_t·v_t instead: v_t the momentum after t
//   steps, α_t the rate of the step that made version t; pipedream's
//   backward then differentiates at that ŵ (the weights its forward used).
//   With schedule.delay_compensation λ0 (by hand too), after the warm-up
//   the summed gradient becomes DelayCompensatedGradient(g, τ_i·δ, ms, λ0)
//   before the step, ms ← β·ms + (1 − β)·g² (DcMeanSquareDecay) from g² at
//   the first, δ following the weights as T2's does (D =
//   schedule.discrepancy_decay, 0.1 unset).
struct ReplayStage {
  torch::nn::Sequential module;
  std::unique_ptr<torch::optim::SGD> sgd;
  std::vector<std::vector<torch::Tensor>> versions;           // weights after 0, 1, ... steps
  std::vector<torch::Tensor> velocity;                        // T2's δ
  std::vector<torch::Tensor> grad_sum;                        // this step's accumulated gradient
  std::vector<torch::Tensor> momentum;                        // v, when stepping by hand
  std::vector<torch::Tensor> mean_square;                     // delay compensation's ms
  std::vector<std::vector<torch::Tensor>> momentum_versions;  // v after 0, 1, ... steps
  std::vector<double> lr_versions;                            // α of the step that made each
  int tau = 0;
};

void Load(torch::nn::Sequential& module, const std::vector<torch::Tensor>& w) {
  torch::NoGradGuard no_grad;
  auto params = module->parameters();
  for (size_t j = 0; j < params.size(); ++j) params[j].copy_(w[j]);
}

// `skipped`: microbatches (1-based) dropped by train.on_nonfinite: skip,
// whose backward teaches no stage anything.
std::vector<std::vector<torch::Tensor>> Replay(const v1::JobSpec& spec, int64_t steps,
                                               const std::vector<torch::Tensor>& inputs,
                                               const std::vector<torch::Tensor>& targets,
                                               const std::set<int64_t>& skipped = {}) {
  const auto& s = spec.schedule();
  const std::string type = s.type();
  const int P = s.stages();
  const int64_t N = s.microbatches_per_step(), M = steps * N;
  const bool async = IsAsynchronous(*ParseScheduleKind(type));
  const bool two_bw = type == "pipedream_2bw";
  const int64_t W = async ? s.warmup_steps() : 0;
  const int64_t K = type == "pipemare" ? s.lr_anneal_steps() : 0;
  const bool t2 = type == "pipemare" && s.has_discrepancy_decay() && s.discrepancy_decay() >= 0;
  const bool spike = async && s.spike_compensation();
  const bool predict = async && s.weight_prediction();
  const double dc = async ? s.delay_compensation() : 0;
  const bool by_hand = spike || predict || dc > 0;
  const bool velocity = t2 || dc > 0;
  const double D =
      s.has_discrepancy_decay() && s.discrepancy_decay() >= 0 ? s.discrepancy_decay() : 0.1;
  const LrSchedule alpha = LrScheduleFromSpec(spec.optimizer(), steps * spec.train().epochs());
  auto ranges = *PartitionUniform(static_cast<int>(spec.model().layers_size()) - 1, P);

  std::vector<ReplayStage> stages(P);
  for (int i = 0; i < P; ++i) {
    ReplayStage& st = stages[i];
    st.module = BuildUnits(spec.model(), ranges[i].first_unit, ranges[i].units, spec.train().seed(),
                           TensorType{{spec.model().layers(ranges[i].first_unit)}, false})
                    ->module;
    st.module->to(torch::kFloat64);
    st.sgd = std::make_unique<torch::optim::SGD>(st.module->parameters(),
                                                 torch::optim::SGDOptions(spec.optimizer().lr())
                                                     .momentum(spec.optimizer().momentum())
                                                     .weight_decay(spec.optimizer().weight_decay())
                                                     .nesterov(spec.optimizer().nesterov()));
    std::vector<torch::Tensor> w0;
    for (const auto& p : st.module->parameters()) {
      w0.push_back(p.detach().clone());
      st.velocity.push_back(torch::zeros_like(p));
      st.grad_sum.push_back(torch::zeros_like(p));
    }
    st.versions.push_back(w0);
    st.momentum_versions.emplace_back();
    st.lr_versions.push_back(0);
    st.tau = async ? AnalyticDelay(P, i, static_cast<int>(N)) : 0;
  }
  const int64_t m0 = std::min(W * N, M);  // synchronous microbatches
  for (int64_t m = 1; m <= M; ++m) {
    const int64_t now = (m - 1) / N;  // steps applied before this backward
    const bool sync = !async || m <= m0;
    std::vector<int64_t> forward_version(P);
    // The weights each stage's forward ran at (pipedream's backward uses
    // exactly these: the stashed version, or its prediction).
    std::vector<std::vector<torch::Tensor>> forward_weights(P);
    std::vector<torch::Tensor> x(P + 1);
    x[0] = inputs[m - 1];
    for (int i = 0; i < P; ++i) {
      const int64_t b = sync ? m - 1 : m0 + std::max<int64_t>(0, m - m0 - (P - i));
      // pipedream_2bw: step s's microbatches run at W(s-1) on every stage.
      forward_version[i] = sync ? now : two_bw ? std::max<int64_t>(now - 1, 0) : b / N;
      const int64_t t = forward_version[i];
      ReplayStage& st = stages[i];
      if (predict && !sync && st.tau > 0 && t >= std::max<int64_t>(W, 1)) {
        std::vector<torch::Tensor> predicted;
        for (size_t j = 0; j < st.versions[t].size(); ++j) {
          predicted.push_back(PredictedWeights(st.versions[t][j], st.momentum_versions[t][j],
                                               st.lr_versions[t], st.tau));
        }
        forward_weights[i] = predicted;
      } else {
        forward_weights[i] = st.versions[t];
      }
      Load(st.module, forward_weights[i]);
      torch::NoGradGuard no_grad;
      x[i + 1] = stages[i].module->forward(x[i]);
    }
    torch::Tensor g;
    for (int i = skipped.count(m) ? -1 : P - 1; i >= 0; --i) {
      ReplayStage& st = stages[i];
      std::vector<torch::Tensor> u = st.versions[now];
      if (!sync && (type == "pipedream" || two_bw)) u = forward_weights[i];
      if (!sync && t2 && st.tau >= 1) {
        for (size_t j = 0; j < u.size(); ++j) {
          u[j] = T2BackwardWeights(st.versions[now][j], st.velocity[j], st.tau);
        }
      }
      Load(st.module, u);
      st.module->zero_grad();
      torch::Tensor xi = x[i].detach().requires_grad_(i > 0);
      torch::Tensor out = st.module->forward(xi);
      if (i == P - 1) {
        (torch::nn::functional::cross_entropy(out, targets[m - 1]) / static_cast<double>(N))
            .backward();
      } else {
        out.backward(g);
      }
      auto params = st.module->parameters();
      for (size_t j = 0; j < params.size(); ++j) st.grad_sum[j] += params[j].grad();
      if (i > 0) g = xi.grad();
    }
    if (m % N != 0) continue;
    const int64_t k = now;  // the step being applied
    for (ReplayStage& st : stages) {
      const double a = BaseLearningRate(alpha, k);
      const double lr = k < W ? a : T1LearningRate(a, k - W, K, st.tau);
      for (auto& group : st.sgd->param_groups()) group.options().set_lr(lr);
      Load(st.module, st.versions.back());
      auto params = st.module->parameters();
      for (size_t j = 0; j < params.size(); ++j) {
        params[j].mutable_grad() = st.grad_sum[j].clone();
        st.grad_sum[j].zero_();
      }
      if (by_hand) {
        const double m_ = spec.optimizer().momentum();
        const SpikeCoefficients c =
            k < W || !spike ? SpikeCoefficients{} : SpikeCompensation(m_, st.tau);
        torch::NoGradGuard no_grad;
        for (size_t j = 0; j < params.size(); ++j) {
          torch::Tensor loss_grad = params[j].grad();
          if (dc > 0 && k >= W && st.tau > 0) {
            const torch::Tensor g2 = loss_grad * loss_grad;
            const double beta = DcMeanSquareDecay();
            if (st.mean_square.size() <= j) st.mean_square.push_back(g2.clone());
            st.mean_square[j] = beta * st.mean_square[j] + (1 - beta) * g2;
            loss_grad =
                DelayCompensatedGradient(loss_grad, st.tau * st.velocity[j], st.mean_square[j], dc);
          }
          const torch::Tensor g = loss_grad + spec.optimizer().weight_decay() * params[j].detach();
          if (st.momentum.size() <= j) {
            st.momentum.push_back(g.clone());
          } else {
            st.momentum[j] = m_ * st.momentum[j] + g;
          }
          params[j].sub_(lr * SpikeCompensatedDirection(st.momentum[j], g, c));
        }
      } else {
        st.sgd->step();
      }
      std::vector<torch::Tensor> w;
      st.lr_versions.push_back(lr);
      st.momentum_versions.emplace_back();
      for (size_t j = 0; j < st.momentum.size(); ++j) {
        st.momentum_versions.back().push_back(st.momentum[j].clone());
      }
      for (size_t j = 0; j < params.size(); ++j) {
        w.push_back(params[j].detach().clone());
        if (velocity) {
          st.velocity[j] =
              T2Velocity(st.velocity[j], w[j], st.versions.back()[j], T2Gamma(D, st.tau));
        }
      }
      st.versions.push_back(w);
    }
  }
  std::vector<std::vector<torch::Tensor>> out;
  for (auto& st : stages) out.push_back(st.versions.back());
  return out;
}

// ---------------------------------------------------------------------------

constexpr int64_t kSteps = 12;
constexpr int64_t kBatch = 4;

v1::JobSpec Spec(const std::string& type, int P, int N) {
  v1::JobSpec spec;
  spec.set_name("exact");
  auto* m = spec.mutable_model();
  m->set_type("mlp");
  for (int w : {6, 5, 5, 4, 4, 3}) m->add_layers(w);  // 5 units
  m->set_activation("tanh");
  spec.mutable_data()->set_type("mnist");
  spec.mutable_data()->set_path("unused");
  auto* o = spec.mutable_optimizer();
  o->set_type("sgd");
  o->set_lr(0.2);
  o->set_momentum(0.9);  // optimizer state in play
  o->set_lr_schedule("cosine");
  auto* s = spec.mutable_schedule();
  s->set_type(type);
  s->set_stages(P);
  s->set_microbatch_size(kBatch);
  s->set_microbatches_per_step(N);
  s->set_lr_anneal_steps(8);
  s->set_discrepancy_decay(0.1);
  spec.mutable_train()->set_epochs(1);
  spec.mutable_train()->set_seed(7);
  return spec;
}

struct Data {
  std::vector<torch::Tensor> inputs, targets;
};
Data MakeData(int64_t microbatches) {
  Data d;
  torch::manual_seed(2021);
  for (int64_t m = 0; m < microbatches; ++m) {
    d.inputs.push_back(torch::randn({kBatch, 6}, torch::kFloat64));
    d.targets.push_back(torch::randint(0, 3, {kBatch}, torch::kInt64));
  }
  return d;
}

std::vector<std::vector<torch::Tensor>> HarnessWeights(PipelineHarness& h) {
  std::vector<std::vector<torch::Tensor>> out;
  for (int i = 0; i < h.stages(); ++i) {
    std::vector<torch::Tensor> w;
    for (const auto& p : h.stage(i).Parameters()) w.push_back(p.detach().clone());
    out.push_back(w);
  }
  return out;
}

std::vector<torch::Tensor> Flatten(const std::vector<std::vector<torch::Tensor>>& stages) {
  std::vector<torch::Tensor> all;
  for (const auto& s : stages) all.insert(all.end(), s.begin(), s.end());
  return all;
}

void ExpectClose(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t j = 0; j < a.size(); ++j) {
    EXPECT_TRUE(torch::allclose(a[j], b[j], /*rtol=*/1e-6, /*atol=*/1e-12))
        << "tensor " << j << " max diff " << (a[j] - b[j]).abs().max().item<double>();
  }
}

// Trains one epoch of `spec` through the harness; checks it against the
// replay, and that its weights moved (a test that cannot pass vacuously).
void ExpectHarnessEqualsReplay(const v1::JobSpec& spec) {
  const int64_t M = kSteps * spec.schedule().microbatches_per_step();
  const Data d = MakeData(M);
  auto h = PipelineHarness::Create(spec, kSteps, torch::kFloat64);
  ASSERT_TRUE(h.ok()) << h.status();
  const auto before = Flatten(HarnessWeights(**h));
  auto losses = (*h)->TrainEpoch(d.inputs, d.targets);
  ASSERT_TRUE(losses.ok()) << losses.status();
  const auto after = Flatten(HarnessWeights(**h));
  EXPECT_GT((after[0] - before[0]).abs().max().item<double>(), 1e-3);
  ExpectClose(after, Flatten(Replay(spec, kSteps, d.inputs, d.targets)));
}

TEST(ExactnessTest, GPipeAcrossStagesEqualsTheUnpartitionedModel) {
  for (int N : {1, 3}) {
    SCOPED_TRACE(::testing::Message() << "N=" << N);
    const Data d = MakeData(kSteps * N);
    auto whole = PipelineHarness::Create(Spec("gpipe", 1, N), kSteps, torch::kFloat64);
    auto cut = PipelineHarness::Create(Spec("gpipe", 5, N), kSteps, torch::kFloat64);
    ASSERT_TRUE(whole.ok() && cut.ok());
    ExpectClose(Flatten(HarnessWeights(**cut)), Flatten(HarnessWeights(**whole)));  // at start
    ASSERT_TRUE((*whole)->TrainEpoch(d.inputs, d.targets).ok());
    ASSERT_TRUE((*cut)->TrainEpoch(d.inputs, d.targets).ok());
    ExpectClose(Flatten(HarnessWeights(**cut)), Flatten(HarnessWeights(**whole)));
    ExpectHarnessEqualsReplay(Spec("gpipe", 5, N));
  }
}

TEST(ExactnessTest, PipeDreamEqualsItsReplayAndEveryBackwardUsedItsStash) {
  for (int N : {1, 2}) {
    SCOPED_TRACE(::testing::Message() << "N=" << N);
    ExpectHarnessEqualsReplay(Spec("pipedream", 5, N));
  }
  // Version ids: each backward differentiated at the version its forward saw.
  const v1::JobSpec spec = Spec("pipedream", 5, 1);
  const Data d = MakeData(kSteps);
  auto h = PipelineHarness::Create(spec, kSteps, torch::kFloat64);
  ASSERT_TRUE(h.ok());
  std::vector<std::map<int64_t, int64_t>> forward_version(5);
  ASSERT_TRUE(
      (*h)->TrainEpoch(d.inputs, d.targets,
                       [&](const Action& a) {
                         const StageStats st = (*h)->stage(a.stage).Stats();
                         if (a.op == Action::Op::kForward) {
                           forward_version[a.stage][a.index] = st.steps;
                         } else if (a.op == Action::Op::kBackward) {
                           EXPECT_EQ(st.last_backward_version, forward_version[a.stage][a.index])
                               << FormatAction(a);
                         }
                       })
          .ok());
}

// Every stage's weights after each of its steps, as the harness trains one
// epoch of `spec` on `d`.
std::map<std::pair<int, int64_t>, std::vector<torch::Tensor>> WeightsAfterEveryStep(
    const v1::JobSpec& spec, const Data& d) {
  std::map<std::pair<int, int64_t>, std::vector<torch::Tensor>> out;
  auto h = PipelineHarness::Create(spec, kSteps, torch::kFloat64);
  EXPECT_TRUE(h.ok()) << h.status();
  if (!h.ok()) return out;
  auto losses = (*h)->TrainEpoch(d.inputs, d.targets, [&](const Action& a) {
    if (a.op != Action::Op::kUpdate) return;
    auto& w = out[{a.stage, a.index}];
    for (const auto& p : (*h)->stage(a.stage).Parameters()) w.push_back(p.detach().clone());
  });
  EXPECT_TRUE(losses.ok()) << losses.status();
  return out;
}

// 1f1b and zero_bubble change only the order of gpipe's forwards and
// backwards within a step (and split zero_bubble's into B and W): the same
// model after every step, bit for bit, with the forward's graph kept or
// recomputed.
TEST(ExactnessTest, OneFOneBAndZeroBubbleAreBitIdenticalToGPipeWithAndWithoutRecompute) {
  for (int N : {1, 3}) {
    const Data d = MakeData(kSteps * N);
    v1::JobSpec reference = Spec("gpipe", 5, N);
    reference.mutable_schedule()->set_recompute(true);  // gpipe as it always ran
    const auto expected = WeightsAfterEveryStep(reference, d);
    ASSERT_EQ(expected.size(), 5u * kSteps);
    for (const char* type : {"gpipe", "1f1b", "zero_bubble"}) {
      for (bool recompute : {false, true}) {
        SCOPED_TRACE(::testing::Message() << type << " N=" << N << " recompute=" << recompute);
        v1::JobSpec spec = Spec(type, 5, N);
        spec.mutable_schedule()->set_recompute(recompute);
        const auto got = WeightsAfterEveryStep(spec, d);
        ASSERT_EQ(got.size(), expected.size());
        for (const auto& [key, w] : expected) {
          const auto& g = got.at(key);
          ASSERT_EQ(g.size(), w.size());
          for (size_t j = 0; j < w.size(); ++j) {
            ASSERT_TRUE(torch::equal(g[j], w[j]))
                << "stage " << key.first << " step " << key.second << " tensor " << j
                << " differs by " << (g[j] - w[j]).abs().max().item<double>();
          }
        }
      }
    }
  }
}

// pipedream keeps the forward's graph by default (on a copy of the stage at
// the stashed version) and recomputes with schedule.recompute: both are its
// replay; pipedream_2bw the same, every stage one version behind.
TEST(ExactnessTest, PipeDreamAndPipeDream2BWEqualTheirReplaysKeptOrRecomputed) {
  for (const char* type : {"pipedream", "pipedream_2bw"}) {
    for (int N : {4, 5}) {
      for (bool recompute : {false, true}) {
        SCOPED_TRACE(::testing::Message() << type << " N=" << N << " recompute=" << recompute);
        v1::JobSpec spec = Spec(type, 5, N);
        spec.mutable_schedule()->set_recompute(recompute);
        ExpectHarnessEqualsReplay(spec);
      }
    }
  }
  // With a warm-up: synchronous first, then one version behind.
  v1::JobSpec spec = Spec("pipedream_2bw", 5, 4);
  spec.mutable_schedule()->set_warmup_steps(3);
  ExpectHarnessEqualsReplay(spec);
}

TEST(ExactnessTest, PipeDream2BWRunsEveryMicrobatchOneVersionBehindWithTwoVersions) {
  for (bool recompute : {false, true}) {
    SCOPED_TRACE(::testing::Message() << "recompute=" << recompute);
    v1::JobSpec spec = Spec("pipedream_2bw", 5, 4);
    spec.mutable_schedule()->set_recompute(recompute);
    const Data d = MakeData(kSteps * 4);
    auto h = PipelineHarness::Create(spec, kSteps, torch::kFloat64);
    ASSERT_TRUE(h.ok());
    int checked = 0;
    ASSERT_TRUE(
        (*h)->TrainEpoch(d.inputs, d.targets,
                         [&](const Action& a) {
                           if (a.op != Action::Op::kBackward) return;
                           const StageStats st = (*h)->stage(a.stage).Stats();
                           // Microbatch m (1-based) is in step (m-1)/N.
                           const int64_t step = (a.index - 1) / 4;
                           EXPECT_EQ(st.last_backward_version, std::max<int64_t>(step - 1, 0))
                               << FormatAction(a);
                           // Recomputing: the live weights and one stashed
                           // version. Keeping graphs: copies of the stage at
                           // the two versions in flight.
                           EXPECT_LE(st.memory.stash, st.memory.weights * (recompute ? 1 : 2))
                               << FormatAction(a);
                           ++checked;
                         })
            .ok());
    EXPECT_EQ(checked, 5 * kSteps * 4);
    EXPECT_EQ((*h)->stage(0).Stats().analytic_delay, 1);
  }
}

TEST(ExactnessTest, AsyncAndPipeMareEqualTheirReplays) {
  for (const char* type : {"async", "pipemare"}) {
    for (int N : {1, 2}) {
      SCOPED_TRACE(::testing::Message() << type << " N=" << N);
      ExpectHarnessEqualsReplay(Spec(type, 5, N));
    }
  }
}

TEST(ExactnessTest, SpikeCompensationEqualsItsReplayOnEveryAsynchronousSchedule) {
  for (const char* type : {"async", "pipedream", "pipemare"}) {
    for (int N : {1, 2}) {
      SCOPED_TRACE(::testing::Message() << type << " N=" << N);
      v1::JobSpec spec = Spec(type, 5, N);
      spec.mutable_schedule()->set_spike_compensation(true);
      spec.mutable_optimizer()->set_weight_decay(0.01);
      ExpectHarnessEqualsReplay(spec);
    }
  }
  v1::JobSpec warm = Spec("pipemare", 5, 1);
  warm.mutable_schedule()->set_spike_compensation(true);
  warm.mutable_schedule()->set_warmup_steps(4);
  ExpectHarnessEqualsReplay(warm);
}

TEST(ExactnessTest, WeightPredictionEqualsItsReplayAloneAndWithSpikeCompensation) {
  for (const char* type : {"async", "pipedream", "pipemare"}) {
    for (int N : {1, 2}) {
      for (bool spike : {false, true}) {
        SCOPED_TRACE(::testing::Message() << type << " N=" << N << " spike " << spike);
        v1::JobSpec spec = Spec(type, 5, N);
        spec.mutable_schedule()->clear_discrepancy_decay();  // T2 and prediction: one or the other
        spec.mutable_schedule()->set_weight_prediction(true);
        spec.mutable_schedule()->set_spike_compensation(spike);
        ExpectHarnessEqualsReplay(spec);
      }
    }
  }
  v1::JobSpec warm = Spec("async", 5, 1);
  warm.mutable_schedule()->set_weight_prediction(true);
  warm.mutable_schedule()->set_warmup_steps(4);
  ExpectHarnessEqualsReplay(warm);
}

TEST(ExactnessTest, DelayCompensationEqualsItsReplayAloneAndWithSpikeCompensation) {
  for (const char* type : {"async", "pipedream", "pipemare"}) {
    for (int N : {1, 2}) {
      for (bool spike : {false, true}) {
        SCOPED_TRACE(::testing::Message() << type << " N=" << N << " spike " << spike);
        v1::JobSpec spec = Spec(type, 5, N);
        spec.mutable_schedule()->set_delay_compensation(2);
        spec.mutable_schedule()->set_spike_compensation(spike);
        spec.mutable_optimizer()->set_weight_decay(0.01);
        ExpectHarnessEqualsReplay(spec);
      }
    }
  }
  // The correction is not negligible here: it moves the result well past the
  // tolerance.
  {
    v1::JobSpec on = Spec("async", 5, 1), off = Spec("async", 5, 1);
    on.mutable_schedule()->set_delay_compensation(2);
    const Data d = MakeData(kSteps);
    const auto a = Flatten(Replay(on, kSteps, d.inputs, d.targets));
    const auto b = Flatten(Replay(off, kSteps, d.inputs, d.targets));
    EXPECT_GT((a[0] - b[0]).abs().max().item<double>(), 1e-4);
  }
  v1::JobSpec warm = Spec("async", 5, 1);
  warm.mutable_schedule()->clear_discrepancy_decay();  // δ with D = 0.1
  warm.mutable_schedule()->set_delay_compensation(0.5);
  warm.mutable_schedule()->set_warmup_steps(4);
  ExpectHarnessEqualsReplay(warm);
}

TEST(ExactnessTest, PipeMareWithWarmupEqualsItsReplay) {
  v1::JobSpec spec = Spec("pipemare", 5, 1);
  spec.mutable_schedule()->set_warmup_steps(4);
  ExpectHarnessEqualsReplay(spec);
}

TEST(ExactnessTest, MeasuredDelayIsTheAnalyticTauInSteadyState) {
  for (const char* type : {"async", "pipemare", "pipedream"}) {
    const v1::JobSpec spec = Spec(type, 5, 1);
    const Data d = MakeData(kSteps);
    auto h = PipelineHarness::Create(spec, kSteps, torch::kFloat64);
    ASSERT_TRUE(h.ok());
    int checked = 0;
    ASSERT_TRUE(
        (*h)->TrainEpoch(
                d.inputs, d.targets,
                [&](const Action& a) {
                  // Steady state: past the fill, before the cool-down.
                  if (a.op != Action::Op::kBackward || a.index < 5 || a.index > kSteps - 5) {
                    return;
                  }
                  EXPECT_EQ((*h)->stage(a.stage).Stats().last_delay, AnalyticDelay(5, a.stage, 1))
                      << type << " " << FormatAction(a);
                  ++checked;
                })
            .ok());
    EXPECT_EQ(checked, 5 * (kSteps - 9));  // backwards 5..kSteps-5 on every stage
  }
}

// Resume: "k steps, checkpoint, restore into fresh stages, the rest" against
// the same job uninterrupted. The cut is taken by the executors as the
// workers take it (checkpoint.every_steps), mid-epoch.
struct Resumed {
  std::vector<double> uninterrupted, resumed;  // losses of microbatches k·N+1..M
  std::vector<torch::Tensor> weights_uninterrupted, weights_resumed;
};
// `requested`: the cut is the coordinator's (a drain's CutAt through the
// stage machines) instead of checkpoint.every_steps.
Resumed ResumeAt(v1::JobSpec spec, int64_t k, int resumed_stages, bool requested = false) {
  Resumed r;
  if (!requested) spec.mutable_checkpoint()->set_every_steps(k);
  const int64_t N = spec.schedule().microbatches_per_step();
  const Data d = MakeData(kSteps * N);
  auto whole = PipelineHarness::Create(spec, kSteps, torch::kFloat64);
  EXPECT_TRUE(whole.ok()) << whole.status();
  if (requested) {
    auto st = (*whole)->RequestCut(k);
    EXPECT_TRUE(st.ok()) << st;
  }
  auto losses = (*whole)->TrainEpoch(d.inputs, d.targets);
  EXPECT_TRUE(losses.ok()) << losses.status();
  const std::vector<UnitState> cut = (*whole)->Cut(k);
  EXPECT_EQ(cut.size(), 5u) << "every unit of the cut after step " << k;
  // Fresh stages (possibly another P) restored from the cut.
  spec.mutable_schedule()->set_stages(resumed_stages);
  auto again = PipelineHarness::Create(spec, kSteps, torch::kFloat64);
  EXPECT_TRUE(again.ok()) << again.status();
  for (int i = 0; i < (*again)->stages(); ++i) {
    auto st = (*again)->stage(i).Restore(cut, k);
    EXPECT_TRUE(st.ok()) << st;
  }
  const std::vector<torch::Tensor> rest_in(d.inputs.begin() + k * N, d.inputs.end());
  const std::vector<torch::Tensor> rest_t(d.targets.begin() + k * N, d.targets.end());
  auto rest = (*again)->TrainEpoch(rest_in, rest_t);
  EXPECT_TRUE(rest.ok()) << rest.status();
  r.uninterrupted.assign(losses->begin() + k * N, losses->end());
  r.resumed = *rest;
  r.weights_uninterrupted = Flatten(HarnessWeights(**whole));
  r.weights_resumed = Flatten(HarnessWeights(**again));
  EXPECT_EQ((*again)->stage(0).Stats().steps, kSteps);
  return r;
}

TEST(ResumeTest, GPipeResumedFromACutIsBitIdenticalToTheUninterruptedRun) {
  for (int N : {1, 3}) {
    SCOPED_TRACE(::testing::Message() << "N=" << N);
    Resumed r = ResumeAt(Spec("gpipe", 5, N), 5, 5);
    ASSERT_EQ(r.weights_resumed.size(), r.weights_uninterrupted.size());
    for (size_t j = 0; j < r.weights_resumed.size(); ++j) {
      EXPECT_TRUE(torch::equal(r.weights_resumed[j], r.weights_uninterrupted[j])) << "tensor " << j;
    }
    EXPECT_EQ(r.resumed, r.uninterrupted);
  }
}

TEST(ResumeTest, ACutAskedOfTheStageMachinesIsTakenAtItsStepAndResumesBitIdentically) {
  Resumed r = ResumeAt(Spec("gpipe", 3, 2), 7, 3, /*requested=*/true);
  ASSERT_EQ(r.weights_resumed.size(), r.weights_uninterrupted.size());
  for (size_t j = 0; j < r.weights_resumed.size(); ++j) {
    EXPECT_TRUE(torch::equal(r.weights_resumed[j], r.weights_uninterrupted[j])) << "tensor " << j;
  }
  EXPECT_EQ(r.resumed, r.uninterrupted);
}

TEST(ExactnessTest, ASkippedMicrobatchTeachesNoStageAndTheRestEqualsTheReplay) {
  // train.on_nonfinite: skip, through the stage machines: a NaN in
  // microbatch 5's input is caught at stage 0, which drops it and passes
  // zeros on flagged; every stage's backward of it then teaches nothing.
  for (const char* type : {"gpipe", "pipemare"}) {
    SCOPED_TRACE(type);
    v1::JobSpec spec = Spec(type, 3, 2);
    spec.mutable_train()->set_on_nonfinite("skip");
    Data d = MakeData(kSteps * 2);
    d.inputs[4] = d.inputs[4].clone();
    d.inputs[4][1][2] = std::numeric_limits<double>::quiet_NaN();
    auto h = PipelineHarness::Create(spec, kSteps, torch::kFloat64);
    ASSERT_TRUE(h.ok()) << h.status();
    auto losses = (*h)->TrainEpoch(d.inputs, d.targets);
    ASSERT_TRUE(losses.ok()) << losses.status();
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ((*h)->stage(i).Stats().steps, kSteps);
    }
    const auto after = Flatten(HarnessWeights(**h));
    for (const auto& w : after) ASSERT_TRUE(torch::isfinite(w).all().item<bool>());
    ExpectClose(after, Flatten(Replay(spec, kSteps, d.inputs, d.targets, {5})));
    // Not a run that learned from it as zeros (zeros in, a real gradient out).
    std::vector<torch::Tensor> zeroed = d.inputs;
    zeroed[4] = torch::zeros_like(zeroed[4]);
    const auto learned = Flatten(Replay(spec, kSteps, zeroed, d.targets));
    EXPECT_GT((after[0] - learned[0]).abs().max().item<double>(), 0);
    // Under fail the same input stops the epoch, naming microbatch and step.
    spec.mutable_train()->set_on_nonfinite("fail");
    auto strict = PipelineHarness::Create(spec, kSteps, torch::kFloat64);
    ASSERT_TRUE(strict.ok()) << strict.status();
    auto failed = (*strict)->TrainEpoch(d.inputs, d.targets);
    ASSERT_FALSE(failed.ok());
    EXPECT_EQ(failed.status().code(), absl::StatusCode::kFailedPrecondition) << failed.status();
    EXPECT_THAT(std::string(failed.status().message()),
                ::testing::HasSubstr("NaN or Inf in the activation of microbatch 5"));
  }
}

TEST(ResumeTest, AsynchronousSchedulesResumeWithinToleranceAtTheFirstStepAfterTheCut) {
  for (const char* type : {"pipedream", "async", "pipemare"}) {
    for (int64_t warmup : {0, 7}) {  // a cut before T3's switch, too
      SCOPED_TRACE(::testing::Message() << type << " warm-up " << warmup);
      v1::JobSpec spec = Spec(type, 5, 2);
      spec.mutable_schedule()->set_warmup_steps(warmup);
      // The resumed forwards of microbatches after the cut run at w_k where
      // the uninterrupted 1F1B ran them at up to τ_0 older versions, so the
      // gap scales with one step's change of the weights: 0.8% at this
      // spec's lr 0.2 with momentum 0.9, within 1e-3 at a training-sized
      // step (lr 0.02 here; the examples use 0.03 on far larger models).
      spec.mutable_optimizer()->set_lr(0.02);
      Resumed r = ResumeAt(spec, 5, 5);
      ASSERT_EQ(r.resumed.size(), r.uninterrupted.size());
      // Microbatch k·N+1: the uninterrupted run forwarded it (stage 0) at
      // an older weight version than the cut's; the resumed run at the cut.
      EXPECT_NEAR(r.resumed[0], r.uninterrupted[0], 1e-3 * std::abs(r.uninterrupted[0]));
    }
  }
}

TEST(ResumeTest, DelayCompensationsStateIsInTheCutAndResumes) {
  v1::JobSpec spec = Spec("async", 5, 2);  // as the resume test above
  spec.mutable_schedule()->set_delay_compensation(2);
  spec.mutable_optimizer()->set_lr(0.02);
  spec.mutable_checkpoint()->set_every_steps(5);
  const Data d = MakeData(kSteps * 2);
  auto h = PipelineHarness::Create(spec, kSteps, torch::kFloat64);
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_TRUE((*h)->TrainEpoch(d.inputs, d.targets).ok());
  // Units 0..3 sit on stages with τ > 0 (P = 5, one unit each): δ and ms.
  for (const UnitState& u : (*h)->Cut(5)) {
    size_t params = 0, velocity = 0, mean_square = 0;
    for (const auto& [key, tensor] : u.tensors) {
      params += key.rfind("param/", 0) == 0;
      velocity += key.rfind("t2/", 0) == 0;
      mean_square += key.rfind("dc/", 0) == 0;
    }
    EXPECT_GT(params, 0u);
    EXPECT_EQ(velocity, u.unit < 4 ? params : 0) << "unit " << u.unit;
    EXPECT_EQ(mean_square, u.unit < 4 ? params : 0) << "unit " << u.unit;
  }
  Resumed r = ResumeAt(spec, 5, 5);
  ASSERT_FALSE(r.resumed.empty());
  EXPECT_NEAR(r.resumed[0], r.uninterrupted[0], 1e-3 * std::abs(r.uninterrupted[0]));
}

TEST(ResumeTest, ACutLoadsIntoAnotherNumberOfStages) {
  // Units are the checkpoint's grain: 5 stages cut, 2 stages resumed. With
  // gpipe the result cannot depend on the partition at all.
  Resumed r = ResumeAt(Spec("gpipe", 5, 2), 6, 2);
  ExpectClose(r.weights_resumed, r.weights_uninterrupted);
}

TEST(ExactnessTest, HarnessRefusesTheWrongNumberOfMicrobatches) {
  auto h = PipelineHarness::Create(Spec("pipemare", 2, 1), kSteps, torch::kFloat64);
  ASSERT_TRUE(h.ok());
  const Data d = MakeData(3);
  auto r = (*h)->TrainEpoch(d.inputs, d.targets);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), ::testing::HasSubstr("an epoch takes 12"));
}

}  // namespace
}  // namespace pipemare
