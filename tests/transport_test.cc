// schedule.transport through real processes: the same job over the default
// gRPC stream and over the Gloo data plane (every tensor, or only those of
// data_plane_min_bytes and more) trains to the same model; a worker
// killed mid-job on Gloo is recovered like one on gRPC, with no hang; workers
// that serve TLS refuse Gloo; payloads of 32 MiB (through the receive-buffer
// pool and, on gloo, the data plane) train alike on both. Label: multiprocess.
#include <gtest/gtest.h>
#include <signal.h>

#include <cmath>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "tests/cluster.h"
#include "tests/process.h"

namespace pipemare::testing {
namespace {

std::string WithTransport(const std::string& spec, const std::string& transport) {
  std::string out = absl::StrReplaceAll(
      spec, {{"schedule: {type:", absl::StrCat("schedule: {transport: ", transport, ", type:")}});
  EXPECT_TRUE(absl::StrContains(out, "transport: " + transport)) << out;
  return out;
}

// schedule.transport: gloo with every tensor over the Gloo pair, not only
// those of 2 MiB and more (data_plane_min_bytes unset).
constexpr char kEveryTensorOverGloo[] = "gloo, data_plane_min_bytes: 0";

// The payload bytes job `id`'s stages sent, and of those the ones that went
// over the data plane, from the workers' /metrics.
std::pair<double, double> SentBytes(Cluster& cluster, const std::string& id) {
  const std::vector<std::string> job = {absl::StrCat("job_id=\"", id, "\"")};
  return {ScrapeSum(cluster, "pipemare_stage_sent_bytes_total", job),
          ScrapeSum(cluster, "pipemare_stage_data_plane_sent_bytes_total", job)};
}

TEST(Transport, GlooAndGrpcTrainTheSameJobToTheSameModel) {
  Cluster cluster(3, {}, /*tls=*/false);
  ASSERT_TRUE(cluster.ok());
  // Same seed, same plan: only how the bytes travel differs. The MLP's
  // tensors are small (under 2 MiB): on plain gloo they ride the stream.
  const std::string base = ShortSpec("transport", "pipemare", 3, 6400);
  const char* transports[] = {"grpc", kEveryTensorOverGloo, "gloo"};
  v1::JobStatus jobs[3];
  std::pair<double, double> sent[3];
  for (int i = 0; i < 3; ++i) {
    auto submit = cluster.Ctl(
        {"submit", cluster.WriteSpec(absl::StrCat("spec", i), WithTransport(base, transports[i])),
         "--wait"},
        300);
    ASSERT_EQ(submit.exit_code, 0) << submit.out << submit.err << cluster.Logs();
    jobs[i] = cluster.Status(absl::StrCat("job-", i + 1));
    ASSERT_EQ(jobs[i].state(), v1::SUCCEEDED) << transports[i] << cluster.Logs();
    sent[i] = SentBytes(cluster, absl::StrCat("job-", i + 1));
  }
  const std::string logs = cluster.Logs();
  // In the job with data_plane_min_bytes 0, stage 1 connected both its
  // edges over Gloo, stages 0 and 2 one each; plain gloo connected none:
  // every tensor of this MLP is under 2 MiB, so no edge needs a pair.
  size_t connected = 0;
  for (size_t at = logs.find("data plane (gloo)"); at != std::string::npos;
       at = logs.find("data plane (gloo)", at + 1)) {
    ++connected;
  }
  EXPECT_EQ(connected, 4u) << logs;
  for (int i = 0; i < 3; ++i) {
    std::cout << transports[i] << ": test accuracy " << jobs[i].metrics().test_accuracy()
              << ", test loss " << jobs[i].metrics().test_loss() << ", sent " << sent[i].first
              << " bytes, " << sent[i].second << " of them over the data plane\n";
    EXPECT_GT(sent[i].first, 0) << transports[i];
  }
  EXPECT_EQ(sent[0].second, 0) << "grpc has no data plane";
  EXPECT_EQ(sent[1].second, sent[1].first) << "data_plane_min_bytes 0: every tensor over Gloo";
  EXPECT_EQ(sent[2].second, 0) << "tensors under 2 MiB ride the stream";
  EXPECT_GE(jobs[1].metrics().test_accuracy(), 0.8) << "a real model learns MNIST over Gloo";
  for (int i : {1, 2}) {
    EXPECT_NEAR(jobs[i].metrics().test_accuracy(), jobs[0].metrics().test_accuracy(), 0.002)
        << transports[i];
    EXPECT_NEAR(jobs[i].metrics().test_loss(), jobs[0].metrics().test_loss(),
                1e-3 * jobs[0].metrics().test_loss())
        << transports[i];
  }
}

TEST(Transport, PayloadsOf32MiBTrainTheSameModelOnBothTransports) {
  // 2048 examples x 4096 floats: every activation and gradient between the
  // two stages is 32 MiB, received into the workers' receive-buffer pool
  // (common/buffer_pool.h) by FromWire on grpc and by the Gloo receive.
  Cluster cluster(2, {}, /*tls=*/false);
  ASSERT_TRUE(cluster.ok());
  const std::string base = absl::StrCat(R"(name: large
model: {type: mlp, layers: [784, 4096, 10], activation: relu}
data: {type: mnist, path: )",
                                        MnistDir(), R"(, train_limit: 8192, test_limit: 2048}
optimizer: {type: sgd, lr: 0.1, momentum: 0.5}
schedule: {type: pipemare, stages: 2, microbatch_size: 2048}
train: {epochs: 2, seed: 3}
)");
  v1::JobStatus jobs[2];
  int i = 0;
  for (const char* transport : {"grpc", "gloo"}) {
    auto submit = cluster.Ctl(
        {"submit", cluster.WriteSpec(transport, WithTransport(base, transport)), "--wait"}, 300);
    ASSERT_EQ(submit.exit_code, 0) << submit.out << submit.err << cluster.Logs();
    jobs[i] = cluster.Status(absl::StrCat("job-", i + 1));
    ASSERT_EQ(jobs[i].state(), v1::SUCCEEDED) << transport << cluster.Logs();
    ++i;
  }
  std::cout << "test accuracy: grpc " << jobs[0].metrics().test_accuracy() << ", gloo "
            << jobs[1].metrics().test_accuracy() << "\n";
  const auto [sent, over_gloo] = SentBytes(cluster, "job-2");
  EXPECT_GE(sent, 16.0 * (32 << 20)) << "2 epochs x 4 steps, an activation and a gradient each";
  EXPECT_EQ(over_gloo, sent) << "tensors of 2 MiB and more go over Gloo";
  EXPECT_GE(jobs[0].metrics().test_accuracy(), 0.5) << "8 steps of 2048 examples learn";
  EXPECT_NEAR(jobs[1].metrics().test_accuracy(), jobs[0].metrics().test_accuracy(), 0.002);
  EXPECT_NEAR(jobs[1].metrics().test_loss(), jobs[0].metrics().test_loss(),
              1e-3 * jobs[0].metrics().test_loss());
}

TEST(Transport, AKilledWorkerOnGlooIsRecoveredWithoutAHang) {
  Cluster cluster(4, {"--worker-timeout", "3"}, /*tls=*/false);
  ASSERT_TRUE(cluster.ok());
  const std::string spec = cluster.WriteSpec(
      "gloo-recover",
      WithTransport(ShortSpec("gloo-recover", "pipemare", 3, 12800, 2), kEveryTensorOverGloo) +
          absl::StrCat("checkpoint: {every_steps: 100, keep: 2, dir: ", cluster.dir(),
                       "/checkpoints}\n"));
  const std::string id = cluster.Submit(spec);
  ASSERT_FALSE(id.empty());
  v1::JobStatus job;
  ASSERT_TRUE(WaitFor(120, [&] {
    job = cluster.Status(id);
    return job.checkpoint().step() >= 100;
  })) << cluster.Logs();
  const int victim = cluster.WorkerForStage(job, 1);
  ASSERT_GE(victim, 0);
  cluster.worker(victim).Signal(SIGKILL);
  const v1::JobStatus end = cluster.WaitForEnd(id, 300);
  ASSERT_EQ(end.state(), v1::SUCCEEDED) << cluster.Logs();
  ASSERT_EQ(end.restarts_size(), 1) << cluster.Logs();
  EXPECT_EQ(end.restarts(0).stage(), 1);
  EXPECT_EQ(end.progress().step(), end.progress().total_steps());
  EXPECT_GE(end.metrics().test_accuracy(), 0.85);
  std::cout << "gloo recovery: detected after " << end.restarts(0).cause() << "; first step "
            << end.restarts(0).recover_seconds() << " s after detection; test accuracy "
            << end.metrics().test_accuracy() << "\n";
  // Every survivor still stops promptly: no thread hangs in a Gloo wait.
  for (int w = 0; w < cluster.worker_count(); ++w) {
    if (w == victim) continue;
    cluster.worker(w).Signal(SIGTERM);
    EXPECT_GE(cluster.worker(w).Wait(30), 0) << "worker " << w << " did not exit";
  }
}

// Refused at submit (it could never run, so it must not use up restarts at
// run time); the workers refuse such a stage too, as a permanent error.
TEST(Transport, ATlsClusterRefusesGlooAtSubmitNamingTheFix) {
  Cluster cluster(2);  // mutual TLS
  ASSERT_TRUE(cluster.ok());
  auto submit = cluster.Ctl(
      {"submit",
       cluster.WriteSpec("tls-gloo",
                         WithTransport(ShortSpec("tls-gloo", "pipemare", 2, 640), "gloo"))});
  EXPECT_EQ(submit.exit_code, 2) << submit.out << submit.err;
  EXPECT_TRUE(absl::StrContains(submit.err, "schedule.transport")) << submit.err;
  EXPECT_TRUE(absl::StrContains(submit.err, "--insecure")) << submit.err;
  EXPECT_TRUE(absl::StrContains(submit.err, "transport: grpc")) << submit.err;
  EXPECT_EQ(cluster.Ctl({"list"}).out.find("job-"), std::string::npos) << "nothing was queued";
}

}  // namespace
}  // namespace pipemare::testing
