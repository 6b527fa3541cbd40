// WorkerRegistry: which stage workers exist, whether they are alive, and which
// job each one serves.
//
//   (RegisterWorker) --> IDLE <--Release-- BUSY
//                          \---Acquire----->/
//   IDLE/BUSY --(no heartbeat for `timeout`)--> LOST   (a later heartbeat
//   gets NOT_FOUND, and the worker registers anew)
//
// Registrations are durable when the coordinator has a state directory
// (Persist/Restore): a restarted coordinator lists every worker it knew,
// LOST until it registers again, and gives it back its id.
//
// Thread-safe.
#ifndef PIPEMARE_COORDINATOR_WORKER_REGISTRY_H_
#define PIPEMARE_COORDINATOR_WORKER_REGISTRY_H_

#include <chrono>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "pipemare/v1/pipemare.pb.h"

namespace pipemare {

class JobStore;

class WorkerRegistry {
 public:
  using Clock = std::chrono::steady_clock;
  explicit WorkerRegistry(std::chrono::milliseconds timeout) : timeout_(timeout) {}

  // Adds a worker and returns its id. A worker registering again with its
  // instance_id keeps its id; an entry with the same address is replaced
  // when it is LOST or has no instance_id (a restart); a live one with
  // another instance_id makes this ALREADY_EXISTS, naming the address and
  // --advertise (two processes claiming one address never evict each other).
  absl::StatusOr<std::string> Register(const v1::RegisterWorkerRequest& request);
  // NOT_FOUND for unknown or LOST workers, and for a worker id registered by
  // another instance (ids restart with the coordinator; the instance does
  // not). An empty `instance_id` skips that check.
  absl::Status Heartbeat(const std::string& worker_id, const std::string& instance_id = "");
  // Marks workers without a recent heartbeat LOST; returns how many.
  int MarkLost();

  std::vector<v1::WorkerInfo> List() const;
  int IdleCount() const;
  // Reserves `n` IDLE workers for `job_id`, or nothing if fewer are idle:
  // element i is the worker that served stage i of the job (ServedStage) if
  // one is idle, else the oldest idle other.
  std::optional<std::vector<v1::WorkerInfo>> Acquire(int n, const std::string& job_id);
  void SetStage(const std::string& worker_id, int stage);
  // Returns the job's BUSY workers to IDLE (a leaving one goes LOST).
  void Release(const std::string& job_id);
  // A worker about to stop: never acquired again; LOST at once when idle,
  // when its job releases it otherwise. Returns its entry (job_id, stage:
  // what it serves now). NOT_FOUND for an unknown or LOST worker.
  absl::StatusOr<v1::WorkerInfo> MarkLeaving(const std::string& worker_id,
                                             const std::string& instance_id);
  bool IsLost(const std::string& worker_id) const;

  // Makes registrations durable in `store`'s database (a coordinator with
  // a --state-dir): the workers a previous coordinator knew come back LOST,
  // each gets its id back when it registers again with its instance id, and
  // new ids come after theirs. From then on every registration is written
  // (and an entry a restarted worker replaced is deleted). Returns how many
  // workers it knew.
  int PersistIn(JobStore* store);
  // Marks a worker LOST now (it refused a connection): it gets no new stage
  // until it heartbeats again and registers anew.
  void MarkUnreachable(const std::string& worker_id);
  // How many times, in all, a worker went LOST for missing heartbeats.
  int64_t HeartbeatMisses() const;
  int64_t Unreachable() const;  // MarkUnreachable calls that found a live entry

 private:
  struct Entry {
    v1::WorkerInfo info;
    std::string instance_id;  // the worker's own id, kept across registrations
    Clock::time_point last_heartbeat;
    int64_t order = 0;
    bool leaving = false;  // MarkLeaving
  };
  // The entry of a registered, not LOST worker (of that instance, unless
  // `instance_id` is empty), or null.
  Entry* FindLive(const std::string& worker_id, const std::string& instance_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The one place a worker's state changes (IDLE, BUSY, LOST): every
  // transition in the diagram above goes through it.
  void SetState(Entry& e, v1::WorkerState to) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::chrono::milliseconds timeout_;
  mutable absl::Mutex mu_;
  std::map<std::string, Entry> workers_ ABSL_GUARDED_BY(mu_);
  int64_t heartbeat_misses_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t unreachable_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  JobStore* store_ ABSL_GUARDED_BY(mu_) = nullptr;  // PersistIn's
};

}  // namespace pipemare

#endif  // PIPEMARE_COORDINATOR_WORKER_REGISTRY_H_
