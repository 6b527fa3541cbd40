// The seam between a stage and how tensor bytes cross one pipeline edge
// (schedule.transport). The edge's Pipe stream (common/pipe_stream.h) always
// carries every message's header, order and control; a DataPlaneEdge, when
// the job names one, carries only the bytes of the tensors, from and into
// their storage:
//   - "grpc" (default): no edge; the bytes ride in the stream's messages;
//   - "gloo": GlooEdge (stage_worker/gloo_edge.h), Gloo's TCP pairs.
// A device-to-device transport for GPU hosts (NCCL) would be one more
// implementation here, with StageHost and the schedules unchanged.
//
// Contract, for every implementation:
//   - rendezvous over the stream: what one end must tell the other to
//     connect goes through `SendKey` and arrives through OnPeerKey;
//   - it carries the tensors of schedule.data_plane_min_bytes and more
//     (kDataPlaneMinBytes unset); smaller ones ride the stream, and the
//     header says which (Tensor.data_plane_bytes set or not);
//   - a tensor's bytes are matched by Tag(microbatch, direction): the
//     receiver posts the receive when the tensor's header arrives on the
//     stream (Tensor.data_plane_bytes) and the compute thread Waits for it
//     before reading the tensor;
//   - failures come back as UNAVAILABLE, so a broken edge fails the stage
//     as a broken stream does and recovery takes over;
//   - Abort() wakes every wait at once (the stage stops or failed).
#ifndef PIPEMARE_STAGE_WORKER_DATA_PLANE_H_
#define PIPEMARE_STAGE_WORKER_DATA_PLANE_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "pipeline/core/settings.h"

namespace pipemare {

class DataPlaneEdge {
 public:
  // Sends one rendezvous key to the peer (on the Pipe stream). Called from
  // Connect's thread; may block.
  using SendKey = std::function<absl::Status(const std::string& key, const std::string& value)>;
  struct Options {
    int rank = 0;           // 0: the upstream end of the edge, 1: the downstream end
    std::string bind_host;  // this host's address the peer reaches (a name or an IP)
    std::chrono::milliseconds connect_timeout{30000};
    // How long one send or receive may wait for its peer before the edge
    // fails. A send waits only when `max_sends_in_flight` are pending, i.e.
    // for a receiver that stopped reading.
    std::chrono::milliseconds wait_timeout{600000};
    size_t max_sends_in_flight = 8;
    std::string name;  // "edge 1-2", for messages
  };
  // A posted receive; Wait() for it before reading its memory.
  class Receive {
   public:
    virtual ~Receive() = default;
  };

  virtual ~DataPlaneEdge() = default;

  // The peer's rendezvous key arrived (a gRPC reaction; never blocks).
  virtual absl::Status OnPeerKey(const std::string& key, const std::string& value) = 0;
  // Connects to the peer: returns once both ends are connected, or
  // UNAVAILABLE (timed out, aborted, unreachable).
  virtual absl::Status Connect() = 0;
  // Sends `size` bytes at `data` under `tag`; `owner` keeps them alive until
  // the peer has them. Returns once posted; waits only while
  // max_sends_in_flight earlier sends are not yet received.
  virtual absl::Status Send(uint64_t tag, const void* data, size_t size,
                            std::shared_ptr<const void> owner) = 0;
  // Posts the receive of `size` bytes into `data` under `tag` (a gRPC
  // reaction: never blocks); `owner` keeps the memory alive until then.
  virtual std::shared_ptr<Receive> PostReceive(uint64_t tag, void* data, size_t size,
                                               std::shared_ptr<void> owner) = 0;
  // Waits until `receive`'s bytes are in its memory: UNAVAILABLE when the
  // edge broke, the wait timed out or the edge was aborted.
  virtual absl::Status Wait(Receive& receive) = 0;
  // Wakes every wait of this edge (Connect, Send, Wait) with `why`; every
  // later call fails. Any thread; idempotent.
  virtual void Abort(const std::string& why) = 0;

  // The slot of a tensor: one per microbatch and direction.
  static uint64_t Tag(uint64_t microbatch, bool gradient) {
    return microbatch * 2 + (gradient ? 1 : 0);
  }
};

// schedule.data_plane_min_bytes when unset: a tensor of fewer bytes rides
// the Pipe stream even on a data plane, since the data plane's rendezvous
// (the receiver's ready notice before the bytes) costs more than it saves
// below this (docs/benchmarks.md, "Eager below, rendezvous above").
inline constexpr int64_t kDataPlaneMinBytes = int64_t{2} << 20;

// The edge for schedule.transport `transport`: null for grpc (the stream
// carries the bytes); FAILED_PRECONDITION naming the fix when this build
// lacks it. (An unknown name never gets here: ParseTransport refuses it.)
absl::StatusOr<std::unique_ptr<DataPlaneEdge>> MakeDataPlaneEdge(Transport transport,
                                                                 DataPlaneEdge::Options options,
                                                                 DataPlaneEdge::SendKey send_key);

}  // namespace pipemare

#endif  // PIPEMARE_STAGE_WORKER_DATA_PLANE_H_
