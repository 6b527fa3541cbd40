// Cutting a model's units into P contiguous stages.
#ifndef PIPEMARE_PIPELINE_PARTITION_H_
#define PIPEMARE_PIPELINE_PARTITION_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"

namespace pipemare {

struct StageRange {
  int first_unit = 0;
  int units = 0;
  bool operator==(const StageRange& o) const {
    return first_unit == o.first_unit && units == o.units;
  }
};

// Splits `num_units` units into `num_stages` contiguous, non-empty ranges
// whose sizes differ by at most one (earlier stages get the extra unit).
// INVALID_ARGUMENT if num_stages < 1 or num_stages > num_units.
absl::StatusOr<std::vector<StageRange>> PartitionUniform(int num_units, int num_stages);

// Splits the units into `num_stages` contiguous, non-empty ranges minimising
// the slowest stage, by dynamic programming (O(P * U^2)). `cost[s][u]` is the
// cost of unit u on stage s's worker (heterogeneous devices: each stage's
// worker timed every unit), so a stage's cost is the sum of its units' costs
// in its own row; `cost` has one row per stage, all of the same length U.
//
// Ties: among the splits with the minimal maximum stage cost, the one whose
// stage sizes (in units) are the most even is returned, i.e. the one with the
// least sum of squared stage sizes; among those still tied, the split points
// that are lexicographically largest (earlier stages get the extra units, as
// in PartitionUniform). So equal costs give exactly PartitionUniform's split,
// and zero-cost units (activations, reshapes) are spread rather than piled
// onto one stage.
//
// INVALID_ARGUMENT if num_stages < 1, num_stages > U, `cost` does not have
// num_stages rows of equal length, or a cost is negative or not finite.
absl::StatusOr<std::vector<StageRange>> PartitionByCost(
    const std::vector<std::vector<double>>& cost, int num_stages);
// The same with one cost per unit, shared by every stage (homogeneous devices).
absl::StatusOr<std::vector<StageRange>> PartitionByCost(const std::vector<double>& cost,
                                                        int num_stages);

// PartitionByCost with each unit's parameter count as its cost (exact integer
// arithmetic), the same tie-breaking: units without parameters cost 0 and
// every stage still gets at least one unit. INVALID_ARGUMENT as
// PartitionByCost (a count is negative).
absl::StatusOr<std::vector<StageRange>> PartitionByParameters(const std::vector<int64_t>& params,
                                                              int num_stages);

// The explicit partition "split": `split` holds the first unit of stages
// 1..P-1 (stage 0 starts at unit 0), P-1 strictly increasing values in
// 1..num_units-1. INVALID_ARGUMENT naming `schedule.split[i]`, e.g.
// "schedule.split[1]: 3 is not after schedule.split[0] = 5; split points must
// increase", or `schedule.stages` as PartitionUniform.
absl::StatusOr<std::vector<StageRange>> PartitionFromSplit(const std::vector<int>& split,
                                                           int num_units, int num_stages);

// Each stage's cost: the sum of cost[s][u] over its units u. `cost` has one
// row per stage, or a single row used for every stage; units or rows missing
// from `cost` count 0.
std::vector<double> StageCosts(const std::vector<StageRange>& ranges,
                               const std::vector<std::vector<double>>& cost);

// Index of the largest stage cost (the earliest on ties); -1 if empty.
int Bottleneck(const std::vector<double>& stage_costs);

}  // namespace pipemare

#endif  // PIPEMARE_PIPELINE_PARTITION_H_
