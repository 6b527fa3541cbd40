// The Coordinator gRPC service: thin handlers that validate requests and
// delegate to JobManager, JobStore and WorkerRegistry.
#ifndef PIPEMARE_COORDINATOR_COORDINATOR_SERVICE_H_
#define PIPEMARE_COORDINATOR_COORDINATOR_SERVICE_H_

#include <map>
#include <string>

#include "coordinator/job_manager.h"
#include "pipemare/v1/pipemare.grpc.pb.h"

namespace pipemare {

// Who may call each Coordinator method (common/security.h): clients with
// tokens, workers with their certificates.
std::map<std::string, unsigned> CoordinatorAccessRules();

class CoordinatorService final : public v1::Coordinator::Service {
 public:
  CoordinatorService(JobStore* store, WorkerRegistry* registry, JobManager* manager,
                     int64_t heartbeat_interval_ms)
      : store_(store),
        registry_(registry),
        manager_(manager),
        heartbeat_interval_ms_(heartbeat_interval_ms) {}

  // Largest SubmitJob request accepted (--max-spec-bytes).
  void set_max_spec_bytes(size_t bytes) { max_spec_bytes_ = bytes; }

  grpc::Status SubmitJob(grpc::ServerContext*, const v1::SubmitJobRequest*,
                         v1::SubmitJobResponse*) override;
  grpc::Status GetJob(grpc::ServerContext*, const v1::GetJobRequest*, v1::JobStatus*) override;
  grpc::Status ListJobs(grpc::ServerContext*, const v1::ListJobsRequest*,
                        v1::ListJobsResponse*) override;
  grpc::Status CancelJob(grpc::ServerContext*, const v1::CancelJobRequest*,
                         v1::JobStatus*) override;
  grpc::Status WatchJob(grpc::ServerContext*, const v1::WatchJobRequest*,
                        grpc::ServerWriter<v1::JobEvent>*) override;
  grpc::Status ListWorkers(grpc::ServerContext*, const v1::ListWorkersRequest*,
                           v1::ListWorkersResponse*) override;
  grpc::Status RegisterWorker(grpc::ServerContext*, const v1::RegisterWorkerRequest*,
                              v1::RegisterWorkerResponse*) override;
  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest*,
                         v1::HeartbeatResponse*) override;
  grpc::Status ExportModel(grpc::ServerContext*, const v1::ExportModelRequest*,
                           v1::ExportModelResponse*) override;
  grpc::Status DrainWorker(grpc::ServerContext*, const v1::DrainWorkerRequest*,
                           v1::DrainWorkerResponse*) override;
  grpc::Status ResumeJob(grpc::ServerContext*, const v1::ResumeJobRequest*,
                         v1::JobStatus*) override;

 private:
  JobStore* const store_;
  WorkerRegistry* const registry_;
  JobManager* const manager_;
  const int64_t heartbeat_interval_ms_;
  size_t max_spec_bytes_ = 1 << 20;
};

}  // namespace pipemare

#endif  // PIPEMARE_COORDINATOR_COORDINATOR_SERVICE_H_
