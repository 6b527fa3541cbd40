// Unit tests of common/: the event log's line format, the /metrics server and
// the Prometheus file_sd targets file.
#include <gtest/gtest.h>
#include <prometheus/counter.h>
#include <prometheus/registry.h>

#include "absl/strings/match.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/security.h"
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
