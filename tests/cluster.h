// A real local cluster for multi-process tests: one pipemare-coordinator and
// N pipemare-worker processes on loopback, plus helpers that drive them
// through the real pipemarectl client.
#ifndef PIPEMARE_TESTS_CLUSTER_H_
#define PIPEMARE_TESTS_CLUSTER_H_

#include <memory>
#include <string>
#include <vector>

#include "common/dev_pki.h"
#include "google/protobuf/util/json_util.h"
#include "pipemare/v1/pipemare.grpc.pb.h"
#include "tests/process.h"

namespace pipemare::testing {

// The test process's development PKI, made once (common/dev_pki.h): every
// Cluster's coordinator and workers run mutual TLS with its certificates,
// pipemarectl calls with its submit token, and the test process itself calls
// as the coordinator (its certificate) with the submit token.
const DevPki& TestPki();
// The flags that give a process its part of TestPki().
std::vector<std::string> CoordinatorTlsFlags();
std::vector<std::string> WorkerTlsFlags();
std::vector<std::string> ClientTlsFlags();

class Cluster {
 public:
  // Starts the coordinator (and `workers` workers) and waits until all are
  // registered and IDLE. Check ok() after constructing. `tls` false: every
  // process runs plaintext (--insecure), as schedule.transport gloo needs.
  explicit Cluster(int workers, std::vector<std::string> coordinator_flags = {}, bool tls = true);
  ~Cluster();

  bool ok() const { return ok_; }
  const std::string& address() const { return address_; }
  // host:port of the coordinator's /metrics (stable across restarts).
  const std::string& metrics_address() const { return metrics_address_; }
  const std::string& dir() const { return dir_; }

  void StartCoordinator();
  // Runs the coordinator's next starts under `wrapper` (argv before its
  // own, e.g. unshare), for tests that give it a view of its own.
  void set_coordinator_wrapper(std::vector<std::string> wrapper) {
    coordinator_wrapper_ = std::move(wrapper);
  }
  // `flags`: more pipemare-worker flags; `cwd`: its working directory
  // (relative data paths resolve there), else the test's.
  void AddWorker(const std::vector<std::string>& flags = {}, const std::string& cwd = "");
  Process& coordinator() { return *coordinator_; }
  Process& worker(int i) { return *workers_[i]; }
  int worker_count() const { return static_cast<int>(workers_.size()); }

  // pipemarectl --coordinator ADDR <args...>
  CommandResult Ctl(const std::vector<std::string>& args, double timeout_seconds = 120);
  // Writes `yaml` to a spec file in the cluster dir; returns its path.
  std::string WriteSpec(const std::string& name, const std::string& yaml);
  // `status JOB --output json` parsed; an empty status on failure.
  v1::JobStatus Status(const std::string& job_id);
  v1::ListWorkersResponse Workers();
  // Submits (without waiting) and returns the job id, or "" on failure.
  std::string Submit(const std::string& spec_path);
  // Waits until the job reaches a terminal state; returns the final status.
  v1::JobStatus WaitForEnd(const std::string& job_id, double seconds);
  int CountWorkers(v1::WorkerState state);
  // Index of the worker process serving `stage` of `job`, or -1.
  int WorkerForStage(const v1::JobStatus& job, int stage);
  // Index of the running worker process serving on `address`, or -1.
  int WorkerServing(const std::string& address);
  std::string Logs();

 private:
  std::string dir_;
  std::string address_;
  std::string metrics_address_;
  std::vector<std::string> coordinator_flags_;
  std::vector<std::string> coordinator_wrapper_;
  std::unique_ptr<Process> coordinator_;
  std::vector<std::unique_ptr<Process>> workers_;
  bool ok_ = false;
  bool tls_ = true;
  int coordinator_starts_ = 0;
};

// `pipemarectl --output json`'s message, unknown fields ignored.
template <typename M>
bool ParseJson(const std::string& json, M* msg) {
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = true;
  return google::protobuf::util::JsonStringToMessage(json, msg, options).ok();
}

// Loads an export (`pipemarectl export --out FILE`) into plain PyTorch with
// examples/export_eval.py, evaluates the job's test split and returns the
// accuracy it printed; a test failure and -1 when it cannot.
double PythonTestAccuracy(const std::string& exported);

// Loads stage `stage` of a `stages`-stage MLP [4, 3, 2] (SGD, pipemare, N
// = 1, 8 steps; one unit per stage when stages = 2, both when 1) on the
// worker behind `stub` as job `job_id`, sending its activations to
// `downstream`: a stage a test drives with raw messages.
grpc::Status LoadTinyMlpStage(v1::StageWorker::Stub& stub, const std::string& job_id, int stage = 0,
                              int stages = 1, const std::string& downstream = "",
                              const std::string& on_nonfinite = "fail");

// A raw Pipe stream to a worker as one of the coordinator's feeds (the test
// process holds the coordinator's certificate), opened with `role` for
// `job_id` and a deadline `seconds` away; `opened` says whether the open
// message was written.
struct RawFeed {
  RawFeed(v1::StageWorker::Stub& stub, const std::string& job_id, v1::StreamOpen::Role role,
          double seconds = 30);
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReaderWriter<v1::StageMessage, v1::StageMessage>> stream;
  bool opened = false;
};

// Sum over every worker's /metrics of the samples of `metric` whose labels
// contain each of `labels` (e.g. job_id="job-1").
double ScrapeSum(Cluster& cluster, const std::string& metric,
                 const std::vector<std::string>& labels);

// A short MNIST job spec in YAML (real data, a few hundred steps).
std::string ShortSpec(const std::string& name, const std::string& schedule, int stages,
                      int64_t train_limit, int epochs = 1);

}  // namespace pipemare::testing

#endif  // PIPEMARE_TESTS_CLUSTER_H_
