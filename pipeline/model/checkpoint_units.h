// Checkpoint unit files (LibTorch): a stage's state at a cut in host memory,
// written and read one unit at a time; the layout and the manifest are in
// pipeline/core/checkpoint.h.
#ifndef PIPEMARE_PIPELINE_CHECKPOINT_UNITS_H_
#define PIPEMARE_PIPELINE_CHECKPOINT_UNITS_H_

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "pipeline/core/checkpoint.h"

namespace pipemare {

struct UnitState {
  int unit = 0;                                                // index in the whole model
  std::vector<std::pair<std::string, torch::Tensor>> tensors;  // host memory
};

// One stage's state at the cut after step `step`, copied to host memory.
struct StageSnapshot {
  int64_t step = 0;
  int stage = 0;
  int64_t generation = 0;  // of the run that took it (fencing; names its files)
  double seconds = 0;      // the copy's time, on the compute thread
  std::vector<UnitState> units;
};

// Writes each unit of `snapshot` to CheckpointStepDir(...)/unit-<u>.pt, or
// unit-<u>.g<generation>.pt for a generation > 0: a stage of an older run
// that is still writing can never overwrite a newer run's file.
absl::StatusOr<std::vector<WrittenFile>> WriteStageSnapshot(const std::string& dir,
                                                            const std::string& job,
                                                            const StageSnapshot& snapshot);

// Reads one unit file, checking its SHA-256 first (when `sha256` is not
// empty). DATA_LOSS naming the file when it is truncated, corrupt or does
// not match.
absl::StatusOr<UnitState> ReadUnitFile(const std::string& path, const std::string& sha256);

// A unit file's bytes: `unit` at the cut after `step`. The same state gives
// the same bytes, so a copy held in memory is checked by the file's SHA-256.
absl::StatusOr<std::string> UnitFileBytes(const UnitState& unit, int64_t step);
// ReadUnitFile on bytes already read (`name` says where from, for errors).
absl::StatusOr<UnitState> ParseUnitFile(const std::string& bytes, const std::string& sha256,
                                        const std::string& name);

}  // namespace pipemare

#endif  // PIPEMARE_PIPELINE_CHECKPOINT_UNITS_H_
