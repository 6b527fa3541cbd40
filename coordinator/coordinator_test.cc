// The job manager's state machine around a scripted run (recovery, shrink,
// bounds, cancel, queueing) and the run's result arithmetic, called directly
// (no sockets). The shared state they stand on (registry, store, committer)
// is tested in state_test.cc.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "coordinator/cut_committer.h"
#include "coordinator/job_manager.h"
#include "coordinator/job_store.h"
#include "coordinator/run_results.h"
#include "coordinator/worker_registry.h"
#include "google/protobuf/util/json_util.h"
#include "pipeline/core/checkpoint.h"

namespace pipemare {
namespace {

using ::testing::HasSubstr;

// ---------------------------------------------------------------------------
// The job manager's state machine. Each test scripts what one run of the
// job does (JobManager::RunOnce: lose a stage, fail, wait for cancel,
// succeed) and watches the job move through the store.

// What each run of a job was given.
struct RunGiven {
  std::vector<v1::WorkerInfo> workers;
  v1::JobSpec spec;
  int64_t generation = 0;
};

class ScriptedRuns {
 public:
  // `script(n, workers, cancel, context)`: what run n (from 0) does.
  using Script = std::function<absl::Status(int, const std::vector<v1::WorkerInfo>&,
                                            const std::atomic<bool>&, RunContext*)>;
  explicit ScriptedRuns(Script script) : script_(std::move(script)) {}
  JobManager::RunOnce Fn() {
    return [this](const std::string&, const v1::JobSpec& spec,
                  const std::vector<v1::WorkerInfo>& workers, const std::atomic<bool>& cancel,
                  RunContext* context) {
      int n;
      {
        std::lock_guard<std::mutex> lock(mu_);
        n = static_cast<int>(runs_.size());
        runs_.push_back({workers, spec, context->generation});
      }
      return script_(n, workers, cancel, context);
    };
  }
  std::vector<RunGiven> runs() {
    std::lock_guard<std::mutex> lock(mu_);
    return runs_;
  }

 private:
  Script script_;
  std::mutex mu_;
  std::vector<RunGiven> runs_;
};

v1::JobSpec Spec(int stages, int max_restarts, double wait_seconds, bool shrink) {
  v1::JobSpec spec;
  spec.set_name("scripted");
  spec.mutable_schedule()->set_stages(stages);
  spec.mutable_recovery()->set_max_restarts(max_restarts);
  spec.mutable_recovery()->set_wait_seconds(wait_seconds);
  spec.mutable_recovery()->set_shrink(shrink);
  return spec;
}

// Registers `n` workers at 10.0.1.<first..>:7071.
void AddWorkers(WorkerRegistry& registry, int n, int first = 1) {
  for (int i = first; i < first + n; ++i) {
    v1::RegisterWorkerRequest r;
    r.set_address(absl::StrCat("10.0.1.", i, ":7071"));
    r.set_instance_id(absl::StrCat("instance-", i));
    ASSERT_TRUE(registry.Register(r).ok());
  }
}

// Waits (10 s at most) until job `id` is in `state`.
v1::JobStatus WaitForState(const JobStore& store, const std::string& id, v1::JobState state) {
  uint64_t version = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  v1::JobStatus job = *store.Get(id);
  while (job.state() != state && std::chrono::steady_clock::now() < deadline) {
    auto next = store.WaitForChange(id, &version, std::chrono::milliseconds(100));
    if (next.ok()) job = *next;
  }
  return job;
}

// A run that loses the worker of `stage`: the stream to it broke.
absl::Status LoseStage(WorkerRegistry& registry, int stage,
                       const std::vector<v1::WorkerInfo>& workers, RunContext* context) {
  context->lost_stages = {stage};
  registry.MarkUnreachable(workers[stage].id());
  return absl::UnavailableError(absl::StrCat("stage ", stage, ": the stream broke"));
}

// Run 0 loses the worker of `stage`; later runs succeed, or lose it again
// when `every_run`.
ScriptedRuns::Script LosesStage(WorkerRegistry& registry, int stage, bool every_run = false) {
  return [&registry, stage, every_run](int n, const std::vector<v1::WorkerInfo>& workers,
                                       const std::atomic<bool>&, RunContext* context) {
    return n == 0 || every_run ? LoseStage(registry, stage, workers, context) : absl::OkStatus();
  };
}

class JobManagerTest : public ::testing::Test {
 protected:
  JobStore store;
  WorkerRegistry registry{std::chrono::seconds(5)};
};

TEST_F(JobManagerTest, ALostStageGoesToASpareAndOnlyThatStageMoves) {
  AddWorkers(registry, 4);  // three stages and a spare
  ScriptedRuns runs(LosesStage(registry, 1));
  JobManager manager(&store, &registry, RunnerOptions(), runs.Fn());
  const std::string id = store.Create(Spec(3, 3, 5, false)).id();
  manager.Poke();
  const v1::JobStatus job = WaitForState(store, id, v1::SUCCEEDED);
  ASSERT_EQ(job.state(), v1::SUCCEEDED) << job.reason();
  const std::vector<RunGiven> r = runs.runs();
  ASSERT_EQ(r.size(), 2u);
  ASSERT_EQ(r[1].workers.size(), 3u);
  EXPECT_EQ(r[1].workers[0].id(), r[0].workers[0].id()) << "survivors keep their stages";
  EXPECT_EQ(r[1].workers[2].id(), r[0].workers[2].id());
  EXPECT_NE(r[1].workers[1].id(), r[0].workers[1].id()) << "the spare took stage 1";
  EXPECT_EQ(r[1].generation, r[0].generation + 1) << "a new generation fences the old run";
  ASSERT_EQ(job.restarts_size(), 1);
  EXPECT_EQ(job.restarts(0).stage(), 1);
  EXPECT_EQ(job.restarts(0).worker_id(), r[0].workers[1].id());
  EXPECT_EQ(job.restarts(0).stages(), 3);
  EXPECT_THAT(job.restarts(0).cause(), HasSubstr("the stream broke"));
  EXPECT_EQ(registry.IdleCount(), 3) << "every live worker is free again";
}

TEST_F(JobManagerTest, ARecoveringJobWaitsForAnIdleWorkerAndRunsOnWhenOneRegisters) {
  AddWorkers(registry, 3);  // no spare
  ScriptedRuns runs(LosesStage(registry, 2));
  JobManager manager(&store, &registry, RunnerOptions(), runs.Fn());
  const std::string id = store.Create(Spec(3, 3, 30, false)).id();
  manager.Poke();
  const v1::JobStatus recovering = WaitForState(store, id, v1::RECOVERING);
  ASSERT_EQ(recovering.state(), v1::RECOVERING);
  EXPECT_THAT(recovering.reason(), HasSubstr("lost stage 2"));
  EXPECT_THAT(recovering.reason(), HasSubstr("restart 1 of 3"));
  AddWorkers(registry, 1, 9);  // a worker arrives
  const v1::JobStatus job = WaitForState(store, id, v1::SUCCEEDED);
  ASSERT_EQ(job.state(), v1::SUCCEEDED) << job.reason();
  const std::vector<RunGiven> r = runs.runs();
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[1].workers[2].address(), "10.0.1.9:7071");
}

TEST_F(JobManagerTest, WithNoSpareAShrinkingJobRunsOnItsSurvivorsWithFewerStages) {
  AddWorkers(registry, 3);
  ScriptedRuns runs(LosesStage(registry, 0));
  JobManager manager(&store, &registry, RunnerOptions(), runs.Fn());
  v1::JobSpec spec = Spec(3, 3, 0.3, true);
  spec.mutable_schedule()->set_partition("split");
  spec.mutable_schedule()->add_split(2);
  spec.mutable_schedule()->add_split(4);
  const std::string id = store.Create(spec).id();
  manager.Poke();
  const v1::JobStatus job = WaitForState(store, id, v1::SUCCEEDED);
  ASSERT_EQ(job.state(), v1::SUCCEEDED) << job.reason();
  const std::vector<RunGiven> r = runs.runs();
  ASSERT_EQ(r.size(), 2u);
  ASSERT_EQ(r[1].workers.size(), 2u);
  EXPECT_EQ(r[1].workers[0].id(), r[0].workers[1].id());
  EXPECT_EQ(r[1].workers[1].id(), r[0].workers[2].id());
  EXPECT_EQ(r[1].spec.schedule().stages(), 2);
  EXPECT_EQ(r[1].spec.schedule().partition(), "parameters") << "a 3-stage split cannot cut 2";
  EXPECT_EQ(r[1].spec.schedule().split_size(), 0);
  EXPECT_EQ(job.spec().schedule().stages(), 2) << "status shows the spec it runs";
  EXPECT_EQ(job.restarts(0).stages(), 2);
}

TEST_F(JobManagerTest, WithNoSpareAndNoShrinkTheJobFailsNamingBothFixes) {
  AddWorkers(registry, 2);
  ScriptedRuns runs(LosesStage(registry, 1, /*every_run=*/true));
  JobManager manager(&store, &registry, RunnerOptions(), runs.Fn());
  const std::string id = store.Create(Spec(2, 3, 0.3, false)).id();
  manager.Poke();
  const v1::JobStatus job = WaitForState(store, id, v1::FAILED);
  ASSERT_EQ(job.state(), v1::FAILED) << job.reason();
  EXPECT_THAT(job.reason(), HasSubstr("recovery.wait_seconds (0.3 s)"));
  EXPECT_THAT(job.reason(), HasSubstr("pipemarectl resume"));
  EXPECT_THAT(job.reason(), HasSubstr("recovery.shrink: true"));
  EXPECT_EQ(runs.runs().size(), 1u);
}

TEST_F(JobManagerTest, RestartsAreBoundedByMaxRestartsAndZeroTurnsRecoveryOff) {
  AddWorkers(registry, 8);
  ScriptedRuns runs(LosesStage(registry, 0, /*every_run=*/true));
  JobManager manager(&store, &registry, RunnerOptions(), runs.Fn());
  const std::string bounded = store.Create(Spec(1, 2, 5, false)).id();
  manager.Poke();
  const v1::JobStatus job = WaitForState(store, bounded, v1::FAILED);
  ASSERT_EQ(job.state(), v1::FAILED) << job.reason();
  EXPECT_EQ(job.restarts_size(), 2);
  EXPECT_THAT(job.reason(), HasSubstr("recovery.max_restarts = 2 used up"));
  EXPECT_EQ(runs.runs().size(), 3u);

  const std::string off = store.Create(Spec(1, 0, 5, false)).id();
  manager.Poke();
  const v1::JobStatus once = WaitForState(store, off, v1::FAILED);
  ASSERT_EQ(once.state(), v1::FAILED) << once.reason();
  EXPECT_THAT(once.reason(), HasSubstr("recovery is off"));
  EXPECT_EQ(once.restarts_size(), 0);
  EXPECT_EQ(runs.runs().size(), 4u);
}

TEST_F(JobManagerTest, AFailureRecoveryCannotHelpEndsTheJobAtOnce) {
  AddWorkers(registry, 3);
  ScriptedRuns runs(
      [&](int, const std::vector<v1::WorkerInfo>&, const std::atomic<bool>&, RunContext*) {
        return absl::FailedPreconditionError("the loss diverged at step 12");
      });
  JobManager manager(&store, &registry, RunnerOptions(), runs.Fn());
  const std::string id = store.Create(Spec(2, 3, 5, false)).id();
  manager.Poke();
  const v1::JobStatus job = WaitForState(store, id, v1::FAILED);
  ASSERT_EQ(job.state(), v1::FAILED);
  EXPECT_THAT(job.reason(), HasSubstr("diverged at step 12"));
  EXPECT_EQ(job.restarts_size(), 0);
  EXPECT_EQ(runs.runs().size(), 1u);
  EXPECT_EQ(registry.IdleCount(), 3);
}

TEST_F(JobManagerTest, JobsWaitOldestFirstAndCancelReachesPendingAndRunningJobs) {
  AddWorkers(registry, 2);
  ScriptedRuns runs([&](int, const std::vector<v1::WorkerInfo>&, const std::atomic<bool>& cancel,
                        RunContext* context) {
    // As a runner does: a cancel of a running job first asks for a drain
    // (a cut), and stops it at once only if that does not end it.
    auto stopped = [&] {
      return cancel.load() || (context->drain != nullptr && context->drain->requested());
    };
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!stopped() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return stopped() ? absl::CancelledError("cancelled by the user")
                     : absl::DeadlineExceededError("never cancelled");
  });
  JobManager manager(&store, &registry, RunnerOptions(), runs.Fn());
  const std::string big = store.Create(Spec(3, 3, 5, false)).id();
  const std::string small = store.Create(Spec(1, 3, 5, false)).id();
  manager.Poke();
  std::this_thread::sleep_for(std::chrono::milliseconds(700));  // a scheduler pass or two
  EXPECT_EQ(store.Get(small)->state(), v1::PENDING) << "a small job does not pass a big one";
  EXPECT_EQ(store.Get(big)->reason(), "waiting for 3 idle workers (2 idle now)");
  EXPECT_TRUE(runs.runs().empty());
  // Cancelled while pending: at once, and the next job in line runs.
  ASSERT_EQ(manager.Cancel(big)->state(), v1::CANCELLED);
  manager.Poke();
  ASSERT_EQ(WaitForState(store, small, v1::RUNNING).state(), v1::RUNNING);
  ASSERT_TRUE(manager.Cancel(small).ok());
  const v1::JobStatus job = WaitForState(store, small, v1::CANCELLED);
  EXPECT_EQ(job.state(), v1::CANCELLED) << job.reason();
  EXPECT_EQ(runs.runs().size(), 1u);
  EXPECT_EQ(manager.Cancel(small).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(registry.IdleCount(), 2);
}

bool WaitFor(double seconds, const std::function<bool()>& predicate) {
  const auto end = std::chrono::steady_clock::now() +
                   std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  while (!predicate()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

// A cancel asks a running job to drain to a cut first; a run that does not
// (it is between epochs, say) is stopped by a second cancel at once.
TEST_F(JobManagerTest, ACancelDrainsFirstAndASecondOneStopsTheRunAtOnce) {
  AddWorkers(registry, 1);
  std::atomic<bool> drain_seen{false};
  ScriptedRuns runs([&](int, const std::vector<v1::WorkerInfo>&, const std::atomic<bool>& cancel,
                        RunContext* context) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (!cancel.load() && std::chrono::steady_clock::now() < deadline) {
      if (context->drain != nullptr && context->drain->requested()) drain_seen = true;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return cancel.load() ? absl::CancelledError("cancelled by the user")
                         : absl::DeadlineExceededError("never cancelled");
  });
  JobManager manager(&store, &registry, RunnerOptions(), runs.Fn());
  const std::string id = store.Create(Spec(1, 3, 5, false)).id();
  manager.Poke();
  ASSERT_EQ(WaitForState(store, id, v1::RUNNING).state(), v1::RUNNING);
  ASSERT_TRUE(WaitFor(5, [&] { return !runs.runs().empty(); }));
  ASSERT_TRUE(manager.Cancel(id).ok());
  ASSERT_TRUE(WaitFor(5, [&] { return drain_seen.load(); })) << "the first cancel asks for a cut";
  EXPECT_EQ(store.Get(id)->state(), v1::RUNNING);
  ASSERT_TRUE(manager.Cancel(id).ok());
  EXPECT_EQ(WaitForState(store, id, v1::CANCELLED).state(), v1::CANCELLED);
}

TEST(RunResultsTest, TrainingLossIsPerWindowAndEpochAndEvaluationIsOverPredictions) {
  RunResults r;
  EXPECT_TRUE(std::isnan(r.TakeWindowLoss()));
  r.StartEpoch();
  v1::MicrobatchResult a, b;
  a.set_loss(1.0);
  a.set_count(4);
  b.set_loss(3.0);
  b.set_count(4);
  r.AddTraining(a);
  r.AddTraining(b);
  EXPECT_DOUBLE_EQ(r.TakeWindowLoss(), 2.0);
  EXPECT_DOUBLE_EQ(r.TakeWindowLoss(), 2.0);  // no results since: the last one stands
  EXPECT_EQ(r.samples_trained(), 8);
  EXPECT_DOUBLE_EQ(r.epoch_train_loss(), 2.0);
  // A language model's evaluation: losses weigh by tokens, not examples.
  r.StartEvaluation();
  v1::MicrobatchResult e1, e2;
  e1.set_loss(1.0);
  e1.set_count(1);
  e1.set_predictions(30);
  e1.set_correct(15);
  e2.set_loss(2.0);
  e2.set_count(1);
  e2.set_predictions(10);
  e2.set_correct(5);
  r.AddEvaluation(e1);
  r.AddEvaluation(e2);
  const RunResults::Evaluation eval = r.Evaluated(/*language_model=*/true);
  EXPECT_DOUBLE_EQ(eval.loss, 50.0 / 40);
  EXPECT_DOUBLE_EQ(eval.accuracy, 0.5);
  EXPECT_DOUBLE_EQ(eval.perplexity, std::exp(50.0 / 40));
  r.StartEpoch();
  EXPECT_EQ(r.epoch_train_loss(), 0);
}

}  // namespace
}  // namespace pipemare
