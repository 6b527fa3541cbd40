// A worker's Prometheus metrics (docs/observability.md lists each one). Stage
// metrics carry the labels job_id and stage; their series are created with
// value 0 when a stage loads, so every panel has data from the start, and are
// kept after the stage is released (the last kRetainedStages stages), so a
// finished job can still be inspected.
#ifndef PIPEMARE_STAGE_WORKER_STAGE_METRICS_H_
#define PIPEMARE_STAGE_WORKER_STAGE_METRICS_H_

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <deque>
#include <memory>
#include <mutex>
#include <string>

namespace pipemare {

struct StageStats;
class WorkerMetrics;

// One stage's series. Thread-safe (prometheus-cpp metrics are atomic).
class StageMetrics {
 public:
  ~StageMetrics();
  StageMetrics(const StageMetrics&) = delete;
  StageMetrics& operator=(const StageMetrics&) = delete;

  prometheus::Histogram* forward_train_seconds;
  prometheus::Histogram* forward_eval_seconds;
  prometheus::Histogram* backward_seconds;
  prometheus::Histogram* weight_seconds;  // zero_bubble's W
  // schedule.replicas > 1: each gradient all-reduce, and the bytes it
  // contributed.
  prometheus::Histogram* allreduce_seconds;
  prometheus::Counter* allreduce_bytes;
  prometheus::Histogram* optimizer_step_seconds;
  prometheus::Counter* busy_seconds;
  prometheus::Counter* idle_seconds;
  prometheus::Counter* forwards_train;
  prometheus::Counter* forwards_eval;
  prometheus::Counter* backwards;
  prometheus::Counter* weight_gradients;
  prometheus::Counter* optimizer_steps;
  prometheus::Counter* sent_activation_bytes;
  prometheus::Counter* sent_gradient_bytes;
  // Of those, the bytes that went over the data plane (schedule.transport
  // gloo, tensors of data_plane_min_bytes and more).
  prometheus::Counter* data_plane_activation_bytes;
  prometheus::Counter* data_plane_gradient_bytes;
  prometheus::Counter* received_activation_bytes;
  prometheus::Counter* received_gradient_bytes;
  prometheus::Counter* received_targets_bytes;
  // Checkpoint cuts: the copy to host memory on the compute thread (what a
  // cut costs training), the background write, and the bytes written.
  prometheus::Histogram* checkpoint_snapshot_seconds;
  prometheus::Histogram* checkpoint_write_seconds;
  prometheus::Counter* checkpoint_bytes;
  // Microbatches dropped here for a NaN or Inf (train.on_nonfinite: skip).
  prometheus::Counter* nonfinite_skipped;

  // Sets the gauges that mirror the runtime's stats.
  void Update(const StageStats& stats);

 private:
  friend class WorkerMetrics;
  StageMetrics(WorkerMetrics* owner, const prometheus::Labels& labels);

  WorkerMetrics* const owner_;
  prometheus::Gauge* in_flight_;
  prometheus::Gauge* delay_;
  prometheus::Gauge* analytic_delay_;
  prometheus::Gauge* learning_rate_;
  prometheus::Gauge* t2_correction_;
  prometheus::Gauge* parameters_;
  // weights, optimizer_state, t2_velocity, stash, saved_activations, receive_pool
  prometheus::Gauge* memory_[6];
  int64_t steps_seen_ = 0;
};

class WorkerMetrics {
 public:
  static constexpr int kRetainedStages = 8;

  explicit WorkerMetrics(const std::string& device);
  WorkerMetrics(const WorkerMetrics&) = delete;
  WorkerMetrics& operator=(const WorkerMetrics&) = delete;

  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

  // The series of (job_id, stage): the same object again if that stage was
  // loaded before and is still retained, so counters keep counting.
  std::shared_ptr<StageMetrics> ForStage(const std::string& job_id, int stage);
  void SetLoadedStages(int n) { stages_->Set(n); }

 private:
  friend class StageMetrics;
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Histogram>& forward_seconds_;
  prometheus::Family<prometheus::Histogram>& backward_seconds_;
  prometheus::Family<prometheus::Histogram>& weight_seconds_;
  prometheus::Family<prometheus::Histogram>& allreduce_seconds_;
  prometheus::Family<prometheus::Counter>& allreduce_bytes_;
  prometheus::Family<prometheus::Histogram>& step_seconds_;
  prometheus::Family<prometheus::Counter>& busy_;
  prometheus::Family<prometheus::Counter>& idle_;
  prometheus::Family<prometheus::Counter>& microbatches_;
  prometheus::Family<prometheus::Counter>& steps_;
  prometheus::Family<prometheus::Counter>& sent_;
  prometheus::Family<prometheus::Counter>& data_plane_;
  prometheus::Family<prometheus::Counter>& received_;
  prometheus::Family<prometheus::Histogram>& checkpoint_snapshot_seconds_;
  prometheus::Family<prometheus::Histogram>& checkpoint_write_seconds_;
  prometheus::Family<prometheus::Counter>& checkpoint_bytes_;
  prometheus::Family<prometheus::Counter>& nonfinite_skipped_;
  prometheus::Family<prometheus::Gauge>& in_flight_;
  prometheus::Family<prometheus::Gauge>& delay_;
  prometheus::Family<prometheus::Gauge>& analytic_delay_;
  prometheus::Family<prometheus::Gauge>& learning_rate_;
  prometheus::Family<prometheus::Gauge>& t2_correction_;
  prometheus::Family<prometheus::Gauge>& memory_;
  prometheus::Family<prometheus::Gauge>& parameters_;
  prometheus::Gauge* stages_;

  std::mutex mu_;
  std::deque<std::pair<std::string, std::shared_ptr<StageMetrics>>> retained_;  // newest last
};

}  // namespace pipemare

#endif  // PIPEMARE_STAGE_WORKER_STAGE_METRICS_H_
