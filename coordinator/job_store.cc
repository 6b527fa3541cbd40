#include "coordinator/job_store.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "google/protobuf/util/json_util.h"

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
      return to == v1::SUCCEEDED || to == v1::FAILED || to == v1::CANCELLED;
    case v1::FAILED:
    case v1::CANCELLED:
      return to == v1::PENDING;  // resume, from the newest checkpoint
    default:
      return false;
  }
}

JobStore::JobStore(std::string state_dir) : state_dir_(std::move(state_dir)) {
  if (state_dir_.empty()) return;
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(state_dir_, ec);
  for (const auto& file : fs::directory_iterator(state_dir_, ec)) {
    if (file.path().extension() != ".json") continue;
    std::ifstream in(file.path());
    std::stringstream ss;
    ss << in.rdbuf();
    v1::JobStatus status;
    if (!google::protobuf::util::JsonStringToMessage(ss.str(), &status).ok() ||
        status.id().empty()) {
      LogWarning(absl::StrCat("ignoring unreadable job file ", file.path().string()));
      continue;
    }
    if (status.state() == v1::RUNNING && !status.checkpoint().manifest().empty()) {
      // It continues from its newest checkpoint once its workers are back.
      status.set_state(v1::PENDING);
      status.set_reason(
          "the coordinator restarted while this job was running; it resumes from "
          "its newest checkpoint");
      status.set_resumes(status.resumes() + 1);
      status.mutable_progress()->set_step(status.checkpoint().step());
      LogInfo(ForJob(status.id()), status.reason());
    } else if (status.state() == v1::RUNNING) {
      status.set_state(v1::FAILED);
      status.set_reason(
          "the coordinator stopped while this job was running, before its first checkpoint; "
          "resubmit it to run again");
      status.set_finished_unix_ms(NowUnixMs());
    }
    next_id_ = std::max(next_id_, IdNumber(status.id()) + 1);
    jobs_[status.id()] = Entry{status, 1};
    Persist(status);
  }
}

void JobStore::Persist(const v1::JobStatus& status) {
  if (state_dir_.empty()) return;
  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  if (!google::protobuf::util::MessageToJsonString(status, &json, options).ok()) return;
  const std::string path = absl::StrCat(state_dir_, "/", status.id(), ".json");
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << json;
    if (!out) {
      LogError(ForJob(status.id()),
               absl::StrCat("cannot write ", tmp, "; the job record is not persisted"));
      return;
    }
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
}

v1::JobStatus JobStore::Create(const v1::JobSpec& spec) {
  std::lock_guard<std::mutex> lock(mu_);
  v1::JobStatus s;
  s.set_id(absl::StrCat("job-", next_id_++));
  s.set_name(spec.name());
  s.set_state(v1::PENDING);
  s.set_schedule(spec.schedule().type());
  *s.mutable_spec() = spec;
  s.mutable_progress()->set_epochs(spec.train().epochs());
  s.set_submitted_unix_ms(NowUnixMs());
  jobs_[s.id()] = Entry{s, 1};
  Persist(s);
  cv_.notify_all();
  return s;
}

absl::StatusOr<v1::JobStatus> JobStore::Get(const std::string& id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = jobs_.find(id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job '", id, "'"));
  return it->second.status;
}

std::vector<v1::JobStatus> JobStore::List() const {
  std::lock_guard<std::mutex> lock(mu_);
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
  std::lock_guard<std::mutex> lock(mu_);
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
  ++it->second.version;
  Persist(s);
  cv_.notify_all();
  return absl::OkStatus();
}

absl::Status JobStore::Update(const std::string& id,
                              const std::function<void(v1::JobStatus&)>& fn) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = jobs_.find(id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job '", id, "'"));
  const v1::JobState state = it->second.status.state();
  fn(it->second.status);
  it->second.status.set_state(state);
  ++it->second.version;
  Persist(it->second.status);
  cv_.notify_all();
  return absl::OkStatus();
}

absl::StatusOr<v1::JobStatus> JobStore::WaitForChange(const std::string& id, uint64_t* version,
                                                      std::chrono::milliseconds timeout) const {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = jobs_.find(id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job '", id, "'"));
  cv_.wait_for(lock, timeout, [&] { return it->second.version != *version; });
  *version = it->second.version;
  return it->second.status;
}

}  // namespace pipemare
