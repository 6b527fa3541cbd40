#include "coordinator/coordinator_service.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/rpc.h"

namespace pipemare {

namespace {

// A worker counts only once the address it advertises parses as host:port
// and answers there: the coordinator and its neighbours will call it at that
// address, and an address that does not answer would only fail its first job.
absl::Status ProbeWorkerAddress(const std::string& address) {
  const size_t colon = address.rfind(':');
  int port = 0;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 1 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("address: '", address, "' is not host:port (a port in 1..65535)"));
  }
  auto stub = v1::StageWorker::NewStub(MakeChannel(address));
  auto context = ContextWithDeadline(3);
  v1::StageStatusResponse response;
  const grpc::Status st = stub->GetStageStatus(context.get(), v1::StageStatusRequest(), &response);
  if (st.error_code() == grpc::StatusCode::UNAVAILABLE ||
      st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    return absl::FailedPreconditionError(
        absl::StrCat("address: the coordinator cannot reach this worker at ", address, " (",
                     st.error_message(), "); --advertise an address the coordinator can reach"));
  }
  return absl::OkStatus();
}

}  // namespace

std::map<std::string, unsigned> CoordinatorAccessRules() {
  const std::string service = absl::StrCat("/", v1::Coordinator::service_full_name(), "/");
  std::map<std::string, unsigned> rules;
  for (const char* method : {"GetJob", "ListJobs", "WatchJob", "ListWorkers"}) {
    rules[service + method] = kReader;
  }
  for (const char* method : {"SubmitJob", "CancelJob", "ExportModel", "ResumeJob"}) {
    rules[service + method] = kSubmitter;
  }
  for (const char* method : {"RegisterWorker", "Heartbeat", "DrainWorker"}) {
    rules[service + method] = kWorker;
  }
  return rules;
}

grpc::Status CoordinatorService::SubmitJob(grpc::ServerContext* context,
                                           const v1::SubmitJobRequest* req,
                                           v1::SubmitJobResponse* resp) {
  if (!req->has_spec()) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "spec: required");
  if (const size_t bytes = req->ByteSizeLong(); bytes > max_spec_bytes_) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("spec: ", bytes, " bytes, more than the coordinator's ",
                                     "--max-spec-bytes ", max_spec_bytes_,
                                     "; a spec names its data and model files rather than "
                                     "holding them"));
  }
  const std::string submitter = CallerName(*context);
  auto job = manager_->Submit(req->spec(), req->from_checkpoint(), submitter, req->init_from());
  if (!job.ok()) {
    LogWarning(absl::StrCat("refused a job from ", submitter, ": ", job.status().message()));
    return ToGrpc(job.status());
  }
  *resp->mutable_job() = *job;
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::GetJob(grpc::ServerContext*, const v1::GetJobRequest* req,
                                        v1::JobStatus* resp) {
  auto job = store_->Get(req->id());
  if (!job.ok()) return ToGrpc(job.status());
  *resp = *job;
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::ListJobs(grpc::ServerContext*, const v1::ListJobsRequest*,
                                          v1::ListJobsResponse* resp) {
  for (auto& job : store_->List()) *resp->add_jobs() = std::move(job);
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::CancelJob(grpc::ServerContext*, const v1::CancelJobRequest* req,
                                           v1::JobStatus* resp) {
  auto job = manager_->Cancel(req->id());
  if (!job.ok()) return ToGrpc(job.status());
  *resp = *job;
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::ListWorkers(grpc::ServerContext*, const v1::ListWorkersRequest*,
                                             v1::ListWorkersResponse* resp) {
  for (auto& w : registry_->List()) *resp->add_workers() = std::move(w);
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::RegisterWorker(grpc::ServerContext* context,
                                                const v1::RegisterWorkerRequest* req,
                                                v1::RegisterWorkerResponse* resp) {
  if (auto st = CheckCertificateNamesAddress(*context, req->address()); !st.ok()) {
    LogWarning(absl::StrCat("refused a worker registering ", req->address(), ": ", st.message()));
    return ToGrpc(st);
  }
  if (auto st = ProbeWorkerAddress(req->address()); !st.ok()) {
    LogWarning(absl::StrCat("refused a worker registering ", req->address(), ": ", st.message()));
    return ToGrpc(st);
  }
  auto id = registry_->Register(*req);
  if (!id.ok()) return ToGrpc(id.status());
  LogInfo(absl::StrCat("worker ", *id, " registered from ", req->address(), " (device ",
                       req->device(), req->metrics_address().empty() ? "" : ", metrics ",
                       req->metrics_address(), ")"));
  resp->set_worker_id(*id);
  resp->set_heartbeat_interval_ms(heartbeat_interval_ms_);
  manager_->Poke();
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest* req,
                                           v1::HeartbeatResponse*) {
  return ToGrpc(registry_->Heartbeat(req->worker_id(), req->instance_id()));
}

grpc::Status CoordinatorService::DrainWorker(grpc::ServerContext*,
                                             const v1::DrainWorkerRequest* req,
                                             v1::DrainWorkerResponse* resp) {
  auto job = manager_->DrainWorker(req->worker_id(), req->instance_id());
  if (!job.ok()) return ToGrpc(job.status());
  resp->set_job_id(*job);
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::ExportModel(grpc::ServerContext*,
                                             const v1::ExportModelRequest* req,
                                             v1::ExportModelResponse* resp) {
  auto exported = manager_->Export(req->id(), req->step());
  if (!exported.ok()) return ToGrpc(exported.status());
  *resp = std::move(*exported);
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::ResumeJob(grpc::ServerContext*, const v1::ResumeJobRequest* req,
                                           v1::JobStatus* resp) {
  auto job = manager_->Resume(req->id());
  if (!job.ok()) return ToGrpc(job.status());
  *resp = std::move(*job);
  return grpc::Status::OK;
}

}  // namespace pipemare
