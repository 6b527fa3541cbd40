// An in-process pipeline: the P stage runtimes of a job (the very code every
// worker runs) connected by in-memory queues, each executing its stage's
// plan (pipeline/schedule.h), in one thread and deterministically. No
// sockets, no threads: for exactness tests and for reasoning about a
// schedule with real tensors.
#ifndef PIPEMARE_PIPELINE_HARNESS_H_
#define PIPEMARE_PIPELINE_HARNESS_H_

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "pipeline/schedule.h"
#include "pipeline/stage_runtime.h"
#include "pipemare/v1/pipemare.pb.h"

namespace pipemare {

class PipelineHarness {
 public:
  // The stages of a validated job spec whose epochs have `steps_per_epoch`
  // optimizer steps (ResolveStageAssignments), with weights in `dtype`.
  static absl::StatusOr<std::unique_ptr<PipelineHarness>> Create(
      const v1::JobSpec& spec, int64_t steps_per_epoch, torch::Dtype dtype = torch::kFloat32);

  // Trains one epoch along the plans: microbatch m (1-based) is inputs[m-1]
  // with targets[m-1], steps_per_epoch · N of them. `after_action`, if set,
  // is called after every action a stage runs. Returns each microbatch's
  // training loss, in microbatch order. Errors: wrong number of
  // microbatches, a runtime error (naming the stage), or a plan that stalls.
  absl::StatusOr<std::vector<double>> TrainEpoch(
      const std::vector<torch::Tensor>& inputs, const std::vector<torch::Tensor>& targets,
      const std::function<void(const Action&)>& after_action = nullptr);

  int stages() const { return static_cast<int>(runtimes_.size()); }
  StageRuntime& stage(int i) { return *runtimes_[i]; }

 private:
  PipelineHarness() = default;

  std::vector<v1::StageAssignment> assignments_;
  std::vector<std::unique_ptr<StageRuntime>> runtimes_;
  uint64_t next_id_ = 1;  // microbatch ids, unique across epochs
};

}  // namespace pipemare

#endif  // PIPEMARE_PIPELINE_HARNESS_H_
