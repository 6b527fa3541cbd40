// JobStore: every job's JobStatus, with a version per job so watchers can wait
// for changes, optionally persisted in a state directory's SQLite database
// (state.db: WAL journal, synchronous=FULL, one transaction per change), so a
// restarted coordinator still answers for every job and runs on the ones it
// was running. Each row holds the job's whole status as JSON: its spec,
// state, stages and their workers, and its newest checkpoint's manifest.
//
// Job lifecycle (UpdateState is its only mutator; CanMove is its table; see
// JobState in the proto):
//   PENDING -> RUNNING -> SUCCEEDED | FAILED | CANCELLED;  PENDING -> CANCELLED;
//   RUNNING -> RECOVERING -> RUNNING | FAILED | CANCELLED  (a lost worker);
//   FAILED | CANCELLED -> PENDING (resume from the newest checkpoint)
//
// Thread-safe.
#ifndef PIPEMARE_COORDINATOR_JOB_STORE_H_
#define PIPEMARE_COORDINATOR_JOB_STORE_H_

#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "pipemare/v1/pipemare.pb.h"

struct sqlite3;

namespace pipemare {

bool IsTerminal(v1::JobState state);
// Whether the lifecycle allows `from` -> `to`.
bool CanMove(v1::JobState from, v1::JobState to);
int64_t NowUnixMs();

class JobStore {
 public:
  // Memory only.
  JobStore() = default;
  // Opens (creating it if needed) `state_dir`/state.db and loads its jobs: a
  // job that was RUNNING or RECOVERING when the previous coordinator stopped
  // goes back to PENDING and continues from its newest checkpoint when it
  // runs (from its first step if it had none); PENDING jobs stay PENDING.
  // Job files of older versions (<state_dir>/job-*.json) are imported once.
  // An error names the file and what is wrong with it.
  static absl::StatusOr<std::unique_ptr<JobStore>> Open(const std::string& state_dir);
  ~JobStore();
  JobStore(const JobStore&) = delete;
  JobStore& operator=(const JobStore&) = delete;

  // Stores a new PENDING job for `spec` and returns its status.
  v1::JobStatus Create(const v1::JobSpec& spec);
  absl::StatusOr<v1::JobStatus> Get(const std::string& id) const;
  std::vector<v1::JobStatus> List() const;
  // PENDING job ids, oldest first.
  std::vector<std::string> Pending() const;

  // Moves a job along its lifecycle; refuses a move CanMove does not allow
  // (FAILED_PRECONDITION). Stamps start/finish times.
  absl::Status UpdateState(const std::string& id, v1::JobState state, const std::string& reason);
  // Changes anything but the state (progress, metrics, stages), durably.
  absl::Status Update(const std::string& id, const std::function<void(v1::JobStatus&)>& fn);
  // Changes a running job's progress and live metrics only, in memory:
  // watchers see it at once and nothing waits on the disk (a runner
  // publishes every 250 ms). It reaches the disk with the job's next durable
  // change; after a crash the resumed run publishes it again.
  absl::Status UpdateProgress(const std::string& id,
                              const std::function<void(v1::JobProgress&, v1::JobMetrics&)>& fn);

  // Blocks until job `id`'s version differs from `*version` or `timeout`
  // passes; then sets *version and returns the status.
  absl::StatusOr<v1::JobStatus> WaitForChange(const std::string& id, uint64_t* version,
                                              std::chrono::milliseconds timeout) const;
  // Job `id`'s version (0: no such job), and its status when that is newer
  // than `known` (nothing is copied otherwise).
  uint64_t VersionIfNewer(const std::string& id, uint64_t known, v1::JobStatus* status) const;
  // Blocks until any job changed since the store's change count was
  // `seen`, or `timeout` passes; returns the change count now.
  uint64_t WaitForAnyChange(uint64_t seen, std::chrono::milliseconds timeout) const;

  // The worker registry's durable part (WorkerRegistry::Persist/Restore):
  // one row per worker id in the same database, written in one transaction.
  // A memory-only store keeps and returns nothing.
  void SaveWorker(const v1::WorkerInfo& info, const std::string& instance_id, bool forget);
  std::vector<std::pair<v1::WorkerInfo, std::string>> Workers() const;

 private:
  struct Entry {
    v1::JobStatus status;
    uint64_t version = 1;
  };
  // Writes the job's row in one transaction (REQUIRES: mu_ held). A failed
  // write is logged and counted; the job goes on in memory.
  void Persist(const v1::JobStatus& status);
  // Moves a job the previous coordinator was running back to PENDING.
  static void Reload(v1::JobStatus& status);

  std::string db_path_;
  ::sqlite3* db_ = nullptr;  // null: memory only
  int lock_fd_ = -1;         // --state-dir/coordinator.lock, flock'ed while open
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::map<std::string, Entry> jobs_;  // GUARDED_BY(mu_)
  uint64_t changes_ = 0;               // every job's changes; GUARDED_BY(mu_)
  int64_t next_id_ = 1;
};

}  // namespace pipemare

#endif  // PIPEMARE_COORDINATOR_JOB_STORE_H_
