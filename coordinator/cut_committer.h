// The coordinator's side of a run's checkpoints (pipeline/core/checkpoint.h):
// asks every stage which cuts it has written, and when all have written the
// same one, newer than the last committed, verifies its files, commits its
// manifest, tells the stages (each keeps the committed cut in memory for a
// recovery) and records it in the job's status. A background thread commits
// the periodic cuts while the feed trains on, so verifying files never holds
// up the feed; the runner commits a drain's cut and the final one itself
// (CommitAt).
#ifndef PIPEMARE_COORDINATOR_CUT_COMMITTER_H_
#define PIPEMARE_COORDINATOR_CUT_COMMITTER_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "coordinator/job_store.h"
#include "pipeline/core/partition.h"
#include "pipemare/v1/pipemare.pb.h"

namespace pipemare {

class CutCommitter {
 public:
  // What a run's manifests record.
  struct Run {
    std::string job_id;
    int64_t generation = 0;   // fencing: only this run's cuts are committed
    std::string dir;          // checkpoint.dir (or the coordinator's default)
    int64_t every_steps = 0;  // checkpoint.every_steps; 0: only the final cut
    int keep = 0;             // checkpoint.keep
    int64_t steps_per_epoch = 0;
    int microbatches_per_step = 0;
    int64_t microbatch_size = 0;
    int64_t seed = 0;
    std::vector<StageRange> ranges;  // the partition
    std::string spec_json;           // the resolved spec
    std::string input_json;          // the input's shape and normalisation
  };
  // Stage i's GetStageStatus, telling it the committed step.
  using StageStatus =
      std::function<grpc::Status(int stage, int64_t committed_step, v1::StageStatusResponse*)>;
  // "stage 2 (worker w-3 at host:port)", for messages.
  using StageLabel = std::function<std::string(int stage)>;

  // `store` (not owned) receives JobStatus.checkpoint.
  CutCommitter(Run run, StageStatus status, StageLabel label, JobStore* store);
  // Stop().
  ~CutCommitter();
  CutCommitter(const CutCommitter&) = delete;
  CutCommitter& operator=(const CutCommitter&) = delete;

  // A resumed run: the cut at `step` is committed already, the job's
  // `committed`-th.
  void ResumeAt(int64_t step, int32_t committed);
  // Starts the background thread (only with every_steps): every 250 ms once
  // `steps_done()` reaches the next periodic cut, polls the stages and
  // commits. A stage's write error (the operator's to fix) goes to
  // `on_error` once and ends the thread.
  void Start(std::function<int64_t()> steps_done, std::function<void(absl::Status)> on_error);
  void Stop();

  // One poll: commits the newest cut every stage has written. An error only
  // for what recovering cannot fix (a stage cannot write, or the
  // coordinator cannot verify cut after cut).
  absl::Status Poll();
  // Polls until the cut at `step` is committed, at most `seconds`; `what`
  // names the cut in the error; CANCELLED once `cancel` is set.
  absl::Status CommitAt(int64_t step, double seconds, const std::string& what,
                        const std::atomic<bool>& cancel);
  int64_t committed_step() const { return committed_step_.load(); }
  const std::string& dir() const { return run_.dir; }

 private:
  absl::Status PollLocked();  // under poll_mu_

  const Run run_;
  const StageStatus status_;
  const StageLabel label_;
  JobStore* const store_;

  std::mutex poll_mu_;                      // one poll at a time (the thread, the runner)
  std::atomic<int64_t> committed_step_{0};  // written under poll_mu_
  // Under poll_mu_: the cuts committed (the job's, across runs); complete
  // cuts in a row the coordinator could not verify (at kMaxVerifyFailures
  // the job fails naming checkpoint.dir); every cut each stage reported
  // newer than the committed one, across polls (step -> stage -> files).
  int32_t committed_ = 0;
  static constexpr int kMaxVerifyFailures = 3;
  int verify_failures_ = 0;
  std::map<int64_t, std::map<int, v1::CheckpointWritten>> reported_;

  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;  // under mu_
  std::thread thread_;
};

}  // namespace pipemare

#endif  // PIPEMARE_COORDINATOR_CUT_COMMITTER_H_
