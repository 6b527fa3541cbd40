// Failures: killing a worker or the coordinator mid-job never leaves a
// process blocked. With recovery off, a lost worker ends the job FAILED with
// a reason and the remaining workers return to idle; a killed coordinator's
// running job runs again under the next one (recovery itself:
// tests/recovery_test.cc). Label: multiprocess.
#include <gtest/gtest.h>
#include <signal.h>

#include "absl/strings/match.h"
#include "tests/cluster.h"

namespace pipemare::testing {
namespace {

TEST(Failure, WithRecoveryOffAKilledWorkerFailsTheJobAndOthersReturnToIdle) {
  Cluster cluster(3, {"--worker-timeout", "3"});
  ASSERT_TRUE(cluster.ok());
  const std::string spec = cluster.WriteSpec(
      "long", ShortSpec("victim", "pipemare", 3, 60000, 5) + "recovery: {max_restarts: 0}\n");
  const std::string id = cluster.Submit(spec);
  ASSERT_FALSE(id.empty());
  v1::JobStatus job;
  ASSERT_TRUE(WaitFor(60, [&] {
    job = cluster.Status(id);
    return job.progress().step() > 20;
  }));
  const int victim = cluster.WorkerForStage(job, 1);
  ASSERT_GE(victim, 0);
  cluster.worker(victim).Signal(SIGKILL);

  v1::JobStatus end = cluster.WaitForEnd(id, 30);
  EXPECT_EQ(end.state(), v1::FAILED) << cluster.Logs();
  EXPECT_TRUE(absl::StrContains(end.reason(), "stage")) << end.reason();
  EXPECT_TRUE(absl::StrContains(end.reason(), "recovery.max_restarts is 0")) << end.reason();
  EXPECT_EQ(end.restarts_size(), 0);
  EXPECT_TRUE(WaitFor(15, [&] {
    return cluster.CountWorkers(v1::IDLE) == 2 && cluster.CountWorkers(v1::LOST) == 1;
  })) << cluster.Logs();
  EXPECT_TRUE(cluster.coordinator().Running());
  // The coordinator's metrics show the loss.
  const std::string metrics = HttpGet("http://" + cluster.metrics_address() + "/metrics");
  // LOST by whichever comes first: missed heartbeats, or the refused
  // connection when the coordinator released its stage.
  EXPECT_TRUE(absl::StrContains(metrics, "pipemare_worker_heartbeat_misses_total 1\n") !=
              absl::StrContains(metrics, "pipemare_worker_unreachable_total 1\n"))
      << metrics;
  EXPECT_TRUE(absl::StrContains(metrics, "pipemare_workers{state=\"LOST\"} 1\n")) << metrics;
  EXPECT_TRUE(absl::StrContains(metrics, "pipemare_jobs{state=\"FAILED\"} 1\n")) << metrics;
  // Nobody is stuck: every survivor stops promptly when asked.
  for (int i = 0; i < cluster.worker_count(); ++i) {
    if (i == victim) continue;
    cluster.worker(i).Signal(SIGTERM);
    EXPECT_GE(cluster.worker(i).Wait(10), 0) << "worker " << i << " did not exit";
  }
  cluster.coordinator().Signal(SIGTERM);
  EXPECT_GE(cluster.coordinator().Wait(10), 0) << "coordinator did not exit";
}

TEST(Failure, AKilledCoordinatorsJobWithoutACheckpointRunsAgainFromItsFirstStep) {
  const std::string state = MakeTempDir();
  Cluster cluster(2, {"--state-dir", state, "--worker-timeout", "3"});
  ASSERT_TRUE(cluster.ok());
  const std::string spec = cluster.WriteSpec("long", ShortSpec("orphan", "pipemare", 2, 60000, 5));
  const std::string id = cluster.Submit(spec);
  ASSERT_FALSE(id.empty());
  ASSERT_TRUE(WaitFor(60, [&] { return cluster.Status(id).progress().step() > 20; }));
  cluster.coordinator().Signal(SIGKILL);
  cluster.coordinator().Wait(10);

  // Workers notice (broken feeds, failing heartbeats), drop the stage and
  // keep running, waiting for a coordinator.
  for (int i = 0; i < 2; ++i) {
    EXPECT_TRUE(WaitFor(20, [&] {
      return absl::StrContains(cluster.worker(i).Log(), "dropping stage") ||
             absl::StrContains(cluster.worker(i).Log(), "released stage");
    })) << cluster.worker(i).Log();
    EXPECT_TRUE(cluster.worker(i).Running());
  }
  cluster.StartCoordinator();
  ASSERT_FALSE(cluster.address().empty());
  v1::JobStatus job = cluster.Status(id);
  EXPECT_TRUE(job.state() == v1::PENDING || job.state() == v1::RUNNING)
      << v1::JobState_Name(job.state());
  EXPECT_EQ(job.resumes(), 1);
  // Its workers came back by themselves and run it again, from step 0.
  ASSERT_TRUE(WaitFor(30, [&] {
    job = cluster.Status(id);
    return job.state() == v1::RUNNING && job.progress().step() > 0;
  })) << cluster.Logs();
  EXPECT_EQ(job.resumed_from_step(), 0);
  ASSERT_EQ(cluster.Ctl({"cancel", id}).exit_code, 0);
  EXPECT_EQ(cluster.WaitForEnd(id, 30).state(), v1::CANCELLED);
  EXPECT_TRUE(WaitFor(20, [&] { return cluster.CountWorkers(v1::IDLE) == 2; })) << cluster.Logs();
  // And the cluster works again.
  const std::string again =
      cluster.Submit(cluster.WriteSpec("again", ShortSpec("again", "pipemare", 2, 3200)));
  ASSERT_FALSE(again.empty());
  EXPECT_EQ(cluster.WaitForEnd(again, 120).state(), v1::SUCCEEDED) << cluster.Logs();
}

}  // namespace
}  // namespace pipemare::testing
