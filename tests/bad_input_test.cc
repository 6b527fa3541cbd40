// Bad job specs are refused at submit time with an error that names the
// field, by the client and by the coordinator itself (a raw RPC that skips
// the client's checks); the coordinator keeps serving. Label: multiprocess.
#include <gtest/gtest.h>

#include "absl/strings/match.h"
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

TEST(BadInput, WorkerRejectsMalformedTensorsWithoutCrashing) {
  Cluster cluster(1);
  ASSERT_TRUE(cluster.ok());
  // A one-stage job, so the worker gets the feeds; then a raw Pipe stream
  // with a truncated tensor must be refused and the worker keeps running.
  v1::ListWorkersResponse workers = cluster.Workers();
  ASSERT_EQ(workers.workers_size(), 1);
  auto stub = v1::StageWorker::NewStub(MakeChannel(workers.workers(0).address()));
  v1::StageAssignment a;
  a.set_job_id("raw-job");
  a.set_stage(0);
  a.set_num_stages(1);
  a.set_first_unit(0);
  a.set_units(2);
  a.mutable_model()->set_type("mlp");
  for (int w : {4, 3, 2}) a.mutable_model()->add_layers(w);
  a.mutable_model()->set_activation("relu");
  a.mutable_optimizer()->set_type("sgd");
  a.mutable_optimizer()->set_lr(0.1);
  a.mutable_schedule()->set_type("pipemare");
  a.mutable_schedule()->set_microbatches_per_step(1);
  a.set_steps_per_epoch(1);
  {
    v1::LoadStageResponse resp;
    auto ctx = ContextWithDeadline(10);
    ASSERT_TRUE(stub->LoadStage(ctx.get(), a, &resp).ok());
  }
  grpc::ClientContext ctx;
  auto stream = stub->Pipe(&ctx);
  v1::StageMessage open;
  open.mutable_open()->set_job_id("raw-job");
  open.mutable_open()->set_role(v1::StreamOpen::INPUT_FEED);
  ASSERT_TRUE(stream->Write(open));
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

}  // namespace
}  // namespace pipemare::testing
