#include "coordinator/job_manager.h"

#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "common/log.h"
#include "common/thread_name.h"
#include "google/protobuf/util/json_util.h"
#include "google/protobuf/util/message_differencer.h"
#include "pipeline/core/checkpoint.h"
#include "pipeline/core/data.h"
#include "pipeline/core/file_access.h"
#include "pipeline/core/job_spec.h"
#include "pipeline/core/schedule.h"
#include "pipeline/core/settings.h"
#include "pipeline/model/model_plan.h"

namespace pipemare {

JobManager::JobManager(JobStore* store, WorkerRegistry* registry, RunnerOptions options,
                       RunOnce run)
    : store_(store),
      registry_(registry),
      options_(options),
      run_(run ? std::move(run)
               : RunOnce([this](const std::string& id, const v1::JobSpec& spec,
                                const std::vector<v1::WorkerInfo>& workers,
                                const std::atomic<bool>& cancel, RunContext* context) {
                   return JobRunner(id, spec, workers, store_, registry_, &cancel, options_,
                                    context)
                       .Run();
                 })) {
  scheduler_ = std::thread([this] { SchedulerLoop(); });
}

JobManager::~JobManager() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    // Each running job drains and cuts a checkpoint at its next step; the
    // next coordinator on this state directory continues from there.
    for (auto& [id, drain] : drains_) drain->Request("the coordinator is stopping", -1);
  }
  cv_.SignalAll();
  scheduler_.join();
  {
    absl::MutexLock lock(&mu_);
    const absl::Time deadline = absl::Now() + absl::Seconds(options_.drain_timeout_seconds + 5);
    while (!runners_.empty() && !cv_.WaitWithDeadline(&mu_, deadline)) {
    }
    for (auto& [id, flag] : cancel_) flag->store(true);  // past the bound
  }
  std::map<std::string, std::thread> runners;
  std::vector<std::thread> finished;
  {
    absl::MutexLock lock(&mu_);
    runners.swap(runners_);
    finished.swap(finished_);
  }
  for (auto& [id, t] : runners) t.join();
  for (auto& t : finished) t.join();
}

namespace {
// The checkpoint directory of a job: <dir>/<job>/step-<k>/manifest.json.
std::string CheckpointDirOf(const v1::JobStatus& job) {
  return std::filesystem::path(job.checkpoint().manifest())
      .parent_path()
      .parent_path()
      .parent_path()
      .string();
}

// A job needs stages x replicas workers at once; with a bound on the
// cluster's workers (--max-workers), more than that can never start.
absl::Status CheckWorkersCanCome(const v1::JobSpec& spec, int max_workers) {
  const int P = spec.schedule().stages(), R = Replicas(spec.schedule());
  if (max_workers <= 0 || static_cast<int64_t>(P) * R <= max_workers) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "schedule.replicas x schedule.stages: ", R, " x ", P, " = ", static_cast<int64_t>(P) * R,
      " workers, and this cluster has at most ", max_workers,
      " (the coordinator's --max-workers); lower schedule.replicas or schedule.stages, or raise "
      "--max-workers once the cluster has more workers"));
}
}  // namespace

absl::StatusOr<Manifest> JobManager::ResolveFrom(const std::string& from,
                                                 std::string* manifest_path) {
  namespace fs = std::filesystem;
  if (auto job = store_->Get(from); job.ok()) {
    if (job->checkpoint().manifest().empty()) {
      return absl::InvalidArgumentError(absl::StrCat("from_checkpoint: job ", from,
                                                     " has no committed checkpoint to start from"));
    }
    auto m = NewestValidManifest(CheckpointDirOf(*job), from);
    if (!m.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("from_checkpoint: job ", from, ": ", m.status().message()));
    }
    *manifest_path = CheckpointStepDir(CheckpointDirOf(*job), from, m->step) + "/manifest.json";
    return m;
  }
  if (auto st = CheckDirectoryUnderRoots(from, "from_checkpoint", options_.checkpoint_dir);
      !st.ok()) {
    return st;
  }
  std::error_code ec;
  fs::path path = fs::absolute(from, ec);
  if (fs::is_regular_file(path, ec) && path.filename() == "manifest.json") {
    path = path.parent_path();
  }
  if (!fs::is_directory(path, ec)) {
    return absl::InvalidArgumentError(
        absl::StrCat("from_checkpoint: '", from,
                     "' is neither a job id nor a checkpoint step directory on the "
                     "coordinator's host (<checkpoint.dir>/<job>/step-<k>)"));
  }
  auto m = ReadManifest(path.string());
  if (!m.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("from_checkpoint: ", path.string(), ": ", m.status().message()));
  }
  *manifest_path = (path / "manifest.json").string();
  return m;
}

absl::StatusOr<v1::JobStatus> JobManager::Submit(v1::JobSpec spec, const std::string& from,
                                                 const std::string& submitter,
                                                 const std::string& init_from) {
  if (!from.empty() && !init_from.empty()) {
    return absl::InvalidArgumentError(
        "from_checkpoint and init_from: give one (--from continues a job's training, "
        "--init-from starts a new one from its weights)");
  }
  ApplyJobSpecDefaults(spec);
  if (auto st = ValidateJobSpec(spec); !st.ok()) return st;
  if (auto st = CheckWorkersCanCome(spec, options_.max_workers); !st.ok()) return st;
  int queued = 0;
  for (const v1::JobStatus& job : store_->List()) {
    if (job.state() == v1::PENDING && job.submitted_by() == submitter) ++queued;
  }
  if (queued >= options_.max_queued_jobs_per_submitter) {
    return absl::ResourceExhaustedError(absl::StrCat(
        submitter, " already has ", queued,
        " jobs waiting for workers, the most one submitter "
        "may queue (the coordinator's --max-queued-jobs); wait for one to start or cancel one"));
  }
  // Checkpoints are written by the coordinator and every worker: only where
  // the operator allows (the data roots, or --checkpoint-dir).
  if (!spec.checkpoint().dir().empty()) {
    if (auto st = CheckDirectoryUnderRoots(spec.checkpoint().dir(), "checkpoint.dir",
                                           options_.checkpoint_dir);
        !st.ok()) {
      return st;
    }
  }
  // What the run would refuse on its workers, refused now: a retry could
  // never help.
  if (options_.tls && TransportOf(spec.schedule().transport()) == Transport::kGloo) {
    return absl::InvalidArgumentError(
        "schedule.transport: gloo sends activations and gradients unencrypted and "
        "unauthenticated, and this cluster runs mutual TLS; use transport: grpc (encrypted), or "
        "run the coordinator and workers with --insecure on a network only they share");
  }
  // The data files' headers and labels, and the model against them (the
  // shape pass): refuse now, not when it runs.
  auto data = InspectData(spec.data());
  if (!data.ok()) return data.status();
  auto plan = PlanModel(spec, *data, options_.max_model_bytes);
  if (!plan.ok()) return plan.status();
  const auto& sched = spec.schedule();
  const int64_t steps_per_epoch = StepsPerEpoch(data->train_count, sched);
  if (steps_per_epoch < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data.train_limit: ", data->train_count, " training examples make no full step of ",
        sched.microbatches_per_step(), " microbatches of ", sched.microbatch_size(),
        "; use more data or a smaller schedule.microbatch_size"));
  }
  const int64_t warmup_steps = WarmupSteps(sched, steps_per_epoch);
  const bool never_async =
      warmup_steps > 0 && warmup_steps >= steps_per_epoch * spec.train().epochs();
  std::string from_manifest;
  const std::string& source = from.empty() ? init_from : from;
  const std::string source_flag = from.empty() ? "init_from" : "from_checkpoint";
  if (!source.empty()) {
    auto m = ResolveFrom(source, &from_manifest);
    if (!m.ok()) {
      return absl::Status(
          m.status().code(),
          absl::StrReplaceAll(m.status().message(), {{"from_checkpoint:", source_flag + ":"}}));
    }
    if (m->files.size() != plan->units.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          source_flag, ": ", from_manifest, " holds ", m->files.size(),
          " units but this spec's model has ", plan->units.size(),
          "; start from a checkpoint of the same model (P and the partition may differ)"));
    }
    // The same units could still differ in their widths: compare the
    // resolved models, as the stages' restore would.
    v1::JobSpec source;
    google::protobuf::util::JsonParseOptions json;
    json.ignore_unknown_fields = true;
    if (google::protobuf::util::JsonStringToMessage(m->spec_json, &source, json).ok()) {
      v1::ModelSpec theirs = source.model(), ours = plan->model;
      theirs.clear_path();  // the same TorchScript file may have moved
      ours.clear_path();
      google::protobuf::util::MessageDifferencer differ;
      std::string differences;
      differ.ReportDifferencesToString(&differences);
      if (!differ.Compare(theirs, ours)) {
        return absl::InvalidArgumentError(
            absl::StrCat("model: differs from the model of ", from_manifest, " (", source.name(),
                         "): ", absl::StripAsciiWhitespace(differences),
                         "; --from and --init-from take the same model (P, the partition and the "
                         "schedule may differ): use that job's model settings"));
      }
    }
    const int64_t total_steps = steps_per_epoch * spec.train().epochs();
    if (!from.empty() && m->step >= total_steps) {
      return absl::InvalidArgumentError(
          absl::StrCat("train.epochs: the checkpoint of ", from_manifest, " is at step ", m->step,
                       " and this spec trains ", total_steps, " steps in all (",
                       spec.train().epochs(), " epochs of ", steps_per_epoch,
                       "); --from continues from that step, so raise train.epochs to train "
                       "on past it, or use --init-from to start a new schedule from its "
                       "weights"));
    }
  }
  v1::JobStatus job = store_->Create(spec);
  store_
      ->SetOrigin(job.id(), from.empty() ? "" : from_manifest, from.empty() ? from_manifest : "",
                  submitter)
      .IgnoreError();
  LogInfo(ForJob(job.id()), absl::StrCat("accepted '", spec.name(), "' from ", submitter, " (",
                                         spec.schedule().type(), ", ", spec.schedule().stages(),
                                         " stages): PENDING"));
  if (never_async) {
    LogWarning(ForJob(job.id()),
               absl::StrCat("its synchronous warm-up (", warmup_steps, " steps) covers all ",
                            steps_per_epoch * spec.train().epochs(), " steps: it never runs ",
                            sched.type()));
  }
  Poke();
  return store_->Get(job.id());
}

absl::StatusOr<Manifest> JobManager::NewestCut(const v1::JobStatus& job) {
  std::vector<std::string> skipped;
  auto m = NewestValidManifest(CheckpointDirOf(job), job.id(), &skipped);
  for (const auto& why : skipped) {
    LogError(ForJob(job.id()), absl::StrCat("skipped a damaged checkpoint: ", why));
  }
  if (!skipped.empty()) {
    if (auto counted = store_->AddSkippedCuts(job.id(), static_cast<int>(skipped.size()));
        !counted.ok()) {
      LogWarning(ForJob(job.id()), std::string(counted.message()));
    }
  }
  return m;
}

absl::StatusOr<v1::ExportModelResponse> JobManager::Export(const std::string& id, int64_t step) {
  auto job = store_->Get(id);
  if (!job.ok()) return job.status();
  if (step < 0) return absl::InvalidArgumentError("step: must be >= 0 (0: the newest checkpoint)");
  if (job->checkpoint().manifest().empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job ", id, " (", v1::JobState_Name(job->state()),
        ") has no committed checkpoint yet; a job commits one after its last step, and every "
        "checkpoint.every_steps steps when set"));
  }
  const std::string dir = CheckpointDirOf(*job);
  absl::StatusOr<Manifest> manifest;
  if (step == 0) {
    manifest = NewestCut(*job);
  } else {
    manifest = ReadManifest(CheckpointStepDir(dir, id, step));
    if (absl::IsNotFound(manifest.status())) {
      std::vector<std::string> steps;
      for (int64_t k : CommittedSteps(dir, id)) steps.push_back(absl::StrCat(k));
      return absl::NotFoundError(
          absl::StrCat("step: job ", id, " has no checkpoint at step ", step, " (checkpoint.keep ",
                       job->spec().checkpoint().keep(), " keeps only the newest cuts); it has ",
                       steps.empty() ? "none" : absl::StrCat("steps ", absl::StrJoin(steps, ", ")),
                       ": give one of them, or leave --checkpoint out for the newest"));
    }
  }
  if (!manifest.ok()) return manifest.status();
  std::string torchscript;
  if (ModelKindOf(job->spec().model().type()) == ModelKind::kTorchScript) {
    auto bytes = ReadWholeFile(job->spec().model().path());
    if (!bytes.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("model.path: the TorchScript file the weights go into is gone: ",
                       bytes.status().message()));
    }
    torchscript = std::move(*bytes);
  }
  const std::string step_dir = CheckpointStepDir(dir, id, manifest->step);
  auto model = ExportModel(step_dir, *manifest, torchscript);
  if (!model.ok()) return model.status();
  nlohmann::json info = {
      {"job", id},
      {"name", job->spec().name()},
      {"step", manifest->step},
      {"total_steps", job->progress().total_steps()},
      {"format", model->format},
      {"spec", nlohmann::json::parse(manifest->spec_json, nullptr, false)},
      {"input", nlohmann::json::parse(manifest->input_json, nullptr, false)},
      {"stages", nlohmann::json::array()},
  };
  for (const auto& s : manifest->stages) {
    info["stages"].push_back({{"first_unit", s.first_unit}, {"units", s.units}});
  }
  // The job's reported results belong to the weights after its last step.
  if (manifest->step == job->progress().total_steps() && job->state() == v1::SUCCEEDED) {
    info["metrics"] = {{"test_accuracy", job->metrics().test_accuracy()},
                       {"test_loss", job->metrics().test_loss()}};
  }
  v1::ExportModelResponse resp;
  resp.set_model(std::move(model->bytes));
  resp.set_format(model->format);
  resp.set_step(manifest->step);
  resp.set_spec_json(info.dump(2));
  LogInfo(ForJob(id), absl::StrCat("exported the model at step ", manifest->step, " (",
                                   resp.model().size(), " bytes, ", model->format, ")"));
  return resp;
}

absl::StatusOr<v1::JobStatus> JobManager::Resume(const std::string& id) {
  auto job = store_->Get(id);
  if (!job.ok()) return job.status();
  if (job->state() != v1::FAILED && job->state() != v1::CANCELLED) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", id, " is ", v1::JobState_Name(job->state()),
                     "; only a FAILED or CANCELLED job can be resumed"));
  }
  if (job->checkpoint().manifest().empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", id, " has no committed checkpoint to resume from; submit it again"));
  }
  auto manifest = NewestValidManifest(CheckpointDirOf(*job), id);
  if (!manifest.ok()) return manifest.status();
  if (auto st = CheckWorkersCanCome(job->spec(), options_.max_workers); !st.ok()) return st;
  if (auto st = store_->UpdateState(id, v1::PENDING,
                                    absl::StrCat("resuming from the checkpoint at step ",
                                                 manifest->step, " when workers are idle"));
      !st.ok()) {
    return st;
  }
  store_->MarkResumed(id, manifest->step).IgnoreError();
  Poke();
  return store_->Get(id);
}

absl::StatusOr<v1::JobStatus> JobManager::Cancel(const std::string& id) {
  auto job = store_->Get(id);
  if (!job.ok()) return job.status();
  if (IsTerminal(job->state())) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", id, " already ended ", v1::JobState_Name(job->state())));
  }
  {
    absl::MutexLock lock(&mu_);
    auto it = cancel_.find(id);
    if (it != cancel_.end()) {
      // Running: drain, so that the cut at the next step is committed and
      // `resume` loses nothing (as a SIGTERM'd coordinator does). A second
      // cancel, or a drain that has not ended within the drain timeout
      // (SchedulerLoop), stops the run at once.
      auto drain = drains_.find(id);
      if (drain != drains_.end() && !drain->second->requested() &&
          cancel_deadlines_.count(id) == 0) {
        drain->second->Request("cancelled by the user", -1);
        cancel_deadlines_[id] =
            std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(
                                                   (options_.drain_timeout_seconds + 5) * 1000));
        LogInfo(ForJob(id), "cancel: draining to a checkpoint first");
      } else {
        it->second->store(true);
      }
      return store_->Get(id);  // the runner moves it to CANCELLED
    }
  }
  // Not running: cancel while PENDING (a race with the scheduler is resolved
  // by UpdateState refusing a second terminal state).
  auto st = store_->UpdateState(id, v1::CANCELLED, "cancelled by the user while pending");
  if (!st.ok()) {
    absl::MutexLock lock(&mu_);
    auto it = cancel_.find(id);
    if (it != cancel_.end()) it->second->store(true);
  }
  return store_->Get(id);
}

void JobManager::Poke() {
  absl::MutexLock lock(&mu_);
  cv_.SignalAll();
}

absl::StatusOr<std::string> JobManager::DrainWorker(const std::string& worker_id,
                                                    const std::string& instance_id) {
  auto info = registry_->MarkLeaving(worker_id, instance_id);
  if (!info.ok()) return info.status();
  LogInfo(absl::StrCat("worker ", worker_id, " at ", info->address(), " is leaving",
                       info->job_id().empty() ? "" : absl::StrCat(" (job ", info->job_id(), ")")));
  if (info->job_id().empty()) return std::string();
  absl::MutexLock lock(&mu_);
  auto it = drains_.find(info->job_id());
  if (it != drains_.end()) {
    it->second->Request(absl::StrCat("worker ", worker_id, " is stopping"), info->stage());
  }
  return info->job_id();
}

bool JobManager::ShuttingDown() {
  absl::MutexLock lock(&mu_);
  return stopping_;
}

void JobManager::SchedulerLoop() {
  NameThisThread("job-scheduler");
  mu_.Lock();
  while (!stopping_) {
    cv_.WaitWithTimeout(&mu_, absl::Milliseconds(500));
    if (stopping_) break;
    for (auto& t : finished_) t.join();
    finished_.clear();
    for (auto it = cancel_deadlines_.begin(); it != cancel_deadlines_.end();) {
      auto flag = cancel_.find(it->first);
      if (flag == cancel_.end()) {
        it = cancel_deadlines_.erase(it);
      } else if (std::chrono::steady_clock::now() >= it->second) {
        LogWarning(ForJob(it->first),
                   "cancel: no checkpoint within the drain timeout; stopping now");
        flag->second->store(true);
        it = cancel_deadlines_.erase(it);
      } else {
        ++it;
      }
    }
    mu_.Unlock();
    if (int lost = registry_->MarkLost(); lost > 0) {
      LogWarning(absl::StrCat(lost, " worker(s) stopped heartbeating and are now LOST"));
    }
    // FIFO: the oldest PENDING job goes first; later jobs wait behind it so
    // a large job is not starved by small ones.
    for (const std::string& id : store_->Pending()) {
      auto job = store_->Get(id);
      if (!job.ok()) continue;
      // Every replica is a whole pipeline.
      const int need = job->spec().schedule().stages() * Replicas(job->spec().schedule());
      auto workers = registry_->Acquire(need, id);
      if (!workers) {
        const std::string reason = absl::StrCat("waiting for ", need, " idle workers (",
                                                registry_->IdleCount(), " idle now)");
        if (job->reason() != reason) {
          store_->SetReason(id, reason).IgnoreError();
        }
        break;
      }
      // The cancel flag exists before the job shows RUNNING: a Cancel that
      // sees RUNNING always finds the flag (before, one in between marked
      // the job CANCELLED while its runner went on holding the workers).
      auto flag = std::make_shared<std::atomic<bool>>(false);
      mu_.Lock();
      cancel_[id] = flag;
      mu_.Unlock();
      if (!store_->UpdateState(id, v1::RUNNING, "").ok()) {  // cancelled meanwhile
        mu_.Lock();
        cancel_.erase(id);
        mu_.Unlock();
        registry_->Release(id);
        continue;
      }
      mu_.Lock();
      StartJob(id, std::move(*workers), std::move(flag));
      mu_.Unlock();
    }
    mu_.Lock();
  }
  mu_.Unlock();
}

void JobManager::StartJob(const std::string& id, std::vector<v1::WorkerInfo> workers,
                          std::shared_ptr<std::atomic<bool>> flag) {
  // cancel_[id] is `flag`.
  for (size_t i = 0; i < workers.size(); ++i) {
    LogInfo(ForStage(id, static_cast<int>(i)),
            absl::StrCat("assigned to worker ", workers[i].id(), " at ", workers[i].address()));
  }
  runners_[id] = std::thread([this, id, workers = std::move(workers), flag]() mutable {
    NameThisThread("job-runner");
    const absl::Status result = RunJob(id, std::move(workers), *flag);
    registry_->Release(id);
    if (result.ok()) {
      store_->UpdateState(id, v1::SUCCEEDED, "").IgnoreError();
    } else if (absl::IsCancelled(result) && ShuttingDown()) {
      // Drained by ~JobManager, not cancelled by a user: it stays RUNNING in
      // the state directory, and the next coordinator there runs it on.
      auto job = store_->Get(id);
      const int64_t step = job.ok() ? job->checkpoint().step() : 0;
      store_
          ->SetReason(id, absl::StrCat("the coordinator stopped; the next one on its state "
                                       "directory continues this job from its checkpoint at step ",
                                       step))
          .IgnoreError();
    } else if (absl::IsCancelled(result)) {
      std::string reason(result.message());
      if (auto job = store_->Get(id); job.ok() && job->checkpoint().step() > 0) {
        absl::StrAppend(&reason, "; `pipemarectl resume ", id,
                        "` continues from the checkpoint at step ", job->checkpoint().step());
      }
      store_->UpdateState(id, v1::CANCELLED, reason).IgnoreError();
    } else {
      store_->UpdateState(id, v1::FAILED, std::string(result.message())).IgnoreError();
    }
    if (absl::IsCancelled(result) && ShuttingDown()) {
      LogInfo(ForJob(id), "drained for the coordinator's stop; it stays RUNNING");
    } else if (absl::IsCancelled(result)) {
      LogInfo(ForJob(id), absl::StrCat("ended: ", result.ToString()));
    } else if (!result.ok()) {
      LogError(ForJob(id), absl::StrCat("ended: ", result.ToString()));
    }
    absl::MutexLock lock(&mu_);
    cancel_.erase(id);
    drains_.erase(id);
    cancel_deadlines_.erase(id);
    auto it = runners_.find(id);
    if (it != runners_.end()) {
      finished_.push_back(std::move(it->second));
      runners_.erase(it);
    }
    cv_.SignalAll();
  });
}

namespace {
// A failure recovery can help: a worker lost, a stream broken, a stage that
// stopped answering. Bad input, divergence and cancellation are not.
bool Recoverable(const absl::Status& st) {
  return absl::IsUnavailable(st) || absl::IsDeadlineExceeded(st);
}
}  // namespace

absl::Status JobManager::RunJob(const std::string& id, std::vector<v1::WorkerInfo> workers,
                                const std::atomic<bool>& cancel) {
  WorkerRegistry::Clock::time_point recovering_since{};
  for (;;) {
    auto job = store_->Get(id);
    if (!job.ok()) return job.status();
    // A job with a committed checkpoint (resumed, recovering, or running
    // when the coordinator restarted) continues from its newest valid one.
    std::optional<Manifest> resume;
    bool weights_only = false;
    if (!job->checkpoint().manifest().empty()) {
      auto m = NewestCut(*job);
      if (!m.ok()) return m.status();
      resume = std::move(*m);
    } else if (!job->from_checkpoint().empty() || !job->init_from().empty()) {
      // submit --from / --init-from: another job's cut, verified again now.
      const bool init = job->from_checkpoint().empty();
      const std::string& manifest = init ? job->init_from() : job->from_checkpoint();
      auto m = ReadManifest(std::filesystem::path(manifest).parent_path().string());
      if (!m.ok()) {
        return absl::FailedPreconditionError(absl::StrCat(
            init ? "init_from: " : "from_checkpoint: ", manifest, ": ", m.status().message()));
      }
      resume = std::move(*m);
      weights_only = init;
    }
    auto drain = std::make_shared<DrainRequest>();
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return absl::CancelledError("the coordinator is stopping");
      drains_[id] = drain;
    }
    RunContext context;
    context.drain = drain.get();
    context.generation = job->generation() + 1;
    context.resume = resume ? &*resume : nullptr;
    context.weights_only = weights_only;
    context.recovering_since = recovering_since;
    store_->SetGeneration(id, context.generation).IgnoreError();
    const absl::Status result = run_(id, job->spec(), workers, cancel, &context);
    if (result.ok() || !Recoverable(result) || cancel.load() || ShuttingDown()) return result;
    auto recovered = Recover(id, result, context, &workers, cancel);
    if (!recovered.ok()) return recovered.status();
    recovering_since = *recovered;
  }
}

absl::StatusOr<WorkerRegistry::Clock::time_point> JobManager::Recover(
    const std::string& id, const absl::Status& failure, const RunContext& run,
    std::vector<v1::WorkerInfo>* workers, const std::atomic<bool>& cancel) {
  const auto detected = WorkerRegistry::Clock::now();
  auto job = store_->Get(id);
  if (!job.ok()) return job.status();
  const v1::RecoverySpec& policy = job->spec().recovery();
  if (job->restarts_size() >= policy.max_restarts()) {
    return absl::UnavailableError(absl::StrCat(
        failure.message(),
        policy.max_restarts() == 0
            ? " (recovery is off: recovery.max_restarts is 0)"
            : absl::StrCat(" (no recovery left: recovery.max_restarts = ", policy.max_restarts(),
                           " used up; raise it to allow more)")));
  }
  std::set<int> lost(run.lost_stages.begin(), run.lost_stages.end());
  const int P = static_cast<int>(workers->size());
  v1::Restart restart;
  restart.set_cause(std::string(failure.message()));
  // Worker k runs stage k mod stages of replica k / stages.
  const int stages_per_replica = std::max(1, job->spec().schedule().stages());
  restart.set_stage(lost.empty() ? -1 : *lost.begin() % stages_per_replica);
  if (!lost.empty()) restart.set_worker_id((*workers)[*lost.begin()].id());
  restart.set_failed_at_step(job->progress().step());
  restart.set_from_step(job->checkpoint().step());
  restart.set_detected_unix_ms(NowUnixMs());
  std::string lost_names;
  for (int k : lost) {
    const int replica = k / stages_per_replica;
    absl::StrAppend(&lost_names, lost_names.empty() ? "" : ", ", "stage ", k % stages_per_replica,
                    replica > 0 ? absl::StrCat(" of replica ", replica) : std::string(),
                    " (worker ", (*workers)[k].id(), ")");
  }
  const std::string what = lost.empty() ? "the pipeline failed" : absl::StrCat("lost ", lost_names);
  if (auto st = store_->UpdateState(
          id, v1::RECOVERING,
          absl::StrCat(what, ": ", failure.message(), "; recovering from the checkpoint at step ",
                       job->checkpoint().step(), " (restart ", job->restarts_size() + 1, " of ",
                       policy.max_restarts(), ")"));
      !st.ok()) {
    return st;
  }
  // Survivors stay reserved for the job; a lost stage's place goes to an
  // idle worker, waiting at most recovery.wait_seconds.
  std::vector<v1::WorkerInfo> kept;
  for (int i = 0; i < P; ++i) {
    if (!lost.count(i)) kept.push_back((*workers)[i]);
  }
  const int need = P - static_cast<int>(kept.size());
  const auto deadline =
      detected + std::chrono::milliseconds(static_cast<int64_t>(policy.wait_seconds() * 1000));
  std::optional<std::vector<v1::WorkerInfo>> replacements;
  if (need > 0) {
    for (;;) {
      if (cancel.load()) return absl::CancelledError("cancelled by the user while recovering");
      replacements = registry_->Acquire(need, id);
      if (replacements || WorkerRegistry::Clock::now() >= deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  } else {
    replacements.emplace();
  }
  v1::JobSpec spec = job->spec();
  if (replacements) {
    size_t next = 0;
    for (int i : lost) (*workers)[i] = (*replacements)[next++];
  } else if (policy.shrink() && Replicas(spec.schedule()) > 1) {
    // Replicas: drop each pipeline that lost a worker; the others go on
    // (the effective batch shrinks with them).
    const int stages = spec.schedule().stages(), R = Replicas(spec.schedule());
    std::set<int> dropped;
    for (int k : lost) dropped.insert(k / stages);
    if (lost.empty() || static_cast<int>(dropped.size()) >= R) {
      return absl::UnavailableError(absl::StrCat(
          what, " and no idle worker replaced it within recovery.wait_seconds (",
          policy.wait_seconds(), " s), and no whole replica is left: ", failure.message()));
    }
    std::vector<v1::WorkerInfo> survivors;
    for (int k = 0; k < P; ++k) {
      if (!dropped.count(k / stages)) survivors.push_back((*workers)[k]);
    }
    *workers = std::move(survivors);
    spec.mutable_schedule()->set_replicas(R - static_cast<int>(dropped.size()));
    LogWarning(ForJob(id),
               absl::StrCat("no idle worker within recovery.wait_seconds (", policy.wait_seconds(),
                            " s); shrinking from ", R, " to ", R - dropped.size(), " replicas"));
  } else if (policy.shrink() && !kept.empty()) {
    // Re-partition onto the workers the job still has; T1 follows the new P.
    *workers = kept;
    auto* sched = spec.mutable_schedule();
    sched->set_stages(static_cast<int>(kept.size()));
    if (PartitionOf(sched->partition()) == PartitionKind::kSplit) {
      sched->set_partition(PartitionName(PartitionKind::kParameters));
    }
    sched->clear_split();
    LogWarning(ForJob(id),
               absl::StrCat("no idle worker within recovery.wait_seconds (", policy.wait_seconds(),
                            " s); shrinking from ", P, " to ", kept.size(), " stages"));
  } else {
    return absl::UnavailableError(
        absl::StrCat(what, " and no idle worker replaced it within recovery.wait_seconds (",
                     policy.wait_seconds(), " s): ", failure.message(),
                     "; add workers and `pipemarectl resume` it, or set recovery.shrink: true"));
  }
  // Stages per pipeline (workers are replicas x stages).
  restart.set_stages(static_cast<int>(workers->size()) / Replicas(spec.schedule()));
  store_->AddRestart(id, spec, restart).IgnoreError();
  for (size_t i = 0; i < workers->size(); ++i) {
    LogInfo(
        ForStage(id, static_cast<int>(i)),
        absl::StrCat("recovering on worker ", (*workers)[i].id(), " at ", (*workers)[i].address()));
  }
  if (auto st = store_->UpdateState(id, v1::RUNNING, ""); !st.ok()) return st;
  return detected;
}

}  // namespace pipemare
