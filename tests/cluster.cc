#include "tests/cluster.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <iostream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/rpc.h"
#include "common/security.h"
#include "google/protobuf/util/json_util.h"

namespace pipemare::testing {

const DevPki& TestPki() {
  static const DevPki* pki = [] {
    DevPkiOptions options;
    options.dir = MakeTempDir() + "/pki";
    auto made = MakeDevPki(options);
    if (!made.ok()) {
      std::cerr << "cannot make the test PKI: " << made.status() << std::endl;
      std::abort();
    }
    SecurityFlags flags;
    flags.ca_file = made->ca;
    flags.cert_file = made->coordinator_cert;
    flags.key_file = made->coordinator_key;
    auto security = LoadRpcSecurity(flags, kCoordinatorName);
    if (!security.ok()) {
      std::cerr << "cannot load the test PKI: " << security.status() << std::endl;
      std::abort();
    }
    auto token = LoadToken(made->submit_token, "submit.token");
    security->token = *token;
    SetRpcSecurity(*security);
    return new DevPki(*made);
  }();
  return *pki;
}

std::vector<std::string> CoordinatorTlsFlags() {
  const DevPki& pki = TestPki();
  return {"--tls-ca",          pki.ca,          "--tls-cert", pki.coordinator_cert, "--tls-key",
          pki.coordinator_key, "--tokens-file", pki.tokens};
}

std::vector<std::string> WorkerTlsFlags() {
  const DevPki& pki = TestPki();
  return {"--tls-ca", pki.ca, "--tls-cert", pki.worker_certs[0], "--tls-key", pki.worker_keys[0]};
}

std::vector<std::string> ClientTlsFlags() {
  const DevPki& pki = TestPki();
  return {"--tls-ca", pki.ca, "--token-file", pki.submit_token};
}

Cluster::Cluster(int workers, std::vector<std::string> coordinator_flags, bool tls)
    : dir_(MakeTempDir()), coordinator_flags_(std::move(coordinator_flags)), tls_(tls) {
  StartCoordinator();
  if (address_.empty()) return;
  for (int i = 0; i < workers; ++i) AddWorker();
  ok_ = WaitFor(60, [&] { return CountWorkers(v1::IDLE) == workers; });
  if (!ok_) std::cerr << "cluster did not come up:\n" << Logs() << std::endl;
}

Cluster::~Cluster() {
  for (auto& w : workers_) w->Signal(SIGTERM);
  if (coordinator_) coordinator_->Signal(SIGTERM);
  for (auto& w : workers_) {
    if (w->Wait(10) < 0) w->Signal(SIGKILL);
  }
  if (coordinator_ && coordinator_->Wait(10) < 0) coordinator_->Signal(SIGKILL);
}

void Cluster::StartCoordinator() {
  const std::string addr_file = absl::StrCat(dir_, "/coordinator.addr");
  unlink(addr_file.c_str());
  // Restarts reuse the same port so workers find the coordinator again.
  const std::string listen = address_.empty() ? "127.0.0.1:0" : address_;
  const std::string metrics_file = absl::StrCat(dir_, "/coordinator.metrics");
  unlink(metrics_file.c_str());
  const std::string metrics_listen = metrics_address_.empty() ? "127.0.0.1:0" : metrics_address_;
  std::vector<std::string> argv = {BinDir() + "/pipemare-coordinator",
                                   "--listen",
                                   listen,
                                   "--address-file",
                                   addr_file,
                                   "--metrics-listen",
                                   metrics_listen,
                                   "--metrics-address-file",
                                   metrics_file};
  argv.insert(argv.end(), coordinator_flags_.begin(), coordinator_flags_.end());
  // Each cluster its own checkpoints: the default, ./pipemare-checkpoints,
  // is shared by every test's job-1 (one test's cleanup of its cuts failed
  // another's commit).
  auto has = [&](const std::string& flag) {
    return std::find(coordinator_flags_.begin(), coordinator_flags_.end(), flag) !=
           coordinator_flags_.end();
  };
  if (!has("--checkpoint-dir") && !has("--state-dir")) {
    argv.insert(argv.end(), {"--checkpoint-dir", dir_ + "/checkpoints"});
  }
  for (const std::string& flag :
       tls_ ? CoordinatorTlsFlags() : std::vector<std::string>{"--insecure"}) {
    argv.push_back(flag);
  }
  argv.insert(argv.begin(), coordinator_wrapper_.begin(), coordinator_wrapper_.end());
  coordinator_ = std::make_unique<Process>(
      argv, absl::StrCat(dir_, "/coordinator-", ++coordinator_starts_, ".log"));
  std::string addr;
  WaitFor(30, [&] {
    addr = ReadFile(addr_file);
    return !addr.empty() || !coordinator_->Running();
  });
  while (!addr.empty() && (addr.back() == '\n')) addr.pop_back();
  address_ = addr;
  metrics_address_ = ReadFile(metrics_file);  // written before the address file
  while (!metrics_address_.empty() && metrics_address_.back() == '\n') metrics_address_.pop_back();
}

void Cluster::AddWorker(const std::vector<std::string>& flags, const std::string& cwd) {
  const int i = static_cast<int>(workers_.size());
  std::vector<std::string> argv;
  if (!cwd.empty()) argv = {"/usr/bin/env", "-C", cwd};
  for (const std::string& arg : std::vector<std::string>{
           BinDir() + "/pipemare-worker", "--coordinator", address_, "--listen", "127.0.0.1:0",
           "--threads", "1", "--coordinator-timeout", "4", "--metrics-listen", "127.0.0.1:0"}) {
    argv.push_back(arg);
  }
  argv.insert(argv.end(), flags.begin(), flags.end());
  for (const std::string& flag : tls_ ? WorkerTlsFlags() : std::vector<std::string>{"--insecure"}) {
    argv.push_back(flag);
  }
  workers_.push_back(std::make_unique<Process>(argv, absl::StrCat(dir_, "/worker-", i, ".log")));
}

CommandResult Cluster::Ctl(const std::vector<std::string>& args, double timeout_seconds) {
  std::vector<std::string> argv = {BinDir() + "/pipemarectl", "--coordinator", address_};
  for (const std::string& flag : tls_ ? ClientTlsFlags() : std::vector<std::string>{"--insecure"}) {
    argv.push_back(flag);
  }
  argv.insert(argv.end(), args.begin(), args.end());
  return Run(argv, timeout_seconds);
}

std::string Cluster::WriteSpec(const std::string& name, const std::string& yaml) {
  const std::string path = absl::StrCat(dir_, "/", name, ".yaml");
  FILE* f = fopen(path.c_str(), "w");
  fputs(yaml.c_str(), f);
  fclose(f);
  return path;
}

v1::JobStatus Cluster::Status(const std::string& job_id) {
  v1::JobStatus s;
  auto r = Ctl({"status", job_id, "--output", "json"}, 20);
  if (r.exit_code == 0) ParseJson(r.out, &s);
  return s;
}

v1::ListWorkersResponse Cluster::Workers() {
  v1::ListWorkersResponse w;
  auto r = Ctl({"workers", "--output", "json"}, 20);
  if (r.exit_code == 0) ParseJson(r.out, &w);
  return w;
}

int Cluster::CountWorkers(v1::WorkerState state) {
  int n = 0;
  const v1::ListWorkersResponse workers = Workers();
  for (const auto& w : workers.workers()) n += w.state() == state;
  return n;
}

int Cluster::WorkerForStage(const v1::JobStatus& job, int stage) {
  if (stage >= job.stages_size()) return -1;
  return WorkerServing(job.stages(stage).worker_address());
}

int Cluster::WorkerServing(const std::string& address) {
  // Worker i's log names the address it serves on. The newest running one:
  // a replacement may be given the port of a worker killed earlier.
  for (int i = worker_count() - 1; i >= 0; --i) {
    if (worker(i).Running() && absl::StrContains(worker(i).Log(), "serving on " + address + " ")) {
      return i;
    }
  }
  return -1;
}

std::string Cluster::Submit(const std::string& spec_path) {
  auto r = Ctl({"submit", spec_path, "--output", "json"}, 20);
  v1::JobStatus s;
  if (r.exit_code != 0 || !ParseJson(r.out, &s)) {
    std::cerr << "submit failed (" << r.exit_code << "): " << r.out << r.err << std::endl;
    return "";
  }
  return s.id();
}

v1::JobStatus Cluster::WaitForEnd(const std::string& job_id, double seconds) {
  v1::JobStatus s;
  WaitFor(seconds, [&] {
    s = Status(job_id);
    return s.state() == v1::SUCCEEDED || s.state() == v1::FAILED || s.state() == v1::CANCELLED;
  });
  return s;
}

std::string Cluster::Logs() {
  std::string all;
  if (coordinator_) all += "--- coordinator\n" + coordinator_->Log();
  for (size_t i = 0; i < workers_.size(); ++i) {
    all += absl::StrCat("--- worker ", i, "\n", workers_[i]->Log());
  }
  return all;
}

std::string ShortSpec(const std::string& name, const std::string& schedule, int stages,
                      int64_t train_limit, int epochs) {
  return absl::StrCat("name: ", name, R"(
model: {type: mlp, layers: [784, 256, 128, 64, 10], activation: relu}
data: {type: mnist, path: )",
                      MnistDir(), ", train_limit: ", train_limit, R"(, test_limit: 2000}
optimizer: {type: sgd, lr: 0.05, momentum: 0.5}
schedule: {type: )",
                      schedule, ", stages: ", stages, R"(, microbatch_size: 32,
           lr_anneal_steps: 100, discrepancy_decay: 0.1}
train: {epochs: )",
                      epochs, R"(, seed: 3}
)");
}

grpc::Status LoadTinyMlpStage(v1::StageWorker::Stub& stub, const std::string& job_id, int stage,
                              int stages, const std::string& downstream,
                              const std::string& on_nonfinite) {
  v1::StageAssignment a;
  a.set_job_id(job_id);
  a.set_stage(stage);
  a.set_num_stages(stages);
  a.set_first_unit(stages == 1 ? 0 : stage);
  a.set_units(stages == 1 ? 2 : 1);
  a.add_input_shape(stage == 0 ? 4 : 3);
  a.mutable_model()->set_type("mlp");
  for (int w : {4, 3, 2}) a.mutable_model()->add_layers(w);
  a.mutable_model()->set_activation("relu");
  a.mutable_optimizer()->set_type("sgd");
  a.mutable_optimizer()->set_lr(0.1);
  a.mutable_schedule()->set_type("pipemare");
  a.mutable_schedule()->set_microbatches_per_step(1);
  a.set_steps_per_epoch(8);
  a.set_total_steps(8);
  a.set_downstream_address(downstream);
  a.set_on_nonfinite(on_nonfinite);
  v1::LoadStageResponse resp;
  auto ctx = ContextWithDeadline(20);
  return stub.LoadStage(ctx.get(), a, &resp);
}

RawFeed::RawFeed(v1::StageWorker::Stub& stub, const std::string& job_id, v1::StreamOpen::Role role,
                 double seconds) {
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000)));
  stream = stub.Pipe(&ctx);
  v1::StageMessage open;
  open.mutable_open()->set_job_id(job_id);
  open.mutable_open()->set_role(role);
  opened = stream->Write(open);
}

double PythonTestAccuracy(const std::string& exported) {
  auto eval = Run(
      {"/usr/bin/python3", std::string(PIPEMARE_SOURCE_DIR) + "/examples/export_eval.py", exported},
      300);
  const size_t at = eval.out.find("\"test_accuracy\": ");
  double accuracy = -1;
  if (eval.exit_code != 0 || at == std::string::npos ||
      !absl::SimpleAtod(eval.out.substr(at + 17, eval.out.find(',', at) - at - 17), &accuracy)) {
    ADD_FAILURE() << "examples/export_eval.py " << exported << ": exit " << eval.exit_code << "\n"
                  << eval.out << eval.err;
    return -1;
  }
  return accuracy;
}

double ScrapeSum(Cluster& cluster, const std::string& metric,
                 const std::vector<std::string>& labels) {
  double sum = 0;
  const v1::ListWorkersResponse workers = cluster.Workers();
  for (const auto& w : workers.workers()) {
    for (absl::string_view line :
         absl::StrSplit(HttpGet("http://" + w.metrics_address() + "/metrics"), '\n')) {
      if (!absl::StartsWith(line, metric + "{")) continue;
      bool all = true;
      for (const auto& l : labels) all = all && absl::StrContains(line, l);
      double v = 0;
      if (all && absl::SimpleAtod(line.substr(line.rfind(' ') + 1), &v)) sum += v;
    }
  }
  return sum;
}

}  // namespace pipemare::testing
