// The stage executor: the one place a stage's plan (pipeline/core/schedule.h) is
// carried out. It does no I/O: a driver tells it what has arrived and sends
// what it returns. Two drivers run it: the worker's stage host (events from
// gRPC streams) and the in-process harness (events from queues), so the
// float64 exactness tests prove the code the workers run.
//
// The plan's actions are the only source of work: F of the plan's next
// forward index (microbatch ids are numbered by arrival order within the
// epoch), B of exactly the microbatch the plan names, and U, which is the
// only caller of the runtime's optimizer step. Each epoch's plan is built
// lazily for this stage alone, from the runtime's step count, when the
// epoch's first forward arrives (an epoch resumed from a checkpoint cut
// inside it runs its remaining steps); between epochs the pipeline is
// drained and evaluation forwards may run.
//
// Thread-compatible: one thread (the driver's compute thread) calls it.
#ifndef PIPEMARE_PIPELINE_STAGE_EXECUTOR_H_
#define PIPEMARE_PIPELINE_STAGE_EXECUTOR_H_

#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "pipeline/core/schedule.h"
#include "pipeline/runtime/stage_runtime.h"
#include "pipemare/v1/pipemare.pb.h"

namespace pipemare {

class StageExecutor {
 public:
  // Runs `runtime` (not owned; outlives the executor) along the plans of
  // assignment `a` (schedule, P, N, steps_per_epoch, warmup_steps), cutting
  // a checkpoint after every checkpoint_every_steps-th step and after the
  // job's last (total_steps).
  // INVALID_ARGUMENT naming the field if those cannot make a plan.
  static absl::StatusOr<StageExecutor> Create(const v1::StageAssignment& a, StageRuntime* runtime);

  // What a driver must do for the plan's next action.
  struct Next {
    Action action;            // between epochs: the next epoch's first forward
    uint64_t microbatch = 0;  // B: the microbatch id whose gradient it needs
  };
  Next Peek() const;
  bool between_epochs() const { return next_ >= plan_.size(); }
  // The job's training is done on this stage: its last step (total_steps)
  // applied and that epoch's plan finished; evaluations may still come.
  bool trained() const {
    return total_steps_ > 0 && between_epochs() && runtime_->Stats().steps >= total_steps_;
  }

  // What an action produced, for the driver to send.
  struct Output {
    Action action;
    uint64_t microbatch = 0;
    // F on a stage but the last: the activation for stage i+1. B on a stage
    // but the first: the gradient for stage i-1. Undefined otherwise.
    torch::Tensor tensor;
    std::optional<LossResult> loss;  // F on the last stage
    double seconds = 0;              // the action's compute time
    // U that ends a cut (pipeline/core/checkpoint.h): the stage's state right
    // after this step, in host memory, for the driver to write.
    std::shared_ptr<const StageSnapshot> snapshot;
  };

  // The plan's next forward, of microbatch `microbatch` (starting the next
  // epoch's plan if none is in progress). `targets` on the last stage only.
  // Errors: the plan's next action is not a forward, or the runtime's.
  absl::StatusOr<Output> Forward(uint64_t microbatch, const torch::Tensor& input,
                                 const torch::Tensor& targets = {});
  // The plan's next backward; `microbatch` must be Peek().microbatch.
  // `grad_output` is undefined on the last stage.
  absl::StatusOr<Output> Backward(uint64_t microbatch, const torch::Tensor& grad_output);
  // Runs the plan's next action if it needs no input from a peer: U (the
  // optimizer step), W (zero_bubble's weight gradient), or on the last
  // stage a backward. Returns what it
  // produced (a gradient to send up), or nullopt if the next action waits
  // for input (or the epoch is done). Drivers call it until nullopt.
  absl::StatusOr<std::optional<Output>> RunLocal();

  // An evaluation forward (no plan, no saved state); only between epochs,
  // FAILED_PRECONDITION otherwise. `targets` on the last stage only.
  absl::StatusOr<Output> Evaluate(uint64_t microbatch, const torch::Tensor& input,
                                  const torch::Tensor& targets = {});

  // One more cut, at the end of step `step` (a drain's, besides the
  // periodic ones): taken by the U that applies it (returns nullptr), or now
  // if the stage has applied exactly `step` steps and its epoch is done.
  // FAILED_PRECONDITION naming the stage's step if it is past `step`.
  absl::StatusOr<std::shared_ptr<const StageSnapshot>> CutAt(int64_t step);

  StageRuntime& runtime() { return *runtime_; }

 private:
  // The stage's state now, stamped with this run's generation.
  std::shared_ptr<const StageSnapshot> TakeSnapshot() const;
  StageExecutor(const v1::StageAssignment& a, StageRuntime* runtime);
  absl::Status StartEpoch();
  // Moves past the plan's next action, which must be `ran`.
  absl::Status Advance(const Action& ran, uint64_t microbatch);

  StageRuntime* runtime_;
  PlanOptions options_;  // first_step set per epoch
  int stage_ = 0;
  int64_t checkpoint_every_ = 0;  // 0: only after the last step
  int64_t cut_at_ = 0;            // CutAt's step, 0 if none
  int64_t total_steps_ = 0;
  int64_t generation_ = 0;    // stamped on snapshots (fencing)
  std::vector<Action> plan_;  // this epoch's actions; done when next_ == size
  size_t next_ = 0;
  int64_t epoch_first_step_ = 0;
  int64_t forwarded_ = 0;                 // forwards in this epoch
  std::map<int64_t, uint64_t> id_of_;     // plan index -> microbatch id
  std::map<uint64_t, int64_t> index_of_;  // microbatch id -> plan index
};

}  // namespace pipemare

#endif  // PIPEMARE_PIPELINE_STAGE_EXECUTOR_H_
