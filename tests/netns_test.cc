// A cluster on separate network hosts: the coordinator and each worker in a
// network namespace of its own (`ip netns`), joined by a bridge, no loopback
// between them, all sharing one hostname (as cloned VMs and containers do).
// Every process is started with the README's own flags and no --advertise.
// Needs root and iproute2; the test says why and skips without them (CI runs
// as root and runs it). Label: multiprocess.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <memory>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
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
          !Ip({"-n", ns, "link", "set", ns_end, "up"})) {
        return "cannot wire a veth pair into the bridge";
      }
    }
    return "";
  }

  std::string Namespace(int i) const { return absl::StrCat(tag_, "-host", i); }
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

TEST(SeparateHosts, TheExampleTrainsOnHostsThatShareAHostnameWithTheReadmesFlags) {
  Hosts hosts;
  const std::string why = hosts.Make(1 + kWorkers);
  if (!why.empty()) GTEST_SKIP() << "cannot make network hosts here: " << why;
  const std::string dir = MakeTempDir();
  // README: pipemare-coordinator --listen 0.0.0.0:7070 --state-dir DIR
  Process coordinator(hosts.In(0, {BinDir() + "/pipemare-coordinator", "--listen", "0.0.0.0:7070",
                                   "--state-dir", dir + "/state"}),
                      dir + "/coordinator.log");
  // README: pipemare-worker --coordinator HOST:7070 --listen 0.0.0.0:7071 --device cpu
  std::vector<std::unique_ptr<Process>> workers;
  for (int i = 1; i <= kWorkers; ++i) {
    workers.push_back(std::make_unique<Process>(
        hosts.In(i, {BinDir() + "/pipemare-worker", "--coordinator", "10.77.0.1:7070", "--listen",
                     "0.0.0.0:7071", "--device", "cpu", "--threads", "1"}),
        absl::StrCat(dir, "/worker-", i, ".log")));
  }
  auto logs = [&] {
    std::string all = coordinator.Log();
    for (auto& w : workers) absl::StrAppend(&all, "\n--- worker\n", w->Log());
    return all;
  };
  // The client on the host side of the bridge, as from a laptop.
  auto ctl = [&](std::vector<std::string> args, double timeout) {
    args.insert(args.begin(), {BinDir() + "/pipemarectl", "--coordinator", "10.77.0.1:7070"});
    return pipemare::testing::Run(args, timeout);
  };
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
  const std::string log = coordinator.Log();
  int registrations = 0;
  for (size_t at = log.find("registered from"); at != std::string::npos;
       at = log.find("registered from", at + 1)) {
    ++registrations;
  }
  EXPECT_EQ(registrations, kWorkers) << log;

  // A fifth process claiming worker 1's address is refused, naming the
  // address and the fix, and evicts nobody.
  Process impostor(
      hosts.In(2, {BinDir() + "/pipemare-worker", "--coordinator", "10.77.0.1:7070", "--listen",
                   "0.0.0.0:7072", "--advertise", absl::StrCat(Hosts::Address(1), ":7071"),
                   "--metrics-listen", "0.0.0.0:9462", "--threads", "1"}),
      dir + "/impostor.log");
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

}  // namespace
}  // namespace pipemare::testing
