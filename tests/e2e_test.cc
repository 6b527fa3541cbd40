// Multi-process tests: a real coordinator and real workers on loopback,
// driven through the real pipemarectl client. Label: multiprocess.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "tests/cluster.h"
#include "tests/process.h"

namespace pipemare::testing {
namespace {

TEST(EndToEnd, PipeMareTrainsAndClientReportsIt) {
  Cluster cluster(4);
  ASSERT_TRUE(cluster.ok());
  const std::string spec = cluster.WriteSpec("train", ShortSpec("e2e-train", "pipemare", 4, 12800));
  auto submit = cluster.Ctl({"submit", spec, "--wait"}, 300);
  ASSERT_EQ(submit.exit_code, 0) << submit.out << submit.err << cluster.Logs();
  EXPECT_TRUE(absl::StrContains(submit.out, "SUCCEEDED")) << submit.out;

  auto list = cluster.Ctl({"list"});
  ASSERT_EQ(list.exit_code, 0) << list.err;
  EXPECT_TRUE(absl::StrContains(list.out, "e2e-train")) << list.out;
  EXPECT_TRUE(absl::StrContains(list.out, "SUCCEEDED")) << list.out;

  v1::JobStatus job = cluster.Status("job-1");
  EXPECT_EQ(job.id(), "job-1");
  EXPECT_EQ(job.name(), "e2e-train");
  EXPECT_EQ(job.state(), v1::SUCCEEDED);
  EXPECT_EQ(job.schedule(), "pipemare");
  ASSERT_EQ(job.stages_size(), 4);
  int units = 0;
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(job.stages(i).index(), i);
    EXPECT_FALSE(job.stages(i).worker_address().empty());
    EXPECT_EQ(job.stages(i).first_unit(), units);
    units += job.stages(i).units();
    // Asynchronous 1F1B with P = 4, N = 1: τ_i = 3 - i, measured as such.
    EXPECT_EQ(job.stages(i).analytic_delay(), 3 - i);
    EXPECT_NEAR(job.stages(i).measured_delay(), 3 - i, 0.05) << "stage " << i;
  }
  EXPECT_EQ(units, 4);
  EXPECT_EQ(job.progress().step(), job.progress().total_steps());
  EXPECT_EQ(job.progress().total_steps(), 12800 / 32);
  EXPECT_GE(job.metrics().test_accuracy(), 0.88) << "a real model learns MNIST";
  EXPECT_GT(job.metrics().samples_per_second(), 0);
  EXPECT_GT(job.metrics().train_loss(), 0);
  ASSERT_EQ(job.epochs_size(), 1);

  auto status_table = cluster.Ctl({"status", "job-1"});
  EXPECT_EQ(status_table.exit_code, 0);
  EXPECT_TRUE(absl::StrContains(status_table.out, "SUCCEEDED")) << status_table.out;

  auto workers = cluster.Ctl({"workers"});
  EXPECT_EQ(workers.exit_code, 0);
  EXPECT_TRUE(absl::StrContains(workers.out, "IDLE")) << workers.out;
  EXPECT_EQ(cluster.CountWorkers(v1::IDLE), 4) << "workers return to idle after the job";
  // A job that ends well fails no stage on the way out (the feeds close and
  // the stages are released one by one after the last step).
  const std::string logs = cluster.Logs();
  EXPECT_FALSE(absl::StrContains(logs, "stage failed")) << logs;
  EXPECT_TRUE(absl::StrContains(logs, "after the job's last step")) << logs;
}

TEST(EndToEnd, GPipeTrainsWithZeroDelay) {
  Cluster cluster(2);
  ASSERT_TRUE(cluster.ok());
  const std::string spec = cluster.WriteSpec("gpipe", ShortSpec("e2e-gpipe", "gpipe", 2, 12800));
  auto submit = cluster.Ctl({"submit", spec, "--wait"}, 300);
  ASSERT_EQ(submit.exit_code, 0) << submit.out << submit.err << cluster.Logs();
  v1::JobStatus job = cluster.Status("job-1");
  EXPECT_EQ(job.state(), v1::SUCCEEDED);
  ASSERT_EQ(job.stages_size(), 2);
  for (const auto& s : job.stages()) EXPECT_EQ(s.measured_delay(), 0) << "synchronous: τ = 0";
  EXPECT_GE(job.metrics().test_accuracy(), 0.85);
}

TEST(EndToEnd, PipeDreamAndAsyncTrainWithTheAnalyticDelay) {
  Cluster cluster(3);
  ASSERT_TRUE(cluster.ok());
  int n = 0;
  for (const std::string schedule : {"pipedream", "async"}) {
    const std::string id = absl::StrCat("job-", ++n);
    const std::string spec =
        cluster.WriteSpec(schedule, ShortSpec("e2e-" + schedule, schedule, 3, 12800));
    auto submit = cluster.Ctl({"submit", spec, "--wait"}, 300);
    ASSERT_EQ(submit.exit_code, 0) << submit.out << submit.err << cluster.Logs();
    v1::JobStatus job = cluster.Status(id);
    EXPECT_EQ(job.state(), v1::SUCCEEDED);
    EXPECT_EQ(job.schedule(), schedule);
    ASSERT_EQ(job.stages_size(), 3);
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(job.stages(i).analytic_delay(), 2 - i) << schedule;
      EXPECT_NEAR(job.stages(i).measured_delay(), 2 - i, 0.05) << schedule << " stage " << i;
      // Memory read off the tensors: weights and saved inputs everywhere; a
      // stash (one copy per version in flight, up to τ_i + 1) only under
      // pipedream, and not on the last stage (τ = 0).
      const auto& peak = job.stages(i).peak_memory();
      EXPECT_EQ(peak.weights(), job.stages(i).parameters() * 4) << schedule << " stage " << i;
      EXPECT_GT(peak.saved_activations(), 0) << schedule << " stage " << i;
      EXPECT_EQ(peak.t2_velocity(), 0) << schedule;
      if (schedule == "pipedream" && i < 2) {
        EXPECT_GE(peak.stash(), peak.weights()) << "stage " << i;
        EXPECT_LE(peak.stash(), (2 - i + 1) * peak.weights()) << "stage " << i;
      } else {
        EXPECT_EQ(peak.stash(), 0);
      }
    }
    // One short epoch at τ up to 2 without T1/T2: learning, not a tuned
    // result (84–86% depending on BLAS threads; chance is 10%).
    EXPECT_GE(job.metrics().test_accuracy(), 0.80) << schedule;
  }
}

// The schedules users compare against, on real workers: 1f1b and
// zero_bubble are gpipe's updates (τ = 0) in another order, zero_bubble's
// W's counted on every stage; pipedream_2bw runs every microbatch one
// version behind (τ = 1) with at most the live weights and one more version
// per stage, here keeping each forward's graph (no recompute).
TEST(EndToEnd, OneFOneBZeroBubbleAndPipeDream2BWTrainOnWorkers) {
  Cluster cluster(3);
  ASSERT_TRUE(cluster.ok());
  int n = 0;
  for (const std::string schedule : {"1f1b", "zero_bubble", "pipedream_2bw"}) {
    const std::string id = absl::StrCat("job-", ++n);
    std::string text = ShortSpec("e2e-" + schedule, schedule, 3, 12800);
    text.replace(text.find("microbatch_size: 32,"), 20,
                 "microbatch_size: 32, microbatches_per_step: 2,");
    const std::string spec = cluster.WriteSpec(schedule, text);
    auto submit = cluster.Ctl({"submit", spec, "--wait"}, 300);
    ASSERT_EQ(submit.exit_code, 0) << submit.out << submit.err << cluster.Logs();
    v1::JobStatus job = cluster.Status(id);
    EXPECT_EQ(job.state(), v1::SUCCEEDED) << schedule;
    EXPECT_EQ(job.schedule(), schedule);
    ASSERT_EQ(job.stages_size(), 3);
    for (int i = 0; i < 3; ++i) {
      const auto& stage = job.stages(i);
      if (schedule == "pipedream_2bw") {
        EXPECT_EQ(stage.analytic_delay(), 1) << "stage " << i;
        EXPECT_GT(stage.measured_delay(), 0.7) << "stage " << i << ": one version behind";
        EXPECT_LE(stage.peak_memory().stash(), 2 * stage.peak_memory().weights()) << i;
      } else {
        EXPECT_EQ(stage.measured_delay(), 0) << schedule << " stage " << i;
        EXPECT_EQ(stage.peak_memory().stash(), 0) << schedule;
      }
    }
    EXPECT_GE(job.metrics().test_accuracy(), 0.80) << schedule;
  }
  // zero_bubble's weight gradients ran as their own actions, one per
  // microbatch on each stage (12800 / 32 = 400), and only there.
  auto weights = [&](const std::string& job) {
    return ScrapeSum(cluster, "pipemare_stage_microbatches_total",
                     {"pass=\"weight\"", "job_id=\"" + job + "\""});
  };
  EXPECT_EQ(weights("job-2"), 3 * 400);
  EXPECT_EQ(weights("job-1"), 0);
}

TEST(EndToEnd, Bfloat16WireHalvesTheBytesBetweenStagesAndStillTrains) {
  Cluster cluster(3);
  ASSERT_TRUE(cluster.ok());
  const std::string base = ShortSpec("e2e-wire", "pipemare", 3, 6400);
  const std::string bf16 = absl::StrReplaceAll(
      base, {{"discrepancy_decay: 0.1}", "discrepancy_decay: 0.1, wire_dtype: bfloat16}"}});
  ASSERT_TRUE(absl::StrContains(bf16, "wire_dtype: bfloat16")) << bf16;
  for (const auto& [name, yaml] : {std::pair{"f32", base}, std::pair{"bf16", bf16}}) {
    auto submit = cluster.Ctl({"submit", cluster.WriteSpec(name, yaml), "--wait"}, 300);
    ASSERT_EQ(submit.exit_code, 0) << submit.out << submit.err << cluster.Logs();
  }
  const v1::JobStatus f32 = cluster.Status("job-1"), half = cluster.Status("job-2");
  EXPECT_EQ(half.state(), v1::SUCCEEDED);
  EXPECT_GE(half.metrics().test_accuracy(), 0.8) << "bfloat16 activations still train";
  for (const std::string kind : {"activation", "gradient"}) {
    for (int stage : {0, 1}) {
      const std::string direction =
          kind == "activation" ? absl::StrCat(stage) : absl::StrCat(stage + 1);
      const std::vector<std::string> labels = {absl::StrCat("kind=\"", kind, "\""),
                                               absl::StrCat("stage=\"", direction, "\"")};
      auto with = [&](const char* job) {
        auto l = labels;
        l.push_back(absl::StrCat("job_id=\"", job, "\""));
        return l;
      };
      const double full = ScrapeSum(cluster, "pipemare_stage_sent_bytes_total", with("job-1"));
      const double halved = ScrapeSum(cluster, "pipemare_stage_sent_bytes_total", with("job-2"));
      EXPECT_GT(full, 0) << kind << " from stage " << direction;
      EXPECT_DOUBLE_EQ(halved * 2, full) << kind << " from stage " << direction;
    }
  }
  EXPECT_NEAR(half.metrics().test_accuracy(), f32.metrics().test_accuracy(), 0.05);
}

TEST(EndToEnd, PipeMareWarmupSwitchesToAsynchronousAtTheConfiguredStep) {
  Cluster cluster(3);
  ASSERT_TRUE(cluster.ok());
  const std::string yaml = absl::StrReplaceAll(
      ShortSpec("e2e-warmup", "pipemare", 3, 12800),
      {{"discrepancy_decay: 0.1}", "discrepancy_decay: 0.1, warmup_steps: 100}"}});
  ASSERT_TRUE(absl::StrContains(yaml, "warmup_steps: 100")) << yaml;
  auto submit = cluster.Ctl({"submit", cluster.WriteSpec("warmup", yaml), "--wait"}, 300);
  ASSERT_EQ(submit.exit_code, 0) << submit.out << submit.err << cluster.Logs();
  v1::JobStatus job = cluster.Status("job-1");
  EXPECT_EQ(job.state(), v1::SUCCEEDED);
  ASSERT_EQ(job.stages_size(), 3);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(job.stages(i).async_from_step(), 100) << "stage " << i;
    // Counted from the switch: τ_i, not diluted by the warm-up's zeros.
    EXPECT_NEAR(job.stages(i).measured_delay(), 2 - i, 0.05) << "stage " << i;
  }
  EXPECT_GE(job.metrics().test_accuracy(), 0.85);
  EXPECT_TRUE(absl::StrContains(cluster.coordinator().Log(),
                                "synchronous warm-up done after 100 steps; switching to "
                                "asynchronous pipemare"))
      << cluster.coordinator().Log();
}

TEST(EndToEnd, PipeMareTrainsWithAdamWClippingAndAStepSchedule) {
  Cluster cluster(3);
  ASSERT_TRUE(cluster.ok());
  const std::string yaml = absl::StrReplaceAll(
      ShortSpec("e2e-adamw", "pipemare", 3, 12800),
      {{"optimizer: {type: sgd, lr: 0.05, momentum: 0.5}",
        "optimizer: {type: adamw, lr: 0.002, weight_decay: 0.01, grad_clip_norm: 1.0,\n"
        "            lr_schedule: step, lr_step_size: 200, lr_step_gamma: 0.5,\n"
        "            lr_warmup_steps: 20}"}});
  ASSERT_TRUE(absl::StrContains(yaml, "type: adamw")) << yaml;
  auto submit = cluster.Ctl({"submit", cluster.WriteSpec("adamw", yaml), "--wait"}, 300);
  ASSERT_EQ(submit.exit_code, 0) << submit.out << submit.err << cluster.Logs();
  v1::JobStatus job = cluster.Status("job-1");
  EXPECT_EQ(job.state(), v1::SUCCEEDED);
  EXPECT_GE(job.metrics().test_accuracy(), 0.85);
  ASSERT_EQ(job.stages_size(), 3);
  for (const auto& stage : job.stages()) {
    // Adam's two moments per parameter, read off the worker's tensors.
    EXPECT_EQ(stage.peak_memory().optimizer_state(), 2 * stage.peak_memory().weights());
    // The last step (k = 399) is past one decay: 0.002 · 0.5, times T1's
    // τ^-(1 - min(k/K, 1)) = 1 at k >= K = 100.
    EXPECT_NEAR(stage.learning_rate(), 0.001, 1e-12) << "stage " << stage.index();
  }
}

TEST(EndToEnd, PipeMareTrainsOnFashionMnistFromDebiansGzippedIdxFiles) {
  const std::string dir = FashionMnistDir();
  ASSERT_TRUE(std::filesystem::exists(dir + "/train-images-idx3-ubyte.gz"))
      << dir << " has no Fashion-MNIST: install Debian's dataset-fashion-mnist "
      << "(scripts/dev.sh deps does)";
  Cluster cluster(3);
  ASSERT_TRUE(cluster.ok());
  // ShortSpec's job, on Fashion-MNIST read as a generic idx dataset.
  const std::string yaml =
      absl::StrReplaceAll(ShortSpec("e2e-fashion", "pipemare", 3, 6400),
                          {{"type: mnist, path: " + MnistDir(), "type: idx, path: " + dir}});
  ASSERT_TRUE(absl::StrContains(yaml, "type: idx, path: " + dir)) << yaml;
  auto submit = cluster.Ctl({"submit", cluster.WriteSpec("fashion", yaml), "--wait"}, 300);
  ASSERT_EQ(submit.exit_code, 0) << submit.out << submit.err << cluster.Logs();
  v1::JobStatus job = cluster.Status("job-1");
  EXPECT_EQ(job.state(), v1::SUCCEEDED);
  EXPECT_EQ(job.progress().total_steps(), 6400 / 32);
  // Sizes and classes read from the files; the train split's own statistics.
  EXPECT_TRUE(absl::StrContains(cluster.coordinator().Log(),
                                "data: idx: 6400 train, 2000 test 1x28x28 images, 10 classes"))
      << cluster.coordinator().Log();
  EXPECT_GE(job.metrics().test_accuracy(), 0.6) << "a real model learns Fashion-MNIST";
  std::printf("Fashion-MNIST test accuracy: %.4f\n", job.metrics().test_accuracy());
}

TEST(EndToEnd, SimulatePrintsEachStagesPlanForAnExampleAndRefusesABadOne) {
  const std::string ctl = BinDir() + "/pipemarectl";
  const std::string examples = std::string(PIPEMARE_SOURCE_DIR) + "/examples/";
  auto ok =
      pipemare::testing::Run({ctl, "simulate", examples + "mnist_pipemare.yaml", "--steps", "20"});
  ASSERT_EQ(ok.exit_code, 0) << ok.err;
  EXPECT_TRUE(absl::StrContains(ok.out, "stage 3: 3F1 3B1 3U1 3F2")) << ok.out;
  EXPECT_TRUE(absl::StrContains(ok.out, "predicted mean utilization")) << ok.out;
  auto bad =
      pipemare::testing::Run({ctl, "simulate", examples + "mnist_pipemare.yaml", "--steps", "0"});
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_TRUE(absl::StrContains(bad.err, "--steps")) << bad.err;
}

TEST(EndToEnd, SecondJobWaitsInPendingThenRuns) {
  Cluster cluster(2);
  ASSERT_TRUE(cluster.ok());
  const std::string a = cluster.WriteSpec("a", ShortSpec("first", "pipemare", 2, 19200));
  const std::string b = cluster.WriteSpec("b", ShortSpec("second", "pipemare", 2, 3200));
  const std::string first = cluster.Submit(a);
  ASSERT_FALSE(first.empty());
  ASSERT_TRUE(WaitFor(30, [&] { return cluster.Status(first).state() == v1::RUNNING; }));
  const std::string second = cluster.Submit(b);
  ASSERT_FALSE(second.empty());
  v1::JobStatus pending = cluster.Status(second);
  EXPECT_EQ(pending.state(), v1::PENDING);
  EXPECT_TRUE(WaitFor(5, [&] {
    return absl::StrContains(cluster.Status(second).reason(), "waiting for 2 idle workers");
  })) << cluster.Status(second).reason();
  EXPECT_EQ(cluster.Status(first).state(), v1::RUNNING) << "the first job is still running";
  EXPECT_EQ(cluster.WaitForEnd(first, 300).state(), v1::SUCCEEDED) << cluster.Logs();
  EXPECT_EQ(cluster.WaitForEnd(second, 300).state(), v1::SUCCEEDED) << cluster.Logs();
}

TEST(EndToEnd, CancelStopsARunningJobAndFreesWorkers) {
  Cluster cluster(2);
  ASSERT_TRUE(cluster.ok());
  const std::string spec = cluster.WriteSpec("long", ShortSpec("long", "pipemare", 2, 60000, 5));
  const std::string id = cluster.Submit(spec);
  ASSERT_FALSE(id.empty());
  ASSERT_TRUE(WaitFor(30, [&] { return cluster.Status(id).progress().step() > 10; }));
  auto cancel = cluster.Ctl({"cancel", id});
  EXPECT_EQ(cancel.exit_code, 0) << cancel.err;
  EXPECT_EQ(cluster.WaitForEnd(id, 20).state(), v1::CANCELLED);
  EXPECT_TRUE(WaitFor(10, [&] { return cluster.CountWorkers(v1::IDLE) == 2; }));
  auto again = cluster.Ctl({"cancel", id});
  EXPECT_NE(again.exit_code, 0) << "cancelling an ended job is refused";
}

}  // namespace
}  // namespace pipemare::testing
