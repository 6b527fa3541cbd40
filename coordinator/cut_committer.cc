#include "coordinator/cut_committer.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/thread_name.h"
#include "pipeline/core/checkpoint.h"

namespace pipemare {

using Clock = std::chrono::steady_clock;

CutCommitter::CutCommitter(Run run, StageStatus status, StageLabel label, JobStore* store)
    : run_(std::move(run)), status_(std::move(status)), label_(std::move(label)), store_(store) {}

CutCommitter::~CutCommitter() { Stop(); }

void CutCommitter::ResumeAt(int64_t step, int32_t committed) {
  std::lock_guard<std::mutex> lock(poll_mu_);
  committed_step_ = step;
  committed_ = committed;
}

void CutCommitter::Start(std::function<int64_t()> steps_done,
                         std::function<void(absl::Status)> on_error) {
  if (run_.every_steps <= 0 || thread_.joinable()) return;  // only the final cut
  thread_ = std::thread([this, steps_done = std::move(steps_done), on_error = std::move(on_error)] {
    NameThisThread("ckpt-committer");
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu_);
        if (cv_.wait_for(lock, std::chrono::milliseconds(250), [&] { return stop_; })) return;
      }
      if (steps_done() < committed_step_.load() + run_.every_steps) continue;  // no cut due
      if (absl::Status st = Poll(); !st.ok()) {
        on_error(st);
        return;
      }
    }
  });
}

void CutCommitter::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

absl::Status CutCommitter::Poll() {
  std::lock_guard<std::mutex> lock(poll_mu_);
  return PollLocked();
}

absl::Status CutCommitter::PollLocked() {
  const int P = static_cast<int>(run_.ranges.size());
  // Stages reach a cut at different moments: remember every cut each one
  // holds, across polls, and commit the newest that all have written.
  auto report = [&](int i, const v1::CheckpointWritten& w) {
    if (w.step() > committed_step_ && w.generation() == run_.generation) {
      reported_[w.step()][i] = w;
    }
  };
  for (int i = 0; i < P; ++i) {
    v1::StageStatusResponse resp;
    if (!status_(i, committed_step_.load(), &resp).ok()) return absl::OkStatus();
    if (!resp.checkpoint().error().empty()) {
      // The operator's to fix, not a lost worker's: no recovery.
      return absl::FailedPreconditionError(
          absl::StrCat(label_(i), " could not write its checkpoint: ", resp.checkpoint().error(),
                       "; check checkpoint.dir (", run_.dir, ") is writable from every worker"));
    }
    // Another run's cuts (fencing) are not this run's to commit.
    report(i, resp.checkpoint());
    for (const auto& held : resp.held()) report(i, held);
  }
  int64_t step = 0;
  for (auto it = reported_.rbegin(); it != reported_.rend(); ++it) {
    if (static_cast<int>(it->second.size()) == P) {
      step = it->first;
      break;
    }
  }
  if (step <= committed_step_) return absl::OkStatus();
  std::vector<v1::CheckpointWritten> written(P);
  for (int i = 0; i < P; ++i) written[i] = reported_[step][i];
  reported_.erase(reported_.begin(), reported_.upper_bound(step));
  const int N = run_.microbatches_per_step;
  Manifest m;
  m.job = run_.job_id;
  m.generation = run_.generation;
  m.step = step;
  m.microbatch = step * N;
  m.epoch = step / run_.steps_per_epoch + 1;
  m.index_in_epoch = (step % run_.steps_per_epoch) * N * run_.microbatch_size;
  m.seed = run_.seed;
  for (const auto& r : run_.ranges) m.stages.push_back({r.first_unit, r.units});
  m.spec_json = run_.spec_json;
  m.input_json = run_.input_json;
  for (const auto& w : written) {
    for (const auto& f : w.files()) m.files.push_back({f.unit(), f.path(), f.bytes(), f.sha256()});
  }
  const auto start = Clock::now();
  if (auto st = CommitManifest(run_.dir, m, run_.keep); !st.ok()) {
    // A damaged cut is not committed; the previous one stays "latest".
    LogError(ForJob(run_.job_id),
             absl::StrCat("checkpoint at step ", step, " not committed: ", st.message()));
    if (absl::IsDataLoss(st) && ++verify_failures_ >= kMaxVerifyFailures) {
      // Not one damaged cut but a directory the coordinator does not share
      // with the workers: the operator's to fix, recovering cannot help.
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint.dir (", run_.dir, "): the coordinator could not verify ", verify_failures_,
          " cuts in a row that every stage reported written (", st.message(),
          "); checkpoint.dir must be one directory every worker and the coordinator reach (a "
          "shared volume on a cluster)"));
    }
    return absl::OkStatus();
  }
  verify_failures_ = 0;
  committed_step_ = step;
  ++committed_;
  // Tell the stages at once (not at the next poll): each keeps the
  // committed cut in memory for a recovery and lets older ones go.
  for (int i = 0; i < P; ++i) {
    v1::StageStatusResponse resp;
    (void)status_(i, step, &resp);
  }
  const std::string manifest = CheckpointStepDir(run_.dir, run_.job_id, step) + "/manifest.json";
  LogInfo(
      ForJob(run_.job_id),
      absl::StrCat("checkpoint committed at step ", step, " (microbatch ", m.microbatch, ", ",
                   m.files.size(), " units, verified in ",
                   std::chrono::duration<double>(Clock::now() - start).count(), " s): ", manifest));
  const int32_t committed = committed_;
  store_->SetCheckpoint(run_.job_id, step, manifest, committed).IgnoreError();
  return absl::OkStatus();
}

absl::Status CutCommitter::CommitAt(int64_t step, double seconds, const std::string& what,
                                    const std::atomic<bool>& cancel) {
  const auto deadline = Clock::now() + std::chrono::duration<double>(seconds);
  while (committed_step_ < step) {
    if (cancel.load()) return absl::CancelledError("cancelled by the user");
    if (auto st = Poll(); !st.ok()) return st;
    if (committed_step_ >= step) break;
    if (Clock::now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "the stages did not all write ", what, " (step ", step, ") to ", run_.dir, " within ",
          seconds, " s; check that checkpoint.dir is the same shared directory on every worker"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return absl::OkStatus();
}

}  // namespace pipemare
