// An in-process pipeline: the P stages of a job, each a stage runtime run by
// its stage machine (pipeline/runtime/stage_machine.h, the very code every worker
// runs: arrival checks, matching, train.on_nonfinite, cuts), connected by
// in-memory hand-offs, in one thread and deterministically. No sockets, no
// threads: for exactness tests and for reasoning about a schedule with real
// tensors.
#ifndef PIPEMARE_PIPELINE_HARNESS_H_
#define PIPEMARE_PIPELINE_HARNESS_H_

#include <torch/torch.h>

#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "pipeline/core/schedule.h"
#include "pipeline/runtime/stage_machine.h"
#include "pipeline/runtime/stage_runtime.h"
#include "pipemare/v1/pipemare.pb.h"

namespace pipemare {

class PipelineHarness {
 public:
  // The stages of a validated job spec whose epochs have `steps_per_epoch`
  // optimizer steps (ResolveStageAssignments), with weights in `dtype`.
  static absl::StatusOr<std::unique_ptr<PipelineHarness>> Create(
      const v1::JobSpec& spec, int64_t steps_per_epoch, torch::Dtype dtype = torch::kFloat32);

  // Trains one epoch along the plans: microbatch m (1-based) is inputs[m-1]
  // with targets[m-1], steps_per_epoch · N of them (after stages restored
  // from a cut inside an epoch: the rest of that epoch's). `after_action`, if set,
  // is called after every action a stage runs. Returns each microbatch's
  // training loss, in microbatch order. Errors: wrong number of
  // microbatches, a runtime error (naming the stage), or a plan that stalls.
  absl::StatusOr<std::vector<double>> TrainEpoch(
      const std::vector<torch::Tensor>& inputs, const std::vector<torch::Tensor>& targets,
      const std::function<void(const Action&)>& after_action = nullptr);

  // Asks every stage for a cut at the end of step `step` (the coordinator's
  // drain): taken by the U that applies it, as the workers take it.
  absl::Status RequestCut(int64_t step);

  int stages() const { return static_cast<int>(runtimes_.size()); }
  StageRuntime& stage(int i) { return *runtimes_[i]; }

  // Every stage's snapshot of the checkpoint cut after step `step` (taken as
  // the workers take it: checkpoint.every_steps, and after the last step),
  // or empty if that cut was not taken.
  std::vector<UnitState> Cut(int64_t step) const;

 private:
  PipelineHarness() = default;

  std::vector<v1::StageAssignment> assignments_;
  std::vector<std::unique_ptr<StageRuntime>> runtimes_;
  std::vector<std::unique_ptr<StageMachine>> machines_;                        // one per runtime
  std::map<int64_t, std::vector<std::shared_ptr<const StageSnapshot>>> cuts_;  // by step
  uint64_t next_id_ = 1;  // microbatch ids, unique across epochs
};

}  // namespace pipemare

#endif  // PIPEMARE_PIPELINE_HARNESS_H_
