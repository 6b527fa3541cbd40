#include "client/commands.h"

#include <chrono>
#include <cstdio>
#include <thread>

#include "client/follow.h"
#include "client/format.h"
#include "common/rpc.h"
#include "pipeline/core/checkpoint.h"
#include "pipeline/core/job_spec.h"
#include "pipeline/core/schedule.h"

namespace pipemare::client {
namespace {

int64_t NowUnixMs() {
  using namespace std::chrono;
  return duration_cast<milliseconds>(system_clock::now().time_since_epoch()).count();
}

// Prints a whole message as JSON on stdout.
void PrintJson(const google::protobuf::Message& message) {
  std::fputs(ToJson(message).c_str(), stdout);
  std::fflush(stdout);
}

void PrintText(const std::string& text) {
  std::fputs(text.c_str(), stdout);
  if (!text.empty() && text.back() != '\n') std::fputc('\n', stdout);
  std::fflush(stdout);
}

// Follows `job_id` like `watch`; stops watching (the job keeps running) on
// SIGINT/SIGTERM.
int Follow(v1::Coordinator::Stub& stub, const GlobalOptions& options, const std::string& job_id) {
  InstallInterruptHandlers();
  FollowOptions follow;
  follow.address = options.coordinator;
  follow.output = options.output;
  FollowResult result = FollowJob(stub, job_id, follow);
  if (result.outcome == FollowOutcome::kInterrupted) {
    std::fprintf(stderr,
                 "interrupted: stopped watching %s; it keeps running "
                 "(pipemarectl cancel %s stops it)\n",
                 job_id.c_str(), job_id.c_str());
  }
  return result.exit_code;
}

}  // namespace

// `text` inside a JSON string literal.
std::string JsonEscape(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += Format("\\u%04x", c);
    } else {
      out += c;
    }
  }
  return out;
}

std::unique_ptr<v1::Coordinator::Stub> ConnectCoordinator(const std::string& address) {
  return v1::Coordinator::NewStub(MakeChannel(address));
}

int ReportRpcError(const grpc::Status& status, const std::string& address) {
  const std::string message(FromGrpc(status).message());
  switch (status.error_code()) {
    case grpc::StatusCode::UNAVAILABLE:
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      std::fprintf(stderr,
                   "error: cannot reach coordinator at %s (is it running? set "
                   "--coordinator or PIPEMARE_COORDINATOR; a TLS handshake that fails also "
                   "ends here: --insecure for a plaintext coordinator, --tls-ca for one whose "
                   "CA this host does not trust, and a host its certificate does not name: "
                   "use a name it holds, e.g. one given to dev-ca --coordinator-host): %s\n",
                   address.c_str(), message.c_str());
      return kExitFailed;
    case grpc::StatusCode::UNAUTHENTICATED:
    case grpc::StatusCode::PERMISSION_DENIED:
      std::fprintf(stderr, "error: the coordinator at %s refused this call: %s\n", address.c_str(),
                   message.c_str());
      return kExitFailed;
    case grpc::StatusCode::INVALID_ARGUMENT:
      std::fprintf(stderr, "error: %s\n", message.c_str());
      return kExitBadInput;
    default:
      std::fprintf(stderr, "error: %s\n", message.c_str());
      return kExitFailed;
  }
}

absl::StatusOr<v1::JobSpec> LoadValidSpec(const std::string& path) {
  absl::StatusOr<v1::JobSpec> spec = LoadJobSpecFile(path);
  absl::Status status = spec.status();
  if (status.ok()) {
    ApplyJobSpecDefaults(*spec);
    status = ValidateJobSpec(*spec);
  }
  if (!status.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(status.message()).c_str());
    return status;
  }
  const auto& schedule = spec->schedule();
  if (IsAsynchronous(ScheduleKindOf(schedule)) && spec->train().epochs() > 0 &&
      schedule.warmup_epochs() >= spec->train().epochs()) {
    std::fprintf(stderr,
                 "warning: schedule.warmup_epochs %g covers all %d of train.epochs: this job "
                 "trains synchronously throughout and never runs %s; lower warmup_epochs or "
                 "raise train.epochs\n",
                 schedule.warmup_epochs(), spec->train().epochs(), schedule.type().c_str());
  }
  return spec;
}

void PrintJobStatus(const v1::JobStatus& job, OutputFormat output) {
  if (output == OutputFormat::kJson) {
    PrintJson(job);
  } else {
    PrintText(RenderJobStatus(job));
  }
}

int RunSubmit(const GlobalOptions& options, const std::string& file, bool wait,
              const std::string& from, const std::string& init_from) {
  absl::StatusOr<v1::JobSpec> spec = LoadValidSpec(file);
  if (!spec.ok()) return kExitBadInput;

  auto stub = ConnectCoordinator(options.coordinator);
  auto context = ContextWithDeadline(kRpcDeadlineSeconds);
  v1::SubmitJobRequest request;
  *request.mutable_spec() = *std::move(spec);
  request.set_from_checkpoint(from);
  request.set_init_from(init_from);
  v1::SubmitJobResponse response;
  grpc::Status status = stub->SubmitJob(context.get(), request, &response);
  if (!status.ok()) return ReportRpcError(status, options.coordinator);

  const v1::JobStatus& job = response.job();
  if (!wait) {
    if (options.output == OutputFormat::kJson) {
      PrintJson(job);
    } else {
      PrintText(RenderSubmitted(job));
    }
    return kExitOk;
  }
  // With --wait, stdout is the watch's (one JSON document at the end for
  // JSON output); the submission note goes to stderr.
  std::fprintf(stderr, "%s\n", RenderSubmitted(job).c_str());
  return Follow(*stub, options, job.id());
}

int RunStatus(const GlobalOptions& options, const std::string& job_id) {
  auto stub = ConnectCoordinator(options.coordinator);
  auto context = ContextWithDeadline(kRpcDeadlineSeconds);
  v1::GetJobRequest request;
  request.set_id(job_id);
  v1::JobStatus job;
  grpc::Status status = stub->GetJob(context.get(), request, &job);
  if (!status.ok()) return ReportRpcError(status, options.coordinator);
  PrintJobStatus(job, options.output);
  return kExitOk;
}

int RunList(const GlobalOptions& options) {
  auto stub = ConnectCoordinator(options.coordinator);
  auto context = ContextWithDeadline(kRpcDeadlineSeconds);
  v1::ListJobsResponse response;
  grpc::Status status = stub->ListJobs(context.get(), v1::ListJobsRequest(), &response);
  if (!status.ok()) return ReportRpcError(status, options.coordinator);
  if (options.output == OutputFormat::kJson) {
    PrintJson(response);
  } else {
    PrintText(RenderJobList(response));
  }
  return kExitOk;
}

int RunWatch(const GlobalOptions& options, const std::string& job_id) {
  auto stub = ConnectCoordinator(options.coordinator);
  return Follow(*stub, options, job_id);
}

int RunCancel(const GlobalOptions& options, const std::string& job_id) {
  auto stub = ConnectCoordinator(options.coordinator);
  auto context = ContextWithDeadline(kRpcDeadlineSeconds);
  v1::CancelJobRequest request;
  request.set_id(job_id);
  v1::JobStatus job;
  grpc::Status status = stub->CancelJob(context.get(), request, &job);
  if (!status.ok()) return ReportRpcError(status, options.coordinator);
  // A running job drains to a checkpoint first (seconds): show how it ended,
  // not the RUNNING it still was when the coordinator answered.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  if (!IsTerminal(job.state()) && options.output != OutputFormat::kJson) {
    std::fprintf(stderr, "cancelling %s: cutting a checkpoint so that it can be resumed...\n",
                 job_id.c_str());
  }
  while (!IsTerminal(job.state()) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    auto get_context = ContextWithDeadline(kRpcDeadlineSeconds);
    v1::GetJobRequest get;
    get.set_id(job_id);
    v1::JobStatus now;
    if (stub->GetJob(get_context.get(), get, &now).ok()) job = std::move(now);
  }
  if (!IsTerminal(job.state())) {
    std::fprintf(stderr, "%s is still %s: it stops at its next step (pipemarectl watch %s)\n",
                 job_id.c_str(), v1::JobState_Name(job.state()).c_str(), job_id.c_str());
  }
  if (options.output == OutputFormat::kJson) {
    PrintJson(job);
  } else {
    PrintText(RenderFinalState(job));
  }
  return kExitOk;
}

int RunWorkers(const GlobalOptions& options) {
  auto stub = ConnectCoordinator(options.coordinator);
  auto context = ContextWithDeadline(kRpcDeadlineSeconds);
  v1::ListWorkersResponse response;
  grpc::Status status = stub->ListWorkers(context.get(), v1::ListWorkersRequest(), &response);
  if (!status.ok()) return ReportRpcError(status, options.coordinator);
  if (options.output == OutputFormat::kJson) {
    PrintJson(response);
  } else {
    PrintText(RenderWorkers(response, NowUnixMs()));
  }
  return kExitOk;
}

int RunResume(const GlobalOptions& options, const std::string& job_id, bool wait) {
  auto stub = ConnectCoordinator(options.coordinator);
  auto context = ContextWithDeadline(kRpcDeadlineSeconds);
  v1::ResumeJobRequest request;
  request.set_id(job_id);
  v1::JobStatus job;
  grpc::Status status = stub->ResumeJob(context.get(), request, &job);
  if (!status.ok()) return ReportRpcError(status, options.coordinator);
  std::fprintf(stderr, "%s: %s\n", job_id.c_str(), job.reason().c_str());
  if (!wait) return kExitOk;
  return RunWatch(options, job_id);
}

int RunExport(const GlobalOptions& options, const std::string& job_id, int64_t step,
              const std::string& out) {
  auto stub = ConnectCoordinator(options.coordinator);
  // The model travels in one message (at most the channel's limit).
  auto context = ContextWithDeadline(300);
  v1::ExportModelRequest request;
  request.set_id(job_id);
  request.set_step(step);
  v1::ExportModelResponse response;
  grpc::Status status = stub->ExportModel(context.get(), request, &response);
  if (!status.ok()) return ReportRpcError(status, options.coordinator);
  for (const auto& [path, bytes] :
       {std::pair{out, &response.model()}, std::pair{out + ".json", &response.spec_json()}}) {
    if (auto st = WriteFileAtomically(path, *bytes); !st.ok()) {
      std::fprintf(stderr, "error: --out: %s\n", std::string(st.message()).c_str());
      return kExitFailed;
    }
  }
  std::fprintf(stderr,
               "exported %s at step %lld to %s (%s, %zu bytes; spec and input in %s.json)\n",
               job_id.c_str(), static_cast<long long>(response.step()), out.c_str(),
               response.format().c_str(), response.model().size(), out.c_str());
  if (options.output == OutputFormat::kJson) {
    std::printf(
        "{\"job\": \"%s\", \"step\": %lld, \"out\": \"%s\", \"spec\": \"%s.json\", "
        "\"format\": \"%s\", \"bytes\": %zu}\n",
        JsonEscape(job_id).c_str(), static_cast<long long>(response.step()),
        JsonEscape(out).c_str(), JsonEscape(out).c_str(), JsonEscape(response.format()).c_str(),
        response.model().size());
    std::fflush(stdout);
  }
  return kExitOk;
}

}  // namespace pipemare::client
