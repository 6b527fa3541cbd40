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
              AllOf(HasSubstr("schedule.type"),
                    HasSubstr("pipemare, gpipe, 1f1b, zero_bubble, pipedream, pipedream_2bw, "
                              "async")));
  o = PlanOptions{ScheduleKind::kGPipe, 2, 0, 4};
  EXPECT_THAT(std::string(BuildPlan(o).status().message()),
              HasSubstr("schedule.microbatches_per_step"));
}

// Every schedule, P up to 8, N up to 4, with and without a warm-up: valid,
// and the delays the plan implies are the analytic τ_i.
TEST(BuildPlanTest, EveryPlanIsValidAndItsDelayIsTheAnalyticTau) {
  for (const char* s :
       {"gpipe", "1f1b", "zero_bubble", "pipemare", "pipedream", "pipedream_2bw", "async"}) {
    const bool sync = !IsAsynchronous(*ParseScheduleKind(s));
    for (int P = 1; P <= 8; ++P) {
      for (int N = 1; N <= 4; ++N) {
        for (int64_t warmup : {0, 3}) {
          const Plan plan = MustBuild(s, P, N, 20, warmup);
          ASSERT_TRUE(ValidatePlan(plan).ok())
              << s << " P=" << P << " N=" << N << ": " << ValidatePlan(plan);
          const Prediction p = PredictPlan(plan);
          for (int i = 0; i < P; ++i) {
            const int tau = sync ? 0 : AnalyticDelay(P, i, N);
            EXPECT_EQ(p.stages[i].max_delay, tau) << s << " P=" << P << " N=" << N << " i=" << i;
          }
        }
      }
    }
  }
}

TEST(BuildPlanTest, OneFOneBIsGPipesStepsInOneForwardOneBackwardOrder) {
  // Stage 0 fills with min(P, N) = 2 forwards, stage 1 with 1; every step
  // ends with its N backwards and U, as gpipe's.
  EXPECT_EQ(FormatPlan(MustBuild("1f1b", 2, 3, 2)),
            "stage 0: 0F1 0F2 0B1 0F3 0B2 0B3 0U1 0F4 0F5 0B4 0F6 0B5 0B6 0U2\n"
            "stage 1: 1F1 1B1 1F2 1B2 1F3 1B3 1U1 1F4 1B4 1F5 1B5 1F6 1B6 1U2\n");
}

TEST(BuildPlanTest, ZeroBubbleSplitsEachBackwardAndRunsWInTheBubbles) {
  // B sends the gradient up at once and comes first; W's wait for the time
  // 1f1b idles (the last stage defers two), no stage holding more than
  // min(P, N) = 3 microbatches.
  EXPECT_EQ(FormatPlan(MustBuild("zero_bubble", 3, 4, 1)),
            "stage 0: 0F1 0F2 0F3 0B1 0W1 0B2 0F4 0B3 0W2 0W3 0B4 0W4 0U1\n"
            "stage 1: 1F1 1F2 1B1 1F3 1B2 1W1 1B3 1F4 1W2 1W3 1B4 1W4 1U1\n"
            "stage 2: 2F1 2B1 2F2 2B2 2F3 2B3 2W1 2W2 2F4 2B4 2W3 2W4 2U1\n");
}

// Activation memory: the most microbatches each stage holds, from the plan
// itself, is the formula docs/algorithm.md states.
TEST(PredictPlanTest, HeldMicrobatchesAreTheFormula) {
  for (const char* s : {"gpipe", "1f1b", "zero_bubble", "pipemare", "pipedream_2bw"}) {
    for (int P : {1, 2, 4, 8, 32}) {
      for (int N : {1, 4, 8}) {
        if (std::string(s) == "pipedream_2bw" && N < P - 1) continue;
        const Prediction p = PredictPlan(MustBuild(s, P, N, 40));
        for (int i = 0; i < P; ++i) {
          EXPECT_EQ(p.stages[i].max_held, HeldByFormula(*ParseScheduleKind(s), P, i, N))
              << s << " P=" << P << " N=" << N << " stage " << i;
        }
      }
    }
  }
}

// The schedules users compare against, on the model of time with the
// backward split evenly into B and W: 1f1b has gpipe's bubble (it only holds
// less), zero_bubble less, and the asynchronous schedules almost none.
TEST(PredictPlanTest, ZeroBubbleBeatsOneFOneBWhichMatchesGPipe) {
  for (int P : {4, 8, 32}) {
    const int N = 8;
    auto util = [&](const char* s) { return PredictPlan(MustBuild(s, P, N, 10)).mean_utilization; };
    EXPECT_NEAR(util("1f1b"), util("gpipe"), 1e-12) << "P=" << P;
    EXPECT_GT(util("zero_bubble"), util("1f1b") + 0.05) << "P=" << P;
    if (P == 8) {
      // ZB-H1's bubble, (P-1)(F+B-W) = 7 units a step, a third of 1f1b's
      // (P-1)(F+B+W) = 21, with 24 units of work per stage and step.
      EXPECT_NEAR(24 / util("zero_bubble") - 24, 7, 0.8);
      EXPECT_NEAR(24 / util("1f1b") - 24, 21, 0.8);
    }
    EXPECT_GT(util("pipemare"), util("zero_bubble")) << "P=" << P;
  }
  // An unsplit plan ignores the W share; zero_bubble's B and W add up to
  // the backward: with no W share at all it is 1f1b.
  const Plan zb = MustBuild("zero_bubble", 4, 8, 3);
  EXPECT_NEAR(PredictPlan(zb, 1, 2, 0.5).stages[0].busy,
              PredictPlan(MustBuild("1f1b", 4, 8, 3)).stages[0].busy, 1e-12);
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
             : w[1] == 'W' ? Action::Op::kWeight
                           : Action::Op::kUpdate;
      a.index = std::stoll(w.substr(2));
      plan.actions[i].push_back(a);
    }
  }
  return plan;
}

TEST(ValidatePlanTest, RefusesBrokenPlansNamingStageAndAction) {
  auto message = [](const Plan& p) { return std::string(ValidatePlan(p).message()); };
  // A split plan: W after its B, once, and its steps count W's.
  EXPECT_TRUE(ValidatePlan(Parse(1, 1, {{"0F1", "0B1", "0W1", "0U1"}})).ok());
  EXPECT_THAT(message(Parse(1, 1, {{"0F1", "0W1", "0B1", "0U1"}})),
              HasSubstr("weight gradient comes before its backward"));
  EXPECT_THAT(message(Parse(1, 1, {{"0F1", "0F2", "0B1", "0W1", "0B2", "0U1"}})),
              HasSubstr("microbatch 2 never gets its weight gradient"));
  EXPECT_THAT(message(Parse(1, 2, {{"0F1", "0F2", "0B1", "0B2", "0W1", "0U1", "0W2"}})),
              HasSubstr("a step after 1 weight gradients (W)"));
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
