// GlooEdge: the opt-in data plane of one pipeline edge (schedule.transport
// "gloo"): a two-rank Gloo context (gloo::transport::tcp, the engine c10d's
// ProcessGroupGloo runs on, the same libgloo that Debian's LibTorch loads)
// between the stage above the edge (rank 0) and the one below (rank 1).
//
// Only tensor bytes travel here, sent from and received into tensor storage
// with no copy of ours. Everything else stays on the edge's Pipe stream:
//   - rendezvous: Gloo's store is this edge's own key-value map; a key one
//     end sets is mirrored to the other as a DataPlaneKey message on the
//     Pipe stream (`send_key`), and arrives through OnPeerKey;
//   - order and matching: the stream carries each tensor's header (with
//     Tensor.data_plane_bytes); its bytes go under a Gloo slot (the tag)
//     derived from the microbatch and the direction, so a receive is
//     posted when its header arrives and matches exactly its send.
//
// Why Gloo's own API and not ProcessGroupGloo: a stage must be able to stop
// while a receive waits (a neighbour failed, the job was cancelled), and
// ProcessGroupGloo offers no way to abort a pending wait (its only way out is
// a timeout that poisons the whole group). Gloo's unbound buffers do
// (abortWaitRecv/abortWaitSend): Abort() wakes every wait of this edge.
//
// A broken pair (the peer died) fails its pending and later waits with the
// socket's error; the stage then fails the way a broken stream makes it.
#ifndef PIPEMARE_STAGE_WORKER_GLOO_EDGE_H_
#define PIPEMARE_STAGE_WORKER_GLOO_EDGE_H_

#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "stage_worker/data_plane.h"

namespace gloo {
namespace rendezvous {
class Context;
}
namespace transport {
class UnboundBuffer;
}
}  // namespace gloo

namespace pipemare {

// Whether this build has the Gloo data plane (CMake PIPEMARE_GLOO).
bool GlooAvailable();

class GlooEdge final : public DataPlaneEdge {
 public:
  GlooEdge(Options options, SendKey send_key);
  ~GlooEdge() override;  // Abort()s first
  GlooEdge(const GlooEdge&) = delete;
  GlooEdge& operator=(const GlooEdge&) = delete;

  // INVALID_ARGUMENT for a key set twice, a key over 256 bytes, a value
  // over 64 KiB or more than 16 keys.
  absl::Status OnPeerKey(const std::string& key, const std::string& value) override;
  // Binds a Gloo TCP device on bind_host and connects the pair.
  absl::Status Connect() override;
  absl::Status Send(uint64_t tag, const void* data, size_t size,
                    std::shared_ptr<const void> owner) override;
  std::shared_ptr<DataPlaneEdge::Receive> PostReceive(uint64_t tag, void* data, size_t size,
                                                      std::shared_ptr<void> owner) override;
  absl::Status Wait(DataPlaneEdge::Receive& receive) override;
  void Abort(const std::string& why) override;

 private:
  class Store;
  class Receive;
  struct PendingSend {
    std::shared_ptr<const void> owner;  // outlives the buffer (see Receive)
    std::unique_ptr<gloo::transport::UnboundBuffer> buffer;
  };
  // Waits for the oldest pending send (mu_ not held while waiting).
  absl::Status WaitOldestSend(std::unique_lock<std::mutex>& lock);
  absl::Status Aborted() const;  // mu_ held

  const Options options_;
  std::unique_ptr<Store> store_;
  std::shared_ptr<gloo::rendezvous::Context> context_;
  mutable std::mutex mu_;
  std::string aborted_;  // why, once Abort ran
  bool connected_ = false;
  std::deque<PendingSend> sends_;
  bool waiting_send_ = false;  // a thread waits for sends_.front()
  // Posted before Connect finished; Connect posts them (and notifies).
  std::vector<std::shared_ptr<Receive>> deferred_;
  std::condition_variable connected_cv_;
  // Posted and not yet waited for (Abort wakes them).
  std::map<const Receive*, std::weak_ptr<Receive>> receives_;
};

}  // namespace pipemare

#endif  // PIPEMARE_STAGE_WORKER_GLOO_EDGE_H_
