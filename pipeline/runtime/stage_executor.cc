#include "pipeline/runtime/stage_executor.h"

#include <chrono>

#include "absl/strings/str_cat.h"

namespace pipemare {

using Op = Action::Op;

namespace {
double SecondsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}
}  // namespace

StageExecutor::StageExecutor(const v1::StageAssignment& a, StageRuntime* runtime)
    : runtime_(runtime),
      options_{ScheduleKindOf(a.schedule()),
               a.num_stages(),
               a.schedule().microbatches_per_step(),
               a.steps_per_epoch(),
               0,
               a.warmup_steps()},
      stage_(a.stage()),
      checkpoint_every_(a.checkpoint_every_steps()),
      total_steps_(a.total_steps()),
      generation_(a.generation()) {}

absl::StatusOr<StageExecutor> StageExecutor::Create(const v1::StageAssignment& a,
                                                    StageRuntime* runtime) {
  if (a.steps_per_epoch() < 1) {
    return absl::InvalidArgumentError("steps_per_epoch: required, >= 1 (the plan's length)");
  }
  StageExecutor e(a, runtime);
  // Checks the options once; each epoch's plan is built when it starts.
  PlanOptions probe = e.options_;
  probe.steps = 1;
  if (auto plan = BuildStagePlan(probe, e.stage_); !plan.ok()) return plan.status();
  return e;
}

StageExecutor::Next StageExecutor::Peek() const {
  if (between_epochs()) return {Action{stage_, Op::kForward, 1}, 0};
  const Action& a = plan_[next_];
  if (a.op != Op::kBackward) return {a, 0};
  auto it = id_of_.find(a.index);
  return {a, it == id_of_.end() ? 0 : it->second};
}

absl::Status StageExecutor::StartEpoch() {
  PlanOptions o = options_;
  o.first_step = runtime_->Stats().steps;
  // An epoch is steps_per_epoch steps; one resumed from a cut inside it
  // runs the rest.
  o.steps = options_.steps - o.first_step % options_.steps;
  auto plan = BuildStagePlan(o, stage_);
  if (!plan.ok()) return plan.status();
  plan_ = std::move(*plan);
  next_ = 0;
  epoch_first_step_ = o.first_step;
  forwarded_ = 0;
  id_of_.clear();
  index_of_.clear();
  return absl::OkStatus();
}

absl::Status StageExecutor::Advance(const Action& ran, uint64_t microbatch) {
  if (between_epochs()) {
    return absl::InternalError(absl::StrCat("stage ", stage_, " ran ", FormatAction(ran),
                                            " after its epoch's plan ended"));
  }
  if (!(plan_[next_] == ran)) {
    return absl::InternalError(absl::StrCat("stage ", stage_, " ran ", FormatAction(ran),
                                            " (microbatch ", microbatch, ") where its plan says ",
                                            FormatAction(plan_[next_])));
  }
  ++next_;
  return absl::OkStatus();
}

absl::StatusOr<StageExecutor::Output> StageExecutor::Forward(uint64_t microbatch,
                                                             const torch::Tensor& input,
                                                             const torch::Tensor& targets) {
  if (between_epochs()) {
    if (auto st = StartEpoch(); !st.ok()) return st;
  }
  if (index_of_.count(microbatch)) {
    return absl::InvalidArgumentError(
        absl::StrCat("microbatch ", microbatch, " forwarded twice in one epoch"));
  }
  const Action ran{stage_, Op::kForward, forwarded_ + 1};
  if (auto st = Advance(ran, microbatch); !st.ok()) return st;
  ++forwarded_;
  id_of_[ran.index] = microbatch;
  index_of_[microbatch] = ran.index;
  const auto start = std::chrono::steady_clock::now();
  Output out{ran, microbatch, {}, std::nullopt};
  if (runtime_->is_last()) {
    auto loss = runtime_->ForwardLoss(microbatch, input, targets, /*train=*/true);
    if (!loss.ok()) return loss.status();
    out.loss = *loss;
  } else {
    auto activation = runtime_->Forward(microbatch, input, /*train=*/true);
    if (!activation.ok()) return activation.status();
    out.tensor = *activation;
  }
  out.seconds = SecondsSince(start);
  return out;
}

absl::StatusOr<StageExecutor::Output> StageExecutor::Backward(uint64_t microbatch,
                                                              const torch::Tensor& grad_output) {
  auto it = index_of_.find(microbatch);
  const Action ran{stage_, Op::kBackward, it == index_of_.end() ? -1 : it->second};
  if (auto st = Advance(ran, microbatch); !st.ok()) return st;
  const auto start = std::chrono::steady_clock::now();
  auto grad_input = runtime_->Backward(microbatch, grad_output);
  if (!grad_input.ok()) return grad_input.status();
  return Output{ran, microbatch, *grad_input, std::nullopt, SecondsSince(start)};
}

absl::StatusOr<std::optional<StageExecutor::Output>> StageExecutor::RunLocal() {
  if (between_epochs()) return std::nullopt;
  const Action a = plan_[next_];
  if (a.op == Op::kBackward && runtime_->is_last()) {
    auto out = Backward(id_of_.at(a.index), torch::Tensor());
    if (!out.ok()) return out.status();
    return std::optional<Output>(std::move(*out));
  }
  if (a.op == Op::kWeight) {  // zero_bubble's W
    const uint64_t microbatch = id_of_.at(a.index);
    const auto start = std::chrono::steady_clock::now();
    if (auto st = runtime_->WeightGradient(microbatch); !st.ok()) return st;
    ++next_;
    return std::optional<Output>(Output{a, microbatch, {}, std::nullopt, SecondsSince(start)});
  }
  if (a.op != Op::kUpdate) return std::nullopt;
  if (auto st = runtime_->Step(); !st.ok()) return st;
  const StageStats stats = runtime_->Stats();
  if (stats.steps != epoch_first_step_ + a.index) {
    return absl::InternalError(absl::StrCat("stage ", stage_, ": the plan's ", FormatAction(a),
                                            " is step ", epoch_first_step_ + a.index,
                                            " but the stage has applied ", stats.steps));
  }
  ++next_;
  Output out{a, 0, {}, std::nullopt, stats.last_step_seconds};
  const int64_t k = stats.steps;
  if ((checkpoint_every_ > 0 && k % checkpoint_every_ == 0) || k == total_steps_ || k == cut_at_) {
    out.snapshot = TakeSnapshot();
  }
  return std::optional<Output>(std::move(out));
}

std::shared_ptr<const StageSnapshot> StageExecutor::TakeSnapshot() const {
  const auto start = std::chrono::steady_clock::now();
  auto snapshot = std::make_shared<StageSnapshot>(runtime_->Snapshot());
  snapshot->generation = generation_;
  snapshot->seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return snapshot;
}

absl::StatusOr<std::shared_ptr<const StageSnapshot>> StageExecutor::CutAt(int64_t step) {
  const int64_t steps = runtime_->Stats().steps;
  if (steps < step) {
    cut_at_ = step;
    return std::shared_ptr<const StageSnapshot>();
  }
  // Between epochs nothing but evaluation ran since the step: the state is
  // the step's.
  if (steps == step && between_epochs()) return TakeSnapshot();
  return absl::FailedPreconditionError(absl::StrCat("stage ", stage_, " cannot cut at step ", step,
                                                    ": it has applied ", steps, " steps",
                                                    steps == step ? " and trained on since" : ""));
}

absl::StatusOr<StageExecutor::Output> StageExecutor::Evaluate(uint64_t microbatch,
                                                              const torch::Tensor& input,
                                                              const torch::Tensor& targets) {
  if (!between_epochs()) {  // a plan ends with every backward done: drained
    return absl::FailedPreconditionError(
        absl::StrCat("evaluation microbatch ", microbatch, " arrived during an epoch"));
  }
  const auto start = std::chrono::steady_clock::now();
  Output out{Action{stage_, Op::kForward, 0}, microbatch, {}, std::nullopt};
  if (runtime_->is_last()) {
    auto loss = runtime_->ForwardLoss(microbatch, input, targets, /*train=*/false);
    if (!loss.ok()) return loss.status();
    out.loss = *loss;
  } else {
    auto activation = runtime_->Forward(microbatch, input, /*train=*/false);
    if (!activation.ok()) return activation.status();
    out.tensor = *activation;
  }
  out.seconds = SecondsSince(start);
  return out;
}

}  // namespace pipemare
