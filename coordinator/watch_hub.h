// WatchJob without a thread per watcher: each `pipemarectl watch` is a
// callback-API stream (grpc::ServerWriteReactor) that holds no thread while
// it waits, and one hub thread wakes on every change in the job store and
// writes the newest status to each watcher whose previous write is done (a
// slow watcher skips versions; it never queues them). Each status version is
// serialized once for all its watchers. Watches are bounded per caller, so
// one client cannot take what the workers' heartbeats and other clients
// need.
#ifndef PIPEMARE_COORDINATOR_WATCH_HUB_H_
#define PIPEMARE_COORDINATOR_WATCH_HUB_H_

#include <grpcpp/grpcpp.h>

#include <condition_variable>
#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include "coordinator/job_store.h"
#include "pipemare/v1/pipemare.pb.h"

namespace pipemare {

class WatchHub {
 public:
  // Watches of `store`'s jobs, at most `max_per_caller` open at once per
  // caller (CallerName; "anonymous" on a plaintext cluster).
  WatchHub(const JobStore* store, size_t max_per_caller);
  // Stop().
  ~WatchHub();
  WatchHub(const WatchHub&) = delete;
  WatchHub& operator=(const WatchHub&) = delete;

  // The reactor of one WatchJob call (gRPC owns it and deletes it when done):
  // the job's status now, then each newer one, until the job ends (OK), the
  // caller goes away, or the hub stops (UNAVAILABLE). NOT_FOUND for no such
  // job; RESOURCE_EXHAUSTED past the caller's bound.
  grpc::ServerWriteReactor<v1::JobEvent>* Watch(grpc::CallbackServerContext* context,
                                                const v1::WatchJobRequest* request);
  // Ends every watch (UNAVAILABLE) and the hub thread. Idempotent.
  void Stop();
  // Watches open now.
  size_t watchers() const;

 private:
  class Watcher;
  friend class Watcher;
  void Loop();
  // Under mu_: what to do next for `w` (a write of a newer status, a finish,
  // or nothing); the caller does it after releasing mu_.
  struct Step {
    Watcher* watcher = nullptr;
    std::shared_ptr<const v1::JobEvent> write;
    bool finish = false;
    grpc::Status status;
  };
  Step NextStepLocked(Watcher* w);
  void Do(const Step& step);
  // Reactions.
  void WriteDone(Watcher* w, bool ok);
  void Cancelled(Watcher* w);
  void Done(Watcher* w);
  // The event of job `id` at its newest version, shared by its watchers;
  // its version (0: no such job).
  uint64_t EventLocked(const std::string& id, std::shared_ptr<const v1::JobEvent>* event,
                       bool* terminal);

  const JobStore* const store_;
  const size_t max_per_caller_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::set<Watcher*> watchers_;               // under mu_
  std::map<std::string, size_t> per_caller_;  // under mu_
  struct Cached {
    uint64_t version = 0;
    std::shared_ptr<const v1::JobEvent> event;
    bool terminal = false;
  };
  std::map<std::string, Cached> cache_;  // by job id; under mu_
  bool stop_ = false;                    // under mu_
  std::thread thread_;
};

}  // namespace pipemare

#endif  // PIPEMARE_COORDINATOR_WATCH_HUB_H_
