// A cluster on separate network hosts: the coordinator and each worker in a
// network namespace of its own (`ip netns`), joined by a bridge, no loopback
// between them, all sharing one hostname (as cloned VMs and containers do).
// Every process is started with the README's own flags and no --advertise.
// Needs root and iproute2; the test says why and skips without them (CI runs
// as root and runs it). Label: multiprocess.
//
// A second test cuts one worker's link mid-job with every process alive and
// checks that the job recovers without it and that, its link back, the
// cut-off worker commits nothing (fencing).
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/strip.h"
#include "tests/cluster.h"
#include "tests/process.h"

namespace pipemare::testing {
namespace {

constexpr int kWorkers = 4;

// The namespaces, bridge and veth pairs of one test, removed on destruction.
class Hosts {
 public:
  Hosts() : tag_(absl::StrCat("pm", getpid() % 100000)) {}
  ~Hosts() {
    for (const auto& ns : namespaces_) Ip({"netns", "del", ns});
    Ip({"link", "del", bridge()});
  }

  // Makes the bridge (10.77.0.254/24 on the host side, for the client) and
  // `count` hosts 10.77.0.1, .11, .12, ...; "" on success, else why not.
  std::string Make(int count) {
    if (geteuid() != 0) return "not root: cannot create network namespaces";
    if (!Ip({"link", "add", bridge(), "type", "bridge"}))
      return "ip link add ... type bridge failed";
    Ip({"addr", "add", "10.77.0.254/24", "dev", bridge()});
    Ip({"link", "set", bridge(), "up"});
    for (int i = 0; i < count; ++i) {
      const std::string ns = Namespace(i);
      if (!Ip({"netns", "add", ns})) return "ip netns add failed";
      namespaces_.push_back(ns);
      const std::string host_end = absl::StrCat(tag_, "h", i), ns_end = absl::StrCat(tag_, "n", i);
      if (!Ip({"link", "add", host_end, "type", "veth", "peer", "name", ns_end}) ||
          !Ip({"link", "set", ns_end, "netns", ns}) ||
          !Ip({"link", "set", host_end, "master", bridge()}) ||
          !Ip({"link", "set", host_end, "up"}) ||
          !Ip({"-n", ns, "addr", "add", absl::StrCat(Address(i), "/24"), "dev", ns_end}) ||
          !Ip({"-n", ns, "link", "set", ns_end, "up"}) ||
          // As on any host: a process reaches its own address over lo (the
          // all-reduce store's server connects to itself).
          !Ip({"-n", ns, "link", "set", "lo", "up"})) {
        return "cannot wire a veth pair into the bridge";
      }
    }
    return "";
  }

  std::string Namespace(int i) const { return absl::StrCat(tag_, "-host", i); }
  // Takes host i's link to the bridge down (every process stays alive) or
  // brings it back.
  bool SetLink(int i, bool up) {
    return Ip({"link", "set", absl::StrCat(tag_, "h", i), up ? "up" : "down"});
  }
  // Host 0 is the coordinator's.
  static std::string Address(int i) {
    return i == 0 ? "10.77.0.1" : absl::StrCat("10.77.0.", 10 + i);
  }
  // argv run inside host i.
  std::vector<std::string> In(int i, std::vector<std::string> argv) const {
    argv.insert(argv.begin(), {"/usr/sbin/ip", "netns", "exec", Namespace(i)});
    return argv;
  }

 private:
  std::string bridge() const { return tag_ + "br"; }
  static bool Ip(std::vector<std::string> args) {
    args.insert(args.begin(), "/usr/sbin/ip");
    return Run(args, 20).exit_code == 0;
  }
  std::string tag_;
  std::vector<std::string> namespaces_;
};

// Certificates for the hosts: the coordinator's names 10.77.0.1, worker i's
// (worker_certs[i - 1]) names host i's address, as a cluster's would.
const DevPki& HostsPki() {
  static const DevPki* pki = [] {
    DevPkiOptions options;
    options.dir = MakeTempDir() + "/hosts-pki";
    options.coordinator_hosts = {Hosts::Address(0)};
    options.workers.clear();
    for (int i = 1; i <= 8; ++i) options.workers.push_back({Hosts::Address(i)});
    return new DevPki(MakeDevPki(options).value());
  }();
  return *pki;
}

std::vector<std::string> HostWorkerTls(int i) {
  const DevPki& pki = HostsPki();
  return {"--tls-ca",   pki.ca,
          "--tls-cert", pki.worker_certs[i - 1],
          "--tls-key",  pki.worker_keys[i - 1]};
}

// The README's processes on separate hosts: the coordinator on host 0
// (`--listen 0.0.0.0:7070 --state-dir DIR`, plus `coordinator_flags`), a
// worker on each of hosts 1..workers (`--coordinator HOST:7070 --listen
// 0.0.0.0:7071 --device cpu`), and the client on the host side of the
// bridge, as from a laptop.
struct HostCluster {
  HostCluster(const Hosts& hosts, int workers, const std::string& dir,
              std::vector<std::string> coordinator_flags = {}) {
    std::vector<std::string> argv = {BinDir() + "/pipemare-coordinator", "--listen", "0.0.0.0:7070",
                                     "--state-dir", dir + "/state"};
    argv.insert(argv.end(), coordinator_flags.begin(), coordinator_flags.end());
    const DevPki& pki = HostsPki();
    argv.insert(argv.end(), {"--tls-ca", pki.ca, "--tls-cert", pki.coordinator_cert, "--tls-key",
                             pki.coordinator_key, "--tokens-file", pki.tokens});
    coordinator = std::make_unique<Process>(hosts.In(0, argv), dir + "/coordinator.log");
    for (int i = 1; i <= workers; ++i) {
      std::vector<std::string> worker = {BinDir() + "/pipemare-worker",
                                         "--coordinator",
                                         "10.77.0.1:7070",
                                         "--listen",
                                         "0.0.0.0:7071",
                                         "--device",
                                         "cpu",
                                         "--threads",
                                         "1"};
      for (const std::string& flag : HostWorkerTls(i)) worker.push_back(flag);
      this->workers.push_back(
          std::make_unique<Process>(hosts.In(i, worker), absl::StrCat(dir, "/worker-", i, ".log")));
    }
  }
  std::string Logs() const {
    std::string all = coordinator->Log();
    for (auto& w : workers) absl::StrAppend(&all, "\n--- worker\n", w->Log());
    return all;
  }
  static CommandResult Ctl(std::vector<std::string> args, double timeout) {
    args.insert(args.begin(), {BinDir() + "/pipemarectl", "--coordinator", "10.77.0.1:7070",
                               "--tls-ca", HostsPki().ca, "--token-file", HostsPki().submit_token});
    return pipemare::testing::Run(args, timeout);
  }
  std::unique_ptr<Process> coordinator;
  std::vector<std::unique_ptr<Process>> workers;
};

TEST(SeparateHosts, TheExampleTrainsOnHostsThatShareAHostnameWithTheReadmesFlags) {
  Hosts hosts;
  const std::string why = hosts.Make(1 + kWorkers);
  if (!why.empty()) GTEST_SKIP() << "cannot make network hosts here: " << why;
  const std::string dir = MakeTempDir();
  HostCluster cluster(hosts, kWorkers, dir);
  auto logs = [&] { return cluster.Logs(); };
  const auto ctl = HostCluster::Ctl;
  ASSERT_TRUE(WaitFor(60, [&] {
    auto r = ctl({"workers"}, 10);
    int idle = 0;
    for (size_t at = r.out.find("IDLE"); at != std::string::npos; at = r.out.find("IDLE", at + 1)) {
      ++idle;
    }
    return idle == kWorkers;
  })) << logs();
  // Each worker advertises its own address on the shared network.
  auto listed = ctl({"workers"}, 10);
  for (int i = 1; i <= kWorkers; ++i) {
    EXPECT_TRUE(absl::StrContains(listed.out, absl::StrCat(Hosts::Address(i), ":7071")))
        << listed.out;
  }
  const std::string spec = absl::StrCat(dir, "/spec.yaml");
  FILE* f = fopen(spec.c_str(), "w");
  fputs(ShortSpec("separate-hosts", "pipemare", kWorkers, 6400).c_str(), f);
  fclose(f);
  auto submit = ctl({"submit", spec, "--wait"}, 300);
  EXPECT_EQ(submit.exit_code, 0) << submit.out << submit.err << logs();
  EXPECT_TRUE(absl::StrContains(submit.out, "SUCCEEDED")) << submit.out;
  // No eviction loop: each worker registered once.
  const std::string log = cluster.coordinator->Log();
  int registrations = 0;
  for (size_t at = log.find("registered from"); at != std::string::npos;
       at = log.find("registered from", at + 1)) {
    ++registrations;
  }
  EXPECT_EQ(registrations, kWorkers) << log;

  // A fifth process claiming worker 1's address (with worker 1's
  // certificate, as a cloned host would have) is refused, naming the
  // address and the fix, and evicts nobody.
  std::vector<std::string> impostor_argv = {BinDir() + "/pipemare-worker",
                                            "--coordinator",
                                            "10.77.0.1:7070",
                                            "--listen",
                                            "0.0.0.0:7072",
                                            "--advertise",
                                            absl::StrCat(Hosts::Address(1), ":7071"),
                                            "--metrics-listen",
                                            "0.0.0.0:9462",
                                            "--threads",
                                            "1"};
  for (const std::string& flag : HostWorkerTls(1)) impostor_argv.push_back(flag);
  Process impostor(hosts.In(2, impostor_argv), dir + "/impostor.log");
  EXPECT_TRUE(WaitFor(20, [&] {
    return absl::StrContains(impostor.Log(), "--advertise HOST:PORT");
  })) << impostor.Log();
  EXPECT_TRUE(absl::StrContains(impostor.Log(), absl::StrCat(Hosts::Address(1), ":7071")));
  auto after = ctl({"workers"}, 10);
  int idle = 0;
  for (size_t at = after.out.find("IDLE"); at != std::string::npos;
       at = after.out.find("IDLE", at + 1)) {
    ++idle;
  }
  EXPECT_EQ(idle, kWorkers) << after.out;
}

// The README's cluster recipe as written, host names included: `dev-ca
// --coordinator-host coord --worker-host w1 --worker-host w2`, the workers'
// worker-wN.pem, `--listen 0.0.0.0:7071` and no --advertise. Each host
// resolves the names through its own hosts file (`ip netns exec` mounts
// /etc/netns/NS/hosts), and all share one hostname, so a worker must find
// which name its certificate gives it.
TEST(SeparateHosts, TheReadmesClusterRecipeWithHostNamesTrainsAndARefusedWorkerSaysWhy) {
  constexpr int kNamed = 2;
  Hosts hosts;
  const std::string why = hosts.Make(1 + kNamed + 1);
  if (!why.empty()) GTEST_SKIP() << "cannot make network hosts here: " << why;
  const std::string names = absl::StrCat("127.0.0.1 localhost\n", Hosts::Address(0), " coord\n",
                                         Hosts::Address(1), " w1\n", Hosts::Address(2), " w2\n");
  std::vector<std::string> etc;
  for (int i = 0; i <= kNamed + 1; ++i) {
    etc.push_back("/etc/netns/" + hosts.Namespace(i));
    std::filesystem::create_directories(etc.back());
    std::ofstream(etc.back() + "/hosts") << names;
  }
  struct Cleanup {
    std::vector<std::string> dirs;
    ~Cleanup() {
      for (const auto& d : dirs) std::filesystem::remove_all(d);
    }
  } cleanup{etc};
  const std::string dir = MakeTempDir();
  const std::string pki = dir + "/pki";
  auto ca = pipemare::testing::Run(
      {BinDir() + "/pipemarectl", "dev-ca", "--out", pki, "--coordinator-host", "coord",
       "--worker-host", "w1", "--worker-host", "w2"},
      30);
  ASSERT_EQ(ca.exit_code, 0) << ca.out << ca.err;
  EXPECT_TRUE(absl::StrContains(ca.out, "worker-w1.pem")) << ca.out;
  // Run again, it keeps the CA that the services already trust.
  auto again = pipemare::testing::Run(
      {BinDir() + "/pipemarectl", "dev-ca", "--out", pki, "--worker-host", "w1"}, 30);
  EXPECT_NE(again.exit_code, 0);
  EXPECT_TRUE(absl::StrContains(again.err, "--force")) << again.err;

  Process coordinator(hosts.In(0, {BinDir() + "/pipemare-coordinator", "--listen", "0.0.0.0:7070",
                                   "--state-dir", dir + "/state", "--tls-ca", pki + "/ca.pem",
                                   "--tls-cert", pki + "/coordinator.pem", "--tls-key",
                                   pki + "/coordinator.key", "--tokens-file", pki + "/tokens"}),
                      dir + "/coordinator.log");
  std::vector<std::unique_ptr<Process>> workers;
  for (int i = 1; i <= kNamed; ++i) {
    const std::string w = absl::StrCat(pki, "/worker-w", i);
    workers.push_back(std::make_unique<Process>(
        hosts.In(i, {BinDir() + "/pipemare-worker", "--coordinator", "coord:7070", "--listen",
                     "0.0.0.0:7071", "--device", "cpu", "--threads", "1", "--tls-ca",
                     pki + "/ca.pem", "--tls-cert", w + ".pem", "--tls-key", w + ".key"}),
        absl::StrCat(dir, "/worker-", i, ".log")));
  }
  auto logs = [&] {
    std::string all = coordinator.Log();
    for (auto& w : workers) absl::StrAppend(&all, "\n--- worker\n", w->Log());
    return all;
  };
  // The client as the README has it, from another host of the network.
  auto ctl = [&](std::vector<std::string> args, double timeout) {
    args.insert(args.begin(), {BinDir() + "/pipemarectl", "--coordinator", "coord:7070", "--tls-ca",
                               pki + "/ca.pem", "--token-file", pki + "/submit.token"});
    return pipemare::testing::Run(hosts.In(kNamed + 1, args), timeout);
  };
  ASSERT_TRUE(WaitFor(60, [&] {
    auto r = ctl({"workers"}, 10);
    return absl::StrContains(r.out, "w1:7071") && absl::StrContains(r.out, "w2:7071");
  })) << logs();
  const std::string spec = dir + "/spec.yaml";
  std::ofstream(spec) << ShortSpec("recipe", "pipemare", kNamed, 3200);
  auto submit = ctl({"submit", spec, "--wait"}, 300);
  EXPECT_EQ(submit.exit_code, 0) << submit.out << submit.err << logs();
  EXPECT_TRUE(absl::StrContains(submit.out, "SUCCEEDED")) << submit.out;

  // A worker on the third host with w1's certificate: no name it holds is
  // this host, and it says so at start instead of being refused forever.
  const std::string w1 = pki + "/worker-w1";
  Process misplaced(
      hosts.In(3, {BinDir() + "/pipemare-worker", "--coordinator", "coord:7070", "--listen",
                   "0.0.0.0:7071", "--threads", "1", "--tls-ca", pki + "/ca.pem", "--tls-cert",
                   w1 + ".pem", "--tls-key", w1 + ".key"}),
      dir + "/misplaced.log");
  EXPECT_EQ(misplaced.Wait(20), 2) << misplaced.Log();
  EXPECT_TRUE(absl::StrContains(misplaced.Log(), "certificate names w1")) << misplaced.Log();
  // With --advertise a name its certificate lacks, the coordinator refuses
  // it and the worker's own log says why.
  Process refused(
      hosts.In(3, {BinDir() + "/pipemare-worker", "--coordinator", "coord:7070", "--listen",
                   "0.0.0.0:7072", "--advertise", absl::StrCat(Hosts::Address(3), ":7072"),
                   "--threads", "1", "--metrics-listen", "", "--tls-ca", pki + "/ca.pem",
                   "--tls-cert", w1 + ".pem", "--tls-key", w1 + ".key"}),
      dir + "/refused.log");
  EXPECT_TRUE(WaitFor(20, [&] {
    return absl::StrContains(refused.Log(),
                             "refused this worker: this worker's certificate "
                             "names w1");
  })) << refused.Log();
}

TEST(SeparateHosts, TwoReplicasOfTwoStagesTrainOnFourHostsWithTheReadmesTls) {
  // schedule.replicas: 2 pipelines of 2 stages, each worker on its own host
  // with the README's certificates; each stage's replicas meet for their
  // all-reduce at the address replica 0's stage gives the coordinator.
  constexpr int kWorkers = 4;
  Hosts hosts;
  const std::string why = hosts.Make(1 + kWorkers + 1);
  if (!why.empty()) GTEST_SKIP() << "cannot make network hosts here: " << why;
  std::string names = absl::StrCat("127.0.0.1 localhost\n", Hosts::Address(0), " coord\n");
  for (int i = 1; i <= kWorkers; ++i) absl::StrAppend(&names, Hosts::Address(i), " w", i, "\n");
  std::vector<std::string> etc;
  for (int i = 0; i <= kWorkers + 1; ++i) {
    etc.push_back("/etc/netns/" + hosts.Namespace(i));
    std::filesystem::create_directories(etc.back());
    std::ofstream(etc.back() + "/hosts") << names;
  }
  struct Cleanup {
    std::vector<std::string> dirs;
    ~Cleanup() {
      for (const auto& d : dirs) std::filesystem::remove_all(d);
    }
  } cleanup{etc};
  const std::string dir = MakeTempDir();
  const std::string pki = dir + "/pki";
  std::vector<std::string> ca_args = {BinDir() + "/pipemarectl", "dev-ca", "--out", pki,
                                      "--coordinator-host",      "coord"};
  for (int i = 1; i <= kWorkers; ++i) {
    ca_args.push_back("--worker-host");
    ca_args.push_back(absl::StrCat("w", i));
  }
  auto ca = pipemare::testing::Run(ca_args, 30);
  ASSERT_EQ(ca.exit_code, 0) << ca.out << ca.err;
  Process coordinator(hosts.In(0, {BinDir() + "/pipemare-coordinator", "--listen", "0.0.0.0:7070",
                                   "--state-dir", dir + "/state", "--tls-ca", pki + "/ca.pem",
                                   "--tls-cert", pki + "/coordinator.pem", "--tls-key",
                                   pki + "/coordinator.key", "--tokens-file", pki + "/tokens"}),
                      dir + "/coordinator.log");
  std::vector<std::unique_ptr<Process>> workers;
  for (int i = 1; i <= kWorkers; ++i) {
    const std::string w = absl::StrCat(pki, "/worker-w", i);
    workers.push_back(std::make_unique<Process>(
        hosts.In(i, {BinDir() + "/pipemare-worker", "--coordinator", "coord:7070", "--listen",
                     "0.0.0.0:7071", "--device", "cpu", "--threads", "1", "--tls-ca",
                     pki + "/ca.pem", "--tls-cert", w + ".pem", "--tls-key", w + ".key"}),
        absl::StrCat(dir, "/worker-", i, ".log")));
  }
  auto logs = [&] {
    std::string all = coordinator.Log();
    for (auto& w : workers) absl::StrAppend(&all, "\n--- worker\n", w->Log());
    return all;
  };
  auto ctl = [&](std::vector<std::string> args, double timeout) {
    args.insert(args.begin(), {BinDir() + "/pipemarectl", "--coordinator", "coord:7070", "--tls-ca",
                               pki + "/ca.pem", "--token-file", pki + "/submit.token"});
    return pipemare::testing::Run(hosts.In(kWorkers + 1, args), timeout);
  };
  ASSERT_TRUE(WaitFor(60, [&] {
    auto r = ctl({"workers"}, 10);
    for (int i = 1; i <= kWorkers; ++i) {
      if (!absl::StrContains(r.out, absl::StrCat("w", i, ":7071"))) return false;
    }
    return true;
  })) << logs();
  const std::string spec = dir + "/spec.yaml";
  std::ofstream(spec) << absl::StrReplaceAll(
      ShortSpec("replicas", "gpipe", 2, 3200),
      {{"microbatch_size: 32,", "microbatch_size: 32, replicas: 2,"}});
  auto submit = ctl({"submit", spec, "--wait"}, 300);
  EXPECT_EQ(submit.exit_code, 0) << submit.out << submit.err << logs();
  EXPECT_TRUE(absl::StrContains(submit.out, "SUCCEEDED")) << submit.out;
  auto status = ctl({"status", "job-1"}, 30);
  EXPECT_TRUE(absl::StrContains(status.out, "2 pipelines of 2 stages (4 workers)")) << status.out;
  EXPECT_TRUE(absl::StrContains(logs(), "replica 1 of 2 joined the stage's all-reduce group"))
      << logs();
}

TEST(SeparateHosts, ACutLinkCostsTheStepsSinceTheCutAndTheCutOffWorkerCommitsNothing) {
  constexpr int kStages = 3;
  constexpr int kHosts = kStages + 1;  // one spare
  Hosts hosts;
  const std::string why = hosts.Make(1 + kHosts);
  if (!why.empty()) GTEST_SKIP() << "cannot make network hosts here: " << why;
  const std::string dir = MakeTempDir();
  // Checkpoints on a directory every host reaches (namespaces share the
  // filesystem, as a shared volume would).
  HostCluster cluster(hosts, kHosts, dir, {"--worker-timeout", "3"});
  auto logs = [&] { return cluster.Logs(); };
  const auto ctl = HostCluster::Ctl;
  auto status = [&](const std::string& id) {
    v1::JobStatus s;
    auto r = ctl({"status", id, "--output", "json"}, 20);
    if (r.exit_code == 0) ParseJson(r.out, &s);
    return s;
  };
  auto idle = [&] {
    v1::ListWorkersResponse w;
    auto r = ctl({"workers", "--output", "json"}, 20);
    if (r.exit_code == 0) ParseJson(r.out, &w);
    int n = 0;
    for (const auto& x : w.workers()) n += x.state() == v1::IDLE;
    return n;
  };
  ASSERT_TRUE(WaitFor(60, [&] { return idle() == kHosts; })) << logs();

  const std::string spec = absl::StrCat(dir, "/spec.yaml");
  FILE* f = fopen(spec.c_str(), "w");
  fputs(absl::StrCat(ShortSpec("cut-link", "pipemare", kStages, 12800, 4),
                     "checkpoint: {every_steps: 50, keep: 10, dir: ", dir, "/checkpoints}\n")
            .c_str(),
        f);
  fclose(f);
  auto submitted = ctl({"submit", spec, "--output", "json"}, 30);
  v1::JobStatus sub;
  ASSERT_TRUE(ParseJson(submitted.out, &sub)) << submitted.out << submitted.err;
  const std::string id = sub.id();
  v1::JobStatus job;
  ASSERT_TRUE(WaitFor(120, [&] {
    job = status(id);
    return job.checkpoint().step() >= 100;
  })) << logs();
  // The middle stage's host loses its link; its processes live on.
  int victim = 0;
  for (const auto& s : job.stages()) {
    if (s.index() != 1) continue;
    for (int i = 1; i <= kHosts; ++i) {
      if (absl::StartsWith(s.worker_address(), Hosts::Address(i) + ":")) victim = i;
    }
  }
  ASSERT_GT(victim, 0) << job.DebugString();
  ASSERT_TRUE(hosts.SetLink(victim, false));
  // Recovered onto the spare while the link is still down.
  ASSERT_TRUE(WaitFor(120, [&] {
    job = status(id);
    return job.restarts_size() == 1 && job.state() == v1::RUNNING &&
           job.restarts(0).recover_seconds() > 0;
  })) << logs();
  EXPECT_EQ(job.restarts(0).stage(), 1);
  EXPECT_GE(job.generation(), 2);
  ASSERT_TRUE(hosts.SetLink(victim, true));
  // The link is back while the job still trains: the cut-off worker, its
  // stage of generation 1 still loaded, must not get anything in.
  EXPECT_EQ(status(id).state(), v1::RUNNING);
  job = status(id);
  for (int i = 0; i < 300 && job.state() == v1::RUNNING; ++i) {
    std::this_thread::sleep_for(std::chrono::seconds(1));
    job = status(id);
  }
  ASSERT_EQ(job.state(), v1::SUCCEEDED) << job.DebugString() << logs();
  EXPECT_GE(job.metrics().test_accuracy(), 0.9);
  // The cut-off worker comes back as a fresh idle worker.
  EXPECT_TRUE(WaitFor(60, [&] { return idle() == kHosts; })) << logs();

  // Fencing: every manifest committed by a run of generation g names only
  // files written by generation g, and "latest" is the last run's.
  int manifests = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir + "/checkpoints/" + id)) {
    const auto path = entry.path() / "manifest.json";
    if (!std::filesystem::exists(path)) continue;
    const nlohmann::json m = nlohmann::json::parse(ReadFile(path.string()));
    const int64_t generation = m.at("generation").get<int64_t>();
    for (const auto& file : m.at("files")) {
      EXPECT_TRUE(absl::StrContains(file.at("file").get<std::string>(),
                                    absl::StrCat(".g", generation, ".pt")))
          << path << ": " << file.dump();
    }
    ++manifests;
  }
  EXPECT_GT(manifests, 1);
  const std::string latest = ReadFile(dir + "/checkpoints/" + id + "/latest");
  const nlohmann::json last = nlohmann::json::parse(ReadFile(absl::StrCat(
      dir, "/checkpoints/", id, "/", absl::StripAsciiWhitespace(latest), "/manifest.json")));
  EXPECT_EQ(last.at("generation").get<int64_t>(), job.generation());
  if (getenv("PIPEMARE_TEST_LOGS") != nullptr) std::cout << logs() << std::endl;
}

}  // namespace
}  // namespace pipemare::testing
