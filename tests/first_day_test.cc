// A user's first day, as the README and docs/ tell it: one process per port,
// a watch that survives a coordinator restart, a cancel that keeps the
// progress, mistakes refused at submit rather than retried at run time, and
// displays that say where the job really is. Real processes, real MNIST,
// driven through the real pipemarectl. Label: multiprocess.
#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/rpc.h"
#include "pipemare/v1/pipemare.grpc.pb.h"
#include "tests/cluster.h"
#include "tests/process.h"

namespace pipemare::testing {
namespace {

int Count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

std::string Port(const std::string& address) { return address.substr(address.rfind(':') + 1); }

TEST(FirstDay, ASecondCoordinatorOrWorkerOnATakenPortOrStateDirExitsAtOnceNamingIt) {
  const std::string state = MakeTempDir();
  Cluster cluster(1, {"--state-dir", state});
  ASSERT_TRUE(cluster.ok());
  auto second = [&](std::vector<std::string> argv, const std::string& log) {
    argv.insert(argv.end(), {"--insecure", "--metrics-listen", ""});
    Process p(argv, cluster.dir() + "/" + log);
    const int code = p.Wait(15);
    return std::make_pair(code, p.Log());
  };
  // The coordinator's port, another state directory.
  auto [code, log] = second({BinDir() + "/pipemare-coordinator", "--listen", cluster.address(),
                             "--state-dir", MakeTempDir()},
                            "second-coordinator.log");
  EXPECT_EQ(code, 2) << log;
  EXPECT_TRUE(absl::StrContains(log, absl::StrCat("port ", Port(cluster.address())))) << log;
  EXPECT_TRUE(absl::StrContains(log, "--listen")) << log;
  // Another port, the same state directory: it would run the same jobs.
  std::tie(code, log) =
      second({BinDir() + "/pipemare-coordinator", "--listen", "127.0.0.1:0", "--state-dir", state},
             "third-coordinator.log");
  EXPECT_EQ(code, 2) << log;
  EXPECT_TRUE(absl::StrContains(log, "another pipemare-coordinator")) << log;
  EXPECT_TRUE(absl::StrContains(log, "--state-dir")) << log;
  // A worker on the first worker's port.
  const std::string taken = cluster.Workers().workers(0).address();
  std::tie(code, log) =
      second({BinDir() + "/pipemare-worker", "--coordinator", cluster.address(), "--listen", taken},
             "second-worker.log");
  EXPECT_EQ(code, 2) << log;
  EXPECT_TRUE(absl::StrContains(log, absl::StrCat("port ", Port(taken)))) << log;
  EXPECT_TRUE(absl::StrContains(log, "--listen")) << log;
  // No GPU here: --device cuda is refused at start, naming the flag.
  if (!std::filesystem::exists("/dev/nvidia0")) {
    std::tie(code, log) = second(
        {BinDir() + "/pipemare-worker", "--coordinator", cluster.address(), "--device", "cuda"},
        "cuda-worker.log");
    EXPECT_EQ(code, 2) << log;
    EXPECT_TRUE(absl::StrContains(log, "--device cuda")) << log;
  }
  // The first ones still serve alone.
  EXPECT_EQ(cluster.CountWorkers(v1::IDLE), 1);
  EXPECT_EQ(cluster.Ctl({"list"}).exit_code, 0);
}

TEST(FirstDay, SubmitWaitFollowsTheJobAcrossACoordinatorStopAndACrashAndExitsZero) {
  const std::string state = MakeTempDir();
  Cluster cluster(3, {"--state-dir", state, "--worker-timeout", "3"});
  ASSERT_TRUE(cluster.ok());
  const std::string spec =
      cluster.WriteSpec("restarts", absl::StrCat(ShortSpec("restarts", "pipemare", 3, 12800, 2),
                                                 "checkpoint: {every_steps: 150, keep: 3}\n"));
  std::vector<std::string> argv = {BinDir() + "/pipemarectl", "--coordinator", cluster.address()};
  for (const std::string& flag : ClientTlsFlags()) argv.push_back(flag);
  argv.insert(argv.end(), {"submit", spec, "--wait"});
  Process submit(argv, cluster.dir() + "/submit-wait.log");
  const std::string id = "job-1";
  ASSERT_TRUE(WaitFor(120, [&] { return cluster.Status(id).progress().step() > 60; }))
      << submit.Log() << cluster.Logs();
  // SIGTERM: the coordinator drains and stops; the next one continues.
  cluster.coordinator().Signal(SIGTERM);
  ASSERT_EQ(cluster.coordinator().Wait(40), 0) << cluster.Logs();
  cluster.StartCoordinator();
  ASSERT_FALSE(cluster.address().empty()) << cluster.Logs();
  // kill -9 once epoch 1 (400 steps) is scored: the next coordinator goes
  // back to the newest periodic cut, 300 when the kill is quick enough, and
  // trains the rest of epoch 1 again.
  v1::JobStatus before;
  ASSERT_TRUE(WaitFor(180,
                      [&] {
                        before = cluster.Status(id);
                        return before.epochs_size() >= 1;
                      }))
      << submit.Log() << cluster.Logs();
  cluster.coordinator().Signal(SIGKILL);
  cluster.coordinator().Wait(10);
  cluster.StartCoordinator();
  ASSERT_FALSE(cluster.address().empty()) << cluster.Logs();
  EXPECT_EQ(submit.Wait(400), 0) << submit.Log() << cluster.Logs();
  EXPECT_TRUE(absl::StrContains(submit.Log(), "SUCCEEDED")) << submit.Log();
  EXPECT_TRUE(absl::StrContains(submit.Log(), "reconnected to the coordinator")) << submit.Log();
  const v1::JobStatus after = cluster.Status(id);
  EXPECT_EQ(after.state(), v1::SUCCEEDED);
  ASSERT_EQ(after.epochs_size(), 2) << after.DebugString();
  EXPECT_EQ(Count(submit.Log(), "epoch 1/2 done"), 1) << submit.Log();
  if (after.resumed_from_step() < 400) {
    // Epoch 1 was trained again from the cut only: its result still speaks
    // for the whole epoch, not the steps after the cut.
    EXPECT_GT(after.epochs(0).seconds(), 0.6 * before.epochs(0).seconds())
        << "resumed from " << after.resumed_from_step() << "\n"
        << before.epochs(0).DebugString() << after.epochs(0).DebugString();
  }
}

TEST(FirstDay, CancelKeepsTheProgressResumeContinuesAndMistakesAreRefusedAtSubmit) {
  // Its own checkpoint directory (the default is shared by every test's job-1).
  Cluster cluster(3, {"--checkpoint-dir", MakeTempDir()});
  ASSERT_TRUE(cluster.ok());
  // 200 steps an epoch, 2 epochs; the default checkpoint settings.
  const std::string yaml = ShortSpec("cancel-me", "pipemare", 3, 6400, 2);
  const std::string spec = cluster.WriteSpec("cancel-me", yaml);
  const std::string id = cluster.Submit(spec);
  ASSERT_FALSE(id.empty());
  ASSERT_TRUE(WaitFor(120, [&] { return cluster.Status(id).progress().step() > 40; }))
      << cluster.Logs();
  auto cancel = cluster.Ctl({"cancel", id});
  EXPECT_EQ(cancel.exit_code, 0) << cancel.err;
  EXPECT_TRUE(absl::StrContains(cancel.out, id + " CANCELLED")) << cancel.out << cancel.err;
  EXPECT_FALSE(absl::StrContains(cancel.out, "RUNNING")) << cancel.out;
  v1::JobStatus job = cluster.Status(id);
  ASSERT_EQ(job.state(), v1::CANCELLED);
  const int64_t cut = job.checkpoint().step();
  EXPECT_GT(cut, 40) << "the cancel cut a checkpoint where it stopped";
  EXPECT_LT(cut, 200);
  EXPECT_TRUE(absl::StrContains(job.reason(), "resume")) << job.reason();
  // Where it stopped: epoch 1 of 2, not the next one.
  EXPECT_EQ(job.progress().epoch(), 1) << job.DebugString();
  auto status = cluster.Ctl({"status", id});
  EXPECT_TRUE(absl::StrContains(status.out, "epoch 1/2")) << status.out;
  auto list = cluster.Ctl({"list"});
  EXPECT_FALSE(absl::StrContains(list.out, "2/2")) << list.out;

  // Resume from the cancel's cut: each epoch reported once.
  auto resume = cluster.Ctl({"resume", id, "--wait"}, 300);
  EXPECT_EQ(resume.exit_code, 0) << resume.out << resume.err << cluster.Logs();
  job = cluster.Status(id);
  EXPECT_EQ(job.state(), v1::SUCCEEDED);
  EXPECT_EQ(job.resumed_from_step(), cut);
  ASSERT_EQ(job.epochs_size(), 2) << job.DebugString();
  EXPECT_EQ(job.epochs(0).epoch(), 1);
  EXPECT_EQ(job.epochs(1).epoch(), 2);
  EXPECT_EQ(Count(resume.out, "epoch 1/2 done"), 1) << resume.out;
  EXPECT_EQ(Count(resume.out, "epoch 2/2 done"), 1) << resume.out;

  // Export to a bare file name, in the client's working directory.
  const std::string cwd = MakeTempDir();
  std::string command = absl::StrCat("cd ", cwd, " && exec ", BinDir(),
                                     "/pipemarectl --coordinator ", cluster.address());
  for (const std::string& flag : ClientTlsFlags()) absl::StrAppend(&command, " ", flag);
  auto exported =
      pipemare::testing::Run({"/bin/sh", "-c", command + " export " + id + " --out model.pt"}, 60);
  EXPECT_EQ(exported.exit_code, 0) << exported.err;
  EXPECT_TRUE(std::filesystem::exists(cwd + "/model.pt"));
  EXPECT_TRUE(std::filesystem::exists(cwd + "/model.pt.json"));
  // A checkpoint checkpoint.keep deleted: which ones there are.
  auto gone = cluster.Ctl({"export", id, "--checkpoint", "1", "--out", cwd + "/old.pt"});
  EXPECT_NE(gone.exit_code, 0);
  EXPECT_TRUE(absl::StrContains(gone.err, "no checkpoint at step 1")) << gone.err;
  EXPECT_TRUE(absl::StrContains(gone.err, "400")) << gone.err;

  // Refused at submit, naming the field and the fix.
  auto refused = [&](const std::string& name, const std::string& text,
                     std::vector<std::string> extra) {
    std::vector<std::string> args = {"submit", cluster.WriteSpec(name, text)};
    args.insert(args.end(), extra.begin(), extra.end());
    return cluster.Ctl(args);
  };
  // Other widths, the same number of units.
  auto widths =
      refused("widths",
              absl::StrReplaceAll(
                  yaml, {{"layers: [784, 256, 128, 64, 10]", "layers: [784, 128, 128, 64, 10]"},
                         {"epochs: 2", "epochs: 3"}}),
              {"--from", id});
  EXPECT_EQ(widths.exit_code, 2) << widths.err;
  EXPECT_TRUE(absl::StrContains(widths.err, "model: differs")) << widths.err;
  EXPECT_TRUE(absl::StrContains(widths.err, "layers")) << widths.err;
  // No step left to train after the source's last one.
  auto epochs = refused("epochs", yaml, {"--from", id});
  EXPECT_EQ(epochs.exit_code, 2) << epochs.err;
  EXPECT_TRUE(absl::StrContains(epochs.err, "train.epochs")) << epochs.err;
  EXPECT_TRUE(absl::StrContains(epochs.err, "step 400")) << epochs.err;
  // Gloo sends plaintext; this cluster runs TLS.
  auto gloo =
      refused("gloo",
              absl::StrReplaceAll(
                  yaml, {{"discrepancy_decay: 0.1", "discrepancy_decay: 0.1, transport: gloo"}}),
              {});
  EXPECT_EQ(gloo.exit_code, 2) << gloo.err;
  EXPECT_TRUE(absl::StrContains(gloo.err, "schedule.transport")) << gloo.err;
  auto jobs = cluster.Ctl({"list"});
  EXPECT_EQ(Count(jobs.out, "job-"), 1) << "nothing refused was queued:\n" << jobs.out;

  // --init-from: the trained weights, a new schedule from step 0.
  const double source_accuracy = job.metrics().test_accuracy();
  auto init = cluster.Ctl(
      {"submit",
       cluster.WriteSpec("init", absl::StrReplaceAll(
                                     yaml, {{"epochs: 2", "epochs: 1"}, {"lr: 0.05", "lr: 0.01"}})),
       "--init-from", id, "--wait", "--output", "json"},
      300);
  EXPECT_EQ(init.exit_code, 0) << init.out << init.err << cluster.Logs();
  v1::JobStatus fine_tuned;
  ASSERT_TRUE(ParseJson(init.out, &fine_tuned)) << init.out;
  EXPECT_EQ(fine_tuned.state(), v1::SUCCEEDED);
  EXPECT_FALSE(fine_tuned.init_from().empty());
  EXPECT_EQ(fine_tuned.resumed_from_step(), 0);
  EXPECT_EQ(fine_tuned.progress().total_steps(), 200);
  // One epoch at a fifth of the learning rate from scratch would not get here.
  EXPECT_GE(fine_tuned.metrics().test_accuracy(), source_accuracy - 0.03)
      << "source " << source_accuracy;
  auto both = cluster.Ctl({"submit", spec, "--from", id, "--init-from", id});
  EXPECT_EQ(both.exit_code, 2) << both.err;

  // A second job on the same workers: while it runs, no worker claims to
  // hold the first one.
  const std::string next =
      cluster.Submit(cluster.WriteSpec("next", ShortSpec("next", "gpipe", 3, 6400, 1)));
  ASSERT_TRUE(WaitFor(60, [&] { return cluster.Status(next).state() == v1::RUNNING; }));
  const v1::ListWorkersResponse listed = cluster.Workers();
  for (const auto& w : listed.workers()) {
    if (w.job_id().empty()) continue;
    EXPECT_TRUE(w.served().job_id().empty() || w.served().job_id() == w.job_id())
        << w.DebugString();
  }
  EXPECT_EQ(cluster.WaitForEnd(next, 300).state(), v1::SUCCEEDED);
}

TEST(FirstDay, LocalRefusesTooFewWorkersNamesLogsAfterWorkersAndExportsToABareName) {
  const std::string dir = MakeTempDir();
  const std::string spec = dir + "/spec.yaml";
  std::ofstream(spec) << ShortSpec("local", "pipemare", 2, 640, 1);
  auto few =
      pipemare::testing::Run({BinDir() + "/pipemarectl", "local", spec, "--workers", "1"}, 30);
  EXPECT_EQ(few.exit_code, 2) << few.err;
  EXPECT_TRUE(absl::StrContains(few.err, "--workers 2")) << few.err;
  // PIPEMARE_* of the user's shell reach neither the run nor its services.
  auto run = pipemare::testing::Run(
      {"/bin/sh", "-c",
       absl::StrCat("cd ", dir, " && PIPEMARE_INSECURE=1 PIPEMARE_METRICS_LISTEN= exec ", BinDir(),
                    "/pipemarectl local ", spec, " --export model.pt --keep-logs")},
      300);
  EXPECT_EQ(run.exit_code, 0) << run.out << run.err;
  EXPECT_TRUE(std::filesystem::exists(dir + "/model.pt")) << run.err;
  const std::string marker = "logs kept in ";
  const size_t at = run.err.rfind(marker);
  ASSERT_NE(at, std::string::npos) << run.err;
  std::string logs = run.err.substr(at + marker.size());
  logs = logs.substr(0, logs.find('\n'));
  for (const std::string id : {"w-1", "w-2"}) {
    const std::string log = ReadFile(logs + "/" + id + ".log");
    EXPECT_TRUE(absl::StrContains(log, " as " + id)) << id << ":\n" << log;
  }
}

// The threads of process `pid` now (0 if unknown).
int Threads(int pid) {
  std::ifstream f(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(f, line)) {
    if (absl::StartsWith(line, "Threads:")) return std::stoi(line.substr(8));
  }
  return 0;
}

// `count` WatchJob streams of one job from this process, read by one thread
// through a completion queue, as that many `pipemarectl watch` would.
class Watches {
 public:
  Watches(const std::string& address, const std::string& job, int count)
      : stub_(v1::Coordinator::NewStub(MakeChannel(address))), watches_(count) {
    v1::WatchJobRequest req;
    req.set_id(job);
    for (Watch& w : watches_) {
      w.reader = stub_->PrepareAsyncWatchJob(&w.context, req, &cq_);
      w.reader->StartCall(Tag(&w, kStarted));
    }
    poller_ = std::thread([this] { Poll(); });
  }
  ~Watches() {
    for (Watch& w : watches_) w.context.TryCancel();
    WaitFor(30, [&] { return finished() == static_cast<int>(watches_.size()); });
    cq_.Shutdown();
    poller_.join();
  }
  // Streams that got at least one event, and that ended.
  int heard() const { return heard_.load(); }
  int finished() const { return finished_.load(); }
  // Streams that ended OK after a status in `state`, and those that ended
  // with `code`.
  int EndedOkIn(v1::JobState state) const {
    int n = 0;
    for (const Watch& w : watches_) n += w.done && w.status.ok() && w.last == state;
    return n;
  }
  int EndedWith(grpc::StatusCode code) const {
    int n = 0;
    for (const Watch& w : watches_) n += w.done && w.status.error_code() == code;
    return n;
  }
  std::string AnError() const {
    for (const Watch& w : watches_) {
      if (w.done && !w.status.ok()) return w.status.error_message();
    }
    return "";
  }

 private:
  enum Op : uintptr_t { kStarted = 0, kRead = 1, kFinished = 2 };
  struct Watch {
    grpc::ClientContext context;
    std::unique_ptr<grpc::ClientAsyncReader<v1::JobEvent>> reader;
    v1::JobEvent event;
    grpc::Status status;
    int events = 0;
    v1::JobState last = v1::PENDING;
    bool done = false;
  };
  static void* Tag(Watch* w, Op op) {
    return reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(w) | op);
  }
  void Poll() {
    void* tag;
    bool ok;
    while (cq_.Next(&tag, &ok)) {
      auto* w = reinterpret_cast<Watch*>(reinterpret_cast<uintptr_t>(tag) & ~uintptr_t{3});
      const Op op = static_cast<Op>(reinterpret_cast<uintptr_t>(tag) & 3);
      if (op == kFinished) {
        w->done = true;
        ++finished_;
      } else if (!ok) {
        w->reader->Finish(&w->status, Tag(w, kFinished));
      } else {
        if (op == kRead) {
          if (w->events++ == 0) ++heard_;
          w->last = w->event.job().state();
        }
        w->reader->Read(&w->event, Tag(w, kRead));
      }
    }
  }

  std::unique_ptr<v1::Coordinator::Stub> stub_;
  grpc::CompletionQueue cq_;
  std::vector<Watch> watches_;
  std::atomic<int> heard_{0}, finished_{0};
  std::thread poller_;
};

// Found as a user would: 300 `pipemarectl watch` on one running job took
// every thread of the coordinator's server; list and submit got "Server
// Threadpool Exhausted", heartbeats failed, every worker was marked LOST and
// the job restarted. A watch now holds no thread.
TEST(FirstDay, AThousandWatchersOfARunningJobCostNoThreadsAndStarveNoWorkerOrClient) {
  Cluster cluster(3, {"--worker-timeout", "3", "--max-watches-per-caller", "1000"});
  ASSERT_TRUE(cluster.ok());
  const std::string id =
      cluster.Submit(cluster.WriteSpec("watched", ShortSpec("watched", "pipemare", 3, 25600, 1)));
  ASSERT_EQ(id, "job-1");
  ASSERT_TRUE(WaitFor(120, [&] { return cluster.Status(id).progress().step() > 20; }))
      << cluster.Logs();
  const int idle_threads = Threads(cluster.coordinator().pid());
  {
    Watches watches(cluster.address(), id, 1000);
    ASSERT_TRUE(WaitFor(60, [&] { return watches.heard() == 1000; }))
        << watches.heard() << " of 1000 watches heard the job; " << watches.AnError();
    // One more from the same caller is past its bound, and says which flag.
    {
      Watches extra(cluster.address(), id, 1);
      ASSERT_TRUE(WaitFor(20, [&] { return extra.finished() == 1; }));
      EXPECT_EQ(extra.EndedWith(grpc::StatusCode::RESOURCE_EXHAUSTED), 1) << extra.AnError();
      EXPECT_TRUE(absl::StrContains(extra.AnError(), "--max-watches-per-caller"))
          << extra.AnError();
    }
    // The coordinator's threads stay bounded: none per watch.
    const int watched_threads = Threads(cluster.coordinator().pid());
    std::cout << "coordinator threads: " << idle_threads << " before the watches, "
              << watched_threads << " with 1000 open" << std::endl;
    EXPECT_LT(watched_threads, idle_threads + 64)
        << idle_threads << " threads before the watches, " << watched_threads << " with 1000";
    EXPECT_EQ(cluster.Status(id).state(), v1::RUNNING);
    // Clients still get answers while the watches are open.
    const CommandResult list = cluster.Ctl({"list"}, 20);
    EXPECT_EQ(list.exit_code, 0) << list.err;
    EXPECT_TRUE(absl::StrContains(list.out, id)) << list.out;
    const std::string next =
        cluster.Submit(cluster.WriteSpec("next", ShortSpec("next", "gpipe", 3, 640, 1)));
    EXPECT_EQ(next, "job-2");
    const v1::JobStatus end = cluster.WaitForEnd(id, 300);
    EXPECT_EQ(end.state(), v1::SUCCEEDED) << end.reason() << cluster.Logs();
    EXPECT_EQ(end.restarts_size(), 0) << "no worker was lost while 1000 watched";
    // Every watch saw the end and ended OK.
    ASSERT_TRUE(WaitFor(60, [&] { return watches.finished() == 1000; }))
        << watches.finished() << " of 1000 watches ended; " << watches.AnError();
    EXPECT_EQ(watches.EndedOkIn(v1::SUCCEEDED), 1000) << watches.AnError();
  }
  EXPECT_EQ(cluster.CountWorkers(v1::LOST), 0);
  cluster.WaitForEnd("job-2", 300);
}

}  // namespace
}  // namespace pipemare::testing
