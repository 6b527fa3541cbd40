// pipemare-coordinator: takes jobs from clients, assigns stages to workers,
// feeds the pipelines and reports progress.
#include <grpcpp/grpcpp.h>

#include <CLI/CLI.hpp>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "common/rpc.h"
#include "common/signals.h"
#include "coordinator/coordinator_service.h"

int main(int argc, char** argv) {
  CLI::App app{"pipemare-coordinator: the Pipemare job coordinator"};
  std::string listen = "0.0.0.0:7070", address_file, state_dir;
  double worker_timeout = 5, heartbeat_interval = 1, stall_timeout = 120;
  app.add_option("--listen", listen, "address to serve on (port 0 = any free port)");
  app.add_option("--address-file", address_file,
                 "write the bound host:port here once serving (for launchers)");
  app.add_option("--state-dir", state_dir, "keep job records here across restarts");
  app.add_option("--worker-timeout", worker_timeout,
                 "seconds without a heartbeat before a worker is LOST")
      ->check(CLI::PositiveNumber);
  app.add_option("--heartbeat-interval", heartbeat_interval, "seconds between worker heartbeats")
      ->check(CLI::PositiveNumber);
  app.add_option("--stall-timeout", stall_timeout,
                 "fail a job whose pipeline makes no progress for this many seconds")
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  if (heartbeat_interval >= worker_timeout) {
    std::cerr << "error: --heartbeat-interval must be shorter than --worker-timeout" << std::endl;
    return 2;
  }
  pipemare::BlockStopSignals();

  pipemare::JobStore store(state_dir);
  pipemare::WorkerRegistry registry(
      std::chrono::milliseconds(static_cast<int64_t>(worker_timeout * 1000)));
  pipemare::RunnerOptions options;
  options.stall_timeout_seconds = stall_timeout;
  auto manager = std::make_unique<pipemare::JobManager>(&store, &registry, options);
  pipemare::CoordinatorService service(&store, &registry, manager.get(),
                                       static_cast<int64_t>(heartbeat_interval * 1000));
  int port = 0;
  auto started = pipemare::StartServer(listen, &service, &port, "--listen");
  if (!started.ok()) {
    std::cerr << "error: " << started.status().message() << std::endl;
    return 2;
  }
  std::unique_ptr<grpc::Server> server = std::move(*started);
  const std::string bound = pipemare::WithPort(listen, port);
  std::cerr << "pipemare-coordinator serving on " << bound << std::endl;
  if (!address_file.empty()) {
    const std::string tmp = address_file + ".tmp";
    std::ofstream(tmp) << bound << "\n";
    std::filesystem::rename(tmp, address_file);
  }
  while (!pipemare::WaitForStop(std::chrono::milliseconds(1000))) {
  }
  std::cerr << "pipemare-coordinator stopping" << std::endl;
  manager.reset();  // cancels running jobs and releases their workers
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  return 0;
}
