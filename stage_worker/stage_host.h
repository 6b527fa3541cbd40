// StageHost: runs one stage assignment on a worker. It owns the stage runtime,
// its Pipe streams (common/pipe_stream.h: the one to the downstream stage,
// opened in Start, and the incoming ones from the upstream stage or the
// coordinator's feeds, attached by WorkerService), and the compute thread
// that executes the schedule.
//
// Threads (so that compute, sends and receives overlap):
//   - compute thread: takes activations/gradients from the inbox, calls the
//     runtime, and queues what it produces on the right stream, which writes
//     it from gRPC's own reactions (no sender thread of ours). The only
//     caller of the runtime's mutators.
//   - gRPC's callback threads: decode each arriving message and put it in
//     the inbox, without blocking. The activation inbox is bounded: when it
//     is full the upstream stream stops reading until the compute thread
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
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "common/pipe_stream.h"
#include "pipeline/checkpoint_units.h"
#include "pipeline/schedule.h"
#include "pipeline/stage_executor.h"
#include "pipeline/stage_runtime.h"
#include "pipemare/v1/pipemare.grpc.pb.h"
#include "stage_worker/data_plane.h"
#include "stage_worker/stage_metrics.h"

namespace pipemare {

// A cut this stage wrote, kept in host memory with the files it became.
struct RetainedCut {
  std::shared_ptr<const StageSnapshot> snapshot;
  std::vector<WrittenFile> files;  // files[i] holds snapshot->units[i]
};
// The unit state in `memory` that was written to exactly `file` (path and
// SHA-256), or null.
const UnitState* FindRetainedUnit(const std::vector<RetainedCut>* memory,
                                  const v1::CheckpointFile& file);

class StageHost {
 public:
  // Builds the stage and, unless it is the last, opens the stream to
  // a.downstream_address() (which must already have its stage loaded).
  // `self_address` only labels error messages. `metrics` (not null) receives
  // the stage's timings, traffic and stats. `virtual_device`: see
  // pipeline/stage_runtime.h (benchmarks only). `memory` (optional): cuts a
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
  // committed step and at most kNewerCuts after it.
  std::vector<RetainedCut> Retained() const;
  // The coordinator committed the cut at `step`: older cuts leave memory.
  void NoteCommitted(int64_t step);
  // Whether every restored unit came from memory.
  bool restored_from_memory() const { return restored_from_memory_; }
  int64_t generation() const { return assignment_.generation(); }

 private:
  explicit StageHost(const v1::StageAssignment& a, const std::string& self_address);

  enum class Side { kNone, kUpstream, kDownstream, kTargets };
  static constexpr int kSides = 4;

  struct Event {
    bool gradient = false;  // else an activation
    uint64_t microbatch = 0;
    v1::Phase phase = v1::TRAIN;
    torch::Tensor tensor;
    bool cut = false;  // CutAt's request (at `step`); no tensor
    int64_t step = 0;
    // Dropped (train.on_nonfinite: skip): a NaN or Inf arrived in it here, or
    // it came flagged from upstream; `tensor` then holds zeros.
    bool skipped = false;
    // Its bytes still arrive over the data plane from `from` (schedule.
    // transport "gloo"): `tensor` is their wire-dtype buffer until Arrive().
    std::shared_ptr<DataPlaneEdge::Receive> arriving;
    Side from = Side::kNone;
  };

  void ComputeLoop();
  // A message arrived on `side` (a gRPC reaction: never blocks). False
  // pauses that stream (a full inbox).
  bool OnMessage(Side side, absl::StatusOr<PipeMessage> message);
  // `side`'s stream ended.
  void OnStreamEnd(Side side, const grpc::Status& status);
  bool NextEvent(Event* event);
  // Compute thread, before `event` is processed: waits for bytes still
  // arriving over the data plane, then converts them to ReceiveAs() and
  // checks them for NaN and Inf (train.on_nonfinite), as OnMessage does for
  // bytes that came on the stream.
  absl::Status Arrive(Event* event);
  // Compute thread, first: connects each data-plane edge (schedule.transport
  // "gloo") once its stream is there.
  absl::Status ConnectDataPlane();
  // The tensor of `message` from `side`: from the stream's bytes (converted
  // to ReceiveAs()), or, when they come over the data plane, an empty
  // wire-dtype tensor of the header's shape with its receive posted in
  // `arriving`. A gRPC reaction: never blocks.
  absl::StatusOr<torch::Tensor> ReceiveTensor(Side side, const PipeMessage& message,
                                              std::shared_ptr<DataPlaneEdge::Receive>* arriving);
  absl::Status Process(const Event& event);
  absl::Status HandleActivation(const Event& event);
  absl::Status HandleGradient(const Event& event);
  // Runs and sends what the plan's next actions produce without input
  // (steps; the last stage's backwards).
  absl::Status RunLocal();
  // Queues `message` (and `payload`, its tensor's data) on the side's stream,
  // blocking while its queue is full; an error once that side broke or the
  // host stops.
  // Under schedule.transport "gloo" a peer's tensor bytes go over its edge
  // after the header (Tensor.data_plane_bytes).
  absl::Status Send(Side side, v1::StageMessage message, WirePayload payload = {});
  std::shared_ptr<PipeStream> Link(Side side) const;
  // "downstream stage 3 at host:port", "input feed from the coordinator"...
  std::string SideName(Side side) const;
  // The type received activations and gradients are computed in: float32
  // when schedule.wire_dtype compresses them, else as they arrive.
  std::optional<torch::ScalarType> ReceiveAs() const {
    return wire_dtype_ ? std::optional(torch::kFloat32) : std::nullopt;
  }
  // Marks the host failed with `message`; tells every side but `from`.
  // `code`: how the coordinator takes it (StageError.code): UNAVAILABLE lets
  // recovery restart the job, anything else fails it.
  void Fail(const std::string& message, Side from = Side::kNone,
            absl::StatusCode code = absl::StatusCode::kUnavailable);
  // What is wrong with activation `t` of microbatch `id` (`header`: its
  // wire dtype), or "" when it has the dtype and example shape this stage
  // takes (schedule.wire_dtype; the shape pass's input of its first unit).
  std::string CheckActivation(uint64_t id, const v1::Tensor& header, const torch::Tensor& t) const;
  // A NaN or Inf arrived in microbatch `id`'s `what` from `side`: under
  // train.on_nonfinite: fail, fails the job naming the stage, microbatch and
  // step and returns false; under skip, counts it and returns true (the
  // caller drops the microbatch).
  bool OnNonFinite(uint64_t id, const std::string& what, Side side);

  const v1::StageAssignment assignment_;
  const std::string self_address_;
  std::unique_ptr<StageRuntime> runtime_;
  std::shared_ptr<StageMetrics> metrics_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  // Each side's stream (downstream: opened in Start; upstream and targets:
  // attached by WorkerService), null until then. GUARDED_BY(mu_)
  std::shared_ptr<PipeStream> link_[kSides];
  bool upstream_paused_ = false;  // the inbox was full; GUARDED_BY(mu_)
  // The data plane of the upstream and downstream edges (schedule.transport
  // other than "grpc"; stage_worker/data_plane.h; else null). Set in Start, before any stream:
  // never reassigned.
  std::unique_ptr<DataPlaneEdge> edge_[kSides];
  std::deque<Event> activations_;
  std::deque<Event> gradients_;
  std::map<uint64_t, torch::Tensor> targets_;
  // Microbatch ids only increase on the upstream and target streams (the
  // coordinator numbers them in feed order): the newest seen on each.
  uint64_t last_activation_ = 0, last_targets_ = 0;
  // Training activations sent downstream whose gradient has not arrived,
  // with the shape sent (a gradient must have it), and the newest id sent.
  std::map<uint64_t, std::vector<int64_t>> awaiting_gradient_;
  uint64_t last_sent_ = 0;
  std::atomic<int64_t> nonfinite_skipped_{0};
  const bool skip_nonfinite_;  // train.on_nonfinite: skip
  std::string error_;
  int64_t cut_request_ = 0;  // CutAt's step, until the compute thread took it
  std::string cut_error_;
  size_t inbox_capacity_ = 0;                    // activations waiting, at most
  std::optional<torch::ScalarType> wire_dtype_;  // schedule.wire_dtype

  // The order of work is the plan, carried out by the executor: a stage
  // waits for exactly the input its next action needs. Compute thread only
  // (set in Start).
  std::optional<StageExecutor> executor_;
  // Sends what an executed action produced (activation, gradient, loss,
  // done) and records its metrics.
  // `skipped`: the microbatch was dropped (StageMessage.skipped).
  absl::Status Emit(const StageExecutor::Output& out, v1::Phase phase, bool skipped = false);

  // Checkpoints: the executor hands each cut's snapshot (host memory) to
  // this thread, which writes it while the stage trains on
  // (pipeline/checkpoint.h) and records what it wrote for Status().
  void CheckpointLoop();
  void QueueCut(std::shared_ptr<const StageSnapshot> snapshot);
  std::thread checkpoint_thread_;
  mutable std::mutex checkpoint_mu_;
  std::condition_variable checkpoint_cv_;
  std::deque<std::shared_ptr<const StageSnapshot>> checkpoint_queue_;  // GUARDED_BY(checkpoint_mu_)
  v1::CheckpointWritten checkpoint_written_;                           // GUARDED_BY(checkpoint_mu_)
  // Cuts written but not yet committed that stay in memory beside the
  // committed one: commits lag the stages (the coordinator polls every
  // 250 ms and verifies each cut's files), so a stage can be cuts ahead of
  // the newest commit when cuts are frequent.
  static constexpr size_t kNewerCuts = 3;
  // Cuts taken but not yet being written, at most.
  static constexpr size_t kMaxQueuedCuts = 2;
  void PruneRetainedLocked();
  std::deque<RetainedCut> retained_;  // GUARDED_BY(checkpoint_mu_), oldest first
  int64_t committed_step_ = 0;        // GUARDED_BY(checkpoint_mu_)
  bool restored_from_memory_ = false;
  bool checkpoint_stop_ = false;  // GUARDED_BY(checkpoint_mu_)

  std::atomic<bool> stopping_{false};
  std::atomic<bool> failed_{false};
  std::thread compute_thread_;
};

}  // namespace pipemare

#endif  // PIPEMARE_STAGE_WORKER_STAGE_HOST_H_
