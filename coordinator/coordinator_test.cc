// The coordinator's managers, called directly (no sockets): the worker
// registry's identities and the job store's lifecycle and restart rules.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>

#include "coordinator/job_store.h"
#include "coordinator/worker_registry.h"
#include "google/protobuf/util/json_util.h"

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

}  // namespace
}  // namespace pipemare
