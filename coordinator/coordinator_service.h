// The Coordinator gRPC service: thin handlers that validate requests and
// delegate to JobManager, JobStore and WorkerRegistry.
#ifndef PIPEMARE_COORDINATOR_COORDINATOR_SERVICE_H_
#define PIPEMARE_COORDINATOR_COORDINATOR_SERVICE_H_

#include <map>
#include <string>

#include "coordinator/job_manager.h"
#include "coordinator/watch_hub.h"
#include "pipemare/v1/pipemare.grpc.pb.h"

namespace pipemare {

// Who may call each Coordinator method (common/security.h): clients with
// tokens, workers with their certificates.
std::map<std::string, unsigned> CoordinatorAccessRules();

// WatchJob runs on gRPC's callback API (coordinator/watch_hub.h: no thread
// per watcher); every other method is synchronous.
class CoordinatorService final
    : public v1::Coordinator::WithCallbackMethod_WatchJob<v1::Coordinator::Service> {
 public:
  // Watches are bounded per caller: --max-watches-per-caller.
  static constexpr size_t kDefaultMaxWatchesPerCaller = 2048;
  CoordinatorService(JobStore* store, WorkerRegistry* registry, JobManager* manager,
                     int64_t heartbeat_interval_ms,
                     size_t max_watches_per_caller = kDefaultMaxWatchesPerCaller)
      : store_(store),
        registry_(registry),
        manager_(manager),
        heartbeat_interval_ms_(heartbeat_interval_ms),
        watches_(store, max_watches_per_caller) {}

  // Largest SubmitJob request accepted (--max-spec-bytes).
  void set_max_spec_bytes(size_t bytes) { max_spec_bytes_ = bytes; }

  grpc::Status SubmitJob(grpc::ServerContext*, const v1::SubmitJobRequest*,
                         v1::SubmitJobResponse*) override;
  grpc::Status GetJob(grpc::ServerContext*, const v1::GetJobRequest*, v1::JobStatus*) override;
  grpc::Status ListJobs(grpc::ServerContext*, const v1::ListJobsRequest*,
                        v1::ListJobsResponse*) override;
  grpc::Status CancelJob(grpc::ServerContext*, const v1::CancelJobRequest*,
                         v1::JobStatus*) override;
  grpc::ServerWriteReactor<v1::JobEvent>* WatchJob(grpc::CallbackServerContext* context,
                                                   const v1::WatchJobRequest* request) override {
    return watches_.Watch(context, request);
  }
  // Ends every open watch (UNAVAILABLE: the client reconnects); before the
  // server shuts down.
  void StopWatches() { watches_.Stop(); }
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
  WatchHub watches_;
};

}  // namespace pipemare

#endif  // PIPEMARE_COORDINATOR_COORDINATOR_SERVICE_H_
