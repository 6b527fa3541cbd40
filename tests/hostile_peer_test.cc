// A peer is trusted with nothing (docs/security.md, "What a stage takes"):
// a real worker's stage, fed by the test as its upstream and answered by
// the test as its downstream stage, gets wrong-shape and wrong-dtype
// activations, duplicate and stale microbatch ids, gradients for
// microbatches it never sent, and NaN gradients under both
// train.on_nonfinite policies, and an optimizer step that throws (Adam's
// state does not fit the worker's address space). Each gets the documented
// status and message, every service stays up, and a job running alongside
// on the same cluster SUCCEEDS. A real job that diverges fails FAILED naming
// the stage, microbatch and step, and is not retried. Label: multiprocess.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/rpc.h"
#include "common/security.h"
#include "pipemare/v1/pipemare.grpc.pb.h"
#include "tests/cluster.h"

namespace pipemare::testing {
namespace {

using Stream = grpc::ServerReaderWriter<v1::StageMessage, v1::StageMessage>;

// Stands in for stage 1 in the test process: the real stage 0 opens its
// downstream stream here and the case's script answers it.
class FakeDownstream final : public v1::StageWorker::Service {
 public:
  using Script = std::function<void(Stream*)>;
  grpc::Status Pipe(grpc::ServerContext*, Stream* stream) override {
    v1::StageMessage open;
    if (!stream->Read(&open)) return grpc::Status(grpc::StatusCode::CANCELLED, "no open");
    Script script;
    {
      std::lock_guard<std::mutex> lock(mu_);
      script = script_;
    }
    if (script) script(stream);
    v1::StageMessage rest;
    while (stream->Read(&rest)) {
    }
    return grpc::Status::OK;
  }
  void set_script(Script s) {
    std::lock_guard<std::mutex> lock(mu_);
    script_ = std::move(s);
  }

 private:
  std::mutex mu_;
  Script script_;
};

v1::StageMessage FloatTensor(uint64_t id, bool gradient, std::vector<int64_t> shape, float value) {
  v1::StageMessage m;
  m.set_microbatch(id);
  m.set_phase(v1::TRAIN);
  v1::Tensor* t = gradient ? m.mutable_gradient() : m.mutable_activation();
  t->set_dtype(v1::FLOAT32);
  int64_t n = 1;
  for (int64_t d : shape) {
    t->add_shape(d);
    n *= d;
  }
  std::vector<float> values(static_cast<size_t>(n), value);
  t->set_data(std::string(reinterpret_cast<const char*>(values.data()), n * sizeof(float)));
  return m;
}

v1::StageStatusResponse StageStatus(v1::StageWorker::Stub& stub, const std::string& job_id) {
  v1::StageStatusRequest req;
  req.set_job_id(job_id);
  v1::StageStatusResponse resp;
  auto ctx = ContextWithDeadline(10);
  grpc::Status st = stub.GetStageStatus(ctx.get(), req, &resp);
  EXPECT_TRUE(st.ok()) << st.error_message();
  return resp;
}

// Polls until `done` holds for the stage's status (10 s at most).
v1::StageStatusResponse WaitForStage(
    v1::StageWorker::Stub& stub, const std::string& job_id,
    const std::function<bool(const v1::StageStatusResponse&)>& done) {
  v1::StageStatusResponse s;
  for (int i = 0; i < 100; ++i) {
    s = StageStatus(stub, job_id);
    if (done(s)) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return s;
}

// The test as the coordinator's input feed to stage 0 of `job_id`.
struct InputFeed : RawFeed {
  InputFeed(v1::StageWorker::Stub& stub, const std::string& job_id)
      : RawFeed(stub, job_id, v1::StreamOpen::INPUT_FEED) {
    EXPECT_TRUE(opened);
  }
};

bool WaitForJobState(Cluster& cluster, const std::string& id, v1::JobState state) {
  for (int i = 0; i < 600; ++i) {
    if (cluster.Status(id).state() == state) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return false;
}

TEST(HostilePeer, EveryBadMicrobatchEndsItsStageWithWhyAndAJobAlongsideSucceeds) {
  Cluster cluster(3);
  ASSERT_TRUE(cluster.ok());
  // The job alongside takes two workers; the hostile stages below go to the
  // third (a worker serves one job at a time).
  const std::string job = cluster.Submit(
      cluster.WriteSpec("alongside.yaml", ShortSpec("alongside", "pipemare", 2, 6400)));
  ASSERT_FALSE(job.empty());
  ASSERT_TRUE(WaitForJobState(cluster, job, v1::RUNNING));
  std::string idle;
  const v1::ListWorkersResponse workers = cluster.Workers();
  for (const auto& w : workers.workers()) {
    if (w.state() == v1::IDLE) idle = w.address();
  }
  ASSERT_FALSE(idle.empty());
  auto stub = v1::StageWorker::NewStub(MakeChannel(idle));
  auto release = [&](const std::string& job_id) {
    v1::ReleaseStageRequest req;
    req.set_job_id(job_id);
    v1::ReleaseStageResponse resp;
    auto ctx = ContextWithDeadline(10);
    grpc::Status st = stub->ReleaseStage(ctx.get(), req, &resp);
    EXPECT_TRUE(st.ok()) << st.error_message();
  };

  // Upstream: what stage 0 takes from its feed (the shape pass's [B, 4]).
  struct UpCase {
    std::string job;
    std::vector<v1::StageMessage> messages;
    std::string why;
  };
  v1::StageMessage tokens = FloatTensor(1, false, {2, 4}, 0);
  tokens.mutable_activation()->set_dtype(v1::INT64);
  tokens.mutable_activation()->set_data(std::string(64, '\0'));
  for (const UpCase& c :
       {UpCase{"wrong-shape",
               {FloatTensor(1, false, {2, 5}, 0)},
               "activation of microbatch 1 has shape [2, 5] but this stage takes [B, 4]"},
        UpCase{"wrong-dtype",
               {tokens},
               "activation of microbatch 1 is INT64 but this stage takes "
               "FLOAT32"},
        UpCase{"duplicate-id",
               {FloatTensor(3, false, {1, 4}, 0), FloatTensor(3, false, {1, 4}, 0)},
               "activation of microbatch 3 arrived after microbatch 3's: a duplicate or "
               "out-of-order id"},
        UpCase{"stale-id",
               {FloatTensor(5, false, {1, 4}, 0), FloatTensor(4, false, {1, 4}, 0)},
               "activation of microbatch 4 arrived after microbatch 5's"}}) {
    SCOPED_TRACE(c.job);
    grpc::Status loaded = LoadTinyMlpStage(*stub, c.job, 0, 1, "");
    ASSERT_TRUE(loaded.ok()) << loaded.error_message();
    InputFeed feed(*stub, c.job);
    for (const auto& m : c.messages) feed.stream->Write(m);
    feed.stream->WritesDone();
    grpc::Status st = feed.stream->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    EXPECT_TRUE(absl::StrContains(st.error_message(), c.why)) << st.error_message();
    EXPECT_TRUE(absl::StrContains(StageStatus(*stub, c.job).error(), c.why));
    release(c.job);
  }

  // Downstream: the test answers stage 0 of a two-stage job as its stage 1.
  FakeDownstream fake;
  int port = 0;
  auto server =
      StartServer("127.0.0.1:0", &fake, &port, "fake",
                  std::make_shared<AccessPolicy>(
                      std::map<std::string, unsigned>{{"/pipemare.v1.StageWorker/Pipe", kWorker}},
                      std::vector<TokenEntry>{}));
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string fake_address = absl::StrCat("127.0.0.1:", port);
  struct DownCase {
    std::string job;
    std::string on_nonfinite;
    std::vector<v1::StageMessage> gradients;  // sent once microbatch 1's activation arrived
    std::string why;                          // the stage's error; "" none
  };
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (const DownCase& c :
       {DownCase{"never-sent",
                 "fail",
                 {FloatTensor(7, true, {1, 3}, 0.1f)},
                 "gradient of microbatch 7, which this stage never sent downstream"},
        DownCase{"stale-gradient",
                 "fail",
                 {FloatTensor(1, true, {1, 3}, 0.1f), FloatTensor(1, true, {1, 3}, 0.1f)},
                 "stale gradient of microbatch 1: its gradient already arrived"},
        DownCase{"wrong-shape-gradient",
                 "fail",
                 {FloatTensor(1, true, {1, 5}, 0.1f)},
                 "gradient of microbatch 1 has shape [1, 5] but the activation sent was [1, 3]"},
        DownCase{"nan-fail",
                 "fail",
                 {FloatTensor(1, true, {1, 3}, nan)},
                 "NaN or Inf in the gradient of microbatch 1 from its downstream stage 1 at " +
                     fake_address + ", at step 0 (train.on_nonfinite: fail"},
        DownCase{"nan-skip", "skip", {FloatTensor(1, true, {1, 3}, nan)}, ""}}) {
    SCOPED_TRACE(c.job);
    std::vector<v1::StageMessage> heard;  // what stage 0 sent after the gradients
    std::mutex heard_mu;
    fake.set_script([&](Stream* s) {
      v1::StageMessage m;
      if (!s->Read(&m) || !m.has_activation() || m.microbatch() != 1) return;
      for (const auto& g : c.gradients) s->Write(g);
      while (s->Read(&m)) {
        std::lock_guard<std::mutex> lock(heard_mu);
        heard.push_back(m);
        if (m.has_activation()) s->Write(FloatTensor(m.microbatch(), true, {1, 3}, 0.1f));
      }
    });
    grpc::Status loaded = LoadTinyMlpStage(*stub, c.job, 0, 2, fake_address, c.on_nonfinite);
    ASSERT_TRUE(loaded.ok()) << loaded.error_message();
    InputFeed feed(*stub, c.job);
    feed.stream->Write(FloatTensor(1, false, {1, 4}, 0.5f));
    if (c.why.empty()) {
      // Skipped: the stage drops microbatch 1, steps on, and trains on 2
      // (stage 0 of two runs F1 F2 B1 U F3 B2 U ...).
      feed.stream->Write(FloatTensor(2, false, {1, 4}, 0.5f));
      auto s = WaitForStage(*stub, c.job, [](const auto& s) { return s.steps() >= 1; });
      EXPECT_EQ(s.steps(), 1) << s.DebugString();
      EXPECT_EQ(s.nonfinite_skipped(), 1);
      feed.stream->Write(FloatTensor(3, false, {1, 4}, 0.5f));
      s = WaitForStage(*stub, c.job, [](const auto& s) { return s.steps() >= 2; });
      EXPECT_EQ(s.steps(), 2) << s.DebugString();
      EXPECT_EQ(s.backwards(), 2);
      EXPECT_EQ(s.nonfinite_skipped(), 1);
      EXPECT_EQ(s.error(), "");
      v1::StageMessage done;
      ASSERT_TRUE(feed.stream->Read(&done));
      EXPECT_TRUE(done.has_done() && done.microbatch() == 1) << done.DebugString();
    } else {
      auto s = WaitForStage(*stub, c.job, [](const auto& s) { return !s.error().empty(); });
      EXPECT_TRUE(absl::StrContains(s.error(), c.why)) << s.error();
      // The feed hears the stage's error, with the code that tells the
      // coordinator whether recovery may retry it.
      v1::StageMessage m;
      bool got_error = false;
      while (feed.stream->Read(&m)) {
        if (m.has_error()) {
          got_error = true;
          EXPECT_TRUE(absl::StrContains(m.error().message(), c.why)) << m.error().message();
          EXPECT_EQ(m.error().code(), absl::StartsWith(c.job, "nan")
                                          ? static_cast<int>(grpc::StatusCode::FAILED_PRECONDITION)
                                          : static_cast<int>(grpc::StatusCode::UNAVAILABLE));
          break;
        }
      }
      EXPECT_TRUE(got_error);
    }
    feed.ctx.TryCancel();
    release(c.job);
  }
  (*server)->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));

  v1::JobStatus end = cluster.WaitForEnd(job, 300);
  EXPECT_EQ(end.state(), v1::SUCCEEDED) << end.reason();
  EXPECT_TRUE(cluster.coordinator().Running());
  for (int i = 0; i < cluster.worker_count(); ++i) EXPECT_TRUE(cluster.worker(i).Running());
}

TEST(HostilePeer, AJobThatDivergesFailsNamingStageMicrobatchAndStepAndIsNotRetried) {
  Cluster cluster(3);
  ASSERT_TRUE(cluster.ok());
  // lr 1e20: the first step's weights make the next activations overflow.
  const std::string spec =
      absl::StrReplaceAll(ShortSpec("diverges", "pipemare", 3, 3200), {{"lr: 0.05", "lr: 1e20"}});
  const std::string job = cluster.Submit(cluster.WriteSpec("diverges.yaml", spec));
  ASSERT_FALSE(job.empty());
  v1::JobStatus end = cluster.WaitForEnd(job, 120);
  EXPECT_EQ(end.state(), v1::FAILED);
  EXPECT_TRUE(absl::StrContains(end.reason(), "NaN or Inf in the ")) << end.reason();
  EXPECT_TRUE(absl::StrContains(end.reason(), " of microbatch ")) << end.reason();
  EXPECT_TRUE(absl::StrContains(end.reason(), ", at step ")) << end.reason();
  EXPECT_TRUE(absl::StrContains(end.reason(), "train.on_nonfinite: fail")) << end.reason();
  EXPECT_EQ(end.restarts_size(), 0) << "a NaN would come back: recovery does not retry it";
  std::cout << "reason: " << end.reason() << std::endl;
  EXPECT_EQ(cluster.CountWorkers(v1::IDLE), 3);
}

// VmSize of process `pid`, in bytes (0 if unknown).
int64_t VirtualSize(pid_t pid) {
  std::ifstream f(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(f, line)) {
    if (absl::StartsWith(line, "VmSize:")) return std::stoll(line.substr(7)) * 1024;
  }
  return 0;
}

TEST(HostilePeer, AnOptimizerStepThatThrowsFailsTheStageAndTheWorkerServesOn) {
  Cluster cluster(1);
  ASSERT_TRUE(cluster.ok());
  auto stub = v1::StageWorker::NewStub(MakeChannel(cluster.Workers().workers(0).address()));
  // A one-stage Adam job whose weights (1 GiB) and gradients fit the
  // worker's address space but whose Adam state, allocated lazily at the
  // first step, does not: the allocator throws inside the optimizer step.
  constexpr int64_t kWidth = 16384;
  constexpr int64_t kWeightBytes = kWidth * kWidth * 4;
  const pid_t pid = cluster.worker(0).pid();
  const int64_t base = VirtualSize(pid);
  ASSERT_GT(base, 0);
  rlimit limit{static_cast<rlim_t>(base + 2 * kWeightBytes + kWeightBytes * 3 / 4), RLIM_INFINITY};
  ASSERT_EQ(prlimit(pid, RLIMIT_AS, &limit, nullptr), 0) << std::strerror(errno);
  v1::StageAssignment a;
  a.set_job_id("adam-oom");
  a.set_num_stages(1);
  a.set_units(1);
  a.add_input_shape(kWidth);
  a.mutable_model()->set_type("mlp");
  a.mutable_model()->add_layers(kWidth);
  a.mutable_model()->add_layers(kWidth);
  a.mutable_optimizer()->set_type("adam");
  a.mutable_optimizer()->set_lr(0.001);
  a.mutable_schedule()->set_type("gpipe");
  a.mutable_schedule()->set_microbatches_per_step(1);
  a.set_steps_per_epoch(1);
  a.set_total_steps(1);
  {
    v1::LoadStageResponse resp;
    auto ctx = ContextWithDeadline(60);
    grpc::Status st = stub->LoadStage(ctx.get(), a, &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
  }
  // Its targets, then one microbatch: forward, backward, the step.
  RawFeed targets(*stub, "adam-oom", v1::StreamOpen::TARGET_FEED);
  ASSERT_TRUE(targets.opened);
  v1::StageMessage t;
  t.set_microbatch(1);
  t.set_phase(v1::TRAIN);
  t.mutable_targets()->set_dtype(v1::INT64);
  t.mutable_targets()->add_shape(1);
  t.mutable_targets()->set_data(std::string(8, '\0'));
  ASSERT_TRUE(targets.stream->Write(t));
  InputFeed feed(*stub, "adam-oom");
  feed.stream->Write(FloatTensor(1, false, {1, kWidth}, 0.01f));
  auto s = WaitForStage(*stub, "adam-oom", [](const auto& s) { return !s.error().empty(); });
  EXPECT_TRUE(absl::StrContains(s.error(), "optimizer step")) << s.error();
  EXPECT_TRUE(absl::StrContains(s.error(), "memory")) << s.error();
  std::cout << "stage error: " << s.error() << std::endl;
  EXPECT_EQ(s.steps(), 0);
  EXPECT_EQ(s.backwards(), 1) << "the forward and backward fit; the step did not";
  EXPECT_TRUE(cluster.worker(0).Running()) << "the exception stayed inside the stage";
  feed.ctx.TryCancel();
  targets.ctx.TryCancel();
  {
    v1::ReleaseStageRequest release;
    release.set_job_id("adam-oom");
    v1::ReleaseStageResponse released;
    auto ctx = ContextWithDeadline(10);
    EXPECT_TRUE(stub->ReleaseStage(ctx.get(), release, &released).ok());
  }
  // The worker serves on: a real job on it succeeds (the limit lifted, so
  // that only the case above is starved).
  limit.rlim_cur = RLIM_INFINITY;
  ASSERT_EQ(prlimit(pid, RLIMIT_AS, &limit, nullptr), 0) << std::strerror(errno);
  const std::string job =
      cluster.Submit(cluster.WriteSpec("after.yaml", ShortSpec("after", "pipemare", 1, 1600)));
  ASSERT_FALSE(job.empty());
  v1::JobStatus end = cluster.WaitForEnd(job, 300);
  EXPECT_EQ(end.state(), v1::SUCCEEDED) << end.reason();
}

}  // namespace
}  // namespace pipemare::testing
