#include "pipeline/runtime/stage_executor.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

namespace pipemare {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kBatch = 4;

// Stage `stage` of the MLP [4, 3, 2] cut into `stages` stages (one unit each
// when P = 2), `steps` steps an epoch.
v1::StageAssignment Assignment(const std::string& schedule, int stage, int stages, int n,
                               int64_t steps) {
  v1::StageAssignment a;
  a.set_job_id("job");
  a.set_stage(stage);
  a.set_num_stages(stages);
  a.set_first_unit(stages == 1 ? 0 : stage);
  a.set_units(stages == 1 ? 2 : 1);
  a.mutable_model()->set_type("mlp");
  for (int64_t w : {4, 3, 2}) a.mutable_model()->add_layers(w);
  a.mutable_optimizer()->set_type("sgd");
  a.mutable_optimizer()->set_lr(0.1);
  a.mutable_schedule()->set_type(schedule);
  a.mutable_schedule()->set_stages(stages);
  a.mutable_schedule()->set_microbatch_size(kBatch);
  a.mutable_schedule()->set_microbatches_per_step(n);
  a.set_steps_per_epoch(steps);
  a.set_seed(3);
  return a;
}

struct Stage {
  std::unique_ptr<StageRuntime> runtime;
  std::optional<StageExecutor> executor;
};

Stage Make(const v1::StageAssignment& a) {
  Stage s;
  auto rt = StageRuntime::Create(a);
  EXPECT_TRUE(rt.ok()) << rt.status();
  s.runtime = std::move(*rt);
  auto ex = StageExecutor::Create(a, s.runtime.get());
  EXPECT_TRUE(ex.ok()) << ex.status();
  s.executor.emplace(std::move(*ex));
  return s;
}

torch::Tensor Targets() { return torch::randint(0, 2, {kBatch}, torch::kInt64); }

TEST(StageExecutorTest, OnlyThePlansUpdateSteps) {
  // One stage, N = 2: F1 B1 F2 B2 U1 (async 1F1B with P = 1).
  Stage s = Make(Assignment("async", 0, 1, 2, 1));
  StageExecutor& ex = *s.executor;
  EXPECT_TRUE(ex.between_epochs());
  ASSERT_TRUE(ex.Forward(1, torch::randn({kBatch, 4}), Targets()).ok());
  auto b1 = ex.RunLocal();  // the last stage's backward needs no input
  ASSERT_TRUE(b1.ok() && b1->has_value());
  EXPECT_EQ(FormatAction((*b1)->action), "0B1");
  auto none = ex.RunLocal();  // F2 waits for its input
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());
  EXPECT_EQ(s.runtime->Stats().steps, 0);
  EXPECT_EQ(s.runtime->backwards_since_step(), 1);
  ASSERT_TRUE(ex.Forward(2, torch::randn({kBatch, 4}), Targets()).ok());
  ASSERT_TRUE(ex.RunLocal().ok());  // B2
  EXPECT_EQ(s.runtime->Stats().steps, 0);
  auto u1 = ex.RunLocal();
  ASSERT_TRUE(u1.ok() && u1->has_value());
  EXPECT_EQ(FormatAction((*u1)->action), "0U1");
  EXPECT_EQ(s.runtime->Stats().steps, 1);
  EXPECT_TRUE(ex.between_epochs());
  // The next epoch's plan starts from the runtime's step count.
  EXPECT_EQ(FormatAction(ex.Peek().action), "0F1");
}

TEST(StageExecutorTest, RefusesWhatThePlanDoesNotSayNext) {
  // Stage 0 of 2, pipedream, N = 1, 2 steps: 0F1 0F2 0B1 0U1 0B2 0U2.
  Stage s = Make(Assignment("pipedream", 0, 2, 1, 2));
  StageExecutor& ex = *s.executor;
  auto f1 = ex.Forward(11, torch::randn({kBatch, 4}));
  ASSERT_TRUE(f1.ok()) << f1.status();
  EXPECT_EQ(f1->tensor.sizes(), (std::vector<int64_t>{kBatch, 3}));
  EXPECT_THAT(std::string(ex.Forward(11, torch::randn({kBatch, 4})).status().message()),
              HasSubstr("forwarded twice"));
  ASSERT_TRUE(ex.Forward(12, torch::randn({kBatch, 4})).ok());
  EXPECT_EQ(FormatAction(ex.Peek().action), "0B1");
  EXPECT_EQ(ex.Peek().microbatch, 11u);
  auto early = ex.Backward(12, torch::randn({kBatch, 3}));
  EXPECT_EQ(early.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(early.status().message()), HasSubstr("where its plan says 0B1"));
  auto eval = ex.Evaluate(99, torch::randn({kBatch, 4}));
  EXPECT_EQ(eval.status().code(), absl::StatusCode::kFailedPrecondition);
  auto b1 = ex.Backward(11, torch::randn({kBatch, 3}));
  ASSERT_TRUE(b1.ok()) << b1.status();
  EXPECT_FALSE(b1->tensor.defined());  // the first stage sends no gradient
  auto u1 = ex.RunLocal();
  ASSERT_TRUE(u1.ok() && u1->has_value());
  EXPECT_EQ(s.runtime->Stats().steps, 1);
}

TEST(StageExecutorTest, ADrainsCutIsTakenByTheStepItNames) {
  // One stage, async, N = 1, 3 steps an epoch, no periodic cuts: a cut
  // asked for at step 2 comes with U2 and holds U2's state, none before.
  Stage s = Make(Assignment("async", 0, 1, 1, 3));
  StageExecutor& ex = *s.executor;
  auto scheduled = ex.CutAt(2);
  ASSERT_TRUE(scheduled.ok()) << scheduled.status();
  EXPECT_EQ(*scheduled, nullptr) << "taken later, by U2";
  std::vector<std::shared_ptr<const StageSnapshot>> cuts;
  for (uint64_t m = 1; m <= 3; ++m) {
    ASSERT_TRUE(ex.Forward(m, torch::randn({kBatch, 4}), Targets()).ok());
    ASSERT_TRUE(ex.RunLocal().ok());  // B
    auto u = ex.RunLocal();
    ASSERT_TRUE(u.ok() && u->has_value());
    cuts.push_back((*u)->snapshot);
    if (m == 2) {
      // Past step 2 mid-epoch: too late for another cut there.
      ASSERT_TRUE(ex.Forward(3, torch::randn({kBatch, 4}), Targets()).ok());
      auto late = ex.CutAt(2);
      EXPECT_EQ(late.status().code(), absl::StatusCode::kFailedPrecondition);
      EXPECT_THAT(std::string(late.status().message()), HasSubstr("has applied 2 steps"));
      ASSERT_TRUE(ex.RunLocal().ok());  // B3
      ASSERT_TRUE(ex.RunLocal().ok());  // U3
      cuts.push_back(nullptr);
      break;
    }
  }
  ASSERT_EQ(cuts.size(), 3u);
  EXPECT_EQ(cuts[0], nullptr);
  ASSERT_NE(cuts[1], nullptr);
  EXPECT_EQ(cuts[1]->step, 2);
  // At the epoch's end, a cut at the step just applied is taken at once.
  ASSERT_TRUE(ex.between_epochs());
  auto now = ex.CutAt(3);
  ASSERT_TRUE(now.ok()) << now.status();
  ASSERT_NE(*now, nullptr);
  EXPECT_EQ((*now)->step, 3);
}

TEST(StageExecutorTest, TheRuntimeRefusesAStepWithoutItsBackwards) {
  Stage s = Make(Assignment("gpipe", 0, 1, 2, 1));
  auto st = s.runtime->Step();
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(st.message()), HasSubstr("a step after 0 backwards"));
}

TEST(StageExecutorTest, RefusesAnAssignmentWithoutAPlan) {
  v1::StageAssignment a = Assignment("gpipe", 0, 1, 1, 1);
  auto rt = StageRuntime::Create(a);
  ASSERT_TRUE(rt.ok());
  a.set_steps_per_epoch(0);
  EXPECT_THAT(std::string(StageExecutor::Create(a, rt->get()).status().message()),
              HasSubstr("steps_per_epoch"));
}

}  // namespace
}  // namespace pipemare
