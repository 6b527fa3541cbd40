#include "pipeline/partition.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ostream>
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

}  // namespace
}  // namespace pipemare
