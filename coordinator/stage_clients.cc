#include "coordinator/stage_clients.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/rpc.h"

namespace pipemare {
namespace {

class GrpcStages : public StageClients {
 public:
  GrpcStages(std::string job_id, std::vector<v1::WorkerInfo> workers, int stages)
      : job_id_(std::move(job_id)), workers_(std::move(workers)), stages_(stages) {
    for (const auto& w : workers_) {
      channels_.push_back(MakeChannel(w.address()));
      stubs_.push_back(v1::StageWorker::NewStub(channels_.back()));
    }
  }

  int stages() const override { return stages_; }
  int workers() const override { return static_cast<int>(workers_.size()); }
  std::string Label(int i) const override {
    const int replica = i / stages_;
    return absl::StrCat("stage ", i % stages_,
                        replica > 0 ? absl::StrCat(" of replica ", replica) : std::string(),
                        " (worker ", workers_[i].id(), " at ", workers_[i].address(), ")");
  }
  std::string Address(int i) const override { return workers_[i].address(); }

  grpc::Status Load(int i, const v1::StageAssignment& a, v1::LoadStageResponse* resp) override {
    auto ctx = ContextWithDeadline(60);
    return stubs_[i]->LoadStage(ctx.get(), a, resp);
  }
  grpc::Status Status(int i, int64_t committed_step, v1::StageStatusResponse* resp) override {
    v1::StageStatusRequest req;
    req.set_job_id(job_id_);
    req.set_committed_step(committed_step);
    auto ctx = ContextWithDeadline(3);
    return stubs_[i]->GetStageStatus(ctx.get(), req, resp);
  }
  grpc::Status Cut(int i, int64_t step, double seconds) override {
    v1::CutCheckpointRequest req;
    req.set_job_id(job_id_);
    req.set_step(step);
    v1::CutCheckpointResponse resp;
    auto ctx = ContextWithDeadline(seconds);
    return stubs_[i]->CutCheckpoint(ctx.get(), req, &resp);
  }
  grpc::Status Release(int i) override {
    v1::ReleaseStageRequest req;
    req.set_job_id(job_id_);
    v1::ReleaseStageResponse resp;
    auto ctx = ContextWithDeadline(3);
    return stubs_[i]->ReleaseStage(ctx.get(), req, &resp);
  }
  grpc::Status Profile(int i, const v1::ProfileRequest& req, v1::ProfileResponse* resp) override {
    auto ctx = ContextWithDeadline(300);
    return stubs_[i]->ProfileUnits(ctx.get(), req, resp);
  }
  std::shared_ptr<grpc::Channel> Channel(int i) override { return channels_[i]; }

 private:
  const std::string job_id_;
  const std::vector<v1::WorkerInfo> workers_;
  const int stages_;
  std::vector<std::shared_ptr<grpc::Channel>> channels_;
  std::vector<std::unique_ptr<v1::StageWorker::Stub>> stubs_;
};

}  // namespace

std::unique_ptr<StageClients> GrpcStageClients(std::string job_id,
                                               std::vector<v1::WorkerInfo> workers, int stages) {
  return std::make_unique<GrpcStages>(std::move(job_id), std::move(workers), stages);
}

absl::StatusOr<std::vector<std::vector<double>>> ProfileOnStages(
    StageClients& stages, const ModelPlan& plan, int64_t microbatch_size, int64_t seed,
    const std::atomic<bool>& cancel, const std::string& job_id) {
  v1::ProfileRequest req;
  *req.mutable_model() = plan.model;
  req.set_torchscript(plan.torchscript);
  for (int64_t dim : plan.input.shape) req.add_input_shape(dim);
  req.set_token_input(plan.input.tokens);
  req.set_vocab(plan.model.classes() > 0 ? plan.model.classes() : 256);
  req.set_microbatch_size(microbatch_size);
  req.set_repeats(3);
  req.set_seed(seed);
  std::vector<std::vector<double>> cost(stages.stages());
  for (int i = 0; i < stages.stages(); ++i) {
    if (cancel.load()) return absl::CancelledError("cancelled by the user");
    v1::ProfileResponse resp;
    grpc::Status st = stages.Profile(i, req, &resp);
    if (!st.ok()) {
      return absl::UnavailableError(
          absl::StrCat("profiling on ", stages.Label(i), " failed: ", st.error_message()));
    }
    if (resp.forward_seconds_size() != static_cast<int>(plan.units.size()) ||
        resp.backward_seconds_size() != resp.forward_seconds_size()) {
      return absl::InternalError(absl::StrCat(stages.Label(i), " profiled ",
                                              resp.forward_seconds_size(), " units of ",
                                              plan.units.size()));
    }
    for (int u = 0; u < resp.forward_seconds_size(); ++u) {
      cost[i].push_back(resp.forward_seconds(u) + resp.backward_seconds(u));
    }
    std::string ms;
    for (double c : cost[i]) absl::StrAppend(&ms, ms.empty() ? "" : " ", std::round(c * 1e5) / 100);
    LogInfo(ForJob(job_id), absl::StrCat("profiled ", plan.units.size(), " units on ",
                                         stages.Label(i), ": forward + backward ms [", ms, "]"));
  }
  return cost;
}

}  // namespace pipemare
