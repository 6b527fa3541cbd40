#include "coordinator/worker_registry.h"

#include <algorithm>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "coordinator/job_store.h"

namespace pipemare {
namespace {
int64_t UnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}
}  // namespace

absl::StatusOr<std::string> WorkerRegistry::Register(const v1::RegisterWorkerRequest& request) {
  if (request.address().empty() || request.address().find(':') == std::string::npos) {
    return absl::InvalidArgumentError("address: required, as host:port");
  }
  if (request.instance_id().size() > 128) {
    return absl::InvalidArgumentError("instance_id: at most 128 bytes");
  }
  const v1::ServedStage& served = request.served();
  if (served.job_id().size() > 128 || (!served.job_id().empty() && served.stage() < 0) ||
      served.cut_steps_size() > 64) {
    return absl::InvalidArgumentError(
        "served: a job_id of at most 128 bytes with a stage >= 0 and at most 64 cut_steps, or "
        "empty");
  }
  absl::MutexLock lock(&mu_);
  std::string id;
  for (auto it = workers_.begin(); it != workers_.end();) {
    Entry& e = it->second;
    const bool same_instance =
        !request.instance_id().empty() && e.instance_id == request.instance_id();
    if (same_instance) {
      id = it->first;  // the same worker again: it keeps its id
      ++it;
    } else if (e.info.address() == request.address()) {
      if (e.info.state() != v1::LOST && !e.instance_id.empty() && !request.instance_id().empty()) {
        // Two live workers cannot share an address: each would evict the
        // other on every registration, and stages would go to the wrong one.
        return absl::AlreadyExistsError(absl::StrCat(
            "address: ", request.address(), " is already registered by live worker ", it->first,
            " (another process advertising the same address, e.g. hosts that share "
            "a hostname); start each worker with --advertise HOST:PORT naming its own IP or DNS "
            "name"));
      }
      if (store_ != nullptr) store_->SaveWorker(e.info, e.instance_id, /*forget=*/true);
      it = workers_.erase(it);  // a restarted worker, or one without an instance id
    } else {
      ++it;
    }
  }
  if (id.empty()) id = absl::StrCat("w-", next_id_);
  Entry& e = workers_[id];
  if (e.order == 0) e.order = next_id_++;
  e.instance_id = request.instance_id();
  e.info.set_id(id);
  e.info.set_address(request.address());
  e.info.set_device(request.device().empty() ? "cpu" : request.device());
  e.info.set_threads(request.threads());
  e.info.set_metrics_address(request.metrics_address());
  *e.info.mutable_served() = served;
  SetState(e, v1::IDLE);
  e.info.clear_job_id();
  e.info.set_stage(-1);
  e.info.set_last_heartbeat_unix_ms(UnixMs());
  e.last_heartbeat = Clock::now();
  if (store_ != nullptr) store_->SaveWorker(e.info, e.instance_id, /*forget=*/false);
  return id;
}

int WorkerRegistry::PersistIn(JobStore* store) {
  const auto saved = store->Workers();
  absl::MutexLock lock(&mu_);
  int known = 0;
  for (const auto& [info, instance] : saved) {
    int64_t number = 0;
    if (info.id().rfind("w-", 0) != 0 || !absl::SimpleAtoi(info.id().substr(2), &number) ||
        number < 1 || workers_.count(info.id())) {
      continue;
    }
    Entry& e = workers_[info.id()];
    e.info = info;
    SetState(e, v1::LOST);
    e.info.clear_job_id();
    e.info.set_stage(-1);
    e.instance_id = instance;
    e.order = number;
    e.last_heartbeat = Clock::now();
    next_id_ = std::max(next_id_, number + 1);
    ++known;
  }
  store_ = store;
  return known;
}

void WorkerRegistry::SetState(Entry& e, v1::WorkerState to) { e.info.set_state(to); }

WorkerRegistry::Entry* WorkerRegistry::FindLive(const std::string& worker_id,
                                                const std::string& instance_id) {
  auto it = workers_.find(worker_id);
  if (it == workers_.end() || it->second.info.state() == v1::LOST ||
      (!instance_id.empty() && it->second.instance_id != instance_id)) {
    return nullptr;
  }
  return &it->second;
}

absl::Status WorkerRegistry::Heartbeat(const std::string& worker_id,
                                       const std::string& instance_id) {
  absl::MutexLock lock(&mu_);
  Entry* e = FindLive(worker_id, instance_id);
  if (e == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("worker_id: '", worker_id, "' is not registered; register again"));
  }
  e->last_heartbeat = Clock::now();
  e->info.set_last_heartbeat_unix_ms(UnixMs());
  return absl::OkStatus();
}

int WorkerRegistry::MarkLost() {
  absl::MutexLock lock(&mu_);
  int lost = 0;
  const auto now = Clock::now();
  for (auto& [id, e] : workers_) {
    if (e.info.state() != v1::LOST && now - e.last_heartbeat > timeout_) {
      SetState(e, v1::LOST);
      ++heartbeat_misses_;
      ++lost;
    }
  }
  return lost;
}

int64_t WorkerRegistry::HeartbeatMisses() const {
  absl::MutexLock lock(&mu_);
  return heartbeat_misses_;
}

std::vector<v1::WorkerInfo> WorkerRegistry::List() const {
  absl::MutexLock lock(&mu_);
  std::vector<const Entry*> entries;
  for (const auto& [id, e] : workers_) entries.push_back(&e);
  std::sort(entries.begin(), entries.end(),
            [](const Entry* a, const Entry* b) { return a->order < b->order; });
  std::vector<v1::WorkerInfo> out;
  for (const Entry* e : entries) out.push_back(e->info);
  return out;
}

int WorkerRegistry::IdleCount() const {
  absl::MutexLock lock(&mu_);
  int n = 0;
  for (const auto& [id, e] : workers_) n += e.info.state() == v1::IDLE && !e.leaving;
  return n;
}

std::optional<std::vector<v1::WorkerInfo>> WorkerRegistry::Acquire(int n,
                                                                   const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  std::vector<Entry*> idle;
  for (auto& [id, e] : workers_) {
    if (e.info.state() == v1::IDLE && !e.leaving) idle.push_back(&e);
  }
  if (static_cast<int>(idle.size()) < n) return std::nullopt;
  std::sort(idle.begin(), idle.end(), [](Entry* a, Entry* b) { return a->order < b->order; });
  // Workers that served this job take back their stages (slot = stage);
  // the oldest others fill the rest.
  std::vector<Entry*> slots(n, nullptr);
  std::vector<Entry*> others;
  for (Entry* e : idle) {
    const v1::ServedStage& s = e->info.served();
    if (s.job_id() == job_id && s.stage() < n && slots[s.stage()] == nullptr) {
      slots[s.stage()] = e;
    } else {
      others.push_back(e);
    }
  }
  size_t next = 0;
  for (Entry*& slot : slots) {
    if (slot == nullptr) slot = others[next++];
  }
  std::vector<v1::WorkerInfo> out;
  for (Entry* e : slots) {
    SetState(*e, v1::BUSY);
    e->info.set_job_id(job_id);
    // Loading another job's stage drops the cuts it kept in memory.
    if (e->info.served().job_id() != job_id) e->info.clear_served();
    out.push_back(e->info);
  }
  return out;
}

void WorkerRegistry::SetStage(const std::string& worker_id, int stage) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker_id);
  if (it != workers_.end()) it->second.info.set_stage(stage);
}

void WorkerRegistry::Release(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  for (auto& [id, e] : workers_) {
    if (e.info.job_id() != job_id) continue;
    if (e.info.stage() >= 0) {  // the worker keeps that stage's cuts in memory
      v1::ServedStage* served = e.info.mutable_served();
      served->Clear();
      served->set_job_id(job_id);
      served->set_stage(e.info.stage());
    }
    e.info.clear_job_id();
    e.info.set_stage(-1);
    if (e.info.state() == v1::BUSY) SetState(e, e.leaving ? v1::LOST : v1::IDLE);
  }
}

absl::StatusOr<v1::WorkerInfo> WorkerRegistry::MarkLeaving(const std::string& worker_id,
                                                           const std::string& instance_id) {
  absl::MutexLock lock(&mu_);
  Entry* e = FindLive(worker_id, instance_id);
  if (e == nullptr) {
    return absl::NotFoundError(
        absl::StrCat("worker_id: '", worker_id, "' is not a live registered worker"));
  }
  e->leaving = true;
  if (e->info.state() == v1::IDLE) SetState(*e, v1::LOST);
  return e->info;
}

bool WorkerRegistry::IsLost(const std::string& worker_id) const {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker_id);
  return it == workers_.end() || it->second.info.state() == v1::LOST;
}

void WorkerRegistry::MarkUnreachable(const std::string& worker_id) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end() || it->second.info.state() == v1::LOST) return;
  SetState(it->second, v1::LOST);
  ++unreachable_;
}

int64_t WorkerRegistry::Unreachable() const {
  absl::MutexLock lock(&mu_);
  return unreachable_;
}

}  // namespace pipemare
