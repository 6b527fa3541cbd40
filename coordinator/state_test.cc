// The coordinator's shared state, without LibTorch and without sockets (label
// "unit"; the sanitizer builds run it too, the TSan build under many
// threads): the worker registry's identities and its one state mutator, the
// job store's lifecycle, named mutators and restart rules, the checkpoint
// committer, and all three hammered at once from many threads.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <set>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "coordinator/cut_committer.h"
#include "coordinator/job_store.h"
#include "coordinator/worker_registry.h"
#include "google/protobuf/util/json_util.h"
#include "pipeline/core/checkpoint.h"

namespace pipemare {
namespace {

using ::testing::HasSubstr;

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
    ASSERT_TRUE(
        store.UpdateProgress(with, [](v1::JobProgress& p, v1::JobMetrics&) { p.set_step(57); })
            .ok());
    ASSERT_TRUE(store.SetCheckpoint(with, 40, "/c/job-1/step-40/manifest.json", 1).ok());
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

// The store and the registry as the coordinator uses them at once: runners
// publishing progress and durable changes, watchers waiting for versions,
// clients listing, workers registering and heartbeating while the scheduler
// acquires, releases and marks them lost. Every watcher sees versions only
// grow and ends at the last one; the registry never hands one worker to two
// jobs; the store's record after reopening holds every durable change. Run
// under ThreadSanitizer in scripts/dev.sh tsan.
TEST(SharedStateTest, ManyThreadsOnTheStoreAndRegistryKeepEveryInvariant) {
  std::string dir = "/tmp/pipemare-state-XXXXXX";
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  constexpr int kJobs = 4, kUpdates = 200, kWorkers = 8;
  std::vector<std::string> ids;
  {
    auto opened = JobStore::Open(dir);
    ASSERT_TRUE(opened.ok()) << opened.status();
    JobStore& store = **opened;
    WorkerRegistry registry(std::chrono::milliseconds(50));
    registry.PersistIn(&store);
    v1::JobSpec spec;
    spec.set_name("busy");
    for (int j = 0; j < kJobs; ++j) {
      ids.push_back(store.Create(spec).id());
      ASSERT_TRUE(store.UpdateState(ids.back(), v1::RUNNING, "").ok());
    }
    std::atomic<bool> done{false};
    std::atomic<int> bad{0};
    std::vector<std::thread> threads;
    for (int j = 0; j < kJobs; ++j) {  // runners
      threads.emplace_back([&, id = ids[j]] {
        for (int k = 1; k <= kUpdates; ++k) {
          store.UpdateProgress(id, [&](v1::JobProgress& p, v1::JobMetrics&) { p.set_step(k); })
              .IgnoreError();
          if (k % 10 == 0) {
            v1::EpochResult e;
            e.set_epoch(k / 10);
            e.set_test_accuracy(0.5 + k / 1000.0);
            bad += !store.AddEpoch(id, e).ok();
            bad += !store.SetCheckpoint(id, k, absl::StrCat(dir, "/", id, "/", k), k / 10).ok();
          }
        }
      });
    }
    for (int j = 0; j < kJobs; ++j) {  // watchers
      threads.emplace_back([&, id = ids[j]] {
        uint64_t version = 0;
        int64_t step = -1;
        while (step < kUpdates) {
          const uint64_t before = version;
          auto s = store.WaitForChange(id, &version, std::chrono::milliseconds(2000));
          if (!s.ok() || version < before || s->progress().step() < step) {
            ++bad;
            return;
          }
          if (version == before) {  // 2 s without a change: the runner stopped early
            ++bad;
            return;
          }
          step = s->progress().step();
        }
      });
    }
    threads.emplace_back([&] {  // clients
      while (!done) {
        for (const auto& s : store.List()) bad += s.id().empty();
        store.WaitForAnyChange(0, std::chrono::milliseconds(1));
      }
    });
    for (int w = 0; w < kWorkers; ++w) {  // workers
      threads.emplace_back([&, w] {
        std::string id;
        while (!done) {
          if (id.empty() || !registry.Heartbeat(id, absl::StrCat("i-", w)).ok()) {
            auto r = registry.Register(
                Worker(absl::StrCat("10.0.0.", w, ":7071"), absl::StrCat("i-", w)));
            id = r.ok() ? *r : "";
          }
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
      });
    }
    threads.emplace_back([&] {  // the scheduler
      int round = 0;
      while (!done) {
        registry.MarkLost();
        const std::string job = absl::StrCat("job-", 100 + round % 3);
        if (auto got = registry.Acquire(2, job)) {
          std::set<std::string> distinct;
          for (const auto& w : *got) distinct.insert(w.id());
          bad += distinct.size() != 2;
          for (int i = 0; i < 2; ++i) registry.SetStage((*got)[i].id(), i);
          int busy = 0;
          for (const auto& w : registry.List()) busy += w.job_id() == job;
          bad += busy != 2;  // no other job holds them
          registry.Release(job);
        }
        ++round;
      }
    });
    for (int j = 0; j < 2 * kJobs; ++j) threads[j].join();
    done = true;
    for (size_t t = 2 * kJobs; t < threads.size(); ++t) threads[t].join();
    EXPECT_EQ(bad.load(), 0);
    EXPECT_EQ(registry.List().size(), static_cast<size_t>(kWorkers));
  }  // the coordinator stops
  auto reopened = JobStore::Open(dir);
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  for (const auto& id : ids) {
    auto s = (*reopened)->Get(id);
    ASSERT_TRUE(s.ok());
    EXPECT_EQ(s->epochs_size(), kUpdates / 10) << id;
    EXPECT_EQ(s->checkpoint().step(), kUpdates) << id;
    EXPECT_EQ(s->checkpoint().committed(), kUpdates / 10) << id;
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace pipemare
