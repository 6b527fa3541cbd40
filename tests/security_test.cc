// Only the right callers (docs/security.md): a real cluster on mutual TLS
// with bearer tokens, called by the real client and by raw gRPC channels
// holding no, wrong, foreign or wrong-role credentials. Each gets its
// documented status, every service stays up, and a job running alongside
// SUCCEEDS. Label: multiprocess.
#include "common/security.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/dev_pki.h"
#include "common/rpc.h"
#include "pipemare/v1/pipemare.grpc.pb.h"
#include "tests/cluster.h"

namespace pipemare::testing {
namespace {

std::string Slurp(const std::string& path) { return ReadFile(path); }

// A channel to `address` with exactly these credentials (not the test
// process's own).
std::shared_ptr<grpc::Channel> ChannelWith(const std::string& address, const std::string& ca,
                                           const std::string& cert, const std::string& key,
                                           const std::string& token = "") {
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = Slurp(ca);
  if (!cert.empty()) {
    options.pem_cert_chain = Slurp(cert);
    options.pem_private_key = Slurp(key);
  }
  auto credentials = grpc::SslCredentials(options);
  if (!token.empty()) {
    credentials =
        grpc::CompositeChannelCredentials(credentials, grpc::AccessTokenCredentials(token));
  }
  return grpc::CreateCustomChannel(address, credentials, ChannelArgs());
}

grpc::Status List(const std::shared_ptr<grpc::Channel>& channel) {
  auto stub = v1::Coordinator::NewStub(channel);
  auto context = ContextWithDeadline(10);
  v1::ListJobsResponse response;
  return stub->ListJobs(context.get(), v1::ListJobsRequest(), &response);
}

std::string WriteToken(const std::string& dir, const std::string& name, const std::string& token) {
  const std::string path = dir + "/" + name;
  std::ofstream(path) << token << "\n";
  return path;
}

TEST(Security, OnlyTheRightCallersGetThroughAndAJobAlongsideSucceeds) {
  Cluster cluster(2);
  ASSERT_TRUE(cluster.ok()) << cluster.Logs();
  const DevPki& pki = TestPki();
  // A job trains while everything below is refused around it.
  const std::string job =
      cluster.Submit(cluster.WriteSpec("alongside", ShortSpec("alongside", "pipemare", 2, 6400)));
  ASSERT_FALSE(job.empty());
  const std::string spec = cluster.WriteSpec("refused", ShortSpec("refused", "pipemare", 2, 3200));
  const std::string ctl = BinDir() + "/pipemarectl";
  auto as = [&](std::vector<std::string> credentials, std::vector<std::string> args) {
    std::vector<std::string> argv = {ctl, "--coordinator", cluster.address()};
    argv.insert(argv.end(), credentials.begin(), credentials.end());
    argv.insert(argv.end(), args.begin(), args.end());
    return pipemare::testing::Run(argv, 60);
  };

  // No token: UNAUTHENTICATED, and the client says what it needs.
  auto r = as({"--tls-ca", pki.ca}, {"list"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(absl::StrContains(r.err, "needs a token")) << r.err;
  // A wrong token.
  const std::string wrong = WriteToken(cluster.dir(), "wrong.token", RandomToken());
  r = as({"--tls-ca", pki.ca, "--token-file", wrong}, {"list"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(absl::StrContains(r.err, "not one this coordinator accepts")) << r.err;
  // A read token reads, and may not submit or cancel.
  r = as({"--tls-ca", pki.ca, "--token-file", pki.read_token}, {"list"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(absl::StrContains(r.out, job)) << r.out;
  r = as({"--tls-ca", pki.ca, "--token-file", pki.read_token}, {"submit", spec});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(absl::StrContains(r.err, "viewer may not call /pipemare.v1.Coordinator/SubmitJob"))
      << r.err;
  r = as({"--tls-ca", pki.ca, "--token-file", pki.read_token}, {"cancel", job});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(absl::StrContains(r.err, "role submit")) << r.err;
  // Plaintext to the TLS port: refused at the handshake, with a hint.
  r = as({"--insecure"}, {"list"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(absl::StrContains(r.err, "--insecure for a plaintext coordinator")) << r.err;
  // TLS with a CA that did not sign the coordinator: the client refuses it.
  DevPkiOptions other_options;
  other_options.dir = cluster.dir() + "/other-pki";
  auto other = MakeDevPki(other_options);
  ASSERT_TRUE(other.ok()) << other.status();
  r = as({"--tls-ca", other->ca, "--token-file", pki.submit_token}, {"list"});
  EXPECT_NE(r.exit_code, 0);

  // Raw gRPC. A foreign CA's worker certificate cannot even connect to a
  // worker (client certificates are required and verified) ...
  v1::ListWorkersResponse workers = cluster.Workers();
  ASSERT_EQ(workers.workers_size(), 2);
  const std::string worker_address = workers.workers(0).address();
  {
    auto foreign = v1::StageWorker::NewStub(
        ChannelWith(worker_address, pki.ca, other->worker_certs[0], other->worker_keys[0]));
    auto context = ContextWithDeadline(10);
    v1::StageStatusResponse response;
    grpc::Status st = foreign->GetStageStatus(context.get(), v1::StageStatusRequest(), &response);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE) << st.error_message();
  }
  // ... nor register with the coordinator.
  {
    auto foreign = v1::Coordinator::NewStub(
        ChannelWith(cluster.address(), pki.ca, other->worker_certs[0], other->worker_keys[0]));
    v1::RegisterWorkerRequest request;
    request.set_address("127.0.0.1:1");
    request.set_instance_id("intruder");
    auto context = ContextWithDeadline(10);
    v1::RegisterWorkerResponse response;
    grpc::Status st = foreign->RegisterWorker(context.get(), request, &response);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE) << st.error_message();
  }
  // A trusted worker certificate may register only an address it names.
  auto as_worker = [&](const std::string& address) {
    return ChannelWith(address, pki.ca, pki.worker_certs[0], pki.worker_keys[0]);
  };
  {
    auto stub = v1::Coordinator::NewStub(as_worker(cluster.address()));
    v1::RegisterWorkerRequest request;
    request.set_address("10.9.9.9:7071");
    request.set_instance_id("elsewhere");
    auto context = ContextWithDeadline(10);
    v1::RegisterWorkerResponse response;
    grpc::Status st = stub->RegisterWorker(context.get(), request, &response);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
    EXPECT_TRUE(absl::StrContains(st.error_message(), "may not register the address 10.9.9.9:7071"))
        << st.error_message();
    // An address the certificate names but where no worker answers, and one
    // that is not host:port.
    request.set_address("127.0.0.1:1");
    auto probe = ContextWithDeadline(10);
    st = stub->RegisterWorker(probe.get(), request, &response);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st.error_message();
    EXPECT_TRUE(absl::StrContains(st.error_message(), "cannot reach this worker at 127.0.0.1:1"))
        << st.error_message();
    request.set_address("127.0.0.1:http");
    auto parse = ContextWithDeadline(10);
    st = stub->RegisterWorker(parse.get(), request, &response);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    // A worker's certificate is not a client's token.
    EXPECT_EQ(List(as_worker(cluster.address())).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  }
  // A worker may feed a neighbour's pipeline stream, not load a stage on it:
  // only the coordinator loads TorchScript and stages.
  {
    auto stub = v1::StageWorker::NewStub(as_worker(worker_address));
    v1::StageAssignment assignment;
    assignment.set_job_id("hijack");
    auto context = ContextWithDeadline(10);
    v1::LoadStageResponse response;
    grpc::Status st = stub->LoadStage(context.get(), assignment, &response);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
    EXPECT_TRUE(absl::StrContains(st.error_message(), "the coordinator's certificate"))
        << st.error_message();
  }
  // Another replica's stage may ask a worker for a cut it holds in memory
  // (live recovery): let through, and this one holds none of that job.
  {
    auto stub = v1::StageWorker::NewStub(as_worker(worker_address));
    v1::FetchCutUnitRequest request;
    request.set_job_id("hijack");
    request.mutable_file()->set_path("/etc/passwd");
    auto context = ContextWithDeadline(10);
    auto reader = stub->FetchCutUnit(context.get(), request);
    v1::CutUnitChunk chunk;
    EXPECT_FALSE(reader->Read(&chunk));
    grpc::Status st = reader->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND) << st.error_message();
  }
  // A client with a token but no certificate cannot reach a worker at all.
  {
    auto stub = v1::StageWorker::NewStub(
        ChannelWith(worker_address, pki.ca, "", "", LoadToken(pki.submit_token, "t").value()));
    auto context = ContextWithDeadline(10);
    v1::StageStatusResponse response;
    grpc::Status st = stub->GetStageStatus(context.get(), v1::StageStatusRequest(), &response);
    EXPECT_NE(st.error_code(), grpc::StatusCode::OK);
  }

  // Every service is still up, no stranger registered, and the job trained.
  EXPECT_TRUE(cluster.coordinator().Running());
  EXPECT_TRUE(cluster.worker(0).Running());
  EXPECT_TRUE(cluster.worker(1).Running());
  EXPECT_EQ(cluster.Workers().workers_size(), 2);
  v1::JobStatus end = cluster.WaitForEnd(job, 300);
  EXPECT_EQ(end.state(), v1::SUCCEEDED) << end.reason() << cluster.Logs();
  EXPECT_EQ(end.submitted_by(), "admin");
}

TEST(Security, ServicesRefuseToStartWithoutCredentialsOrInsecure) {
  const std::string dir = MakeTempDir();
  // No TLS files and no --insecure: exit 2 with the fix named.
  auto r = pipemare::testing::Run(
      {BinDir() + "/pipemare-coordinator", "--listen", "127.0.0.1:0", "--metrics-listen", ""}, 30);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(absl::StrContains(r.out + r.err, "--insecure")) << r.out << r.err;
  const DevPki& pki = TestPki();
  // A worker's certificate on the coordinator.
  r = pipemare::testing::Run(
      {BinDir() + "/pipemare-coordinator", "--listen", "127.0.0.1:0", "--metrics-listen", "",
       "--tls-ca", pki.ca, "--tls-cert", pki.worker_certs[0], "--tls-key", pki.worker_keys[0],
       "--tokens-file", pki.tokens},
      30);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(absl::StrContains(r.out + r.err, "needs a certificate named 'pipemare-coordinator'"))
      << r.out << r.err;
  // A key that is not the certificate's.
  r = pipemare::testing::Run(
      {BinDir() + "/pipemare-worker", "--coordinator", "127.0.0.1:1", "--metrics-listen", "",
       "--tls-ca", pki.ca, "--tls-cert", pki.worker_certs[0], "--tls-key", pki.coordinator_key},
      30);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(absl::StrContains(r.out + r.err, "is not the key of --tls-cert")) << r.out << r.err;
  // A tokens file with a short token names the line.
  const std::string tokens = dir + "/tokens";
  std::ofstream(tokens) << "# comment\nalice submit short\n";
  r = pipemare::testing::Run(
      {BinDir() + "/pipemare-coordinator", "--listen", "127.0.0.1:0", "--metrics-listen", "",
       "--tls-ca", pki.ca, "--tls-cert", pki.coordinator_cert, "--tls-key", pki.coordinator_key,
       "--tokens-file", tokens},
      30);
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(absl::StrContains(r.out + r.err, "line 2: the token of alice")) << r.out << r.err;
}

TEST(Security, AJobReadsAndWritesOnlyUnderTheDataRoots) {
  // A root holding a good corpus, a symlink that escapes it and a FIFO that
  // would block a reader forever; MNIST is a second root.
  const std::string root = MakeTempDir();
  std::filesystem::copy_file("/usr/share/games/fortunes/cookie", root + "/corpus.txt");
  ASSERT_EQ(symlink("/etc/passwd", (root + "/escape.txt").c_str()), 0);
  ASSERT_EQ(mkfifo((root + "/fifo.txt").c_str(), 0600), 0);
  Cluster cluster(2, {"--data-root", root, "--data-root", MnistDir()});
  ASSERT_TRUE(cluster.ok()) << cluster.Logs();
  const std::string good = ShortSpec("rooted", "pipemare", 2, 3200);
  const std::string job = cluster.Submit(cluster.WriteSpec("rooted", good));
  ASSERT_FALSE(job.empty());
  auto text = [](const std::string& path) {
    return "name: text\nmodel: {type: transformer_lm, depth: 1, width: 32, heads: 2}\n"
           "data: {type: text, path: " +
           path +
           ", context: 16}\noptimizer: {type: adam, lr: 0.001}\n"
           "schedule: {type: pipemare, stages: 2, microbatch_size: 16}\ntrain: {epochs: 1}\n";
  };
  struct Case {
    std::string what, spec;
    std::vector<std::string> says;
  };
  const std::vector<Case> cases = {
      {"a corpus outside the roots",
       text("/usr/share/games/fortunes/cookie"),
       {"data.path", "outside the coordinator's data roots"}},
      {"a symlink out of a root",
       text(root + "/escape.txt"),
       {"data.path", "resolves to /etc/passwd", "outside"}},
      {"a FIFO", text(root + "/fifo.txt"), {"data.path", "not a regular file"}},
      {"a /proc file", text("/proc/self/environ"), {"data.path", "system file"}},
      {"idx files outside the roots",
       "name: idx\nmodel: {type: mlp, layers: [784, 10]}\n"
       "data: {type: idx, path: /usr/share/datasets/fashion-mnist}\n"
       "optimizer: {type: sgd, lr: 0.1}\nschedule: {type: gpipe, stages: 1}\n"
       "train: {epochs: 1}\n",
       {"data.path", "outside the coordinator's data roots"}},
      {"checkpoints outside the roots",
       good + "checkpoint: {dir: /tmp/pipemare-elsewhere}\n",
       {"checkpoint.dir", "outside the coordinator's data roots"}},
  };
  int i = 0;
  for (const Case& c : cases) {
    auto r =
        cluster.Ctl({"submit", cluster.WriteSpec("refused" + std::to_string(i++), c.spec)}, 60);
    EXPECT_NE(r.exit_code, 0) << c.what;
    for (const std::string& s : c.says) {
      EXPECT_TRUE(absl::StrContains(r.err, s)) << c.what << ": " << r.err;
    }
  }
  // submit --from a directory outside the roots.
  auto r = cluster.Ctl({"submit", cluster.WriteSpec("from", good), "--from", "/etc"}, 60);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(absl::StrContains(r.err, "from_checkpoint: /etc resolves to /etc")) << r.err;
  EXPECT_TRUE(cluster.coordinator().Running());
  v1::JobStatus end = cluster.WaitForEnd(job, 300);
  EXPECT_EQ(end.state(), v1::SUCCEEDED) << end.reason() << cluster.Logs();
}

TEST(Security, StagesReadTheirOwnDataOnlyUnderTheirRootsAndOnlyTheCoordinatorsCopy) {
  // The coordinator reads a corpus at a path relative to its directory (the
  // test's). Stage 0 and the last stage read the examples themselves: a
  // worker started where that path is a copy with one byte changed, and a
  // worker whose --data-root leaves the data out, each fail the job naming
  // the file, the fault and the worker.
  const std::string rel = absl::StrCat("stage-data-", getpid(), "/corpus.txt");
  std::filesystem::create_directories(std::filesystem::path(rel).parent_path());
  std::filesystem::copy_file("/usr/share/games/fortunes/cookie", rel,
                             std::filesystem::copy_options::overwrite_existing);
  const std::string elsewhere = MakeTempDir();
  std::filesystem::create_directories(elsewhere + "/" +
                                      std::filesystem::path(rel).parent_path().string());
  std::filesystem::copy_file(rel, elsewhere + "/" + rel);
  {
    std::fstream f(elsewhere + "/" + rel, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    f.put('#');
  }
  const std::string spec =
      "name: own-data\nmodel: {type: transformer_lm, depth: 1, width: 32, heads: 2}\n"
      "data: {type: text, path: " +
      rel +
      ", context: 16}\noptimizer: {type: adam, lr: 0.001}\n"
      "schedule: {type: gpipe, stages: 1, microbatch_size: 16}\ntrain: {epochs: 1}\n";
  struct Case {
    std::string what;
    std::vector<std::string> flags;
    std::string cwd;
    std::vector<std::string> says;
  };
  const std::vector<Case> cases = {
      {"a different copy",
       {},
       elsewhere,
       {"data.path", rel, "differs from the coordinator's", "SHA-256"}},
      {"data outside the worker's roots",
       {"--data-root", elsewhere},
       "",
       {"data.path", "outside this worker's data roots", "--data-root"}},
  };
  for (const Case& c : cases) {
    Cluster cluster(0);
    ASSERT_FALSE(cluster.address().empty()) << cluster.Logs();
    cluster.AddWorker(c.flags, c.cwd);
    ASSERT_TRUE(WaitFor(60, [&] { return cluster.CountWorkers(v1::IDLE) == 1; })) << cluster.Logs();
    const std::string job = cluster.Submit(cluster.WriteSpec("own-data", spec));
    ASSERT_FALSE(job.empty()) << cluster.Logs();
    const v1::JobStatus end = cluster.WaitForEnd(job, 120);
    EXPECT_EQ(end.state(), v1::FAILED) << c.what << ": " << end.reason();
    for (const std::string& s : c.says) {
      EXPECT_TRUE(absl::StrContains(end.reason(), s)) << c.what << ": " << end.reason();
    }
    // The worker that read it is named.
    EXPECT_TRUE(absl::StrContains(end.reason(), "data on this worker (127.0.0.1:"))
        << c.what << ": " << end.reason();
  }
  std::filesystem::remove_all(std::filesystem::path(rel).parent_path());
}

TEST(Security, ASubmitterMayQueueOnlySoManyJobsAndSpecsAreBounded) {
  // No workers: every job waits. Two may, the third is refused.
  Cluster cluster(0, {"--max-queued-jobs", "2", "--max-spec-bytes", "4096"});
  ASSERT_FALSE(cluster.address().empty()) << cluster.Logs();
  const std::string spec = cluster.WriteSpec("queued", ShortSpec("queued", "gpipe", 2, 3200));
  EXPECT_FALSE(cluster.Submit(spec).empty());
  EXPECT_FALSE(cluster.Submit(spec).empty());
  auto r = cluster.Ctl({"submit", spec});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(absl::StrContains(r.err, "admin already has 2 jobs waiting")) << r.err;
  EXPECT_TRUE(absl::StrContains(r.err, "--max-queued-jobs")) << r.err;
  // A spec larger than --max-spec-bytes, sent raw (the client has no bound).
  auto stub = v1::Coordinator::NewStub(MakeChannel(cluster.address()));
  v1::SubmitJobRequest request;
  request.mutable_spec()->set_name(std::string(5000, 'x'));
  v1::SubmitJobResponse response;
  auto context = ContextWithDeadline(10);
  grpc::Status st = stub->SubmitJob(context.get(), request, &response);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(st.error_message(), "--max-spec-bytes 4096")) << st.error_message();
  EXPECT_TRUE(cluster.coordinator().Running());
}

TEST(Security, AModelOverTheCoordinatorsBudgetIsRefusedBeforeItIsBuilt) {
  // --max-model-bytes 2 MiB: the short spec's MLP (242k parameters, 0.97 MB)
  // fits; one with a 784 x 1024 layer (3.2 MB) is refused naming the layer
  // and the flag, by arithmetic before the shape pass allocates it.
  Cluster cluster(0, {"--max-model-bytes", "2097152"});
  ASSERT_FALSE(cluster.address().empty()) << cluster.Logs();
  const std::string fits = ShortSpec("fits", "gpipe", 2, 3200);
  EXPECT_FALSE(cluster.Submit(cluster.WriteSpec("fits", fits)).empty());
  const std::string big = absl::StrReplaceAll(
      fits, {{"name: fits", "name: big"}, {"[784, 256, 128, 64, 10]", "[784, 1024, 10]"}});
  auto r = cluster.Ctl({"submit", cluster.WriteSpec("big", big)});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_TRUE(absl::StrContains(r.err,
                                "model.layers[0]: would hold 803840 parameters (3215360 "
                                "bytes of float32), more than the 524288 the model may "
                                "still hold under the coordinator's --max-model-bytes "
                                "2097152"))
      << r.err;
  EXPECT_TRUE(cluster.coordinator().Running());
}

}  // namespace
}  // namespace pipemare::testing
