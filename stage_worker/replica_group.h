// ReplicaGroup: one stage's all-reduce group across the job's
// schedule.replicas pipelines. c10d's ProcessGroupGloo (rank = the replica)
// over a c10d TCPStore that replica 0's stage serves; the coordinator hands
// its address to the other replicas' assignments (the rendezvous goes
// through the coordinator). Before each optimizer step the stage averages
// its gradients with the group: one all-reduce of the flattened gradients.
//
// The group's sockets are Gloo's plaintext TCP (as schedule.transport gloo);
// docs/security.md says so.
#ifndef PIPEMARE_STAGE_WORKER_REPLICA_GROUP_H_
#define PIPEMARE_STAGE_WORKER_REPLICA_GROUP_H_

#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "pipemare/v1/pipemare.pb.h"

namespace c10d {
class Store;
class ProcessGroup;
}  // namespace c10d

namespace pipemare {

class ReplicaGroup {
 public:
  // Null when a.replicas() <= 1. Replica 0 starts serving the store on a
  // free port (Address()); the others need a.collective_address().
  // `self_address`: host:port the worker advertises (the store and Gloo's
  // pairs bind on its host).
  static absl::StatusOr<std::unique_ptr<ReplicaGroup>> Create(const v1::StageAssignment& a,
                                                              const std::string& self_address);
  ~ReplicaGroup();

  // host:port of the store (replica 0).
  std::string Address() const;
  // Joins the group; blocks until every replica has, at most `timeout`
  // (also the bound on each all-reduce). The compute thread, before its
  // first action.
  absl::Status Connect(std::chrono::milliseconds timeout);
  // Averages `grads` (defined, contiguous or not) across the replicas in
  // place. Throws (c10::Error, std::exception) when a replica is gone, or
  // once Abort() was called.
  void Average(const std::vector<torch::Tensor>& grads);
  // Ends a waiting Average at once (the stage stops: a replica that will
  // never join this all-reduce must not hold it for the group's timeout).
  // The abandoned collective finishes or times out on a thread of its own.
  void Abort() { aborted_ = true; }

  int64_t allreduces() const { return allreduces_.load(); }
  double seconds() const { return seconds_.load(); }
  int64_t bytes() const { return bytes_.load(); }

 private:
  ReplicaGroup() = default;
  int rank_ = 0, size_ = 1;
  std::string bind_host_, address_;
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::atomic<int64_t> allreduces_{0}, bytes_{0};
  std::atomic<double> seconds_{0};
  std::atomic<bool> aborted_{false};
};

}  // namespace pipemare

#endif  // PIPEMARE_STAGE_WORKER_REPLICA_GROUP_H_
