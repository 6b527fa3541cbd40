#include "coordinator/drain.h"

#include "absl/strings/str_cat.h"
#include "common/log.h"

namespace pipemare {

Drain::Drain(const DrainRequest& request, StageClients& stages, CutCommitter& committer,
             double timeout_seconds, std::string job_id)
    : request_(request),
      stages_(stages),
      committer_(committer),
      timeout_seconds_(timeout_seconds),
      job_id_(std::move(job_id)) {}

bool Drain::Start(int64_t fed, int microbatches_per_step) {
  const std::string why = request_.reason().first;
  // No stage can have applied a step whose last microbatch was not fed.
  step_ = fed / microbatches_per_step + 1;
  start_ = std::chrono::steady_clock::now();
  LogInfo(ForJob(job_id_),
          absl::StrCat("draining (", why, "): cutting at step ", step_, " while training on"));
  for (int i = 0; i < stages_.stages(); ++i) {
    grpc::Status cut = stages_.Cut(i, step_, timeout_seconds_);
    if (!cut.ok()) {
      // The newest periodic cut stands; the run ends now.
      LogError(ForJob(job_id_), absl::StrCat("drain: ", stages_.Label(i), " cannot cut at step ",
                                             step_, ": ", cut.error_message()));
      step_ = committer_.committed_step();
      return false;
    }
  }
  return true;
}

absl::Status Drain::Finish(const std::atomic<bool>& cancel, std::vector<int>* lost_stages) {
  const auto [why, stage] = request_.reason();
  absl::Status st = absl::OkStatus();
  if (step_ > committer_.committed_step()) {
    st = committer_.CommitAt(step_, timeout_seconds_, "the drain's checkpoint", cancel);
  }
  if (!st.ok()) {
    LogError(ForJob(job_id_), absl::StrCat("drain: ", st.message()));
  } else {
    LogInfo(ForJob(job_id_),
            absl::StrCat(
                "drained and committed the cut at step ", committer_.committed_step(), " in ",
                std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(),
                " s"));
  }
  if (stage >= 0) {
    lost_stages->push_back(stage);
    return absl::UnavailableError(absl::StrCat(stages_.Label(stage), " left (", why,
                                               "); drained at step ", committer_.committed_step()));
  }
  return absl::CancelledError(why);
}

}  // namespace pipemare
