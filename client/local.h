// `pipemarectl local`: runs a job on a throwaway cluster of one coordinator
// and N workers on loopback, started from the binaries next to pipemarectl.
#ifndef PIPEMARE_CLIENT_LOCAL_H_
#define PIPEMARE_CLIENT_LOCAL_H_

#include <string>

#include "client/commands.h"

namespace pipemare::client {

struct LocalOptions {
  std::string spec_file;
  int workers = 0;  // 0: one per pipeline stage
  int threads = 0;  // per worker; 0 = the host's CPUs shared evenly among the workers
  bool keep_logs = false;
  // If set, the trained model is exported here when the job succeeds.
  std::string export_file;
  // If set, a Prometheus file_sd targets file naming the coordinator's and
  // every worker's /metrics (deploy/prometheus/local.yml reads such files).
  std::string prometheus_targets;
  // Plaintext without authentication instead of a throwaway CA's mutual
  // TLS and a token.
  bool insecure = false;
  // Each worker's --device ("cpu", "cuda", "cuda:N"): workers on one GPU
  // share it.
  std::string device = "cpu";
};

// Validates the spec, starts the cluster, runs the job to its end, prints the
// final status and stops everything it started. Returns the exit code: 0 only
// if the job SUCCEEDED, 1 if it ended otherwise or the cluster failed, 2 for
// a bad spec, 130 when interrupted.
int RunLocal(const GlobalOptions& options, const LocalOptions& local);

}  // namespace pipemare::client

#endif  // PIPEMARE_CLIENT_LOCAL_H_
