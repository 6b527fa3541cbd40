#include "pipeline/partition.h"

#include "absl/strings/str_cat.h"

namespace pipemare {

absl::StatusOr<std::vector<StageRange>> PartitionUniform(int num_units, int num_stages) {
  if (num_stages < 1) return absl::InvalidArgumentError("schedule.stages: must be >= 1");
  if (num_stages > num_units) {
    return absl::InvalidArgumentError(absl::StrCat(
        "schedule.stages: ", num_stages, " stages but the model has only ", num_units, " units"));
  }
  std::vector<StageRange> ranges;
  const int base = num_units / num_stages;
  const int extra = num_units % num_stages;
  int next = 0;
  for (int i = 0; i < num_stages; ++i) {
    const int n = base + (i < extra ? 1 : 0);
    ranges.push_back({next, n});
    next += n;
  }
  return ranges;
}

}  // namespace pipemare
