// The coordinator's Prometheus metrics, computed at scrape time from the job
// store and the worker registry (docs/observability.md lists each one): jobs
// and workers by state, heartbeat misses, and per job (label job_id) its
// progress, throughput, losses and accuracy.
#ifndef PIPEMARE_COORDINATOR_COORDINATOR_METRICS_H_
#define PIPEMARE_COORDINATOR_COORDINATOR_METRICS_H_

#include <prometheus/collectable.h>

#include <vector>

#include "coordinator/job_store.h"
#include "coordinator/worker_registry.h"

namespace pipemare {

class CoordinatorMetrics : public prometheus::Collectable {
 public:
  // Per-job series are exported for every PENDING or RUNNING job and the
  // kRecentJobs most recently submitted others.
  static constexpr int kRecentJobs = 50;

  CoordinatorMetrics(const JobStore* store, const WorkerRegistry* registry)
      : store_(store), registry_(registry) {}

  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  const JobStore* const store_;
  const WorkerRegistry* const registry_;
};

}  // namespace pipemare

#endif  // PIPEMARE_COORDINATOR_COORDINATOR_METRICS_H_
