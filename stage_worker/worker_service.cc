#include "stage_worker/worker_service.h"

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/rpc.h"
#include "pipeline/core/job_spec.h"
#include "pipeline/core/settings.h"
#include "pipeline/model/model.h"
#include "stage_worker/replica_cuts.h"

namespace pipemare {

std::map<std::string, unsigned> WorkerAccessRules() {
  const std::string service = absl::StrCat("/", v1::StageWorker::service_full_name(), "/");
  std::map<std::string, unsigned> rules;
  for (const char* method :
       {"LoadStage", "GetStageStatus", "ReleaseStage", "CutCheckpoint", "ProfileUnits"}) {
    rules[service + method] = kCoordinator;
  }
  rules[service + "Pipe"] = kCoordinator | kWorker;
  // The same stage of another replica, restoring a cut this worker holds.
  rules[service + "FetchCutUnit"] = kWorker;
  return rules;
}

std::shared_ptr<StageHost> WorkerService::Current(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  if (host_ && host_->job_id() == job_id) return host_;
  return nullptr;
}

grpc::Status WorkerService::LoadStage(grpc::ServerContext*, const v1::StageAssignment* request,
                                      v1::LoadStageResponse* response) {
  if (request->job_id().empty()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "job_id: required");
  }
  if (auto st = RequireFiniteFields(*request); !st.ok()) return ToGrpc(st);
  if (TransportOf(request->schedule().transport()) == Transport::kGloo) {
    if (!plaintext_) {
      return grpc::Status(
          grpc::StatusCode::INVALID_ARGUMENT,
          absl::StrCat("schedule.transport: gloo sends activations and gradients unencrypted and "
                       "unauthenticated, and worker ",
                       self_address_,
                       " serves mutual TLS; use transport: grpc (encrypted), or run the workers "
                       "with --insecure on a network only they share"));
    }
  }
  std::shared_ptr<StageHost> old;
  {
    absl::MutexLock lock(&mu_);
    if (host_ && !host_->failed() && host_->job_id() != request->job_id()) {
      return grpc::Status(
          grpc::StatusCode::FAILED_PRECONDITION,
          absl::StrCat("worker is busy with job ", host_->job_id(), "; release it first"));
    }
    old = std::move(host_);
    CountStagesLocked();
  }
  std::vector<RetainedCut> memory;
  if (old) old->Stop();
  {
    absl::MutexLock lock(&mu_);
    if (old) KeepMemoryLocked(*old);
    if (memory_job_ == request->job_id()) memory = std::move(memory_);
    memory_.clear();  // used now or never: a new stage keeps its own
    memory_job_.clear();
  }
  const LogContext log = ForStage(request->job_id(), request->stage());
  auto host = StageHost::Start(*request, device_, self_address_,
                               metrics_->ForStage(request->job_id(), request->stage()),
                               virtual_device_, &memory);
  if (!host.ok()) {
    LogError(log, absl::StrCat("cannot load stage: ", host.status().message()));
    return ToGrpc(host.status());
  }
  const StageStats stats = (*host)->Stats();
  response->set_parameters(stats.parameters);
  response->set_analytic_delay(stats.analytic_delay);
  response->set_restored_from_memory((*host)->restored_from_memory());
  response->set_restored_from_replica((*host)->restored_from_replica());
  response->set_collective_address((*host)->collective_address());
  {
    absl::MutexLock lock(&mu_);
    host_ = *host;
    CountStagesLocked();
  }
  LogInfo(log, absl::StrCat("loaded stage ", request->stage(), " of ", request->num_stages(),
                            ": units [", request->first_unit(), ", ",
                            request->first_unit() + request->units(), "), ", stats.parameters,
                            " parameters, schedule ", request->schedule().type()));
  return grpc::Status::OK;
}

grpc::Status WorkerService::ProfileUnits(grpc::ServerContext*, const v1::ProfileRequest* request,
                                         v1::ProfileResponse* response) {
  {
    absl::MutexLock lock(&mu_);
    if (host_ && !host_->failed()) {
      return grpc::Status(
          grpc::StatusCode::FAILED_PRECONDITION,
          absl::StrCat("worker is busy with job ", host_->job_id(), "; profile idle workers only"));
    }
  }
  auto bad = [](const std::string& what) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, what);
  };
  if (request->microbatch_size() < 1 || request->microbatch_size() > 65536) {
    return bad("microbatch_size: must be in 1..65536");
  }
  if (request->repeats() < 0 || request->repeats() > 100) return bad("repeats: must be in 0..100");
  const std::vector<int64_t> shape(request->input_shape().begin(), request->input_shape().end());
  if (auto st = CheckExampleShape(shape, request->microbatch_size(), "input_shape"); !st.ok()) {
    return ToGrpc(st);
  }
  if (request->token_input() && request->vocab() < 1) return bad("vocab: >= 1 for token input");
  absl::MutexLock profiling(&profile_mu_);
  at::init_num_threads();  // OpenMP's thread count is per thread (see StageHost)
  const TensorType input{shape, request->token_input()};
  auto costs = ::pipemare::ProfileUnits(
      request->model(), request->torchscript(), input, request->vocab(), request->microbatch_size(),
      request->repeats() ? request->repeats() : 3, request->seed(), device_);
  if (!costs.ok()) return ToGrpc(costs.status());
  for (size_t u = 0; u < costs->parameters.size(); ++u) {
    // The virtual device's compute is its configured wait per unit.
    response->add_forward_seconds(virtual_device_.enabled ? virtual_device_.forward_seconds_per_unit
                                                          : costs->forward_seconds[u]);
    response->add_backward_seconds(virtual_device_.enabled
                                       ? virtual_device_.backward_seconds_per_unit
                                       : costs->backward_seconds[u]);
    response->add_parameters(costs->parameters[u]);
  }
  return grpc::Status::OK;
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* WorkerService::Pipe(
    grpc::CallbackServerContext* context) {
  return ServePipe(
      context,
      [this](absl::StatusOr<PipeMessage> first,
             std::shared_ptr<PipeStream> stream) -> grpc::Status {
        if (!first.ok()) return ToGrpc(first.status());
        if (!first->message.has_open()) {
          return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                              "open: the first message of a Pipe stream must be a StreamOpen");
        }
        const v1::StreamOpen& open = first->message.open();
        auto host = Current(open.job_id());
        if (!host) {
          return grpc::Status(
              grpc::StatusCode::NOT_FOUND,
              absl::StrCat("open.job_id: this worker has no stage of job '", open.job_id(), "'"));
        }
        return host->Attach(open, std::move(stream));
      });
}

grpc::Status WorkerService::GetStageStatus(grpc::ServerContext*,
                                           const v1::StageStatusRequest* request,
                                           v1::StageStatusResponse* response) {
  auto host = Current(request->job_id());
  if (!host) {
    return grpc::Status(grpc::StatusCode::NOT_FOUND,
                        absl::StrCat("job_id: no stage of job '", request->job_id(), "' here"));
  }
  if (request->committed_step() < 0) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("committed_step: ", request->committed_step(),
                                     " is negative; send 0 when no cut is committed"));
  }
  host->NoteCommitted(request->committed_step());
  *response = host->Status();
  return grpc::Status::OK;
}

grpc::Status WorkerService::ReleaseStage(grpc::ServerContext*,
                                         const v1::ReleaseStageRequest* request,
                                         v1::ReleaseStageResponse*) {
  std::shared_ptr<StageHost> host;
  {
    absl::MutexLock lock(&mu_);
    if (host_ && host_->job_id() == request->job_id()) host = std::move(host_);
    CountStagesLocked();
  }
  if (host) {
    host->Stop();
    absl::MutexLock lock(&mu_);
    KeepMemoryLocked(*host);
  }
  if (host) LogInfo(ForJob(request->job_id()), "released stage");
  return grpc::Status::OK;  // releasing what is not here is a no-op
}

grpc::Status WorkerService::CutCheckpoint(grpc::ServerContext*,
                                          const v1::CutCheckpointRequest* request,
                                          v1::CutCheckpointResponse*) {
  auto host = Current(request->job_id());
  if (!host) {
    return grpc::Status(grpc::StatusCode::NOT_FOUND,
                        absl::StrCat("job_id: no stage of job '", request->job_id(), "' here"));
  }
  if (request->step() < 1) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "step: must be >= 1");
  }
  return ToGrpc(host->CutAt(request->step()));
}

grpc::Status WorkerService::FetchCutUnit(grpc::ServerContext*,
                                         const v1::FetchCutUnitRequest* request,
                                         grpc::ServerWriter<v1::CutUnitChunk>* writer) {
  std::shared_ptr<StageHost> host;
  std::vector<RetainedCut> memory;
  std::string job;
  {
    absl::MutexLock lock(&mu_);
    host = host_;
    if (!host) {
      memory = memory_;
      job = memory_job_;
    }
  }
  if (host) {
    memory = host->Retained();
    job = host->job_id();
  }
  return ServeCutUnit(job, memory, *request, writer);
}

v1::ServedStage WorkerService::Served() {
  std::shared_ptr<StageHost> host;
  v1::ServedStage served;
  {
    absl::MutexLock lock(&mu_);
    host = host_;
    if (!host && !memory_job_.empty()) {
      served.set_job_id(memory_job_);
      served.set_stage(memory_stage_);
      served.set_generation(memory_generation_);
      for (const RetainedCut& cut : memory_) served.add_cut_steps(cut.snapshot->step);
    }
  }
  if (host) {
    served.set_job_id(host->job_id());
    served.set_stage(host->stage());
    served.set_generation(host->generation());
    for (const RetainedCut& cut : host->Retained()) served.add_cut_steps(cut.snapshot->step);
  }
  return served;
}

void WorkerService::ReleaseAll(const std::string& why) {
  std::shared_ptr<StageHost> host;
  {
    absl::MutexLock lock(&mu_);
    host = std::move(host_);
    CountStagesLocked();
  }
  if (host) {
    LogWarning(ForJob(host->job_id()), absl::StrCat("dropping stage: ", why));
    host->Stop();
    absl::MutexLock lock(&mu_);
    KeepMemoryLocked(*host);
  }
}

}  // namespace pipemare
