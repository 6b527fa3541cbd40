// The StageWorker gRPC service: thin handlers over the worker's one StageHost.
// A worker serves at most one stage at a time. When a stage ends, the cuts it
// kept in memory stay until the next load: a recovery that rolls the job
// back to one of them restores the stage without reading disk.
#ifndef PIPEMARE_STAGE_WORKER_WORKER_SERVICE_H_
#define PIPEMARE_STAGE_WORKER_WORKER_SERVICE_H_

#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "pipemare/v1/pipemare.grpc.pb.h"
#include "stage_worker/stage_host.h"

namespace pipemare {

// Who may call each StageWorker method (common/security.h): the pipeline
// stream takes the coordinator (its feeds) and neighbouring workers,
// FetchCutUnit workers only (another replica's stage); every other method
// only the coordinator.
std::map<std::string, unsigned> WorkerAccessRules();

// Pipe is served on gRPC's callback API with raw byte buffers
// (common/pipe_stream.h); the other methods are synchronous.
class WorkerService final
    : public v1::StageWorker::WithRawCallbackMethod_Pipe<v1::StageWorker::Service> {
 public:
  // `metrics` must outlive the service.
  // `virtual_device`: see pipeline/runtime/stage_runtime.h (benchmarks only).
  WorkerService(torch::Device device, std::string self_address, WorkerMetrics* metrics,
                VirtualDevice virtual_device = {})
      : device_(device),
        self_address_(std::move(self_address)),
        metrics_(metrics),
        virtual_device_(virtual_device) {}

  grpc::Status LoadStage(grpc::ServerContext* context, const v1::StageAssignment* request,
                         v1::LoadStageResponse* response) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Pipe(
      grpc::CallbackServerContext* context) override;
  grpc::Status GetStageStatus(grpc::ServerContext* context, const v1::StageStatusRequest* request,
                              v1::StageStatusResponse* response) override;
  grpc::Status ReleaseStage(grpc::ServerContext* context, const v1::ReleaseStageRequest* request,
                            v1::ReleaseStageResponse* response) override;
  grpc::Status CutCheckpoint(grpc::ServerContext* context, const v1::CutCheckpointRequest* request,
                             v1::CutCheckpointResponse* response) override;
  // Times every unit of a model on this worker's device (partition
  // "profile"). Idle workers only; one profile at a time.
  grpc::Status ProfileUnits(grpc::ServerContext* context, const v1::ProfileRequest* request,
                            v1::ProfileResponse* response) override;
  // A unit of a cut this worker holds in memory, for the same stage of
  // another replica (stage_worker/replica_cuts.h).
  grpc::Status FetchCutUnit(grpc::ServerContext* context, const v1::FetchCutUnitRequest* request,
                            grpc::ServerWriter<v1::CutUnitChunk>* writer) override;

  // Drops the current stage, whatever its job (coordinator lost, shutdown).
  void ReleaseAll(const std::string& why);
  // Whether a stage is loaded (draining waits until it is released).
  bool HasStage() {
    absl::MutexLock lock(&mu_);
    return host_ != nullptr && !host_->failed();
  }
  void set_self_address(const std::string& a) { self_address_ = a; }
  // The worker serves plaintext gRPC (--insecure): only then may a job send
  // tensors over the unencrypted Gloo data plane (schedule.transport).
  void set_plaintext(bool plaintext) { plaintext_ = plaintext; }
  // The stage loaded now, or the last one and the cuts of it this worker
  // holds in memory (RegisterWorkerRequest.served).
  v1::ServedStage Served();

 private:
  std::shared_ptr<StageHost> Current(const std::string& job_id);
  // Sets the loaded-stages gauge from host_.
  void CountStagesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    metrics_->SetLoadedStages(host_ ? 1 : 0);
  }

  const torch::Device device_;
  std::string self_address_;
  bool plaintext_ = false;
  WorkerMetrics* const metrics_;
  const VirtualDevice virtual_device_;
  absl::Mutex mu_;
  std::shared_ptr<StageHost> host_ ABSL_GUARDED_BY(mu_);
  // Cuts kept by the last stage that ended, and its job, stage and
  // generation.
  std::string memory_job_ ABSL_GUARDED_BY(mu_);
  int memory_stage_ ABSL_GUARDED_BY(mu_) = -1;
  int64_t memory_generation_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<RetainedCut> memory_ ABSL_GUARDED_BY(mu_);
  // Keeps `host`'s cuts as memory_.
  void KeepMemoryLocked(const StageHost& host) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    memory_job_ = host.job_id();
    memory_stage_ = host.stage();
    memory_generation_ = host.generation();
    memory_ = host.Retained();
  }
  absl::Mutex profile_mu_;  // one ProfileUnits at a time
};

}  // namespace pipemare

#endif  // PIPEMARE_STAGE_WORKER_WORKER_SERVICE_H_
