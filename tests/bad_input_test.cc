// Bad job specs are refused at submit time with an error that names the
// field, by the client and by the coordinator itself (a raw RPC that skips
// the client's checks); the coordinator keeps serving. Label: multiprocess.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/rpc.h"
#include "pipemare/v1/pipemare.grpc.pb.h"
#include "tests/cluster.h"

namespace pipemare::testing {
namespace {

struct BadCase {
  const char* what;
  std::string spec;   // YAML
  const char* field;  // must appear in the error
};

std::vector<BadCase> Cases() {
  const std::string good = ShortSpec("bad", "pipemare", 2, 3200);
  return {
      {"missing field", absl::StrReplaceAll(good, {{"lr: 0.05, ", ""}}), "optimizer.lr"},
      {"ill-typed field", absl::StrReplaceAll(good, {{"stages: 2", "stages: two"}}),
       "schedule.stages"},
      {"unknown field", absl::StrReplaceAll(good, {{"stages: 2", "stagez: 2"}}), "schedule.stagez"},
      {"more stages than units", absl::StrReplaceAll(good, {{"stages: 2", "stages: 9"}}),
       "schedule.stages"},
      {"dataset path that does not exist",
       absl::StrReplaceAll(good, {{MnistDir(), "/nonexistent/mnist"}}), "data.path"},
      {"unknown schedule", absl::StrReplaceAll(good, {{"type: pipemare", "type: hogwild"}}),
       "schedule.type"},
  };
}

TEST(BadInput, ClientRefusesEachSpecNamingTheField) {
  Cluster cluster(0);
  ASSERT_FALSE(cluster.address().empty());
  int i = 0;
  for (const auto& c : Cases()) {
    const std::string path = cluster.WriteSpec("bad" + std::to_string(i++), c.spec);
    auto r = cluster.Ctl({"submit", path});
    EXPECT_NE(r.exit_code, 0) << c.what;
    EXPECT_TRUE(absl::StrContains(r.err, c.field)) << c.what << ": " << r.err;
  }
  auto list = cluster.Ctl({"list", "--output", "json"});
  EXPECT_EQ(list.exit_code, 0);
  EXPECT_FALSE(absl::StrContains(list.out, "\"id\"")) << "no job was created: " << list.out;
}

TEST(BadInput, CoordinatorRefusesEachSpecNamingTheFieldAndKeepsServing) {
  Cluster cluster(0);
  ASSERT_FALSE(cluster.address().empty());
  auto stub = v1::Coordinator::NewStub(MakeChannel(cluster.address()));
  for (const auto& c : Cases()) {
    // Build the proto the way the client would, minus its validation; the
    // ill-typed/unknown-field cases cannot be expressed as a proto, so those
    // are sent as the nearest wrong value (stages 0 / none).
    v1::SubmitJobRequest req;
    auto* s = req.mutable_spec();
    s->set_name("raw");
    s->mutable_model()->set_type("mlp");
    for (int w : {784, 256, 128, 64, 10}) s->mutable_model()->add_layers(w);
    s->mutable_data()->set_type("mnist");
    s->mutable_data()->set_path(absl::StrContains(c.spec, "/nonexistent") ? "/nonexistent/mnist"
                                                                          : MnistDir());
    s->mutable_optimizer()->set_lr(absl::StrContains(c.what, "missing") ? 0 : 0.05);
    s->mutable_schedule()->set_type(absl::StrContains(c.spec, "hogwild") ? "hogwild" : "pipemare");
    int stages = 2;
    if (absl::StrContains(c.what, "more stages")) stages = 9;
    if (absl::StrContains(c.what, "ill-typed") || absl::StrContains(c.what, "unknown field")) {
      stages = 0;
    }
    s->mutable_schedule()->set_stages(stages);
    s->mutable_train()->set_epochs(1);
    v1::SubmitJobResponse resp;
    auto ctx = ContextWithDeadline(10);
    grpc::Status st = stub->SubmitJob(ctx.get(), req, &resp);
    EXPECT_FALSE(st.ok()) << c.what;
    const std::string field =
        absl::StrContains(c.what, "unknown field") ? "schedule.stages" : c.field;
    EXPECT_TRUE(absl::StrContains(st.error_message(), field))
        << c.what << ": " << st.error_message();
  }
  // Still serving, and no job was created.
  v1::ListJobsResponse jobs;
  auto ctx = ContextWithDeadline(10);
  ASSERT_TRUE(stub->ListJobs(ctx.get(), v1::ListJobsRequest(), &jobs).ok());
  EXPECT_EQ(jobs.jobs_size(), 0);
  EXPECT_TRUE(cluster.coordinator().Running());
}

TEST(BadInput, AJobNeedingMoreWorkersThanTheClusterWillEverHaveIsRefusedNamingTheFix) {
  // --max-workers: the most workers this cluster will have. A job needing
  // more (stages x replicas) would wait PENDING for ever: refused at submit.
  Cluster cluster(0, {"--max-workers", "4"});
  ASSERT_FALSE(cluster.address().empty());
  auto spec = [&](int stages, int replicas) {
    const std::string name = absl::StrCat("r", replicas, "p", stages);
    return cluster.WriteSpec(
        name,
        absl::StrReplaceAll(ShortSpec(name, "gpipe", stages, 6400),
                            {{"microbatch_size: 32,",
                              absl::StrCat("microbatch_size: 32, replicas: ", replicas, ",")}}));
  };
  auto refused = cluster.Ctl({"submit", spec(3, 2)});
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_TRUE(absl::StrContains(refused.err, "schedule.replicas x schedule.stages: 2 x 3 = 6"))
      << refused.err;
  EXPECT_TRUE(absl::StrContains(refused.err, "at most 4 (the coordinator's --max-workers)"))
      << refused.err;
  // Exactly as many as may come: accepted, and it waits for them.
  auto accepted = cluster.Ctl({"submit", spec(2, 2)});
  EXPECT_EQ(accepted.exit_code, 0) << accepted.err;
  auto jobs = cluster.Ctl({"list"});
  EXPECT_TRUE(absl::StrContains(jobs.out, "PENDING")) << jobs.out;
  EXPECT_FALSE(absl::StrContains(jobs.out, "r2p3")) << jobs.out;
}

TEST(BadInput, DataChangedBeforeAResumeFailsItNamingTheFileAndTheFix) {
  // The coordinator keeps the data's manifest from the job's first run: a
  // later run (a recovery, a resume) on files changed since fails, naming
  // the file, rather than training on other examples at the cut's position.
  Cluster cluster(2);
  ASSERT_TRUE(cluster.ok());
  const std::string data = cluster.dir() + "/mnist";
  std::filesystem::create_directories(data);
  for (const auto& entry : std::filesystem::directory_iterator(MnistDir())) {
    std::filesystem::copy_file(entry.path(), std::filesystem::path(data) / entry.path().filename());
  }
  const std::string spec = cluster.WriteSpec(
      "changed",
      absl::StrCat(
          absl::StrReplaceAll(ShortSpec("changed", "gpipe", 2, 12800, 3), {{MnistDir(), data}}),
          "checkpoint: {every_steps: 10, dir: ", cluster.dir(), "/checkpoints}\n"));
  const std::string id = cluster.Submit(spec);
  ASSERT_FALSE(id.empty()) << cluster.Logs();
  v1::JobStatus job;
  ASSERT_TRUE(WaitFor(120, [&] {
    job = cluster.Status(id);
    return job.checkpoint().step() > 0;
  })) << cluster.Logs();
  ASSERT_EQ(job.data_files_size(), 4);
  EXPECT_EQ(job.data_files(0).sha256().size(), 64u);
  auto cancel = cluster.Ctl({"cancel", id});
  ASSERT_EQ(cancel.exit_code, 0) << cancel.err;
  ASSERT_EQ(cluster.WaitForEnd(id, 120).state(), v1::CANCELLED) << cluster.Logs();
  {
    // The same size, one test label changed (a re-labelled copy).
    std::fstream labels(data + "/t10k-labels-idx1-ubyte",
                        std::ios::in | std::ios::out | std::ios::binary);
    labels.seekg(100);
    const char label = static_cast<char>(labels.get());
    labels.seekp(100);
    labels.put(static_cast<char>((label + 1) % 10));
  }
  auto resumed = cluster.Ctl({"resume", id, "--wait"}, 120);
  EXPECT_NE(resumed.exit_code, 0);
  job = cluster.WaitForEnd(id, 120);
  EXPECT_EQ(job.state(), v1::FAILED) << cluster.Logs();
  EXPECT_TRUE(
      absl::StrContains(job.reason(), "t10k-labels-idx1-ubyte changed since the job started"))
      << job.reason();
  EXPECT_TRUE(absl::StrContains(job.reason(), "put back the files the job started with"))
      << job.reason();
}

// Writes an idx file: magic 0x0000080<dims>, the sizes, then `data`.
void WriteIdx(const std::string& path, std::vector<uint32_t> sizes, size_t data_bytes) {
  std::string bytes = {0, 0, 8, static_cast<char>(sizes.size())};
  for (uint32_t s : sizes) {
    for (int shift : {24, 16, 8, 0}) bytes.push_back(static_cast<char>(s >> shift));
  }
  for (size_t i = 0; i < data_bytes; ++i) bytes.push_back(static_cast<char>(i % 3));  // 0, 1, 2
  std::ofstream(path, std::ios::binary) << bytes;
}

TEST(BadInput, IdxDataThatDoesNotHoldUpIsRefusedAtSubmitNamingTheFile) {
  Cluster cluster(0);
  ASSERT_FALSE(cluster.address().empty());
  const std::string dir = cluster.dir();
  // 6 training images of 2x2 pixels with labels 0..2 (3 classes); 3 test.
  WriteIdx(dir + "/train-images", {6, 2, 2}, 24);
  WriteIdx(dir + "/test-images", {3, 2, 2}, 12);
  WriteIdx(dir + "/test-labels", {3}, 3);
  WriteIdx(dir + "/train-labels", {6}, 6);
  WriteIdx(dir + "/short-labels", {6}, 4);  // the header promises 6
  const std::string yaml = R"(name: idx
model: {type: mlp, layers: LAYERS}
data: {type: idx, path: DIR, train_images: train-images, train_labels: LABELS,
       test_images: test-images, test_labels: test-labels}
optimizer: {lr: 0.05}
schedule: {type: pipemare, stages: 2, microbatch_size: 2}
train: {epochs: 1}
)";
  auto spec = [&](const std::string& layers, const std::string& train_labels) {
    return cluster.WriteSpec(
        "idx",
        absl::StrReplaceAll(yaml, {{"LAYERS", layers}, {"DIR", dir}, {"LABELS", train_labels}}));
  };
  auto r = cluster.Ctl({"submit", spec("[4, 8, 3]", "short-labels")});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(absl::StrContains(r.err, "data.train_labels: " + dir + "/short-labels: truncated"))
      << r.err;
  // The model must fit the files: rows x cols inputs, at least 3 outputs.
  r = cluster.Ctl({"submit", spec("[4, 8, 2]", "train-labels")});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(absl::StrContains(r.err, "model.layers[2]: is 2")) << r.err;
  EXPECT_TRUE(absl::StrContains(r.err, "3 classes")) << r.err;
  r = cluster.Ctl({"submit", spec("[5, 8, 3]", "train-labels")});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(absl::StrContains(r.err, "model.layers[0]: is 5")) << r.err;
  EXPECT_TRUE(absl::StrContains(r.err, "2x2 = 4 pixels")) << r.err;
  auto list = cluster.Ctl({"list", "--output", "json"});
  EXPECT_FALSE(absl::StrContains(list.out, "\"id\"")) << "no job was created: " << list.out;
  // With the whole label file and a fitting model the same spec is accepted.
  r = cluster.Ctl({"submit", spec("[4, 8, 3]", "train-labels")});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(cluster.coordinator().Running());
}

TEST(BadInput, WorkerRejectsMalformedTensorsWithoutCrashing) {
  Cluster cluster(1);
  ASSERT_TRUE(cluster.ok());
  // A one-stage job, so the worker gets the feeds; then a raw Pipe stream
  // with a truncated tensor must be refused and the worker keeps running.
  v1::ListWorkersResponse workers = cluster.Workers();
  ASSERT_EQ(workers.workers_size(), 1);
  auto stub = v1::StageWorker::NewStub(MakeChannel(workers.workers(0).address()));
  {
    grpc::Status loaded = LoadTinyMlpStage(*stub, "raw-job");
    ASSERT_TRUE(loaded.ok()) << loaded.error_message();
  }
  RawFeed feed(*stub, "raw-job", v1::StreamOpen::INPUT_FEED);
  ASSERT_TRUE(feed.opened);
  auto& stream = feed.stream;
  v1::StageMessage bad;
  bad.set_microbatch(1);
  bad.set_phase(v1::TRAIN);
  bad.mutable_activation()->set_dtype(v1::FLOAT32);
  bad.mutable_activation()->add_shape(2);
  bad.mutable_activation()->add_shape(4);
  bad.mutable_activation()->set_data(std::string(7, '\0'));  // needs 32 bytes
  stream->Write(bad);
  stream->WritesDone();
  grpc::Status st = stream->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(st.error_message(), "truncated")) << st.error_message();
  EXPECT_TRUE(cluster.worker(0).Running()) << "the worker survives bad input";
  v1::StageStatusRequest sreq;
  sreq.set_job_id("raw-job");
  v1::StageStatusResponse sresp;
  auto sctx = ContextWithDeadline(10);
  ASSERT_TRUE(stub->GetStageStatus(sctx.get(), sreq, &sresp).ok());
  EXPECT_TRUE(absl::StrContains(sresp.error(), "truncated")) << sresp.error();
}

TEST(BadInput, AFeedThatRepeatsOrFloodsMicrobatchesIsCutOffNamingWhy) {
  // The target feed is trusted with nothing: a repeated microbatch id, or
  // more targets than the pipeline's window could need (a peer growing the
  // worker's memory without bound), ends the stream with INVALID_ARGUMENT
  // and the stage's error says why; the worker keeps serving.
  Cluster cluster(1);
  ASSERT_TRUE(cluster.ok());
  v1::ListWorkersResponse workers = cluster.Workers();
  ASSERT_EQ(workers.workers_size(), 1);
  auto stub = v1::StageWorker::NewStub(MakeChannel(workers.workers(0).address()));
  auto targets = [](uint64_t id) {
    v1::StageMessage m;
    m.set_microbatch(id);
    m.set_phase(v1::TRAIN);
    m.mutable_targets()->set_dtype(v1::INT64);
    m.mutable_targets()->add_shape(1);
    m.mutable_targets()->set_data(std::string(8, '\0'));
    return m;
  };
  struct Case {
    std::string job;
    std::vector<uint64_t> ids;
    std::string why;
  };
  // One stage, N = 1: the window is max(P, 2N) + 2 = 4 microbatches.
  for (const Case& c : {Case{"repeat-job", {7, 8, 7}, "targets of microbatch 7 arrived twice"},
                        Case{"flood-job",
                             {1, 2, 3, 4, 5},
                             "targets of microbatch 5: more than 4 targets waiting"}}) {
    SCOPED_TRACE(c.job);
    ASSERT_TRUE(LoadTinyMlpStage(*stub, c.job).ok());
    RawFeed feed(*stub, c.job, v1::StreamOpen::TARGET_FEED, 20);
    ASSERT_TRUE(feed.opened);
    auto& stream = feed.stream;
    for (uint64_t id : c.ids) stream->Write(targets(id));
    stream->WritesDone();
    grpc::Status st = stream->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    EXPECT_TRUE(absl::StrContains(st.error_message(), c.why)) << st.error_message();
    v1::StageStatusRequest sreq;
    sreq.set_job_id(c.job);
    v1::StageStatusResponse sresp;
    auto sctx = ContextWithDeadline(10);
    ASSERT_TRUE(stub->GetStageStatus(sctx.get(), sreq, &sresp).ok());
    EXPECT_TRUE(absl::StrContains(sresp.error(), c.why)) << sresp.error();
  }
  EXPECT_TRUE(cluster.worker(0).Running()) << "the worker survives a hostile feed";
}

TEST(BadInput, NonFiniteNumbersAreRefusedByCoordinatorAndWorkerNamingTheField) {
  // Through the raw RPCs (pipemarectl's YAML parser refuses .nan itself):
  // before, a NaN momentum, dropout or warm-up was accepted.
  Cluster cluster(1);
  ASSERT_TRUE(cluster.ok());
  auto coordinator = v1::Coordinator::NewStub(MakeChannel(cluster.address()));
  v1::SubmitJobRequest req;
  auto* s = req.mutable_spec();
  s->set_name("nan");
  s->mutable_model()->set_type("mlp");
  for (int w : {784, 64, 10}) s->mutable_model()->add_layers(w);
  s->mutable_data()->set_type("mnist");
  s->mutable_data()->set_path(MnistDir());
  s->mutable_optimizer()->set_lr(0.05);
  s->mutable_optimizer()->set_momentum(std::nan(""));
  s->mutable_schedule()->set_type("pipemare");
  s->mutable_schedule()->set_stages(1);
  s->mutable_train()->set_epochs(1);
  v1::SubmitJobResponse resp;
  auto ctx = ContextWithDeadline(10);
  grpc::Status st = coordinator->SubmitJob(ctx.get(), req, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(st.error_message(), "optimizer.momentum: NaN"))
      << st.error_message();

  auto worker = v1::StageWorker::NewStub(MakeChannel(cluster.Workers().workers(0).address()));
  v1::StageAssignment a;
  a.set_job_id("inf-job");
  a.set_num_stages(1);
  a.set_units(2);
  a.mutable_model()->set_type("mlp");
  for (int w : {4, 3, 2}) a.mutable_model()->add_layers(w);
  a.mutable_optimizer()->set_type("sgd");
  a.mutable_optimizer()->set_lr(std::numeric_limits<double>::infinity());
  a.mutable_schedule()->set_type("pipemare");
  a.mutable_schedule()->set_microbatches_per_step(1);
  a.set_steps_per_epoch(1);
  v1::LoadStageResponse load;
  auto lctx = ContextWithDeadline(10);
  st = worker->LoadStage(lctx.get(), a, &load);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(st.error_message(), "optimizer.lr: +Inf")) << st.error_message();
  EXPECT_TRUE(cluster.coordinator().Running());
  EXPECT_TRUE(cluster.worker(0).Running());
  EXPECT_EQ(cluster.CountWorkers(v1::IDLE), 1);
}

}  // namespace
}  // namespace pipemare::testing
