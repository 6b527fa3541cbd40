#include "coordinator/job_store.h"

#include <fcntl.h>
#include <sqlite3.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "google/protobuf/util/json_util.h"
#include "pipeline/core/checkpoint.h"

namespace pipemare {

bool IsTerminal(v1::JobState s) {
  return s == v1::SUCCEEDED || s == v1::FAILED || s == v1::CANCELLED;
}

int64_t NowUnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

namespace {
int64_t IdNumber(const std::string& id) {
  try {
    return id.rfind("job-", 0) == 0 ? std::stoll(id.substr(4)) : 0;
  } catch (...) {
    return 0;
  }
}
}  // namespace

bool CanMove(v1::JobState from, v1::JobState to) {
  switch (from) {
    case v1::PENDING:
      return to == v1::RUNNING || to == v1::CANCELLED;
    case v1::RUNNING:
      return to == v1::SUCCEEDED || to == v1::FAILED || to == v1::CANCELLED || to == v1::RECOVERING;
    case v1::RECOVERING:  // a lost worker: on with replacements, or ended
      return to == v1::RUNNING || to == v1::FAILED || to == v1::CANCELLED;
    case v1::FAILED:
    case v1::CANCELLED:
      return to == v1::PENDING;  // resume, from the newest checkpoint
    default:
      return false;
  }
}

namespace {
std::string ToJson(const google::protobuf::Message& status) {
  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  // Cannot fail for a valid message.
  (void)google::protobuf::util::MessageToJsonString(status, &json, options);
  return json;
}

// Runs `sql` (no results); the error names `what`.
absl::Status Exec(sqlite3* db, const char* sql, const std::string& what) {
  char* err = nullptr;
  if (sqlite3_exec(db, sql, nullptr, nullptr, &err) != SQLITE_OK) {
    std::string message = err ? err : sqlite3_errmsg(db);
    sqlite3_free(err);
    return absl::InternalError(absl::StrCat(what, ": ", message));
  }
  return absl::OkStatus();
}
}  // namespace

void JobStore::Reload(v1::JobStatus& status) {
  if (status.state() != v1::RUNNING && status.state() != v1::RECOVERING) return;
  status.set_state(v1::PENDING);
  status.set_resumes(status.resumes() + 1);
  if (!status.checkpoint().manifest().empty()) {
    status.set_reason(
        "the coordinator restarted while this job was running; it continues from its newest "
        "checkpoint once its workers are back");
    status.mutable_progress()->set_step(status.checkpoint().step());
  } else {
    status.set_reason(
        "the coordinator restarted while this job was running, before its first checkpoint; "
        "it runs again from its first step once its workers are back");
    status.mutable_progress()->set_step(0);
  }
  LogInfo(ForJob(status.id()), status.reason());
}

absl::StatusOr<std::unique_ptr<JobStore>> JobStore::Open(const std::string& state_dir) {
  namespace fs = std::filesystem;
  auto store = std::make_unique<JobStore>();
  absl::MutexLock lock(&store->mu_);  // nobody else has it yet; the analysis wants it held
  std::error_code ec;
  fs::create_directories(state_dir, ec);
  if (ec) {
    return absl::FailedPreconditionError(
        absl::StrCat("--state-dir ", state_dir, ": cannot create it: ", ec.message()));
  }
  // One coordinator per state directory: a second one would run the same
  // jobs again on the same workers. The lock goes with the process, so a
  // kill -9 frees it.
  const std::string lock_path = (fs::path(state_dir) / "coordinator.lock").string();
  store->lock_fd_ = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (store->lock_fd_ < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("--state-dir: cannot open ", lock_path, ": ", std::strerror(errno)));
  }
  if (::flock(store->lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    std::string holder;
    char buffer[32] = {};
    if (::pread(store->lock_fd_, buffer, sizeof(buffer) - 1, 0) > 0) {
      holder = absl::StrCat(" (pid ", absl::StripAsciiWhitespace(buffer), ")");
    }
    return absl::FailedPreconditionError(
        absl::StrCat("--state-dir ", state_dir, ": another pipemare-coordinator", holder,
                     " uses this state directory; stop it, or give this one another --state-dir"));
  }
  const std::string pid = absl::StrCat(::getpid(), "\n");
  if (::ftruncate(store->lock_fd_, 0) != 0 ||
      ::pwrite(store->lock_fd_, pid.data(), pid.size(), 0) < 0) {
    LogWarning(absl::StrCat("cannot write this process's id to ", lock_path));
  }
  store->db_path_ = (fs::path(state_dir) / "state.db").string();
  const std::string& path = store->db_path_;
  if (sqlite3_open_v2(path.c_str(), &store->db_, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE,
                      nullptr) != SQLITE_OK) {
    std::string why = store->db_ ? sqlite3_errmsg(store->db_) : "out of memory";
    return absl::FailedPreconditionError(
        absl::StrCat("--state-dir: cannot open ", path, ": ", why));
  }
  sqlite3_busy_timeout(store->db_, 5000);
  // WAL: a commit is one append and one fsync; FULL: that fsync happens on
  // every commit, so a state change that returned survives a power cut.
  for (const char* sql : {"PRAGMA journal_mode=WAL", "PRAGMA synchronous=FULL",
                          "CREATE TABLE IF NOT EXISTS jobs (id TEXT PRIMARY KEY, number "
                          "INTEGER NOT NULL, state TEXT NOT NULL, status TEXT NOT NULL)",
                          "CREATE TABLE IF NOT EXISTS workers (id TEXT PRIMARY KEY, instance "
                          "TEXT NOT NULL, info TEXT NOT NULL)"}) {
    if (auto st = Exec(store->db_, sql,
                       absl::StrCat(path,
                                    " is not a Pipemare state database (or is damaged; "
                                    "move it away to start afresh)"));
        !st.ok()) {
      return st;
    }
  }
  // Older coordinators kept one JSON file per job: import them once.
  std::vector<v1::JobStatus> loaded;
  for (const auto& file : fs::directory_iterator(state_dir, ec)) {
    if (file.path().extension() != ".json" || file.path().filename().string().rfind("job-", 0)) {
      continue;
    }
    auto text = ReadWholeFile(file.path().string());
    v1::JobStatus status;
    if (!text.ok() || !google::protobuf::util::JsonStringToMessage(*text, &status).ok() ||
        status.id().empty()) {
      LogWarning(absl::StrCat("ignoring unreadable job file ", file.path().string()));
      continue;
    }
    loaded.push_back(std::move(status));
    fs::rename(file.path(), file.path().string() + ".imported", ec);
  }
  sqlite3_stmt* select = nullptr;
  if (sqlite3_prepare_v2(store->db_, "SELECT id, status FROM jobs ORDER BY number", -1, &select,
                         nullptr) != SQLITE_OK) {
    return absl::InternalError(absl::StrCat(path, ": ", sqlite3_errmsg(store->db_)));
  }
  while (sqlite3_step(select) == SQLITE_ROW) {
    const char* id = reinterpret_cast<const char*>(sqlite3_column_text(select, 0));
    const char* json = reinterpret_cast<const char*>(sqlite3_column_text(select, 1));
    v1::JobStatus status;
    if (json == nullptr || !google::protobuf::util::JsonStringToMessage(json, &status).ok() ||
        status.id().empty()) {
      LogWarning(absl::StrCat("ignoring the unreadable row of job ", id ? id : "?", " in ", path));
      continue;
    }
    loaded.push_back(std::move(status));
  }
  sqlite3_finalize(select);
  for (auto& status : loaded) {
    Reload(status);
    store->next_id_ = std::max(store->next_id_, IdNumber(status.id()) + 1);
    store->jobs_[status.id()] = Entry{status, 1};
    store->Persist(status);
  }
  LogInfo(absl::StrCat("job store ", path, ": ", loaded.size(), " job(s)"));
  return store;
}

JobStore::~JobStore() {
  if (db_ != nullptr) sqlite3_close(db_);
  if (lock_fd_ >= 0) ::close(lock_fd_);
}

void JobStore::Persist(const v1::JobStatus& status) {
  if (db_ == nullptr) return;
  sqlite3_stmt* upsert = nullptr;
  int rc = sqlite3_prepare_v2(db_,
                              "INSERT INTO jobs (id, number, state, status) VALUES (?1, ?2, ?3, "
                              "?4) ON CONFLICT(id) DO UPDATE SET state = ?3, status = ?4",
                              -1, &upsert, nullptr);
  if (rc == SQLITE_OK) {
    const std::string json = ToJson(status);
    const std::string state = v1::JobState_Name(status.state());
    sqlite3_bind_text(upsert, 1, status.id().c_str(), -1, SQLITE_TRANSIENT);
    sqlite3_bind_int64(upsert, 2, IdNumber(status.id()));
    sqlite3_bind_text(upsert, 3, state.c_str(), -1, SQLITE_TRANSIENT);
    sqlite3_bind_text(upsert, 4, json.data(), static_cast<int>(json.size()), SQLITE_TRANSIENT);
    rc = sqlite3_step(upsert);  // one statement: one transaction, fsynced
  }
  sqlite3_finalize(upsert);
  if (rc != SQLITE_DONE && rc != SQLITE_OK) {
    LogError(ForJob(status.id()), absl::StrCat("cannot write the job to ", db_path_, ": ",
                                               sqlite3_errmsg(db_), "; it goes on in memory only"));
  }
}

void JobStore::SaveWorker(const v1::WorkerInfo& info, const std::string& instance_id, bool forget) {
  absl::MutexLock lock(&mu_);
  if (db_ == nullptr) return;
  sqlite3_stmt* stmt = nullptr;
  int rc = sqlite3_prepare_v2(db_,
                              forget ? "DELETE FROM workers WHERE id = ?1"
                                     : "INSERT INTO workers (id, instance, info) VALUES (?1, ?2, "
                                       "?3) ON CONFLICT(id) DO UPDATE SET instance = ?2, info = ?3",
                              -1, &stmt, nullptr);
  if (rc == SQLITE_OK) {
    v1::WorkerInfo saved = info;
    saved.clear_state();  // what it is now is the registry's, not the database's
    saved.clear_job_id();
    saved.clear_last_heartbeat_unix_ms();
    const std::string json = ToJson(saved);
    sqlite3_bind_text(stmt, 1, info.id().c_str(), -1, SQLITE_TRANSIENT);
    if (!forget) {
      sqlite3_bind_text(stmt, 2, instance_id.c_str(), -1, SQLITE_TRANSIENT);
      sqlite3_bind_text(stmt, 3, json.data(), static_cast<int>(json.size()), SQLITE_TRANSIENT);
    }
    rc = sqlite3_step(stmt);
  }
  sqlite3_finalize(stmt);
  if (rc != SQLITE_DONE && rc != SQLITE_OK) {
    LogError(absl::StrCat("cannot write worker ", info.id(), " to ", db_path_, ": ",
                          sqlite3_errmsg(db_), "; it is known in memory only"));
  }
}

std::vector<std::pair<v1::WorkerInfo, std::string>> JobStore::Workers() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::pair<v1::WorkerInfo, std::string>> workers;
  if (db_ == nullptr) return workers;
  sqlite3_stmt* select = nullptr;
  if (sqlite3_prepare_v2(db_, "SELECT id, instance, info FROM workers", -1, &select, nullptr) !=
      SQLITE_OK) {
    LogError(absl::StrCat(db_path_, ": cannot read workers: ", sqlite3_errmsg(db_)));
    return workers;
  }
  while (sqlite3_step(select) == SQLITE_ROW) {
    const char* id = reinterpret_cast<const char*>(sqlite3_column_text(select, 0));
    const char* instance = reinterpret_cast<const char*>(sqlite3_column_text(select, 1));
    const char* json = reinterpret_cast<const char*>(sqlite3_column_text(select, 2));
    v1::WorkerInfo info;
    if (id == nullptr || json == nullptr ||
        !google::protobuf::util::JsonStringToMessage(json, &info).ok() || info.id() != id) {
      LogWarning(
          absl::StrCat("ignoring the unreadable row of worker ", id ? id : "?", " in ", db_path_));
      continue;
    }
    workers.emplace_back(std::move(info), instance ? instance : "");
  }
  sqlite3_finalize(select);
  return workers;
}

v1::JobStatus JobStore::Create(const v1::JobSpec& spec) {
  absl::MutexLock lock(&mu_);
  v1::JobStatus s;
  s.set_id(absl::StrCat("job-", next_id_++));
  s.set_name(spec.name());
  s.set_state(v1::PENDING);
  s.set_schedule(spec.schedule().type());
  *s.mutable_spec() = spec;
  s.mutable_progress()->set_epochs(spec.train().epochs());
  s.set_submitted_unix_ms(NowUnixMs());
  Entry& e = jobs_[s.id()] = Entry{s, 0};
  Persist(s);
  Changed(e);
  return s;
}

absl::StatusOr<v1::JobStatus> JobStore::Get(const std::string& id) const {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job '", id, "'"));
  return it->second.status;
}

std::vector<v1::JobStatus> JobStore::List() const {
  absl::MutexLock lock(&mu_);
  std::vector<v1::JobStatus> out;
  for (const auto& [id, e] : jobs_) out.push_back(e.status);
  std::sort(out.begin(), out.end(), [](const v1::JobStatus& a, const v1::JobStatus& b) {
    return IdNumber(a.id()) < IdNumber(b.id());
  });
  return out;
}

std::vector<std::string> JobStore::Pending() const {
  std::vector<std::string> out;
  for (const auto& s : List()) {
    if (s.state() == v1::PENDING) out.push_back(s.id());
  }
  return out;
}

absl::Status JobStore::UpdateState(const std::string& id, v1::JobState state,
                                   const std::string& reason) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job '", id, "'"));
  v1::JobStatus& s = it->second.status;
  if (!CanMove(s.state(), state)) {
    return absl::FailedPreconditionError(
        IsTerminal(s.state())
            ? absl::StrCat("job ", id, " already ended ", v1::JobState_Name(s.state()))
            : absl::StrCat("job ", id, " cannot go from ", v1::JobState_Name(s.state()), " to ",
                           v1::JobState_Name(state)));
  }
  LogInfo(ForJob(id), absl::StrCat(v1::JobState_Name(s.state()), " -> ", v1::JobState_Name(state),
                                   reason.empty() ? "" : ": ", reason));
  s.set_state(state);
  s.set_reason(reason);
  if (state == v1::RUNNING && s.started_unix_ms() == 0) s.set_started_unix_ms(NowUnixMs());
  if (IsTerminal(state)) s.set_finished_unix_ms(NowUnixMs());
  if (state == v1::PENDING) s.set_finished_unix_ms(0);  // resumed
  Persist(s);
  Changed(it->second);
  return absl::OkStatus();
}

void JobStore::Changed(Entry& e) {
  ++e.version;
  ++changes_;
}

namespace {
// OUT_OF_RANGE when the job has no stage `stage` (a caller's mistake, not a
// worker's: the runner indexes the plan it set).
absl::Status StageInRange(const v1::JobStatus& s, int stage) {
  if (stage >= 0 && stage < s.stages_size()) return absl::OkStatus();
  return absl::OutOfRangeError(
      absl::StrCat("job '", s.id(), "' has no stage ", stage, " (it has ", s.stages_size(), ")"));
}
}  // namespace

absl::Status JobStore::Mutate(const std::string& id, bool durable,
                              const std::function<void(v1::JobStatus&)>& fn) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job '", id, "'"));
  v1::JobStatus& s = it->second.status;
  const v1::JobState state = s.state();
  fn(s);
  s.set_state(state);  // only UpdateState moves a job
  if (durable) Persist(s);
  Changed(it->second);
  return absl::OkStatus();
}

absl::Status JobStore::SetOrigin(const std::string& id, const std::string& from_checkpoint,
                                 const std::string& init_from, const std::string& submitted_by) {
  return Mutate(id, true, [&](v1::JobStatus& s) {
    s.set_from_checkpoint(from_checkpoint);
    s.set_init_from(init_from);
    s.set_submitted_by(submitted_by);
  });
}

absl::Status JobStore::SetReason(const std::string& id, const std::string& reason) {
  return Mutate(id, true, [&](v1::JobStatus& s) { s.set_reason(reason); });
}

absl::Status JobStore::MarkResumed(const std::string& id, int64_t from_step) {
  return Mutate(id, true, [&](v1::JobStatus& s) {
    s.set_resumes(s.resumes() + 1);
    s.mutable_progress()->set_step(from_step);
  });
}

absl::Status JobStore::AddSkippedCuts(const std::string& id, int n) {
  return Mutate(id, true, [&](v1::JobStatus& s) {
    s.mutable_checkpoint()->set_skipped(s.checkpoint().skipped() + n);
  });
}

absl::Status JobStore::SetGeneration(const std::string& id, int64_t generation) {
  return Mutate(id, true, [&](v1::JobStatus& s) { s.set_generation(generation); });
}

absl::Status JobStore::AddRestart(const std::string& id, const v1::JobSpec& spec,
                                  const v1::Restart& restart) {
  return Mutate(id, true, [&](v1::JobStatus& s) {
    *s.mutable_spec() = spec;
    *s.add_restarts() = restart;
  });
}

absl::Status JobStore::SetDataFiles(const std::string& id,
                                    const google::protobuf::RepeatedPtrField<v1::DataFile>& files) {
  return Mutate(id, true, [&](v1::JobStatus& s) { *s.mutable_data_files() = files; });
}

absl::Status JobStore::SetRecoverSeconds(const std::string& id, double seconds) {
  return Mutate(id, true, [&](v1::JobStatus& s) {
    if (!s.restarts().empty()) s.mutable_restarts()->rbegin()->set_recover_seconds(seconds);
  });
}

absl::Status JobStore::SetRestoredFromMemory(const std::string& id, int stages, int from_replica) {
  return Mutate(id, true, [&](v1::JobStatus& s) {
    if (s.restarts().empty()) return;
    v1::Restart& r = *s.mutable_restarts()->rbegin();
    r.set_restored_from_memory(stages);
    r.set_restored_from_replica(from_replica);
  });
}

absl::Status JobStore::SetPlan(const std::string& id, const std::string& task,
                               const std::string& partition,
                               const std::vector<v1::StageStatus>& stages) {
  return Mutate(id, true, [&](v1::JobStatus& s) {
    s.set_task(task);
    s.set_partition(partition);
    s.mutable_stages()->Assign(stages.begin(), stages.end());
  });
}

absl::Status JobStore::SetStageLoaded(const std::string& id, int stage, int64_t parameters,
                                      bool restored_from_memory, double analytic_delay) {
  absl::Status in_range;
  auto done = Mutate(id, true, [&](v1::JobStatus& s) {
    in_range = StageInRange(s, stage);
    if (!in_range.ok()) return;
    v1::StageStatus* st = s.mutable_stages(stage);
    st->set_parameters(parameters);
    st->set_restored_from_memory(restored_from_memory);
    st->set_analytic_delay(analytic_delay);
  });
  return done.ok() ? in_range : done;
}

absl::Status JobStore::SetCheckpoint(const std::string& id, int64_t step,
                                     const std::string& manifest, int32_t committed) {
  return Mutate(id, true, [&](v1::JobStatus& s) {
    s.mutable_checkpoint()->set_step(step);
    s.mutable_checkpoint()->set_manifest(manifest);
    s.mutable_checkpoint()->set_committed(committed);
  });
}

absl::Status JobStore::ClearEpochs(const std::string& id) {
  return Mutate(id, true, [](v1::JobStatus& s) { s.clear_epochs(); });
}

absl::StatusOr<JobStore::Rewound> JobStore::RewindTo(const std::string& id, int64_t step,
                                                     int epoch) {
  Rewound out;
  absl::Status st = Mutate(id, true, [&](v1::JobStatus& s) {
    s.set_resumed_from_step(step);
    out.committed = s.checkpoint().committed();
    auto* epochs = s.mutable_epochs();
    while (!epochs->empty() && epochs->rbegin()->epoch() >= epoch) {
      if (epochs->rbegin()->epoch() == epoch) out.cut_epoch = *epochs->rbegin();
      epochs->RemoveLast();
    }
  });
  if (!st.ok()) return st;
  return out;
}

absl::Status JobStore::AddEpoch(const std::string& id, const v1::EpochResult& epoch) {
  return Mutate(id, true, [&](v1::JobStatus& s) {
    *s.add_epochs() = epoch;
    s.mutable_metrics()->set_test_accuracy(epoch.test_accuracy());
    s.mutable_metrics()->set_test_loss(epoch.test_loss());
    if (epoch.test_perplexity() != 0) {
      s.mutable_metrics()->set_test_perplexity(epoch.test_perplexity());
    }
  });
}

absl::Status JobStore::UpdateProgress(
    const std::string& id, const std::function<void(v1::JobProgress&, v1::JobMetrics&)>& fn) {
  return Mutate(id, false,
                [&](v1::JobStatus& s) { fn(*s.mutable_progress(), *s.mutable_metrics()); });
}

absl::Status JobStore::UpdateStageLive(const std::string& id, int stage,
                                       const v1::StageStatusResponse& live) {
  absl::Status in_range;
  auto done = Mutate(id, false, [&](v1::JobStatus& s) {
    in_range = StageInRange(s, stage);
    if (!in_range.ok()) return;
    v1::StageStatus* st = s.mutable_stages(stage);
    st->set_measured_delay(live.measured_delay());
    st->set_learning_rate(live.learning_rate());
    *st->mutable_memory() = live.memory();
    *st->mutable_peak_memory() = live.peak_memory();
    st->set_async_from_step(live.async_from_step());
    st->set_nonfinite_skipped(live.nonfinite_skipped());
    st->set_allreduces(live.allreduces());
    st->set_allreduce_seconds(live.allreduce_seconds());
    st->set_allreduce_bytes(live.allreduce_bytes());
  });
  return done.ok() ? in_range : done;
}

uint64_t JobStore::VersionIfNewer(const std::string& id, uint64_t known,
                                  v1::JobStatus* status) const {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(id);
  if (it == jobs_.end()) return 0;
  if (it->second.version > known) *status = it->second.status;
  return it->second.version;
}

uint64_t JobStore::WaitForAnyChange(uint64_t seen, std::chrono::milliseconds timeout) const {
  absl::MutexLock lock(&mu_);
  auto changed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return changes_ != seen; };
  mu_.AwaitWithTimeout(absl::Condition(&changed), absl::FromChrono(timeout));
  return changes_;
}

absl::StatusOr<v1::JobStatus> JobStore::WaitForChange(const std::string& id, uint64_t* version,
                                                      std::chrono::milliseconds timeout) const {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job '", id, "'"));
  auto changed = [&]()
                     ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return it->second.version != *version; };
  mu_.AwaitWithTimeout(absl::Condition(&changed), absl::FromChrono(timeout));
  *version = it->second.version;
  return it->second.status;
}

}  // namespace pipemare
