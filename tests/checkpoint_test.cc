// Checkpoints and export through real processes: a job's cuts are committed
// with verified manifests, the trained model exports to a file that plain
// PyTorch (Debian's python3-torch) loads and scores at the job's own test
// accuracy, and a damaged newest checkpoint is detected and passed over.
// Label: multiprocess.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "tests/cluster.h"
#include "tests/process.h"

namespace pipemare::testing {
namespace {

namespace fs = std::filesystem;

// A 2-stage PipeMare MNIST job of `epochs` epochs cutting a checkpoint every
// `every` steps, into the cluster's directory, keeping 2. `extra`: more YAML.
std::string CheckpointedSpec(Cluster& cluster, const std::string& name, int64_t train_limit,
                             int epochs = 1, int every = 40, const std::string& extra = "") {
  return cluster.WriteSpec(
      name, absl::StrCat(ShortSpec(name, "pipemare", 2, train_limit, epochs),
                         "checkpoint: {every_steps: ", every, ", keep: 2, dir: ", cluster.dir(),
                         "/checkpoints}\n", extra));
}
// Recovery off: a lost worker fails the job, for `pipemarectl resume`.
constexpr char kNoRecovery[] = "recovery: {max_restarts: 0}\n";

std::vector<int64_t> StepDirs(const std::string& job_dir) {
  std::vector<int64_t> steps;
  for (const auto& e : fs::directory_iterator(job_dir)) {
    const std::string name = e.path().filename().string();
    int64_t k;
    if (name.rfind("step-", 0) == 0 && absl::SimpleAtoi(name.substr(5), &k)) steps.push_back(k);
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

TEST(Checkpoint, ExportLoadsInPlainPyTorchAtTheJobsAccuracy) {
  Cluster cluster(2);
  ASSERT_TRUE(cluster.ok());
  // 800 steps, a few seconds: the coordinator commits cuts as it sees every
  // stage has written one (it asks every 250 ms).
  const std::string spec = CheckpointedSpec(cluster, "ckpt-export", 12800, 2);
  auto submit = cluster.Ctl({"submit", spec, "--wait"}, 300);
  ASSERT_EQ(submit.exit_code, 0) << submit.out << submit.err << cluster.Logs();
  v1::JobStatus job = cluster.Status("job-1");
  ASSERT_EQ(job.state(), v1::SUCCEEDED);
  const int64_t total = job.progress().total_steps();
  ASSERT_EQ(total, 2 * 12800 / 32);
  // The cut after the last step is committed; the ones before it too
  // (every 40 steps), and only the newest `keep` remain on disk.
  EXPECT_EQ(job.checkpoint().step(), total);
  EXPECT_GE(job.checkpoint().committed(), 2) << cluster.Logs();
  const std::string job_dir = cluster.dir() + "/checkpoints/job-1";
  EXPECT_EQ(job.checkpoint().manifest(), absl::StrCat(job_dir, "/step-", total, "/manifest.json"));
  const std::vector<int64_t> kept = StepDirs(job_dir);
  ASSERT_EQ(kept.size(), 2u);
  EXPECT_EQ(kept.back(), total);
  EXPECT_EQ(kept.front() % 40, 0);

  const std::string out = cluster.dir() + "/model.pt";
  auto exported = cluster.Ctl({"export", "job-1", "--out", out});
  ASSERT_EQ(exported.exit_code, 0) << exported.err << cluster.Logs();
  EXPECT_TRUE(absl::StrContains(exported.err, absl::StrCat("at step ", total))) << exported.err;
  ASSERT_TRUE(fs::exists(out + ".json"));

  // Plain PyTorch: torch.load, load_state_dict(strict=True), the test split.
  EXPECT_GT(job.metrics().test_accuracy(), 0.85) << "a real model was trained";
  EXPECT_NEAR(PythonTestAccuracy(out), job.metrics().test_accuracy(), 0.001)
      << "the exported weights are the ones the job evaluated";
}

TEST(Checkpoint, ADamagedNewestCheckpointIsDetectedAndThePreviousOneUsed) {
  Cluster cluster(2);
  ASSERT_TRUE(cluster.ok());
  const std::string spec = CheckpointedSpec(cluster, "ckpt-damaged", 12800, 2);
  auto submit = cluster.Ctl({"submit", spec, "--wait"}, 300);
  ASSERT_EQ(submit.exit_code, 0) << submit.out << submit.err << cluster.Logs();
  const int64_t total = cluster.Status("job-1").progress().total_steps();
  const std::string job_dir = cluster.dir() + "/checkpoints/job-1";
  const std::vector<int64_t> kept = StepDirs(job_dir);
  ASSERT_EQ(kept.size(), 2u);
  // Truncate one unit file of the newest cut, as a crash mid-copy would
  // (written by the job's first run: generation 1).
  const std::string victim = absl::StrCat(job_dir, "/step-", total, "/unit-00001.g1.pt");
  ASSERT_TRUE(fs::exists(victim));
  fs::resize_file(victim, fs::file_size(victim) / 2);

  // Asked for by step: refused, naming the file.
  auto named = cluster.Ctl({"export", "job-1", "--out", cluster.dir() + "/bad.pt", "--checkpoint",
                            std::to_string(total)});
  EXPECT_NE(named.exit_code, 0);
  EXPECT_TRUE(absl::StrContains(named.err, "unit-00001.g1.pt")) << named.err;
  EXPECT_FALSE(fs::exists(cluster.dir() + "/bad.pt"));
  // The newest valid one: the previous cut, with the damage counted.
  const std::string out = cluster.dir() + "/model.pt";
  auto fallback = cluster.Ctl({"export", "job-1", "--out", out});
  ASSERT_EQ(fallback.exit_code, 0) << fallback.err << cluster.Logs();
  EXPECT_TRUE(absl::StrContains(fallback.err, absl::StrCat("at step ", kept.front())))
      << fallback.err;
  EXPECT_EQ(cluster.Status("job-1").checkpoint().skipped(), 1);
  EXPECT_TRUE(absl::StrContains(cluster.Logs(), "skipped a damaged checkpoint")) << cluster.Logs();
}

TEST(Checkpoint, AJobFailedByADeadWorkerResumesFromItsNewestCheckpoint) {
  Cluster cluster(2, {"--worker-timeout", "3"});
  ASSERT_TRUE(cluster.ok());
  // 2000 steps (a few seconds) so that the kill lands mid-job.
  const std::string id =
      cluster.Submit(CheckpointedSpec(cluster, "ckpt-resume", 12800, 5, 100, kNoRecovery));
  ASSERT_FALSE(id.empty());
  ASSERT_TRUE(WaitFor(120, [&] { return cluster.Status(id).checkpoint().step() >= 100; }))
      << cluster.Logs();
  cluster.worker(1).Signal(SIGKILL);
  v1::JobStatus failed = cluster.WaitForEnd(id, 60);
  ASSERT_EQ(failed.state(), v1::FAILED) << cluster.Logs();
  const int64_t cut = failed.checkpoint().step();
  ASSERT_GE(cut, 100);
  ASSERT_LT(cut, failed.progress().total_steps());

  cluster.AddWorker();  // a replacement
  auto resumed = cluster.Ctl({"resume", id, "--wait"}, 300);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.out << resumed.err << cluster.Logs();
  v1::JobStatus job = cluster.Status(id);
  EXPECT_EQ(job.state(), v1::SUCCEEDED);
  EXPECT_EQ(job.resumes(), 1);
  EXPECT_EQ(job.resumed_from_step(), cut);
  EXPECT_EQ(job.progress().step(), job.progress().total_steps());
  EXPECT_EQ(job.checkpoint().step(), job.progress().total_steps());
  ASSERT_EQ(job.epochs_size(), 5) << "every epoch's result, before and after the cut, once";
  for (int e = 0; e < 5; ++e) EXPECT_EQ(job.epochs(e).epoch(), e + 1);
  EXPECT_GE(job.metrics().test_accuracy(), 0.9) << "training went on from the cut";
  EXPECT_TRUE(
      absl::StrContains(cluster.Logs(), absl::StrCat("resuming from the checkpoint at step ", cut)))
      << cluster.Logs();
  // A job that SUCCEEDED is not resumed.
  auto again = cluster.Ctl({"resume", id});
  EXPECT_NE(again.exit_code, 0);
  EXPECT_TRUE(absl::StrContains(again.err, "only a FAILED or CANCELLED job")) << again.err;
}

TEST(Checkpoint, AKilledCoordinatorsRunningJobContinuesFromItsCheckpointAfterARestart) {
  const std::string state = MakeTempDir();
  Cluster cluster(2, {"--state-dir", state, "--worker-timeout", "3"});
  ASSERT_TRUE(cluster.ok());
  const std::string first = cluster.Submit(CheckpointedSpec(cluster, "ckpt-first", 3200, 1, 0));
  ASSERT_FALSE(first.empty());
  ASSERT_EQ(cluster.WaitForEnd(first, 120).state(), v1::SUCCEEDED) << cluster.Logs();
  const std::string id = cluster.Submit(CheckpointedSpec(cluster, "ckpt-coord", 12800, 5, 100));
  ASSERT_FALSE(id.empty());
  ASSERT_TRUE(WaitFor(120, [&] { return cluster.Status(id).checkpoint().step() >= 100; }))
      << cluster.Logs();
  auto ids_of = [&] {
    std::set<std::string> ids;
    const v1::ListWorkersResponse workers = cluster.Workers();
    for (const auto& w : workers.workers()) ids.insert(w.id());
    return ids;
  };
  const std::set<std::string> ids = ids_of();
  ASSERT_EQ(ids.size(), 2u);
  cluster.coordinator().Signal(SIGKILL);
  cluster.coordinator().Wait(10);
  cluster.StartCoordinator();
  ASSERT_FALSE(cluster.address().empty());
  // Every job submitted before the kill is still listed, with its state,
  // and every worker it knew, under the same id (LOST until it registers).
  EXPECT_EQ(cluster.Status(first).state(), v1::SUCCEEDED);
  EXPECT_EQ(ids_of(), ids);
  v1::JobStatus job = cluster.WaitForEnd(id, 300);
  EXPECT_EQ(job.state(), v1::SUCCEEDED) << cluster.Logs();
  EXPECT_EQ(job.resumes(), 1);
  EXPECT_GE(job.resumed_from_step(), 100);
  EXPECT_EQ(job.progress().step(), job.progress().total_steps());
  EXPECT_EQ(job.epochs_size(), 5);
  EXPECT_GE(job.metrics().test_accuracy(), 0.9);
  // The workers came back under their ids, reported the stages they served,
  // got them back and restored them from memory, not disk.
  EXPECT_EQ(ids_of(), ids);
  ASSERT_EQ(job.stages_size(), 2);
  for (const auto& stage : job.stages()) {
    EXPECT_TRUE(stage.restored_from_memory()) << "stage " << stage.index() << "\n"
                                              << cluster.Logs();
  }
}

TEST(Checkpoint, KillingWorkersWhileTheyWriteNeverLeavesABadLatest) {
  // A cut every 5 steps (~13 ms of training; a write takes about as long):
  // some stage is nearly always writing one. Kill a
  // worker at a random moment, 20 times; after each kill the newest
  // checkpoint must export (every file present and verified, one
  // generation), and the job resumes from it.
  Cluster cluster(2, {"--worker-timeout", "3"});
  ASSERT_TRUE(cluster.ok());
  const std::string id =
      cluster.Submit(CheckpointedSpec(cluster, "ckpt-kill", 12800, 100, 5, kNoRecovery));
  ASSERT_FALSE(id.empty());
  std::mt19937 rng(7);
  int64_t last_cut = 0;
  for (int round = 0; round < 20; ++round) {
    SCOPED_TRACE(::testing::Message() << "round " << round);
    ASSERT_TRUE(WaitFor(120, [&] {
      const v1::JobStatus s = cluster.Status(id);
      return s.state() == v1::RUNNING && s.checkpoint().step() > last_cut;
    })) << cluster.Logs();
    const int victim = cluster.WorkerForStage(cluster.Status(id), static_cast<int>(rng() % 2));
    ASSERT_GE(victim, 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 300));
    cluster.worker(victim).Signal(SIGKILL);
    const v1::JobStatus failed = cluster.WaitForEnd(id, 60);
    ASSERT_EQ(failed.state(), v1::FAILED) << cluster.Logs();
    last_cut = failed.checkpoint().step();
    const std::string out = absl::StrCat(cluster.dir(), "/model-", round, ".pt");
    auto exported =
        cluster.Ctl({"export", id, "--out", out, "--checkpoint", std::to_string(last_cut)});
    ASSERT_EQ(exported.exit_code, 0) << "the committed cut verifies: " << exported.err;
    // "latest" names the committed cut, whose manifest is of that cut.
    const std::string job_dir = cluster.dir() + "/checkpoints/" + id;
    EXPECT_EQ(ReadFile(job_dir + "/latest"), absl::StrCat("step-", last_cut, "\n"));
    cluster.AddWorker();  // the killed one's replacement
    auto resumed = cluster.Ctl({"resume", id});
    ASSERT_EQ(resumed.exit_code, 0) << resumed.err << cluster.Logs();
  }
  cluster.Ctl({"cancel", id});
}

TEST(Checkpoint, ANewSpecStartsFromAnotherJobsCheckpointOnAnotherNumberOfStages) {
  Cluster cluster(3);
  ASSERT_TRUE(cluster.ok());
  // One epoch on 2 stages...
  const std::string first = cluster.Submit(CheckpointedSpec(cluster, "from-a", 12800, 1, 100));
  ASSERT_FALSE(first.empty());
  const v1::JobStatus a = cluster.WaitForEnd(first, 300);
  ASSERT_EQ(a.state(), v1::SUCCEEDED) << cluster.Logs();
  const int64_t cut = a.progress().total_steps();
  // ...continued for a second epoch on 3 stages, from the first job's cut.
  const std::string spec = cluster.WriteSpec(
      "from-b", absl::StrCat(ShortSpec("from-b", "pipemare", 3, 12800, 2),
                             "checkpoint: {dir: ", cluster.dir(), "/checkpoints}\n"));
  auto submitted = cluster.Ctl({"submit", spec, "--from", first, "--wait"}, 300);
  ASSERT_EQ(submitted.exit_code, 0) << submitted.out << submitted.err << cluster.Logs();
  const v1::JobStatus b = cluster.Status("job-2");
  EXPECT_EQ(b.state(), v1::SUCCEEDED);
  EXPECT_EQ(b.stages_size(), 3);
  EXPECT_EQ(b.resumed_from_step(), cut);
  EXPECT_EQ(b.from_checkpoint(), a.checkpoint().manifest());
  EXPECT_EQ(b.progress().step(), 2 * cut);
  ASSERT_EQ(b.epochs_size(), 1) << "only the second epoch was trained";
  EXPECT_EQ(b.epochs(0).epoch(), 2);
  EXPECT_GE(b.metrics().test_accuracy(), a.metrics().test_accuracy() - 0.01)
      << "it went on from the trained weights, not from scratch";
  // A step directory works as well; what is not a checkpoint, or one of
  // another model, is refused naming the field.
  const std::string step_dir = fs::path(a.checkpoint().manifest()).parent_path().string();
  auto by_path = cluster.Ctl({"submit", spec, "--from", step_dir});
  EXPECT_EQ(by_path.exit_code, 0) << by_path.err;
  auto nothing = cluster.Ctl({"submit", spec, "--from", "job-99"});
  EXPECT_NE(nothing.exit_code, 0);
  EXPECT_TRUE(absl::StrContains(nothing.err, "from_checkpoint")) << nothing.err;
  const std::string other = cluster.WriteSpec(
      "from-c",
      absl::StrReplaceAll(ShortSpec("from-c", "pipemare", 2, 12800, 2),
                          {{"layers: [784, 256, 128, 64, 10]", "layers: [784, 64, 10]"}}));
  auto mismatch = cluster.Ctl({"submit", other, "--from", first});
  EXPECT_NE(mismatch.exit_code, 0);
  EXPECT_TRUE(absl::StrContains(mismatch.err, "holds 4 units but this spec's model has 2"))
      << mismatch.err;
}

TEST(Checkpoint, AJobWithoutACheckpointCannotBeExported) {
  Cluster cluster(0);
  ASSERT_TRUE(cluster.ok());
  // Two stages and no workers: the job stays PENDING.
  const std::string spec = CheckpointedSpec(cluster, "ckpt-pending", 3200);
  const std::string id = cluster.Submit(spec);
  ASSERT_FALSE(id.empty());
  auto r = cluster.Ctl({"export", id, "--out", cluster.dir() + "/none.pt"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(absl::StrContains(r.err, "has no committed checkpoint")) << r.err;
  auto unknown = cluster.Ctl({"export", "job-99", "--out", cluster.dir() + "/none.pt"});
  EXPECT_NE(unknown.exit_code, 0);
}

TEST(Checkpoint, AStageThatCannotWriteItsCutFailsTheJobNamingTheDirectory) {
  Cluster cluster(2);
  ASSERT_TRUE(cluster.ok());
  // checkpoint.dir under a regular file: every stage's write fails.
  const std::string blocker = cluster.dir() + "/not-a-directory";
  FILE* f = fopen(blocker.c_str(), "w");
  ASSERT_NE(f, nullptr);
  fclose(f);
  const std::string spec = cluster.WriteSpec(
      "ckpt-unwritable",
      absl::StrCat(ShortSpec("ckpt-unwritable", "pipemare", 2, 6400),
                   "checkpoint: {every_steps: 20, dir: ", blocker, "/checkpoints}\n"));
  const std::string id = cluster.Submit(spec);
  ASSERT_FALSE(id.empty());
  const v1::JobStatus job = cluster.WaitForEnd(id, 120);
  EXPECT_EQ(job.state(), v1::FAILED) << cluster.Logs();
  EXPECT_TRUE(absl::StrContains(job.reason(), "could not write its checkpoint")) << job.reason();
  EXPECT_TRUE(absl::StrContains(job.reason(), "checkpoint.dir")) << job.reason();
  EXPECT_TRUE(absl::StrContains(job.reason(), blocker)) << job.reason();
  EXPECT_EQ(job.restarts_size(), 0) << "a write error is not a lost worker";
  // The workers are free again.
  EXPECT_TRUE(WaitFor(30, [&] { return cluster.CountWorkers(v1::IDLE) == 2; })) << cluster.Logs();
}

TEST(Checkpoint, ACheckpointDirTheCoordinatorDoesNotShareFailsTheJobNamingIt) {
  // The coordinator gets a mount namespace of its own with an empty tmpfs
  // over checkpoint.dir: the workers write their cuts, the coordinator finds
  // none of the files (a directory that is not one shared volume).
  if (geteuid() != 0 || std::system("unshare --mount true 2>/dev/null") != 0) {
    GTEST_SKIP() << "needs root to give the coordinator a mount namespace of its own";
  }
  Cluster cluster(2);
  ASSERT_TRUE(cluster.ok());
  const std::string dir = cluster.dir() + "/not-shared";
  cluster.set_coordinator_wrapper(
      {"/usr/bin/unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c",
       absl::StrCat("mkdir -p ", dir, " && mount -t tmpfs tmpfs ", dir, " && exec \"$@\""), "sh"});
  cluster.coordinator().Signal(SIGKILL);
  cluster.coordinator().Wait(10);
  cluster.StartCoordinator();
  ASSERT_FALSE(cluster.address().empty()) << cluster.Logs();
  ASSERT_TRUE(WaitFor(30, [&] { return cluster.CountWorkers(v1::IDLE) == 2; })) << cluster.Logs();
  const std::string spec = cluster.WriteSpec(
      "ckpt-not-shared", absl::StrCat(ShortSpec("ckpt-not-shared", "pipemare", 2, 6400),
                                      "checkpoint: {every_steps: 10, dir: ", dir, "}\n"));
  const std::string id = cluster.Submit(spec);
  ASSERT_FALSE(id.empty());
  const v1::JobStatus job = cluster.WaitForEnd(id, 120);
  EXPECT_EQ(job.state(), v1::FAILED) << cluster.Logs();
  // 3 or more: the committer and the runner's last poll may both count one.
  EXPECT_TRUE(absl::StrContains(job.reason(), "cuts in a row that every stage reported written"))
      << job.reason();
  EXPECT_TRUE(absl::StrContains(job.reason(), absl::StrCat("checkpoint.dir (", dir)))
      << job.reason();
  EXPECT_TRUE(absl::StrContains(job.reason(), "shared volume")) << job.reason();
  EXPECT_EQ(job.restarts_size(), 0) << "recovering cannot fix a directory";
}

}  // namespace
}  // namespace pipemare::testing
