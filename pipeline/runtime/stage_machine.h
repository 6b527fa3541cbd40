// The stage machine: everything one pipeline stage decides, without I/O.
// Arrivals go in (an activation, a gradient, the last stage's targets, a
// cut request); what the stage computes comes out through the driver's
// Emit callback, in the order the plan runs it. It owns:
//   - the arrival checks: dtype and shape against the stage's input, ids
//     that only increase, a gradient only for an activation this stage sent
//     and still awaits (of that shape), bounded inboxes;
//   - train.on_nonfinite: a NaN or Inf in what arrived or in the last
//     stage's loss either fails the stage (FAILED_PRECONDITION, naming the
//     microbatch and step) or drops the microbatch (StageRuntime::Drop);
//   - matching: exactly the input the plan's next action needs (the stage
//     executor's Peek), the last stage's targets paired with their
//     activation, evaluation forwards only between epochs;
//   - cuts the coordinator asks for, taken between two actions.
// Two drivers run it: the worker's stage host (gRPC streams and threads,
// stage_worker/stage_host.h) and the in-process harness (queues, one
// thread, pipeline/runtime/harness.h), so the float64 exactness tests prove the
// decisions the workers make.
//
// Threads: Offer, RequestCut, AwaitCut and Stop may be called from any
// thread and never block on compute (Offer checks a tensor's values on the
// caller's thread). Next and Run belong to one thread, the driver's compute
// thread.
#ifndef PIPEMARE_PIPELINE_STAGE_MACHINE_H_
#define PIPEMARE_PIPELINE_STAGE_MACHINE_H_

#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "pipeline/runtime/stage_executor.h"
#include "pipeline/runtime/stage_runtime.h"
#include "pipemare/v1/pipemare.pb.h"

namespace pipemare {

class StageMachine {
 public:
  enum class Kind { kActivation, kGradient, kTargets, kCut };
  // One arrival, and, from Next, the input the next action takes.
  struct Input {
    Kind kind = Kind::kActivation;
    uint64_t microbatch = 0;
    v1::Phase phase = v1::TRAIN;  // activations
    // As it came over the wire (activations and gradients): checked against
    // what this stage takes (schedule.wire_dtype, stage 0's feed).
    v1::DType dtype = v1::FLOAT32;
    // Its values, in the type the stage computes in; or, while `arriving`
    // is set, a buffer its bytes are still arriving in.
    torch::Tensor tensor;
    // The driver's handle of bytes still arriving (a data plane); opaque
    // here. The driver waits for them and clears it before Run, which then
    // checks the values.
    std::shared_ptr<void> arriving;
    // Dropped (train.on_nonfinite: skip): flagged so by upstream, or a NaN or
    // Inf arrived in it here; `tensor` then holds zeros.
    bool skipped = false;
    bool checked = false;  // its values were checked for NaN and Inf
    int source = 0;        // the driver's tag of where it came from; 0: computed here
    int64_t step = 0;      // kCut: the cut is at the end of this step
  };

  struct Options {
    // Names an input's source in messages: "downstream stage 3 at ...".
    std::function<std::string(int source)> source_name;
    // Called (from any thread) with the warning for each dropped microbatch.
    std::function<void(const std::string& warning)> on_skip;
  };

  // The machine of assignment `a` running `runtime` (not owned; outlives it).
  static absl::StatusOr<std::unique_ptr<StageMachine>> Create(const v1::StageAssignment& a,
                                                              StageRuntime* runtime,
                                                              Options options);
  StageMachine(const StageMachine&) = delete;
  StageMachine& operator=(const StageMachine&) = delete;

  // Inputs of one kind that may wait, at most: the coordinator keeps at most
  // P + 1 (asynchronous) or 2N (synchronous) microbatches in flight, so the
  // bound only bites on a misbehaving peer.
  size_t inbox_capacity() const { return inbox_capacity_; }

  // An arrival (kind activation, gradient or targets). INVALID_ARGUMENT: a bad
  // message, saying why (the driver refuses its sender);
  // FAILED_PRECONDITION: a NaN or Inf under train.on_nonfinite: fail (the
  // stage fails, and the job with it: no retry helps). `inbox_full` (activations): the inbox is now
  // full; read no more from that source until Next says to resume.
  absl::Status Offer(Input input, bool* inbox_full = nullptr);

  // Asks for a cut at the end of step `step` (StageExecutor::CutAt), taken
  // by the compute thread between two actions. FAILED_PRECONDITION while
  // another is pending.
  absl::Status RequestCut(int64_t step);
  // Waits up to `timeout` for the requested cut: OK once taken,
  // FAILED_PRECONDITION if the stage refused it (past that step),
  // UNAVAILABLE if the machine stopped or the time ran out.
  absl::Status AwaitCut(std::chrono::milliseconds timeout);

  // Ends every wait: Next returns nothing from now on, AwaitCut fails with
  // `why`. Idempotent.
  void Stop(const std::string& why);

  // Compute thread. The input the plan's next action needs, or a requested
  // cut, waiting up to `wait` for it; nothing if none came or the machine
  // stopped. `resume`: a source paused by a full activation inbox may read
  // on.
  std::optional<Input> Next(std::chrono::milliseconds wait, bool* resume = nullptr);
  // Compute thread. Runs `input` (from Next), then the actions the plan puts
  // next that need no input (U; the last stage's backwards), handing each
  // output to `emit` as it is produced: the action's output, its phase, and
  // whether its microbatch was dropped. An error fails the stage;
  // FAILED_PRECONDITION (a NaN or Inf under fail) fails the job too.
  using Emit =
      std::function<absl::Status(const StageExecutor::Output& out, v1::Phase phase, bool skipped)>;
  absl::Status Run(Input input, const Emit& emit);

  int64_t nonfinite_skipped() const;
  // Any thread: the stage has run the job's whole training plan
  // (StageExecutor::trained), so a neighbour or feed that now closes cleanly
  // ends the job, not the stage.
  bool trained() const { return trained_.load(); }
  StageRuntime& runtime() { return *runtime_; }
  // The plan's position (compute thread only).
  const StageExecutor& executor() const { return *executor_; }

 private:
  StageMachine(const v1::StageAssignment& a, StageRuntime* runtime, Options options);
  // What is wrong with activation `in`, or "" when it has the dtype and
  // example shape this stage takes.
  std::string CheckActivation(const Input& in) const;
  absl::Status OfferActivation(Input in, bool* inbox_full);
  absl::Status OfferGradient(Input in);
  absl::Status OfferTargets(Input in);
  // The one NaN/Inf check: marks `in` checked, and skipped (zeros) when a
  // NaN or Inf arrived in it under skip; FAILED_PRECONDITION under fail.
  absl::Status CheckValues(Input* in);
  // A NaN or Inf in microbatch `id`'s `what` from `source`: the failure
  // (train.on_nonfinite: fail), or OK after counting and warning (skip).
  absl::Status OnNonFinite(uint64_t id, const std::string& what, int source);
  absl::Status RunActivation(Input& in, const Emit& emit);
  absl::Status RunGradient(Input& in, const Emit& emit);
  absl::Status RunLocal(const Emit& emit);

  const v1::StageAssignment assignment_;
  StageRuntime* const runtime_;
  const Options options_;
  const bool last_;
  const bool skip_nonfinite_;  // train.on_nonfinite: skip
  v1::DType peer_dtype_;       // what neighbours send (schedule.wire_dtype)
  size_t inbox_capacity_ = 0;
  // The plan, carried out. Compute thread only.
  std::optional<StageExecutor> executor_;

  mutable absl::Mutex mu_;
  absl::CondVar cv_;
  std::deque<Input> activations_ ABSL_GUARDED_BY(mu_);  // in arrival order
  std::deque<Input> gradients_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, torch::Tensor> targets_ ABSL_GUARDED_BY(mu_);
  bool paused_ ABSL_GUARDED_BY(mu_) = false;  // the activation inbox was full
  // Ids only increase on the upstream and target sources (the coordinator
  // numbers them in feed order): the newest seen on each.
  uint64_t last_activation_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t last_targets_ ABSL_GUARDED_BY(mu_) = 0;
  // Training activations sent downstream whose gradient has not arrived,
  // with the shape sent, and the newest id sent.
  std::map<uint64_t, std::vector<int64_t>> awaiting_gradient_ ABSL_GUARDED_BY(mu_);
  uint64_t last_sent_ ABSL_GUARDED_BY(mu_) = 0;
  // RequestCut's step until the compute thread took it, then whether it is
  // done and why it was refused.
  int64_t cut_request_ ABSL_GUARDED_BY(mu_) = 0;
  bool cut_pending_ ABSL_GUARDED_BY(mu_) = false;
  std::string cut_error_ ABSL_GUARDED_BY(mu_);
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  std::string stop_reason_ ABSL_GUARDED_BY(mu_);
  int64_t nonfinite_skipped_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<bool> trained_{false};  // set by the compute thread
};

}  // namespace pipemare

#endif  // PIPEMARE_PIPELINE_STAGE_MACHINE_H_
