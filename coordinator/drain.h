// A drain (RunContext::drain: a worker or the coordinator is stopping)
// without stopping the pipeline: Start asks every stage for a cut at the end
// of a step none can have reached (the next after the microbatches fed so
// far); training goes on until stage 0 applied it (Due); Finish commits that
// cut and says how the run ends: UNAVAILABLE naming a leaving stage (the job
// recovers without it), or CANCELLED (the coordinator stops; the job stays
// RUNNING for the next one). Later microbatches in flight are dropped: a
// resume replays them.
#ifndef PIPEMARE_COORDINATOR_DRAIN_H_
#define PIPEMARE_COORDINATOR_DRAIN_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "coordinator/cut_committer.h"
#include "coordinator/job_runner.h"
#include "coordinator/stage_clients.h"

namespace pipemare {

class Drain {
 public:
  // Cut requests and the commit each wait at most `timeout_seconds`.
  Drain(const DrainRequest& request, StageClients& stages, CutCommitter& committer,
        double timeout_seconds, std::string job_id);

  bool started() const { return step_ > 0; }
  // Asks every stage for the cut; `fed`: training microbatches fed so far.
  // False when a stage cannot take it: the newest committed cut stands and
  // the run ends now (Finish).
  bool Start(int64_t fed, int microbatches_per_step);
  // Stage 0 has trained past the drain's step.
  bool Due(int64_t trained, int microbatches_per_step) const {
    return step_ > 0 && trained >= step_ * microbatches_per_step;
  }
  // Commits the drain's cut; how the run ends. A leaving stage is added to
  // `lost_stages`.
  absl::Status Finish(const std::atomic<bool>& cancel, std::vector<int>* lost_stages);

 private:
  const DrainRequest& request_;
  StageClients& stages_;
  CutCommitter& committer_;
  const double timeout_seconds_;
  const std::string job_id_;
  int64_t step_ = 0;  // the drain's cut, once Start asked for it
  std::chrono::steady_clock::time_point start_;
};

}  // namespace pipemare

#endif  // PIPEMARE_COORDINATOR_DRAIN_H_
