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
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "coordinator/job_store.h"
#include "coordinator/worker_registry.h"
#include "pipeline/checkpoint.h"

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
};

class JobRunner {
 public:
  // `resume` (optional, not owned): a verified checkpoint of this job to
  // continue from: every stage restores its units from it, and step count,
  // learning rates, data position and results continue after its step.
  JobRunner(std::string job_id, v1::JobSpec spec, std::vector<v1::WorkerInfo> workers,
            JobStore* store, WorkerRegistry* registry, const std::atomic<bool>* cancel,
            RunnerOptions options, const Manifest* resume = nullptr);

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
  const Manifest* resume_;
};

}  // namespace pipemare

#endif  // PIPEMARE_COORDINATOR_JOB_RUNNER_H_
