// pipemare-coordinator: takes jobs from clients, assigns stages to workers,
// feeds the pipelines and reports progress.
#include <grpcpp/grpcpp.h>

#include <CLI/CLI.hpp>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "common/health.h"
#include "common/log.h"
#include "common/metrics.h"
#include "common/rpc.h"
#include "common/signals.h"
#include "coordinator/coordinator_metrics.h"
#include "coordinator/coordinator_service.h"
#include "pipeline/core/file_access.h"

int main(int argc, char** argv) {
  CLI::App app{"pipemare-coordinator: the Pipemare job coordinator"};
  std::string listen = "0.0.0.0:7070", address_file, state_dir;
  std::string metrics_listen = "0.0.0.0:9460", metrics_address_file, log_format = "text";
  double worker_timeout = 5, heartbeat_interval = 1, stall_timeout = 120;
  app.add_option("--listen", listen, "address to serve on (port 0 = any free port)")
      ->envname("PIPEMARE_LISTEN");
  app.add_option("--address-file", address_file,
                 "write the bound host:port here once serving (for launchers)")
      ->envname("PIPEMARE_ADDRESS_FILE");
  app.add_option("--state-dir", state_dir, "keep job records here across restarts")
      ->envname("PIPEMARE_STATE_DIR");
  std::string checkpoint_dir;
  app.add_option("--checkpoint-dir", checkpoint_dir,
                 "checkpoints of jobs whose spec names no checkpoint.dir (default: STATE_DIR/"
                 "checkpoints, or ./pipemare-checkpoints without --state-dir); a directory "
                 "every worker reaches at the same path")
      ->envname("PIPEMARE_CHECKPOINT_DIR");
  app.add_option("--worker-timeout", worker_timeout,
                 "seconds without a heartbeat before a worker is LOST")
      ->check(CLI::PositiveNumber)
      ->envname("PIPEMARE_WORKER_TIMEOUT");
  app.add_option("--heartbeat-interval", heartbeat_interval, "seconds between worker heartbeats")
      ->check(CLI::PositiveNumber)
      ->envname("PIPEMARE_HEARTBEAT_INTERVAL");
  app.add_option("--stall-timeout", stall_timeout,
                 "fail a job whose pipeline makes no progress for this many seconds")
      ->check(CLI::PositiveNumber)
      ->envname("PIPEMARE_STALL_TIMEOUT");
  double drain_timeout = 20;
  app.add_option(
         "--drain-timeout", drain_timeout,
         "on SIGTERM, seconds each running job may take to drain and commit a "
         "checkpoint; the coordinator exits at most this + 10 s after SIGTERM, and at once on "
         "a second one")
      ->check(CLI::PositiveNumber)
      ->envname("PIPEMARE_DRAIN_TIMEOUT");
  app.add_option("--metrics-listen", metrics_listen,
                 "host:port for Prometheus /metrics (port 0 = any; empty = off)")
      ->envname("PIPEMARE_METRICS_LISTEN");
  app.add_option("--metrics-address-file", metrics_address_file,
                 "write the bound metrics host:port here once serving (for launchers)")
      ->envname("PIPEMARE_METRICS_ADDRESS_FILE");
  app.add_option("--log-format", log_format, "text or json")->envname("PIPEMARE_LOG_FORMAT");
  std::string health_listen;
  app.add_option("--health-listen", health_listen,
                 "host:port for gRPC health checks (grpc.health.v1.Health, plaintext, for "
                 "probes: '' live, pipemare.v1.Coordinator ready; port 0 = any; empty = off)")
      ->envname("PIPEMARE_HEALTH_LISTEN");
  pipemare::SecurityFlags security_flags;
  pipemare::AddSecurityFlags(app, &security_flags, /*client=*/false);
  std::string tokens_file;
  app.add_option("--tokens-file", tokens_file,
                 "the clients' bearer tokens, one 'NAME ROLE TOKEN' per line (ROLE read or "
                 "submit); required with TLS")
      ->envname("PIPEMARE_TOKENS_FILE");
  std::vector<std::string> data_roots;
  app.add_option("--data-root", data_roots,
                 "a directory jobs may read data and TorchScript models from and keep "
                 "checkpoints in (repeat, or separate with commas, for more; symlinks are followed "
                 "before the check). "
                 "Unset: any file this host can read (trusted users only)")
      ->envname("PIPEMARE_DATA_ROOT")
      ->delimiter(',');
  int max_queued_jobs = 32;
  app.add_option("--max-queued-jobs", max_queued_jobs,
                 "jobs one submitter may have waiting for workers at once")
      ->envname("PIPEMARE_MAX_QUEUED_JOBS")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  int max_workers = 0;
  app.add_option("--max-workers", max_workers,
                 "the most workers this cluster will ever have (e.g. the worker StatefulSet's "
                 "replicas): a job that needs more (schedule.stages x schedule.replicas) is "
                 "refused at submit rather than left waiting. 0: no bound")
      ->envname("PIPEMARE_MAX_WORKERS")
      ->check(CLI::Range(0, 1 << 20))
      ->capture_default_str();
  size_t max_watches_per_caller = pipemare::CoordinatorService::kDefaultMaxWatchesPerCaller;
  app.add_option("--max-watches-per-caller", max_watches_per_caller,
                 "WatchJob streams (pipemarectl watch, submit --wait) one caller may hold open at "
                 "once; each holds no thread")
      ->envname("PIPEMARE_MAX_WATCHES_PER_CALLER")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  int64_t max_model_bytes = pipemare::kDefaultMaxModelBytes;
  app.add_option("--max-model-bytes", max_model_bytes,
                 "float32 parameter bytes one job's model may take; each unit is checked by "
                 "arithmetic before the shape pass builds it, and this coordinator holds one "
                 "unit at a time")
      ->envname("PIPEMARE_MAX_MODEL_BYTES")
      ->check(CLI::Range(int64_t{1} << 20, int64_t{1} << 40))
      ->capture_default_str();
  size_t max_spec_bytes = 1 << 20;
  app.add_option("--max-spec-bytes", max_spec_bytes, "largest job spec accepted, in bytes")
      ->envname("PIPEMARE_MAX_SPEC_BYTES")
      ->check(CLI::Range(1024, 64 << 20))
      ->capture_default_str();
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
  if (heartbeat_interval >= worker_timeout) {
    pipemare::LogError("error: --heartbeat-interval must be shorter than --worker-timeout");
    return 2;
  }
  auto security = pipemare::LoadRpcSecurity(security_flags, pipemare::kCoordinatorName);
  if (!security.ok()) {
    pipemare::LogError(absl::StrCat("error: ", security.status().message()));
    return 2;
  }
  std::vector<pipemare::TokenEntry> tokens;
  if (!security->insecure) {
    if (tokens_file.empty()) {
      pipemare::LogError(
          "error: --tokens-file is required with TLS: clients authenticate with bearer tokens "
          "(scripts/dev-ca.sh writes one), or give --insecure");
      return 2;
    }
    auto loaded = pipemare::LoadTokens(tokens_file);
    if (!loaded.ok()) {
      pipemare::LogError(absl::StrCat("error: ", loaded.status().message()));
      return 2;
    }
    tokens = std::move(*loaded);
  } else {
    pipemare::LogWarning(
        "--insecure: plaintext gRPC, and anyone who reaches this port may submit jobs and "
        "register workers");
  }
  if (auto st = pipemare::SetDataRoots(data_roots, "--data-root", "the coordinator's"); !st.ok()) {
    pipemare::LogError(absl::StrCat("error: ", st.message()));
    return 2;
  }
  if (data_roots.empty()) {
    pipemare::LogWarning(
        "no --data-root: a job may read any file this host can read as its data or model");
  }
  const bool insecure = security->insecure;
  pipemare::SetRpcSecurity(std::move(*security));
  pipemare::BlockStopSignals();
  // Draining waits drain_timeout + 5 s for running jobs, then the server
  // 2 s; whatever still holds the process after that is cut short.
  pipemare::SetStopBound(drain_timeout + 10);
  pipemare::TuneMallocForLargeMessages();

  std::unique_ptr<pipemare::JobStore> store = std::make_unique<pipemare::JobStore>();
  if (!state_dir.empty()) {
    auto opened = pipemare::JobStore::Open(state_dir);
    if (!opened.ok()) {
      pipemare::LogError(absl::StrCat("error: ", opened.status().message()));
      return 2;
    }
    store = std::move(*opened);
  }
  pipemare::WorkerRegistry registry(
      std::chrono::milliseconds(static_cast<int64_t>(worker_timeout * 1000)));
  // Workers a previous coordinator knew: listed LOST until they register
  // again, which gives each its id back.
  if (const int known = registry.PersistIn(store.get()); known > 0) {
    pipemare::LogInfo(
        absl::StrCat("worker registry: ", known, " worker(s) known from the state database"));
  }
  pipemare::RunnerOptions options;
  options.stall_timeout_seconds = stall_timeout;
  options.drain_timeout_seconds = drain_timeout;
  options.max_queued_jobs_per_submitter = max_queued_jobs;
  options.max_workers = max_workers;
  options.max_model_bytes = max_model_bytes;
  options.tls = !insecure;
  options.checkpoint_dir = !checkpoint_dir.empty() ? checkpoint_dir
                           : !state_dir.empty()    ? state_dir + "/checkpoints"
                                                   : "pipemare-checkpoints";
  options.checkpoint_dir = std::filesystem::absolute(options.checkpoint_dir).string();
  auto manager = std::make_unique<pipemare::JobManager>(store.get(), &registry, options);
  pipemare::CoordinatorService service(store.get(), &registry, manager.get(),
                                       static_cast<int64_t>(heartbeat_interval * 1000),
                                       max_watches_per_caller);
  service.set_max_spec_bytes(max_spec_bytes);
  auto metrics = std::make_shared<pipemare::CoordinatorMetrics>(store.get(), &registry);
  std::unique_ptr<pipemare::MetricsServer> metrics_server;
  if (!metrics_listen.empty()) {
    auto m = pipemare::MetricsServer::Start(metrics_listen, {metrics});
    if (!m.ok()) {
      pipemare::LogError(absl::StrCat("error: ", m.status().message()));
      return 2;
    }
    metrics_server = std::move(*m);
  }
  std::unique_ptr<pipemare::HealthServer> health;
  if (!health_listen.empty()) {
    auto h = pipemare::HealthServer::Start(health_listen, pipemare::kCoordinatorServiceName,
                                           "--health-listen");
    if (!h.ok()) {
      pipemare::LogError(absl::StrCat("error: ", h.status().message()));
      return 2;
    }
    health = std::move(*h);
  }
  int port = 0;
  auto policy = std::make_shared<pipemare::AccessPolicy>(pipemare::CoordinatorAccessRules(),
                                                         std::move(tokens));
  // Clients present tokens, workers certificates: a client certificate is
  // verified when presented, not required.
  auto started = pipemare::StartServer(listen, &service, &port, "--listen", policy,
                                       /*require_client_certificate=*/false);
  if (!started.ok()) {
    pipemare::LogError(absl::StrCat("error: ", started.status().message()));
    return 2;
  }
  std::unique_ptr<grpc::Server> server = std::move(*started);
  const std::string bound = pipemare::WithPort(listen, port);
  pipemare::LogInfo(absl::StrCat("pipemare-coordinator serving on ", bound,
                                 insecure ? " (plaintext)" : " (TLS)", ", metrics on ",
                                 metrics_server ? metrics_server->address() : "(off)",
                                 ", health on ", health ? health->address() : "(off)"));
  if (health) health->Ready(true);  // the store is loaded and the service serves
  // Written atomically (rename): a reader sees the whole address or nothing.
  auto write_file = [](const std::string& path, const std::string& text) {
    const std::string tmp = path + ".tmp";
    std::ofstream(tmp) << text << "\n";
    std::filesystem::rename(tmp, path);
  };
  if (!metrics_address_file.empty() && metrics_server) {
    write_file(metrics_address_file, metrics_server->address());
  }
  if (!address_file.empty()) write_file(address_file, bound);
  while (!pipemare::WaitForStop(std::chrono::milliseconds(1000))) {
  }
  pipemare::LogInfo("pipemare-coordinator stopping: draining running jobs");
  if (health) health->Ready(false);
  manager.reset();        // drains running jobs (a cut each), releases their workers
  service.StopWatches();  // after the drain: watchers see how the jobs ended
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  return 0;
}
