#include "coordinator/job_runner.h"

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <numeric>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/pipe_stream.h"
#include "common/rpc.h"
#include "common/thread_name.h"
#include "google/protobuf/util/json_util.h"
#include "pipeline/checkpoint.h"
#include "pipeline/data.h"
#include "pipeline/job_spec.h"
#include "pipeline/model_plan.h"
#include "pipeline/partition.h"
#include "pipeline/pipemare_math.h"
#include "pipeline/schedule.h"
#include "pipeline/tensor_codec.h"
#include "pipeline/training.h"
#include "pipemare/v1/pipemare.grpc.pb.h"

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
  Impl(const JobRunner& r) : r_(r), spec_(r.spec_), P_(spec_.schedule().stages()) {}
  ~Impl() {
    StopCommitter();
    CloseFeeds();
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
  // What the feed readers hand to the runner.
  struct FeedEvent {
    enum Kind { kDone, kResult, kError } kind;
    uint64_t microbatch = 0;
    v1::Phase phase = v1::TRAIN;
    v1::MicrobatchResult result;
    bool skipped = false;  // a result of a microbatch dropped for a NaN or Inf
    std::string error;
    // kError: the stage's StageError.code; UNAVAILABLE (or 0) is what
    // recovery may retry.
    absl::StatusCode code = absl::StatusCode::kUnavailable;
  };
  // A feed is a Pipe stream (common/pipe_stream.h); what it sends back
  // becomes FeedEvents from gRPC's threads.
  struct Feed {
    std::shared_ptr<PipeStream> stream;
    std::string what;  // "input feed to stage 0 (worker ...)"
  };

  // Loads every stage, last first (each opens its stream to the next).
  absl::Status LoadStages(std::vector<v1::StageAssignment> assignments);
  absl::Status OpenFeed(Feed& feed, int stage, v1::StreamOpen::Role role);
  // A feed's reaction to what a stage sent (never blocks).
  void OnFeedMessage(const std::string& what, absl::StatusOr<PipeMessage> m);
  void PushEvent(FeedEvent e);
  void CloseFeeds();
  void ReleaseStages();
  absl::Status SendMicrobatch(const Examples& data, const std::vector<int64_t>& order,
                              int64_t begin, int64_t count, uint64_t id, v1::Phase phase);
  // Cuts the model into stages by schedule.partition; fills the stages'
  // units, parameters, predicted cost and the bottleneck in the job status.
  absl::StatusOr<std::vector<StageRange>> Partition(const ModelPlan& plan);
  // Each worker times every unit (partition "profile"): cost[stage][unit].
  absl::StatusOr<std::vector<std::vector<double>>> Profile(const ModelPlan& plan);
  // Processes feed events until `done()` holds. Fails on cancel, a stage
  // error, a lost worker, or a stall.
  absl::Status WaitUntil(const std::function<bool()>& done);
  void Handle(const FeedEvent& e);
  void Publish(bool force);
  // Stage i's GetStageStatus (3 s deadline), telling it the committed step.
  grpc::Status StageStatus(int i, v1::StageStatusResponse* resp);
  void PollStages();
  // Checkpoints: asks every stage which cut it has written last; when all
  // have written the same one, newer than the last committed, verifies the
  // files and commits its manifest (pipeline/checkpoint.h). Returns a
  // stage's write error, if any.
  // Callers hold commit_mu_.
  absl::Status PollCheckpoints();
  // The committer thread: while the feed loop trains on, polls every 250 ms
  // once a periodic cut is due and commits it, so verifying a cut's files
  // never holds up the feed. A stage's write error ends the run through
  // commit_error_.
  void StartCommitter();
  void StopCommitter();
  void CommitterLoop();
  // Waits until the cut at `step` is committed, at most `seconds`; `what`
  // names the cut in the error.
  absl::Status CommitCheckpointAt(int64_t step, double seconds, const std::string& what);
  // A drain (RunContext::drain) without stopping the pipeline: StartDrain
  // asks every stage for a cut at the end of a step none can have reached
  // (the next after the microbatches fed so far); training goes on until
  // stage 0 applied it; FinishDrain commits that cut and returns how the
  // run ends (UNAVAILABLE naming a leaving stage, or CANCELLED). Later
  // microbatches in flight are dropped: a resume replays them.
  absl::Status StartDrain();
  absl::Status FinishDrain();
  std::string StageLabel(int i) const {
    return absl::StrCat("stage ", i, " (worker ", r_.workers_[i].id(), " at ",
                        r_.workers_[i].address(), ")");
  }

  const JobRunner& r_;
  const v1::JobSpec& spec_;
  const int P_;
  std::vector<std::shared_ptr<grpc::Channel>> channels_;
  std::vector<std::unique_ptr<v1::StageWorker::Stub>> stubs_;
  Feed input_feed_, target_feed_;
  bool feeds_open_ = false;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<FeedEvent> events_;  // GUARDED_BY(mu_)

  // Runner-thread state.
  Data data_;        // the job's examples (PlanRun)
  bool lm_ = false;  // a language model: perplexity and token accuracy
  int64_t warmup_steps_ = 0;
  uint64_t next_id_ = 1;  // the next microbatch id fed
  Clock::time_point epoch_start_;
  int64_t in_flight_ = 0;     // TRAIN microbatches sent, stage-0 backward not done
  int64_t train_done_ = 0;    // stage-0 backwards completed in the whole job
  int64_t eval_pending_ = 0;  // EVAL microbatches sent, result not back
  double window_loss_ = 0;
  int64_t window_count_ = 0;
  double epoch_loss_ = 0;
  int64_t epoch_loss_count_ = 0;
  double eval_loss_ = 0;
  int64_t eval_correct_ = 0, eval_count_ = 0;
  int64_t eval_predictions_ = 0;  // examples, or tokens for a language model
  double last_train_loss_ = NAN;
  int64_t steps_per_epoch_ = 0;
  int64_t total_steps_ = 0;
  int64_t samples_trained_ = 0;
  int epoch_ = 0;
  double train_seconds_ = 0;  // time spent training (not evaluating)
  // A resume from a cut inside an epoch an earlier run finished: that run's
  // result of it, whose share before the cut completes the new one.
  std::optional<v1::EpochResult> cut_epoch_before_;
  Clock::time_point epoch_train_start_;
  Clock::time_point last_event_ = Clock::now();
  Clock::time_point last_publish_;
  Clock::time_point job_start_ = Clock::now();
  // Checkpoints.
  std::string checkpoint_dir_;
  std::vector<StageRange> ranges_;
  std::string manifest_spec_json_;          // the resolved spec, as the manifest keeps it
  std::string input_json_;                  // the input's shape and normalisation
  std::mutex commit_mu_;                    // one poll/commit at a time (committer, runner)
  std::atomic<int64_t> committed_step_{0};  // written under commit_mu_
  int32_t committed_ = 0;                   // GUARDED_BY(commit_mu_)
  // Complete cuts in a row whose files the coordinator could not verify;
  // at kMaxVerifyFailures the job fails naming checkpoint.dir.
  static constexpr int kMaxVerifyFailures = 3;
  int verify_failures_ = 0;             // GUARDED_BY(commit_mu_)
  std::atomic<int64_t> steps_done_{0};  // train_done_ / N, for the committer
  std::thread committer_;
  bool committer_stop_ = false;  // GUARDED_BY(mu_)
  absl::Status commit_error_;    // GUARDED_BY(mu_)
  int64_t drain_step_ = 0;       // the drain's cut, once StartDrain asked for it
  Clock::time_point drain_start_;
  std::map<int64_t, std::map<int, v1::CheckpointWritten>> reported_;  // step -> stage -> files
};

absl::Status JobRunner::Run() {
  Impl impl(*this);
  return impl.Run();
}

absl::Status JobRunner::Impl::LoadStages(std::vector<v1::StageAssignment> assignments) {
  // Last stage first: each stage opens its stream to the next on load.
  for (int i = P_ - 1; i >= 0; --i) {
    v1::StageAssignment& a = assignments[i];
    if (i + 1 < P_) a.set_downstream_address(r_.workers_[i + 1].address());
    v1::LoadStageResponse resp;
    auto ctx = ContextWithDeadline(60);
    grpc::Status st = stubs_[i]->LoadStage(ctx.get(), a, &resp);
    if (st.error_code() == grpc::StatusCode::INVALID_ARGUMENT) {
      // The stage refuses the assignment itself (the spec, or a checkpoint
      // that does not fit the model): any worker would, so recovery, which
      // retries on other workers, cannot help.
      return absl::InvalidArgumentError(
          absl::StrCat("loading ", StageLabel(i), " failed: ", st.error_message()));
    }
    if (!st.ok()) {
      return absl::UnavailableError(
          absl::StrCat("loading ", StageLabel(i), " failed: ", st.error_message()));
    }
    r_.registry_->SetStage(r_.workers_[i].id(), i);
    if (resp.restored_from_memory()) ++r_.context_->restored_from_memory;
    r_.store_
        ->Update(r_.job_id_,
                 [&](v1::JobStatus& s) {
                   auto* stage = s.mutable_stages(i);
                   stage->set_parameters(resp.parameters());
                   stage->set_restored_from_memory(resp.restored_from_memory());
                   stage->set_analytic_delay(resp.analytic_delay());
                 })
        .IgnoreError();
  }
  return absl::OkStatus();
}

absl::Status JobRunner::Impl::OpenFeed(Feed& feed, int stage, v1::StreamOpen::Role role) {
  v1::StageMessage open;
  open.mutable_open()->set_job_id(r_.job_id_);
  open.mutable_open()->set_role(role);
  open.mutable_open()->set_from_stage(-1);
  open.mutable_open()->set_generation(r_.context_->generation);
  feed.what = absl::StrCat(role == v1::StreamOpen::INPUT_FEED ? "input" : "target", " feed to ",
                           StageLabel(stage));
  PipeStream::Callbacks callbacks;
  callbacks.on_message = [this, what = feed.what](absl::StatusOr<PipeMessage> m) {
    OnFeedMessage(what, std::move(m));
    return true;  // results and acks are small and bounded by the window
  };
  callbacks.on_end = [this, what = feed.what](const grpc::Status& st) {
    FeedEvent e;
    e.kind = FeedEvent::kError;
    e.error =
        absl::StrCat("lost the ", what, st.ok() ? "" : absl::StrCat(": ", st.error_message()));
    PushEvent(std::move(e));
  };
  // Sends queue behind at most the in-flight window.
  const size_t capacity =
      static_cast<size_t>(std::max(P_, 2 * spec_.schedule().microbatches_per_step())) + 2;
  feed.stream = OpenPipe(channels_[stage], EncodePipeMessage(open), std::move(callbacks), capacity);
  return absl::OkStatus();
}

void JobRunner::Impl::OnFeedMessage(const std::string& what, absl::StatusOr<PipeMessage> m) {
  FeedEvent e;
  e.kind = FeedEvent::kError;
  if (!m.ok()) {
    e.error = absl::StrCat(what, ": ", m.status().message());
  } else {
    const v1::StageMessage& msg = m->message;
    e.microbatch = msg.microbatch();
    e.phase = msg.phase();
    if (msg.has_done()) {
      e.kind = FeedEvent::kDone;
    } else if (msg.has_result()) {
      e.kind = FeedEvent::kResult;
      e.result = msg.result();
      e.skipped = msg.skipped();
    } else if (msg.has_error()) {
      e.error = msg.error().message();
      if (msg.error().code() != 0) e.code = static_cast<absl::StatusCode>(msg.error().code());
    } else {
      e.error = absl::StrCat(what, " sent an unexpected message");
    }
  }
  PushEvent(std::move(e));
}

void JobRunner::Impl::PushEvent(FeedEvent e) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back(std::move(e));
  }
  cv_.notify_all();
}

void JobRunner::Impl::CloseFeeds() {
  for (Feed* f : {&input_feed_, &target_feed_}) {
    if (!f->stream) continue;
    f->stream->CloseAndWait();  // after it, no event from this feed
    f->stream.reset();
  }
}

void JobRunner::Impl::ReleaseStages() {
  // In parallel would be faster; stages release in milliseconds, and a dead
  // worker costs one short deadline.
  for (size_t i = 0; i < stubs_.size(); ++i) {
    v1::ReleaseStageRequest req;
    req.set_job_id(r_.job_id_);
    v1::ReleaseStageResponse resp;
    auto ctx = ContextWithDeadline(3);
    grpc::Status st = stubs_[i]->ReleaseStage(ctx.get(), req, &resp);
    if (st.error_code() == grpc::StatusCode::UNAVAILABLE ||
        st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ||
        r_.registry_->IsLost(r_.workers_[i].id())) {
      // Dead or cut off: not idle for the next job (or this one's recovery)
      // until it heartbeats again.
      r_.registry_->MarkUnreachable(r_.workers_[i].id());
      r_.context_->lost_stages.push_back(static_cast<int>(i));
      LogWarning(ForJob(r_.job_id_), absl::StrCat(StageLabel(i), " is unreachable (",
                                                  st.error_message(), "); marked LOST"));
    }
  }
}

absl::Status JobRunner::Impl::SendMicrobatch(const Examples& data,
                                             const std::vector<int64_t>& order, int64_t begin,
                                             int64_t count, uint64_t id, v1::Phase phase) {
  const int64_t in_size = data.InputSize(), target_size = data.TargetSize();
  const bool tokens = data.token_input();
  // The feed sends these buffers as they are (common/pipe_wire.h): each
  // message's payload slice keeps its buffer until gRPC has written it.
  auto x = std::make_shared<std::vector<float>>(tokens ? 0 : count * in_size);
  auto t = std::make_shared<std::vector<int64_t>>(tokens ? count * in_size : 0);
  auto y = std::make_shared<std::vector<int64_t>>(count * target_size);
  for (int64_t j = 0; j < count; ++j) {
    const int64_t src = order.empty() ? begin + j : order[begin + j];
    if (tokens) {
      std::copy_n(data.tokens.data() + src * in_size, in_size, t->data() + j * in_size);
    } else {
      std::copy_n(data.inputs.data() + src * in_size, in_size, x->data() + j * in_size);
    }
    std::copy_n(data.targets.data() + src * target_size, target_size, y->data() + j * target_size);
  }
  v1::StageMessage targets;
  targets.set_microbatch(id);
  targets.set_phase(phase);
  targets.mutable_targets()->set_dtype(v1::INT64);
  targets.mutable_targets()->add_shape(count);
  for (int64_t d : data.target_shape) targets.mutable_targets()->add_shape(d);
  v1::StageMessage input;
  input.set_microbatch(id);
  input.set_phase(phase);
  input.mutable_activation()->set_dtype(tokens ? v1::INT64 : v1::FLOAT32);
  input.mutable_activation()->add_shape(count);
  for (int64_t d : data.input_shape) input.mutable_activation()->add_shape(d);
  WirePayload in_payload = tokens ? WirePayload{t->data(), t->size() * sizeof(int64_t), t}
                                  : WirePayload{x->data(), x->size() * sizeof(float), x};
  // Targets first, so the last stage has them when the activation arrives.
  if (!target_feed_.stream->Send(
          EncodePipeMessage(targets, {y->data(), y->size() * sizeof(int64_t), y}))) {
    return absl::UnavailableError(absl::StrCat("lost the target feed to ", StageLabel(P_ - 1)));
  }
  if (!input_feed_.stream->Send(EncodePipeMessage(input, std::move(in_payload)))) {
    return absl::UnavailableError(absl::StrCat("lost the input feed to ", StageLabel(0)));
  }
  return absl::OkStatus();
}

void JobRunner::Impl::Handle(const FeedEvent& e) {
  if (e.kind == FeedEvent::kDone) {
    --in_flight_;
    ++train_done_;
    steps_done_.store(train_done_ / spec_.schedule().microbatches_per_step());
    if (r_.context_->recovering_since != Clock::time_point() &&
        train_done_ % spec_.schedule().microbatches_per_step() == 0) {
      // The first step trained after a recovery ends its timeline.
      const double seconds =
          std::chrono::duration<double>(Clock::now() - r_.context_->recovering_since).count();
      r_.context_->recovering_since = Clock::time_point();
      r_.store_
          ->Update(r_.job_id_,
                   [&](v1::JobStatus& s) {
                     if (!s.restarts().empty()) {
                       s.mutable_restarts()->rbegin()->set_recover_seconds(seconds);
                     }
                   })
          .IgnoreError();
      LogInfo(ForJob(r_.job_id_), absl::StrCat("recovered: first step trained ", seconds,
                                               " s after the failure was detected"));
    }
  } else if (e.kind == FeedEvent::kResult) {
    if (e.skipped) {
      // Dropped for a NaN or Inf (train.on_nonfinite: skip): counted by
      // the stage that dropped it, in no loss or accuracy.
      if (e.phase == v1::EVAL) --eval_pending_;
    } else if (e.phase == v1::EVAL) {
      --eval_pending_;
      // Losses are means over predictions (examples or tokens).
      const int64_t predictions =
          e.result.predictions() > 0 ? e.result.predictions() : e.result.count();
      eval_loss_ += e.result.loss() * predictions;
      eval_correct_ += e.result.correct();
      eval_count_ += e.result.count();
      eval_predictions_ += predictions;
    } else {
      window_loss_ += e.result.loss();
      ++window_count_;
      epoch_loss_ += e.result.loss();
      ++epoch_loss_count_;
      samples_trained_ += e.result.count();
    }
  }
}

absl::Status JobRunner::Impl::WaitUntil(const std::function<bool()>& done) {
  while (!done()) {
    if (r_.cancel_->load()) return absl::CancelledError("cancelled by the user");
    FeedEvent e;
    bool got = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (!commit_error_.ok()) return commit_error_;
      cv_.wait_for(lock, std::chrono::milliseconds(200),
                   [&] { return !events_.empty() || !commit_error_.ok(); });
      if (!events_.empty()) {
        e = std::move(events_.front());
        events_.pop_front();
        got = true;
      }
    }
    if (got) {
      last_event_ = Clock::now();
      if (e.kind == FeedEvent::kError) return absl::Status(e.code, e.error);
      Handle(e);
      Publish(false);
      continue;
    }
    for (int i = 0; i < P_; ++i) {
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
  if (window_count_ > 0) {
    last_train_loss_ = window_loss_ / window_count_;
    window_loss_ = 0;
    window_count_ = 0;
  }
  const int N = spec_.schedule().microbatches_per_step();
  const int64_t steps = train_done_ / N;
  const double training =
      train_seconds_ + (epoch_train_start_.time_since_epoch().count() != 0
                            ? std::chrono::duration<double>(now - epoch_train_start_).count()
                            : 0.0);
  r_.store_
      ->Update(r_.job_id_,
               [&](v1::JobStatus& s) {
                 auto* p = s.mutable_progress();
                 p->set_epoch(epoch_);
                 p->set_epochs(spec_.train().epochs());
                 p->set_step(steps);
                 p->set_total_steps(total_steps_);
                 auto* m = s.mutable_metrics();
                 if (!std::isnan(last_train_loss_)) m->set_train_loss(last_train_loss_);
                 if (training > 0) m->set_samples_per_second(samples_trained_ / training);
                 m->set_elapsed_seconds(std::chrono::duration<double>(now - job_start_).count());
                 if (steps > 0) {
                   m->set_eta_seconds(training / steps * static_cast<double>(total_steps_ - steps));
                 }
               })
      .IgnoreError();
}

grpc::Status JobRunner::Impl::StageStatus(int i, v1::StageStatusResponse* resp) {
  v1::StageStatusRequest req;
  req.set_job_id(r_.job_id_);
  req.set_committed_step(committed_step_.load());
  auto ctx = ContextWithDeadline(3);
  return stubs_[i]->GetStageStatus(ctx.get(), req, resp);
}

void JobRunner::Impl::PollStages() {
  for (int i = 0; i < P_; ++i) {
    v1::StageStatusResponse resp;
    if (!StageStatus(i, &resp).ok()) continue;
    r_.store_
        ->Update(r_.job_id_,
                 [&](v1::JobStatus& s) {
                   s.mutable_stages(i)->set_measured_delay(resp.measured_delay());
                   s.mutable_stages(i)->set_learning_rate(resp.learning_rate());
                   *s.mutable_stages(i)->mutable_memory() = resp.memory();
                   *s.mutable_stages(i)->mutable_peak_memory() = resp.peak_memory();
                   s.mutable_stages(i)->set_async_from_step(resp.async_from_step());
                   s.mutable_stages(i)->set_nonfinite_skipped(resp.nonfinite_skipped());
                 })
        .IgnoreError();
  }
}

void JobRunner::Impl::StartCommitter() {
  if (spec_.checkpoint().every_steps() <= 0) return;  // only the final cut
  committer_ = std::thread([this] { CommitterLoop(); });
}

void JobRunner::Impl::StopCommitter() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    committer_stop_ = true;
  }
  cv_.notify_all();
  if (committer_.joinable()) committer_.join();
}

void JobRunner::Impl::CommitterLoop() {
  NameThisThread("ckpt-committer");
  const int64_t every = spec_.checkpoint().every_steps();
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (cv_.wait_for(lock, std::chrono::milliseconds(250), [&] { return committer_stop_; })) {
        return;
      }
    }
    if (steps_done_.load() < committed_step_.load() + every) continue;  // no cut due
    absl::Status st;
    {
      std::lock_guard<std::mutex> lock(commit_mu_);
      st = PollCheckpoints();
    }
    if (!st.ok()) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        commit_error_ = st;
      }
      cv_.notify_all();
      return;
    }
  }
}

absl::Status JobRunner::Impl::PollCheckpoints() {
  std::vector<v1::CheckpointWritten> written(P_);
  // Stages reach a cut at different moments: remember every cut each one
  // holds, across polls, and commit the newest that all have written.
  auto report = [&](int i, const v1::CheckpointWritten& w) {
    if (w.step() > committed_step_ && w.generation() == r_.context_->generation) {
      reported_[w.step()][i] = w;
    }
  };
  for (int i = 0; i < P_; ++i) {
    v1::StageStatusResponse resp;
    if (!StageStatus(i, &resp).ok()) return absl::OkStatus();
    if (!resp.checkpoint().error().empty()) {
      // The operator's to fix, not a lost worker's: no recovery.
      return absl::FailedPreconditionError(absl::StrCat(
          StageLabel(i), " could not write its checkpoint: ", resp.checkpoint().error(),
          "; check checkpoint.dir (", checkpoint_dir_, ") is writable from every worker"));
    }
    // Another run's cuts (fencing) are not this run's to commit.
    report(i, resp.checkpoint());
    for (const auto& held : resp.held()) report(i, held);
  }
  int64_t step = 0;
  for (auto it = reported_.rbegin(); it != reported_.rend(); ++it) {
    if (static_cast<int>(it->second.size()) == P_) {
      step = it->first;
      break;
    }
  }
  if (step <= committed_step_) return absl::OkStatus();
  for (int i = 0; i < P_; ++i) written[i] = reported_[step][i];
  reported_.erase(reported_.begin(), reported_.upper_bound(step));
  const int N = spec_.schedule().microbatches_per_step();
  Manifest m;
  m.job = r_.job_id_;
  m.generation = r_.context_->generation;
  m.step = step;
  m.microbatch = step * N;
  m.epoch = step / steps_per_epoch_ + 1;
  m.index_in_epoch = (step % steps_per_epoch_) * N * spec_.schedule().microbatch_size();
  m.seed = spec_.train().seed();
  for (const auto& r : ranges_) m.stages.push_back({r.first_unit, r.units});
  m.spec_json = manifest_spec_json_;
  m.input_json = input_json_;
  for (const auto& w : written) {
    for (const auto& f : w.files()) m.files.push_back({f.unit(), f.path(), f.bytes(), f.sha256()});
  }
  const auto start = Clock::now();
  if (auto st = CommitManifest(checkpoint_dir_, m, spec_.checkpoint().keep()); !st.ok()) {
    // A damaged cut is not committed; the previous one stays "latest".
    LogError(ForJob(r_.job_id_),
             absl::StrCat("checkpoint at step ", step, " not committed: ", st.message()));
    if (absl::IsDataLoss(st) && ++verify_failures_ >= kMaxVerifyFailures) {
      // Not one damaged cut but a directory the coordinator does not share
      // with the workers: the operator's to fix, recovering cannot help.
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint.dir (", checkpoint_dir_, "): the coordinator could not verify ",
          verify_failures_, " cuts in a row that every stage reported written (", st.message(),
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
  for (int i = 0; i < P_; ++i) {
    v1::StageStatusResponse resp;
    (void)StageStatus(i, &resp);
  }
  const std::string manifest =
      CheckpointStepDir(checkpoint_dir_, r_.job_id_, step) + "/manifest.json";
  LogInfo(
      ForJob(r_.job_id_),
      absl::StrCat("checkpoint committed at step ", step, " (microbatch ", m.microbatch, ", ",
                   m.files.size(), " units, verified in ",
                   std::chrono::duration<double>(Clock::now() - start).count(), " s): ", manifest));
  r_.store_
      ->Update(r_.job_id_,
               [&](v1::JobStatus& s) {
                 s.mutable_checkpoint()->set_step(step);
                 s.mutable_checkpoint()->set_manifest(manifest);
                 s.mutable_checkpoint()->set_committed(committed_);
               })
      .IgnoreError();
  return absl::OkStatus();
}

absl::Status JobRunner::Impl::CommitCheckpointAt(int64_t step, double seconds,
                                                 const std::string& what) {
  const auto deadline = Clock::now() + std::chrono::duration<double>(seconds);
  while (committed_step_ < step) {
    if (r_.cancel_->load()) return absl::CancelledError("cancelled by the user");
    absl::Status st;
    {
      std::lock_guard<std::mutex> lock(commit_mu_);
      st = PollCheckpoints();
    }
    if (!st.ok()) return st;
    if (committed_step_ >= step) break;
    if (Clock::now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "the stages did not all write ", what, " (step ", step, ") to ", checkpoint_dir_,
          " within ", seconds,
          " s; check that checkpoint.dir is the same shared directory on every worker"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return absl::OkStatus();
}

absl::Status JobRunner::Impl::StartDrain() {
  const auto [why, stage] = r_.context_->drain->reason();
  const int N = spec_.schedule().microbatches_per_step();
  // No stage can have applied a step whose last microbatch was not fed.
  const int64_t fed = train_done_ + in_flight_;
  drain_step_ = fed / N + 1;
  drain_start_ = Clock::now();
  LogInfo(ForJob(r_.job_id_), absl::StrCat("draining (", why, "): cutting at step ", drain_step_,
                                           " while training on"));
  for (int i = 0; i < P_; ++i) {
    v1::CutCheckpointRequest req;
    req.set_job_id(r_.job_id_);
    req.set_step(drain_step_);
    v1::CutCheckpointResponse resp;
    auto ctx = ContextWithDeadline(r_.options_.drain_timeout_seconds);
    grpc::Status cut = stubs_[i]->CutCheckpoint(ctx.get(), req, &resp);
    if (!cut.ok()) {
      // The newest periodic cut stands; the run ends now.
      LogError(ForJob(r_.job_id_), absl::StrCat("drain: ", StageLabel(i), " cannot cut at step ",
                                                drain_step_, ": ", cut.error_message()));
      drain_step_ = committed_step_;
      return FinishDrain();
    }
  }
  return absl::OkStatus();
}

absl::Status JobRunner::Impl::FinishDrain() {
  const auto [why, stage] = r_.context_->drain->reason();
  absl::Status st = absl::OkStatus();
  if (drain_step_ > committed_step_) {
    st = CommitCheckpointAt(drain_step_, r_.options_.drain_timeout_seconds,
                            "the drain's checkpoint");
  }
  Publish(true);
  if (!st.ok()) {
    LogError(ForJob(r_.job_id_), absl::StrCat("drain: ", st.message()));
  } else {
    LogInfo(ForJob(r_.job_id_),
            absl::StrCat("drained and committed the cut at step ", committed_step_.load(), " in ",
                         std::chrono::duration<double>(Clock::now() - drain_start_).count(), " s"));
  }
  if (stage >= 0) {
    r_.context_->lost_stages.push_back(stage);
    return absl::UnavailableError(absl::StrCat(StageLabel(stage), " left (", why,
                                               "); drained at step ", committed_step_.load()));
  }
  return absl::CancelledError(why);
}

absl::StatusOr<std::vector<std::vector<double>>> JobRunner::Impl::Profile(const ModelPlan& plan) {
  v1::ProfileRequest req;
  *req.mutable_model() = plan.model;
  req.set_torchscript(plan.torchscript);
  for (int64_t dim : plan.input.shape) req.add_input_shape(dim);
  req.set_token_input(plan.input.tokens);
  req.set_vocab(plan.model.classes() > 0 ? plan.model.classes() : 256);
  req.set_microbatch_size(spec_.schedule().microbatch_size());
  req.set_repeats(3);
  req.set_seed(spec_.train().seed());
  // One worker at a time: workers that share a host would time each other.
  std::vector<std::vector<double>> cost(P_);
  for (int i = 0; i < P_; ++i) {
    if (r_.cancel_->load()) return absl::CancelledError("cancelled by the user");
    v1::ProfileResponse resp;
    auto ctx = ContextWithDeadline(300);
    grpc::Status st = stubs_[i]->ProfileUnits(ctx.get(), req, &resp);
    if (!st.ok()) {
      return absl::UnavailableError(
          absl::StrCat("profiling on ", StageLabel(i), " failed: ", st.error_message()));
    }
    if (resp.forward_seconds_size() != static_cast<int>(plan.units.size()) ||
        resp.backward_seconds_size() != resp.forward_seconds_size()) {
      return absl::InternalError(absl::StrCat(StageLabel(i), " profiled ",
                                              resp.forward_seconds_size(), " units of ",
                                              plan.units.size()));
    }
    for (int u = 0; u < resp.forward_seconds_size(); ++u) {
      cost[i].push_back(resp.forward_seconds(u) + resp.backward_seconds(u));
    }
    std::string ms;
    for (double c : cost[i]) absl::StrAppend(&ms, ms.empty() ? "" : " ", std::round(c * 1e5) / 100);
    LogInfo(ForJob(r_.job_id_), absl::StrCat("profiled ", plan.units.size(), " units on ",
                                             StageLabel(i), ": forward + backward ms [", ms, "]"));
  }
  return cost;
}

absl::StatusOr<std::vector<StageRange>> JobRunner::Impl::Partition(const ModelPlan& plan) {
  const auto& sched = spec_.schedule();
  const std::string kind = sched.partition().empty() ? "uniform" : sched.partition();
  const int units = static_cast<int>(plan.units.size());
  std::vector<double> params;
  for (const auto& u : plan.units) params.push_back(static_cast<double>(u.parameters));
  absl::StatusOr<std::vector<StageRange>> ranges;
  std::vector<double> predicted;  // seconds per microbatch ("profile" only)
  if (kind == "profile") {
    auto cost = Profile(plan);
    if (!cost.ok()) return cost.status();
    ranges = PartitionByCost(*cost, P_);
    if (ranges.ok()) predicted = StageCosts(*ranges, *cost);
  } else if (kind == "parameters") {
    std::vector<int64_t> exact;  // integer arithmetic: exact ties
    for (const auto& u : plan.units) exact.push_back(u.parameters);
    ranges = PartitionByParameters(exact, P_);
  } else if (kind == "split") {
    ranges = PartitionFromSplit({sched.split().begin(), sched.split().end()}, units, P_);
  } else {
    ranges = PartitionUniform(units, P_);
  }
  if (!ranges.ok()) return ranges.status();
  const std::vector<double> stage_params = StageCosts(*ranges, {params});
  // The bottleneck by the partition's own cost: seconds, parameters, or
  // (uniform and split) units.
  std::vector<double> by = predicted;
  if (kind == "parameters") by = stage_params;
  if (by.empty()) {
    for (const auto& r : *ranges) by.push_back(r.units);
  }
  const int bottleneck = Bottleneck(by);
  std::string summary;
  r_.store_
      ->Update(r_.job_id_,
               [&](v1::JobStatus& s) {
                 s.set_partition(kind);
                 s.clear_stages();
                 for (int i = 0; i < P_; ++i) {
                   const StageRange& r = (*ranges)[i];
                   auto* st = s.add_stages();
                   st->set_index(i);
                   st->set_worker_id(r_.workers_[i].id());
                   st->set_worker_address(r_.workers_[i].address());
                   st->set_first_unit(r.first_unit);
                   st->set_units(r.units);
                   st->set_parameters(static_cast<int64_t>(stage_params[i]));
                   if (!predicted.empty()) st->set_predicted_seconds(predicted[i]);
                   st->set_bottleneck(i == bottleneck);
                   absl::StrAppend(
                       &summary, i ? ", " : "", "[", r.first_unit, ",", r.first_unit + r.units, ")",
                       predicted.empty()
                           ? ""
                           : absl::StrCat(" ", std::round(predicted[i] * 1e4) / 10, " ms"));
                 }
               })
      .IgnoreError();
  LogInfo(ForJob(r_.job_id_), absl::StrCat("partition ", kind, " of ", units, " units: ", summary,
                                           "; bottleneck stage ", bottleneck));
  return ranges;
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
    CloseFeeds();
    ReleaseStages();
    return st;
  }
  Publish(true);
  StartCommitter();
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
  StopCommitter();
  // The trained model: the cut after the last step, committed before the
  // stages are released.
  if (st.ok()) {
    st = CommitCheckpointAt(total_steps_, r_.options_.final_checkpoint_timeout_seconds,
                            "the final checkpoint");
  }
  Publish(true);
  CloseFeeds();
  ReleaseStages();
  return st;
}

absl::StatusOr<std::vector<v1::StageAssignment>> JobRunner::Impl::PlanRun() {
  const auto& sched = spec_.schedule();
  const int N = sched.microbatches_per_step();
  const int64_t mbs = sched.microbatch_size();
  for (int i = 0; i < P_; ++i) {
    channels_.push_back(MakeChannel(r_.workers_[i].address()));
    stubs_.push_back(v1::StageWorker::NewStub(channels_.back()));
  }
  auto data = LoadData(spec_.data());
  if (!data.ok()) return absl::InvalidArgumentError(data.status().message());
  data_ = std::move(*data);
  // Checked at submit; the files may have changed since.
  auto plan = PlanModel(spec_, data_.info, r_.options_.max_model_bytes);
  if (!plan.ok()) return absl::InvalidArgumentError(plan.status().message());
  lm_ = data_.info.task == Task::kLanguageModel;
  r_.store_
      ->Update(r_.job_id_,
               [&](v1::JobStatus& s) { s.set_task(lm_ ? "language_model" : "classification"); })
      .IgnoreError();
  LogInfo(ForJob(r_.job_id_),
          absl::StrCat("data: ", data_.info.description,
                       data_.normalisation.empty() ? "" : "; normalised ", data_.normalisation));
  auto ranges = Partition(*plan);
  if (!ranges.ok()) return ranges.status();
  steps_per_epoch_ = StepsPerEpoch(data_.train.count, sched);
  if (steps_per_epoch_ < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data.train_limit: ", data_.train.count, " training examples make no full step of ", N,
        " microbatches of ", mbs, "; use more data or smaller schedule.microbatch_size"));
  }
  total_steps_ = steps_per_epoch_ * spec_.train().epochs();
  v1::JobSpec resolved = spec_;
  *resolved.mutable_model() = plan->model;
  auto assignments = ResolveStageAssignments(resolved, r_.job_id_, steps_per_epoch_, &*ranges);
  if (!assignments.ok()) return assignments.status();
  ranges_ = *ranges;
  checkpoint_dir_ =
      spec_.checkpoint().dir().empty() ? r_.options_.checkpoint_dir : spec_.checkpoint().dir();
  {
    google::protobuf::util::JsonPrintOptions json;
    json.preserve_proto_field_names = true;  // as the spec files spell them
    // Cannot fail for a valid message; an empty spec would only leave the
    // manifest without it.
    (void)google::protobuf::util::MessageToJsonString(resolved, &manifest_spec_json_, json);
  }
  {
    std::string shape, channels;
    for (int64_t dim : plan->input.shape) absl::StrAppend(&shape, shape.empty() ? "" : ",", dim);
    for (const auto& c : data_.channels) {
      absl::StrAppend(&channels, channels.empty() ? "" : ",", "{\"mean\":", c.mean,
                      ",\"std\":", c.std, "}");
    }
    input_json_ =
        absl::StrCat("{\"shape\":[", shape, "],\"tokens\":", plan->input.tokens ? "true" : "false",
                     ",\"normalisation\":[", channels, "]}");
  }
  for (auto& a : *assignments) {
    a.set_checkpoint_dir(checkpoint_dir_);
    a.set_generation(r_.context_->generation);
    for (int64_t dim : plan->units[a.first_unit()].in.shape) a.add_input_shape(dim);
    for (int64_t dim : plan->units[a.first_unit() + a.units() - 1].out.shape) {
      a.add_output_shape(dim);
    }
    a.set_token_input(plan->units[a.first_unit()].in.tokens);
    a.set_torchscript(plan->torchscript);
  }
  // T3: synchronous for the first W steps (asynchronous schedules only).
  warmup_steps_ = assignments->front().warmup_steps();
  // The schedule as data: refuse a plan that cannot run before any stage loads.
  PlanOptions options{sched.type(), P_, N, steps_per_epoch_, 0, warmup_steps_};
  auto built = BuildPlan(options);
  absl::Status valid = built.ok() ? ValidatePlan(*built) : built.status();
  if (!valid.ok()) return valid;
  return assignments;
}

namespace {
// Each stage's units' files of the cut `m` (any partition's: by unit index).
void AddRestoreFiles(const Manifest& m, std::vector<v1::StageAssignment>& assignments) {
  for (auto& a : assignments) {
    for (const auto& f : m.files) {
      if (f.unit < a.first_unit() || f.unit >= a.first_unit() + a.units()) continue;
      auto* file = a.add_restore();
      file->set_unit(f.unit);
      file->set_path(f.path);
      file->set_bytes(f.bytes);
      file->set_sha256(f.sha256);
    }
  }
}
}  // namespace

absl::Status JobRunner::Impl::ApplyResume(std::vector<v1::StageAssignment>& assignments) {
  const Manifest* resume = r_.context_->resume;
  if (resume == nullptr || r_.context_->weights_only) {
    // A first run, or one run again from its first step: no old results.
    r_.store_->Update(r_.job_id_, [](v1::JobStatus& s) { s.clear_epochs(); }).IgnoreError();
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
  committed_step_ = resume->step;
  train_done_ = resume->step * spec_.schedule().microbatches_per_step();
  steps_done_ = resume->step;
  LogInfo(ForJob(r_.job_id_),
          absl::StrCat("resuming from the checkpoint at step ", resume->step, " (microbatch ",
                       resume->microbatch, ", epoch ", resume->epoch, ", example ",
                       resume->index_in_epoch, " of its order)"));
  r_.store_
      ->Update(r_.job_id_,
               [&](v1::JobStatus& s) {
                 s.set_resumed_from_step(resume->step);
                 committed_ = s.checkpoint().committed();
                 // Results after the cut are trained again. The epoch the cut
                 // falls in is trained only from the cut on: what an earlier
                 // run measured of it stands for the part before the cut.
                 auto* epochs = s.mutable_epochs();
                 while (!epochs->empty() && epochs->rbegin()->epoch() >= resume->epoch) {
                   if (epochs->rbegin()->epoch() == resume->epoch) {
                     cut_epoch_before_ = *epochs->rbegin();
                   }
                   epochs->RemoveLast();
                 }
               })
      .IgnoreError();
  for (auto& a : assignments) a.set_start_step(resume->step);
  AddRestoreFiles(*resume, assignments);
  return absl::OkStatus();
}

absl::Status JobRunner::Impl::LoadRun(std::vector<v1::StageAssignment> assignments) {
  absl::Status st = LoadStages(std::move(assignments));
  if (st.ok() && r_.context_->recovering_since != Clock::time_point()) {
    const int from_memory = r_.context_->restored_from_memory;
    r_.store_
        ->Update(r_.job_id_,
                 [&](v1::JobStatus& s) {
                   if (!s.restarts().empty()) {
                     s.mutable_restarts()->rbegin()->set_restored_from_memory(from_memory);
                   }
                 })
        .IgnoreError();
  }
  if (st.ok()) st = OpenFeed(target_feed_, P_ - 1, v1::StreamOpen::TARGET_FEED);
  if (st.ok()) st = OpenFeed(input_feed_, 0, v1::StreamOpen::INPUT_FEED);
  return st;
}

absl::Status JobRunner::Impl::TrainEpoch(int64_t first_j) {
  const auto& sched = spec_.schedule();
  const int N = sched.microbatches_per_step();
  const int64_t mbs = sched.microbatch_size();
  const bool gpipe = sched.type() == "gpipe";
  const std::vector<int64_t> order = EpochOrder(data_.train.count, spec_.train(), epoch_);
  epoch_loss_ = 0;
  epoch_loss_count_ = 0;
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
    if (drain_step_ == 0 && r_.context_->drain != nullptr && r_.context_->drain->requested()) {
      st = StartDrain();
      if (!st.ok()) break;
    }
    if (drain_step_ > 0 && train_done_ >= drain_step_ * N) {
      st = FinishDrain();
      break;
    }
    const int64_t window = InFlightWindow(sync, P_, N);
    st = WaitUntil([&] { return in_flight_ < window; });
    if (st.ok()) st = SendMicrobatch(data_.train, order, j * mbs, mbs, next_id_++, v1::TRAIN);
    if (st.ok()) ++in_flight_;
  }
  if (st.ok()) st = WaitUntil([&] { return in_flight_ == 0; });
  train_seconds_ += std::chrono::duration<double>(Clock::now() - epoch_train_start_).count();
  epoch_train_start_ = Clock::time_point();
  return st;
}

absl::Status JobRunner::Impl::EvaluateEpoch() {
  // The whole test split with the epoch's final weights.
  const Examples& test = data_.test;
  const int64_t eval_mbs = EvalMicrobatchSize(spec_.schedule().microbatch_size());
  eval_loss_ = 0;
  eval_correct_ = eval_count_ = eval_predictions_ = 0;
  absl::Status st;
  for (int64_t b = 0; b < test.count && st.ok(); b += eval_mbs) {
    st = WaitUntil([&] { return eval_pending_ < P_ + 1; });
    if (st.ok()) {
      st = SendMicrobatch(test, {}, b, std::min(eval_mbs, test.count - b), next_id_++, v1::EVAL);
    }
    if (st.ok()) ++eval_pending_;
  }
  if (st.ok()) st = WaitUntil([&] { return eval_pending_ == 0; });
  if (!st.ok()) return st;
  PollStages();
  // Accuracy over predictions: examples, or next tokens for a language model.
  const double accuracy =
      eval_predictions_ ? static_cast<double>(eval_correct_) / eval_predictions_ : 0;
  const double test_loss = eval_predictions_ ? eval_loss_ / eval_predictions_ : 0;
  const double perplexity = lm_ ? std::exp(test_loss) : 0;
  double epoch_train_loss = epoch_loss_count_ ? epoch_loss_ / epoch_loss_count_ : 0;
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
  r_.store_
      ->Update(r_.job_id_,
               [&](v1::JobStatus& s) {
                 auto* e = s.add_epochs();
                 e->set_epoch(epoch_);
                 e->set_train_loss(epoch_train_loss);
                 e->set_test_loss(test_loss);
                 e->set_test_accuracy(accuracy);
                 e->set_seconds(seconds);
                 s.mutable_metrics()->set_test_accuracy(accuracy);
                 s.mutable_metrics()->set_test_loss(test_loss);
                 if (lm_) {
                   e->set_test_perplexity(perplexity);
                   s.mutable_metrics()->set_test_perplexity(perplexity);
                 }
               })
      .IgnoreError();
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
