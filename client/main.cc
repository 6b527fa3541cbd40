// pipemarectl: the command-line client of a Pipemare coordinator, and a
// launcher for one-machine runs (`pipemarectl local`).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/commands.h"
#include "client/local.h"
#include "client/simulate.h"
#include "common/dev_pki.h"
#include "common/health.h"
#include "common/security.h"

namespace pipemare::client {
namespace {

std::string DefaultCoordinator() {
  const char* env = std::getenv("PIPEMARE_COORDINATOR");
  return env != nullptr && *env != '\0' ? env : "127.0.0.1:7070";
}

// Levenshtein distance, for "did you mean".
size_t EditDistance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] != b[j - 1] ? 1 : 0)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

int Main(int argc, char** argv) {
  CLI::App app{"pipemarectl: submit, follow and manage Pipemare training jobs"};
  app.require_subcommand(1);
  // Global options may also come after the subcommand.
  app.fallthrough();

  GlobalOptions options;
  options.coordinator = DefaultCoordinator();
  app.add_option("--coordinator", options.coordinator,
                 "Coordinator address host:port (env PIPEMARE_COORDINATOR)")
      ->capture_default_str();
  std::string output = "table";
  app.add_option("--output,-o", output, "Output format")
      ->check(CLI::IsMember({"table", "json"}))
      ->capture_default_str();

  SecurityFlags security_flags;
  AddSecurityFlags(app, &security_flags, /*client=*/true);

  std::string file;
  std::string job_id;
  bool wait = false;
  LocalOptions local;

  CLI::App* submit = app.add_subcommand("submit", "Submit a job spec (YAML or JSON)");
  submit->add_option("FILE", file, "Job spec file")->required();
  submit->add_flag("--wait", wait, "Follow the job; exit 0 only if it SUCCEEDED");
  std::string from;
  submit->add_option("--from", from,
                     "Start from another job's checkpoint: a job id (its newest checkpoint) or a "
                     "checkpoint step directory on the coordinator's host; P, the partition and "
                     "the schedule may differ, the model may not");
  std::string init_from;
  submit
      ->add_option("--init-from", init_from,
                   "Start from another job's weights only (a job id or checkpoint step "
                   "directory, as --from), at step 0 with fresh optimizer state and schedule: "
                   "a fine-tune, or a new schedule from trained weights")
      ->excludes("--from");

  CLI::App* status = app.add_subcommand("status", "Show one job in detail");
  status->add_option("JOB", job_id, "Job id")->required();

  CLI::App* list = app.add_subcommand("list", "List jobs");

  CLI::App* watch = app.add_subcommand("watch", "Follow a job until it ends");
  watch->add_option("JOB", job_id, "Job id")->required();

  CLI::App* cancel = app.add_subcommand("cancel", "Cancel a job");
  cancel->add_option("JOB", job_id, "Job id")->required();

  CLI::App* workers = app.add_subcommand("workers", "List registered workers");

  CLI::App* resume =
      app.add_subcommand("resume", "Continue a FAILED or CANCELLED job from its newest checkpoint");
  resume->add_option("JOB", job_id, "Job id")->required();
  resume->add_flag("--wait", wait, "Follow the job; exit 0 only if it SUCCEEDED");

  std::string export_out;
  int64_t export_step = 0;
  CLI::App* export_cmd = app.add_subcommand(
      "export", "Write a job's trained model as a PyTorch state dict (or TorchScript module)");
  export_cmd->add_option("JOB", job_id, "Job id")->required();
  export_cmd->add_option("--out", export_out, "Model file to write (its spec goes to FILE.json)")
      ->required();
  export_cmd
      ->add_option("--checkpoint", export_step,
                   "The checkpoint's step (default: the newest that verifies)")
      ->check(CLI::PositiveNumber);

  CLI::App* local_cmd =
      app.add_subcommand("local", "Run a job on a coordinator and workers started on this machine");
  local_cmd->add_option("FILE", local.spec_file, "Job spec file")->required();
  local_cmd->add_option("--workers", local.workers, "Workers to start (default: one per stage)")
      ->check(CLI::PositiveNumber);
  local_cmd
      ->add_option("--threads", local.threads,
                   "Threads per worker (0 = the host's CPUs shared evenly among the workers)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  local_cmd->add_option("--export", local.export_file,
                        "When the job succeeds, write its trained model here (as export does)");
  local_cmd
      ->add_option("--device", local.device,
                   "Every worker's --device: cpu, cuda or cuda:N (workers share one GPU)")
      ->capture_default_str();
  local_cmd->add_flag("--keep-logs", local.keep_logs,
                      "Keep the log directory even if the job succeeds");
  local_cmd->add_option("--prometheus-targets", local.prometheus_targets,
                        "Write the services' /metrics addresses to this file, as Prometheus "
                        "file_sd targets (e.g. deploy/prometheus/targets/local.json)");

  SimulateOptions simulate;
  CLI::App* simulate_cmd = app.add_subcommand(
      "simulate",
      "Print each stage's plan for the job and its predicted utilization (runs nothing)");
  simulate_cmd->add_option("FILE", simulate.spec_file, "Job spec file")->required();
  simulate_cmd->add_option("--steps", simulate.steps, "Optimizer steps in the simulated epoch")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  simulate_cmd->add_option("--show", simulate.show, "Actions printed per stage (0 = all)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  simulate_cmd
      ->add_option("--backward-cost", simulate.backward_cost,
                   "Cost of a backward relative to a forward")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  simulate_cmd
      ->add_option("--weight-share", simulate.weight_share,
                   "zero_bubble: the weight gradient W's share of a backward")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();

  DevPkiOptions dev_ca;
  std::vector<std::string> worker_hosts;
  CLI::App* dev_ca_cmd = app.add_subcommand(
      "dev-ca",
      "Make a development cluster CA, the coordinator's and workers' certificates and two "
      "client tokens (scripts/dev-ca.sh; for trying TLS out, not for production)");
  dev_ca_cmd->add_option("--out", dev_ca.dir, "Directory to write them to")->required();
  dev_ca_cmd
      ->add_option("--coordinator-host", dev_ca.coordinator_hosts,
                   "A name or IP address the coordinator is reached by (repeat for more)")
      ->capture_default_str();
  dev_ca_cmd->add_option("--worker-host", worker_hosts,
                         "One worker certificate per use, naming HOST[,HOST...]: the addresses "
                         "that worker may advertise (default: one for 127.0.0.1,localhost)");
  bool dev_ca_force = false;
  dev_ca_cmd->add_flag("--force", dev_ca_force,
                       "Replace a CA already in --out (every certificate and token it made "
                       "stops working)");
  dev_ca_cmd->add_option("--days", dev_ca.days, "Days the certificates are valid")
      ->check(CLI::Range(1, 3650))
      ->capture_default_str();

  std::string health_address, health_service;
  double health_timeout = 3;
  CLI::App* health_cmd = app.add_subcommand(
      "health",
      "Check a service's --health-listen port (grpc.health.v1.Health, plaintext): exit 0 "
      "when SERVING, 1 otherwise (for Docker HEALTHCHECK and scripts)");
  health_cmd->add_option("ADDRESS", health_address, "host:port of the health port")->required();
  health_cmd
      ->add_option("--service", health_service,
                   "'' (default): is it up; pipemare.v1.Coordinator or pipemare.v1.StageWorker: "
                   "is it ready")
      ->capture_default_str();
  health_cmd->add_option("--timeout", health_timeout, "Seconds to wait for the answer")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();

  // A misspelt command reads as "no command" to CLI11: name it instead.
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.empty() || arg[0] == '-') {
      // An option of pipemarectl's own that takes a value skips that value.
      if ((arg == "--coordinator" || arg == "--output" || arg == "-o" || arg == "--tls-ca" ||
           arg == "--token-file") &&
          i + 1 < argc) {
        ++i;
      }
      continue;
    }
    bool known = false;
    std::string closest;
    size_t closest_distance = 3;  // suggest only near misses
    for (const CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) {
      const std::string& name = sub->get_name();
      if (name == arg) known = true;
      const size_t d = EditDistance(arg, name);
      if (d < closest_distance) closest_distance = d, closest = name;
    }
    if (!known) {
      std::fprintf(stderr, "error: unknown command '%s'%s; run pipemarectl --help for the list\n",
                   arg.c_str(),
                   closest.empty() ? "" : absl::StrCat(" (did you mean '", closest, "'?)").c_str());
      return kExitBadInput;
    }
    break;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int code = app.exit(e);
    return code == 0 ? kExitOk : kExitBadInput;
  }
  options.output = output == "json" ? OutputFormat::kJson : OutputFormat::kTable;
  const bool json = options.output == OutputFormat::kJson;
  simulate.json = json;
  if (*simulate_cmd) return RunSimulate(simulate);
  if (*health_cmd) {
    auto serving = CheckServing(health_address, health_service, health_timeout);
    const std::string what =
        health_service.empty() ? health_address : health_service + " at " + health_address;
    if (!serving.ok()) {
      std::fprintf(stderr, "%s: no answer: %s\n", what.c_str(),
                   std::string(serving.status().message()).c_str());
      if (json) {
        std::printf("{\"address\": \"%s\", \"service\": \"%s\", \"status\": \"NO_ANSWER\"}\n",
                    JsonEscape(health_address).c_str(), JsonEscape(health_service).c_str());
      }
      return kExitFailed;
    }
    if (json) {
      std::printf("{\"address\": \"%s\", \"service\": \"%s\", \"status\": \"%s\"}\n",
                  JsonEscape(health_address).c_str(), JsonEscape(health_service).c_str(),
                  *serving ? "SERVING" : "NOT_SERVING");
    } else {
      std::printf("%s: %s\n", what.c_str(), *serving ? "SERVING" : "NOT_SERVING");
    }
    return *serving ? kExitOk : kExitFailed;
  }
  if (*dev_ca_cmd) {
    dev_ca.replace = dev_ca_force;
    if (!worker_hosts.empty()) {
      dev_ca.name_workers_by_host = true;
      dev_ca.workers.clear();
      for (const std::string& hosts : worker_hosts) {
        dev_ca.workers.push_back(absl::StrSplit(hosts, ',', absl::SkipEmpty()));
      }
    }
    auto pki = MakeDevPki(dev_ca);
    if (!pki.ok()) {
      std::fprintf(stderr, "error: %s\n", std::string(pki.status().message()).c_str());
      return kExitFailed;
    }
    std::string worker_files;
    for (const std::string& cert : pki->worker_certs) {
      const std::string base = std::filesystem::path(cert).filename().string();
      absl::StrAppend(&worker_files, worker_files.empty() ? "" : ", ", base, " (.key)");
    }
    std::printf(
        "wrote to %s:\n"
        "  ca.pem (ca.key)        the cluster CA: every service's --tls-ca, a client's --tls-ca\n"
        "  coordinator.pem/.key   the coordinator's --tls-cert/--tls-key\n"
        "  worker certificates    %s: each worker's --tls-cert/--tls-key\n"
        "  tokens                 the coordinator's --tokens-file (admin: submit, viewer: read)\n"
        "  submit.token           a client's --token-file for admin; read.token for viewer\n",
        dev_ca.dir.c_str(), worker_files.c_str());
    return kExitOk;
  }
  if (*local_cmd) {
    // Runs its own coordinator and workers with a throwaway CA and token.
    local.insecure = security_flags.insecure;
    return RunLocal(options, local);
  }
  auto security = LoadRpcSecurity(security_flags, /*role=*/"");
  if (!security.ok()) {
    std::fprintf(stderr, "error: %s\n", std::string(security.status().message()).c_str());
    return kExitBadInput;
  }
  SetRpcSecurity(std::move(*security));

  if (*submit) return RunSubmit(options, file, wait, from, init_from);
  if (*status) return RunStatus(options, job_id);
  if (*list) return RunList(options);
  if (*watch) return RunWatch(options, job_id);
  if (*cancel) return RunCancel(options, job_id);
  if (*workers) return RunWorkers(options);
  if (*resume) return RunResume(options, job_id, wait);
  if (*export_cmd) return RunExport(options, job_id, export_step, export_out);
  return kExitBadInput;
}

}  // namespace
}  // namespace pipemare::client

int main(int argc, char** argv) { return pipemare::client::Main(argc, argv); }
