// The runner's calls to the stages of one run, one worker per stage: load,
// status, cut, release and profile, and the channel each feed opens on. An
// interface so that the runner takes its stages from outside; the gRPC one
// is the real one.
#ifndef PIPEMARE_COORDINATOR_STAGE_CLIENTS_H_
#define PIPEMARE_COORDINATOR_STAGE_CLIENTS_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "pipeline/model/model_plan.h"
#include "pipemare/v1/pipemare.grpc.pb.h"

namespace pipemare {

class StageClients {
 public:
  virtual ~StageClients() = default;
  // Stages of one pipeline: replica 0's are 0..stages()-1; with
  // schedule.replicas, stage i of replica r is index r * stages() + i.
  virtual int stages() const = 0;
  // Every stage of every replica.
  virtual int workers() const = 0;
  // "stage 2 (worker w-3 at host:port)", "stage 2 of replica 1 (...)", for
  // messages.
  virtual std::string Label(int stage) const = 0;
  // The address its upstream stage streams to.
  virtual std::string Address(int stage) const = 0;
  // LoadStage (60 s).
  virtual grpc::Status Load(int stage, const v1::StageAssignment& a,
                            v1::LoadStageResponse* resp) = 0;
  // GetStageStatus (3 s), telling the stage the committed step.
  virtual grpc::Status Status(int stage, int64_t committed_step, v1::StageStatusResponse* resp) = 0;
  // CutCheckpoint at the end of `step`, waiting at most `seconds`.
  virtual grpc::Status Cut(int stage, int64_t step, double seconds) = 0;
  // ReleaseStage (3 s).
  virtual grpc::Status Release(int stage) = 0;
  // ProfileUnits (300 s).
  virtual grpc::Status Profile(int stage, const v1::ProfileRequest& req,
                               v1::ProfileResponse* resp) = 0;
  // The channel a feed to this stage opens its stream on.
  virtual std::shared_ptr<grpc::Channel> Channel(int stage) = 0;
};

// The stages of job `job_id` on `workers` (stage i of replica r on
// workers[r * stages + i]), over gRPC (common/rpc.h's channels: the
// cluster's TLS and token).
std::unique_ptr<StageClients> GrpcStageClients(std::string job_id,
                                               std::vector<v1::WorkerInfo> workers, int stages);

// Every unit's forward + backward seconds timed on each stage's worker, one
// worker at a time (workers that share a host would time each other):
// cost[stage][unit]. CANCELLED once `cancel` is set; UNAVAILABLE naming the
// stage when a worker cannot profile.
absl::StatusOr<std::vector<std::vector<double>>> ProfileOnStages(
    StageClients& stages, const ModelPlan& plan, int64_t microbatch_size, int64_t seed,
    const std::atomic<bool>& cancel, const std::string& job_id);

}  // namespace pipemare

#endif  // PIPEMARE_COORDINATOR_STAGE_CLIENTS_H_
