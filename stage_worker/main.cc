// pipemare-worker: serves one pipeline stage at a time for a coordinator.
#include <grpcpp/grpcpp.h>
#include <torch/torch.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/health.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/rpc.h"
#include "common/signals.h"
#include "pipeline/core/file_access.h"
#include "stage_worker/stage_metrics.h"
#include "stage_worker/worker_service.h"

namespace {

// "cpu" | "cuda" | "cuda:N" -> device, or an error message naming --device.
absl::StatusOr<torch::Device> ParseDevice(const std::string& s) {
  if (s == "cpu") return torch::Device(torch::kCPU);
  if (s == "cuda" || s.rfind("cuda:", 0) == 0) {
    if (!torch::cuda::is_available()) {
      return absl::FailedPreconditionError(
          absl::StrCat("--device ", s,
                       ": this LibTorch has no CUDA support or sees no GPU; use --device cpu "
                       "or run a CUDA build of the worker on a GPU host"));
    }
    int index = 0;
    if (s.size() > 5) {
      try {
        index = std::stoi(s.substr(5));
      } catch (...) {
        return absl::InvalidArgumentError(absl::StrCat("--device ", s, ": expected cuda:N"));
      }
    }
    if (index < 0 || index >= static_cast<int>(torch::cuda::device_count())) {
      return absl::InvalidArgumentError(
          absl::StrCat("--device ", s, ": only ", torch::cuda::device_count(), " GPUs visible"));
    }
    return torch::Device(torch::kCUDA, index);
  }
  return absl::InvalidArgumentError(absl::StrCat("--device ", s, ": expected cpu, cuda or cuda:N"));
}

// LibTorch intra-op threads when --threads is 0: the CPUs this process may
// use (its cgroup's CPU quota where one is set, e.g. a Kubernetes limit) split
// evenly among the --workers-per-host workers sharing them, at least 1.
int AutoThreads(int workers_per_host) {
  double cpus = std::max(1u, std::thread::hardware_concurrency());
  std::ifstream quota("/sys/fs/cgroup/cpu.max");  // cgroup v2: "max 100000" or "200000 100000"
  std::string limit;
  double period = 0;
  if (quota >> limit >> period && limit != "max" && period > 0) {
    cpus = std::min(cpus, std::max(1.0, std::stod(limit) / period));
  }
  return std::max(1, static_cast<int>(cpus) / std::max(1, workers_per_host));
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"pipemare-worker: serves pipeline stages for a Pipemare coordinator"};
  std::string coordinator, listen = "0.0.0.0:0", advertise, device_flag = "cpu";
  std::string metrics_listen = "0.0.0.0:9461", log_format = "text";
  int threads = 0, workers_per_host = 1;
  std::string virtual_device_flag;
  double lost_after = 10;
  app.add_option("--coordinator", coordinator, "coordinator address host:port")
      ->required()
      ->envname("PIPEMARE_COORDINATOR");
  app.add_option("--listen", listen, "address to serve the StageWorker service on (port 0 = any)")
      ->envname("PIPEMARE_LISTEN");
  app.add_option("--advertise", advertise,
                 "address other workers and the coordinator use to reach this one "
                 "(default: the --listen host with the bound port)")
      ->envname("PIPEMARE_ADVERTISE");
  app.add_option("--device", device_flag, "cpu, cuda or cuda:N")->envname("PIPEMARE_DEVICE");
  app.add_option("--threads", threads,
                 "LibTorch intra-op threads (0 = the CPUs available divided by "
                 "--workers-per-host)")
      ->check(CLI::Range(0, 256))
      ->envname("PIPEMARE_THREADS");
  app.add_option("--workers-per-host", workers_per_host,
                 "workers sharing this host's CPUs, for the --threads 0 default")
      ->check(CLI::Range(1, 4096))
      ->envname("PIPEMARE_WORKERS_PER_HOST");
  app.add_option("--virtual-device", virtual_device_flag,
                 "FWD_MS,BWD_MS: benchmark mode; every unit's forward and backward "
                 "compute become a wait of that many milliseconds (messages, shapes and "
                 "the schedule stay real; values are zeros; weights do not change)")
      ->envname("PIPEMARE_VIRTUAL_DEVICE");
  app.add_option("--coordinator-timeout", lost_after,
                 "seconds without reaching the coordinator before the current stage is dropped")
      ->check(CLI::PositiveNumber)
      ->envname("PIPEMARE_COORDINATOR_TIMEOUT");
  double drain_timeout = 30;
  app.add_option("--drain-timeout", drain_timeout,
                 "on SIGTERM with a stage loaded, seconds to wait for its job to drain, cut a "
                 "checkpoint and release it before exiting anyway (at most this + 10 s after "
                 "SIGTERM; at once on a second one)")
      ->check(CLI::PositiveNumber)
      ->envname("PIPEMARE_DRAIN_TIMEOUT");
  app.add_option("--metrics-listen", metrics_listen,
                 "host:port for Prometheus /metrics (port 0 = any; empty = off)")
      ->envname("PIPEMARE_METRICS_LISTEN");
  app.add_option("--log-format", log_format, "text or json")->envname("PIPEMARE_LOG_FORMAT");
  std::string health_listen;
  app.add_option("--health-listen", health_listen,
                 "host:port for gRPC health checks (grpc.health.v1.Health, plaintext, for "
                 "probes: '' live, pipemare.v1.StageWorker ready = registered with the "
                 "coordinator; port 0 = any; empty = off)")
      ->envname("PIPEMARE_HEALTH_LISTEN");
  std::vector<std::string> data_roots;
  app.add_option("--data-root", data_roots,
                 "a directory this worker may read a job's examples from, as stage 0 or the last "
                 "stage (repeat, or separate with commas; symlinks are followed before the "
                 "check). Unset: any file this host can read (trusted coordinators only)")
      ->delimiter(',')
      ->envname("PIPEMARE_DATA_ROOT");
  pipemare::SecurityFlags security_flags;
  pipemare::AddSecurityFlags(app, &security_flags, /*client=*/false);
  CLI11_PARSE(app, argc, argv);
  // CLI11 takes an empty variable for an unset one; the docs say an empty
  // PIPEMARE_METRICS_LISTEN turns metrics off, as --metrics-listen '' does.
  if (const char* env = std::getenv("PIPEMARE_METRICS_LISTEN");
      env != nullptr && *env == '\0' && app.count("--metrics-listen") == 0) {
    metrics_listen.clear();
  }
  pipemare::SetServerLimits(security_flags.limits);

  if (auto st = pipemare::InitLogging(log_format); !st.ok()) {
    std::cerr << "error: " << st.message() << std::endl;
    return 2;
  }
  auto security = pipemare::LoadRpcSecurity(security_flags, pipemare::kWorkerName);
  if (!security.ok()) {
    pipemare::LogError(absl::StrCat("error: ", security.status().message()));
    return 2;
  }
  if (auto st = pipemare::SetDataRoots(data_roots, "--data-root", "this worker's"); !st.ok()) {
    pipemare::LogError(absl::StrCat("error: ", st.message()));
    return 2;
  }
  const bool insecure = security->insecure;
  if (insecure) {
    pipemare::LogWarning(
        "--insecure: plaintext gRPC, and anyone who reaches this port may load a stage or "
        "feed the pipeline");
  }
  pipemare::SetRpcSecurity(std::move(*security));
  pipemare::BlockStopSignals();
  // The drain waits at most drain_timeout, the server 2 s; whatever still
  // holds the process after that is cut short.
  pipemare::SetStopBound(drain_timeout + 10);
  pipemare::TuneMallocForLargeMessages();
  auto device = ParseDevice(device_flag);
  if (!device.ok()) {
    pipemare::LogError(absl::StrCat("error: ", device.status().message()));
    return 2;
  }
  if (threads == 0) threads = AutoThreads(workers_per_host);
  torch::set_num_threads(threads);
  pipemare::VirtualDevice virtual_device;
  if (!virtual_device_flag.empty()) {
    auto v = pipemare::ParseVirtualDevice(virtual_device_flag, "--virtual-device");
    if (!v.ok()) {
      pipemare::LogError(absl::StrCat("error: ", v.status().message()));
      return 2;
    }
    virtual_device = *v;
    device_flag = absl::StrCat("virtual(", virtual_device_flag, " ms/unit)");
  }

  pipemare::WorkerMetrics metrics(device_flag);
  std::unique_ptr<pipemare::MetricsServer> metrics_server;
  if (!metrics_listen.empty()) {
    auto m = pipemare::MetricsServer::Start(metrics_listen, {metrics.registry()});
    if (!m.ok()) {
      pipemare::LogError(absl::StrCat("error: ", m.status().message()));
      return 2;
    }
    metrics_server = std::move(*m);
  }
  std::unique_ptr<pipemare::HealthServer> health;
  if (!health_listen.empty()) {
    auto h = pipemare::HealthServer::Start(health_listen, pipemare::kWorkerServiceName,
                                           "--health-listen");
    if (!h.ok()) {
      pipemare::LogError(absl::StrCat("error: ", h.status().message()));
      return 2;
    }
    health = std::move(*h);
  }
  auto ready = [&](bool r) {
    if (health) health->Ready(r);
  };
  pipemare::WorkerService service(*device, "", &metrics, virtual_device);
  int port = 0;
  auto started =
      pipemare::StartServer(listen, &service, &port, "--listen",
                            std::make_shared<pipemare::AccessPolicy>(
                                pipemare::WorkerAccessRules(), std::vector<pipemare::TokenEntry>{}),
                            /*require_client_certificate=*/true);
  if (!started.ok()) {
    pipemare::LogError(absl::StrCat("error: ", started.status().message()));
    return 2;
  }
  std::unique_ptr<grpc::Server> server = std::move(*started);
  if (advertise.empty()) {
    advertise = pipemare::WithPort(listen, port);
    if (advertise.rfind("0.0.0.0:", 0) == 0 || advertise.rfind("[::]:", 0) == 0) {
      // Bound to every interface: advertise the address this host uses to
      // reach the coordinator, which peers on that network can reach too
      // (a hostname may be shared by cloned hosts or containers).
      auto local = pipemare::LocalAddressToward(coordinator);
      if (!local.ok()) {
        pipemare::LogError(
            absl::StrCat("error: --advertise: cannot work out this host's address "
                         "toward the coordinator (",
                         local.status().message(), "); give --advertise HOST:PORT"));
        return 2;
      }
      // Over TLS the coordinator accepts only a host the certificate
      // names: advertise that name when it is this host's.
      const std::vector<std::string> names =
          insecure ? std::vector<std::string>{}
                   : pipemare::CertificateHosts(pipemare::CurrentRpcSecurity().cert_pem);
      char hostname[256] = {};
      ::gethostname(hostname, sizeof(hostname) - 1);
      std::string host = pipemare::AdvertisedHost(*local, names, hostname);
      if (host.empty()) {
        pipemare::LogError(absl::StrCat(
            "error: --advertise: this worker's certificate names ", absl::StrJoin(names, ", "),
            ", and none of them is this host (", hostname, ", ", *local,
            " toward the coordinator); the coordinator would refuse it. Give --advertise "
            "HOST:PORT with a name the certificate holds, or issue a certificate for this host"));
        return 2;
      }
      advertise = pipemare::WithPort(host, port);
    }
  }
  // Who this worker is across re-registrations (not its address).
  const std::string instance_id = [] {
    std::random_device rd;
    return absl::StrFormat("%08x%08x", rd(), rd());
  }();
  service.set_self_address(advertise);
  service.set_plaintext(insecure);
  // Advertise metrics on the same host as the service when bound to any.
  std::string metrics_address;
  if (metrics_server) {
    metrics_address = metrics_server->address();
    if (metrics_address.rfind("0.0.0.0:", 0) == 0) {
      metrics_address = pipemare::WithPort(
          advertise, std::stoi(metrics_address.substr(metrics_address.rfind(':') + 1)));
    }
  }
  pipemare::LogInfo(absl::StrCat("pipemare-worker serving on ", advertise,
                                 insecure ? " (plaintext)" : " (TLS)", " (device ", device_flag,
                                 ", threads ", threads, "), metrics on ",
                                 metrics_address.empty() ? "(off)" : metrics_address,
                                 ", health on ", health ? health->address() : "(off)"));

  // Register, then heartbeat; re-register when the coordinator forgets us.
  auto stub = pipemare::v1::Coordinator::NewStub(pipemare::MakeChannel(coordinator));
  std::string worker_id;
  auto heartbeat = [&](double deadline_seconds) {
    pipemare::v1::HeartbeatRequest req;
    req.set_worker_id(worker_id);
    req.set_instance_id(instance_id);
    pipemare::v1::HeartbeatResponse resp;
    auto ctx = pipemare::ContextWithDeadline(deadline_seconds);
    return stub->Heartbeat(ctx.get(), req, &resp);
  };
  int64_t interval_ms = 1000;
  auto last_contact = std::chrono::steady_clock::now();
  bool warned = false;
  std::string last_refusal;
  while (!pipemare::StopRequested()) {
    if (worker_id.empty()) {
      pipemare::v1::RegisterWorkerRequest req;
      req.set_address(advertise);
      req.set_device(device_flag);
      req.set_threads(threads);
      req.set_metrics_address(metrics_address);
      req.set_instance_id(instance_id);
      // What it serves: a restarted coordinator gives that job back to it on
      // the same stage, restoring from memory.
      *req.mutable_served() = service.Served();
      pipemare::v1::RegisterWorkerResponse resp;
      auto ctx = pipemare::ContextWithDeadline(5);
      grpc::Status st = stub->RegisterWorker(ctx.get(), req, &resp);
      if (st.ok()) {
        worker_id = resp.worker_id();
        ready(true);
        interval_ms = std::max<int64_t>(100, resp.heartbeat_interval_ms());
        last_contact = std::chrono::steady_clock::now();
        warned = false;
        pipemare::LogInfo(
            absl::StrCat("registered with coordinator ", coordinator, " as ", worker_id,
                         req.served().job_id().empty()
                             ? ""
                             : absl::StrCat(", holding stage ", req.served().stage(), " of job ",
                                            req.served().job_id(), " (",
                                            req.served().cut_steps_size(), " cuts in memory)")));
      } else if (st.error_code() == grpc::StatusCode::ALREADY_EXISTS) {
        // Another live worker advertises our address: say so every time (a
        // configuration error), and retry: if it was our own previous
        // process, its entry goes LOST and we get in.
        pipemare::LogError(absl::StrCat("the coordinator refused this worker: ", st.error_message(),
                                        " (retrying)"));
      } else if (st.error_code() != grpc::StatusCode::UNAVAILABLE &&
                 st.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED) {
        // The coordinator answered and said no (a certificate that does not
        // name the advertised address, a bad request): say why, once per
        // reason, and keep trying (the operator may fix the other side).
        if (st.error_message() != last_refusal) {
          last_refusal = st.error_message();
          pipemare::LogError(absl::StrCat("the coordinator ", coordinator, " refused this worker: ",
                                          st.error_message(), " (retrying)"));
        }
      } else if (!warned) {
        pipemare::LogWarning(absl::StrCat("cannot register with coordinator ", coordinator, ": ",
                                          st.error_message(), " (retrying)"));
        warned = true;
      }
    } else {
      grpc::Status st = heartbeat(5);
      if (st.ok()) {
        last_contact = std::chrono::steady_clock::now();
      } else if (st.error_code() == grpc::StatusCode::NOT_FOUND) {
        pipemare::LogWarning(
            absl::StrCat("coordinator does not know ", worker_id, "; registering again"));
        service.ReleaseAll("the coordinator no longer knows this worker");
        worker_id.clear();
        ready(false);
        continue;
      }
    }
    if (std::chrono::steady_clock::now() - last_contact >
        std::chrono::milliseconds(static_cast<int64_t>(lost_after * 1000))) {
      service.ReleaseAll("coordinator unreachable");
      worker_id.clear();
      ready(false);
      last_contact = std::chrono::steady_clock::now();
    }
    pipemare::WaitForStop(std::chrono::milliseconds(interval_ms));
  }
  if (service.HasStage() && !worker_id.empty()) {
    // Leave cleanly: the job drains at its next step, cuts a checkpoint and
    // recovers without this worker, losing nothing; wait (bounded) for the
    // coordinator to release the stage.
    pipemare::v1::DrainWorkerRequest req;
    req.set_worker_id(worker_id);
    req.set_instance_id(instance_id);
    pipemare::v1::DrainWorkerResponse resp;
    auto ctx = pipemare::ContextWithDeadline(5);
    grpc::Status st = stub->DrainWorker(ctx.get(), req, &resp);
    if (st.ok()) {
      pipemare::LogInfo(absl::StrCat("pipemare-worker stopping: draining job ", resp.job_id(),
                                     " (at most ", drain_timeout, " s)"));
      const auto deadline = std::chrono::steady_clock::now() +
                            std::chrono::milliseconds(static_cast<int64_t>(drain_timeout * 1000));
      auto beat = std::chrono::steady_clock::now();
      while (service.HasStage() && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        if (std::chrono::steady_clock::now() - beat > std::chrono::milliseconds(interval_ms)) {
          // Still alive while draining: not LOST before the cut is taken.
          (void)heartbeat(2);
          beat = std::chrono::steady_clock::now();
        }
      }
    } else {
      pipemare::LogWarning(absl::StrCat("cannot tell the coordinator this worker leaves (",
                                        st.error_message(), "); stopping now"));
    }
  }
  pipemare::LogInfo("pipemare-worker stopping");
  ready(false);
  service.ReleaseAll("worker shutting down");
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  return 0;
}
