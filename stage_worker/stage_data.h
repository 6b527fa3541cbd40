// StageData: the examples of a stage that reads them itself
// (StageAssignment.data): stage 0 makes the inputs, the last stage the
// targets of each DataSlice its feeds carry, so the coordinator sends no
// examples. Loaded once per stage, after this host's files are checked
// against the coordinator's manifest (StageAssignment.data_files). No
// LibTorch.
#ifndef PIPEMARE_STAGE_WORKER_STAGE_DATA_H_
#define PIPEMARE_STAGE_WORKER_STAGE_DATA_H_

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/status/statusor.h"
#include "pipeline/core/data.h"
#include "pipemare/v1/pipemare.pb.h"

namespace pipemare {

class StageData {
 public:
  // The stage's examples, or null when the assignment gives none (a middle
  // stage, or feeds that carry tensors). Paths are checked against this
  // process's --data-root; a file that differs from the manifest is
  // INVALID_ARGUMENT naming the field, the file and the fix.
  static absl::StatusOr<std::unique_ptr<StageData>> Load(const v1::StageAssignment& a);

  // Inputs (stage 0) or targets (the last stage) of `slice` in `phase`:
  // TRAIN slices are positions in epoch slice.epoch's order (EpochOrder),
  // EVAL slices test examples in file order. INVALID_ARGUMENT naming the
  // field for a slice outside its split. Thread-safe.
  absl::StatusOr<Batch> Make(const v1::DataSlice& slice, v1::Phase phase, bool targets);

  int64_t bytes() const;  // the examples held

 private:
  StageData() = default;
  Data data_;
  v1::TrainSpec train_;
  int64_t max_train_count_ = 0, max_eval_count_ = 0;
  int epochs_ = 0;
  std::mutex mu_;
  int64_t order_epoch_ = 0;                            // under mu_
  std::shared_ptr<const std::vector<int64_t>> order_;  // under mu_
};

}  // namespace pipemare

#endif  // PIPEMARE_STAGE_WORKER_STAGE_DATA_H_
