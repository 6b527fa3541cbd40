#include "pipeline/core/lr_schedule.h"

#include <gtest/gtest.h>

#include "pipeline/core/pipemare_math.h"

namespace pipemare {
namespace {

LrSchedule Schedule(LrSchedule::Kind kind, int64_t total = 100) {
  LrSchedule s;
  s.lr = 0.1;
  s.kind = kind;
  s.total_steps = total;
  return s;
}

TEST(BaseLearningRateTest, ConstantAndCosine) {
  EXPECT_DOUBLE_EQ(BaseLearningRate(Schedule(LrSchedule::Kind::kConstant), 50), 0.1);
  const LrSchedule cosine = Schedule(LrSchedule::Kind::kCosine);
  EXPECT_NEAR(BaseLearningRate(cosine, 0), 0.1, 1e-12);
  EXPECT_NEAR(BaseLearningRate(cosine, 50), 0.05, 1e-12);  // ½(1 + cos π/2)
  EXPECT_NEAR(BaseLearningRate(cosine, 25), 0.1 * 0.5 * (1 + std::sqrt(0.5)), 1e-12);
  EXPECT_NEAR(BaseLearningRate(cosine, 100), 0.0, 1e-12);
  EXPECT_NEAR(BaseLearningRate(cosine, 150), 0.0, 1e-12);  // clamped
  // T1 rescales the base schedule: α_{k,i} = α_k · τ^-(1 - k/K).
  EXPECT_NEAR(T1LearningRate(BaseLearningRate(cosine, 50), 50, 100, 4), 0.05 * 0.5, 1e-12);
}

TEST(BaseLearningRateTest, StepDecaysByGammaEveryStepSize) {
  LrSchedule s = Schedule(LrSchedule::Kind::kStep);
  s.step_size = 30;
  s.gamma = 0.5;
  EXPECT_DOUBLE_EQ(BaseLearningRate(s, 0), 0.1);
  EXPECT_DOUBLE_EQ(BaseLearningRate(s, 29), 0.1);
  EXPECT_DOUBLE_EQ(BaseLearningRate(s, 30), 0.05);
  EXPECT_DOUBLE_EQ(BaseLearningRate(s, 95), 0.1 * 0.125);
}

TEST(BaseLearningRateTest, LinearWarmupComposesWithTheSchedule) {
  LrSchedule s = Schedule(LrSchedule::Kind::kCosine);
  s.warmup_steps = 4;
  EXPECT_NEAR(BaseLearningRate(s, 0), 0.1 * 0.25, 1e-12);
  EXPECT_NEAR(BaseLearningRate(s, 1), 0.1 * 0.5 * 0.5 * (1 + std::cos(M_PI / 100)), 1e-12);
  EXPECT_NEAR(BaseLearningRate(s, 50), 0.05, 1e-12);  // past the warm-up: the cosine alone
}

TEST(BaseLearningRateTest, FromSpec) {
  v1::OptimizerSpec o;
  o.set_lr(0.2);
  o.set_lr_schedule("step");
  o.set_lr_step_size(10);
  LrSchedule s = LrScheduleFromSpec(o, 1000);
  EXPECT_EQ(s.kind, LrSchedule::Kind::kStep);
  EXPECT_DOUBLE_EQ(s.gamma, 0.1) << "default";
  EXPECT_DOUBLE_EQ(BaseLearningRate(s, 10), 0.02);
  o.set_lr_step_gamma(0.5);
  EXPECT_DOUBLE_EQ(BaseLearningRate(LrScheduleFromSpec(o, 1000), 10), 0.1);
}

}  // namespace
}  // namespace pipemare
