// A stage's links to its neighbours, one per side: the Pipe stream
// (common/pipe_stream.h) to the downstream stage, opened here, and the
// incoming ones from the upstream stage or the coordinator's feeds, attached
// by WorkerService; and, under schedule.transport "gloo", the data plane
// (stage_worker/data_plane.h) that carries a large tensor's bytes beside its
// header on the stream. Everything that crosses a side goes through here:
// tensors in (ReceiveTensor, Wait) and out (Send), and the error that tells
// every neighbour a stage failed.
#ifndef PIPEMARE_STAGE_WORKER_STAGE_LINKS_H_
#define PIPEMARE_STAGE_WORKER_STAGE_LINKS_H_

#include <grpcpp/grpcpp.h>
#include <torch/torch.h>

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "common/pipe_stream.h"
#include "pipemare/v1/pipemare.grpc.pb.h"
#include "stage_worker/data_plane.h"
#include "stage_worker/stage_metrics.h"
#include "stage_worker/tensor_wire.h"

namespace pipemare {

class StageLinks {
 public:
  enum class Side { kNone, kUpstream, kDownstream, kTargets };
  // What a side's stream delivers: each message (false pauses reading: a
  // full inbox) and its end. gRPC reactions: never block.
  using OnMessage = std::function<bool(Side, absl::StatusOr<PipeMessage>)>;
  using OnEnd = std::function<void(Side, const grpc::Status&)>;

  // The links of the stage of `a` at `self_address` (which only labels
  // messages and binds the data plane); `window`: messages a stream queues
  // at most. No I/O until Open.
  StageLinks(const v1::StageAssignment& a, std::string self_address,
             std::shared_ptr<StageMetrics> metrics, size_t window, OnMessage on_message,
             OnEnd on_end);
  ~StageLinks();
  StageLinks(const StageLinks&) = delete;
  StageLinks& operator=(const StageLinks&) = delete;

  // Creates the data plane of each neighbour edge whose tensors are large
  // enough (schedule.transport other than "grpc"), then opens the stream to
  // the downstream stage (every stage but the last; it must already have
  // its stage loaded). INVALID_ARGUMENT naming a missing field,
  // UNAVAILABLE when the downstream stage cannot be reached.
  absl::Status Open();
  // Takes an incoming stream whose first message, `open`, was read: checks
  // its generation (fencing) and role, then delivers its messages. Does not
  // block (a gRPC reaction calls it).
  grpc::Status Attach(const v1::StreamOpen& open, std::shared_ptr<PipeStream> stream);
  // Connects each data-plane edge once its stream is there, both at once.
  // The compute thread's first call.
  absl::Status ConnectDataPlane();

  // The peer's data-plane rendezvous key arrived on `side`'s stream.
  absl::Status OnPeerKey(Side side, const v1::DataPlaneKey& key);
  // The tensor of `message` from `side`: from the stream's bytes (converted
  // to ReceiveAs()), or, when they come over the data plane, an empty
  // wire-dtype tensor of the header's shape with its receive posted in
  // `arriving`. A gRPC reaction: never blocks.
  absl::StatusOr<torch::Tensor> ReceiveTensor(Side side, const PipeMessage& message,
                                              std::shared_ptr<void>* arriving);
  // Waits for the bytes of `arriving` (from ReceiveTensor) into `tensor`,
  // then converts it to ReceiveAs().
  absl::Status Wait(Side side, const std::shared_ptr<void>& arriving, torch::Tensor* tensor);
  // Queues `message` (and `payload`, its tensor's data) on the side's
  // stream, blocking while its queue is full; an error once that side broke
  // or the links closed. A tensor of at least data_plane_min_bytes goes over
  // the side's data plane after its header (Tensor.data_plane_bytes).
  absl::Status Send(Side side, v1::StageMessage message, WirePayload payload = {});
  // Ends the side's stream with `status` (a peer's bad message).
  void CloseWith(Side side, const grpc::Status& status);
  // A paused stream (a full inbox) reads on.
  void ResumeReading(Side side);

  // The stage fails or stops: Attach refuses, ConnectDataPlane and every
  // data-plane wait return. Idempotent.
  void Abort(const std::string& why);
  // Sends `message` on every side but `from`, ahead of anything queued and
  // nothing after it (a StageError).
  void SendLast(Side from, const v1::StageMessage& message);
  // Cancels every stream and waits until none calls back. Idempotent.
  void CloseAndWait();

  // "downstream stage 3 at host:port", "input feed from the coordinator"...
  std::string SideName(Side side) const;
  // schedule.wire_dtype: what tensors are sent in (nullopt: as computed).
  const std::optional<torch::ScalarType>& wire_dtype() const { return wire_dtype_; }
  // The type received activations and gradients are computed in: float32
  // when schedule.wire_dtype compresses them, else as they arrive.
  std::optional<torch::ScalarType> ReceiveAs() const {
    return wire_dtype_ ? std::optional(torch::kFloat32) : std::nullopt;
  }

 private:
  static constexpr int kSides = 4;
  std::shared_ptr<PipeStream> Link(Side side) const;
  DataPlaneEdge* Edge(Side side) const;
  PipeStream::Callbacks CallbacksFor(Side side);

  const v1::StageAssignment assignment_;
  const std::string self_address_;
  const std::shared_ptr<StageMetrics> metrics_;
  const size_t window_;
  const OnMessage on_message_;
  const OnEnd on_end_;
  const std::optional<torch::ScalarType> wire_dtype_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  // Each side's stream, null until opened or attached. Under mu_.
  std::shared_ptr<PipeStream> link_[kSides];
  bool aborted_ = false;  // under mu_
  // The data plane of the upstream and downstream edges, else null. Set in
  // Open, before any stream: never reassigned.
  std::unique_ptr<DataPlaneEdge> edge_[kSides];
};

}  // namespace pipemare

#endif  // PIPEMARE_STAGE_WORKER_STAGE_LINKS_H_
