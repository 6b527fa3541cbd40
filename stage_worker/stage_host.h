// StageHost: runs one stage assignment on a worker. It owns the stage
// runtime, the stage machine that decides what the stage does with what
// arrives (pipeline/runtime/stage_machine.h), the stage's links to its neighbours
// (stage_worker/stage_links.h), the checkpoint writer
// (stage_worker/cut_writer.h), and the compute thread.
//
// Threads (so that compute, sends and receives overlap):
//   - compute thread: takes from the machine the input the plan's next
//     action needs, runs it, and queues what it produces on the right link,
//     which writes it from gRPC's own reactions (no sender thread of ours).
//     The only caller of the runtime's mutators.
//   - gRPC's callback threads: decode each arriving message and offer it to
//     the machine, without blocking. The activation inbox is bounded: when
//     it is full the upstream stream stops reading until the compute thread
//     takes one, and HTTP/2 flow control pushes back on the sender.
//   - the checkpoint writer.
// Any failure (a broken stream, a bad tensor, a LibTorch error) marks the host
// failed, tells every neighbour with a StageError so the failure reaches the
// coordinator's feeds at once, and stops the compute thread.
#ifndef PIPEMARE_STAGE_WORKER_STAGE_HOST_H_
#define PIPEMARE_STAGE_WORKER_STAGE_HOST_H_

#include <grpcpp/grpcpp.h>
#include <torch/torch.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/pipe_stream.h"
#include "pipeline/runtime/stage_machine.h"
#include "pipeline/runtime/stage_runtime.h"
#include "pipemare/v1/pipemare.grpc.pb.h"
#include "stage_worker/cut_writer.h"
#include "stage_worker/replica_group.h"
#include "stage_worker/stage_data.h"
#include "stage_worker/stage_links.h"
#include "stage_worker/stage_metrics.h"

namespace pipemare {

class StageHost {
 public:
  // Builds the stage and, unless it is the last, opens the stream to
  // a.downstream_address() (which must already have its stage loaded).
  // `self_address` only labels error messages. `metrics` (not null) receives
  // the stage's timings, traffic and stats. `virtual_device`: see
  // pipeline/runtime/stage_runtime.h (benchmarks only). `memory` (optional): cuts a
  // previous stage of this worker kept; units of a.restore() found there are
  // restored from memory instead of disk.
  static absl::StatusOr<std::shared_ptr<StageHost>> Start(
      const v1::StageAssignment& a, torch::Device device, const std::string& self_address,
      std::shared_ptr<StageMetrics> metrics, VirtualDevice virtual_device = {},
      const std::vector<RetainedCut>* memory = nullptr);
  ~StageHost();
  StageHost(const StageHost&) = delete;
  StageHost& operator=(const StageHost&) = delete;

  const std::string& job_id() const { return assignment_.job_id(); }
  int stage() const { return assignment_.stage(); }

  // Takes an incoming stream whose first message, `open`, was read: sets
  // its callbacks, or returns why it is refused. Does not block (a gRPC
  // reaction calls it).
  grpc::Status Attach(const v1::StreamOpen& open, std::shared_ptr<PipeStream> stream);

  // Stops threads and cancels every stream. Idempotent; safe from any thread
  // except the host's own.
  void Stop();

  bool failed() const { return failed_.load(); }
  // Adds a cut at the end of step `step` (StageExecutor::CutAt), handed to
  // the compute thread between two of its actions; returns once it took it.
  // FAILED_PRECONDITION when the stage is past `step`.
  absl::Status CutAt(int64_t step);
  v1::StageStatusResponse Status() const;
  StageStats Stats() const { return runtime_->Stats(); }
  // The cuts this stage keeps in memory: the newest at or before the job's
  // committed step and at most a few after it (CutWriter::Retained).
  std::vector<RetainedCut> Retained() const;
  // The coordinator committed the cut at `step`: older cuts leave memory.
  void NoteCommitted(int64_t step);
  // Whether every restored unit came from memory.
  bool restored_from_memory() const { return restored_from_memory_; }
  // Whether the units it did not hold itself all came from a replica's
  // memory (replica_cuts.h).
  bool restored_from_replica() const { return restored_from_replica_; }
  int64_t generation() const { return assignment_.generation(); }
  // Replica 0 with schedule.replicas > 1: where the other replicas of this
  // stage meet for the all-reduce (LoadStageResponse.collective_address).
  std::string collective_address() const {
    return replicas_ && assignment_.replica() == 0 ? replicas_->Address() : std::string();
  }

 private:
  using Side = StageLinks::Side;
  explicit StageHost(const v1::StageAssignment& a, const std::string& self_address);

  void ComputeLoop();
  // A message arrived on `side` (a gRPC reaction: never blocks). False
  // pauses that stream (a full inbox).
  bool OnMessage(Side side, absl::StatusOr<PipeMessage> message);
  // `side`'s stream ended.
  void OnStreamEnd(Side side, const grpc::Status& status);
  // The machine's input of `message` from `side`: its kind, id and tensor
  // (StageLinks::ReceiveTensor). INVALID_ARGUMENT: a message `side` may not
  // send, or a bad tensor. A gRPC reaction: never blocks.
  absl::StatusOr<StageMachine::Input> ToInput(Side side, const PipeMessage& message);
  // The tensor of a DataSlice that arrived on a feed: inputs on stage 0's
  // input feed, targets on the last stage's target feed (StageData).
  absl::StatusOr<torch::Tensor> FromSlice(Side side, const v1::StageMessage& m);
  // Compute thread, before `input` runs: waits for bytes still arriving
  // over the data plane (StageLinks::Wait); the machine then checks them
  // for NaN and Inf, as it did on arrival for bytes that came on the stream.
  absl::Status Arrive(StageMachine::Input* input);
  // Sends what an executed action produced (activation, gradient, loss,
  // done), hands a cut to the writer, and records its metrics. `skipped`:
  // the microbatch was dropped (StageMessage.skipped).
  absl::Status Emit(const StageExecutor::Output& out, v1::Phase phase, bool skipped);
  // "stage 2 (host:port): " + message.
  std::string Labeled(absl::string_view message) const;
  // Marks the host failed with `message`; tells every side but `from`.
  // `code`: how the coordinator takes it (StageError.code): UNAVAILABLE lets
  // recovery restart the job, anything else fails it.
  void Fail(const std::string& message, Side from = Side::kNone,
            absl::StatusCode code = absl::StatusCode::kUnavailable);

  const v1::StageAssignment assignment_;
  const std::string self_address_;
  std::unique_ptr<StageRuntime> runtime_;
  std::shared_ptr<StageMetrics> metrics_;
  // Everything the stage decides: arrival checks, matching, the non-finite
  // policy, cuts. Set in Start.
  std::unique_ptr<StageMachine> machine_;
  std::unique_ptr<StageLinks> links_;  // set in Start
  // Stage 0's and the last stage's own copy of the job's examples (null on
  // the others, or when the feeds carry tensors). Set in Start.
  std::unique_ptr<StageData> data_;
  // schedule.replicas > 1: this stage's all-reduce group. Set in Start,
  // joined by the compute thread.
  std::unique_ptr<ReplicaGroup> replicas_;
  // Writes the cuts the machine takes, and keeps the newest in memory.
  std::unique_ptr<CutWriter> cuts_;
  bool restored_from_memory_ = false;
  bool restored_from_replica_ = false;

  mutable std::mutex error_mu_;
  std::string error_;  // why the host failed; under error_mu_

  std::atomic<bool> stopping_{false};
  std::atomic<bool> failed_{false};
  std::thread compute_thread_;
};

}  // namespace pipemare

#endif  // PIPEMARE_STAGE_WORKER_STAGE_HOST_H_
