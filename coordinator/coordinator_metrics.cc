#include "coordinator/coordinator_metrics.h"

#include <prometheus/metric_family.h>

#include <algorithm>
#include <map>
#include <string>

#include "coordinator/feeds.h"

namespace pipemare {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

MetricFamily Family(const char* name, const char* help, MetricType type) {
  MetricFamily f;
  f.name = name;
  f.help = help;
  f.type = type;
  return f;
}

void Add(MetricFamily& f, std::vector<ClientMetric::Label> labels, double value) {
  ClientMetric m;
  m.label = std::move(labels);
  if (f.type == MetricType::Counter) {
    m.counter.value = value;
  } else {
    m.gauge.value = value;
  }
  f.metric.push_back(std::move(m));
}

}  // namespace

std::vector<MetricFamily> CoordinatorMetrics::Collect() const {
  std::vector<v1::JobStatus> jobs = store_->List();
  const std::vector<v1::WorkerInfo> workers = registry_->List();

  MetricFamily by_state = Family("pipemare_jobs", "Jobs by state", MetricType::Gauge);
  std::map<v1::JobState, int> job_counts;
  for (v1::JobState s :
       {v1::PENDING, v1::RUNNING, v1::RECOVERING, v1::SUCCEEDED, v1::FAILED, v1::CANCELLED}) {
    job_counts[s] = 0;
  }
  for (const auto& j : jobs) ++job_counts[j.state()];
  for (const auto& [state, n] : job_counts) {
    if (state == v1::JOB_STATE_UNSPECIFIED) continue;
    Add(by_state, {{"state", v1::JobState_Name(state)}}, n);
  }

  MetricFamily workers_by_state =
      Family("pipemare_workers", "Registered workers by state", MetricType::Gauge);
  std::map<v1::WorkerState, int> worker_counts = {{v1::IDLE, 0}, {v1::BUSY, 0}, {v1::LOST, 0}};
  for (const auto& w : workers) ++worker_counts[w.state()];
  for (const auto& [state, n] : worker_counts) {
    if (state == v1::WORKER_STATE_UNSPECIFIED) continue;
    Add(workers_by_state, {{"state", v1::WorkerState_Name(state)}}, n);
  }

  MetricFamily misses =
      Family("pipemare_worker_heartbeat_misses_total",
             "Times a worker went LOST for missing heartbeats", MetricType::Counter);
  Add(misses, {}, static_cast<double>(registry_->HeartbeatMisses()));
  MetricFamily unreachable =
      Family("pipemare_worker_unreachable_total",
             "Times a worker went LOST because it refused the coordinator's connection",
             MetricType::Counter);
  Add(unreachable, {}, static_cast<double>(registry_->Unreachable()));

  MetricFamily sent = Family(
      "pipemare_coordinator_sent_bytes_total",
      "Bytes the coordinator sent on its feeds to stage 0 and the last stage (data slices; the "
      "stages read the examples themselves)",
      MetricType::Counter);
  Add(sent, {{"path", "feeds"}}, static_cast<double>(Feeds::TotalSentBytes()));

  // Newest first; keep live jobs and the kRecentJobs newest others.
  std::sort(jobs.begin(), jobs.end(), [](const v1::JobStatus& a, const v1::JobStatus& b) {
    return a.submitted_unix_ms() > b.submitted_unix_ms();
  });
  MetricFamily info = Family("pipemare_job_info", "Always 1; the job's name, schedule and state",
                             MetricType::Gauge);
  MetricFamily step = Family("pipemare_job_step", "Optimizer steps done", MetricType::Gauge);
  MetricFamily total =
      Family("pipemare_job_total_steps", "Optimizer steps in the whole job", MetricType::Gauge);
  MetricFamily epoch =
      Family("pipemare_job_epoch", "Epoch in progress (1-based)", MetricType::Gauge);
  MetricFamily rate = Family("pipemare_job_samples_per_second",
                             "Training samples per second over the last window", MetricType::Gauge);
  MetricFamily train_loss = Family("pipemare_job_train_loss",
                                   "Mean training loss over the last window", MetricType::Gauge);
  MetricFamily eval_loss = Family("pipemare_job_eval_loss",
                                  "Held-out loss after the last finished epoch", MetricType::Gauge);
  MetricFamily eval_accuracy =
      Family("pipemare_job_eval_accuracy",
             "Held-out accuracy (ratio 0..1) after the last finished epoch", MetricType::Gauge);
  MetricFamily perplexity =
      Family("pipemare_job_eval_perplexity",
             "Language models: held-out perplexity, exp(eval loss), after the last finished epoch",
             MetricType::Gauge);
  MetricFamily restarts = Family(
      "pipemare_job_restarts_total",
      "Automatic recoveries of the job from a lost worker (status: restarts)", MetricType::Counter);
  MetricFamily recover_seconds =
      Family("pipemare_job_last_recovery_seconds",
             "From detecting the job's last failure to its first step trained after it",
             MetricType::Gauge);
  MetricFamily predicted =
      Family("pipemare_stage_predicted_seconds",
             "The profile partition's predicted forward + backward seconds per microbatch of "
             "each stage; bottleneck=\"true\" on the slowest",
             MetricType::Gauge);
  int others = 0;
  for (const auto& j : jobs) {
    const bool live =
        j.state() == v1::PENDING || j.state() == v1::RUNNING || j.state() == v1::RECOVERING;
    if (!live && ++others > kRecentJobs) continue;
    const std::vector<ClientMetric::Label> id = {{"job_id", j.id()}};
    Add(info,
        {{"job_id", j.id()},
         {"name", j.name()},
         {"schedule", j.schedule()},
         {"state", v1::JobState_Name(j.state())},
         {"task", j.task()},
         {"partition", j.partition()}},
        1);
    for (const auto& s : j.stages()) {
      if (s.predicted_seconds() <= 0) continue;
      Add(predicted,
          {{"job_id", j.id()},
           {"stage", std::to_string(s.index())},
           {"bottleneck", s.bottleneck() ? "true" : "false"}},
          s.predicted_seconds());
    }
    Add(step, id, static_cast<double>(j.progress().step()));
    Add(restarts, id, j.restarts_size());
    if (!j.restarts().empty() && j.restarts().rbegin()->recover_seconds() > 0) {
      Add(recover_seconds, id, j.restarts().rbegin()->recover_seconds());
    }
    Add(total, id, static_cast<double>(j.progress().total_steps()));
    Add(epoch, id, j.progress().epoch());
    Add(rate, id, j.metrics().samples_per_second());
    Add(train_loss, id, j.metrics().train_loss());
    if (!j.epochs().empty()) {
      Add(eval_loss, id, j.metrics().test_loss());
      Add(eval_accuracy, id, j.metrics().test_accuracy());
      if (j.metrics().test_perplexity() > 0) {
        Add(perplexity, id, j.metrics().test_perplexity());
      }
    }
  }
  return {by_state,   workers_by_state,
          misses,     unreachable,
          info,       step,
          total,      epoch,
          rate,       train_loss,
          eval_loss,  eval_accuracy,
          perplexity, predicted,
          restarts,   recover_seconds,
          sent};
}

}  // namespace pipemare
