// JobStore: every job's JobStatus, with a version per job so watchers can wait
// for changes, optionally persisted in a state directory's SQLite database
// (state.db: WAL journal, synchronous=FULL, one transaction per change), so a
// restarted coordinator still answers for every job and runs on the ones it
// was running. Each row holds the job's whole status as JSON: its spec,
// state, stages and their workers, and its newest checkpoint's manifest.
//
// The record has two parts. The durable one (state, spec, origin, plan and
// stages, checkpoint, restarts, epochs) changes only through the named
// mutators below, each one transaction. The volatile one (progress, live
// metrics, each stage's live figures) changes in memory only: watchers see
// it at once and nothing waits on the disk; it reaches the disk with the
// job's next durable change.
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
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
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

  // Durable changes, one per thing that happens to a job. NOT_FOUND for an
  // unknown id.
  //
  // Where it came from (submit --from / --init-from) and who submitted it.
  absl::Status SetOrigin(const std::string& id, const std::string& from_checkpoint,
                         const std::string& init_from, const std::string& submitted_by);
  absl::Status SetReason(const std::string& id, const std::string& reason);
  // `resume`: one more resume, continuing from `from_step`.
  absl::Status MarkResumed(const std::string& id, int64_t from_step);
  // Cuts found damaged and passed over when choosing where to resume.
  absl::Status AddSkippedCuts(const std::string& id, int n);
  // The run's generation (fences stale workers' writes).
  absl::Status SetGeneration(const std::string& id, int64_t generation);
  // A recovery: the spec it runs on from now (stages may have shrunk) and
  // the restart's record.
  absl::Status AddRestart(const std::string& id, const v1::JobSpec& spec,
                          const v1::Restart& restart);
  // The newest restart's figures once known.
  absl::Status SetRecoverSeconds(const std::string& id, double seconds);
  // The job's data as its first run read it (JobStatus.data_files).
  absl::Status SetDataFiles(const std::string& id,
                            const google::protobuf::RepeatedPtrField<v1::DataFile>& files);
  // Workers that restored from their own memory, and from a replica's.
  absl::Status SetRestoredFromMemory(const std::string& id, int stages, int from_replica);
  // A run's plan: its task, partition and stages (replacing any before).
  absl::Status SetPlan(const std::string& id, const std::string& task, const std::string& partition,
                       const std::vector<v1::StageStatus>& stages);
  // What stage `stage`'s worker reported when it loaded.
  absl::Status SetStageLoaded(const std::string& id, int stage, int64_t parameters,
                              bool restored_from_memory, double analytic_delay);
  // A committed cut: the newest checkpoint and how many the job has committed.
  absl::Status SetCheckpoint(const std::string& id, int64_t step, const std::string& manifest,
                             int32_t committed);
  absl::Status ClearEpochs(const std::string& id);
  // A run resuming at the cut at `step` in `epoch`: drops the results of
  // `epoch` and after (they are trained again).
  struct Rewound {
    int32_t committed = 0;  // cuts the job committed so far
    // What an earlier run measured of `epoch` (it stands for the part of
    // the epoch before the cut), if any.
    std::optional<v1::EpochResult> cut_epoch;
  };
  absl::StatusOr<Rewound> RewindTo(const std::string& id, int64_t step, int epoch);
  // An epoch's results; its test figures become the job's metrics.
  absl::Status AddEpoch(const std::string& id, const v1::EpochResult& epoch);

  // Volatile changes (in memory; see above).
  //
  // A running job's progress and live metrics (a runner publishes every
  // 250 ms); after a crash the resumed run publishes them again.
  absl::Status UpdateProgress(const std::string& id,
                              const std::function<void(v1::JobProgress&, v1::JobMetrics&)>& fn);
  // Stage `stage`'s live figures, as its worker reports them.
  absl::Status UpdateStageLive(const std::string& id, int stage,
                               const v1::StageStatusResponse& live);

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
  // Applies `fn` to job `id`'s record (never its state) and, when
  // `durable`, writes it: the one path of every mutator but UpdateState.
  absl::Status Mutate(const std::string& id, bool durable,
                      const std::function<void(v1::JobStatus&)>& fn);
  // Writes the job's row in one transaction. A failed write is logged; the
  // job goes on in memory.
  void Persist(const v1::JobStatus& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A change is visible: wakes every waiter.
  void Changed(Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves a job the previous coordinator was running back to PENDING.
  static void Reload(v1::JobStatus& status);

  std::string db_path_;
  int lock_fd_ = -1;  // --state-dir/coordinator.lock, flock'ed while open
  mutable absl::Mutex mu_;
  ::sqlite3* db_ ABSL_GUARDED_BY(mu_) = nullptr;  // null: memory only
  std::map<std::string, Entry> jobs_ ABSL_GUARDED_BY(mu_);
  uint64_t changes_ ABSL_GUARDED_BY(mu_) = 0;  // every job's changes
  int64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace pipemare

#endif  // PIPEMARE_COORDINATOR_JOB_STORE_H_
