// The job runner in one process: real stage workers (WorkerService on
// in-process gRPC servers, plaintext), the real runner, job store and worker
// registry; no coordinator process, no client. A full job, a lost stage and a
// cancel, each in seconds. Label: unit.
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/rpc.h"
#include "coordinator/job_runner.h"
#include "coordinator/job_store.h"
#include "coordinator/worker_registry.h"
#include "pipeline/core/job_spec.h"
#include "stage_worker/stage_metrics.h"
#include "stage_worker/worker_service.h"
#include "tests/process.h"

namespace pipemare::testing {
namespace {

struct InProcessWorker {
  InProcessWorker() : metrics("cpu"), service(torch::kCPU, "", &metrics) {
    int port = 0;
    auto started = StartServer("127.0.0.1:0", &service, &port, "--listen", nullptr, false);
    EXPECT_TRUE(started.ok()) << started.status();
    if (!started.ok()) return;
    server = std::move(*started);
    address = absl::StrCat("127.0.0.1:", port);
    service.set_self_address(address);
  }
  ~InProcessWorker() { Stop(); }
  // As a dead worker: its stage goes and its server stops answering.
  void Stop() {
    service.ReleaseAll("the test stops this worker");
    if (server) server->Shutdown(std::chrono::system_clock::now());
    server.reset();
  }
  WorkerMetrics metrics;
  WorkerService service;
  std::unique_ptr<grpc::Server> server;
  std::string address;
};

class RunnerTest : public ::testing::Test {
 protected:
  RunnerTest() : registry_(std::chrono::milliseconds(3000)) {
    for (int i = 0; i < 3; ++i) {
      workers_.push_back(std::make_unique<InProcessWorker>());
      v1::RegisterWorkerRequest r;
      r.set_address(workers_.back()->address);
      r.set_device("cpu");
      r.set_instance_id(absl::StrCat("in-process-", i));
      auto id = registry_.Register(r);
      EXPECT_TRUE(id.ok()) << id.status();
      v1::WorkerInfo info;
      info.set_id(id.value_or(""));
      info.set_address(workers_.back()->address);
      infos_.push_back(info);
    }
  }

  // A validated MNIST spec of `examples` training examples on 3 stages.
  v1::JobSpec Spec(int64_t examples) {
    auto spec =
        ParseJobSpec(absl::StrCat(R"(name: in-process
model: {type: mlp, layers: [784, 128, 64, 10], activation: relu}
data: {type: mnist, path: )",
                                  MnistDir(), ", train_limit: ", examples, R"(, test_limit: 1000}
optimizer: {type: sgd, lr: 0.05, momentum: 0.5}
schedule: {type: pipemare, stages: 3, microbatch_size: 32, lr_anneal_steps: 100}
train: {epochs: 1, seed: 3}
)"));
    EXPECT_TRUE(spec.ok()) << spec.status();
    ApplyJobSpecDefaults(*spec);
    EXPECT_TRUE(ValidateJobSpec(*spec).ok());
    return *spec;
  }

  // Runs `spec` to its end; `during` (if set) runs beside it once the job
  // trained 20 steps.
  absl::Status Run(const v1::JobSpec& spec, const std::function<void()>& during = nullptr) {
    job_ = store_.Create(spec).id();
    RunnerOptions options;
    options.checkpoint_dir = MakeTempDir();
    options.stall_timeout_seconds = 30;
    JobRunner runner(job_, spec, infos_, &store_, &registry_, &cancel_, options, &context_);
    std::thread side;
    if (during) {
      side = std::thread([&] {
        if (WaitFor(60, [&] { return store_.Get(job_)->progress().step() >= 20; })) during();
      });
    }
    absl::Status st = runner.Run();
    if (side.joinable()) side.join();
    return st;
  }

  JobStore store_;
  WorkerRegistry registry_;
  std::vector<std::unique_ptr<InProcessWorker>> workers_;
  std::vector<v1::WorkerInfo> infos_;
  std::atomic<bool> cancel_{false};
  RunContext context_;
  std::string job_;
};

TEST_F(RunnerTest, AFullJobTrainsScoresAndCommitsItsFinalCut) {
  const v1::JobSpec spec = Spec(6400);
  ASSERT_TRUE(Run(spec).ok());
  const v1::JobStatus status = *store_.Get(job_);
  EXPECT_EQ(status.progress().step(), 200);
  ASSERT_EQ(status.epochs_size(), 1);
  EXPECT_GT(status.epochs(0).test_accuracy(), 0.8);
  EXPECT_EQ(status.checkpoint().step(), 200) << "the trained model is committed";
  EXPECT_EQ(status.stages_size(), 3);
  EXPECT_TRUE(context_.lost_stages.empty());
}

TEST_F(RunnerTest, ALostStageEndsTheRunUnavailableNamingItForRecovery) {
  absl::Status st = Run(Spec(25600), [&] { workers_[1]->Stop(); });
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "stage")) << st;
  // Released on the way out: the dead worker is marked for recovery.
  EXPECT_NE(std::find(context_.lost_stages.begin(), context_.lost_stages.end(), 1),
            context_.lost_stages.end());
  EXPECT_FALSE(workers_[0]->service.HasStage());
  EXPECT_FALSE(workers_[2]->service.HasStage());
}

TEST_F(RunnerTest, ACancelEndsTheRunCancelledAndReleasesEveryStage) {
  absl::Status st = Run(Spec(25600), [&] { cancel_ = true; });
  EXPECT_EQ(st.code(), absl::StatusCode::kCancelled) << st;
  for (const auto& w : workers_) EXPECT_FALSE(w->service.HasStage());
  EXPECT_LT(store_.Get(job_)->progress().step(), 800);
}

}  // namespace
}  // namespace pipemare::testing
