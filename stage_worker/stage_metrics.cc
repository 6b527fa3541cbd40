#include "stage_worker/stage_metrics.h"

#include <algorithm>

#include "common/buffer_pool.h"
#include "pipeline/runtime/stage_runtime.h"

namespace pipemare {
namespace {

using prometheus::BuildCounter;
using prometheus::BuildGauge;
using prometheus::BuildHistogram;
using prometheus::Labels;

// Seconds, 100 µs to 10 s: a small MLP stage on CPU up to a large GPU block.
const prometheus::Histogram::BucketBoundaries& DurationBuckets() {
  static const prometheus::Histogram::BucketBoundaries b = {
      0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
      0.05,   0.1,     0.25,   0.5,   1,      2.5,   5,    10};
  return b;
}

Labels With(Labels l, const std::string& key, const std::string& value) {
  l[key] = value;
  return l;
}

// The last is the worker's, not the stage's tensors: free receive buffers
// kept for the next large payload (common/buffer_pool.h).
constexpr const char* kMemoryKinds[] = {"weights", "optimizer_state",   "t2_velocity",
                                        "stash",   "saved_activations", "receive_pool"};
constexpr int kKinds = sizeof(kMemoryKinds) / sizeof(kMemoryKinds[0]);
static_assert(kKinds == 6, "StageMetrics::memory_ holds one gauge per kind");

}  // namespace

WorkerMetrics::WorkerMetrics(const std::string& device)
    : registry_(std::make_shared<prometheus::Registry>()),
      forward_seconds_(BuildHistogram()
                           .Name("pipemare_stage_forward_seconds")
                           .Help("Duration of one stage forward of one microbatch")
                           .Register(*registry_)),
      backward_seconds_(
          BuildHistogram()
              .Name("pipemare_stage_backward_seconds")
              .Help("Duration of one backward of one microbatch (with its recompute under "
                    "schedule.recompute; zero_bubble: the input gradient B), without the step")
              .Register(*registry_)),
      weight_seconds_(BuildHistogram()
                          .Name("pipemare_stage_weight_gradient_seconds")
                          .Help("zero_bubble: duration of one weight gradient (W) of one "
                                "microbatch")
                          .Register(*registry_)),
      allreduce_seconds_(BuildHistogram()
                             .Name("pipemare_stage_allreduce_seconds")
                             .Help("schedule.replicas > 1: duration of one all-reduce of the "
                                   "stage's gradients with its replicas (c10d Gloo)")
                             .Register(*registry_)),
      allreduce_bytes_(BuildCounter()
                           .Name("pipemare_stage_allreduce_bytes_total")
                           .Help("schedule.replicas > 1: gradient bytes this stage contributed "
                                 "to its all-reduces")
                           .Register(*registry_)),
      step_seconds_(BuildHistogram()
                        .Name("pipemare_stage_optimizer_step_seconds")
                        .Help("Duration of one optimizer step")
                        .Register(*registry_)),
      busy_(BuildCounter()
                .Name("pipemare_stage_busy_seconds_total")
                .Help("Compute-thread time spent computing")
                .Register(*registry_)),
      idle_(BuildCounter()
                .Name("pipemare_stage_idle_seconds_total")
                .Help("Compute-thread time spent waiting for input (the bubble)")
                .Register(*registry_)),
      microbatches_(BuildCounter()
                        .Name("pipemare_stage_microbatches_total")
                        .Help("Microbatches processed, by pass (forward|backward) and phase")
                        .Register(*registry_)),
      steps_(BuildCounter()
                 .Name("pipemare_stage_optimizer_steps_total")
                 .Help("Optimizer steps applied")
                 .Register(*registry_)),
      sent_(BuildCounter()
                .Name("pipemare_stage_sent_bytes_total")
                .Help("Tensor payload bytes sent: activations downstream, gradients upstream")
                .Register(*registry_)),
      data_plane_(BuildCounter()
                      .Name("pipemare_stage_data_plane_sent_bytes_total")
                      .Help("Of the tensor payload bytes sent, those that went over the data "
                            "plane (schedule.transport gloo) instead of the Pipe stream")
                      .Register(*registry_)),
      received_(BuildCounter()
                    .Name("pipemare_stage_received_bytes_total")
                    .Help("Tensor payload bytes received, by kind")
                    .Register(*registry_)),
      checkpoint_snapshot_seconds_(
          BuildHistogram()
              .Name("pipemare_stage_checkpoint_snapshot_seconds")
              .Help("Compute-thread time to copy the stage's state to host memory for one "
                    "checkpoint cut: what a cut costs training")
              .Register(*registry_)),
      checkpoint_write_seconds_(
          BuildHistogram()
              .Name("pipemare_stage_checkpoint_write_seconds")
              .Help("Background time to write one cut: serialize, SHA-256, fsync, rename")
              .Register(*registry_)),
      checkpoint_bytes_(BuildCounter()
                            .Name("pipemare_stage_checkpoint_bytes_total")
                            .Help("Bytes of checkpoint files written")
                            .Register(*registry_)),
      nonfinite_skipped_(BuildCounter()
                             .Name("pipemare_stage_nonfinite_skipped_total")
                             .Help("Microbatches dropped at this stage for a NaN or Inf that "
                                   "arrived here (train.on_nonfinite: skip)")
                             .Register(*registry_)),
      in_flight_(BuildGauge()
                     .Name("pipemare_stage_microbatches_in_flight")
                     .Help("Forwards whose backward has not run yet")
                     .Register(*registry_)),
      delay_(BuildGauge()
                 .Name("pipemare_stage_delay_steps")
                 .Help("Measured mean delay: optimizer steps between a forward and its backward")
                 .Register(*registry_)),
      analytic_delay_(BuildGauge()
                          .Name("pipemare_stage_analytic_delay_steps")
                          .Help("The schedule's analytic delay tau_i")
                          .Register(*registry_)),
      learning_rate_(BuildGauge()
                         .Name("pipemare_stage_learning_rate")
                         .Help("Step size of the last optimizer step, after T1")
                         .Register(*registry_)),
      t2_correction_(
          BuildGauge()
              .Name("pipemare_stage_t2_correction_norm")
              .Help("L2 norm of the backward weights minus the current ones at the last backward "
                    "(T2's correction; the stash's age under pipedream)")
              .Register(*registry_)),
      memory_(BuildGauge()
                  .Name("pipemare_stage_memory_bytes")
                  .Help("Bytes the stage holds, by kind")
                  .Register(*registry_)),
      parameters_(BuildGauge()
                      .Name("pipemare_stage_parameters")
                      .Help("Parameters of the stage")
                      .Register(*registry_)) {
  BuildGauge()
      .Name("pipemare_worker_info")
      .Help("Always 1; the worker's device in the label")
      .Register(*registry_)
      .Add({{"device", device}})
      .Set(1);
  stages_ = &BuildGauge()
                 .Name("pipemare_worker_stages")
                 .Help("Stages loaded on this worker now")
                 .Register(*registry_)
                 .Add({});
}

std::shared_ptr<StageMetrics> WorkerMetrics::ForStage(const std::string& job_id, int stage) {
  const std::string key = job_id + "/" + std::to_string(stage);
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = retained_.begin(); it != retained_.end(); ++it) {
    if (it->first == key) {
      auto m = it->second;
      m->steps_seen_ = 0;  // a reloaded stage's runtime counts steps from 0
      retained_.erase(it);
      retained_.emplace_back(key, m);
      return m;
    }
  }
  std::shared_ptr<StageMetrics> m(
      new StageMetrics(this, {{"job_id", job_id}, {"stage", std::to_string(stage)}}));
  retained_.emplace_back(key, m);
  while (static_cast<int>(retained_.size()) > kRetainedStages) retained_.pop_front();
  return m;
}

StageMetrics::StageMetrics(WorkerMetrics* owner, const Labels& l) : owner_(owner) {
  WorkerMetrics& w = *owner;
  forward_train_seconds = &w.forward_seconds_.Add(With(l, "phase", "train"), DurationBuckets());
  forward_eval_seconds = &w.forward_seconds_.Add(With(l, "phase", "eval"), DurationBuckets());
  backward_seconds = &w.backward_seconds_.Add(l, DurationBuckets());
  weight_seconds = &w.weight_seconds_.Add(l, DurationBuckets());
  allreduce_seconds = &w.allreduce_seconds_.Add(l, DurationBuckets());
  allreduce_bytes = &w.allreduce_bytes_.Add(l);
  optimizer_step_seconds = &w.step_seconds_.Add(l, DurationBuckets());
  busy_seconds = &w.busy_.Add(l);
  idle_seconds = &w.idle_.Add(l);
  forwards_train = &w.microbatches_.Add(With(With(l, "pass", "forward"), "phase", "train"));
  forwards_eval = &w.microbatches_.Add(With(With(l, "pass", "forward"), "phase", "eval"));
  backwards = &w.microbatches_.Add(With(With(l, "pass", "backward"), "phase", "train"));
  weight_gradients = &w.microbatches_.Add(With(With(l, "pass", "weight"), "phase", "train"));
  optimizer_steps = &w.steps_.Add(l);
  sent_activation_bytes = &w.sent_.Add(With(l, "kind", "activation"));
  sent_gradient_bytes = &w.sent_.Add(With(l, "kind", "gradient"));
  data_plane_activation_bytes = &w.data_plane_.Add(With(l, "kind", "activation"));
  data_plane_gradient_bytes = &w.data_plane_.Add(With(l, "kind", "gradient"));
  received_activation_bytes = &w.received_.Add(With(l, "kind", "activation"));
  received_gradient_bytes = &w.received_.Add(With(l, "kind", "gradient"));
  received_targets_bytes = &w.received_.Add(With(l, "kind", "targets"));
  checkpoint_snapshot_seconds = &w.checkpoint_snapshot_seconds_.Add(l, DurationBuckets());
  checkpoint_write_seconds = &w.checkpoint_write_seconds_.Add(l, DurationBuckets());
  checkpoint_bytes = &w.checkpoint_bytes_.Add(l);
  nonfinite_skipped = &w.nonfinite_skipped_.Add(l);
  in_flight_ = &w.in_flight_.Add(l);
  delay_ = &w.delay_.Add(l);
  analytic_delay_ = &w.analytic_delay_.Add(l);
  learning_rate_ = &w.learning_rate_.Add(l);
  t2_correction_ = &w.t2_correction_.Add(l);
  parameters_ = &w.parameters_.Add(l);
  for (int k = 0; k < kKinds; ++k) {
    memory_[k] = &w.memory_.Add(With(l, "kind", kMemoryKinds[k]));
  }
}

StageMetrics::~StageMetrics() {
  WorkerMetrics& w = *owner_;
  w.forward_seconds_.Remove(forward_train_seconds);
  w.forward_seconds_.Remove(forward_eval_seconds);
  w.backward_seconds_.Remove(backward_seconds);
  w.weight_seconds_.Remove(weight_seconds);
  w.allreduce_seconds_.Remove(allreduce_seconds);
  w.allreduce_bytes_.Remove(allreduce_bytes);
  w.step_seconds_.Remove(optimizer_step_seconds);
  w.busy_.Remove(busy_seconds);
  w.idle_.Remove(idle_seconds);
  w.microbatches_.Remove(forwards_train);
  w.microbatches_.Remove(forwards_eval);
  w.microbatches_.Remove(backwards);
  w.microbatches_.Remove(weight_gradients);
  w.steps_.Remove(optimizer_steps);
  w.sent_.Remove(sent_activation_bytes);
  w.sent_.Remove(sent_gradient_bytes);
  w.data_plane_.Remove(data_plane_activation_bytes);
  w.data_plane_.Remove(data_plane_gradient_bytes);
  w.received_.Remove(received_activation_bytes);
  w.received_.Remove(received_gradient_bytes);
  w.received_.Remove(received_targets_bytes);
  w.checkpoint_snapshot_seconds_.Remove(checkpoint_snapshot_seconds);
  w.checkpoint_write_seconds_.Remove(checkpoint_write_seconds);
  w.checkpoint_bytes_.Remove(checkpoint_bytes);
  w.nonfinite_skipped_.Remove(nonfinite_skipped);
  w.in_flight_.Remove(in_flight_);
  w.delay_.Remove(delay_);
  w.analytic_delay_.Remove(analytic_delay_);
  w.learning_rate_.Remove(learning_rate_);
  w.t2_correction_.Remove(t2_correction_);
  w.parameters_.Remove(parameters_);
  for (auto* g : memory_) w.memory_.Remove(g);
}

void StageMetrics::Update(const StageStats& s) {
  in_flight_->Set(static_cast<double>(s.in_flight));
  delay_->Set(s.measured_delay);
  analytic_delay_->Set(s.analytic_delay);
  learning_rate_->Set(s.learning_rate);
  t2_correction_->Set(s.t2_correction_norm);
  parameters_->Set(static_cast<double>(s.parameters));
  const int64_t bytes[kKinds] = {s.memory.weights,
                                 s.memory.optimizer_state,
                                 s.memory.t2_velocity,
                                 s.memory.stash,
                                 s.memory.saved_activations,
                                 static_cast<int64_t>(BufferPool::Receive().GetStats().free_bytes)};
  for (int k = 0; k < kKinds; ++k) memory_[k]->Set(static_cast<double>(bytes[k]));
  if (s.steps > steps_seen_) {
    optimizer_steps->Increment(static_cast<double>(s.steps - steps_seen_));
    optimizer_step_seconds->Observe(s.last_step_seconds);
    steps_seen_ = s.steps;
  }
}

}  // namespace pipemare
