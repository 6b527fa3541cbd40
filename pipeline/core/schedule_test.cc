#include "pipeline/core/schedule.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "pipeline/core/pipemare_math.h"

namespace pipemare {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

Plan MustBuild(const std::string& schedule, int P, int N, int64_t steps, int64_t warmup = 0) {
  PlanOptions o;
  auto kind = ParseScheduleKind(schedule);
  EXPECT_TRUE(kind.ok()) << kind.status();
  o.schedule = kind.value_or(ScheduleKind::kPipeMare);
  o.stages = P;
  o.microbatches_per_step = N;
  o.steps = steps;
  o.warmup_steps = warmup;
  auto plan = BuildPlan(o);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return plan.ok() ? *plan : Plan{};
}

// Golden plans: what the stage host does, written out.
TEST(BuildPlanTest, GPipeForwardsThenBackwardsThenSteps) {
  EXPECT_EQ(FormatPlan(MustBuild("gpipe", 2, 2, 2)),
            "stage 0: 0F1 0F2 0B1 0B2 0U1 0F3 0F4 0B3 0B4 0U2\n"
            "stage 1: 1F1 1F2 1B1 1B2 1U1 1F3 1F4 1B3 1B4 1U2\n");
}

TEST(BuildPlanTest, AsyncIsOneForwardOneBackwardWithFillAndCoolDown) {
  const std::string expected =
      "stage 0: 0F1 0F2 0F3 0B1 0U1 0F4 0B2 0U2 0B3 0U3 0B4 0U4\n"
      "stage 1: 1F1 1F2 1B1 1U1 1F3 1B2 1U2 1F4 1B3 1U3 1B4 1U4\n"
      "stage 2: 2F1 2B1 2U1 2F2 2B2 2U2 2F3 2B3 2U3 2F4 2B4 2U4\n";
  for (const char* s : {"pipemare", "pipedream", "async"}) {
    EXPECT_EQ(FormatPlan(MustBuild(s, 3, 1, 4)), expected) << s;
  }
}

TEST(BuildPlanTest, WarmupStepsAreSynchronousThenOneFOneB) {
  EXPECT_EQ(FormatPlan(MustBuild("pipemare", 2, 1, 4, /*warmup=*/2)),
            "stage 0: 0F1 0B1 0U1 0F2 0B2 0U2 0F3 0F4 0B3 0U3 0B4 0U4\n"
            "stage 1: 1F1 1B1 1U1 1F2 1B2 1U2 1F3 1B3 1U3 1F4 1B4 1U4\n");
  // A later epoch starting past the warm-up is all asynchronous.
  PlanOptions o{ScheduleKind::kPipeMare, 2, 1, 4, /*first_step=*/4, /*warmup_steps=*/2};
  EXPECT_EQ(FormatPlan(*BuildPlan(o)), FormatPlan(MustBuild("pipemare", 2, 1, 4)));
}

TEST(BuildPlanTest, BadOptionsNameTheField) {
  PlanOptions o{ScheduleKind::kPipeMare, 0, 1, 4};
  EXPECT_THAT(std::string(BuildPlan(o).status().message()), HasSubstr("schedule.stages"));
  // The schedule's name is checked where it is parsed, once.
  EXPECT_THAT(std::string(ParseScheduleKind("zero-bubble").status().message()),
              AllOf(HasSubstr("schedule.type"), HasSubstr("pipemare, gpipe, pipedream, async")));
  o = PlanOptions{ScheduleKind::kGPipe, 2, 0, 4};
  EXPECT_THAT(std::string(BuildPlan(o).status().message()),
              HasSubstr("schedule.microbatches_per_step"));
}

// Every schedule, P up to 8, N up to 4, with and without a warm-up: valid,
// and the delays the plan implies are the analytic τ_i.
TEST(BuildPlanTest, EveryPlanIsValidAndItsDelayIsTheAnalyticTau) {
  for (const char* s : {"gpipe", "pipemare", "pipedream", "async"}) {
    for (int P = 1; P <= 8; ++P) {
      for (int N = 1; N <= 4; ++N) {
        for (int64_t warmup : {0, 3}) {
          const Plan plan = MustBuild(s, P, N, 20, warmup);
          ASSERT_TRUE(ValidatePlan(plan).ok())
              << s << " P=" << P << " N=" << N << ": " << ValidatePlan(plan);
          const Prediction p = PredictPlan(plan);
          for (int i = 0; i < P; ++i) {
            const int tau = std::string(s) == "gpipe" ? 0 : AnalyticDelay(P, i, N);
            EXPECT_EQ(p.stages[i].max_delay, tau) << s << " P=" << P << " N=" << N << " i=" << i;
          }
        }
      }
    }
  }
}

TEST(PredictPlanTest, GPipeUtilizationIsTheBubbleFormula) {
  for (int P : {2, 4, 8, 16, 32}) {
    for (int N : {1, 4, 8}) {
      const Prediction p = PredictPlan(MustBuild("gpipe", P, N, 3));
      EXPECT_NEAR(p.mean_utilization, static_cast<double>(N) / (N + P - 1), 1e-12)
          << "P=" << P << " N=" << N;
    }
  }
}

TEST(PredictPlanTest, AsynchronousPipelinesHaveAlmostNoBubble) {
  // Fill and cool-down once per epoch: (P - 1) slots out of M + P - 1.
  const Prediction p = PredictPlan(MustBuild("pipemare", 8, 1, 1000));
  EXPECT_GT(p.mean_utilization, 0.98);
  const Prediction g = PredictPlan(MustBuild("gpipe", 8, 1, 1000));
  EXPECT_GT(p.mean_utilization / g.mean_utilization, 7.5) << "(N+P-1)/N = 8";
}

Plan Parse(int P, int N, const std::vector<std::vector<std::string>>& words) {
  Plan plan;
  plan.stages = P;
  plan.microbatches_per_step = N;
  plan.actions.resize(P);
  for (int i = 0; i < P; ++i) {
    for (const std::string& w : words[i]) {
      Action a;
      a.stage = w[0] - '0';
      a.op = w[1] == 'F'   ? Action::Op::kForward
             : w[1] == 'B' ? Action::Op::kBackward
                           : Action::Op::kUpdate;
      a.index = std::stoll(w.substr(2));
      plan.actions[i].push_back(a);
    }
  }
  return plan;
}

TEST(ValidatePlanTest, RefusesBrokenPlansNamingStageAndAction) {
  auto message = [](const Plan& p) { return std::string(ValidatePlan(p).message()); };
  EXPECT_THAT(message(Parse(1, 1, {{"0B1", "0F1", "0U1"}})),
              AllOf(HasSubstr("stage 0, action 1 (0B1)"), HasSubstr("before its forward")));
  EXPECT_THAT(message(Parse(1, 1, {{"0F1", "0F1"}})), HasSubstr("forwarded twice"));
  EXPECT_THAT(message(Parse(1, 2, {{"0F1", "0B1", "0U1"}})),
              AllOf(HasSubstr("action 3 (0U1)"), HasSubstr("each step takes 2")));
  EXPECT_THAT(message(Parse(1, 1, {{"0F1", "0B1"}})), HasSubstr("never followed by a step"));
  EXPECT_THAT(message(Parse(1, 1, {{"0F1"}})), HasSubstr("never backwarded"));
  EXPECT_THAT(
      message(Parse(2, 1, {{"0F1", "0B1", "0U1", "0F2", "0B2", "0U2"}, {"1F1", "1B1", "1U1"}})),
      HasSubstr("0F2 sends to stage 1, which never forwards microbatch 2"));
  // Stage 0 waits for 1B1; stage 1 wants 0F2 first.
  EXPECT_THAT(message(Parse(2, 1,
                            {{"0F1", "0B1", "0U1", "0F2", "0B2", "0U2"},
                             {"1F1", "1F2", "1B1", "1U1", "1B2", "1U2"}})),
              AllOf(HasSubstr("deadlocks"), HasSubstr("stage 0 at action 2 (0B1) waits for 1B1"),
                    HasSubstr("stage 1 at action 2 (1F2) waits for 0F2")));
  EXPECT_THAT(message(Parse(1, 1, {{"1F1"}})), HasSubstr("belongs to stage 1"));
}

}  // namespace
}  // namespace pipemare
