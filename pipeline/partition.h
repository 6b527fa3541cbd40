// Cutting a model's units into P contiguous stages.
#ifndef PIPEMARE_PIPELINE_PARTITION_H_
#define PIPEMARE_PIPELINE_PARTITION_H_

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

}  // namespace pipemare

#endif  // PIPEMARE_PIPELINE_PARTITION_H_
