// JobManager: accepts jobs (validating them at the edge), queues them, starts
// a JobRunner for the oldest PENDING job once enough workers are idle,
// recovers a job that lost a worker (RECOVERING: replacement or shrink, then
// on from its newest checkpoint), and records how each job ended. Also marks
// silent workers LOST.
//
// Thread-safe. Owns one scheduler thread and one thread per running job.
#ifndef PIPEMARE_COORDINATOR_JOB_MANAGER_H_
#define PIPEMARE_COORDINATOR_JOB_MANAGER_H_

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/job_runner.h"
#include "coordinator/job_store.h"
#include "coordinator/worker_registry.h"

namespace pipemare {

class JobManager {
 public:
  // One run of job `id` on `workers` until it ends (JobRunner::Run by
  // default); the state machine around it (PENDING, RUNNING, RECOVERING,
  // the end) is this class's. coordinator_test.cc drives that state machine
  // with a scripted run, without sockets.
  using RunOnce = std::function<absl::Status(const std::string& id, const v1::JobSpec& spec,
                                             const std::vector<v1::WorkerInfo>& workers,
                                             const std::atomic<bool>& cancel, RunContext* context)>;

  JobManager(JobStore* store, WorkerRegistry* registry, RunnerOptions options,
             RunOnce run = nullptr);
  // Drains every running job (each cuts a checkpoint at its next step and
  // stays RUNNING for the next coordinator), cancels what is still running
  // after RunnerOptions::drain_timeout_seconds, and joins every thread.
  ~JobManager();
  JobManager(const JobManager&) = delete;
  JobManager& operator=(const JobManager&) = delete;

  // Applies defaults, validates the spec and checks the dataset exists;
  // INVALID_ARGUMENT / NOT_FOUND naming the field otherwise.
  // `from`: SubmitJobRequest.from_checkpoint (empty: from the first step);
  // refused naming the field when it names no verified checkpoint, or one of
  // another number of units.
  // `init_from`: SubmitJobRequest.init_from (weights only, from step 0);
  // at most one of the two.
  absl::StatusOr<v1::JobStatus> Submit(v1::JobSpec spec, const std::string& from = "",
                                       const std::string& submitter = "anonymous",
                                       const std::string& init_from = "");
  // PENDING -> CANCELLED at once; RUNNING -> CANCELLED once its runner stops
  // (within a second). FAILED_PRECONDITION for a job that already ended.
  absl::StatusOr<v1::JobStatus> Cancel(const std::string& id);
  // FAILED or CANCELLED -> PENDING; when it runs it continues from its newest
  // valid checkpoint (step count, learning rates, data position, results).
  // FAILED_PRECONDITION for a job in another state or without a checkpoint.
  absl::StatusOr<v1::JobStatus> Resume(const std::string& id);
  // Wakes the scheduler (a worker registered or became idle).
  void Poke() ABSL_LOCKS_EXCLUDED(mu_);
  // A worker about to stop: never given a stage again; the job it serves
  // drains at its next step, cuts a checkpoint there and recovers without it.
  // Returns that job's id ("" when idle). NOT_FOUND for an unknown worker.
  absl::StatusOr<std::string> DrainWorker(const std::string& worker_id,
                                          const std::string& instance_id);
  // The trained model of job `id` from its checkpoint after step `step`
  // (0: the newest that verifies; a damaged newer one is skipped with a log
  // line and counted in the job's checkpoint.skipped). NOT_FOUND for an
  // unknown job, FAILED_PRECONDITION when it has no committed checkpoint,
  // DATA_LOSS naming the file when the asked-for one does not verify.
  absl::StatusOr<v1::ExportModelResponse> Export(const std::string& id, int64_t step);

 private:
  // submit --from's source: a job id (its newest checkpoint that verifies)
  // or a step directory / manifest.json path, fully verified; sets
  // `manifest_path`. INVALID_ARGUMENT naming from_checkpoint otherwise.
  absl::StatusOr<Manifest> ResolveFrom(const std::string& from, std::string* manifest_path);
  // The newest cut of `job` that verifies; each damaged newer one is logged
  // and counted in its checkpoint.skipped.
  absl::StatusOr<Manifest> NewestCut(const v1::JobStatus& job);
  void SchedulerLoop();
  bool ShuttingDown() ABSL_LOCKS_EXCLUDED(mu_);
  void StartJob(const std::string& id, std::vector<v1::WorkerInfo> workers,
                std::shared_ptr<std::atomic<bool>> flag) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs job `id` on `workers` to its end, recovering from lost workers as
  // its spec's recovery allows; returns how it ended.
  absl::Status RunJob(const std::string& id, std::vector<v1::WorkerInfo> workers,
                      const std::atomic<bool>& cancel);
  // After a recoverable failure of one run: RECOVERING, a Restart record,
  // replacements for the lost stages' workers (or fewer stages with
  // recovery.shrink), RUNNING again. Returns when the failure was detected;
  // an error ends the job.
  absl::StatusOr<WorkerRegistry::Clock::time_point> Recover(const std::string& id,
                                                            const absl::Status& failure,
                                                            const RunContext& run,
                                                            std::vector<v1::WorkerInfo>* workers,
                                                            const std::atomic<bool>& cancel);

  JobStore* const store_;
  WorkerRegistry* const registry_;
  const RunnerOptions options_;
  const RunOnce run_;

  absl::Mutex mu_;
  absl::CondVar cv_;  // a job ended, or Poke
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::map<std::string, std::shared_ptr<std::atomic<bool>>> cancel_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::thread> runners_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::shared_ptr<DrainRequest>> drains_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> finished_ ABSL_GUARDED_BY(mu_);
  // Cancelled jobs draining to a cut: when the cancel flag is set anyway.
  std::map<std::string, std::chrono::steady_clock::time_point> cancel_deadlines_
      ABSL_GUARDED_BY(mu_);
  std::thread scheduler_;
};

}  // namespace pipemare

#endif  // PIPEMARE_COORDINATOR_JOB_MANAGER_H_
