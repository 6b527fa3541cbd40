// JobRunner: runs one job on the workers reserved for it. Loads the data,
// cuts the model into stages, loads each stage on its worker (last first, so
// each stage can open its stream to the next), opens the two data feeds
// (inputs to stage 0, targets to the last stage), feeds microbatches as the
// schedule allows, evaluates on the test split after every epoch, publishes
// progress to the JobStore, and releases the workers at the end.
//
// The coordinator is never on the activation path: it only sees the feeds.
#ifndef PIPEMARE_COORDINATOR_JOB_RUNNER_H_
#define PIPEMARE_COORDINATOR_JOB_RUNNER_H_

#include <atomic>
#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/job_store.h"
#include "coordinator/worker_registry.h"
#include "pipeline/core/checkpoint.h"
#include "pipeline/model/model_plan.h"

namespace pipemare {

struct RunnerOptions {
  // Fail the job when no feed event arrives for this long.
  double stall_timeout_seconds = 120;
  // Publish progress at most this often.
  double publish_interval_seconds = 0.25;
  // Where checkpoints go when the spec names no checkpoint.dir.
  std::string checkpoint_dir = "checkpoints";
  // How long the end of a job waits for every stage to write its last cut.
  double final_checkpoint_timeout_seconds = 120;
  // How long a drain (SIGTERM) waits for a stage to take its cut request,
  // and for the cut to be committed.
  double drain_timeout_seconds = 20;
  // Jobs one submitter may have waiting (PENDING) at once.
  int max_queued_jobs_per_submitter = 32;
  // The most workers this cluster will ever have (--max-workers; 0: no
  // bound): a job that needs more (stages x replicas) is refused at submit
  // instead of waiting PENDING for ever.
  int max_workers = 0;
  // The float32 parameter bytes one job's model may take, checked unit by
  // unit before each is built (the shape pass at submit and at start).
  int64_t max_model_bytes = kDefaultMaxModelBytes;
  // The cluster runs mutual TLS (the coordinator's, and so its workers',
  // security): schedule.transport gloo, which is plaintext, is refused at
  // submit.
  bool tls = false;
};

// Asks a running job to drain (a worker or the coordinator is stopping:
// SIGTERM): cut a checkpoint at the next step no stage has reached, train on
// until it is taken, commit it and end the run. Thread-safe.
class DrainRequest {
 public:
  // `stage`: the stage whose worker leaves (the run then ends UNAVAILABLE
  // naming it, and the job recovers without it); -1: the coordinator stops
  // (the run ends CANCELLED and the job stays RUNNING for the next one).
  void Request(std::string why, int stage) {
    absl::MutexLock lock(&mu_);
    if (requested_) return;  // the first reason stands
    why_ = std::move(why);
    stage_ = stage;
    requested_ = true;
  }
  bool requested() const { return requested_.load(); }
  std::pair<std::string, int> reason() const {
    absl::MutexLock lock(&mu_);
    return {why_, stage_};
  }

 private:
  std::atomic<bool> requested_{false};
  mutable absl::Mutex mu_;
  std::string why_ ABSL_GUARDED_BY(mu_);
  int stage_ ABSL_GUARDED_BY(mu_) = -1;
};

// One run of a job: which generation it is, where it starts, and what it
// reports back for recovery (JobManager).
struct RunContext {
  // Fencing (JobStatus.generation): stamped on every assignment, stream and
  // manifest of this run.
  int64_t generation = 0;
  // A verified checkpoint of this job to continue from (not owned; null: the
  // first step): every stage restores its units from it, and step count,
  // learning rates, data position and results continue after its step.
  const Manifest* resume = nullptr;
  // With `resume`: take only its weights and start at step 0 (--init-from).
  bool weights_only = false;
  // Set when this run recovers from a failure detected then: the first step
  // it trains completes the job's last Restart (recover_seconds).
  std::chrono::steady_clock::time_point recovering_since{};
  // Not owned, may be null: a drain asked of this run.
  const DrainRequest* drain = nullptr;
  // Out: the stages whose workers were lost (unreachable, or silent past the
  // heartbeat timeout) when the run ended, how many workers restored their
  // units from their own memory, and how many from replica 0's.
  std::vector<int> lost_stages;
  int restored_from_memory = 0;
  int restored_from_replica = 0;
};

class JobRunner {
 public:
  // `context` (not owned) must outlive Run().
  JobRunner(std::string job_id, v1::JobSpec spec, std::vector<v1::WorkerInfo> workers,
            JobStore* store, WorkerRegistry* registry, const std::atomic<bool>* cancel,
            RunnerOptions options, RunContext* context);

  // Runs the job to its end and returns how it ended: OK (SUCCEEDED),
  // CANCELLED, or an error whose message is the user-facing reason. Releases
  // the stages on every path. Does not set the job's final state.
  absl::Status Run();

 private:
  class Impl;
  std::string job_id_;
  v1::JobSpec spec_;
  std::vector<v1::WorkerInfo> workers_;
  JobStore* store_;
  WorkerRegistry* registry_;
  const std::atomic<bool>* cancel_;
  RunnerOptions options_;
  RunContext* context_;
};

}  // namespace pipemare

#endif  // PIPEMARE_COORDINATOR_JOB_RUNNER_H_
