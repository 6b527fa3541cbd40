#include "coordinator/job_runner.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "coordinator/cut_committer.h"
#include "coordinator/drain.h"
#include "coordinator/feeds.h"
#include "coordinator/run_plan.h"
#include "coordinator/run_results.h"
#include "coordinator/stage_clients.h"
#include "pipeline/core/checkpoint.h"
#include "pipeline/core/data.h"
#include "pipeline/core/job_spec.h"
#include "pipeline/core/pipemare_math.h"
#include "pipeline/core/schedule.h"
#include "pipeline/core/settings.h"
#include "pipeline/core/training.h"
#include "pipeline/model/model_plan.h"

namespace pipemare {

using Clock = std::chrono::steady_clock;

JobRunner::JobRunner(std::string job_id, v1::JobSpec spec, std::vector<v1::WorkerInfo> workers,
                     JobStore* store, WorkerRegistry* registry, const std::atomic<bool>* cancel,
                     RunnerOptions options, RunContext* context)
    : job_id_(std::move(job_id)),
      spec_(std::move(spec)),
      workers_(std::move(workers)),
      store_(store),
      registry_(registry),
      cancel_(cancel),
      options_(options),
      context_(context) {}

class JobRunner::Impl {
 public:
  Impl(const JobRunner& r)
      : r_(r),
        spec_(r.spec_),
        P_(spec_.schedule().stages()),
        R_(Replicas(spec_.schedule())),
        NR_(static_cast<int64_t>(spec_.schedule().microbatches_per_step()) * R_),
        stages_(GrpcStageClients(r.job_id_, r.workers_, P_)) {}
  ~Impl() {
    if (committer_) committer_->Stop();
    if (feeds_) feeds_->Close();
  }

  absl::Status Run();

 private:
  // Run's steps, in order.
  // Loads the data, checks the model, partitions it and resolves each
  // stage's assignment (checkpoint directory, generation, input shape);
  // refuses a plan that cannot run.
  absl::StatusOr<std::vector<v1::StageAssignment>> PlanRun();
  // From the run context's cut, if any: step, results and the unit files
  // each stage restores.
  absl::Status ApplyResume(std::vector<v1::StageAssignment>& assignments);
  // Loads every stage and opens the coordinator's feeds.
  absl::Status LoadRun(std::vector<v1::StageAssignment> assignments);
  // Feeds epoch epoch_'s training microbatches from index `first_j` (a
  // resume's data position) and waits for their backwards; drains early
  // when asked to.
  absl::Status TrainEpoch(int64_t first_j);
  // Scores the test split with the epoch's final weights and records the
  // epoch's results; ABORTED when training diverged.
  absl::Status EvaluateEpoch();

 private:
  // Loads every stage, last first (each opens its stream to the next).
  absl::Status LoadStages(std::vector<v1::StageAssignment> assignments);
  // Loads stage i of replica r; replica 0's stages give `collective[i]`,
  // the others take it.
  absl::Status LoadStage(int r, int i, v1::StageAssignment a, std::vector<std::string>& collective);
  void ReleaseStages();
  // Processes feed events until `done()` holds. Fails on cancel, a stage
  // error, a lost worker, or a stall.
  absl::Status WaitUntil(const std::function<bool()>& done);
  void Handle(const FeedEvent& e);
  void Publish(bool force);
  int64_t committed_step() const { return committer_ ? committer_->committed_step() : 0; }
  void PollStages();
  std::string StageLabel(int i) const { return stages_->Label(i); }

  const JobRunner& r_;
  const v1::JobSpec& spec_;
  const int P_;
  // schedule.replicas: R pipelines, stage i of replica r on worker r·P + i;
  // a step is N microbatches on each, NR_ = N·R backwards done.
  const int R_;
  const int64_t NR_;
  const std::unique_ptr<StageClients> stages_;
  std::unique_ptr<Feeds> feeds_;  // opened by LoadRun

  // Runner-thread state.
  // The job's splits: stage 0 and the last stage read the examples.
  int64_t train_count_ = 0, test_count_ = 0;
  bool lm_ = false;  // a language model: perplexity and token accuracy
  int64_t warmup_steps_ = 0;
  uint64_t next_id_ = 1;  // the next microbatch id fed
  Clock::time_point epoch_start_;
  int64_t in_flight_ = 0;     // TRAIN microbatches sent, stage-0 backward not done
  int64_t train_done_ = 0;    // stage-0 backwards completed in the whole job
  int64_t eval_pending_ = 0;  // EVAL microbatches sent, result not back
  RunResults results_;
  int64_t steps_per_epoch_ = 0;
  int64_t total_steps_ = 0;
  int epoch_ = 0;
  double train_seconds_ = 0;  // time spent training (not evaluating)
  // A resume from a cut inside an epoch an earlier run finished: that run's
  // result of it, whose share before the cut completes the new one.
  std::optional<v1::EpochResult> cut_epoch_before_;
  Clock::time_point epoch_train_start_;
  Clock::time_point last_event_ = Clock::now();
  Clock::time_point last_publish_;
  Clock::time_point job_start_ = Clock::now();
  // Checkpoints: committed beside the feed (PlanRun makes it).
  std::unique_ptr<CutCommitter> committer_;
  std::atomic<int64_t> steps_done_{0};  // train_done_ / N, for the committer
  absl::Mutex commit_mu_;
  absl::Status commit_error_ ABSL_GUARDED_BY(commit_mu_);  // the committer's
  std::optional<Drain> drain_;                             // once RunContext::drain asked for one
};

absl::Status JobRunner::Run() {
  Impl impl(*this);
  return impl.Run();
}

absl::Status JobRunner::Impl::LoadStages(std::vector<v1::StageAssignment> assignments) {
  // Replica 0 first: its stages serve the rendezvous of each stage's
  // all-reduce group, whose addresses the other replicas' assignments carry.
  std::vector<std::string> collective(P_);
  for (int r = 0; r < R_; ++r) {
    // Last stage first: each stage opens its stream to the next on load.
    for (int i = P_ - 1; i >= 0; --i) {
      if (auto st = LoadStage(r, i, assignments[i], collective); !st.ok()) return st;
    }
  }
  return absl::OkStatus();
}

absl::Status JobRunner::Impl::LoadStage(int r, int i, v1::StageAssignment a,
                                        std::vector<std::string>& collective) {
  const int k = r * P_ + i;
  if (i + 1 < P_) a.set_downstream_address(stages_->Address(k + 1));
  a.set_replica(r);
  a.set_replicas(R_);
  if (r > 0) a.set_collective_address(collective[i]);
  if (r > 0 && a.restore_size() > 0 && !a.restore_weights_only()) {
    // Live recovery: replica 0's stage, loaded first, holds the cut in
    // memory (its own, or the one it just restored): the others take it
    // from there rather than from the checkpoint's files.
    a.add_replica_donors(stages_->Address(i));
  }
  v1::LoadStageResponse resp;
  grpc::Status st = stages_->Load(k, a, &resp);
  if (st.error_code() == grpc::StatusCode::INVALID_ARGUMENT) {
    // The stage refuses the assignment itself (the spec, or a checkpoint
    // that does not fit the model): any worker would, so recovery, which
    // retries on other workers, cannot help.
    return absl::InvalidArgumentError(
        absl::StrCat("loading ", StageLabel(k), " failed: ", st.error_message()));
  }
  if (!st.ok()) {
    return absl::UnavailableError(
        absl::StrCat("loading ", StageLabel(k), " failed: ", st.error_message()));
  }
  r_.registry_->SetStage(r_.workers_[k].id(), i);
  if (resp.restored_from_memory()) ++r_.context_->restored_from_memory;
  if (resp.restored_from_replica()) ++r_.context_->restored_from_replica;
  if (r == 0 && R_ > 1) {
    if (resp.collective_address().empty()) {
      return absl::InternalError(
          absl::StrCat(StageLabel(k), " gave no address for its replicas' all-reduce"));
    }
    collective[i] = resp.collective_address();
  }
  if (r > 0) return absl::OkStatus();  // the job's status shows replica 0's stages
  if (auto recorded = r_.store_->SetStageLoaded(r_.job_id_, i, resp.parameters(),
                                                resp.restored_from_memory(), resp.analytic_delay());
      !recorded.ok()) {
    LogWarning(ForJob(r_.job_id_), std::string(recorded.message()));
  }
  return absl::OkStatus();
}

void JobRunner::Impl::ReleaseStages() {
  // In parallel would be faster; stages release in milliseconds, and a dead
  // worker costs one short deadline.
  for (int i = 0; i < stages_->workers(); ++i) {
    grpc::Status st = stages_->Release(i);
    if (st.error_code() == grpc::StatusCode::UNAVAILABLE ||
        st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ||
        r_.registry_->IsLost(r_.workers_[i].id())) {
      // Dead or cut off: not idle for the next job (or this one's recovery)
      // until it heartbeats again.
      r_.registry_->MarkUnreachable(r_.workers_[i].id());
      r_.context_->lost_stages.push_back(i);
      LogWarning(ForJob(r_.job_id_), absl::StrCat(StageLabel(i), " is unreachable (",
                                                  st.error_message(), "); marked LOST"));
    }
  }
}

void JobRunner::Impl::Handle(const FeedEvent& e) {
  if (e.kind == FeedEvent::kDone) {
    --in_flight_;
    ++train_done_;
    steps_done_.store(train_done_ / NR_);
    if (r_.context_->recovering_since != Clock::time_point() && train_done_ % NR_ == 0) {
      // The first step trained after a recovery ends its timeline.
      const double seconds =
          std::chrono::duration<double>(Clock::now() - r_.context_->recovering_since).count();
      r_.context_->recovering_since = Clock::time_point();
      r_.store_->SetRecoverSeconds(r_.job_id_, seconds).IgnoreError();
      LogInfo(ForJob(r_.job_id_), absl::StrCat("recovered: first step trained ", seconds,
                                               " s after the failure was detected"));
    }
  } else if (e.kind == FeedEvent::kResult) {
    if (e.phase == v1::EVAL) --eval_pending_;
    if (e.skipped) return;  // counted by the stage that dropped it
    if (e.phase == v1::EVAL) {
      results_.AddEvaluation(e.result);
    } else {
      results_.AddTraining(e.result);
    }
  }
}

absl::Status JobRunner::Impl::WaitUntil(const std::function<bool()>& done) {
  while (!done()) {
    if (r_.cancel_->load()) return absl::CancelledError("cancelled by the user");
    {
      absl::MutexLock lock(&commit_mu_);
      if (!commit_error_.ok()) return commit_error_;
    }
    if (std::optional<FeedEvent> e = feeds_->Next(std::chrono::milliseconds(200))) {
      last_event_ = Clock::now();
      if (e->kind == FeedEvent::kError) return absl::Status(e->code, e->error);
      Handle(*e);
      Publish(false);
      continue;
    }
    for (int i = 0; i < stages_->workers(); ++i) {
      if (r_.registry_->IsLost(r_.workers_[i].id())) {
        r_.context_->lost_stages.push_back(i);
        return absl::UnavailableError(
            absl::StrCat(StageLabel(i), " stopped sending heartbeats; the worker is lost"));
      }
    }
    const double idle = std::chrono::duration<double>(Clock::now() - last_event_).count();
    if (idle > r_.options_.stall_timeout_seconds) {
      return absl::DeadlineExceededError(absl::StrCat(
          "no progress from the pipeline for ", static_cast<int>(idle), " s; a stage may be hung"));
    }
  }
  return absl::OkStatus();
}

void JobRunner::Impl::Publish(bool force) {
  const auto now = Clock::now();
  if (!force && std::chrono::duration<double>(now - last_publish_).count() <
                    r_.options_.publish_interval_seconds) {
    return;
  }
  last_publish_ = now;
  const double train_loss = results_.TakeWindowLoss();
  const int64_t steps = train_done_ / NR_;
  const double training =
      train_seconds_ + (epoch_train_start_.time_since_epoch().count() != 0
                            ? std::chrono::duration<double>(now - epoch_train_start_).count()
                            : 0.0);
  r_.store_
      ->UpdateProgress(
          r_.job_id_,
          [&](v1::JobProgress& p, v1::JobMetrics& m) {
            p.set_epoch(epoch_);
            p.set_epochs(spec_.train().epochs());
            p.set_step(steps);
            p.set_total_steps(total_steps_);
            if (!std::isnan(train_loss)) m.set_train_loss(train_loss);
            if (training > 0) {
              m.set_samples_per_second(static_cast<double>(results_.samples_trained()) / training);
            }
            m.set_elapsed_seconds(std::chrono::duration<double>(now - job_start_).count());
            if (steps > 0) {
              m.set_eta_seconds(training / steps * static_cast<double>(total_steps_ - steps));
            }
          })
      .IgnoreError();
}

void JobRunner::Impl::PollStages() {
  for (int i = 0; i < P_; ++i) {
    v1::StageStatusResponse resp;
    if (!stages_->Status(i, committed_step(), &resp).ok()) continue;
    if (auto recorded = r_.store_->UpdateStageLive(r_.job_id_, i, resp); !recorded.ok()) {
      LogWarning(ForJob(r_.job_id_), std::string(recorded.message()));
    }
  }
}

// The run, step by step: plan (data, model, partition, assignments), resume
// (from the run context's cut, if any), load (every stage, then the feeds),
// then per epoch train and evaluate, and the final cut. Checkpoints are
// committed beside the feed (the committer thread); a drain ends the
// training loop early; a failure anywhere releases the stages.
absl::Status JobRunner::Impl::Run() {
  auto assignments = PlanRun();
  if (!assignments.ok()) return assignments.status();
  if (auto st = ApplyResume(*assignments); !st.ok()) return st;
  absl::Status st = LoadRun(std::move(*assignments));
  if (!st.ok()) {
    if (feeds_) feeds_->Close();
    ReleaseStages();
    return st;
  }
  Publish(true);
  committer_->Start([this] { return steps_done_.load(); },
                    [this](absl::Status st) {
                      {
                        absl::MutexLock lock(&commit_mu_);
                        commit_error_ = std::move(st);
                      }
                      feeds_->Wake();
                    });
  // Where training continues (weights alone start at step 0).
  const Manifest* resume = r_.context_->weights_only ? nullptr : r_.context_->resume;
  const int N = spec_.schedule().microbatches_per_step();
  const int64_t first_epoch = resume != nullptr ? resume->step / steps_per_epoch_ + 1 : 1;
  // epoch_ stays at the epoch a failure or cancel ended in (status shows it).
  for (epoch_ = first_epoch; epoch_ <= spec_.train().epochs(); ++epoch_) {
    // The first epoch after a resume starts at the cut's data position.
    const int64_t first_j =
        resume != nullptr && epoch_ == first_epoch ? (resume->step % steps_per_epoch_) * N : 0;
    st = TrainEpoch(first_j);
    if (st.ok()) st = EvaluateEpoch();
    if (!st.ok()) break;
  }
  epoch_ = std::min(epoch_, spec_.train().epochs());
  committer_->Stop();
  // The trained model: the cut after the last step, committed before the
  // stages are released.
  if (st.ok()) {
    st = committer_->CommitAt(total_steps_, r_.options_.final_checkpoint_timeout_seconds,
                              "the final checkpoint", *r_.cancel_);
  }
  Publish(true);
  feeds_->Close();
  ReleaseStages();
  return st;
}

absl::StatusOr<std::vector<v1::StageAssignment>> JobRunner::Impl::PlanRun() {
  auto job = r_.store_->Get(r_.job_id_);
  if (!job.ok()) return job.status();
  auto run = MakeRunPlan(
      spec_, r_.job_id_, r_.context_->generation, r_.options_.checkpoint_dir,
      r_.options_.max_model_bytes,
      [this](const ModelPlan& plan) {
        return ProfileOnStages(*stages_, plan, spec_.schedule().microbatch_size(),
                               spec_.train().seed(), *r_.cancel_, r_.job_id_);
      },
      job->data_files());
  if (!run.ok()) return run.status();
  if (job->data_files().empty()) {
    // The first run: every later one (a recovery, a resume) must find the
    // same files, or its data position would name other examples.
    if (auto st = r_.store_->SetDataFiles(r_.job_id_, run->assignments.front().data_files());
        !st.ok()) {
      return st;
    }
  }
  train_count_ = run->data.train.count;
  test_count_ = run->data.test.count;
  lm_ = run->lm;
  steps_per_epoch_ = run->steps_per_epoch;
  total_steps_ = run->total_steps;
  warmup_steps_ = run->warmup_steps;
  LogInfo(ForJob(r_.job_id_),
          absl::StrCat("data: ", run->data.info.description,
                       run->data.normalisation.empty() ? "" : "; normalised ",
                       run->data.normalisation, "; stage 0 and the last stage read it"));
  run->data = Data();  // the coordinator carries no examples
  std::string summary;
  std::vector<v1::StageStatus> stages(P_);
  for (int i = 0; i < P_; ++i) {
    const StageRange& r = run->ranges[i];
    v1::StageStatus& st = stages[i];
    st.set_index(i);
    st.set_worker_id(r_.workers_[i].id());
    st.set_worker_address(r_.workers_[i].address());
    st.set_first_unit(r.first_unit);
    st.set_units(r.units);
    st.set_parameters(static_cast<int64_t>(run->stage_parameters[i]));
    const bool timed = !run->predicted_seconds.empty();
    if (timed) st.set_predicted_seconds(run->predicted_seconds[i]);
    st.set_bottleneck(i == run->bottleneck);
    absl::StrAppend(
        &summary, i ? ", " : "", "[", r.first_unit, ",", r.first_unit + r.units, ")",
        timed ? absl::StrCat(" ", std::round(run->predicted_seconds[i] * 1e4) / 10, " ms") : "");
  }
  r_.store_
      ->SetPlan(r_.job_id_, TaskName(lm_ ? Task::kLanguageModel : Task::kClassification),
                run->partition, stages)
      .IgnoreError();
  LogInfo(ForJob(r_.job_id_),
          absl::StrCat("partition ", run->partition, " of ",
                       run->ranges.back().first_unit + run->ranges.back().units,
                       " units: ", summary, "; bottleneck stage ", run->bottleneck));
  committer_ = std::make_unique<CutCommitter>(
      std::move(run->cuts),
      [this](int i, int64_t committed, v1::StageStatusResponse* resp) {
        return stages_->Status(i, committed, resp);
      },
      [this](int i) { return StageLabel(i); }, r_.store_);
  return std::move(run->assignments);
}

absl::Status JobRunner::Impl::ApplyResume(std::vector<v1::StageAssignment>& assignments) {
  const Manifest* resume = r_.context_->resume;
  if (resume == nullptr || r_.context_->weights_only) {
    // A first run, or one run again from its first step: no old results.
    r_.store_->ClearEpochs(r_.job_id_).IgnoreError();
  }
  if (resume == nullptr) return absl::OkStatus();
  if (r_.context_->weights_only) {
    // --init-from: the units' weights, then everything else from step 0.
    LogInfo(ForJob(r_.job_id_), absl::StrCat("starting from the weights of the checkpoint of ",
                                             resume->job, " at step ", resume->step));
    for (auto& a : assignments) a.set_restore_weights_only(true);
    AddRestoreFiles(*resume, assignments);
    return absl::OkStatus();
  }
  if (resume->step >= total_steps_ || resume->step < 0) {
    return absl::FailedPreconditionError(absl::StrCat("the checkpoint at step ", resume->step,
                                                      " is not inside this job's ", total_steps_,
                                                      " steps"));
  }
  train_done_ = resume->step * NR_;
  steps_done_ = resume->step;
  LogInfo(ForJob(r_.job_id_),
          absl::StrCat("resuming from the checkpoint at step ", resume->step, " (microbatch ",
                       resume->microbatch, ", epoch ", resume->epoch, ", example ",
                       resume->index_in_epoch, " of its order)"));
  // Results after the cut are trained again. The epoch the cut falls in is
  // trained only from the cut on: what an earlier run measured of it stands
  // for the part before the cut.
  auto rewound = r_.store_->RewindTo(r_.job_id_, resume->step, resume->epoch);
  if (!rewound.ok()) return rewound.status();
  cut_epoch_before_ = rewound->cut_epoch;
  committer_->ResumeAt(resume->step, rewound->committed);
  for (auto& a : assignments) a.set_start_step(resume->step);
  AddRestoreFiles(*resume, assignments);
  return absl::OkStatus();
}

absl::Status JobRunner::Impl::LoadRun(std::vector<v1::StageAssignment> assignments) {
  absl::Status st = LoadStages(std::move(assignments));
  if (st.ok() && r_.context_->recovering_since != Clock::time_point()) {
    r_.store_
        ->SetRestoredFromMemory(r_.job_id_, r_.context_->restored_from_memory,
                                r_.context_->restored_from_replica)
        .IgnoreError();
  }
  if (!st.ok()) return st;
  // Sends queue behind at most the in-flight window.
  feeds_ = std::make_unique<Feeds>(
      r_.job_id_, r_.context_->generation,
      static_cast<size_t>(std::max(P_, 2 * spec_.schedule().microbatches_per_step())) + 2);
  std::vector<Feeds::Ends> ends;
  for (int r = 0; r < R_; ++r) {
    const int first = r * P_, last = r * P_ + P_ - 1;
    ends.push_back(
        {stages_->Channel(first), stages_->Channel(last), StageLabel(first), StageLabel(last)});
  }
  feeds_->Open(ends);
  return absl::OkStatus();
}

absl::Status JobRunner::Impl::TrainEpoch(int64_t first_j) {
  const auto& sched = spec_.schedule();
  const int N = sched.microbatches_per_step();
  const int64_t mbs = sched.microbatch_size();
  const bool gpipe = !IsAsynchronous(ScheduleKindOf(sched));
  results_.StartEpoch();
  epoch_train_start_ = Clock::now();
  epoch_start_ = epoch_train_start_;
  const int64_t microbatches = steps_per_epoch_ * N;
  absl::Status st;
  for (int64_t j = first_j; j < microbatches && st.ok(); ++j) {
    const int64_t step = (epoch_ - 1) * steps_per_epoch_ + j / N;
    const bool sync = gpipe || step < warmup_steps_;
    if (!gpipe && warmup_steps_ > 0 && step == warmup_steps_ && j % N == 0) {
      LogInfo(ForJob(r_.job_id_), absl::StrCat("synchronous warm-up done after ", warmup_steps_,
                                               " steps; switching to asynchronous ", sched.type()));
    }
    if (!drain_ && r_.context_->drain != nullptr && r_.context_->drain->requested()) {
      drain_.emplace(*r_.context_->drain, *stages_, *committer_, r_.options_.drain_timeout_seconds,
                     r_.job_id_);
      if (!drain_->Start(train_done_ + in_flight_, NR_)) {
        st = drain_->Finish(*r_.cancel_, &r_.context_->lost_stages);
        Publish(true);
        break;
      }
    }
    if (drain_ && drain_->Due(train_done_, NR_)) {
      st = drain_->Finish(*r_.cancel_, &r_.context_->lost_stages);
      Publish(true);
      break;
    }
    // Each replica keeps the window; microbatch j of step s on replica r
    // takes positions ((s·R + r)·N + j mod N)·mbs.. of the epoch's order.
    const int64_t window = InFlightWindow(sync, P_, N) * R_;
    st = WaitUntil([&] { return in_flight_ < window; });
    const uint64_t id = next_id_++;
    for (int r = 0; r < R_ && st.ok(); ++r) {
      v1::DataSlice slice;
      slice.set_epoch(epoch_);
      slice.set_begin((((j / N) * R_ + r) * N + j % N) * mbs);
      slice.set_count(mbs);
      st = feeds_->Send(r, slice, id, v1::TRAIN);
      if (st.ok()) ++in_flight_;
    }
  }
  if (st.ok()) st = WaitUntil([&] { return in_flight_ == 0; });
  train_seconds_ += std::chrono::duration<double>(Clock::now() - epoch_train_start_).count();
  epoch_train_start_ = Clock::time_point();
  return st;
}

absl::Status JobRunner::Impl::EvaluateEpoch() {
  // The whole test split with the epoch's final weights.
  const int64_t eval_mbs = EvalMicrobatchSize(spec_.schedule().microbatch_size());
  results_.StartEvaluation();
  absl::Status st;
  for (int64_t b = 0; b < test_count_ && st.ok(); b += eval_mbs) {
    st = WaitUntil([&] { return eval_pending_ < P_ + 1; });
    v1::DataSlice slice;
    slice.set_begin(b);
    slice.set_count(std::min(eval_mbs, test_count_ - b));
    // Replicas hold the same weights: replica 0 scores the test split.
    if (st.ok()) st = feeds_->Send(0, slice, next_id_++, v1::EVAL);
    if (st.ok()) ++eval_pending_;
  }
  if (st.ok()) st = WaitUntil([&] { return eval_pending_ == 0; });
  if (!st.ok()) return st;
  PollStages();
  const RunResults::Evaluation eval = results_.Evaluated(lm_);
  const double accuracy = eval.accuracy, test_loss = eval.loss, perplexity = eval.perplexity;
  double epoch_train_loss = results_.epoch_train_loss();
  double seconds = std::chrono::duration<double>(Clock::now() - epoch_start_).count();
  if (cut_epoch_before_ && cut_epoch_before_->epoch() == epoch_ && r_.context_->resume != nullptr) {
    // Weighted by steps: the earlier run's epoch average for the steps
    // before the cut, this run's for the rest.
    const double before =
        static_cast<double>(r_.context_->resume->step % steps_per_epoch_) / steps_per_epoch_;
    epoch_train_loss = before * cut_epoch_before_->train_loss() + (1 - before) * epoch_train_loss;
    seconds += before * cut_epoch_before_->seconds();
  }
  cut_epoch_before_.reset();
  v1::EpochResult result;
  result.set_epoch(epoch_);
  result.set_train_loss(epoch_train_loss);
  result.set_test_loss(test_loss);
  result.set_test_accuracy(accuracy);
  result.set_seconds(seconds);
  if (lm_) result.set_test_perplexity(perplexity);
  r_.store_->AddEpoch(r_.job_id_, result).IgnoreError();
  LogInfo(ForJob(r_.job_id_),
          absl::StrCat("epoch ", epoch_, ": train loss ", epoch_train_loss, ", test loss ",
                       test_loss, lm_ ? ", test token accuracy " : ", test accuracy ", accuracy,
                       lm_ ? absl::StrCat(", test perplexity ", perplexity) : "", " (", seconds,
                       " s)"));
  if (!std::isfinite(epoch_train_loss)) {
    return absl::AbortedError(
        absl::StrCat("training diverged in epoch ", epoch_,
                     " (loss is not finite); lower optimizer.lr or "
                     "optimizer.momentum, or raise schedule.lr_anneal_steps"));
  }
  return absl::OkStatus();
}

}  // namespace pipemare
