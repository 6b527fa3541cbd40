#include "pipeline/core/partition.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

namespace pipemare {

// Lets gtest print ranges in failure messages.
void PrintTo(const StageRange& r, std::ostream* os) {
  *os << "{" << r.first_unit << ", " << r.units << "}";
}

namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(PartitionUniformTest, OneUnitPerStage) {
  auto p = PartitionUniform(4, 4);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_THAT(*p,
              ElementsAre(StageRange{0, 1}, StageRange{1, 1}, StageRange{2, 1}, StageRange{3, 1}));
}

TEST(PartitionUniformTest, EarlierStagesGetTheExtraUnit) {
  auto p = PartitionUniform(5, 2);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_THAT(*p, ElementsAre(StageRange{0, 3}, StageRange{3, 2}));
}

TEST(PartitionUniformTest, SevenIntoThree) {
  auto p = PartitionUniform(7, 3);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_THAT(*p, ElementsAre(StageRange{0, 3}, StageRange{3, 2}, StageRange{5, 2}));
}

TEST(PartitionUniformTest, SingleUnitSingleStage) {
  auto p = PartitionUniform(1, 1);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_THAT(*p, ElementsAre(StageRange{0, 1}));
}

TEST(PartitionUniformTest, OneStageTakesEverything) {
  auto p = PartitionUniform(9, 1);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_THAT(*p, ElementsAre(StageRange{0, 9}));
}

TEST(PartitionUniformTest, ContiguousCoveringBalancedForManySizes) {
  for (int units = 1; units <= 40; ++units) {
    for (int stages = 1; stages <= units; ++stages) {
      SCOPED_TRACE(testing::Message() << units << " units, " << stages << " stages");
      auto p = PartitionUniform(units, stages);
      ASSERT_TRUE(p.ok()) << p.status();
      ASSERT_EQ(static_cast<int>(p->size()), stages);
      int next = 0;
      int min_size = units + 1;
      int max_size = 0;
      for (size_t i = 0; i < p->size(); ++i) {
        const StageRange& r = (*p)[i];
        EXPECT_EQ(r.first_unit, next) << "stage " << i << " is not contiguous";
        EXPECT_GE(r.units, 1) << "stage " << i << " is empty";
        if (i > 0) EXPECT_LE(r.units, (*p)[i - 1].units) << "later stage larger at " << i;
        min_size = std::min(min_size, r.units);
        max_size = std::max(max_size, r.units);
        next = r.first_unit + r.units;
      }
      EXPECT_EQ(next, units) << "ranges do not cover all units";
      EXPECT_LE(max_size - min_size, 1);
    }
  }
}

TEST(PartitionUniformTest, ZeroOrNegativeStagesIsInvalid) {
  for (int stages : {0, -1}) {
    auto p = PartitionUniform(4, stages);
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(p.status().message()), HasSubstr("schedule.stages"));
  }
}

TEST(PartitionUniformTest, MoreStagesThanUnitsIsInvalid) {
  auto p = PartitionUniform(3, 4);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(p.status().message()),
              testing::AllOf(HasSubstr("schedule.stages"), HasSubstr("3 units")));
  EXPECT_EQ(PartitionUniform(0, 1).status().code(), absl::StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------------------
// PartitionByCost, PartitionByParameters: brute force over every split.

// Every way to cut `units` units into `stages` non-empty contiguous ranges.
std::vector<std::vector<StageRange>> AllSplits(int units, int stages) {
  std::vector<std::vector<StageRange>> out;
  std::vector<StageRange> cur;
  std::function<void(int, int)> rec = [&](int first, int left) {
    if (left == 1) {
      cur.push_back({first, units - first});
      out.push_back(cur);
      cur.pop_back();
      return;
    }
    for (int end = first + 1; end <= units - (left - 1); ++end) {
      cur.push_back({first, end - first});
      rec(end, left - 1);
      cur.pop_back();
    }
  };
  rec(0, stages);
  return out;
}

double MaxCost(const std::vector<StageRange>& ranges,
               const std::vector<std::vector<double>>& cost) {
  const std::vector<double> c = StageCosts(ranges, cost);
  return c[Bottleneck(c)];
}

int64_t SumSquaredSizes(const std::vector<StageRange>& ranges) {
  int64_t s = 0;
  for (const StageRange& r : ranges) s += int64_t{r.units} * r.units;
  return s;
}

// The documented answer, by brute force: least slowest stage, then least sum
// of squared sizes, then the lexicographically largest split points.
std::vector<StageRange> BruteForce(const std::vector<std::vector<double>>& cost, int stages) {
  const int units = static_cast<int>(cost[0].size());
  std::vector<StageRange> best;
  for (const auto& split : AllSplits(units, stages)) {
    if (best.empty()) {
      best = split;
      continue;
    }
    const double m = MaxCost(split, cost), bm = MaxCost(best, cost);
    if (m != bm) {
      if (m < bm) best = split;
      continue;
    }
    const int64_t q = SumSquaredSizes(split), bq = SumSquaredSizes(best);
    if (q != bq) {
      if (q < bq) best = split;
      continue;
    }
    for (size_t i = 0; i < split.size(); ++i) {
      if (split[i].units != best[i].units) {
        if (split[i].units > best[i].units) best = split;
        break;
      }
    }
  }
  return best;
}

void ExpectValidSplit(const std::vector<StageRange>& p, int units, int stages) {
  ASSERT_EQ(static_cast<int>(p.size()), stages);
  int next = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    EXPECT_EQ(p[i].first_unit, next) << "stage " << i << " is not contiguous";
    EXPECT_GE(p[i].units, 1) << "stage " << i << " is empty";
    next = p[i].first_unit + p[i].units;
  }
  EXPECT_EQ(next, units);
}

TEST(PartitionByCostTest, AllSplitsCountsCombinations) {
  EXPECT_EQ(AllSplits(9, 5).size(), 70u);  // C(8, 4)
  EXPECT_EQ(AllSplits(4, 1).size(), 1u);
}

TEST(PartitionByCostTest, MatchesBruteForceHomogeneousWithTies) {
  // Small integer costs, zeros included, so ties are common and the
  // tie-breaking is checked too.
  std::mt19937 rng(20240611);
  std::uniform_int_distribution<int> value(0, 4);
  for (int trial = 0; trial < 400; ++trial) {
    const int units = 1 + trial % 9;
    const int stages = 1 + (trial / 9) % std::min(units, 5);
    std::vector<double> c(units);
    for (double& x : c) x = value(rng);
    SCOPED_TRACE(testing::Message()
                 << "trial " << trial << ": " << units << " units, " << stages << " stages");
    auto p = PartitionByCost(c, stages);
    ASSERT_TRUE(p.ok()) << p.status();
    ExpectValidSplit(*p, units, stages);
    const auto want = BruteForce({c}, stages);
    EXPECT_EQ(MaxCost(*p, {c}), MaxCost(want, {c}));
    EXPECT_THAT(*p, testing::ElementsAreArray(want));
  }
}

TEST(PartitionByCostTest, MatchesBruteForceHeterogeneous) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> real(0.0, 1.0);
  std::uniform_int_distribution<int> small(0, 3);
  std::uniform_real_distribution<double> speed(0.5, 4.0);
  for (int trial = 0; trial < 400; ++trial) {
    const int units = 1 + trial % 9;
    const int stages = 1 + (trial / 9) % std::min(units, 5);
    // Each stage's worker has its own speed and per-unit noise; every other
    // trial uses small integers so ties occur.
    std::vector<std::vector<double>> cost(stages, std::vector<double>(units));
    for (int s = 0; s < stages; ++s) {
      const double k = speed(rng);
      for (int u = 0; u < units; ++u) {
        cost[s][u] = trial % 2 == 0 ? k * real(rng) : small(rng) * (s + 1);
      }
    }
    SCOPED_TRACE(testing::Message()
                 << "trial " << trial << ": " << units << " units, " << stages << " stages");
    auto p = PartitionByCost(cost, stages);
    ASSERT_TRUE(p.ok()) << p.status();
    ExpectValidSplit(*p, units, stages);
    const auto want = BruteForce(cost, stages);
    EXPECT_DOUBLE_EQ(MaxCost(*p, cost), MaxCost(want, cost));
    EXPECT_THAT(*p, testing::ElementsAreArray(want));
  }
}

TEST(PartitionByCostTest, EqualCostsGiveTheUniformSplit) {
  for (double c : {0.0, 1.0, 0.25}) {
    for (int units = 1; units <= 16; ++units) {
      for (int stages = 1; stages <= units; ++stages) {
        SCOPED_TRACE(testing::Message()
                     << "cost " << c << ", " << units << " units, " << stages << " stages");
        auto p = PartitionByCost(std::vector<double>(units, c), stages);
        ASSERT_TRUE(p.ok()) << p.status();
        EXPECT_EQ(*p, *PartitionUniform(units, stages));
      }
    }
  }
}

TEST(PartitionByCostTest, UnbalancedModelBeatsUniform) {
  // One unit costs 10x the others: it gets a stage of its own.
  const std::vector<double> c = {1, 1, 1, 10, 1, 1, 1, 1};
  auto p = PartitionByCost(c, 4);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_THAT(*p,
              ElementsAre(StageRange{0, 3}, StageRange{3, 1}, StageRange{4, 2}, StageRange{6, 2}));
  const auto uniform = *PartitionUniform(8, 4);
  EXPECT_EQ(MaxCost(*p, {c}), 10.0);
  EXPECT_EQ(MaxCost(uniform, {c}), 11.0);
  EXPECT_LT(MaxCost(*p, {c}), MaxCost(uniform, {c}));
  EXPECT_EQ(Bottleneck(StageCosts(*p, {c})), 1);
}

TEST(PartitionByCostTest, SlowWorkerGetsFewerUnits) {
  // Stage 1's worker is 3x slower than stage 0's.
  const std::vector<std::vector<double>> cost = {{1, 1, 1, 1}, {3, 3, 3, 3}};
  auto p = PartitionByCost(cost, 2);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_THAT(*p, ElementsAre(StageRange{0, 3}, StageRange{3, 1}));
  EXPECT_THAT(StageCosts(*p, cost), ElementsAre(3.0, 3.0));
  EXPECT_THAT(StageCosts(*PartitionUniform(4, 2), cost), ElementsAre(2.0, 6.0));
  // The same costs on the other order of workers.
  auto q = PartitionByCost({{3, 3, 3, 3}, {1, 1, 1, 1}}, 2);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_THAT(*q, ElementsAre(StageRange{0, 1}, StageRange{1, 3}));
}

TEST(PartitionByCostTest, InvalidInputs) {
  auto code = [](const absl::StatusOr<std::vector<StageRange>>& p) { return p.status().code(); };
  auto msg = [](const absl::StatusOr<std::vector<StageRange>>& p) {
    return std::string(p.status().message());
  };
  EXPECT_EQ(code(PartitionByCost(std::vector<double>{1, 2}, 0)),
            absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(msg(PartitionByCost(std::vector<double>{1, 2}, 0)), HasSubstr("schedule.stages"));
  EXPECT_THAT(msg(PartitionByCost(std::vector<double>{1, 2}, 3)),
              testing::AllOf(HasSubstr("schedule.stages"), HasSubstr("2 units")));
  EXPECT_THAT(msg(PartitionByCost(std::vector<double>{}, 1)), HasSubstr("0 units"));
  EXPECT_THAT(msg(PartitionByCost(std::vector<std::vector<double>>{{1, 2, 3}}, 2)),
              HasSubstr("partition cost: 1 rows for 2 stages; give one per stage"));
  EXPECT_THAT(msg(PartitionByCost({{1, 2, 3}, {1, 2}}, 2)),
              HasSubstr("partition cost: stage 1 has 2 units, stage 0 has 3"));
  EXPECT_THAT(
      msg(PartitionByCost(std::vector<double>{1, -2, 3}, 2)),
      HasSubstr("partition cost: unit 1 on stage 0 costs -2; costs must be finite and >= 0"));
  EXPECT_THAT(msg(PartitionByCost({{1, 2, 3}, {1, 2, std::nan("")}}, 2)),
              HasSubstr("unit 2 on stage 1"));
  EXPECT_THAT(
      msg(PartitionByCost(std::vector<double>{1, std::numeric_limits<double>::infinity()}, 2)),
      HasSubstr("must be finite"));
  EXPECT_THAT(msg(PartitionByParameters({5, -1}, 1)),
              HasSubstr("partition parameters: unit 1 on stage 0 costs -1"));
  EXPECT_THAT(msg(PartitionByParameters({5, 1}, 3)), HasSubstr("schedule.stages"));
}

TEST(PartitionByParametersTest, MatchesBruteForce) {
  std::mt19937 rng(99);
  std::uniform_int_distribution<int> coin(0, 2);
  std::uniform_int_distribution<int64_t> count(1, 50000);
  for (int trial = 0; trial < 300; ++trial) {
    const int units = 1 + trial % 9;
    const int stages = 1 + (trial / 9) % std::min(units, 5);
    std::vector<int64_t> params(units);
    std::vector<double> as_double(units);
    for (int u = 0; u < units; ++u) {
      params[u] = coin(rng) == 0 ? 0 : count(rng);  // a third have none (relu, flatten)
      as_double[u] = static_cast<double>(params[u]);
    }
    SCOPED_TRACE(testing::Message()
                 << "trial " << trial << ": " << units << " units, " << stages << " stages");
    auto p = PartitionByParameters(params, stages);
    ASSERT_TRUE(p.ok()) << p.status();
    ExpectValidSplit(*p, units, stages);
    EXPECT_THAT(*p, testing::ElementsAreArray(BruteForce({as_double}, stages)));
  }
}

TEST(PartitionByParametersTest, ParameterFreeUnitsStillGiveNonEmptyStages) {
  auto p = PartitionByParameters({0, 0, 0, 0}, 4);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_THAT(*p,
              ElementsAre(StageRange{0, 1}, StageRange{1, 1}, StageRange{2, 1}, StageRange{3, 1}));
  // linear, relu, linear, relu, linear, relu, big linear, relu: cutting
  // before unit 5 or unit 6 ties at 1000; the more even 5 | 3 is taken.
  auto q = PartitionByParameters({100, 0, 100, 0, 100, 0, 1000, 0}, 2);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_THAT(*q, ElementsAre(StageRange{0, 5}, StageRange{5, 3}));
  // Not the lexicographically earliest cut (1 | 3 units): the even one.
  auto r = PartitionByParameters({10, 0, 10, 0}, 2);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(*r, ElementsAre(StageRange{0, 2}, StageRange{2, 2}));
}

TEST(PartitionByParametersTest, BalancesParametersBetterThanUniform) {
  // A LeNet-like model: the parameters sit in the last layers.
  const std::vector<int64_t> params = {156, 0, 0, 2416, 0, 0, 0, 48120, 0, 10164, 0, 850};
  auto p = PartitionByParameters(params, 2);
  ASSERT_TRUE(p.ok()) << p.status();
  std::vector<double> as_double(params.begin(), params.end());
  EXPECT_LT(MaxCost(*p, {as_double}), MaxCost(*PartitionUniform(12, 2), {as_double}));
  EXPECT_EQ(MaxCost(*p, {as_double}), 50692.0);  // everything up to the big layer
  EXPECT_THAT(*p, ElementsAre(StageRange{0, 8}, StageRange{8, 4}));
}

// ---------------------------------------------------------------------------
// PartitionFromSplit.

TEST(PartitionFromSplitTest, CutsAtTheGivenUnits) {
  auto p = PartitionFromSplit({3, 5}, 8, 3);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_THAT(*p, ElementsAre(StageRange{0, 3}, StageRange{3, 2}, StageRange{5, 3}));
  auto one = PartitionFromSplit({}, 4, 1);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_THAT(*one, ElementsAre(StageRange{0, 4}));
  auto each = PartitionFromSplit({1, 2, 3}, 4, 4);
  ASSERT_TRUE(each.ok()) << each.status();
  EXPECT_EQ(*each, *PartitionUniform(4, 4));
}

TEST(PartitionFromSplitTest, Errors) {
  auto msg = [](const absl::StatusOr<std::vector<StageRange>>& p) {
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
    return std::string(p.status().message());
  };
  EXPECT_EQ(msg(PartitionFromSplit({5, 3}, 10, 3)),
            "schedule.split[1]: 3 is not after schedule.split[0] = 5; split points must increase");
  EXPECT_EQ(msg(PartitionFromSplit({4, 4}, 10, 3)),
            "schedule.split[1]: 4 is not after schedule.split[0] = 4; split points must increase");
  EXPECT_EQ(msg(PartitionFromSplit({0, 4}, 10, 3)),
            "schedule.split[0]: 0 is out of range 1..9 for a model of 10 units");
  EXPECT_EQ(msg(PartitionFromSplit({4, 10}, 10, 3)),
            "schedule.split[1]: 10 is out of range 1..9 for a model of 10 units");
  EXPECT_EQ(msg(PartitionFromSplit({-1}, 10, 2)),
            "schedule.split[0]: -1 is out of range 1..9 for a model of 10 units");
  EXPECT_EQ(msg(PartitionFromSplit({2, 5}, 10, 4)),
            "schedule.split: 2 points for 4 stages; give stages - 1 = 3");
  EXPECT_EQ(msg(PartitionFromSplit({2}, 10, 1)),
            "schedule.split: 1 points for 1 stages; give stages - 1 = 0");
  EXPECT_THAT(msg(PartitionFromSplit({}, 10, 0)), HasSubstr("schedule.stages"));
  EXPECT_THAT(msg(PartitionFromSplit({1, 2, 3}, 3, 4)),
              testing::AllOf(HasSubstr("schedule.stages"), HasSubstr("3 units")));
}

// ---------------------------------------------------------------------------
// StageCosts, Bottleneck.

TEST(StageCostsTest, SumsEachStagesUnitsOnItsOwnRow) {
  const std::vector<StageRange> ranges = {{0, 2}, {2, 1}, {3, 3}};
  EXPECT_THAT(StageCosts(ranges, {{1, 2, 4, 8, 16, 32}, {1, 1, 1, 1, 1, 1}, {0, 0, 0, 1, 2, 3}}),
              ElementsAre(3.0, 1.0, 6.0));
  // One row serves every stage.
  EXPECT_THAT(StageCosts(ranges, {{1, 2, 4, 8, 16, 32}}), ElementsAre(3.0, 4.0, 56.0));
  EXPECT_TRUE(StageCosts({}, {{1.0}}).empty());
}

TEST(BottleneckTest, IndexOfTheLargestEarliestOnTies) {
  EXPECT_EQ(Bottleneck({1.0, 3.0, 2.0}), 1);
  EXPECT_EQ(Bottleneck({4.0, 1.0, 4.0}), 0);
  EXPECT_EQ(Bottleneck({1.0, 2.0, 2.0}), 1);
  EXPECT_EQ(Bottleneck({0.0}), 0);
  EXPECT_EQ(Bottleneck({}), -1);
}

}  // namespace
}  // namespace pipemare
