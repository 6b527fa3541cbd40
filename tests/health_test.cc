// Health for probes (common/health.h): the coordinator and a worker serve
// gRPC's health service on their --health-listen ports (the worker's set
// through PIPEMARE_HEALTH_LISTEN, as a container's environment would). The
// coordinator is ready once serving; the worker is live from its start and
// ready only while registered: it goes NOT_SERVING when its coordinator
// dies and SERVING again once it re-registered with the restarted one.
// Checked with the real `pipemarectl health` (what Docker's HEALTHCHECK
// runs). Label: multiprocess.
#include "common/health.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "tests/cluster.h"

namespace pipemare::testing {
namespace {

// A port nothing listens on now (the kernel's pick, released again).
int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

// `pipemarectl health ADDRESS [--service S]`: its exit code and stdout.
CommandResult Health(const std::string& address, const std::string& service = "") {
  std::vector<std::string> argv = {BinDir() + "/pipemarectl", "health", address};
  if (!service.empty()) argv.insert(argv.end(), {"--service", service});
  return Run(argv, 30);
}

bool Serving(const std::string& address, const std::string& service) {
  auto s = CheckServing(address, service, 2);
  return s.ok() && *s;
}

TEST(Health, ProbesSeeTheCoordinatorReadyAndAWorkerReadyOnlyWhileRegistered) {
  const std::string coordinator_health = absl::StrCat("127.0.0.1:", FreePort());
  Cluster cluster(0, {"--health-listen", coordinator_health});
  ASSERT_FALSE(cluster.address().empty()) << cluster.Logs();
  auto r = Health(coordinator_health);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, coordinator_health + ": SERVING\n");
  r = Health(coordinator_health, kCoordinatorServiceName);
  EXPECT_EQ(r.exit_code, 0) << r.err;

  const std::string worker_health = absl::StrCat("127.0.0.1:", FreePort());
  std::vector<std::string> argv = {BinDir() + "/pipemare-worker",
                                   "--coordinator",
                                   cluster.address(),
                                   "--listen",
                                   "127.0.0.1:0",
                                   "--coordinator-timeout",
                                   "2",
                                   "--metrics-listen",
                                   ""};
  for (const std::string& flag : WorkerTlsFlags()) argv.push_back(flag);
  setenv("PIPEMARE_HEALTH_LISTEN", worker_health.c_str(), 1);
  Process worker(argv, cluster.dir() + "/health-worker.log");
  unsetenv("PIPEMARE_HEALTH_LISTEN");
  ASSERT_TRUE(WaitFor(20, [&] { return Serving(worker_health, kWorkerServiceName); }))
      << worker.Log();
  EXPECT_EQ(Health(worker_health, kWorkerServiceName).exit_code, 0);
  // An unknown service name is no answer, not SERVING.
  r = Health(worker_health, "pipemare.v1.Nothing");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(absl::StrContains(r.err, "no answer")) << r.err;

  // The coordinator dies: the worker stays live but is not ready.
  cluster.coordinator().Signal(SIGKILL);
  cluster.coordinator().Wait(10);
  ASSERT_TRUE(WaitFor(20, [&] { return !Serving(worker_health, kWorkerServiceName); }))
      << worker.Log();
  r = Health(worker_health, kWorkerServiceName);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.out, absl::StrCat(kWorkerServiceName, " at ", worker_health, ": NOT_SERVING\n"));
  EXPECT_EQ(Health(worker_health).exit_code, 0) << "still live";
  EXPECT_NE(Health(coordinator_health).exit_code, 0);

  // Back: the worker registers again and is ready.
  cluster.StartCoordinator();
  ASSERT_FALSE(cluster.address().empty()) << cluster.Logs();
  EXPECT_TRUE(WaitFor(30, [&] { return Serving(worker_health, kWorkerServiceName); }))
      << worker.Log();
  EXPECT_TRUE(Serving(coordinator_health, kCoordinatorServiceName));
  EXPECT_TRUE(worker.Running());
}

}  // namespace
}  // namespace pipemare::testing
