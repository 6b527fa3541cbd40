// Observability, end to end: Debian's real Prometheus server scrapes a real
// coordinator and real workers every second while a short job trains; then
// its HTTP API must show every target up and data for every PromQL
// expression of the Grafana dashboard (template variables substituted).
// promtool checks each service's /metrics exposition. Label: multiprocess.
#include <arpa/inet.h>
#include <curl/curl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "common/metrics.h"
#include "tests/cluster.h"

namespace pipemare::testing {
namespace {

using nlohmann::json;

std::string UrlEncode(const std::string& s) {
  CURL* curl = curl_easy_init();
  char* e = curl_easy_escape(curl, s.c_str(), static_cast<int>(s.size()));
  std::string out(e);
  curl_free(e);
  curl_easy_cleanup(curl);
  return out;
}

int FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

// Every "expr" of every panel target, rows and nested panels included.
void CollectExprs(const json& node, std::vector<std::string>* out) {
  if (node.is_object()) {
    if (node.contains("targets") && node["targets"].is_array()) {
      for (const auto& t : node["targets"]) {
        if (t.contains("expr")) out->push_back(t["expr"].get<std::string>());
      }
    }
    for (const auto& [key, value] : node.items()) {
      if (key != "targets") CollectExprs(value, out);
    }
  } else if (node.is_array()) {
    for (const auto& v : node) CollectExprs(v, out);
  }
}

std::string Dashboard() {
  return ReadFile(std::string(PIPEMARE_SOURCE_DIR) + "/deploy/grafana/dashboards/pipemare.json");
}

TEST(Observability, DashboardParsesAndUsesOnlyItsVariables) {
  const json dashboard = json::parse(Dashboard());
  std::vector<std::string> exprs;
  CollectExprs(dashboard, &exprs);
  EXPECT_GE(exprs.size(), 20u);
  for (const auto& e : exprs) {
    std::string rest =
        absl::StrReplaceAll(e, {{"$job_id", ""}, {"$stage", ""}, {"$__rate_interval", ""}});
    EXPECT_EQ(rest.find('$'), std::string::npos) << "unknown variable in: " << e;
  }
}

TEST(Observability, PrometheusScrapesEveryTargetAndEveryPanelHasData) {
  const std::string prometheus = "/usr/bin/prometheus";
  const std::string promtool = "/usr/bin/promtool";
  ASSERT_EQ(access(prometheus.c_str(), X_OK), 0)
      << "install Debian's prometheus (scripts/dev.sh deps does)";

  // Two pipelines of two stages: the replicas' panels have data too.
  Cluster cluster(4, {"--log-format", "json"});
  ASSERT_TRUE(cluster.ok()) << cluster.Logs();
  ASSERT_FALSE(cluster.metrics_address().empty()) << cluster.Logs();
  std::vector<std::string> worker_targets;
  const v1::ListWorkersResponse workers = cluster.Workers();  // (not a temporary: it is iterated)
  for (const auto& w : workers.workers()) {
    ASSERT_FALSE(w.metrics_address().empty()) << "worker " << w.id() << " reported no metrics";
    worker_targets.push_back(w.metrics_address());
  }

  // promtool lints each service's exposition (before and after a job).
  auto check_metrics = [&](const std::string& target) {
    const std::string text = HttpGet("http://" + target + "/metrics");
    ASSERT_FALSE(text.empty()) << target;
    const std::string file = absl::StrCat(cluster.dir(), "/metrics-", FreePort(), ".txt");
    std::ofstream(file) << text;
    auto r = pipemare::testing::Run(
        {"/bin/sh", "-c", absl::StrCat(promtool, " check metrics < ", file)}, 30);
    EXPECT_EQ(r.exit_code, 0) << target << ": " << r.out << r.err;
  };
  check_metrics(cluster.metrics_address());
  for (const auto& t : worker_targets) check_metrics(t);

  // A real Prometheus on a free loopback port running the repository's own
  // local configuration (scrapes every second; targets from a file_sd file).
  const int port = FreePort();
  const std::string config = cluster.dir() + "/prometheus.yml";
  std::filesystem::copy_file(std::string(PIPEMARE_SOURCE_DIR) + "/deploy/prometheus/local.yml",
                             config, std::filesystem::copy_options::overwrite_existing);
  std::filesystem::create_directories(cluster.dir() + "/targets");
  ASSERT_TRUE(WriteFileSdTargets(cluster.dir() + "/targets/cluster.json", cluster.metrics_address(),
                                 worker_targets)
                  .ok());
  auto check = pipemare::testing::Run({promtool, "check", "config", config}, 30);
  ASSERT_EQ(check.exit_code, 0) << check.out << check.err;
  Process server(
      {prometheus, "--config.file=" + config, "--storage.tsdb.path=" + cluster.dir() + "/tsdb",
       absl::StrCat("--web.listen-address=127.0.0.1:", port)},
      cluster.dir() + "/prometheus.log");
  const std::string api = absl::StrCat("http://127.0.0.1:", port);
  ASSERT_TRUE(WaitFor(60, [&] { return !HttpGet(api + "/-/ready").empty(); }))
      << "prometheus did not become ready:\n"
      << server.Log();

  // Prometheus discovers every target from the file and scrapes it before the job starts.
  auto targets_up = [&] {
    const std::string body = HttpGet(api + "/api/v1/targets");
    if (body.empty()) return false;
    const json active = json::parse(body)["data"]["activeTargets"];
    size_t up = 0;
    for (const auto& t : active) up += t["health"] == "up";
    return active.size() == 1 + worker_targets.size() && up == active.size();
  };
  ASSERT_TRUE(WaitFor(30, targets_up)) << HttpGet(api + "/api/v1/targets") << server.Log();

  const auto start = std::chrono::system_clock::now();
  const std::string spec = cluster.WriteSpec(
      "obs", absl::StrReplaceAll(ShortSpec("obs", "pipemare", 2, 12800, 2),
                                 {{"microbatch_size: 32,", "microbatch_size: 32, replicas: 2,"}}));
  const std::string job_id = cluster.Submit(spec);
  ASSERT_FALSE(job_id.empty()) << cluster.Logs();
  v1::JobStatus job = cluster.WaitForEnd(job_id, 300);
  ASSERT_EQ(job.state(), v1::SUCCEEDED) << job.reason() << cluster.Logs();
  std::this_thread::sleep_for(std::chrono::seconds(3));  // the last scrapes

  // Every target up.
  const json targets = json::parse(HttpGet(api + "/api/v1/targets"));
  ASSERT_EQ(targets["status"], "success");
  const auto& active = targets["data"]["activeTargets"];
  EXPECT_EQ(active.size(), 1 + worker_targets.size());
  for (const auto& t : active) {
    EXPECT_EQ(t["health"], "up") << t.dump();
  }

  // Every dashboard expression has data for this job over its run.
  std::vector<std::string> exprs;
  CollectExprs(json::parse(Dashboard()), &exprs);
  ASSERT_FALSE(exprs.empty());
  const double from = std::chrono::duration<double>(start.time_since_epoch()).count() - 2;
  const double to =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  for (const auto& e : exprs) {
    const std::string q =
        absl::StrReplaceAll(e, {{"$job_id", job_id}, {"$stage", ".*"}, {"$__rate_interval", "4s"}});
    const std::string body =
        HttpGet(absl::StrCat(api, "/api/v1/query_range?query=", UrlEncode(q),
                             absl::StrFormat("&start=%.3f&end=%.3f&step=1", from, to)));
    ASSERT_FALSE(body.empty()) << "query failed: " << q;
    const json r = json::parse(body);
    bool finite = false;
    for (const auto& series : r["data"]["result"]) {
      for (const auto& point : series["values"]) {
        const std::string v = point[1].get<std::string>();
        if (v != "NaN" && v != "+Inf" && v != "-Inf") finite = true;
      }
    }
    EXPECT_TRUE(finite) << "no data for: " << q << "\n" << body.substr(0, 300);
  }

  // Every template variable's label_values() query offers this job and its stages.
  const json dashboard = json::parse(Dashboard());
  for (const auto& variable : dashboard["templating"]["list"]) {
    if (variable["type"] != "query") continue;
    const std::string query = variable["query"]["query"];
    // label_values(SELECTOR, LABEL)
    ASSERT_EQ(query.rfind("label_values(", 0), 0u) << query;
    const size_t comma = query.rfind(',');
    const std::string selector =
        absl::StrReplaceAll(query.substr(13, comma - 13), {{"$job_id", job_id}});
    const std::string label(
        absl::StripAsciiWhitespace(query.substr(comma + 1, query.size() - comma - 2)));
    const json values = json::parse(HttpGet(
        absl::StrCat(api, "/api/v1/label/", label, "/values?match[]=", UrlEncode(selector))));
    const std::string expected = label == "job_id" ? job_id : "0";
    bool found = false;
    for (const auto& v : values["data"]) found |= v == expected;
    EXPECT_TRUE(found) << variable["name"] << ": " << values.dump();
  }

  // Metrics stay for the finished job, and the exposition still lints.
  check_metrics(cluster.metrics_address());
  for (const auto& t : worker_targets) check_metrics(t);
  const std::string worker0 = HttpGet("http://" + worker_targets[0] + "/metrics");
  EXPECT_NE(worker0.find(absl::StrCat("job_id=\"", job_id, "\"")), std::string::npos);
  server.Signal(SIGTERM);
  server.Wait(10);

  // Logs: the coordinator (--log-format json) writes one JSON object per
  // line with time and level, and job events carry the job and the stage.
  std::istringstream coordinator_log(cluster.coordinator().Log());
  std::string line;
  bool lifecycle = false, assignment = false;
  while (std::getline(coordinator_log, line)) {
    if (line.empty()) continue;
    json event;
    ASSERT_NO_THROW(event = json::parse(line)) << "not JSON: " << line;
    EXPECT_TRUE(event.contains("time") && event.contains("level") && event.contains("msg")) << line;
    if (event.value("job_id", "") == job_id) {
      lifecycle |= event["msg"] == "RUNNING -> SUCCEEDED";
      assignment |= event.contains("stage") &&
                    event["msg"].get<std::string>().find("assigned to worker") != std::string::npos;
    }
  }
  EXPECT_TRUE(lifecycle && assignment) << cluster.coordinator().Log();
  // Workers log text lines with the job and the stage.
  EXPECT_NE(cluster.worker(0).Log().find(absl::StrCat(" INFO job=", job_id, " stage=")),
            std::string::npos)
      << cluster.worker(0).Log();
}

}  // namespace
}  // namespace pipemare::testing
