// The coordinator's managers, called directly (no sockets): the worker
// registry's identities, the job store's lifecycle and restart rules, and
// the job manager's state machine around a scripted run (recovery, shrink,
// bounds, cancel, queueing).
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
#include "pipeline/checkpoint.h"

namespace pipemare {
namespace {

using ::testing::HasSubstr;

v1::RegisterWorkerRequest Worker(const std::string& address, const std::string& instance) {
  v1::RegisterWorkerRequest r;
  r.set_address(address);
  r.set_instance_id(instance);
  return r;
}

TEST(WorkerRegistryTest, AWorkerRegisteringAgainKeepsItsId) {
  WorkerRegistry registry(std::chrono::seconds(5));
  auto a = registry.Register(Worker("10.0.0.2:7071", "aaaa"));
  auto b = registry.Register(Worker("10.0.0.3:7071", "bbbb"));
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(*a, *b);
  // Same instance, even from a new address (DHCP): same id, one entry.
  auto again = registry.Register(Worker("10.0.0.9:7071", "aaaa"));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *a);
  ASSERT_EQ(registry.List().size(), 2u);
  EXPECT_EQ(registry.List()[0].address(), "10.0.0.9:7071");
}

TEST(WorkerRegistryTest, AHeartbeatUnderAnIdGivenToAnotherInstanceIsNotFound) {
  // After a coordinator restart ids start again at w-1: a worker still
  // heartbeating as w-1 from before must register anew, not pass for the
  // new w-1.
  WorkerRegistry registry(std::chrono::seconds(5));
  auto id = registry.Register(Worker("10.0.0.2:7071", "new-one"));
  ASSERT_TRUE(id.ok());
  EXPECT_TRUE(registry.Heartbeat(*id, "new-one").ok());
  EXPECT_EQ(registry.Heartbeat(*id, "old-one").code(), absl::StatusCode::kNotFound);
}

TEST(WorkerRegistryTest, TwoLiveWorkersClaimingOneAddressAreRefusedNotEvicted) {
  WorkerRegistry registry(std::chrono::seconds(5));
  auto first = registry.Register(Worker("vm:7071", "aaaa"));
  ASSERT_TRUE(first.ok());
  for (int i = 0; i < 3; ++i) {  // no eviction loop: the first stays, each retry is refused
    auto second = registry.Register(Worker("vm:7071", "bbbb"));
    EXPECT_EQ(second.status().code(), absl::StatusCode::kAlreadyExists);
    EXPECT_THAT(std::string(second.status().message()), HasSubstr("vm:7071"));
    EXPECT_THAT(std::string(second.status().message()), HasSubstr("--advertise"));
  }
  ASSERT_EQ(registry.List().size(), 1u);
  EXPECT_EQ(registry.List()[0].id(), *first);
  EXPECT_TRUE(registry.Heartbeat(*first).ok());
}

TEST(WorkerRegistryTest, ARestartedWorkerTakesOverTheAddressOnceTheOldOneIsLost) {
  WorkerRegistry registry(std::chrono::seconds(5));
  auto old = registry.Register(Worker("10.0.0.2:7071", "aaaa"));
  ASSERT_TRUE(old.ok());
  EXPECT_FALSE(registry.Register(Worker("10.0.0.2:7071", "cccc")).ok());
  registry.MarkUnreachable(*old);  // it refused a connection: dead
  EXPECT_TRUE(registry.IsLost(*old));
  EXPECT_EQ(registry.Unreachable(), 1);
  auto fresh = registry.Register(Worker("10.0.0.2:7071", "cccc"));
  ASSERT_TRUE(fresh.ok());
  EXPECT_NE(*fresh, *old);
  ASSERT_EQ(registry.List().size(), 1u);
  EXPECT_EQ(registry.List()[0].state(), v1::IDLE);
}

TEST(WorkerRegistryTest, AnUnreachableWorkerGetsNoStage) {
  WorkerRegistry registry(std::chrono::seconds(5));
  auto a = registry.Register(Worker("10.0.0.2:7071", "aaaa"));
  auto b = registry.Register(Worker("10.0.0.3:7071", "bbbb"));
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE(registry.Acquire(2, "job-1").has_value());
  registry.MarkUnreachable(*b);
  registry.Release("job-1");
  EXPECT_EQ(registry.IdleCount(), 1);
  EXPECT_FALSE(registry.Acquire(2, "job-2").has_value());
  EXPECT_EQ(registry.Heartbeat(*b).code(), absl::StatusCode::kNotFound);
}

TEST(WorkerRegistryTest, ARestartedCoordinatorListsTheWorkersItKnewAndGivesThemTheirIds) {
  std::string dir = (std::filesystem::temp_directory_path() / "pipemare-workers-XXXXXX").string();
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  std::string a, b;
  {
    auto store = JobStore::Open(dir);
    ASSERT_TRUE(store.ok()) << store.status();
    WorkerRegistry registry(std::chrono::seconds(5));
    EXPECT_EQ(registry.PersistIn(store->get()), 0);
    a = *registry.Register(Worker("10.0.0.2:7071", "aaaa"));
    b = *registry.Register(Worker("10.0.0.3:7071", "bbbb"));
    // A restarted worker (new instance) at b's address replaces b once b
    // is lost: b's row goes, the new worker's comes.
    registry.MarkUnreachable(b);
    b = *registry.Register(Worker("10.0.0.3:7071", "cccc"));
  }  // the coordinator dies
  auto store = JobStore::Open(dir);
  ASSERT_TRUE(store.ok()) << store.status();
  WorkerRegistry registry(std::chrono::seconds(5));
  EXPECT_EQ(registry.PersistIn(store->get()), 2);
  auto listed = registry.List();
  ASSERT_EQ(listed.size(), 2u);
  for (const auto& w : listed) EXPECT_EQ(w.state(), v1::LOST) << w.id();
  EXPECT_EQ(listed[0].address(), "10.0.0.2:7071");
  EXPECT_EQ(registry.IdleCount(), 0) << "known, but none is acquired before it registers";
  // Each comes back under its id; a newcomer's id follows theirs.
  EXPECT_EQ(*registry.Register(Worker("10.0.0.3:7071", "cccc")), b);
  EXPECT_EQ(*registry.Register(Worker("10.0.0.2:7071", "aaaa")), a);
  const std::string fresh = *registry.Register(Worker("10.0.0.4:7071", "dddd"));
  EXPECT_NE(fresh, a);
  EXPECT_NE(fresh, b);
  EXPECT_EQ(registry.IdleCount(), 3);
  std::filesystem::remove_all(dir);
}

v1::RegisterWorkerRequest Serving(const std::string& address, const std::string& instance,
                                  const std::string& job, int stage) {
  v1::RegisterWorkerRequest r = Worker(address, instance);
  r.mutable_served()->set_job_id(job);
  r.mutable_served()->set_stage(stage);
  r.mutable_served()->add_cut_steps(100);
  return r;
}

TEST(WorkerRegistryTest, WorkersThatServedAJobGetTheirStagesBackSoTheyRestoreFromMemory) {
  WorkerRegistry registry(std::chrono::seconds(5));
  const std::string a = *registry.Register(Serving("10.0.0.1:7071", "a", "job-7", 2));
  const std::string b = *registry.Register(Worker("10.0.0.2:7071", "b"));
  const std::string c = *registry.Register(Serving("10.0.0.3:7071", "c", "job-7", 0));
  const std::string d = *registry.Register(Serving("10.0.0.4:7071", "d", "job-5", 1));
  EXPECT_EQ(registry.List()[0].served().job_id(), "job-7") << "listed: pipemarectl workers";
  auto workers = registry.Acquire(3, "job-7");
  ASSERT_TRUE(workers);
  ASSERT_EQ(workers->size(), 3u);
  EXPECT_EQ((*workers)[0].id(), c) << "stage 0 goes back to the worker that served it";
  EXPECT_EQ((*workers)[1].id(), b) << "the oldest other fills a stage no one holds";
  EXPECT_EQ((*workers)[2].id(), a);
  // A worker released by a job holds that job's stage in memory from then on.
  for (int i = 0; i < 3; ++i) registry.SetStage((*workers)[i].id(), i);
  registry.Release("job-7");
  for (const auto& w : registry.List()) {
    if (w.id() == b) EXPECT_EQ(w.served().stage(), 1);
    if (w.id() == b) EXPECT_EQ(w.served().job_id(), "job-7");
  }
  // While a worker runs another job it holds that one, not the last.
  {
    WorkerRegistry other(std::chrono::seconds(5));
    const std::string w = *other.Register(Serving("10.0.0.9:7071", "w", "job-12", 0));
    auto taken = other.Acquire(1, "job-13");
    ASSERT_TRUE(taken);
    EXPECT_EQ(other.List()[0].job_id(), "job-13");
    EXPECT_TRUE(other.List()[0].served().job_id().empty()) << other.List()[0].DebugString();
    EXPECT_EQ(w, (*taken)[0].id());
  }
  // Another job takes the oldest.
  auto other = registry.Acquire(1, "job-9");
  ASSERT_TRUE(other);
  EXPECT_EQ((*other)[0].id(), a);
  (void)d;
}

TEST(WorkerRegistryTest, AServedStageWithoutAStageIsRefusedNamingTheField) {
  WorkerRegistry registry(std::chrono::seconds(5));
  auto st = registry.Register(Serving("10.0.0.1:7071", "a", "job-7", -1));
  EXPECT_EQ(st.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.status().message()), HasSubstr("served"));
}

TEST(JobStoreTest, TheLifecycleTableAllowsResumeButNothingAfterSuccess) {
  JobStore store;
  v1::JobSpec spec;
  spec.set_name("j");
  const std::string id = store.Create(spec).id();
  EXPECT_FALSE(store.UpdateState(id, v1::SUCCEEDED, "").ok()) << "PENDING cannot succeed";
  ASSERT_TRUE(store.UpdateState(id, v1::RUNNING, "").ok());
  ASSERT_TRUE(store.UpdateState(id, v1::FAILED, "worker lost").ok());
  EXPECT_GT(store.Get(id)->finished_unix_ms(), 0);
  ASSERT_TRUE(store.UpdateState(id, v1::PENDING, "resuming").ok());
  EXPECT_EQ(store.Get(id)->finished_unix_ms(), 0);
  ASSERT_TRUE(store.UpdateState(id, v1::RUNNING, "").ok());
  // A lost worker: RECOVERING, then on (never back to PENDING).
  ASSERT_TRUE(store.UpdateState(id, v1::RECOVERING, "lost stage 1").ok());
  EXPECT_FALSE(store.UpdateState(id, v1::PENDING, "").ok());
  EXPECT_FALSE(store.UpdateState(id, v1::SUCCEEDED, "").ok()) << "only a run succeeds";
  ASSERT_TRUE(store.UpdateState(id, v1::RUNNING, "").ok());
  ASSERT_TRUE(store.UpdateState(id, v1::SUCCEEDED, "").ok());
  for (auto to : {v1::PENDING, v1::RUNNING, v1::RECOVERING, v1::FAILED, v1::CANCELLED}) {
    auto st = store.UpdateState(id, to, "");
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << v1::JobState_Name(to);
    EXPECT_THAT(std::string(st.message()), HasSubstr("already ended SUCCEEDED"));
  }
}

TEST(JobStoreTest, ARestartContinuesRunningJobsFromTheirCheckpointOrTheirFirstStep) {
  std::string dir = (std::filesystem::temp_directory_path() / "pipemare-store-XXXXXX").string();
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  std::string with, without, done;
  {
    auto opened = JobStore::Open(dir);
    ASSERT_TRUE(opened.ok()) << opened.status();
    JobStore& store = **opened;
    v1::JobSpec spec;
    spec.set_name("j");
    with = store.Create(spec).id();
    without = store.Create(spec).id();
    done = store.Create(spec).id();
    for (const auto& id : {with, without, done})
      ASSERT_TRUE(store.UpdateState(id, v1::RUNNING, "").ok());
    ASSERT_TRUE(store.UpdateState(done, v1::SUCCEEDED, "").ok());
    ASSERT_TRUE(store
                    .Update(with,
                            [](v1::JobStatus& s) {
                              s.mutable_checkpoint()->set_step(40);
                              s.mutable_checkpoint()->set_manifest(
                                  "/c/job-1/step-40/manifest.json");
                              s.mutable_progress()->set_step(57);
                            })
                    .ok());
  }  // the coordinator dies
  auto reopened = JobStore::Open(dir);
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  JobStore& restarted = **reopened;
  EXPECT_TRUE(std::filesystem::exists(dir + "/state.db"));
  auto a = restarted.Get(with);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->state(), v1::PENDING);
  EXPECT_EQ(a->resumes(), 1);
  EXPECT_EQ(a->progress().step(), 40) << "progress restarts at the cut";
  EXPECT_THAT(a->reason(), HasSubstr("continues from its newest checkpoint"));
  EXPECT_EQ(restarted.Get(without)->state(), v1::PENDING);
  EXPECT_THAT(restarted.Get(without)->reason(), HasSubstr("runs again from its first step"));
  EXPECT_EQ(restarted.Get(done)->state(), v1::SUCCEEDED);
  EXPECT_EQ(restarted.Pending(), (std::vector<std::string>{with, without}));
  EXPECT_EQ(restarted.Create(v1::JobSpec()).id(), "job-4") << "ids are never reused";
  std::filesystem::remove_all(dir);
}

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
    ASSERT_TRUE(
        registry.Register(Worker(absl::StrCat("10.0.1.", i, ":7071"), absl::StrCat("instance-", i)))
            .ok());
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

// The committer against two stages whose reports the test writes: it
// commits only a cut every stage of this run has written, newest first, and
// refuses what recovery cannot fix.
TEST(CutCommitterTest, CommitsTheNewestCutEveryStageOfThisRunWroteAndNamesTheDirWhenItCannot) {
  std::string dir = "/tmp/pipemare-committer-XXXXXX";
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  JobStore store;
  v1::JobSpec spec;
  spec.set_name("cuts");
  const std::string job = store.Create(spec).id();
  CutCommitter::Run run;
  run.job_id = job;
  run.generation = 2;
  run.dir = dir;
  run.keep = 3;
  run.steps_per_epoch = 10;
  run.microbatches_per_step = 2;
  run.microbatch_size = 4;
  run.ranges = {{0, 1}, {1, 1}};
  // What each stage reports: its newest cut, the cuts it holds, an error.
  std::mutex mu;
  v1::StageStatusResponse reports[2];
  int64_t told = -1;  // the committed step the stages last heard
  auto written = [&](int unit, int64_t step, int64_t generation) {
    const std::string step_dir = CheckpointStepDir(dir, job, step);
    std::filesystem::create_directories(step_dir);
    const std::string name = absl::StrCat("unit-", unit, ".pt"), bytes = absl::StrCat("u", unit);
    std::ofstream(step_dir + "/" + name) << bytes;
    v1::CheckpointWritten w;
    w.set_step(step);
    w.set_generation(generation);
    auto* f = w.add_files();
    f->set_unit(unit);
    f->set_path(name);
    f->set_bytes(static_cast<int64_t>(bytes.size()));
    f->set_sha256(Sha256Hex(bytes));
    return w;
  };
  CutCommitter committer(
      run,
      [&](int i, int64_t committed, v1::StageStatusResponse* resp) {
        std::lock_guard<std::mutex> lock(mu);
        told = committed;
        *resp = reports[i];
        return grpc::Status::OK;
      },
      [](int i) { return absl::StrCat("stage ", i); }, &store);
  *reports[0].mutable_checkpoint() = written(0, 5, 2);
  *reports[1].mutable_checkpoint() = written(1, 3, 2);
  ASSERT_TRUE(committer.Poll().ok());
  EXPECT_EQ(committer.committed_step(), 0);  // no cut both wrote yet
  // Stage 1 catches up; stage 0 moved on but still holds 5. A cut of
  // another run (generation 1) is never this run's to commit.
  *reports[0].mutable_checkpoint() = written(0, 7, 1);
  *reports[0].add_held() = written(0, 5, 2);
  *reports[1].mutable_checkpoint() = written(1, 5, 2);
  ASSERT_TRUE(committer.Poll().ok());
  EXPECT_EQ(committer.committed_step(), 5);
  EXPECT_EQ(told, 5);  // told at once, not at the next poll
  auto status = store.Get(job);
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(status->checkpoint().step(), 5);
  EXPECT_EQ(status->checkpoint().committed(), 1);
  EXPECT_TRUE(std::filesystem::exists(CheckpointStepDir(dir, job, 5) + "/manifest.json"));
  // Waiting for a cut no stage writes ends, naming the directory.
  std::atomic<bool> cancel{false};
  absl::Status late = committer.CommitAt(9, 0.2, "the final checkpoint", cancel);
  EXPECT_EQ(late.code(), absl::StatusCode::kDeadlineExceeded) << late;
  EXPECT_THAT(std::string(late.message()), ::testing::HasSubstr(dir));
  // A stage that cannot write: the operator's to fix, not recovery's.
  reports[1].mutable_checkpoint()->set_error("disk full");
  absl::Status refused = committer.Poll();
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_THAT(std::string(refused.message()),
              ::testing::AllOf(::testing::HasSubstr("stage 1"), ::testing::HasSubstr("disk full"),
                               ::testing::HasSubstr("checkpoint.dir")));
  std::filesystem::remove_all(dir);
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
