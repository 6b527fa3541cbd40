#include "pipeline/core/pipemare_math.h"

#include <gtest/gtest.h>

#include <cmath>

namespace pipemare {
namespace {

constexpr double kTol = 1e-12;

TEST(AnalyticDelayTest, OneMicrobatchPerStep) {
  EXPECT_EQ(AnalyticDelay(4, 0, 1), 3);
  EXPECT_EQ(AnalyticDelay(4, 1, 1), 2);
  EXPECT_EQ(AnalyticDelay(4, 2, 1), 1);
  EXPECT_EQ(AnalyticDelay(4, 3, 1), 0);
}

TEST(AnalyticDelayTest, SeveralMicrobatchesPerStepRoundUp) {
  EXPECT_EQ(AnalyticDelay(8, 0, 4), 2);  // ceil(7/4)
  EXPECT_EQ(AnalyticDelay(8, 1, 4), 2);  // ceil(6/4)
  EXPECT_EQ(AnalyticDelay(8, 2, 4), 2);  // ceil(5/4)
  EXPECT_EQ(AnalyticDelay(8, 3, 4), 1);  // ceil(4/4)
  EXPECT_EQ(AnalyticDelay(8, 4, 4), 1);  // ceil(3/4)
  EXPECT_EQ(AnalyticDelay(8, 6, 4), 1);  // ceil(1/4)
  EXPECT_EQ(AnalyticDelay(8, 7, 4), 0);
}

TEST(AnalyticDelayTest, SingleStageHasNoDelay) { EXPECT_EQ(AnalyticDelay(1, 0, 1), 0); }

TEST(T1LearningRateTest, AnnealsFromAlphaOverTauToAlpha) {
  EXPECT_NEAR(T1LearningRate(0.1, 0, 100, 4), 0.025, kTol);
  EXPECT_NEAR(T1LearningRate(0.1, 50, 100, 4), 0.1 * std::pow(4.0, -0.5), kTol);
  EXPECT_NEAR(T1LearningRate(0.1, 50, 100, 4), 0.05, kTol);
  EXPECT_NEAR(T1LearningRate(0.1, 25, 100, 4), 0.1 * std::pow(4.0, -0.75), kTol);
  EXPECT_NEAR(T1LearningRate(0.1, 100, 100, 4), 0.1, kTol);
  EXPECT_NEAR(T1LearningRate(0.1, 200, 100, 4), 0.1, kTol);
}

TEST(T1LearningRateTest, NoChangeWithoutDelayOrAnnealing) {
  EXPECT_NEAR(T1LearningRate(0.1, 0, 100, 1), 0.1, kTol);
  EXPECT_NEAR(T1LearningRate(0.1, 0, 100, 0), 0.1, kTol);
  EXPECT_NEAR(T1LearningRate(0.1, 0, 0, 4), 0.1, kTol);
  EXPECT_NEAR(T1LearningRate(0.1, 10, -5, 4), 0.1, kTol);
}

TEST(T1LearningRateTest, IsMonotoneInK) {
  double prev = 0;
  for (int k = 0; k <= 120; ++k) {
    const double lr = T1LearningRate(0.2, k, 100, 3);
    EXPECT_GE(lr, prev) << k;
    EXPECT_LE(lr, 0.2 + kTol) << k;
    prev = lr;
  }
}

TEST(T2GammaTest, IsTheTauthRootOfD) {
  EXPECT_NEAR(T2Gamma(0.1, 2), 0.31622776601683794, kTol);
  EXPECT_NEAR(T2Gamma(0.1, 1), 0.1, kTol);
  EXPECT_NEAR(T2Gamma(0.1, 3), std::cbrt(0.1), kTol);
  EXPECT_NEAR(T2Gamma(0.1, 0), 0.1, kTol);  // tau clamped to 1
}

TEST(T2VelocityTest, HandComputed) {
  // 0.25 * 0.5 + 0.75 * (1.2 - 1.0)
  EXPECT_NEAR(T2Velocity(0.5, 1.2, 1.0, 0.25), 0.275, kTol);
  EXPECT_NEAR(T2Velocity(0.5, 1.2, 1.0, 1.0), 0.5, kTol);
  EXPECT_NEAR(T2Velocity(0.5, 1.2, 1.0, 0.0), 0.2, kTol);
}

TEST(T2BackwardWeightsTest, HandComputed) {
  EXPECT_NEAR(T2BackwardWeights(1.0, 0.275, 3), 0.175, kTol);
  EXPECT_NEAR(T2BackwardWeights(1.0, 0.275, 0), 1.0, kTol);
  EXPECT_NEAR(T2BackwardWeights(-2.0, -0.5, 2), -1.0, kTol);
}

TEST(SpikeCompensationTest, CoefficientsAndTheUndelayedTotal) {
  const SpikeCoefficients c = SpikeCompensation(0.9, 3);
  EXPECT_NEAR(c.a, 0.729, kTol);
  EXPECT_NEAR(c.b, (1 - 0.729) / (1 - 0.9), kTol);
  // A gradient's total effect, b + a/(1 − m), is the undelayed 1/(1 − m).
  for (double m : {0.0, 0.5, 0.9, 0.99}) {
    for (int tau : {0, 1, 2, 7}) {
      const SpikeCoefficients s = SpikeCompensation(m, tau);
      EXPECT_NEAR(s.b + s.a / (1 - m), 1 / (1 - m), 1e-9) << "m " << m << " tau " << tau;
    }
  }
  EXPECT_NEAR(SpikeCompensation(0.9, 0).a, 1, kTol);  // no delay: plain momentum
  EXPECT_NEAR(SpikeCompensation(0.9, 0).b, 0, kTol);
  EXPECT_NEAR(SpikeCompensation(0.0, 4).a, 0, kTol);  // no momentum: plain SGD
  EXPECT_NEAR(SpikeCompensation(0.0, 4).b, 1, kTol);
  EXPECT_NEAR(SpikeCompensation(1.0, 4).b, 4, kTol);  // the limit m → 1: τ
  EXPECT_NEAR(SpikeCompensatedDirection(2.0, 1.0, c), 0.729 * 2 + 2.71, kTol);
}

}  // namespace
}  // namespace pipemare
