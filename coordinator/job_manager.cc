#include "coordinator/job_manager.h"

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "pipeline/data.h"
#include "pipeline/job_spec.h"
#include "pipeline/model_plan.h"

namespace pipemare {

JobManager::JobManager(JobStore* store, WorkerRegistry* registry, RunnerOptions options)
    : store_(store), registry_(registry), options_(options) {
  scheduler_ = std::thread([this] { SchedulerLoop(); });
}

JobManager::~JobManager() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    for (auto& [id, flag] : cancel_) flag->store(true);
  }
  cv_.notify_all();
  scheduler_.join();
  std::map<std::string, std::thread> runners;
  std::vector<std::thread> finished;
  {
    std::lock_guard<std::mutex> lock(mu_);
    runners.swap(runners_);
    finished.swap(finished_);
  }
  for (auto& [id, t] : runners) t.join();
  for (auto& t : finished) t.join();
}

absl::StatusOr<v1::JobStatus> JobManager::Submit(v1::JobSpec spec) {
  ApplyJobSpecDefaults(spec);
  if (auto st = ValidateJobSpec(spec); !st.ok()) return st;
  // The data files' headers and labels, and the model against them (the
  // shape pass): refuse now, not when it runs.
  auto data = InspectData(spec.data());
  if (!data.ok()) return data.status();
  if (auto plan = PlanModel(spec, *data); !plan.ok()) return plan.status();
  v1::JobStatus job = store_->Create(spec);
  LogInfo(ForJob(job.id()), absl::StrCat("accepted '", spec.name(), "' (", spec.schedule().type(),
                                         ", ", spec.schedule().stages(), " stages): PENDING"));
  Poke();
  return store_->Get(job.id());
}

absl::StatusOr<v1::JobStatus> JobManager::Cancel(const std::string& id) {
  auto job = store_->Get(id);
  if (!job.ok()) return job.status();
  if (IsTerminal(job->state())) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", id, " already ended ", v1::JobState_Name(job->state())));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = cancel_.find(id);
    if (it != cancel_.end()) {
      it->second->store(true);
      return store_->Get(id);  // the runner moves it to CANCELLED
    }
  }
  // Not running: cancel while PENDING (a race with the scheduler is resolved
  // by UpdateState refusing a second terminal state).
  auto st = store_->UpdateState(id, v1::CANCELLED, "cancelled by the user while pending");
  if (!st.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = cancel_.find(id);
    if (it != cancel_.end()) it->second->store(true);
  }
  return store_->Get(id);
}

void JobManager::Poke() { cv_.notify_all(); }

bool JobManager::ShuttingDown() {
  std::lock_guard<std::mutex> lock(mu_);
  return stopping_;
}

void JobManager::SchedulerLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    cv_.wait_for(lock, std::chrono::milliseconds(500));
    if (stopping_) break;
    for (auto& t : finished_) t.join();
    finished_.clear();
    lock.unlock();
    if (int lost = registry_->MarkLost(); lost > 0) {
      LogWarning(absl::StrCat(lost, " worker(s) stopped heartbeating and are now LOST"));
    }
    // FIFO: the oldest PENDING job goes first; later jobs wait behind it so
    // a large job is not starved by small ones.
    for (const std::string& id : store_->Pending()) {
      auto job = store_->Get(id);
      if (!job.ok()) continue;
      const int need = job->spec().schedule().stages();
      auto workers = registry_->Acquire(need, id);
      if (!workers) {
        const std::string reason = absl::StrCat("waiting for ", need, " idle workers (",
                                                registry_->IdleCount(), " idle now)");
        if (job->reason() != reason) {
          store_->Update(id, [&](v1::JobStatus& s) { s.set_reason(reason); }).IgnoreError();
        }
        break;
      }
      if (!store_->UpdateState(id, v1::RUNNING, "").ok()) {  // cancelled meanwhile
        registry_->Release(id);
        continue;
      }
      lock.lock();
      StartJob(id, std::move(*workers));
      lock.unlock();
    }
    lock.lock();
  }
}

void JobManager::StartJob(const std::string& id, std::vector<v1::WorkerInfo> workers) {
  // REQUIRES: mu_ held.
  auto flag = std::make_shared<std::atomic<bool>>(false);
  cancel_[id] = flag;
  for (size_t i = 0; i < workers.size(); ++i) {
    LogInfo(ForStage(id, static_cast<int>(i)),
            absl::StrCat("assigned to worker ", workers[i].id(), " at ", workers[i].address()));
  }
  runners_[id] = std::thread([this, id, workers = std::move(workers), flag]() mutable {
    auto job = store_->Get(id);
    absl::Status result = job.ok() ? JobRunner(id, job->spec(), std::move(workers), store_,
                                               registry_, flag.get(), options_)
                                         .Run()
                                   : job.status();
    registry_->Release(id);
    if (result.ok()) {
      store_->UpdateState(id, v1::SUCCEEDED, "").IgnoreError();
    } else if (absl::IsCancelled(result) && ShuttingDown()) {
      // The cancel flag was raised by ~JobManager, not by a user.
      store_
          ->UpdateState(id, v1::FAILED,
                        "the coordinator shut down while this job was running; resubmit it")
          .IgnoreError();
    } else if (absl::IsCancelled(result)) {
      store_->UpdateState(id, v1::CANCELLED, std::string(result.message())).IgnoreError();
    } else {
      store_->UpdateState(id, v1::FAILED, std::string(result.message())).IgnoreError();
    }
    if (!result.ok()) LogError(ForJob(id), absl::StrCat("ended: ", result.ToString()));
    std::lock_guard<std::mutex> lock(mu_);
    cancel_.erase(id);
    auto it = runners_.find(id);
    if (it != runners_.end()) {
      finished_.push_back(std::move(it->second));
      runners_.erase(it);
    }
    cv_.notify_all();
  });
}

}  // namespace pipemare
