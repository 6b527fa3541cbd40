// Unit tests of common/: the event log's line format, the /metrics server and
// the Prometheus file_sd targets file.
#include <gtest/gtest.h>
#include <prometheus/counter.h>
#include <prometheus/registry.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/dev_pki.h"
#include "common/health.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/rpc.h"
#include "common/security.h"
#include "pipemare/v1/pipemare.grpc.pb.h"
#include "tests/process.h"

namespace pipemare {
namespace {

TEST(Log, TextLineHasLevelJobStageAndOneLine) {
  EXPECT_EQ(FormatLogEvent(false, LogLevel::kInfo, ForStage("job-1", 2), "loaded stage"),
            "INFO job=job-1 stage=2 loaded stage");
  EXPECT_EQ(FormatLogEvent(false, LogLevel::kError, {}, "bad\nthing"), "ERROR bad thing");
  EXPECT_EQ(FormatLogEvent(false, LogLevel::kWarning, ForJob("job-3"), "x"), "WARN job=job-3 x");
}

TEST(Log, JsonEscapesAndOmitsAbsentFields) {
  EXPECT_EQ(FormatLogEvent(true, LogLevel::kInfo, ForStage("job-1", 0), "a \"quoted\"\nline"),
            R"("level":"info","job_id":"job-1","stage":0,"msg":"a \"quoted\"\nline")");
  EXPECT_EQ(FormatLogEvent(true, LogLevel::kError, {}, "x"), R"("level":"error","msg":"x")");
}

TEST(Log, RejectsUnknownFormatNamingTheFlag) {
  absl::Status st = InitLogging("yaml");
  EXPECT_FALSE(st.ok());
  EXPECT_TRUE(absl::StrContains(st.message(), "--log-format")) << st.message();
  EXPECT_TRUE(InitLogging("text").ok());
}

TEST(MetricsServer, ServesARegistryOnAnyFreePort) {
  auto registry = std::make_shared<prometheus::Registry>();
  prometheus::BuildCounter()
      .Name("pipemare_test_total")
      .Help("t")
      .Register(*registry)
      .Add({})
      .Increment(3);
  auto server = MetricsServer::Start("127.0.0.1:0", {registry});
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_TRUE(absl::StartsWith((*server)->address(), "127.0.0.1:"));
  EXPECT_NE((*server)->address(), "127.0.0.1:0");
  const std::string body = testing::HttpGet("http://" + (*server)->address() + "/metrics");
  EXPECT_TRUE(absl::StrContains(body, "pipemare_test_total 3")) << body;
}

TEST(MetricsServer, BadOrTakenAddressNamesTheFlag) {
  auto bad = MetricsServer::Start("localhost", {});
  ASSERT_FALSE(bad.ok());
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "--metrics-listen"));
  auto first = MetricsServer::Start("127.0.0.1:0", {});
  ASSERT_TRUE(first.ok());
  auto second = MetricsServer::Start((*first)->address(), {});
  ASSERT_FALSE(second.ok());
  EXPECT_TRUE(absl::StrContains(second.status().message(), "--metrics-listen"))
      << second.status().message();
}

TEST(FileSd, ListsCoordinatorAndWorkersWithServiceLabels) {
  EXPECT_EQ(FileSdTargets("127.0.0.1:9460", {"127.0.0.1:1", "127.0.0.1:2"}),
            "[{\"targets\": [\"127.0.0.1:9460\"], \"labels\": {\"service\": \"coordinator\"}},\n"
            " {\"targets\": [\"127.0.0.1:1\", \"127.0.0.1:2\"], \"labels\": {\"service\": "
            "\"worker\"}}]\n");
  EXPECT_EQ(FileSdTargets("", {}), "[]\n");
}

TEST(FileSd, UnwritablePathIsAnErrorNamingIt) {
  absl::Status st = WriteFileSdTargets("/nonexistent-dir/targets.json", "127.0.0.1:1", {});
  ASSERT_FALSE(st.ok());
  EXPECT_TRUE(absl::StrContains(st.message(), "/nonexistent-dir/targets.json")) << st.message();
}

TEST(CertificateName, AWildcardCoversExactlyOneLeftmostLabelAndNoIpAddress) {
  EXPECT_TRUE(CertificateNameCovers("10.0.0.11", "10.0.0.11"));
  EXPECT_TRUE(CertificateNameCovers("Worker.Example", "worker.example"));
  const std::string wildcard = "*.pipemare-worker.pipemare.svc";
  EXPECT_TRUE(CertificateNameCovers(wildcard, "pipemare-worker-0.pipemare-worker.pipemare.svc"));
  EXPECT_TRUE(CertificateNameCovers(wildcard, "pipemare-worker-12.PIPEMARE-WORKER.pipemare.svc"));
  EXPECT_FALSE(CertificateNameCovers(wildcard, "pipemare-worker.pipemare.svc"));
  EXPECT_FALSE(CertificateNameCovers(wildcard, "a.b.pipemare-worker.pipemare.svc"));
  EXPECT_FALSE(CertificateNameCovers(wildcard, ".pipemare-worker.pipemare.svc"));
  EXPECT_FALSE(CertificateNameCovers(wildcard, "pipemare-worker-0.pipemare-worker.other.svc"));
  EXPECT_FALSE(CertificateNameCovers("*.com", "example.com"));
  EXPECT_FALSE(CertificateNameCovers("*.0.0.11", "10.0.0.11"));
  EXPECT_FALSE(CertificateNameCovers("worker.example", "evil-worker.example"));
}

}  // namespace
}  // namespace pipemare

namespace pipemare {
namespace {

// One process per port: gRPC's default SO_REUSEPORT let a second server
// bind a port that already served and take half its calls.
TEST(Ports, ASecondServerOnATakenPortIsRefusedNamingThePortAndTheFlag) {
  v1::Coordinator::Service first_service, second_service;
  int port = 0;
  auto first = StartServer("127.0.0.1:0", &first_service, &port, "--listen");
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_GT(port, 0);
  int second_port = 0;
  auto second =
      StartServer(absl::StrCat("127.0.0.1:", port), &second_service, &second_port, "--listen");
  ASSERT_FALSE(second.ok()) << "two servers on port " << port;
  EXPECT_TRUE(absl::StrContains(second.status().message(), absl::StrCat("port ", port)))
      << second.status().message();
  EXPECT_TRUE(absl::StrContains(second.status().message(), "another port with --listen"))
      << second.status().message();
  (*first)->Shutdown();

  auto health = HealthServer::Start("127.0.0.1:0", "", "--health-listen");
  ASSERT_TRUE(health.ok()) << health.status();
  auto again = HealthServer::Start((*health)->address(), "", "--health-listen");
  ASSERT_FALSE(again.ok());
  EXPECT_TRUE(absl::StrContains(again.status().message(), "--health-listen"))
      << again.status().message();
}

using ::pipemare::testing::MakeTempDir;
using ::pipemare::testing::ReadFile;

TEST(DevPki, WorkerFilesAreNamedAfterTheirHostAndAnExistingCaIsNotReplacedSilently) {
  DevPkiOptions options;
  options.dir = MakeTempDir() + "/pki";
  options.workers = {{"w1"}};
  options.name_workers_by_host = true;
  options.replace = false;
  auto pki = MakeDevPki(options);
  ASSERT_TRUE(pki.ok()) << pki.status();
  ASSERT_EQ(pki->worker_certs.size(), 1u);
  EXPECT_TRUE(absl::EndsWith(pki->worker_certs[0], "/worker-w1.pem")) << pki->worker_certs[0];
  EXPECT_EQ(CertificateHosts(ReadFile(pki->worker_certs[0])), std::vector<std::string>{"w1"});
  const std::string ca = ReadFile(pki->ca);
  auto again = MakeDevPki(options);
  ASSERT_FALSE(again.ok());
  EXPECT_TRUE(absl::StrContains(again.status().message(), "--force")) << again.status();
  EXPECT_EQ(ReadFile(pki->ca), ca) << "the CA was replaced";
  // One certificate for several hosts (compose, a wildcard) stays worker.pem.
  options.dir = MakeTempDir() + "/shared";
  options.workers = {{"worker-0", "worker-1"}};
  auto shared = MakeDevPki(options);
  ASSERT_TRUE(shared.ok()) << shared.status();
  EXPECT_TRUE(absl::EndsWith(shared->worker_certs[0], "/worker.pem"));
  EXPECT_EQ(CertificateHosts(ReadFile(shared->worker_certs[0])),
            (std::vector<std::string>{"worker-0", "worker-1"}));
}

TEST(AdvertisedHost, AWorkerBoundToEveryInterfaceAdvertisesANameItsCertificateHolds) {
  // No certificate (plaintext): the address toward the coordinator.
  EXPECT_EQ(AdvertisedHost("10.0.0.5", {}, "vm"), "10.0.0.5");
  // The certificate names that address.
  EXPECT_EQ(AdvertisedHost("10.0.0.5", {"w1", "10.0.0.5"}, "vm"), "10.0.0.5");
  // The certificate names this host's name (the README's recipe).
  EXPECT_EQ(AdvertisedHost("10.0.0.5", {"w1"}, "w1"), "w1");
  // A name that resolves to the address toward the coordinator.
  EXPECT_EQ(AdvertisedHost("127.0.0.1", {"localhost"}, "vm"), "localhost");
  // Nothing fits: the worker says so at start instead of being refused forever.
  EXPECT_EQ(AdvertisedHost("10.0.0.5", {"w1"}, "vm"), "");
}

}  // namespace
}  // namespace pipemare
